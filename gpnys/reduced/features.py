"""Gaussian-process regression on an explicit feature map: the linear solver shared by LLA/NCR and RFF.

With features ``phi(x) in R^s`` (rows of ``Phi``, ``(n, s)``) the model ``y = phi(x)^T w + eps``,
``w ~ N(0, I_s)``, ``eps ~ N(0, sigma^2)`` is the GP with kernel ``phi(x)^T phi(x')``. Its posterior (the GP
reading of [SPA]'s LLA with ``lambda_0 = sigma^2``; the papers themselves give no GP formulas):

* ``w | y ~ N(w_hat, sigma^2 M^{-1})`` with ``M = Phi^T Phi + sigma^2 I_s`` and ``w_hat = M^{-1} Phi^T y``
  — the ridge (KRR, ``lambda_0 = sigma^2``) solution of LLA, [SPA] eq. (12);
* mean ``phi_z^T w_hat``; subset-of-regressors variance ``v_SoR(z) = sigma^2 phi_z^T M^{-1} phi_z``.

The ``s x s`` system is solved by Cholesky (``s`` is at most a few thousand), or by any callable
``solver(M, B) -> M^{-1} B`` — the point of LLA is that an off-the-shelf linear solver trains it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from gpnys.linalg import safe_cholesky

__all__ = ["FeatureGP", "feature_nll"]

Solver = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FeatureGP:
    """Posterior of the Bayesian linear model on features (module docstring).

    Args:
        Phi: ``(n, s)`` training features.
        y: ``(n,)`` targets, with the prior mean already subtracted.
        noise: ``sigma^2 > 0``.
        solver: optional ``solver(M, B)`` returning ``M^{-1} B`` for ``M (s, s)``, ``B (s, t)``; default
            Cholesky (the factor is kept for the variances).

    Attributes:
        w: ``(s,)`` posterior mean of the weights.

    Example:
        >>> import torch
        >>> from gpnys.reduced.features import FeatureGP
        >>> g = torch.Generator().manual_seed(0)
        >>> Phi = torch.randn(50, 5, dtype=torch.float64, generator=g)  # training features
        >>> Phi_z = torch.randn(3, 5, dtype=torch.float64, generator=g)  # test features
        >>> y = torch.randn(50, dtype=torch.float64, generator=g)
        >>> gp = FeatureGP(Phi, y, noise=0.1)

        The same posterior as the GP with kernel ``Phi Phi^T`` in function space:

        >>> A = Phi @ Phi.mT + 0.1 * torch.eye(50, dtype=torch.float64)
        >>> torch.allclose(gp.mean(Phi_z), Phi_z @ Phi.mT @ torch.linalg.solve(A, y))
        True
        >>> Kz = Phi_z @ Phi.mT
        >>> prior = (Phi_z * Phi_z).sum(1)
        >>> torch.allclose(gp.sor_variance(Phi_z), prior - (Kz * torch.linalg.solve(A, Kz.mT).mT).sum(1))
        True
    """

    def __init__(self, Phi: torch.Tensor, y: torch.Tensor, noise: float, solver: Solver | None = None) -> None:
        s = Phi.shape[1]
        self.noise = float(noise)
        self.M = Phi.mT @ Phi
        self.M.diagonal().add_(self.noise)
        self.L = None if solver is not None else safe_cholesky(self.M, "FeatureGP: Phi^T Phi + noise I")
        self._solver = solver
        self.w = self.solve(Phi.mT @ y[:, None])[:, 0] if s else Phi.new_zeros(0)

    def solve(self, B: torch.Tensor) -> torch.Tensor:
        """``M^{-1} B`` for ``B (s, t)``."""
        if self._solver is not None:
            return self._solver(self.M, B)
        return torch.cholesky_solve(B, self.L)

    def mean(self, Phi_z: torch.Tensor) -> torch.Tensor:
        """Posterior mean ``(m,)`` at test features ``Phi_z (m, s)``."""
        return Phi_z @ self.w

    def sor_variance(self, Phi_z: torch.Tensor) -> torch.Tensor:
        """``sigma^2 phi_z^T M^{-1} phi_z`` (``(m,)``): the variance of ``phi_z^T w`` (no noise)."""
        if self.L is not None:
            V = torch.linalg.solve_triangular(self.L, Phi_z.mT, upper=False)
            return self.noise * V.square().sum(0)
        return self.noise * (Phi_z.mT * self.solve(Phi_z.mT)).sum(0)


def feature_nll(Phi: torch.Tensor, y: torch.Tensor, noise: torch.Tensor,
                trace_gap: torch.Tensor | None = None) -> torch.Tensor:
    """``-log N(y | 0, Phi Phi^T + sigma^2 I) / n`` (the DTC evidence), differentiable in ``Phi`` and ``noise``.

    By Woodbury with ``M = Phi^T Phi + sigma^2 I``: ``log det = (n - s) log sigma^2 + log det M`` and
    ``y^T (.)^{-1} y = (y^T y - y^T Phi M^{-1} Phi^T y) / sigma^2``: ``O(n s^2)``. With ``trace_gap`` =
    ``tr(K - Phi Phi^T)`` it adds ``trace_gap / (2 sigma^2 n)``, giving minus Titsias' (2009) collapsed
    variational bound per point (SGPR's objective).

    Args:
        Phi: ``(n, s)``; y: ``(n,)`` (prior mean subtracted); noise: 0-dim tensor ``sigma^2``.

    Example:
        >>> import torch
        >>> from gpnys.reduced.features import feature_nll
        >>> g = torch.Generator().manual_seed(0)
        >>> Phi = torch.randn(50, 5, dtype=torch.float64, generator=g)
        >>> y = torch.randn(50, dtype=torch.float64, generator=g)
        >>> noise = torch.tensor(0.1, dtype=torch.float64)
        >>> cov = Phi @ Phi.mT + noise * torch.eye(50, dtype=torch.float64)
        >>> ref = -torch.distributions.MultivariateNormal(torch.zeros(50, dtype=torch.float64), cov).log_prob(y) / 50
        >>> torch.allclose(feature_nll(Phi, y, noise), ref)
        True
    """
    n, s = Phi.shape
    M = Phi.mT @ Phi + noise * torch.eye(s, dtype=Phi.dtype, device=Phi.device)
    L = torch.linalg.cholesky(M)
    b = torch.linalg.solve_triangular(L, Phi.mT @ y[:, None], upper=False)
    quad = (y.square().sum() - b.square().sum()) / noise
    logdet = (n - s) * torch.log(noise) + 2.0 * L.diagonal().log().sum()
    out = 0.5 * (quad + logdet + n * math.log(2 * math.pi)) / n
    if trace_gap is not None:
        out = out + 0.5 * trace_gap / (noise * n)
    return out
