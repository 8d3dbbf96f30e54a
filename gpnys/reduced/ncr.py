"""NCR: Nyström computational regularization (Rudi et al. 2015; [SPA] §II-F eq. (11); [NSL] eq. (6), (21)).

The hypothesis space is ``span{k(c_j, .)}``: ``f(z) = k(z, C) beta`` with

    beta = (K_mn K_nm + sigma^2 K_mm)^+ K_mn (y - m)          ([SPA] eq. (11), lambda_0 = sigma^2)

computed here in that landmark form (as the least-squares problem it solves, by the thresholded pseudo-inverse of
``[K_nm; sigma K_mm^1/2]``), not through the LLA features — so that [SPA] Prop 2 / Cor 1 (NCR = LLA when every
landmark direction is kept) is a check between two independent computations. The predictive variance is LLA's (the
same GP on ``span(C)``).
"""

from __future__ import annotations

import gpytorch
import torch

from gpnys.kernels.blocks import kernel_block
from gpnys.reduced.features import Solver
from gpnys.reduced.lla import LLAPosterior, validate_test_points

__all__ = ["NCRPosterior"]


class NCRPosterior(LLAPosterior):
    """NCR posterior: mean ``k(z, C) beta`` ([SPA] eq. (11)); variance as :class:`LLAPosterior` (all directions).

    Args: as :class:`~gpnys.reduced.lla.LLAPosterior` without ``rank``; ``rtol`` also cuts the singular values of
    ``[K_nm; sigma K_mm^1/2]`` relative to the largest in ``beta``'s solve.

    Attributes:
        beta: ``(m,)`` landmark coefficients.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import NCRPosterior
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> ncr = NCRPosterior(kernel, X, y, 0.01, C)
        >>> beta = torch.linalg.solve(k(C, X) @ k(X, C) + 0.01 * k(C, C), k(C, X) @ y)  # [SPA] eq. (11)
        >>> torch.allclose(ncr.beta, beta), torch.allclose(ncr.mean(Z), k(Z, C) @ beta)
        (True, True)
    """

    method = "ncr"

    def __init__(self, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, noise: float,
                 landmarks: torch.Tensor, prior_mean: float = 0.0, variance: str = "dtc", rtol: float | None = None,
                 solver: Solver | None = None) -> None:
        super().__init__(kernel, X, y, noise, landmarks, prior_mean=prior_mean, variance=variance, rtol=rtol,
                         solver=solver)
        work = torch.promote_types(X.dtype, torch.float64)
        Knm = self.features.cross(X).to(work)
        Kmm = kernel_block(kernel, landmarks, landmarks).to(work)
        m = Kmm.shape[0]
        # beta minimises ||K_nm beta - r||^2 + sigma^2 beta^T K_mm beta: the least-squares problem of the stacked
        # [K_nm; sigma K_mm^1/2] against [r; 0], solved by its SVD's pseudo-inverse. Its singular values are the
        # square roots of (K_mn K_nm + sigma^2 K_mm)'s eigenvalues, so the solve holds twice the digits of a pseudo-
        # inverse of that matrix, which lost K_mm's small directions (an RKHS error of 0.18 where LLA's was 9e-4,
        # RBF, length-scale 3, m = 100)
        evals, V = torch.linalg.eigh(Kmm)
        root = (V * evals.clamp_min(0.0).sqrt()) @ V.mT
        S = torch.cat([Knm, self.noise ** 0.5 * root])
        rhs = torch.cat([self.residual.to(work), Knm.new_zeros(m)])
        # eigh's eigenvalues carry absolute errors of about eps lambda_max, so K_mm^1/2 is known only to
        # sqrt(eps lambda_max) in its near-null directions: S's singular values below sigma times that are rounding
        # (kept, their inverses made beta depend on the BLAS's thread count, RKHS errors 3e-4 or 3e-3 on one problem)
        eps = torch.finfo(work).eps
        floor = float((self.noise * eps * evals.max().clamp_min(0.0)) ** 0.5)
        pinv = torch.linalg.pinv(S, atol=floor, rtol=m * eps if rtol is None else rtol)
        self.beta = (pinv @ rhs).to(X.dtype)

    def mean(self, Z: torch.Tensor) -> torch.Tensor:
        validate_test_points(Z, self.X.shape[1])
        return self.prior_mean + self.features.cross(Z) @ self.beta
