"""Preconditioned conjugate gradients for ``(K + mu I) X = B`` with per-column iteration counts.

Why not ``linear_operator.utils.linear_cg`` (linear_operator 0.6.1, read in full)? It solves the same
systems but is unsuitable for *measuring* preconditioners:

* it returns only the solution (plus Lanczos tridiagonals when ``n_tridiag > 0``); the number of
  iterations run is not returned at all (it appears only inside the text of a warning);
* its stopping test is ``residual_norm.mean() < tolerance`` -- the **mean over all columns** of the
  norm of the residual of the *normalised* system (each column of ``B`` is divided by its norm first),
  and it is only checked from iteration ``min(10, max_iter - 1)`` on, so at least 11 iterations always
  run even if the preconditioner is exact;
* a column is frozen only once its residual drops below ``stop_updating_after`` (default ``1e-10``),
  not at the user tolerance, so there are no per-column convergence flags or per-column counts;
* the residual it tests is the recursively updated one and is never recomputed, the iteration cap is
  additionally clipped to ``n`` when ``settings.terminate_cg_by_size`` is on, and the defaults come
  from global ``linear_operator.settings`` contexts (``cg_tolerance`` = 1 -- a mean relative residual
  of 1 -- and ``max_cg_iterations`` = 1000).

The AFN paper's experiments (its §5) need: stop each right-hand side when its relative residual
``||b - A x|| / ||b|| <= tol`` (1e-4), at most 500 iterations, ``x0 = 0``, and report the iteration count.
:func:`pcg` does exactly this, column-wise independently (each column has its own ``alpha``/``beta`` and is frozen
when it converges), and recomputes the *true* residual at the end.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from gpnys.budget import block_bytes
from gpnys.checks import NumericalWarning
from gpnys.linalg import small_dense
from gpnys.precond.base import Preconditioner

__all__ = ["PCGResult", "ConvergenceWarning", "NonFiniteError", "pcg", "galerkin_step", "STORE_BLOCKS"]

#: memory blocks (:func:`gpnys.budget.block_bytes`) the directions kept for a Galerkin step may take by default
STORE_BLOCKS = 8

Matmul = Callable[[torch.Tensor], torch.Tensor]
#: ``((diag, offdiag), steps, rel) -> bool``: whether the Lanczos quadrature of the tridiagonals so far has converged
#: (``rel``: each column's relative residual now)
QuadratureTest = Callable[[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor], bool]
PrecondLike = Union[Preconditioner, Matmul, None]


class NonFiniteError(FloatingPointError):
    """A product ``A p``, a preconditioner apply or the final residual of :func:`pcg` held NaN or inf: the system
    is not finite (e.g. a kernel matrix at extreme hyperparameters). Raised at once, never a truncated solve."""


class ConvergenceWarning(NumericalWarning):
    """PCG stopped before every column reached the tolerance (or lost accuracy); see :class:`PCGResult`."""


@dataclass
class PCGResult:
    """Output of :func:`pcg`. ``t`` is the number of right-hand sides (1 for a vector ``b``).

    Attributes:
        x: solution, same shape as ``B`` (``(n,)`` or ``(n, t)``).
        iterations: max over columns of the iterations run (int).
        iterations_per_column: ``(t,)`` long, iterations each column ran before it converged or stopped.
        rel_residual: ``(t,)``, the TRUE relative residual ``||b - A x|| / ||b||`` recomputed at the end
            with one extra product (``||r||`` itself for a zero column ``b``).
        converged: ``(t,)`` bool, the column met the stopping test ``||r_k|| <= tol ||b||`` on the
            recursively updated residual (the standard PCG test, as in the paper's code).
        residual_history: ``(iterations + 1, t)`` recursive relative residuals per iteration if
            ``record_history=True`` (frozen columns repeat their last value), else ``None``.
        breakdown: ``(t,)`` bool, the column stopped because ``p^T A p <= 0`` or ``r^T M^{-1} r <= 0``
            (matrix or preconditioner not numerically SPD, or an exact solution was hit).
        residual: the true residual ``B - A X`` (shape of ``B``).
        tridiagonal: with ``lanczos=True``, ``(diag, offdiag)`` of shapes ``(iterations, t)`` and
            ``(iterations - 1, t)``: column ``j``'s first ``iterations_per_column[j]`` (resp. one fewer) entries are
            the Lanczos tridiagonal of ``M^{-1/2} A M^{-1/2}`` started at ``M^{-1/2} b_j`` (Saad 2003, Sec. 6.7.3);
            the rest is padding. Only meaningful for columns started at 0 (``x0`` ``None`` or 0 there).
        abs_products: ``A |x_j|`` of the first ``abs_columns`` columns, ``(n, abs_columns)``.
        error_estimate: with ``estimate``, ``(n, s)`` Galerkin estimates of ``A⁻¹ r_j`` for its ``s`` columns, in
            column order (``None`` where the directions exceeded ``store_bytes``, or there were none).
    """

    x: torch.Tensor
    iterations: int
    iterations_per_column: torch.Tensor
    rel_residual: torch.Tensor
    converged: torch.Tensor
    residual_history: torch.Tensor | None = None
    breakdown: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    tridiagonal: tuple[torch.Tensor, torch.Tensor] | None = None
    abs_products: torch.Tensor | None = None
    error_estimate: torch.Tensor | None = None


def _as_precond(precond: PrecondLike) -> Matmul | None:
    if precond is None:
        return None
    if isinstance(precond, Preconditioner):
        return precond.solve
    if callable(precond):
        return precond
    raise TypeError(f"precond must be a Preconditioner, a callable or None, got {type(precond)}")


def _size(matmul: Matmul) -> int | None:
    """The order of the operator ``matmul`` where it says (a tensor's or LinearOperator's ``shape``, a kernel
    system's ``n``), else ``None``."""
    shape = getattr(matmul, "shape", None)
    if isinstance(shape, tuple) and len(shape) == 2:
        return int(shape[-1])
    n = getattr(matmul, "n", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def pcg(
    matmul: Matmul,
    B: torch.Tensor,
    precond: PrecondLike = None,
    tol: float | torch.Tensor = 1e-4,
    maxiter: int = 500,
    x0: torch.Tensor | None = None,
    record_history: bool = False,
    lanczos: bool = False,
    miniter: int = 0,
    quadrature: Optional[QuadratureTest] = None,
    abs_columns: int = 0,
    project: torch.Tensor | None = None,
    store_bytes: int | None = None,
    estimate: torch.Tensor | None = None,
) -> PCGResult:
    """Solve ``A X = B`` (``A`` SPD, given by ``matmul``) by preconditioned CG, column by column.

    Each column ``j`` runs the textbook PCG recursion with its own ``alpha_j``, ``beta_j`` and stops
    (is frozen) as soon as ``||r_j|| <= tol * ||b_j||``; products with ``A`` and ``M^{-1}`` are applied
    only to the still-active columns, as one block. After the loop the true residual ``B - A X`` is
    recomputed. A :class:`ConvergenceWarning` is issued if any column did not converge, or if a converged
    column's true residual exceeds ``10 * tol`` (recursive residual drift, e.g. float32).

    Args:
        matmul: ``V (n, s) -> A V (n, s)`` for SPD ``A`` (n x n).
        B: right-hand sides, ``(n,)`` or ``(n, t)``.
        precond: ``M^{-1}``: a gpnys :class:`~gpnys.precond.base.Preconditioner` (its ``solve`` is used),
            a callable ``R (n, s) -> M^{-1} R (n, s)``, or ``None`` (plain CG).
        tol: relative residual tolerance (> 0): one for all columns, or a ``(t,)`` tensor of one per column.
        maxiter: maximum iterations per column (>= 0).
        x0: optional initial guess, same shape as ``B`` (default 0).
        record_history: store the per-iteration recursive relative residuals.
        lanczos: record the Lanczos tridiagonals of the CG coefficients (``PCGResult.tridiagonal``), for
            stochastic Lanczos quadrature.
        miniter: no column stops before this many iterations (unless it breaks down): a floor on the Lanczos
            steps of a quadrature.
        quadrature: with ``lanczos``, lifts that floor early: called with the tridiagonals so far (the layout of
            ``PCGResult.tridiagonal``), each column's steps and relative residual once a column has met its
            tolerance but not the floor; from its first ``True`` on, columns stop at their tolerance alone.
        abs_columns: also multiply ``|x_j|`` for the first ``abs_columns`` columns, in the same product as the
            true residual (no product of their own): ``PCGResult.abs_products`` ``(n, abs_columns)``.
        project: ``(t,)`` bool, columns that take one Galerkin step over every column's search directions once
            they are the only ones still active (:func:`galerkin_step`; the probes' Krylov spaces then shorten the
            tail of a tighter solve), after which their CG restarts; their tridiagonals are no Lanczos process past
            it. ``None``: no step.
        store_bytes: largest size of the directions and their products kept for ``project``, counted twice (the
            step joins them into one block each; default: eight memory blocks, :func:`gpnys.budget.block_bytes`);
            past it they are dropped and no step is taken.
        estimate: ``(t,)`` bool, columns outside ``project`` whose errors ``A⁻¹ r_j`` are estimated, not applied,
            by the same Galerkin projection once every column outside ``project`` has stopped (or at
            ``maxiter``): ``PCGResult.error_estimate``. The other columns' Krylov spaces hold most of a column's
            error, where the preconditioned residual ``M⁻¹ r_j`` can be off by orders of magnitude (a low-rank
            Nyström ``M``). ``None``: none.

    Returns:
        :class:`PCGResult`.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.kernels.system import kernel_system
        >>> from gpnys.solvers import pcg
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.RBFKernel().double()
        >>> A = kernel_system(X, kernel, mu=0.1)  # v -> (K + 0.1 I) v
        >>> B = torch.randn(200, 3, dtype=torch.float64, generator=g)
        >>> res = pcg(A, B, tol=1e-10)
        >>> K = kernel(X).to_dense().detach()
        >>> x_ref = torch.linalg.solve(K + 0.1 * torch.eye(200, dtype=torch.float64), B)
        >>> torch.allclose(res.x, x_ref, atol=1e-6)
        True
        >>> res.converged.tolist(), bool((res.rel_residual <= 1e-9).all())
        ([True, True, True], True)
    """
    if not isinstance(B, torch.Tensor) or B.dim() not in (1, 2) or not B.is_floating_point():
        raise ValueError(f"B must be a floating (n,) or (n, t) tensor, got {getattr(B, 'shape', type(B))}")
    size = _size(matmul)
    if size is not None and B.shape[0] != size:
        raise ValueError(f"B must have the operator's {size} rows, got shape {tuple(B.shape)}")
    tols = torch.as_tensor(tol, dtype=torch.float64).reshape(-1)
    if tols.numel() == 0 or not bool(((tols > 0) & torch.isfinite(tols)).all()):
        raise ValueError(f"tol must be positive and finite, got {tol!r}")
    if isinstance(maxiter, bool) or int(maxiter) != maxiter or maxiter < 0:
        raise ValueError(f"maxiter must be a non-negative integer, got {maxiter!r}")
    if isinstance(miniter, bool) or int(miniter) != miniter or miniter < 0:
        raise ValueError(f"miniter must be a non-negative integer, got {miniter!r}")
    if not torch.isfinite(B).all():
        raise ValueError("B contains NaN or inf")
    system_dtype = getattr(matmul, "dtype", None)  # e.g. KernelSystem: solve in the promoted dtype, as GPyTorch
    if isinstance(system_dtype, torch.dtype) and system_dtype != B.dtype:
        B = B.to(torch.promote_types(B.dtype, system_dtype))
    apply_m = _as_precond(precond)
    vec = B.dim() == 1
    Bm = B[:, None] if vec else B
    n, t = Bm.shape

    if x0 is None:
        X = torch.zeros_like(Bm)
        R = Bm.clone()
    else:
        if x0.shape != B.shape:
            raise ValueError(f"x0 must have the shape of B {tuple(B.shape)}, got {tuple(x0.shape)}")
        if not torch.isfinite(x0).all():
            raise ValueError("x0 contains NaN or inf")
        X = (x0[:, None] if vec else x0).to(Bm).clone()
        R = Bm.clone()
        started = torch.nonzero(X.abs().amax(0) > 0).reshape(-1)  # columns with a nonzero guess: one product
        if started.numel():
            R[:, started] -= matmul(X[:, started])

    bnorm = torch.linalg.vector_norm(Bm, dim=0)
    denom = torch.where(bnorm > 0, bnorm, torch.ones_like(bnorm))
    rel = torch.linalg.vector_norm(R, dim=0) / denom
    if tols.numel() not in (1, t):
        raise ValueError(f"tol must be a number or one per column ({t}), got {tols.numel()} values")
    tol_col = tols.to(device=Bm.device, dtype=rel.dtype).expand(t)
    tol = float(tols.max())  # for the messages
    converged = rel <= tol_col
    breakdown = torch.zeros(t, dtype=torch.bool, device=B.device)
    its = torch.zeros(t, dtype=torch.long, device=B.device)
    history = [rel.clone()] if record_history else None

    Z = apply_m(R) if apply_m is not None else R.clone()
    P = Z.clone()
    rz = (R * Z).sum(0)
    # Lanczos coefficients (alpha_k, beta_k) per iteration and column; NaN where a column was inactive
    alphas: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    floor = int(miniter)
    if floor > 0:
        converged = converged & (rel == 0)
    if quadrature is not None and not lanczos:
        raise ValueError("quadrature needs lanczos=True")

    active = ~converged
    # the search directions and their products, for the Galerkin step of the columns in ``project``
    store: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    errors: torch.Tensor | None = None  # the estimated errors of the columns in ``estimate``
    if project is not None or estimate is not None:
        flags_of = {}
        for name, mask in (("project", project), ("estimate", estimate)):
            mask = torch.zeros(t, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
            if mask.numel() != t:
                raise ValueError(f"{name} must hold one flag per column ({t}), got {mask.numel()}")
            flags_of[name] = mask.reshape(-1).to(B.device)
        project, estimate = flags_of["project"], flags_of["estimate"]
        if bool((project & estimate).any()):
            raise ValueError("estimate: a column of project takes its Galerkin step; its error is not estimated")
        estimated = torch.nonzero(estimate).flatten()
        store = [] if bool(project.any()) or estimated.numel() else None
        cap = block_bytes(B.device) * STORE_BLOCKS if store_bytes is None else int(store_bytes)
        stored = 0  # bytes of the directions and products kept, and of their joined copies at the step
    for step in range(int(maxiter)):
        idx = torch.nonzero(active).flatten()
        if idx.numel() == 0:
            break
        Pa = P[:, idx]
        APa = matmul(Pa)
        pap = (Pa * APa).sum(0)
        rza = rz[idx]
        nonfinite = ~torch.isfinite(pap) | ~torch.isfinite(rza)  # a NaN / inf in a product or preconditioner apply
        bad = ~(pap > 0) | ~(rza > 0) | nonfinite
        if store is not None:  # (a broken-down column's direction is left out at the step: galerkin_step)
            store.append((Pa, APa))
            stored += 4 * Pa.numel() * Pa.element_size()
            if stored > cap:
                store = None  # over its budget: no step
        alpha = torch.where(bad, torch.zeros_like(rza), rza / torch.where(bad, torch.ones_like(pap), pap))
        X[:, idx] += alpha * Pa
        Ra = R[:, idx] - alpha * APa
        R[:, idx] = Ra
        its[idx] += (~bad).long()
        rel_a = torch.linalg.vector_norm(Ra, dim=0) / denom[idx]
        rel[idx] = rel_a
        if lanczos:
            alphas.append(torch.full_like(rz, math.nan).index_put((idx,), alpha))
            betas.append(torch.full_like(rz, math.nan))
        met = rel_a <= tol_col[idx]
        if quadrature is not None and step + 1 < floor and bool((met & (rel_a > 0)).any()):
            if quadrature(_tridiagonal(alphas, betas, Bm), its.clone(), rel.clone()):
                floor = 0  # the quadrature has converged: the tolerances alone stop the columns from here
        conv_a = met & ((step + 1 >= floor) | (rel_a == 0))
        converged[idx] = conv_a
        breakdown[idx] = bad & ~conv_a
        still = ~conv_a & ~bad
        active[idx] = still
        if record_history:
            history.append(rel.clone())
        flags = [still.any(), nonfinite.any()]
        if store is not None:  # whether columns of ``project`` go on, and whether any others do
            flags += [(still & project[idx]).any(), (still & ~project[idx]).any()]
        go_on, broken, *going = torch.stack(flags).tolist()  # one host sync per iteration
        if broken:
            column = int(idx[nonfinite][0])
            raise NonFiniteError(f"PCG: a product or preconditioner apply returned NaN or inf at iteration {step + 1} "
                                 f"(column {column}): the operator or preconditioner is not finite")
        keep = idx[still]
        restart = False
        if store is not None and not going[0] and not estimated.numel():
            store = None  # the columns that would take the step have all stopped
        if store is not None and not going[1]:
            # the columns left may take their Galerkin step over every direction so far, then restart; the errors
            # of the estimated columns (all stopped now) come from the same projection
            W, AW = (torch.cat(part, 1) for part in zip(*store))
            store = None
            movers = keep if going[0] and W.shape[1] else keep[:0]  # (no direction: the columns broke down)
            if W.shape[1]:
                dx, dr = galerkin_step(W, AW, torch.cat([R[:, movers], R[:, estimated]], 1))
                errors = dx[:, movers.numel():] if estimated.numel() else None
                dx, dr = dx[:, : movers.numel()], dr[:, : movers.numel()]
            restart = movers.numel() > 0
        if not go_on:
            break
        if restart:
            X[:, keep] += dx
            R[:, keep] -= dr
            rel[keep] = torch.linalg.vector_norm(R[:, keep], dim=0) / denom[keep]
            done = rel[keep] <= tol_col[keep]
            converged[keep] = done
            active[keep] = ~done
            if record_history:
                history[-1] = rel.clone()
            keep = keep[~done]
            if keep.numel() == 0:
                break
        # Update search directions only for the columns that go on (restarted ones: the preconditioned residual).
        Rk = R[:, keep]
        Zk = apply_m(Rk) if apply_m is not None else Rk
        rz_new = (Rk * Zk).sum(0)
        if restart:
            P[:, keep] = Zk
        else:
            beta = rz_new / rz[keep]
            if lanczos:
                betas[-1][keep] = beta
            P[:, keep] = Zk + beta * P[:, keep]
        rz[keep] = rz_new

    if store and errors is None and estimated.numel():  # the estimated columns ran to maxiter
        W, AW = (torch.cat(part, 1) for part in zip(*store))
        errors = galerkin_step(W, AW, R[:, estimated])[0] if W.shape[1] else None  # (no direction: no estimate)
    if abs_columns:
        both = matmul(torch.cat([X, X[:, :abs_columns].abs()], 1))
        residual, abs_products = Bm - both[:, :t], both[:, t:]
    else:
        residual, abs_products = Bm - matmul(X), None
    true_res = torch.linalg.vector_norm(residual, dim=0) / denom
    if not bool(torch.isfinite(true_res).all()):
        raise NonFiniteError("PCG: the final residual is NaN or inf: the operator is not finite")
    if not bool(converged.all()):
        bad_cols = int((~converged).sum())
        warnings.warn(
            f"PCG: {bad_cols} of {t} column(s) did not reach rel. residual {tol:g} in {int(its.max())} "
            f"iterations (maxiter={maxiter}); worst true rel. residual {float(true_res.max()):.3g}"
            + (f"; {int(breakdown.sum())} column(s) broke down (not numerically SPD)" if breakdown.any() else ""),
            ConvergenceWarning,
            stacklevel=2,
        )
    elif bool((true_res > 10 * tol_col).any()):
        warnings.warn(
            f"PCG: recursive residuals met tol={tol:g} but the true rel. residual is up to "
            f"{float(true_res.max()):.3g} (loss of accuracy; try float64 or a smaller tol)",
            ConvergenceWarning,
            stacklevel=2,
        )
    return PCGResult(
        x=X[:, 0] if vec else X,
        iterations=int(its.max()) if t else 0,
        iterations_per_column=its,
        rel_residual=true_res,
        converged=converged,
        residual_history=torch.stack(history) if record_history else None,
        breakdown=breakdown,
        residual=residual[:, 0] if vec else residual,
        tridiagonal=_tridiagonal(alphas, betas, Bm) if lanczos else None,
        abs_products=abs_products,
        error_estimate=errors,
    )


def galerkin_step(W: torch.Tensor, AW: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Galerkin correction of iterates with residuals ``R`` over the directions ``W``: ``(W c, (A W) c)`` with
    ``(Wᵀ A W) c = Wᵀ R``, which minimises each column's ``A``-norm error over ``x + span(W)`` (the projection that
    starts augmented CG, Erhel & Guyomarc'h 2000, SIAM J. Matrix Anal. Appl. 21(4), §2). The directions are scaled
    to a unit ``A``-norm and those of ``Wᵀ A W``'s eigenvectors below ``m eps`` of its largest eigenvalue are left
    out, so dependent directions (overlapping Krylov spaces) cannot blow it up; so are directions with ``wᵀAw <= 0``
    (a column that broke down).

    Args:
        W: ``(n, m)`` directions; AW: ``(n, m)`` their products with ``A``; R: ``(n, s)`` residuals.

    Returns:
        ``(dx, dr)``, ``(n, s)`` each: add ``dx`` to the iterates and subtract ``dr`` from the residuals.

    Example:
        >>> import torch
        >>> from gpnys.solvers.pcg import galerkin_step
        >>> g = torch.Generator().manual_seed(0)
        >>> Q = torch.randn(30, 30, dtype=torch.float64, generator=g)
        >>> A = Q @ Q.mT + torch.eye(30, dtype=torch.float64)
        >>> b = torch.randn(30, 1, dtype=torch.float64, generator=g)
        >>> W = torch.randn(30, 30, dtype=torch.float64, generator=g)  # a full span: the exact solution
        >>> dx, dr = galerkin_step(W, A @ W, b)
        >>> torch.allclose(dx, torch.linalg.solve(A, b)), torch.allclose(dr, b)
        (True, True)
    """
    diag = (W * AW).sum(0)
    good = torch.isfinite(diag) & (diag > 0)
    if not bool(good.all()):  # a broken-down column's direction (pᵀAp <= 0): its unit scaling would overflow
        W, AW = W[:, good], AW[:, good]
    m = W.shape[1]
    if m == 0:
        return torch.zeros_like(R), torch.zeros_like(R)
    gram = W.mT @ AW
    scale = gram.diagonal().clamp_min(torch.finfo(W.dtype).tiny).rsqrt()
    gram = scale[:, None] * (0.5 * (gram + gram.mT)) * scale[None, :]
    with small_dense(m, W.device):
        ev, Q = torch.linalg.eigh(gram)
    keep = ev > ev[-1] * m * torch.finfo(W.dtype).eps
    Q, ev = Q[:, keep], ev[keep]
    c = scale[:, None] * (Q @ ((Q.mT @ (scale[:, None] * (W.mT @ R))) / ev[:, None]))
    return W @ c, AW @ c


def _tridiagonal(alphas: list[torch.Tensor], betas: list[torch.Tensor],
                 B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lanczos ``T`` from CG's coefficients: ``T_kk = 1/alpha_k + beta_{k-1}/alpha_{k-1}``,
    ``T_{k,k+1} = sqrt(beta_k) / alpha_k`` (Saad 2003, eq. 6.103), padded with NaN past a column's end."""
    if not alphas:
        empty = B.new_zeros(0, B.shape[1])
        return empty, empty
    a = torch.stack(alphas)  # (m, t)
    b = torch.stack(betas)
    diag = 1.0 / a
    diag[1:] += b[:-1] / a[:-1]
    off = b[:-1].sqrt() / a[:-1]
    return diag, off
