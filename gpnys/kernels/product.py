"""How a kernel product ``K V`` is computed: the one rule that decides between a stored matrix and recomputation.

Every kernel product in gpnys goes one of five ways, and :func:`choose_product` alone picks which:

================================  ==============================================================================
``"dense"``                       ``K`` held as one ``n x n`` tensor (the operator's cache, the PCG system's
                                  ``K``, or one transient block of :class:`~gpnys.kernels.entries.KernelEntries`)
``"fused"``                       recomputed on the fly by the kernel operator's backends (torch tiles, Triton,
                                  KeOps; cutoff plan included): RBF / Matérn only
``"rows"``                        recomputed in GPyTorch row blocks, any kernel, memory ``O(block n)``
``"partitioned-fused"``           ``"fused"`` with the rows split over a process group's ranks
``"partitioned-rows"``            ``"rows"`` split over the ranks, one gather
================================  ==============================================================================

The callers are :class:`~gpnys.kernels.operator.StationaryKernelOperator` (dense cache or fused passes),
:class:`~gpnys.kernels.entries.KernelEntries` (all five), the PCG system
:class:`~gpnys.solvers.pcg.KernelSystem`, and the CLI's ``kernel_storage`` report.
"""

from __future__ import annotations

from typing import Callable

import torch

from gpnys.budget import dense_limit_bytes as budget_dense_limit

__all__ = ["caches_dense", "choose_product", "PRODUCTS", "FUSED_SHARE"]

#: the ways a kernel product is computed (:func:`choose_product`)
PRODUCTS = ("dense", "fused", "rows", "partitioned-fused", "partitioned-rows")

#: with the Triton backend a stored ``K`` is not used when the cutoff plan computes at most this share of the
#: entries: recomputing that share in the fused kernels costs about as much as reading a stored ``K``, and forming
#: ``K`` is saved (docs/gpu.md)
FUSED_SHARE = 0.4


def caches_dense(n: int, itemsize: int, matern: bool, dense_limit_bytes: int | None = None,
                 device: torch.device | str | None = None) -> bool:
    """Whether ``K`` (and, for Matérn, ``H = k'/r``) of ``n x n`` entries of ``itemsize`` bytes fits
    ``dense_limit_bytes`` (``None``: the dense-cache budget of ``device``, :mod:`gpnys.budget`).

    Example:
        >>> from gpnys.kernels.product import caches_dense
        >>> caches_dense(1000, 8, matern=True, dense_limit_bytes=16_000_000), caches_dense(1001, 8, True, 16_000_000)
        (True, False)
    """
    limit = budget_dense_limit(device) if dense_limit_bytes is None else dense_limit_bytes
    return (2 if matern else 1) * n * n * itemsize <= limit


def choose_product(n: int, itemsize: int, *, closed_form: bool, dense_limit_bytes: int | None = None,
                   matern: bool = False, explicit_block: bool = False, partitioned: bool = False,
                   fused_share: Callable[[], float | None] | None = None,
                   device: torch.device | str | None = None) -> str:
    """How to compute ``K V`` for ``n`` points (one of :data:`PRODUCTS`).

    Args:
        n: points; itemsize: bytes per entry of ``K``.
        closed_form: the kernel is a plain RBF / Matérn (:func:`~gpnys.kernels.operator.supported`), so the
            fused backends can recompute it.
        dense_limit_bytes: bytes a stored ``K`` may take (``None``: the device's dense-cache budget); a transient
            block passes its row budget times ``n * itemsize``.
        matern: a stored Matérn kernel keeps ``H = k'/r`` too (twice the bytes).
        explicit_block: the caller fixed GPyTorch row blocks, so no fused pass.
        partitioned: the rows are split over a process group (no stored ``K`` then).
        fused_share: the share of entries the cutoff plan computes on the Triton backend (called only when ``K``
            fits); at most :data:`FUSED_SHARE` prefers the fused passes over a stored ``K``.

    Example:
        >>> from gpnys.kernels.product import choose_product
        >>> choose_product(1000, 8, closed_form=True, dense_limit_bytes=10**9)
        'dense'
        >>> choose_product(10**6, 4, closed_form=True, dense_limit_bytes=10**9), choose_product(
        ...     10**6, 4, closed_form=False, dense_limit_bytes=10**9)
        ('fused', 'rows')
    """
    fused = closed_form and not explicit_block
    if partitioned:
        return "partitioned-fused" if fused else "partitioned-rows"
    if caches_dense(n, itemsize, matern, dense_limit_bytes, device):
        share = None if fused_share is None else fused_share()
        if share is None or share > FUSED_SHARE:
            return "dense"
    return "fused" if fused else "rows"
