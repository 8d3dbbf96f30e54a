"""k-means landmarks (clustered Nyström; Zhang & Kwok 2008): k-means++ seeding, then Lloyd iterations.

The centres are not data points. Lloyd's assignment step runs in row blocks
(:func:`~gpnys.landmarks.distances.nearest`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpnys.landmarks.common import generator, validate_points_k
from gpnys.landmarks.distances import nearest, row_block, sqdist_to_point

__all__ = ["KMeansResult", "kmeans"]


@dataclass
class KMeansResult:
    """k-means output. ``centers: (k, d)``, ``labels: (n,)`` long, ``inertia``: sum of squared distances."""

    centers: torch.Tensor
    labels: torch.Tensor
    inertia: float
    n_iter: int


def kmeans(X: torch.Tensor, k: int, iters: int = 20, seed: int = 0, tol: float = 1e-6) -> KMeansResult:
    """k-means++ seeding (Arthur & Vassilvitskii 2007) followed by Lloyd iterations.

    Used for clustered Nyström landmarks (Zhang & Kwok 2008). An empty cluster is re-seeded at the point
    farthest from its centre. Stops when the relative decrease of the inertia falls below ``tol``.

    Args:
        X: ``(n, d)`` points; k: number of centres (``1 <= k <= n``); iters: max Lloyd iterations.

    Returns:
        :class:`KMeansResult` with ``centers (k, d)`` in X's dtype.

    Example:
        >>> import torch
        >>> from gpnys.landmarks import kmeans
        >>> X = torch.rand(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> res = kmeans(X, 5, seed=0)
        >>> res.centers.shape
        torch.Size([5, 2])
        >>> d2 = torch.cdist(X, res.centers).square()  # every point is labelled with its nearest centre
        >>> torch.equal(res.labels, d2.argmin(1)), abs(res.inertia - float(d2.min(1).values.sum())) < 1e-9
        (True, True)
    """
    validate_points_k(X, k)
    if isinstance(iters, bool) or int(iters) != iters or iters < 0:
        raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
    if not float(tol) >= 0:
        raise ValueError(f"tol must be >= 0, got {tol!r}")
    n = X.shape[0]
    gen = generator(seed, X.device)
    block = row_block(n, X.shape[1], X.device)
    first = int(torch.randint(n, (1,), generator=gen, device=X.device))
    centers = [X[first]]
    mind = sqdist_to_point(X, X[first], block)
    for _ in range(1, k):
        total = mind.sum()
        if total <= 0:  # all remaining points coincide with centres: take any not-yet-used point
            probs = torch.ones_like(mind)
        else:
            probs = mind / total
        idx = int(torch.multinomial(probs, 1, generator=gen))
        centers.append(X[idx])
        mind = torch.minimum(mind, sqdist_to_point(X, X[idx], block))
    C = torch.stack(centers)
    labels, d2 = nearest(X, C)
    inertia = float(d2.sum())
    it = 0
    for it in range(1, iters + 1):
        sums = torch.zeros_like(C).index_add_(0, labels, X)
        counts = torch.bincount(labels, minlength=k).to(X.dtype)
        empty = counts == 0
        C = torch.where(empty[:, None], C, sums / counts.clamp_min(1)[:, None])
        if empty.any():
            far = torch.argsort(d2, descending=True)[: int(empty.sum())]
            C[empty] = X[far]
        labels, d2 = nearest(X, C)
        new = float(d2.sum())
        done = inertia - new <= tol * max(inertia, 1e-300)
        inertia = new
        if done:
            break
    return KMeansResult(centers=C, labels=labels, inertia=inertia, n_iter=it)
