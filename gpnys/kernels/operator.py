"""``s^2 k(X, X; l)`` as a ``LinearOperator`` with a blocked, closed-form hyperparameter derivative.

GPyTorch's CG path evaluates the training kernel as a dense tensor *with autograd*: every elementwise step of the
kernel (distances, exponentials, polynomial factors, ...) keeps an ``n x n`` temporary for the backward pass —
about 16 GB at n = 15 000 for a Matérn-3/2 ARD kernel, and the backward through them was half of a training step
(measured 10.5 of 21 s at elevators n = 14 940). :class:`StationaryKernelOperator` instead

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
per leaf, instead of ``O(n^2 (t + d))``. Written by hand because
neither GPyTorch nor linear_operator offers a kernel operator whose derivative avoids the autograd graph on CPU
(GPyTorch's KeOps kernels do so on GPUs only, through KeOps).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import gpytorch
import torch
from linear_operator.operators import LinearOperator

from gpnys.budget import block_elems, block_rows, dense_limit_bytes as budget_dense_limit
from gpnys.kernels import keops as keops_backend
from gpnys.kernels.cutoff import LeafPlan, cutoff_radius, leaf_plan, spatial_order
from gpnys.linalg import thin_matmul

__all__ = ["StationaryKernelOperator", "supported", "caches_dense"]


def caches_dense(n: int, itemsize: int, matern: bool, dense_limit_bytes: int | None = None) -> bool:
    """Whether :class:`StationaryKernelOperator` keeps the kernel dense for ``n`` points: ``K`` (and, for Matérn,
    ``H = k'/r``) of ``n x n`` entries of ``itemsize`` bytes within ``dense_limit_bytes`` (``None``: the budget's)."""
    limit = budget_dense_limit() if dense_limit_bytes is None else dense_limit_bytes
    return (2 if matern else 1) * n * n * itemsize <= limit


def _nu(base: gpytorch.kernels.Kernel) -> float | None:
    return None if isinstance(base, gpytorch.kernels.RBFKernel) else float(base.nu)


def supported(base: gpytorch.kernels.Kernel) -> bool:
    """True for a plain (unbatched, all-dimensions) GPyTorch RBF or Matérn kernel."""
    return (
        type(base) in (gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel)
        and base.active_dims is None
        and len(base.batch_shape) == 0
    )


def _k_and_h(r: torch.Tensor, nu: float | None, k: torch.Tensor, h: torch.Tensor | None) -> None:
    """Write ``k(r)`` and ``k'(r) / r`` of the unit-variance kernel into ``k`` and ``h`` (``r`` is overwritten);
    in place and without temporaries, because on CPU these elementwise passes over ``n x n`` are memory-bound
    and a fresh ``(b, n)`` allocation per block costs more than the arithmetic (page faults: a per-block
    ``r.neg()`` was half of a matmul's time). RBF has ``h = -k``, so its ``h`` is neither computed nor stored
    (``None``)."""
    if nu is None:
        torch.exp(r.square_().mul_(-0.5), out=k)
    elif nu == 0.5:
        torch.exp(r.neg_(), out=k)
        tiny = torch.finfo(r.dtype).tiny
        torch.div(k, r.clamp_(max=-tiny), out=h)  # -exp(-r) / r, with r = -r here
        h.masked_fill_(r >= -tiny, 0.0)
    elif nu == 1.5:
        r.mul_(-math.sqrt(3.0))  # r = -a, a = sqrt(3) r
        torch.exp(r, out=h)  # e = exp(-a)
        torch.addcmul(h, r, h, value=-1.0, out=k)  # (1 + a) e
        h.mul_(-3.0)
    else:
        r.mul_(math.sqrt(5.0))  # a
        torch.exp(torch.neg(r, out=k), out=k)  # e (k is scratch)
        torch.addcmul(k, r, k, out=h)  # (1 + a) e
        torch.addcmul(h, r.square_(), k, value=1.0 / 3.0, out=k)  # (1 + a + a^2/3) e
        h.mul_(-5.0 / 3.0)


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
            matmuls recompute row blocks. ``None``: the memory budget's (:mod:`gpnys.budget`, 4 GiB by default:
            Matérn n ~ 16 000 in float64, RBF n ~ 23 000). Row blocks follow the budget's ``block_bytes``.
        prune_tol: on the recomputed path, skip leaf pairs whose unit-kernel entries are all ``<= prune_tol``
            (their distance exceeds :func:`~gpnys.kernels.cutoff.cutoff_radius`); ``None``: machine epsilon of
            ``X``'s dtype (each skipped entry is below the rounding of the diagonal); ``0``: never skip. Used only
            when it removes at least :attr:`MIN_SKIPPED` of the entries.
        keops: recompute products and derivatives with KeOps (:mod:`gpnys.kernels.keops`) instead of torch tiles;
            ``None``: when ``X`` is on a CUDA device and ``pykeops`` is installed. The dense cache, when it fits,
            comes first either way.
    """

    #: points per leaf of the cutoff plan (rows of one on-the-fly tile)
    LEAF = 64
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
        keops: bool | None = None,
    ) -> None:
        limit = budget_dense_limit() if dense_limit_bytes is None else int(dense_limit_bytes)
        if prune_tol is not None and not prune_tol >= 0:
            raise ValueError(f"prune_tol must be >= 0 (or None), got {prune_tol}")
        tol = torch.finfo(X.dtype).eps if prune_tol is None else float(prune_tol)
        if keops is None:
            keops = X.is_cuda and keops_backend.available()
        elif keops and not keops_backend.available():
            raise ValueError("keops=True needs pykeops (pip install pykeops)")
        super().__init__(X, outputscale, lengthscale, base=base, cache=cache, dense_limit_bytes=limit, prune_tol=tol,
                         keops=bool(keops))
        self.keops = bool(keops)
        self.X, self.outputscale, self.lengthscale = X, outputscale, lengthscale
        self.base, self.cache = base, cache
        self.dense_limit_bytes = limit
        self.prune_tol = tol
        self.nu = _nu(base)

    # -- values -------------------------------------------------------------------------------------------
    def _block_rows(self) -> int:
        return block_rows(self.X.shape[0])

    def _scaled(self) -> torch.Tensor:
        """``z = (x - mean) / l`` (``(n, d)``); centring keeps ``(z_i - z_j)^2`` accurate in float32."""
        Z = (self.X - self.X.mean(0)) / self.lengthscale.detach().reshape(-1)
        self._zmax = float(Z.abs().max()) if Z.numel() else 0.0
        return Z

    def _rows(self, Zr: torch.Tensor, Zc: torch.Tensor, sq: torch.Tensor, rows: slice, cols: slice | torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor | None], scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write ``(k, h)`` of the tile ``rows`` x ``cols`` with coordinates ``(Zr, Zc)`` (:meth:`_tile_coords`;
        ``sq = |z|^2`` per point, used on full-width tiles) into ``out``, two
        ``(|rows|, |cols|)`` blocks (``h`` is ``None`` for RBF, where it is ``-k``); ``scratch`` (same shape) holds
        the distances. Reusing the caller's buffers keeps a pass free of ``(b, n)`` allocations (glibc keeps and
        re-faults freed blocks: slower, and the peak RSS grows by the retained blocks)."""
        with torch.no_grad():
            full = isinstance(cols, slice)
            if full:
                sr, sc, zmax = sq[rows], sq, self._zmax
            else:
                sr, sc = Zr.square().sum(1), Zc.square().sum(1)
                zmax = float(sc.max().sqrt()) if self.nu == 0.5 else 0.0
            R = torch.addmm(sc[None, :], Zr, Zc.mT, alpha=-2.0, out=scratch)
            R.add_(sr[:, None]).clamp_(min=0.0).sqrt_()  # the expanded (matmul) form of the distance
            # ... leaves ~sqrt(eps) |z| on the diagonal
            if full:
                R.diagonal(offset=rows.start).zero_()
            else:  # a leaf's own positions form one ascending run of `cols`
                q0, q1 = (int(q) for q in torch.searchsorted(cols, cols.new_tensor([rows.start, rows.stop])))
                R[cols[q0:q1] - rows.start, torch.arange(q0, q1, device=R.device)] = 0.0
            if self.nu == 0.5:  # ... and on coincident points, where h = -exp(-r)/r would amplify it
                R.masked_fill_(R < math.sqrt(torch.finfo(R.dtype).eps) * zmax, 0.0)
            _k_and_h(R, self.nu, *out)
            return out

    @staticmethod
    def _tile_coords(Z: torch.Tensor, rows: slice, cols: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Z[rows], Z[cols])``; a cutoff tile (``cols`` an index tensor) is centred on its leaf, so that
        ``|z| ~`` the cutoff radius rather than the data's extent: the expanded forms of the distance and of the
        length-scale derivative then lose ``eps |z|^2`` relative to a small ``|z|``."""
        if isinstance(cols, slice):
            return Z[rows], Z[cols]
        Zr = Z[rows]
        c = Zr.mean(0)
        return Zr - c, Z[cols] - c

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Cached dense ``(K, H)`` (unit kernel and ``k'/r``; ``H`` is ``None`` for RBF) for the current
        length-scale, or ``None`` if too big. The buffers are reused across length-scales (no fresh n^2
        allocation per training step)."""
        n = self.X.shape[0]
        if not caches_dense(n, self.X.element_size(), self.nu is not None, self.dense_limit_bytes):
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
            Z, bs = self._scaled(), self._block_rows()
            sq = Z.square().sum(1)
            scratch = Z.new_empty(min(bs, n) * n)
            for a in range(0, n, bs):
                rows = slice(a, min(a + bs, n))
                m = rows.stop - a
                self._rows(Z[rows], Z, sq, rows, slice(None), (K[rows], None if H is None else H[rows]),
                           scratch[: m * n].view(m, n))
            self.cache.update(X=self.X, key=key, K=K, H=H)
        return self.cache["K"], self.cache["H"]

    def _key(self) -> tuple:
        """The inputs (by version; identity is checked separately) and the length-scale key the caches."""
        return (self.X._version, tuple(self.lengthscale.detach().reshape(-1).tolist()))

    def plan(self) -> LeafPlan | None:
        """The cutoff plan for the current length-scale (cached), or ``None`` when it would skip less than
        :attr:`MIN_SKIPPED` of the entries (or ``prune_tol`` is 0)."""
        radius = cutoff_radius(self.nu, self.prune_tol)
        key = (*self._key(), radius)
        if self.cache.get("plan_X") is not self.X or self.cache.get("plan_key") != key:
            Z = self._scaled()
            plan = None
            if math.isfinite(radius) and Z.shape[0] > self.LEAF and float((Z.amax(0) - Z.amin(0)).norm()) > radius:
                plan = leaf_plan(Z, spatial_order(Z, self.LEAF), self.LEAF, radius)
                plan = plan if plan.fraction <= 1.0 - self.MIN_SKIPPED else None
            self.cache.update(plan_X=self.X, plan_key=key, plan=plan)
        return self.cache["plan"]

    def _pass(self):
        """One pass over the kernel: ``(perm, Z, tiles)`` where ``perm`` (``None``: identity) is the working
        order, ``Z`` the scaled points in that order and ``tiles`` yields ``(rows, cols, K_tile, H_tile, Zr, Zc)`` with
        ``rows`` a slice and ``cols`` a slice or an ascending index tensor of working-order positions. Recomputed
        tiles are views of one workspace, valid until the next step."""
        n = self.X.shape[0]
        dense = self._dense()
        Z = self._scaled()
        if dense is not None:
            bs = self._block_rows()
            K, H = dense
            tiles = ((slice(a, a + bs), slice(None), K[a : a + bs], None if H is None else H[a : a + bs],
                      Z[a : a + bs], Z) for a in range(0, n, bs))
            return None, Z, tiles
        plan = self.plan()
        if plan is None:
            bs = min(self._block_rows(), n)
            shapes = [(slice(a, min(a + bs, n)), slice(None)) for a in range(0, n, bs)]
            perm, size = None, bs * n
        else:
            perm, Z = plan.perm, Z[plan.perm]
            width = max(1, block_elems() // plan.leaf)  # a leaf's columns in chunks of at most one block
            shapes = ((plan.rows(i), c) for i in range(plan.num_leaves) for c in plan.cols(i).split(width))
            size = plan.leaf * min(width, n)
        sq = Z.square().sum(1)
        buffers = [Z.new_empty(size) for _ in range(2 if self.nu is None else 3)]

        def tiles():
            for rows, cols in shapes:
                m, w = rows.stop - rows.start, (n if isinstance(cols, slice) else cols.shape[0])
                scratch, Kt, *Ht = (b[: m * w].view(m, w) for b in buffers)
                Zr, Zc = self._tile_coords(Z, rows, cols)  # once per tile: the derivative reuses them
                yield (rows, cols, *self._rows(Zr, Zc, sq, rows, cols, (Kt, Ht[0] if Ht else None), scratch), Zr, Zc)

        return perm, Z, tiles()

    def _unit_matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        dense = self._dense()
        if dense is not None:
            return thin_matmul(dense[0], rhs)
        if self.keops:
            return keops_backend.matmul(self._scaled(), rhs, self.nu)
        perm, _, tiles = self._pass()
        R = rhs if perm is None else rhs[perm]
        out = torch.zeros_like(R)
        for rows, cols, Kt, *_ in tiles:
            out[rows].addmm_(Kt, R[cols])
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
        return self.outputscale.detach() * torch.ones(self.X.shape[0], dtype=self.X.dtype, device=self.X.device)

    # -- derivative ---------------------------------------------------------------------------------------
    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> tuple[Any, ...]:
        """``d/d(outputscale, lengthscale) sum_t u_t^T K v_t`` in closed form (module docstring); ``None`` for X."""
        U, V = left_vecs.detach(), right_vecs.detach()
        if U.dim() == 1:
            U, V = U[:, None], V[:, None]
        if self.keops and self._dense() is None:
            Z = self._scaled()
            return (None, *self._finish(*keops_backend.derivative_sums(Z, U, V, self.nu), Z.dtype))
        perm, Z, tiles = self._pass()
        if perm is not None:
            U, V = U[perm], V[perm]
        return (None, *self._derivative(Z, tiles, lambda rows, cols: U[rows] @ V[cols].mT))

    def weighted_derivative(self, weight: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``d/d(outputscale, lengthscale) sum_ij W_ij (s^2 K)_ij`` for a weight matrix ``W`` (``(n, n)``) given
        by tiles: ``weight(rows, cols)`` returns ``W[rows][:, cols]`` (``rows``, ``cols``: slices or index
        tensors), which this method overwrites. Returns tensors shaped like ``outputscale`` and ``lengthscale``."""
        perm, Z, tiles = self._pass()
        if perm is None:
            return self._derivative(Z, tiles, weight)
        return self._derivative(Z, tiles, lambda rows, cols: weight(perm[rows], perm[cols]))

    def _derivative(self, Z: torch.Tensor, tiles, weight: Callable[[Any, Any], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The closed form over the tiles of one pass (``Z`` and the indices in the pass's working order)."""
        # The expanded form below subtracts two sums of size ~|z|^2 whose difference is ~|z_i - z_j|^2: it is
        # accumulated in (at least) float64, or float32 loses digits once |z| >> the weighted pairs' distances.
        acc = torch.promote_types(Z.dtype, torch.float64)
        d_s2 = Z.new_zeros((), dtype=acc)
        per_dim = Z.new_zeros(Z.shape[1], dtype=acc)  # sum_ij A_ij (z_id - z_jd)^2, tile by tile
        for rows, cols, Kt, Ht, Zr, Zc in tiles:
            W = weight(rows, cols)  # (|rows|, |cols|)
            d_s2 = d_s2 + (W[:, None, :] @ Kt[:, :, None]).sum(dtype=acc)  # row dots: no (b, n) temporary
            A = W.mul_(Kt).neg_() if Ht is None else W.mul_(Ht)  # RBF: A = W o H = -(W o K)
            A = A.to(acc)
            Zr, Zc = Zr.to(acc), Zc.to(acc)
            per_dim += ((A.sum(1)[:, None] * Zr.square()).sum(0) + (A.sum(0)[:, None] * Zc.square()).sum(0)
                        - 2.0 * (Zr * (A @ Zc)).sum(0))
        return self._finish(d_s2, per_dim, Z.dtype)

    def _finish(self, d_s2: torch.Tensor, per_dim: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d/d s^2, d/d l)`` from ``sum_ij W_ij K_ij`` and ``sum_ij A_ij (z_id - z_jd)^2`` (``(d,)``)."""
        s2 = self.outputscale.detach()
        ls = self.lengthscale.detach().reshape(-1)
        d_s2 = d_s2.to(dtype)
        d_ls = (-s2 * per_dim.to(dtype) / ls)
        if ls.numel() == 1:
            d_ls = d_ls.sum()
        return d_s2.reshape(self.outputscale.shape), d_ls.reshape(self.lengthscale.shape)
