"""A NaN or inf inside a kernel product never passes unseen: whichever product of the solve it hits (the first, a
later CG iteration, the final residual), the evaluation raises a ``NonFiniteError`` that names the hyperparameters,
instead of returning inf, NaN or a finite value from a solve cut short."""

from __future__ import annotations

import gpytorch
import pytest
import torch

import gpnys
from gpnys.gp import ExactGPModel
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.solvers import NonFiniteError, pcg


def _model(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(150, 2, generator=g, dtype=torch.float64).to(dtype)
    y = torch.sin(6 * X[:, 0]).to(dtype)
    return ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").to(dtype), X, y


@pytest.mark.parametrize("at_call", [1, 3, -1])  # the first product, a later CG product, the last (true residual)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_in_one_kernel_product_raises(monkeypatch, dtype, at_call, value):
    model, X, y = _model(dtype)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpnys.use_preconditioner(model) as hook:
        float(-mll(model(X), y).detach())  # a clean evaluation counts the products
    calls = {"n": 0}
    original = StationaryKernelOperator._matmul

    def counting(self, rhs):
        calls["n"] += 1
        return original(self, rhs)

    monkeypatch.setattr(StationaryKernelOperator, "_matmul", counting)
    with gpnys.use_preconditioner(model):
        float(-mll(model(X), y).detach())
    total = calls["n"]
    target = total if at_call == -1 else at_call
    calls["n"] = 0

    def poisoned(self, rhs):
        calls["n"] += 1
        out = original(self, rhs)
        if calls["n"] == target:
            out = out.clone()
            out[7, 0] = value
        return out

    monkeypatch.setattr(StationaryKernelOperator, "_matmul", poisoned)
    with pytest.raises(NonFiniteError, match=r"NaN or inf.*lengthscale=.*noise="), gpnys.use_preconditioner(model):
        (-mll(model(X), y)).backward()
    assert hook.builds >= 1


def test_pcg_raises_on_a_non_finite_product():
    A = torch.eye(5, dtype=torch.float64) * 2

    def matmul(V):
        out = A @ V
        out[2] = float("nan")
        return out

    with pytest.raises(NonFiniteError, match="iteration 1"):
        pcg(matmul, torch.ones(5, dtype=torch.float64))


def test_pcg_raises_on_a_non_finite_preconditioner():
    A = torch.diag(torch.arange(1.0, 6.0, dtype=torch.float64))
    with pytest.raises(NonFiniteError):
        pcg(lambda V: A @ V, torch.ones(5, dtype=torch.float64), lambda R: R * float("inf"))


@pytest.mark.parametrize("mean", ["constant", "linear"])
def test_a_non_finite_mean_raises_naming_the_mean(mean):
    """A NaN in the mean module's parameters: ``NonFiniteError`` that names the prior mean and the hyperparameters
    (before, PCG's "B contains NaN or inf")."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(80, 2, dtype=torch.float64, generator=g)
    y = torch.sin(4 * X[:, 0])
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    if mean == "linear":
        model.mean_module = gpytorch.means.LinearMean(2).double()
    with torch.no_grad():
        next(model.mean_module.parameters()).fill_(float("nan"))
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    settings = gpnys.EstimatorSettings(solver="iterative")
    with pytest.raises(NonFiniteError, match="prior mean"), gpnys.use_preconditioner(model, settings=settings):
        mll(model(X), y)


def _noise_model(n, noise, dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = torch.sin(5 * X[:, 0]) + X[:, 1] + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    likelihood = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-10))
    model = ExactGPModel(X.to(dtype), y.to(dtype), likelihood, kernel="rbf").to(dtype)
    model.likelihood.noise = noise
    model.covar_module.base_kernel.lengthscale = 0.3
    return model, X.to(dtype), y.to(dtype)


def test_a_kernel_matrix_that_is_not_numerically_positive_definite_raises_not_psd():
    """float32 at a noise of 1e-8 (the true loss is 2.0e5 per point): CG's first step finds pᵀK̂p <= 0 on some probes,
    and the evaluation raises linear_operator's NotPSDError naming the dtype and the hyperparameters (BoTorch's fit
    restarts on it), not a NonFiniteError from the probes' inf log-determinant terms."""
    from linear_operator.utils.errors import NotPSDError

    model, X, y = _noise_model(100, 1e-8, torch.float32)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    settings = gpnys.EstimatorSettings(solver="iterative", probe_seed=0)
    with pytest.raises(NotPSDError, match=r"not numerically positive definite in float32.*noise="):
        with gpnys.use_preconditioner(model, settings=settings):
            (-mll(model(X), y)).backward()


@pytest.mark.parametrize("cap, warned, method", [(2, True, "nystrom"), (1000, False, "nystrom"), (8, False, "auto")])
def test_cg_cut_at_its_iteration_cap_warns(dtype, cap, warned, method):
    """A solve cut at max_cg_iterations far above cg_tolerance: its bias is not bounded by the error bars (a noise
    gradient came out 400 standard errors off after 2 iterations), and one warning says so. Columns held at the cap
    by the Lanczos floor alone (``lanczos_share=None``), their tolerance met, do not warn."""
    import warnings

    model, X, y = _noise_model(600, 1e-3, dtype)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    settings = gpnys.EstimatorSettings(solver="iterative", probe_seed=0, max_cg_iterations=cap, lanczos_share=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gpnys.use_preconditioner(model, method, settings=settings, **({"rank": 20} if method == "nystrom" else {})):
            (-mll(model(X), y)).backward()
    cut = [w for w in seen if "CG stopped at max_cg_iterations" in str(w.message)]
    assert len(cut) == (1 if warned else 0), [str(w.message) for w in seen]


@pytest.mark.parametrize("dtype, noise, jittered", [(torch.float32, 1e-8, True), (torch.float64, 1e-2, False)])
def test_a_jittered_cholesky_is_not_reported_exact(dtype, noise, jittered):
    """float32 at a noise of 1e-8 on the Cholesky path: GPyTorch adds jitter and returns the jittered matrix's loss
    (401 per point against 3.0e5). The estimate had reported it exact (standard error 0); its standard errors are
    now NaN (unknown, so the stop test never takes the gradient for noise), with one gpnys warning. An unjittered
    factorisation stays exact."""
    import math
    import warnings

    model, X, y = _noise_model(200, noise, dtype)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module="linear_operator")  # a caller's own filter on GPyTorch's warnings
        with gpnys.use_preconditioner(model, settings=gpnys.EstimatorSettings(solver="cholesky")) as hook:
            (-mll(model(X), y)).backward()
    est = hook.last_estimate
    ours = [w for w in seen if "Cholesky path needed GPyTorch's jitter" in str(w.message)]
    assert est.path == "cholesky" and len(ours) == (1 if jittered else 0) and len(seen) == len(ours), seen
    assert math.isnan(est.std_error) == jittered and (est.std_error == 0.0) != jittered
    assert all(bool(se.isnan().all()) == jittered for se in est.grad_std_error.values())
    assert not gpnys.gp.estimator.gradient_at_noise(model, est)
