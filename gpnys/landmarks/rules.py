"""Landmark rules by name, and how many landmarks (``m = auto``).

:func:`select` dispatches the rules of :data:`METHODS` (``"fps"``, ``"uniform"``, ``"kmeans"``);
:func:`select_landmarks` adds ``"leverage"`` (ridge-leverage-score sampling, :mod:`gpnys.landmarks.leverage`) and
checks its arguments — the samplers of [SPA] §IV-A and [NSL] §4 and its supplement §5, plus FPS. Landmarks are
always **distinct** rows of X (sampling without replacement): sampling with replacement, as in [NSL]'s supplement
§5, duplicates landmarks and makes ``K_mm`` singular.

:func:`choose_m` gives ``m = auto``: the AFN paper's numerical rank ``#{lambda_i(K) > 0.1 mu}`` of the unit-variance
kernel (``mu = noise / outputscale``), from :func:`gpnys.landmarks.rank.estimate_rank`.
"""

from __future__ import annotations

import math
from typing import Any

import gpytorch
import torch

from gpnys.checks import validate_choice, validate_count, validate_points
from gpnys.kernels.entries import split_outputscale
from gpnys.landmarks.clustering import kmeans
from gpnys.landmarks.common import generator, validate_kernel, validate_noise, validate_points_k, validate_seed
from gpnys.landmarks.farthest import fps
from gpnys.landmarks.leverage import leverage_sample
from gpnys.landmarks.rank import estimate_rank
from gpnys.landmarks.sampling import uniform

__all__ = ["METHODS", "RULES", "choose_m", "select", "select_landmarks"]

METHODS = ("fps", "uniform", "kmeans")
RULES = ("uniform", "fps", "kmeans", "leverage")


def select(X: torch.Tensor, k: int, method: str = "fps", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose ``k`` landmarks of ``X (n, d)`` by ``method`` in :data:`METHODS` (:func:`select_landmarks` adds the
    leverage rule).

    Returns ``(points (k, d), indices (k,) or None)``; k-means centres are not rows of X, so their
    indices are ``None``.

    Example:
        >>> import torch
        >>> from gpnys.landmarks import select
        >>> X = torch.rand(100, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> C, idx = select(X, 8, "uniform", seed=1)
        >>> torch.equal(C, X[idx]), select(X, 8, "kmeans")[1]
        (True, None)
    """
    if method == "fps":
        idx = fps(X, k).indices
    elif method == "uniform":
        validate_points_k(X, k)
        idx = uniform(X.shape[0], k, seed=seed, device=X.device)
    elif method == "kmeans":
        return kmeans(X, k, seed=seed).centers, None
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return X[idx], idx


def select_landmarks(X: torch.Tensor, m: int, rule: str = "fps", kernel: gpytorch.kernels.Kernel | None = None,
                     noise: float | None = None, seed: int = 0,
                     sketch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose ``m`` landmarks of X by ``rule`` in :data:`RULES`.

    * ``"uniform"``: ``m`` distinct rows uniformly at random; ``"fps"``: farthest point sampling (AFN paper
      Algorithm 6; deterministic, ``seed`` unused); ``"kmeans"``: k-means++ / Lloyd centres (Zhang & Kwok 2008),
      not data points — :func:`select`.
    * ``"leverage"``: ridge-leverage-score sampling (Alaoui & Mahoney 2015; Musco & Musco 2017) at
      ``lambda = noise``: scores from :func:`~gpnys.landmarks.leverage.ridge_leverage_scores` with a seeded
      uniform sketch of ``min(n, 2 m)`` rows (``sketch_size`` overrides it), then ``m`` **distinct** indices drawn
      successively with probabilities ``∝ tau~`` (``torch.multinomial`` without replacement, seeded generator on X's device).
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
        >>> from gpnys.landmarks import fps, select_landmarks
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
    validate_choice(rule, "rule", RULES)
    seed = validate_seed(seed)
    if noise is not None:
        validate_noise(noise)
    if rule != "leverage":
        return select(X, m, method=rule, seed=seed)
    validate_kernel(kernel)
    lam = validate_noise(noise)
    idx = leverage_sample(X, m, kernel, lam, generator(seed, X.device), sketch_size)
    return X[idx], idx


def choose_m(X: torch.Tensor, kernel: gpytorch.kernels.Kernel, noise: float, m_max: int | None = None,
             seed: int = 0, **rank_options: Any) -> int:
    """``m = auto``: the numerical rank ``#{lambda_i(K_1) > 0.1 mu}`` of the unit-variance kernel matrix ``K_1``.

    ``mu = noise / outputscale`` (``K + sigma^2 I = outputscale (K_1 + mu I)``), estimated by
    :func:`gpnys.landmarks.rank.estimate_rank` (AFN paper Algorithm 4; exact for ``n <=`` its subsample size 500)
    at the kernel's current length-scale, then clipped to ``[1, min(n, m_max or n)]``.

    Args:
        X: ``(n, d)`` points; kernel: GPyTorch kernel (a ``ScaleKernel`` is unwrapped); noise: ``sigma^2 > 0``.
        m_max: optional upper bound, ``>= 1``.
        seed: seed of the rank estimate's subsamples.
        rank_options: forwarded to :func:`~gpnys.landmarks.rank.estimate_rank` (``m``, ``reps``, ``refine_n``, ...).

    Returns:
        ``m`` as an ``int``.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> from gpnys.landmarks import choose_m
        >>> kernel.outputscale = 2.0
        >>> m = choose_m(X, kernel, noise=0.02)  # mu = noise / outputscale = 0.01

        For ``n <= 500`` the estimate is exact: the eigenvalues of the unit-variance kernel matrix above ``0.1 mu``.

        >>> eigenvalues = torch.linalg.eigvalsh(kernel.base_kernel(X).to_dense().detach())
        >>> m == int((eigenvalues > 0.1 * 0.01).sum())
        True
    """
    validate_points(X)
    validate_kernel(kernel)
    lam = validate_noise(noise)
    seed = validate_seed(seed)
    n = X.shape[0]
    cap = n if m_max is None else min(n, validate_count(m_max, "m_max", 1))
    _, outputscale = split_outputscale(kernel)
    if not (outputscale > 0 and math.isfinite(outputscale)):
        raise ValueError(f"kernel outputscale must be positive and finite, got {outputscale}")
    k = estimate_rank(X, kernel, lam / outputscale, seed=seed, **rank_options).k
    return int(min(max(int(k), 1), cap))
