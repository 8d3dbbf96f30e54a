"""float32 inputs to the exact posterior and the RKHS distances: the dense reference and the distances run in at
least float64 (on the float32 data and hyperparameters) and match a float64 evaluation of the same rounded data."""

import copy
import warnings

import gpytorch
import pytest
import torch

from gpnys import datasets
from gpnys.checks import NumericalWarning
from gpnys.reduced import ExactPosterior, reduced_posterior, rkhs_error

NOISE = 1e-3


@pytest.fixture(scope="module")
def problem():
    ds = datasets.load("concrete", n=900, seed=0)
    X32, y32, Z32 = ds.train_x.float(), ds.train_y.float(), ds.test_x[:100].float()
    k32 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).float()
    k32.base_kernel.lengthscale, k32.outputscale = 2.0, 1.0
    k64 = copy.deepcopy(k32).double()  # the float32 hyperparameters, exactly
    e32 = ExactPosterior(k32, X32, y32, NOISE)
    e64 = ExactPosterior(k64, X32.double(), y32.double(), NOISE)
    return X32, y32, Z32, k32, k64, e32, e64


def test_exact_posterior_is_the_float64_one(problem):
    X32, _, Z32, _, _, e32, e64 = problem
    assert e32.quad == pytest.approx(e64.quad, rel=1e-10)  # a float32 Cholesky: 2e-4 off here
    assert e32.alpha.dtype == torch.float32
    mean, var = e32.mean(Z32), e32.variance(Z32)
    assert mean.dtype == var.dtype == torch.float32
    torch.testing.assert_close(mean.double(), e64.mean(Z32.double()), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var.double(), e64.variance(Z32.double()), rtol=1e-6, atol=1e-7)
    B = torch.randn(X32.shape[0], 2, generator=torch.Generator().manual_seed(0))
    assert e32.solve(B).dtype == torch.float32


def test_lla_with_m_equal_n_in_float32(problem):
    """LLA with every point a landmark is the exact posterior: its float32 RKHS distance was 0.154 (float64:
    6e-5), from float32 features along ``K_mm``'s smallest directions and float32 cancellations."""
    X32, y32, Z32, k32, k64, e32, e64 = problem
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)  # K_mm's numerically zero directions cut off
        p32 = reduced_posterior("lla", k32, X32, y32, NOISE, m=X32.shape[0], landmarks="fps")
        p64 = reduced_posterior("lla", k64, X32.double(), y32.double(), NOISE, m=X32.shape[0], landmarks="fps")
    r32, r64 = rkhs_error(p32, e32), rkhs_error(p64, e64)
    assert r64 < 1e-3 and r32 < 1e-3
    assert p32.mean(Z32).dtype == torch.float32
    assert float((p32.mean(Z32).double() - e64.mean(Z32.double())).abs().max()) < 1e-4


@pytest.mark.parametrize("method", ["lla", "gsa", "ncr"])
def test_rkhs_errors_match_float64_with_fewer_landmarks(problem, method):
    X32, y32, _, k32, k64, e32, e64 = problem
    p32 = reduced_posterior(method, k32, X32, y32, NOISE, m=200, landmarks="fps")
    p64 = reduced_posterior(method, k64, X32.double(), y32.double(), NOISE, m=200, landmarks="fps")
    assert rkhs_error(p32, e32) == pytest.approx(rkhs_error(p64, e64), rel=1e-4)
