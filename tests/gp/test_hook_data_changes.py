"""The hook's caches follow the model's training data: ``set_train_data`` with the same n or a new n, in-place edits
of the training tensors and a move to another dtype start the preconditioner, point and kernel caches afresh, so
every loss matches Cholesky on the data the model holds at that call."""

from __future__ import annotations

import gpytorch
import pytest
import torch

import gpnys
from gpnys.gp import ExactGPModel
from helpers import cholesky_loss


@pytest.fixture(autouse=True)
def _seeded_probes():
    """The probes come from torch's global generator: the same draw whatever tests ran before."""
    torch.manual_seed(0)


def _data(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)




def _check(est, model, X, y, loss, rounding):
    assert est.n == X.shape[0]
    exact = cholesky_loss(model, X, y)
    assert abs(loss - exact) <= 5 * est.std_error / est.n + rounding, (loss, exact, est)


def test_set_train_data_same_and_new_n_within_one_hook(dtype):
    rounding = 1e-8 if dtype == torch.float64 else 2e-4
    X, y = _data(300, 0, dtype)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).to(dtype)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    losses = []
    with gpnys.use_preconditioner(model) as hook:
        for n, seed in [(300, 0), (300, 1), (200, 2), (400, 3)]:
            X, y = _data(n, seed, dtype)
            model.set_train_data(X, y, strict=False)
            loss = -mll(model(X), y)
            loss.backward()
            losses.append((X, y, float(loss.detach()), hook.last_estimate))
            assert hook.cache.X.shape[0] == n
            assert hook.last_estimate.cg_iterations < 50
    for X, y, loss, est in losses:
        _check(est, model, X, y, loss, rounding)
    assert hook.builds >= 4  # one preconditioner per data set


def test_in_place_edit_of_training_targets_and_inputs():
    X, y = _data(250, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpnys.use_preconditioner(model) as hook:
        float(-mll(model(X), y))
        builds = hook.builds
        with torch.no_grad():
            model.train_inputs[0].mul_(0.5)  # the same tensors, new values
            model.train_targets.add_(1.0)
        X2, y2 = model.train_inputs[0].clone(), model.train_targets.clone()
        loss = float(-mll(model(model.train_inputs[0]), model.train_targets))
        assert hook.builds == builds + 1
        _check(hook.last_estimate, model, X2, y2, loss, 1e-8)


def test_same_data_keeps_the_caches():
    X, y = _data(250, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpnys.use_preconditioner(model) as hook:
        float(-mll(model(X), y))
        cache = hook.cache
        second = float(-mll(model(X), y))
        assert hook.cache is cache and hook.builds == 1
        _check(hook.last_estimate, model, X, y, second, 1e-8)


def test_new_data_is_validated():
    X, y = _data(100, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpnys.use_preconditioner(model):
        X2, y2 = _data(100, 1)
        y2[3] = float("nan")
        model.set_train_data(X2, y2, strict=False)
        with pytest.raises(ValueError, match="train_targets"):
            mll(model(X2), y2)


def _move_within_one_hook(device, dtype_after):
    X, y = _data(200, 0, torch.float32)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood())
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpnys.use_preconditioner(model) as hook:
        float(-mll(model(X), y).detach())
        model.to(device=device, dtype=dtype_after)  # ExactGP moves its training data too
        X2, y2 = model.train_inputs[0], model.train_targets
        loss = float(-mll(model(X2), y2).detach())
        assert hook.train_x.device == X2.device and hook.train_x.dtype == dtype_after
        _check(hook.last_estimate, model, X2, y2, loss, 1e-6)


def test_dtype_move_within_one_hook():
    _move_within_one_hook("cpu", torch.float64)


@pytest.mark.cuda
def test_device_move_within_one_hook(cuda_device):
    _move_within_one_hook(cuda_device, torch.float64)


def _loss(model, X, y):
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.train()
    loss = -mll(model(X), y)
    loss.backward()
    return float(loss.detach())


@pytest.mark.parametrize("dense_limit_bytes", [None, 0])
def test_kernel_family_changes_within_one_hook(dense_limit_bytes):
    """A new kernel object (Matérn-3/2 -> RBF) or ``nu`` changed in place: the dense kernel and the
    preconditioner are not served from the old kernel's caches (the RBF loss came out as the Matérn one's)."""
    X, y = _data(300, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").double()
    model.covar_module.base_kernel.lengthscale = 0.3
    with gpnys.memory_budget(dense_bytes=dense_limit_bytes), gpnys.use_preconditioner(model, "afn") as hook:
        for change in ("none", "rbf", "nu"):
            if change == "rbf":
                ls = model.covar_module.base_kernel.lengthscale.detach()
                model.covar_module.base_kernel = gpytorch.kernels.RBFKernel().double()
                model.covar_module.base_kernel.lengthscale = ls
            elif change == "nu":
                model.covar_module.base_kernel = gpytorch.kernels.MaternKernel(nu=1.5).double()
                model.covar_module.base_kernel.lengthscale = 0.3
                _loss(model, X, y)
                model.covar_module.base_kernel.nu = 2.5
            loss = _loss(model, X, y)
            _check(hook.last_estimate, model, X, y, loss, 1e-8)


def test_active_dims_kernel_follows_nu_and_columns():
    """A kernel with ``active_dims``: a new ``nu`` reaches the hook (the selected-columns view is kept up to date),
    and other columns get a preconditioner built on them."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(300, 3, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + X[:, 2] + 0.1 * torch.randn(300, generator=g, dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, active_dims=[0, 1]))
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel=kernel).double()
    model.covar_module.base_kernel.lengthscale = 0.3
    for nu in (1.5, 2.5, 0.5):
        model.covar_module.base_kernel.nu = nu
        with gpnys.use_preconditioner(model, "afn") as hook:
            loss = _loss(model, X, y)
            _check(hook.last_estimate, model, X, y, loss, 1e-8)
    with gpnys.use_preconditioner(model, "afn") as hook:
        _loss(model, X, y)
        iterations = hook.last_estimate.cg_iterations
        for dims in ([1, 2], [0, 1]):
            model.covar_module.active_dims = model.covar_module.base_kernel.active_dims = torch.tensor(dims)
            loss = _loss(model, X, y)
            _check(hook.last_estimate, model, X, y, loss, 1e-8)
            assert hook.last_estimate.cg_iterations <= 3 * max(iterations, 5)


def test_predict_after_set_train_data():
    """``hook.predict`` right after ``set_train_data`` (no loss evaluated on the new data) predicts from the new
    data: a new n raised, the same n ran PCG with the old points' preconditioner to its iteration limit."""
    from gpnys.gp.training import predict

    X, y = _data(300, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    T = _data(40, 9)[0]
    settings = gpnys.EstimatorSettings(solver="iterative", variance_method="pcg")
    with gpnys.use_preconditioner(model, "afn", settings=settings) as hook:
        _loss(model, X, y)
        for n, seed in [(300, 1), (200, 2)]:
            X, y = _data(n, seed)
            model.set_train_data(X, y, strict=False)
            mean, var = hook.predict(T)
            mean_ref, var_ref = predict(model, T)
            assert float((mean - mean_ref).abs().max()) < 1e-6
            assert bool(((var - var_ref).abs() <= hook.variance_bound + 1e-12).all())
            assert hook.cache.X.shape[0] == n


def test_snapshot_copied_inside_the_context_is_its_own_model():
    """A deep copy taken inside the context (the best model so far) evaluates with its own hyperparameters, inside
    and after the context, and can be hooked itself; it went through this hook with the original's noise."""
    import copy
    import pickle

    X, y = _data(200, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    with gpnys.use_preconditioner(model):
        _loss(model, X, y)
        best = copy.deepcopy(model)
        model.likelihood.noise = 0.5
        inside = _loss(best, X, y)
    exact = cholesky_loss(best, X, y)
    assert abs(inside - exact) < 1e-6 and abs(_loss(best, X, y) - exact) < 1e-10
    assert abs(exact - cholesky_loss(model, X, y)) > 0.05  # the two models differ
    with gpnys.use_preconditioner(best) as hook:
        loss = _loss(best, X, y)
        _check(hook.last_estimate, best, X, y, loss, 1e-8)
    assert "marginal" not in vars(best.likelihood)
    assert abs(_loss(pickle.loads(pickle.dumps(best)), X, y) - exact) < 1e-10


@pytest.mark.parametrize("change", ["period_length", "alpha"])
def test_preconditioner_follows_every_kernel_hyperparameter(change):
    """A period or an RQ alpha changed, the length-scale not: the preconditioner is built anew (it was served as
    fresh, and the control variate then ran on a preconditioner of other hyperparameters)."""
    from gpnys.gp.preconditioners import PreconditionerCache
    from gpnys.precond.cache import PointCache

    X, _ = _data(200, 0)
    base = (gpytorch.kernels.PeriodicKernel() if change == "period_length" else gpytorch.kernels.RQKernel()).double()
    kernel = gpytorch.kernels.ScaleKernel(base).double()
    cache, points = PreconditionerCache("nystrom", {"rank": 20}), PointCache(X)
    noise = torch.tensor(0.01, dtype=torch.float64)
    P, _ = cache.get(points, kernel, noise)
    setattr(base, change, 2.5)
    Q, _ = cache.get(points, kernel, noise)
    assert Q is not P and len(cache.history) == 2 and not cache.stale


def test_cholesky_path_predictions_of_batched_multi_output_and_linear_models():
    """The Cholesky path's own moments apply to one output of an RBF / Matérn or any plain kernel; batched models,
    several outputs and kernels with their own GPyTorch prediction strategy get GPyTorch's prediction unchanged."""
    from botorch.models import SingleTaskGP

    from gpnys.gp.training import predict

    X, y = _data(60, 0)
    settings = gpnys.EstimatorSettings(solver="cholesky")
    linear = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    linear.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.LinearKernel()).double()
    two = SingleTaskGP(X, torch.stack([y, -y], -1))
    T = _data(5, 1)[0]
    for model, bounded in ((linear, True), (two, False)):
        with gpnys.use_preconditioner(model, settings=settings) as hook:
            mean, var = hook.predict(T)
        ref_mean, ref_var = predict(model, T)
        torch.testing.assert_close(mean, ref_mean.reshape(mean.shape))
        torch.testing.assert_close(var, ref_var.reshape(var.shape))
        assert (hook.variance_bound is not None) == bounded and (hook.mean_bound is not None) == bounded


def test_predict_after_the_kernel_module_is_replaced():
    """``model.covar_module = ...`` inside the context (isotropic Matérn-3/2 to an ARD one with outputscale 2): the
    next ``hook.predict`` reads the new kernel from the model, with no training step in between."""
    from gpnys.gp.training import predict

    X, y = _data(300, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").double()
    T = _data(20, 9)[0]
    settings = gpnys.EstimatorSettings(solver="iterative", variance_method="pcg")
    with gpnys.use_preconditioner(model, "afn", settings=settings, k=60, w=20) as hook:
        _loss(model, X, y)
        new = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=2)).double()
        new.base_kernel.lengthscale = torch.tensor([[0.2, 0.5]], dtype=torch.float64)
        new.outputscale = 2.0
        model.covar_module = new
        mean, var = hook.predict(T)
    mean_ref, var_ref = predict(model, T)
    assert float((mean - mean_ref).abs().max()) < 1e-6
    assert bool(((var - var_ref).abs() <= hook.variance_bound + 1e-12).all())


def test_replaced_known_noise_rebuilds_the_preconditioner():
    """Known per-point noise replaced by a new tensor of the same size (the old one freed, so its memory may be
    handed to the new one) or edited in place: each is a new preconditioner, and the loss matches Cholesky."""
    import gc

    X, y = _data(300, 0)
    g = torch.Generator().manual_seed(3)

    def noise():
        return 0.01 + 0.05 * torch.rand(300, generator=g, dtype=torch.float64)

    lik = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=noise()).double()
    model = ExactGPModel(X, y, lik).double()
    settings = gpnys.EstimatorSettings(solver="iterative")
    with gpnys.use_preconditioner(model, "afn", settings=settings, k=60, w=20) as hook:
        _loss(model, X, y)
        builds = hook.builds
        for change in ("replace", "replace", "in place"):
            if change == "replace":
                lik.noise = None  # the old tensor is freed before the new one is made
                gc.collect()
                lik.noise = noise()
            else:
                with torch.no_grad():
                    lik.noise.mul_(1.5)
            loss = _loss(model, X, y)
            assert hook.builds == builds + 1, change
            builds = hook.builds
            _check(hook.last_estimate, model, X, y, loss, 1e-8)


def test_warm_start_holds_one_column():
    """The solution kept for the next evaluation's start is a copy of one column (``(n,)``), not a view that keeps
    the whole block of probe solutions alive."""
    X, y = _data(300, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    with gpnys.use_preconditioner(model, "afn", settings=gpnys.EstimatorSettings(solver="iterative"), k=60) as hook:
        _loss(model, X, y)
        warm = hook.problem.warm_start
    assert warm.shape == (300,) and warm.is_contiguous()
    assert warm.untyped_storage().nbytes() == 300 * warm.element_size()


@pytest.mark.parametrize("warm_start", [False, True])
def test_probe_seed_estimate_and_the_evaluations_before(warm_start):
    """With ``probe_seed`` the estimate at the same hyperparameters is the same after a visit elsewhere: to rounding
    without a warm start; with one, within a small share of its error bars (settings.probe_seed)."""
    X, y = _data(300, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").double()
    kernel = model.covar_module.base_kernel
    settings = gpnys.EstimatorSettings(solver="iterative", probe_seed=0, warm_start=warm_start)
    with gpnys.use_preconditioner(model, "afn", settings=settings, k=60, w=20) as hook:
        first = _loss(model, X, y), hook.last_estimate
        raw = kernel.raw_lengthscale.detach().clone()
        with torch.no_grad():
            kernel.lengthscale = kernel.lengthscale * 1.5
        _loss(model, X, y)
        with torch.no_grad():
            kernel.raw_lengthscale.copy_(raw)
        again = _loss(model, X, y), hook.last_estimate
    if not warm_start:
        assert abs(again[0] - first[0]) <= 1e-13 * abs(first[0])
    else:
        assert abs(again[0] - first[0]) <= 0.1 * first[1].std_error / first[1].n


def test_reuse_without_error_bars_warns_and_rebuilds():
    """``reuse_tolerance`` needs the iteration counts of gpnys's own evaluations: with ``error_bars=False`` it is
    ignored with one warning, and each changed hyperparameter gets a new preconditioner."""
    with pytest.warns(gpnys.NumericalWarning, match="reuse_tolerance needs error_bars"):
        settings = gpnys.EstimatorSettings(solver="iterative", error_bars=False, reuse_tolerance=1.0)
    X, y = _data(300, 0)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    kernel = model.covar_module.base_kernel
    with gpnys.use_preconditioner(model, "afn", settings=settings, k=60) as hook:
        for _ in range(3):
            _loss(model, X, y)
            with torch.no_grad():
                kernel.lengthscale = kernel.lengthscale * 1.2
    assert hook.builds == 3
