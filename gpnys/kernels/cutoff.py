"""Which kernel entries are below a tolerance: spatial leaves and their neighbour lists.

A stationary kernel decays with distance: the unit Matérn-3/2 kernel is below float64's machine epsilon beyond
``r = 23.4`` length-scales, RBF beyond ``r = 8.5``. In a low-dimensional point set larger than that, most pairs are
that far apart (synthetic 3-D with unit density, n = 200 000, l = 1: the cube's edge is 58), and an on-the-fly
product spends most of its time computing zeros. :func:`leaf_plan` sorts the points into compact leaves of ``c``
points (recursive median bisection along the widest axis, as a k-d tree does), bounds each leaf by its box, and
lists for every leaf the leaves whose box lies within the cutoff radius. Entries between leaves not listed are all
``<= tol`` (times the outputscale) and are skipped.

Hand-written because the maintained spatial libraries answer point queries (``scipy.spatial.cKDTree``), not the
leaf-to-leaf box lists a blocked kernel product needs, and they live on the CPU only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from gpnys.kernels.formulas import unit_kernel

__all__ = ["cutoff_radius", "normal_range", "spatial_order", "LeafPlan", "leaf_plan", "SUBNORMAL_MARGIN"]

#: the smallest kernel value a tile holds, in units of its dtype's smallest normal number (:func:`normal_range`)
SUBNORMAL_MARGIN = 2.0**20


def cutoff_radius(nu: float | None, tol: float) -> float:
    """Smallest ``r`` (in length-scales) beyond which the unit kernel (RBF: ``nu=None``; Matérn ``nu``) is
    ``<= tol``; ``inf`` for ``tol <= 0``. The kernels are decreasing in ``r``, so a bisection is exact."""
    if tol <= 0.0:
        return math.inf
    if tol >= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while unit_kernel(hi, nu) > tol:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if unit_kernel(mid, nu) > tol else (lo, mid)
    return hi


@functools.lru_cache(maxsize=None)
def normal_range(nu: float | None, dtype: torch.dtype) -> float:
    """The squared distance (in length-scales) up to which the unit kernel stays at least ``SUBNORMAL_MARGIN``
    times ``dtype``'s smallest normal number: a tile's distances are clamped there (the kernel beyond is set to its
    value at this distance, at most ``2^20 tiny``: 1.2e-32 in float32, 2.3e-302 in float64). Subnormal entries
    (below ``tiny``) take the CPU's slow path in every product that reads them: 0.2 % of a float64 kernel's entries
    made its products 1.4x slower (docs/scaling.md). The margin keeps Matérn's ``k'/r``, about ``k / r`` there,
    normal too. A dtype whose floor, summed over 2^40 entries, would exceed its machine epsilon (float16) is never
    clamped (``inf``).

    Example:
        >>> import torch
        >>> from gpnys.kernels.cutoff import normal_range
        >>> round(normal_range(None, torch.float32) ** 0.5, 2)  # RBF: exp(-r²/2) = 2^20 tiny at r = 12.12
        12.12
    """
    info = torch.finfo(dtype)
    floor = SUBNORMAL_MARGIN * info.tiny
    if floor * 2.0**40 > info.eps:  # float16: the floor summed over a row's far entries would exceed the rounding
        return math.inf
    return cutoff_radius(nu, floor) ** 2


@torch.no_grad()
def spatial_order(X: torch.Tensor, leaf: int) -> torch.Tensor:
    """Permutation ``perm`` (``(n,)``) that puts the points ``X`` (``(n, d)``) in k-d tree leaf order: every run
    ``perm[i * leaf : (i + 1) * leaf]`` is one leaf, split off by recursive median bisection along the widest axis
    (splits fall on multiples of ``leaf``, so only the last leaf may be smaller).

    Built level by level: all ``S`` segments longer than ``leaf`` at one depth are padded to a common length ``w``
    and sorted together as one ``(S, w)`` batch (a few host syncs per level, not one per tree node). Segments are
    disjoint and each sort permutes within its segment only, so this equals splitting them one at a time; within
    a segment the sort is stable (ties keep their order) and the widest axis is the first of equal widths."""
    n, d = X.shape
    dev = X.device
    perm = torch.arange(n + 1, device=dev)  # perm[n]: scratch slot that the padding is written to
    start = torch.zeros(1, dtype=torch.long, device=dev)
    size = torch.full((1,), n, dtype=torch.long, device=dev)
    while True:
        keep = size > leaf
        start, size = start[keep], size[keep]  # (S,) segments still to split
        S = start.numel()
        if S == 0:
            return perm[:n]
        w = int(size.max())
        off = torch.arange(w, device=dev)
        real = off < size[:, None]  # (S, w); padding repeats the segment's first point (same box)
        seg = perm.index_select(0, (start[:, None] + torch.where(real, off, 0)).view(-1))
        P = X.index_select(0, seg).view(S, w, d)
        seg = seg.view(S, w)
        hi = P.amax(1)
        axis = (hi - P.amin(1)).argmax(1, keepdim=True)  # (S, 1) widest axis, first of ties
        key = P.gather(2, axis[:, None, :].expand(-1, w, 1)).squeeze(2)  # (S, w)
        # padding sorts last: it equals the segment's largest key (NaN included) and comes after every real point
        key = torch.where(real, key, hi.gather(1, axis))
        order = torch.argsort(key, dim=1, stable=True)
        dst = torch.where(real, start[:, None] + off, n)
        perm.index_put_((dst.view(-1),), seg.gather(1, order).view(-1))
        half = (size + 2 * leaf - 1) // (2 * leaf)  # ceil(size / (2 leaf)) >= 1
        mid = start + half * leaf
        start, size = torch.cat([start, mid]), torch.cat([mid - start, start + size - mid])


@dataclass
class LeafPlan:
    """Leaves of ``leaf`` consecutive points of ``perm`` and, per leaf, the positions (in ``perm`` order) of the
    columns to compute: ``cols(i)`` concatenates the leaves listed for leaf ``i``.

    Attributes:
        perm: ``(n,)`` spatial order (:func:`spatial_order`).
        leaf: points per leaf.
        near_ptr, near_idx: CSR lists of neighbour leaves (``near_idx[near_ptr[i]:near_ptr[i + 1]]``, ascending).
        fraction: share of the ``n^2`` entries that the listed leaf pairs cover.
        near_ptr_t: ``near_ptr`` as an int64 tensor (``(L + 1,)``) on ``near_idx``'s device, for device kernels.
    """

    perm: torch.Tensor
    leaf: int
    near_ptr: list[int]
    near_idx: torch.Tensor
    fraction: float
    near_ptr_t: torch.Tensor

    @property
    def n(self) -> int:
        return self.perm.shape[0]

    @property
    def num_leaves(self) -> int:
        return len(self.near_ptr) - 1

    def rows(self, i: int) -> slice:
        """Positions (in ``perm`` order) of leaf ``i``'s points."""
        return slice(i * self.leaf, min(self.n, (i + 1) * self.leaf))

    def cols(self, i: int, upper: bool = False) -> torch.Tensor:
        """Ascending positions (in ``perm`` order) of the points in leaf ``i``'s neighbour leaves (``upper``: only
        the leaves ``j >= i``; the lists are symmetric, so these cover the upper triangle). ``(m_i,)``"""
        leaves = self.near_idx[self.near_ptr[i] : self.near_ptr[i + 1]]
        if upper:
            leaves = leaves[leaves >= i]
        pos = (leaves[:, None] * self.leaf + torch.arange(self.leaf, device=leaves.device)).reshape(-1)
        return pos[pos < self.n]


@torch.no_grad()
def leaf_plan(Z: torch.Tensor, perm: torch.Tensor, leaf: int, radius: float) -> LeafPlan:
    """Neighbour leaves of the leaves of ``perm`` (``(n,)``, :func:`spatial_order`) for points ``Z`` (``(n, d)``, in
    length-scale units): leaf ``j`` is listed for leaf ``i`` when the distance between their bounding boxes is at
    most ``radius``, so every pair of points farther apart than ``radius`` whose leaves are not listed is skipped.

    The box distances are symmetric (bit for bit), so only the upper triangle is computed, in row chunks (one host
    sync each, for ``nonzero``), and mirrored; one sort by ``(row, column)`` then gives the CSR lists."""
    n, d = Z.shape
    dev = Z.device
    L = -(-n // leaf)
    P = Z[perm]
    pad = L * leaf - n  # repeat the last point so every leaf has `leaf` rows (it does not change the boxes)
    if pad:
        P = torch.cat([P, P[-1:].expand(pad, d)])
    P = P.reshape(L, leaf, d)
    lo, hi = P.amin(1).T.contiguous(), P.amax(1).T.contiguous()  # (d, L) leaf boxes
    sizes = torch.full((L,), leaf, dtype=torch.long, device=dev)
    sizes[-1] = n - (L - 1) * leaf
    entries = 1 << (25 if dev.type == "cuda" else 22)  # leaf-pair gaps in chunks of ~4M entries (32M on a GPU)
    chunk = max(1, entries // max(1, L * d))
    r2 = radius * radius
    upper = []
    for a in range(0, L, chunk):
        # leaves a..a+chunk-1 against a..L-1, one axis at a time: (chunk, L - a) squared gaps between the boxes
        sq = []
        for lo_k, hi_k in zip(lo, hi):
            gap = (lo_k[None, a:] - hi_k[a : a + chunk, None]).clamp_(min=0)
            gap += (lo_k[a : a + chunk, None] - hi_k[None, a:]).clamp_(min=0)
            sq.append(gap.square_())
        if d <= 3:  # summed in order, as torch's CPU sum adds up a last dimension this short
            dist2 = sq[0]
            for s in sq[1:]:
                dist2 += s
        else:  # torch's own order (partial sums) for longer ones
            dist2 = torch.stack(sq, -1).sum(-1)
        ij = (dist2 <= r2).nonzero()
        upper.append(ij[ij[:, 1] >= ij[:, 0]] + a)  # (i, j) with i <= j
    i, j = torch.cat(upper).unbind(1)
    off = i != j
    i, j = torch.cat([i, j[off]]), torch.cat([j, i[off]])  # and its mirror image
    key = torch.sort(i * L + j).values  # row-major: rows ascending, columns ascending within a row
    near_idx = key % L
    ptr_t = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.bincount(i, minlength=L).cumsum(0)])
    pairs = int((sizes[i] * sizes[j]).sum())  # points covered, integer-exact on every device
    return LeafPlan(perm=perm, leaf=leaf, near_ptr=ptr_t.tolist(), near_idx=near_idx,
                    fraction=pairs / float(n * n), near_ptr_t=ptr_t)
