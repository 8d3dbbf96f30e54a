"""Tests of gpnys.precond.pivchol: GPyTorch's pivoted Cholesky as a gpnys Preconditioner."""

from __future__ import annotations

import math

import gpytorch
import pytest
import torch
from helpers import points

from gpnys.precond.base import Preconditioner
from gpnys.precond.pivchol import KernelRowsOperator, PivotedCholeskyPreconditioner


def explicit_P(P: PivotedCholeskyPreconditioner) -> torch.Tensor:
    """Reference P = L L^T + mu I formed from the factor (independent of P.matmul)."""
    return P.L @ P.L.mT + P.mu * torch.eye(P.n, dtype=P.L.dtype)


@pytest.mark.parametrize("kernel_cls", [gpytorch.kernels.RBFKernel, lambda: gpytorch.kernels.MaternKernel(nu=1.5)])
def test_factor_matches_gpytorch(kernel_cls):
    X = points(300, scale=4.0)
    kernel = kernel_cls().double()
    kernel.lengthscale = 1.3
    P = PivotedCholeskyPreconditioner(X, kernel, 1e-2, rank=25)
    with torch.no_grad():
        L_ref, piv_ref = kernel(X).pivoted_cholesky(rank=25, return_pivots=True)
    assert isinstance(P, Preconditioner) and P.rank == 25 and P.L.shape == (300, 25)
    torch.testing.assert_close(P.L, L_ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(P.pivots, piv_ref[:25])
    dense = PivotedCholeskyPreconditioner(X, kernel, 1e-2, rank=25, lazy=False)
    torch.testing.assert_close(dense.L, L_ref, rtol=1e-12, atol=1e-12)


def test_lazy_path_never_forms_n_by_n():
    n = 400
    X = points(n, scale=4.0)
    kernel = gpytorch.kernels.RBFKernel().double()
    calls: list[tuple[int, ...]] = []
    orig = kernel.forward

    def spy(x1, x2, diag=False, **kw):
        out = orig(x1, x2, diag=diag, **kw)
        calls.append(tuple(out.shape))
        return out

    kernel.forward = spy
    PivotedCholeskyPreconditioner(X, kernel, 1e-2, rank=10)
    assert calls and max(math.prod(s) for s in calls) <= n  # diagonal + one row per pivot
    calls.clear()
    PivotedCholeskyPreconditioner(X, kernel, 1e-2, rank=10, lazy=False)
    assert max(math.prod(s) for s in calls) == n * n  # GPyTorch's own path evaluates the whole matrix


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_solve_matmul_logdet(dtype):
    X = points(250, dtype=dtype, scale=4.0)
    kernel = gpytorch.kernels.MaternKernel(nu=1.5).to(dtype)
    mu = 1e-2
    P = PivotedCholeskyPreconditioner(X, kernel, mu, rank=40)
    V = torch.randn(250, 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(P.solve(P.matmul(V)), V, rtol=tol, atol=tol)
    torch.testing.assert_close(P.matmul(P.solve(V[:, 0])), V[:, 0], rtol=tol, atol=tol)
    M = explicit_P(P).double()
    ref = torch.linalg.solve(M, V.double())
    assert float(torch.linalg.matrix_norm(P.solve(V).double() - ref) / torch.linalg.matrix_norm(ref)) < tol
    assert P.logdet().dtype == dtype
    assert abs(float(P.logdet()) - float(torch.logdet(M))) < (1e-2 if dtype == torch.float32 else 1e-8)


def test_sample_covariance():
    n = 20
    X = points(n, seed=3, scale=4.0)
    kernel = gpytorch.kernels.RBFKernel().double()
    P = PivotedCholeskyPreconditioner(X, kernel, 0.05, rank=5)
    M = explicit_P(P)
    S = P.sample(40000, generator=torch.Generator().manual_seed(0))
    assert S.shape == (n, 40000)
    emp = S @ S.mT / S.shape[1]
    assert float(torch.linalg.matrix_norm(emp - M) / torch.linalg.matrix_norm(M)) < 0.03
    # the square factor used by the Preconditioner interface: F F^T = P exactly
    F = P._sample(torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(F @ F.mT, M, rtol=1e-10, atol=1e-10)


def test_scale_kernel_stripped_and_early_stop():
    X = points(200, scale=4.0)
    base = gpytorch.kernels.RBFKernel().double()
    base.lengthscale = 1.0
    scaled = gpytorch.kernels.ScaleKernel(base).double()
    scaled.outputscale = 7.0
    a = PivotedCholeskyPreconditioner(X, base, 0.1, rank=20)
    b = PivotedCholeskyPreconditioner(X, scaled, 0.1, rank=20)
    torch.testing.assert_close(a.L, b.L)
    # a nearly constant kernel: GPyTorch's error_tol (1e-3) stops early, rank < requested
    base.lengthscale = 1e3
    c = PivotedCholeskyPreconditioner(X, base, 0.1, rank=50)
    assert 1 <= c.rank < 50 and c.summary()["requested_rank"] == 50
    d = PivotedCholeskyPreconditioner(X, base, 0.1, rank=5, error_tol=0.0)
    assert d.rank == 5 and torch.isfinite(d.L).all()
    s = a.summary()
    assert s["kind"] == "pivchol" and s["rank"] == 20 and s["setup_s"] >= 0


def test_bad_input():
    X = points(50, scale=4.0)
    kernel = gpytorch.kernels.RBFKernel().double()
    with pytest.raises(ValueError):
        PivotedCholeskyPreconditioner(X, kernel, 0.0)
    with pytest.raises(ValueError):
        PivotedCholeskyPreconditioner(X, kernel, 1e-2, rank=51)
    with pytest.raises(ValueError):
        PivotedCholeskyPreconditioner(X, kernel, 1e-2, rank=0)
    bad = X.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError):
        PivotedCholeskyPreconditioner(bad, kernel, 1e-2)
    P = PivotedCholeskyPreconditioner(X, kernel, 1e-2, rank=5)
    with pytest.raises(ValueError):
        P.solve(torch.zeros(49, dtype=torch.float64))


def test_rows_operator_entries():
    X = points(60, scale=4.0)
    kernel = gpytorch.kernels.MaternKernel(nu=2.5).double()
    op = KernelRowsOperator(X, kernel)
    with torch.no_grad():
        K = kernel(X).to_dense()
    torch.testing.assert_close(op.to_dense(), K)
    torch.testing.assert_close(op.diagonal(), K.diagonal())
    idx = torch.tensor([3, 7, 11])
    torch.testing.assert_close(op[idx, idx], K[idx, idx])
    V = torch.randn(60, 2, dtype=torch.float64)
    torch.testing.assert_close(op @ V, K @ V)
