"""Dense kernel blocks of a GPyTorch kernel, without autograd: ``k(A, B)`` in row blocks and the diagonal."""

from __future__ import annotations

import gpytorch
import torch

from gpnys.budget import block_rows

__all__ = ["kernel_block", "kernel_diag"]


def kernel_block(kernel: gpytorch.kernels.Kernel, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """Dense ``k(A, B)`` (``(a, b)``) without autograd, evaluated in row blocks of ``A``."""
    rows = block_rows(B.shape[0], device=B.device)
    with torch.no_grad():
        return torch.cat([kernel(A[i : i + rows], B).to_dense() for i in range(0, A.shape[0], rows)])


def kernel_diag(kernel: gpytorch.kernels.Kernel, Z: torch.Tensor) -> torch.Tensor:
    """``k(z, z)`` for every row of ``Z`` (``(nz,)``)."""
    with torch.no_grad():
        return kernel(Z, Z, diag=True).to(Z.dtype)
