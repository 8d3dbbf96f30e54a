import itertools

import pytest
import torch

from gpnys import landmarks, memory_budget
from gpnys.landmarks.farthest import _fps_triton
from gpnys.launch import failed


def brute_force_fps(X, k, start):
    """The O(d k^2 n) definition: next point = argmax_j min_{i in S} ||x_j - x_i||, lowest index on ties."""
    chosen = [start]
    for _ in range(k - 1):
        D = torch.cdist(X, X[chosen]).min(dim=1).values
        D[chosen] = -1
        chosen.append(int(torch.argmax(D)))
    return chosen


def test_fps_matches_brute_force(dtype):
    g = torch.Generator().manual_seed(0)
    for d in (1, 2, 5):
        X = torch.rand(40, d, generator=g, dtype=dtype)
        res = landmarks.fps(X, 15)
        centroid_nearest = int(torch.argmin(((X - X.mean(0)) ** 2).sum(1)))
        assert res.indices.tolist() == brute_force_fps(X, 15, centroid_nearest)
        assert res.indices.dtype == torch.long and res.fill_distances.dtype == dtype


def test_fps_fill_distances_are_correct_and_monotone():
    X = torch.rand(200, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    res = landmarks.fps(X, 30)
    for i in (0, 5, 29):
        ref = landmarks.fill_distance(X, X[res.indices[: i + 1]])
        torch.testing.assert_close(res.fill_distances[i], ref)
    assert bool((res.fill_distances[1:] <= res.fill_distances[:-1] + 1e-12).all())


def test_fps_two_approximation_of_fill_distance():
    # Gonzalez / Thm 4.6: h_FPS <= 2 h_min. Compare with the best of many random subsets and, on a tiny set,
    # with the exact optimum over all subsets.
    g = torch.Generator().manual_seed(2)
    X = torch.rand(300, 2, generator=g, dtype=torch.float64)
    k = 10
    h_fps = landmarks.fill_distance(X, X[landmarks.fps(X, k).indices])
    best_random = min(float(landmarks.fill_distance(X, X[torch.randperm(300, generator=g)[:k]])) for _ in range(2000))
    assert float(h_fps) <= 2 * best_random
    Y = torch.rand(12, 2, generator=g, dtype=torch.float64)
    opt = min(float(landmarks.fill_distance(Y, Y[list(s)])) for s in itertools.combinations(range(12), 3))
    for start in range(12):  # the bound holds for any start point
        assert float(landmarks.fill_distance(Y, Y[landmarks.fps(Y, 3, start=start).indices])) <= 2 * opt + 1e-12


def test_fps_k_equals_n_and_duplicates():
    X = torch.tensor([[0.0], [1.0], [1.0], [0.0], [5.0]])
    res = landmarks.fps(X, 5)
    assert sorted(res.indices.tolist()) == [0, 1, 2, 3, 4]  # every point exactly once, duplicates last
    assert set(res.indices[:3].tolist()) in ({0, 1, 4}, {1, 3, 4}, {0, 2, 4}, {2, 3, 4})
    assert float(res.fill_distances[-1]) == 0.0
    assert float(res.fill_distances[2]) == 0.0  # three distinct values cover everything


def test_fps_blocked_equals_unblocked():
    X = torch.randn(500, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = landmarks.fps(X, 50).indices
    with memory_budget(block_bytes=8 * 64):  # force many small row blocks
        assert torch.equal(landmarks.fps(X, 50).indices, ref)


@pytest.mark.parametrize("fn", ["fps", "kmeans", "select"])
def test_bad_input(fn):
    f = getattr(landmarks, fn)
    X = torch.rand(10, 2)
    with pytest.raises(ValueError, match="k=11"):
        f(X, 11)
    with pytest.raises(ValueError, match="k must be"):
        f(X, 0)
    with pytest.raises(ValueError, match="empty"):
        f(torch.empty(0, 2), 1)
    bad = X.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        f(bad, 2)
    with pytest.raises(ValueError, match="2-D"):
        f(torch.rand(10), 2)


def test_uniform_seeded_distinct():
    a = landmarks.uniform(100, 30, seed=1)
    assert torch.equal(a, landmarks.uniform(100, 30, seed=1))
    assert not torch.equal(a, landmarks.uniform(100, 30, seed=2))
    assert a.unique().numel() == 30 and int(a.max()) < 100
    assert landmarks.uniform(7, 7, seed=0).sort().values.tolist() == list(range(7))
    with pytest.raises(ValueError, match="k=8"):
        landmarks.uniform(7, 8)


def test_kmeans_recovers_separated_clusters(dtype):
    g = torch.Generator().manual_seed(4)
    true = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]], dtype=dtype)
    X = torch.cat([c + 0.1 * torch.randn(50, 2, generator=g, dtype=dtype) for c in true])
    res = landmarks.kmeans(X, 3, seed=0)
    assert res.centers.dtype == dtype
    dist = torch.cdist(true, res.centers).min(dim=1).values
    assert float(dist.max()) < 0.1
    again = landmarks.kmeans(X, 3, seed=0)
    assert torch.equal(res.centers, again.centers)
    # Lloyd never increases the inertia relative to the k-means++ seeding alone
    assert res.inertia <= landmarks.kmeans(X, 3, seed=0, iters=0).inertia + 1e-9


def test_kmeans_with_duplicates_and_k_equals_n():
    X = torch.tensor([[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 5, dtype=torch.float64)
    res = landmarks.kmeans(X, 10, seed=1)
    assert torch.isfinite(res.centers).all() and res.inertia == pytest.approx(0.0)


def test_select_dispatch():
    X = torch.rand(50, 3, generator=torch.Generator().manual_seed(5))
    pts, idx = landmarks.select(X, 5, "fps")
    assert torch.equal(pts, X[idx])
    pts, idx = landmarks.select(X, 5, "kmeans")
    assert idx is None and pts.shape == (5, 3)
    with pytest.raises(ValueError, match="method"):
        landmarks.select(X, 5, "random")


@pytest.mark.parametrize("n,d,k", [(1, 2, 1), (37, 1, 37), (300, 3, 60), (2500, 9, 40), (1100, 70, 5)])
def test_fps_triton_kernel_matches_the_torch_loop(n, d, k, dtype):
    """The one-program Triton FPS (run here by Triton's interpreter; compiled on CUDA) picks the torch loop's points,
    with its fill distances: chunks of the pass (n > BLOCK), k = n, ties between duplicates, d past a power of 2."""
    g = torch.Generator().manual_seed(n + d)
    X = torch.rand(n, d, generator=g, dtype=torch.float64)
    if n > 100:
        X[n // 2 : n // 2 + 30] = X[3]  # duplicates: distance-0 ties, never re-picked
    X = X.to(dtype)
    ref = landmarks.fps(X, k, start=n // 3)  # CPU tensors: the torch loop
    got = _fps_triton(X, k, n // 3)
    assert got is not None
    assert got.indices.tolist() == ref.indices.tolist()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got.fill_distances, ref.fill_distances, rtol=tol, atol=tol)
    again = _fps_triton(X, k, n // 3)
    assert torch.equal(again.indices, got.indices) and torch.equal(again.fill_distances, got.fill_distances)


@pytest.mark.cuda
def test_fps_on_cuda_uses_the_kernel_and_matches_the_cpu(cuda_device, dtype):
    X = torch.rand(3000, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    ref = landmarks.fps(X, 200)
    got = landmarks.fps(X.to(cuda_device), 200)
    assert not failed("fps", got.indices.device, dtype)
    assert got.indices.device.type == cuda_device.type
    assert got.indices.cpu().tolist() == ref.indices.tolist()
    assert torch.allclose(got.fill_distances.cpu(), ref.fill_distances, rtol=1e-5)
