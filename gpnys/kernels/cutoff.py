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

import math
from dataclasses import dataclass

import torch

__all__ = ["cutoff_radius", "spatial_order", "LeafPlan", "leaf_plan"]


def _unit_kernel(r: float, nu: float | None) -> float:
    if nu is None:
        return math.exp(-0.5 * r * r)
    a = math.sqrt(2.0 * nu) * r
    poly = {0.5: 1.0, 1.5: 1.0 + a, 2.5: 1.0 + a + a * a / 3.0}[nu]
    return poly * math.exp(-a)


def cutoff_radius(nu: float | None, tol: float) -> float:
    """Smallest ``r`` (in length-scales) beyond which the unit kernel (RBF: ``nu=None``; Matérn ``nu``) is
    ``<= tol``; ``inf`` for ``tol <= 0``. The kernels are decreasing in ``r``, so a bisection is exact."""
    if tol <= 0.0:
        return math.inf
    if tol >= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while _unit_kernel(hi, nu) > tol:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _unit_kernel(mid, nu) > tol else (lo, mid)
    return hi


@torch.no_grad()
def spatial_order(X: torch.Tensor, leaf: int) -> torch.Tensor:
    """Permutation ``perm`` (``(n,)``) that puts the points ``X`` (``(n, d)``) in k-d tree leaf order: every run
    ``perm[i * leaf : (i + 1) * leaf]`` is one leaf, split off by recursive median bisection along the widest axis
    (splits fall on multiples of ``leaf``, so only the last leaf may be smaller)."""
    n = X.shape[0]
    perm = torch.arange(n, device=X.device)
    todo = [(0, n)]
    while todo:
        a, b = todo.pop()
        if b - a <= leaf:
            continue
        seg = perm[a:b]
        P = X[seg]
        axis = int((P.amax(0) - P.amin(0)).argmax())
        perm[a:b] = seg[torch.argsort(P[:, axis], stable=True)]
        mid = a + max(1, math.ceil((b - a) / (2 * leaf))) * leaf
        todo += [(a, mid), (mid, b)]
    return perm


@dataclass
class LeafPlan:
    """Leaves of ``leaf`` consecutive points of ``perm`` and, per leaf, the positions (in ``perm`` order) of the
    columns to compute: ``cols(i)`` concatenates the leaves listed for leaf ``i``.

    Attributes:
        perm: ``(n,)`` spatial order (:func:`spatial_order`).
        leaf: points per leaf.
        near_ptr, near_idx: CSR lists of neighbour leaves (``near_idx[near_ptr[i]:near_ptr[i + 1]]``, ascending).
        fraction: share of the ``n^2`` entries that the listed leaf pairs cover.
    """

    perm: torch.Tensor
    leaf: int
    near_ptr: list[int]
    near_idx: torch.Tensor
    fraction: float

    @property
    def n(self) -> int:
        return self.perm.shape[0]

    @property
    def num_leaves(self) -> int:
        return len(self.near_ptr) - 1

    def rows(self, i: int) -> slice:
        """Positions (in ``perm`` order) of leaf ``i``'s points."""
        return slice(i * self.leaf, min(self.n, (i + 1) * self.leaf))

    def cols(self, i: int) -> torch.Tensor:
        """Ascending positions (in ``perm`` order) of the points in leaf ``i``'s neighbour leaves. ``(m_i,)``"""
        leaves = self.near_idx[self.near_ptr[i] : self.near_ptr[i + 1]]
        pos = (leaves[:, None] * self.leaf + torch.arange(self.leaf, device=leaves.device)).reshape(-1)
        return pos[pos < self.n]


@torch.no_grad()
def leaf_plan(Z: torch.Tensor, perm: torch.Tensor, leaf: int, radius: float) -> LeafPlan:
    """Neighbour leaves of the leaves of ``perm`` (``(n,)``, :func:`spatial_order`) for points ``Z`` (``(n, d)``, in
    length-scale units): leaf ``j`` is listed for leaf ``i`` when the distance between their bounding boxes is at
    most ``radius``, so every pair of points farther apart than ``radius`` whose leaves are not listed is skipped."""
    n, d = Z.shape
    L = -(-n // leaf)
    P = Z[perm]
    pad = L * leaf - n  # repeat the last point so every leaf has `leaf` rows (it does not change the boxes)
    if pad:
        P = torch.cat([P, P[-1:].expand(pad, d)])
    P = P.reshape(L, leaf, d)
    lo, hi = P.amin(1), P.amax(1)  # (L, d) leaf boxes
    ptr, idx, pairs = [0], [], 0
    sizes = torch.full((L,), leaf, dtype=torch.long, device=Z.device)
    sizes[-1] = n - (L - 1) * leaf
    chunk = max(1, (1 << 22) // max(1, L * d))  # leaf-pair gaps in chunks of ~4M entries
    r2 = radius * radius
    for a in range(0, L, chunk):
        gap = (lo[None, :, :] - hi[a : a + chunk, None, :]).clamp(min=0) + (lo[a : a + chunk, None, :] - hi[None, :, :]).clamp(min=0)
        near = gap.square().sum(-1) <= r2  # (chunk, L)
        counts = near.sum(1)
        pairs += int((near.to(sizes.dtype) @ sizes * sizes[a : a + chunk]).sum())
        for row, c in zip(near, counts.tolist()):
            idx.append(row.nonzero().squeeze(1))
            ptr.append(ptr[-1] + c)
    near_idx = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long, device=Z.device)
    return LeafPlan(perm=perm, leaf=leaf, near_ptr=ptr, near_idx=near_idx, fraction=pairs / float(n * n))
