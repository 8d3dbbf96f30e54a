"""Model layer over the reduced posteriors: a functional constructor and a GPyTorch-compatible model.

* :func:`reduced_posterior` — ``"lla" | "ncr" | "gsa" | "rff"`` posterior for given hyperparameters, with
  landmark selection (``uniform``, ``fps``, ``kmeans``, ``leverage``) and ``m="auto"`` (the numerical-rank
  estimate of the preconditioner layer for the current length-scale).
* :class:`ReducedGP` — behaves like a GPyTorch ``ExactGP`` in eval mode (``model(x)`` is a
  ``MultivariateNormal`` of the latent function, ``likelihood(model(x))`` adds the noise), with hyperparameters
  copied from a trained exact model (:meth:`ReducedGP.from_exact`) or trained on the reduced model's own
  objective (:meth:`ReducedGP.fit`: DTC evidence or Titsias' collapsed bound).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Union

import gpytorch
import torch
from linear_operator.operators import DiagLinearOperator

from gpnys.checks import validate_choice, validate_count, validate_training_data
from gpnys.gp.discover import same_points, training_kernel
from gpnys.kernels.entries import computation_dtype
from gpnys.landmarks.rules import choose_m, select_landmarks
from gpnys.linalg import safe_cholesky
from gpnys.reduced.features import feature_nll
from gpnys.reduced.gsa import GSAPosterior
from gpnys.reduced.lla import LLAPosterior
from gpnys.reduced.ncr import NCRPosterior
from gpnys.reduced.rff import RFFPosterior

__all__ = ["reduced_posterior", "ReducedGP", "METHODS", "OBJECTIVES"]

METHODS = ("lla", "ncr", "gsa", "rff")
OBJECTIVES = ("titsias", "dtc")
Posterior = Union[LLAPosterior, RFFPosterior]


def _count(m: int | str, X: torch.Tensor, kernel, noise: float, seed: int) -> int:
    if m == "auto":
        return choose_m(X, kernel, noise, seed=seed)
    if isinstance(m, str):
        raise ValueError(f"m must be 'auto' or an integer in [1, n={X.shape[0]}], got {m!r}")
    return validate_count(m, "m", 1, X.shape[0])


def reduced_posterior(method: str, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, noise: float,
                      m: int | str = 500, landmarks: str | torch.Tensor | None = None, seed: int = 0,
                      prior_mean: float = 0.0,
                      **options: Any) -> Posterior:
    """A reduced GP posterior at fixed hyperparameters.

    Args:
        method: ``"lla"``, ``"ncr"``, ``"gsa"`` or ``"rff"``.
        kernel: GPyTorch kernel (outputscale included); X: ``(n, d)``; y: ``(n,)``; noise: ``sigma^2``. Mixed
            dtypes of X, y, landmark points and the kernel are promoted, as GPyTorch does (the posteriors'
            constructors take y and landmarks in X's dtype).
        m: landmarks (RFF: frequencies, i.e. ``2m`` features), or ``"auto"``.
        landmarks: a rule of :data:`gpnys.landmarks.RULES` or the points ``(m, d)`` themselves; ``None``:
            ``"fps"`` (RFF takes none: a rule or points with ``"rff"`` is a ``ValueError``).
        seed: seeds landmark selection and RFF frequencies.
        prior_mean: constant prior mean.
        options: passed to the posterior (``variance``, ``coef``, ``rank``, ``rtol``, ``solver``).

    Returns:
        an object with ``mean(Z)`` and ``variance(Z)`` (``(nz,)`` each, latent) and ``method``.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import select_landmarks
        >>> from gpnys.reduced import reduced_posterior
        >>> post = reduced_posterior("lla", kernel, X, y, noise=0.01, m=30)  # 30 FPS landmarks
        >>> post.method, post.m, post.mean(Z).shape
        ('lla', 30, torch.Size([5]))

        LLA's mean is the subset-of-regressors / DTC mean ``k(z, C) (K_mn K_nm + sigma^2 K_mm)^{-1} K_mn y``:

        >>> C, _ = select_landmarks(X, 30, "fps")
        >>> beta = torch.linalg.solve(k(C, X) @ k(X, C) + 0.01 * k(C, C), k(C, X) @ y)
        >>> torch.allclose(post.mean(Z), k(Z, C) @ beta)
        True
        >>> bool((post.variance(Z) > 0).all())
        True
    """
    validate_choice(method, "method", METHODS)
    if isinstance(X, torch.Tensor) and isinstance(y, torch.Tensor) and X.is_floating_point():
        # mixed dtypes as GPyTorch takes them: data (landmark points included) promoted with each other and the
        # kernel's parameters; the posteriors' constructors themselves take one dtype
        points = [landmarks] if isinstance(landmarks, torch.Tensor) and landmarks.is_floating_point() else []
        dtype = computation_dtype(kernel, X, y, *points)
        X, y = X.to(dtype), y.to(dtype)
        landmarks = landmarks.to(dtype) if points else landmarks
    if method == "rff" and landmarks is not None:
        raise ValueError(f"landmarks: method 'rff' draws random features and takes no landmarks, got {landmarks!r}"
                         if not isinstance(landmarks, torch.Tensor) else
                         "landmarks: method 'rff' draws random features and takes no landmark points")
    landmarks = "fps" if landmarks is None else landmarks
    if isinstance(landmarks, torch.Tensor):
        C = landmarks
    else:
        mm = _count(m, X, kernel, noise, seed)
        if method == "rff":
            return RFFPosterior(kernel, X, y, noise, mm, seed=seed, prior_mean=prior_mean, **options)
        C, _ = select_landmarks(X, mm, landmarks, kernel=kernel, noise=noise, seed=seed)
    cls = {"lla": LLAPosterior, "ncr": NCRPosterior, "gsa": GSAPosterior}[method]
    return cls(kernel, X, y, noise, C, prior_mean=prior_mean, **options)


class ReducedGP(gpytorch.models.GP):
    """A Nyström-reduced (or RFF) GP regression model with GPyTorch's model interface.

    Args:
        train_x: ``(n, d)``; train_y: ``(n,)``.
        likelihood: ``GaussianLikelihood``.
        covar_module: ``ScaleKernel`` over RBF/Matérn (its hyperparameters are used, and trained by ``fit``).
        mean_module: ``ConstantMean`` or ``ZeroMean`` (default ``ZeroMean``).
        method: as :func:`reduced_posterior`.
        m: as :func:`reduced_posterior`.
        landmarks: as :func:`reduced_posterior`. Landmarks are chosen when the posterior is first needed (and again
            after hyperparameters change, for the kernel-dependent rules ``leverage`` and ``m="auto"``).
        seed: as :func:`reduced_posterior`.
        **options: as :func:`reduced_posterior`.

    Eval mode: ``model(x)`` returns ``MultivariateNormal(mean, diag(variance))`` of the latent function at
    ``x (b, d)`` (independent marginals); ``likelihood(model(x))`` adds the noise.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.reduced import ReducedGP, reduced_posterior
        >>> likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
        >>> likelihood.noise = 0.01
        >>> model = ReducedGP(X, y, likelihood, kernel, method="lla", m=30).eval()
        >>> f = model(Z)  # the latent posterior at Z
        >>> noise = likelihood.noise.item()
        >>> torch.allclose(f.mean, reduced_posterior("lla", kernel, X, y, noise, m=30).mean(Z))
        True
        >>> torch.allclose(likelihood(f).variance, f.variance + noise)
        True

        :meth:`fit` trains the hyperparameters on :meth:`loss`: minus the DTC evidence per point (``"dtc"``), plus
        ``tr(K - Q) / (2 sigma^2 n)`` for Titsias' bound (``"titsias"``), with ``Q = K_nm K_mm^{-1} K_mn``:

        >>> C = X[:30]  # fixed landmark points
        >>> Q = k(X, C) @ torch.linalg.solve(k(C, C), k(C, X))
        >>> cov = Q + noise * torch.eye(200, dtype=torch.float64)
        >>> dtc = -torch.distributions.MultivariateNormal(torch.zeros(200, dtype=torch.float64), cov).log_prob(y) / 200
        >>> torch.allclose(model.loss(C, "dtc"), dtc)
        True
        >>> torch.allclose(model.loss(C), dtc + (k(X, X) - Q).trace() / (2 * noise * 200))
        True
    """

    def __init__(self, train_x: torch.Tensor, train_y: torch.Tensor,
                 likelihood: gpytorch.likelihoods.GaussianLikelihood, covar_module: gpytorch.kernels.Kernel,
                 mean_module: gpytorch.means.Mean | None = None,
                 method: str = "lla", m: int | str = 500, landmarks: str | torch.Tensor | None = None, seed: int = 0,
                 **options: Any) -> None:
        super().__init__()
        validate_choice(method, "method", METHODS)
        if not isinstance(likelihood, gpytorch.likelihoods.GaussianLikelihood) or isinstance(
                likelihood, gpytorch.likelihoods.FixedNoiseGaussianLikelihood):
            # the reduced posteriors take one noise variance; per-point noise would be answered with the first one
            raise ValueError(f"likelihood must be a GaussianLikelihood with one (learned) noise variance, got "
                             f"{type(likelihood).__name__}; per-point noise is not supported by ReducedGP")
        self.train_inputs, self.train_targets = (train_x,), train_y
        self.likelihood, self.covar_module = likelihood, covar_module
        self.mean_module = mean_module if mean_module is not None else gpytorch.means.ZeroMean()
        self.method, self.m, self.landmarks, self.seed, self.options = method, m, landmarks, seed, options
        self._posterior: Posterior | None = None
        self._key: tuple | None = None

    @classmethod
    def from_exact(cls, model: gpytorch.models.ExactGP, **kwargs: Any) -> "ReducedGP":
        """A reduced model with (copies of) the kernel, mean and likelihood of a trained ``ExactGP``. The kernel is
        the one its ``forward`` evaluates (any attribute name, :func:`~gpnys.gp.discover.training_kernel`); the
        mean is ``model.mean_module``, else the model's one ``Mean`` attribute (any name)."""
        kernel, seen = training_kernel(model)
        X = model.train_inputs[0]
        if not same_points(seen, X):
            raise ValueError("model: its forward() transforms the inputs before the kernel; build ReducedGP on the "
                             "transformed inputs instead")
        means = [m for m in model.children() if isinstance(m, gpytorch.means.Mean)]
        mean = getattr(model, "mean_module", None)
        if not isinstance(mean, gpytorch.means.Mean):
            if len(means) != 1:
                raise ValueError(f"model: ReducedGP.from_exact takes the prior mean from the model's one mean module "
                                 f"(ConstantMean or ZeroMean, any attribute name); this model has {len(means)}")
            mean = means[0]
        return cls(X, model.train_targets, copy.deepcopy(model.likelihood), copy.deepcopy(kernel),
                   copy.deepcopy(mean), **kwargs)

    def _prior_mean(self) -> float:
        c = getattr(self.mean_module, "constant", None)
        return 0.0 if c is None else float(c.detach().reshape(-1)[0])

    def _noise(self) -> float:
        return float(self.likelihood.noise.detach().reshape(-1)[0])

    def posterior(self) -> Posterior:
        """The reduced posterior for the current hyperparameters (rebuilt when they change)."""
        key = tuple(tuple(p.detach().reshape(-1).tolist()) for p in self.parameters())
        if self._posterior is None or key != self._key:
            X, y = self.train_inputs[0], self.train_targets
            with torch.no_grad():
                self._posterior = reduced_posterior(self.method, self.covar_module, X, y, self._noise(), m=self.m,
                                                    landmarks=self.landmarks, seed=self.seed,
                                                    prior_mean=self._prior_mean(), **self.options)
            self._key = key
        return self._posterior

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        if self.training:
            raise RuntimeError("ReducedGP has no training-mode forward: train with ReducedGP.fit (or ReducedGP.loss), "
                               "or copy hyperparameters with ReducedGP.from_exact; call model.eval() to predict")
        post = self.posterior()
        with torch.no_grad():
            return gpytorch.distributions.MultivariateNormal(post.mean(x), DiagLinearOperator(post.variance(x)))

    def __call__(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:  # GP.__call__ is abstract
        return self.forward(x)

    # -- training on the reduced objective --------------------------------------------------------------
    def loss(self, landmarks: torch.Tensor, objective: str = "titsias") -> torch.Tensor:
        """Differentiable ``-objective / n`` with fixed landmark points ``(m, d)``.

        ``"dtc"``: ``-log N(y | m, Q + sigma^2 I)`` with ``Q = K_nm K_mm^{-1} K_mn`` (the DTC/SoR evidence);
        ``"titsias"``: plus ``tr(K - Q) / (2 sigma^2)`` (minus the collapsed variational bound, Titsias 2009).
        ``Phi = K_nm L^{-T}`` with ``L`` the Cholesky factor of ``K_mm`` (shifted, with a warning, only if it
        fails): the eigenvalue cut-off of the posterior has no stable gradient (``eigh``'s derivative divides by
        eigenvalue gaps), so training uses the factor.
        """
        validate_choice(objective, "objective", OBJECTIVES)
        X, y = self.train_inputs[0], self.train_targets
        kern = self.covar_module
        L = safe_cholesky(kern(landmarks, landmarks).to_dense(), "ReducedGP.loss: K_mm")
        Phi = torch.linalg.solve_triangular(L, kern(landmarks, X).to_dense(), upper=False).mT
        noise = self.likelihood.noise.reshape(-1)[0]
        gap = None
        if objective == "titsias":
            gap = kern(X, X, diag=True).sum() - Phi.square().sum()
        return feature_nll(Phi, y - self.mean_module(X), noise, gap)

    def fit(self, iters: int = 100, lr: float = 0.05, objective: str = "titsias") -> list[float]:
        """Adam on :meth:`loss` with landmarks chosen once at the initial hyperparameters; returns the losses."""
        if isinstance(iters, bool) or int(iters) != iters or iters < 0:
            raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be positive and finite, got {lr!r}")
        if self.method == "rff":
            raise ValueError("fit trains the Nyström objectives; RFF models take hyperparameters from_exact")
        X = self.train_inputs[0]
        validate_training_data(X, self.train_targets, ("train_x", "train_y"))
        if isinstance(self.landmarks, torch.Tensor):
            C = self.landmarks
        else:
            with torch.no_grad():
                mm = _count(self.m, X, self.covar_module, self._noise(), self.seed)
                C, _ = select_landmarks(X, mm, self.landmarks or "fps", kernel=self.covar_module, noise=self._noise(),
                                        seed=self.seed)
        self.train()
        opt = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=lr)
        trace = []
        for _ in range(int(iters)):
            opt.zero_grad()
            value = self.loss(C, objective)
            value.backward()
            opt.step()
            trace.append(float(value.detach()))
        self.eval()
        self._posterior = None
        return trace
