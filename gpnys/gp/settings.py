"""Accuracy knobs of GPyTorch's CG + SLQ estimator under gpnys (:class:`EstimatorSettings`)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gpytorch

from gpnys.checks import NumericalWarning, validate_choice, validate_count, validate_positive
from gpnys.gp.variance import VARIANCE_NEIGHBOURS
from gpnys.kernels.backends import BACKENDS
from gpnys.precond.afn import CV_FAMILIES

#: ``EstimatorSettings.solver`` values: ``"auto"`` (the cost model of :mod:`gpnys.gp.path`), ``"cholesky"``,
#: ``"iterative"``
SOLVERS = ("auto", "cholesky", "iterative")

__all__ = ["EstimatorSettings", "EstimatorOptions", "KernelOptions", "VarianceOptions", "VARIANCE_METHODS",
           "GP_DEFAULTS"]

#: preconditioner options for GP training when the caller gives none. The AFN paper's k = 2000, w = 100 (Zhao et
#: al. 2024, §5) target PCG at mu = 1e-4; GP training has mu = noise / outputscale, typically 1e-3..1e-1, where far
#: fewer landmarks and neighbours already give loss and gradient errors well below the probe noise, at a fraction
#: of the cost (docs/training.md).
GP_DEFAULTS: dict[str, dict[str, int]] = {"afn": {"k": 500, "w": 30}, "auto": {"k": 500, "w": 30}}

#: predictive variance methods of ``hook.predict``
VARIANCE_METHODS = ("auto", "pcg", "cholesky", "cached")


@dataclass(kw_only=True)
class KernelOptions:
    """How the training kernel is computed: :class:`~gpnys.kernels.operator.StationaryKernelOperator`'s storage,
    cutoff, backend and process group.

    Attributes:
        kernel_operator: during training, replace GPyTorch's autograd-tracked dense kernel by
            :class:`~gpnys.kernels.operator.StationaryKernelOperator` (RBF/Matérn under a ``ScaleKernel``): same
            values, closed-form derivative, no ``n x n`` autograd temporaries.
        dense_limit_bytes: that operator caches the dense kernel up to this size, else recomputes row blocks
            (:func:`gpnys.kernels.product.choose_product`); ``None``: the memory budget's
            (:func:`gpnys.budget.memory_budget`, 4 GiB by default).
        kernel_prune_tol: on the recomputed path the operator skips blocks of entries all ``<= kernel_prune_tol``
            times the outputscale (:mod:`gpnys.kernels.cutoff`); ``None``: machine epsilon of the data's dtype,
            ``0``: compute every entry.
        kernel_backend: the backend of that operator's recomputed products (:mod:`gpnys.kernels.backends`):
            ``None`` picks fused Triton kernels on CUDA and torch tiles on CPU; ``"torch"``, ``"triton"``,
            ``"keops"`` force one (KeOps is never chosen by itself). ``kernel_tf32``: let float32 Triton tile
            products use TF32 (about 1e-3 relative error).
        kernel_group: split that operator's products and derivative sums, and the FSAI / AFN preconditioner
            builds, by rows over the ranks of a ``torch.distributed`` process group (``True``: the default group;
            :mod:`gpnys.distributed`). Every rank runs the same training loop on the same data with the same seed
            and gets the same numbers.
    """

    kernel_operator: bool = True
    dense_limit_bytes: int | None = None
    kernel_prune_tol: float | None = None
    kernel_backend: str | None = None
    kernel_tf32: bool = False
    kernel_group: Any = None

    def __post_init__(self) -> None:
        if self.dense_limit_bytes is not None:
            validate_count(self.dense_limit_bytes, "dense_limit_bytes", 0)
        if self.kernel_prune_tol is not None and not float(self.kernel_prune_tol) >= 0:
            raise ValueError(f"kernel_prune_tol must be >= 0 or None, got {self.kernel_prune_tol!r}")
        if self.kernel_backend is not None:
            validate_choice(self.kernel_backend, "kernel_backend", BACKENDS, also="or None")

    def operator_options(self, group: bool = True) -> dict[str, Any]:
        """These options as :class:`~gpnys.kernels.operator.StationaryKernelOperator`'s keyword arguments
        (``group=False``: without the process group)."""
        out = {"dense_limit_bytes": self.dense_limit_bytes, "prune_tol": self.kernel_prune_tol,
               "backend": self.kernel_backend, "tf32": self.kernel_tf32}
        if group:
            out["group"] = self.kernel_group
        return out


@dataclass(kw_only=True)
class VarianceOptions:
    """How ``hook.predict`` (:meth:`gpnys.gp.prediction.HookPrediction.predict`) computes predictive variances.

    Attributes:
        variance_method: ``"auto"``, ``"pcg"``, ``"cholesky"`` or ``"cached"``.
        variance_tolerance, variance_block: their PCG tolerance and test-point block size.
        variance_neighbours: ``(w, w2)`` of the cached method (:class:`gpnys.gp.variance.LocalVariance`).
        variance_rel_error: recompute by PCG the cached variances whose error bound exceeds this share of the
            variance (``None``: keep them, with their bound).
    """

    variance_method: str = "auto"
    variance_tolerance: float = 1e-3
    variance_block: int = 1024
    variance_neighbours: tuple[int, int] = VARIANCE_NEIGHBOURS
    variance_rel_error: float | None = None

    def __post_init__(self) -> None:
        validate_choice(self.variance_method, "variance_method", VARIANCE_METHODS)
        validate_count(self.variance_block, "variance_block", 1)
        if not 0 < float(self.variance_tolerance) < 1:
            raise ValueError(f"variance_tolerance must be in (0, 1), got {self.variance_tolerance!r}")
        if self.variance_rel_error is not None and not float(self.variance_rel_error) > 0:
            raise ValueError(f"variance_rel_error must be positive or None, got {self.variance_rel_error!r}")


@dataclass(kw_only=True)
class EstimatorOptions:
    """The marginal likelihood's estimator: CG, probes, Lanczos quadrature, control variate, path and warm starts.

    Attributes:
        cg_tolerance: mean relative residual at which GPyTorch's CG stops (its training default is 1.0, a large
            part of its error). With a gpnys preconditioner 3e-2 already puts the solve error far below the
            probe noise (tighter tolerances only add iterations; docs/accuracy.md).
        max_cg_iterations: CG iteration cap.
        num_probes: Hutchinson / SLQ probe vectors (``num_trace_samples``).
        lanczos_steps: Lanczos steps kept for the quadrature (``max_lanczos_quadrature_iterations``). GPyTorch
            runs CG for at least this many iterations, so it also sets the minimum cost; the preconditioned
            spectrum is clustered enough that 10 steps suffice (docs/accuracy.md).
        lanczos_share: gpnys's estimator (``error_bars``) lifts that floor once the quadrature's truncation
            estimate is below this share of the probes' standard error and decaying (the estimator's
            ``_quadrature_test``). With a strong preconditioner the solves converge in a few steps, so the floor
            would otherwise set most of an evaluation's kernel passes (docs/accuracy.md, "Lanczos steps: stopped at
            the noise"). Only in the first probe batch and once the solve with ``r`` has converged, so the probes'
            solves run as long as it (their bias in the gradient is first order in their residual). ``None``:
            always ``lanczos_steps``.
        variance_reduction: add the preconditioner control variate to the log-det gradient
            (:meth:`PreconditionerHook.control_variate`) when the preconditioner supports it.
        probes: ``"rademacher"`` (``z = R e`` with random signs ``e``) or ``"gaussian"`` (``z ~ N(0, P)``); both
            have covariance ``P``, the Rademacher one never has a larger trace-estimator variance.
        probe_seed: when set, every MLL evaluation draws its probes from this seed (common random numbers), so
            the estimate is a deterministic function of the hyperparameters — what a quasi-Newton optimiser such as
            BoTorch's L-BFGS-B needs; the global RNG is left untouched. ``None``: fresh probes per call (for Adam).
            With ``warm_start`` (or a reused preconditioner) it also depends, far within its error bars, on the
            previous evaluation: the probes' Lanczos steps stop with the solve with ``y - m``, whose start is the
            previous solution (at n = 300 the loss moved by 7e-7 relative, the gradient by 4–8 % of its standard
            error). ``warm_start=False`` and ``reuse_tolerance=None`` make it a function of the hyperparameters alone.
        control_variate: for AFN, ``"diag"`` (cheap, ``O(nk(k + t))``), ``"full"`` (rebuild the FSAI rows with
            autograd, ``O(n w^2 k)``: removes the most variance, at a cost that grows past the CG solve's for
            large ``n``), ``"frozen"`` (``diag`` without rebuilding the ``(n - k) x k`` block ``V``,
            ``O(k^2 (k + t) + n k t)``: ``diag``'s gradient errors wherever measured, cheaper) or ``"auto"``
            (full while ``(n - k) w^2 k <= 2e9``, else frozen:
            :meth:`gpnys.precond.afn.AFNPreconditioner.control_family`); see
            :meth:`gpnys.precond.afn.AFNPreconditioner.differentiable_terms` and docs/training.md.
        error_bars: estimate the MLL with gpnys's own PCG + SLQ (:mod:`gpnys.gp.estimator`), which gives every
            value and gradient component a standard error (``hook.last_estimate``) and honours
            ``target_rel_error``; ``False``: GPyTorch's ``InvQuadLogdet`` with the same preconditioner (no error bars).
        solver: ``"auto"``: each evaluation takes GPyTorch's dense Cholesky where a cost model calibrated on this
            device predicts it faster and it fits the memory budget, else the preconditioned path (only for the
            ``"auto"`` preconditioner; a named one asks for the preconditioned path; :mod:`gpnys.gp.path`);
            ``"cholesky"`` or ``"iterative"`` force one. ``None``: ``$GPNYS_SOLVER``, else ``"auto"``. The path
            taken and why: ``hook.last_estimate.path`` and ``.path_reason``.
        reuse_tolerance: reuse the training preconditioner across steps while every length-scale and
            ``noise / outputscale`` stays within this relative change of those it was built for, without the control
            variate on those steps (:mod:`gpnys.gp.preconditioners`; docs/training.md, "Warm starts"); ``None``:
            rebuild whenever a hyperparameter changes. refresh_growth: rebuild anyway once the CG iterations exceed
            this multiple of those of the preconditioner's first evaluation. Both need ``error_bars`` (its
            evaluations count the iterations); without it ``reuse_tolerance`` is ignored, with one warning.
        grow_landmarks: where the kernel is recomputed on the fly (too large to store), an evaluation that needs at
            least this many CG iterations with AFN holding all its ``k`` landmarks (a default ``k``) doubles ``k``
            for the next builds, up to :data:`~gpnys.gp.preconditioners.MAX_GROWTH` times the default, half of
            ``n`` and the device's memory; a growth whose first evaluation needs no fewer iterations is undone
            (:meth:`~gpnys.gp.preconditioners.PreconditionerCache.observe`; docs/training.md, "Landmarks that
            grow"). ``None``: ``k`` stays fixed, as it does without ``error_bars`` (no iteration counts).
        warm_start: the solve with ``y - m`` starts from the previous evaluation's solution (same data); the
            probes' solves start at 0, as their quadrature needs (docs/training.md, "Warm starts").
        target_rel_error: keep adding batches of ``num_probes`` probes (reusing the preconditioner and the solve
            with ``y``; CG and Lanczos tightened where they dominate) until the loss's standard error is below this
            share of ``|loss|`` and the gradient's (the norm of its components' standard errors) below this share of
            ``||gradient||``; ``None``: one batch. max_probes: the cap on probes per evaluation.
    """

    cg_tolerance: float = 3e-2
    max_cg_iterations: int = 1000
    num_probes: int = 16
    lanczos_steps: int = 10
    lanczos_share: float | None = 0.1
    variance_reduction: bool = True
    probes: str = "rademacher"
    control_variate: str = "auto"
    probe_seed: int | None = None
    error_bars: bool = True
    target_rel_error: float | None = None
    max_probes: int = 1024
    solver: str | None = None
    warm_start: bool = True
    reuse_tolerance: float | None = None
    refresh_growth: float = 1.5
    grow_landmarks: int | None = 15

    def __post_init__(self) -> None:
        validate_positive(self.cg_tolerance, "cg_tolerance")
        if self.grow_landmarks is not None:
            validate_count(self.grow_landmarks, "grow_landmarks", 1)
        validate_count(self.max_cg_iterations, "max_cg_iterations", 1)
        validate_count(self.lanczos_steps, "lanczos_steps", 1)
        if self.reuse_tolerance is not None and not float(self.reuse_tolerance) >= 0:
            raise ValueError(f"reuse_tolerance must be >= 0 or None, got {self.reuse_tolerance!r}")
        if not float(self.refresh_growth) >= 1:
            raise ValueError(f"refresh_growth must be >= 1, got {self.refresh_growth!r}")
        if self.reuse_tolerance is not None and not self.error_bars:
            warnings.warn("gpnys: reuse_tolerance needs error_bars=True, whose evaluations count the CG iterations "
                          "that refresh a reused preconditioner; it is ignored, and the preconditioner is rebuilt "
                          "whenever a hyperparameter changes", NumericalWarning, stacklevel=3)
        if self.solver is None:
            self.solver = os.environ.get("GPNYS_SOLVER", "auto")
        validate_choice(self.solver, "solver", SOLVERS)
        if self.target_rel_error is not None and not (0 < float(self.target_rel_error) < 1):
            raise ValueError(f"target_rel_error must be in (0, 1) or None, got {self.target_rel_error!r}")
        if isinstance(self.max_probes, bool) or int(self.max_probes) != self.max_probes or self.max_probes < 2:
            raise ValueError(f"max_probes must be an integer >= 2, got {self.max_probes!r}")
        if self.lanczos_share is not None and not (0 < float(self.lanczos_share) < 1):
            raise ValueError(f"lanczos_share must be in (0, 1) or None, got {self.lanczos_share!r}")
        # one probe has no sample variance: the error bars need two
        validate_count(self.num_probes, "num_probes", 2 if self.error_bars else 1)
        if self.target_rel_error is not None and self.num_probes > self.max_probes:  # read only with a target
            raise ValueError(f"max_probes ({self.max_probes}) must be >= num_probes ({self.num_probes})")
        validate_choice(self.control_variate, "control_variate", CV_FAMILIES)
        validate_choice(self.probes, "probes", ("rademacher", "gaussian"))
        if self.probe_seed is not None:
            try:  # an integer, a float or a 0-dim tensor of one
                whole = not isinstance(self.probe_seed, bool) and bool(int(self.probe_seed) == self.probe_seed)
            except (TypeError, ValueError, RuntimeError):
                whole = False
            if not whole:
                raise ValueError(f"probe_seed must be an integer or None, got {self.probe_seed!r}")


@dataclass(kw_only=True)
class EstimatorSettings(EstimatorOptions, KernelOptions, VarianceOptions):
    """All of gpnys's options for one model, applied inside :func:`use_preconditioner`: the estimator's
    (:class:`EstimatorOptions`), the kernel computation's (:class:`KernelOptions`) and the predictive variances'
    (:class:`VarianceOptions`), composed into one flat set of fields.

    Example:
        Ask for standard errors below 0.2 % of the loss and of the gradient's norm; probes are added in batches
        until they are, and the Cholesky loss lies within three of the reported standard errors (``solver``: at
        200 points ``auto`` would take Cholesky itself):

        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel
        >>> from gpnys.gp.settings import EstimatorSettings
        >>> from gpnys.gp.hook import use_preconditioner
        >>> _ = torch.manual_seed(0)
        >>> X = torch.rand(200, 2, dtype=torch.float64)
        >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64)
        >>> model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
        >>> mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        >>> settings = EstimatorSettings(num_probes=4, target_rel_error=2e-3, probe_seed=0, solver="iterative")
        >>> with use_preconditioner(model, "auto", settings=settings) as hook:
        ...     loss = -mll(model(X), y)
        ...     loss.backward()
        >>> est = hook.last_estimate  # an Estimate of the total -log p(y); the loss is est.value / est.n
        >>> est.probes > settings.num_probes
        True
        >>> with torch.no_grad(), gpytorch.settings.max_cholesky_size(10_000):
        ...     loss_chol = (-mll(model(X), y)).item()
        >>> abs(loss.item() - loss_chol) < 3 * est.std_error / est.n
        True
    """

    def __post_init__(self) -> None:
        EstimatorOptions.__post_init__(self)
        KernelOptions.__post_init__(self)
        VarianceOptions.__post_init__(self)

    def context(self) -> contextlib.ExitStack:
        # importing BoTorch turns GPyTorch's fast (CG/SLQ) log_prob and solves off globally; they are the point here
        fast = gpytorch.settings.fast_computations
        flags = {"covar_root_decomposition": fast.covar_root_decomposition.on(), "log_prob": True, "solves": True}
        values = (0, self.cg_tolerance, min(self.cg_tolerance, 1e-4), self.max_cg_iterations, self.num_probes,
                  self.lanczos_steps)
        return _entered(flags, dict(zip(GPYTORCH_SETTINGS, values)))


#: the scalar GPyTorch settings :meth:`EstimatorSettings.context` sets (besides ``fast_computations``), in the order of
#: its values; :func:`current_gpytorch_settings` saves the same ones
GPYTORCH_SETTINGS = ("max_cholesky_size", "cg_tolerance", "eval_cg_tolerance", "max_cg_iterations",
                     "num_trace_samples", "max_lanczos_quadrature_iterations")


def _entered(flags: dict[str, bool], values: dict[str, Any]) -> contextlib.ExitStack:
    """An ``ExitStack`` inside ``fast_computations(**flags)`` and each ``gpytorch.settings.<name>(value)``."""
    stack = contextlib.ExitStack()
    stack.enter_context(gpytorch.settings.fast_computations(**flags))
    for name, value in values.items():
        stack.enter_context(getattr(gpytorch.settings, name)(value))
    return stack


def current_gpytorch_settings() -> Callable[[], contextlib.ExitStack]:
    """The GPyTorch settings :meth:`EstimatorSettings.context` changes, as they are now: a factory of a context
    that puts them back (a model the hook passes through computes under the caller's settings, not the hook's)."""
    fast = gpytorch.settings.fast_computations
    flags = {"covar_root_decomposition": fast.covar_root_decomposition.on(), "log_prob": fast.log_prob.on(),
             "solves": fast.solves.on()}
    values = {name: getattr(gpytorch.settings, name).value() for name in GPYTORCH_SETTINGS}
    return lambda: _entered(flags, values)
