"""Causal k-nearest-neighbour sparsity patterns for FSAI (AFN paper Algorithm 1 and §3.1).

Row ``i`` of a lower-triangular FSAI factor may only use columns ``j <= i``, so its pattern is the
``w - 1`` nearest neighbours of point ``i`` among the points *numbered before it* plus ``i`` itself (the
paper's §3.1), with ``i`` last so that Algorithm 1's unit vector ``e_w`` picks the diagonal.

Hand-written on purpose: the maintained kNN libraries (scikit-learn, FAISS, pykeops, torch_cluster) answer
"nearest among all points" and have no notion of "nearest among earlier-ordered points", which would need
one index per prefix. Three exact paths:

* brute force in row blocks: ``O(n^2 d / 2)`` time, ``O(n * block)`` memory, any device;
* on the CPU from :data:`TREE_MIN_N` points on (and ``d <=`` :data:`TREE_MAX_D`): rows in chunks of
  :data:`TREE_CHUNK`; each chunk queries a ``scipy.spatial.cKDTree`` of all earlier chunks and brute-forces the
  pairs inside the chunk, then keeps the ``w - 1`` nearest of both. ``O(n^2 / C log n)`` tree builds,
  ``O(n C d)`` brute force, several times faster than the brute force in low dimension (docs/scaling.md).
  Exact distance ties between a tree candidate and another point may be broken differently from the brute
  force path (deterministically), which matters only for duplicated points.
* on a GPU from :data:`GRID_MIN_N` points on (and ``d <=`` :data:`GRID_MAX_D`): the first :data:`GRID_FIRST`
  rows by brute force, then rows in doubling chunks ``[s, 2s)``: a uniform grid over ``X[:2s]`` with about
  ``w - 1`` of the ``s`` earlier points per cell, each row's candidates the earlier points of the ``3^d`` cells
  around its own, sorted by (distance, index). A row's answer is kept only when its ``(w - 1)``-th distance is
  below the distance to the edge of those cells (so no point outside can be nearer); the rest go to the brute
  force. Distances are explicit differences. ``O(n 3^d w)`` work instead of ``O(n^2 d / 2)`` (docs/gpu.md).
  ``grid=True`` runs it on any device (the CPU keeps the tree by default, which is faster there).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gpnys.budget import block_bytes, block_rows

__all__ = ["causal_knn", "TREE_MIN_N", "TREE_MAX_D", "TREE_CHUNK", "GRID_MIN_N", "GRID_MAX_D", "GRID_FIRST"]

#: smallest n for the k-d tree path (below it the brute force takes under a second)
TREE_MIN_N = 20_000
#: largest dimension for the k-d tree path (k-d trees lose their pruning in high dimension)
TREE_MAX_D = 8
#: rows per chunk of the k-d tree path
TREE_CHUNK = 4096
#: smallest n of the grid path when it is chosen by default (on a GPU; below it the brute force is as fast)
GRID_MIN_N = 50_000
#: largest dimension of the grid path (each row searches 3^d cells)
GRID_MAX_D = 4
#: rows answered by brute force before the grid path's first chunk
GRID_FIRST = 8192
#: bytes per candidate pair of the grid path (indices, distances and three sort permutations), for its batches
_PAIR_BYTES = 96


@torch.no_grad()
def causal_knn(X: torch.Tensor, w: int, block: int | None = None, tree: bool | None = None,
               grid: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal kNN pattern: for each row ``i`` of ``X`` its ``w - 1`` nearest rows among ``j < i``, then ``i``.

    Distances are Euclidean in ``X``'s dtype: squared in the expanded form (one product, no square roots) by brute
    force, explicit differences on the grid path. Neighbours are ordered by distance, ties
    broken by the lowest index; the row's own index is always LAST (the position ``e_w`` of Algorithm 1).
    Rows ``i < w - 1`` have only ``i`` candidates; their missing slots are padded with index ``i`` and
    ``valid = False`` (pads sit between the neighbours and the final ``i``), so shapes stay rectangular.

    Args:
        X: ``(n, d)`` points in the order that defines "earlier".
        w: pattern width (nonzeros per row including the diagonal), ``w >= 1``.
        block: rows per distance block of the brute-force path; default: the memory budget's block.
        tree: use the k-d tree path (CPU only); ``None``: when ``n >= TREE_MIN_N`` and ``d <= TREE_MAX_D``.
        grid: use the grid path (any device); ``None``: on a GPU when ``n >= GRID_MIN_N`` and ``d <= GRID_MAX_D``.

    Returns:
        ``idx: (n, w)`` long and ``valid: (n, w)`` bool, on ``X``'s device. ``idx[i, -1] == i`` always.

    Example:
        >>> import torch
        >>> from gpnys.precond.knn import causal_knn
        >>> X = torch.rand(200, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> idx, valid = causal_knn(X, 5)
        >>> bool((idx[:, -1] == torch.arange(200)).all())  # each row's own index last
        True
        >>> valid[2].tolist()  # row 2 has only two earlier points: two pads before itself
        [True, True, False, False, True]
        >>> d = torch.cdist(X[50:51], X[:50])[0]  # row 50 against the points numbered before it
        >>> torch.equal(idx[50, :4], d.argsort()[:4])
        True
    """
    if X.dim() != 2:
        raise ValueError(f"X must be a 2-D tensor (n, d), got shape {tuple(X.shape)}")
    n = X.shape[0]
    if isinstance(w, bool) or int(w) != w or w < 1:
        raise ValueError(f"w must be a positive integer, got {w!r}")
    w = int(w)
    dev = X.device
    rows_all = torch.arange(n, device=dev)
    idx = rows_all[:, None].expand(n, w).clone()
    valid = torch.zeros(n, w, dtype=torch.bool, device=dev)
    valid[:, -1] = True
    m = w - 1  # neighbours wanted per row
    if m == 0 or n <= 1:
        return idx, valid
    if tree and grid:
        raise ValueError("tree and grid are two different paths: ask for at most one")
    if grid is None:
        grid = not tree and dev.type != "cpu" and n >= GRID_MIN_N and X.shape[1] <= GRID_MAX_D
    if tree is None:
        tree = not grid and dev.type == "cpu" and n >= TREE_MIN_N and X.shape[1] <= TREE_MAX_D
    if tree:
        if dev.type != "cpu":
            raise ValueError(f"tree=True runs on CPU tensors (scipy's cKDTree); X is on {dev}")
        _tree_knn(X, m, idx, valid)
        return idx, valid
    first = min(n, GRID_FIRST) if grid else n
    bb = int(block) if block else block_rows(first, cap=first, device=dev)
    for i0 in range(1, first, bb):  # row 0 has no candidates
        _brute_rows(X, rows_all[i0 : min(first, i0 + bb)], m, idx, valid, exact=grid)
    if first < n:
        _grid_knn(X, m, idx, valid, first, block)
    return idx, valid


def _brute_rows(X: torch.Tensor, rows: torch.Tensor, m: int, idx: torch.Tensor, valid: torch.Tensor,
                exact: bool = False) -> None:
    """Fill ``idx[rows, :m]`` / ``valid[rows, :m]`` by brute force: distances from ``X[rows]`` to every earlier
    point. ``rows``: ``(b,)`` ascending, all ``>= 1``."""
    i1, r0 = int(rows[-1]) + 1, int(rows[0])
    # (b, i1): candidates are the columns j < i. ``exact``: explicit differences, as the grid path measures (the
    # expanded form's cancellation can reorder near-ties in float32); else squared distances in one product of the
    # padded points [-2x, |x|², 1] and [y, 1, |y|²] (torch's expanded form without its square roots: the same order)
    Xr, Xc = X.index_select(0, rows), X[:i1]
    if exact:
        D = torch.cdist(Xr, Xc, compute_mode="donot_use_mm_for_euclid_dist")
    else:
        one_r, one_c = Xr.new_ones(Xr.shape[0], 1), Xc.new_ones(i1, 1)
        D = torch.cat([-2.0 * Xr, Xr.square().sum(1, keepdim=True), one_r], 1) @ torch.cat(
            [Xc, one_c, Xc.square().sum(1, keepdim=True)], 1).mT
        D.clamp_(min=0.0)
    # columns before the first row are every row's candidates: only the rest needs the causal mask
    D[:, r0:].masked_fill_(torch.arange(r0, i1, device=X.device)[None, :] >= rows[:, None], float("inf"))
    kk = min(m, i1)
    # topk with one extra value tells whether the kk-th distance ties with an unpicked one; only such
    # rows (rare, plus the padded early rows whose threshold is inf) need the exact tie-break below.
    top = torch.topk(D, min(kk + 1, i1), dim=1, largest=False)
    cols, dsel = top.indices[:, :kk], top.values[:, :kk]
    if top.values.shape[1] > kk:
        amb = (top.values[:, kk] == top.values[:, kk - 1]).nonzero().squeeze(1)
        if amb.numel():
            cols[amb] = _lowest_index_ties(D[amb], dsel[amb, -1:], kk)
            dsel[amb] = D[amb].gather(1, cols[amb])
    dsel, cols = _order_candidates(dsel, cols, kk)
    ok = torch.isfinite(dsel)  # inf = no real candidate (row i < w - 1)
    idx[rows, :kk] = torch.where(ok, cols, rows[:, None])
    valid[rows, :kk] = ok


def _grid_knn(X: torch.Tensor, m: int, idx: torch.Tensor, valid: torch.Tensor, first: int,
              block: int | None) -> None:
    """Rows ``first..n-1`` by the grid path (module docstring); rows it cannot prove go to :func:`_brute_rows`."""
    n, d = X.shape
    dev = X.device
    offsets = torch.cartesian_prod(*[torch.arange(-1, 2, device=dev)] * d).reshape(-1, d)  # (3^d, d)
    failed = []
    s = first
    while s < n:
        e = min(n, 2 * s)
        failed.append(_grid_chunk(X, s, e, m, idx, valid, offsets))
        s = e
    rows = torch.cat(failed)
    nf = rows.numel()
    bb = int(block) if block else block_rows(n, cap=max(1, nf), device=dev)
    for j in range(0, nf, bb):
        _brute_rows(X, rows[j : j + bb], m, idx, valid, exact=True)


def _grid_chunk(X: torch.Tensor, s: int, e: int, m: int, idx: torch.Tensor, valid: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``s..e-1`` (``e <= 2 s``) on a grid over ``X[:e]``; returns the rows left unproven ``(f,)``."""
    d = X.shape[1]
    dev = X.device
    P = X[:e]
    lo, hi = P.min(0).values, P.max(0).values
    ext = (hi - lo).tolist()
    live = [x for x in ext if x > 0]
    # cell side: about m of the s earlier points per cell if they filled their bounding box uniformly
    h = (math.prod(live) * m / s) ** (1.0 / len(live)) if live else 1.0
    G = [min(1 << (62 // d), max(1, math.ceil(x / h))) for x in ext]  # cells per dimension (keys fit int64)
    Gt = torch.tensor(G, device=dev)
    stride = torch.tensor([math.prod(G[j + 1 :]) for j in range(d)], device=dev)
    cell = torch.minimum(((P - lo) / h).floor().long().clamp_min(0), Gt - 1)
    skey, perm = torch.sort((cell * stride).sum(1))
    cq = cell[s:e]
    nbc = cq[:, None, :] + offsets[None]  # (c, 3^d, d) the cells around each row's own
    inside = ((nbc >= 0) & (nbc < Gt)).all(-1)
    nkey = (nbc * stride).sum(-1)
    start = torch.searchsorted(skey, nkey)
    cnt = torch.where(inside, torch.searchsorted(skey, nkey, right=True) - start, 0)
    # a point outside those cells is at least `margin` away (infinite towards the grid's edge, where none lie);
    # rounding of the cell assignment is covered by a few ulps of the coordinates
    q, cf = X[s:e], cq.to(X.dtype)
    below = torch.where(cq > 1, q - (lo + (cf - 1) * h), float("inf"))
    above = torch.where(cq < Gt - 2, (lo + (cf + 2) * h) - q, float("inf"))
    slack = 8 * torch.finfo(X.dtype).eps * float(torch.maximum(lo.abs(), hi.abs()).max() + h)
    margin = (torch.minimum(below, above).min(1).values - slack).clamp_min(0)
    # query batches of about one memory block of candidate pairs
    cum = cnt.sum(1).cumsum(0)
    per_batch = max(1, block_bytes(dev) // _PAIR_BYTES)
    total = int(cum[-1])
    ends = torch.searchsorted(cum, torch.arange(per_batch, total + per_batch, per_batch, device=dev), right=True)
    bounds = sorted({min(e - s, max(1, int(b))) for b in ends.tolist()} | {e - s})
    failed = []
    a = 0
    for b in bounds:
        if b <= a:
            continue
        failed.append(s + a + _grid_batch(X, s + a, s + b, m, idx, valid, perm, start[a:b], cnt[a:b], margin[a:b]))
        a = b
    return torch.cat(failed)


def _grid_batch(X: torch.Tensor, r0: int, r1: int, m: int, idx: torch.Tensor, valid: torch.Tensor,
                perm: torch.Tensor, start: torch.Tensor, cnt: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """Rows ``r0..r1-1`` given their cells' ranges ``start, cnt (b, 3^d)`` in ``perm``; returns the offsets (into
    ``r0..r1-1``) of the rows whose ``m``-th distance is not below ``margin (b,)``."""
    dev = X.device
    b, nb = cnt.shape
    cnt_f, start_f = cnt.reshape(-1), start.reshape(-1)
    seg = torch.repeat_interleave(torch.arange(b * nb, device=dev), cnt_f)
    pos = torch.arange(seg.numel(), device=dev) - (cnt_f.cumsum(0) - cnt_f)[seg]
    cand = perm[start_f[seg] + pos]
    qloc = seg // nb
    keep = cand < qloc + r0  # causal: earlier points only
    cand, qloc = cand[keep], qloc[keep]
    d2 = (X.index_select(0, cand) - X.index_select(0, qloc + r0)).square().sum(1)
    # order by (row, distance, index): three stable sorts, least significant key first
    o = torch.sort(cand, stable=True).indices
    o = o[torch.sort(d2[o], stable=True).indices]
    o = o[torch.sort(qloc[o], stable=True).indices]
    cand, qloc, d2 = cand[o], qloc[o], d2[o]
    per_row = torch.bincount(qloc, minlength=b)
    rank = torch.arange(qloc.numel(), device=dev) - (per_row.cumsum(0) - per_row)[qloc]
    sel = rank < m
    dm = torch.full((b, m), float("inf"), dtype=X.dtype, device=dev)
    cm = torch.zeros((b, m), dtype=torch.long, device=dev)
    dm[qloc[sel], rank[sel]] = d2[sel]
    cm[qloc[sel], rank[sel]] = cand[sel]
    ok = (per_row >= m) & (dm[:, -1] < margin.square())
    rows = torch.arange(r0, r1, device=dev)
    good = ok.nonzero().squeeze(1)
    idx[rows[good], :m] = cm[good]
    valid[rows[good], :m] = True
    return (~ok).nonzero().squeeze(1)


def _lowest_index_ties(D: torch.Tensor, t: torch.Tensor, kk: int) -> torch.Tensor:
    """Columns of the ``kk`` smallest entries per row of ``D (b, c)`` given the kk-th smallest ``t (b, 1)``:
    everything below ``t``, then the lowest-index entries equal to ``t``. ``(b, kk)`` ascending."""
    less = D < t
    tie = D == t
    need = kk - less.sum(dim=1, keepdim=True)
    sel = less | (tie & (tie.cumsum(dim=1) <= need))
    return sel.nonzero()[:, 1].view(-1, kk)


def _order_candidates(dist: torch.Tensor, cols: torch.Tensor, kk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kk`` nearest of the candidates ``(dist, cols)`` (``(b, c)``) per row, ordered by distance, ties by
    lowest index (sort by index, then stably by distance)."""
    cols, o = torch.sort(cols, dim=1)
    dist = dist.gather(1, o)
    dist, o = torch.sort(dist, dim=1, stable=True)
    return dist[:, :kk], cols.gather(1, o)[:, :kk]


def _tree_knn(X: torch.Tensor, m: int, idx: torch.Tensor, valid: torch.Tensor) -> None:
    """Fill ``idx[:, :m]`` / ``valid[:, :m]`` by chunks: k-d tree of the earlier chunks plus brute force inside
    the chunk (module docstring). CPU only (scipy)."""
    from scipy.spatial import cKDTree  # here, not at import: scipy.spatial pulls in scipy.sparse (~0.3 s)

    n = X.shape[0]
    P = X.detach().to(torch.float64).numpy()
    inf = float("inf")
    for s in range(0, n, TREE_CHUNK):
        e = min(n, s + TREE_CHUNK)
        rows = torch.arange(s, e)
        D = torch.cdist(X[s:e].double(), X[s:e].double())  # pairs inside the chunk: j < i only
        D.masked_fill_(rows[None, :] >= rows[:, None], inf)
        kin = min(m, e - s)
        dist, cols = torch.topk(D, kin, dim=1, largest=False)
        cols = cols + s
        if s > 0:
            kt = min(m, s)
            dt, it = cKDTree(P[:s]).query(P[s:e], k=kt)
            dt, it = np.asarray(dt).reshape(e - s, kt), np.asarray(it).reshape(e - s, kt)
            dist = torch.cat([dist, torch.from_numpy(dt)], 1)
            cols = torch.cat([cols, torch.from_numpy(it).to(torch.long)], 1)
        kk = min(m, e - 1)
        dist, cols = _order_candidates(dist, cols, kk)
        ok = torch.isfinite(dist)
        idx[s:e, :kk] = torch.where(ok, cols, rows[:, None]).to(idx.device)
        valid[s:e, :kk] = ok.to(valid.device)
