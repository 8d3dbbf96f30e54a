"""Batch-mode single-task models (inputs ``(b, n, d)``, targets ``(b, n)``, BoTorch's multi-output
``SingleTaskGP``) are accelerated: one preconditioner and one estimate per batch element. Each element's loss and
every parameter's gradient match GPyTorch's Cholesky path within the hook's own standard errors."""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

import gpnys
from gpnys.checks import NumericalWarning
from gpnys.gp.settings import EstimatorSettings

B, N = 3, 120


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(B, N, 2, generator=g, dtype=torch.float64)
    y = torch.sin(5 * X[..., 0]) + X[..., 1] + 0.1 * torch.randn(B, N, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def _kernel(name):
    batch = torch.Size([B])
    base = {"rbf": lambda: gpytorch.kernels.RBFKernel(batch_shape=batch, ard_num_dims=2),
            "matern52": lambda: gpytorch.kernels.MaternKernel(nu=2.5, batch_shape=batch),
            "periodic": lambda: gpytorch.kernels.PeriodicKernel(batch_shape=batch)}[name]()
    return gpytorch.kernels.ScaleKernel(base, batch_shape=batch)


class BatchGP(gpytorch.models.ExactGP):
    def __init__(self, X, y, kernel="rbf"):
        super().__init__(X, y, gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([B])))
        self.mean = gpytorch.means.ConstantMean(batch_shape=torch.Size([B]))
        self.cov = _kernel(kernel)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))


def _model(kernel, dtype):
    X, y = _data(dtype)
    model = BatchGP(X, y, kernel).to(dtype)
    ls = model.cov.base_kernel.lengthscale
    model.cov.base_kernel.lengthscale = torch.tensor([0.2, 0.4, 0.8], dtype=dtype).reshape(B, 1, 1).expand_as(ls)
    model.likelihood.noise = torch.tensor([[0.01], [0.05], [0.1]], dtype=dtype)
    return model, X, y


def _loss_and_grads(model, X, y, hook_settings=None):
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.train()
    model.zero_grad()
    hook = None
    if hook_settings is None:
        with gpytorch.settings.max_cholesky_size(10**6):
            loss = -mll(model(X), y)
            loss.sum().backward()
    else:
        with warnings.catch_warnings(record=True) as caught, \
                gpnys.use_preconditioner(model, settings=hook_settings) as hook:
            warnings.simplefilter("always")
            loss = -mll(model(X), y)
            loss.sum().backward()
        assert not [w for w in caught if issubclass(w.category, NumericalWarning)], [str(w.message) for w in caught]
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, hook


@pytest.mark.parametrize("kernel", ["rbf", "matern52", "periodic"])
def test_batch_elements_match_cholesky(kernel, dtype):
    model, X, y = _model(kernel, dtype)
    exact_loss, exact, _ = _loss_and_grads(model, X, y)
    loss, got, hook = _loss_and_grads(model, X, y, EstimatorSettings(probe_seed=0))
    assert hook.passthrough is None and len(hook.elements) == B and len(hook.batch_estimates) == B
    assert all(element.builds == 1 for element in hook.elements)  # one preconditioner per element
    # float rounding and the solve with y, which stops at a relative residual (its error reaches the mean's gradient)
    rounding = 1e-5 if dtype == torch.float64 else 2e-3
    assert loss.shape == (B,)
    for i, est in enumerate(hook.batch_estimates):
        assert est.n == N
        assert abs(float(loss[i] - exact_loss[i])) <= 4 * est.std_error / N + rounding, (i, loss, exact_loss)
    total = hook.last_estimate
    assert total.n == B * N and total.value == pytest.approx(sum(e.value for e in hook.batch_estimates))
    scale = max(float(g.abs().max()) for g in exact.values())
    assert set(got) == set(exact)
    for name, g_exact in exact.items():
        se = total.grad_std_error[name].reshape(g_exact.shape) / N
        assert bool(((got[name] - g_exact).abs() <= 5 * se + rounding * scale + 1e-12).all()), (
            name, got[name], g_exact, se)


def test_same_probe_seed_same_result():
    model, X, y = _model("rbf", torch.float64)
    runs = [_loss_and_grads(model, X, y, EstimatorSettings(probe_seed=3))[:2] for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    for name in runs[0][1]:
        assert torch.equal(runs[0][1][name], runs[1][1][name]), name


def test_bad_element_is_named():
    model, X, y = _model("rbf", torch.float64)
    y = y.clone()
    y[1, 5] = float("nan")
    model.set_train_data(X, y, strict=False)
    with pytest.raises(ValueError, match="train_targets"):
        with gpnys.use_preconditioner(model):
            pass


def test_set_train_data_rebuilds_the_elements():
    model, X, y = _model("rbf", torch.float64)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    X2, y2 = _data(torch.float64, seed=1)
    with gpnys.use_preconditioner(model, settings=EstimatorSettings(probe_seed=0)) as hook:
        mll(model(X), y)
        first = hook.elements
        model.set_train_data(X2, y2, strict=False)
        loss = -mll(model(X2), y2)
    assert hook.elements is not first
    with gpytorch.settings.max_cholesky_size(10**6), torch.no_grad():
        exact = -mll(model(X2), y2)
    for i, est in enumerate(hook.batch_estimates):
        assert abs(float(loss[i].detach() - exact[i])) <= 4 * est.std_error / N + 1e-6


def test_botorch_multi_output_single_task_gp():
    pytest.importorskip("botorch")
    from botorch.models import SingleTaskGP

    g = torch.Generator().manual_seed(0)
    X = torch.rand(150, 3, generator=g, dtype=torch.float64)
    Y = torch.stack([torch.sin(6 * X[:, 0]), torch.cos(4 * X[:, 1])], -1)
    Y = Y + 0.05 * torch.randn(150, 2, generator=g, dtype=torch.float64)
    model = SingleTaskGP(X, Y)
    inputs, targets = model.train_inputs[0], model.train_targets
    assert inputs.dim() == 3  # BoTorch's batched outputs
    exact_loss, exact, _ = _loss_and_grads(model, inputs, targets)
    loss, got, hook = _loss_and_grads(model, inputs, targets, EstimatorSettings(probe_seed=0))
    assert len(hook.elements) == 2
    for i, est in enumerate(hook.batch_estimates):
        assert abs(float(loss[i] - exact_loss[i])) <= 4 * est.std_error / 150 + 1e-6
    se = hook.last_estimate.grad_std_error
    scale = max(float(g.abs().max()) for g in exact.values())
    for name, g_exact in exact.items():
        # as in test_batch_elements_match_cholesky: the solve with y's residual reaches the mean's gradient
        tol = 5 * se[name].reshape(g_exact.shape) / 150 + 1e-5 * scale
        assert bool(((got[name] - g_exact).abs() <= tol).all()), (name, got[name], g_exact)
