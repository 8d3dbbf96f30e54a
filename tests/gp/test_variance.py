"""Cached predictive variances with per-point error bounds (gpnys.gp.variance)."""

import copy
import warnings

import gpytorch
import numpy as np
import pytest
import torch

from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel, predict
from gpnys.gp.variance import LocalVariance
from gpnys.precond.afn import AFNPreconditioner


def _model(n=600, d=4, ard=True, dtype=torch.float64, noise=0.05, seed=0, kernel="matern32", fixed=False):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=torch.float64) * 4
    y = torch.sin(X).sum(1) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    if fixed:
        D = noise * (0.5 + torch.rand(n, generator=g, dtype=torch.float64))
        lik = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=D.to(dtype))
    else:
        lik = gpytorch.likelihoods.GaussianLikelihood()
    m = ExactGPModel(X.to(dtype), y.to(dtype), lik.to(dtype), kernel=kernel, ard=ard).to(dtype)
    m.covar_module.base_kernel.lengthscale = torch.linspace(0.8, 1.6, d) if ard else 1.2
    m.covar_module.outputscale = 0.7
    if not fixed:
        lik.noise = noise
    T = torch.rand(200, d, generator=g, dtype=torch.float64).to(dtype) * 4
    return m, T


def _exact_latent(m, T):
    """The latent posterior variance by a dense Cholesky (float64)."""
    m64 = copy.deepcopy(m).double()
    m64.set_train_data(m64.train_inputs[0].double(), m64.train_targets.double(), strict=False)
    mean, var = predict(m64, T.double())
    noise = m64.likelihood.noise.detach()
    return var - (noise if noise.numel() == 1 else 0.0)


def _cache(m, k=80, w=(30, 120), lam=None):
    X = m.train_inputs[0]
    s2 = m.covar_module.outputscale.detach()
    noise = m.likelihood.noise.detach()
    noise = noise[0] if noise.numel() == 1 else noise
    mu = float(noise.mean() / s2)
    P = AFNPreconditioner(X, m.covar_module.base_kernel, mu, k=k, w=20)
    if lam is None:  # the exact smallest eigenvalue of P̂⁻¹ K̂ (the hook estimates it by Lanczos)
        K = m.covar_module(X).to_dense().detach() + torch.diag(noise.expand(X.shape[0]))
        Pinv = P.solve(torch.eye(X.shape[0], dtype=X.dtype, device=X.device)) / s2
        lam = float(torch.linalg.eigvals(Pinv @ K).real.min())
    return LocalVariance(X, m.covar_module, noise, P.landmark_idx, lambda R: P.solve(R) / s2, lam, w)


@pytest.mark.parametrize("kernel,ard", [("matern32", True), ("rbf", False), ("matern52", True), ("matern12", False)])
def test_cached_variance_against_cholesky(kernel, ard, dtype):
    """The Galerkin variance is a rigorous upper bound; the estimate is within its bound at every point."""
    m, T = _model(kernel=kernel, ard=ard, dtype=dtype)
    ref = _exact_latent(m, T)
    est = _cache(m)(T)
    # the bound holds float32's rounding too: no slack beyond float64's
    assert bool((est.upper.double() >= ref - est.bound.double() - 1e-12).all())
    err = (est.variance.double() - ref).abs()
    assert bool((err <= est.bound.double() + 1e-12).all())
    rel = err / ref
    # measured medians (n = 600, d = 4, AFN k = 80, w = 30): 0.3 % (3/2), 0.8 % (5/2), 0.06 % (1/2), 5.2 % (RBF)
    assert float(rel.median()) < (0.1 if kernel == "rbf" else 0.02)
    assert est.variance.dtype == dtype and est.bound.shape == (200,)


def _hard_model(dtype, n=1500, seed=0):
    """Matérn-1/2, length-scale 0.2, noise 1e-3, inputs far from the origin: float32's distances lose near pairs."""
    g = torch.Generator().manual_seed(seed)
    X = 5 + torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    m = ExactGPModel(X.to(dtype), y.to(dtype), gpytorch.likelihoods.GaussianLikelihood(), kernel="matern12",
                     ard=False).to(dtype)
    m.covar_module.base_kernel.lengthscale, m.likelihood.noise = 0.2, 1e-3
    return m, (5 + torch.rand(200, 2, generator=g, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("solver,method", [("iterative", "cached"), ("cholesky", "auto")])
def test_float32_variances_within_their_bound(dtype, solver, method):
    """Every variance, cached or by GPyTorch's Cholesky path, is within its bound of the float64 Cholesky
    variance of the same (rounded) data, float32 rounding included; errors and bounds stay below 1e-3 of it."""
    m, T = _hard_model(dtype)
    ref = predict(copy.deepcopy(m).double(), T.double())[1]
    with use_preconditioner(m, "auto", settings=EstimatorSettings(solver=solver, variance_method=method)) as hook:
        _, var = hook.predict(T)
    assert hook.variance_method_used == ("cached" if solver == "iterative" else "cholesky")
    err = (var.double() - ref).abs()
    slack = 0.0 if dtype == torch.float32 else 1e-9  # the float64 reference's own rounding (GPyTorch's distances)
    assert bool((err <= hook.variance_bound.double() + slack * ref).all()), float((err / hook.variance_bound).max())
    assert float((err / ref).max()) < 1e-3
    exact64 = dtype == torch.float64 and solver == "cholesky"  # rounding alone
    assert float((hook.variance_bound.double() / ref).median()) < (1e-9 if exact64 else 1e-3)


def test_cached_variance_per_point_noise():
    m, T = _model(fixed=True)
    ref = _exact_latent(m, T)
    est = _cache(m)(T)
    assert bool((est.upper >= ref * (1 - 1e-9)).all())
    assert bool(((est.variance - ref).abs() <= est.bound + 1e-12).all())


def test_cached_variance_more_neighbours_is_more_accurate():
    m, T = _model(n=800)
    ref = _exact_latent(m, T)
    errs = [float(((_cache(m, w=w)(T).variance - ref).abs() / ref).median()) for w in ((5, 20), (40, 160))]
    assert errs[1] < errs[0]


def test_cached_variance_is_deterministic():
    m, T = _model()
    a, b = _cache(m, lam=0.5)(T), _cache(m, lam=0.5)(T)
    assert torch.equal(a.variance, b.variance) and torch.equal(a.bound, b.bound)


def test_cached_variance_bad_input():
    m, T = _model(n=200)
    X = m.train_inputs[0]
    noise = m.likelihood.noise.detach()[0]
    Z = torch.arange(20)
    M = lambda R: R  # noqa: E731
    with pytest.raises(ValueError, match="neighbours"):
        LocalVariance(X, m.covar_module, noise, Z, M, 0.5, (0, 10))
    with pytest.raises(ValueError, match="neighbours"):
        LocalVariance(X, m.covar_module, noise, Z, M, 0.5, (20, 10))
    with pytest.raises(ValueError, match="lambda_min"):
        LocalVariance(X, m.covar_module, noise, Z, M, 0.0)
    with pytest.raises(ValueError, match="kernel"):
        LocalVariance(X, gpytorch.kernels.ScaleKernel(gpytorch.kernels.LinearKernel()).double(), noise, Z, M, 0.5)
    for bad in ({"variance_method": "love"}, {"variance_rel_error": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EstimatorSettings(**bad)


def _hook_predict(m, T, **settings):
    with use_preconditioner(m, "afn", k=100, w=20, settings=EstimatorSettings(**settings)) as hook:
        mean, var = hook.predict(T)
    return hook, mean, var


def test_hook_cached_method_and_refinement():
    """hook.predict(variance_method="cached"): bounds cover the error; variance_rel_error recomputes the points
    whose bound is too wide by PCG, whose bound (||r||² / σ²) is rigorous."""
    m, T = _model(n=800)
    mean_ref, var_ref = predict(m, T)
    hook, mean, var = _hook_predict(m, T, variance_method="cached")
    assert hook.variance_method_used == "cached"
    assert float((mean - mean_ref).abs().max()) < 1e-5
    assert bool(((var - var_ref).abs() <= hook.variance_bound + 1e-10).all())
    coarse = hook.variance_bound.clone()
    hook, _, var2 = _hook_predict(m, T, variance_method="cached", variance_rel_error=1e-3, variance_tolerance=1e-8)
    latent = var_ref - m.likelihood.noise.detach()
    assert bool((hook.variance_bound <= 1e-3 * latent + 1e-12).all())
    assert float(((var2 - var_ref) / latent).abs().max()) < 1e-3
    assert float(hook.variance_bound.max()) < float(coarse.max())
    hook, _, _ = _hook_predict(m, T, variance_method="pcg")
    assert bool(((_hook_predict(m, T, variance_method="pcg")[2] - var_ref).abs() <= hook.variance_bound + 1e-9).all())


def test_auto_choice():
    """auto: the cached method where it costs under a tenth of the cheaper exact one (the demo's size), else exact."""
    from gpnys.gp.prediction import _choose

    def pick(n, m, dense=True):
        return _choose(n, m, 20, dense, LocalVariance.flops(n, 500, 18, m))

    assert pick(14940, 1659) == "cached"
    assert pick(3000, 1500) == "cholesky"
    assert pick(3000, 5, dense=False) == "pcg"
    assert pick(200000, 1000, dense=False) == "cached"
    m, T = _model(n=300)
    hook, _, _ = _hook_predict(m, T[:5], variance_method="auto")
    assert hook.variance_method_used in ("pcg", "cholesky")


@pytest.mark.cuda
def test_cached_variance_cuda(cuda_device):
    m, T = _model(n=400)
    ref = _exact_latent(m, T)
    m, T = m.to(cuda_device), T.to(cuda_device)
    est = _cache(m)(T)
    assert est.variance.device.type == torch.device(cuda_device).type
    assert bool(((est.variance.cpu() - ref).abs() <= est.bound.cpu() + 1e-10).all())


def _exact_mean(m, T):
    """The float64 predictive mean of ``m``'s hyperparameters from kernel entries by differences (GPyTorch's float64
    Matérn-1/2 entries are off by 1e-12 at near pairs)."""
    from gpnys.kernels.entries import difference_entries

    m64 = copy.deepcopy(m).double().eval()
    X, y, kernel = m64.train_inputs[0], m64.train_targets, m64.covar_module
    with torch.no_grad():
        K = difference_entries(kernel, X, X) + m64.likelihood.noise * torch.eye(X.shape[0], dtype=torch.float64)
        alpha = torch.linalg.solve(K, y - m64.mean_module(X))
        return m64.mean_module(T.double()) + difference_entries(kernel, X, T.double()).mT @ alpha


@pytest.mark.parametrize("solver", ["iterative", "cholesky"])
@pytest.mark.parametrize("hard", [True, False])
def test_predictive_means_within_their_estimated_bound(dtype, solver, hard):
    """``hook.mean_bound`` covers the mean's error against float64 at every point, and is within 100 times it."""
    m, T = _hard_model(dtype) if hard else _model(n=800, dtype=dtype)
    ref = _exact_mean(m, T)
    with use_preconditioner(m, "auto", settings=EstimatorSettings(solver=solver)) as hook:
        mean, _ = hook.predict(T, variance=False)
        bound = hook.mean_bound.double()
        assert torch.equal(mean, hook.predict(T)[0]) and torch.equal(hook.mean_bound.double(), bound)
    err = (mean.double() - ref).abs()
    # the float64 reference's own rounding (a dense solve with a condition number near 1e6): 1e-12
    slack = 0.0 if dtype == torch.float32 else 1e-12 * float(ref.abs().max())
    assert bool((err <= bound + slack).all()), float((err / bound).max())
    assert float(bound.max()) < 100 * float(err.max())


@pytest.mark.parametrize("method,options", [("auto", {}), ("nystrom", {"rank": 40})])
def test_mean_bound_holds_where_the_preconditioned_correction_points_elsewhere(method, options):
    """Matérn-3/2 ARD at noise 1e-3 (n = 800): the weights' error K̂⁻¹ρ estimated as P̂⁻¹ρ / λ̂ alone points elsewhere,
    and float64 means just outside the data were up to 43 times their estimate off (23 times with a rank-40 Nyström
    preconditioner). One refinement step and the estimate of what it leaves hold every point."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(800, 2, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + X[:, 1] ** 2 + 0.5 + 0.0316 * torch.randn(800, generator=g, dtype=torch.float64)
    m = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32", ard=True).double()
    m.likelihood.noise = 1e-3
    m.covar_module.base_kernel.lengthscale = torch.tensor([[0.3, 0.6]], dtype=torch.float64)
    T = torch.cat([torch.rand(100, 2, generator=g, dtype=torch.float64),
                   1 + 0.5 * torch.rand(50, 2, generator=g, dtype=torch.float64)])
    ref = _exact_mean(m, T)
    with use_preconditioner(m, method, settings=EstimatorSettings(solver="iterative"), **options) as hook:
        mean, _ = hook.predict(T, variance=False)
        bound = hook.mean_bound.double()
    err = (mean.double() - ref).abs()
    slack = 1e-12 * float(ref.abs().max())  # the reference's own rounding
    assert bool((err <= bound + slack).all()), float((err / bound).max())
    assert float(bound.max()) < 1e3 * float(err.max())


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="needs an extended-precision long double (x86)")
def test_exact_path_mean_bound_holds_the_rounding():
    """The exact path at noise 1e-6 (RBF, n = 800, float64): the residual recomputed in float64 is mostly rounding,
    and its image through the factor was exceeded 14 times by the means' error (about 1e-8) against an
    extended-precision reference. The products' rounding in random signs, mapped through the factor, holds it."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(800, 2, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + X[:, 1] ** 2 + 0.5 + 0.01 * torch.randn(800, generator=g, dtype=torch.float64)
    m = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="rbf", ard=False).double()
    m.likelihood.noise_covar.raw_noise_constraint.lower_bound.fill_(1e-8)
    m.likelihood.noise = 1e-6
    m.covar_module.base_kernel.lengthscale = 0.3
    T = torch.cat([torch.rand(100, 2, generator=g, dtype=torch.float64),
                   1 + 0.5 * torch.rand(50, 2, generator=g, dtype=torch.float64)])
    with use_preconditioner(m, "auto", settings=EstimatorSettings(solver="cholesky")) as hook:
        mean, _ = hook.predict(T, variance=False)
        bound = hook.mean_bound.double()

    # the reference: kernel entries in long double (differences), weights by iterative refinement of a float64 solve
    ld = np.longdouble
    ls, s2, c = (float(v) for v in (m.covar_module.base_kernel.lengthscale, m.covar_module.outputscale,
                                     m.mean_module.constant))

    def k(A, B):
        d = (A.numpy().astype(ld)[:, None, :] - B.numpy().astype(ld)[None, :, :]) / ld(ls)
        return ld(s2) * np.exp(-(d * d).sum(-1) / 2)

    K = k(X, X) + ld(float(m.likelihood.noise)) * np.eye(800, dtype=ld)
    r = y.numpy().astype(ld) - ld(c)
    alpha = np.zeros(800, dtype=ld)
    for _ in range(6):
        alpha += np.linalg.solve(K.astype(np.float64), (r - K @ alpha).astype(np.float64)).astype(ld)
    ref = torch.from_numpy((ld(c) + k(X, T).T @ alpha).astype(np.float64))
    err = (mean - ref).abs()
    assert bool((err <= bound + torch.finfo(torch.float64).eps * ref.abs()).all()), float((err / bound).max())


def test_float32_variances_stay_within_the_prior():
    """Float32 at noise 1e-5 (RBF, n = 800): PCG breaks down after a few iterations (with its warning), and the
    quadratic forms it gave made latent variances 4e4 times the prior's. A latent variance lies in ``[0, k(x, x)]``."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(800, 2, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + X[:, 1] ** 2 + 0.5 + 0.003 * torch.randn(800, generator=g, dtype=torch.float64)
    m = ExactGPModel(X.float(), y.float(), gpytorch.likelihoods.GaussianLikelihood(), kernel="rbf", ard=False).float()
    m.likelihood.noise_covar.raw_noise_constraint.lower_bound.fill_(1e-8)
    m.likelihood.noise = 1e-5
    m.covar_module.base_kernel.lengthscale = 0.3
    T = torch.rand(100, 2, generator=g, dtype=torch.float64).float()
    settings = EstimatorSettings(solver="iterative", variance_method="pcg")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PCG's own, which say it broke down
        with use_preconditioner(m, "auto", settings=settings) as hook:
            _, var = hook.predict(T)
    latent = var - m.likelihood.noise.detach()
    prior = m.covar_module(T, diag=True).detach()
    assert bool((latent >= -1e-6).all()) and bool((latent <= prior * (1 + 1e-6) + 1e-6).all())


def test_float32_pcg_variances_within_their_bound():
    """``variance_method="pcg"`` in float32 (Matérn-1/2, noise 1e-3, n = 800): the bound ``|ρ|² / min σ²`` reads a
    residual computed in float32, which does not show the products' rounding, and 81 of 100 variances inside the
    data were up to 40 times it off; with the weights' rounding (``rounding_error``) every one is within it."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(800, 2, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + X[:, 1] ** 2 + 0.5 + 0.0316 * torch.randn(800, generator=g, dtype=torch.float64)
    m = ExactGPModel(X.float(), y.float(), gpytorch.likelihoods.GaussianLikelihood(), kernel="matern12",
                     ard=False).float()
    m.likelihood.noise = 1e-3
    m.covar_module.base_kernel.lengthscale = 0.3
    T = torch.rand(100, 2, generator=g, dtype=torch.float64).float()
    ref = _exact_latent(m, T)
    with use_preconditioner(m, "auto", settings=EstimatorSettings(solver="iterative", variance_method="pcg")) as hook:
        _, var = hook.predict(T)
        bound = hook.variance_bound.double()
    err = (var.double() - m.likelihood.noise.detach().double() - ref).abs()
    slack = torch.finfo(torch.float32).eps * var.double().abs()  # one unit of the returned value's rounding
    assert bool((err <= bound + slack).all()), float((err / bound).max())


@pytest.mark.cuda
@pytest.mark.parametrize("solver,method", [("iterative", "cached"), ("cholesky", "auto")])
def test_float32_variances_within_their_bound_cuda(cuda_device, solver, method):
    m, T = _hard_model(torch.float32, n=800)
    ref = predict(copy.deepcopy(m).double(), T.double())[1]
    m, T = m.to(cuda_device), T.to(cuda_device)
    with use_preconditioner(m, "auto", settings=EstimatorSettings(solver=solver, variance_method=method)) as hook:
        _, var = hook.predict(T)
    assert var.device.type == torch.device(cuda_device).type
    assert bool(((var.cpu().double() - ref).abs() <= hook.variance_bound.cpu().double()).all())


def test_afn_schur_quad_matches_solve(dtype):
    """For r vanishing on the landmarks, r^T M^{-1} r = ||G r_2||^2 (the fast remainder of the cached method)."""
    m, _ = _model(n=300, dtype=dtype)
    X = m.train_inputs[0]
    P = AFNPreconditioner(X, m.covar_module.base_kernel, 0.1, k=40, w=10)
    R = torch.randn(300, 5, dtype=dtype, generator=torch.Generator().manual_seed(1))
    R[P.landmark_idx] = 0
    ref = (R * P.solve(R)).sum(0)
    assert torch.allclose(P.schur_quad(R[P.rest_idx]), ref, rtol=1e-10 if dtype == torch.float64 else 1e-4)


def test_cli_fit_variance_flags(capsys):
    import json

    from gpnys.cli.main import main

    argv = ["fit", "--data", "concrete", "--n", "200", "--iters", "2", "--k", "40", "--json"]
    assert main([*argv, "--variance-method", "cached"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["variance_method"] == "cached" and 0 < out["variance_rel_bound_median"] <= out["variance_rel_bound_max"]
    assert 0 < out["mean_bound_max"] < 1e-3 * out["test_rmse"]  # target units, like the RMSE
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--variance-rel-error", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--variance-rel-error" in err[0]
