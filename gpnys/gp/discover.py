"""Which kernel, on which inputs, a GPyTorch model's training covariance really uses, and whether gpnys can
accelerate it.

A model may keep its kernel under any attribute name, and its ``forward`` may transform the inputs before the
kernel sees them (``self.cov(20 * x)``). Both are visible in the covariance GPyTorch builds: in training mode
``forward`` returns a ``MultivariateNormal`` whose lazy covariance is a ``LazyEvaluatedKernelTensor`` carrying the
kernel object and the inputs it was called with. gpnys reads them there instead of from attribute names. Those
inputs are the ones the kernel's ``active_dims`` selected; :func:`selected_kernel` is the kernel as it acts on them.
"""

from __future__ import annotations

import gpytorch
import torch
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import LinearOperator

__all__ = ["training_kernel", "selected_kernel", "same_points", "unsupported_model", "unsupported_covariance",
           "STRUCTURED_KERNELS"]


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
        return selected_kernel(cov.kernel), cov.x1
    raise ValueError(f"model: its forward() covariance is a {type(cov).__name__}, not one kernel evaluated on the "
                     "training inputs; combine the kernels into one kernel object (k1 + k2, k1 * k2)")


def selected_kernel(kernel: gpytorch.kernels.Kernel) -> gpytorch.kernels.Kernel:
    """The kernel as it acts on the inputs its ``active_dims`` already selected (GPyTorch's ``Kernel.__call__``
    selects them before it builds the lazy kernel tensor whose ``x1`` the hook reads): a view without those
    ``active_dims``, and without a ``ScaleKernel``'s base kernel's (GPyTorch copies them onto the ``ScaleKernel``,
    whose ``forward`` calls the base's ``forward``, which skips them). The view shares the kernel's parameters and
    constraints (a shallow copy with its own buffers), so it follows their values; it is made once per kernel and
    brought up to date with the kernel's other state (``nu``, buffers) at every call. A kernel without
    ``active_dims`` is returned as it is.

    Example:
        >>> import gpytorch
        >>> from gpnys.gp.discover import selected_kernel
        >>> k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(active_dims=[0, 2]))
        >>> view = selected_kernel(k)
        >>> view.active_dims, view.base_kernel.active_dims
        (None, None)
        >>> view.base_kernel.raw_lengthscale is k.base_kernel.raw_lengthscale  # the same parameters
        True
    """
    if kernel.active_dims is None:
        return kernel
    view = vars(kernel).get("_gpnys_selected")
    if view is None:
        view = type(kernel).__new__(type(kernel))  # copy.copy would share the module's __dict__ here
        object.__setattr__(kernel, "_gpnys_selected", view)  # a plain attribute: not a submodule of the kernel
    # refreshed on every call: plain attributes (a Matérn kernel's nu), buffers and sub-modules may have changed
    state = {k: v for k, v in kernel.__dict__.items() if k != "_gpnys_selected"}
    view.__dict__.update(state, _buffers=dict(kernel._buffers), _modules=dict(kernel._modules))
    view.active_dims = None
    if isinstance(kernel, gpytorch.kernels.ScaleKernel):
        view.base_kernel = selected_kernel(kernel.base_kernel)
    return view


#: kernels whose evaluation is structured or approximate (grid interpolation, inducing points, random features,
#: task covariances, products over dimensions): the hook leaves them to GPyTorch's own computation
STRUCTURED_KERNELS = tuple(getattr(gpytorch.kernels, name) for name in (
    "GridInterpolationKernel", "GridKernel", "InducingPointKernel", "ProductStructureKernel", "AdditiveStructureKernel",
    "RFFKernel", "IndexKernel", "MultitaskKernel", "LCMKernel", "NewtonGirardAdditiveKernel", "SpectralDeltaKernel",
) if hasattr(gpytorch.kernels, name))


def unsupported_model(model: gpytorch.models.ExactGP, train_x: torch.Tensor | None = None) -> str | None:
    """Why the hook cannot accelerate ``model`` (its data, outputs or likelihood), or ``None``: batched inputs,
    several inputs to ``forward`` (a task index), several outputs, or a likelihood other than a
    ``GaussianLikelihood`` / ``FixedNoiseGaussianLikelihood`` (multitask likelihoods included). Targets whose
    last dimension is not the inputs' ``n`` under one of those two likelihoods are a ``ValueError``."""
    inputs = model.train_inputs
    if inputs is None or len(inputs) != 1:
        return "its forward() takes several inputs (e.g. a task index)"
    X = inputs[0] if train_x is None else train_x
    batch = inputs[0].shape[:-2]
    if len(batch) > 1 or X.shape[:-2] != batch:
        return f"its training inputs have more than one batch dimension, shape {tuple(inputs[0].shape)}"
    targets, likelihood = model.train_targets, model.likelihood
    single = isinstance(likelihood, (gpytorch.likelihoods.GaussianLikelihood,
                                     gpytorch.likelihoods.FixedNoiseGaussianLikelihood))
    n = inputs[0].shape[-2]
    if single and targets is not None and (targets.dim() == 0 or targets.shape[-1] != n):
        # a single-output likelihood with targets (n - 1,), (n, 1) or (n, t): GPyTorch fails later, or broadcasts
        raise ValueError(f"train_targets must hold one target per training point, shape ({n},) (or (b, {n}) with "
                         f"inputs (b, {n}, d)), got {tuple(targets.shape)}; several outputs need a multitask "
                         "likelihood or a batch of models")
    if targets is None or targets.shape != inputs[0].shape[:-1]:
        return "it has several outputs or tasks"
    policy = gpytorch.settings.observation_nan_policy.value()
    if policy != "ignore" and not bool(torch.isfinite(model.train_targets).all()):
        return f"its targets hold missing values under observation_nan_policy({policy!r})"
    if not single:
        return f"its likelihood is a {type(likelihood).__name__}"
    if tuple(getattr(likelihood, "batch_shape", ())) not in ((), tuple(batch)):
        return f"its likelihood's batch shape {tuple(likelihood.batch_shape)} is not the inputs' {tuple(batch)}"
    return None


def unsupported_covariance(op: LinearOperator) -> str | None:
    """Why the hook cannot accelerate the training covariance's kernel part ``op``, or ``None``: it must be one
    kernel evaluated on one set of ``(n, d)`` points (``(b, n, d)`` in batch mode), with no structured or
    approximate kernel inside."""
    if not (isinstance(op, LazyEvaluatedKernelTensor) and op.x1 is op.x2 and op.x1.shape[:-1] == op.shape[:-1]
            and op.dim() in (2, 3)):
        return (f"its training covariance is a {type(op).__name__}, not one kernel evaluated on the training inputs "
                "(combine kernels into one kernel object, k1 + k2, to have it accelerated)")
    structured = [type(m).__name__ for m in op.kernel.modules() if isinstance(m, STRUCTURED_KERNELS)]
    if structured:
        return f"its kernel uses {structured[0]}, a structured or approximate kernel"
    return None
