"""GSA: the Gram-matrix substitution ("naive") approach (Williams & Seeger 2001; [SPA] §II-D eq. (3), Cor 3).

Substitute ``K~ = K_nm K_mm^+ K_mn = Phi Phi^T`` for ``K`` in the training solve and predict with the *exact*
kernel against all n training points: ``f(z) = m + k(z, X) alpha``. The training solve is LLA's ([SPA] §III-D,
Cor 3 and Algorithm 1: GSA and LLA differ in one term only, ``X_H`` vs. ``X~_H``). The coefficient is not unique:
[SPA] (3) depends on ``alpha`` only through ``G alpha``, so every ``alpha`` with ``G alpha = w_hat`` solves it,
and they predict differently. Two choices:

* ``coef="woodbury"`` (the Nyström GP of Williams & Seeger): ``alpha = (K~ + sigma^2 I)^{-1} (y - m)
  = (y - m - Phi w_hat) / sigma^2`` ([NSL] eq. (23); the LLA training residual over sigma^2);
* ``coef="min_norm"`` (default; [SPA] Algorithm 1, the papers' plots): ``alpha = G^+ w_hat``, the minimum-norm solution
  of ``Phi^T alpha = w_hat`` (least squares through a QR of ``Phi``: the ``n x s`` pseudo-inverse of the possibly
  ill-conditioned ``G`` is never formed).

They differ by ``y_perp / sigma^2``, ``y_perp = (I - G^+ G)(y - m)``. Variance (both): the exact prior term
minus the Nyström-GP reduction, ``k_zz - k_z^T (K~ + sigma^2 I)^{-1} k_z``
``= k_zz - (|k_z|^2 - k_z^T Phi M^{-1} Phi^T k_z) / sigma^2``; the joint "covariance" it comes from mixes
approximate and exact blocks and is not PSD (the Nyström GP is not a proper GP prior: Williams, Rasmussen,
Schwaighofer & Tresp 2002), so it can go negative: it is clamped at zero with a warning. It subtracts two terms of size
``|k_z|^2 / sigma^2``, so expect cancellation error of ``eps |k_z|^2 / sigma^2`` (large in float32).
"""

from __future__ import annotations

import warnings

import gpytorch
import torch

from gpnys.checks import NumericalWarning, validate_choice
from gpnys.kernels.blocks import kernel_block, kernel_diag
from gpnys.reduced.features import Solver
from gpnys.reduced.lla import LLAPosterior, validate_test_points

__all__ = ["GSAPosterior", "COEFFICIENTS"]

COEFFICIENTS = ("woodbury", "min_norm")


class GSAPosterior(LLAPosterior):
    """GSA posterior (module docstring). Args as :class:`~gpnys.reduced.lla.LLAPosterior` plus ``coef``.

    Attributes:
        alpha: ``(n,)`` coefficients on the training points.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import GSAPosterior
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> gsa = GSAPosterior(kernel, X, y, 0.01, C, coef="woodbury")

        The Nyström GP of Williams & Seeger: ``K~ = Phi Phi^T`` in the training solve, the exact kernel at ``Z``:

        >>> alpha = torch.linalg.solve(gsa.Phi @ gsa.Phi.mT + 0.01 * torch.eye(200, dtype=torch.float64), y)
        >>> torch.allclose(gsa.alpha, alpha), torch.allclose(gsa.mean(Z), k(Z, X) @ alpha)
        (True, True)

        The minimum-norm coefficient solves the same training problem ``Phi^T alpha = w_hat``:

        >>> gsa = GSAPosterior(kernel, X, y, 0.01, C)  # coef="min_norm"
        >>> torch.allclose(gsa.Phi.mT @ gsa.alpha, gsa.w)
        True
    """

    method = "gsa"

    def __init__(self, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, noise: float,
                 landmarks: torch.Tensor, prior_mean: float = 0.0, coef: str = "min_norm", rtol: float | None = None,
                 solver: Solver | None = None) -> None:
        validate_choice(coef, "coef", COEFFICIENTS)
        super().__init__(kernel, X, y, noise, landmarks, prior_mean=prior_mean, rtol=rtol, solver=solver)
        self.coef = coef
        if coef == "woodbury":
            self.alpha = (self.residual - self.Phi @ self.w) / self.noise
        else:  # min-norm solution of Phi^T alpha = w: Phi = Q R, alpha = Q R^{-T} w (Phi has full column rank
            # when the landmarks are data points, [SPA] Prop 5; QR works on every device, unlike lstsq's drivers)
            Q, R = torch.linalg.qr(self.Phi)
            self.alpha = Q @ torch.linalg.solve_triangular(R.mT, self.w[:, None], upper=False)[:, 0]

    def _cross_train(self, Z: torch.Tensor) -> torch.Tensor:
        validate_test_points(Z, self.X.shape[1])
        return kernel_block(self.kernel, Z, self.X)  # (nz, n)

    def mean(self, Z: torch.Tensor) -> torch.Tensor:
        return self.prior_mean + self._cross_train(Z) @ self.alpha

    def variance(self, Z: torch.Tensor) -> torch.Tensor:
        Kzx = self._cross_train(Z)
        U = Kzx @ self.Phi  # rows (Phi^T k_z)^T: (nz, s)
        reduction = (Kzx.square().sum(1) - self.gp.sor_variance(U) / self.noise) / self.noise
        v = kernel_diag(self.kernel, Z) - reduction
        neg = v < 0
        if bool(neg.any()):
            warnings.warn(f"GSA: the naive variance k_zz - k_z^T (K~ + sigma^2 I)^-1 k_z is negative at "
                          f"{int(neg.sum())} of {v.numel()} points (min {float(v.min()):.3g}); clamped at 0 "
                          "(the GSA joint covariance is not PSD; DTC variances come from LLAPosterior)",
                          NumericalWarning, stacklevel=2)
        return v.clamp_min(0.0)
