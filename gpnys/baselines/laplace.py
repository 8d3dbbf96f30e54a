"""The dense Laplace approximation of a GP with a non-Gaussian likelihood: the reference :mod:`gpnys.classify` is
checked against.

Rasmussen & Williams (2006), Algorithm 3.1: Newton's method for the mode with a Cholesky factor of
``B = I + W^½ K W^½`` and the approximate log marginal likelihood ``log q(y|X)`` (eq. (3.32)), for any
:class:`~gpnys.classify.likelihoods.LaplaceLikelihood` (default: Bernoulli, logistic link).
``O(n³)`` time and ``O(n²)`` memory: for checks at small and moderate n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpnys.classify.likelihoods import Bernoulli, LaplaceLikelihood

__all__ = ["DenseLaplace", "dense_laplace"]


@dataclass
class DenseLaplace:
    """The mode ``f`` ``(n,)``, ``a = ∇ log p(y|f)`` ``(n,)`` (``= K⁻¹ f`` at the mode), ``W`` ``(n,)``, the Cholesky
    factor ``L`` of ``B`` ``(n, n)`` and ``log_q`` (0-dim; with autograd when ``K`` has it)."""

    f: torch.Tensor
    a: torch.Tensor
    W: torch.Tensor
    L: torch.Tensor
    log_q: torch.Tensor

    def latent(self, Ks: torch.Tensor, kss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent predictive mean ``k*ᵀ a`` and variance ``k** − vᵀv``, ``v = L⁻¹ W^½ k*`` (R&W Algorithm 3.2,
        eq. (3.21), (3.24)) at ``m`` test points: ``Ks = K(X, X*)`` ``(n, m)``, ``kss = k(x*, x*)`` ``(m,)``."""
        v = torch.linalg.solve_triangular(self.L, self.W.sqrt()[:, None] * Ks, upper=False)
        return Ks.mT @ self.a, kss - (v * v).sum(0)


def dense_laplace(K: torch.Tensor, y: torch.Tensor, tol: float = 1e-12, max_iter: int = 100,
                  extra: int = 3, likelihood: LaplaceLikelihood | None = None) -> DenseLaplace:
    """R&W Algorithm 3.1 on the kernel matrix ``K`` ``(n, n)`` and observations ``y`` ``(n,)`` (labels 0/1 for the
    default Bernoulli ``likelihood``): Newton steps until
    no ``f_i`` moves by more than ``tol``, then ``extra`` more, so that when ``K`` carries autograd the derivative of
    the iterate is the implicit derivative of the mode (the Newton map converges quadratically in both).

    Example:
        >>> import torch
        >>> from gpnys.baselines.laplace import dense_laplace
        >>> X = torch.linspace(0, 1, 50, dtype=torch.float64)[:, None]
        >>> K = torch.exp(-0.5 * (X - X.T) ** 2 / 0.1**2)
        >>> out = dense_laplace(K, (X[:, 0] > 0.5).double())
        >>> bool(torch.allclose(K @ out.a, out.f))  # the mode: f = K ∇log p(y|f), R&W eq. (3.17)
        True
        >>> round(float(out.log_q), 4) < 0
        True
    """
    lik = Bernoulli() if likelihood is None else likelihood
    n = K.shape[0]
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    f = K.new_zeros(n)
    left = None
    for _ in range(max_iter):
        grad, W, _ = lik.derivatives(f, y)
        sW = W.sqrt()
        L = torch.linalg.cholesky(eye + sW[:, None] * K * sW)
        b = W * f + grad
        a = b - sW * torch.cholesky_solve((sW * (K @ b))[:, None], L)[:, 0]
        f_new = K @ a
        moved = float((f_new - f).detach().abs().max())
        f = f_new
        if left is None and moved < tol:
            left = extra
        if left is not None:
            if left == 0:
                break
            left -= 1
    a, W, _ = lik.derivatives(f, y)
    L = torch.linalg.cholesky(eye + W.sqrt()[:, None] * K * W.sqrt())
    log_q = -0.5 * a @ f + lik.log_prob(f, y) - L.diagonal().log().sum()
    return DenseLaplace(f=f, a=a, W=W, L=L, log_q=log_q)
