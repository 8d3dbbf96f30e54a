"""Property tests (Hypothesis) of the preconditioner invariants over random shapes, kernels (plain, ARD, sums,
products, ``active_dims``), noise levels mu, per-point noise, dtypes and duplicated points.

For every drawn case and every preconditioner ``P`` of ``K + mu I`` (of ``K + diag(mu_i)`` for the preconditioners
that take per-point shifts, when the case draws them):

* ``P.solve(P.matmul(V)) = V`` (the two applies are inverse to each other);
* ``P.logdet()`` equals ``slogdet`` of the dense ``P`` (built by applying ``P`` to the identity);
* ``P`` is symmetric positive definite.

Separately, ``P.sample`` draws have covariance ``P`` (empirical covariance of many draws).
"""

import gpytorch
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpnys.kernels.entries import split_outputscale
from gpnys.precond import make_preconditioner
from gpnys.precond.strategy import DIAG_PRECONDITIONERS

KERNELS = {
    "rbf": lambda d: gpytorch.kernels.RBFKernel(),
    "matern12-ard": lambda d: gpytorch.kernels.MaternKernel(nu=0.5, ard_num_dims=d),
    "matern52": lambda d: gpytorch.kernels.MaternKernel(nu=2.5),
    "sum": lambda d: gpytorch.kernels.RBFKernel() + gpytorch.kernels.MaternKernel(nu=1.5),
    "product-active-dims": lambda d: (gpytorch.kernels.RBFKernel(active_dims=[0])
                                      * gpytorch.kernels.MaternKernel(nu=1.5, active_dims=list(range(d)))),
    "scaled-active-dims": lambda d: gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(active_dims=[d - 1])),
}
METHODS = ["afn", "nystrom", "fsai", "auto", "pivchol"]


@st.composite
def cases(draw, kernels=tuple(sorted(KERNELS))):
    n = draw(st.integers(8, 60))
    d = draw(st.integers(2, 4))  # >= 2: active_dims then select a strict subset
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.5, 2.0, 3.0, 20.0]))
    if draw(st.booleans()):  # duplicated points
        X[n // 2] = X[0]
    kernel = KERNELS[draw(st.sampled_from(kernels))](d).double()
    mu = draw(st.sampled_from([1e-3, 1e-2, 0.1, 1.0]))
    method = draw(st.sampled_from(METHODS))
    diag = None
    if method in DIAG_PRECONDITIONERS and draw(st.booleans()):  # per-point shifts: mu times 0.1 .. 10
        diag = mu * 100.0 ** (torch.rand(n, generator=g, dtype=torch.float64) - 0.5)
    return X, kernel, mu, method, seed, diag


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(cases())
def test_preconditioner_invariants(case):
    X, kernel, mu, method, seed, diag = case
    n = X.shape[0]
    opts = {"k": max(1, n // 3), "w": min(5, n)} if method in ("afn", "auto") else {}
    if method == "fsai":
        opts = {"w": min(5, n)}
    with torch.no_grad():
        P = make_preconditioner(method, X, kernel, mu, seed=seed, diag=diag, **opts)
    eye = torch.eye(n, dtype=X.dtype)
    Pd = P.matmul(eye)
    scale = float(Pd.abs().max())
    assert float((Pd - Pd.mT).abs().max()) <= 1e-8 * scale, "P symmetric"
    evals = torch.linalg.eigvalsh(0.5 * (Pd + Pd.mT))
    assert float(evals.min()) > 0, "P positive definite"
    V = torch.randn(n, 3, dtype=X.dtype, generator=torch.Generator().manual_seed(seed))
    back = P.solve(P.matmul(V))
    cond = float(evals.max() / evals.min())
    assert float((back - V).abs().max()) <= 1e-12 * cond * float(V.abs().max()) + 1e-9, "solve(matmul(V)) = V"
    sign, logdet = torch.linalg.slogdet(Pd)
    assert float(sign) > 0
    assert abs(float(P.logdet()) - float(logdet)) <= 1e-8 * max(1.0, abs(float(logdet))) + 1e-10 * n * cond


@pytest.mark.parametrize("method", ["afn", "nystrom", "fsai", "afn-diag", "nystrom-diag"])
def test_sample_covariance_is_P(method):
    """``sample`` draws ``R e`` with ``R R^T = P``: the empirical covariance of many draws approaches ``P``."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(30, 2, generator=g, dtype=torch.float64) * 3
    kernel = (gpytorch.kernels.RBFKernel() + gpytorch.kernels.MaternKernel(nu=1.5)).double()
    opts = {"k": 10, "w": 5} if method.startswith("afn") else ({"w": 5} if method == "fsai" else {})
    if method.endswith("-diag"):  # per-point shifts 0.01 .. 1
        opts["diag"] = 10.0 ** (-2 * torch.rand(30, generator=g, dtype=torch.float64))
    with torch.no_grad():
        P = make_preconditioner(method.removesuffix("-diag"), X, kernel, 0.1, **opts)
    Pd = P.matmul(torch.eye(30, dtype=X.dtype))
    S = P.sample(40000, generator=torch.Generator().manual_seed(1), distribution="rademacher")
    emp = S @ S.mT / S.shape[1]
    assert float((emp - Pd).norm() / Pd.norm()) < 0.03


@pytest.mark.parametrize("name", sorted(KERNELS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_afn_with_every_point_a_landmark_is_the_kernel(name, data):
    """AFN with k = n reproduces ``K + mu I`` or ``K + diag(mu_i)`` (GPyTorch's own evaluation of the unit-variance kernel,
    ``active_dims`` included): the preconditioners see the kernel the model uses."""
    X, kernel, mu, _, seed, diag = data.draw(cases(kernels=(name,)))
    n = X.shape[0]
    shift = mu * torch.ones(n, dtype=X.dtype) if diag is None else diag
    with torch.no_grad():
        P = make_preconditioner("afn", X, kernel, mu, seed=seed, k=n, w=min(5, n), diag=diag)
        unit, _ = split_outputscale(kernel)  # preconditioners take the unit-variance kernel (mu = noise / s^2)
        A = unit(X).to_dense() + torch.diag(shift)
    Pd = P.matmul(torch.eye(n, dtype=X.dtype))
    # GPyTorch's distances are expanded forms centred on each block's mean: at duplicated points r ~ sqrt(eps) |x|,
    # which Matérn-1/2 (k = 1 - r + ...) turns into ~1e-7 differences between two blocks' evaluations
    assert float((Pd - A).abs().max()) <= 1e-6 * float(A.abs().max())
