"""Causal k-nearest-neighbour sparsity patterns for FSAI (AFN paper Algorithm 1, line 2; pitfall P8).

Row ``i`` of a lower-triangular FSAI factor may only use columns ``j <= i``, so its pattern is the
``w - 1`` nearest neighbours of point ``i`` among the points *numbered before it* plus ``i`` itself.

Hand-written on purpose: the maintained kNN libraries (scikit-learn, FAISS, pykeops, torch_cluster) answer
"nearest among all points" and have no notion of "nearest among earlier-ordered points", which would need
one index per prefix. Two exact paths:

* brute force in row blocks: ``O(n^2 d / 2)`` time, ``O(n * block)`` memory, any device;
* on the CPU from :data:`TREE_MIN_N` points on (and ``d <=`` :data:`TREE_MAX_D`): rows in chunks of
  :data:`TREE_CHUNK`; each chunk queries a ``scipy.spatial.cKDTree`` of all earlier chunks and brute-forces the
  pairs inside the chunk, then keeps the ``w - 1`` nearest of both. ``O(n^2 / C log n)`` tree builds,
  ``O(n C d)`` brute force: at n = 200 000, d = 3 (w = 30) 9.1 s instead of 68 s (docs/scaling.md).
  Exact distance ties between a tree candidate and another point may be broken differently from the brute
  force path (deterministically), which matters only for duplicated points.
"""

from __future__ import annotations

import numpy as np
import scipy.spatial
import torch

from gpnys.budget import block_rows

__all__ = ["causal_knn", "TREE_MIN_N", "TREE_MAX_D", "TREE_CHUNK"]

#: smallest n for the k-d tree path (below it the brute force takes under a second)
TREE_MIN_N = 20_000
#: largest dimension for the k-d tree path (k-d trees lose their pruning in high dimension)
TREE_MAX_D = 8
#: rows per chunk of the k-d tree path
TREE_CHUNK = 4096


@torch.no_grad()
def causal_knn(X: torch.Tensor, w: int, block: int | None = None, tree: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal kNN pattern: for each row ``i`` of ``X`` its ``w - 1`` nearest rows among ``j < i``, then ``i``.

    Distances are Euclidean in ``X``'s dtype (``torch.cdist``). Neighbours are ordered by distance, ties
    broken by the lowest index; the row's own index is always LAST (the position ``e_w`` of Algorithm 1).
    Rows ``i < w - 1`` have only ``i`` candidates; their missing slots are padded with index ``i`` and
    ``valid = False`` (pads sit between the neighbours and the final ``i``), so shapes stay rectangular.

    Args:
        X: ``(n, d)`` points in the order that defines "earlier".
        w: pattern width (nonzeros per row including the diagonal), ``w >= 1``.
        block: rows per distance block of the brute-force path; default: the memory budget's block.
        tree: use the k-d tree path (CPU only); ``None``: when ``n >= TREE_MIN_N`` and ``d <= TREE_MAX_D``.

    Returns:
        ``idx: (n, w)`` long and ``valid: (n, w)`` bool, on ``X``'s device. ``idx[i, -1] == i`` always.
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
    if tree is None:
        tree = dev.type == "cpu" and n >= TREE_MIN_N and X.shape[1] <= TREE_MAX_D
    if tree:
        if dev.type != "cpu":
            raise ValueError(f"tree=True runs on CPU tensors (scipy's cKDTree); X is on {dev}")
        _tree_knn(X, m, idx, valid)
        return idx, valid
    block = int(block) if block else block_rows(n, cap=n, device=dev)
    for i0 in range(1, n, block):  # row 0 has no candidates
        i1 = min(n, i0 + block)
        rows = rows_all[i0:i1]
        D = torch.cdist(X[i0:i1], X[:i1])  # (b, i1): candidates are the columns j < i
        D.masked_fill_(rows_all[:i1][None, :] >= rows[:, None], float("inf"))
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
        idx[i0:i1, :kk] = torch.where(ok, cols, rows[:, None])
        valid[i0:i1, :kk] = ok
    return idx, valid


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
            dt, it = scipy.spatial.cKDTree(P[:s]).query(P[s:e], k=kt)
            dt, it = np.asarray(dt).reshape(e - s, kt), np.asarray(it).reshape(e - s, kt)
            dist = torch.cat([dist, torch.from_numpy(dt)], 1)
            cols = torch.cat([cols, torch.from_numpy(it).to(torch.long)], 1)
        kk = min(m, e - 1)
        dist, cols = _order_candidates(dist, cols, kk)
        ok = torch.isfinite(dist)
        idx[s:e, :kk] = torch.where(ok, cols, rows[:, None]).to(idx.device)
        valid[s:e, :kk] = ok.to(valid.device)
