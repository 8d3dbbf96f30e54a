"""Landmark selection for every Nyström-type method: farthest point sampling, uniform, k-means.

* :func:`fps` — farthest point sampling (AFN paper Algorithm 6, Gonzalez 1985), O(d k n) time with the
  running min-distance vector, O(n) extra memory; returns the selection order and fill distances.
* :func:`uniform` — k distinct indices uniformly at random.
* :func:`kmeans` — k-means++ seeded Lloyd iterations (clustered Nyström; Zhang & Kwok 2008), centres
  are not data points.

All functions are seeded, device-agnostic and work in float32 and float64. Distances are computed in
row blocks so that temporary memory stays O(block * d) on top of the O(n) running vectors.

FPS and Lloyd's assignment step are written here because no maintained torch library offers a seeded,
blocked, device-agnostic version that also returns the fill distances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpnys.budget import block_rows

__all__ = ["FPSResult", "KMeansResult", "fps", "uniform", "kmeans", "fill_distance", "select", "METHODS"]

METHODS = ("fps", "uniform", "kmeans")


def _validate(X: torch.Tensor, k: int) -> None:
    if not isinstance(X, torch.Tensor) or X.dim() != 2:
        raise ValueError(f"X must be a 2-D tensor (n, d), got {getattr(X, 'shape', type(X))}")
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise ValueError(f"X is empty: shape {tuple(X.shape)}")
    if not torch.isfinite(X).all():
        raise ValueError("X contains NaN or inf")
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k > X.shape[0]:
        raise ValueError(f"k={k} landmarks requested but X has only n={X.shape[0]} points")


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def _sqdist_to_point(X: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    """||X_j - x||^2 for every row j, computed by differences (no cancellation), in row blocks. (n,)"""
    n = X.shape[0]
    if n <= block:
        return (X - x).square().sum(dim=1)
    return torch.cat([(X[i : i + block] - x).square().sum(dim=1) for i in range(0, n, block)])


def _row_block(n: int, m: int, device: torch.device | None = None) -> int:
    return block_rows(m, cap=n, device=device)


@dataclass
class FPSResult:
    """Farthest point sampling output.

    Attributes:
        indices: ``(k,)`` long, the selected rows of X in selection order (the first r form the FPS set of size r).
        fill_distances: ``(k,)``, ``fill_distances[i]`` = max over all points of the distance to the first
            ``i + 1`` landmarks (eq. 16 of the AFN paper, with Omega = X). Non-increasing.
    """

    indices: torch.Tensor
    fill_distances: torch.Tensor


def fps(X: torch.Tensor, k: int, start: int | None = None) -> FPSResult:
    """Farthest point sampling, AFN paper Algorithm 6, in O(d k n) time.

    Starts at the point nearest the centroid (``start`` overrides it), then repeatedly picks the point
    farthest from the selected set, keeping the running minimum distance of every point to that set.
    Ties are broken by the lowest index. Selected points are never re-picked, so duplicated points are
    selected (with distance 0) only once the distinct points are exhausted.

    Args:
        X: ``(n, d)`` points.
        k: number of landmarks, ``1 <= k <= n``.
        start: optional index of the first landmark.

    Returns:
        :class:`FPSResult` with ``indices (k,)`` and ``fill_distances (k,)``, the latter in X's dtype.

    Example:
        >>> import torch
        >>> from gpnys.landmarks import fill_distance, fps
        >>> X = torch.rand(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> res = fps(X, 10)
        >>> res.indices.unique().numel()  # distinct rows of X
        10
        >>> int(res.indices[0]) == int((X - X.mean(0)).norm(dim=1).argmin())  # start: nearest the centroid
        True

        Each landmark is the point farthest from the ones before it, at the previous fill distance:

        >>> far = torch.cdist(X[res.indices[5:6]], X[res.indices[:5]]).min()
        >>> torch.allclose(far, res.fill_distances[4])
        True
        >>> torch.allclose(res.fill_distances[-1], fill_distance(X, X[res.indices]))
        True
    """
    _validate(X, k)
    n = X.shape[0]
    block = _row_block(n, X.shape[1], X.device)
    if start is None:
        start = int(torch.argmin(_sqdist_to_point(X, X.mean(dim=0), block)))
    elif not 0 <= start < n:
        raise ValueError(f"start must be in [0, {n}), got {start}")
    if X.is_cuda and n <= FPS_TRITON_MAX_N and X.shape[1] <= FPS_TRITON_MAX_D:
        out = _fps_triton(X, k, start)
        if out is not None:
            return out
    indices = torch.empty(k, dtype=torch.long, device=X.device)
    fill = torch.empty(k, dtype=X.dtype, device=X.device)
    # running min squared distance to the selected set; selected points hold -1 (below any distance, and kept by
    # the minimum), so duplicates (distance 0) are never re-picked. The loop never reads a value back to the host:
    # on a GPU its k steps are queued without a synchronisation each.
    mind = torch.full((n,), float("inf"), dtype=X.dtype, device=X.device)
    last = torch.full((1,), start, dtype=torch.long, device=X.device)
    for i in range(k):
        indices[i : i + 1] = last
        torch.minimum(mind, _sqdist_to_point(X, X.index_select(0, last), block), out=mind)
        mind.index_fill_(0, last, -1.0)
        last = torch.argmax(mind).reshape(1)
        fill[i : i + 1] = mind.index_select(0, last)  # = max(mind) over the unselected points
    return FPSResult(indices=indices, fill_distances=fill.clamp_min(0).sqrt())


#: on CUDA, FPS of at most this many points runs as one Triton program (:func:`_fps_triton`); larger sets keep the
#: torch loop, whose k steps each fill the whole GPU
FPS_TRITON_MAX_N = 1 << 17
#: ... of at most this many dimensions (a chunk of points lives in registers)
FPS_TRITON_MAX_D = 64


def _fps_triton(X: torch.Tensor, k: int, start: int) -> FPSResult | None:
    """:func:`fps` by :func:`gpnys.kernels.backends.triton_kernels.fps_kernel` (the same steps, ties and fill
    distances), or ``None`` when Triton is missing or its kernel failed for this device and dtype (one warning:
    :func:`gpnys.kernels.backends.triton_fused.guarded_launch`)."""
    from gpnys.kernels.backends import triton_available

    if not triton_available():
        return None
    from gpnys.kernels.backends.triton_fused import guarded_launch

    n, d = X.shape
    dp = 1 << max(0, (d - 1).bit_length())

    def launch() -> FPSResult:
        from gpnys.kernels.backends.triton_kernels import fps_kernel

        Xc = X.contiguous()
        mind = torch.full((n,), float("inf"), dtype=X.dtype, device=X.device)
        idx = torch.empty(k, dtype=torch.int64, device=X.device)
        fill = torch.empty(k, dtype=X.dtype, device=X.device)
        fps_kernel[(1,)](Xc, mind, idx, fill, n, d, k, int(start), BLOCK=max(32, min(1024, 4096 // dp)), DP=dp)
        return FPSResult(indices=idx, fill_distances=fill.clamp_min(0).sqrt())

    return guarded_launch("fps", X.device, X.dtype, False, launch, lambda: None, "the torch loop")


def uniform(n: int, k: int, seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """``k`` distinct indices drawn uniformly from ``range(n)`` with a seeded generator. Returns ``(k,)`` long.

    Example:
        >>> import torch
        >>> from gpnys.landmarks import uniform
        >>> idx = uniform(300, 10, seed=1)
        >>> idx.unique().numel(), torch.equal(idx, uniform(300, 10, seed=1))
        (10, True)
    """
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k > n:
        raise ValueError(f"k={k} landmarks requested but there are only n={n} points")
    device = torch.device(device) if device is not None else torch.device("cpu")
    return torch.randperm(n, generator=_generator(seed, device), device=device)[:k]


def _nearest(X: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of and squared distance to the nearest row of C for every row of X, in row blocks. ((n,), (n,))"""
    block = _row_block(X.shape[0], C.shape[0], X.device)
    labels, dists = [], []
    for i in range(0, X.shape[0], block):
        d2 = torch.cdist(X[i : i + block], C).square()
        dmin, arg = d2.min(dim=1)
        labels.append(arg)
        dists.append(dmin)
    return torch.cat(labels), torch.cat(dists)


def fill_distance(X: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """``max_j min_i ||X_j - landmarks_i||`` (AFN paper eq. 16 with Omega = X). Returns a 0-dim tensor."""
    _, d2 = _nearest(X, landmarks)
    return d2.max().clamp_min(0).sqrt()


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
    _validate(X, k)
    if isinstance(iters, bool) or int(iters) != iters or iters < 0:
        raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
    n = X.shape[0]
    gen = _generator(seed, X.device)
    block = _row_block(n, X.shape[1], X.device)
    first = int(torch.randint(n, (1,), generator=gen, device=X.device))
    centers = [X[first]]
    mind = _sqdist_to_point(X, X[first], block)
    for _ in range(1, k):
        total = mind.sum()
        if total <= 0:  # all remaining points coincide with centres: take any not-yet-used point
            probs = torch.ones_like(mind)
        else:
            probs = mind / total
        idx = int(torch.multinomial(probs, 1, generator=gen))
        centers.append(X[idx])
        mind = torch.minimum(mind, _sqdist_to_point(X, X[idx], block))
    C = torch.stack(centers)
    labels, d2 = _nearest(X, C)
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
        labels, d2 = _nearest(X, C)
        new = float(d2.sum())
        done = inertia - new <= tol * max(inertia, 1e-300)
        inertia = new
        if done:
            break
    return KMeansResult(centers=C, labels=labels, inertia=inertia, n_iter=it)


def select(X: torch.Tensor, k: int, method: str = "fps", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose ``k`` landmarks by ``method`` in ``{"fps", "uniform", "kmeans"}``.

    Returns ``(points (k, d), indices (k,) or None)``; k-means centres are not rows of X, so their
    indices are ``None``.
    """
    if method == "fps":
        idx = fps(X, k).indices
    elif method == "uniform":
        _validate(X, k)
        idx = uniform(X.shape[0], k, seed=seed, device=X.device)
    elif method == "kmeans":
        return kmeans(X, k, seed=seed).centers, None
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return X[idx], idx
