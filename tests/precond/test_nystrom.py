"""Tests for gpnys.precond.nystrom.NystromPreconditioner (stable eigen-form Nyström, eq. 8, and RAN scaling)."""

import itertools
import math

import gpytorch
import pytest
import torch
from helpers import dense_P, make_kernel, points

from gpnys import landmarks
from gpnys.precond.base import Preconditioner
from gpnys.precond.nystrom import NystromPreconditioner

MU = 0.05
N = 240
K_RANK = 60
LS_FACTORS = (0.2, 1.0, 5.0)  # length-scale = factor * sqrt(d): near-diagonal K, middle, near-low-rank K


def normal_points(n, d, seed=0, dtype=torch.float64):
    """Standard normal points; typical pairwise distance ~ sqrt(2 d)."""
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def dense_K(X, kern):
    """Reference dense unit-variance K in float64."""
    with torch.no_grad():
        return kern.forward(X.double(), X.double()).double()


GRID = list(
    itertools.product((3, 18), ("rbf", "matern"), LS_FACTORS, ("column", "sketch"), ("stable", "ran"))
)


def grid_id(case):
    d, kn, f, s, sc = case
    return f"d{d}-{kn}-ls{f}-{s}-{sc}"


@pytest.mark.parametrize("case", GRID, ids=[grid_id(c) for c in GRID])
def test_solve_matmul_logdet_factor(case, dtype):
    d, kname, factor, sampling, scaling = case
    X = normal_points(N, d, seed=d, dtype=dtype)
    kern = make_kernel(kname, factor * math.sqrt(d))
    P = NystromPreconditioner(X, kern, MU, K_RANK, sampling=sampling, scaling=scaling)
    assert isinstance(P, Preconditioner) and P.rank == K_RANK and P.n == N
    assert P.U.shape == (N, K_RANK) and P.lam.shape == (K_RANK,)
    assert P.U.dtype == dtype and P.lam.dtype == dtype
    assert bool((P.lam >= 0).all()) and bool((P.lam[:-1] >= P.lam[1:]).all())
    tol = 1e-9 if dtype == torch.float64 else 2e-3
    # U has orthonormal columns.
    I_k = torch.eye(K_RANK, dtype=dtype)
    assert torch.allclose(P.U.mT @ P.U, I_k, atol=tol * 10)

    g = torch.Generator().manual_seed(1)
    V = torch.randn(N, 3, generator=g, dtype=torch.float64).to(dtype)
    out = P.solve(P.matmul(V))
    assert out.dtype == dtype and out.shape == V.shape
    assert (out - V).norm() / V.norm() < tol
    assert (P.matmul(P.solve(V)) - V).norm() / V.norm() < tol
    # Vector input.
    assert P.solve(V[:, 0]).shape == (N,)
    assert torch.allclose(P.solve(V[:, 0]), P.solve(V)[:, 0], rtol=tol, atol=tol * float(P.solve(V).abs().max()))

    D = dense_P(P).double()
    assert torch.allclose(D, D.mT, atol=tol * D.abs().max())
    ref = torch.logdet(D)
    ld = P.logdet()
    assert ld.dim() == 0 and ld.dtype == dtype
    assert abs(float(ld) - float(ref)) < (1e-8 if dtype == torch.float64 else 1e-4) * N

    # The symmetric square root: F F^T = P with F = sample-map applied to the identity.
    F = P._sample(torch.eye(N, dtype=dtype)).double()
    assert torch.allclose(F, F.mT, atol=tol * F.abs().max())
    assert (F @ F.mT - D).norm() / D.norm() < tol

    # Eigen-structure of each scaling.
    U, lam = P.U.double(), P.lam.double()
    if scaling == "stable":  # P = U Lam U^T + mu I  (eq. 8 inverted)
        expect = U @ torch.diag(lam) @ U.mT + MU * torch.eye(N, dtype=torch.float64)
    else:  # RAN: P = U (Lam + mu)/(lam_k + mu) U^T + (I - U U^T)
        expect = U @ torch.diag((lam + MU) / (lam[-1] + MU)) @ U.mT + torch.eye(N, dtype=torch.float64) - U @ U.mT
        assert P.complement_eig == 1.0
        assert abs(float(P.range_eigs[-1]) - 1.0) < 1e-6
    assert (D - expect).norm() / expect.norm() < tol


@pytest.mark.parametrize("sampling,scaling", list(itertools.product(("column", "sketch"), ("stable", "ran"))))
def test_empirical_covariance_of_samples(sampling, scaling):
    n = 64
    X = normal_points(n, 3, seed=5)
    P = NystromPreconditioner(X, make_kernel("matern", 1.5), MU, 16, sampling=sampling, scaling=scaling)
    S = P.sample(20000, generator=torch.Generator().manual_seed(3))
    assert S.shape == (n, 20000) and S.dtype == torch.float64
    cov = S @ S.mT / S.shape[1]
    D = dense_P(P)
    assert (cov - D).norm() / D.norm() < 0.1


@pytest.mark.parametrize("kname,factor", [("rbf", 0.2), ("rbf", 1.0), ("rbf", 5.0), ("matern", 0.2), ("matern", 5.0)])
@pytest.mark.parametrize("sampling", ["column", "sketch"])
def test_full_rank_equals_K_plus_mu(kname, factor, sampling):
    n, d = 150, 3
    X = normal_points(n, d, seed=2)
    kern = make_kernel(kname, factor * math.sqrt(d))
    P = NystromPreconditioner(X, kern, MU, n, sampling=sampling, scaling="stable")
    A = dense_K(X, kern) + MU * torch.eye(n, dtype=torch.float64)
    assert (dense_P(P) - A).abs().max() < 1e-10
    assert abs(float(P.logdet() - torch.logdet(A))) < 1e-8
    V = torch.randn(n, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.allclose(P.solve(V), torch.linalg.solve(A, V), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("landmarks_rule", ["fps", "uniform"])
def test_matches_textbook_nystrom_when_well_conditioned(landmarks_rule):
    n, d, k = 300, 3, 40
    X = normal_points(n, d, seed=4)
    kern = make_kernel("matern", 0.5)  # short length-scale: K11 well conditioned
    P = NystromPreconditioner(X, kern, MU, k, landmarks=landmarks_rule)
    K = dense_K(X, kern)
    idx = P.landmark_indices
    K11 = K[idx][:, idx]
    assert torch.linalg.cond(K11) < 1e3
    Knk = K[:, idx]
    textbook = Knk @ torch.linalg.solve(K11, Knk.mT)
    ours = P.U @ torch.diag(P.lam) @ P.U.mT
    assert (ours - textbook).norm() / textbook.norm() < 1e-10
    # Nyström interpolates the landmark columns exactly.
    assert torch.allclose(ours[:, idx], Knk, atol=1e-10)


def nystrom_error(P, K):
    """Relative trace-norm error tr(K - K_nys)/tr(K) (K - K_nys is PSD for column Nyström)."""
    return float((torch.diagonal(K).sum() - P.lam.sum()) / torch.diagonal(K).sum())


def test_fps_beats_uniform_on_average():
    # Fixed data and seeds: deterministic. FPS vs the mean over 5 uniform draws, in several settings.
    n, d = 300, 3
    X = points(n, d, seed=7, scale=10.0)
    wins, total = 0, 0
    for kname, ls, k in [("rbf", 2.0, 30), ("rbf", 3.0, 20), ("matern", 3.0, 40), ("matern", 5.0, 25)]:
        kern = make_kernel(kname, ls)
        K = dense_K(X, kern)
        e_fps = nystrom_error(NystromPreconditioner(X, kern, MU, k, landmarks="fps"), K)
        e_uni = [nystrom_error(NystromPreconditioner(X, kern, MU, k, landmarks="uniform", seed=s), K) for s in range(5)]
        mean_uni = sum(e_uni) / len(e_uni)
        total += 1
        wins += e_fps < mean_uni
        assert e_fps < 1.0 and mean_uni < 1.0
    assert wins == total


def test_given_landmark_indices_match_fps_and_use_prefix():
    X = normal_points(200, 3, seed=8)
    kern = make_kernel("rbf", 1.0)
    order = landmarks.fps(X, 50).indices
    P1 = NystromPreconditioner(X, kern, MU, 30, landmarks="fps")
    P2 = NystromPreconditioner(X, kern, MU, 30, landmark_indices=order)
    assert torch.equal(P1.landmark_indices, order[:30]) and torch.equal(P2.landmark_indices, order[:30])
    assert torch.equal(P1.U, P2.U) and torch.equal(P1.lam, P2.lam)
    assert P2.summary()["landmarks"] == "given"


def test_scale_kernel_outputscale_is_stripped():
    X = normal_points(120, 3, seed=9)
    base = make_kernel("matern", 1.0)
    scaled = gpytorch.kernels.ScaleKernel(make_kernel("matern", 1.0))
    scaled.outputscale = 3.0
    P1 = NystromPreconditioner(X, base, MU, 20)
    P2 = NystromPreconditioner(X, scaled, MU, 20)
    assert torch.allclose(P1.lam, P2.lam) and torch.allclose(P1.logdet(), P2.logdet())


def test_summary_fields():
    X = normal_points(100, 3, seed=10)
    P = NystromPreconditioner(X, make_kernel("rbf", 1.0), MU, 10, landmarks="uniform", scaling="ran", seed=3)
    s = P.summary()
    keys = ("kind", "n", "rank", "mu", "shifts", "setup_s", "sampling", "landmarks", "scaling", "lam_max", "lam_min", "nu")
    for key in keys:
        assert key in s
    assert s["kind"] == "nystrom" and s["rank"] == 10 and s["sampling"] == "column"
    assert s["landmarks"] == "uniform" and s["scaling"] == "ran"
    assert s["lam_max"] >= s["lam_min"] >= 0 and s["nu"] > 0 and s["setup_s"] >= 0
    sk = NystromPreconditioner(X, make_kernel("rbf", 1.0), MU, 10, sampling="sketch").summary()
    assert sk["sampling"] == "sketch" and sk["landmarks"] is None


def test_seeded_reproducibility():
    X = normal_points(150, 18, seed=11)
    kern = make_kernel("matern", 4.0)
    for kw in ({"landmarks": "uniform"}, {"sampling": "sketch"}, {"landmarks": "fps"}):
        a = NystromPreconditioner(X, kern, MU, 20, seed=5, **kw)
        b = NystromPreconditioner(X, kern, MU, 20, seed=5, **kw)
        assert torch.equal(a.U, b.U) and torch.equal(a.lam, b.lam)
        c = NystromPreconditioner(X, kern, MU, 20, seed=6, **kw)
        if kw.get("landmarks") == "fps":
            assert torch.equal(a.U, c.U)  # FPS is deterministic
        else:
            assert not torch.equal(a.lam, c.lam)
    u5 = NystromPreconditioner(X, kern, MU, 20, landmarks="uniform", seed=5).landmark_indices
    u6 = NystromPreconditioner(X, kern, MU, 20, landmarks="uniform", seed=6).landmark_indices
    assert not torch.equal(u5, u6)


def test_float32_runs_in_float32():
    X = normal_points(100, 3, seed=12, dtype=torch.float32)
    for sampling in ("column", "sketch"):
        P = NystromPreconditioner(X, make_kernel("rbf", 1.0), MU, 20, sampling=sampling)
        outs = (P.U, P.lam, P.range_eigs, P.solve(torch.ones(100)), P.matmul(torch.ones(100, 2)), P.logdet(), P.sample(3))
        for t in outs:
            assert t.dtype == torch.float32
        assert P.sample(3).shape == (100, 3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mu": 0.0}, "mu"),
        ({"mu": -1.0}, "mu"),
        ({"mu": float("nan")}, "mu"),
        ({"mu": float("inf")}, "mu"),
        ({"k": 0}, "k"),
        ({"k": -3}, "k"),
        ({"k": 51}, "k"),
        ({"k": 2.5}, "k"),
        ({"landmarks": "kmeans"}, "landmarks"),
        ({"landmarks": "FPS"}, "landmarks"),
        ({"sampling": "random"}, "sampling"),
        ({"scaling": "smw"}, "scaling"),
        ({"seed": "a"}, "seed"),
        ({"sampling": "sketch", "landmark_indices": torch.arange(5)}, "landmark_indices"),
        ({"landmark_indices": torch.arange(3)}, "landmark_indices"),
        ({"landmark_indices": torch.tensor([0, 1, 2, 3, 99])}, "landmark_indices"),
        ({"landmark_indices": torch.tensor([0, 1, 1, 3, 4])}, "landmark_indices"),
        ({"landmark_indices": torch.arange(5.0)}, "landmark_indices"),
    ],
)
def test_bad_arguments(kwargs, match):
    X = normal_points(50, 3, seed=13)
    args = {"mu": MU, "k": 5}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        NystromPreconditioner(X, make_kernel("rbf", 1.0), **args)


@pytest.mark.parametrize(
    "X",
    [
        torch.empty(0, 3, dtype=torch.float64),
        torch.empty(5, 0, dtype=torch.float64),
        torch.tensor([[0.0, 1.0], [float("nan"), 0.0]], dtype=torch.float64),
        torch.tensor([[0.0, 1.0], [float("inf"), 0.0]], dtype=torch.float64),
        torch.zeros(4, dtype=torch.float64),
    ],
)
def test_bad_points(X):
    with pytest.raises(ValueError, match="X"):
        NystromPreconditioner(X, make_kernel("rbf", 1.0), MU, 1)


def test_wrong_rhs_rows():
    X = normal_points(40, 3, seed=14)
    P = NystromPreconditioner(X, make_kernel("rbf", 1.0), MU, 5)
    with pytest.raises(ValueError):
        P.solve(torch.ones(39, dtype=torch.float64))
