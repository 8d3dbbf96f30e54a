"""Kernel entries on index sets and blocked products, from a GPyTorch stationary kernel.

Preconditioners need ``K(X[I], X[J])`` for small index sets (FSAI patterns, landmark blocks) and never
the whole ``n x n`` matrix. :class:`KernelEntries` evaluates a *unit-variance* kernel (a ``ScaleKernel``'s
outputscale is stripped off and reported) without autograd, in the dtype and device of ``X``.
"""

from __future__ import annotations

import functools
from typing import Any

import gpytorch
import torch

from gpnys.budget import block_rows
from gpnys.collectives import RowGroup
from gpnys.kernels.formulas import k_of_r
from gpnys.kernels.operator import StationaryKernelOperator, _nu, supported
from gpnys.kernels.product import choose_product

__all__ = ["KernelEntries", "split_outputscale", "evaluate", "computation_dtype", "difference_entries", "k_of_points"]


def computation_dtype(module: torch.nn.Module, *tensors: torch.Tensor) -> torch.dtype:
    """The dtype GPyTorch computes in: the floating ``tensors``' dtypes promoted with ``module``'s floating
    parameters' (float32 inputs in a float64 model give float64)."""
    dtypes = [t.dtype for t in tensors if t.is_floating_point()]
    dtypes += [p.dtype for p in module.parameters() if p.is_floating_point()]
    return functools.reduce(torch.promote_types, dtypes)


def split_outputscale(kernel: gpytorch.kernels.Kernel) -> tuple[gpytorch.kernels.Kernel, float]:
    """Return ``(base_kernel, outputscale)``: ``(kernel, 1.0)`` when ``kernel`` is not a ``ScaleKernel``."""
    if isinstance(kernel, gpytorch.kernels.ScaleKernel):
        return kernel.base_kernel, float(kernel.outputscale.detach().reshape(-1)[0])
    return kernel, 1.0


def batch_element(kernel: gpytorch.kernels.Kernel, index: int) -> gpytorch.kernels.Kernel:
    """Element ``index`` of a kernel with batch shape ``(b,)`` (a copy; the kernel itself without batch shape):
    GPyTorch's ``kernel[index]`` with every sub-kernel's ``active_dims`` kept. GPyTorch 1.15's ``Kernel.__getitem__``
    slices every buffer, ``active_dims`` included, as if it were batched (``[0, 2]`` becomes ``0`` for element 0
    and ``2`` for element 1), so the element would read other input columns.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.kernels.entries import batch_element
        >>> k = gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2]), active_dims=[0, 2])
        >>> k[1].active_dims.tolist(), batch_element(k, 1).active_dims.tolist()
        (2, [0, 2])
    """
    element = kernel[index]
    for new, old in zip(element.modules(), kernel.modules()):
        if isinstance(old, gpytorch.kernels.Kernel) and old.active_dims is not None:
            new.active_dims = old.active_dims
    return element


def evaluate(kernel: gpytorch.kernels.Kernel, A: torch.Tensor, B: torch.Tensor, diag: bool = False) -> torch.Tensor:
    """Dense ``k(A, B)`` (``(..., p, q)``; ``diag``: ``(..., p)``) with autograd to the kernel's parameters.

    ``kernel.forward`` skips the kernel's own ``active_dims`` (GPyTorch applies them in ``__call__``, which
    returns a lazy tensor), so they are applied here; sub-kernels of sums and products apply theirs in their
    ``forward``, which answers with a ``LinearOperator``: made dense."""
    dims = kernel.active_dims
    if dims is not None:
        dims = dims.to(A.device)
        A, B = A.index_select(-1, dims), B.index_select(-1, dims)
    K = kernel.forward(A, B, diag=diag)
    return K if isinstance(K, torch.Tensor) else K.to_dense()


def k_of_points(A: torch.Tensor, B: torch.Tensor, nu: float | None) -> torch.Tensor:
    """Unit-variance RBF / Matérn-``nu`` kernel ``k(A, B)`` (``(..., p, q)``) of points already divided by the
    length-scale, from their differences: ``torch.cdist`` without its ``|a|² + |b|² − 2aᵀb`` form, which loses about
    ``eps |a|²`` of a near pair's ``r²`` (Matérn-1/2's cusp turns that into errors of ``sqrt(eps)`` at ``r ≈ 0``)."""
    return k_of_r(torch.cdist(A, B, compute_mode="donot_use_mm_for_euclid_dist"), nu)


def difference_entries(kernel: gpytorch.kernels.Kernel, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor | None:
    """``k(A, B)`` (``(p, q)``) of an RBF / Matérn kernel, or of sums, products and ``ScaleKernel`` s of them (each
    with its ``active_dims``), from differences of centred, scaled points (:func:`k_of_points`), without autograd;
    ``None`` for other kernels, batched kernels or batched points. A reference for the rounding of GPyTorch's own
    entries, whose ``|a|² + |b|² − 2aᵀb`` loses near pairs in float32.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.kernels.entries import difference_entries
        >>> _ = torch.manual_seed(0)
        >>> X = 5 + torch.rand(500, 2)  # float32, away from the origin
        >>> k = gpytorch.kernels.MaternKernel(nu=0.5)
        >>> k.lengthscale = 0.2
        >>> ref = k.double()(X.double()).to_dense().detach()
        >>> k = k.float()
        >>> float((k(X).to_dense().detach() - ref).abs().max()) > 1e-5  # GPyTorch's |a|² + |b|² − 2aᵀb
        True
        >>> float((difference_entries(k, X, X) - ref).abs().max()) < 1e-6
        True
    """
    return _entries(kernel, A, B)


def _entries(kernel: gpytorch.kernels.Kernel, A: torch.Tensor, B: torch.Tensor, called: bool = True
             ) -> torch.Tensor | None:
    """:func:`difference_entries`; ``called``: the kernel is called (GPyTorch's ``__call__`` selects its
    ``active_dims``), not a ``ScaleKernel``'s base, whose ``forward`` it runs on the columns it selected."""
    if A.dim() != 2 or B.dim() != 2 or len(kernel.batch_shape):
        return None
    if called and kernel.active_dims is not None:
        dims = kernel.active_dims.to(A.device)
        A, B = A.index_select(-1, dims), B.index_select(-1, dims)
    if isinstance(kernel, (gpytorch.kernels.AdditiveKernel, gpytorch.kernels.ProductKernel)):
        parts = [_entries(k, A, B) for k in kernel.kernels]
        if not parts or any(part is None for part in parts):
            return None
        out = parts[0]
        for part in parts[1:]:
            out = out + part if isinstance(kernel, gpytorch.kernels.AdditiveKernel) else out * part
        return out
    if isinstance(kernel, gpytorch.kernels.ScaleKernel):
        inner = _entries(kernel.base_kernel, A, B, called=False)
        return None if inner is None else kernel.outputscale.detach().reshape(()).to(inner.dtype) * inner
    if type(kernel) not in (gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel):
        return None
    with torch.no_grad():
        dtype = computation_dtype(kernel, A, B)  # GPyTorch's promotion: float32 inputs in a float64 model
        A, B = A.to(dtype), B.to(dtype)
        ls = kernel.lengthscale.detach().reshape(-1).to(dtype)
        centre = A.mean(0)
        return k_of_points((A - centre) / ls, (B - centre) / ls, _nu(kernel))


class KernelEntries:
    """Entries of the unit-variance kernel matrix ``K = k(X, X)`` on demand.

    Args:
        X: ``(n, d)`` points.
        kernel: a GPyTorch kernel; a ``ScaleKernel`` is unwrapped (see :func:`split_outputscale`), its own
            ``active_dims`` applied to ``X`` (:attr:`X` holds the columns the base kernel sees).
    """

    def __init__(self, X: torch.Tensor, kernel: gpytorch.kernels.Kernel) -> None:
        if not isinstance(kernel, gpytorch.kernels.Kernel):
            raise ValueError(f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel).__name__}")
        dims = kernel.active_dims if isinstance(kernel, gpytorch.kernels.ScaleKernel) else None
        if dims is not None and kernel.base_kernel.active_dims is None:
            # GPyTorch's ScaleKernel selects its columns before its base kernel's forward, which the entries call
            X = X.index_select(-1, dims.to(X.device))
        self.X = X
        self.kernel, self.outputscale = split_outputscale(kernel)
        self._op_cache: dict = {}  # the on-the-fly operator's cutoff plan, reused while the length-scale holds

    @property
    def n(self) -> int:
        return self.X.shape[0]

    def points(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """``k(A, B)`` for point sets ``A: (..., p, d)``, ``B: (..., q, d)`` (batch dims broadcast), without
        autograd (:func:`evaluate`). ``(..., p, q)``"""
        with torch.no_grad():
            return evaluate(self.kernel, A, B).to(self.X.dtype)

    def __call__(self, I: torch.Tensor | slice, J: torch.Tensor | slice) -> torch.Tensor:
        """``K[I][:, J]`` for index tensors or slices. ``(|I|, |J|)``; evaluated in row blocks of the memory
        budget when large (a GPyTorch kernel holds a few temporaries of the result's size)."""
        A, B = self.X[I], self.X[J]
        rows = block_rows(B.shape[0], parts=4, device=self.X.device)
        if A.shape[0] <= rows:
            return self.points(A, B)
        out = A.new_empty(A.shape[0], B.shape[0])
        for a in range(0, A.shape[0], rows):
            out[a : a + rows] = self.points(A[a : a + rows], B)
        return out

    def batched(self, idx: torch.Tensor) -> torch.Tensor:
        """Local blocks ``K[s_b, s_b]`` for a batch of index sets ``idx: (b, w)``. Returns ``(b, w, w)``."""
        P = self.X[idx]
        return self.points(P, P)

    def matmul(self, V: torch.Tensor, block: int | None = None, group: Any = None) -> torch.Tensor:
        """``K @ V`` for ``V: (n, t)``, computed as :func:`~gpnys.kernels.product.choose_product` says: one
        transient block when ``K`` fits the block budget (``block`` rows, default the memory budget's), the kernel
        operator's fused backends (cutoff included) for a plain RBF/Matérn kernel and no explicit ``block``,
        otherwise GPyTorch row blocks (memory ``O(block * n)``). ``(n, t)``

        ``group`` (a :class:`~gpnys.collectives.RowGroup`, or a ``torch.distributed`` group /
        ``True``): every rank computes its rows and one gather assembles ``K V`` on all (docs/scaling.md, "Across
        processes and GPUs")."""
        n = self.n
        ranks = RowGroup.of(group)
        partitioned = ranks is not None and ranks.size > 1
        rows = block or block_rows(n, cap=n, device=self.X.device)
        itemsize = self.X.element_size()
        how = choose_product(n, itemsize, closed_form=supported(self.kernel), dense_limit_bytes=rows * n * itemsize,
                             explicit_block=block is not None, partitioned=partitioned)
        if how == "partitioned-fused":
            return self._operator_matmul(V, ranks.group)
        if how == "partitioned-rows":
            return ranks.gather_rows("kernel product", n, lambda a, b: self._rows_matmul(a, b, V, block), [V],
                                     (V.shape[1],))
        if how == "dense":
            return self(slice(None), slice(None)) @ V
        if how == "fused":
            return self._operator_matmul(V, None)
        return self._rows_matmul(0, n, V, rows)

    def _operator_matmul(self, V: torch.Tensor, group: Any) -> torch.Tensor:
        """``K @ V`` by the on-the-fly operator of the unit-variance kernel (``dense_limit_bytes=0``), its passes
        split over ``group`` (``None``: not split)."""
        one = torch.ones((), dtype=self.X.dtype, device=self.X.device)
        with torch.no_grad():
            op = StationaryKernelOperator(self.X, one, self.kernel.lengthscale.detach().to(self.X.dtype),
                                          base=self.kernel, cache=self._op_cache, dense_limit_bytes=0, group=group)
            return op.matmul(V.to(self.X.dtype))

    def _rows_matmul(self, a: int, b: int, V: torch.Tensor, block: int | None) -> torch.Tensor:
        """Rows ``[a, b)`` of ``K @ V`` in GPyTorch row blocks of ``block`` rows (default: the memory budget's)."""
        block = block or block_rows(self.n, cap=self.n, device=self.X.device)
        return torch.cat([self(slice(i, min(i + block, b)), slice(None)) @ V for i in range(a, b, block)])
