"""Tests of gpnys.solvers.pcg: PCG with per-column counts/flags, and the kernel-system product."""

from __future__ import annotations

import warnings

import gpytorch
import pytest
import torch
from helpers import make_kernel, points

from gpnys.checks import NumericalWarning
from gpnys.kernels.system import kernel_system
from gpnys.precond.pivchol import PivotedCholeskyPreconditioner
from gpnys.solvers import ConvergenceWarning, PCGResult, pcg
from gpnys.solvers.pcg import galerkin_step


def spd(n: int, cond: float = 100.0, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    ev = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
    return ((Q * ev) @ Q.T).to(dtype)


def test_matches_dense_solve_and_iteration_bound():
    n = 60
    A = spd(n, cond=10.0)
    b = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = pcg(lambda v: A @ v, b, tol=1e-10, maxiter=10 * n)
    assert isinstance(res, PCGResult)
    assert res.x.shape == (n,)
    torch.testing.assert_close(res.x, torch.linalg.solve(A, b), rtol=1e-8, atol=1e-8)
    assert res.converged.all() and res.rel_residual.shape == (1,)
    assert float(res.rel_residual[0]) < 1e-9
    # CG terminates in <= n steps in exact arithmetic (well-conditioned, so no loss of orthogonality).
    assert 1 <= res.iterations <= n


def test_iterations_bounded_by_distinct_eigenvalues():
    """In exact arithmetic CG needs at most (#distinct eigenvalues) steps; 8 here, allow +2 for rounding."""
    n = 200
    g = torch.Generator().manual_seed(7)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    ev = torch.tensor([1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0], dtype=torch.float64).repeat_interleave(25)
    A = (Q * ev) @ Q.T
    b = torch.randn(n, dtype=torch.float64, generator=g)
    res = pcg(lambda v: A @ v, b, tol=1e-10)
    assert res.converged.all() and res.iterations <= 10


def test_block_rhs_per_column_flags_and_counts():
    n = 80
    A = spd(n, cond=1e3)
    evals, evecs = torch.linalg.eigh(A)
    g = torch.Generator().manual_seed(2)
    B = torch.stack(
        [
            torch.randn(n, dtype=torch.float64, generator=g),
            evecs[:, 5],  # an eigenvector: one iteration
            torch.zeros(n, dtype=torch.float64),  # zero rhs: zero iterations
            torch.randn(n, dtype=torch.float64, generator=g),
        ],
        dim=1,
    )
    res = pcg(lambda V: A @ V, B, tol=1e-8, maxiter=1000, record_history=True)
    assert res.x.shape == B.shape
    assert res.converged.tolist() == [True, True, True, True]
    assert res.iterations_per_column[1] == 1
    assert res.iterations_per_column[2] == 0
    assert res.iterations_per_column[0] > 5 and res.iterations == int(res.iterations_per_column.max())
    torch.testing.assert_close(res.x, torch.linalg.solve(A, B), rtol=1e-6, atol=1e-7)
    assert (res.rel_residual < 1e-7).all()
    assert res.residual_history.shape == (res.iterations + 1, 4)
    # Each column equals a solo solve (columns are independent).
    solo = pcg(lambda V: A @ V, B[:, 3], tol=1e-8, maxiter=1000)
    # rounding of blocked vs. single-column BLAS; past n = 80 iterations CG has lost orthogonality, so the counts
    # (~145) may drift by a few (143 vs 146 measured in one environment)
    assert abs(solo.iterations - int(res.iterations_per_column[3])) <= max(2, 0.05 * solo.iterations)
    torch.testing.assert_close(solo.x, res.x[:, 3], rtol=1e-6, atol=1e-7)


def test_maxiter_too_small_warns_and_flags():
    n = 100
    A = spd(n, cond=1e4)
    B = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with pytest.warns(ConvergenceWarning, match="did not reach"):
        res = pcg(lambda V: A @ V, B, tol=1e-10, maxiter=5)
    assert not res.converged.any()
    assert res.iterations == 5 and (res.iterations_per_column == 5).all()
    assert (res.rel_residual > 1e-10).all()
    # the warning is a NumericalWarning and can be filtered or turned into an error
    assert issubclass(ConvergenceWarning, NumericalWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericalWarning)
        with pytest.raises(ConvergenceWarning):
            pcg(lambda V: A @ V, B, tol=1e-10, maxiter=5)


def test_perfect_preconditioner_one_or_two_iterations():
    n = 70
    A = spd(n, cond=1e6)
    B = torch.randn(n, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    res = pcg(lambda V: A @ V, B, precond=lambda R: torch.linalg.solve(A, R), tol=1e-8)
    assert res.converged.all()
    assert 1 <= res.iterations <= 2
    torch.testing.assert_close(res.x, torch.linalg.solve(A, B), rtol=1e-7, atol=1e-9)


def test_initial_guess_and_bad_input():
    n = 30
    A = spd(n)
    b = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x = torch.linalg.solve(A, b)
    res = pcg(lambda v: A @ v, b, x0=x, tol=1e-6)
    assert res.iterations == 0 and res.converged.all()
    with pytest.raises(ValueError):
        pcg(lambda v: A @ v, b, tol=0.0)
    with pytest.raises(ValueError):
        pcg(lambda v: A @ v, b, maxiter=-1)
    with pytest.raises(ValueError):
        pcg(lambda v: A @ v, torch.full((n,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError):
        pcg(lambda v: A @ v, b, x0=torch.zeros(n + 1, dtype=torch.float64))
    with pytest.raises(TypeError):
        pcg(lambda v: A @ v, b, precond=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_system_dense_and_blocked(dtype):
    X = points(300, dtype=dtype, scale=5.0)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).to(dtype)
    kernel.outputscale = 4.0  # stripped: K has unit variance
    dense = kernel_system(X, kernel, 0.1)
    blocked = kernel_system(X, kernel, 0.1, dense_limit_bytes=0)
    assert dense.dense and not blocked.dense
    with torch.no_grad():
        K = kernel.base_kernel(X).to_dense()
    V = torch.randn(300, 2, dtype=dtype, generator=torch.Generator().manual_seed(0))
    ref = K @ V + 0.1 * V
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(dense(V), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(blocked(V), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(blocked(V[:, 0]), ref[:, 0], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pcg_kernel_system_with_preconditioner(dtype):
    X = points(400, dtype=dtype, seed=1, scale=5.0)
    kernel = make_kernel("rbf", 1.0, dtype)
    mu = 1e-2
    A = kernel_system(X, kernel, mu)
    b = torch.rand(400, dtype=dtype, generator=torch.Generator().manual_seed(2)) - 0.5
    plain = pcg(A, b, tol=1e-4)
    P = PivotedCholeskyPreconditioner(X, kernel, mu, rank=100)
    pre = pcg(A, b, precond=P, tol=1e-4)
    assert plain.converged.all() and pre.converged.all()
    assert pre.iterations < plain.iterations
    assert pre.x.dtype == dtype
    assert float(pre.rel_residual[0]) < 2e-4


def test_mixed_dtypes_are_promoted_as_gpytorch_does():
    """float32 points with a float64 kernel, or a float32 right-hand side for a float64 system: solved in float64
    (not a raw dtype error), equal to the all-float64 solve."""
    import gpytorch

    from gpnys import pcg
    from gpnys.kernels.system import kernel_system

    g = torch.Generator().manual_seed(0)
    X = torch.rand(120, 2, generator=g, dtype=torch.float64)
    B = torch.randn(120, 2, generator=g, dtype=torch.float64)
    k = gpytorch.kernels.RBFKernel().double()
    ref = pcg(kernel_system(X, k, 0.1), B, tol=1e-10).x
    for system, rhs in ((kernel_system(X.float(), k, 0.1), B), (kernel_system(X, k, 0.1), B.float())):
        x = pcg(system, rhs, tol=1e-10).x
        assert x.dtype == torch.float64
        assert float((x - ref).abs().max()) <= 1e-5 * float(ref.abs().max())  # float32 inputs: rounded points


def _tight_and_loose(dtype: torch.dtype, device: torch.device | str = "cpu"):
    """A system whose spectrum decays to a floor (as a kernel matrix plus noise), with one column at a tight
    tolerance and eight at a loose one: the tight column's tail runs alone."""
    n = 300
    g = torch.Generator().manual_seed(11)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    ev = 1e3 * torch.exp(-torch.arange(n, dtype=torch.float64) / 8) + 1.0
    A = ((Q * ev) @ Q.T).to(device=device, dtype=dtype)
    B = torch.randn(n, 9, dtype=torch.float64, generator=g).to(device=device, dtype=dtype)
    tight = 1e-8 if dtype == torch.float64 else 1e-4
    tol = torch.full((9,), 1e-2, dtype=torch.float64)
    tol[0] = tight
    return A, B, tol, tight


def test_galerkin_step_is_the_a_norm_projection():
    """Against the dense formula W (Wᵀ A W)⁻¹ Wᵀ r, with a duplicated direction (a singular Wᵀ A W) left harmless."""
    n, m = 50, 12
    A = spd(n, cond=1e3, seed=3)
    g = torch.Generator().manual_seed(4)
    W = torch.randn(n, m, dtype=torch.float64, generator=g)
    R = torch.randn(n, 2, dtype=torch.float64, generator=g)
    ref = W @ torch.linalg.solve(W.mT @ A @ W, W.mT @ R)
    dx, dr = galerkin_step(W, A @ W, R)
    torch.testing.assert_close(dx, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(dr, A @ ref, rtol=1e-9, atol=1e-10)
    Wd = torch.cat([W, 3.0 * W[:, :1]], 1)
    dx2, _ = galerkin_step(Wd, A @ Wd, R)
    torch.testing.assert_close(dx2, ref, rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_project_shortens_the_tight_tail_and_keeps_the_answer(dtype):
    A, B, tol, tight = _tight_and_loose(dtype)
    run = lambda **kw: pcg(lambda V: A @ V, B, tol=tol, maxiter=400, lanczos=True, **kw)  # noqa: E731
    plain = run()
    project = torch.zeros(9, dtype=torch.bool)
    project[0] = True
    fast = run(project=project)
    assert fast.converged.all()
    assert fast.iterations_per_column[0] < 0.8 * plain.iterations_per_column[0]  # 120 -> 66 in float64
    x_ref = torch.linalg.solve(A.double(), B[:, 0].double())
    err = float((fast.x[:, 0].double() - x_ref).norm() / x_ref.norm())
    assert float(fast.rel_residual[0]) <= 10 * tight and err < 1e4 * tight  # cond 1e3
    # the loose columns, and their Lanczos coefficients, are the plain run's
    torch.testing.assert_close(fast.x[:, 1:], plain.x[:, 1:], rtol=1e-5, atol=1e-6)
    k = int(plain.iterations_per_column[1:].min())
    torch.testing.assert_close(fast.tridiagonal[0][:k, 1:], plain.tridiagonal[0][:k, 1:], rtol=1e-5, atol=1e-6)
    assert torch.equal(run(project=project).x, fast.x)  # deterministic


def test_project_over_its_budget_and_bad_input():
    A, B, tol, _ = _tight_and_loose(torch.float64)
    project = torch.zeros(9, dtype=torch.bool)
    project[0] = True
    plain = pcg(lambda V: A @ V, B, tol=tol, maxiter=400)
    starved = pcg(lambda V: A @ V, B, tol=tol, maxiter=400, project=project, store_bytes=1)
    assert torch.equal(starved.iterations_per_column, plain.iterations_per_column)
    torch.testing.assert_close(starved.x, plain.x, rtol=0, atol=0)
    with pytest.raises(ValueError, match="project"):
        pcg(lambda V: A @ V, B, tol=tol, project=project[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_project", [False, True])
def test_estimate_holds_the_stopped_columns_errors(dtype, with_project):
    """``estimate``: the errors ``A⁻¹ r_j`` of columns stopped at a loose tolerance, by the Galerkin projection over
    every column's directions, within 40 % of the dense ``A⁻¹ r_j`` (25 %; a low-rank Nyström-like ``M``, ``I`` past
    its rank, puts ``M⁻¹ r_j`` 4 times off); the answer itself is the run's without it (to the projection's
    rounding), and the estimate the same twice."""
    A, B, tol, _ = _tight_and_loose(dtype)
    ev, V = torch.linalg.eigh(A.double())
    top = V[:, -10:]
    M = lambda R: (top @ ((top.mT @ R.double()) / ev[-10:, None]) + (R.double() - top @ (top.mT @ R.double()))).to(R)  # noqa: E731
    project = torch.zeros(9, dtype=torch.bool)
    project[0] = with_project
    estimate = torch.zeros(9, dtype=torch.bool)
    estimate[1:5] = True
    run = lambda **kw: pcg(lambda V: A @ V, B, M, tol=tol, maxiter=400, project=project, **kw)  # noqa: E731
    res, plain = run(estimate=estimate), run()
    assert res.error_estimate.shape == (300, 4) and plain.error_estimate is None
    true = torch.linalg.solve(A.double(), res.residual[:, 1:5].double())
    rel = lambda E: float((E.double() - true).norm() / true.norm())  # noqa: E731
    assert rel(res.error_estimate) < 0.4 and rel(M(res.residual[:, 1:5])) > 2.0, (rel(res.error_estimate),)
    torch.testing.assert_close(res.x, plain.x)  # (the projection's solve takes more columns: its rounding moves)
    assert torch.equal(run(estimate=estimate).error_estimate, res.error_estimate)
    with pytest.raises(ValueError, match="estimate"):
        pcg(lambda V: A @ V, B, tol=tol, project=project | estimate, estimate=estimate | True)
    with pytest.raises(ValueError, match="estimate"):
        pcg(lambda V: A @ V, B, tol=tol, estimate=estimate[:3])


def test_estimate_at_a_breakdown_and_without_directions():
    """A column that breaks down (pᵀAp <= 0) leaves its direction out of the projection (its Gram matrix had turned
    indefinite and ``eigh`` failed); with no direction at all (``maxiter=0``) there is no estimate (``None``, not 0)."""
    g = torch.Generator().manual_seed(1)
    X = torch.rand(100, 2, generator=g, dtype=torch.float64)
    K = torch.exp(-torch.cdist(X, X).square() / 0.18) + 1e-2 * torch.eye(100, dtype=torch.float64)
    K[0, 0] = -5.0  # indefinite
    B = torch.randn(100, 4, generator=g, dtype=torch.float64)
    estimate = torch.tensor([False, True, True, False])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = pcg(lambda V: K @ V, B, tol=1e-3, project=torch.tensor([True, False, False, False]), estimate=estimate)
        assert bool(res.breakdown.all()) and bool(torch.isfinite(res.error_estimate).all())
        assert pcg(lambda V: K @ V, B, tol=1e-3, maxiter=0, estimate=estimate).error_estimate is None


@pytest.mark.cuda
def test_project_on_device(cuda_device):
    A, B, tol, tight = _tight_and_loose(torch.float64, cuda_device)
    project = torch.zeros(9, dtype=torch.bool, device=cuda_device)
    project[0] = True
    res = pcg(lambda V: A @ V, B, tol=tol, maxiter=400, project=project)
    assert res.converged.all() and float(res.rel_residual[0]) <= 10 * tight
