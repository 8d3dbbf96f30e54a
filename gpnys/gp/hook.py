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
import dataclasses
import warnings
from typing import Any, Callable

import gpytorch
import torch
import torch.distributed as dist
from gpytorch.lazy import LazyEvaluatedKernelTensor
from linear_operator.operators import AddedDiagLinearOperator, DiagLinearOperator, LinearOperator

from gpnys.checks import NumericalWarning, validate_count, validate_positive_tensors, validate_training_data
from gpnys.collectives import RowGroup
from gpnys.gp.control_variate import control_variate_terms, frozen_jacobian_terms
from gpnys.gp.discover import same_points, training_kernel, unsupported_covariance, unsupported_model
from gpnys.gp.estimator import Estimate, EstimatorState, hyperparameter_summary, log_prob
from gpnys.gp.operators import (
    BatchPreconditionedMVN,
    CallerSettingsMVN,
    CholeskyMVN,
    PreconditionedAddedDiag,
    PreconditionedMVN,
    PreconditionerOperator,
)
from gpnys.gp.path import PathChooser
from gpnys.gp.preconditioners import PreconditionerCache, StepRecord
from gpnys.gp.prediction import HookPrediction
from gpnys.gp.settings import EstimatorSettings, current_gpytorch_settings
from gpnys.gp.training_kernel import TrainingKernel
from gpnys.kernels.entries import computation_dtype, split_outputscale
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.precond.base import Preconditioner
from gpnys.precond.cache import PointCache
from gpnys.precond.strategy import (
    PRECONDITIONERS,
)

__all__ = ["use_preconditioner", "PreconditionerHook", "GP_DEFAULTS"]

#: preconditioner options for GP training when the caller gives none. The AFN paper's k = 2000, w = 100 (Zhao et
#: al. 2024, §5) target PCG at mu = 1e-4; GP training has mu = noise / outputscale, typically 1e-3..1e-1, where far
#: fewer landmarks and neighbours already give loss and gradient errors well below the probe noise, at a fraction
#: of the cost (docs/training.md).
GP_DEFAULTS: dict[str, dict[str, int]] = {"afn": {"k": 500, "w": 30}, "auto": {"k": 500, "w": 30}}



class PreconditionerHook(HookPrediction):
    """Builds and serves gpnys preconditioners for one ``ExactGP`` (see :func:`use_preconditioner`).

    Attributes:
        builds: number of preconditioner builds; applications: number of ``P̂⁻¹`` applications by CG;
        samples: probe draws through the factor; history: one :class:`StepRecord` per build.
    """

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
        if isinstance(method, str) and method not in PRECONDITIONERS:
            raise ValueError(f"method must be one of {PRECONDITIONERS} or a Preconditioner class, got {method!r}")
        if isinstance(method, str) and method == "none":
            raise ValueError("method 'none' would disable preconditioning; use GPyTorch without the hook instead")
        if not isinstance(method, str) and not (isinstance(method, type) and issubclass(method, Preconditioner)):
            raise ValueError(f"method must be a name or a Preconditioner subclass, got {method!r}")
        self.model = model
        self.method = method
        self.settings = settings or EstimatorSettings()
        self.kernels = TrainingKernel(self.settings)  # started afresh with the data (_set_data, _reset)
        self.seed = seed
        self._user_options = dict(options)
        #: why GPyTorch's own computation runs instead (a model or kernel the hook cannot accelerate), else None
        self.passthrough: str | None = unsupported_model(model, train_x)
        self._warned_passthrough = False
        self.applications = self.samples = self.estimates = 0
        self.history: list[StepRecord] = []  # one per preconditioner build, kept across data changes
        self.last_estimate: Estimate | None = None
        self.batch_estimates: list[Estimate] = []  # batch mode: one per element (last_estimate is their sum)
        #: the path of each evaluation, Cholesky or preconditioned (:class:`~gpnys.gp.path.PathChooser`)
        self.paths = PathChooser(self.settings.solver, method, self._problem)
        if self.passthrough is not None:
            return
        failure = None
        try:
            self._set_data(model.train_inputs[0] if train_x is None else train_x)
            for key in ("k", "w", "rank"):  # explicit sizes (the defaults are clamped to n by the factory)
                if options.get(key) is not None:
                    validate_count(options[key], key, 1, model.train_inputs[0].shape[-2])
        except ValueError as err:
            failure = err
        group = self.settings.kernel_group
        if group is not None and group is not False and dist.is_available() and dist.is_initialized():
            RowGroup.of(group).agree("input", failure)  # a rank that rejects its input tells the others now
        elif failure is not None:
            raise failure
        self.last_probes: torch.Tensor | None = None
        self.variance_reduction = bool(self.settings.variance_reduction)
        self.control_variates = 0
        self._warned_inputs = False  # one warning per hook for inputs that carry gradients (kernel_operator)
        self._warned_scale = False  # one warning per hook for an outputscale of 0 (hyperparameters_usable)

    # -- the training data ------------------------------------------------------------------------------
    def _data_key(self) -> tuple:
        """Identity, storage, version, shape and device of the model's training tensors: any change (``set_train_data``
        with the same or a new n, an in-place edit, ``model.to(device)``) changes the key."""
        tensors = (*self.model.train_inputs, self.model.train_targets)
        return tuple((id(t), t.data_ptr(), t._version, tuple(t.shape), str(t.device), t.dtype) for t in tensors)

    def _set_data(self, X: torch.Tensor) -> None:
        """Validate the training data (inputs ``X`` ``(n, d)``, or ``(b, n, d)`` for a batch-mode model, as the kernel
        sees them) and start every cache that depends on it afresh: points, preconditioners, kernel values and
        plans (one set per batch element)."""
        model = self.model
        shape = model.train_inputs[0].shape
        if X.dim() != len(shape) or X.shape[:-1] != shape[:-1]:
            raise ValueError(f"train inputs must be (n, d) or (b, n, d) with the model's n = {shape[-2]} points"
                             f"{f' and batch {shape[0]}' if len(shape) == 3 else ''}, got {tuple(X.shape)}")
        #: one :class:`BatchElement` per batch element of a batch-mode model (its own preconditioner), else None
        self.elements: list[BatchElement] | None = None
        self.kernels = TrainingKernel(self.settings)  # a batch-mode model's elements have their own (_reset)
        if X.dim() == 3:
            self.elements = [BatchElement(self, i, X[i]) for i in range(X.shape[0])]
        else:
            self._reset(X, model.train_targets)
        self._data = self._data_key()

    def _reset(self, X: torch.Tensor, y: torch.Tensor) -> None:
        """Validate one ``(n, d)`` point set and its targets ``(n,)`` and start its caches afresh."""
        validate_training_data(X, y, ("train_inputs", "train_targets"))
        noise = self._noise().detach()
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
        self.preconditioners = PreconditionerCache(self.method, self.options, self.seed, group, self.history,
                                                   self.settings.reuse_tolerance, self.settings.refresh_growth)
        #: (kernel, inputs) of the training covariance GPyTorch built last (the kernel under any attribute name,
        #: the inputs as its forward() passed them)
        self._seen: tuple[gpytorch.kernels.Kernel, torch.Tensor] | None = None
        self._warm_a: torch.Tensor | None = None  # the last K̂⁻¹ (y - m): the next solve's start (warm_start)

    def _pass_through(self, reason: str) -> None:
        """Let GPyTorch's own computation run for this model (one warning per hook, saying why)."""
        self.passthrough = reason
        if not self._warned_passthrough:
            self._warned_passthrough = True
            warnings.warn(f"gpnys: {reason}: the hook passes this model through, and GPyTorch's own computation runs "
                          "unchanged (docs/compatibility.md)", NumericalWarning, stacklevel=5)

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
        zero_scale = validate_positive_tensors(*checks, zero=scale)
        if zero_scale and not self._warned_scale:
            self._warned_scale = True
            warnings.warn("gpnys: outputscale is 0, so K̂ = σ² I: GPyTorch's own computation gives its exact loss",
                          NumericalWarning, stacklevel=4)
        return not zero_scale

    def sync_data(self) -> bool:
        """Follow the model's training data: when it changed since the caches were built (``set_train_data``, an
        in-place edit, a device move), start them afresh on the new data. Returns whether they were reset."""
        if self._data_key() == self._data:
            return False
        self._set_data(self.model.train_inputs[0])
        return True

    @property
    def kernel_fraction(self) -> float | None:
        """:attr:`TrainingKernel.fraction <gpnys.gp.training_kernel.TrainingKernel.fraction>` of the training kernel."""
        return self.kernels.fraction

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
        terms = control_variate_terms(current[0], self.kernel, self._noise(),
                                      Z, self.settings.control_variate if own else schur, split)
        self.control_variates += own and terms is not None
        return terms

    def frozen_jacobian_terms(self, Z: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """:func:`gpnys.gp.control_variate.frozen_jacobian_terms` of the training preconditioner."""
        current = self.preconditioners.current
        return None if current is None else frozen_jacobian_terms(current[0], self.kernel, self._noise(), Z)

    def estimator_state(self) -> EstimatorState:
        """What gpnys's estimator reads for one evaluation at the current hyperparameters (it writes nothing back;
        :meth:`evaluate` records its result)."""
        P, s2 = self.preconditioner()
        return EstimatorState(
            model=self.model, preconditioner=P, s2=s2, noise=self._noise(), settings=self.settings,
            warm_start=self._warm_a, variance_reduction=self.variance_reduction and not self.preconditioners.stale,
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
        self._warm_a = result.warm_start
        self.preconditioners.observe(result.estimate.cg_iterations)
        self.last_estimate = result.estimate
        self.estimates += 1
        return result.log_prob

    def batch_closed_form(self, op: LazyEvaluatedKernelTensor) -> bool:
        """Whether a batch-mode model's elements take gpnys's closed-form kernel operator rather than slices of
        GPyTorch's evaluated ``(b, n, n)`` kernel."""
        return self.kernels.closed_form(op.kernel[0], op.x1.requires_grad)

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

    def record_exact(self, log_prob: torch.Tensor) -> None:
        """The Cholesky path's :class:`Estimate`: ``-log_prob`` (``()`` or ``(b,)``), standard errors 0."""
        n = self.model.train_inputs[0].shape[-2]
        parts = [Estimate(value=-float(v), std_error=0.0, n=n, path="cholesky", path_reason=self.path_reason)
                 for v in log_prob.reshape(-1).tolist()]
        self.batch_estimates = parts if log_prob.dim() else []
        self.last_estimate = Estimate.total(parts)
        self.estimates += 1

    # -- the kernel and its inputs ----------------------------------------------------------------------
    @property
    def kernel(self) -> gpytorch.kernels.Kernel:
        """The kernel of the training covariance: the one GPyTorch evaluated in the model's ``forward`` (any
        attribute name; :func:`~gpnys.gp.discover.training_kernel` before the first training call)."""
        if self._seen is None:
            self._seen = training_kernel(self.model)
        return self._seen[0]

    def _noise(self) -> torch.Tensor:
        """The training noise variances: 0-dim for a ``GaussianLikelihood``, ``(n,)`` for known per-point noise
        (``FixedNoiseGaussianLikelihood``). Carries autograd."""
        noise = self._likelihood_noise()
        return noise.reshape(-1)[0] if noise.numel() == 1 else noise.reshape(-1)

    def _likelihood_noise(self) -> torch.Tensor:
        """The likelihood's noise tensor for this hook's points (a batch element takes its slice)."""
        return self.model.likelihood.noise

    def _inputs(self) -> torch.Tensor:
        """The points the kernel sees: the training inputs, or what ``forward`` made of them (e.g. ``20 * x``),
        in the computation dtype; the landmark / kNN cache follows them."""
        X = self.train_x
        if self._seen is not None:
            seen = self.kernels.promoted(self._seen[1], X.dtype)
            if not same_points(seen, X):
                X = seen
        if not same_points(self.cache.X, X):
            self.cache = PointCache(X.detach())
        return self.cache.X

    # -- building -------------------------------------------------------------------------------------
    @property
    def builds(self) -> int:
        """Preconditioner builds so far (one :class:`StepRecord` each in :attr:`history`)."""
        return len(self.history)

    def preconditioner(self, options: dict[str, Any] | None = None) -> tuple[Preconditioner, torch.Tensor]:
        """The preconditioner ``P`` of ``K + μI`` for the current hyperparameters, and ``s²`` (0-dim), from
        :attr:`preconditioners` (:class:`~gpnys.gp.preconditioners.PreconditionerCache`).

        ``options`` (e.g. ``{"k": 2000, "w": 60}``) override the hook's preconditioner options for this request;
        such a preconditioner is cached separately from the training one (both rebuilt when the hyperparameters
        change), so posterior solves can use a stronger preconditioner than the many MLL evaluations."""
        self._inputs()  # the point cache follows the inputs the kernel sees
        return self.preconditioners.get(self.cache, self.kernel, self._noise(), options)

    # -- the GPyTorch override ------------------------------------------------------------------------
    def override(self, op: AddedDiagLinearOperator) -> tuple[Callable, LinearOperator, torch.Tensor]:
        """``preconditioner_override`` for the training covariance: ``(closure, P̂ operator, log det P̂)``."""
        P, s2 = self.preconditioner()
        if op.shape[-1] != P.n or op.dim() != 2:
            raise ValueError(f"gpnys preconditioner built for n={P.n} but CG got an operator of shape {tuple(op.shape)}")

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

    def stationary_operator(self, X: torch.Tensor) -> StationaryKernelOperator | None:
        """The training kernel on ``X`` as gpnys's closed-form operator, or ``None``
        (:meth:`~gpnys.gp.training_kernel.TrainingKernel.operator`)."""
        return self.kernels.operator(self.kernel, X)

    def system(self, X: torch.Tensor, options: dict[str, Any] | None = None) -> tuple[Callable, Callable]:
        """``(A, M)`` for the current hyperparameters: ``A(V) = K̂ V`` with ``K̂ = s² K(X, X) + σ² I`` and
        ``M(R) = P̂⁻¹ R``, both ``(n, t) -> (n, t)``, for :func:`gpnys.solvers.pcg.pcg` (no autograd).
        ``options``: preconditioner options for ``M`` (see :meth:`preconditioner`)."""
        P, s2 = self.preconditioner(options)
        noise = self._noise().detach()
        noise = noise if noise.dim() == 0 else noise[:, None]  # K + D for per-point noise
        kmm = self.kernels.product(self.kernel, X, self.train_x.dtype)

        def A(V: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return kmm(V) + noise * V

        return A, (lambda R: P.solve(R) / s2)

    def kernel_operator(self, op: LinearOperator) -> LinearOperator:
        """The training covariance's kernel part: :meth:`stationary_operator` on the inputs the kernel actually
        received (``op.x1``, so a ``forward`` that transforms x is respected) while training, else ``op``."""
        if not (self.model.training and isinstance(op, LazyEvaluatedKernelTensor)
                and op.x1 is op.x2 and op.x1.dim() == 2 and op.x1.shape[0] == self.train_x.shape[0]):
            return op
        self._seen = (op.kernel, op.x1)
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
        so = self.stationary_operator(op.x1)
        if so is not None:
            self.kernels.inputs = op.x1
        return op if so is None else so

    # -- context ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def activate(self):
        likelihood = self.model.likelihood
        if "marginal" in vars(likelihood):  # an outer hook's wrapper: stacking would drop one on exit
            raise ValueError("model: gpnys.use_preconditioner is already active on this model; nested contexts on "
                             "one model are not supported (leave the outer one first)")
        if self.passthrough is not None:
            self._pass_through(self.passthrough)
            yield self
            return
        original = likelihood.marginal
        hook = self
        callers = current_gpytorch_settings()  # a passed-through evaluation runs under these, not the hook's

        def marginal(function_dist, *args, **kwargs):
            hook.sync_data()
            out = original(function_dist, *args, **kwargs)
            cov = out.lazy_covariance_matrix
            shape = hook.model.train_inputs[0].shape[:-1]  # (n,) or (b, n)
            if not (isinstance(cov, AddedDiagLinearOperator) and cov.shape[:-1] == shape):
                return out
            reason = unsupported_covariance(cov._linear_op)
            if reason is not None:
                hook._pass_through(reason)
            if reason is not None or not hook.hyperparameters_usable(cov._linear_op.kernel):
                return CallerSettingsMVN(out.mean, cov, callers)
            if hook.model.training and hook.paths.choose()[0] == "cholesky":
                out = CholeskyMVN(out.mean, cov)
                out._gpnys_hook = hook
                return out
            if hook.elements is not None:  # batch mode: one preconditioner and estimate per element
                out = BatchPreconditionedMVN(out.mean, cov) if hook.model.training else out
                out._gpnys_hook = hook
                return out
            cov = PreconditionedAddedDiag(hook.kernel_operator(cov._linear_op), cov._diag_tensor,
                                          preconditioner_override=hook.override)
            out = PreconditionedMVN(out.mean, cov)
            out._gpnys_hook = hook
            return out

        likelihood.marginal = marginal
        try:
            with self.settings.context():
                yield self
        finally:
            del likelihood.marginal  # restore the class method


class BatchElement(PreconditionerHook):
    """Batch element ``index`` of a batch-mode model (inputs ``(b, n, d)``, targets ``(b, n)``, a kernel and
    likelihood with batch shape ``(b,)`` or none): its own points, noise, kernel slice and preconditioner, so that
    gpnys's estimator runs on each of the ``b`` independent marginals ``N(m_i, K̂_i)`` (``K̂_i = s_i² K_i + σ_i² I``).

    The preconditioner is built from a detached copy of the kernel's slice (``kernel[index]``); the estimator's
    products carry autograd through the slice of the batched kernel itself. Without a differentiable preconditioner
    family (:meth:`PreconditionerHook.control_variate`) the log-determinant gradient is the plain, still unbiased,
    estimator."""

    def __init__(self, parent: PreconditionerHook, index: int, X: torch.Tensor) -> None:
        self.parent, self.index = parent, index
        self.model, self.method, self.seed, self.paths = parent.model, parent.method, parent.seed, parent.paths
        # every rank of a process group evaluates every element itself (row groups split one n x n operator), and
        # a probe seed is offset per element: the elements' errors stay independent, so their sum's adds in quadrature
        seed = parent.settings.probe_seed
        self.settings = dataclasses.replace(parent.settings, kernel_group=None,
                                            probe_seed=None if seed is None else int(seed) + index)
        self._user_options = parent._user_options
        self.applications = self.samples = self.estimates = 0
        self.history: list[StepRecord] = []
        self.last_estimate: Estimate | None = None
        self.last_probes: torch.Tensor | None = None
        self.variance_reduction = False
        self.control_variates = 0
        self._reset(X, parent.model.train_targets[index])

    @property
    def kernel(self) -> gpytorch.kernels.Kernel:
        """This element's slice of the training kernel (a detached copy, refreshed by :meth:`covariance`)."""
        if self._seen is None:
            kernel, inputs = training_kernel(self.model)
            self._seen = (kernel[self.index], inputs[self.index])
        return self._seen[0]

    def _likelihood_noise(self) -> torch.Tensor:
        noise = self.model.likelihood.noise
        return noise[self.index] if noise.dim() == 2 else noise  # (b, 1) or (b, n): batched

    def covariance(self, op: LazyEvaluatedKernelTensor, dense: LinearOperator | None,
                   diag: torch.Tensor) -> LinearOperator:
        """``K̂_i`` ``(n, n)`` of this element, with autograd: ``s_i² K_i`` as a
        :class:`~gpnys.kernels.operator.StationaryKernelOperator` (RBF/Matérn, inputs without gradients; else the
        slice of GPyTorch's evaluated batch ``dense``) plus the noise ``diag`` ``(n,)``."""
        kernel = op.kernel[self.index]
        self._seen = (kernel, op.x1[self.index])
        X = self._inputs()
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
        return PreconditionedAddedDiag(kop, DiagLinearOperator(diag), preconditioner_override=self.override)


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
            ``auto`` default to :data:`GP_DEFAULTS` (k = 500, w = 30).

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
