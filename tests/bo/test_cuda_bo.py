"""BoTorch on a CUDA device: :class:`gpnys.bo.PreconditionedSingleTaskGP` against BoTorch's ``SingleTaskGP``.

The ``cuda`` suite's BoTorch part (the rest is ``tests/test_cuda.py``): conftest runs a module under BoTorch's global
GPyTorch settings only when the module sets ``USES_BOTORCH = True``, and that flag is module-wide, so these tests
live in their own module. ``max_cholesky_size=0`` forces the preconditioned path (as in ``tests/bo/test_bo.py``); the
model and its data live on ``cuda_device``, the reference ``SingleTaskGP`` (dense Cholesky) on float64 CPU copies
with the same hyperparameters (state dict).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("botorch")

from botorch.fit import fit_gpytorch_mll  # noqa: E402
from botorch.models import SingleTaskGP  # noqa: E402
from gpytorch.mlls import ExactMarginalLogLikelihood  # noqa: E402

from gpnys.bo import PreconditionedSingleTaskGP  # noqa: E402

USES_BOTORCH = True  # conftest: run under BoTorch's global GPyTorch settings
pytestmark = pytest.mark.cuda

F64 = torch.float64
CPU = torch.device("cpu")
N, D = 300, 4
PRECOND = {"k": 40, "w": 10, "posterior_cholesky_size": 0}  # k < n: an inexact preconditioner, so PCG iterates


def data(n=N, d=D, seed=0, noise_std=0.01):
    """Float64 CPU ``(X (n, d), Y (n, 1))``: a smooth function on the unit cube plus noise."""
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=F64)
    Y = (torch.sin(3.0 * X) + 0.5 * torch.cos(5.0 * X[:, :1] * X[:, 1:2])).sum(-1, keepdim=True)
    return X, Y + noise_std * torch.randn(n, 1, generator=g, dtype=F64)


def query_points(m=100, d=D, seed=1):
    return torch.rand(m, d, generator=torch.Generator().manual_seed(seed), dtype=F64)


def set_hypers(model, noise=1e-3, constant=0.1):
    dtype = model.train_inputs[0].dtype
    model.likelihood.noise = torch.tensor(noise, dtype=dtype)
    model.covar_module.lengthscale = torch.linspace(0.3, 0.7, D, dtype=dtype).reshape(1, D)
    model.mean_module.constant = torch.tensor(constant, dtype=dtype)
    return model


def reference(model, X, Y) -> SingleTaskGP:
    """``SingleTaskGP`` on the float64 CPU data ``X, Y`` with the model's state dict (hyperparameters and the
    outcome transform's statistics)."""
    ref = SingleTaskGP(X, Y)
    ref.load_state_dict({k: v.detach().to(CPU, F64) for k, v in model.state_dict().items()})
    return ref


def exact_mll(model) -> float:
    model.train()
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    with torch.no_grad():
        return float(mll(model(*model.train_inputs), model.train_targets))


def rel_error(actual, expected) -> float:
    actual, expected = actual.detach().to(CPU, F64), expected.detach().to(CPU, F64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(((actual - expected).abs() / expected.abs()).max())


def model_on(device, dtype, X, Y, **kwargs):
    options = {"max_cholesky_size": 0, "posterior_tolerance": 1e-8, **PRECOND, **kwargs}
    return PreconditionedSingleTaskGP(X.to(device, dtype), Y.to(device, dtype), **options)


def test_posterior_matches_single_task_gp_on_device(cuda_device):
    X, Y = data()
    ref = set_hypers(SingleTaskGP(X, Y))
    model = model_on(cuda_device, F64, X, Y)
    model.load_state_dict(ref.state_dict())  # copies into the device parameters and buffers
    assert model.uses_preconditioner()
    Xt = query_points()
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt.to(cuda_device))
    assert p.mean.device.type == p.variance.device.type == cuda_device.type
    assert p.mean.shape == p.variance.shape == (100, 1)
    assert model.posterior_iterations > 0  # PCG really iterated (k < n)
    hook = model.hook()
    assert hook.builds >= 1 and hook.train_x.device.type == cuda_device.type
    err_mean, err_var = rel_error(p.mean, p_ref.mean), rel_error(p.variance, p_ref.variance)
    assert err_mean < 1e-6 and err_var < 1e-6
    # a joint q-batch covariance (the variational form) against the dense one
    Xq = torch.rand(4, 3, D, generator=torch.Generator().manual_seed(2), dtype=F64)
    with torch.no_grad():
        c_ref = ref.posterior(Xq).distribution.covariance_matrix
        c = model.posterior(Xq.to(cuda_device)).distribution.covariance_matrix
    assert c.shape == c_ref.shape == (4, 3, 3) and c.device.type == cuda_device.type
    assert float((c.cpu() - c_ref).abs().max()) < 1e-8


def test_fit_on_device_and_posterior_at_the_fitted_hyperparameters(cuda_device):
    X, Y = data(seed=5, noise_std=0.05)
    model = model_on(cuda_device, F64, X, Y)
    start = exact_mll(reference(model, X, Y))
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    fit_gpytorch_mll(mll, optimizer_kwargs={"options": {"maxiter": 8}})
    hook = model.hook()
    assert hook.builds > 1 and hook.applications > 0  # the preconditioned CG path trained it
    ref = reference(model, X, Y)
    fitted = exact_mll(ref)
    assert fitted > start + 1e-2 * abs(start)  # the fit improved the exact MLL
    # the preconditioned MLL estimate (CG + SLQ on the device) against the exact one at the fitted values
    model.train()
    with model.preconditioned(), torch.no_grad():
        value = float(ExactMarginalLogLikelihood(model.likelihood, model)(model(*model.train_inputs),
                                                                         model.train_targets))
    assert abs(value - fitted) <= 1e-2 * abs(fitted)  # 16 probes, k = 40: measured 0.9e-3 to 2.2e-3 over 3 seeds
    model.eval()
    Xt = query_points(seed=3)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt.to(cuda_device))
    err_mean, err_var = rel_error(p.mean, p_ref.mean), rel_error(p.variance, p_ref.variance)
    assert err_mean < 1e-6 and err_var < 1e-6


def test_fantasy_model_on_device(cuda_device):
    """``fantasize`` on the device (PCG base, no (n + q) factorisation) against ``SingleTaskGP``'s on the CPU, with
    the knowledge gradient's value and gradient."""
    from botorch.acquisition import qKnowledgeGradient
    from botorch.sampling import SobolQMCNormalSampler

    X, Y = data()
    ref = set_hypers(SingleTaskGP(X, Y))
    model = model_on(cuda_device, F64, X, Y, posterior_tolerance=1e-10)
    model.load_state_dict(ref.state_dict())
    Xq = torch.rand(3, 2, D, generator=torch.Generator().manual_seed(4), dtype=F64)
    Xt = query_points(5, seed=5)
    sampler = lambda: SobolQMCNormalSampler(torch.Size([4]), seed=1)  # noqa: E731
    with torch.no_grad():
        p_ref = ref.fantasize(Xq, sampler()).posterior(Xt)
        p = model.fantasize(Xq.to(cuda_device), sampler()).posterior(Xt.to(cuda_device))
    assert p.mean.device.type == cuda_device.type and p.mean.shape == p_ref.mean.shape == (4, 3, 5, 1)
    assert rel_error(p.mean, p_ref.mean) < 1e-6 and rel_error(p.variance, p_ref.variance) < 1e-6
    X_kg = torch.rand(2, 1 + 4, D, generator=torch.Generator().manual_seed(6), dtype=F64)
    out = []
    for m, x in ((ref, X_kg.clone()), (model, X_kg.to(cuda_device))):
        x.requires_grad_(True)
        v = qKnowledgeGradient(m, sampler=sampler(), num_fantasies=None)(x)
        v.sum().backward()
        out.append((v.detach(), x.grad))
    assert rel_error(out[1][0], out[0][0]) < 1e-6
    assert float((out[1][1].cpu() - out[0][1]).abs().max() / out[0][1].abs().max()) < 1e-5


def test_multi_output_model_on_device(cuda_device):
    """Two outputs on the device: the training estimate (one preconditioner per output) within its error bars of
    the exact loss, and the PCG posterior per output against ``SingleTaskGP``'s on the CPU."""
    X, Y = data()
    Y2 = torch.cat([Y, torch.cos(4 * X).sum(-1, keepdim=True)], -1)
    ref = SingleTaskGP(X, Y2)
    ref.covar_module.lengthscale = torch.stack([torch.linspace(0.3, 0.7, D), torch.linspace(0.8, 0.4, D)])[:, None]
    ref.likelihood.noise = torch.tensor([[1e-3], [4e-3]], dtype=F64)
    model = model_on(cuda_device, F64, X, Y2, posterior_tolerance=1e-10)
    model.load_state_dict(ref.state_dict())
    model.train()
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    with model.preconditioned() as hook, torch.no_grad():
        value = float(mll(model(*model.train_inputs), model.train_targets).sum())
    assert len(hook.batch_estimates) == 2 and hook.problem.elements[0].train_x.device.type == cuda_device.type
    ref.train()
    with torch.no_grad():
        exact = float(ExactMarginalLogLikelihood(ref.likelihood, ref)(ref(*ref.train_inputs), ref.train_targets).sum())
    assert abs(value - exact) <= max(4 * hook.last_estimate.std_error / N, 1e-6), (value, exact)
    model.eval()
    ref.eval()
    Xt = query_points(50)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt.to(cuda_device))
    assert p.mean.device.type == cuda_device.type and p.mean.shape == (50, 2)
    assert all(m.posterior_iterations > 0 for m in model.output_models)
    assert rel_error(p.mean, p_ref.mean) < 1e-6 and rel_error(p.variance, p_ref.variance) < 1e-6
