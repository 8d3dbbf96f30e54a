"""Every learnable parameter gets the exact GP's gradient under the hook: feature extractors in ``forward``,
learnable input transforms (BoTorch's ``Warp``), learnable means, priors and the kernel's hyperparameters.

Each model's gradient, parameter by parameter, is compared with GPyTorch's Cholesky path at the same parameters,
within the hook's own standard errors (``hook.last_estimate.grad_std_error``) plus float rounding.
"""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

import gpnys
from gpnys.checks import NumericalWarning

N = 160


def _data(dtype, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(N, d, generator=g, dtype=torch.float64)
    y = torch.sin(5 * X[:, 0]) + X[:, 1] ** 2 + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


class FeatureGP(gpytorch.models.ExactGP):
    """Deep kernel learning: an MLP before an RBF kernel, a linear mean on the features."""

    def __init__(self, x, y):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.mean = gpytorch.means.LinearMean(2)
        self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

    def forward(self, x):
        z = self.net(x)
        return gpytorch.distributions.MultivariateNormal(self.mean(z), self.cov(z))


class ScaledInputGP(gpytorch.models.ExactGP):
    """A learnable per-dimension input scale inside ``forward``, a Matérn kernel and a length-scale prior."""

    def __init__(self, x, y):
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        self.scale = torch.nn.Parameter(torch.ones(x.shape[1], dtype=x.dtype))
        self.mean = gpytorch.means.ConstantMean()
        self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(
            nu=2.5, lengthscale_prior=gpytorch.priors.GammaPrior(3.0, 6.0)))

    def forward(self, x):
        z = x * self.scale
        return gpytorch.distributions.MultivariateNormal(self.mean(z), self.cov(z))


def _gradients(model, X, y, use_hook: bool):
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.train()
    model.zero_grad()
    hook = None
    if use_hook:
        with warnings.catch_warnings(record=True) as caught, gpnys.use_preconditioner(model) as hook:
            warnings.simplefilter("always")
            loss = -mll(model(X), y)
            loss.backward()
        assert sum(issubclass(w.category, NumericalWarning) and "carry gradients" in str(w.message)
                   for w in caught) == 1, [str(w.message) for w in caught]
    else:
        with gpytorch.settings.max_cholesky_size(10**6):
            loss = -mll(model(X), y)
            loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach()), grads, hook


def _check(model_cls, dtype, seed=0):
    X, y = _data(dtype, seed=seed)
    torch.manual_seed(seed)
    model = model_cls(X, y).to(dtype)
    exact_loss, exact, _ = _gradients(model, X, y, use_hook=False)
    loss, got, hook = _gradients(model, X, y, use_hook=True)
    est = hook.last_estimate
    # float rounding and the solve with y, which stops at a relative residual (its error reaches the mean's gradient)
    rounding = 1e-5 if dtype == torch.float64 else 2e-3
    scale = max(float(g.abs().max()) for g in exact.values())
    assert abs(loss - exact_loss) <= 4 * est.std_error / N + rounding
    assert set(got) == set(exact)
    for name, g_exact in exact.items():
        assert name in est.grad_std_error, f"{name}: no standard error"
        se = est.grad_std_error[name].reshape(g_exact.shape) / N
        assert bool(((got[name] - g_exact).abs() <= 5 * se + rounding * scale + 1e-12).all()), (
            name, got[name], g_exact, se)
        # not a gradient that happens to be zero: the parameters before the kernel move the loss
    moved = [name for name in exact if name.startswith(("net.", "scale")) and float(exact[name].abs().max()) > 1e-6]
    assert moved, "the test model's input parameters have no gradient to check"


@pytest.mark.parametrize("model_cls", [FeatureGP, ScaledInputGP])
def test_every_parameter_matches_cholesky(model_cls, dtype):
    _check(model_cls, dtype)


def test_same_seed_same_gradient():
    X, y = _data(torch.float64)
    out = []
    for _ in range(2):
        torch.manual_seed(1)
        model = FeatureGP(X, y).double()
        out.append(_gradients(model, X, y, use_hook=True)[1])
    for name in out[0]:
        assert torch.equal(out[0][name], out[1][name]), name


def test_botorch_warp_input_transform_gets_its_gradient():
    pytest.importorskip("botorch")
    from botorch.models import SingleTaskGP
    from botorch.models.transforms.input import Warp

    from gpnys.bo import PreconditionedSingleTaskGP

    X, y = _data(torch.float64)
    Y = y[:, None]

    def build(cls, **kw):
        torch.manual_seed(0)
        warp = Warp(d=3, indices=[0, 1])
        return cls(X, Y, input_transform=warp, **kw)

    ref = build(SingleTaskGP)
    model = build(PreconditionedSingleTaskGP, max_cholesky_size=0)
    model.load_state_dict(ref.state_dict())
    for m in (ref, model):
        m.train()
        m.zero_grad()
    with gpytorch.settings.max_cholesky_size(10**6):
        (-gpytorch.mlls.ExactMarginalLogLikelihood(ref.likelihood, ref)(ref(*ref.train_inputs), ref.train_targets)
         ).backward()
    with warnings.catch_warnings(), model.preconditioned() as hook:  # what fit_gpytorch_mll enters
        warnings.simplefilter("ignore", NumericalWarning)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        (-mll(model(*model.train_inputs), model.train_targets)).backward()
    assert hook is not None
    se = hook.last_estimate.grad_std_error
    # the solve with y stops at BoTorch's looser CG tolerance: its error reaches the mean's gradient
    floor = 1e-3 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    for name, p in ref.named_parameters():
        if not p.requires_grad:
            continue
        q = dict(model.named_parameters())[name]
        assert q.grad is not None, f"{name}: no gradient"
        tol = (5 * se[name].reshape(p.shape) / N if name in se else 0) + floor
        assert bool(((q.grad - p.grad).abs() <= tol).all()), (name, q.grad, p.grad)
    warp_grads = [p.grad for name, p in ref.named_parameters() if "input_transform" in name]
    assert warp_grads and max(float(g.abs().max()) for g in warp_grads) > 1e-6


def test_periodic_kernel_period_length_gradient_within_its_error_bar():
    """The periodic kernel runs through GPyTorch's kernel tensor: the period length's derivative is kept, and its
    gradient is within its own error bar of Cholesky for every probe seed (the bar is not merely wide: the
    mean |z| stays below 2)."""
    from gpnys.gp.settings import EstimatorSettings

    g = torch.Generator().manual_seed(0)
    X = torch.rand(N, 1, generator=g, dtype=torch.float64) * 4
    y = torch.sin(3 * X[:, 0]) + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)

    class Periodic(gpytorch.models.ExactGP):
        def __init__(self):
            super().__init__(X, y, gpytorch.likelihoods.GaussianLikelihood())
            self.mean = gpytorch.means.ConstantMean()
            self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(x))

    model = Periodic().double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpytorch.settings.max_cholesky_size(10**6):
        (-mll(model(X), y)).backward()
    name = "cov.base_kernel.raw_period_length"
    exact = dict(model.named_parameters())[name].grad.clone()
    assert float(exact.abs().max()) > 1e-4
    zs = []
    for seed in range(4):
        model.zero_grad()
        with gpnys.use_preconditioner(model, settings=EstimatorSettings(probe_seed=seed)) as hook:
            (-mll(model(X), y)).backward()
        got = dict(model.named_parameters())[name].grad
        se = hook.last_estimate.grad_std_error[name].reshape(exact.shape) / N
        zs.append(float(((got - exact) / se).abs().max()))
    assert max(zs) < 5 and sum(zs) / len(zs) < 2, zs
