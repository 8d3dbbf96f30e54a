"""The training problem behind the hook: one model's data, kernel and noise, their caches, and the record of its
evaluations.

:class:`TrainingProblem` owns what :class:`~gpnys.gp.hook.PreconditionerHook` intercepts GPyTorch *for*: it
validates and follows the training data (``set_train_data``, in-place edits, device moves), finds the training
kernel and its inputs, serves the preconditioner ``P`` of ``K + μI``
(:class:`~gpnys.gp.preconditioners.PreconditionerCache`), hands gpnys's estimator its explicit
:class:`~gpnys.gp.estimator.EstimatorState` and records each :class:`~gpnys.gp.estimator.Estimate`, with the
counters. Prediction (:class:`~gpnys.gp.prediction.HookPrediction`)
reads the same state. A batch-mode model has one :class:`BatchElement` per element.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

import gpytorch
import torch
import torch.distributed as dist
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import (
    AddedDiagLinearOperator,
    DiagLinearOperator,
    LinearOperator,
)

from gpnys.checks import (
    HyperparameterError,
    NumericalWarning,
    validate_count,
    validate_positive_tensors,
    validate_seed,
    validate_training_data,
)
from gpnys.collectives import RowGroup, partitioned, signature
from gpnys.gp.control_variate import control_variate_terms, frozen_jacobian_terms
from gpnys.gp.discover import same_points, selected_kernel, training_kernel
from gpnys.gp.estimator import (
    Estimate,
    EstimatorState,
    hyperparameter_summary,
    log_prob,
    trainable_parameters,
)
from gpnys.gp.operators import PreconditionedAddedDiag, PreconditionerOperator
from gpnys.gp.path import PathChooser
from gpnys.gp.preconditioners import PreconditionerCache, StepRecord
from gpnys.gp.prediction import HookPrediction
from gpnys.gp.settings import GP_DEFAULTS, EstimatorSettings
from gpnys.gp.training_kernel import TrainingKernel
from gpnys.kernels.entries import batch_element, computation_dtype, split_outputscale
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.keys import TensorKey, same_objects
from gpnys.precond.base import Preconditioner
from gpnys.precond.cache import PointCache

__all__ = ["TrainingProblem", "BatchElement"]


class TrainingProblem(HookPrediction):
    """The data, kernel, noise and preconditioners of one ``ExactGP``'s training, and the record of its evaluations.

    Args:
        model: the ``ExactGP``; inputs ``(n, d)`` (or ``(b, n, d)`` in batch mode), targets ``(n,)`` / ``(b, n)``.
        method: a preconditioner name of :data:`~gpnys.precond.strategy.PRECONDITIONERS` or class.
        settings: the estimator's settings. seed: the preconditioner's seed.
        options: preconditioner options (``k``, ``w``, ``rank``, ...); ``afn`` / ``auto`` default to
            :data:`~gpnys.gp.settings.GP_DEFAULTS`, at most n.
        train_x: the inputs the kernel sees; ``None`` leaves the problem without data (a passed-through model).

    Attributes:
        builds: number of preconditioner builds; applications: number of ``P̂⁻¹`` applications; samples: probe
        draws through the factor; estimates: evaluations recorded; history: one :class:`StepRecord` per build;
        last_estimate: the latest :class:`~gpnys.gp.estimator.Estimate` (batch mode: the sum of
        ``batch_estimates``); warm_start: the last ``K̂⁻¹ (y − m)`` ``(n,)``, the next solve's start.

    Example:
        The preconditioned system ``(A, M)`` of a model's training covariance, without the hook:

        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel
        >>> from gpnys.gp.problem import TrainingProblem
        >>> from gpnys.gp.settings import EstimatorSettings
        >>> X = torch.rand(300, 2, dtype=torch.float64)
        >>> model = ExactGPModel(X, torch.sin(6 * X[:, 0]), gpytorch.likelihoods.GaussianLikelihood()).double()
        >>> problem = TrainingProblem(model, "auto", EstimatorSettings(), 0, {}, X)
        >>> A, M = problem.system(X)  # A(V) = K̂ V, M(R) = P̂⁻¹ R, both (300, t) -> (300, t)
        >>> A(torch.ones(300, 1, dtype=torch.float64)).shape, problem.builds
        (torch.Size([300, 1]), 1)
    """

    def __init__(self, model: gpytorch.models.ExactGP, method: str | type[Preconditioner],
                 settings: EstimatorSettings, seed: int, options: dict[str, Any],
                 train_x: torch.Tensor | None) -> None:
        self.model, self.method, self.settings, self.seed = model, method, settings, validate_seed(seed)
        self.kernels = TrainingKernel(settings)  # started afresh with the data (_set_data, _reset)
        self._user_options = dict(options)
        self.applications = self.samples = self.estimates = self.control_variates = 0
        self.history: list[StepRecord] = []  # one per preconditioner build, kept across data changes
        self.last_estimate: Estimate | None = None
        self.batch_estimates: list[Estimate] = []  # batch mode: one per element (last_estimate is their sum)
        self.last_probes: torch.Tensor | None = None
        self.variance_reduction = bool(settings.variance_reduction)
        #: the path of each evaluation, Cholesky or preconditioned (:class:`~gpnys.gp.path.PathChooser`)
        self.paths = PathChooser(settings.solver, method, self._problem,
                                 partitioned=partitioned(settings.kernel_group))
        self._warned_scale = False  # one warning for an outputscale of 0 (hyperparameters_usable)
        #: (kernel, inputs) of the training covariance GPyTorch built last (the kernel under any attribute name,
        #: the inputs as its forward() passed them)
        self.seen: tuple[gpytorch.kernels.Kernel, torch.Tensor] | None = None
        self.warm_start: torch.Tensor | None = None  # the last K̂⁻¹ (y - m): the next solve's start
        #: one :class:`BatchElement` per batch element of a batch-mode model (its own preconditioner), else None
        self.elements: list[BatchElement] | None = None
        self._modules: tuple[torch.nn.Module, ...] | None = None  # the model's modules at the last sync_data
        if train_x is None:
            return
        failure = None
        try:
            self._set_data(train_x)
            for key in ("k", "w", "rank"):  # explicit sizes (the defaults are clamped to n by the factory)
                if options.get(key) is not None:
                    validate_count(options[key], key, 1, model.train_inputs[0].shape[-2])
        except ValueError as err:
            failure = err
        group = settings.kernel_group
        if partitioned(group) and dist.is_available() and dist.is_initialized():
            # a rank that rejects its input tells the others now; the data and settings must agree exactly
            RowGroup.of(group).agree("input", failure, None if failure is not None else self._signature(train_x))
        elif failure is not None:
            raise failure

    def _signature(self, train_x: torch.Tensor) -> dict[str, Any]:
        """What every rank of a row partition must hold alike (:meth:`RowGroup.agree`): the training inputs as the
        kernel sees them and as the model holds them, the targets, known per-point noise, the model's modules and
        state (its hyperparameters: on the Cholesky path no collective would see them differ), the estimator's
        settings (but the group), the preconditioner's method, options and seed, and on a CPU the thread count (the
        replicated products round by it)."""
        model = self.model
        noise = getattr(model.likelihood, "noise", None) if isinstance(
            model.likelihood, gpytorch.likelihoods.FixedNoiseGaussianLikelihood) else None
        settings = {f"settings.{f.name}": repr(getattr(self.settings, f.name))
                    for f in dataclasses.fields(self.settings) if f.name != "kernel_group"}
        method = self.method if isinstance(self.method, str) else f"{self.method.__module__}.{self.method.__name__}"
        state = {f"model.{name}": t for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
        modules = {f"module {name or '(model)'}": type(module).__name__ for name, module in model.named_modules()}
        threads = torch.get_num_threads() if train_x.device.type == "cpu" else None
        return {**signature(inputs=train_x, train_inputs=model.train_inputs[0], train_targets=model.train_targets,
                            noise=noise, **state),
                **settings, "method": method, "options": repr(sorted(self._user_options.items())), "seed": self.seed,
                **modules, "threads": threads}

    # -- the training data ------------------------------------------------------------------------------
    def _data_key(self) -> tuple:
        """The model's training tensors by memory and version (:class:`~gpnys.keys.TensorKey`): any change
        (``set_train_data`` with the same or a new n, an in-place edit, ``model.to(device)``) changes the key."""
        return tuple(TensorKey(t) for t in (*self.model.train_inputs, self.model.train_targets))

    def _set_data(self, X: torch.Tensor) -> None:
        """Validate the training data (inputs ``X`` ``(n, d)``, or ``(b, n, d)`` for a batch-mode model, as the kernel
        sees them) and start every cache that depends on it afresh: points, preconditioners, kernel values and
        plans (one set per batch element)."""
        model = self.model
        shape = model.train_inputs[0].shape
        if X.dim() != len(shape) or X.shape[:-1] != shape[:-1]:
            raise ValueError(f"train inputs must be (n, d) or (b, n, d) with the model's n = {shape[-2]} points"
                             f"{f' and batch {shape[0]}' if len(shape) == 3 else ''}, got {tuple(X.shape)}")
        self.elements = None
        self.kernels = TrainingKernel(self.settings)  # a batch-mode model's elements have their own (_reset)
        if X.dim() == 3:
            self.elements = [BatchElement(self, i, X[i]) for i in range(X.shape[0])]
        else:
            self._reset(X, model.train_targets)
        self._data = self._data_key()

    def _reset(self, X: torch.Tensor, y: torch.Tensor) -> None:
        """Validate one ``(n, d)`` point set and its targets ``(n,)`` and start its caches afresh."""
        validate_training_data(X, y, ("train_inputs", "train_targets"))
        noise = self.noise().detach()
        if noise.numel() not in (1, X.shape[0]):
            raise ValueError(f"likelihood.noise must be one variance or one per training point ({X.shape[0]}), got "
                             f"shape {tuple(self.model.likelihood.noise.shape)}")
        validate_positive_tensors(("likelihood.noise", noise, False))
        #: the kernel operator's caches and promoted inputs (:class:`~gpnys.gp.training_kernel.TrainingKernel`)
        self.kernels = TrainingKernel(self.settings)
        # GP_DEFAULTS' sizes at most n (an explicit size is the caller's, validated against n in __init__)
        defaults = GP_DEFAULTS.get(self.method, {}) if isinstance(self.method, str) else {}
        self.options = {**{key: min(value, X.shape[0]) for key, value in defaults.items()}, **self._user_options}
        self.train_x = X.detach().to(computation_dtype(self.model, X))
        self.cache = PointCache(self.train_x)
        group = self.settings.kernel_group if isinstance(self.method, str) else None
        #: the preconditioners of these points (:class:`~gpnys.gp.preconditioners.PreconditionerCache`)
        grows = (isinstance(self.method, str) and self.method in ("afn", "auto")
                 and not {"k", "afn_k"} & set(self._user_options))
        self.preconditioners = PreconditionerCache(self.method, self.options, self.seed, group, self.history,
                                                   self.settings.reuse_tolerance if self.settings.error_bars
                                                   else None, self.settings.refresh_growth,
                                                   self.settings.grow_landmarks if grows else None)
        self.seen = None
        self.warm_start = None

    def sync_data(self) -> bool:
        """Follow the model's training data: when it changed since the caches were built (``set_train_data``, an
        in-place edit, a device move), start them afresh on the new data. Returns whether they were reset. A
        replaced module (a new kernel) is read again at the next evaluation or prediction."""
        modules = tuple(self.model.modules())
        if self._modules is not None and not same_objects(self._modules, modules):
            # a module was replaced (say model.covar_module = ...): the kernel is read again from the model's forward
            for problem in [self, *(self.elements or [])]:
                problem.seen = None
        self._modules = modules
        if self._data_key() == self._data:
            return False
        self._set_data(self.model.train_inputs[0])
        return True

    def hyperparameters_usable(self, kernel: gpytorch.kernels.Kernel) -> bool:
        """Check the hyperparameters of ``kernel`` (the one this evaluation's covariance holds) and the noise before
        an evaluation, in one host read: a ``ValueError`` naming the parameter for a non-finite or non-positive
        length-scale, outputscale or noise (the loss does not exist there, and the preconditioner's
        ``mu = noise / outputscale`` would hide which one it was). An outputscale of exactly 0 leaves ``K̂ = σ² I``,
        whose loss exists: ``False`` then, and the caller runs GPyTorch's own computation (one warning)."""
        base, _ = split_outputscale(kernel)
        checks = [("likelihood.noise", self.model.likelihood.noise, False)]
        if isinstance(getattr(base, "lengthscale", None), torch.Tensor):
            checks.append(("lengthscale", base.lengthscale, False))
        scale = kernel.outputscale if isinstance(kernel, gpytorch.kernels.ScaleKernel) else None
        if scale is not None:
            checks.append(("outputscale", scale, True))
        try:
            zero_scale = validate_positive_tensors(*checks, zero=scale)
        except ValueError as err:
            raise HyperparameterError(str(err)) from None
        if zero_scale and not self._warned_scale:
            self._warned_scale = True
            warnings.warn("gpnys: outputscale is 0, so K̂ = σ² I: GPyTorch's own computation is exact there",
                          NumericalWarning, stacklevel=4)
        return not zero_scale

    # -- the kernel, its inputs and the noise -----------------------------------------------------------
    def _seen(self) -> tuple[gpytorch.kernels.Kernel, torch.Tensor]:
        """:attr:`seen`, read from the model's ``forward`` (:func:`~gpnys.gp.discover.training_kernel`) before the
        first training call."""
        if self.seen is None:
            self.seen = training_kernel(self.model)
        return self.seen

    @property
    def kernel(self) -> gpytorch.kernels.Kernel:
        """The kernel of the training covariance: the one GPyTorch evaluated in the model's ``forward`` (any
        attribute name), as it acts on the inputs it was given (:func:`~gpnys.gp.discover.selected_kernel`)."""
        return self._seen()[0]

    @property
    def kernel_fraction(self) -> float | None:
        """:attr:`TrainingKernel.fraction <gpnys.gp.training_kernel.TrainingKernel.fraction>` of the training kernel."""
        return self.kernels.fraction

    def noise(self) -> torch.Tensor:
        """The training noise variances: 0-dim for a ``GaussianLikelihood``, ``(n,)`` for known per-point noise
        (``FixedNoiseGaussianLikelihood``). Carries autograd."""
        noise = self._likelihood_noise()
        return noise.reshape(-1)[0] if noise.numel() == 1 else noise.reshape(-1)

    def _likelihood_noise(self) -> torch.Tensor:
        """The likelihood's noise tensor for these points (a batch element takes its slice)."""
        return self.model.likelihood.noise

    def inputs(self) -> torch.Tensor:
        """The points the kernel sees: the training inputs, or what ``forward`` made of them (e.g. ``20 * x``),
        in the computation dtype; the landmark / kNN cache follows them."""
        X = self.train_x
        seen = self.kernels.promoted(self._seen()[1], X.dtype)
        if not same_points(seen, X):
            X = seen
        if not same_points(self.cache.X, X):
            self.cache = PointCache(X.detach())
        return self.cache.X

    def stationary_operator(self, X: torch.Tensor) -> StationaryKernelOperator | None:
        """The training kernel on ``X`` as gpnys's closed-form operator, or ``None``
        (:meth:`~gpnys.gp.training_kernel.TrainingKernel.operator`)."""
        return self.kernels.operator(self.kernel, X)

    def batch_closed_form(self, op: LazyEvaluatedKernelTensor) -> bool:
        """Whether a batch-mode model's elements take gpnys's closed-form kernel operator rather than slices of
        GPyTorch's evaluated ``(b, n, n)`` kernel."""
        return self.kernels.closed_form(selected_kernel(batch_element(op.kernel, 0)), op.x1.requires_grad)

    # -- the preconditioner and the system --------------------------------------------------------------
    @property
    def builds(self) -> int:
        """Preconditioner builds so far (one :class:`StepRecord` each in :attr:`history`)."""
        return len(self.history)

    def preconditioner(self, options: dict[str, Any] | None = None) -> tuple[Preconditioner, torch.Tensor]:
        """The preconditioner ``P`` of ``K + μI`` for the current hyperparameters, and ``s²`` (0-dim), from
        :attr:`preconditioners` (:class:`~gpnys.gp.preconditioners.PreconditionerCache`).

        ``options`` (e.g. ``{"k": 2000, "w": 60}``) override the preconditioner options for this request; such a
        preconditioner is cached separately from the training one (both rebuilt when the hyperparameters change),
        so posterior solves can use a stronger preconditioner than the many MLL evaluations."""
        self.inputs()  # the point cache follows the inputs the kernel sees
        return self.preconditioners.get(self.cache, self.kernel, self.noise(), options)

    def override(self, op: AddedDiagLinearOperator) -> tuple[Callable, LinearOperator, torch.Tensor]:
        """GPyTorch's ``preconditioner_override`` for the training covariance: ``(closure, P̂ operator,
        log det P̂)``."""
        P, s2 = self.preconditioner()
        if op.shape[-1] != P.n or op.dim() != 2:
            raise ValueError(f"gpnys preconditioner built for n={P.n} but CG got an operator of shape "
                             f"{tuple(op.shape)}")

        def closure(rhs: torch.Tensor) -> torch.Tensor:
            self.applications += 1
            return P.solve(rhs) / s2

        logdet = P.logdet() + P.n * torch.log(s2)
        op = PreconditionerOperator(s2, precond=P, on_sample=self._record_probes, distribution=self.settings.probes)
        return closure, op, logdet

    def _record_probes(self, Z: torch.Tensor) -> None:
        """Keep the probes ``z_j ~ N(0, P̂)`` (``(n, t)``) GPyTorch's SLQ and trace estimator use this call."""
        self.samples += Z.shape[1]
        self.last_probes = Z

    def system(self, X: torch.Tensor, options: dict[str, Any] | None = None) -> tuple[Callable, Callable]:
        """``(A, M)`` for the current hyperparameters: ``A(V) = K̂ V`` with ``K̂ = s² K(X, X) + σ² I`` and
        ``M(R) = P̂⁻¹ R``, both ``(n, t) -> (n, t)``, for :func:`gpnys.solvers.pcg.pcg` (no autograd).
        ``options``: preconditioner options for ``M`` (see :meth:`preconditioner`)."""
        P, s2 = self.preconditioner(options)
        noise = self.noise().detach()
        noise = noise if noise.dim() == 0 else noise[:, None]  # K + D for per-point noise
        kmm = self.kernels.product(self.kernel, X, self.train_x.dtype)

        def A(V: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return kmm(V) + noise * V

        return A, (lambda R: P.solve(R) / s2)

    # -- the estimator's glue ---------------------------------------------------------------------------
    def control_variate(self) -> torch.Tensor | None:
        """``C(θ) = log det P̂(θ) + (1/t) Σ_j z_jᵀ P̂(θ)⁻¹ z_j`` on the probes of the last SLQ call
        (:mod:`gpnys.gp.control_variate`); ``None`` when the preconditioner cannot be differentiated (then
        GPyTorch's plain estimate is used)."""
        terms = self.control_variate_terms()
        return None if terms is None else terms[0] + terms[1].mean()

    def control_variate_terms(self, probes: torch.Tensor | None = None, schur: str | None = None,
                              split: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:func:`gpnys.gp.control_variate.control_variate_terms` of the training preconditioner on ``probes``
        ``(n, t)`` (default: the last probes GPyTorch drew, which this consumes). ``schur``: AFN's family
        (default ``settings.control_variate``, the estimate's own, counted in :attr:`control_variates`)."""
        Z = probes
        if Z is None:
            Z, self.last_probes = self.last_probes, None
        current = self.preconditioners.current
        if current is None or Z is None:
            return None
        own = schur is None  # the estimate's own family, not a proxy for its error bars
        terms = control_variate_terms(current[0], self.kernel, self.noise(),
                                      Z, self.settings.control_variate if own else schur, split)
        self.control_variates += own and terms is not None
        return terms

    def frozen_jacobian_terms(self, Z: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """:func:`gpnys.gp.control_variate.frozen_jacobian_terms` of the training preconditioner."""
        current = self.preconditioners.current
        return None if current is None else frozen_jacobian_terms(current[0], self.kernel, self.noise(), Z)

    def estimator_state(self) -> EstimatorState:
        """What gpnys's estimator reads for one evaluation at the current hyperparameters (it writes nothing back;
        :meth:`evaluate` records its result)."""
        P, s2 = self.preconditioner()
        return EstimatorState(
            model=self.model, preconditioner=P, s2=s2, noise=self.noise(), settings=self.settings,
            warm_start=self.warm_start, variance_reduction=self.variance_reduction and not self.preconditioners.stale,
            control_variate_terms=self.control_variate_terms, frozen_jacobian_terms=self.frozen_jacobian_terms,
            describe=lambda: hyperparameter_summary(self.kernel, self.model.likelihood.noise),
            path_reason=self.path_reason)

    def evaluate(self, mvn: gpytorch.distributions.MultivariateNormal, value: torch.Tensor) -> torch.Tensor:
        """``log p(value)`` under the training marginal ``mvn`` by gpnys's estimator
        (:func:`gpnys.gp.estimator.log_prob`), with its :class:`Estimate` in :attr:`last_estimate` and its solution
        kept as the next evaluation's warm start. 0-dim, with the estimator's gradient."""
        result = log_prob(self.estimator_state(), mvn, value)
        self.applications += result.applications
        self.samples += result.samples
        self.warm_start = result.warm_start
        self.preconditioners.observe(result.estimate.cg_iterations, recomputed=self.kernels.recomputed)
        self.last_estimate = result.estimate
        self.estimates += 1
        return result.log_prob

    def record_batch(self, estimates: list[Estimate]) -> None:
        """A batch-mode evaluation: one :class:`Estimate` per element, :attr:`last_estimate` their sum."""
        self.batch_estimates = estimates
        self.last_estimate = Estimate.total(estimates)
        self.estimates += 1

    def record_unbarred(self, log_prob: torch.Tensor) -> None:
        """GPyTorch's own estimator on the preconditioned path (no error bars): an :class:`Estimate` of ``-log_prob``
        (summed over a batch) with NaN standard errors, so that the record never shows an earlier evaluation's."""
        n = self.model.train_inputs[0].shape[-2]
        self.last_estimate = Estimate(value=-float(log_prob.sum()), std_error=math.nan, n=n, path="iterative",
                                      path_reason=self.path_reason)
        self.batch_estimates = []
        self.estimates += 1

    def record_exact(self, log_prob: torch.Tensor, gradients: bool = False, jittered: bool = False) -> None:
        """The Cholesky path's :class:`Estimate`: ``-log_prob`` (``()`` or ``(b,)``), standard errors 0 (with
        ``gradients``, each trainable parameter's too, named as the preconditioned path names them); NaN where the
        factorisation was ``jittered`` (the value is then the jittered matrix's, its error unknown)."""
        n = self.model.train_inputs[0].shape[-2]
        se = math.nan if jittered else 0.0
        zeros = ({name: torch.full_like(p, se).detach() for name, p in trainable_parameters(self.model)}
                 if gradients else {})
        parts = [Estimate(value=-float(v), std_error=se, n=n, path="cholesky", path_reason=self.path_reason,
                          grad_std_error=zeros) for v in log_prob.reshape(-1).tolist()]
        self.batch_estimates = parts if log_prob.dim() else []
        self.last_estimate = Estimate.total(parts)
        self.estimates += 1

    # -- the path: Cholesky or preconditioned -------------------------------------------------------------
    def _problem(self) -> tuple[int, int, torch.device, torch.dtype]:
        """``(n, batch, device, dtype)`` of the training data, as the cost model (:mod:`gpnys.gp.path`) sees it."""
        X = self.model.train_inputs[0]
        return X.shape[-2], X.shape[0] if X.dim() == 3 else 1, X.device, computation_dtype(self.model, X)

    @property
    def path(self) -> str | None:
        """The path of the latest evaluation, ``"cholesky"`` or ``"iterative"`` (``None`` before)."""
        return self.paths.path

    @property
    def path_reason(self) -> str:
        """Why the latest evaluation took :attr:`path` (:func:`gpnys.gp.path.choose_path`)."""
        return self.paths.reason


class BatchElement(TrainingProblem):
    """Batch element ``index`` of a batch-mode model (inputs ``(b, n, d)``, targets ``(b, n)``, a kernel and
    likelihood with batch shape ``(b,)`` or none): its own points, noise, kernel slice and preconditioner, so that
    gpnys's estimator runs on each of the ``b`` independent marginals ``N(m_i, K̂_i)`` (``K̂_i = s_i² K_i + σ_i² I``).

    The preconditioner is built from a detached copy of the kernel's slice (``kernel[index]``); the estimator's
    products carry autograd through the slice of the batched kernel itself. Without a differentiable preconditioner
    family (:meth:`TrainingProblem.control_variate`) the log-determinant gradient is the plain, still unbiased,
    estimator."""

    def __init__(self, parent: TrainingProblem, index: int, X: torch.Tensor) -> None:
        # every rank of a process group evaluates every element itself (row groups split one n x n operator), and
        # a probe seed is offset per element: the elements' errors stay independent, so their sum's adds in quadrature
        seed = parent.settings.probe_seed
        settings = dataclasses.replace(parent.settings, kernel_group=None,
                                       probe_seed=None if seed is None else int(seed) + index)
        super().__init__(parent.model, parent.method, settings, parent.seed, parent._user_options, None)
        self.parent, self.index, self.paths = parent, index, parent.paths
        self.variance_reduction = False
        self._reset(X, parent.model.train_targets[index])

    def _seen(self) -> tuple[gpytorch.kernels.Kernel, torch.Tensor]:
        """This element's slice of the training kernel (a detached copy, refreshed by :meth:`covariance`) and of
        its inputs."""
        if self.seen is None:
            kernel, inputs = training_kernel(self.model)
            self.seen = (batch_element(kernel, self.index), inputs[self.index])
        return self.seen

    def _likelihood_noise(self) -> torch.Tensor:
        noise = self.model.likelihood.noise
        return noise[self.index] if noise.dim() == 2 else noise  # (b, 1) or (b, n): batched

    def covariance(self, op: LazyEvaluatedKernelTensor, dense: LinearOperator | None,
                   diag: torch.Tensor) -> LinearOperator:
        """``K̂_i`` ``(n, n)`` of this element, with autograd: ``s_i² K_i`` as a
        :class:`~gpnys.kernels.operator.StationaryKernelOperator` (RBF/Matérn, inputs without gradients; else the
        slice of GPyTorch's evaluated batch ``dense``) plus the noise ``diag`` ``(n,)``."""
        kernel = selected_kernel(batch_element(op.kernel, self.index))
        self.seen = (kernel, op.x1[self.index])
        X = self.inputs()
        if dense is not None:
            kop = dense[self.index]
        else:
            scaled = isinstance(op.kernel, gpytorch.kernels.ScaleKernel)
            ls = (op.kernel.base_kernel if scaled else op.kernel).lengthscale  # (b, 1, d) or (1, d)
            s2 = op.kernel.outputscale if scaled else torch.ones((), dtype=X.dtype, device=X.device)
            kop = StationaryKernelOperator(
                X, s2[self.index] if s2.dim() else s2, ls[self.index] if ls.dim() == 3 else ls,
                base=split_outputscale(kernel)[0],
                cache=self.kernels.cache, **self.settings.operator_options(group=False))
        return PreconditionedAddedDiag(kop, DiagLinearOperator(diag), preconditioner_override=self.override,
                                       settings=self.settings)
