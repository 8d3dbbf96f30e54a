"""Tests of gpnys.landmarks.rank: AFN Algorithm 4 numerical-rank estimation."""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch
from helpers import make_kernel, points

from gpnys.landmarks.rank import (
    RankEstimate,
    estimate_rank,
    numerical_rank,
    nystrom_rel_error,
)

F64 = torch.float64


def cube(n: int, edge: float = 10.0, seed: int = 0) -> torch.Tensor:
    """Uniform float64 points in a cube of the given edge (paper Fig. 5 uses edge 10)."""
    return points(n, seed=seed, scale=edge)


def true_rank(X: torch.Tensor, kernel: gpytorch.kernels.Kernel, mu: float) -> int:
    with torch.no_grad():
        K = kernel(X.double()).to_dense().double()
    return numerical_rank(torch.linalg.eigvalsh(K), mu)


@pytest.fixture(scope="module")
def fig5():
    """Paper Fig. 5: 1000 uniform points in a cube of edge 10, Gaussian l = 5 (GPyTorch 5/sqrt 2), mu = 1e-4."""
    X = cube(1000, seed=1)
    kernel = make_kernel("rbf", 5 / math.sqrt(2), F64)
    return X, kernel, 1e-4, true_rank(X, kernel, 1e-4)


def test_fig5_window(fig5):
    X, kernel, mu, truth = fig5
    assert 230 <= truth <= 260  # the paper reports 243 for its own draw
    est = estimate_rank(X, kernel, mu, m=500)
    assert isinstance(est, RankEstimate)
    assert est.branch == "eigen-count" and est.m == 500 and len(est.r_per_rep) == 3
    # The scaled subsample over-estimates (numerical rank is not extensive: a smaller cube at the
    # same density has relatively more boundary); observed ~302 for truth 243 (ratio ~1.25).
    assert truth <= est.k <= 1.5 * truth
    assert est.details["emulated_n"] == 1000 and est.details["k_nystrom"] < 2000


def test_fig5_float32_matches_float64(fig5):
    X, kernel, mu, truth = fig5
    e64 = estimate_rank(X, kernel, mu, m=300, reps=2)
    e32 = estimate_rank(X.float(), make_kernel("rbf", 5 / math.sqrt(2), torch.float32), mu, m=300, reps=2)
    assert abs(e32.k - e64.k) <= 0.1 * e64.k
    assert 0.5 * truth <= e32.k <= 2 * truth
    # staying in float32 for the m x m work still runs (less accurate counts for small mu)
    k32 = make_kernel("rbf", 5 / math.sqrt(2), torch.float32)
    e32w = estimate_rank(X.float(), k32, 1e-2, m=200, reps=1, work_dtype=torch.float32)
    assert 1 <= e32w.k <= 1000


def test_extreme_lengthscales():
    X = cube(1000)
    big = estimate_rank(X, make_kernel("rbf", 1000.0, F64), 1e-4, m=200)
    assert big.k <= 30  # truth is 4
    tiny = estimate_rank(X, make_kernel("rbf", 0.1, F64), 1e-4, m=200)
    assert tiny.k == 1000  # K ~ I: every eigenvalue exceeds 0.1 mu


def test_monotone_in_lengthscale():
    X = cube(1000, seed=2)
    lengthscales = (0.5, 2.0, 4.0, 8.0, 30.0, 200.0)
    ks = [estimate_rank(X, make_kernel("rbf", ls, F64), 1e-4, m=200, reps=2).k for ls in lengthscales]
    assert all(a >= b for a, b in zip(ks, ks[1:])), ks
    assert ks[0] > 5 * ks[-1]


def test_scaled_nystrom_branch():
    X = cube(1000)
    est = estimate_rank(X, make_kernel("rbf", 0.3, F64), 1e-4, m=200, max_k=100)
    assert est.branch == "scaled-nystrom"
    assert est.k == min(math.ceil(max(est.r_per_rep) * 1000 / 200), 1000) >= 100
    assert "counts" not in est.details


def test_whole_set_is_exact_when_n_le_m():
    X = cube(150, edge=5.0)
    kernel = make_kernel("matern32", 2.0, F64)
    est = estimate_rank(X, kernel, 1e-3, m=500)
    assert est.m == 150 and est.details["whole_set"] and len(est.r_per_rep) == 1
    assert est.k == true_rank(X, kernel, 1e-3)


def test_ard_scale_and_matern():
    X = cube(600)
    iso = estimate_rank(X, make_kernel("rbf", 3.0, F64), 1e-3, m=200, reps=2)
    ard = gpytorch.kernels.RBFKernel(ard_num_dims=3).double()
    ard.lengthscale = torch.tensor([[3.0, 3.0, 3.0]])
    assert estimate_rank(X, ard, 1e-3, m=200, reps=2).k == iso.k
    scaled = gpytorch.kernels.ScaleKernel(make_kernel("rbf", 3.0, F64)).double()
    scaled.outputscale = 5.0  # stripped: mu is relative to the unit-variance kernel
    assert estimate_rank(X, scaled, 1e-3, m=200, reps=2).k == iso.k
    # anisotropic: stretching one axis (longer lengthscale) lowers the rank
    ard.lengthscale = torch.tensor([[3.0, 3.0, 30.0]])
    assert estimate_rank(X, ard, 1e-3, m=200, reps=2).k < iso.k
    mat = make_kernel("matern32", 3.0, F64)
    em = estimate_rank(X, mat, 1e-3, m=200, reps=2)
    assert iso.k < em.k <= 600  # Matern-3/2 decays slower than the Gaussian


def test_reproducible_and_seeded():
    X = cube(800)
    a = estimate_rank(X, make_kernel("rbf", 2.0, F64), 1e-4, m=150, seed=3)
    b = estimate_rank(X, make_kernel("rbf", 2.0, F64), 1e-4, m=150, seed=3)
    assert a.k == b.k and a.r_per_rep == b.r_per_rep and a.details["counts"] == b.details["counts"]
    others = {
        tuple(estimate_rank(X, make_kernel("rbf", 2.0, F64), 1e-4, m=150, seed=s).details["counts"]) for s in range(4)
    }
    assert len(others) > 1  # the seed does change the subsamples


def test_nystrom_rel_error_matches_definition():
    X = cube(120, edge=6.0)
    with torch.no_grad():
        K = make_kernel("rbf", 1.0, F64)(X).to_dense()
    for r in (1, 10, 60, 120):
        C = K[:, :r]
        ref = torch.linalg.matrix_norm(K - C @ torch.linalg.solve(C[:r], C.mT)) / torch.linalg.matrix_norm(K)
        assert abs(nystrom_rel_error(K, r) - float(ref)) < 1e-6


def test_bad_input():
    X = cube(100)
    k = make_kernel("rbf", 1.0, F64)
    for kwargs in ({"mu": 0.0}, {"mu": -1.0}, {"mu": float("nan")}, {"m": 1}, {"reps": 0}, {"tol": 0.0}, {"tol": 1.5}):
        args = {"mu": 1e-3, **kwargs}
        with pytest.raises(ValueError):
            estimate_rank(X, k, **args)
    bad = X.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError):
        estimate_rank(bad, k, 1e-3)
    with pytest.raises(ValueError):
        estimate_rank(X[:, 0], k, 1e-3)


def test_refine_n_emulates_a_larger_set():
    X = cube(1000)
    k = make_kernel("rbf", 4.0, F64)
    a = estimate_rank(X, k, 1e-4, m=200, max_k=400)
    b = estimate_rank(X, k, 1e-4, m=200, max_k=400, refine_n=1000)
    assert a.details["emulated_n"] == 400 and b.details["emulated_n"] == 1000
    assert a.branch == b.branch == "eigen-count"
    assert b.k > a.k  # the rank of a 400-point subsample is smaller than that of all 1000 points
    with pytest.raises(ValueError):
        estimate_rank(X, k, 1e-4, m=200, refine_n=1001)
    with pytest.raises(ValueError):
        estimate_rank(X, k, 1e-4, m=200, refine_n=100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decide_only_stops_once_the_switch_is_decided(dtype):
    """``decide_only``: step 1 stops at the first repetition whose ``k`` reaches ``max_k``; the branch is the full
    estimate's and ``k`` a lower bound of it (the maximum over repetitions only grows). Below ``max_k`` every
    repetition runs and the estimate is the full one."""
    X = cube(3000, edge=10.0, seed=2).to(dtype)
    kernel = make_kernel("rbf", 0.5, dtype)
    full = estimate_rank(X, kernel, 1e-2, m=300, reps=3, max_k=200, seed=4)
    fast = estimate_rank(X, kernel, 1e-2, m=300, reps=3, max_k=200, seed=4, decide_only=True)
    assert full.branch == fast.branch == "scaled-nystrom" and full.details["reps"] == 3
    assert fast.details["reps"] == 1 and fast.r_per_rep == full.r_per_rep[:1]
    assert 200 <= fast.k <= full.k
    high = estimate_rank(X, kernel, 1e-2, m=300, reps=3, max_k=10**6, seed=4, decide_only=True)
    assert high.branch == "eigen-count" and high.details["reps"] == 3
    assert high.k == estimate_rank(X, kernel, 1e-2, m=300, reps=3, max_k=10**6, seed=4).k


def test_float32_kernel_that_does_not_promote():
    """The estimate works in float64 on float32 points; a kernel whose float32 parameters do not promote against
    float64 points (PolynomialKernel's ``addmm`` with its offset) is taken in the working precision too, so the
    estimate runs (before, the Nyström and AFN builds failed and fell back to a pivoted Cholesky)."""
    X = points(300, 3, dtype=torch.float32)
    kernel = gpytorch.kernels.PolynomialKernel(power=2)
    est = estimate_rank(X, kernel, 1e-2)
    ref = estimate_rank(X.double(), gpytorch.kernels.PolynomialKernel(power=2).double(), 1e-2)
    assert est.k == ref.k and kernel.offset.dtype == torch.float32  # the caller's kernel is left as it was
