"""AFNPreconditioner (AFN paper Algorithms 2-3): identities, exactness, sampling, robustness, caching."""

import warnings

import gpytorch
import pytest
import torch
from helpers import dense_A, dense_P, make_kernel, points

from gpnys.checks import NumericalWarning
from gpnys.landmarks import fps
from gpnys.precond.afn import AFNPreconditioner
from gpnys.precond.cache import PointCache

F64 = torch.float64
LENGTHSCALES = {3: (0.05, 0.3, 3.0), 18: (0.3, 1.5, 10.0)}  # small / mid / large vs the spread of [0, 1]^d


@pytest.mark.parametrize("d", [3, 18])
@pytest.mark.parametrize("kname", ["rbf", "matern32"])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["small", "mid", "large"])
def test_afn_identities(d, kname, which):
    n, mu, k, w = 240, 1e-2, 40, 20
    X = points(n, d, seed=d)
    kern = make_kernel(kname, LENGTHSCALES[d][which])
    P = AFNPreconditioner(X, kern, mu, k=k, w=w)
    v = torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(P.solve(P.matmul(v)), v, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(P.solve(v[:, 1]), P.solve(v)[:, 1])
    Pd = dense_P(P)
    torch.testing.assert_close(Pd, Pd.T, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(P.logdet(), torch.logdet(Pd), rtol=1e-8, atol=1e-8)
    # M reproduces the landmark rows/columns of K + mu I exactly (eq. 12).
    A = dense_A(X, kern, mu)
    lm = P.landmark_idx
    torch.testing.assert_close(Pd[lm], A[lm], rtol=1e-9, atol=1e-9)
    # A useful preconditioner: P^{-1} A is better conditioned than A (mid/large length-scales).
    if which > 0:
        assert torch.linalg.cond(P.solve(A)) < torch.linalg.cond(A)
    G = P.G.to_dense()
    assert P.G.layout == torch.sparse_csr and G.shape == (n - k, n - k)
    assert bool((G.triu(1) == 0).all()) and bool((G.diagonal() > 0).all())
    s = P.summary()
    assert s["kind"] == "afn" and s["rank"] == k and s["k"] == k and s["w"] == w
    assert s["landmarks"] == ("fps" if d <= 10 else "uniform") and s["landmarks_requested"] == "auto"
    assert s["nnz"] == P.G.values().numel() and s["setup_s"] > 0 and s["shifts"] == []


@pytest.mark.parametrize("d,kname,which", [(3, "matern32", 0), (3, "rbf", 2), (18, "rbf", 1), (18, "matern32", 2)])
def test_afn_sample_covariance(d, kname, which):
    n = 100
    P = AFNPreconditioner(points(n, d, seed=2), make_kernel(kname, LENGTHSCALES[d][which]), 1e-2, k=20, w=15)
    S = P.sample(20000, generator=torch.Generator().manual_seed(0))
    assert S.shape == (n, 20000)
    Pd = dense_P(P)
    assert float((S @ S.T / 20000 - Pd).norm() / Pd.norm()) < 0.1


@pytest.mark.parametrize("kname", ["rbf", "matern32"])
@pytest.mark.parametrize("landmarks", ["fps", "uniform"])
def test_afn_full_schur_pattern_reproduces_A(kname, landmarks):
    n, k, mu = 140, 30, 1e-3
    X = points(n, 3, seed=4)
    kern = make_kernel(kname, 0.3)
    A = dense_A(X, kern, mu)
    for w in (n - k, n):  # w > n - k is clamped to n - k (the Schur complement has n - k rows)
        P = AFNPreconditioner(X, kern, mu, k=k, w=w, landmarks=landmarks)
        assert P.w == n - k
        torch.testing.assert_close(dense_P(P), A, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(P.logdet(), torch.logdet(A), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(P.solve(A[:, :5]), torch.eye(n, dtype=F64)[:, :5], rtol=1e-7, atol=1e-7)


def test_afn_k_clamped_to_n_minus_1_and_landmark_rules():
    X = points(60, 3)
    kern = make_kernel("rbf", 0.3)
    P = AFNPreconditioner(X, kern, 1e-2, k=60, w=10)
    assert P.k == P.rank == 59 and P.w == 1 and P.G.shape == (1, 1)
    torch.testing.assert_close(dense_P(P), dense_A(X, kern, 1e-2), rtol=1e-9, atol=1e-9)
    Pf = AFNPreconditioner(X, kern, 1e-2, k=12, w=10, landmarks="fps")
    assert torch.equal(Pf.landmark_idx, fps(X, 12).indices)
    Pu = AFNPreconditioner(points(60, 12), kern, 1e-2, k=12, w=10)
    assert Pu.landmarks == "uniform"
    Pa = AFNPreconditioner(X, kern, 1e-2, k=12, w=10)
    assert Pa.landmarks == "fps" and torch.equal(Pa.landmark_idx, Pf.landmark_idx)
    assert sorted(torch.cat([Pf.landmark_idx, Pf.rest_idx]).tolist()) == list(range(60))
    assert bool((Pf.rest_idx[1:] > Pf.rest_idx[:-1]).all())  # the rest keeps the data order


def test_afn_same_seed_identical_other_seed_differs():
    X = points(150, 18)
    kern = make_kernel("matern32", 1.5)
    a = AFNPreconditioner(X, kern, 1e-2, k=30, w=15, landmarks="uniform", seed=3)
    b = AFNPreconditioner(X, kern, 1e-2, k=30, w=15, landmarks="uniform", seed=3)
    c = AFNPreconditioner(X, kern, 1e-2, k=30, w=15, landmarks="uniform", seed=4)
    assert torch.equal(a.landmark_idx, b.landmark_idx) and torch.equal(a.L, b.L) and torch.equal(a.V, b.V)
    assert torch.equal(a.G.to_dense(), b.G.to_dense())
    I = torch.eye(150, dtype=F64)
    assert torch.equal(a.matmul(I), b.matmul(I)) and torch.equal(a.logdet(), b.logdet())
    assert not torch.equal(a.landmark_idx, c.landmark_idx)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert torch.equal(a.sample(4, generator=g1), b.sample(4, generator=g2))


def test_afn_float32_and_float64(dtype):
    X = points(160, 3, dtype=dtype)
    P = AFNPreconditioner(X, make_kernel("matern32", 0.3), 1e-2, k=30, w=15)
    assert P.L.dtype == dtype and P.V.dtype == dtype and P.G.dtype == dtype
    assert P.logdet().dtype == dtype and P.sample(2).dtype == dtype
    v = torch.randn(160, 2, dtype=dtype)
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(P.solve(P.matmul(v)), v, rtol=tol, atol=tol)


@pytest.mark.parametrize("landmarks", ["fps", "uniform"])
def test_afn_float32_tiny_mu_duplicates_warns_and_stays_finite(landmarks):
    Y = points(100, 3, dtype=torch.float32)
    X = torch.cat([Y, Y[:50], Y[:30]])[torch.randperm(180, generator=torch.Generator().manual_seed(0))]
    with pytest.warns(NumericalWarning):
        P = AFNPreconditioner(X, make_kernel("rbf", 1.0), 1e-8, k=40, w=20, landmarks=landmarks)
    assert P.shifts == P.summary()["shifts"] and len(P.shifts) > 0
    I = torch.eye(180)
    for out in (P.matmul(I), P.solve(I), P.logdet(), P.sample(5)):
        assert bool(torch.isfinite(out).all())


def test_afn_bad_input():
    X = points(50, 3)
    kern = make_kernel("rbf", 0.3)
    for mu in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="mu"):
            AFNPreconditioner(X, kern, mu, k=10, w=5)
    Xn = X.clone()
    Xn[0, 0] = float("nan")
    with pytest.raises(ValueError, match="X"):
        AFNPreconditioner(Xn, kern, 1e-2, k=10, w=5)
    with pytest.raises(ValueError, match="X"):
        AFNPreconditioner(torch.empty(0, 3, dtype=F64), kern, 1e-2, k=10, w=5)
    with pytest.raises(ValueError, match="X"):
        AFNPreconditioner(X[:1], kern, 1e-2, k=1, w=1)
    with pytest.raises(ValueError, match="k"):
        AFNPreconditioner(X, kern, 1e-2, k=51, w=5)
    with pytest.raises(ValueError, match="k"):
        AFNPreconditioner(X, kern, 1e-2, k=0, w=5)
    with pytest.raises(ValueError, match="w"):
        AFNPreconditioner(X, kern, 1e-2, k=10, w=51)
    with pytest.raises(ValueError, match="landmarks"):
        AFNPreconditioner(X, kern, 1e-2, k=10, w=5, landmarks="kmeans")


def test_afn_cache_reuse_isotropic_and_ard():
    X = points(200, 3)
    cache = PointCache(X)
    a1 = AFNPreconditioner(X, make_kernel("rbf", 0.2), 1e-2, k=30, w=15, cache=cache)
    misses = cache.misses
    assert a1.summary()["cache_hits"] == 0 and misses == 2  # FPS order + kNN pattern
    a2 = AFNPreconditioner(X, make_kernel("rbf", 0.6), 1e-3, k=20, w=15, landmarks="fps", cache=cache)
    assert cache.misses == misses + 1  # FPS prefix reused; the rest (and its pattern) differ for k = 20
    a3 = AFNPreconditioner(X, make_kernel("matern32", 0.6), 1e-3, k=20, w=15, cache=cache)
    assert cache.misses == misses + 1 and a3.summary()["cache_hits"] == 2
    fresh = AFNPreconditioner(X, make_kernel("matern32", 0.6), 1e-3, k=20, w=15)
    I = torch.eye(200, dtype=F64)
    assert torch.equal(a3.matmul(I), fresh.matmul(I)) and torch.equal(a2.landmark_idx, fresh.landmark_idx)
    # ARD: landmarks reused, the kNN pattern of X_r / lengthscale recomputed.
    ard = gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=3)
    ard.lengthscale = torch.tensor([0.1, 0.5, 2.0])
    b1 = AFNPreconditioner(X, ard, 1e-2, k=20, w=15, cache=cache)
    assert cache.misses == misses + 2 and b1.summary()["cache_hits"] == 1
    b2 = AFNPreconditioner(X, ard, 1e-1, k=20, w=15, cache=cache)
    assert cache.misses == misses + 2 and b2.summary()["cache_hits"] == 2
    v = torch.randn(200, 2, dtype=F64)
    torch.testing.assert_close(b1.solve(b1.matmul(v)), v, rtol=1e-8, atol=1e-8)


def test_afn_clean_build_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        P = AFNPreconditioner(points(150, 3), make_kernel("rbf", 0.3), 1e-2, k=25, w=10)
        P.solve(torch.ones(150, dtype=F64))
        P.matmul(torch.ones(150, dtype=F64))


def test_schur_landmark_part_in_float32_where_the_shift_dwarfs_its_rounding():
    """A float64 build forms V_s V_sᵀ in float32 above the margin: the preconditioner stays exact as used (solve,
    logdet, the "full" control variate family), and about as good as the float64 build (forced through the margin)."""
    from unittest import mock

    from gpnys.precond.afn import schur_product_dtype

    X = points(400, 3, seed=5)
    kern = make_kernel("rbf", 0.3)
    mu, k, w = 0.05, 60, 15
    P = AFNPreconditioner(X, kern, mu, k=k, w=w)
    with mock.patch("gpnys.precond.afn.SCHUR_ROUNDING_MARGIN", float("inf")):
        P64 = AFNPreconditioner(X, kern, mu, k=k, w=w)
    assert P.schur_dtype == torch.float32 and P64.schur_dtype == F64 and P.G.dtype == F64
    v = torch.randn(400, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(P.solve(P.matmul(v)), v, rtol=1e-8, atol=1e-8)
    Pd = dense_P(P)
    torch.testing.assert_close(P.logdet(), torch.logdet(Pd), rtol=1e-9, atol=1e-9)
    # G within the float32 rounding of the landmark part, and the same conditioning of P^{-1} A
    G, G64 = P.G.to_dense(), P64.G.to_dense()
    assert float((G - G64).norm() / G64.norm()) < 1e-4
    A = dense_A(X, kern, mu)
    cond, cond64 = torch.linalg.cond(P.solve(A)), torch.linalg.cond(P64.solve(A))
    assert abs(float(cond / cond64) - 1.0) < 1e-3
    # the "full" family rebuilds the blocks at the same precision: it equals P at the current hyperparameters
    Z = torch.randn(400, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    logdet, quad = P.differentiable_terms(kern, torch.tensor(mu, dtype=F64), Z, schur="full")
    torch.testing.assert_close(logdet, P.logdet(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(quad, (Z * P.solve(Z)).sum(0), rtol=1e-9, atol=1e-9)
    # below the margin, in float32 points and with a complete pattern: the build's own dtype
    assert AFNPreconditioner(X, kern, 1e-5, k=k, w=w).schur_dtype == F64
    P32 = AFNPreconditioner(X.float(), make_kernel("rbf", 0.3, torch.float32), mu, k=k, w=w)
    assert P32.schur_dtype == torch.float32
    assert schur_product_dtype(F64, mu, k, 400 - k, 1.0, 400 - k) == F64
    assert AFNPreconditioner(X, kern, mu, k=k, w=w).G.values().equal(P.G.values())  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_schur_operand_leaves_no_subnormal_products(dtype):
    """At a short length-scale most of V is far below 1: its Schur product's operand drops the
    entries whose products would be subnormal (slow on a CPU), losing at most k sqrt(tiny) per block entry; the
    preconditioner built with it stays exact as used and equal to its "full" control variate family. (ℓ = 0.03 for
    float64, whose sqrt(tiny) is 1.5e-154.)"""
    from gpnys.precond.afn import schur_operand

    X = points(400, 6, seed=3)
    kern = make_kernel("rbf", 0.15 if dtype == torch.float32 else 0.03)
    mu, k, w = 0.1, 60, 15
    P = AFNPreconditioner(X, kern, mu, k=k, w=w)
    tiny = torch.finfo(dtype).tiny
    V = P.V[:, None, :]  # (rows, 1, k)
    low = schur_operand(V, dtype)
    assert bool(((V.abs() < tiny**0.5) & (V != 0)).any())  # the case this is for
    prod = low @ low.mT
    assert not bool(((prod != 0) & (prod.abs() < tiny)).any())  # no subnormal results
    exact = (V @ V.mT).to(dtype)
    assert float((prod - exact).abs().max()) <= k * tiny**0.5 + 4 * torch.finfo(dtype).eps * float(exact.abs().max())
    v = torch.randn(400, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(P.solve(P.matmul(v)), v, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(P.logdet(), torch.logdet(dense_P(P)), rtol=1e-9, atol=1e-9)
    Z = torch.randn(400, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    logdet, _ = P.differentiable_terms(kern, torch.tensor(mu, dtype=F64), Z, schur="full")
    torch.testing.assert_close(logdet, P.logdet(), rtol=1e-10, atol=1e-10)
