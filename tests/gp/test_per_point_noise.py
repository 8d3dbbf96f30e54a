"""Known per-point noise inside the preconditioners: Nyström, AFN, FSAI and auto on ``K + diag(mu_i)``.

``mu_i = D_i / s^2``: AFN factors ``K11 + D1`` and the Schur complement ``K22 + D2 - V V^T``, FSAI works on
``K + D``, Nyström on ``D^{-1/2} K D^{-1/2} + I``. References are dense float64 matrices; ``mu`` (the mean shift)
only labels the preconditioner then.
"""

import gpytorch
import pytest
import torch
from helpers import dense_P, make_kernel, points

from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import EstimatorSettings
from gpnys.precond.afn import AFNPreconditioner
from gpnys.precond.fsai import FSAIPreconditioner
from gpnys.precond.nystrom import NystromPreconditioner
from gpnys.precond.strategy import DIAG_PRECONDITIONERS, make_preconditioner

F64 = torch.float64


def shifts(n, seed=0, dtype=F64, low=1e-3, high=1e-1):
    """Per-point shifts spread over two decades, log-uniform."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return (low * (high / low) ** u).to(dtype)


def dense_KD(X, kern, D):
    with torch.no_grad():
        return kern(X).to_dense().to(X.dtype) + torch.diag(D)


OPTIONS_FULL = {"afn": lambda n: {"k": 30, "w": n}, "fsai": lambda n: {"w": n}, "nystrom": lambda n: {"rank": n}}
OPTIONS_PARTIAL = {"afn": {"k": 40, "w": 15}, "fsai": {"w": 15}}


@pytest.mark.parametrize("name", ["afn", "fsai", "nystrom"])
def test_full_patterns_reproduce_K_plus_D(name, dtype):
    """With every landmark / neighbour the preconditioner is K + D itself: product, solve and log det exact."""
    n = 120
    X = points(n, 3, dtype=dtype, seed=2)
    kern = make_kernel("matern32", 0.3, dtype)
    D = shifts(n, dtype=dtype)
    A = dense_KD(X, kern, D)
    opts = OPTIONS_FULL[name](n)
    P = make_preconditioner(name, X, kern, float(D.mean()), diag=D, **opts)
    assert torch.equal(P.diag, D)
    tol = 1e-9 if dtype == F64 else 2e-3
    Pd = dense_P(P)
    assert float((Pd - A).norm() / A.norm()) < tol
    assert abs(float(P.logdet()) - float(torch.logdet(A.double()))) < tol * n
    V = torch.randn(n, 3, generator=torch.Generator().manual_seed(1), dtype=F64).to(dtype)
    back = P.solve(A @ V)
    assert float((back - V).norm() / V.norm()) < (1e-7 if dtype == F64 else 5e-2)


@pytest.mark.parametrize("name", ["afn", "fsai"])
def test_per_point_shifts_precondition_better_than_their_mean(name):
    """Strongly heteroscedastic D: P built on K + D leaves P^{-1}(K + D) better conditioned than P built on
    K + mean(D) I, at the same (partial) landmarks and pattern; both stay SPD with exact log det."""
    n = 300
    X = points(n, 3, seed=5)
    kern = make_kernel("matern32", 0.2)
    D = shifts(n, seed=3, low=1e-4, high=1e-1)
    A = dense_KD(X, kern, D)
    opts = OPTIONS_PARTIAL[name]
    conds = {}
    for label, diag in (("diag", D), ("mean", None)):
        P = make_preconditioner(name, X, kern, float(D.mean()), diag=diag, **opts)
        Pd = 0.5 * (dense_P(P) + dense_P(P).T)
        sign, logdet = torch.linalg.slogdet(Pd)
        assert float(sign) == 1.0 and abs(float(P.logdet()) - float(logdet)) < 1e-7 * n
        Lp = torch.linalg.cholesky(Pd)
        W = torch.linalg.solve_triangular(Lp, torch.linalg.solve_triangular(Lp, A, upper=False).T, upper=False)
        conds[label] = float(torch.linalg.cond(0.5 * (W + W.T)))
    assert conds["diag"] < 0.5 * conds["mean"], conds


def test_auto_passes_the_shifts_to_afn_and_uses_the_mean_for_nystrom():
    X = points(200, 3, seed=1)
    D = shifts(200)
    afn = make_preconditioner("auto", X, make_kernel("matern32", 0.05), float(D.mean()), diag=D, k=50, w=10)
    assert afn.choice == "afn" and torch.equal(afn.inner.diag, D)
    nys = make_preconditioner("auto", X, make_kernel("rbf", 2.0), float(D.mean()), diag=D, k=150, w=10)
    assert nys.choice == "nystrom" and nys.inner.diag is None


def test_diag_bad_input():
    X = points(50, 2)
    kern = make_kernel("rbf", 0.5)
    for bad in (torch.ones(49, dtype=F64), torch.ones(50, 1, dtype=F64), torch.zeros(50, dtype=F64),
                torch.full((50,), float("nan"), dtype=F64), [0.1] * 50):
        with pytest.raises(ValueError, match="diag"):
            AFNPreconditioner(X, kern, 0.1, k=10, w=5, diag=bad)
        with pytest.raises(ValueError, match="diag"):
            FSAIPreconditioner(X, kern, 0.1, w=5, diag=bad)
    assert DIAG_PRECONDITIONERS == ("nystrom", "fsai", "afn", "auto")
    for name in ("ran", "sketch", "pivchol"):
        with pytest.raises(ValueError, match="diag"):
            make_preconditioner(name, X, kern, 0.1, diag=torch.ones(50, dtype=F64), rank=5)
    with pytest.raises(ValueError, match="diag"):
        NystromPreconditioner(X, kern, 0.1, 5, scaling="ran", diag=torch.ones(50, dtype=F64))


def test_same_shifts_same_preconditioner():
    X = points(150, 3, seed=7)
    D = shifts(150, seed=8)
    P1, P2 = (AFNPreconditioner(X, make_kernel("matern32", 0.2), float(D.mean()), k=20, w=8, diag=D)
              for _ in range(2))
    V = torch.randn(150, 2, generator=torch.Generator().manual_seed(0), dtype=F64)
    assert torch.equal(P1.solve(V), P2.solve(V)) and torch.equal(P1.logdet(), P2.logdet())


class _Model(gpytorch.models.ExactGP):
    def __init__(self, X, y, noise):
        super().__init__(X, y, gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=noise))
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


@pytest.mark.parametrize("method", ["afn", "fsai", "nystrom"])
def test_hook_builds_on_the_per_point_noise_and_matches_cholesky(method):
    """FixedNoiseGaussianLikelihood under the hook: AFN and FSAI get D / s^2, Nyström the mean; the loss and its
    gradients (control variate in the family each was built in) agree with Cholesky."""
    n = 400
    X = points(n, 2, seed=11)
    y = torch.sin(6 * X).sum(1) + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=F64)
    noise = shifts(n, seed=4, low=1e-3, high=2e-1)
    model = _Model(X, y, noise).double()
    model.covar_module.base_kernel.lengthscale = 0.3
    model.covar_module.outputscale = 1.5
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)

    def loss_and_grad():
        model.zero_grad()
        loss = -mll(model(X), y)
        loss.backward()
        g = [p.grad.detach().clone().reshape(-1) for p in (model.covar_module.raw_outputscale,
                                                            model.covar_module.base_kernel.raw_lengthscale)]
        return float(loss.detach()), torch.cat(g)

    with gpytorch.settings.max_cholesky_size(n + 1):
        ref, g_ref = loss_and_grad()
    opts = {"afn": {"k": 60, "w": 20}, "fsai": {"w": 30}, "nystrom": {"rank": 80}}[method]
    settings = EstimatorSettings(num_probes=64, probe_seed=0)
    with use_preconditioner(model, method, settings=settings, **opts) as hook:
        got, g = loss_and_grad()
        P, s2 = hook.preconditioner()
        if method == "nystrom":
            assert P.diag is None
        else:
            torch.testing.assert_close(P.diag, noise / float(s2))
        assert hook.control_variates == (0 if method == "fsai" else 1)
    assert abs(got - ref) < 3e-3 * abs(ref)  # measured <= 6e-4 (fixed probes)
    assert float(((g - g_ref).abs() / g_ref.abs().clamp_min(0.1 * g_ref.norm())).max()) < 0.05


@pytest.mark.parametrize("name,schur", [("afn", "full"), ("afn", "diag"), ("afn", "frozen"), ("nystrom", None)])
def test_differentiable_terms_with_per_point_shifts_equal_P(name, schur):
    """The control variate's family at the current hyperparameters is P itself: its log det and z^T P^{-1} z, with
    per-point shifts, equal the preconditioner's (and the log det has a gradient in the outputscale)."""
    n = 160
    X = points(n, 2, seed=9)
    kern = make_kernel("matern32", 0.3)
    D = shifts(n, seed=2)
    P = make_preconditioner(name, X, kern, float(D.mean()), diag=D,
                            **({"k": 30, "w": 10} if name == "afn" else {"rank": 40}))
    Z = torch.randn(n, 4, generator=torch.Generator().manual_seed(3), dtype=F64)
    s2 = torch.tensor(1.0, dtype=F64, requires_grad=True)
    kw = {"schur": schur} if schur else {}
    logdet, quad = P.differentiable_terms(kern, D / s2, Z, **kw)
    torch.testing.assert_close(logdet.detach(), P.logdet(), rtol=1e-9, atol=1e-8)
    torch.testing.assert_close(quad.detach(), (Z * P.solve(Z)).sum(0), rtol=1e-8, atol=1e-8)
    (g,) = torch.autograd.grad(logdet + quad.sum(), s2)
    assert torch.isfinite(g) and float(g) != 0.0


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["afn", "fsai", "nystrom"])
def test_per_point_shifts_on_the_device(cuda_device, name, dtype):
    """The same preconditioners on the cuda suite's device: exact with full patterns, against the CPU dense K + D."""
    n = 120
    X = points(n, 3, seed=2)
    D = shifts(n)
    A = dense_KD(X, make_kernel("matern32", 0.3, F64), D)
    Xd, Dd = X.to(cuda_device, dtype), D.to(cuda_device, dtype)
    P = make_preconditioner(name, Xd, make_kernel("matern32", 0.3, dtype).to(cuda_device), float(D.mean()),
                            diag=Dd, **OPTIONS_FULL[name](n))
    Pd = dense_P(P).to("cpu", F64)
    assert P.diag.device.type == cuda_device.type and Pd.dtype == F64
    tol = 1e-9 if dtype == F64 else 2e-3
    assert float((Pd - A).norm() / A.norm()) < tol
    assert abs(float(P.logdet()) - float(torch.logdet(A))) < tol * n
