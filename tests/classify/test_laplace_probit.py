"""``LaplaceGPClassifier(link="probit")`` against the dense Laplace approximation with the probit likelihood
(R&W 2006, Algorithm 3.1, eq. (3.16)): the mode, log q, the class probabilities (exact for the probit link, eq.
(3.82)) and the hyperparameters' gradient against autograd through the dense Newton iteration."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch

from gpnys.baselines.laplace import dense_laplace
from gpnys.classify import BernoulliProbit, LaplaceGPClassifier

F64 = torch.float64


def data(n, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, dtype=F64, generator=g)
    latent = torch.sin(6 * X[:, 0]) + X[:, 1] - 0.5
    y = (latent + 0.5 * torch.randn(n, dtype=F64, generator=g) > 0).to(F64)
    return X.to(dtype), y.to(dtype)


def make_kernel(dtype=F64):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).to(dtype)
    k.base_kernel.lengthscale, k.outputscale = 0.3, 2.0
    return k


def test_mode_log_q_and_probabilities_match_dense(dtype):
    X, y = data(220)
    kernel = make_kernel()
    tol = {} if dtype == F64 else dict(cg_tolerance=1e-5, newton_tol=1e-5, slq_tolerance=1e-4)
    clf = LaplaceGPClassifier(make_kernel(dtype), link="probit", precond_options={"k": 40}, num_probes=32, **tol)
    clf.fit(X.to(dtype), y.to(dtype))
    with torch.no_grad():
        ref = dense_laplace(kernel(X).to_dense(), y, likelihood=BernoulliProbit())
    f_tol, p_tol = (1e-6, 1e-5) if dtype == F64 else (1e-3, 1e-3)
    assert (clf.f_hat_.double() - ref.f).abs().max() < f_tol
    log_q = float(ref.log_q)
    rounding = 1e-8 if dtype == F64 else 1e-5
    assert abs(clf.log_marginal_likelihood_ - log_q) <= 4 * clf.mll_std_error_ + rounding * abs(log_q)
    Xs = torch.rand(30, 2, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mean, var = ref.latent(kernel(X, Xs).to_dense(), kernel(Xs, diag=True))
    expected = torch.special.ndtr(mean / torch.sqrt(1 + var))
    torch.testing.assert_close(clf.predict_proba(Xs.to(dtype))[:, 1].double(), expected, rtol=0, atol=p_tol)
    assert torch.equal(clf.predict(Xs.to(dtype)), (mean > 0).long())


def test_gradient_matches_autograd_through_dense_newton():
    X, y = data(200)
    kernel = make_kernel()
    clf = LaplaceGPClassifier(kernel, link="probit", precond_options={"k": 40}, num_probes=64).fit(X, y)
    dense_kernel = copy.deepcopy(kernel)
    dense_laplace(dense_kernel(X).to_dense(), y, likelihood=BernoulliProbit()).log_q.backward()
    for name, p in dense_kernel.named_parameters():
        got, se = clf.mll_gradient_[name], clf.mll_gradient_std_error_[name]
        assert bool(((got - p.grad).abs() <= 4 * se + 1e-6 * p.grad.abs()).all()), (name, got, p.grad, se)


def test_same_seed_same_results_and_bad_link():
    X, y = data(100)
    a = LaplaceGPClassifier(make_kernel(), link="probit", precond_options={"k": 20}, seed=4).fit(X, y)
    b = LaplaceGPClassifier(make_kernel(), link="probit", precond_options={"k": 20}, seed=4).fit(X, y)
    assert a.log_marginal_likelihood_ == b.log_marginal_likelihood_ and torch.equal(a.f_hat_, b.f_hat_)
    with pytest.raises(ValueError, match="link"):
        LaplaceGPClassifier(make_kernel(), link="cloglog").fit(X, y)


@pytest.mark.cuda
def test_probit_on_the_cuda_device(cuda_device):
    X, y = data(150)
    kernel = make_kernel()
    clf = LaplaceGPClassifier(copy.deepcopy(kernel).to(cuda_device), link="probit", precond_options={"k": 40})
    clf.fit(X.to(cuda_device), y.to(cuda_device))
    with torch.no_grad():
        ref = dense_laplace(kernel(X).to_dense(), y, likelihood=BernoulliProbit())
    assert abs(clf.log_marginal_likelihood_ - float(ref.log_q)) <= 4 * clf.mll_std_error_ + 1e-8 * abs(float(ref.log_q))


def test_large_outputscale_with_a_low_rank_preconditioner_reaches_the_mode():
    """Probit at outputscale 1e4 with a rank-40 AFN preconditioner (n = 200): an inexact Newton step stopped ascending
    and was taken for the mode, 2e3 from it (max|f − K∇log p|) and log q 20 off, with no warning. The steps after
    such a failure solve to ``cg_tolerance`` with a fresh preconditioner and reach the dense mode."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(200, 2, dtype=torch.float64, generator=g)
    y = (torch.sin(6 * X[:, 0]) + X[:, 1] > 0.8).double()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    kernel.base_kernel.lengthscale, kernel.outputscale = 0.3, 1e4
    clf = LaplaceGPClassifier(kernel, link="probit", precond_options={"k": 40}, num_probes=16).fit(X, y)
    with torch.no_grad():
        K = kernel(X).to_dense()
        ref = dense_laplace(K, y, likelihood=BernoulliProbit())
    assert float((clf.f_hat_ - ref.f).abs().max()) < 1e-6 * float(ref.f.abs().max())
    assert abs(clf.log_marginal_likelihood_ - float(ref.log_q)) <= 4 * clf.mll_std_error_
