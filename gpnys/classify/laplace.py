"""Laplace-approximate GPs with non-Gaussian likelihoods on preconditioned CG: binary classification (Bernoulli,
logistic link), Poisson counts (log link) and robust regression (Student-t noise, with the Fisher information as
``W``), :mod:`gpnys.classify.likelihoods`.

Rasmussen & Williams (2006), "Gaussian Processes for Machine Learning" (R&W), §3.4, Algorithms 3.1 (mode and
approximate log marginal likelihood) and 3.2 (predictions), with every Cholesky factorisation of
``B = I + W^½ K W^½`` replaced by preconditioned CG (:func:`gpnys.solvers.pcg`) and ``log det B`` by stochastic
Lanczos quadrature.

Preconditioning. ``B = W^½ (K + W⁻¹) W^½``, and ``K + W⁻¹`` is a kernel matrix with the per-point shifts
``W⁻¹`` that gpnys's preconditioners take (``diag=``): with ``P ≈ K̃ + W⁻¹/s²`` (``K = s² K̃``, ``K̃`` of unit
variance) built by :func:`gpnys.precond.strategy.make_preconditioner`, CG runs on ``B`` with the preconditioner
``M = s² W^½ P W^½``, the same iterates as CG on ``K + W⁻¹`` with ``P`` but a stopping test on ``B``'s residual,
which weights the points by ``W^½`` (``B ⪰ I``, so its relative residual bounds the relative error).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable

import gpytorch
import numpy as np
import torch

from gpnys.checks import NumericalWarning, validate_choice, validate_count, validate_positive
from gpnys.classify.estimator import LaplaceEstimator, as_output
from gpnys.classify.likelihoods import LaplaceLikelihood, check_observations, resolve_likelihood
from gpnys.collectives import resolve_group
from gpnys.gp.discover import selected_kernel
from gpnys.gp.estimator import gradient_spread, ritz_log_square, slq_quadrature, slq_variance
from gpnys.gp.settings import GP_DEFAULTS
from gpnys.kernels.blocks import kernel_diag
from gpnys.kernels.entries import computation_dtype, evaluate, split_outputscale
from gpnys.kernels.operator import StationaryKernelOperator, supported
from gpnys.kernels.system import kernel_system
from gpnys.precond.cache import PointCache
from gpnys.precond.strategy import DIAG_PRECONDITIONERS, make_preconditioner
from gpnys.solvers.pcg import pcg

__all__ = ["LaplaceGP", "LaplaceGPClassifier", "LaplacePredictions", "BernoulliClassifier", "halve_step", "at_mode",
           "w_floor", "W_FLOOR"]

#: the floor on ``W``: where a probability rounds to 0 or 1, ``W = π(1 - π)`` underflows and ``W⁻¹`` (the
#: preconditioner's shift) and ``W^{-½}`` would be infinite. Newton's steps clamp ``W`` here: that changes their
#: Hessian (the mode, where the gradient vanishes, is unchanged) and damps them where ``W`` vanishes (a floor of
#: ``1e-18`` at outputscale 1e8 on separable labels left ``f`` 400 from the mode). At the mode, ``log det B``, the
#: gradient and the predictions clamp it at :func:`w_floor`, ``W_FLOOR / max K_ii``, which moves ``log det B`` by at
#: most ``W_FLOOR`` per clamped point and a latent variance by about ``W_FLOOR K_ii``: clamping at ``1e-10`` there
#: biased ``log q`` by 0.22 at outputscale 1e8 and by 8.2 at 1e10 on separable labels
W_FLOOR = 1e-10


def w_floor(k_max: float, dtype: torch.dtype) -> float:
    """The clamp on ``W`` for a kernel whose largest diagonal entry is ``k_max``: ``W_FLOOR / max(1, k_max)``, and at
    least ``√tiny`` of ``dtype``, where ``W⁻¹`` still fits (a float32 outputscale above about 1e9).

    Example:
        >>> import torch
        >>> from gpnys.classify.laplace import w_floor
        >>> w_floor(1.0, torch.float64), w_floor(1e8, torch.float64)
        (1e-10, 1e-18)
    """
    return max(W_FLOOR / max(1.0, k_max), math.sqrt(torch.finfo(dtype).tiny))


#: a Newton step rebuilds the preconditioner once its CG iterations per decade of residual reduction exceed this
#: factor times those of the first solve after the previous build
REBUILD_GROWTH = 1.5

#: the largest relative CG tolerance of a Newton step (inexact Newton, Dembo, Eisenstat and Steihaug 1982): step k
#: solves to ``min(NEWTON_FORCING, sqrt(|r_k| / |r_0|))`` (at least ``cg_tolerance``) with ``r = ∇ log p - a`` the
#: mode's residual, which keeps Newton's convergence superlinear at a fraction of the CG iterations
NEWTON_FORCING = 1e-2

#: the Newton and CG tolerances are floored at this many machine epsilons of the working dtype: in float32 a
#: mode does not settle, nor a residual fall, much below its rounding (``newton_tol = 1e-8`` ran ``max_newton``
#: steps to the same mode as ``1e-5``)
TOLERANCE_EPS = 100


#: each latent variance's solve runs on until its error bound ``|ρ|²`` is at most this share of the variance (a
#: warning where the working precision leaves it above the square root of this share)
VARIANCE_RTOL = 1e-4

#: a Newton iteration that ends where ``Ψ`` no longer rises warns above this mode residual, relative to
#: ``max(1, max|f|)`` (:meth:`LaplaceGP._check_mode`)
MODE_RESIDUAL = 1e-3


def _floored_tolerance(tol: float, dtype: torch.dtype) -> float:
    """``tol``, at least :data:`TOLERANCE_EPS` machine epsilons of ``dtype``."""
    return max(tol, TOLERANCE_EPS * torch.finfo(dtype).eps)


def _validate_tolerance(value: float, name: str) -> float:
    """A relative residual tolerance as a float in ``(0, 1)``; a ``ValueError`` naming ``name`` otherwise (at 1 and
    above CG stops before its first step: ``x = 0``)."""
    tol = validate_positive(value, name)
    if tol >= 1:
        raise ValueError(f"{name} must be in (0, 1) (a relative residual), got {value!r}")
    return tol


def halve_step(objective: Callable[[float], float], value: float, slack: float) -> tuple[float, float] | None:
    """Step halving, R&W Algorithm 3.1's safeguard: the first step ``t = 1, ½, ¼, …`` (30 at most) whose
    ``objective(t)`` is at least ``value - slack``, and that objective; ``None`` when none is (no ascent left at this
    precision: the mode)."""
    step = 1.0
    for _ in range(30):
        new = objective(step)
        if new >= value - slack:
            return step, new
        step /= 2
    return None


def warm_start_holds(psi_warm: float, psi_cold: float, likelihood: LaplaceLikelihood, f: torch.Tensor,
                     y: torch.Tensor) -> bool:
    """Whether Newton may start from a warm start whose latent is ``f`` (``(n,)``) and whose ``Ψ`` (R&W eq. (3.12))
    is ``psi_warm``: that ``Ψ`` is finite and at least the cold start's ``psi_cold = Ψ(0) = log p(y|0)``, and ``W``
    at ``f`` is finite. Under a large hyperparameter move the previous mode can put ``f`` far from the new one
    (Poisson counts: ``f`` in [−91, 106] for a mode in [2, 6], ``W = e^f`` up to 1e46; Newton from there stopped at
    ``max_newton`` with ``log q`` −5e25 for −723, or the Cholesky of ``B`` failed)."""
    if not (math.isfinite(psi_warm) and psi_warm >= psi_cold):
        return False
    return bool(torch.isfinite(likelihood.derivatives(f, y)[1]).all())


def at_mode(change: float, last: float, gain: float, slack: float, tol: float, size: float) -> bool:
    """Newton's stopping rule for the Laplace mode: the distance left, estimated from the step's change of ``f`` and
    the steps' ratio ``q = change / last`` as ``change · max(1, q / (1 − q))``, is at most ``tol max(1, size)``
    (``size = max |f|``); or the steps no longer shrink (``change >= last``) and ``Ψ`` no longer rises (``gain <=
    slack``): the mode at this precision (rounding in the solves; a flat ``Ψ``, as Student-t noise of small df with
    far outliers gives, where Fisher scoring would wander at ``Ψ``'s rounding for any number of steps). The ratio
    matters where the steps shrink linearly (Fisher scoring for Student-t noise): a small step there is far from the
    mode (df = 1.5 in float32 stopped with f 0.6 % off and a gradient entry 5 %)."""
    q = change / last if math.isfinite(last) and last > 0 else 0.0
    left = change * max(1.0, q / (1.0 - q)) if q < 1.0 else math.inf
    return left <= tol * max(1.0, size) or (change >= last and gain <= slack)


class LaplacePredictions(LaplaceEstimator):
    """The estimator protocol and predictions of a Laplace model (:class:`LaplaceGP`,
    :class:`~gpnys.classify.ReducedLaplaceGP`) from its ``_latent(X, variance)``: the latent mean ``(m,)`` and,
    with ``variance``, the latent variance ``(m,)`` (else ``None``) at points ``X`` ``(m, d)``, ``m ≥ 1``, in the fit's
    dtype on its device.

    Inputs: tensors, numpy arrays or lists (:class:`~gpnys.classify.estimator.LaplaceEstimator`); the predictions
    are tensors for a tensor ``X`` and numpy arrays otherwise."""

    kernel: gpytorch.kernels.Kernel

    def _newton_and_training_settings(self) -> None:
        """The arguments both Laplace models take, checked at :meth:`fit` and kept as numbers: ``max_newton``,
        ``newton_tol``, ``optimizer_steps``, ``lr`` and ``seed`` (a ``ValueError`` names a bad one)."""
        self._max_newton = validate_count(self.max_newton, "max_newton", 1)
        self._newton_tol = validate_positive(self.newton_tol, "newton_tol")
        self._optimizer_steps = validate_count(self.optimizer_steps, "optimizer_steps", 0)
        self._lr = validate_positive(self.lr, "lr")
        self._seed = validate_count(self.seed, "seed", 0)

    def _resolve_likelihood(self) -> LaplaceLikelihood:
        return resolve_likelihood(self.likelihood)

    def _targets(self, y: Any, X: torch.Tensor) -> torch.Tensor:
        """``y`` as a tensor on ``X``'s device (a numpy array or a list of numbers converted);
        :func:`~gpnys.classify.likelihoods.check_observations` checks it."""
        if isinstance(y, torch.Tensor):
            return y
        arr = np.asarray(y)
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"y must hold numbers, got dtype {arr.dtype}")
        return torch.from_numpy(np.require(arr, requirements="W")).to(X.device)

    def _prepare(self, X: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor, LaplaceLikelihood]:
        """Check the constructor's ``kernel`` and likelihood, and the training data: ``(X, y, likelihood)``, ``X``
        ``(n, d)`` floating (``n_features_in_`` set) and ``y`` ``(n,)`` in the likelihood's support."""
        if not isinstance(self.kernel, gpytorch.kernels.Kernel):
            raise ValueError(f"kernel must be a GPyTorch kernel, got {type(self.kernel).__name__}")
        likelihood = self._resolve_likelihood()
        if y is None:
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
        param = next(iter(self.kernel.parameters()), None)
        X = self._fit_points(X, param.device if param is not None else torch.device("cpu"))
        return X, check_observations(X, self._targets(y, X), likelihood), likelihood

    def _copy_hyperparameters(self, X: torch.Tensor, likelihood: LaplaceLikelihood) -> torch.dtype:
        """Start a fit on ``X``: ``kernel_`` and ``likelihood_``, deep copies of the ``kernel`` given at
        construction and of ``likelihood`` (the constructor's, resolved; its tensors in the computation dtype, on
        ``X``'s device), which the fit trains and the predictions read. The given objects are never modified, so
        every fit starts from them (as scikit-learn's estimators do). Returns the computation dtype."""
        self.kernel_ = copy.deepcopy(self.kernel)
        dtype = computation_dtype(self.kernel_, X)
        self.likelihood_ = copy.deepcopy(likelihood).to(dtype, X.device)
        return dtype

    def _latent(self, Xs: torch.Tensor, variance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _latent_at(self, X: Any, variance: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """``_latent`` at the query points ``X`` (0 rows give empty tensors), and whether ``X`` was a tensor."""
        self._check_fitted()
        Xs, tensor = self._query_points(X, self._X.dtype, self._X.device)
        if Xs.shape[0] == 0:
            empty = Xs.new_zeros(0)
            return empty, empty if variance else None, tensor
        return (*self._latent(Xs, variance), tensor)

    def predict_latent(self, X: Any) -> tuple[Any, Any]:
        """Latent predictive mean and variance at ``X`` ``(m, d)``, each ``(m,)`` (the model's ``_latent``)."""
        mean, var, tensor = self._latent_at(X, True)
        return as_output(mean, tensor), as_output(var, tensor)

    def predict(self, X: Any) -> tuple[Any, Any]:
        """Predictive mean and variance of the observation at ``X`` ``(m, d)``, each ``(m,)``, over the latent
        Gaussian, by the likelihood's ``moments``: for counts the log-normal mixture's
        (:meth:`~gpnys.classify.likelihoods.Poisson.moments`); for labels ``P(y = 1)`` by the probit approximation
        and its Bernoulli variance; for Student-t noise the latent mean and ``v + σ² ν / (ν − 2)``."""
        mean, var, tensor = self._latent_at(X, True)
        with torch.no_grad():
            mean, var = self.likelihood_.moments(mean, var)
        return as_output(mean, tensor), as_output(var, tensor)


class LaplaceGP(LaplacePredictions):
    """Laplace-approximate GP with a non-Gaussian likelihood (R&W §3.4): ``"bernoulli"`` (labels 0/1, logistic
    link; :class:`LaplaceGPClassifier` adds class probabilities) or ``"poisson"`` (counts, log link).

    :meth:`fit` finds the posterior mode, the approximate log marginal likelihood ``log q(y|X, θ)`` (eq. (3.32))
    and its gradient in the kernel's raw hyperparameters θ (R&W §5.5.1, eqs. (5.22)-(5.24), Algorithm 5.1: the
    explicit terms and the implicit one through the mode), each with an SLQ standard error; with
    ``optimizer_steps > 0`` it first trains θ by Adam on ``-log q / n``, each step's Newton iteration started at the
    previous step's ``a = K⁻¹ f̂``.

    The gradient's trace ``tr((K + W⁻¹)⁻¹ ∂K)`` and the implicit term's ``diag((K⁻¹ + W)⁻¹)`` are estimated on the
    probes of ``log det B``: with ``z ~ N(0, P̂)``, ``P̂ ≈ K + W⁻¹``, ``u = (K + W⁻¹)⁻¹ z`` (the probes' solves) and
    ``v = P̂⁻¹ z``, ``E[uᵀ ∂K v] = tr((K + W⁻¹)⁻¹ ∂K)`` and ``E[(W⁻¹ u) ∘ (K v)] = diag((K⁻¹ + W)⁻¹)``, so the
    implicit term costs one more block solve and the standard errors come from the per-probe terms.

    A scikit-learn estimator without a ``score``: ``get_params`` / ``set_params`` and ``sklearn.base.clone`` (the
    constructor keeps its arguments as given and :meth:`fit` checks them), ``X`` and ``y`` as tensors, numpy arrays
    or lists, and predictions as tensors for a tensor ``X`` and as numpy arrays otherwise. ``predict`` returns the
    mean and the variance, so ``GridSearchCV`` needs a ``scoring``; :class:`LaplaceGPClassifier` has ``score``.

    Args:
        kernel: a GPyTorch kernel (e.g. ``ScaleKernel(MaternKernel(nu=1.5))``); its outputscale is ``s²``. Every
            fit works on a deep copy, ``kernel_``: this object is never modified. Its ``active_dims`` (on a
            ``ScaleKernel`` or its base kernel) select the columns of ``X`` it reads, as in GPyTorch's ``kernel(X)``.
        likelihood: ``"bernoulli"``, ``"poisson"``, ``"studentt"`` or a
            :class:`~gpnys.classify.likelihoods.LaplaceLikelihood` (e.g. ``StudentT(df=4.0, scale=0.5)``); its
            trainable parameters (the Student-t's scale) are trained with the kernel's, on a deep copy
            (``likelihood_``).
        method: preconditioner name taking per-point shifts (``"afn"``, ``"fsai"``, ``"nystrom"``, ``"auto"``).
            AFN is built on ``W⁻¹`` itself; ``"auto"``'s Nyström branch (a low estimated rank) uses one scalar
            level for all points, a poor fit when ``W⁻¹`` spans decades (confident points).
        precond_options: extra options for :func:`~gpnys.precond.strategy.make_preconditioner` (``k``, ``w``,
            ``rank``); AFN's sizes default to GP training's (:data:`gpnys.gp.settings.GP_DEFAULTS`, k = 500, w = 30),
            at most n.
        cg_tolerance: relative residual, in ``(0, 1)``, of every CG solve with ``B`` (Newton steps and predictive
            variances), at least :data:`TOLERANCE_EPS` (100) machine epsilons of the working dtype (1.2e-5 in
            float32).
        max_newton: Newton steps at most. newton_tol: stop once a step changes no ``f_i`` by more than
            ``newton_tol * max(1, max|f|)``; floored like ``cg_tolerance`` (100 eps: the default 1e-8 is below
            what a float32 mode resolves). Newton also stops once a step moves ``f`` no less than the previous one
            while ``Ψ`` rises by no more than its rounding (the mode at this precision).
        num_probes: SLQ probes for ``log det B``. slq_tolerance: CG tolerance, in ``(0, 1)``, of the probe
            solves (their Lanczos tridiagonals). max_cg: CG iterations at most per solve.
        seed: seeds the probes and the preconditioner's randomness (same seed, same results).
        optimizer_steps: Adam steps on the kernel's hyperparameters in :meth:`fit` (0: keep them), from those of
            ``kernel`` at every fit. lr: Adam's learning rate.
        group: a ``torch.distributed`` process group (``True``: the default one) whose ranks split the kernel
            products, the preconditioner builds and the gradient's derivative pass by rows (every rank holds all of
            ``X`` and ``y``, runs the same Newton steps and gets the same results; start the ranks with the same
            seed, e.g. :func:`gpnys.distributed.init`). ``None``: one process.

    Attributes (after :meth:`fit`):
        kernel_, likelihood_: the kernel and likelihood of the fit, copies of ``kernel`` and ``likelihood`` with the
            trained hyperparameters (``optimizer_steps > 0``); the predictions use them.
        n_features_in_: the columns of ``X``.
        f_hat_: ``(n,)`` posterior mode. log_marginal_likelihood_: float, R&W eq. (3.32).
        mll_std_error_: float, the SLQ standard error of ``log_marginal_likelihood_``.
        mll_gradient_: ``{raw parameter name: tensor}``, ``∂ log q / ∂θ`` (R&W eq. (5.23)-(5.24)), shapes of the
            parameters; empty for a kernel without trainable parameters. mll_gradient_std_error_: the same, its
            standard errors.
        newton_iterations_: int. cg_iterations_: list of the CG iterations of each Newton step. builds_:
            preconditioner builds of the last fit (a Newton step reuses the previous one until its CG iterations
            grow by :data:`REBUILD_GROWTH`; the mode gets a fresh one).
        history_: one ``{"step", "log_marginal_likelihood", "std_error", "newton_iterations"}`` per Adam step.

    Example:
        Poisson counts whose log-rate is a smooth function:

        >>> import gpytorch, torch
        >>> from gpnys.classify import LaplaceGP
        >>> g = torch.Generator().manual_seed(0)
        >>> X = torch.rand(100, 1, dtype=torch.float64, generator=g)
        >>> y = torch.poisson(torch.exp(1 + torch.sin(6 * X[:, 0])), generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> kernel.base_kernel.lengthscale, kernel.outputscale = 0.2, 1.0
        >>> gp = LaplaceGP(kernel, likelihood="poisson", num_probes=8).fit(X, y)
        >>> mean, var = gp.predict(X[:3])                       # expected counts and their variances
        >>> bool(((mean - torch.exp(1 + torch.sin(6 * X[:3, 0]))).abs() < 1.5).all())
        True
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, *, likelihood: str | LaplaceLikelihood = "bernoulli",
                 method: str = "afn", precond_options: dict | None = None,
                 cg_tolerance: float = 1e-8, max_newton: int = 50, newton_tol: float = 1e-8, num_probes: int = 32,
                 slq_tolerance: float = 1e-6, max_cg: int = 1000, seed: int = 0, optimizer_steps: int = 0,
                 lr: float = 0.1, group: Any = None) -> None:
        self.kernel, self.likelihood, self.method, self.precond_options = kernel, likelihood, method, precond_options
        self.cg_tolerance, self.max_newton, self.newton_tol = cg_tolerance, max_newton, newton_tol
        self.num_probes, self.slq_tolerance, self.max_cg, self.seed = num_probes, slq_tolerance, max_cg, seed
        self.optimizer_steps, self.lr, self.group = optimizer_steps, lr, group

    def _settings(self) -> None:
        """Check the constructor's arguments (at :meth:`fit`, as scikit-learn does) and keep them, as numbers, in
        private attributes that the fit reads; a ``ValueError`` names a bad one."""
        self._method = validate_choice(self.method, "method", DIAG_PRECONDITIONERS)
        if self.precond_options is not None and not isinstance(self.precond_options, dict):
            raise ValueError(f"precond_options must be a dict or None, got {type(self.precond_options).__name__}")
        self._precond_options = dict(self.precond_options or {})
        self._cg_tolerance = _validate_tolerance(self.cg_tolerance, "cg_tolerance")
        self._slq_tolerance = _validate_tolerance(self.slq_tolerance, "slq_tolerance")
        self._num_probes = validate_count(self.num_probes, "num_probes", 2)
        self._max_cg = validate_count(self.max_cg, "max_cg", 1)
        self._newton_and_training_settings()
        self._group = None if self.group is None or self.group is False else resolve_group(self.group)

    # ---- the pieces of B = I + W^½ K W^½ -------------------------------------------------------------------
    def _state(self, f: torch.Tensor, build: bool = True, floor: float = W_FLOOR) -> None:
        """``W`` (clamped at ``floor``, see :data:`W_FLOOR`) and ``W^½`` at ``f``, and (``build``) the preconditioner
        ``P ≈ K̃ + W⁻¹/s²`` for them; without ``build`` the previous ``P`` stays (any SPD ``P`` keeps CG exact)."""
        self._W = self.likelihood_.derivatives(f, self._y)[1].clamp_min(floor)
        self._sW = self._W.sqrt()
        if not build:
            return
        D = 1.0 / (self._W * self._s2)
        # the scalar level (rank estimate, Nyström's scaled form) is the median shift: the mean is dominated by
        # the confidently classified points' large W⁻¹
        n = self._X.shape[0]
        options = {**{key: min(v, n) for key, v in GP_DEFAULTS.get(self._method, {}).items()}, **self._precond_options}
        self._P = make_preconditioner(self._method, self._Xk, self._kernel, float(D.median()), cache=self._points,
                                      seed=self._seed, diag=D, group=self._group, **options)

    def _K(self, V: torch.Tensor) -> torch.Tensor:
        """``K V = s² K̃ V`` (``V`` of shape ``(n,)`` or ``(n, t)``)."""
        return self._s2 * (self._system(V) - self._system.mu * V)

    def _B(self, V: torch.Tensor) -> torch.Tensor:
        sW = self._sW[:, None] if V.dim() == 2 else self._sW
        return V + sW * self._K(sW * V)

    def _M_inv(self, R: torch.Tensor) -> torch.Tensor:
        """``M⁻¹ R = W^{-½} P⁻¹ W^{-½} R / s²``."""
        sW = self._sW[:, None] if R.dim() == 2 else self._sW
        return self._P.solve(R / sW) / (sW * self._s2)

    def _solve_B(self, R: torch.Tensor, tol: float | torch.Tensor, lanczos: bool = False,
                 x0: torch.Tensor | None = None):
        return pcg(self._B, R, self._M_inv, tol=tol, maxiter=self._max_cg, lanczos=lanczos, x0=x0)

    # ---- fit -----------------------------------------------------------------------------------------------
    def fit(self, X: Any, y: Any) -> "LaplaceGP":
        """Posterior mode (R&W Algorithm 3.1, Newton's method on eq. (3.18)) and log marginal likelihood
        (eq. (3.32)), after ``optimizer_steps`` Adam steps on the hyperparameters. ``X: (n, d)``, ``y: (n,)`` in the
        likelihood's support (0/1 or bool labels; counts), tensors or arrays. Checks the constructor's arguments
        first. Returns ``self``."""
        self._settings()
        X, yv, likelihood = self._prepare(X, y)
        self._copy_hyperparameters(X, likelihood)
        self._warned_kernel = False  # one warning a fit (_column_gradients)
        params = [p for p in self.kernel_.parameters() if p.requires_grad] + self.likelihood_.parameters()
        self.history_: list[dict] = []
        if self._optimizer_steps and not params:
            warnings.warn(f"{type(self).__name__}: optimizer_steps = {self._optimizer_steps} but neither the kernel "
                          "nor the likelihood has a trainable parameter; no step is taken", UserWarning, stacklevel=2)
        a0 = None
        if self._optimizer_steps and params:
            opt = torch.optim.Adam(params, lr=self._lr)
            for step in range(self._optimizer_steps):
                with torch.no_grad():
                    self._fit(X, yv, a0)
                grads = self._gradient()
                self.history_.append({"step": step, "log_marginal_likelihood": self.log_marginal_likelihood_,
                                      "std_error": self.mll_std_error_, "newton_iterations": self.newton_iterations_})
                opt.zero_grad()
                for p, g in zip(params, grads):
                    p.grad = -g / X.shape[0]  # Adam minimises -log q / n
                opt.step()
                a0 = self.a_
        with torch.no_grad():
            self._fit(X, yv, a0)
        self._gradient()
        return self

    def _fit(self, X: torch.Tensor, y: torch.Tensor, a0: torch.Tensor | None = None) -> None:
        dtype = computation_dtype(self.kernel_, X)
        self._X = X.to(dtype)
        self._y = y.to(dtype)
        # the kernel as GPyTorch's __call__ applies it: on the columns its active_dims select (the ScaleKernel's,
        # which GPyTorch copies from its base kernel), as the kernel view of gpnys.gp.discover that acts on them
        # (it shares kernel_'s parameters); every product, preconditioner build, derivative and prediction uses
        # the pair, so that a ScaleKernel's own active_dims are not dropped with its outputscale
        self._kernel = selected_kernel(self.kernel_)
        self._Xk = self._columns(self._X)
        _, s2 = split_outputscale(self._kernel)
        self._s2 = s2
        self._system = kernel_system(self._Xk, self._kernel, mu=1.0, group=self._group)  # K̃ V = system(V) - V
        self._points = PointCache(self._Xk)  # FPS order and kNN patterns, shared by every Newton step's build
        # Ψ in at least float64 from the iterates, and the iterates' own rounding as the slack of its comparisons,
        # 64 eps (½|a ∘ f| + |∇log p ∘ f|) (2-norms: the roundings' signs are independent): 64 eps (|Ψ| + n) exceeded
        # all the gain left where separable labels leave Ψ near 0 (float32 at outputscale 1e6: f 9 % from the mode)
        wide = torch.promote_types(dtype, torch.float64)
        y_wide = self._y.to(wide)

        def psi_at(a_t: torch.Tensor, f_t: torch.Tensor) -> float:
            f_t = f_t.to(wide)
            return float(self.likelihood_.log_prob(f_t, y_wide) - 0.5 * (a_t.to(wide) * f_t).sum())

        a, f, psi = self._start(a0, psi_at)
        eps = torch.finfo(dtype).eps
        slack = 0.0
        cg_tol, newton_tol = (_floored_tolerance(t, dtype) for t in (self._cg_tolerance, self._newton_tol))
        self.cg_iterations_: list[int] = []
        self.newton_iterations_ = 0
        self.builds_ = 0
        fresh = rate = None  # CG iterations per decade: of the first solve after the latest build, of the last
        first = None  # |r_0|, the first step's residual
        converged = False
        last = math.inf  # the previous step's largest change of f
        gains: list[float] = []  # Ψ's rise at each step
        strict = False  # the steps solve to cg_tol with a fresh preconditioner (after an inexact step failed)
        for _ in range(self._max_newton):
            # the preconditioner is rebuilt for the new W only when CG has slowed by half since the last build
            # (a build costs about as much as a Newton step's solve)
            build = fresh is None or rate > REBUILD_GROWTH * fresh or strict
            self._state(f, build)
            self.builds_ += build
            grad = self.likelihood_.derivatives(f, self._y)[0]  # ∇ log p(y|f)
            slack = 64 * eps * float(0.5 * (a * f).norm() + (grad * f).norm())
            # R&W Algorithm 3.1 lines 5-7, a_new = b - W^½ B⁻¹ W^½ K b with b = W f + ∇, started at the previous
            # a: the step is da = W^½ B⁻¹ W^{-½} (∇ - a), solved inexactly (NEWTON_FORCING)
            rhs = (grad - a) / self._sW
            norm = float(rhs.norm())
            first = norm if first is None else first
            tol = cg_tol if strict else max(cg_tol, min(NEWTON_FORCING, math.sqrt(norm / first) if first > 0 else 0.0))
            res = self._solve_B(rhs, tol)
            self.cg_iterations_.append(res.iterations)
            rate = res.iterations / -math.log10(tol)
            fresh = rate if build else fresh
            da = self._sW * res.x
            df = self._K(da)
            self.newton_iterations_ += 1
            # step halving while the objective Ψ = log p(y|f) - ½ aᵀf (Algorithm 3.1 line 8) decreases (a
            # safeguard; a and f = K a are linear in the step, so halving costs no product)
            halved = halve_step(lambda t: psi_at(a + t * da, f + t * df), psi, slack)
            if halved is None and not strict:
                # no ascent along an inexact step (a loose solve, a preconditioner built for another W): the rest
                # solve to cg_tol with a fresh preconditioner (probit at outputscale 1e4 stopped here 2e3 from the
                # mode, max|f - K∇log p|, where the strict steps reach 1e-11)
                strict = True
                continue
            if halved is None:
                converged = True
                break  # no ascent left at this precision: the mode
            step, new = halved
            gains.append(new - psi)
            psi = new
            change = float((step * df).abs().max())
            a, f = a + step * da, f + step * df
            if at_mode(change, last, gains[-1], slack, newton_tol, float(f.abs().max())):
                if strict or change <= newton_tol * max(1.0, float(f.abs().max())):
                    converged = True
                    break
                strict = True  # a flat Ψ after an inexact step: confirm it with strict steps
            last = change
        if not converged:  # not the mode: its Laplace approximation, and with it every figure below, is off
            self._warn_short(f, change, gains, slack)
        else:
            self._check_mode(f)
        # a fresh P at the mode, W clamped where it moves log det B by at most W_FLOOR a point: log det B's and the
        # gradient's probes, and the predictions
        self._state(f, floor=w_floor(float(kernel_diag(self._kernel, self._Xk).max()), dtype))
        self.builds_ += 1
        self.f_hat_, self.a_ = f, a
        self._grad = self.likelihood_.derivatives(f, self._y)[0]
        logdet, se = self._logdet_B()  # keeps its probes and solves for _gradient
        # the sums in the wide dtype (as Ψ's): in float32 the terms of log p (y f, e^f and log y! of counts in the
        # thousands) cancel to a hundredth of their size, and their rounding put log q 40-54 standard errors off
        fw, aw = f.to(wide), a.to(wide)
        quadratic, log_p = float(-0.5 * (aw * fw).sum()), float(self.likelihood_.log_prob(fw, y_wide))
        self.log_marginal_likelihood_ = quadratic + log_p - 0.5 * logdet
        # and the iterates' drift: the steps update f and a = K⁻¹f side by side, and their rounding moves them
        # apart (float32 Poisson counts in the thousands: a off by 1e-3 with f good to 6e-7, log q 16-21 standard
        # errors off without this term); ½ aᵀ(f - K a) sizes what that does to ½ aᵀf (one kernel product), and the
        # rounding of the inputs of the two sums what it does to them
        consistency = 0.5 * float((aw * (fw - self._K(a).to(wide))).sum())
        rounding = eps * (abs(quadratic) + abs(log_p))
        self.mll_std_error_ = math.sqrt((0.5 * se) ** 2 + consistency**2 + rounding**2)

    def _start(self, a0: torch.Tensor | None,
               psi_at: Callable[[torch.Tensor, torch.Tensor], float]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Newton's start ``(a, f = K a, Ψ)``: the warm start ``a0`` (the previous hyperparameters' ``K⁻¹ f̂``; ``f =
        K a0``, ``Ψ = log p(y|f) − ½ a0ᵀ f``, R&W eq. (3.12)) where :func:`warm_start_holds`; else the cold start,
        zero."""
        zero = self._X.new_zeros(self._X.shape[0])
        cold = psi_at(zero, zero)
        if a0 is None:
            return zero, zero, cold
        a = a0.to(self._X.dtype)
        f = self._K(a)
        warm = psi_at(a, f)
        return (a, f, warm) if warm_start_holds(warm, cold, self.likelihood_, f, self._y) else (zero, zero, cold)

    def _mode_residual(self, f: torch.Tensor) -> float:
        """``max|f − K∇log p(y|f)|``, 0 at the mode (one kernel product)."""
        return float((f - self._K(self.likelihood_.derivatives(f, self._y)[0])).abs().max())

    def _check_mode(self, f: torch.Tensor) -> None:
        """Where Newton stopped, warn if the mode's residual (:meth:`_mode_residual`) exceeds
        :data:`MODE_RESIDUAL` of ``max(1, max|f|)``: the solves could not resolve the mode at this precision, and a
        step that CG cut short looks as small as one at the mode (float32 Poisson counts in the thousands at
        outputscale 100: 0.36 of it and ``log q`` −6e5 for −1156; a good float32 fit is below 3e-4)."""
        residual = self._mode_residual(f)
        size = max(1.0, float(f.abs().max()))
        if residual > MODE_RESIDUAL * size:
            hint = ": use float64" if f.dtype != torch.float64 else ""
            warnings.warn(f"{type(self).__name__}: Newton's method stopped, but max|f − K∇log p(y|f)| = "
                          f"{residual:.3e} ({residual / size:.2g} of max(1, max|f|); 0 at the mode): f is not the "
                          f"mode, and log q and the predictions are off{hint}", NumericalWarning, stacklevel=4)

    def _warn_short(self, f: torch.Tensor, change: float, gains: list[float], rounding: float) -> None:
        """The warning for Newton's method stopped at ``max_newton`` before the mode: the last step's change of
        ``f``, the mode's residual ``max|f − K∇log p(y|f)|`` (0 at the mode; one kernel product) and Ψ's rise over
        the last steps; raising ``max_newton`` is advised only while Ψ still rises above its ``rounding``."""
        residual = self._mode_residual(f)
        recent = gains[-5:]
        rise = sum(recent)
        advice = ("Ψ still rises: raise max_newton" if rise > len(recent) * rounding else
                  "Ψ no longer rises above its rounding, so more steps would not move f towards the mode; a larger "
                  "newton_tol accepts this f")
        warnings.warn(f"{type(self).__name__}: Newton's method stopped at max_newton = {self._max_newton} steps "
                      f"before the mode moved less than newton_tol: the last step moved f by {change:.2e}, "
                      f"max|f − K∇log p(y|f)| = {residual:.3e} (0 at the mode), and Ψ = log p(y|f) − ½ fᵀK⁻¹f rose "
                      f"by {rise:.2e} over the last {len(recent)} steps; {advice}", NumericalWarning, stacklevel=4)

    def _columns(self, X: torch.Tensor) -> torch.Tensor:
        """The columns of ``X`` ``(m, d)`` that ``kernel_``'s ``active_dims`` select (all of them without)."""
        dims = self.kernel_.active_dims
        return X if dims is None else X.index_select(-1, dims.to(X.device))

    def _logdet_B(self) -> tuple[float, float]:
        """``log det B = log det M + log det(M^{-½} B M^{-½})``: ``log det M = n log s² + Σ log W + log det P``
        exactly, the rest by SLQ with probes ``~ N(0, M)``; returns it and the SLQ standard error."""
        n, t = self._X.shape[0], self._num_probes
        device = self._X.device
        gen = torch.Generator(device=device).manual_seed(self._seed)
        Z = math.sqrt(self._s2) * self._sW[:, None] * self._P.sample(t, generator=gen)
        res = self._solve_B(Z, self._slq_tolerance, lanczos=True)
        self._probes = (Z / self._sW[:, None], self._sW[:, None] * res.x)  # z ~ N(0, P̂) and (K + W⁻¹)⁻¹ z
        ell, truncation, ritz = slq_quadrature(res.tridiagonal, res.iterations_per_column, n)
        wide = torch.promote_types(self._W.dtype, torch.float64)
        parts = (n * math.log(self._s2), float(self._W.log().sum(dtype=wide)), float(self._P.logdet()),
                 float(ell.mean()))
        # the terms' spread floored by the largest Ritz value (slq_variance), the quadrature's truncation and the
        # working precision's rounding of the parts (float32: a Poisson fit's log q 4-5 standard errors off, 7e-8
        # of it, without the last)
        # the floor centred on the terms' mean log eigenvalue, so that it does not move with P̂'s scale; the
        # gradient's rows share it (gradient_spread)
        self._slq_terms = (ell, ritz_log_square(ritz, float(ell.mean()) / n))
        rounding = torch.finfo(self._X.dtype).eps * sum(abs(v) for v in parts)
        se = math.sqrt(slq_variance(*self._slq_terms) / t + float(truncation.mean()) ** 2 + rounding**2)
        return sum(parts), se

    # ---- the hyperparameters' gradient ---------------------------------------------------------------------
    def _gradient(self) -> list[torch.Tensor]:
        """``∂ log q / ∂θ`` at the mode for the kernel's trainable parameters (R&W Algorithm 5.1), kept in
        :attr:`mll_gradient_` with standard errors; returns the gradients in ``kernel.parameters()`` order.

        Per probe ``k`` (class docstring): ``½ aᵀ ∂K a - ½ u_kᵀ ∂K v_k + c_kᵀ ∂K ∇log p`` with
        ``c_k = (K + W⁻¹)⁻¹ W⁻¹ s2_k``, ``s2_k = ½ d_k ∘ ∇³ log p``, ``d_k = (W⁻¹ u_k) ∘ (K v_k)`` (eq. (5.23):
        ``(I - K R) b = W⁻¹ (K + W⁻¹)⁻¹ b``)."""
        named = [(name, p) for name, p in self.kernel_.named_parameters() if p.requires_grad]
        named += self.likelihood_.named_parameters()
        params = [p for _, p in named]
        kernel_params = params[: len(params) - len(self.likelihood_.parameters())]
        self.mll_gradient_, self.mll_gradient_std_error_ = {}, {}
        if not params:  # a frozen kernel (and likelihood): nothing to differentiate
            return []
        Zp, U = self._probes
        t = Zp.shape[1]
        with torch.no_grad():
            V = self._P.solve(Zp) / self._s2  # P̂⁻¹ z
            third = self.likelihood_.derivatives(self.f_hat_, self._y)[2]  # ∇³ log p(y|f)
            d = U / self._W[:, None] * self._K(V)  # E[d_k] = diag((K⁻¹ + W)⁻¹)
            # ∂ log q / ∂f̂ = -½ diag((K⁻¹ + W)⁻¹) ∂W/∂f̂ with ∂W/∂f̂ = -∇³ log p: a plus sign here (checked
            # against autograd through a dense Newton iteration in the tests)
            s2 = 0.5 * d * third[:, None]
            C = torch.zeros_like(s2) if not bool(third.any()) else (  # A⁻¹ = W^½ B⁻¹ W^½
                self._sW[:, None] * self._solve_B(s2 / self._sW[:, None], self._slq_tolerance).x)
        parts = []
        if kernel_params:
            a, g = self.a_, self._grad
            left = torch.cat([a[:, None], U, C], 1)
            right = torch.cat([a[:, None], V, g[:, None].expand(-1, t)], 1)
            weights = torch.cat([left.new_full((1,), 0.5), left.new_full((t,), -0.5), left.new_ones(t)])
            columns = self._column_gradients(left * weights, right, kernel_params)  # (2t + 1, p)
            parts.append(columns[0] + columns[1 : t + 1] + columns[t + 1 :])  # (t, p): one per probe
        if len(params) > len(kernel_params):
            parts.append(self._likelihood_rows(d, C, params[len(kernel_params):]))
        rows = torch.cat(parts, 1)
        mean, se = rows.mean(0), gradient_spread(rows, *self._slq_terms).sqrt() / math.sqrt(t)
        grads = []
        offset = 0
        for name, p in named:
            k = p.numel()
            grads.append(mean[offset : offset + k].reshape(p.shape))
            self.mll_gradient_[name] = grads[-1]
            self.mll_gradient_std_error_[name] = se[offset : offset + k].reshape(p.shape)
            offset += k
        return grads

    def _likelihood_rows(self, d: torch.Tensor, C: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """Per probe ``k``, ``∂ log q / ∂θ`` for the likelihood's parameters ``θ`` (``(t, p)``): at the mode held
        fixed, ``∂ log p(y|f̂) - ½ Σ_i d_ki ∂W_i`` (``E[d_k] = diag((K⁻¹ + W)⁻¹)``, ``∂ log det B = tr((K⁻¹ +
        W)⁻¹ ∂W)``), plus the implicit term through the mode, ``(K c_k)ᵀ ∂∇log p`` (``f̂ = K ∇log p`` gives
        ``∂f̂ = (K⁻¹ + W)⁻¹ ∂∇log p``, and ``(K⁻¹ + W)⁻¹ s2_k = K c_k``). By autograd of these ``t`` scalars."""
        f = self.f_hat_.detach()
        KC = self._K(C) if bool(C.any()) else C
        with torch.enable_grad():
            grad, W, _ = self.likelihood_.derivatives(f, self._y)
            per_probe = self.likelihood_.log_prob(f, self._y) - 0.5 * (W[:, None] * d).sum(0) + grad @ KC  # (t,)
            rows = []
            for k in range(per_probe.shape[0]):
                got = torch.autograd.grad(per_probe[k], params, retain_graph=True, allow_unused=True)
                rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                       for p, g in zip(params, got)]))
        return torch.stack(rows).detach().to(d.dtype)

    def _column_gradients(self, L: torch.Tensor, R: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """Rows ``j``: ``∂(l_jᵀ K(θ) r_j) / ∂θ`` flattened over ``params`` (``(t, p)``). For a ``ScaleKernel`` over
        RBF/Matérn (or a bare one) in one pass of the kernel operator's per-column derivatives, chained to the raw
        parameters; any other kernel by autograd through GPyTorch's kernel, a column at a time (one warning)."""
        base, _ = split_outputscale(self._kernel)
        scaled = isinstance(self._kernel, gpytorch.kernels.ScaleKernel)
        X = self._Xk
        if supported(base):
            with torch.enable_grad():
                s2 = self._kernel.outputscale if scaled else torch.ones((), dtype=X.dtype, device=X.device)
                op = StationaryKernelOperator(X, s2, base.lengthscale, base=base, cache={}, group=self._group)
                _, d_s2, d_ls = op.column_derivatives(L, R)
                out = []
                for p in params:  # chain rule to the raw parameters: the constraints act entrywise
                    parts = []
                    for value, d in ((s2, d_s2), (base.lengthscale, d_ls)):
                        if not value.requires_grad:
                            continue
                        (dv,) = torch.autograd.grad(value.sum(), p, retain_graph=True, allow_unused=True)
                        if dv is not None:
                            parts.append(d.reshape(d.shape[0], -1) * dv.reshape(1, -1))
                    out.append(sum(parts) if parts else L.new_zeros(L.shape[1], p.numel()))
                return torch.cat(out, 1).detach()
        if not self._warned_kernel:
            self._warned_kernel = True
            warnings.warn(f"{type(self).__name__}: {type(base).__name__} has no closed-form derivative pass; its "
                          "gradient runs through GPyTorch's kernel a probe at a time (slower)", NumericalWarning,
                          stacklevel=3)
        rows = []
        with torch.enable_grad():
            for j in range(L.shape[1]):
                value = L[:, j] @ self._kernel(X).matmul(R[:, j])
                got = torch.autograd.grad(value, params, allow_unused=True)
                rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                       for p, g in zip(params, got)]))
        return torch.stack(rows).detach()

    # ---- predictions (LaplacePredictions) -----------------------------------------------------------------
    def _latent(self, Xs: torch.Tensor, variance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Latent mean ``k*ᵀ ∇log p(y|f̂)`` (R&W eq. (3.21)) and variance ``k(x*, x*) - k*ᵀ (K + W⁻¹)⁻¹ k*``
        (eq. (3.24))."""
        base, _ = split_outputscale(self._kernel)
        Xs = self._columns(Xs)
        with torch.no_grad():
            Ks = self._s2 * evaluate(base, self._Xk, Xs).to(self._X.dtype)  # (n, m)
            # R&W eq. (3.21), with K⁻¹f̂ for ∇ log p(y|f̂) (equal at the mode): consistent with f̂ where Newton
            # stopped short of it, where ∇ log p(y|f̂) gave predictions in the hundreds for targets in [-1, 4]
            mean = Ks.mT @ self.a_
            if not variance:
                return mean, None
            kss = self._s2 * evaluate(base, Xs, Xs, diag=True).to(self._X.dtype)
            R = self._sW[:, None] * Ks  # R&W Algorithm 3.2: vᵀv = (W^½ k*)ᵀ B⁻¹ (W^½ k*), eq. (3.24)
            floor = _floored_tolerance(self._cg_tolerance, self._X.dtype)
            res = self._solve_B(R, floor)
            # in the variational form 2 Rᵀx - xᵀB x = Rᵀx + xᵀρ (ρ = R - B x, the true residual), below RᵀB⁻¹R by
            # ρᵀB⁻¹ρ ≤ |ρ|² (B ≥ I): second order in the solve's error. kss - vᵀv can cancel to 1e-9 of kss
            # (Poisson counts in the thousands at outputscale 1e4, n = 800: variances up to 215 % off at the
            # default tolerance), so each column solves on from x until |ρ|² ≤ VARIANCE_RTOL of its variance
            def variance(res: Any) -> tuple[torch.Tensor, torch.Tensor]:
                return kss - ((R * res.x).sum(0) + (res.x * res.residual).sum(0)), res.residual.square().sum(0)

            var, bound = variance(res)
            if bool((bound > VARIANCE_RTOL * var.clamp_min(0)).any()):
                norms = R.norm(dim=0).clamp_min(torch.finfo(R.dtype).tiny)
                reach = TOLERANCE_EPS * torch.finfo(R.dtype).eps  # the working precision's, not cg_tolerance
                tols = ((VARIANCE_RTOL * var.clamp_min(0)).sqrt() / norms).clamp(min=reach, max=floor)
                var, bound = variance(self._solve_B(R, tols.to(torch.float64), x0=res.x))
                short = bound > math.sqrt(VARIANCE_RTOL) * var.clamp_min(0)  # a bound that loose: worth a word
                if bool(short.any()):
                    worst = float((bound / var.clamp_min(torch.finfo(var.dtype).tiny))[short].max())
                    warnings.warn(f"{type(self).__name__}: {int(short.sum())} latent variances are bounded only to "
                                  f"{worst:.2g} of their value: the solve with B reached its floor"
                                  f"{' (float64 goes further)' if var.dtype != torch.float64 else ''}",
                                  NumericalWarning, stacklevel=4)
            return mean, var.clamp_min(0)

    def predict_variance(self, X: Any) -> Any:
        """Latent predictive variance ``k(x*, x*) - k*ᵀ (K + W⁻¹)⁻¹ k*`` (R&W eq. (3.24)). ``X: (m, d)`` -> ``(m,)``"""
        _, var, tensor = self._latent_at(X, True)
        return as_output(var, tensor)


#: the links of the binary classifiers and their likelihoods (:data:`gpnys.classify.likelihoods.LIKELIHOODS`)
LINKS = {"logit": "bernoulli", "probit": "bernoulli_probit"}


class BernoulliClassifier:
    """Binary classification for a Laplace model whose ``_latent_at`` gives latent means and variances: the
    Bernoulli likelihood with ``link`` ``"logit"`` (R&W eq. (3.15), :class:`~gpnys.classify.likelihoods.Bernoulli`)
    or ``"probit"`` (eq. (3.16), :class:`~gpnys.classify.likelihoods.BernoulliProbit`), any two labels, class
    probabilities and scikit-learn's classifier methods. Mixed in before the model (``class C(BernoulliClassifier,
    Model)``), whose constructor arguments the class lists, ``link`` in place of ``likelihood``.

    Labels: ``y`` holds exactly two distinct labels (numbers, strings, booleans), kept sorted as ``classes_``; the
    model's Bernoulli ``y`` is 1 for ``classes_[1]`` and 0 for ``classes_[0]`` (labels 0/1 stay as they are).
    ``predict`` returns labels of ``classes_``: a long tensor for a tensor ``X`` and numeric labels, else a numpy
    array."""

    _estimator_type = "classifier"
    link: str
    classes_: np.ndarray

    def _resolve_likelihood(self) -> LaplaceLikelihood:
        return resolve_likelihood(LINKS[validate_choice(self.link, "link", LINKS)])

    def _targets(self, y: Any, X: torch.Tensor) -> torch.Tensor:
        """Two labels ``y`` ``(n,)`` (a tensor, an array or a list) as the model's 0/1 (1: ``classes_[1]``) in
        ``X``'s dtype on its device; sets ``classes_``. A ``ValueError`` names ``y`` for another shape, NaN, labels
        that are not whole numbers (``"Unknown label type: continuous"``, as scikit-learn's classifiers say), and for
        one class or more than two."""
        n = X.shape[0]
        if isinstance(y, torch.Tensor):
            if y.dim() != 1 or y.shape[0] != n:
                raise ValueError(f"y must be a 1-D tensor of {n} observations, got {tuple(y.shape)}")
            if y.is_complex():
                raise ValueError(f"y must hold real labels, got {y.dtype}")
            if y.is_floating_point():
                if not bool(torch.isfinite(y).all()):
                    raise ValueError("y contains NaN or inf")
                if bool((y != y.round()).any()):
                    raise ValueError(f"y: Unknown label type: continuous (labels that are not whole numbers); "
                                     f"{type(self).__name__} takes two classes")
            classes = torch.unique(y)  # sorted
            self._two_classes(classes.numpy(force=True))
            positive = y == classes[-1]
        else:
            from sklearn.utils.multiclass import check_classification_targets
            from sklearn.utils.validation import column_or_1d

            try:
                arr = column_or_1d(y, warn=True)  # an (n, 1) column warns (DataConversionWarning) and is raveled
            except ValueError as exc:
                raise ValueError(f"y: {exc}") from exc
            if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
                raise ValueError("y contains NaN or inf")
            try:
                check_classification_targets(arr)
            except ValueError as exc:
                raise ValueError(f"y: {exc}") from exc
            if arr.shape[0] != n:
                raise ValueError(f"y must hold {n} labels (one a row of X), got {arr.shape[0]}")
            classes, inverse = np.unique(arr, return_inverse=True)
            self._two_classes(classes)
            positive = torch.from_numpy(inverse.reshape(-1) == 1)
        return positive.to(device=X.device, dtype=X.dtype)

    def _two_classes(self, classes: np.ndarray) -> None:
        """``classes_`` (sorted labels), or a ``ValueError`` naming ``y`` unless there are two."""
        name = type(self).__name__
        if len(classes) == 1:
            raise ValueError(f"y holds one class only ({classes.tolist()[0]!r}): {name} needs two")
        if len(classes) > 2:
            shown = ", ".join(repr(c) for c in classes.tolist()[:5]) + (", ..." if len(classes) > 5 else "")
            raise ValueError(f"y holds {len(classes)} classes ({shown}). Only binary classification is supported: "
                             f"{name} takes two labels")
        self.classes_ = classes
        self._label_values = None  # labels that a long tensor holds exactly (predict's output for tensor X)
        if classes.dtype.kind in "biuf":
            whole = classes.astype(np.int64)
            if bool((whole == classes).all()):
                self._label_values = torch.from_numpy(whole)

    def _labels(self, positive: torch.Tensor, tensor: bool) -> Any:
        index = positive.long()
        if tensor and self._label_values is not None:
            return self._label_values.to(index.device)[index]
        return self.classes_[index.numpy(force=True)]

    def predict_proba(self, X: Any) -> Any:
        """Class probabilities ``(m, 2)`` (columns: ``classes_[0]``, ``classes_[1]``; 0/1 for labels 0/1): the
        averaged predictive probability (R&W eq. (3.25)), for the logit link by MacKay's probit approximation
        ``σ(μ / √(1 + π v / 8))`` (R&W §3.4.2), for the probit link exactly, ``Φ(μ / √(1 + v))``."""
        mean, var, tensor = self._latent_at(X, True)
        with torch.no_grad():
            p1, _ = self.likelihood_.moments(mean, var)
        return as_output(torch.stack([1 - p1, p1], 1), tensor)

    def decision_function(self, X: Any) -> Any:
        """``(m,)``: the argument of the link in :meth:`predict_proba`, ``μ / √(1 + π v / 8)`` (logit) or
        ``μ / √(1 + v)`` (probit), so that ``P(classes_[1]) = σ(·)`` or ``Φ(·)``: it ranks the points as the
        probabilities do and has the sign of the latent mean ``μ`` (positive: ``classes_[1]``). ``predict_latent``
        gives ``μ`` and ``v``."""
        mean, var, tensor = self._latent_at(X, True)
        with torch.no_grad():
            return as_output(self.likelihood_.moderated(mean, var), tensor)

    def predict(self, X: Any) -> Any:  # type: ignore[override]
        """Labels ``(m,)`` of ``classes_``: ``classes_[1]`` where the latent mean is positive, the more probable class
        (R&W §3.4.2); no variance is computed. A long tensor for a tensor ``X`` (numeric labels), else a numpy
        array."""
        mean, _, tensor = self._latent_at(X, False)
        return self._labels(mean > 0, tensor)

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Accuracy of :meth:`predict` on ``X`` against ``y`` (scikit-learn's ``accuracy_score``, as its
        ``ClassifierMixin.score``)."""
        from sklearn.metrics import accuracy_score

        def array(v: Any) -> Any:
            return v.numpy(force=True) if isinstance(v, torch.Tensor) else v

        return float(accuracy_score(array(y), array(self.predict(X)), sample_weight=array(sample_weight)))


class LaplaceGPClassifier(BernoulliClassifier, LaplaceGP):
    """Laplace-approximate GP binary classifier (R&W §3.4): :class:`LaplaceGP` with the Bernoulli likelihood, class
    probabilities and labels, and a scikit-learn classifier (``clone``, ``Pipeline``, ``GridSearchCV``; ``classes_``,
    ``score``, ``decision_function``; numpy arrays or tensors in, the same kind out). ``link``: ``"logit"`` (R&W
    eq. (3.15), :class:`~gpnys.classify.likelihoods.Bernoulli`) or ``"probit"`` (eq. (3.16),
    :class:`~gpnys.classify.likelihoods.BernoulliProbit`). ``y``: any two labels (:class:`BernoulliClassifier`).
    Other arguments as :class:`LaplaceGP`'s; all are checked by :meth:`fit`.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.classify import LaplaceGPClassifier
        >>> g = torch.Generator().manual_seed(0)
        >>> X = torch.rand(80, 2, dtype=torch.float64, generator=g)
        >>> y = (X[:, 0] > 0.5).double()
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
        >>> kernel.base_kernel.lengthscale, kernel.outputscale = 0.3, 4.0
        >>> clf = LaplaceGPClassifier(kernel, num_probes=8).fit(X, y)
        >>> p = clf.predict_proba(X)
        >>> p.shape, bool(torch.allclose(p.sum(1), torch.ones(80, dtype=torch.float64)))
        (torch.Size([80, 2]), True)
        >>> bool((clf.predict(X) == y).double().mean() > 0.9)
        True
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, *, link: str = "logit", method: str = "afn",
                 precond_options: dict | None = None, cg_tolerance: float = 1e-8, max_newton: int = 50,
                 newton_tol: float = 1e-8, num_probes: int = 32, slq_tolerance: float = 1e-6, max_cg: int = 1000,
                 seed: int = 0, optimizer_steps: int = 0, lr: float = 0.1, group: Any = None) -> None:
        self.kernel, self.link, self.method, self.precond_options = kernel, link, method, precond_options
        self.cg_tolerance, self.max_newton, self.newton_tol = cg_tolerance, max_newton, newton_tol
        self.num_probes, self.slq_tolerance, self.max_cg, self.seed = num_probes, slq_tolerance, max_cg, seed
        self.optimizer_steps, self.lr, self.group = optimizer_steps, lr, group
