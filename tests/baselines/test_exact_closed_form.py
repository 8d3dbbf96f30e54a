"""``gpnys.baselines.exact.cholesky_loss``: the exact -MLL/n with a closed-form gradient, against GPyTorch's Cholesky
path with autograd (real data, perturbed hyperparameters, every supported kernel, ARD, both means)."""

import gpytorch
import pytest
import torch

from gpnys import datasets
from gpnys.baselines.exact import cholesky_loss
from gpnys.gp.training import ExactGPModel, exact_settings, fit, hyperparameters

DS = datasets.load("concrete", n=300, seed=0)


def _model(kernel, ard, mean, dtype, seed=0):
    X, y = DS.train_x.to(dtype), DS.train_y.to(dtype)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(X)
    model = ExactGPModel(X, y, lik, kernel=kernel, ard=ard, mean=mean).to(X)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.train()


def _loss_and_grad(model, closed):
    if closed:
        loss = cholesky_loss(model)
    else:
        with exact_settings(model.train_targets.shape[0]):
            loss = -gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)(
                model(*model.train_inputs), model.train_targets)
    loss.backward()
    return float(loss), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kernel,ard,mean", [("rbf", False, "constant"), ("rbf", True, "zero"),
                                             ("matern12", False, "zero"), ("matern32", True, "constant"),
                                             ("matern52", True, "constant")])
def test_matches_gpytorch_cholesky(kernel, ard, mean, dtype):
    tol = {torch.float64: 1e-8, torch.float32: 1e-3}[dtype]  # Matérn-1/2 at duplicate points: 2e-9
    l0, g0 = _loss_and_grad(_model(kernel, ard, mean, dtype), closed=False)
    l1, g1 = _loss_and_grad(_model(kernel, ard, mean, dtype), closed=True)
    assert abs(l1 - l0) <= tol * abs(l0)
    assert float((g1 - g0).norm()) <= tol * float(g0.norm())


def test_fit_with_closed_form_matches_gpytorch_fit():
    runs = []
    for loss in (None, cholesky_loss):
        model = _model("matern32", True, "constant", torch.float64)
        res = fit(model, iters=5, lr=0.1, progress=False, loss=loss)
        runs.append((res.loss_trace, hyperparameters(model)))
    (t0, h0), (t1, h1) = runs
    assert t1 == pytest.approx(t0, rel=1e-9)
    assert h1["lengthscale"] == pytest.approx(h0["lengthscale"], rel=1e-8)
    assert h1["noise"] == pytest.approx(h0["noise"], rel=1e-8)


def test_rejects_unsupported_model():
    model = _model("rbf", False, "zero", torch.float64)
    model.covar_module = model.covar_module.base_kernel  # no ScaleKernel
    with pytest.raises(ValueError, match="ScaleKernel"):
        cholesky_loss(model)
