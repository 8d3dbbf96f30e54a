"""The error bars cover float32 rounding: a float32 evaluation's loss is within 3 of its reported standard errors
of the float64 Cholesky loss, also where ``K̂`` is ill-conditioned and rounding, not the probes, dominates (there
``Estimate.rounding_dominates`` says so)."""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

import gpnys
from gpnys import datasets
from gpnys.gp import ExactGPModel
from gpnys.gp.settings import EstimatorSettings
from gpnys.precond.base import NumericalWarning
from helpers import cholesky_loss

CASES = [("concrete", 182, 2.0, 1e-3), ("concrete", 182, 0.5, 1e-2), ("concrete", 182, 1.0, 0.1),
         ("elevators", 300, 2.0, 1e-3), ("elevators", 300, 0.5, 1e-2), ("kin40k", 300, 0.5, 1e-2)]


def _model(name, n, ls, noise, dtype):
    ds = datasets.load(name, n=n, seed=0)
    X, y = ds.train_x.to(dtype), ds.train_y.to(dtype)
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-6))
    model = ExactGPModel(X, y, lik, kernel="matern32").to(dtype)
    model.covar_module.base_kernel.lengthscale = ls
    model.likelihood.noise = noise
    return model, X, y


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]:g}" for c in CASES])
def test_float32_loss_within_its_error_bar_of_float64_cholesky(case):
    name, n, ls, noise = case
    exact = cholesky_loss(*_model(name, n, ls, noise, torch.float64))
    model, X, y = _model(name, n, ls, noise, torch.float32)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    for seed in range(3):
        with warnings.catch_warnings(), gpnys.use_preconditioner(model, settings=EstimatorSettings(probe_seed=seed)) as h:
            warnings.simplefilter("ignore", NumericalWarning)
            loss = float(-mll(model(X), y).detach())
        est = h.last_estimate
        assert est.rounding_error > 0
        assert abs(loss - exact) <= 3 * est.std_error / n, (loss, exact, est.std_error / n, est.rounding_error / n)


def test_rounding_dominates_where_the_kernel_is_ill_conditioned():
    model, X, y = _model("concrete", 182, 2.0, 1e-3, torch.float32)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with warnings.catch_warnings(), gpnys.use_preconditioner(model) as hook:
        warnings.simplefilter("ignore", NumericalWarning)
        mll(model(X), y)
    assert hook.last_estimate.rounding_dominates


def test_float64_has_no_rounding_term():
    model, X, y = _model("elevators", 300, 0.5, 1e-2, torch.float64)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpnys.use_preconditioner(model) as hook:
        mll(model(X), y)
    assert hook.last_estimate.rounding_error == 0.0 and not hook.last_estimate.rounding_dominates
