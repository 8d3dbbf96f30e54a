"""Preconditioner reuse across training steps (``EstimatorSettings.reuse_tolerance``): a preconditioner built at
nearby hyperparameters serves the next steps without a rebuild; each reused step's loss and gradient stay within
their error bars of Cholesky (the control variate is dropped there, so the plain estimator is unbiased), a large
move or a rise in CG iterations rebuilds, and reuse off rebuilds at every change."""

from __future__ import annotations

import gpytorch
import pytest
import torch

import gpnys
from gpnys.gp import ExactGPModel
from gpnys.gp.preconditioners import PreconditionerCache
from gpnys.gp.settings import EstimatorSettings
from gpnys.precond.cache import PointCache

N = 300


def _model(dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(N, 3, generator=g, dtype=torch.float64).to(dtype)
    y = (torch.sin(5 * X[:, 0].double()) + X[:, 1].double()
         + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)).to(dtype)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").to(dtype)
    model.likelihood.noise = 0.05
    return model, X, y


def _cholesky(model, X, y):
    """``-MLL / n`` and its gradient by GPyTorch's Cholesky, per named parameter."""
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.zero_grad()
    with gpytorch.settings.max_cholesky_size(10**6), gpytorch.settings.fast_computations(log_prob=False):
        loss = -mll(model(X), y)
        loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return float(loss), grads


def _step(hook, model, X, y):
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.zero_grad()
    loss = -mll(model(X), y)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad()
    return float(loss.detach()), grads, hook.last_estimate


def test_nearby_hyperparameters_reuse_the_preconditioner_within_the_error_bars(dtype):
    model, X, y = _model(dtype)
    settings = EstimatorSettings(solver="iterative", reuse_tolerance=0.1, probe_seed=0, num_probes=32)
    rounding = 0.0 if dtype == torch.float64 else 2e-5
    with gpnys.use_preconditioner(model, "afn", settings=settings, k=40, w=10) as hook:
        _step(hook, model, X, y)
        assert hook.builds == 1 and not hook.preconditioners.stale
        cv = hook.control_variates
        with torch.no_grad():  # a training step's worth of movement: 3 % in the length-scale, 5 % in the noise
            model.covar_module.base_kernel.lengthscale = 1.03 * model.covar_module.base_kernel.lengthscale
            model.likelihood.noise = 1.05 * model.likelihood.noise
        loss, grads, est = _step(hook, model, X, y)
        assert hook.builds == 1 and hook.preconditioners.stale and hook.preconditioners.reuses == 1
        assert hook.control_variates == cv  # no control variate from a stale family
    exact, exact_grads = _cholesky(model, X, y)
    assert abs(loss - exact) <= 4 * est.std_error / N + rounding, (loss, exact, est.std_error / N)
    for name, g in grads.items():
        # the probes' part by its standard error; the solve with y - m (the mean's gradient) to its CG tolerance
        se = est.grad_std_error[name] / N
        slack = 1e-3 * float(exact_grads[name].abs().max()) + rounding
        assert torch.all((g - exact_grads[name]).abs() <= 4 * se + slack), (name, g, exact_grads[name], se)


def test_a_large_move_or_reuse_off_rebuilds(dtype):
    model, X, y = _model(dtype)
    for tol, scale, builds in ((0.1, 1.5, 2), (None, 1.01, 2), (0.1, 1.01, 1)):
        settings = EstimatorSettings(solver="iterative", reuse_tolerance=tol, probe_seed=0)
        model.covar_module.base_kernel.lengthscale = 0.5
        with gpnys.use_preconditioner(model, "afn", settings=settings, k=40, w=10) as hook:
            _step(hook, model, X, y)
            with torch.no_grad():
                model.covar_module.base_kernel.lengthscale = scale * model.covar_module.base_kernel.lengthscale
            _step(hook, model, X, y)
            assert hook.builds == builds, (tol, scale, hook.builds)


def test_rising_iterations_refresh_the_preconditioner():
    g = torch.Generator().manual_seed(1)
    X = torch.rand(200, 2, generator=g, dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    noise = torch.tensor(0.01, dtype=torch.float64)
    cache = PreconditionerCache("afn", {"k": 30, "w": 10}, reuse_tolerance=0.2, refresh_growth=1.5)
    points = PointCache(X)
    P, _ = cache.get(points, kernel, noise)
    cache.observe(10)
    kernel.base_kernel.lengthscale = 1.05 * kernel.base_kernel.lengthscale.detach()
    Q, s2 = cache.get(points, kernel, noise)
    assert Q is P and cache.stale and float(s2) == pytest.approx(float(kernel.outputscale))
    cache.observe(14)  # within 1.5x: kept
    kernel.base_kernel.lengthscale = 1.01 * kernel.base_kernel.lengthscale.detach()
    assert cache.get(points, kernel, noise)[0] is P
    cache.observe(16)  # above 1.5 x 10: the next request rebuilds
    R, _ = cache.get(points, kernel, noise)
    assert R is not P and not cache.stale and len(cache.history) == 2


def test_reuse_is_reproducible():
    runs = []
    for _ in range(2):
        model, X, y = _model(torch.float64)
        settings = EstimatorSettings(solver="iterative", reuse_tolerance=0.1, probe_seed=3)
        with gpnys.use_preconditioner(model, "afn", settings=settings, k=40, w=10) as hook:
            _step(hook, model, X, y)
            with torch.no_grad():
                model.likelihood.noise = 1.02 * model.likelihood.noise
            runs.append(_step(hook, model, X, y)[0])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("bad, name", [({"reuse_tolerance": -0.1}, "reuse_tolerance"),
                                       ({"refresh_growth": 0.5}, "refresh_growth")])
def test_bad_reuse_settings(bad, name):
    with pytest.raises(ValueError, match=name):
        EstimatorSettings(**bad)


def test_reused_steps_error_bars_cover_cholesky():
    """Over 16 probe seeds at a stale preconditioner, the loss lies within 2 standard errors of Cholesky about 95 %
    of the time: at least 12 (fewer happens with probability below 1e-3 if the bars are honest)."""
    model, X, y = _model(torch.float64)
    with torch.no_grad():
        model.covar_module.base_kernel.lengthscale = 0.4
    covered = 0
    for seed in range(16):
        settings = EstimatorSettings(solver="iterative", reuse_tolerance=0.2, probe_seed=seed, num_probes=8)
        with gpnys.use_preconditioner(model, "afn", settings=settings, k=30, w=10) as hook:
            with torch.no_grad():
                model.covar_module.base_kernel.lengthscale = 0.4
            _step(hook, model, X, y)
            with torch.no_grad():
                model.covar_module.base_kernel.lengthscale = 0.44
            loss, _, est = _step(hook, model, X, y)
            assert hook.preconditioners.stale and est.std_error > 0
        exact, _ = _cholesky(model, X, y)
        covered += abs(loss - exact) <= 2 * est.std_error / N
    assert covered >= 12, covered
