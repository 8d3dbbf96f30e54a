"""Predictions of a model under the training hook: the PCG predictive mean and variances with a per-point error
bound (:meth:`HookPrediction.predict`), without GPyTorch's dense ``n x n`` prediction cache."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Callable

import gpytorch
import torch

from gpnys.budget import block_rows
from gpnys.checks import validate_test_points
from gpnys.gp.discover import same_points, training_kernel
from gpnys.gp.posterior import PCGPosterior
from gpnys.gp.training import eval_mode
from gpnys.gp.training import predict as exact_predict
from gpnys.gp.variance import ROUNDING_FACTOR, LocalVariance, rounding_error
from gpnys.kernels.entries import difference_entries
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.landmarks import select
from gpnys.linalg import draw, safe_cholesky
from gpnys.precond.afn import AFNPreconditioner
from gpnys.solvers.pcg import ConvergenceWarning, PCGResult, pcg

#: landmarks of :class:`~gpnys.gp.variance.LocalVariance` when the preconditioner has none (FSAI, pivoted Cholesky,
#: a sketched Nyström): the AFN default's k.
VARIANCE_LANDMARKS = 500

#: the mean's weights take one step of iterative refinement, a PCG solve on their residual to this relative
#: tolerance; the means' error estimates hold the products' rounding in this many draws of random signs, from a
#: generator of this seed (:meth:`HookPrediction._mean_weights`, :func:`mean_bound`)
MEAN_REFINE_TOL, MEAN_ROUNDING_SIGNS, MEAN_ROUNDING_SEED = 0.1, 4, 7919

__all__ = ["HookPrediction"]


class HookPrediction:
    """The prediction half of :class:`gpnys.gp.problem.TrainingProblem` (a mixin: it uses the problem's ``system``,
    ``stationary_operator``, ``kernel``, ``sync_data`` and ``settings``); ``hook.predict`` reads it.

    Attributes (of the latest :meth:`predict`): variance_method_used; variance_bound ``(m,)``; mean_bound ``(m,)``;
    variance_iterations (PCG iterations of the variance solves); prediction_time ``{"total_s", "variance_s"}``.
    """

    variance_method_used: str | None = None
    variance_bound: torch.Tensor | None = None
    mean_bound: torch.Tensor | None = None
    variance_iterations: int = 0
    prediction_time: Mapping[str, float] = MappingProxyType({})
    _warned_variance = False  # one warning for variance_method="cholesky" without the dense kernel

    def predict(self, test_x: torch.Tensor, variance: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Predictive mean and variance of ``y`` (noise included) at ``test_x (m, d)``: ``((m,), (m,))``.

        The mean is ``m(x) + k_x^T K̂^{-1} (y - m(X))``, one PCG solve with this preconditioner (relative
        residual 1e-6 in float64, 1e-5 in float32; GPyTorch's own prediction cache would form the dense
        ``n x n`` kernel), then test points in blocks of the memory budget. ``mean_bound`` ``(m,)`` estimates its
        error (:func:`mean_bound`): the weights' error ``K̂⁻¹ρ`` for their residual ``ρ = y - m(X) - K̂ α̂``
        (estimated as ``P̂⁻¹ρ / λ̂``; by the Cholesky factor on the exact path) seen through ``k_x``, plus the
        rounding of ``k_xᵀα̂``. An estimate: the rigorous ``sqrt(k(x, x)) ||ρ|| / sqrt(min σ²)`` is about 1 000
        times wider in float32 (docs/accuracy.md). The variance
        ``k(x, x) - k_x^T K̂^{-1} k_x + noise`` comes with a per-point error bound, ``variance_bound`` ``(m,)``,
        by one of (``settings.variance_method``; the choice is kept in ``variance_method_used``):

        * ``"pcg"``: the ``m`` systems ``K̂ B = K(X, test_x)`` by :func:`gpnys.solvers.pcg.pcg` with this
          preconditioner (warm start ``P̂^{-1} k_x``, tolerance ``settings.variance_tolerance``, column blocks of
          ``settings.variance_block``). The variational form ``2 b^T x - x^T K̂ x = b^T K̂^{-1} b - ||e||^2_K̂`` is
          second order in the error, bounded by ``||r||² / min σ²``. Cost ``~ 2 n^2 m`` per iteration.
        * ``"cholesky"``: one Cholesky of ``K̂``, ``n^3/3 + n^2 m`` flops; only offered when the dense kernel is
          already cached (it needs one more ``n x n`` buffer). Bound: the rounding estimate
          :func:`~gpnys.gp.variance.rounding_error` (float32's eps makes it matter).
        * ``"cached"``: :class:`gpnys.gp.variance.LocalVariance`, a landmark root built once plus a local
          correction per point, ``O(n k^2)`` once and ``O(n k)`` per point; approximate, with the bound of that
          class. With ``settings.variance_rel_error`` set, points whose bound exceeds that share of their variance
          are recomputed by ``"pcg"``.
        * ``"auto"``: ``"cached"`` when it costs under a tenth of the cheaper exact method (:func:`_choose`), else
          that exact method.

        Where the hook's evaluations take the Cholesky path (:mod:`gpnys.gp.path`), ``"auto"`` and ``"cholesky"``
        predict from one dense factor; an explicit ``"pcg"`` or ``"cached"`` is honoured.

        A model whose kernel does not see the training inputs as given (a ``forward`` that transforms x, a kernel
        with ``active_dims``), and on the Cholesky path a batched or multi-output model, gets GPyTorch's own
        prediction: ``variance_bound`` and ``mean_bound`` are then ``None`` (no bound). ``prediction_time``:
        ``{"total_s", "variance_s"}`` of the latest call (the variances alone: cache, evaluation, solves).
        GPyTorch's LOVE is not used: its variances were too far off (docs/accuracy.md, "Predictive variances with
        error bounds").

        Example:
            Against the Cholesky prediction (:func:`gpnys.gp.predict`), variances by PCG:

            >>> import gpytorch, torch
            >>> from gpnys.gp import ExactGPModel, predict
            >>> from gpnys.gp.settings import EstimatorSettings
            >>> from gpnys.gp.hook import use_preconditioner
            >>> _ = torch.manual_seed(0)
            >>> X = torch.rand(200, 2, dtype=torch.float64)
            >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64)
            >>> model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
            >>> X_test = torch.rand(30, 2, dtype=torch.float64)
            >>> with use_preconditioner(model, "auto", settings=EstimatorSettings(variance_method="pcg")) as hook:
            ...     mean, var = hook.predict(X_test)
            >>> mean_ref, var_ref = predict(model, X_test)
            >>> torch.allclose(mean, mean_ref, rtol=1e-5), torch.allclose(var, var_ref, rtol=1e-3)
            (True, True)
            >>> bool(((var - var_ref).abs() <= hook.variance_bound + 1e-12).all())  # within the reported bound
            True
        """
        self.sync_data()  # training data set since the last evaluation: the caches start afresh on it
        T, shape = self._test_points(test_x)
        self.variance_method_used, self.variance_bound, self.mean_bound, self.variance_iterations = None, None, None, 0
        t_start = time.perf_counter()
        with eval_mode(self.model):  # the caller's training loop goes on in the mode it had
            mean, var, t_var = self._predict(T, variance)
        self.prediction_time = {"total_s": time.perf_counter() - t_start, "variance_s": t_var}
        if shape is None:
            return mean, var
        if self.variance_bound is not None:
            self.variance_bound = self.variance_bound.reshape(shape)
        if self.mean_bound is not None:
            self.mean_bound = self.mean_bound.reshape(shape)
        return mean.reshape(shape), (None if var is None else var.reshape(shape))

    def _test_points(self, test_x: torch.Tensor) -> tuple[torch.Tensor, torch.Size | None]:
        """``test_x`` checked against the training inputs ``(n, d)`` (a ``ValueError`` naming it), as ``(m, d)``
        points and the batch shape to give the results (``None``: ``(m,)`` as given). A 1-D ``test_x`` of a model
        on one input dimension is ``m`` points, as in GPyTorch; ``(..., m, d)`` points are predicted as one set (each
        marginal is its own point's). A batch-mode model's ``test_x`` goes on as given."""
        X = self.model.train_inputs[0]
        test_x = validate_test_points(test_x, X)
        if X.dim() != 2 or test_x.dim() == 2:
            return test_x, None
        return test_x.reshape(-1, X.shape[-1]), test_x.shape[:-1]

    def _predict(self, test_x: torch.Tensor, variance: bool) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """:meth:`predict`, with the model and its likelihood in eval mode: the means, the variances (or ``None``)
        and the seconds spent on the variances alone."""
        model, lik = self.model, self.model.likelihood
        X = model.train_inputs[0]
        try:
            kernel = self.kernel if X.dim() == 2 else None
        except ValueError:  # a covariance that is not one kernel call: GPyTorch's path below
            kernel = None
        usable = kernel is None or self.hyperparameters_usable(kernel)  # a ValueError naming a bad one
        exact = self.settings.variance_method in ("auto", "cholesky") or not variance  # "pcg" / "cached" asked for
        if usable and exact and self.paths.choose()[0] == "cholesky":  # small n: one Cholesky (gpnys.gp.path)
            self.variance_method_used = "cholesky"
            own = self._exact_moments(test_x, variance)
            if own is None:  # GPyTorch's exact prediction, without bounds
                mean, var = exact_predict(model, test_x)
            else:
                mean, self.mean_bound, var, self.variance_bound = own
            return mean, (var if variance else None), 0.0
        kx = None if X.dim() != 2 else (self.kernels.inputs if self.kernels.inputs is not None
                                         else self._discovered_inputs())
        op = self.stationary_operator(X) if kx is not None and usable else None
        if op is None or not same_points(kx, X):
            # GPyTorch's own path, under the caller's settings: a forward that transforms x, a kernel without
            # gpnys's operator, a batch-mode model, an outputscale of 0 (K̂ = σ² I)
            with torch.no_grad():
                if not variance:
                    with gpytorch.settings.skip_posterior_variances(True):
                        return lik(model(test_x)).mean, None, 0.0
                self.variance_method_used = "gpytorch"
                pred = lik(model(test_x))
                return pred.mean, pred.variance, 0.0
        with torch.no_grad(), self.settings.context():
            noise = self.noise().detach()
            n, m = X.shape[0], test_x.shape[0]
            alpha, lam, iters, correction = self._mean_weights(X)
            t_var = 0.0  # seconds spent on the variances alone (cache, evaluation, solves)
            # test-point blocks: (n, b) kernel columns within the memory budget (GPyTorch holds a few copies)
            block = min(self.settings.variance_block, max(64, block_rows(n, parts=4, device=X.device)))
            if not variance:
                parts = [_mean_block(model, kernel, X, T, alpha, correction)[1:] for T in test_x.split(block)]
                self.mean_bound = torch.cat([err for _, err in parts])
                return torch.cat([mean for mean, _ in parts]), None, 0.0
            method = self.settings.variance_method
            t0 = time.perf_counter()
            if method == "cholesky" and op._dense() is None:
                method = "pcg"  # Cholesky needs the cached dense kernel: the exact PCG variances instead
                if not self._warned_variance:
                    self._warned_variance = True
                    warnings.warn("gpnys: variance_method='cholesky' needs the dense kernel cached, which this model "
                                  "does not hold (the memory budget at this n, a process group, or the GPU's fused "
                                  "kernels): the variances are solved by PCG", RuntimeWarning, stacklevel=4)
            if method in ("auto", "cached"):
                Z = self._variance_landmarks(op)
                if method == "auto":
                    cached = LocalVariance.flops(n, Z.numel(), X.shape[1], m, self.settings.variance_neighbours)
                    method = _choose(n, m, iters, op._dense() is not None, cached)
                if method == "cached":
                    P, s2 = self.preconditioner()
                    inner = P.chosen
                    quad = ((lambda C: inner.schur_quad(C[inner.rest_idx]) / s2)
                            if isinstance(inner, AFNPreconditioner) and Z is inner.landmark_idx else None)
                    cache = LocalVariance(op.X, kernel, noise, Z, lambda R: P.solve(R) / s2, lam,
                                          self.settings.variance_neighbours, quad)
            self.variance_method_used = method
            solve = self._cholesky_quad(op, noise) if method == "cholesky" else self._pcg_quad(X, noise)
            t_var += time.perf_counter() - t0
            means, mean_bounds, out, bounds = [], [], [], []
            for T in test_x.split(block):
                Kxt, mean, err = _mean_block(model, kernel, X, T, alpha, correction)  # Kxt: (n, b)
                kxx = kernel(T, diag=True)
                means.append(mean)
                mean_bounds.append(err)
                t0 = time.perf_counter()
                if method == "cached":
                    est = cache(T, kxx)
                    var, bound = est.variance, est.bound
                    tol = self.settings.variance_rel_error
                    redo = (bound > tol * var) if tol is not None else torch.zeros_like(var, dtype=torch.bool)
                    if bool(redo.any()):
                        # per-column PCG tolerance whose bound ||r||² / min σ² meets the request
                        Bc = Kxt[:, redo]
                        need = (tol * var[redo] * noise.min()).sqrt() / Bc.norm(dim=0).clamp_min(1e-300)
                        q, b = solve(Bc, need.clamp_max(self.settings.variance_tolerance))
                        var, bound = var.clone(), bound.clone()
                        var[redo], bound[redo] = _latent_variance(kxx[redo], q), b
                else:
                    q, bound = solve(Kxt)
                    var = _latent_variance(kxx, q)
                out.append(var)
                bounds.append(bound)
                t_var += time.perf_counter() - t0
        self.variance_bound, self.mean_bound = torch.cat(bounds), torch.cat(mean_bounds)
        return torch.cat(means), _y_variance(torch.cat(out), lik, noise), t_var

    def _exact_moments(self, test_x: torch.Tensor, variance: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """``(mean, mean_bound, variance of y, variance_bound)`` at ``test_x`` (each ``(m,)``; the variances
        ``None`` unless ``variance``) from one Cholesky factor of the dense ``K̂``, entries by differences for RBF /
        Matérn kernels (:func:`~gpnys.kernels.entries.difference_entries`: GPyTorch's ``|a|² + |b|² − 2aᵀb`` loses
        near pairs in float32), GPyTorch's otherwise. ``None`` where GPyTorch's own prediction is needed: a kernel
        that does not see the training inputs as given, batched inputs or kernels, several outputs."""
        model = self.model
        X, y = model.train_inputs[0], model.train_targets
        kx = self.kernels.inputs if self.kernels.inputs is not None else self._discovered_inputs()
        if (kx is None or not same_points(kx, X) or X.dim() != 2 or y.dim() != 1
                or len(getattr(self.kernel, "batch_shape", ())) > 0):
            return None
        kernel, n, noise = self.kernel, X.shape[0], self.noise().detach()
        with torch.no_grad():
            K = cross_covariance(kernel, X, X)
            quad, L = _dense_quad(K, noise)
            r = y - model.forward(X).mean
            alpha = torch.cholesky_solve(r[:, None], L)[:, 0]
            # the weights' error K̂⁻¹ρ for their residual, recomputed in the working precision, and the products'
            # rounding, which that residual does not show (_rounding_draws): each mapped through the factor
            rho = r - (K @ alpha[:, None])[:, 0]
            e = _rounding_draws(K.abs() @ alpha.abs()[:, None] + r.abs()[:, None])
            del K
            correction = torch.cholesky_solve(torch.cat([rho[:, None], e], 1), L)
            means, mean_bounds, out, bounds = [], [], [], []
            for T in test_x.split(max(64, block_rows(n, parts=4, device=X.device))):
                B, mean, err = _mean_block(model, kernel, X, T, alpha, correction)
                means.append(mean)
                mean_bounds.append(err)
                if variance:
                    q, bound = quad(B)
                    out.append(_latent_variance(kernel(T, diag=True), q))
                    bounds.append(bound)
        mean, mean_err = torch.cat(means), torch.cat(mean_bounds)
        if not variance:
            return mean, mean_err, None, None
        return mean, mean_err, _y_variance(torch.cat(out), model.likelihood, noise), torch.cat(bounds)

    def _discovered_inputs(self) -> torch.Tensor | None:
        """The inputs the kernel sees, read from the covariance ``forward`` builds
        (:func:`~gpnys.gp.discover.training_kernel`), for a model that was not trained under this hook (a fitted model
        loaded for prediction): without them :meth:`predict` would take GPyTorch's path, which forms the dense
        ``n x n`` kernel. ``None`` when the covariance is not one kernel call (GPyTorch's path then)."""
        try:
            self.seen = training_kernel(self.model)
        except ValueError:
            return None
        return self.seen[1]

    def _mean_weights(self, X: torch.Tensor) -> tuple[torch.Tensor, float, int]:
        """``alpha = K̂^{-1} (y - m(X))`` (``(n,)``) by PCG with this preconditioner: the predictive mean is
        ``m(x) + k_x^T alpha``. Not GPyTorch's prediction cache, which evaluates the dense ``n x n`` kernel. Also
        the smallest Ritz value of ``P̂^{-1} K̂`` from the same run's Lanczos tridiagonal (an estimate of its
        smallest eigenvalue, for :class:`~gpnys.gp.variance.LocalVariance`), the iteration count and the estimate
        of the weights' error for :func:`mean_bound`."""
        r = self.model.train_targets - self.model.forward(X).mean
        tol = 1e-6 if X.dtype == torch.float64 else 1e-5
        A, M = self.system(X)
        res = PCGPosterior(A, M, self.settings.max_cg_iterations).mean_weights(
            r, key=None, tol=tol, start=torch.zeros_like(r), lanczos=True, miniter=10)
        alpha, lam = res.x[:, 0], ritz_min(res)
        # one step of iterative refinement: δ ≈ K̂⁻¹ρ (ρ: PCG's true residual, recomputed at its end) by a short PCG
        # solve to MEAN_REFINE_TOL, added to the weights, whose error is then K̂⁻¹ρ₂ (ρ₂ the step's true residual).
        # Each mean's error estimate is |k_xᵀδ| + |k_xᵀP̂⁻¹ρ₂| / λ̂ (λ̂ <= 1, the Ritz estimate of λ_min(P̂⁻¹K̂)).
        # P̂⁻¹ρ / λ̂ alone points elsewhere than K̂⁻¹ρ: at noise 1e-3 (Matérn-3/2, n = 800) float64 means were up to 43
        # times that estimate off
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # a residual at the rounding floor: δ says so
            ref = pcg(A, res.residual, precond=M, tol=MEAN_REFINE_TOL, maxiter=self.settings.max_cg_iterations)
        delta = ref.x[:, 0]
        alpha = alpha + delta
        # and the floor no residual shows: the products' rounding e ~ u (K̂|α| + |r|) moves α by K̂⁻¹e ≈ P̂⁻¹e / λ̂, in
        # MEAN_ROUNDING_SIGNS draws of independent signs (the probabilistic model of rounding; at ℓ = 0.05 and
        # noise 1e-4 float64 means were 1.9e-13 off, 34 times the estimate without it)
        e = _rounding_draws(A(alpha.abs()[:, None]) + r.abs()[:, None])
        correction = torch.cat([delta[:, None], M(ref.residual), M(e)], 1)
        correction[:, 1:] /= min(lam, 1.0)
        return alpha, lam, res.iterations + ref.iterations, correction

    def _variance_landmarks(self, op: StationaryKernelOperator) -> torch.Tensor:
        """``(k,)`` landmark rows for :class:`~gpnys.gp.variance.LocalVariance`: the preconditioner's (AFN, column
        Nyström), else :data:`VARIANCE_LANDMARKS` chosen by AFN's rule (FPS for d <= 10, else uniform)."""
        P, _ = self.preconditioner()
        Z = P.landmark_rows()
        if Z is None:
            X = op.X
            k = min(VARIANCE_LANDMARKS, X.shape[0] // 2)
            Z = select(X / op.lengthscale.detach().reshape(-1), k, "fps" if X.shape[1] <= 10 else "uniform")[1]
        return Z

    def _pcg_quad(self, X: torch.Tensor, noise: torch.Tensor) -> Callable:
        """``B -> (diag(B^T K̂^{-1} B), bound)`` by PCG (see :meth:`predict`), each ``(b,)``; an optional per-column
        relative tolerance ``(b,)`` replaces ``settings.variance_tolerance``."""
        post = PCGPosterior(*self.system(X), self.settings.max_cg_iterations)
        with torch.no_grad():  # the size of K̂'s entries, for the rounding of the weights (rounding_error)
            scale = self.kernel(X, diag=True).max() + noise.max()

        def quad(B: torch.Tensor, tol: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            out = post.quad(B, self.settings.variance_tolerance if tol is None else tol, noise.min(),
                            rounding=lambda x: rounding_error(scale, x.abs().sum(0)))
            self.variance_iterations = post.iterations
            return out

        return quad

    def _cholesky_quad(self, op: StationaryKernelOperator, noise: torch.Tensor) -> Callable:
        """``B -> (diag(B^T K̂^{-1} B), rounding bound)`` through one Cholesky of the cached dense ``K̂`` (see
        :meth:`predict`)."""
        return _dense_quad(op._dense()[0] * op.outputscale.detach(), noise)[0]


def _dense_quad(K: torch.Tensor, noise: torch.Tensor) -> tuple[Callable, torch.Tensor]:
    """``(quad, L)`` for a dense kernel matrix ``K`` ``(n, n)`` (the noise is added in place): ``L L^T = K + noise``
    and ``quad: B -> (diag(B^T K̂^{-1} B), rounding bound)`` (:func:`~gpnys.gp.variance.rounding_error`, from the
    kriging weights ``K̂⁻¹B``)."""
    K.diagonal().add_(noise)
    scale = K.diagonal().max()
    L = safe_cholesky(K, "predictive covariance K + noise I")

    def quad(B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        V = torch.linalg.solve_triangular(L, B, upper=False)
        x = torch.linalg.solve_triangular(L.mT, V, upper=True)  # the kriging weights, for the rounding bound
        return V.square().sum(0), rounding_error(scale, x.abs().sum(0))

    return quad, L


def _rounding_draws(size: torch.Tensor) -> torch.Tensor:
    """``(n, MEAN_ROUNDING_SIGNS)`` draws of the products' rounding ``u · size ∘ s_k`` for ``size = |K̂||α| + |r|``
    ``(n, 1)``, with independent random signs ``s_k`` (the probabilistic model of rounding) from a generator of its
    own (:data:`MEAN_ROUNDING_SEED`: the same draws every call, the caller's random stream untouched)."""
    gen = torch.Generator(device=size.device).manual_seed(MEAN_ROUNDING_SEED)
    signs = draw((size.shape[0], MEAN_ROUNDING_SIGNS), size.dtype, size.device, generator=gen,
                 distribution="rademacher")
    return torch.finfo(size.dtype).eps / 2 * size * signs


def mean_bound(B: torch.Tensor, alpha: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """``(b,)`` error estimates of the predictive means ``m(x) + k_xᵀα̂`` for ``B = k(X, T)`` ``(n, b)``, the weights
    ``alpha`` ``(n,)`` and ``correction`` ``(n,)`` or ``(n, c)``, estimates of the weights' error or its parts (a
    refinement step's ``δ ≈ K̂⁻¹ρ`` and ``P̂⁻¹ρ₂ / λ̂`` for what it left; the Cholesky path's ``K̂⁻¹ρ``, ``ρ`` each
    recomputed in the working precision): ``Σ_c |k_xᵀ correction_c| + 4 eps |k_x|ᵀ|α̂|``, the last term the rounding
    of ``k_xᵀα̂``, whose terms cancel. Two estimates along different directions seldom cancel at the same point."""
    dot = B.abs().mT @ alpha.abs()
    C = correction if correction.dim() == 2 else correction[:, None]
    return (B.mT @ C).abs().sum(-1) + ROUNDING_FACTOR * torch.finfo(alpha.dtype).eps * dot


def _mean_block(model: gpytorch.models.ExactGP, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, T: torch.Tensor,
                alpha: torch.Tensor, correction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k(X, T), mean, mean_bound)`` at a block of test points ``T (b, d)``: ``(n, b)``, ``(b,)``, ``(b,)``."""
    B = cross_covariance(kernel, X, T)
    return B, model.forward(T).mean + B.mT @ alpha, mean_bound(B, alpha, correction)


def _latent_variance(kxx: torch.Tensor, quad: torch.Tensor) -> torch.Tensor:
    """``k(x, x) − k_xᵀK̂⁻¹k_x`` from the prior variances ``kxx`` and the quadratic forms ``quad`` (``(b,)`` each),
    within ``[0, k(x, x)]``, where every latent variance lies: a quadratic form computed below 0 (float32 PCG that
    broke down at noise 1e-5, with its warning) gave variances 4e4 times the prior's."""
    return (kxx - quad).clamp_min(0.0).minimum(kxx)


def _y_variance(latent: torch.Tensor, likelihood: gpytorch.likelihoods.Likelihood, noise: torch.Tensor
                ) -> torch.Tensor:
    """The variance of ``y`` from the latent one, as GPyTorch's likelihood gives it at new points: plus a
    homoskedastic ``noise``. A known per-point training noise (``FixedNoiseGaussianLikelihood``) says nothing about
    new points, where GPyTorch adds only its learnt additional noise (``learn_additional_noise=True``): so does
    this."""
    if not isinstance(likelihood, gpytorch.likelihoods.FixedNoiseGaussianLikelihood):
        return latent + noise
    if likelihood.second_noise_covar is None:
        return latent
    return latent + likelihood.second_noise.detach().reshape(())


def cross_covariance(kernel: gpytorch.kernels.Kernel, X: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """``k(X, T)`` ``(n, b)`` without autograd: from differences for RBF / Matérn kernels
    (:func:`~gpnys.kernels.entries.difference_entries`, exact to rounding where GPyTorch's float32 distances lose
    near pairs), else GPyTorch's."""
    B = difference_entries(kernel, X, T)
    return B if B is not None else kernel(X, T).to_dense()


def ritz_min(res: PCGResult) -> float:
    """Smallest Ritz value of the first column's Lanczos tridiagonal in a ``pcg(..., lanczos=True)`` result
    (the smallest eigenvalue of ``M^{-1/2} A M^{-1/2}`` is at most this and usually close once CG has run)."""
    it = int(res.iterations_per_column[0])
    if it == 0:
        return 1.0
    d, e = res.tridiagonal
    T = torch.diag(d[:it, 0]) + torch.diag(e[:it - 1, 0], 1) + torch.diag(e[:it - 1, 0], -1)
    return float(torch.linalg.eigvalsh(T)[0])


def _choose(n: int, m: int, iters: int, dense: bool, cached: float) -> str:
    """``"auto"``: flop counts of the exact methods (Cholesky only with the dense kernel cached; PCG at the mean
    solve's iterations, at least 10) against ``cached`` (:meth:`LocalVariance.flops`); ``"cached"`` below a tenth."""
    pcg_flops = 2.0 * max(10, iters) * n * n * m
    exact = min(pcg_flops, n ** 3 / 3 + n * n * m) if dense else pcg_flops
    if cached * 10 < exact:
        return "cached"
    return "cholesky" if dense and n ** 3 / 3 + n * n * m < pcg_flops else "pcg"
