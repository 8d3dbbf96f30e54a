"""Landmark selection for the reduced (GSA / LLA / NCR) models, and ``m = auto``.

Rules (the samplers of [SPA] §IV-A and [NSL] §4 and its supplement §5, plus FPS): ``"uniform"``, ``"fps"`` and
``"kmeans"`` delegate to :mod:`gpnys.landmarks`; ``"leverage"`` is approximate ridge-leverage-score (RLS)
sampling (Alaoui & Mahoney 2015; Musco & Musco 2017) at ridge ``lambda = noise``, the GP's own regulariser
(``K + sigma^2 I``). Which leverage scores the papers use is not stated ([SPA] §IV-A defers to its refs. [24,
33]); the choices made here are documented in :func:`ridge_leverage_scores`.

Landmarks are always **distinct** rows of X (sampling without replacement): sampling with replacement, as in
[NSL]'s supplement §5, duplicates landmarks and makes ``K_mm`` singular.

:func:`choose_m` gives ``m = auto``: the AFN paper's numerical rank ``#{lambda_i(K) > 0.1 mu}`` of the
unit-variance kernel (``mu = noise / outputscale``), from :func:`gpnys.precond.rank.estimate_rank`.

Nothing of size ``n x n`` is formed: leverage scores need ``k(X, S)`` (``n x s``, in row blocks) and ``s x s``
matrices only.
"""

from __future__ import annotations

import math
from typing import Any

import gpytorch
import torch

from gpnys import landmarks as _lm
from gpnys.checks import validate_count, validate_points, validate_positive
from gpnys.kernels.entries import split_outputscale
from gpnys.precond.rank import estimate_rank
from gpnys.reduced.lla import kernel_block, kernel_diag

__all__ = ["RULES", "choose_m", "ridge_leverage_scores", "select_landmarks"]

RULES = ("uniform", "fps", "kmeans", "leverage")
_MULTINOMIAL_MAX = 1 << 24  # torch.multinomial's category limit; Gumbel-top-k beyond it (same distribution)


def _validate_noise(noise: Any) -> float:
    if noise is None:
        raise ValueError("noise is required (the ridge lambda = noise > 0)")
    return validate_positive(noise, "noise")


def _validate_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")  # noqa: TRY004 (library rule: ValueError)
    return seed


def _validate_kernel(kernel: Any) -> None:
    if kernel is None:
        raise ValueError("kernel is required for leverage-score sampling")
    if not isinstance(kernel, gpytorch.kernels.Kernel):
        raise ValueError(f"kernel must be a gpytorch Kernel, got {type(kernel).__name__}")  # noqa: TRY004


def _scores(X: torch.Tensor, kernel: gpytorch.kernels.Kernel, lam: float, sketch: torch.Tensor,
            rtol: float | None) -> torch.Tensor:
    """Approximate ridge leverage scores from the sketch rows ``sketch (s,)``; see :func:`ridge_leverage_scores`.

    Returns ``(n,)`` in the working precision ``promote_types(X.dtype, float64)``.
    """
    work = torch.promote_types(X.dtype, torch.float64)
    S = X[sketch]
    s = S.shape[0]
    # Thresholded eigendecomposition K_SS = V diag(e) V^T: keep e_j > rtol * e_max, no jitter (a rank-deficient
    # K_SS is the normal case).
    K_SS = kernel_block(kernel, S, S).to(work)
    evals, V = torch.linalg.eigh(0.5 * (K_SS + K_SS.mT))
    if rtol is None:  # below s * eps(X.dtype) * e_max the kernel entries' own rounding dominates
        rtol = s * torch.finfo(X.dtype).eps
    keep = evals > rtol * evals[-1].clamp_min(torch.finfo(work).tiny)
    A = V[:, keep] / evals[keep].sqrt()  # (s, r): Nyström features phi_i = A^T k(S, x_i), K~ = Phi Phi^T
    Phi = kernel_block(kernel, X, S).to(work) @ A  # (n, r)
    r = Phi.shape[1]
    M = Phi.mT @ Phi + lam * torch.eye(r, dtype=work, device=X.device)  # (r, r)
    L = torch.linalg.cholesky(M)  # M >= lam I: always positive definite
    Z = torch.linalg.solve_triangular(L, Phi.mT, upper=False)  # (r, n): z_i = L^{-1} phi_i
    diag = kernel_diag(kernel, X).to(work)  # k_ii (n,)
    proj = Phi.square().sum(dim=1)  # K~_ii = |phi_i|^2
    tau = Z.square().sum(dim=0) + (diag - proj).clamp_min(0) / lam
    # Exact scores obey tau_i <= k_ii / (k_ii + lam) (drop every column of K but i): clip to that bound.
    return torch.minimum(tau, diag / (diag + lam)).clamp_min(0)


def ridge_leverage_scores(X: torch.Tensor, kernel: gpytorch.kernels.Kernel, noise: float,
                          sketch_size: int | None = None, seed: int = 0, rtol: float | None = None) -> torch.Tensor:
    """Approximate ridge leverage scores ``tau_i = [K (K + lambda I)^{-1}]_ii`` at ``lambda = noise``. ``(n,)``

    A seeded uniform sketch ``S`` of ``s = sketch_size`` distinct rows gives the Nyström approximation
    ``K~ = K_nS K_SS^+ K_Sn = Phi Phi^T`` with ``Phi = K_nS V_r E_r^{-1/2}`` (thresholded eigendecomposition
    ``K_SS = V E V^T`` in ``promote_types(X.dtype, float64)``, eigenvalues ``<= rtol * e_max`` dropped,
    default ``rtol = s * eps(X.dtype)``, no jitter). The estimate is

        tau~_i = phi_i^T (Phi^T Phi + lambda I_r)^{-1} phi_i  +  (k_ii - |phi_i|^2) / lambda,

    i.e. the Nyström score ``[K~ (K~ + lambda I)^{-1}]_ii`` of Alaoui & Mahoney (2015, Sec. 3) plus the residual
    term ``(k_ii - K~_ii) / lambda`` that Musco & Musco (2017, "Recursive sampling for the Nyström method",
    eq. (3)/Lemma 6) add for the part of ``k(x_i, .)`` outside the sketch space. With the feature map
    ``K = B^T B`` and ``P`` the projector onto ``span B_S`` this is ``b_i^T (P B B^T P + lambda I)^{-1} b_i``,
    never below Musco & Musco's over-estimate ``b_i^T (B_S B_S^T + lambda I)^{-1} b_i`` and **exact** when
    ``rank K_SS = rank K`` (e.g. ``sketch_size = n``, up to the dropped eigenvalues). The result is clipped to
    ``[0, k_ii / (k_ii + lambda)]``, a bound every exact score obeys.

    Cost: ``O(n s d)`` kernel entries (row blocks), ``O(s^3 + n s^2)`` flops, ``O(n s)`` memory.

    Args:
        X: ``(n, d)`` points.
        kernel: GPyTorch kernel of the GP, outputscale included (``K`` is the prior covariance).
        noise: ``lambda = sigma^2 > 0``.
        sketch_size: ``s`` in ``[1, n]``; default ``min(n, 500)``.
        seed: seed of the sketch (generator on X's device).
        rtol: eigenvalue cut-off relative to the largest (see above).

    Returns:
        ``(n,)`` scores in X's dtype; their sum approximates the effective dimension ``tr K (K + lambda I)^{-1}``.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.reduced.landmarks import ridge_leverage_scores
        >>> K = k(X, X)

        With the whole set as the sketch (``rank K_SS = rank K``) the scores are exact:

        >>> tau = ridge_leverage_scores(X, kernel, noise=0.01, sketch_size=200)
        >>> torch.allclose(tau, (K @ torch.linalg.inv(K + 0.01 * torch.eye(200, dtype=torch.float64))).diagonal())
        True
    """
    validate_points(X)
    _validate_kernel(kernel)
    lam = _validate_noise(noise)
    seed = _validate_seed(seed)
    n = X.shape[0]
    s = min(n, 500) if sketch_size is None else validate_count(sketch_size, "sketch_size", 1, n, "n")
    if rtol is not None and not (0 <= float(rtol) < 1):
        raise ValueError(f"rtol must be in [0, 1), got {rtol!r}")
    sketch = _lm.uniform(n, s, seed=seed, device=X.device)
    return _scores(X, kernel, lam, sketch, rtol).to(X.dtype)


def _sample_without_replacement(p: torch.Tensor, m: int, gen: torch.Generator) -> torch.Tensor:
    """``m`` distinct indices drawn successively with probabilities ``∝ p`` (``p > 0``). ``(m,)`` long"""
    if p.shape[0] <= _MULTINOMIAL_MAX:
        return torch.multinomial(p, m, replacement=False, generator=gen)
    # Gumbel-top-k (Vieira 2014; Kool et al. 2019): the same distribution as successive sampling.
    u = torch.rand(p.shape, generator=gen, dtype=p.dtype, device=p.device).clamp_min(torch.finfo(p.dtype).tiny)
    return torch.topk(p.log() - (-u.log()).log(), m).indices


def select_landmarks(X: torch.Tensor, m: int, rule: str = "fps", kernel: gpytorch.kernels.Kernel | None = None,
                     noise: float | None = None, seed: int = 0,
                     sketch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose ``m`` landmarks of X by ``rule`` in :data:`RULES`.

    * ``"uniform"``: ``m`` distinct rows uniformly at random; ``"fps"``: farthest point sampling (AFN paper
      Algorithm 6; deterministic, ``seed`` unused); ``"kmeans"``: k-means++ / Lloyd centres (Zhang & Kwok 2008),
      not data points — all from :mod:`gpnys.landmarks`.
    * ``"leverage"``: ridge-leverage-score sampling (Alaoui & Mahoney 2015; Musco & Musco 2017) at
      ``lambda = noise``: scores from :func:`ridge_leverage_scores` with a seeded uniform sketch of
      ``min(n, 2 m)`` rows (``sketch_size`` overrides it), then ``m`` **distinct** indices drawn successively
      with probabilities ``∝ tau~`` (``torch.multinomial`` without replacement, seeded generator on X's device).
      Requires ``kernel`` (outputscale included) and ``noise``.

    Args:
        X: ``(n, d)`` points; m: number of landmarks, an integer in ``[1, n]``.
        rule: selection rule; kernel, noise: GP kernel and noise variance (``"leverage"`` only).
        seed: seed of the random rules (same seed and device → same landmarks).
        sketch_size: leverage-score sketch size (``"leverage"`` only).

    Returns:
        ``(C (m, d), idx (m,) long or None)`` with ``C = X[idx]``; ``idx`` is ``None`` for k-means.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import select_landmarks
        >>> C, idx = select_landmarks(X, 20, "leverage", kernel=kernel, noise=0.01, seed=0)
        >>> idx.unique().numel(), torch.equal(C, X[idx])  # distinct rows of X
        (20, True)
        >>> C, idx = select_landmarks(X, 20, "fps")
        >>> torch.equal(idx, fps(X, 20).indices)
        True
        >>> C, idx = select_landmarks(X, 20, "kmeans", seed=0)  # centres, not data points
        >>> C.shape, idx
        (torch.Size([20, 2]), None)
    """
    validate_points(X)
    n = X.shape[0]
    m = validate_count(m, "m", 1, n, "n")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    seed = _validate_seed(seed)
    if noise is not None:
        _validate_noise(noise)
    if rule != "leverage":
        return _lm.select(X, m, method=rule, seed=seed)
    _validate_kernel(kernel)
    lam = _validate_noise(noise)
    s = min(n, 2 * m) if sketch_size is None else validate_count(sketch_size, "sketch_size", 1, n, "n")
    gen = _lm._generator(seed, X.device)
    sketch = torch.randperm(n, generator=gen, device=X.device)[:s]
    tau = _scores(X, kernel, lam, sketch, None)
    # Every exact score is > 0 for k_ii > 0; the floor only guards rounding so that m distinct draws exist.
    p = tau.clamp_min(torch.finfo(tau.dtype).eps * float(tau.max().clamp_min(torch.finfo(tau.dtype).tiny)))
    idx = _sample_without_replacement(p, m, gen)
    return X[idx], idx


def choose_m(X: torch.Tensor, kernel: gpytorch.kernels.Kernel, noise: float, m_max: int | None = None,
             seed: int = 0, **rank_options: Any) -> int:
    """``m = auto``: the numerical rank ``#{lambda_i(K_1) > 0.1 mu}`` of the unit-variance kernel matrix ``K_1``.

    ``mu = noise / outputscale`` (``K + sigma^2 I = outputscale (K_1 + mu I)``), estimated by
    :func:`gpnys.precond.rank.estimate_rank` (AFN paper Algorithm 4; exact for ``n <=`` its subsample size 500)
    at the kernel's current length-scale, then clipped to ``[1, min(n, m_max or n)]``.

    Args:
        X: ``(n, d)`` points; kernel: GPyTorch kernel (a ``ScaleKernel`` is unwrapped); noise: ``sigma^2 > 0``.
        m_max: optional upper bound, ``>= 1``.
        seed: seed of the rank estimate's subsamples.
        rank_options: forwarded to :func:`~gpnys.precond.rank.estimate_rank` (``m``, ``reps``, ``refine_n``, ...).

    Returns:
        ``m`` as an ``int``.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> from gpnys.reduced import choose_m
        >>> kernel.outputscale = 2.0
        >>> m = choose_m(X, kernel, noise=0.02)  # mu = noise / outputscale = 0.01

        For ``n <= 500`` the estimate is exact: the eigenvalues of the unit-variance kernel matrix above ``0.1 mu``.

        >>> eigenvalues = torch.linalg.eigvalsh(kernel.base_kernel(X).to_dense().detach())
        >>> m == int((eigenvalues > 0.1 * 0.01).sum())
        True
    """
    validate_points(X)
    _validate_kernel(kernel)
    lam = _validate_noise(noise)
    seed = _validate_seed(seed)
    n = X.shape[0]
    cap = n if m_max is None else min(n, validate_count(m_max, "m_max", 1))
    _, outputscale = split_outputscale(kernel)
    if not (outputscale > 0 and math.isfinite(outputscale)):
        raise ValueError(f"kernel outputscale must be positive and finite, got {outputscale}")
    k = estimate_rank(X, kernel, lam / outputscale, seed=seed, **rank_options).k
    return int(min(max(int(k), 1), cap))
