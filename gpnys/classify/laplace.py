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
import torch

from gpnys.checks import NumericalWarning, validate_choice, validate_count, validate_points, validate_positive
from gpnys.classify.likelihoods import LaplaceLikelihood, check_observations, resolve_likelihood
from gpnys.collectives import resolve_group
from gpnys.gp.discover import selected_kernel
from gpnys.gp.estimator import slq_terms
from gpnys.gp.settings import GP_DEFAULTS
from gpnys.kernels.entries import computation_dtype, evaluate, split_outputscale
from gpnys.kernels.operator import StationaryKernelOperator, supported
from gpnys.kernels.system import kernel_system
from gpnys.precond.cache import PointCache
from gpnys.precond.strategy import DIAG_PRECONDITIONERS, make_preconditioner
from gpnys.solvers.pcg import pcg

__all__ = ["LaplaceGP", "LaplaceGPClassifier", "LaplacePredictions", "BernoulliClassifier", "halve_step"]

#: the floor on ``W = π(1 - π)``: where a probability rounds to 0 or 1, ``W`` underflows and ``W⁻¹`` (the
#: preconditioner's shift) and ``W^{-½}`` would be infinite; clamping changes the Hessian used by a Newton step
#: there by at most this much (the mode, where the gradient vanishes, is unchanged) and ``log det B`` by about
#: ``1e-10 K_ii`` per clamped point; the latent variances see the clamped points as observed with noise ``1e10``
#: instead of none, a change of about ``K_ii² 1e-10`` (visible only with large outputscales)
W_FLOOR = 1e-10


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


def _floored_tolerance(tol: float, dtype: torch.dtype) -> float:
    """``tol``, at least :data:`TOLERANCE_EPS` machine epsilons of ``dtype``."""
    return max(tol, TOLERANCE_EPS * torch.finfo(dtype).eps)


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


class LaplacePredictions:
    """The predictions of a fitted Laplace model (:class:`LaplaceGP`, :class:`~gpnys.classify.ReducedLaplaceGP`)
    from its ``_latent(X, variance)``: the latent mean ``(m,)`` and, with ``variance``, the latent variance ``(m,)``
    (else ``None``) at points ``X`` ``(m, d)`` that :meth:`_check_points` accepted."""

    kernel: gpytorch.kernels.Kernel
    likelihood: LaplaceLikelihood

    def _copy_hyperparameters(self, X: torch.Tensor) -> torch.dtype:
        """Start a fit on ``X``: ``kernel_`` and ``likelihood_``, deep copies of the ``kernel`` and ``likelihood``
        given at construction (the likelihood's tensors in the computation dtype, on ``X``'s device), which the fit
        trains and the predictions read. The given objects are never modified, so every fit starts from them (as
        scikit-learn's estimators do). Returns the computation dtype."""
        self.kernel_ = copy.deepcopy(self.kernel)
        dtype = computation_dtype(self.kernel_, X)
        self.likelihood_ = copy.deepcopy(self.likelihood).to(dtype, X.device)
        return dtype

    def _check_points(self, Xs: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "f_hat_"):
            raise RuntimeError(f"{type(self).__name__}: call fit first")
        validate_points(Xs, "X")
        if Xs.shape[1] != self._X.shape[1]:
            raise ValueError(f"X must have {self._X.shape[1]} columns, got {Xs.shape[1]}")
        return Xs.to(self._X.dtype)

    def _latent(self, Xs: torch.Tensor, variance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def predict_latent(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent predictive mean and variance at ``X`` ``(m, d)``, each ``(m,)`` (the model's ``_latent``)."""
        return self._latent(self._check_points(X), True)

    def predict(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predictive mean and variance of the observation at ``X`` ``(m, d)``, each ``(m,)``, over the latent
        Gaussian, by the likelihood's ``moments``: for counts the log-normal mixture's
        (:meth:`~gpnys.classify.likelihoods.Poisson.moments`); for labels ``P(y = 1)`` by the probit approximation
        and its Bernoulli variance; for Student-t noise the latent mean and ``v + σ² ν / (ν − 2)``."""
        mean, var = self.predict_latent(X)
        with torch.no_grad():
            return self.likelihood_.moments(mean, var)


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
        cg_tolerance: relative residual of every CG solve with ``B`` (Newton steps and predictive variances),
            at least :data:`TOLERANCE_EPS` (100) machine epsilons of the working dtype (1.2e-5 in float32).
        max_newton: Newton steps at most. newton_tol: stop once a step changes no ``f_i`` by more than
            ``newton_tol * max(1, max|f|)``; floored like ``cg_tolerance`` (100 eps: the default 1e-8 is below
            what a float32 mode resolves). Newton also stops once a step moves ``f`` no less than the previous one
            while ``Ψ`` rises by no more than its rounding (the mode at this precision).
        num_probes: SLQ probes for ``log det B``. slq_tolerance: CG tolerance of the probe solves (their
            Lanczos tridiagonals). max_cg: CG iterations at most per solve.
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
        if not isinstance(kernel, gpytorch.kernels.Kernel):
            raise ValueError(f"kernel must be a GPyTorch kernel, got {type(kernel).__name__}")
        self.likelihood = resolve_likelihood(likelihood)
        validate_choice(method, "method", DIAG_PRECONDITIONERS)
        self.kernel, self.method = kernel, method
        self.precond_options = dict(precond_options or {})
        self.cg_tolerance = validate_positive(cg_tolerance, "cg_tolerance")
        self.newton_tol = validate_positive(newton_tol, "newton_tol")
        self.slq_tolerance = validate_positive(slq_tolerance, "slq_tolerance")
        self.max_newton = validate_count(max_newton, "max_newton", 1)
        self.num_probes = validate_count(num_probes, "num_probes", 2)
        self.max_cg = validate_count(max_cg, "max_cg", 1)
        self.seed = validate_count(seed, "seed", 0)
        self.optimizer_steps = validate_count(optimizer_steps, "optimizer_steps", 0)
        self.lr = validate_positive(lr, "lr")
        self.group = None if group is None or group is False else resolve_group(group)
        self._warned_kernel = False

    # ---- the pieces of B = I + W^½ K W^½ -------------------------------------------------------------------
    def _state(self, f: torch.Tensor, build: bool = True) -> None:
        """``W`` (clamped, see :data:`W_FLOOR`) and ``W^½`` at ``f``, and (``build``) the preconditioner
        ``P ≈ K̃ + W⁻¹/s²`` for them; without ``build`` the previous ``P`` stays (any SPD ``P`` keeps CG exact)."""
        self._W = self.likelihood_.derivatives(f, self._y)[1].clamp_min(W_FLOOR)
        self._sW = self._W.sqrt()
        if not build:
            return
        D = 1.0 / (self._W * self._s2)
        # the scalar level (rank estimate, Nyström's scaled form) is the median shift: the mean is dominated by
        # the confidently classified points' large W⁻¹
        n = self._X.shape[0]
        options = {**{key: min(v, n) for key, v in GP_DEFAULTS.get(self.method, {}).items()}, **self.precond_options}
        self._P = make_preconditioner(self.method, self._Xk, self._kernel, float(D.median()), cache=self._points,
                                      seed=self.seed, diag=D, group=self.group, **options)

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

    def _solve_B(self, R: torch.Tensor, tol: float, lanczos: bool = False):
        return pcg(self._B, R, self._M_inv, tol=tol, maxiter=self.max_cg, lanczos=lanczos)

    # ---- fit -----------------------------------------------------------------------------------------------
    def fit(self, X: torch.Tensor, y: torch.Tensor) -> "LaplaceGP":
        """Posterior mode (R&W Algorithm 3.1, Newton's method on eq. (3.18)) and log marginal likelihood
        (eq. (3.32)), after ``optimizer_steps`` Adam steps on the hyperparameters. ``X: (n, d)``, ``y: (n,)`` in the
        likelihood's support (0/1 or bool labels; counts). Returns ``self``."""
        yv = check_observations(X, y, self.likelihood)
        self._copy_hyperparameters(X)
        self._warned_kernel = False  # one warning a fit (_column_gradients)
        params = [p for p in self.kernel_.parameters() if p.requires_grad] + self.likelihood_.parameters()
        self.history_: list[dict] = []
        if self.optimizer_steps and not params:
            warnings.warn(f"{type(self).__name__}: optimizer_steps = {self.optimizer_steps} but neither the kernel nor "
                          "the likelihood has a trainable parameter; no step is taken", UserWarning, stacklevel=2)
        a0 = None
        if self.optimizer_steps and params:
            opt = torch.optim.Adam(params, lr=self.lr)
            for step in range(self.optimizer_steps):
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
        self._system = kernel_system(self._Xk, self._kernel, mu=1.0, group=self.group)  # K̃ V = system(V) - V
        self._points = PointCache(self._Xk)  # FPS order and kNN patterns, shared by every Newton step's build
        n = X.shape[0]
        # a warm start a0 (the previous hyperparameters' K⁻¹ f̂) gives f = K a0 and Ψ = log p(y|f) - ½ a0ᵀ f
        a = self._X.new_zeros(n) if a0 is None else a0.to(self._X.dtype)
        f = self._X.new_zeros(n) if a0 is None else self._K(a)
        psi = float(self.likelihood_.log_prob(f, self._y) - 0.5 * (a * f).sum())
        slack = 64 * torch.finfo(dtype).eps
        cg_tol, newton_tol = (_floored_tolerance(t, dtype) for t in (self.cg_tolerance, self.newton_tol))
        self.cg_iterations_: list[int] = []
        self.newton_iterations_ = 0
        self.builds_ = 0
        fresh = rate = None  # CG iterations per decade: of the first solve after the latest build, of the last
        first = None  # |r_0|, the first step's residual
        converged = False
        last = math.inf  # the previous step's largest change of f
        gains: list[float] = []  # Ψ's rise at each step
        for _ in range(self.max_newton):
            # the preconditioner is rebuilt for the new W only when CG has slowed by half since the last build
            # (a build costs about as much as a Newton step's solve)
            build = fresh is None or rate > REBUILD_GROWTH * fresh
            self._state(f, build)
            self.builds_ += build
            grad = self.likelihood_.derivatives(f, self._y)[0]  # ∇ log p(y|f)
            # R&W Algorithm 3.1 lines 5-7, a_new = b - W^½ B⁻¹ W^½ K b with b = W f + ∇, started at the previous
            # a: the step is da = W^½ B⁻¹ W^{-½} (∇ - a), solved inexactly (NEWTON_FORCING)
            rhs = (grad - a) / self._sW
            norm = float(rhs.norm())
            first = norm if first is None else first
            tol = max(cg_tol, min(NEWTON_FORCING, math.sqrt(norm / first) if first > 0 else 0.0))
            res = self._solve_B(rhs, tol)
            self.cg_iterations_.append(res.iterations)
            rate = res.iterations / -math.log10(tol)
            fresh = rate if build else fresh
            da = self._sW * res.x
            df = self._K(da)
            self.newton_iterations_ += 1
            # step halving while the objective Ψ = log p(y|f) - ½ aᵀf (Algorithm 3.1 line 8) decreases (a
            # safeguard; a and f = K a are linear in the step, so halving costs no product)
            halved = halve_step(lambda t: float(self.likelihood_.log_prob(f + t * df, self._y)
                                                - 0.5 * ((a + t * da) * (f + t * df)).sum()),
                                psi, slack * (abs(psi) + n))
            if halved is None:
                converged = True
                break  # no ascent left at this precision: the mode
            step, new = halved
            gains.append(new - psi)
            psi = new
            change = float((step * df).abs().max())
            a, f = a + step * da, f + step * df
            if change <= newton_tol * max(1.0, float(f.abs().max())):
                converged = True
                break
            if change >= last and gains[-1] <= slack * (abs(psi) + n):
                # the steps no longer shrink and Ψ no longer rises: the mode at this precision (rounding in the
                # solves; a flat Ψ, as Student-t noise of small df with far outliers gives, where Fisher scoring
                # would wander at Ψ's rounding for any number of steps), as ReducedLaplaceGP stops
                converged = True
                break
            last = change
        if not converged:  # not the mode: its Laplace approximation, and with it every figure below, is off
            self._warn_short(f, change, gains, slack * (abs(psi) + n))
        self._state(f)  # a fresh P at the mode: log det B's and the gradient's probes
        self.builds_ += 1
        self.f_hat_, self.a_ = f, a
        self._grad = self.likelihood_.derivatives(f, self._y)[0]
        logdet, se = self._logdet_B()  # keeps its probes and solves for _gradient
        self.log_marginal_likelihood_ = (float(-0.5 * (a * f).sum() + self.likelihood_.log_prob(f, self._y))
                                         - 0.5 * logdet)
        self.mll_std_error_ = 0.5 * se

    def _warn_short(self, f: torch.Tensor, change: float, gains: list[float], rounding: float) -> None:
        """The warning for Newton's method stopped at ``max_newton`` before the mode: the last step's change of
        ``f``, the mode's residual ``max|f − K∇log p(y|f)|`` (0 at the mode; one kernel product) and Ψ's rise over
        the last steps; raising ``max_newton`` is advised only while Ψ still rises above its ``rounding``."""
        residual = float((f - self._K(self.likelihood_.derivatives(f, self._y)[0])).abs().max())
        recent = gains[-5:]
        rise = sum(recent)
        advice = ("Ψ still rises: raise max_newton" if rise > len(recent) * rounding else
                  "Ψ no longer rises above its rounding, so more steps would not move f towards the mode; a larger "
                  "newton_tol accepts this f")
        warnings.warn(f"{type(self).__name__}: Newton's method stopped at max_newton = {self.max_newton} steps "
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
        n, t = self._X.shape[0], self.num_probes
        device = self._X.device
        gen = torch.Generator(device=device).manual_seed(self.seed)
        Z = math.sqrt(self._s2) * self._sW[:, None] * self._P.sample(t, generator=gen)
        res = self._solve_B(Z, self.slq_tolerance, lanczos=True)
        self._probes = (Z / self._sW[:, None], self._sW[:, None] * res.x)  # z ~ N(0, P̂) and (K + W⁻¹)⁻¹ z
        ell, _ = slq_terms(res.tridiagonal, res.iterations_per_column, n)
        exact = n * math.log(self._s2) + float(self._W.log().sum()) + float(self._P.logdet())
        return exact + float(ell.mean()), float(ell.std()) / math.sqrt(t)

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
                self._sW[:, None] * self._solve_B(s2 / self._sW[:, None], self.slq_tolerance).x)
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
        mean, se = rows.mean(0), rows.std(0) / math.sqrt(t)
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
                op = StationaryKernelOperator(X, s2, base.lengthscale, base=base, cache={}, group=self.group)
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
            res = self._solve_B(R, _floored_tolerance(self.cg_tolerance, self._X.dtype))
            return mean, (kss - (R * res.x).sum(0)).clamp_min(0)

    def predict_variance(self, X: torch.Tensor) -> torch.Tensor:
        """Latent predictive variance ``k(x*, x*) - k*ᵀ (K + W⁻¹)⁻¹ k*`` (R&W eq. (3.24)). ``X: (m, d)`` -> ``(m,)``"""
        return self._latent(self._check_points(X), True)[1]



class BernoulliClassifier:
    """Binary labels (0/1) for a Laplace model whose ``predict_latent`` gives latent means and variances: the
    Bernoulli likelihood with ``link`` ``"logit"`` (R&W eq. (3.15), :class:`~gpnys.classify.likelihoods.Bernoulli`)
    or ``"probit"`` (eq. (3.16), :class:`~gpnys.classify.likelihoods.BernoulliProbit`), and class probabilities.
    Mixed in before the model (``class C(BernoulliClassifier, Model)``), whose other arguments it passes on."""

    def __init__(self, kernel: gpytorch.kernels.Kernel, *, link: str = "logit", **kwargs) -> None:
        if "likelihood" in kwargs:
            raise ValueError(f"likelihood: {type(self).__name__} is Bernoulli; the model it extends takes other "
                             "likelihoods")
        if link not in ("logit", "probit"):
            raise ValueError(f"link must be 'logit' or 'probit', got {link!r}")
        self.link = link
        super().__init__(kernel, likelihood="bernoulli" if link == "logit" else "bernoulli_probit", **kwargs)

    def predict_proba(self, X: torch.Tensor) -> torch.Tensor:
        """Class probabilities ``(m, 2)`` (columns: class 0, class 1): the averaged predictive probability
        (R&W eq. (3.25)), for the logit link by MacKay's probit approximation ``σ(μ / √(1 + π v / 8))`` (R&W
        §3.4.2), for the probit link exactly, ``Φ(μ / √(1 + v))``."""
        mean, var = self.predict_latent(X)  # first: it raises for an unfitted model, which has no likelihood_
        with torch.no_grad():
            p1, _ = self.likelihood_.moments(mean, var)
        return torch.stack([1 - p1, p1], 1)

    def predict(self, X: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Labels ``(m,)`` (0/1, long): the sign of the latent mean, the more probable class (R&W §3.4.2); no
        variance is computed."""
        mean, _ = self._latent(self._check_points(X), False)
        return (mean > 0).long()


class LaplaceGPClassifier(BernoulliClassifier, LaplaceGP):
    """Laplace-approximate GP binary classifier (labels 0/1; R&W §3.4): :class:`LaplaceGP` with the Bernoulli
    likelihood, class probabilities and labels. ``link``: ``"logit"`` (R&W eq. (3.15),
    :class:`~gpnys.classify.likelihoods.Bernoulli`) or ``"probit"`` (eq. (3.16),
    :class:`~gpnys.classify.likelihoods.BernoulliProbit`). Other arguments as :class:`LaplaceGP`'s.

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
