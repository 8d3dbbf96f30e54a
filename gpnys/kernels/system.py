"""The kernel system ``v -> (K + mu I) v`` that :func:`gpnys.solvers.pcg` solves, for a unit-variance kernel.

Its product is computed as :func:`~gpnys.kernels.product.choose_product` says: a stored ``K``, the kernel
operator's fused passes, or GPyTorch row blocks.
"""

from __future__ import annotations

from typing import Any

import gpytorch
import torch

from gpnys.checks import validate_mu, validate_points
from gpnys.collectives import partitioned
from gpnys.kernels.entries import KernelEntries, computation_dtype
from gpnys.kernels.operator import StationaryKernelOperator, supported
from gpnys.kernels.product import choose_product
from gpnys.linalg import thin_matmul

__all__ = ["KernelSystem", "kernel_system"]


class KernelSystem:
    """The product ``v -> (K + mu I) v`` for a unit-variance kernel matrix ``K = k(X, X)``.

    ``K`` is cached densely (built in row blocks) where :func:`~gpnys.kernels.product.choose_product` says it fits
    ``dense_limit_bytes`` (``None``: the memory budget's for ``X``'s device, :mod:`gpnys.budget`);
    otherwise every product recomputes ``K``: for a plain RBF/Matérn kernel through
    :class:`~gpnys.kernels.operator.StationaryKernelOperator` (cutoff plan in low dimension; torch tiles on CPU,
    fused Triton kernels on CUDA), else in row blocks via :meth:`KernelEntries.matmul` (memory ``O(block * n)``). Call with
    ``V: (n,)`` or ``(n, t)``; returns the same shape.

    ``group`` (a ``torch.distributed`` group, ``True`` for the default one) splits a plain RBF/Matérn kernel's
    recomputed products by rows over its ranks (:mod:`gpnys.kernels.backends.partitioned`; every rank holds ``X``
    and ``V`` and gets the whole product); another kernel's row blocks run whole on every rank.

    Attributes: ``n``, ``mu``, ``dense`` (whether ``K`` is cached), ``entries`` (:class:`KernelEntries`).
    """

    def __init__(
        self, X: torch.Tensor, kernel: gpytorch.kernels.Kernel, mu: float, dense_limit_bytes: int | None = None,
        group: Any = None,
    ) -> None:
        validate_points(X)
        self.mu = validate_mu(mu)
        # GPyTorch's computation dtype: the inputs promoted with the kernel's parameters (float32 X, float64 kernel
        # -> float64); products take any floating V and answer in it
        self.dtype = computation_dtype(kernel, X)
        X = X.to(self.dtype)
        self.entries = KernelEntries(X, kernel)
        self.n = X.shape[0]
        base = self.entries.kernel
        # one matrix (no Matérn H here); "rows" is KernelEntries.matmul's own product
        how = choose_product(self.n, X.element_size(), closed_form=supported(base),
                             dense_limit_bytes=dense_limit_bytes, device=X.device, partitioned=partitioned(group))
        self.dense = how == "dense"
        self._K: torch.Tensor | None = None
        if self.dense:
            self._K = self.entries(slice(None), slice(None))  # built in row blocks of the budget
        self._op: StationaryKernelOperator | None = None
        if how in ("fused", "partitioned-fused"):
            one = torch.ones((), dtype=X.dtype, device=X.device)
            self._op = StationaryKernelOperator(self.entries.X, one, base.lengthscale.detach().to(X.dtype), base=base,
                                                cache={}, dense_limit_bytes=0,
                                                group=group if partitioned(group) else None)

    def __call__(self, V: torch.Tensor) -> torch.Tensor:
        vec = V.dim() == 1
        Vm = (V[:, None] if vec else V).to(self.dtype)
        if self._K is not None:
            KV = thin_matmul(self._K, Vm, symmetric=True)
        elif self._op is not None:
            with torch.no_grad():
                KV = self._op.matmul(Vm)
        else:
            KV = self.entries.matmul(Vm)
        out = KV + self.mu * Vm
        return out[:, 0] if vec else out


def kernel_system(
    X: torch.Tensor, kernel: gpytorch.kernels.Kernel, mu: float, dense_limit_bytes: int | None = None,
    group: Any = None,
) -> KernelSystem:
    """Return the callable ``v -> K v + mu v`` (see :class:`KernelSystem`); ``X: (n, d)``, ``mu > 0``; ``group``
    splits the recomputed products over a process group's ranks.

    The outputscale of a ``ScaleKernel`` is stripped (``K`` has unit variance, ``mu = noise/outputscale``).

    Example:
        >>> import gpytorch, torch
        >>> from gpnys import memory_budget
        >>> from gpnys.kernels.system import kernel_system
        >>> X = torch.rand(100, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).double()
        >>> kernel.outputscale = 3.0
        >>> A = kernel_system(X, kernel, mu=0.1)
        >>> K1 = kernel.base_kernel(X).to_dense().detach()  # unit variance
        >>> V = torch.eye(100, dtype=torch.float64)[:, :4]
        >>> A.dense, torch.allclose(A(V), K1 @ V + 0.1 * V)
        (True, True)
        >>> with memory_budget(dense_bytes=0):  # no dense cache: K recomputed on the fly, same product
        ...     A = kernel_system(X, kernel, mu=0.1)
        >>> A.dense, torch.allclose(A(V), K1 @ V + 0.1 * V)
        (False, True)
    """
    return KernelSystem(X, kernel, mu, dense_limit_bytes=dense_limit_bytes, group=group)
