"""The dense reference :func:`gpnys.baselines.laplace.dense_laplace` (R&W 2006, Algorithm 3.1) where its plain Newton
steps overshoot: Poisson counts in the hundreds and Student-t noise of small ``df`` with far outliers; and its warning
when ``max_iter`` ends before the mode."""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch

from gpnys.baselines.laplace import dense_laplace
from gpnys.checks import NumericalWarning
from gpnys.classify import LaplaceGP, Poisson, StudentT

F64 = torch.float64


def points(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, dtype=F64, generator=g)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
    kernel.base_kernel.lengthscale = 0.3
    with torch.no_grad():
        return X, kernel, kernel(X).to_dense(), g


def psi(K, f, y, lik):
    """``Ψ = log p(y|f) − ½ fᵀK⁻¹f`` (R&W eq. (3.12)), by a dense solve."""
    return float(lik.log_prob(f, y) - 0.5 * f @ torch.linalg.solve(K, f))


def test_poisson_counts_in_the_hundreds():
    """From ``f = 0`` the first Newton step overshoots (``e^f`` overflows, the Cholesky of ``B`` fails): halved, it
    reaches the mode, which ``LaplaceGP`` with the exact (full-rank Nyström) preconditioner finds as well."""
    X, kernel, K, g = points(150)
    y = torch.poisson(torch.exp(6 + torch.sin(6 * X[:, 0])), generator=g)
    assert float(y.max()) > 500
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        out = dense_laplace(K, y, likelihood=Poisson())
    grad = Poisson().derivatives(out.f, y)[0]
    # the mode: f = K ∇log p(y|f), to the rounding of ∇ = y − e^f (counts of about 1000)
    assert float((out.f - K @ grad).abs().max()) < 1e-6 * float((K @ grad).abs().max())
    gp = LaplaceGP(kernel, likelihood="poisson", method="nystrom", precond_options={"rank": 150}, num_probes=4)
    gp.fit(X, y)
    assert float((gp.f_hat_ - out.f).abs().max()) < 1e-6
    assert abs(gp.log_marginal_likelihood_ - float(out.log_q)) < 1e-8 * abs(float(out.log_q))


def test_heavy_tailed_student_t_returns_the_mode():
    """Student-t noise with ``df = 1.5`` and 10 % outliers five scales away: unhalved Fisher-scoring steps never
    settle (the function used to return a point 100 away from stationarity, log q +47 where the mode's is −22).
    Against 3000 halved steps: the same Ψ and log q."""
    X, _, K, g = points(150)
    y = torch.sin(5 * X[:, 0]) + 0.05 * torch.randn(150, dtype=F64, generator=g)
    y[::10] += 5.0
    lik = StudentT(df=1.5, scale=0.05, train_scale=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        out = dense_laplace(K, y, likelihood=lik)
    # the reference: 3000 Fisher-scoring steps, each halved until Ψ does not fall
    n = K.shape[0]
    W = lik.derivatives(y, y)[1]  # constant in f
    sW = W.sqrt()
    L = torch.linalg.cholesky(torch.eye(n, dtype=F64) + sW[:, None] * K * sW)
    a, f = K.new_zeros(n), K.new_zeros(n)
    value = float(lik.log_prob(f, y))
    for _ in range(3000):
        b = W * f + lik.derivatives(f, y)[0]
        da = b - sW * torch.cholesky_solve((sW * (K @ b))[:, None], L)[:, 0] - a
        t = 1.0
        while t > 1e-9:
            new = float(lik.log_prob(f + t * (K @ da), y) - 0.5 * (a + t * da) @ (f + t * (K @ da)))
            if new >= value:
                a, f, value = a + t * da, f + t * (K @ da), new
                break
            t /= 2
    reference = value - float(L.diagonal().log().sum())  # R&W eq. (3.32)
    assert abs(psi(K, out.f, y, lik) - psi(K, f, y, lik)) < 1e-6
    assert abs(float(out.log_q) - reference) < 1e-3


def test_stopping_short_warns():
    X, _, K, _ = points(100)
    y = (torch.sin(6 * X[:, 0]) > 0).double()
    with pytest.warns(NumericalWarning, match="max_iter = 2"):
        dense_laplace(K, y, max_iter=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        out = dense_laplace(K, y)
    assert torch.allclose(K @ out.a, out.f, rtol=0, atol=1e-10)
