"""Uniform landmarks: ``k`` distinct indices drawn with a seeded generator."""

from __future__ import annotations

import torch

from gpnys.landmarks.common import generator

__all__ = ["uniform"]


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
    return torch.randperm(n, generator=generator(seed, device), device=device)[:k]
