"""``s^2 k(X, X; l)`` as a ``LinearOperator`` with a blocked, closed-form hyperparameter derivative.

GPyTorch's CG path evaluates the training kernel as a dense tensor *with autograd*: every elementwise step of the
kernel (distances, exponentials, polynomial factors, ...) keeps an ``n x n`` temporary for the backward pass, and
the backward through them is a large share of a training step (docs/training.md). :class:`StationaryKernelOperator`
instead

* keeps the ``n x n`` unit-variance kernel ``K`` and ``H = k'(R)/R`` (below; RBF's ``H = -K`` is not stored)
  without autograd, computed in one pass (or, above ``dense_limit_bytes``, recomputes row blocks on the fly:
  memory ``O(b n)``);
* answers ``_bilinear_derivative(U, V)`` — the only derivative GPyTorch's ``inv_quad_logdet`` asks for,
  ``d/dtheta sum_t u_t^T K v_t`` — in closed form, one row block at a time.

Closed form. For a stationary kernel ``k(r)`` with ``r^2 = sum_d (x_d - x'_d)^2 / l_d^2``, let ``h(r) = k'(r) / r``
(RBF: ``-exp(-r^2/2)``; Matérn-1/2: ``-exp(-r)/r``; 3/2: ``-3 exp(-sqrt3 r)``; 5/2:
``-(5/3)(1 + sqrt5 r) exp(-sqrt5 r)``). With ``W = U V^T`` and ``A = W o h(R)`` (elementwise) and ``z = x / l``,

    d/d l_d  sum_ij s^2 W_ij k(r_ij) = -(s^2 / l_d) sum_ij A_ij (z_id - z_jd)^2
                                     = -(s^2 / l_d) [z_d^T diag(A 1) z_d + z_d^T diag(A^T 1) z_d - 2 z_d^T A z_d],
    d/d s^2                          = sum_ij W_ij k(r_ij) = sum_t u_t^T K v_t,

each a pass over row blocks of ``A`` (``O(n^2 (t + d))`` flops, ``O(b n)`` memory).

Cutoff. Without the dense cache, blocks whose entries are all ``<= prune_tol`` (machine epsilon by default) are
skipped: the points are sorted into k-d tree leaves and each leaf meets only the leaves within the cutoff radius
(:mod:`gpnys.kernels.cutoff`). Products and derivatives then cost ``O(n m (t + d))`` with ``m`` the neighbours
per leaf, instead of ``O(n^2 (t + d))``.

Backends. The recomputed passes run on one of :mod:`gpnys.kernels.backends`: torch tiles on CPU, fused Triton
kernels on CUDA (both block-sparse over the cutoff plan), KeOps only when asked for. Written by hand because
neither GPyTorch nor linear_operator offers a kernel operator whose derivative avoids the autograd graph on CPU
(GPyTorch's KeOps kernels do so on GPUs only, through KeOps).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import gpytorch
import torch
from linear_operator.operators import LinearOperator

from gpnys.budget import block_rows, fill_rows
from gpnys.budget import dense_limit_bytes as budget_dense_limit
from gpnys.collectives import partitioned, resolve_group
from gpnys.kernels.backends import LEAF, make_backend, select_backend
from gpnys.kernels.backends.base import KernelBackend
from gpnys.kernels.backends.dense import DenseBackend, LastProduct
from gpnys.kernels.backends.partitioned import PartitionedBackend
from gpnys.kernels.backends.torch_tiles import Tile, TorchTiles, squared_norms
from gpnys.kernels.cutoff import LeafPlan, cutoff_radius, leaf_plan, spatial_order
from gpnys.kernels.formulas import formula, k_of_r
from gpnys.kernels.product import choose_product

__all__ = ["StationaryKernelOperator", "supported"]


def _nu(base: gpytorch.kernels.Kernel) -> float | None:
    return None if isinstance(base, gpytorch.kernels.RBFKernel) else float(base.nu)


def supported(base: gpytorch.kernels.Kernel) -> bool:
    """True for a plain (unbatched, all-dimensions) GPyTorch RBF or Matérn kernel."""
    return (
        type(base) in (gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel)
        and base.active_dims is None
        and len(base.batch_shape) == 0
    )


class StationaryKernelOperator(LinearOperator):
    """``outputscale * k(X, X)`` (``(n, n)``) for a GPyTorch RBF/Matérn ``base`` kernel.

    Args:
        X: ``(n, d)`` inputs (no gradient is propagated to them).
        outputscale: 0-dim tensor ``s^2`` (carries autograd to the raw parameter).
        lengthscale: ``(1, 1)`` or ``(1, d)`` tensor, ``base.lengthscale`` (carries autograd).
        base: the unit-variance GPyTorch kernel whose current hyperparameters equal ``lengthscale``.
        cache: a dict shared across reconstructions (GPyTorch rebuilds operators from their representation) that
            holds the dense unit kernel (or the cutoff plan) for the current length-scale.
        dense_limit_bytes: cache the dense K (and, for Matérn, H) only up to this many bytes together; above,
            matmuls recompute the kernel on the fly. ``None``: the memory budget's for ``X``'s device
            (:mod:`gpnys.budget`: 4 GiB on CPU — Matérn n ~ 16 000 in float64 —, a share of the free memory on
            CUDA).
        prune_tol: on the recomputed path, skip leaf pairs whose unit-kernel entries are all ``<= prune_tol``
            (their distance exceeds :func:`~gpnys.kernels.cutoff.cutoff_radius`); ``None``: machine epsilon of
            ``X``'s dtype (each skipped entry is below the rounding of the diagonal); ``0``: never skip. Used only
            when it removes at least :attr:`MIN_SKIPPED` of the entries.
        backend: the recomputed passes' backend (:func:`gpnys.kernels.backends.select_backend`): ``None`` picks
            Triton on CUDA and torch tiles elsewhere; ``"torch"``, ``"triton"`` or ``"keops"`` forces one. The
            dense cache, when it fits, comes first either way.
        tf32: let the Triton backend's float32 tile products use TF32 (~1e-3 relative error); off by default.
        group: split the recomputed passes by rows over the ranks of a ``torch.distributed`` process group
            (``True``: the default group; :mod:`gpnys.kernels.backends.partitioned`); no dense cache then. Every
            rank must hold the same ``X`` and right-hand sides.
    """

    #: points per leaf of the cutoff plan (rows of one on-the-fly tile; the Triton backend's tile size)
    LEAF = LEAF
    #: the cutoff plan is used only when it skips at least this share of the n^2 entries
    MIN_SKIPPED = 0.25

    def __init__(
        self,
        X: torch.Tensor,
        outputscale: torch.Tensor,
        lengthscale: torch.Tensor,
        *,
        base: gpytorch.kernels.Kernel,
        cache: dict[str, Any],
        dense_limit_bytes: int | None = None,
        prune_tol: float | None = None,
        backend: str | None = None,
        tf32: bool = False,
        group: Any = None,
    ) -> None:
        limit = budget_dense_limit(X.device) if dense_limit_bytes is None else int(dense_limit_bytes)
        if partitioned(group):  # row-partitioned: every rank recomputes only its rows
            group, limit = resolve_group(group), 0
        else:
            group = None
        if prune_tol is not None and not prune_tol >= 0:
            raise ValueError(f"prune_tol must be >= 0 (or None), got {prune_tol}")
        tol = torch.finfo(X.dtype).eps if prune_tol is None else float(prune_tol)
        name = select_backend(X.device, backend)
        super().__init__(X, outputscale, lengthscale, base=base, cache=cache, dense_limit_bytes=limit, prune_tol=tol,
                         backend=name, tf32=bool(tf32), group=group)  # (kwargs rebuild the operator: keep them all)
        self.X, self.outputscale, self.lengthscale = X, outputscale, lengthscale
        self.base, self.cache = base, cache
        self.dense_limit_bytes = limit
        self.prune_tol = tol
        self.nu = _nu(base)
        self.formula = formula(self.nu)
        local = make_backend(name, self.formula, tf32)
        self.tiles = local if isinstance(local, TorchTiles) else TorchTiles(self.formula, tf32)
        self.group = group
        self.backend = local if group is None else PartitionedBackend(local, group)

    @property
    def keops(self) -> bool:
        """Whether the recomputed passes run on KeOps."""
        return getattr(self.backend, "inner", self.backend).name == "keops"

    # -- values -------------------------------------------------------------------------------------------
    def _block_rows(self) -> int:
        return block_rows(self.X.shape[0], device=self.X.device)

    def _scaled(self) -> torch.Tensor:
        """``z = (x - mean) / l`` (``(n, d)``); centring keeps ``(z_i - z_j)^2`` accurate in float32."""
        return (self.X - self.X.mean(0)) / self.lengthscale.detach().reshape(-1)

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Cached dense ``(K, H)`` (unit kernel and ``k'/r``; ``H`` is ``None`` for RBF) for the current
        length-scale, or ``None`` if too big. The buffers are reused across length-scales (no fresh n^2
        allocation per training step)."""
        n = self.X.shape[0]
        share = (lambda: None if (plan := self.plan()) is None else plan.fraction) if self.backend.name == "triton" \
            else None  # the fused kernels over a small enough plan share beat reading a stored K
        if choose_product(n, self.X.element_size(), closed_form=True, dense_limit_bytes=self.dense_limit_bytes,
                          matern=self.nu is not None, partitioned=self.group is not None, fused_share=share) != "dense":
            return None
        key = self._key()
        if self.cache.get("X") is not self.X or self.cache.get("key") != key:
            K, H = self.cache.get("K"), self.cache.get("H")
            if K is None or K.shape != (n, n) or K.dtype != self.X.dtype or K.device != self.X.device:
                K = torch.empty(n, n, dtype=self.X.dtype, device=self.X.device)
                H = None
            if self.nu is None:
                H = None
            elif H is None:
                H = torch.empty_like(K)
            D = None
            if self._caches_derivative():
                D = self.cache.get("D")
                if D is None or D.shape != K.shape or D.dtype != K.dtype or D.device != K.device:
                    D = torch.empty_like(K)
            Z, bs = self._scaled(), fill_rows(n, self.X.device)
            sq = squared_norms(Z)
            zmax = float(sq.max().sqrt()) if Z.numel() else 0.0
            scratch = Z.new_empty(min(bs, n) * n)
            padded = self.tiles.padded(Z, sq)
            for a in range(0, n, bs):
                rows = slice(a, min(a + bs, n))
                m = rows.stop - a
                self.tiles.fill(Z[rows], Z, sq, rows, slice(None), (K[rows], None if H is None else H[rows]),
                                scratch[: m * n].view(m, n), zmax, None if D is None else D[rows], padded)
            self.cache.setdefault("last_product", LastProduct()).clear()  # a product of the old K answers nothing
            self.cache.update(X=self.X, key=key, K=K, H=H, D=D)
        return self.cache["K"], self.cache["H"]

    def _caches_derivative(self) -> bool:
        """Whether the dense cache also holds ``D = A o R² / 2`` (``A = -K`` for RBF, ``H`` for Matérn; self-pairs
        0), half the isotropic length-scale derivative's matrix, filled in the same tiles as ``K``: an isotropic float64
        kernel whose ``K`` (and ``H``) and ``D`` fit the dense budget together. The derivative pass is then two
        products instead of recomputing every tile's distances."""
        n, matern = self.X.shape[0], self.nu is not None
        return (self.lengthscale.numel() == 1 and self.X.dtype == torch.float64
                and ((2 if matern else 1) + 1) * n * n * self.X.element_size() <= self.dense_limit_bytes)

    def _key(self) -> tuple:
        """The inputs (by version; identity is checked separately), the kernel family (``nu``; ``None`` for RBF) and
        the length-scale key the caches."""
        return (self.X._version, self.nu, tuple(self.lengthscale.detach().reshape(-1).tolist()))

    def plan(self) -> LeafPlan | None:
        """The cutoff plan for the current length-scale (cached), or ``None`` when it would skip less than
        :attr:`MIN_SKIPPED` of the entries (or ``prune_tol`` is 0, or the backend is KeOps, which computes every
        pair)."""
        radius = cutoff_radius(self.nu, self.prune_tol)
        key = (*self._key(), radius)
        if self.cache.get("plan_X") is not self.X or self.cache.get("plan_key") != key:
            Z = self._scaled()
            plan = None
            if (math.isfinite(radius) and not self.keops and Z.shape[0] > self.LEAF
                    and float((Z.amax(0) - Z.amin(0)).norm()) > radius):
                plan = leaf_plan(Z, spatial_order(Z, self.LEAF), self.LEAF, radius)
                plan = plan if plan.fraction <= 1.0 - self.MIN_SKIPPED else None
            self.cache.update(plan_X=self.X, plan_key=key, plan=plan)
        return self.cache["plan"]

    def _working(self) -> tuple[torch.Tensor | None, torch.Tensor, LeafPlan | None]:
        """``(perm, Z, plan)`` of an on-the-fly pass: the scaled points in the plan's working order (``perm``
        ``None``: the input order, no plan)."""
        Z = self._scaled()
        plan = self.plan()
        if plan is None:
            return None, Z, None
        return plan.perm, Z[plan.perm], plan

    def _route(self) -> tuple[torch.Tensor | None, torch.Tensor, LeafPlan | None, KernelBackend]:
        """``(perm, Z, plan, backend)`` of a pass: the stored kernel's :class:`DenseBackend` (input order, no plan)
        where :func:`~gpnys.kernels.product.choose_product` keeps it dense, else the recomputing backend with the
        working order ``perm`` (``None``: identity), the scaled points ``Z`` in it and the cutoff plan."""
        dense = self._dense()
        self.cache["stored"] = dense is not None  # what the last pass read (TrainingKernel.recomputed)
        if dense is not None:
            return None, self._scaled(), None, DenseBackend(self.formula, *dense, self.cache.get("D"),
                                                            self._block_rows(), self.cache["last_product"])
        return (*self._working(), self.backend)

    def _pass(self) -> tuple[torch.Tensor | None, torch.Tensor, Iterator[Tile]]:
        """One torch pass over the kernel: ``(perm, Z, tiles)`` with ``perm`` the working order (``None``:
        identity), ``Z`` the scaled points in it and ``tiles`` (:data:`~gpnys.kernels.backends.torch_tiles.Tile`)
        read from the stored kernel or recomputed (:meth:`TorchTiles.tiles`)."""
        perm, Z, plan, backend = self._route()
        return perm, Z, (backend if isinstance(backend, DenseBackend) else self.tiles).tiles(Z, plan)

    def _unit_matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        perm, Z, plan, backend = self._route()
        out = backend.matmul(Z, rhs if perm is None else rhs[perm], plan)
        if perm is not None:
            out = out.index_copy(0, perm, out)  # back to the input order: result[perm] = out
        return out

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        return self.outputscale.detach() * self._unit_matmul(rhs)

    def _size(self) -> torch.Size:
        n = self.X.shape[0]
        return torch.Size([n, n])

    def _transpose_nonbatch(self) -> "StationaryKernelOperator":
        return self

    def _diagonal(self) -> torch.Tensor:
        """``s^2`` at every point (``k(0) = 1``), differentiable in ``s^2`` as the dense kernel's diagonal is."""
        return self.outputscale * torch.ones(self.X.shape[0], dtype=self.X.dtype, device=self.X.device)

    def _get_indices(self, row_index: torch.Tensor, col_index: torch.Tensor, *batch_indices: Any) -> torch.Tensor:
        """Entries ``s^2 k(x_i, x_j)`` of index pairs (``op[rows, cols]``), from the pairs' own differences and
        differentiable in ``s^2`` and ``l``: LinearOperator's default reads this operator's 0-dim and ``(1, d)``
        parameters as batch dimensions and raises."""
        diff = (self.X[row_index] - self.X[col_index]) / self.lengthscale.reshape(-1)
        return self.outputscale * k_of_r(torch.linalg.vector_norm(diff, dim=-1), self.nu)

    # -- derivative ---------------------------------------------------------------------------------------
    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> tuple[Any, ...]:
        """``d/d(outputscale, lengthscale) sum_t u_t^T K v_t`` in closed form (module docstring); ``None`` for X."""
        U, V = left_vecs.detach(), right_vecs.detach()
        if U.dim() == 1:
            U, V = U[:, None], V[:, None]
        perm, Z, plan, backend = self._route()
        if perm is not None:
            U, V = U[perm], V[perm]
        return (None, *self._finish(*backend.derivative_sums(Z, U, V, plan), Z.dtype))

    def column_derivatives(self, U: torch.Tensor, V: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        """Per column ``j``: ``d/d(outputscale, lengthscale) u_j^T K v_j`` for ``U, V: (n, t)``, as
        :meth:`_bilinear_derivative` would give for each column alone: ``(None, (t, *outputscale.shape),
        (t, *lengthscale.shape))``, in one pass of the backend's ``column_derivative_sums`` (torch tiles, fused
        Triton planes; KeOps column by column). The per-probe terms of the trace estimator, for its standard
        error."""
        U, V = U.detach(), V.detach()
        ls = self.lengthscale.detach()
        iso = ls.numel() == 1
        perm, Z, plan, backend = self._route()
        if perm is not None:
            U, V = U[perm], V[perm]
        s, g = backend.column_derivative_sums(Z, U, V, plan, iso)
        d_s2 = s.to(Z.dtype).reshape(-1, *self.outputscale.shape)
        d_ls = -self.outputscale.detach() * g.to(Z.dtype) / ls.reshape(1, -1)
        if ls.numel() == 1:
            d_ls = d_ls.sum(1)
        return None, d_s2, d_ls.reshape(-1, *ls.shape)

    def weighted_derivative(self, weight: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``d/d(outputscale, lengthscale) sum_ij W_ij (s^2 K)_ij`` for a weight matrix ``W`` (``(n, n)``) given
        by tiles: ``weight(rows, cols)`` returns ``W[rows][:, cols]`` (``rows``, ``cols``: slices or index
        tensors), which this method overwrites. Returns tensors shaped like ``outputscale`` and ``lengthscale``.
        Always on the torch tiles (an arbitrary ``W`` has no fused form)."""
        perm, Z, tiles = self._pass()
        if perm is not None:
            weight = (lambda w: lambda rows, cols: w(perm[rows], perm[cols]))(weight)
        return self._finish(*TorchTiles.weighted_sums(Z, tiles, weight), Z.dtype)

    def _finish(self, d_s2: torch.Tensor, per_dim: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d/d s^2, d/d l)`` from ``sum_ij W_ij K_ij`` and ``sum_ij A_ij (z_id - z_jd)^2`` (``(d,)``)."""
        s2 = self.outputscale.detach()
        ls = self.lengthscale.detach().reshape(-1)
        d_s2 = d_s2.to(dtype)
        d_ls = (-s2 * per_dim.to(dtype) / ls)
        if ls.numel() == 1:
            d_ls = d_ls.sum()
        return d_s2.reshape(self.outputscale.shape), d_ls.reshape(self.lengthscale.shape)
