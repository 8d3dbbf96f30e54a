"""The dense backend: products and derivative sums read from a stored unit kernel instead of recomputed.

When :func:`~gpnys.kernels.product.choose_product` says ``"dense"``,
:class:`~gpnys.kernels.operator.StationaryKernelOperator` keeps ``K`` (and, for Matérn, ``H = k'/r``; for an
isotropic float64 kernel also ``D = A o R² / 2``, half the length-scale derivative's matrix) and answers through this
backend, with the interface every backend has (:class:`~gpnys.kernels.backends.base.KernelBackend`). Storage:
the ``n x n`` matrices themselves (filled once per length-scale by the operator); a product is one GEMM, a
derivative sum two (with ``D``; one when the last product already took ``U``, :class:`LastProduct`) or one pass over
row blocks of the stored tiles (the torch tiles' reductions).
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

__all__ = ["DenseBackend", "LastProduct"]


class LastProduct:
    """The last full product ``K B`` of a stored unit kernel, kept so that a derivative pass whose ``U`` is ``B``'s
    leading columns reads ``K U`` instead of multiplying again: the estimator's true residual ``K̂ [X, |X|]`` is
    followed by the per-probe derivative sums ``u_jᵀ K v_j`` with ``U = X``'s columns, and ``u_jᵀ K v_j =
    v_jᵀ (K U)_j`` for a symmetric ``K`` (one product of an evaluation's 17-18 on the CPU). A lookup answers only
    for a ``U`` equal, entry for entry, to those columns, with neither tensor modified in place since; the owner
    clears it when it refills ``K``."""

    def __init__(self) -> None:
        self.entry: tuple[torch.Tensor, int, torch.Tensor, int] | None = None

    def record(self, B: torch.Tensor, out: torch.Tensor) -> None:
        """Keep ``(B, K B)`` (``(n, t)`` each)."""
        self.entry = (B, B._version, out, out._version) if B.dim() == 2 else None

    def clear(self) -> None:
        self.entry = None

    def lookup(self, U: torch.Tensor) -> torch.Tensor | None:
        """``K U`` (``(n, t)``) when ``U`` is the recorded ``B``'s first ``t`` columns, else ``None``."""
        if self.entry is None:
            return None
        B, b_version, out, out_version = self.entry
        t = U.shape[-1]
        if (B._version != b_version or out._version != out_version or U.dim() != 2 or U.shape[0] != B.shape[0]
                or t > B.shape[1] or U.dtype != B.dtype or U.device != B.device or not torch.equal(B[:, :t], U)):
            return None
        return out[:, :t]


class DenseBackend(KernelBackend):
    """Products and derivative sums of a stored unit kernel.

    Args:
        formula: the kernel's row of :data:`gpnys.kernels.formulas.FORMULAS`.
        K: ``(n, n)`` unit kernel; H: ``(n, n)`` ``k'/r`` (``None`` for RBF, whose ``H = -K``).
        D: ``(n, n)`` ``A o R² / 2`` of an isotropic kernel (:meth:`TorchTiles.fill`), or ``None``.
        block: rows per stored tile of a pass.
        last: where full products are recorded and derivative passes look them up (:class:`LastProduct`); the
            owner of ``K`` clears it when ``K`` changes. ``None``: none kept.

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
                 block: int, last: LastProduct | None = None) -> None:
        super().__init__(formula)
        self.K, self.H, self.D, self.block, self.last = K, H, D, int(block), last

    def tiles(self, Z: torch.Tensor, plan: LeafPlan | None = None) -> Iterator[Tile]:
        """The stored kernel as row tiles (:data:`~gpnys.kernels.backends.torch_tiles.Tile`)."""
        n, bs = Z.shape[0], self.block
        return ((slice(a, a + bs), slice(None), self.K[a : a + bs], None if self.H is None else self.H[a : a + bs],
                 Z[a : a + bs], Z) for a in range(0, n, bs))

    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None, rows: Rows | None = None) -> torch.Tensor:
        a, b = check_rows(Z.shape[0], rows)
        if (a, b) == (0, Z.shape[0]):
            out = thin_matmul(self.K, R, symmetric=True)
            if self.last is not None:
                self.last.record(R, out)
            return out
        return thin_matmul(self.K[a:b], R)

    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, g)`` over all rows; with ``D`` stored, ``g`` is ``(1,)``, the isotropic sum (two products)."""
        check_rows(Z.shape[0], rows)
        if self.D is not None:
            return (U * thin_matmul(self.K, V, symmetric=True)).sum(), (U * self._derivative(V)).sum().reshape(1)
        return TorchTiles.weighted_sums(Z, self.tiles(Z), lambda r, c: U[r] @ V[c].mT)

    def column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                               isotropic: bool = False, rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        check_rows(Z.shape[0], rows)
        if isotropic and self.D is not None:
            KU = None if self.last is None else self.last.lookup(U)
            s = (U * thin_matmul(self.K, V, symmetric=True)).sum(0) if KU is None else (V * KU).sum(0)
            return s, (U * self._derivative(V)).sum(0)[:, None]
        return TorchTiles.column_sums(Z, self.tiles(Z), U, V, isotropic)

    def _derivative(self, V: torch.Tensor) -> torch.Tensor:
        """``(A o R²) V``: twice the product with the stored ``D = A o R² / 2``."""
        return 2.0 * thin_matmul(self.D, V, symmetric=True)
