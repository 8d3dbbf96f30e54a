"""Which kernel, on which inputs, a GPyTorch model's training covariance really uses.

A model may keep its kernel under any attribute name, and its ``forward`` may transform the inputs before the
kernel sees them (``self.cov(20 * x)``). Both are visible in the covariance GPyTorch builds: in training mode
``forward`` returns a ``MultivariateNormal`` whose lazy covariance is a ``LazyEvaluatedKernelTensor`` carrying the
kernel object and the inputs it was called with. gpnys reads them there instead of from attribute names.
"""

from __future__ import annotations

import gpytorch
import torch
from gpytorch.lazy import LazyEvaluatedKernelTensor

__all__ = ["training_kernel", "same_points"]


def same_points(A: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether two point sets are the same tensor or equal in shape and value (``forward`` may rebuild its
    inputs, e.g. ``1.0 * x``, so identity alone would miss equal inputs)."""
    return A is B or (A.shape == B.shape and torch.equal(A, B))


def training_kernel(model: gpytorch.models.ExactGP) -> tuple[gpytorch.kernels.Kernel, torch.Tensor]:
    """``(kernel, inputs)`` of ``model``'s prior covariance at its training inputs: the kernel object its
    ``forward`` evaluated and the ``(n, d)`` (batch mode: ``(b, n, d)``) points it passed to it. No kernel entry is
    computed (the covariance stays lazy). ``ValueError`` when the covariance is not a single kernel evaluated on one
    set of points (e.g. ``k1(x) + k2(x)`` added outside a kernel object: wrap them in one kernel, ``k1 + k2``).

    Example:
        A ``forward`` that scales its inputs before the kernel sees them:

        >>> import gpytorch, torch
        >>> from gpnys.gp.discover import training_kernel
        >>> class Scaled(gpytorch.models.ExactGP):
        ...     def __init__(self, x, y):
        ...         super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
        ...         self.cov = gpytorch.kernels.RBFKernel()
        ...     def forward(self, x):
        ...         return gpytorch.distributions.MultivariateNormal(torch.zeros(x.shape[0]), self.cov(20 * x))
        >>> X = torch.rand(30, 2)
        >>> model = Scaled(X, X.sum(-1))
        >>> kernel, inputs = training_kernel(model)
        >>> kernel is model.cov, torch.equal(inputs, 20 * X)
        (True, True)
    """
    X = model.train_inputs[0]
    # forward() in the model's current mode: toggling it would have side effects (BoTorch models transform their
    # stored training inputs when they enter eval mode)
    with torch.no_grad(), gpytorch.settings.lazily_evaluate_kernels(True):
        cov = model.forward(X).lazy_covariance_matrix
    if isinstance(cov, LazyEvaluatedKernelTensor) and cov.x1 is cov.x2 and cov.x1.dim() == X.dim():
        return cov.kernel, cov.x1
    raise ValueError(f"model: its forward() covariance is a {type(cov).__name__}, not one kernel evaluated on the "
                     "training inputs; combine the kernels into one kernel object (k1 + k2, k1 * k2)")
