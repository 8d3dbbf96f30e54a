"""The dense Laplace approximation of a GP with a non-Gaussian likelihood: the reference :mod:`gpnys.classify` is
checked against.

Rasmussen & Williams (2006), Algorithm 3.1: Newton's method for the mode with a Cholesky factor of
``B = I + W^½ K W^½`` and the approximate log marginal likelihood ``log q(y|X)`` (eq. (3.32)), for any
:class:`~gpnys.classify.likelihoods.LaplaceLikelihood` (default: Bernoulli, logistic link).
``O(n³)`` time and ``O(n²)`` memory: for checks at small and moderate n.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from gpnys.checks import NumericalWarning
from gpnys.classify.laplace import at_mode, halve_step
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


def dense_laplace(K: torch.Tensor, y: torch.Tensor, tol: float = 1e-12, max_iter: int = 500,
                  extra: int = 3, likelihood: LaplaceLikelihood | None = None) -> DenseLaplace:
    """R&W Algorithm 3.1 on the kernel matrix ``K`` ``(n, n)`` and observations ``y`` ``(n,)`` (labels 0/1 for the
    default Bernoulli ``likelihood``): Newton steps, each halved while it lowers the objective
    ``Ψ = log p(y|f) − ½ aᵀf`` (Algorithm 3.1's safeguard: a first step from ``f = 0`` overshoots for counts in the
    hundreds or heavy-tailed noise), until a full step would move no ``f_i`` by more than
    ``tol * max(1, max|f|)`` (``tol`` at least 100 machine epsilons of ``K``'s dtype), or the steps stop shrinking
    while ``Ψ`` no longer rises above its rounding (the mode at this precision: rounding in ``K``'s solves keeps
    moving ``f`` by about ``1e-10`` for counts in the hundreds, and Student-t noise of small ``df`` with far
    outliers makes ``Ψ`` flat near its maximum), then ``extra`` more, so that
    when ``K`` carries autograd the derivative of the iterate is the implicit derivative of the mode (the Newton map
    converges quadratically in both). A ``NumericalWarning`` when ``max_iter`` steps end before that: ``f`` is not
    the mode, and ``log_q`` is not its Laplace approximation. Student-t noise's steps are Fisher scoring (its ``W``
    is the Fisher information), which converges linearly: ``df = 1.5`` with 10 % outliers 100 scales away takes
    about 150 steps, hence the default ``max_iter``; a Newton step costs ``O(n³)``, and a converged run stops early.

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
    eps = torch.finfo(K.dtype).eps
    tol = max(tol, 100 * eps)
    a, f = K.new_zeros(n), K.new_zeros(n)

    def objective(a_t: torch.Tensor, f_t: torch.Tensor) -> float:
        return float((lik.log_prob(f_t, y) - 0.5 * (a_t * f_t).sum()).detach())

    psi = objective(a, f)
    left = None
    step = last = float("inf")
    for _ in range(max_iter):
        grad, W, _ = lik.derivatives(f, y)
        sW = W.sqrt()
        L = torch.linalg.cholesky(eye + sW[:, None] * K * sW)
        b = W * f + grad
        da = b - sW * torch.cholesky_solve((sW * (K @ b))[:, None], L)[:, 0] - a
        df = K @ da
        step = float(df.detach().abs().max())
        # halved while Ψ falls by more than its rounding; a full step where none gains (at the mode, where the
        # step is rounding itself): then the iterate stays the Newton map's, which the autograd derivative needs
        slack = 64 * eps * (abs(psi) + n)
        halved = halve_step(lambda t: objective(a + t * da, f + t * df), psi, slack)
        t, new = (1.0, objective(a + da, f + df)) if halved is None else halved
        gain, psi = new - psi, new
        a, f = a + t * da, f + t * df
        if left is None and at_mode(step, last, gain, slack, tol, float(f.detach().abs().max())):
            left = extra
        last = step
        if left is not None:
            if left == 0:
                break
            left -= 1
    if left is None:
        warnings.warn(f"dense_laplace: Newton's method stopped at max_iter = {max_iter} steps, its last step moving "
                      f"f by {step:.2e} (tol {tol:.0e} relative): f is not the mode, nor log_q its Laplace "
                      "approximation", NumericalWarning, stacklevel=2)
    # the iterate a (= K⁻¹f), not ∇log p(y|f): the two agree at the mode, but where W is large (counts in the
    # thousands at outputscale 1e4) ∇log p amplifies f's rounding, and log_q was 0.086 off (and +3289 at 1e8)
    W = lik.derivatives(f, y)[1]
    L = torch.linalg.cholesky(eye + W.sqrt()[:, None] * K * W.sqrt())
    log_q = -0.5 * a @ f + lik.log_prob(f, y) - L.diagonal().log().sum()
    return DenseLaplace(f=f, a=a, W=W, L=L, log_q=log_q)
