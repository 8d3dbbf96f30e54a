"""Launching hand-written Triton kernels: whether Triton is there, and a guard that falls back, warning once.

Used by the kernel operator's Triton backend (:mod:`gpnys.kernels.backends.triton_fused`) and by farthest point
sampling (:mod:`gpnys.landmarks.fps`). Triton itself is imported only by the kernel modules, lazily.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any, Callable

import torch

__all__ = ["triton_available", "interpreting", "guarded_launch", "failed"]

#: (kernels, device type, dtype, tf32) whose Triton launch failed: answered by the fallback from then on (one warning)
_FAILED: set[tuple[str, str, torch.dtype, bool]] = set()


def triton_available() -> bool:
    """Whether ``triton`` is importable."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``: kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _failure_key(kernels: str, device: torch.device, dtype: torch.dtype, tf32: bool) -> tuple:
    return kernels, device.type, dtype, bool(tf32) and dtype == torch.float32


def failed(kernels: str, device: torch.device, dtype: torch.dtype, tf32: bool = False) -> bool:
    """Whether the Triton ``kernels`` (``"kernel"``: the product and derivative; ``"fps"``) failed for this device,
    dtype and TF32 setting, so that their fallback answers."""
    return _failure_key(kernels, device, dtype, tf32) in _FAILED


def guarded_launch(kernels: str, device: torch.device, dtype: torch.dtype, tf32: bool, launch: Callable[[], Any],
                   fallback: Callable[[], Any], fallback_name: str) -> Any:
    """``launch()``, or ``fallback()`` once a Triton launch of ``kernels`` failed for this key: the first failure is
    recorded and warned about (``RuntimeWarning``), so an answer is never silently from another path."""
    key = _failure_key(kernels, device, dtype, tf32)
    if key not in _FAILED:
        try:
            return launch()
        except Exception as err:  # noqa: BLE001 - compile / launch errors surface as many types (CompilationError, ...)
            _FAILED.add(key)
            warnings.warn(f"Triton kernel failed ({kernels}) for {dtype} on {device.type} ({type(err).__name__}: "
                          f"{err}); using {fallback_name} instead", RuntimeWarning, stacklevel=5)
    return fallback()
