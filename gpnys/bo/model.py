"""A BoTorch ``SingleTaskGP`` that trains and predicts with gpnys preconditioners once Cholesky gets too big.

:class:`PreconditionedSingleTaskGP` is a ``SingleTaskGP`` (same constructor, modules, transforms and
priors). Up to ``max_cholesky_size`` training points it *is* a ``SingleTaskGP``: BoTorch's Cholesky path runs
unchanged, but for fantasies (last item). Above it, no ``n x n`` Cholesky of the training covariance
``K̂ = K(X, X) + σ² I`` is formed:

* **training** — ``fit_gpytorch_mll(mll)`` calls the model's ``custom_fit`` (BoTorch's hook for model-specific
  fitting): BoTorch's default routine (``_fit_fallback``: L-BFGS-B through ``fit_gpytorch_mll_scipy``, retries
  on failure) inside :meth:`PreconditionedSingleTaskGP.preconditioned`, i.e. GPyTorch's CG + SLQ with
  the gpnys preconditioner, the exact ``log det P`` and the preconditioner control variate (Wenger et al. 2022;
  :mod:`gpnys.gp.estimator`). Probes are drawn from a fixed seed at every evaluation (common random numbers,
  :attr:`gpnys.gp.settings.EstimatorSettings.probe_seed`), so BoTorch's L-BFGS-B sees a deterministic objective.
* **posterior** wherever Cholesky's working set fits the memory budget (:func:`gpnys.gp.path.cholesky_fits`;
  an integer ``posterior_cholesky_size`` instead fixes the size): BoTorch's exact path, one Cholesky of ``K̂`` per
  data and hyperparameters (GPyTorch's prediction caches), then triangular solves per call. A fit needs a
  factorisation *and its backward pass* per evaluation, tens of them; an acquisition optimisation needs one at fixed
  hyperparameters and then hundreds of solves, each of which PCG would pay in full, so where it fits the one
  factorisation is the cheaper (docs/bo.md; benchmarks/RESULTS.md, "BoTorch").
* **posterior** beyond that at ``X* (*b, q, d)`` — mean ``m(X*) + K(X*, X) α`` with ``α = K̂⁻¹ (y − m(X))`` by PCG,
  cached while data and hyperparameters are unchanged; joint covariance in the variational form

  ``Σ = K(X*, X*) − (K*ᵀ B + Bᵀ K* − Bᵀ K̂ B)``,  ``B ≈ K̂⁻¹ K*`` (``K* = K(X, X*)``, ``n x q`` per batch),

  whose error is second order in the PCG error of ``B`` (``Σ − Σ_exact = Eᵀ K̂ E``, ``E = B − K̂⁻¹K*``) and whose
  gradient w.r.t. ``X*`` (``B`` held fixed) is the exact one to first order — what ``optimize_acqf`` needs.
  Each column of ``B`` is solved until a bound on its variance's error and an estimate of its own error (which the
  gradient holds) are within ``posterior_variance_rtol`` (1e-4); where the dtype cannot reach that (float32 at a
  small noise), one warning per model says what it reached. ``B`` is warm-started from the previous call's
  solution when the batch shape repeats (an L-BFGS run over the acquisition function moves ``X*`` a little per
  step): ``x0 = B_prev + P̂⁻¹ (K* − K*_prev)``.
  BoTorch draws joint samples for ``q > 1`` from the ``q x q`` covariance (its Cholesky is ``q x q``).
* ``condition_on_observations`` with one new batch of points returns a new model of this class with the data
  appended (hyperparameters kept, transforms not refitted, as BoTorch does).
* **fantasies** at every size — batched observations (``fantasize``, as ``qKnowledgeGradient``,
  ``qMultiStepLookahead`` and ``qNegIntegratedPosteriorVariance`` make them) give a :class:`PreconditionedFantasyGP`:
  the posterior at ``[X_t, X_q]`` (PCG or Cholesky, as above) conditioned on the fantasy targets, a ``q x q``
  Cholesky per batch (:mod:`gpnys.bo.fantasy`). GPyTorch's fantasy update, which ``SingleTaskGP`` takes, forms
  ``(*f, *b, n + q, n + q)`` matrices under BoTorch's settings (GPyTorch's fast solves off), and detaches its
  covariance cache, so the gradient of an acquisition that sees ``X_q`` only through the fantasy covariance
  (``qNegIntegratedPosteriorVariance``) misses that term.

Models on non-batched inputs take the preconditioned path, with a learnt noise (``train_Yvar=None``,
``GaussianLikelihood``) or known per-point noise (``train_Yvar``, ``FixedNoiseGaussianLikelihood``: ``K̂ = K + D``,
AFN built on ``K + D / s²`` itself; see :class:`gpnys.gp.hook.PreconditionerHook`). With ``m > 1`` outputs
(``train_Y (n, m)``: BoTorch's batch of ``m`` independent GPs on inputs ``(m, n, d)``) each output trains through
its own preconditioner and estimate (the hook's batch mode), under BoTorch's batched L-BFGS-B (one problem per
output, without the stop at the noise level), and its posterior is that of a single-output model of its own
(:attr:`PreconditionedSingleTaskGP.output_models`: PCG, or Cholesky where the ``m`` factors fit the memory budget;
never GPyTorch's batched exact path, whose cache is broadcast over the acquisition's batch); their conditioning
and fantasies take BoTorch's path. Models on
batched inputs ``(b, n, d)`` stay on BoTorch's path, with a warning above the threshold.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
import warnings
from typing import Any, Iterator, Mapping, NamedTuple

import gpytorch
import torch
from botorch.fit import DEFAULT_WARNING_HANDLER
from botorch.models import SingleTaskGP
from botorch.models.transforms.input import InputTransform
from botorch.models.transforms.outcome import OutcomeTransform
from botorch.optim.closures import get_loss_closure
from botorch.optim.fit import fit_gpytorch_mll_scipy
from botorch.optim.utils import get_parameters_and_bounds
from botorch.utils.types import DEFAULT
from gpytorch.distributions import MultivariateNormal
from gpytorch.likelihoods import FixedNoiseGaussianLikelihood, GaussianLikelihood, Likelihood
from gpytorch.means import Mean
from gpytorch.module import Module

from gpnys.bo.fantasy import condition_blocks, condition_joint, latent_mvn
from gpnys.checks import HyperparameterError, NumericalWarning, validate_choice, validate_count, validate_positive
from gpnys.gp.estimator import gradient_at_noise
from gpnys.gp.hook import PreconditionerHook
from gpnys.gp.path import POSTERIOR_MATRICES, cholesky_fits, choose_path, measured_scale, near_switch, uses_costs
from gpnys.gp.posterior import PCGPosterior
from gpnys.gp.settings import EstimatorSettings
from gpnys.kernels.entries import batch_element
from gpnys.keys import TensorKey, same_objects
from gpnys.linalg import synchronize
from gpnys.precond.strategy import PRECONDITIONERS
from gpnys.solvers.pcg import ConvergenceWarning, PCGResult

try:  # BoTorch's default fitting routine: private, and no public name runs it without the dispatch back to us
    from botorch.fit import _fit_fallback
except ImportError as err:  # pragma: no cover - a BoTorch release that renamed it
    import botorch

    raise ImportError(f"gpnys.bo needs botorch.fit._fit_fallback, which botorch {botorch.__version__} does not have "
                      "(gpnys is tested with botorch 0.18): install a release that has it") from err

__all__ = [
    "PreconditionedSingleTaskGP", "PreconditionedFantasyGP", "PosteriorSolveError", "BO_DEFAULTS", "BO_LANDMARK_CAP",
    "POSTERIOR_CHOLESKY_SIZE", "POSTERIOR_VARIANCE_RTOL",
]

#: the default of ``posterior_cholesky_size``: ``None``, the posterior (fixed hyperparameters) factorises ``K̂`` once
#: wherever Cholesky's working set fits the memory budget (``n³/3`` flops and ``8 n²`` bytes a matrix in float64),
#: instead of solving by PCG per acquisition call (module docstring; docs/bo.md)
POSTERIOR_CHOLESKY_SIZE: int | None = None
#: the default of ``posterior_variance_rtol``: each PCG posterior variance is solved until the bound on its error is
#: at most this fraction of it (:meth:`PreconditionedSingleTaskGP._column_solves`; measured in docs/bo.md)
POSTERIOR_VARIANCE_RTOL = 1e-4
#: at most this many further solves of the columns whose variance bound exceeds ``posterior_variance_rtol``
VARIANCE_ROUNDS = 3
#: the products' rounding is computed (one product with ``|B|``) where its cheap part exceeds this share of the
#: allowance ``rtol · v``, or where a column needs a further solve
VARIANCE_ROUNDING = 1e-3
#: at most this many fresh L-BFGS-B runs after one that stopped on its own with the gradient still above its noise
#: and more than the loss's standard error gained (:meth:`custom_fit`)
FIT_RESTARTS = 8

#: landmark / neighbour counts of ``afn`` and ``auto`` in :class:`PreconditionedSingleTaskGP` unless given (``k`` is
#: capped at a fraction of ``n``, :data:`BO_LANDMARK_CAP`). BO data are often nearly noiseless (BoTorch's noise
#: floor is 1e-4 after ``Standardize``), so ``mu`` is far below the 1e-3..1e-1 that
#: :data:`gpnys.gp.settings.GP_DEFAULTS` (k = 500) was chosen for, and more landmarks pay for themselves in fewer CG
#: iterations and a smaller gradient error. The posterior preconditioner is built once per data and hyperparameters
#: and then applied in every PCG iteration of an acquisition optimisation, so it gets more still (docs/bo.md,
#: "Posterior").
BO_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {"k": 1500, "w": 30},
    "posterior": {"k": 3500, "w": 90},
}
#: fraction of the training points the landmark defaults may take, per use. The posterior preconditioner is
#: built once per data and hyperparameters and then applied in every PCG iteration of an acquisition
#: optimisation, so it may take more (its Cholesky is of the k x k landmark block, never of the n x n matrix).
BO_LANDMARK_CAP: dict[str, float] = {"train": 0.5, "posterior": 0.7}


class _Columns(NamedTuple):
    """The PCG posterior's pieces at points ``x (*b, q, d)`` (:meth:`PreconditionedSingleTaskGP._pcg_columns`)."""

    x: torch.Tensor  #: the points, input-transformed
    mean: torch.Tensor  #: ``(*b, q)``
    K: torch.Tensor  #: ``K* = K(X, x)`` ``(*b, n, q)``, differentiable w.r.t. ``x``
    B: torch.Tensor  #: ``B ≈ K̂⁻¹ K*`` ``(*b, n, q)``, held fixed (module docstring)
    KB: torch.Tensor  #: ``K̂ B``, held fixed


class PreconditionedSingleTaskGP(SingleTaskGP):
    """``SingleTaskGP`` whose MLL training and posterior solves use gpnys preconditioners above a size threshold.

    Args:
        train_X: ``(n, d)``, as for ``SingleTaskGP``.
        train_Y: ``(n, m)``, as for ``SingleTaskGP`` (``m`` outputs: ``m`` independent GPs, module docstring).
        train_Yvar: as for ``SingleTaskGP``.
        likelihood: as for ``SingleTaskGP``.
        covar_module: as for ``SingleTaskGP``.
        mean_module: as for ``SingleTaskGP``.
        outcome_transform: as for ``SingleTaskGP``.
        input_transform: as for ``SingleTaskGP``.
        precond: ``"auto"`` (AFN paper Algorithm 5: Nyström or AFN for the current length-scale), ``"afn"``,
            ``"nystrom"``, ``"fsai"``, ``"pivchol"``, ...
        max_cholesky_size: at most this many training points the model behaves exactly as ``SingleTaskGP``
            (Cholesky), above it it is preconditioned. ``None``: GPyTorch's ``max_cholesky_size`` setting at call
            time (4096 once BoTorch is imported), and above it the cost model of :mod:`gpnys.gp.path` (calibrated
            once per device and dtype) keeps Cholesky where that is predicted faster and fits the memory budget;
            a named ``precond`` asks for the preconditioned path there, as in the hook.
        settings: the MLL estimator's knobs (:class:`~gpnys.gp.settings.EstimatorSettings`); by default 16 probes
            with a fixed ``probe_seed`` (= ``seed``, also where the given settings leave it ``None``) so the
            training objective is deterministic for L-BFGS-B and the global RNG is not touched. Its
            ``solver`` (default ``$GPNYS_SOLVER`` or ``"auto"``) applies to ``max_cholesky_size=None``:
            ``"iterative"`` / ``"cholesky"`` force the path above GPyTorch's threshold.
        seed: seed of the preconditioner (rank estimation, landmarks) and of the probes.
        posterior_tolerance: relative PCG residual for ``B = K̂⁻¹ K*`` in a first pass (its columns then go on as
            ``posterior_variance_rtol`` needs). The covariance error is second order in it but scales like
            ``tol² |k*|² / σ²``. ``α`` is solved to ``tol²``. Both are floored at ``1000 eps`` of the dtype.
        posterior_variance_rtol: each test point's column of ``B`` is solved until the bound ``‖ρ‖² / min σ²`` on its
            variance's error is at most this fraction of the variance, and the estimate ``‖P̂⁻¹ρ‖`` of its own
            error (the variance's gradient w.r.t. the point is first order in it) at most this fraction of it
            (``ρ`` its residual; docs/bo.md, "Posterior", for the measured errors and cost). Where the dtype's
            rounding keeps it from that (float32 at a small noise), one ``NumericalWarning`` per model names the
            accuracy reached. ``None``: ``posterior_tolerance`` alone, unchecked.
        posterior_options: preconditioner options for the posterior solves only, over ``**precond_options``
            (which apply to both) and the defaults for ``afn`` / ``auto`` (``k=3500, w=90``, at most ``0.7 n``
            landmarks, :data:`BO_DEFAULTS`);
            built once per data and hyperparameters.
        posterior_cholesky_size: above ``max_cholesky_size``, the posterior still takes BoTorch's exact Cholesky
            path (one factorisation per data and hyperparameters, module docstring): ``None`` (default) wherever
            its :data:`~gpnys.gp.path.POSTERIOR_MATRICES` ``n x n`` matrices fit the memory budget
            (:func:`gpnys.budget.dense_limit_bytes`: 4 GiB on a CPU, half the free memory of a GPU), decided once
            per size, device and dtype; an int: up to this many training points; ``0``: always PCG.
        fit_subset: ``fit_gpytorch_mll`` on the preconditioned path first fits the hyperparameters on this many
            seeded random training points (BoTorch's Cholesky path; ``None``: off), then runs L-BFGS-B on all the
            data from there. The full-data objective is the same; only the starting point (and so the number
            of the expensive full-data evaluations) changes.
        **precond_options: passed to the training preconditioner (default for ``afn`` / ``auto``: ``k=1500,
            w=30``, :data:`BO_DEFAULTS`).

    Attributes:
        posterior_iterations: PCG iterations of the latest posterior solve (``B``, with the further solves of
            ``posterior_variance_rtol``), for diagnostics.
        posterior_variance_error: the latest PCG posterior's largest bound on a variance's relative error (with the
            dtype's rounding, estimated); ``None`` without ``posterior_variance_rtol`` or a PCG posterior yet.
        posterior_gradient_error: the latest PCG posterior's largest estimated relative error ``‖P̂⁻¹ρ‖ / ‖b‖`` of a
            column of ``B``, which the variances' gradients hold.
        alpha_iterations: PCG iterations of the latest solve for ``α = K̂⁻¹ (y − m)``.
        path_reason: why the latest :meth:`uses_preconditioner` chose its path.
        posterior_path_reason: why the latest posterior above ``max_cholesky_size`` took BoTorch's exact path or
            PCG (:meth:`posterior_exact`).
        output_models: ``m`` outputs: the single-output models of the posterior (their own
            ``posterior_iterations``).

    Example:
        Above ``max_cholesky_size`` the posterior comes from PCG; it matches ``SingleTaskGP``'s Cholesky posterior
        at the same hyperparameters. (``fit_gpytorch_mll(ExactMarginalLogLikelihood(gp.likelihood, gp))`` trains
        it as it trains a ``SingleTaskGP``.)

        >>> import torch
        >>> from botorch.models import SingleTaskGP
        >>> from gpnys.bo import PreconditionedSingleTaskGP
        >>> _ = torch.manual_seed(0)
        >>> X = torch.rand(100, 3, dtype=torch.float64)
        >>> Y = X.sin().sum(-1, keepdim=True) + 0.05 * torch.randn(100, 1, dtype=torch.float64)
        >>> gp = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=50, posterior_cholesky_size=0)
        >>> gp.uses_preconditioner()  # n = 100 > 50
        True
        >>> exact = SingleTaskGP(X, Y)
        >>> _ = exact.load_state_dict(gp.state_dict())
        >>> Xt = torch.rand(5, 3, dtype=torch.float64)
        >>> with torch.no_grad():
        ...     post, ref = gp.posterior(Xt), exact.posterior(Xt)
        >>> bool((post.mean - ref.mean).abs().max() < 1e-6)
        True
        >>> bool((post.variance - ref.variance).abs().max() < 1e-6)
        True
        >>> gp.hook().history[-1].kind  # the posterior solves' preconditioner (BO_DEFAULTS["posterior"])
        'afn'
    """

    def __init__(
        self,
        train_X: torch.Tensor,
        train_Y: torch.Tensor,
        train_Yvar: torch.Tensor | None = None,
        likelihood: Likelihood | None = None,
        covar_module: Module | None = None,
        mean_module: Mean | None = None,
        outcome_transform: OutcomeTransform | Any | None = DEFAULT,
        input_transform: InputTransform | None = None,
        *,
        precond: str = "auto",
        max_cholesky_size: int | None = None,
        settings: EstimatorSettings | None = None,
        seed: int = 0,
        posterior_tolerance: float = 1e-6,
        posterior_variance_rtol: float | None = POSTERIOR_VARIANCE_RTOL,
        posterior_options: dict[str, Any] | None = None,
        posterior_cholesky_size: int | None = POSTERIOR_CHOLESKY_SIZE,
        fit_subset: int | None = 1000,
        **precond_options: Any,
    ) -> None:
        validate_choice(precond, "precond", tuple(p for p in PRECONDITIONERS if p != "none"))
        validate_positive(posterior_tolerance, "posterior_tolerance")
        if posterior_variance_rtol is not None:
            posterior_variance_rtol = validate_positive(posterior_variance_rtol, "posterior_variance_rtol")
        # sizes: an integer (or None); validate_count also takes a whole float such as 1e4
        max_cholesky_size, posterior_cholesky_size, fit_subset = (
            None if v is None else validate_count(v, name, low) for v, name, low in (
                (max_cholesky_size, "max_cholesky_size", 0), (posterior_cholesky_size, "posterior_cholesky_size", 0),
                (fit_subset, "fit_subset", 1)))
        super().__init__(train_X, train_Y, train_Yvar, likelihood, covar_module, mean_module, outcome_transform,
                         input_transform)
        #: why the last fit on the preconditioned path ended early ("gradient at noise level"), else None
        self.fit_stopped: str | None = None
        #: fresh L-BFGS-B runs the last fit took after runs that stopped away from the noise level (:meth:`custom_fit`)
        self.fit_restarts = 0
        #: set by :meth:`warm_start_from`: the next fit starts from the copied hyperparameters (no subset start)
        self._gpnys_warm_fit = False
        #: ``(n,)`` start of the first solve with ``y - m`` (:meth:`warm_start_from`, :meth:`condition_on_observations`)
        self._gpnys_seed: torch.Tensor | None = None
        #: why the latest :meth:`uses_preconditioner` chose its path
        self.path_reason = ""
        #: the cost model's choice for ``max_cholesky_size=None``: ``((n, m, device, dtype, solver), path, reason)``
        self._gpnys_path: tuple[tuple, str, str] | None = None
        #: the key of ``_gpnys_path`` whose preconditioned choice a timed evaluation re-examined (:meth:`custom_fit`)
        self._gpnys_timed: tuple | None = None
        #: why the latest preconditioned-path posterior took BoTorch's exact path or PCG (:meth:`posterior_exact`)
        self.posterior_path_reason = ""
        #: the memory budget's choice for ``posterior_cholesky_size=None``: ``((n, m, device, dtype), exact, reason)``
        self._gpnys_posterior_path: tuple[tuple, bool, str] | None = None
        #: a failed PCG posterior solve: ``(state, reason)``; the exact path is taken while the state is the same
        self._gpnys_posterior_failed: tuple[tuple[torch.Tensor, ...], str] | None = None
        #: a fantasy model's ``(base model, X_q (*f, *b, q, d), y_q (*f, *b, q), noise (*f, *b, q))``
        #: (:meth:`condition_on_observations`), transformed; ``None`` for a model of its own data
        self._gpnys_fantasy: tuple[PreconditionedSingleTaskGP, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: open :meth:`preconditioned` contexts: their hook is in use, and :meth:`train` keeps it
        self._gpnys_in_use = 0
        #: whether this model (or the model whose output models these are) said that its PCG posterior variances
        #: miss ``posterior_variance_rtol``: one warning per model, not per call (:meth:`_column_solves`)
        self._gpnys_accuracy_warned = [False]
        #: the latest PCG posterior's bound on its variances' relative error, and estimate of the relative error of
        #: the solves their gradients hold (:meth:`_column_solves`)
        self.posterior_variance_error: float | None = None
        self.posterior_gradient_error: float | None = None
        settings = settings or EstimatorSettings()
        if settings.probe_seed is None:  # L-BFGS-B's line searches need a deterministic objective
            settings = dataclasses.replace(settings, probe_seed=seed)
        self._gpnys_config = {"precond": precond, "max_cholesky_size": max_cholesky_size,
                              # the model decides the path (uses_preconditioner); its hook always iterates
                              "solver": settings.solver,
                              "settings": dataclasses.replace(settings, solver="iterative"),
                              "seed": seed,
                              "posterior_tolerance": float(posterior_tolerance),
                              "posterior_variance_rtol": posterior_variance_rtol,
                              "posterior_cholesky_size": posterior_cholesky_size,
                              "options": precond_options, "posterior_options": dict(posterior_options or {}),
                              "fit_subset": fit_subset}
        self._clear_gpnys_caches()

    # -- state --------------------------------------------------------------------------------------------
    def _clear_gpnys_caches(self) -> None:
        self._gpnys_hook: PreconditionerHook | None = None
        self._gpnys_hook_x: torch.Tensor | None = None  # the kernel inputs the hook was made for
        self._gpnys_hook_kernel: tuple[Module, ...] | None = None  # the kernel modules it was made for
        self._gpnys_hook_settings: tuple | None = None  # and their plain settings (:meth:`_settings`)
        self._gpnys_posterior: PCGPosterior | None = None
        #: per block shape, the relative residuals the latest block's columns needed (:meth:`_column_solves`)
        self._gpnys_column_tol: dict[torch.Size, torch.Tensor] = {}
        #: ``m`` outputs: ``((state, modules, settings), one single-output model per output)`` for the posterior
        #: (:meth:`_output_models`)
        self._gpnys_outputs: tuple[tuple[tuple[torch.Tensor, ...], tuple[Module, ...], tuple],
                                   list[PreconditionedSingleTaskGP]] | None = None
        self.posterior_iterations = 0
        self.alpha_iterations = 0

    def train(self, mode: bool = True) -> "PreconditionedSingleTaskGP":
        """``SingleTaskGP.train``. Where GPyTorch drops ``SingleTaskGP``'s prediction cache (``train()``, and
        ``eval()`` after training), it also drops this model's: the hook (training and posterior preconditioners,
        the kernel inputs it found), ``α``, the posterior's solves and the output models, rebuilt on first use; a
        change that no cache key sees is picked up there. The hook of an open :meth:`preconditioned` context
        (``fit_gpytorch_mll``, whose routine switches modes itself) is in use and stays."""
        if mode or self.training:
            for name in _CACHES:
                if not (getattr(self, "_gpnys_in_use", 0) and name.startswith("_gpnys_hook")):
                    setattr(self, name, None)
            self._gpnys_exact_fantasy = False  # GPyTorch drops the fantasy caches that held a given noise
        return super().train(mode)

    def warm_start_from(self, previous: SingleTaskGP | Mapping[str, torch.Tensor]) -> "PreconditionedSingleTaskGP":
        """Start where the previous BO iteration's model ended; returns ``self``.

        * its kernel, mean and (learnt-noise) likelihood parameters are copied, and the next
          ``fit_gpytorch_mll`` starts L-BFGS-B from them, without the ``fit_subset`` start;
        * where ``previous``'s training inputs are the first rows of these (points appended), the first solve
          with ``y - m`` (training) and the posterior's ``α`` start from its ``K̂⁻¹ (y - m)``, new rows at 0.

        The preconditioners and the FPS landmarks are built anew for the new points (docs/bo.md, "Warm starts").
        The probes stay those of ``seed``.

        Args:
            previous: the last iteration's model (``SingleTaskGP`` or this class), same kernel and mean structure,
                or its :meth:`warm_state` (e.g. from a checkpoint; a plain ``state_dict()`` gives the
                hyperparameters only, its outcome transform's entries are skipped).

        Example:
            >>> import torch
            >>> from gpnys.bo import PreconditionedSingleTaskGP
            >>> X = torch.rand(60, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            >>> Y = X.sum(-1, keepdim=True).sin()
            >>> old = PreconditionedSingleTaskGP(X[:50], Y[:50], max_cholesky_size=0)
            >>> old.covar_module.lengthscale = 0.3
            >>> new = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0).warm_start_from(old)
            >>> torch.allclose(new.covar_module.lengthscale, old.covar_module.lengthscale)
            True
        """
        state = (previous.warm_state() if isinstance(previous, PreconditionedSingleTaskGP)
                 else previous if isinstance(previous, Mapping) else previous.state_dict())
        for name in ("covar_module", "mean_module") + (() if self._known_noise() else ("likelihood",)):
            getattr(self, name).load_state_dict({k[len(name) + 1:]: v for k, v in state.items()
                                                 if k.startswith(name + ".")})
        self._gpnys_warm_fit = True
        self._gpnys_seed = None
        alpha, Xp, X = state.get("gpnys_solution"), state.get("gpnys_solution_inputs"), self._kernel_inputs()
        if (alpha is not None and Xp is not None and Xp.dim() == X.dim() and Xp.shape[:-2] == X.shape[:-2]
                and Xp.shape[-2] <= X.shape[-2] and alpha.shape == Xp.shape[:-1]
                and torch.equal(X[..., : Xp.shape[-2], :], Xp.to(X))):  # (an input transform may move with the data)
            new = alpha.new_zeros(*alpha.shape[:-1], X.shape[-2] - Xp.shape[-2])
            self._gpnys_seed = torch.cat([alpha, new], dim=-1).to(X)
        return self

    def warm_state(self) -> dict[str, torch.Tensor]:
        """What :meth:`warm_start_from` reads, as tensors for a checkpoint: the ``state_dict()`` without the outcome
        transform, and the latest ``K̂⁻¹ (y - m)`` (the posterior's ``α``, else the last training solve) as
        ``gpnys_solution (n,)`` with its kernel inputs ``gpnys_solution_inputs (n, d)`` where there is one
        (``(m, n)`` and ``(m, n, d)`` for ``m`` outputs)."""
        state = {k: v.detach().clone() for k, v in self.state_dict().items() if not k.startswith("outcome_transform")}
        alpha = self._solution()
        if alpha is not None:
            state.update(gpnys_solution=alpha.detach().clone(), gpnys_solution_inputs=self._kernel_inputs().clone())
        return state

    def _solution(self) -> torch.Tensor | None:
        """The latest ``K̂⁻¹ (y - m)`` ``(n,)`` (``(m, n)`` for ``m`` outputs): the posterior's ``α``, else the last
        training solve; ``None`` before either."""
        outputs = [] if self._gpnys_outputs is None else self._gpnys_outputs[1]
        for parts in ([getattr(model._gpnys_posterior, "alpha", None) for model in outputs],
                      [getattr(self._gpnys_posterior, "alpha", None)],
                      [] if self._gpnys_hook is None else
                      [p.warm_start for p in self._gpnys_hook.problem.elements or [self._gpnys_hook.problem]]):
            if parts and all(p is not None for p in parts):
                return torch.stack(parts) if len(parts) > 1 else parts[0]
        return None

    def _known_noise(self) -> bool:
        """Whether the likelihood holds known per-point noise (``train_Yvar``): one variance per training point."""
        lik = self.likelihood
        return type(lik) is FixedNoiseGaussianLikelihood and lik.noise.shape == self.train_targets.shape

    def _outputs(self) -> int:
        """The outputs ``m`` of a model on non-batched inputs (``m > 1``: BoTorch's multi-output model, a batch of
        ``m`` independent GPs on inputs ``(m, n, d)``), else 0 (batched inputs)."""
        if len(self._input_batch_shape) or self.train_inputs[0].dim() != 2 + (self._num_outputs > 1):
            return 0
        return self._num_outputs

    def _handled(self) -> bool:
        """Non-batched inputs (one or ``m`` outputs), a ``GaussianLikelihood`` or known per-point noise: the models
        whose training and posterior gpnys preconditions. Those with one output also get gpnys's fantasies
        (:meth:`condition_on_observations`)."""
        return self._outputs() > 0 and (type(self.likelihood) is GaussianLikelihood or self._known_noise())

    def uses_preconditioner(self) -> bool:
        """Whether the preconditioned path applies: non-batched inputs (one or ``m`` outputs), a ``GaussianLikelihood``
        or known per-point noise (``train_Yvar``), and more than ``max_cholesky_size`` training points (with
        ``max_cholesky_size=None``, where the cost model does not predict Cholesky faster for ``m`` marginals)."""
        limit = self._gpnys_config["max_cholesky_size"]
        X = self.train_inputs[0]
        if X.shape[-2] <= (gpytorch.settings.max_cholesky_size.value() if limit is None else limit):
            self.path_reason = f"{X.shape[-2]} points <= max_cholesky_size"
            return False
        if limit is None:  # above GPyTorch's threshold the cost model may still find Cholesky faster on this device
            # decided once per size, device and dtype: this runs on every posterior call of an acquisition
            # optimisation, whose posteriors must not switch path as the free memory moves
            n, solver = X.shape[-2], self._gpnys_config["solver"]
            key = (n, self._outputs(), X.device, X.dtype, solver)
            if self._gpnys_path is None or self._gpnys_path[0] != key:
                self._gpnys_path = (key, *choose_path(n, max(self._outputs(), 1), X.device, X.dtype, solver,
                                                      self._gpnys_config["precond"]))
            _, path, self.path_reason = self._gpnys_path
            if path == "cholesky":
                return False
        else:
            self.path_reason = f"{X.shape[-2]} points > max_cholesky_size={limit}"
        if self._handled():
            return True
        if not getattr(self, "_gpnys_warned", False):  # above the threshold, but not a case gpnys handles: say so
            self._gpnys_warned = True
            warnings.warn(f"PreconditionedSingleTaskGP: {X.shape[-2]} training points exceed max_cholesky_size="
                          f"{limit}, but models on batched inputs or with other likelihoods are not preconditioned "
                          "yet: this model runs SingleTaskGP's Cholesky path", NumericalWarning, stacklevel=2)
        return False

    def _kernel_inputs(self) -> torch.Tensor:
        """Training inputs as the kernel sees them (input transform applied), ``(n, d)`` (``(m, n, d)`` for ``m``
        outputs)."""
        X = self.train_inputs[0]
        if hasattr(self, "input_transform") and not self._has_transformed_inputs:
            with torch.no_grad():
                X = self.input_transform.preprocess_transform(X)
        return X.detach()

    def _kernel_modules(self) -> tuple[Module, ...]:
        """The kernel module and its submodules, as objects: the hook holds them, so a replaced one
        (``model.covar_module = ...``, a new sub-kernel) needs a new hook."""
        return tuple(self.covar_module.modules())

    def _settings(self) -> tuple:
        """The plain settings of the kernel and mean modules, which neither :meth:`_values` (floating-point
        parameters and buffers) nor the modules' identities see: each module's public attributes that are numbers,
        strings, ``None`` or tuples of them (Matérn's ``nu``, ``ard_num_dims``) and its integer buffers by value
        (``active_dims``). A change (``kernel.nu = 0.5``, ``kernel.active_dims = ...``) needs a new hook, ``α`` and
        output models."""
        out = []
        for i, module in enumerate((*self.covar_module.modules(), *self.mean_module.modules())):
            for name, value in vars(module).items():
                value = _plain(value)
                if value is not _NOT_PLAIN and not name.startswith("_") and name != "training":
                    out.append((i, name, value))
            out.extend((i, name, buffer.tolist()) for name, buffer in module.named_buffers(recurse=False)
                       if not buffer.is_floating_point())
        return tuple(out)

    def hook(self) -> PreconditionerHook:
        """The :class:`~gpnys.gp.hook.PreconditionerHook` for the current training data, kernel modules and their
        settings (rebuilt when any changes, the inputs' dtype or device included, and after :meth:`train`; it
        rebuilds the preconditioner itself when the hyperparameters change)."""
        X, h, kernel, settings = self._kernel_inputs(), self._gpnys_hook, self._kernel_modules(), self._settings()
        if (h is None or not _same_state((self._gpnys_hook_x,), (X,))
                or not same_objects(self._gpnys_hook_kernel, kernel) or self._gpnys_hook_settings != settings):
            c = self._gpnys_config
            h = PreconditionerHook(self, c["precond"], c["settings"], c["seed"], train_x=X,
                                   **self._options("train", X.shape[-2]))
            if self._gpnys_seed is not None and self._gpnys_seed.shape == X.shape[:-1]:
                for problem, seed in ([(h.problem, self._gpnys_seed)] if h.problem.elements is None
                                      else zip(h.problem.elements, self._gpnys_seed)):
                    problem.warm_start = seed.to(X)
            self._gpnys_hook, self._gpnys_hook_x, self._gpnys_hook_kernel = h, X, kernel
            self._gpnys_hook_settings, self._gpnys_posterior = settings, None
        return h

    def _options(self, use: str, n: int) -> dict[str, Any]:
        """Preconditioner options for ``use`` (``"train"`` or ``"posterior"``): :data:`BO_DEFAULTS` for ``afn`` /
        ``auto`` (landmarks capped at :data:`BO_LANDMARK_CAP` ``[use] * n``) under the caller's options."""
        c = self._gpnys_config
        user = c["options"] if use == "train" else {**c["options"], **c["posterior_options"]}
        defaults = dict(BO_DEFAULTS[use]) if c["precond"] in ("afn", "auto") else {}
        if defaults:
            defaults["k"] = max(1, min(defaults["k"], int(BO_LANDMARK_CAP[use] * n)))
            defaults["w"] = max(1, min(defaults["w"], n))  # FSAI width: at most n (small n on this path)
        return {**defaults, **user}

    @contextlib.contextmanager
    def preconditioned(self) -> Iterator[PreconditionerHook | None]:
        """Context for MLL evaluations: GPyTorch's CG + SLQ with the gpnys preconditioner when
        :meth:`uses_preconditioner`, else a no-op (yields ``None``). ``fit_gpytorch_mll`` enters it by itself."""
        if not self.uses_preconditioner():
            yield None
            return
        with self.hook().activate() as h:
            self._gpnys_in_use = getattr(self, "_gpnys_in_use", 0) + 1
            try:
                yield h
            finally:
                self._gpnys_in_use -= 1

    def custom_fit(self, mll: gpytorch.mlls.MarginalLogLikelihood,
                   **kwargs: Any) -> gpytorch.mlls.MarginalLogLikelihood:
        """Called by ``botorch.fit.fit_gpytorch_mll``: BoTorch's default fitting routine (its private
        ``_fit_fallback``; same keywords) with the preconditioner active (:meth:`preconditioned`)."""
        # The estimated objective is deterministic (fixed probes) but only as smooth as the CG tolerance allows, so
        # L-BFGS-B can end in an "ABNORMAL" line search at the optimum; BoTorch would discard that fit and
        # restart from prior samples, so it is accepted here like BoTorch's own accepted warnings.
        # The same for the stop at the noise level below (a StopIteration from the callback reads as a failure)
        kwargs.setdefault("warning_handler", lambda w: DEFAULT_WARNING_HANDLER(w) or "ABNORMAL" in str(w.message)
                          or "StopIteration" in str(w.message))
        self.fit_stopped, self.fit_restarts = None, 0
        if not self.uses_preconditioner():
            return _fit_fallback(mll, **kwargs)
        if kwargs.get("closure") is None and not self._gpnys_warm_fit:
            self._fit_on_subset(mll, kwargs)
        self._gpnys_warm_fit = False
        if kwargs.get("closure") is None and self._cholesky_after_timing(mll):
            return _fit_fallback(mll, **kwargs)
        if kwargs.get("optimizer", fit_gpytorch_mll_scipy) is not fit_gpytorch_mll_scipy:
            # another optimizer (fit_gpytorch_mll_torch) runs once as the caller set it up (its step_limit, its
            # stopping criterion): the stop and restarts below answer L-BFGS-B's stop on the estimate's ripples
            with self.preconditioned(), _finite_loss(mll):
                return _fit_fallback(mll, **kwargs)
        # m outputs: BoTorch fits them as m independent L-BFGS-B problems in one batch, whose callback does not say
        # which problem it reports on: each stops on its own tolerances, without the test at the noise level, and
        # the restarts need the caller's iteration budget unset (its steps are not counted)
        multi = self._outputs() > 1
        with self.preconditioned() as hook, _finite_loss(mll):
            options = dict(kwargs.get("optimizer_kwargs") or {})
            user = options.get("callback")
            # L-BFGS-B's box (BoTorch bounds the constrained values, e.g. the noise at 1e-4): a component held at a
            # bound does not count against the stop
            _, box = get_parameters_and_bounds(mll)
            box = {**box, **(options.get("bounds") or {})}
            bounds = {name.removeprefix("model."): b for name, b in box.items()}

            steps = [0]  # L-BFGS-B iterations over all runs, against the caller's maxiter

            def at_noise(parameters: dict[str, torch.Tensor], result: Any) -> None:
                # L-BFGS-B ends once the gradient is within its noise (a chi-square test of g = 0 at 5 %): past
                # that it only chases the estimator's noise (and fails line searches doing so)
                steps[0] += 1
                if user is not None:
                    user(parameters, result)
                if gradient_at_noise(self, hook.last_estimate, bounds=bounds):
                    self.fit_stopped = "gradient at noise level"
                    raise StopIteration

            maxiter = (options.get("options") or {}).get("maxiter")
            if multi and maxiter is not None:
                return _fit_fallback(mll, **kwargs)
            last, idle = math.inf, 0  # the estimated loss where the previous run ended; runs in a row without gain
            while True:
                left = None if maxiter is None else maxiter - steps[0]
                run = options if multi else {**options, "callback": at_noise}
                if left is not None:
                    run["options"] = {**options["options"], "maxiter": left}
                kwargs["optimizer_kwargs"] = run
                mll = _fit_fallback(mll, **kwargs)
                # L-BFGS-B also stops on its own, on a relative change of the estimated loss below its ftol: the
                # estimate is only as smooth as the CG tolerances make it, and a step that lands in one of its
                # ripples can end the run far from the optimum. A fresh run from there (a new curvature model)
                # goes on while the gradient is above its noise, one of the last two runs gained more than the
                # loss's standard error, and the restarts and the caller's budget last.
                if (self.fit_stopped is not None or (left is not None and steps[0] >= maxiter)
                        or self._gradient_at_noise(mll, hook, bounds)):
                    return mll
                estimate = hook.last_estimate
                # a fresh run right after a long one often stops within a few steps, and the next goes on: two
                # runs in a row that gain less than the loss's standard error end the fit
                idle = idle + 1 if last - estimate.value <= estimate.std_error else 0
                if idle >= 2 or self.fit_restarts >= FIT_RESTARTS:
                    self.fit_stopped = "no progress" if self.fit_restarts < FIT_RESTARTS else "restarts spent"
                    warnings.warn(
                        f"gpnys: the fit stopped with the gradient above its noise ({self.fit_stopped} after "
                        f"{self.fit_restarts} fresh L-BFGS-B runs): the estimated loss is not smooth enough here "
                        "for L-BFGS-B, and the hyperparameters may be short of the optimum; more probes "
                        "(EstimatorSettings(num_probes=...)) or precond='auto' smooth it", NumericalWarning,
                        stacklevel=3)
                    return mll
                last = estimate.value
                self.fit_restarts += 1

    def _gradient_at_noise(self, mll: gpytorch.mlls.MarginalLogLikelihood, hook: PreconditionerHook,
                           bounds: dict[str, Any]) -> bool:
        """One evaluation of ``mll``'s loss and gradient at the current hyperparameters (train mode, as the fit
        evaluates), and :func:`~gpnys.gp.estimator.gradient_at_noise` on it; the training mode is restored. Where
        the gradient is above its noise, a constant mean then takes Newton's step (:meth:`_constant_mean_step`) from
        this evaluation's gradient, before the next L-BFGS-B run."""
        mode = mll.training
        mll.train()
        mll.zero_grad()
        try:
            model = mll.model
            (-mll(model(*model.train_inputs), model.train_targets).sum()).backward()
            # gpnys's estimator did not run (another mll, a passed-through kernel), or gave no error bars (GPyTorch's
            # estimator, a jittered Cholesky): nothing to test against, and L-BFGS-B's own stop stands
            if hook.last_estimate is None or math.isnan(hook.last_estimate.std_error):
                return True
            at_noise = gradient_at_noise(self, hook.last_estimate, bounds=bounds)
            if not at_noise:
                self._constant_mean_step(hook.last_estimate)
            return at_noise
        finally:
            mll.zero_grad()
            mll.train(mode)

    def _constant_mean_step(self, estimate: Any) -> None:
        """Newton's step on a ``ConstantMean``'s constant (without a constraint or prior), from the gradient just
        computed: the loss is quadratic in it, ``L(c) = L + g (c' - c) + ½ H (c' - c)²`` with
        ``H = 1ᵀK̂⁻¹1`` (``estimate.mean_curvature``), so ``c - g / H`` is its exact optimum at the other
        hyperparameters. The constant has no probe noise, but L-BFGS-B moves it with the others, whose noisy
        gradients can stall it: a fit ended 19 nats short with only the constant 2.5 off its optimum."""
        mean = self.mean_module
        if (type(mean) is not gpytorch.means.ConstantMean or getattr(mean, "raw_constant_constraint", None)
                is not None or any(True for _ in mean.named_priors())):
            return
        H = estimate.mean_curvature.get("mean_module.raw_constant")
        p = mean.raw_constant
        if H is None or p.grad is None:
            return
        H = H.reshape(p.shape).to(p)
        with torch.no_grad():
            n = self.train_targets.shape[-1]  # the gradient is of the loss per point (each output's, for m)
            p.sub_(torch.where(H > 0, p.grad * n / H.clamp_min(torch.finfo(H.dtype).tiny), 0.0))

    def _cholesky_after_timing(self, mll: gpytorch.mlls.MarginalLogLikelihood) -> bool:
        """Whether the fit turns to Cholesky after timing this model's loss on the preconditioned path. With
        ``max_cholesky_size=None`` under ``auto`` the cost model chose that path before any evaluation, from its
        calibration alone: its preconditioned cost can be far from this model's, and a GPU's latency inflates its
        Cholesky cubic. Near the switch (:func:`gpnys.gp.path.near_switch`), once per size and on one process, it
        decides again with this model's time (the faster of two evaluations: the first holds one-off costs) and
        Cholesky measured at this size (:func:`gpnys.gp.path.choose_path`, ``measure``; docs/bo.md)."""
        c = self._gpnys_config
        if c["max_cholesky_size"] is not None or not uses_costs(c["solver"], c["precond"]) or self._gpnys_path is None:
            return False
        key, path, _ = self._gpnys_path
        if (path != "iterative" or getattr(self, "_gpnys_timed", None) == key
                or type(mll) is not gpytorch.mlls.ExactMarginalLogLikelihood):
            return False
        n, outputs, device, dtype, _ = key
        if self.hook().paths.partitioned or not near_switch(n, device, dtype):
            return False  # ranks must not decide apart; far from the switch no evaluation is spent on it
        params = [p for p in mll.parameters() if p.requires_grad]
        mll.train()  # as BoTorch's fit: the training marginal, not the posterior
        times = []
        with self.preconditioned(), torch.enable_grad():
            for _ in range(2):
                synchronize(device)
                t0 = time.perf_counter()
                try:
                    loss = get_loss_closure(mll)().sum()
                except HyperparameterError:  # start values where the loss is undefined: the fit's recovery decides
                    return False
                torch.autograd.grad(loss, params, allow_unused=True)
                synchronize(device)
                times.append(time.perf_counter() - t0)
        self._gpnys_timed = key
        seconds, batch = min(times), max(outputs, 1)
        path, reason = choose_path(n, batch, device, dtype, "auto", "auto", current="iterative",
                                   iterative_scale=measured_scale(seconds, n, batch, device, dtype), measure=True)
        self._gpnys_path = (key, path, f"{reason}; after timing the preconditioned path at {seconds:.3g} s")
        self.path_reason = self._gpnys_path[2]
        return path == "cholesky"

    def _fit_on_subset(self, mll: gpytorch.mlls.MarginalLogLikelihood, kwargs: dict[str, Any]) -> None:
        """Start values for the full-data fit: ``_fit_fallback`` on ``fit_subset`` seeded random training points
        (a copy of this model, Cholesky path); its kernel, mean and likelihood parameters are copied back."""
        m, n = self._gpnys_config["fit_subset"], self.train_targets.shape[-1]
        if m is None or n <= m or type(mll) is not gpytorch.mlls.ExactMarginalLogLikelihood:
            return
        with self._without_caches():
            sub = copy.deepcopy(self)
        sub.train()  # original (untransformed) inputs, as BoTorch trains
        g = torch.Generator().manual_seed(self._gpnys_config["seed"])
        idx = torch.randperm(n, generator=g)[:m].sort().values.to(self.train_targets.device)
        sub.set_train_data(sub.train_inputs[0][..., idx, :], sub.train_targets[..., idx], strict=False)
        if self._known_noise():  # the subset's own known noise (a FixedNoiseGaussianLikelihood has no state to copy)
            sub.likelihood.noise = self.likelihood.noise[..., idx]
        sub._gpnys_config = {**sub._gpnys_config, "max_cholesky_size": m}
        _fit_fallback(gpytorch.mlls.ExactMarginalLogLikelihood(sub.likelihood, sub), **kwargs)
        for name in ("covar_module", "mean_module", "likelihood"):
            getattr(self, name).load_state_dict(getattr(sub, name).state_dict())

    # -- posterior ----------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.training or len(args) != 1 or kwargs or gpytorch.settings.prior_mode.on() or args[0].dim() < 2:
            return super().__call__(*args, **kwargs)
        if vars(self).get("_gpnys_exact_fantasy"):  # conditioned with noise= on a learnt noise (its fantasy caches)
            with gpytorch.settings.max_cholesky_size(self.train_inputs[0].shape[-2]):
                return super().__call__(*args, **kwargs)
        if self._outputs() > 1 and self._handled():  # at every size (:meth:`_output_posterior`)
            return self._output_posterior(args[0])
        if not self.uses_preconditioner():
            return super().__call__(*args, **kwargs)
        if self.posterior_exact():  # BoTorch's exact path (module docstring)
            with gpytorch.settings.max_cholesky_size(self.train_inputs[0].shape[-2]):
                return super().__call__(*args, **kwargs)
        try:
            return self._preconditioned_posterior(args[0])
        except PosteriorSolveError as failure:
            self._solve_failed(failure)
            with gpytorch.settings.max_cholesky_size(self.train_inputs[0].shape[-2]):
                return super().__call__(*args, **kwargs)

    def _solve_failed(self, failure: PosteriorSolveError) -> None:
        """After a failed PCG posterior solve (e.g. float32 at BoTorch's noise floor, where PCG's answer would be
        wrong): the posteriors take BoTorch's exact path while the data and hyperparameters stay as they are (one
        warning), where its factor fits the memory budget; else :class:`PosteriorSolveError`."""
        X = self.train_inputs[0]
        n = X.shape[-2]
        fits, why = cholesky_fits(n, 1, X.device, X.dtype, POSTERIOR_MATRICES)
        if not fits:
            hint = ": use float64 (model.double())" if X.dtype != torch.float64 else ""
            raise PosteriorSolveError(f"{failure}, and BoTorch's exact path does not fit either ({why}){hint}") \
                from None
        self._gpnys_posterior_failed = (self._state(), f"{failure}: BoTorch's exact path")
        warnings.warn(f"PreconditionedSingleTaskGP: {failure}; the posteriors at these data and hyperparameters "
                      "take BoTorch's exact Cholesky path", NumericalWarning, stacklevel=3)

    def posterior_exact(self) -> bool:
        """Whether a posterior above ``max_cholesky_size`` takes BoTorch's exact path (one Cholesky of ``K̂``) rather
        than PCG solves: up to an integer ``posterior_cholesky_size``, else where
        :func:`gpnys.gp.path.cholesky_fits` finds the memory budget enough, decided once per size, device and dtype
        so that the posteriors of one acquisition optimisation do not switch path as the free memory moves. The
        reason is in ``posterior_path_reason``."""
        failed = self._gpnys_posterior_failed
        if failed is not None and _same_state(failed[0], self._state()):  # a PCG solve failed here (_solve_failed)
            self.posterior_path_reason = failed[1]
            return True
        X, limit = self.train_inputs[0], self._gpnys_config["posterior_cholesky_size"]
        n = X.shape[-2]
        if limit is not None:
            self.posterior_path_reason = f"{n} points {'<=' if n <= limit else '>'} posterior_cholesky_size={limit}"
            return n <= limit
        key = (n, self._outputs(), X.device, X.dtype)
        if self._gpnys_posterior_path is None or self._gpnys_posterior_path[0] != key:
            self._gpnys_posterior_path = (key, *cholesky_fits(n, max(self._outputs(), 1), X.device, X.dtype,
                                                              POSTERIOR_MATRICES))
        _, exact, self.posterior_path_reason = self._gpnys_posterior_path
        return exact

    def _tolerance(self, dtype: torch.dtype, power: int = 1) -> float:
        return max(self._gpnys_config["posterior_tolerance"] ** power, 1000 * torch.finfo(dtype).eps)

    def _posterior_solves(self, X: torch.Tensor) -> PCGPosterior:
        """The :class:`~gpnys.gp.posterior.PCGPosterior` of the posterior system (its own preconditioner,
        :data:`BO_DEFAULTS` ``["posterior"]``), kept across calls for its cached ``α`` and warm block."""
        hook = self.hook()  # the system on the inputs the kernel sees (its active_dims applied)
        A, M = hook.system(hook.problem.inputs(), self._options("posterior", X.shape[0]))
        if self._gpnys_posterior is None:
            self._gpnys_posterior = PCGPosterior(A, M, self._gpnys_config["settings"].max_cg_iterations)
            self._gpnys_column_tol = {}
        return self._gpnys_posterior.update(A, M)

    def _alpha(self, X: torch.Tensor, post: PCGPosterior) -> torch.Tensor:
        """``α = K̂⁻¹ (y − m(X))`` ``(n,)``, cached on the data, the mean module, the values of the parameters and
        buffers, and the known noise tensor (``post`` is made anew with the hook: new kernel modules or settings)."""
        y, known = self.train_targets, self._known_noise_tensor()
        # the tensors by memory and version (held: a replacement cannot reuse their memory); known noise so too, as
        # its n values would cost a host copy per posterior
        key = (TensorKey(X), TensorKey(y), tuple(self.mean_module.modules()), tuple(self._values(X).tolist()),
               None if known is None else TensorKey(known))
        with torch.no_grad():
            r = self.train_targets - self.mean_module(X)
            # the start: the hook's last training solve (same data; after a fit, at these hyperparameters; a new hook
            # starts with warm_start_from's seed), else P̂⁻¹ r
            # (the hook _posterior_solves has just brought up to date: no second look at the settings)
            res = post.mean_weights(r, key, self._tolerance(X.dtype, 2), start=self._gpnys_hook.problem.warm_start)
            _check_solve(res, self._tolerance(X.dtype), "mean weights")  # α runs tighter than the covariance needs
            alpha = res.x[:, 0]
        self.alpha_iterations = post.mean_iterations
        return alpha

    def _pcg_columns(self, *xs: torch.Tensor) -> list[_Columns]:
        """The PCG posterior's pieces at each point set ``x (*b, q, d)`` (input-transformed), from one PCG solve of
        all their columns (:class:`_Columns`)."""
        for x in xs:
            finite = torch.isfinite(x).all(-1)
            if not bool(finite.all()):
                raise ValueError(f"X: the test inputs have NaN or inf entries ({int((~finite).sum())} of "
                                 f"{finite.numel()} points); the PCG posterior needs finite points")
        X = self.train_inputs[0]
        post = self._posterior_solves(X)
        alpha = self._alpha(X, post)
        n = X.shape[0]
        Ks = [self.covar_module(X, x).to_dense() for x in xs]
        with torch.no_grad():  # one solve: its cost is mostly the products with K̂, whatever the column count
            R = torch.cat([K.detach().movedim(-2, 0).reshape(n, -1) for K in Ks], dim=1)
            prior = torch.cat([self.covar_module(x, diag=True).detach().reshape(-1) for x in xs]).to(R)
            B, KB = self._column_solves(post, R, prior)
        out, start = [], 0
        for x, K in zip(xs, Ks):
            stop = start + K[..., 0, :].numel()
            Bx, KBx = (T[:, start:stop].reshape(n, *K.shape[:-2], K.shape[-1]).movedim(0, -2) for T in (B, KB))
            out.append(_Columns(x, self.mean_module(x) + (K.mT @ alpha[:, None]).squeeze(-1), K, Bx, KBx))
            start = stop
        return out

    def _column_solves(self, post: PCGPosterior, R: torch.Tensor,
                       prior: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, K̂B)`` for the kernel columns ``R = K(X, x) (n, t)`` (``prior`` ``(t,)``: ``k(x, x)``): PCG to
        ``posterior_tolerance``, then each column on until its variance and that variance's gradient are within
        ``rtol = posterior_variance_rtol``.

        * The variational variance ``v = k(x, x) − (2 rᵀb − bᵀK̂b)`` is off by ``ρᵀK̂⁻¹ρ ≤ ‖ρ‖² / min σ²`` (``ρ`` the
          column's true residual; ``λ_min(K̂) ≥ min σ²``): a bound, to be at most ``rtol · v``.
        * Its gradient w.r.t. ``x`` (``b`` held fixed) is off by ``2 ∂rᵀe``, first order in the solution's error
          ``e = b − K̂⁻¹r``, whose estimate ``‖P̂⁻¹ρ‖`` (one preconditioner solve; within 0.7–1.5 of ``‖e‖`` where
          measured, while ``‖ρ‖ / min σ²`` was up to 60 times ``‖e‖``) is to be at most ``rtol ‖b‖``.

        A column that misses either is solved again from its ``b``, to the relative residual that scales its miss
        down to a quarter (half, for the gradient's first-order error), at most :data:`VARIANCE_ROUNDS` times, not
        below what the dtype can reach, ``2 u ‖K̂|b|‖ / ‖r‖`` (``u`` the unit roundoff). The rounding of the
        products and of ``v`` itself adds about ``u (k(x, x) + 2 |r|ᵀ|b| + 2 |b|ᵀK̂|b|)`` to ``v``'s error, which no
        solve removes (float32 at a small noise). ``posterior_variance_error`` is the largest
        (bound + rounding) / ``v``; a miss of ``rtol`` (in it or in the gradient's estimate) gets one
        :class:`~gpnys.checks.NumericalWarning` per model."""
        tol = self._tolerance(R.dtype)
        rtol = self._gpnys_config["posterior_variance_rtol"]
        last = self._gpnys_column_tol.get(R.shape) if rtol is not None else None
        with warnings.catch_warnings():  # with the check below, a column short of its tolerance shows there
            if rtol is not None:
                warnings.simplefilter("ignore", ConvergenceWarning)
            res = post.solve(R, tol if last is None else last.clamp_max(tol))
        _check_solve(res, tol, "posterior")
        self.posterior_iterations = post.iterations
        B, rho = res.x, res.residual
        if rtol is None:
            self.posterior_variance_error = self.posterior_gradient_error = None
            return B, R - rho
        noise = self._gpnys_hook.problem.noise()  # the hook _posterior_solves brought up to date
        floor = max(float(noise.detach().min()), torch.finfo(R.dtype).tiny)  # λ_min(K̂) >= σ²
        tiny, u = torch.finfo(R.dtype).tiny, torch.finfo(R.dtype).eps / 2
        norm = torch.linalg.vector_norm(R, dim=0).clamp_min(tiny)
        rounding = reach = None
        for step in range(VARIANCE_ROUNDS + 1):
            v = prior - (2 * R * B - B * (R - rho)).sum(0)
            bound = rho.square().sum(0) / floor  # >= v's error
            e = torch.linalg.vector_norm(post.M(rho), dim=0)  # ≈ ‖b − K̂⁻¹r‖
            b = torch.linalg.vector_norm(B, dim=0)
            cheap = u * (prior + 2 * (R.abs() * B.abs()).sum(0))
            over = (bound > rtol * v.clamp_min(0)) | (e > rtol * b)
            if rounding is None and bool((cheap > VARIANCE_ROUNDING * rtol * v).any() | over.any()):
                KaB = post.A(B.abs())  # the products' rounding (one product), where it may matter
                rounding = cheap + 2 * u * (B.abs() * KaB).sum(0)
                reach = 2 * u * torch.linalg.vector_norm(KaB, dim=0) / norm
            # the relative residual that brings each column to a quarter of its allowances
            rel = torch.linalg.vector_norm(rho, dim=0) / norm
            want = torch.minimum(torch.sqrt(rtol * v.clamp_min(0) * floor) / (2 * norm),
                                 rel * rtol * b / (2 * e).clamp_min(tiny))
            want = (want if reach is None else torch.maximum(want, reach)).clamp_min(torch.finfo(R.dtype).eps)
            if step == VARIANCE_ROUNDS or not bool(over.any()):
                break
            over &= want < rel  # the columns that can still gain
            if not bool(over.any()):
                break
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                res = post.solve(R, torch.where(over, want, 1.0).to(torch.float64))
            self.posterior_iterations += post.iterations
            better = res.residual.square().sum(0) <= rho.square().sum(0)  # a stalled column keeps its better b
            B, rho = torch.where(better, res.x, B), torch.where(better, res.residual, rho)
        # the next block of this shape (an acquisition optimiser's next step) is solved to what these columns need
        self._gpnys_column_tol[R.shape] = want.to(torch.float64)
        error = torch.where(v > 0, (bound + (0 if rounding is None else rounding)) / v, torch.inf)
        self.posterior_variance_error = worst = float(error.max()) if error.numel() else 0.0
        gradient = float((e / b.clamp_min(tiny)).max()) if e.numel() else 0.0
        self.posterior_gradient_error = gradient
        if max(worst, gradient) > rtol and not self._gpnys_accuracy_warned[0]:
            self._gpnys_accuracy_warned[0] = True
            remedy = ("use float64 (model.double())" if R.dtype != torch.float64 else
                      "a stronger posterior preconditioner (posterior_options) or BoTorch's exact path "
                      "(posterior_cholesky_size) would help")
            warnings.warn(f"PreconditionedSingleTaskGP: the PCG posterior variances are accurate to {worst:.2g} "
                          f"relative (a bound on the solve's error and an estimate of {R.dtype}'s rounding), their "
                          f"gradients' solves to {gradient:.2g} (an estimate), against posterior_variance_rtol="
                          f"{rtol:g}; {remedy}. Said once per model; posterior_variance_error holds each posterior's "
                          "bound", NumericalWarning, stacklevel=4)
        return B, R - rho

    def _pcg_covariance(self, a: _Columns, b: _Columns) -> torch.Tensor:
        """The posterior covariance ``K(x_a, x_b) − K*_aᵀ K̂⁻¹ K*_b`` of two :meth:`_pcg_columns` (batch shapes
        broadcast), the second term in the variational form ``K*_aᵀ B_b + B_aᵀ K*_b − B_aᵀ K̂ B_b``: second order in
        the solves' errors, and its gradient w.r.t. both point sets exact to first order."""
        cross = a.K.mT @ b.B + a.B.mT @ b.K - a.B.mT @ b.KB
        return self.covar_module(a.x, b.x).to_dense() - cross

    def _preconditioned_posterior(self, x: torch.Tensor) -> MultivariateNormal:
        """Latent posterior at ``x (*b, q, d)`` (already input-transformed): mean ``(*b, q)``, covariance
        ``(*b, q, q)`` (module docstring)."""
        (cols,) = self._pcg_columns(x)
        cov = self._pcg_covariance(cols, cols)
        return latent_mvn(cols.mean, cov)

    def _output_posterior(self, x: torch.Tensor) -> MultivariateNormal:
        """``m`` outputs: the latent posterior at ``x (*b, 1 | m, q, d)`` (input-transformed, with BoTorch's output
        dimension), mean ``(*b, m, q)`` and covariance ``(*b, m, q, q)``, one posterior per output
        (:meth:`_output_models`; each by PCG, or by Cholesky below ``max_cholesky_size`` and where
        :meth:`posterior_exact` says the ``m`` factors fit). At every size: GPyTorch's batched exact path, which
        ``SingleTaskGP`` takes, broadcasts its ``(m, n, n)`` cache over the batch of ``x``, e.g. 51 GB for BoTorch's
        128 raw samples at ``n = 5000`` (docs/bo.md, "Multiple outputs")."""
        x = x if x.dim() > 2 else x.unsqueeze(-3)
        models = self._output_models()
        if x.shape[-3] not in (1, len(models)):  # (GPyTorch's batched model would not broadcast it either)
            raise ValueError(f"x: expected (*batch, 1 or {len(models)}, q, d) for {len(models)} outputs, got "
                             f"{tuple(x.shape)}")
        parts = [model(x[..., min(i, x.shape[-3] - 1), :, :]) for i, model in enumerate(models)]
        for name in ("posterior_variance_error", "posterior_gradient_error"):
            errors = [getattr(model, name) for model in models]
            setattr(self, name, None if None in errors else max(errors))
        return latent_mvn(torch.stack([p.mean for p in parts], dim=-2),
                          torch.stack([p.covariance_matrix for p in parts], dim=-3))

    def _output_models(self) -> list["PreconditionedSingleTaskGP"]:
        """``m`` outputs: one single-output model per output for the posterior, on the kernel inputs and the
        outcome-transformed targets: that output's kernel (a copy, :func:`~gpnys.kernels.entries.batch_element`),
        this model's mean module taken at that output (:class:`_OutputMean`) and its noise. Remade when the data or
        hyperparameters change (their first ``α`` starts from the latest solutions, else :meth:`warm_start_from`'s),
        kept otherwise for their caches (``α``, preconditioner, warm blocks, Cholesky factor), until the kernel or
        mean modules or their settings (:meth:`_settings`) change or :meth:`train` drops them. Their posteriors'
        gradients reach the inputs, not this model's hyperparameters (BoTorch's acquisitions need the former)."""
        state, modules = self._state(), self._kernel_modules() + tuple(self.mean_module.modules())
        settings = self._settings()
        if (self._gpnys_outputs is not None and _same_state(self._gpnys_outputs[0][0], state)
                and same_objects(self._gpnys_outputs[0][1], modules) and self._gpnys_outputs[0][2] == settings):
            return self._gpnys_outputs[1]
        X, Y, c = self._kernel_inputs(), self.train_targets.detach(), self._gpnys_config
        m, known = X.shape[0], self._known_noise()
        noise = self.likelihood.noise.detach()
        noise = noise if known else noise.expand(m, noise.shape[-1])  # (m, n); (m, 1), also from a shared noise
        seeds = self._solution()
        seeds = self._gpnys_seed if seeds is None else seeds
        # each model's posterior_cholesky_size, all or none: exact below the threshold (a SingleTaskGP's answer)
        # and where the m factors fit the budget
        exact = X.shape[-2] if not self.uses_preconditioner() or self.posterior_exact() else 0
        models = []
        for i in range(m):
            likelihood = None if known else GaussianLikelihood(
                noise_constraint=copy.deepcopy(self.likelihood.noise_covar.raw_noise_constraint))
            model = PreconditionedSingleTaskGP(
                X[i], Y[i, :, None], noise[i, :, None] if known else None, likelihood,
                batch_element(self.covar_module, i), _OutputMean(self.mean_module, i, m), outcome_transform=None,
                precond=c["precond"], max_cholesky_size=0, settings=c["settings"], seed=c["seed"],
                posterior_tolerance=c["posterior_tolerance"], posterior_variance_rtol=c["posterior_variance_rtol"],
                posterior_options=c["posterior_options"],
                posterior_cholesky_size=exact, fit_subset=None, **c["options"])
            if not known:
                model.likelihood.noise = noise[i]
            model._gpnys_seed = None if seeds is None else seeds[i]
            model._gpnys_accuracy_warned = self._gpnys_accuracy_warned  # one warning for the m outputs
            models.append(model.eval())
        self._gpnys_outputs = ((state, modules, settings), models)
        return models

    def subset_output(self, idcs: list[int]) -> "PreconditionedSingleTaskGP":
        """BoTorch's ``subset_output`` (a copy with the outputs ``idcs``), made without this model's caches (the hook,
        solves and output models are rebuilt for the subset on first use; sparse factors cannot be deep-copied)."""
        with self._without_caches():
            new = super().subset_output(idcs)
        seed = self._gpnys_seed  # the warm start of each kept output, in the subset's order
        if seed is not None and seed.dim() == 2 and self._outputs() > 1:
            seed = seed[idcs]
            new._gpnys_seed = seed[0] if len(idcs) == 1 else seed
        return new

    @property
    def output_models(self) -> list["PreconditionedSingleTaskGP"]:
        """``m`` outputs on the preconditioned path: the single-output models whose posteriors it stacks, for
        diagnostics (``posterior_iterations``, ``hook().history``); empty before the first such posterior.

        Example:
            >>> import torch
            >>> from gpnys.bo import PreconditionedSingleTaskGP
            >>> X = torch.rand(120, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            >>> Y = torch.stack([X.sum(-1).sin(), X.prod(-1)], -1)  # two outputs
            >>> gp = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=50, posterior_cholesky_size=0)
            >>> with torch.no_grad():
            ...     gp.posterior(X[:4]).mean.shape
            torch.Size([4, 2])
            >>> len(gp.output_models), gp.output_models[0].train_targets.shape
            (2, torch.Size([120]))
        """
        return [] if self._gpnys_outputs is None else list(self._gpnys_outputs[1])

    # -- conditioning -------------------------------------------------------------------------------------
    def condition_on_observations(self, X: torch.Tensor, Y: torch.Tensor, **kwargs: Any) -> "SingleTaskGP":
        """BoTorch's ``condition_on_observations`` (module docstring).

        Above ``max_cholesky_size``, one batch ``(X (q, d), Y (q, 1))`` gives a new model of this class with the data
        appended. At any size, batched ``X (*b, q, d)`` / ``Y (*f, *b, q, 1)`` (``fantasize``), one batch with
        ``noise=`` on a learnt noise (one output), or any conditioning of a fantasy model, give a
        :class:`PreconditionedFantasyGP` of ``batch_shape`` ``(*f, *b)``: the same
        modules, its posteriors conditioned on the points without an ``(n + q) x (n + q)`` factorisation
        (:func:`gpnys.bo.fantasy.condition_joint`). Their noise variances are ``noise (*b, q, 1)`` in the
        outcome-transformed scale, as BoTorch takes them (required with known noise), else the learnt noise. (With
        ``noise=`` on a learnt noise, ``SingleTaskGP``'s conditioned means take the learnt noise at the new points,
        GPyTorch's fantasy update, and its variances the given one; these posteriors hold the given noise in both.)

        Example:
            >>> import torch
            >>> from botorch.sampling import SobolQMCNormalSampler
            >>> from gpnys.bo import PreconditionedSingleTaskGP
            >>> X = torch.rand(80, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            >>> gp = PreconditionedSingleTaskGP(X, X.sum(-1, keepdim=True).sin(), max_cholesky_size=40)
            >>> fantasy = gp.fantasize(X[:3] + 0.01, SobolQMCNormalSampler(torch.Size([8]), seed=0))
            >>> fantasy.batch_shape, fantasy.posterior(X[:5]).mean.shape
            (torch.Size([8]), torch.Size([8, 5, 1]))
        """
        if self._fantasy_applies(X, Y, kwargs):
            return self._fantasy(X, Y, kwargs.get("noise"))
        # known noise needs the new points' noise (BoTorch's ``noise=``): BoTorch's own path appends both
        if (not self.uses_preconditioner() or X.dim() != 2 or Y.dim() != 2 or kwargs or self._known_noise()
                or self._outputs() > 1):
            with self._without_caches():  # GPyTorch deep-copies the model (sparse CSR factors cannot be copied)
                self._prediction_caches()
                new = super().condition_on_observations(X, Y, **kwargs)
            new._gpnys_warned = True  # a model of this documented path: no "not preconditioned" warning
            if kwargs.get("noise") is not None and not self._known_noise():
                # m outputs: the given noise lives only in GPyTorch's fantasy caches (the likelihood's noise is
                # learnt, one value): the new model predicts from them until train(), by GPyTorch's exact path
                new._gpnys_exact_fantasy = True
                warnings.warn("PreconditionedSingleTaskGP.condition_on_observations: noise= on a model of "
                              f"{self._outputs()} outputs whose noise is learnt takes GPyTorch's fantasy update, as "
                              "SingleTaskGP does: its means give the new points the learnt noise (its variances the "
                              "given one). Condition each output alone (subset_output) for posteriors that hold the "
                              "given noise throughout", NumericalWarning, stacklevel=2)
            return new
        self.eval()
        X_tf = self.transform_inputs(X)
        if hasattr(self, "outcome_transform"):
            Y, _ = self.outcome_transform(Y, X=X_tf)
        self._validate_tensor_args(X=X_tf, Y=Y, strict=False)
        with self._without_caches():
            new = copy.deepcopy(self)
        new.set_train_data(torch.cat([self.train_inputs[0], X_tf.detach()]),
                           torch.cat([self.train_targets, Y.detach().squeeze(-1)]), strict=False)
        if hasattr(self, "input_transform"):
            new._original_train_inputs = torch.cat([self._original_train_inputs, X.detach()])
        new.warm_start_from(self)  # its solves start from this model's K̂⁻¹ (y - m) (same hyperparameters)
        new._gpnys_warm_fit = False  # a refit of the new model starts as usual
        return new

    def get_fantasy_model(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs: Any) -> "SingleTaskGP":
        """GPyTorch's ``get_fantasy_model`` (``inputs (*b, q, d)`` and ``targets (*b, q)`` in the model's transformed
        space): a copy of this model with the points appended and GPyTorch's fantasy update of its caches, which
        are built first where this model's posterior does not build them (its PCG path).

        Example:
            >>> import torch
            >>> from gpnys.bo import PreconditionedSingleTaskGP
            >>> X = torch.rand(80, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            >>> gp = PreconditionedSingleTaskGP(X, X.sum(-1, keepdim=True).sin(), outcome_transform=None,
            ...                                 max_cholesky_size=40, posterior_cholesky_size=0).eval()
            >>> new = gp.get_fantasy_model(X[:3] + 0.01, torch.zeros(3, dtype=torch.float64))
            >>> new.train_inputs[0].shape
            torch.Size([83, 2])
        """
        with self._without_caches():
            self._prediction_caches()
            new = super().get_fantasy_model(inputs, targets, **kwargs)
        new._gpnys_warned = True
        return new

    def _prediction_caches(self) -> None:
        """Build GPyTorch's ``prediction_strategy`` (CG / Lanczos above its ``max_cholesky_size``), which its fantasy
        updates need and this model's PCG posterior does not build."""
        if self.prediction_strategy is None:
            with torch.no_grad():
                gpytorch.models.ExactGP.__call__(self.eval(), self.train_inputs[0][..., :1, :])

    def _fantasy_applies(self, X: torch.Tensor, Y: torch.Tensor, kwargs: dict[str, Any]) -> bool:
        """Whether :meth:`condition_on_observations` returns a fantasy model (its docstring): batched points or a
        fantasy model, a model gpnys handles at any size, no keywords but ``noise`` (required with known noise)."""
        # one set of points is appended to a new model of this class, unless it comes with noise= on a learnt noise
        # (the likelihood holds one noise for all points: a fantasy model holds the given one)
        plain = X.dim() == 2 and Y.dim() == 2 and (kwargs.get("noise") is None or self._known_noise())
        if self._gpnys_fantasy is None and (plain or not self._handled() or self._outputs() > 1):
            return False
        if set(kwargs) - {"noise"}:
            if self._gpnys_fantasy is not None:
                raise ValueError(f"condition_on_observations of a fantasy model takes only noise=, got "
                                 f"{sorted(kwargs)}")
            return False
        if self._base()._known_noise() and kwargs.get("noise") is None:
            raise ValueError("noise: known per-point noise (train_Yvar) needs the new points' noise variances")
        return True

    def _fantasy(self, X: torch.Tensor, Y: torch.Tensor, noise: torch.Tensor | None) -> "PreconditionedSingleTaskGP":
        """A fantasy model (:meth:`condition_on_observations`): a shallow copy sharing this model's modules, with
        the points ``(X_q (*f, *b, q, d)`` input-transformed, ``y_q``, ``s (*f, *b, q))`` outcome-transformed,
        appended to those it already holds, and the model it conditions (whose caches its posteriors use)."""
        self.eval()
        if X.dim() < 2:
            raise ValueError(f"X: expected (*batch, q, d), got {tuple(X.shape)}")
        if Y.dim() < 2 or Y.shape[-1] != 1 or Y.shape[-2] != X.shape[-2]:
            raise ValueError(f"Y: expected (*batch, q, 1) with q = X.shape[-2] = {X.shape[-2]}, got {tuple(Y.shape)}")
        if self._gpnys_fantasy is not None:
            self._check_base()
        base = self._base()
        d = base.train_inputs[0].shape[-1]
        if X.shape[-1] != d:
            raise ValueError(f"X: expected {d} columns, got {X.shape[-1]}")
        for name, value in (("X", X), ("Y", Y), ("noise", noise)):
            if value is not None and not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name} has NaN or inf entries")
        X_tf = self.transform_inputs(X)
        if hasattr(self, "outcome_transform"):  # noise is in the transformed scale already, as BoTorch takes it
            Y, _ = self.outcome_transform(Y, X=X_tf)
        y = Y.squeeze(-1)
        s = self.likelihood.noise if noise is None else noise.squeeze(-1)
        if noise is not None and bool((noise < 0).any()):
            raise ValueError("noise must be non-negative")
        s = s.expand(*s.shape[:-1], y.shape[-1])
        held = [] if self._gpnys_fantasy is None else [self._gpnys_fantasy[1:]]  # a fantasy of a fantasy: both sets
        batch = torch.broadcast_shapes(X_tf.shape[:-2], y.shape[:-1], s.shape[:-1], *(h[1].shape[:-1] for h in held))

        def spread(T: torch.Tensor, event: int) -> torch.Tensor:  # (..., *event) -> (*batch, *event)
            return T.expand(*batch, *T.shape[T.dim() - event:])

        # (a single set stays an expanded view: _fantasy_posterior solves X_q's columns once per distinct point)
        Xq, yq, sq = (torch.cat([spread(T, 2 - (i > 0)) for T in parts], dim=-1 - (i == 0)) if len(parts) > 1
                      else spread(parts[0], 2 - (i > 0)) for i, parts in enumerate(zip(*held, (X_tf, y, s))))
        new = PreconditionedFantasyGP.__new__(PreconditionedFantasyGP)
        new.__dict__.update(self.__dict__)  # a shallow copy: the modules are shared, a fantasy never trains
        new._gpnys_fantasy = (base, Xq, yq, sq)
        new._gpnys_fantasy_state = self._gpnys_fantasy_state if self._gpnys_fantasy is not None else self._state()
        new._input_batch_shape = new._aug_batch_shape = batch
        return new

    def _base(self) -> "PreconditionedSingleTaskGP":
        """The model whose data a fantasy model conditions (this model, where it is not a fantasy model)."""
        return self if self._gpnys_fantasy is None else self._gpnys_fantasy[0]

    def _values(self, like: torch.Tensor) -> torch.Tensor:
        """Every floating-point parameter and buffer (hyperparameters, constraint bounds, transform statistics),
        flattened into one tensor of ``like``'s dtype and device, detached."""
        return torch.cat([t.detach().reshape(-1).to(like) for t in self.state_dict().values() if t.is_floating_point()])

    def _known_noise_tensor(self) -> torch.Tensor | None:
        """A ``FixedNoiseGaussianLikelihood``'s noise (a plain tensor, outside the ``state_dict``), else ``None``."""
        lik = self.likelihood
        return lik.noise_covar.noise if isinstance(lik, FixedNoiseGaussianLikelihood) else None

    def _state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a fantasy model of this model depends on: its training inputs and targets (as its posterior sees
        them) and a copy of :meth:`_values` and the known noise (hyperparameters, transform statistics)."""
        X, known = self.train_inputs[0], self._known_noise_tensor()
        values = self._values(X) if known is None else torch.cat([self._values(X), known.detach().reshape(-1).to(X)])
        return X, self.train_targets, values.clone()

    def __getstate__(self) -> dict[str, Any]:
        """The model without its hook, solves and output models (``copy.deepcopy``, ``pickle``, ``torch.save``):
        they hold closures and sparse CSR factors, which neither copies, and are rebuilt on first use."""
        state = super().__getstate__()
        return {**state, **{name: None for name in _CACHES}, "_gpnys_in_use": 0}

    @contextlib.contextmanager
    def _without_caches(self) -> Iterator[None]:
        """Detach the hook and solves while BoTorch or GPyTorch work on the model; restore them afterwards."""
        names = _CACHES
        caches = [getattr(self, name) for name in names]
        self._clear_gpnys_caches()
        try:
            yield
        finally:
            for name, value in zip(names, caches):
                setattr(self, name, value)


class PosteriorSolveError(RuntimeError):
    """The PCG posterior's solves broke down or stalled far above their tolerance (float32 near the noise floor):
    their answer would be wrong. :class:`PreconditionedSingleTaskGP`'s posterior then takes BoTorch's exact path
    where it fits the memory budget (one warning), else raises this."""


#: a posterior solve that ends above this true relative residual (and ten times its tolerance) has failed: a float32
#: solve at BoTorch's noise floor ended at 0.2-0.5. Below it, a solve that missed its tolerance keeps its answer
#: with PCG's own ConvergenceWarning (the covariance's error is second order in the residual)
SOLVE_FAILED = 1e-3


def _check_solve(res: PCGResult, tol: float, what: str) -> None:
    """Raise :class:`PosteriorSolveError` where ``res`` (a posterior solve) ended at a true relative residual above
    ``max(10 tol, SOLVE_FAILED)``, ``tol`` the posterior's tolerance (:meth:`PreconditionedSingleTaskGP._tolerance`):
    broken down or stalled (``K̂`` not numerically positive definite in the working precision)."""
    if res.rel_residual.numel() == 0:  # no columns (a posterior at zero points): nothing was solved
        return
    worst = float(res.rel_residual.max())
    if worst > max(10 * tol, SOLVE_FAILED):
        broke = int(res.breakdown.sum()) if res.breakdown is not None else 0
        raise PosteriorSolveError(f"the PCG {what} solves stalled at a relative residual of {worst:.2g} against "
                                  f"{tol:g} ({res.x.dtype}{f', {broke} broke down' if broke else ''})")


@contextlib.contextmanager
def _finite_loss(mll: gpytorch.mlls.MarginalLogLikelihood) -> Iterator[None]:
    """Within the context, BoTorch's loss for ``mll`` (``get_loss_closure``, which every fit of BoTorch's builds its
    closures from, the m outputs' batched one included, through ``mll.compute_custom_loss``) reads a trial point
    whose hyperparameters leave the loss undefined (:class:`~gpnys.checks.HyperparameterError`: a length-scale
    whose softplus underflowed to 0 on a long L-BFGS-B step) as an infinite loss with a zero gradient, from which
    the line search steps back as from any rise, where the error would have ended the fit. A batch of m outputs
    gets an infinite loss for each (the hook checks them together), as BoTorch's own closure does for a NaN."""
    own = vars(mll).get("compute_custom_loss")
    default = get_loss_closure(mll)

    def loss(**kwargs: Any) -> torch.Tensor:
        try:
            return default(**kwargs)
        except HyperparameterError:
            params = [p for p in mll.parameters() if p.requires_grad]
            zero = sum(p.sum() for p in params) * 0.0  # a graph to the parameters: their gradients are 0
            like = params[0]
            return torch.full(mll.model._aug_batch_shape, math.inf, dtype=like.dtype, device=like.device) + zero

    mll.compute_custom_loss = loss
    try:
        yield
    finally:
        if own is None:
            del mll.compute_custom_loss
        else:
            mll.compute_custom_loss = own


#: the caches of :class:`PreconditionedSingleTaskGP` that a copy of the model leaves behind and ``train()`` drops
_CACHES = ("_gpnys_hook", "_gpnys_hook_x", "_gpnys_hook_kernel", "_gpnys_hook_settings", "_gpnys_posterior",
           "_gpnys_outputs")
#: :func:`_plain`'s answer for a value that is not a plain setting
_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    """``value`` where it is a plain setting (``None``, a bool, int, float or string, or a tuple or list of them,
    ``torch.Size`` included) as a tuple comparable with ``==`` (a NaN as the string ``"nan"``), else
    :data:`_NOT_PLAIN`."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return "nan" if math.isnan(value) else value
    if isinstance(value, (tuple, list)):
        items = tuple(_plain(v) for v in value)
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    return _NOT_PLAIN


def _same_state(before: tuple[torch.Tensor, ...], now: tuple[torch.Tensor, ...]) -> bool:
    """Whether two :meth:`PreconditionedSingleTaskGP._state` tuples are the same data and parameters."""
    return all(a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
               for a, b in zip(before, now))


class _OutputMean(Mean):
    """Output ``index`` of the mean module of BoTorch's ``m``-output model: the module itself (batch shape ``(m,)`` or
    none, any class) evaluated at the inputs repeated over the ``m`` outputs, and its ``index``-th output taken,
    ``(*b, q, d) -> (*b, q)``. (``Mean`` has no slicing of its own, and its parameters need not lead with the batch
    dimension, e.g. ``LinearMean``'s.)"""

    def __init__(self, mean: Mean, index: int, outputs: int) -> None:
        super().__init__()
        self.mean, self.index, self.outputs = mean, index, outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(-3).expand(*x.shape[:-2], self.outputs, *x.shape[-2:])
        return self.mean(x)[..., self.index, :]


class PreconditionedFantasyGP(PreconditionedSingleTaskGP):
    """A :class:`PreconditionedSingleTaskGP` conditioned on fantasy observations, made by its
    ``condition_on_observations`` / ``fantasize``; it predicts, it does not train.

    It holds the base model (whose posterior caches and preconditioner its posteriors reuse) and the points
    ``X_q (*f, *b, q, d)``, ``y_q (*f, *b, q)`` with noise variances ``s``. Its latent posterior at ``X_t`` is the
    base model's joint posterior at ``[X_t, X_q]`` conditioned on ``y_q`` (:func:`gpnys.bo.fantasy.condition_joint`:
    a ``q x q`` Cholesky, never one of ``n + q``), with gradients w.r.t. ``X_t``, ``X_q`` and ``y_q``.
    ``batch_shape`` is ``(*f, *b)``; ``train_inputs`` and ``train_targets`` are the base data with the points
    appended, ``(*f, *b, n + q, d)`` and ``(*f, *b, n + q)``, built when read (as GPyTorch's fantasy models hold
    them).

    Example:
        Four fantasies of the targets at two new points (``Y (f, q, 1)``, in the data's scale):

        >>> import torch
        >>> from gpnys.bo import PreconditionedSingleTaskGP
        >>> X = torch.rand(60, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        >>> gp = PreconditionedSingleTaskGP(X, X.cos().sum(-1, keepdim=True))
        >>> fantasy = gp.condition_on_observations(X[:2] + 0.05, torch.full((4, 2, 1), 2.5, dtype=torch.float64))
        >>> type(fantasy).__name__, fantasy.batch_shape, fantasy.train_targets.shape
        ('PreconditionedFantasyGP', torch.Size([4]), torch.Size([4, 62]))
    """

    _gpnys_fantasy: tuple[PreconditionedSingleTaskGP, torch.Tensor, torch.Tensor, torch.Tensor]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("PreconditionedFantasyGP is made by PreconditionedSingleTaskGP.condition_on_observations "
                        "or fantasize")

    def train(self, mode: bool = True) -> "PreconditionedFantasyGP":
        """``train(False)``: eval mode, as for any model. ``train()`` only marks the fantasy model (its inputs and the
        modules it shares with the base model stay as they are), and calling it in that mode raises."""
        if mode:
            self.training = True
            return self
        return super().train(False)

    def set_train_data(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("a PreconditionedFantasyGP only predicts: its data are the base model's with the "
                                  "conditioned points appended; set the data of the model it was conditioned from")

    def __call__(self, *args: Any, **kwargs: Any) -> MultivariateNormal:
        if self.training or len(args) != 1 or kwargs:
            raise NotImplementedError("a PreconditionedFantasyGP only predicts: call it in eval mode on one input, "
                                      "or use posterior(); fit the model it was conditioned from")
        return self._fantasy_posterior(args[0])

    def _check_base(self) -> None:
        """Raise if the base model's data, hyperparameters or transforms changed since this fantasy model was made
        (its held targets and noise belong to that state; BoTorch's fantasy models are copies frozen there)."""
        base = self._base()
        base.eval()
        if not _same_state(self._gpnys_fantasy_state, base._state()):
            raise RuntimeError("the model this PreconditionedFantasyGP was made from has changed since (data, "
                               "hyperparameters, transforms, device or dtype): call fantasize / "
                               "condition_on_observations on it again")

    def _fantasy_posterior(self, x: torch.Tensor) -> MultivariateNormal:
        """Latent posterior of a fantasy model at ``x (*b, t, d)`` (input-transformed): the base model's joint
        posterior at ``[x, X_q]`` conditioned on ``y_q`` (:func:`gpnys.bo.fantasy.condition_joint`)."""
        self._check_base()
        base, Xq, y, s = self._gpnys_fantasy
        if base.uses_preconditioner() and not base.posterior_exact():
            # PCG: x's columns and X_q's in one solve, X_q without the batch dimensions it is only broadcast along
            # (the fantasies of one qKG point share it), joined in the variational form
            Xq_pcg = Xq[tuple(slice(0, 1) if Xq.stride(i) == 0 else slice(None) for i in range(Xq.dim() - 2))]
            try:
                t, q = base._pcg_columns(x, Xq_pcg)
                return condition_blocks(t.mean, base._pcg_covariance(t, t), q.mean, base._pcg_covariance(t, q),
                                        base._pcg_covariance(q, q), y, s)
            except PosteriorSolveError as failure:
                base._solve_failed(failure)  # then the joint posterior below takes BoTorch's exact path
        batch = torch.broadcast_shapes(x.shape[:-2], y.shape[:-1])
        Z = torch.cat([x.expand(*batch, *x.shape[-2:]), Xq.expand(*batch, *Xq.shape[-2:])], dim=-2)
        return condition_joint(base(Z), x.shape[-2], y, s)

    def _noise_mean(self) -> torch.Tensor:
        """Known noise: the mean of the base model's noise variances and the fantasy points', ``(*f, *b, 1, 1)``, what
        BoTorch takes as the observation noise of a fantasy model's new points (its likelihood holds all ``n + q``)."""
        base, _, _, s = self._gpnys_fantasy
        noise = base.likelihood.noise
        return ((noise.sum(-1) + s.sum(-1)) / (noise.shape[-1] + s.shape[-1]))[..., None, None]

    def _apply_noise(self, X: torch.Tensor, mvn: MultivariateNormal,
                     observation_noise: bool | torch.Tensor = False) -> MultivariateNormal:
        if observation_noise is True and self._base()._known_noise():
            observation_noise = self._noise_mean()
        return super()._apply_noise(X, mvn, observation_noise)

    def fantasize(self, X: torch.Tensor, sampler: Any, observation_noise: torch.Tensor | None = None,
                  **kwargs: Any) -> "PreconditionedFantasyGP":
        if observation_noise is None and self._base()._known_noise():
            observation_noise = self._noise_mean()
        return super().fantasize(X, sampler, observation_noise=observation_noise, **kwargs)

    @property
    def train_inputs(self) -> tuple[torch.Tensor]:
        base, Xq, *_ = self._gpnys_fantasy
        X = base.train_inputs[0]
        return (torch.cat([X.expand(*Xq.shape[:-2], *X.shape), Xq], dim=-2),)

    @property
    def train_targets(self) -> torch.Tensor:
        base, _, y, _ = self._gpnys_fantasy
        return torch.cat([base.train_targets.expand(*y.shape[:-1], -1), y], dim=-1)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "PreconditionedFantasyGP":
        """``.to()`` / ``.double()`` ... where nothing moves (BoTorch's ``acqf.to(X)``) is a no-op; a fantasy model
        cannot move device or dtype by itself (it shares the base model's modules): move the base, fantasize again."""
        for T in self._gpnys_fantasy[1:]:
            moved = fn(T)
            if moved.dtype != T.dtype or moved.device != T.device:
                raise RuntimeError("a PreconditionedFantasyGP cannot change device or dtype: move the model it was "
                                   "made from and call fantasize / condition_on_observations on it again")
        return self

    def custom_fit(self, mll: gpytorch.mlls.MarginalLogLikelihood, **kwargs: Any) -> Any:
        raise NotImplementedError("a PreconditionedFantasyGP does not train: fit the model it was conditioned from")
