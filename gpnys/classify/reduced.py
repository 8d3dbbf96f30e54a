"""Laplace-approximate GPs on a Nyström kernel: non-Gaussian likelihoods at ``O(n m s)`` a Newton step.

The prior is the rank-``s`` Nyström kernel ``K̃ = K_nm K_mm⁺ K_mn = Φ Φᵀ`` of ``m`` landmarks, ``Φ = K_nm A``,
``A = V_s Λ_s^{-½}`` from the eigendecomposition ``K_mm = V Λ Vᵀ`` ([SPA] Algorithm 1 step 3; [NSL] eq. (1)), that is
``f = Φ w`` with ``w ~ N(0, I_s)``: the LLA weight space ([SPA] §II-E) with a non-Gaussian likelihood in place of
the Gaussian one. The Laplace approximation (Rasmussen & Williams 2006, §3.4) runs in that weight space:

* the mode ``ŵ = argmax ψ(w)``, ``ψ(w) = log p(y|Φw) − ½|w|²``, by Newton's method with the ``s × s`` Hessian
  ``H = I + Φᵀ W Φ`` (``W = −∇∇ log p``) factored by Cholesky, with step halving on ``ψ``;
* ``log q(y|X) = log p(y|Φŵ) − ½|ŵ|² − ½ log det H``, which is R&W eq. (3.32) for ``K̃``: ``|ŵ|² = f̂ᵀ K̃⁺ f̂``
  and ``det(I + W^½ K̃ W^½) = det H`` (Sylvester's determinant identity);
* its gradient in the hyperparameters is exact for this model (no probes) and comes from autograd through two
  first-order substitutions: ``ŵ`` enters ``ψ`` held fixed (``∂ψ/∂w = 0`` at the mode) and enters ``log det H``
  through ``ŵ + H⁻¹ ∇_w ψ(ŵ; θ)``, whose derivative is the implicit one, ``dŵ/dθ = H⁻¹ ∂_θ ∇_w ψ`` (R&W §5.5.1
  in weight space); ``Φ`` enters with the derivative of ``K_nm V_s Λ_s^{-½}``: that of ``K_nm A (Aᵀ K_mm A)^{-½}``
  at fixed ``A`` within the kept eigen-directions, plus their turn towards the dropped ones, ``dV_s = V_⊥ M``,
  ``M_jk = v_jᵀ dK_mm v_k / (λ_k − λ_j)`` (first-order eigenvector perturbation; the truncated kernel has no
  derivative where a kept and a dropped eigenvalue meet);
* latent predictions ``μ* = φ*ᵀ ŵ`` and ``v* = φ*ᵀ H⁻¹ φ*`` (SoR), plus the projection residual
  ``k** − |φ*|² ≥ 0`` (DTC, the default), as :class:`~gpnys.reduced.lla.LLAPosterior`.

Cost: ``O(n m d)`` for ``K_nm``, ``O(n m s + m³)`` for ``Φ`` and ``O(n s² + s³)`` a Newton step; memory about two
``n × m`` buffers, nine while differentiating;
the exact engine (:class:`~gpnys.classify.LaplaceGP`) costs ``O(n²)`` a kernel product. Training may run on a
seeded subsample of the rows (``subsample``): the hyperparameters move on ``subsample`` rows, then the mode,
``log q`` and its gradient are computed on all of them.

[SPA]: W. Li, M. Liu and D. Zhang, "Geometric interpretation of running Nyström-based kernel machines and error
analysis". [NSL]: W. Li, M. Liu and D. Zhang, "Nyström subspace learning for large-scale SVMs".
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import gpytorch
import torch

from gpnys.checks import NumericalWarning, validate_choice, validate_count, validate_points
from gpnys.classify.laplace import (
    BernoulliClassifier,
    LaplacePredictions,
    at_mode,
    halve_step,
    warm_start_holds,
)
from gpnys.classify.likelihoods import LaplaceLikelihood
from gpnys.kernels.blocks import kernel_diag
from gpnys.landmarks.rules import METHODS, select
from gpnys.reduced.lla import VARIANCES, NystromFeatureMap

__all__ = ["ReducedLaplaceGP", "ReducedLaplaceClassifier"]

#: the default number of landmarks (at most n), as GPyTorch's usual SVGP inducing-point count
DEFAULT_M = 500


class ReducedLaplaceGP(LaplacePredictions):
    """Laplace-approximate GP on the rank-``s`` Nyström kernel ``K̃ = Φ Φᵀ`` (module docstring): the mode, ``log q``
    (R&W eq. (3.32) for ``K̃``) and its exact gradient, with ``"bernoulli"`` (0/1 labels, logistic link),
    ``"bernoulli_probit"``, ``"poisson"`` or ``"studentt"`` likelihoods (:mod:`gpnys.classify.likelihoods`).

    A scikit-learn estimator as :class:`~gpnys.classify.LaplaceGP` is (``clone``; arguments checked by :meth:`fit`;
    tensors or numpy arrays in, the same kind out).

    Args:
        kernel: a GPyTorch kernel (outputscale included); its trainable parameters (and the likelihood's) are trained
            with ``optimizer_steps > 0``, on deep copies (``kernel_``, ``likelihood_``) made at every fit: the objects
            given are never modified.
        likelihood: a name in :data:`~gpnys.classify.likelihoods.LIKELIHOODS` or a
            :class:`~gpnys.classify.likelihoods.LaplaceLikelihood`.
        m: landmarks (default ``min(500, n)``, or the rows of a ``landmarks`` tensor); at most n.
        landmarks: a rule of :func:`gpnys.landmarks.select` (``"kmeans"``, ``"fps"``, ``"uniform"``), chosen once on
            the training rows, or an ``(m, d)`` tensor of landmarks.
        rank: keep the top ``rank`` eigen-directions of ``K_mm`` ([NSL] truncation); default: every one above
            ``rtol``. rtol: the eigenvalue cut-off relative to the largest (default ``√ε`` of the working precision:
            directions that carry less than that share of ``K_mm`` are dropped, and kept ones are well conditioned
            for the gradient; ``rank_`` and ``dropped_`` report the result).
        variance: ``"dtc"`` (default) or ``"sor"`` latent predictive variances (module docstring).
        max_newton: Newton steps at most. newton_tol: stop once a step changes no ``f_i`` by more than
            ``newton_tol * max(1, max|f|)``.
        optimizer_steps: Adam steps on ``-log q / n`` before the final fit (0: keep the hyperparameters); each
            step's Newton iteration starts at the previous mode. lr: Adam's learning rate. subsample: train on this
            many seeded rows (``None``: all rows); the final mode, ``log q`` and gradient use every row.
        seed: seeds the landmark rule and the subsample (same seed and device, same results).

    Attributes (after :meth:`fit`):
        kernel_, likelihood_: the kernel and likelihood of the fit, copies of ``kernel`` and ``likelihood`` with the
            trained hyperparameters (``optimizer_steps > 0``); the predictions use them.
        landmarks_: ``(m, d)``. rank_: kept directions ``s``. dropped_: ``m − s``, the directions not kept.
        n_features_in_: the columns of ``X``.
        w_: ``(s,)`` the mode in weight space. f_hat_: ``(n,)`` the latent mode ``Φ ŵ``.
        log_marginal_likelihood_: float. mll_gradient_: ``{raw parameter name: tensor}``, ``∂ log q / ∂θ``.
        newton_iterations_: int (the final fit). history_: one ``{"step", "log_marginal_likelihood",
        "newton_iterations"}`` per Adam step (on the training rows of that step).

    Example:
        >>> import gpytorch, torch

        Regression with Student-t noise, robust to a few outliers:

        >>> from gpnys.classify import ReducedLaplaceGP, StudentT
        >>> g = torch.Generator().manual_seed(0)
        >>> X = torch.rand(500, 1, dtype=torch.float64, generator=g)
        >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(500, dtype=torch.float64, generator=g)
        >>> y[::25] += 3.0                                      # 4 % outliers
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> kernel.base_kernel.lengthscale = 0.2
        >>> likelihood = StudentT(df=4.0, scale=0.1)
        >>> gp = ReducedLaplaceGP(kernel, likelihood=likelihood, m=40, landmarks="fps").fit(X, y)
        >>> mean, _ = gp.predict(X)
        >>> bool((mean - torch.sin(6 * X[:, 0])).abs().max() < 0.2)
        True
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, *, likelihood: str | LaplaceLikelihood = "bernoulli",
                 m: int | None = None, landmarks: str | torch.Tensor = "kmeans", rank: int | None = None,
                 rtol: float | None = None, variance: str = "dtc", max_newton: int = 50, newton_tol: float = 1e-8,
                 optimizer_steps: int = 0, lr: float = 0.1, subsample: int | None = None, seed: int = 0) -> None:
        self.kernel, self.likelihood, self.m, self.landmarks, self.rank, self.rtol = (kernel, likelihood, m, landmarks,
                                                                                     rank, rtol)
        self.variance, self.max_newton, self.newton_tol = variance, max_newton, newton_tol
        self.optimizer_steps, self.lr, self.subsample, self.seed = optimizer_steps, lr, subsample, seed

    def _settings(self) -> None:
        """Check the constructor's arguments (at :meth:`fit`, as scikit-learn does) and keep them, as numbers, in
        private attributes that the fit reads; a ``ValueError`` names a bad one."""
        landmarks, m = self.landmarks, self.m
        if isinstance(landmarks, torch.Tensor):
            validate_points(landmarks, "landmarks")
            if m is not None and m != landmarks.shape[0]:
                raise ValueError(f"m = {m} disagrees with the {landmarks.shape[0]} landmarks given; leave m out")
        else:
            validate_choice(landmarks, "landmarks", METHODS, also="or an (m, d) tensor")
        self._landmarks_rule = landmarks
        self._variance = validate_choice(self.variance, "variance", VARIANCES)
        self._m = None if m is None else validate_count(m, "m", 1)
        self._rank = None if self.rank is None else validate_count(self.rank, "rank", 1)
        self._rtol = None
        if self.rtol is not None:
            try:
                self._rtol = float(self.rtol)
            except (TypeError, ValueError):
                self._rtol = math.nan
            if not 0 < self._rtol < 1:
                raise ValueError(f"rtol must be in (0, 1), got {self.rtol!r}")
        self._subsample = None if self.subsample is None else validate_count(self.subsample, "subsample", 1)
        self._newton_and_training_settings()

    # ---- fit -----------------------------------------------------------------------------------------------
    def fit(self, X: Any, y: Any) -> "ReducedLaplaceGP":
        """Landmarks, ``optimizer_steps`` Adam steps on the hyperparameters, then the mode, ``log q`` and its gradient
        on every row. ``X: (n, d)``, ``y: (n,)`` in the likelihood's support, tensors or arrays. Checks the
        constructor's arguments first. Returns ``self``."""
        self._settings()
        X, y, likelihood = self._prepare(X, y)
        n = X.shape[0]
        dtype = self._copy_hyperparameters(X, likelihood)
        X, y = X.to(dtype), y.to(dtype)
        if self._subsample is not None and self._subsample > n:
            raise ValueError(f"subsample must be <= n = {n}, got {self._subsample}")
        self.landmarks_ = self._landmarks(X)
        params = [p for p in self.kernel_.parameters() if p.requires_grad] + self.likelihood_.parameters()
        self.history_: list[dict] = []
        if self._optimizer_steps and not params:
            warnings.warn(f"{type(self).__name__}: optimizer_steps = {self._optimizer_steps} but neither the kernel "
                          "nor the likelihood has a trainable parameter; no step is taken", UserWarning, stacklevel=2)
        beta = None  # the last mode as landmark coefficients A ŵ: a warm start in any later basis
        if self._optimizer_steps and params:
            rows = X, y
            if self._subsample is not None and self._subsample < n:
                gen = torch.Generator(device=X.device).manual_seed(self._seed)
                idx = torch.randperm(n, generator=gen, device=X.device)[: self._subsample]
                rows = X[idx], y[idx]
            opt = torch.optim.Adam(params, lr=self._lr)
            for step in range(self._optimizer_steps):
                log_q, beta, iterations = self._evaluate(*rows, beta, differentiable=True)
                self.history_.append({"step": step, "log_marginal_likelihood": float(log_q.detach()),
                                      "newton_iterations": iterations})
                opt.zero_grad()
                (-log_q / rows[0].shape[0]).backward()
                opt.step()
            beta = beta if rows[0] is X else None  # the subsample's mode is no start for every row's
        log_q, _, self.newton_iterations_ = self._evaluate(X, y, beta, differentiable=bool(params))
        self.log_marginal_likelihood_ = float(log_q.detach())
        named = [(name, p) for name, p in self.kernel_.named_parameters() if p.requires_grad]
        named += self.likelihood_.named_parameters()
        grads = torch.autograd.grad(log_q, [p for _, p in named], allow_unused=True) if named else ()
        self.mll_gradient_ = {name: (torch.zeros_like(p) if g is None else g).detach()
                              for (name, p), g in zip(named, grads)}
        with torch.no_grad():
            self.f_hat_ = self._Phi @ self.w_
        self._X, self._y = X, y
        if self.newton_iterations_ >= self._max_newton:
            warnings.warn(f"{type(self).__name__}: Newton's method stopped at max_newton = {self._max_newton} steps "
                          "before the mode moved less than newton_tol", NumericalWarning, stacklevel=2)
        return self

    def _landmarks(self, X: torch.Tensor) -> torch.Tensor:
        given = self._landmarks_rule
        if isinstance(given, torch.Tensor):
            if given.shape[1] != X.shape[1]:
                raise ValueError(f"landmarks must have d = {X.shape[1]} columns like X, got {given.shape[1]}")
            if given.shape[0] > X.shape[0]:
                raise ValueError(f"landmarks: m = {given.shape[0]} exceeds n = {X.shape[0]}")
            return given.to(X)
        m = min(DEFAULT_M, X.shape[0]) if self._m is None else self._m
        if m > X.shape[0]:
            raise ValueError(f"m must be <= n = {X.shape[0]}, got {m}")
        return select(X, m, method=given, seed=self._seed)[0]

    def _features(self) -> NystromFeatureMap:
        """The Nyström map at the current hyperparameters (its ``A`` without autograd); a cut-off is by design here
        (``rtol``), so its warning is not raised at every step."""
        C = self.landmarks_
        rtol = math.sqrt(torch.finfo(C.dtype).eps) if self._rtol is None else self._rtol
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumericalWarning)
            fmap = NystromFeatureMap(self.kernel_, C, rank=self._rank, rtol=rtol)
        self.rank_, self.dropped_ = fmap.s, C.shape[0] - fmap.s
        return fmap

    def _evaluate(self, X: torch.Tensor, y: torch.Tensor, beta0: torch.Tensor | None,
                  differentiable: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(log q, A ŵ, Newton steps)`` on the rows ``X``, ``y``, Newton started at the landmark coefficients
        ``beta0`` (``A ŵ`` of an earlier basis; ``None``: zero); ``log q`` carries the exact gradient when
        ``differentiable`` (module docstring); keeps ``ŵ`` as ``w_``."""
        fmap = self._features()
        A, C, s = fmap.A, self.landmarks_, fmap.s
        with torch.set_grad_enabled(differentiable):
            K_nm = self.kernel_(X, C).to_dense()
            Phi = K_nm @ A
            Q = self.kernel_(C, C).to_dense()
            if differentiable:
                # value K_nm A; derivative that of K_nm V_s Λ_s^{-½}: within the kept eigen-directions that of
                # K_nm A (Aᵀ K_mm A)^{-½} at fixed A, and their turn towards the dropped ones, dV_s = V_⊥ M with
                # M_jk = v_jᵀ dK_mm v_k / (λ_k − λ_j) (first-order eigenvector perturbation)
                dQ = Q - Q.detach()
                S = A.mT @ dQ @ A
                Phi = Phi - 0.5 * Phi.detach() @ S
                if s < C.shape[0]:
                    lam = fmap.eigenvalues.to(A)
                    V_kept, V_drop = (fmap.eigenvectors[:, :s].to(A), fmap.eigenvectors[:, s:].to(A))
                    M = (V_drop.mT @ dQ @ V_kept) / (lam[:s][None, :] - lam[s:][:, None])
                    Phi = Phi + (K_nm.detach() @ V_drop) @ M / lam[:s].sqrt()
        P = Phi.detach()
        w0 = None if beta0 is None else A.mT @ (Q.detach() @ beta0)  # Aᵀ K_mm A = I: the same f in this basis
        w, iterations = self._mode(P, y, w0)
        lik = self.likelihood_
        with torch.no_grad():
            L = self._cholesky_H(P, lik.derivatives(P @ w, y)[1])
        with torch.set_grad_enabled(differentiable):
            if differentiable:  # ŵ + H⁻¹ ∇_w ψ(ŵ; θ): value ŵ, derivative dŵ/dθ (implicit function theorem)
                grad_w = Phi.mT @ lik.derivatives(Phi @ w, y)[0] - w
                w_theta = w + torch.cholesky_solve(grad_w[:, None], L)[:, 0]
                L_theta = self._cholesky_H(Phi, lik.derivatives(Phi @ w_theta, y)[1])
            else:
                L_theta = L
            log_q = lik.log_prob(Phi @ w, y) - 0.5 * (w @ w) - L_theta.diagonal().log().sum()
        self._fmap, self._Phi, self._L, self.w_ = fmap, P, L, w
        return log_q, A @ w, iterations

    @staticmethod
    def _cholesky_H(Phi: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """The Cholesky factor of ``H = I + Φᵀ W Φ`` (``s × s``, ``H ⪰ I``)."""
        H = Phi.mT @ (W[:, None] * Phi)
        H.diagonal().add_(1.0)
        return torch.linalg.cholesky(H)

    def _mode(self, Phi: torch.Tensor, y: torch.Tensor, w0: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """Newton's method on ``ψ(w) = log p(y|Φw) − ½|w|²`` from ``w0`` (the previous step's mode) where ``ψ(w0)`` is
        finite and at least ``ψ(0) = log p(y|0)`` and ``W`` is finite there, else from zero (the cold start)."""
        lik = self.likelihood_
        s = Phi.shape[1]
        eps = torch.finfo(Phi.dtype).eps
        tol = max(self._newton_tol, 64 * eps)  # a float32 mode does not settle below its rounding
        # ψ in at least float64 from the iterates, with the iterates' own rounding as its slack, 64 eps (|w|² +
        # |∇log p ∘ f|) (a 2-norm: the roundings' signs are independent; the 1-norm let Student-t steps of df = 1.5
        # lower ψ by 1e-3 and stop f 0.6 % from the mode in float32). A slack of 64 eps (|ψ| + n) was 3e-3 in
        # float32 at n = 400 where separable labels leave ψ at -0.08, and Newton stopped with f 34-67 % from the
        # mode, log q and the gradient far off, and no warning
        wide = torch.promote_types(Phi.dtype, torch.float64)
        y_wide = y.to(wide)

        def psi_at(w_t: torch.Tensor, f_t: torch.Tensor) -> float:
            w_t = w_t.to(wide)
            return float(lik.log_prob(f_t.to(wide), y_wide) - 0.5 * (w_t @ w_t))

        with torch.no_grad():
            w, f = Phi.new_zeros(s), Phi.new_zeros(Phi.shape[0])
            psi = psi_at(w, f)  # ψ(0) = log p(y|0): the cold start
            if w0 is not None:  # the warm start where it holds (else H's Cholesky can fail)
                f0 = Phi @ w0
                psi0 = psi_at(w0, f0)
                if warm_start_holds(psi0, psi, lik, f0, y):
                    w, f, psi = w0, f0, psi0
            iterations, last = 0, math.inf
            for _ in range(self._max_newton):
                g, W, _ = lik.derivatives(f, y)
                slack = 64 * eps * float((w @ w) + (g * f).norm())
                L = self._cholesky_H(Phi, W)
                dw = torch.cholesky_solve((Phi.mT @ g - w)[:, None], L)[:, 0]
                df = Phi @ dw
                iterations += 1
                halved = halve_step(lambda t: psi_at(w + t * dw, f + t * df), psi, slack)
                if halved is None:
                    break  # no ascent left at this precision: the mode
                step, psi_new = halved
                change = float((step * df).abs().max())
                w, f = w + step * dw, f + step * df
                gain, psi = psi_new - psi, psi_new
                if at_mode(change, last, gain, slack, tol, float(f.abs().max())):
                    break
                last = change
        return w, iterations

    # ---- predictions (LaplacePredictions) -----------------------------------------------------------------
    def _latent(self, X: torch.Tensor, variance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Latent mean ``φ*ᵀ ŵ`` and variance ``φ*ᵀ H⁻¹ φ*`` (+ ``k** − |φ*|²`` for DTC)."""
        X = X.to(self._X.device)
        with torch.no_grad():
            phi = self._fmap(X)
            mean = phi @ self.w_
            if not variance:
                return mean, None
            v = torch.linalg.solve_triangular(self._L, phi.mT, upper=False)
            var = v.square().sum(0)
            if self._variance == "dtc":
                var = var + (kernel_diag(self.kernel_, X) - phi.square().sum(1)).clamp_min(0.0)
            return mean, var


class ReducedLaplaceClassifier(BernoulliClassifier, ReducedLaplaceGP):
    """Laplace GP binary classifier on the Nyström kernel: :class:`ReducedLaplaceGP` with the Bernoulli likelihood,
    class probabilities and labels, and a scikit-learn classifier as
    :class:`~gpnys.classify.LaplaceGPClassifier` is (``clone``, ``Pipeline``, ``GridSearchCV``; ``classes_``,
    ``score``, ``decision_function``; any two labels). ``link``: ``"logit"`` (R&W eq. (3.15)) or ``"probit"``
    (eq. (3.16)). Other arguments as :class:`ReducedLaplaceGP`'s; all are checked by :meth:`fit`.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.classify import ReducedLaplaceClassifier
        >>> g = torch.Generator().manual_seed(0)
        >>> X = torch.rand(400, 2, dtype=torch.float64, generator=g)
        >>> y = (X[:, 0] > 0.5).double()
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
        >>> kernel.base_kernel.lengthscale, kernel.outputscale = 0.3, 4.0
        >>> clf = ReducedLaplaceClassifier(kernel, m=40, optimizer_steps=5).fit(X, y)
        >>> p = clf.predict_proba(X)
        >>> p.shape, bool(torch.allclose(p.sum(1), torch.ones(400, dtype=torch.float64)))
        (torch.Size([400, 2]), True)
        >>> bool((clf.predict(X) == y).double().mean() > 0.9)
        True
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, *, link: str = "logit", m: int | None = None,
                 landmarks: str | torch.Tensor = "kmeans", rank: int | None = None, rtol: float | None = None,
                 variance: str = "dtc", max_newton: int = 50, newton_tol: float = 1e-8, optimizer_steps: int = 0,
                 lr: float = 0.1, subsample: int | None = None, seed: int = 0) -> None:
        self.kernel, self.link, self.m, self.landmarks, self.rank, self.rtol = kernel, link, m, landmarks, rank, rtol
        self.variance, self.max_newton, self.newton_tol = variance, max_newton, newton_tol
        self.optimizer_steps, self.lr, self.subsample, self.seed = optimizer_steps, lr, subsample, seed
