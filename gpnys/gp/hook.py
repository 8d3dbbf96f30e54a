"""Drop-in gpnys preconditioners for GPyTorch's marginal-likelihood training (CG + stochastic Lanczos quadrature).

One line around an existing training loop::

    with gpnys.use_preconditioner(model, "auto"):      # or gpnys.AFNPreconditioner, "afn", "nystrom", ...
        loss = -mll(model(x), y); loss.backward()

How it hooks in. GPyTorch's ``GaussianLikelihood.marginal`` returns ``K̂ = s² K + σ² I`` as an
``AddedDiagLinearOperator``, whose ``_preconditioner()`` honours a ``preconditioner_override``. But
``MultivariateNormal.log_prob`` first calls ``covar.evaluate_kernel()``, and
``AddedDiagLinearOperator.evaluate_kernel`` rebuilds the sum *without* the override (gpytorch 1.15.2 /
linear_operator 0.6.1), so an override set naively is silently dropped and GPyTorch's rank-15 pivoted
Cholesky runs instead. Here the likelihood's ``marginal`` is wrapped (for this model's likelihood only, and
only inside the context) to return a :class:`PreconditionedAddedDiag`, whose ``evaluate_kernel`` keeps the
override. The override captures the model's training inputs and kernel, and builds the gpnys preconditioner
``P`` of ``K + μI`` with ``μ = σ²/s²`` for the *current* hyperparameters (rebuilt whenever they change,
re-estimating the rank; FPS order and kNN patterns are reused through one
:class:`~gpnys.precond.cache.PointCache`). GPyTorch then gets

* ``P̂⁻¹ r = P⁻¹ r / s²`` for preconditioned CG,
* ``log det P̂ = n log s² + log det P`` exactly, so ``log det K̂ = log det P̂ + SLQ(P̂^{-1/2} K̂ P̂^{-1/2})``,
* probes ``z ~ N(0, P̂)`` drawn through the preconditioner's factor (:class:`PreconditionerOperator`).

By default the marginal's ``log_prob`` is not GPyTorch's ``InvQuadLogdet`` but gpnys's estimator with the same
``P̂`` (:mod:`gpnys.gp.estimator`): per-probe terms give every value and gradient a standard error
(``hook.last_estimate``). Estimator settings (CG tolerance, probe count, Lanczos steps, requested accuracy) are
applied inside the context; see :class:`EstimatorSettings`.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any

import gpytorch
import torch
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import AddedDiagLinearOperator, LinearOperator

from gpnys.checks import NumericalWarning, validate_choice
from gpnys.gp.discover import selected_kernel, unsupported_covariance, unsupported_model
from gpnys.gp.operators import (
    BatchPreconditionedMVN,
    CallerSettingsMVN,
    CholeskyMVN,
    PreconditionedAddedDiag,
    PreconditionedMVN,
)
from gpnys.gp.problem import TrainingProblem
from gpnys.gp.settings import EstimatorSettings, current_gpytorch_settings
from gpnys.kernels.entries import split_outputscale
from gpnys.precond.base import Preconditioner
from gpnys.precond.strategy import PRECONDITIONERS

__all__ = ["use_preconditioner", "PreconditionerHook"]


class HookedMarginal:
    """The hooked likelihood's ``marginal`` while the context lasts (an instance attribute over the class method).

    A deep copy of the likelihood, such as a model snapshot taken in a training loop or BoTorch's fantasy models,
    gets its own class method bound to itself instead: a copied hook would evaluate the copy through this model's
    caches and this likelihood's noise, after the context too.
    """

    def __init__(self, likelihood: gpytorch.likelihoods.Likelihood, call: Any) -> None:
        self.likelihood, self.call = likelihood, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self.likelihood))  # deepcopy registers the likelihood's copy before copying its state
        if copy is None:
            raise TypeError("a hooked marginal copies only with its likelihood")
        return types.MethodType(type(copy).marginal, copy)


class PreconditionerHook:
    """Intercepts GPyTorch's training marginal for one ``ExactGP`` inside its context (:func:`use_preconditioner`);
    what it trains on, the preconditioners and the record of the evaluations are its :attr:`problem`
    (:class:`~gpnys.gp.problem.TrainingProblem`).

    The problem's record reads through the hook (:data:`READS`), e.g. ``hook.last_estimate``, ``hook.builds``,
    ``hook.history``, ``hook.applications``, ``hook.predict(test_x)``; they are read-only here.
    """

    #: the :class:`~gpnys.gp.problem.TrainingProblem` members read through the hook
    READS = frozenset({
        "model", "settings", "method", "seed", "options", "train_x", "elements", "kernel", "kernels", "cache",
        "kernel_fraction", "last_estimate", "batch_estimates", "builds", "history", "applications", "samples",
        "estimates", "control_variates", "preconditioners", "preconditioner", "system", "stationary_operator",
        "control_variate", "path", "path_reason", "paths", "predict", "variance_method_used", "variance_bound",
        "mean_bound", "variance_iterations", "prediction_time"})

    def __init__(
        self,
        model: gpytorch.models.ExactGP,
        method: str | type[Preconditioner] = "auto",
        settings: EstimatorSettings | None = None,
        seed: int = 0,
        train_x: torch.Tensor | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, gpytorch.models.ExactGP):
            raise ValueError(f"model must be a gpytorch.models.ExactGP, got {type(model).__name__}")
        half = sorted({str(p.dtype) for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)})
        if half:  # float16 / bfloat16 data in a float32 model is promoted, as GPyTorch promotes it
            raise TypeError(f"model: {', '.join(half)} parameters are not supported (neither GPyTorch's Cholesky nor "
                            "torch's linear algebra computes in them); use model.float() or model.double()")
        if isinstance(method, str):
            validate_choice(method, "method", PRECONDITIONERS, also="or a Preconditioner class")
        if isinstance(method, str) and method == "none":
            raise ValueError("method 'none' would disable preconditioning; use GPyTorch without the hook instead")
        if not isinstance(method, str) and not (isinstance(method, type) and issubclass(method, Preconditioner)):
            raise ValueError(f"method must be a name or a Preconditioner subclass, got {method!r}")
        #: why GPyTorch's own computation runs instead (a model or kernel the hook cannot accelerate), else None
        self.passthrough: str | None = unsupported_model(model, train_x)
        self._warned_passthrough = False
        self._warned_inputs = False  # one warning per hook for inputs that carry gradients (kernel_operator)
        self._warned_kernel = False  # ... and one for a kernel without the closed-form operator
        X = None if self.passthrough is not None else model.train_inputs[0] if train_x is None else train_x
        #: the data, kernel, noise, preconditioners and evaluations (:class:`~gpnys.gp.problem.TrainingProblem`)
        self.problem = TrainingProblem(model, method, settings or EstimatorSettings(), seed, options, X)

    def __getattr__(self, name: str) -> Any:
        if name in PreconditionerHook.READS:
            return getattr(self.problem, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in PreconditionerHook.READS:
            raise AttributeError(f"hook.{name} is read-only: set hook.problem.{name}")
        super().__setattr__(name, value)

    def _pass_through(self, reason: str) -> None:
        """Let GPyTorch's own computation run for this model (one warning per hook, saying why)."""
        self.passthrough = reason
        if not self._warned_passthrough:
            self._warned_passthrough = True
            warnings.warn(f"gpnys: {reason}: the hook passes this model through, and GPyTorch's own computation runs "
                          "unchanged (docs/compatibility.md)", NumericalWarning, stacklevel=5)

    def kernel_operator(self, op: LinearOperator) -> LinearOperator:
        """The training covariance's kernel part: gpnys's closed-form operator
        (:meth:`~gpnys.gp.problem.TrainingProblem.stationary_operator`) on the inputs the kernel actually received
        (``op.x1``, so a ``forward`` that transforms x is respected) while training, else ``op``."""
        problem = self.problem
        if not (problem.model.training and isinstance(op, LazyEvaluatedKernelTensor)
                and op.x1 is op.x2 and op.x1.dim() == 2 and op.x1.shape[0] == problem.train_x.shape[0]):
            return op
        problem.seen = (selected_kernel(op.kernel), op.x1)
        if op.x1.requires_grad:
            # inputs that carry gradients (a feature extractor in forward(), a learnable input transform): the
            # closed-form operator differentiates the hyperparameters only, so GPyTorch's own kernel tensor runs,
            # whose derivative reaches x1 and through it every parameter before the kernel
            if not self._warned_inputs:
                self._warned_inputs = True
                warnings.warn("gpnys: the kernel's inputs carry gradients (a feature extractor or a learnable input "
                              "transform); the kernel runs through GPyTorch's operator so that they get theirs, "
                              "slower than gpnys's closed-form kernel operator", NumericalWarning, stacklevel=4)
            return op
        so = problem.stationary_operator(op.x1)
        if so is not None:
            problem.kernels.inputs = op.x1
        elif problem.kernels.options.kernel_operator and not self._warned_kernel:
            # a kernel outside the closed-form table (periodic, spectral mixture, linear, sums, products): GPyTorch's
            # kernel tensor, dense n x n with autograd, on the same estimator (docs/compatibility.md)
            self._warned_kernel = True
            name = type(split_outputscale(problem.seen[0])[0]).__name__
            warnings.warn(f"gpnys: {name} has no closed form in gpnys's kernel operator (RBF, Matérn 1/2, 3/2, 5/2): "
                          "its products and derivatives run through GPyTorch's dense n x n kernel with autograd, "
                          "slower and larger in memory at large n; the estimate is the same", NumericalWarning,
                          stacklevel=4)
        return op if so is None else so

    def marginal(self, out: gpytorch.distributions.MultivariateNormal,
                 callers: tuple) -> gpytorch.distributions.MultivariateNormal:
        """What GPyTorch gets for the likelihood's marginal ``out``: the preconditioned training marginal
        (:mod:`gpnys.gp.operators`), the Cholesky path's, or ``out`` itself under the caller's GPyTorch settings
        (``callers``) for a covariance the hook cannot take."""
        problem = self.problem
        cov = out.lazy_covariance_matrix
        shape = problem.model.train_inputs[0].shape[:-1]  # (n,) or (b, n)
        if not (isinstance(cov, AddedDiagLinearOperator) and cov.shape[:-1] == shape):
            return out
        reason = unsupported_covariance(cov._linear_op)
        if reason is not None:
            self._pass_through(reason)
        if reason is not None or not problem.hyperparameters_usable(cov._linear_op.kernel):
            return CallerSettingsMVN(out.mean, cov, callers)
        if problem.model.training and problem.paths.choose(training=torch.is_grad_enabled())[0] == "cholesky":
            out = CholeskyMVN(out.mean, cov)
        elif problem.elements is not None:  # batch mode: one preconditioner and estimate per element
            if not problem.model.training:
                return out
            out = BatchPreconditionedMVN(out.mean, cov)
        else:
            cov = PreconditionedAddedDiag(self.kernel_operator(cov._linear_op), cov._diag_tensor,
                                          preconditioner_override=problem.override, settings=problem.settings)
            out = PreconditionedMVN(out.mean, cov)
        out._gpnys_problem = problem
        return out

    @contextlib.contextmanager
    def activate(self):
        """The context: the model's likelihood's ``marginal`` goes through :meth:`marginal` (this likelihood only,
        restored on exit). The estimator's GPyTorch settings apply to the marginals it returns, not globally: any
        other model evaluated in the context computes under its caller's settings."""
        likelihood = self.model.likelihood
        if isinstance(vars(likelihood).get("marginal"), HookedMarginal):  # stacking would drop one on exit
            raise ValueError("model: gpnys.use_preconditioner is already active on this model; nested contexts on "
                             "one model are not supported (leave the outer one first)")
        if self.passthrough is not None:
            self._pass_through(self.passthrough)
            yield self
            return
        original = likelihood.marginal
        callers = current_gpytorch_settings()  # a passed-through evaluation runs under these, not the hook's

        def marginal(function_dist, *args, **kwargs):
            self.problem.sync_data()
            return self.marginal(original(function_dist, *args, **kwargs), callers)

        likelihood.marginal = HookedMarginal(likelihood, marginal)
        try:  # the hook's GPyTorch settings apply to this model's marginals only (PreconditionedAddedDiag)
            yield self
        finally:
            del likelihood.marginal  # restore the class method


def use_preconditioner(
    model: gpytorch.models.ExactGP,
    method: str | type[Preconditioner] = "auto",
    settings: EstimatorSettings | None = None,
    seed: int = 0,
    train_x: torch.Tensor | None = None,
    **options: Any,
) -> contextlib.AbstractContextManager[PreconditionerHook]:
    """Context manager: train / predict ``model`` with a gpnys preconditioner for GPyTorch's CG + SLQ.

    Args:
        model: an ``ExactGP`` with a ``GaussianLikelihood``; inputs ``(n, d)``.
        method: ``"auto"`` (AFN paper Algorithm 5), ``"afn"``, ``"nystrom"``, ``"fsai"``, ``"pivchol"``,
            ``"ran"``, ``"sketch"``, or a :class:`~gpnys.precond.base.Preconditioner` subclass called as
            ``cls(X, kernel, mu, **options)``.
        settings: estimator accuracy knobs (:class:`EstimatorSettings`).
        seed: seed of the preconditioner's randomness (rank-estimation subsamples, uniform landmarks).
        train_x: the ``(n, d)`` inputs the kernel sees in training when the model's ``forward`` transforms
            ``model.train_inputs`` (e.g. a BoTorch input transform); default ``model.train_inputs[0]``.
        **options: passed to the preconditioner (e.g. ``k=2000``, ``w=100``, ``rank=...``); ``afn`` and
            ``auto`` default to :data:`~gpnys.gp.settings.GP_DEFAULTS` (k = 500, w = 30).

    Returns:
        The context manager; entering it gives the :class:`PreconditionerHook` with its counters.

    Example:
        The loss ``-MLL / n`` of a GPyTorch model by PCG + SLQ under the hook, against the Cholesky value:

        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel
        >>> from gpnys.gp.hook import use_preconditioner
        >>> _ = torch.manual_seed(0)
        >>> X = torch.rand(200, 2, dtype=torch.float64)
        >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64)
        >>> model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
        >>> mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        >>> with use_preconditioner(model, "auto") as hook:
        ...     loss = -mll(model(X), y)
        ...     loss.backward()
        >>> with torch.no_grad(), gpytorch.settings.max_cholesky_size(10_000):
        ...     loss_chol = (-mll(model(X), y)).item()
        >>> abs(loss.item() - loss_chol) < 1e-3
        True
        >>> hook.last_estimate.std_error / hook.last_estimate.n < 1e-3  # the estimate's standard error
        True
    """
    return PreconditionerHook(model, method, settings, seed, train_x, **options).activate()
