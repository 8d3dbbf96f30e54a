"""The torch backend: the kernel recomputed in row tiles (or cutoff-plan leaf tiles), in place.

Each tile ``K[rows, cols]`` (and ``H = k'/r`` for Matérn) is written into reused workspace buffers, then
multiplied (product) or weighted and reduced (derivative sums, :mod:`gpnys.kernels.backends`). Distances use the
expanded form ``|z_i|^2 + |z_j|^2 - 2 z_i . z_j`` (one GEMM per tile, the fastest form on CPU) with the diagonal
set to zero exactly. The dense cache of :class:`~gpnys.kernels.operator.StationaryKernelOperator` is filled with
the same :meth:`TorchTiles.fill`. Whole passes are symmetric (:meth:`TorchTiles.upper_tiles`): each tile of the
upper triangle serves ``K[I, J] R[J]`` and ``K[I, J]^T R[I]`` (products), or its pairs and their mirrors (derivative
sums), so half the entries are computed; a row range (``rows=``) computes its rows' tiles whole.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch

from gpnys.budget import block_elems, block_rows
from gpnys.collectives import LEAF
from gpnys.kernels.backends.base import KernelBackend, check_rows
from gpnys.kernels.cutoff import LeafPlan, normal_range
from gpnys.kernels.formulas import Formula

__all__ = ["TorchTiles", "k_and_h_inplace", "Tile"]

#: ``(rows, cols, K_tile, H_tile, Z_rows, Z_cols)``: ``rows`` a slice, ``cols`` a slice or an ascending index
#: tensor of working-order positions; ``H_tile`` is ``None`` for RBF (``H = -K``)
Tile = tuple[slice, Any, torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor]


def k_and_h_inplace(r: torch.Tensor, f: Formula, k: torch.Tensor, h: torch.Tensor | None) -> None:
    """Write ``k(r)`` and ``k'(r) / r`` of the unit kernel into ``k`` and ``h`` (``r`` is overwritten).

    The formulas of :mod:`gpnys.kernels.formulas`, hand-fused in place and without temporaries: on CPU these
    elementwise passes over ``n x n`` are memory-bound and a fresh ``(b, n)`` allocation per block costs more than
    the arithmetic (page faults; docs/scaling.md). RBF has ``h = -k``, so its
    ``h`` is neither computed nor stored (``None``)."""
    if f.rbf:
        torch.exp(r.square_().mul_(-0.5), out=k)
    elif f.singular:  # Matérn-1/2: k = e^{-r}, h = -e^{-r} / r
        torch.exp(r.neg_(), out=k)
        tiny = torch.finfo(r.dtype).tiny
        torch.div(k, r.clamp_(max=-tiny), out=h)  # -exp(-r) / r, with r = -r here
        h.masked_fill_(r >= -tiny, 0.0)
    elif len(f.p) == 2:  # Matérn-3/2: k = (1 + a) e^{-a}, h = -c^2 e^{-a}
        r.mul_(-f.c)  # r = -a
        torch.exp(r, out=h)  # e = exp(-a)
        torch.addcmul(h, r, h, value=-1.0, out=k)  # (1 + a) e
        h.mul_(f.c2 * f.q[0])
    else:  # Matérn-5/2: k = (1 + a + a^2/3) e^{-a}, h = -(c^2/3)(1 + a) e^{-a}
        r.mul_(f.c)  # a
        torch.exp(torch.neg(r, out=k), out=k)  # e (k is scratch)
        torch.addcmul(k, r, k, out=h)  # (1 + a) e
        torch.addcmul(h, r.square_(), k, value=f.p[2], out=k)  # (1 + a + a^2/3) e
        h.mul_(f.c2 * f.q[0])


def squared_norms(Z: torch.Tensor) -> torch.Tensor:
    """``|z_i|²`` ``(n,)`` for the expanded distance form, in float64 for float32 and below (their rounding,
    ``u |z|²``, would otherwise reach every distance)."""
    acc = Z.dtype if torch.finfo(Z.dtype).eps < 1e-10 else torch.float64
    return Z.to(acc).square().sum(1)


def padded_coordinates(Z: torch.Tensor, sq: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, Q)``, ``(n, d + 2)`` each in ``sq``'s dtype (:func:`squared_norms`), with ``P Qᵀ = c r²`` for the points
    ``Z``: ``P = [z, c |z|², 1]``, ``Q = [-2c z, 1, c |z|²]``, the expanded form, so that a tile's distances are one
    product, with no pass to add the norms."""
    return _padded(Z, sq, c, True), _padded(Z, sq, c, False)


def _padded(Z: torch.Tensor, sq: torch.Tensor, c: float, left: bool) -> torch.Tensor:
    """``P`` (``left``) or ``Q`` of :func:`padded_coordinates`."""
    Za, one, norms = Z.to(sq.dtype), sq.new_ones(sq.shape[0], 1), c * sq[:, None]
    return torch.cat([Za, norms, one] if left else [(-2.0 * c) * Za, one, norms], 1)


def _zero_self_pairs(R: torch.Tensor, rows: slice, cols: slice | torch.Tensor) -> None:
    """Set each point's (squared) distance to itself to 0 in the tile ``rows`` x ``cols``; a leaf's own positions
    form one ascending run of ``cols``."""
    if isinstance(cols, slice):
        R.diagonal(offset=(rows.start or 0) - (cols.start or 0)).zero_()
    else:
        q0, q1 = (int(q) for q in torch.searchsorted(cols, cols.new_tensor([rows.start, rows.stop])))
        R[cols[q0:q1] - rows.start, torch.arange(q0, q1, device=R.device)] = 0.0


def _tail(cols: Any, skip: int) -> Any:
    """A tile's columns past its first ``skip`` (``cols`` a slice or an index tensor)."""
    return slice(cols.start + skip, cols.stop) if isinstance(cols, slice) else cols[skip:]


class TorchTiles(KernelBackend):
    """Tiles of ``k(Z, Z)`` recomputed with torch ops (module docstring); runs on any device."""

    name = "torch"

    # -- tiles --------------------------------------------------------------------------------------------
    def fill(self, Zr: torch.Tensor, Zc: torch.Tensor, sq: torch.Tensor, rows: slice, cols: slice | torch.Tensor,
             out: tuple[torch.Tensor, torch.Tensor | None], scratch: torch.Tensor,
             zmax: float, derivative: torch.Tensor | None = None,
             padded: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write ``(k, h)`` of the tile ``rows`` x ``cols`` with coordinates ``(Zr, Zc)`` (:meth:`coords`;
        ``sq = |z|^2`` per point and ``zmax = max |z|`` (the largest norm), used on full-width tiles) into ``out``, two
        ``(|rows|, |cols|)`` blocks (``h`` is ``None`` for RBF); ``scratch`` (same shape) holds the distances.
        Reusing the caller's buffers keeps a pass free of ``(b, n)`` allocations (glibc keeps and re-faults freed
        blocks: slower, and the peak RSS grows by the retained blocks). ``derivative`` (a full-width tile's block
        of the same shape): also write ``A o R² / 2`` there (``A = -k`` for RBF, ``h`` otherwise; the point's pair
        with itself 0), half the isotropic length-scale derivative's matrix. ``padded``: :meth:`padded` of the
        whole pass's points, which a full-width tile's distances come from in one product."""
        with torch.no_grad():
            full = isinstance(cols, slice)
            singular = self.formula.singular
            acc = sq.dtype  # float64 for float32 and below (:func:`squared_norms`)
            # c r² (c = -1/2 for RBF, whose k = exp(-r²/2) and A o R² / 2 = k (-r²/2) then take one pass each)
            c = -0.5 if self.formula.rbf else 1.0
            if full and padded is not None:
                P, Q = padded[0][rows], padded[1][cols]
            else:
                if full:
                    sr, sc = sq[rows], sq[cols]
                else:
                    sr, sc = squared_norms(Zr), squared_norms(Zc)
                    zmax = float(torch.maximum(sr.max(), sc.max()).sqrt()) if singular else 0.0
                P, Q = _padded(Zr, sr, c, True), _padded(Zc, sc, c, False)
            # the expanded form cancels to u |z|^2: in float32 that is the kernel's largest error (duplicate points
            # at a short length-scale), so its sums run in float64 and are rounded once
            R = torch.mm(P, Q.mT, out=scratch) if acc == Zr.dtype else scratch.copy_(P @ Q.mT)
            # r² >= 0 (the expanded form's rounding), and at most where the kernel is still a normal number
            # (:func:`~gpnys.kernels.cutoff.normal_range`): subnormal entries would slow every product that reads them
            far = c * normal_range(self.formula.nu, R.dtype)
            R.clamp_(*((far, 0.0) if c < 0 else (0.0, far)))
            _zero_self_pairs(R, rows, cols)  # the expanded (matmul) form leaves ~eps |z|² there
            if self.formula.rbf:  # k = exp(-r²/2) and k (-r²/2) from -r²/2 itself: no square root and square
                k = torch.exp(R, out=out[0])
                if derivative is not None:
                    torch.mul(R, k, out=derivative)
                return out
            if derivative is not None:
                torch.mul(R, 0.5, out=derivative)
            R.sqrt_()
            near = None
            if singular:  # ... and on near-coincident points, where h = -exp(-r)/r would amplify it: r below the
                # expanded form's rounding in the accumulation dtype, (d + 2) terms of up to 2 |z|^2 each
                # (a point's pair with itself is exactly 0 already)
                below = (R < math.sqrt(8 * (Zr.shape[1] + 2) * torch.finfo(acc).eps) * zmax) & (R > 0)
                hit = below.any(1).nonzero().flatten()
                if hit.numel():
                    # their r from explicit differences (0 on coincident points), row chunks of a quarter tile at
                    # most: with the set many length-scales wide the threshold reaches 5e-4, and k = 1 there was
                    # that far off (GPyTorch: 5e-7)
                    near = below
                    for part in hit.split(max(1, R.shape[0] // 4)):
                        D = torch.cdist(Zr[part].to(acc), Zc.to(acc), compute_mode="donot_use_mm_for_euclid_dist")
                        R[part] = torch.where(near[part], D.to(R.dtype), R[part])
            k_and_h_inplace(R, self.formula, *out)
            if near is not None:
                # their share of the length-scale derivative, k'(r) r with r below the threshold, is left out: the
                # sums read (z_i - z_j)² in the expanded form, whose rounding h ~ 1/r would amplify
                out[1].masked_fill_(near, 0.0)
            if derivative is not None:
                derivative.mul_(out[1])
            return out

    def padded(self, Z: torch.Tensor, sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`padded_coordinates` with :meth:`fill`'s scale (``c = -1/2`` for RBF, else 1)."""
        return padded_coordinates(Z, sq, -0.5 if self.formula.rbf else 1.0)

    @staticmethod
    def coords(Z: torch.Tensor, rows: slice, cols: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Z[rows], Z[cols])``; a cutoff tile (``cols`` an index tensor) is centred on its leaf, so that
        ``|z| ~`` the cutoff radius rather than the data's extent: the expanded forms of the distance and of the
        length-scale derivative then lose ``eps |z|^2`` relative to a small ``|z|``."""
        if isinstance(cols, slice):
            return Z[rows], Z[cols]
        Zr = Z[rows]
        c = Zr.mean(0)
        return Zr - c, Z[cols] - c

    def tiles(self, Z: torch.Tensor, plan: LeafPlan | None, rows: tuple[int, int] | None = None) -> Iterator[Tile]:
        """Recomputed tiles covering ``k(Z, Z)`` (every pair, or the plan's leaf pairs), or only its rows
        ``rows = (a, b)`` (leaf-aligned with a plan); each is a view of one workspace, valid until the next is
        yielded."""
        n = Z.shape[0]
        a, b = check_rows(n, rows)
        if plan is None:
            bs = block_rows(n, cap=max(1, b - a), device=Z.device)
            shapes: Any = [(None, slice(r, min(r + bs, b)), slice(None)) for r in range(a, b, bs)]
            size = bs * n
        else:
            width = self._width(Z, plan)
            leaves = range(a // plan.leaf, min(plan.num_leaves, -(-b // plan.leaf)))
            shapes = ((None, plan.rows(i), c) for i in leaves for c in plan.cols(i).split(width))
            size = plan.leaf * min(width, n)
        return (tile for _, tile in self._filled(Z, shapes, size))

    def upper_tiles(self, Z: torch.Tensor, plan: LeafPlan | None,
                    rows: tuple[int, int] | None = None) -> Iterator[tuple[int, Tile]]:
        """``(skip, tile)`` over the upper triangle of ``k(Z, Z)`` by blocks: row block ``I`` against the column
        blocks ``J >= I`` (every pair: one tile ``I x [I, n)``; a plan: leaf ``I``'s listed leaves ``J >= I``, in
        chunks), for the row blocks within ``rows`` (leaf-aligned; ``None``: all). The first ``skip`` columns of
        a tile are the diagonal block ``I x I``; the rest are mirrored by the symmetric product."""
        n = Z.shape[0]
        a, b = check_rows(n, rows)
        if plan is None:
            bs = block_rows(n, cap=max(1, b - a), device=Z.device)
            blocks = [slice(r, min(r + bs, b)) for r in range(a, b, bs)]
            return self._filled(Z, [(r.stop - r.start, r, slice(r.start, n)) for r in blocks], bs * n)
        width = self._width(Z, plan)

        def shapes() -> Iterator[tuple[int, slice, torch.Tensor]]:  # lazily: the lists of a large plan are big
            for i in range(a // plan.leaf, min(plan.num_leaves, -(-b // plan.leaf))):
                rows, at = plan.rows(i), 0
                for c in plan.cols(i, upper=True).split(width):
                    yield min(max(rows.stop - rows.start - at, 0), c.shape[0]), rows, c
                    at += c.shape[0]

        return self._filled(Z, shapes(), plan.leaf * min(width, n))

    @staticmethod
    def upper_split(n: int, plan: LeafPlan | None, parts: int) -> list[int]:
        """``parts + 1`` row boundaries ``0 = b_0 <= ... <= b_parts = n``, each but the last a leaf's start, that
        share the upper triangle's entries (:meth:`upper_tiles`) about equally: row ``i`` holds ``n - i`` of them
        (every pair), a plan's leaf its listed leaves ``j >= i``. With more parts than leaves some shares are empty.
        For a row-partitioned symmetric product."""
        if plan is None:
            rows = torch.arange(0, n, LEAF, dtype=torch.float64)
            work = (n - rows) * torch.clamp(n - rows, max=LEAF)  # a leaf block's entries (about)
        else:
            ptr = plan.near_ptr_t.to(plan.near_idx.device)
            owner = torch.repeat_interleave(torch.arange(plan.num_leaves, device=ptr.device), ptr.diff())
            work = torch.bincount(owner[plan.near_idx >= owner], minlength=plan.num_leaves).to(torch.float64)
        cum = torch.cat([work.new_zeros(1), work.cumsum(0)])  # entries before each leaf block
        goal = cum[-1] * torch.arange(parts + 1, dtype=torch.float64, device=cum.device) / parts
        cuts = torch.searchsorted(cum, goal).clamp_(max=len(work) - 1).tolist()  # a rank starts at a leaf's start
        return [c * LEAF for c in cuts[:-1]] + [n]

    def upper_matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None,
                     rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``(n, t)``: the symmetric product's share of the row blocks ``rows`` (``None``: all, which is ``K R``):
        each upper tile ``K[I, J]`` (:meth:`upper_tiles`) adds ``K[I, J] R[J]`` to rows ``I`` and, off the
        diagonal, ``K[I, J]^T R[I]`` to rows ``J``. Half the kernel entries of a row pass, the same GEMM flops."""
        out = R.new_zeros(Z.shape[0], R.shape[1])
        for skip, (r, cols, Kt, *_) in self.upper_tiles(Z, plan, rows):
            out[r].addmm_(Kt, R[cols])
            if Kt.shape[1] > skip:  # the mirrored tile K[J, I] = K[I, J]^T
                if isinstance(cols, slice):
                    out[cols.start + skip : cols.stop].addmm_(Kt[:, skip:].mT, R[r])
                else:
                    out.index_add_(0, cols[skip:], Kt[:, skip:].mT @ R[r])
        return out

    @staticmethod
    def _width(Z: torch.Tensor, plan: LeafPlan) -> int:
        """Columns per cutoff tile: a leaf's columns in chunks of at most one block."""
        return max(1, block_elems(device=Z.device) // plan.leaf)

    def _filled(self, Z: torch.Tensor, shapes: Any, size: int) -> Iterator[tuple[Any, Tile]]:
        """``(tag, tile)`` for the ``(tag, rows, cols)`` of ``shapes`` (``rows`` a slice, ``cols`` a slice or an
        ascending index tensor), the tiles filled in ``size``-element workspaces; the tag passes through."""
        n = Z.shape[0]
        sq = squared_norms(Z)
        zmax = float(sq.max().sqrt()) if Z.numel() else 0.0
        buffers = [Z.new_empty(size) for _ in range(2 if self.formula.rbf else 3)]
        padded = None
        for tag, rows, cols in shapes:
            m = rows.stop - rows.start
            w = (len(range(*cols.indices(n))) if isinstance(cols, slice) else cols.shape[0])
            scratch, Kt, *Ht = (b[: m * w].view(m, w) for b in buffers)
            Zr, Zc = self.coords(Z, rows, cols)  # once per tile: the derivative reuses them
            if padded is None and isinstance(cols, slice):
                padded = self.padded(Z, sq)
            yield tag, (rows, cols, *self.fill(Zr, Zc, sq, rows, cols, (Kt, Ht[0] if Ht else None), scratch, zmax,
                                               padded=padded), Zr, Zc)

    # -- the two passes -----------------------------------------------------------------------------------
    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``K R``: all rows by the symmetric product (:meth:`upper_matmul`), a row range ``rows`` by its own
        tiles."""
        n = Z.shape[0]
        a, b = check_rows(n, rows)
        if (a, b) == (0, n):
            return self.upper_matmul(Z, R, plan)
        out = R.new_zeros(b - a, R.shape[1])
        for r, cols, Kt, *_ in self.tiles(Z, plan, rows):
            out[r.start - a : r.stop - a].addmm_(Kt, R[cols])
        return out

    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if check_rows(Z.shape[0], rows) == (0, Z.shape[0]):
            return self.upper_derivative_sums(Z, U, V, plan)
        return self.weighted_sums(Z, self.tiles(Z, plan, rows), lambda r, cols: U[r] @ V[cols].mT)

    def upper_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                              rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`derivative_sums` over the upper tiles of the row blocks ``rows`` (``None``: all) and their
        mirrors: the weight ``U V^T`` on a tile's columns past the diagonal block gains the mirror's ``(V U^T)``
        (``K`` and ``H`` are symmetric), so half the kernel entries are computed."""
        def weight(r: slice, cols: Any, skip: int) -> torch.Tensor:
            W = U[r] @ V[cols].mT
            if W.shape[1] > skip:
                W[:, skip:] += V[r] @ U[_tail(cols, skip)].mT
            return W

        return self.weighted_sums(Z, self.upper_tiles(Z, plan, rows), weight, mirrored=True)

    def column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                               isotropic: bool = False,
                               rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if check_rows(Z.shape[0], rows) == (0, Z.shape[0]):
            return self.upper_column_derivative_sums(Z, U, V, plan, isotropic)
        return self.column_sums(Z, self.tiles(Z, plan, rows), U, V, isotropic)

    def upper_column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor,
                                     plan: LeafPlan | None, isotropic: bool = False,
                                     rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`column_derivative_sums` over the upper tiles of the row blocks ``rows`` and their mirrors
        (:meth:`upper_tiles`; ``None``: all rows, which is the whole sum): half the kernel entries. Shares of
        :meth:`upper_split` add up to the whole."""
        return self.column_sums(Z, self.upper_tiles(Z, plan, rows), U, V, isotropic, mirrored=True)

    @staticmethod
    def weighted_sums(Z: torch.Tensor, tiles: Iterator[Any], weight: Callable[..., torch.Tensor],
                      mirrored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_ij W_ij K_ij, [sum_ij W_ij H_ij (z_id - z_jd)^2]_d)`` over ``tiles`` for a weight matrix given
        by tiles (``weight(rows, cols)``, overwritten here); in at least float64. ``mirrored``: ``tiles`` are
        :meth:`upper_tiles`' ``(skip, tile)`` and ``weight(rows, cols, skip)`` folds the mirrored tile's weight
        into the columns past ``skip`` (``K`` and ``H`` are symmetric)."""
        # The expanded form below subtracts two sums of size ~|z|^2 whose difference is ~|z_i - z_j|^2: it is
        # accumulated in (at least) float64, or float32 loses digits once |z| >> the weighted pairs' distances.
        acc = torch.promote_types(Z.dtype, torch.float64)
        s = Z.new_zeros((), dtype=acc)
        g = Z.new_zeros(Z.shape[1], dtype=acc)
        for item in tiles:
            skip, (rows, cols, Kt, Ht, Zr, Zc) = item if mirrored else (None, item)
            W = weight(rows, cols) if skip is None else weight(rows, cols, skip)  # (|rows|, |cols|)
            s = s + (W[:, None, :] @ Kt[:, :, None]).sum(dtype=acc)  # row dots: no (b, n) temporary
            A = W.mul_(Kt).neg_() if Ht is None else W.mul_(Ht)  # RBF: A = W o H = -(W o K)
            A = _without_self_pairs(A.to(acc), rows, cols)
            Zr, Zc = Zr.to(acc), Zc.to(acc)
            g += ((A.sum(1)[:, None] * Zr.square()).sum(0) + (A.sum(0)[:, None] * Zc.square()).sum(0)
                  - 2.0 * (Zr * (A @ Zc)).sum(0))
        return s, g

    @staticmethod
    def column_sums(Z: torch.Tensor, tiles: Iterator[Any], U: torch.Tensor, V: torch.Tensor,
                    isotropic: bool = False, mirrored: bool = False,
                    same_points: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`weighted_sums` for each rank-one weight ``W_j = u_j v_j^T`` separately, in one pass:
        ``s_j = u_j^T K v_j`` (``(t,)``) and ``g_jd = sum_ik u_ij v_kj A_ik (z_id - z_kd)^2`` (``(t, d)``), from
        the products ``A V``, ``A^T U`` and ``A (z_d o V)`` (``O(n^2 t (d + 3))`` flops, no ``(b, n, t)``
        temporary); in at least float64. ``isotropic``: only ``sum_d g_jd`` is needed (``(t, 1)``), from
        ``(A o R^2) V`` with ``R^2`` the tile's squared distances: ``O(n^2 t)`` flops, ``d`` times fewer.
        ``mirrored``: ``tiles`` are :meth:`upper_tiles`' ``(skip, tile)``, and each tile's columns past ``skip``
        also stand for the mirrored tile ``K[J, I]``, whose terms are the tile's with ``U`` and ``V`` swapped.
        ``same_points``: rows and columns index one point set (a tile's ``(i, i)`` entries pair a point with
        itself and are left out of ``g``); ``False`` for a block between two sets."""
        acc = torch.promote_types(Z.dtype, torch.float64)
        t, d = U.shape[1], Z.shape[1]
        s = Z.new_zeros(t, dtype=acc)
        g = Z.new_zeros(t, 1 if isotropic else d, dtype=acc)
        padded = None  # Z's padded coordinates, for the tiles of whole rows (slices of Z)
        for item in tiles:
            skip, (rows, cols, Kt, Ht, Zr, Zc) = item if mirrored else (0, item)
            Kt = Kt.to(acc)
            whole = isotropic and _views_of(Z, Zr, rows) and _views_of(Z, Zc, cols)
            Zr, Zc = Zr.to(acc), Zc.to(acc)
            sign = 1.0
            if isotropic:  # A o R^2, R^2 in the expanded form (accumulated in float64, as above)
                if whole:
                    padded = padded_coordinates(Z, squared_norms(Z), 1.0) if padded is None else padded
                    P, Q = padded[0][rows], padded[1][cols]
                else:
                    P, Q = _padded(Zr, Zr.square().sum(1), 1.0, True), _padded(Zc, Zc.square().sum(1), 1.0, False)
                R2 = P @ Q.mT
                R2 = _without_self_pairs(R2.clamp_(min=0.0), rows, cols) if same_points else R2.clamp_(min=0.0)
                # in R²'s own buffer; RBF's A = -K as a sign on its sums (no negated copy of the tile)
                A, sign = (R2.mul_(Kt), -1.0) if Ht is None else (R2.mul_(Ht), 1.0)
            else:
                A = -Kt if Ht is None else Ht.to(acc)  # RBF: H = -K
                A = _without_self_pairs(A, rows, cols) if same_points else A
            terms = [(U[rows], V[cols], Kt, A, Zc)]
            if mirrored and Kt.shape[1] > skip:  # K[J, I] = K[I, J]^T: u_J^T K[J, I] v_I = v_I^T K[I, J] u_J
                terms.append((V[rows], U[_tail(cols, skip)], Kt[:, skip:], A[:, skip:], Zc[skip:]))
            for Ur, Vc, Kp, Ap, Zp in terms:
                Ur, Vc = Ur.to(acc), Vc.to(acc)
                s += (Ur * (Kp @ Vc)).sum(0)
                if isotropic:
                    g[:, 0] += sign * (Ur * (Ap @ Vc)).sum(0)
                    continue
                AZV = (Ap @ (Zp[:, :, None] * Vc[:, None, :]).reshape(Zp.shape[0], d * t)).view(-1, d, t)
                g += ((Ur * (Ap @ Vc)).mT @ Zr.square() + (Vc * (Ap.mT @ Ur)).mT @ Zp.square()
                      - 2.0 * torch.einsum("it,id,idt->td", Ur, Zr, AZV))
        return s, g


def _views_of(Z: torch.Tensor, Zt: torch.Tensor, sel: Any) -> bool:
    """Whether a tile's coordinates ``Zt`` are ``Z[sel]`` itself (a slice's view of ``Z``, not a gathered or centred
    copy), so that rows of ``Z``'s padded coordinates stand for them."""
    if not isinstance(sel, slice):
        return False
    view = Z[sel]
    return Zt.shape == view.shape and Zt.data_ptr() == view.data_ptr() and Zt.stride() == view.stride()


def _without_self_pairs(A: torch.Tensor, rows: Any, cols: Any) -> torch.Tensor:
    """``A`` with the entries that pair a point with itself set to 0 (in place). Their ``(z_i - z_i)^2`` is exactly
    0, but the expanded form ``z_i^2 + z_j^2 - 2 z_i z_j`` leaves a rounding error of about ``eps |z|^2``, which at
    length-scales near 1e-8 (``|z| = |x| / l`` near 1e8) is as large as the whole derivative."""
    def span(sel: Any, size: int) -> tuple[int, int]:  # first and last point of a slice (of the tile's extent)
        if isinstance(sel, slice):  # or of an index tensor
            start = sel.start or 0
            return start, start + size - 1
        return int(sel.min()), int(sel.max())

    if A.numel() == 0:
        return A
    (r0, r1), (c0, c1) = span(rows, A.shape[0]), span(cols, A.shape[1])
    if r1 < c0 or c1 < r0:  # most tiles: no point in both (no index tensors built)
        return A
    if isinstance(rows, slice) and isinstance(cols, slice):  # one diagonal of the tile
        _zero_self_pairs(A, rows, cols)
        return A
    r = torch.arange(r0, r1 + 1, device=A.device) if isinstance(rows, slice) else rows.to(A.device)
    c = torch.arange(c0, c1 + 1, device=A.device) if isinstance(cols, slice) else cols.to(A.device)
    A.masked_fill_(r[:, None] == c[None, :], 0.0)
    return A
