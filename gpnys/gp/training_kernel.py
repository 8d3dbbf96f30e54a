"""The training covariance's kernel as gpnys computes it: the closed-form kernel operator and its caches.

:class:`TrainingKernel` keeps, for one point set, what the kernel computation reuses across evaluations: the
:class:`~gpnys.kernels.operator.StationaryKernelOperator`'s cache (its stored ``K`` or cutoff plan, for the
current length-scale), the inputs it last saw, and the inputs promoted to GPyTorch's computation dtype (a copy
kept while they are unchanged, so the operator's caches, keyed on their identity, still hit).
"""

from __future__ import annotations

from typing import Any, Callable

import gpytorch
import torch

from gpnys.gp.settings import KernelOptions
from gpnys.kernels.entries import KernelEntries, split_outputscale
from gpnys.kernels.operator import StationaryKernelOperator, supported

__all__ = ["TrainingKernel"]


class TrainingKernel:
    """The kernel operator's state for one training point set (module docstring).

    Args:
        options: the kernel options (:class:`~gpnys.gp.settings.KernelOptions`, e.g. an ``EstimatorSettings``).

    Attributes:
        cache: the operator's cache (stored ``K`` / ``H`` or the cutoff plan); inputs: the inputs the training
            covariance's kernel last received (``None`` before), as ``forward`` passed them.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.gp.settings import EstimatorSettings
        >>> from gpnys.gp.training_kernel import TrainingKernel
        >>> X = torch.rand(50, 2, dtype=torch.float64)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> op = TrainingKernel(EstimatorSettings()).operator(kernel, X)
        >>> torch.allclose(op.to_dense(), kernel(X).to_dense())
        True
    """

    def __init__(self, options: KernelOptions) -> None:
        self.options = options
        self.cache: dict[str, Any] = {}
        self.inputs: torch.Tensor | None = None
        self._promotion: tuple | None = None

    @property
    def fraction(self) -> float | None:
        """Share of the ``n^2`` kernel entries the operator computes per product: ``1.0`` without a cutoff plan,
        ``None`` before the operator's first on-the-fly product, and while it reads a stored kernel."""
        if "plan_key" not in self.cache or self.cache.get("stored"):
            return None
        plan = self.cache["plan"]
        return 1.0 if plan is None else plan.fraction

    @property
    def recomputed(self) -> bool:
        """Whether the operator's last pass recomputed the kernel's entries (no stored ``K``): each CG iteration
        then costs a pass over them (:class:`~gpnys.gp.preconditioners.PreconditionerCache`'s landmark growth).
        ``False`` before any pass, with a stored kernel, and for kernels without the closed-form operator."""
        return self.cache.get("stored") is False

    def closed_form(self, kernel: gpytorch.kernels.Kernel, inputs_carry_gradients: bool = False) -> bool:
        """Whether ``kernel`` (a ``ScaleKernel`` over RBF/Matérn, or a bare one) takes the closed-form operator:
        ``kernel_operator`` on and the inputs without gradients."""
        base, _ = split_outputscale(kernel)
        return bool(self.options.kernel_operator) and supported(base) and not inputs_carry_gradients

    def operator(self, kernel: gpytorch.kernels.Kernel, X: torch.Tensor) -> StationaryKernelOperator | None:
        """``kernel(X, X)`` as a :class:`~gpnys.kernels.operator.StationaryKernelOperator` (``(n, n)``, with
        autograd to the outputscale and length-scale) for an unbatched closed-form kernel, else ``None``."""
        if not (self.closed_form(kernel) and len(kernel.batch_shape) == 0):
            return None
        scaled = isinstance(kernel, gpytorch.kernels.ScaleKernel)
        base = kernel.base_kernel if scaled else kernel
        X = self.promoted(X, base.lengthscale.dtype)
        # a bare RBF/Matérn (BoTorch's default SingleTaskGP kernel) has the constant outputscale 1
        s2 = kernel.outputscale if scaled else torch.ones((), dtype=X.dtype, device=X.device)
        return StationaryKernelOperator(X, s2, base.lengthscale, base=base, cache=self.cache,
                                        **self.options.operator_options())

    def product(self, kernel: gpytorch.kernels.Kernel, X: torch.Tensor,
                dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """``V -> s² K(X, X) V`` (``(n, t) -> (n, t)``) for ``kernel``: :meth:`operator`'s product where the kernel
        takes it, else dense row blocks of the memory budget (:class:`~gpnys.kernels.entries.KernelEntries`, never
        GPyTorch's ``n x n`` evaluation) on ``X`` promoted to ``dtype``."""
        op = self.operator(kernel, X)
        if op is not None:
            return op._matmul
        entries = KernelEntries(self.promoted(X, dtype), kernel)
        return lambda V: entries.outputscale * entries.matmul(V)

    def promoted(self, X: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``X`` in the dtype GPyTorch computes the kernel in (inputs promoted with the hyperparameters: float32
        inputs in a float64 model give a float64 kernel), the copy kept while ``X`` is unchanged."""
        target = torch.promote_types(X.dtype, dtype)
        if X.dtype == target:
            return X
        src, version, out = self._promotion if self._promotion is not None else (None, None, None)
        if src is not X or version != X._version or out.dtype != target:
            out = X.detach().to(target)
            self._promotion = (X, X._version, out)
        return out
