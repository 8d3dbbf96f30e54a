"""The preconditioners' argument checks: per-point shifts in the working dtype, right-hand sides, draws, seeds and
FPS starts name what is wrong."""

import gpytorch
import pytest
import torch
from helpers import points

from gpnys.landmarks import fps, kmeans
from gpnys.precond import AFNPreconditioner, FSAIPreconditioner
from gpnys.precond.strategy import AutoPreconditioner


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
