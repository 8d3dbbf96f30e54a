"""Models the hook cannot accelerate pass through: GPyTorch's own computation runs unchanged (the same loss and
gradients as without the hook, bit for bit), with one warning that says why, and nothing raises.

Each class of model of docs/compatibility.md's pass-through table is here: two batch dimensions, multitask models
(Kronecker, Hadamard with a task index in ``forward``, independent outputs), structured and approximate kernels
(KISS-GP grid interpolation, SGPR inducing points, product structure, random Fourier features) and a covariance
made of two kernel calls."""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

import gpnys
from gpnys import use_preconditioner
from gpnys.checks import NumericalWarning
from gpnys.gp import ExactGPModel
from gpnys.gp.settings import EstimatorSettings

N = 60


def _x(d=2, seed=0):
    return torch.rand(N, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _mvn(mean, cov):
    return gpytorch.distributions.MultivariateNormal(mean, cov)


class TwoBatchDimsGP(gpytorch.models.ExactGP):
    """Inputs ``(2, 2, n, d)``: two batch dimensions (one batch dimension is accelerated, test_batch_mode.py)."""

    def __init__(self):
        batch = torch.Size([2, 2])
        x = _x().expand(*batch, N, 2)
        y = torch.sin(4 * x[..., 0]) + torch.arange(4, dtype=x.dtype).reshape(2, 2, 1)
        super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood(batch_shape=batch))
        self.mean = gpytorch.means.ConstantMean(batch_shape=batch)
        self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch)

    def forward(self, x):
        return _mvn(self.mean(x), self.cov(x))


class KroneckerMultitaskGP(gpytorch.models.ExactGP):
    def __init__(self):
        x = _x()
        y = torch.stack([torch.sin(4 * x[:, 0]), torch.cos(4 * x[:, 1])], -1)
        super().__init__(x, y, gpytorch.likelihoods.MultitaskGaussianLikelihood(num_tasks=2))
        self.mean = gpytorch.means.MultitaskMean(gpytorch.means.ConstantMean(), num_tasks=2)
        self.cov = gpytorch.kernels.MultitaskKernel(gpytorch.kernels.RBFKernel(), num_tasks=2, rank=1)

    def forward(self, x):
        return gpytorch.distributions.MultitaskMultivariateNormal(self.mean(x), self.cov(x))


class HadamardGP(gpytorch.models.ExactGP):
    def __init__(self):
        x = _x()
        i = (torch.arange(N) % 2)[:, None]
        super().__init__((x, i), torch.sin(4 * x[:, 0]) + i[:, 0], gpytorch.likelihoods.GaussianLikelihood())
        self.mean = gpytorch.means.ConstantMean()
        self.cov = gpytorch.kernels.RBFKernel()
        self.task = gpytorch.kernels.IndexKernel(num_tasks=2, rank=1)

    def forward(self, x, i):
        return _mvn(self.mean(x), self.cov(x).mul(self.task(i)))


def _single(kernel_fn, d=2):
    class Single(gpytorch.models.ExactGP):
        def __init__(self):
            x = _x(d)
            super().__init__(x, torch.sin(4 * x[:, 0]), gpytorch.likelihoods.GaussianLikelihood())
            self.mean = gpytorch.means.ConstantMean()
            self.cov = kernel_fn(x)

        def forward(self, x):
            return _mvn(self.mean(x), self.cov(x))

    return Single


class TwoCallsGP(gpytorch.models.ExactGP):
    def __init__(self):
        x = _x()
        super().__init__(x, torch.sin(4 * x[:, 0]), gpytorch.likelihoods.GaussianLikelihood())
        self.k1, self.k2 = gpytorch.kernels.RBFKernel(), gpytorch.kernels.MaternKernel()

    def forward(self, x):
        return _mvn(torch.zeros_like(x[:, 0]), self.k1(x) + self.k2(x))


MODELS = {
    "two batch dimensions": TwoBatchDimsGP,
    "kronecker multitask": KroneckerMultitaskGP,
    "hadamard multitask": HadamardGP,
    "kiss-gp": _single(lambda x: gpytorch.kernels.ScaleKernel(gpytorch.kernels.GridInterpolationKernel(
        gpytorch.kernels.RBFKernel(), grid_size=16, num_dims=2))),
    "sgpr": _single(lambda x: gpytorch.kernels.InducingPointKernel(
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()), inducing_points=x[:10].clone(),
        likelihood=gpytorch.likelihoods.GaussianLikelihood())),
    "product structure": _single(lambda x: gpytorch.kernels.ProductStructureKernel(
        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()), num_dims=2)),
    "random fourier features": _single(lambda x: gpytorch.kernels.RFFKernel(num_samples=20)),
    "two kernel calls": TwoCallsGP,
}


def _loss_and_grads(model, hook: bool):
    torch.manual_seed(0)
    model.train()
    model.zero_grad()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    caught = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if hook:
            with gpnys.use_preconditioner(model) as h:
                out = model(*model.train_inputs)
                loss = -mll(out, model.train_targets).sum()
                loss.backward()
            assert h.passthrough is not None and h.builds == 0 and h.last_estimate is None
        else:
            out = model(*model.train_inputs)
            loss = -mll(out, model.train_targets).sum()
            loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    ours = [w for w in caught if issubclass(w.category, NumericalWarning) and "passes this model through" in str(w.message)]
    return float(loss.detach()), grads, ours


@pytest.mark.parametrize("name", list(MODELS))
def test_model_passes_through_unchanged_with_one_warning(name):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    loss0, grads0, warned0 = _loss_and_grads(model, hook=False)
    loss1, grads1, warned1 = _loss_and_grads(model, hook=True)
    assert not warned0 and len(warned1) == 1, [str(w.message) for w in warned1]
    assert loss1 == loss0
    assert grads1.keys() == grads0.keys() and grads0
    for k in grads0:
        assert torch.equal(grads1[k], grads0[k]), k


def test_a_model_that_passes_through_warns_once_per_hook():
    model = TwoCallsGP().double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpnys.use_preconditioner(model):
            for _ in range(3):
                (-mll(model(*model.train_inputs), model.train_targets)).backward()
    assert sum("passes this model through" in str(w.message) for w in caught) == 1


def test_bad_input_still_raises():
    """Pass-through is for models the hook cannot accelerate, not for bad data: NaN targets still raise."""
    model = _single(lambda x: gpytorch.kernels.RBFKernel())().double()
    y = model.train_targets.clone()
    y[0] = float("nan")
    model.set_train_data(model.train_inputs[0], y, strict=False)
    with pytest.raises(ValueError, match="train_targets"), gpnys.use_preconditioner(model):
        pass


@pytest.mark.parametrize("policy", ["mask"])  # ExactMarginalLogLikelihood supports only "mask"
def test_missing_targets_under_gpytorchs_nan_policy_pass_through(policy):
    """GPyTorch's missing-data support (``observation_nan_policy``): NaN targets are GPyTorch's to mask or fill, so
    the model passes through; without the policy they are still a ValueError (test_bad_input_still_raises)."""
    model = _single(lambda x: gpytorch.kernels.RBFKernel())().double()
    y = model.train_targets.clone()
    y[::7] = float("nan")
    model.set_train_data(model.train_inputs[0], y, strict=False)
    with gpytorch.settings.observation_nan_policy(policy):
        loss0, grads0, warned0 = _loss_and_grads(model, hook=False)
        loss1, grads1, warned1 = _loss_and_grads(model, hook=True)
    assert len(warned1) == 1 and "missing values" in str(warned1[0].message)
    assert loss1 == loss0
    for k in grads0:
        assert torch.equal(grads1[k], grads0[k]), k


@pytest.mark.parametrize("shape", [(N - 1,), (N + 5,), (N, 1), (N, 2)])
def test_targets_of_another_shape_raise_naming_them(shape):
    """A single-output likelihood with targets that are not one per training point: a ValueError naming
    ``train_targets`` (GPyTorch would fail later, or broadcast a loss of shape (n,)), not a pass-through."""
    model = _single(lambda x: gpytorch.kernels.RBFKernel())().double()
    y = torch.rand(*shape, dtype=torch.float64)
    model.set_train_data(model.train_inputs[0], y, strict=False)
    with pytest.raises(ValueError, match="train_targets must hold one target per training point") as err:
        with gpnys.use_preconditioner(model):
            pass
    assert f"got {tuple(shape)}" in str(err.value)


def test_other_models_inside_the_context_compute_as_their_caller_set_up():
    """The hook's GPyTorch settings (CG + SLQ, ``max_cholesky_size=0``) belong to the hooked model's marginals:
    a second model (a plain GPyTorch model, or one under a hook of its own with other settings) evaluated inside
    the context gives its own loss, gradients and predictions, bit for bit; before, it got GPyTorch's default CG at
    the hook's tolerance (0.54 for an exact 0.76 here). The hooked model still matches Cholesky."""
    from gpnys.gp import ExactGPModel
    from gpnys.gp.settings import EstimatorSettings

    def model(seed):
        x = _x(3, seed)
        return ExactGPModel(x, torch.sin(6 * x[:, 0]), gpytorch.likelihoods.GaussianLikelihood()).double()

    def loss_grads_pred(m):
        m.train()
        m.zero_grad()
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(m.likelihood, m)
        loss = -mll(m(*m.train_inputs), m.train_targets)
        loss.backward()
        m.eval()
        with torch.no_grad():
            pred = m.likelihood(m(_x(3, seed=9)[:5]))
        m.train()
        return (float(loss), [p.grad.clone() for p in m.parameters()], pred.mean, pred.variance)

    hooked, other, third = model(0), model(1), model(2)
    before = loss_grads_pred(other)
    with gpnys.use_preconditioner(hooked, settings=EstimatorSettings(probe_seed=0)) as hook:
        inside = loss_grads_pred(other)
        with gpnys.use_preconditioner(third, settings=EstimatorSettings(probe_seed=0, cg_tolerance=0.5)):
            nested = loss_grads_pred(other)
        ours = loss_grads_pred(hooked)
        se = hook.last_estimate.std_error / N  # of the loss per point
    for got in (inside, nested):
        assert got[0] == before[0]
        for a, b in zip(got[1:], before[1:]):
            for u, v in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                assert torch.equal(u, v)
    exact = loss_grads_pred(hooked)  # outside the hook: Cholesky at n = 60
    assert abs(ours[0] - exact[0]) <= 4 * se
    torch.testing.assert_close(ours[2], exact[2], rtol=1e-4, atol=1e-5)


def test_leave_one_out_runs_as_gpytorchs_own_with_a_warning():
    """``LeaveOneOutPseudoLikelihood`` factors the covariance itself: under the hook it gets GPyTorch's dense value and
    gradient, and says that the preconditioner does nothing for it."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(300, 2, generator=g, dtype=torch.float64)
    y = torch.sin(5 * X[:, 0])
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    model.train()
    loo = gpytorch.mlls.LeaveOneOutPseudoLikelihood(model.likelihood, model)
    with gpytorch.settings.max_cholesky_size(10**6):
        ref = loo(model(X), y)
        ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    with use_preconditioner(model, settings=EstimatorSettings(solver="iterative")):
        with pytest.warns(NumericalWarning, match="LeaveOneOutPseudoLikelihood"):
            value = loo(model(X), y)
        grads = torch.autograd.grad(value, list(model.parameters()))
    assert float(value) == pytest.approx(float(ref), rel=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
