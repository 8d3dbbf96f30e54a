"""Dense products with a few right-hand-side columns, in the form the CPU BLAS runs fastest.

``A @ B`` with a large ``A (m, k)`` and a thin ``B (k, t)`` (t ~ 5-64 columns: the probes of the MLL estimator, the
CG block, a q-batch) is computed by torch's CPU BLAS far below memory bandwidth; the same product written as
``(Bᵀ Aᵀ)ᵀ`` (the same values, ``Aᵀ`` a view) is not (timings: docs/scaling.md). The hot products of the kernel
operator, the kernel system and the Nyström / AFN preconditioners go through :func:`thin_matmul`.
"""

from __future__ import annotations

import torch

__all__ = ["thin_matmul"]


def thin_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A @ B`` for ``A (..., m, k)`` and ``B (..., k, t)`` as ``(Bᵀ Aᵀ)ᵀ``, contiguous ``(..., m, t)``; a 1-D ``B``
    is multiplied directly."""
    if B.dim() == 1:
        return A @ B
    return (B.mT @ A.mT).mT.contiguous()
