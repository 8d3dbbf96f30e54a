"""The interface every kernel backend implements (:class:`KernelBackend`) and the row ranges of a partial pass
(package docstring of :mod:`gpnys.kernels.backends`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from gpnys.collectives import LEAF, Rows
from gpnys.kernels.formulas import Formula

if TYPE_CHECKING:
    from gpnys.kernels.cutoff import LeafPlan

__all__ = ["KernelBackend", "check_rows"]


def check_rows(n: int, rows: Rows | None) -> Rows:
    """``rows`` (``None``: all ``n``) as ``(a, b)``; ``ValueError`` unless a range of whole :data:`LEAF`-point blocks
    within ``[0, n]`` (``b = n`` may end a partial block; ``(n, n)`` is the empty range of a rank past the last
    point, :func:`~gpnys.collectives.row_range`)."""
    if rows is None:
        return 0, n
    a, b = (int(r) for r in rows)
    if (a % LEAF and a != n) or (b % LEAF and b != n) or not 0 <= a <= b <= n:
        raise ValueError(f"rows must be a range of whole {LEAF}-point blocks within [0, {n}], got {rows}")
    return a, b


class KernelBackend(ABC):
    """Products and derivative sums of the unit kernel ``k(Z, Z)`` (module docstring).

    Args:
        formula: the kernel's row of :data:`gpnys.kernels.formulas.FORMULAS`.
        tf32: let float32 tile products use TF32 tensor cores (Triton on CUDA only; ~1e-3 relative error).
    """

    name: str = ""

    def __init__(self, formula: Formula, tf32: bool = False) -> None:
        self.formula = formula
        self.tf32 = bool(tf32)

    @abstractmethod
    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None, rows: Rows | None = None) -> torch.Tensor:
        """``k(Z, Z) @ R`` for ``Z: (n, d)``, ``R: (n, t)`` (working order): ``(n, t)``, or its rows ``rows``
        (``(b - a, t)``)."""

    @abstractmethod
    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, g)``: ``()`` and ``(d,)`` tensors in at least float64 (module docstring)."""

    def column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                               isotropic: bool = False, rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`derivative_sums` of each column pair ``(U[:, j], V[:, j])`` alone: ``s (t,)`` and ``g (t, d)``
        (``(t, 1)``, summed over the dimensions, when ``isotropic``), in at least float64. This default makes one
        :meth:`derivative_sums` pass per column; the torch tiles and Triton do all columns in one pass."""
        acc = torch.promote_types(Z.dtype, torch.float64)
        t, d = U.shape[1], Z.shape[1]
        s, g = Z.new_zeros(t, dtype=acc), Z.new_zeros(t, d, dtype=acc)
        for j in range(t):
            s[j], g[j] = self.derivative_sums(Z, U[:, j : j + 1], V[:, j : j + 1], plan, rows)
        return s, (g.sum(1, keepdim=True) if isotropic else g)
