"""Preconditioners of a markedly anisotropic ARD kernel choose their landmarks in the kernel's own metric, ``X / ℓ``
(length-scales rounded to powers of 2): the same kernel matrix written as ``(X, ARD ℓ)`` or as ``(X / ℓ, ℓ = 1)``
gets the same landmarks and the same preconditioner; and the base class's argument checks (per-point shifts in the
working dtype, right-hand sides, draws, seeds)."""

import gpytorch
import pytest
import torch
from helpers import points

from gpnys.landmarks import fps, kmeans
from gpnys.precond import AFNPreconditioner, FSAIPreconditioner, NystromPreconditioner
from gpnys.precond.cache import PointCache
from gpnys.precond.strategy import AutoPreconditioner, make_preconditioner
from gpnys.solvers import pcg

LS = (1 / 16, 16.0)  # powers of 2: the rounded metric is X / l itself


def _kernels(dtype):
    ard = gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=2).to(dtype)
    ard.lengthscale = torch.tensor(LS, dtype=dtype)
    iso = gpytorch.kernels.MaternKernel(nu=1.5).to(dtype)
    iso.lengthscale = 1.0
    return ard, iso


@pytest.mark.parametrize("name", ["nystrom", "afn", "auto"])
def test_ard_landmarks_are_those_of_the_scaled_points(name, dtype):
    X = points(600, 2, dtype=dtype)
    ard, iso = _kernels(dtype)
    scaled = X / torch.tensor(LS, dtype=dtype)
    options = {"nystrom": dict(rank=60), "afn": dict(k=60, w=10), "auto": dict(k=60, w=10)}[name]
    P = make_preconditioner(name, X, ard, 1e-2, cache=PointCache(X), **options)
    Q = make_preconditioner(name, scaled, iso, 1e-2, cache=PointCache(scaled), **options)
    landmarks = getattr(P.chosen, "landmark_indices", None)
    if landmarks is None:
        landmarks = P.chosen.landmark_idx
    reference = getattr(Q.chosen, "landmark_indices", None)
    if reference is None:
        reference = Q.chosen.landmark_idx
    assert torch.equal(landmarks, reference)
    eye = torch.eye(600, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(P.matmul(eye), Q.matmul(eye), rtol=tol, atol=tol)


def test_ard_landmarks_cut_pcg_iterations():
    """Length-scales 400 times apart: landmarks chosen on the raw coordinates had cost Nyström of rank 100 about 2.5
    times the PCG iterations of those chosen in the kernel's metric (415 against 161 at l = (0.05, 20))."""
    X = points(1500, 2)
    ard, _ = _kernels(torch.float64)
    ard.lengthscale = torch.tensor([0.05, 20.0], dtype=torch.float64)
    K = ard(X).to_dense().detach() + 1e-3 * torch.eye(1500, dtype=torch.float64)
    b = torch.randn(1500, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    raw = NystromPreconditioner(X, ard, 1e-3, 100, landmarks="fps", landmark_indices=fps(X, 100).indices)
    ours = NystromPreconditioner(X, ard, 1e-3, 100, landmarks="fps")
    its = {P: pcg(lambda V: K @ V, b, precond=P, tol=1e-8, maxiter=2000).iterations for P in (raw, ours)}
    assert its[ours] < 0.6 * its[raw], its


def test_shifts_checked_in_the_working_dtype():
    """A float64 shift that float32 rounds to 0 (1e-50) or to inf (1e40) is refused, where it had been stored."""
    X = points(40, 2, dtype=torch.float32)
    kernel = gpytorch.kernels.RBFKernel()
    for bad in (1e-50, 1e40):
        diag = torch.full((40,), 0.1, dtype=torch.float64)
        diag[5] = bad
        for build in (lambda: FSAIPreconditioner(X, kernel, 0.1, w=5, diag=diag),
                      lambda: AFNPreconditioner(X, kernel, 0.1, k=5, w=5, diag=diag)):
            with pytest.raises(ValueError, match="diag must be positive and finite in torch.float32"):
                build()
    with pytest.raises(ValueError, match="diag must be a floating tensor"):
        FSAIPreconditioner(X, kernel, 0.1, w=5, diag=torch.ones(40, dtype=torch.bool))


def test_argument_checks_name_the_argument():
    X = points(80, 2)
    kernel = gpytorch.kernels.RBFKernel().double()
    kernel.lengthscale = 0.01
    P = AFNPreconditioner(X, kernel, 0.1, k=10, w=5)
    with pytest.raises(ValueError, match="R must have the preconditioner's dtype"):
        P.solve(torch.ones(80, dtype=torch.float32))
    with pytest.raises(ValueError, match="R must have 80 rows"):
        P.matmul(torch.ones(79, dtype=torch.float64))
    for num in (-1, 1.5):
        with pytest.raises(ValueError, match="num"):
            P.sample(num)
    for call, name in ((lambda: AFNPreconditioner(X, kernel, 0.1, k=10, w=5, seed=1.5), "seed"),
                       (lambda: kmeans(X, 3, seed=1.5), "seed"), (lambda: fps(X, 3, start=1.5), "start"),
                       (lambda: fps(X.long(), 3), "X")):
        with pytest.raises(ValueError, match=name):
            call()
    # auto's default neighbours (100) at n = 80 on its AFN branch: at most n, as make_preconditioner gives
    auto = AutoPreconditioner(X, kernel, 0.1, max_k=40)
    assert auto.choice == "afn" and auto.inner.w <= 80
