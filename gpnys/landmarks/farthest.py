"""Farthest point sampling (AFN paper Algorithm 6; Gonzalez 1985) in O(d k n) time and O(n) extra memory.

A running vector holds each point's squared distance to the selected set, so each step is one O(n d) pass, in row
blocks. On CUDA, small sets run as one Triton program (:mod:`gpnys.landmarks.farthest_triton`, launched through
:func:`gpnys.launch.guarded_launch`); otherwise, and whenever that kernel failed, the torch loop answers. Written here
because no maintained torch library offers a seeded, blocked, device-agnostic FPS that also returns the fill
distances.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpnys.checks import validate_count
from gpnys.landmarks.common import validate_points_k
from gpnys.landmarks.distances import row_block, sqdist_to_point
from gpnys.launch import guarded_launch, triton_available

__all__ = ["FPSResult", "fps", "FPS_TRITON_MAX_N", "FPS_TRITON_MAX_D"]


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
    validate_points_k(X, k)
    n = X.shape[0]
    block = row_block(n, X.shape[1], X.device)
    if start is None:
        start = int(torch.argmin(sqdist_to_point(X, X.mean(dim=0), block)))
    else:
        start = validate_count(start, "start", 0, n - 1, "n - 1")
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
        torch.minimum(mind, sqdist_to_point(X, X.index_select(0, last), block), out=mind)
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
    """:func:`fps` by :func:`gpnys.landmarks.farthest_triton.fps_kernel` (the same steps, ties and fill
    distances), or ``None`` when Triton is missing or its kernel failed for this device and dtype (one warning:
    :func:`gpnys.launch.guarded_launch`)."""
    if not triton_available():
        return None
    n, d = X.shape
    dp = 1 << max(0, (d - 1).bit_length())

    def launch() -> FPSResult:
        from gpnys.landmarks.farthest_triton import fps_kernel

        Xc = X.contiguous()
        mind = torch.full((n,), float("inf"), dtype=X.dtype, device=X.device)
        idx = torch.empty(k, dtype=torch.int64, device=X.device)
        fill = torch.empty(k, dtype=X.dtype, device=X.device)
        fps_kernel[(1,)](Xc, mind, idx, fill, n, d, k, int(start), BLOCK=max(32, min(1024, 4096 // dp)), DP=dp)
        return FPSResult(indices=idx, fill_distances=fill.clamp_min(0).sqrt())

    return guarded_launch("fps", X.device, X.dtype, False, launch, lambda: None, "the torch loop")
