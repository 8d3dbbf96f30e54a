"""The dense backend: products and derivative sums read from a stored unit kernel instead of recomputed.

When :func:`~gpnys.kernels.product.choose_product` says ``"dense"``,
:class:`~gpnys.kernels.operator.StationaryKernelOperator` keeps ``K`` (and, for Matérn, ``H = k'/r``; for an
isotropic float64 kernel also ``D = A o R²``, the length-scale derivative's matrix) and answers through this
backend, with the interface every backend has (:class:`~gpnys.kernels.backends.base.KernelBackend`). Storage:
the ``n x n`` matrices themselves (filled once per length-scale by the operator); a product is one GEMM, a
derivative sum two (with ``D``) or one pass over row blocks of the stored tiles (the torch tiles' reductions).
"""

from __future__ import annotations

from typing import Iterator

import torch

from gpnys.collectives import Rows
from gpnys.kernels.backends.base import KernelBackend, check_rows
from gpnys.kernels.backends.torch_tiles import Tile, TorchTiles
from gpnys.kernels.cutoff import LeafPlan
from gpnys.kernels.formulas import Formula
from gpnys.linalg import thin_matmul

__all__ = ["DenseBackend"]


class DenseBackend(KernelBackend):
    """Products and derivative sums of a stored unit kernel.

    Args:
        formula: the kernel's row of :data:`gpnys.kernels.formulas.FORMULAS`.
        K: ``(n, n)`` unit kernel; H: ``(n, n)`` ``k'/r`` (``None`` for RBF, whose ``H = -K``).
        D: ``(n, n)`` ``A o R²`` of an isotropic kernel, or ``None``.
        block: rows per stored tile of a pass.

    The ``plan`` of every method is ignored (every entry is stored); ``Z`` is the scaled points, in input order.
    With ``D`` stored (an isotropic kernel only), :meth:`derivative_sums` returns ``g`` as the sum over the
    dimensions, shape ``(1,)``: all an isotropic length-scale's derivative needs.

    Example:
        >>> import torch
        >>> from gpnys.kernels.backends.dense import DenseBackend
        >>> from gpnys.kernels.formulas import formula
        >>> Z = torch.rand(50, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> K = torch.exp(-0.5 * torch.cdist(Z, Z).square())  # the unit RBF kernel of the scaled points
        >>> be = DenseBackend(formula(None), K, None, None, block=16)
        >>> V = torch.ones(50, 3, dtype=torch.float64)
        >>> torch.allclose(be.matmul(Z, V, None), K @ V)
        True
    """

    name = "dense"

    def __init__(self, formula: Formula, K: torch.Tensor, H: torch.Tensor | None, D: torch.Tensor | None,
                 block: int) -> None:
        super().__init__(formula)
        self.K, self.H, self.D, self.block = K, H, D, int(block)

    def tiles(self, Z: torch.Tensor, plan: LeafPlan | None = None) -> Iterator[Tile]:
        """The stored kernel as row tiles (:data:`~gpnys.kernels.backends.torch_tiles.Tile`)."""
        n, bs = Z.shape[0], self.block
        return ((slice(a, a + bs), slice(None), self.K[a : a + bs], None if self.H is None else self.H[a : a + bs],
                 Z[a : a + bs], Z) for a in range(0, n, bs))

    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None, rows: Rows | None = None) -> torch.Tensor:
        a, b = check_rows(Z.shape[0], rows)
        if (a, b) == (0, Z.shape[0]):
            return thin_matmul(self.K, R, symmetric=True)
        return thin_matmul(self.K[a:b], R)

    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, g)`` over all rows; with ``D`` stored, ``g`` is ``(1,)``, the isotropic sum (two products)."""
        check_rows(Z.shape[0], rows)
        if self.D is not None:
            return ((U * thin_matmul(self.K, V, symmetric=True)).sum(),
                    (U * thin_matmul(self.D, V, symmetric=True)).sum().reshape(1))
        return TorchTiles.weighted_sums(Z, self.tiles(Z), lambda r, c: U[r] @ V[c].mT)

    def column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                               isotropic: bool = False, rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        check_rows(Z.shape[0], rows)
        if isotropic and self.D is not None:
            return ((U * thin_matmul(self.K, V, symmetric=True)).sum(0),
                    (U * thin_matmul(self.D, V, symmetric=True)).sum(0)[:, None])
        return TorchTiles.column_sums(Z, self.tiles(Z), U, V, isotropic)
