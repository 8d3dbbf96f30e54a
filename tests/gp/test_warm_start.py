"""Warm starts: the solve with ``y - m`` starts from the previous evaluation's solution. Along a training run
every step's loss stays within its error bar of Cholesky, the solve needs no more iterations than from zero, and
a change of the data drops the start."""

from __future__ import annotations

import gpytorch
import pytest
import torch

import gpnys
import gpnys.gp.estimator as estimator
from gpnys.gp import ExactGPModel
from gpnys.gp.settings import EstimatorSettings

N = 300
PCG = estimator.pcg  # the solver itself, whatever a test patches in its place


def _data(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 3, generator=g, dtype=torch.float64)
    y = torch.sin(5 * X[:, 0]) + X[:, 1] + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return X, y


def _run(warm, dtype=torch.float64, steps=6, monkeypatch=None):
    """Adam steps under the hook; per step the hook's loss, its standard error, the Cholesky loss at the same
    hyperparameters and the solve with y's iteration count."""
    X, y = _data()
    X, y = X.to(dtype), y.to(dtype)
    torch.manual_seed(0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").to(dtype)
    model.likelihood.noise = 0.05
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    iterations, rows = [], []
    monkeypatch.setattr(estimator, "pcg", lambda *a, **k: (lambda r: iterations.append(
        int(r.iterations_per_column[0])) or r)(PCG(*a, **k)))
    settings = EstimatorSettings(solver="iterative", warm_start=warm, probe_seed=0)
    with gpnys.use_preconditioner(model, "nystrom", settings=settings, rank=30) as hook:
        for _ in range(steps):
            with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6), \
                    gpytorch.settings.fast_computations(log_prob=False):
                model.train()
                exact = float(-mll(model(X), y))
            opt.zero_grad()
            loss = -mll(model(X), y)
            loss.backward()
            opt.step()
            est = hook.last_estimate
            rows.append((float(loss.detach()), est.std_error / N, exact))
    return rows, iterations


def test_warm_started_steps_stay_within_their_error_bars(monkeypatch, dtype):
    rows, iterations = _run(True, dtype, monkeypatch=monkeypatch)
    rounding = 0.0 if dtype == torch.float64 else 1e-5
    for loss, se, exact in rows:
        assert abs(loss - exact) <= 4 * se + rounding, (loss, exact, se)
    cold_rows, cold_iterations = _run(False, dtype, monkeypatch=monkeypatch)
    assert iterations[0] == cold_iterations[0]  # the first step has nothing to start from
    assert sum(iterations[1:]) < sum(cold_iterations[1:]), (iterations, cold_iterations)


def test_a_data_change_drops_the_start(monkeypatch):
    X, y = _data()
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    X2, y2 = _data(seed=1, n=N + 20)
    with gpnys.use_preconditioner(model, settings=EstimatorSettings(solver="iterative", probe_seed=0)) as hook:
        mll(model(X), y)
        assert hook.problem.warm_start is not None and hook.problem.warm_start.shape == (N,)
        model.set_train_data(X2, y2, strict=False)
        loss = -mll(model(X2), y2)
        assert hook.problem.warm_start.shape == (N + 20,)  # rebuilt on the new data, not started from the old
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6):
        exact = float(-mll(model(X2), y2))
    assert abs(float(loss.detach()) - exact) <= 4 * hook.last_estimate.std_error / (N + 20)


def test_same_seed_same_trajectory(monkeypatch):
    a, _ = _run(True, monkeypatch=monkeypatch, steps=3)
    b, _ = _run(True, monkeypatch=monkeypatch, steps=3)
    assert a == b
