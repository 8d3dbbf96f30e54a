"""Argument checks and seeded generators shared by the landmark rules."""

from __future__ import annotations

import numbers
from typing import Any

import gpytorch
import torch

from gpnys.checks import validate_points, validate_positive, validate_seed

__all__ = ["validate_points_k", "generator", "validate_seed", "validate_noise", "validate_kernel"]


def validate_points_k(X: torch.Tensor, k: int) -> None:
    """``ValueError`` unless ``X`` is a finite, non-empty floating ``(n, d)`` tensor and ``k`` an integer in
    ``[1, n]``."""
    validate_points(X)
    if isinstance(k, bool) or not isinstance(k, numbers.Real) or int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if k > X.shape[0]:
        raise ValueError(f"k={k} landmarks requested but X has only n={X.shape[0]} points")


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (an integer, or a ``ValueError`` naming it)."""
    return torch.Generator(device=device).manual_seed(validate_seed(seed))



def validate_noise(noise: Any) -> float:
    if noise is None:
        raise ValueError("noise is required (the ridge lambda = noise > 0)")
    return validate_positive(noise, "noise")


def validate_kernel(kernel: Any) -> None:
    if kernel is None:
        raise ValueError("kernel is required for leverage-score sampling")
    if not isinstance(kernel, gpytorch.kernels.Kernel):
        raise ValueError(f"kernel must be a gpytorch Kernel, got {type(kernel).__name__}")  # noqa: TRY004
