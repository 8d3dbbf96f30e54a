"""The KeOps backend: fused reductions through pykeops, only on explicit request (``backend="keops"``).

KeOps compiles the kernel formula into one reduction that never stores a tile in global memory, as GPyTorch's
``gpytorch.kernels.keops`` kernels do. It is never chosen automatically (:mod:`gpnys.kernels.backends`): some
pykeops / CUDA combinations crash the process (docs/gpu.md). On the CPU (how the tests check the formulas) it is
slower than the torch tiles. It computes every pair: the cutoff plan is not used (the products are the same,
with the skipped entries included).

Formulas (``D_ij = |z_i - z_j|^2`` from explicit differences, so no expanded-form cancellation and an exact zero
diagonal; ``k`` and ``h = k'/r`` from :func:`gpnys.kernels.formulas.k_and_h`):

    (K V)_i                     = sum_j k(r_ij) v_j
    sum_ij (u_i . v_j) k(r_ij)                                       (outputscale derivative)
    sum_ij (u_i . v_j) h(r_ij) (z_id - z_jd)^2                      (per-dimension length-scale sums)
"""

from __future__ import annotations

import importlib.util

import torch

from gpnys.kernels.backends.base import KernelBackend, check_rows
from gpnys.kernels.cutoff import LeafPlan
from gpnys.kernels.formulas import k_and_h

__all__ = ["available", "KeOpsBackend", "TINY"]

#: regularises Matérn-1/2's h = -exp(-r)/r at r = 0, where it only multiplies (z_id - z_jd)^2 = 0; small enough to
#: change nothing at r > 0, large enough that 1/TINY times the weights cannot overflow to inf (inf * 0 = nan)
TINY = 1e-30


def available() -> bool:
    """Whether ``pykeops`` is importable."""
    return importlib.util.find_spec("pykeops") is not None


def _lazy(Z: torch.Tensor, rows: tuple[int, int] | None = None):
    from pykeops.torch import LazyTensor

    a, b = check_rows(Z.shape[0], rows)
    Zi = Z[a:b]
    zi, zj = LazyTensor(Zi[:, None, :].contiguous()), LazyTensor(Z[None, :, :].contiguous())
    diff = zi - zj
    return LazyTensor, diff, (diff**2).sum(-1)


class KeOpsBackend(KernelBackend):
    """KeOps reductions over every pair (module docstring); ``plan`` only fixes the working order."""

    name = "keops"

    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        _, _, D2 = _lazy(Z, rows)
        k, _ = k_and_h(D2, self.formula.nu, TINY)
        return k @ R.contiguous()

    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        LazyTensor, diff, D2 = _lazy(Z, rows)
        k, h = k_and_h(D2, self.formula.nu, TINY)
        a, b = check_rows(Z.shape[0], rows)
        Ui = U[a:b]
        w = (LazyTensor(Ui[:, None, :].contiguous()) * LazyTensor(V[None, :, :].contiguous())).sum(-1)
        acc = torch.promote_types(Z.dtype, torch.float64)
        s = (w * k).sum(1).sum().to(acc)
        g = ((w * h) * diff**2).sum(1).sum(0).to(acc)
        return s, g
