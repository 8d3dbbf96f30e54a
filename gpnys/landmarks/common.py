"""Argument checks and seeded generators shared by the landmark rules."""

from __future__ import annotations

from typing import Any

import gpytorch
import torch

from gpnys.checks import validate_positive, validate_seed

__all__ = ["validate_points_k", "generator", "validate_seed", "validate_noise", "validate_kernel"]


def validate_points_k(X: torch.Tensor, k: int) -> None:
    """``ValueError`` unless ``X`` is a finite, non-empty ``(n, d)`` tensor and ``k`` an integer in ``[1, n]``."""
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


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(int(seed))



def validate_noise(noise: Any) -> float:
    if noise is None:
        raise ValueError("noise is required (the ridge lambda = noise > 0)")
    return validate_positive(noise, "noise")


def validate_kernel(kernel: Any) -> None:
    if kernel is None:
        raise ValueError("kernel is required for leverage-score sampling")
    if not isinstance(kernel, gpytorch.kernels.Kernel):
        raise ValueError(f"kernel must be a gpytorch Kernel, got {type(kernel).__name__}")  # noqa: TRY004
