"""``LaplaceGP`` with kernels that read some input columns (``active_dims`` on the ``ScaleKernel``, on its base
kernel, on both, on a bare kernel, with ARD length-scales): the mode, log q, its gradient and the predictions
against the dense Laplace approximation (R&W 2006, Algorithms 3.1, 3.2) on GPyTorch's own kernel matrix."""

from __future__ import annotations

import copy
import warnings

import gpytorch
import pytest
import torch

from gpnys.baselines.laplace import dense_laplace
from gpnys.checks import NumericalWarning
from gpnys.classify import LaplaceGP, LaplaceGPClassifier, Poisson
from gpnys.classify.likelihoods import Bernoulli

F64 = torch.float64
#: float32's tolerances (test_laplace.py's)
F32_TOLERANCES = {"cg_tolerance": 1e-5, "newton_tol": 1e-5, "slq_tolerance": 1e-4}


def columns(n, d=3, seed=0):
    """``(n, d)`` points whose labels depend on column 0 only: the other columns are noise to a kernel on column 0."""
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, dtype=F64, generator=g)
    y = (torch.sin(6 * X[:, 0]) + 0.3 * torch.randn(n, dtype=F64, generator=g) > 0.3).double()
    return X, y


def scaled_matern(placement, dtype=F64):
    """``ScaleKernel(MaternKernel(nu=1.5))`` (or, ``"bare"``, ``MaternKernel(nu=1.5)``) reading column 0,
    ℓ = 0.3, s² = 4."""
    dims = torch.tensor([0])
    if placement == "scale":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5), active_dims=dims)
    elif placement == "base":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, active_dims=dims))
    elif placement == "both":
        k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, active_dims=dims),
                                         active_dims=dims)
    else:
        k = gpytorch.kernels.MaternKernel(nu=1.5, active_dims=dims)
        k = k.to(dtype)
        k.lengthscale = 0.3
        return k
    k = k.to(dtype)
    k.base_kernel.lengthscale, k.outputscale = 0.3, 4.0
    return k


def ard_rbf(dtype=F64):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2, active_dims=[0, 2])).to(dtype)
    k.base_kernel.lengthscale, k.outputscale = torch.tensor([[0.3, 0.5]]), 3.0
    return k


def reference(X, y, kernel, Xs, likelihood=None):
    """The dense mode, log q, latent mean and variance at ``Xs``, and ``∂ log q / ∂θ`` by autograd through the
    Newton iteration, in float64 on GPyTorch's kernel matrix ``kernel(X)``."""
    kernel = copy.deepcopy(kernel).double()
    X, y, Xs = X.double(), y.double(), Xs.double()
    lik = Bernoulli() if likelihood is None else likelihood
    out = dense_laplace(kernel(X).to_dense(), y, likelihood=lik)
    named = [(name, p) for name, p in kernel.named_parameters()]
    grads = torch.autograd.grad(out.log_q, [p for _, p in named])
    with torch.no_grad():
        mean, var = out.latent(kernel(X, Xs).to_dense(), kernel(Xs, diag=True))
    return {"f": out.f.detach(), "log_q": float(out.log_q.detach()), "mean": mean, "var": var,
            "grad": {name: g for (name, _), g in zip(named, grads)}}


def check(model, ref, Xs, n, dtype):
    """The fitted ``model`` against ``reference``'s figures: the mode and latent predictions to 1e-5 (float64) /
    1e-3 (float32), log q and each gradient entry within four standard errors plus a rounding allowance."""
    close, rounding = (1e-5, 1e-6) if dtype == F64 else (1e-3, 1e-3)
    assert model.f_hat_.dtype == dtype
    assert float((model.f_hat_.double() - ref["f"]).abs().max()) < close
    assert abs(model.log_marginal_likelihood_ - ref["log_q"]) <= 4 * model.mll_std_error_ + rounding * n
    mu, v = model.predict_latent(Xs.to(dtype))
    assert float((mu.double() - ref["mean"]).abs().max()) < close
    assert float((v.double() - ref["var"]).abs().max()) < close
    assert set(model.mll_gradient_) == set(ref["grad"])
    for name, g in ref["grad"].items():
        got, se = model.mll_gradient_[name].double(), model.mll_gradient_std_error_[name].double()
        assert bool(((got - g).abs() <= 4 * se + rounding * (1 + g.abs())).all()), (name, got, g, se)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("placement", ["scale", "base", "both", "bare"])
def test_classifier_reads_the_columns_gpytorch_reads(placement, dtype):
    """Labels that depend on column 0, a kernel on column 0: the dense log q on all three columns is about 10
    lower, so a fit on every column fails here by far more than the error bars."""
    X, y = columns(200)
    Xs = columns(20, seed=1)[0]
    kernel = scaled_matern(placement, dtype)
    options = F32_TOLERANCES if dtype == torch.float32 else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)  # a closed-form derivative pass: no warning
        clf = LaplaceGPClassifier(kernel, precond_options={"k": 40}, num_probes=64, **options)
        clf.fit(X.to(dtype), y.to(dtype))
    check(clf, reference(X, y, kernel, Xs), Xs, 200, dtype)
    # the predictions do not depend on the columns the kernel ignores
    A, B = Xs.clone(), Xs.clone()
    A[:, 1:], B[:, 1:] = 0.9, 0.1
    assert torch.equal(clf.predict_proba(A.to(dtype)), clf.predict_proba(B.to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
def test_ard_kernel_on_two_of_three_columns(dtype):
    """ARD length-scales (2,) for columns 0 and 2 of a 3-column X: AFN's neighbours and the kernel products are
    computed on those two columns."""
    X, y = columns(200)
    y = (torch.sin(6 * X[:, 0]) + X[:, 2] > 0.8).double()
    Xs = columns(20, seed=1)[0]
    kernel = ard_rbf(dtype)
    options = F32_TOLERANCES if dtype == torch.float32 else {}
    clf = LaplaceGPClassifier(kernel, precond_options={"k": 40}, num_probes=64, **options).fit(X.to(dtype),
                                                                                               y.to(dtype))
    check(clf, reference(X, y, kernel, Xs), Xs, 200, dtype)


def test_poisson_with_scale_kernel_active_dims():
    g = torch.Generator().manual_seed(2)
    X = torch.rand(200, 2, dtype=F64, generator=g)
    y = torch.poisson(torch.exp(1 + torch.sin(5 * X[:, 0])), generator=g)
    Xs = torch.rand(20, 2, dtype=F64, generator=g)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5), active_dims=[1]).double()
    kernel.base_kernel.lengthscale, kernel.outputscale = 0.2, 1.0
    gp = LaplaceGP(kernel, likelihood="poisson", precond_options={"k": 40}, num_probes=64).fit(X, y)
    check(gp, reference(X, y, kernel, Xs, Poisson()), Xs, 200, F64)


def test_training_with_scale_kernel_active_dims_raises_the_dense_log_marginal():
    """Adam steps on a kernel that reads column 0: the trained kernel's dense log q (on GPyTorch's matrix) is the
    fit's, and above the start's."""
    X, y = columns(150, d=2)
    kernel = scaled_matern("scale")
    kernel.base_kernel.lengthscale, kernel.outputscale = 1.0, 0.5  # a poor start
    start = reference(X, y, kernel, X[:2])["log_q"]
    clf = LaplaceGPClassifier(kernel, precond_options={"k": 30}, num_probes=16, optimizer_steps=10).fit(X, y)
    ref = reference(X, y, clf.kernel_, X[:2])
    assert ref["log_q"] > start + 2
    assert abs(clf.log_marginal_likelihood_ - ref["log_q"]) <= 4 * clf.mll_std_error_ + 1e-6 * 150
