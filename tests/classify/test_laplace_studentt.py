"""``LaplaceGP(likelihood=StudentT(...))``, robust regression, against the dense Laplace approximation with the same
(Fisher-information) ``W``: the mode, log q, the predictions, and the gradient in the kernel's and the noise scale's
parameters against autograd through the dense Newton iteration; the likelihood's own derivatives against autograd
and numerical integration."""

from __future__ import annotations

import copy
import math
import re
import warnings

import gpytorch
import pytest
import torch
from scipy import integrate

from gpnys.baselines.laplace import dense_laplace
from gpnys.checks import NumericalWarning
from gpnys.classify import LaplaceGP
from gpnys.classify.likelihoods import StudentT

F64 = torch.float64


def data(n, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, dtype=F64, generator=g)
    y = torch.sin(5 * X[:, 0]) + X[:, 1] + 0.1 * torch.randn(n, dtype=F64, generator=g)
    y[::13] += 3.0  # outliers, where -∇∇ log p < 0
    return X.to(dtype), y.to(dtype)


def make_kernel(dtype=F64):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).to(dtype)
    k.base_kernel.lengthscale, k.outputscale = 0.3, 1.0
    return k


def reference(X, y, kernel, scale=0.2, df=4.0):
    lik = StudentT(df=df, scale=scale).to(F64, torch.device("cpu"))
    return dense_laplace(kernel(X.double()).to_dense(), y.double(), likelihood=lik), lik


def test_derivatives_match_autograd_and_fisher_information(dtype):
    lik = StudentT(df=3.0, scale=0.7).to(dtype, torch.device("cpu"))
    y = torch.tensor([0.0, 1.0, -2.0, 4.0], dtype=dtype)
    f = torch.tensor([0.3, 1.0, 0.5, -1.0], dtype=dtype, requires_grad=True)
    (g1,) = torch.autograd.grad(lik.log_prob(f, y), f)
    grad, W, third = lik.derivatives(f.detach(), y)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, g1, **tol)
    assert bool((third == 0).all())  # W does not depend on f
    # W is E[-d² log p / df²] under the likelihood itself (the observed curvature is negative for outliers)
    nu, s = 3.0, 0.7
    const = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi * s * s)

    def density(r):
        return math.exp(const - (nu + 1) / 2 * math.log1p(r * r / (nu * s * s)))

    def curvature(r):
        return (nu + 1) * (nu * s * s - r * r) / (nu * s * s + r * r) ** 2

    expected, _ = integrate.quad(lambda r: density(r) * curvature(r), -math.inf, math.inf)
    assert float(W[0].detach()) == pytest.approx(expected, rel=1e-5)
    assert curvature(4.0 - (-1.0)) < 0  # the outlier's observed information: B would not be SPD with it
    total, _ = integrate.quad(density, -math.inf, math.inf)
    assert total == pytest.approx(1.0, rel=1e-8)  # the normalising constant in log_prob


def test_mode_log_q_and_predictions_match_dense():
    X, y = data(220)
    kernel = make_kernel()
    gp = LaplaceGP(kernel, likelihood=StudentT(df=4.0, scale=0.2), precond_options={"k": 40}, num_probes=32)
    gp.fit(X, y)
    ref, _ = reference(X, y, kernel)
    assert (gp.f_hat_ - ref.f).abs().max() < 1e-6
    log_q = float(ref.log_q)
    assert abs(gp.log_marginal_likelihood_ - log_q) <= 4 * gp.mll_std_error_ + 1e-8 * abs(log_q)
    Xs = torch.rand(30, 2, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mean, var = ref.latent(kernel(X, Xs).to_dense(), kernel(Xs, diag=True))  # R&W eq. (3.21), (3.24)
    mu, s2 = gp.predict_latent(Xs)
    assert (mu - mean).abs().max() < 1e-5 and (s2 - var).abs().max() < 1e-5
    ym, yv = gp.predict(Xs)
    torch.testing.assert_close(ym, mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(yv, var + 0.2**2 * 4.0 / 2.0, rtol=1e-4, atol=1e-5)  # + σ² ν / (ν - 2)


def test_exact_preconditioner_gives_the_exact_log_q():
    X, y = data(80)
    kernel = make_kernel()
    gp = LaplaceGP(kernel, likelihood=StudentT(scale=0.2), method="nystrom", precond_options={"rank": 80}).fit(X, y)
    assert abs(gp.log_marginal_likelihood_ - float(reference(X, y, kernel)[0].log_q)) < 1e-8
    assert gp.mll_std_error_ < 1e-8


def test_gradient_in_the_kernel_and_the_scale_matches_autograd_through_dense_newton():
    X, y = data(200)
    kernel = make_kernel()
    gp = LaplaceGP(kernel, likelihood=StudentT(df=4.0, scale=0.2), precond_options={"k": 40}, num_probes=64)
    gp.fit(X, y)
    dense_kernel = copy.deepcopy(kernel)
    ref, lik = reference(X, y, dense_kernel)
    ref.log_q.backward()
    expected = {name: p.grad for name, p in dense_kernel.named_parameters()}
    expected["likelihood.raw_scale"] = lik.raw_scale.grad
    assert set(gp.mll_gradient_) == set(expected)
    for name, g in expected.items():
        got, se = gp.mll_gradient_[name], gp.mll_gradient_std_error_[name]
        assert bool(((got - g).abs() <= 4 * se + 1e-6 * g.abs()).all()), (name, got, g, se)


def test_fixed_scale_is_not_trained():
    X, y = data(60)
    lik = StudentT(scale=0.3, train_scale=False)
    gp = LaplaceGP(make_kernel(), likelihood=lik, precond_options={"k": 20}, num_probes=8, optimizer_steps=2).fit(X, y)
    assert "likelihood.raw_scale" not in gp.mll_gradient_ and float(lik.scale) == pytest.approx(0.3)


def test_training_raises_log_q_learns_the_scale_and_is_reproducible():
    X, y = data(200)
    runs = []
    for _ in range(2):
        kernel = make_kernel()
        lik = StudentT(df=4.0, scale=0.5)
        start = float(reference(X, y, kernel, scale=0.5)[0].log_q)
        gp = LaplaceGP(kernel, likelihood=lik, precond_options={"k": 40}, num_probes=16, optimizer_steps=15,
                       seed=1).fit(X, y)
        runs.append(gp)
    scale = float(runs[0].likelihood_.scale)  # the trained scale and kernel
    final = float(reference(X, y, runs[0].kernel_, scale=scale)[0].log_q)
    assert final > start + 20
    assert scale < 0.25  # towards the inliers' noise (0.1), not the outliers' spread
    assert abs(runs[0].log_marginal_likelihood_ - final) <= 4 * runs[0].mll_std_error_ + 1e-6 * abs(final)
    assert runs[0].log_marginal_likelihood_ == runs[1].log_marginal_likelihood_
    assert torch.equal(runs[0].f_hat_, runs[1].f_hat_)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fit_trains_a_copy_of_the_likelihood_and_refits_identically(dtype):
    X, y = data(100, dtype)
    lik = StudentT(df=4.0, scale=0.5)
    options = {"cg_tolerance": 1e-5, "newton_tol": 1e-5, "slq_tolerance": 1e-4} if dtype == torch.float32 else {}
    gp = LaplaceGP(make_kernel(dtype), likelihood=lik, precond_options={"k": 30}, num_probes=8, optimizer_steps=3,
                   **options)
    mean, var = gp.fit(X, y).predict(X[:20])
    assert float(lik.scale.detach()) == pytest.approx(0.5) and lik.raw_scale.dtype == torch.float32  # untouched
    assert float(gp.likelihood_.scale.detach()) < 0.5 and gp.likelihood_.raw_scale.dtype == dtype  # trained on the copy
    again = gp.fit(X, y).predict(X[:20])
    assert torch.equal(again[0], mean) and torch.equal(again[1], var)


def test_float32():
    X, y = data(200)
    gp = LaplaceGP(make_kernel(torch.float32), likelihood=StudentT(scale=0.2), precond_options={"k": 40},
                   cg_tolerance=1e-5, newton_tol=1e-5, slq_tolerance=1e-4).fit(X.float(), y.float())
    ref, _ = reference(X, y, make_kernel())
    assert gp.f_hat_.dtype == torch.float32 and gp.likelihood_.raw_scale.dtype == torch.float32
    assert (gp.f_hat_.double() - ref.f).abs().max() < 1e-3
    assert abs(gp.log_marginal_likelihood_ - float(ref.log_q)) <= 4 * gp.mll_std_error_ + 1e-5 * abs(float(ref.log_q))


@pytest.mark.parametrize("kwargs, match", [({"df": 0.0}, "df"), ({"df": float("nan")}, "df"),
                                           ({"scale": -1.0}, "scale"), ({"scale": 0.0}, "scale")])
def test_bad_parameters_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StudentT(**kwargs)


def test_bad_observations_name_y():
    with pytest.raises(ValueError, match=r"\by\b"):
        LaplaceGP(make_kernel(), likelihood="studentt").fit(torch.rand(4, 2, dtype=F64),
                                                            torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=F64))


@pytest.mark.cuda
def test_student_t_on_the_cuda_device(cuda_device):
    X, y = data(200)
    kernel = make_kernel()
    gp = LaplaceGP(copy.deepcopy(kernel).to(cuda_device), likelihood=StudentT(scale=0.2), precond_options={"k": 40})
    gp.fit(X.to(cuda_device), y.to(cuda_device))
    ref, _ = reference(X, y, kernel)
    assert abs(gp.log_marginal_likelihood_ - float(ref.log_q)) <= 4 * gp.mll_std_error_ + 1e-8 * abs(float(ref.log_q))
    assert gp.likelihood_.raw_scale.device.type == torch.device(cuda_device).type


def heavy_tailed(n=200):
    """``df = 1.5`` noise of scale 0.05 with 10 % outliers 100 scales away: Fisher scoring (``W`` = 222 at every
    point, the outliers' observed curvature about −0.1) crawls, and ``Ψ`` is flat near its maximum."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 2, dtype=F64, generator=g)
    y = torch.sin(5 * X[:, 0]) + 0.05 * torch.randn(n, dtype=F64, generator=g)
    y[::10] += 5.0
    return X, y, StudentT(df=1.5, scale=0.05, train_scale=False)


def test_heavy_tailed_noise_stops_at_the_modes_precision():
    """Once the steps stop shrinking and Ψ stops rising above its rounding, the mode is found at this precision:
    the fit stops there (it used to run all ``max_newton`` steps and warn to raise it, which changed nothing) and
    matches the dense reference."""
    X, y, lik = heavy_tailed()
    kernel = make_kernel()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        gp = LaplaceGP(kernel, likelihood=lik, precond_options={"k": 40}, num_probes=32, max_newton=400).fit(X, y)
    assert gp.newton_iterations_ < 400
    with torch.no_grad():
        ref = dense_laplace(kernel(X).to_dense(), y, likelihood=lik)
        Xs = torch.rand(20, 2, dtype=F64, generator=torch.Generator().manual_seed(4))
        mean, var = ref.latent(kernel(X, Xs).to_dense(), kernel(Xs, diag=True))
    assert abs(gp.log_marginal_likelihood_ - float(ref.log_q)) <= 4 * gp.mll_std_error_ + 1e-3
    mu, v = gp.predict_latent(Xs)
    assert float((mu - mean).abs().max()) < 1e-3 and float((v - var).abs().max()) < 1e-5


def test_max_newton_warning_states_the_residual():
    """Stopped short of the mode while Ψ still rises: the warning gives ``max|f − K∇log p(y|f)|`` at the ``f``
    reached (checked against a dense product) and says to raise ``max_newton``."""
    X, y, lik = heavy_tailed()
    kernel = make_kernel()
    with pytest.warns(NumericalWarning, match="raise max_newton") as record:
        gp = LaplaceGP(kernel, likelihood=lik, precond_options={"k": 40}, num_probes=8, max_newton=10).fit(X, y)
    message = str(record[0].message)
    stated = float(re.search(r"max\|f − K∇log p\(y\|f\)\| = ([0-9.e+-]+)", message).group(1))
    with torch.no_grad():
        residual = float((gp.f_hat_ - kernel(X).to_dense() @ lik.derivatives(gp.f_hat_, y)[0]).abs().max())
    assert residual > 1
    assert stated == pytest.approx(residual, rel=1e-2)
