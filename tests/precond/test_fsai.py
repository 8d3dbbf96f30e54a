"""causal_knn, PointCache, fsai_factor and FSAIPreconditioner (AFN paper Algorithm 1)."""

import warnings

import gpytorch
import pytest
import torch
from helpers import dense_A, dense_P, make_kernel, points

from gpnys.checks import NumericalWarning
from gpnys.landmarks import fps
from gpnys.precond import knn
from gpnys.precond.cache import PointCache
from gpnys.precond.fsai import FSAIPreconditioner, SparseTriangular, fsai_factor
from gpnys.precond.knn import causal_knn
from gpnys.solvers.pcg import pcg

F64 = torch.float64
# Length-scales small / mid / large relative to the spread of uniform points in [0, 1]^d.
LENGTHSCALES = {3: (0.05, 0.3, 3.0), 18: (0.3, 1.5, 10.0)}


def brute_force_causal_knn(X, w):
    """Reference: nearest w-1 among j < i by (squared distance, index), then i; pads (i, False) before i."""
    n = X.shape[0]
    idx = torch.empty(n, w, dtype=torch.long)
    valid = torch.zeros(n, w, dtype=torch.bool)
    for i in range(n):
        cand = sorted(range(i), key=lambda j: (float(((X[i] - X[j]) ** 2).sum()), j))[: w - 1]
        row = cand + [i] * (w - 1 - len(cand)) + [i]
        idx[i] = torch.tensor(row)
        valid[i, : len(cand)] = True
        valid[i, -1] = True
    return idx, valid


# --------------------------------------------------------------------------------------------- causal_knn
@pytest.mark.parametrize("w", [1, 2, 5, 12, 50])
def test_causal_knn_matches_brute_force_with_ties(w):
    # Small integer coordinates: many exact ties and duplicates, and exact distances in any cdist mode.
    X = torch.randint(0, 4, (40, 2), generator=torch.Generator().manual_seed(0)).to(F64)
    ref_idx, ref_valid = brute_force_causal_knn(X, w)
    for block in (None, 7):
        idx, valid = causal_knn(X, w, block=block)
        assert idx.shape == (40, w) and idx.dtype == torch.long and valid.dtype == torch.bool
        assert torch.equal(valid, ref_valid)
        assert torch.equal(idx, ref_idx)


def test_causal_knn_random_float32_and_is_causal(dtype):
    X = points(120, 5, dtype=dtype, seed=1)
    idx, valid = causal_knn(X, 9)
    ref_idx, ref_valid = brute_force_causal_knn(X.double(), 9)
    assert torch.equal(valid, ref_valid)
    assert torch.equal(idx, ref_idx)  # continuous data: no ties, same order in float32 as in float64
    rows = torch.arange(120)[:, None]
    assert bool((idx[:, -1] == rows[:, 0]).all())
    assert bool((idx[:, :-1][valid[:, :-1]] < rows.expand(-1, 8)[valid[:, :-1]]).all())


@pytest.mark.parametrize("n,w,d", [(9000, 30, 3), (4200, 5, 2), (300, 50, 3), (10, 30, 3)])
def test_causal_knn_tree_path_matches_brute_force(n, w, d, dtype, monkeypatch):
    """The k-d tree path (prefix trees + in-chunk brute force) gives the brute-force pattern on continuous data,
    across chunk boundaries (small chunks here) and for rows with fewer than w - 1 predecessors."""
    monkeypatch.setattr(knn, "TREE_CHUNK", 1000)
    X = points(n, d, dtype=dtype, seed=n)
    idx, valid = causal_knn(X, w, tree=True)
    # the tree measures distances in float64, so the float64 brute force is the reference for both dtypes
    ref_idx, ref_valid = causal_knn(X.double(), w, tree=False)
    assert torch.equal(valid, ref_valid)
    assert torch.equal(idx, ref_idx)
    again = causal_knn(X, w, tree=True)
    assert torch.equal(again[0], idx)


def _clustered(n, d, dtype, seed):
    """Three tight clusters, a sparse halo and exact duplicates: cells from empty to crowded."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(3, d, generator=g, dtype=F64) * 10
    X = centres[torch.randint(0, 3, (n,), generator=g)] + 0.05 * torch.randn(n, d, generator=g, dtype=F64)
    halo = torch.rand(n // 10, d, generator=g, dtype=F64) * 10
    X = torch.cat([X, halo])[torch.randperm(n + n // 10, generator=g)]
    X[n // 2 : n // 2 + 40] = X[n // 3]  # 40 copies of one point: distance ties broken by the lowest index
    return X.to(dtype)


@pytest.mark.parametrize("case,n,w,d", [("uniform", 5000, 30, 3), ("uniform", 3000, 8, 1), ("uniform", 3000, 12, 4),
                                        ("uniform", 2100, 30, 2), ("clustered", 4000, 20, 3)])
def test_causal_knn_grid_path_matches_brute_force(case, n, w, d, dtype, monkeypatch):
    """The grid path (doubling chunks, 3^d cells per row, rows it cannot prove sent to the brute force) gives the
    pattern of an explicit-difference brute force in the data's own dtype, ties included, and is deterministic."""
    monkeypatch.setattr(knn, "GRID_FIRST", 256)
    X = points(n, d, dtype=dtype, seed=n + d) if case == "uniform" else _clustered(n, d, dtype, seed=3)
    brute = []
    monkeypatch.setattr(knn, "_brute_rows", lambda X_, rows, *a, f=knn._brute_rows, **kw: (brute.append(rows.numel()),
                                                                                       f(X_, rows, *a, **kw)))
    idx, valid = causal_knn(X, w, grid=True)
    # reference: squared distances by explicit differences in X's dtype, ordered by (distance, index)
    D = (X[:, None, :] - X[None, :, :]).square().sum(-1)
    D.masked_fill_(torch.ones(len(X), len(X), dtype=torch.bool).triu(), float("inf"))
    o = torch.sort(D, dim=1, stable=True).indices[:, : w - 1]
    ok = torch.isfinite(D.gather(1, o))
    rows = torch.arange(len(X))[:, None]
    assert torch.equal(valid[:, :-1], ok) and bool(valid[:, -1].all())
    assert torch.equal(idx[:, :-1], torch.where(ok, o, rows)) and torch.equal(idx[:, -1], rows[:, 0])
    # the grid answered most rows past the first 256 itself
    assert sum(brute) - 255 < 0.2 * (len(X) - 256)
    again = causal_knn(X, w, grid=True)
    assert torch.equal(again[0], idx) and torch.equal(again[1], valid)


def test_causal_knn_grid_path_choice_and_errors(monkeypatch):
    calls = []
    monkeypatch.setattr(knn, "_grid_knn", lambda *a: calls.append(a))
    monkeypatch.setattr(knn, "GRID_MIN_N", 50)
    monkeypatch.setattr(knn, "GRID_FIRST", 20)
    causal_knn(points(60, 3, dtype=F64, seed=0), 4)  # the CPU never chooses the grid by itself
    assert calls == []
    causal_knn(points(60, 3, dtype=F64, seed=0), 4, grid=True)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="tree and grid"):
        causal_knn(points(60, 3, dtype=F64, seed=0), 4, tree=True, grid=True)


def test_causal_knn_chooses_the_tree_path_by_size(monkeypatch):
    calls = []
    monkeypatch.setattr(knn, "_tree_knn", lambda *a: calls.append(a))
    monkeypatch.setattr(knn, "TREE_MIN_N", 50)
    causal_knn(points(60, 3, dtype=F64, seed=0), 4)
    assert len(calls) == 1
    causal_knn(points(40, 3, dtype=F64, seed=0), 4)  # below TREE_MIN_N
    causal_knn(points(60, 12, dtype=F64, seed=0), 4)  # above TREE_MAX_D
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------- PointCache
def test_point_cache_fps_prefix_and_uniform():
    X = points(150, 3)
    cache = PointCache(X)
    a = cache.fps(20)
    b = cache.fps(8)
    assert torch.equal(a, fps(X, 20).indices) and torch.equal(b, a[:8])
    assert (cache.hits, cache.misses) == (1, 1)
    u1, u2, u3 = cache.uniform(10, 0), cache.uniform(10, 0), cache.uniform(10, 1)
    assert torch.equal(u1, u2) and not torch.equal(u1, u3)
    assert (cache.hits, cache.misses) == (2, 3)
    with pytest.raises(ValueError, match="different points"):
        FSAIPreconditioner(points(150, 3, seed=5), make_kernel("rbf", 0.3), 1e-2, w=10, cache=cache)


def test_point_cache_reuse_isotropic_and_recompute_ard():
    X = points(200, 3)
    cache = PointCache(X)
    P1 = FSAIPreconditioner(X, make_kernel("matern32", 0.2), 1e-2, w=15, cache=cache)
    misses = cache.misses
    P2 = FSAIPreconditioner(X, make_kernel("matern32", 0.7), 1e-2, w=15, cache=cache)
    assert cache.misses == misses and P2.summary()["cache_hits"] == 1 and P1.summary()["cache_hits"] == 0
    fresh = FSAIPreconditioner(X, make_kernel("matern32", 0.7), 1e-2, w=15)
    assert torch.equal(P2.G.to_dense(), fresh.G.to_dense())
    # ARD: the neighbour order depends on the length-scale vector, so the pattern is recomputed ...
    ard = gpytorch.kernels.RBFKernel(ard_num_dims=3)
    ard.lengthscale = torch.tensor([0.05, 1.0, 1.0])
    P3 = FSAIPreconditioner(X, ard, 1e-2, w=15, cache=cache)
    assert cache.misses == misses + 1 and P3.summary()["cache_hits"] == 0
    idx, valid = causal_knn(X / torch.tensor([0.05, 1.0, 1.0], dtype=F64), 15)
    ref = torch.zeros(200, 200, dtype=torch.bool)
    ref[torch.arange(200)[:, None].expand(-1, 15)[valid], idx[valid]] = True
    assert torch.equal(P3.G.to_dense() != 0, ref)
    # ... and reused for the same vector.
    FSAIPreconditioner(X, ard, 1e-1, w=15, cache=cache)
    assert cache.misses == misses + 1
    ard.lengthscale = torch.tensor([1.0, 1.0, 0.05])
    FSAIPreconditioner(X, ard, 1e-2, w=15, cache=cache)
    assert cache.misses == misses + 2


def test_point_cache_reuses_ard_patterns_within_tolerance():
    X = points(300, 3)
    ard = gpytorch.kernels.RBFKernel(ard_num_dims=3)
    base = torch.tensor([0.2, 0.5, 1.0], dtype=F64)
    cache = PointCache(X, scale_rtol=0.1)
    ard.lengthscale = base
    P1 = FSAIPreconditioner(X, ard, 1e-3, w=12, cache=cache)
    misses = cache.misses
    # every component within 10 %: the stored pattern is reused, and the factor still solves A to PCG accuracy
    ard.lengthscale = base * torch.tensor([1.09, 0.93, 1.0], dtype=F64)
    P2 = FSAIPreconditioner(X, ard, 1e-3, w=12, cache=cache)
    assert cache.misses == misses and torch.equal(P2.G.to_dense() != 0, P1.G.to_dense() != 0)
    A = dense_A(X, ard, 1e-3)
    b = torch.randn(300, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    res = pcg(lambda v: A @ v, b, precond=P2.solve, tol=1e-10, maxiter=300)
    torch.testing.assert_close(res.x, torch.linalg.solve(A, b), rtol=1e-7, atol=1e-7)
    # one component 12 % off: recomputed on X / lengthscale, exactly as without a cache
    ard.lengthscale = base * torch.tensor([1.12, 1.0, 1.0], dtype=F64)
    P3 = FSAIPreconditioner(X, ard, 1e-3, w=12, cache=cache)
    assert cache.misses == misses + 1
    assert torch.equal(P3.G.to_dense(), FSAIPreconditioner(X, ard, 1e-3, w=12).G.to_dense())
    # scale_rtol = 0: a pattern per distinct vector; a negative tolerance is an error
    exact = PointCache(X, scale_rtol=0.0)
    for f in (1.0, 1.0 + 1e-5):
        ard.lengthscale = base * f
        FSAIPreconditioner(X, ard, 1e-3, w=12, cache=exact)
    assert (exact.hits, exact.misses) == (0, 2)
    with pytest.raises(ValueError, match="scale_rtol"):
        PointCache(X, scale_rtol=-0.1)


# --------------------------------------------------------------------------------------------- fsai_factor
def test_fsai_factor_structure_and_exact_local_property():
    X = points(150, 3)
    kern = make_kernel("rbf", 0.3)
    A = dense_A(X, kern, 1e-2)
    idx, valid = causal_knn(X, 10)
    G = fsai_factor(lambda I: A[I[:, :, None], I[:, None, :]], idx, valid, batch=17)
    assert G.layout == torch.sparse_csr and G.shape == (150, 150)
    Gd = G.to_dense()
    assert bool((Gd.triu(1) == 0).all()) and bool((Gd.diagonal() > 0).all())
    assert G.values().numel() == int(valid.sum())
    # Algorithm 1 makes (G A G^T)_ii = 1 and (G A)[i, s_i \ {i}] = 0 for every row.
    GA = Gd @ A
    torch.testing.assert_close((GA @ Gd.T).diagonal(), torch.ones(150, dtype=F64))
    for i in (0, 3, 77, 149):
        s = idx[i][valid[i]][:-1]
        assert float(GA[i, s].abs().sum()) < 1e-10
    # Batch size does not change the result.
    G2 = fsai_factor(lambda I: A[I[:, :, None], I[:, None, :]], idx, valid)
    torch.testing.assert_close(G2.to_dense(), Gd)
    T = SparseTriangular(G)
    R = torch.randn(150, 3, dtype=F64)
    torch.testing.assert_close(T.solve(T.mm(R)), R)
    torch.testing.assert_close(T.tsolve(T.tmm(R)), R)
    torch.testing.assert_close(T.tmm(R), Gd.T @ R)


def test_fsai_factor_shifts_non_spd_blocks_without_nans():
    n = 30
    A = torch.ones(n, n, dtype=F64)  # rank one: every local block of size >= 2 is singular
    idx, valid = causal_knn(points(n, 2), 5)
    shifts = []
    with pytest.warns(NumericalWarning):
        G = fsai_factor(lambda I: A[I[:, :, None], I[:, None, :]], idx, valid, shifts=shifts)
    assert shifts and bool(torch.isfinite(G.values()).all()) and bool((SparseTriangular(G).diag > 0).all())


# --------------------------------------------------------------------------------------------- FSAI preconditioner
@pytest.mark.parametrize("d", [3, 18])
@pytest.mark.parametrize("kname", ["rbf", "matern32"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["small", "mid", "large"])
def test_fsai_identities(d, kname, which):
    n, mu = 200, 1e-2
    X = points(n, d, seed=d)
    kern = make_kernel(kname, LENGTHSCALES[d][which])
    P = FSAIPreconditioner(X, kern, mu, w=25)
    v = torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(P.solve(P.matmul(v)), v, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(P.matmul(v[:, 0]), P.matmul(v)[:, 0])
    Pd = dense_P(P)
    torch.testing.assert_close(Pd, Pd.T, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(P.logdet(), torch.logdet(Pd), rtol=1e-8, atol=1e-8)
    G = P.G.to_dense()
    assert P.G.layout == torch.sparse_csr and bool((G.triu(1) == 0).all()) and bool((G.diagonal() > 0).all())
    # A useful preconditioner: P^{-1} A is much better conditioned than A at mid/large length-scales.
    A = dense_A(X, kern, mu)
    if which > 0:
        assert torch.linalg.cond(P.solve(A)) < torch.linalg.cond(A)
    s = P.summary()
    assert s["kind"] == "fsai" and s["rank"] == 0 and s["w"] == 25 and s["nnz"] == P.G.values().numel()
    assert s["setup_s"] > 0 and s["shifts"] == []


@pytest.mark.parametrize("d,kname,which", [(3, "matern32", 0), (3, "rbf", 1), (18, "matern32", 2)])
def test_fsai_sample_covariance(d, kname, which):
    n = 100
    P = FSAIPreconditioner(points(n, d, seed=2), make_kernel(kname, LENGTHSCALES[d][which]), 1e-2, w=20)
    S = P.sample(20000, generator=torch.Generator().manual_seed(0))
    assert S.shape == (n, 20000)
    Pd = dense_P(P)
    assert float((S @ S.T / 20000 - Pd).norm() / Pd.norm()) < 0.1


@pytest.mark.parametrize("kname", ["rbf", "matern32"])
def test_fsai_full_pattern_reproduces_A(kname):
    n, mu = 150, 1e-3
    X = points(n, 3, seed=3)
    kern = make_kernel(kname, 0.3)
    P = FSAIPreconditioner(X, kern, mu, w=n)
    A = dense_A(X, kern, mu)
    torch.testing.assert_close(dense_P(P), A, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(P.logdet(), torch.logdet(A), rtol=1e-9, atol=1e-9)


def test_fsai_scalekernel_uses_unit_variance_kernel():
    X = points(100, 3)
    base = make_kernel("rbf", 0.3)
    sk = gpytorch.kernels.ScaleKernel(make_kernel("rbf", 0.3))
    sk.outputscale = 4.0
    torch.testing.assert_close(
        FSAIPreconditioner(X, sk, 1e-2, w=10).G.to_dense(), FSAIPreconditioner(X, base, 1e-2, w=10).G.to_dense()
    )


def test_fsai_float32_and_float64(dtype):
    X = points(150, 3, dtype=dtype)
    P = FSAIPreconditioner(X, make_kernel("matern32", 0.3), 1e-2, w=20)
    assert P.G.dtype == dtype and P.logdet().dtype == dtype and P.sample(3).dtype == dtype
    v = torch.randn(150, 2, dtype=dtype)
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(P.solve(P.matmul(v)), v, rtol=tol, atol=tol)


def test_fsai_float32_tiny_mu_duplicates_warns_and_stays_finite():
    Y = points(80, 3, dtype=torch.float32)
    X = torch.cat([Y, Y[:40]])
    with pytest.warns(NumericalWarning):
        P = FSAIPreconditioner(X, make_kernel("rbf", 1.0), 1e-8, w=20)
    assert P.shifts and P.summary()["shifts"]
    I = torch.eye(120)
    for out in (P.matmul(I), P.solve(I), P.logdet(), P.sample(5)):
        assert bool(torch.isfinite(out).all())


def test_fsai_bad_input():
    X = points(50, 3)
    kern = make_kernel("rbf", 0.3)
    with pytest.raises(ValueError, match="mu"):
        FSAIPreconditioner(X, kern, 0.0, w=5)
    with pytest.raises(ValueError, match="mu"):
        FSAIPreconditioner(X, kern, -1.0, w=5)
    Xn = X.clone()
    Xn[3, 1] = float("nan")
    with pytest.raises(ValueError, match="X"):
        FSAIPreconditioner(Xn, kern, 1e-2, w=5)
    with pytest.raises(ValueError, match="X"):
        FSAIPreconditioner(torch.empty(0, 3, dtype=F64), kern, 1e-2, w=5)
    with pytest.raises(ValueError, match="w"):
        FSAIPreconditioner(X, kern, 1e-2, w=51)
    with pytest.raises(ValueError, match="w"):
        FSAIPreconditioner(X, kern, 1e-2, w=0)
    P = FSAIPreconditioner(X, kern, 1e-2, w=5)
    with pytest.raises(ValueError, match="rows"):
        P.solve(torch.ones(49, dtype=F64))


def test_fsai_is_deterministic():
    X = points(120, 18)
    kern = make_kernel("matern32", 1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean build warns about nothing
        a = FSAIPreconditioner(X, kern, 1e-2, w=20)
    b = FSAIPreconditioner(X, kern, 1e-2, w=20)
    assert torch.equal(a.G.to_dense(), b.G.to_dense())


@pytest.mark.cuda
def test_causal_knn_grid_path_on_the_device(cuda_device, monkeypatch):
    """On a GPU the grid path is the default from GRID_MIN_N points (lowered here) and gives the CPU grid path's
    pattern (explicit differences on both; float64, so no rounding ties between the two devices' sums)."""
    monkeypatch.setattr(knn, "GRID_MIN_N", 1000)
    monkeypatch.setattr(knn, "GRID_FIRST", 256)
    X = points(6000, 3, dtype=F64, seed=12)
    calls = []
    monkeypatch.setattr(knn, "_grid_knn", lambda *a, f=knn._grid_knn: (calls.append(1), f(*a))[1])
    on_gpu = cuda_device.type == "cuda"
    idx, valid = causal_knn(X.to(cuda_device), 30, grid=None if on_gpu else True)  # the CPU's default is the tree
    assert calls == [1]
    ref_idx, ref_valid = causal_knn(X, 30, grid=True)
    assert torch.equal(idx.cpu(), ref_idx) and torch.equal(valid.cpu(), ref_valid)
