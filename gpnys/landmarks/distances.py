"""Blocked point-to-set distances: one point to all rows, nearest centre, fill distance.

Every pass runs in row blocks (:func:`gpnys.budget.block_rows`), so temporary memory stays ``O(block * d)`` on top
of the ``O(n)`` outputs. Squared distances come from explicit differences (no expanded-form cancellation) or
``torch.cdist``.
"""

from __future__ import annotations

import torch

from gpnys.budget import block_rows
from gpnys.checks import validate_points

__all__ = ["fill_distance", "nearest", "row_block", "sqdist_to_point"]


def row_block(n: int, m: int, device: torch.device | None = None) -> int:
    """Rows per block for a pass against ``m`` columns (or points), at most ``n``."""
    return block_rows(m, cap=n, device=device)


def sqdist_to_point(X: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    """``||X_j - x||^2`` for every row j, computed by differences (no cancellation), in row blocks. ``(n,)``"""
    n = X.shape[0]
    if n <= block:
        return (X - x).square().sum(dim=1)
    return torch.cat([(X[i : i + block] - x).square().sum(dim=1) for i in range(0, n, block)])


def nearest(X: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of and squared distance to the nearest row of C for every row of X, in row blocks. ``((n,), (n,))``"""
    block = row_block(X.shape[0], C.shape[0], X.device)
    labels, dists = [], []
    for i in range(0, X.shape[0], block):
        d2 = torch.cdist(X[i : i + block], C).square()
        dmin, arg = d2.min(dim=1)
        labels.append(arg)
        dists.append(dmin)
    return torch.cat(labels), torch.cat(dists)


def fill_distance(X: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """``max_j min_i ||X_j - landmarks_i||`` (AFN paper eq. 16 with Omega = X) for ``X (n, d)``, ``landmarks
    (k, d)``. Returns a 0-dim tensor.

    Example:
        >>> import torch
        >>> from gpnys.landmarks import fill_distance
        >>> X = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]])
        >>> fill_distance(X, X[:2])  # the point at 3 is 2 away from its nearest landmark
        tensor(2.)
    """
    validate_points(X, "X")
    validate_points(landmarks, "landmarks")
    if landmarks.shape[1] != X.shape[1] or landmarks.dtype != X.dtype or landmarks.device != X.device:
        raise ValueError(f"landmarks must be (k, {X.shape[1]}) points of X's dtype and device, got "
                         f"{tuple(landmarks.shape)} {landmarks.dtype} on {landmarks.device}")
    _, d2 = nearest(X, landmarks)
    return d2.max().clamp_min(0).sqrt()
