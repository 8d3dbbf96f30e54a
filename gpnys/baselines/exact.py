"""The exact reference loss: ``-MLL / n`` by one Cholesky, with its gradient in closed form (:func:`cholesky_loss`).

The same exact loss as GPyTorch's Cholesky path, without autograd through the ``n x n`` Cholesky and kernel: a
fraction of the time and memory of a GPyTorch Cholesky step, which makes full-split Cholesky baselines practical
(``fit(..., loss=cholesky_loss)``; docs/training.md).
"""

from __future__ import annotations

import math
from typing import Any

import gpytorch
import torch

from gpnys.kernels.operator import StationaryKernelOperator, supported
from gpnys.linalg import safe_cholesky

__all__ = ["cholesky_loss"]


def cholesky_loss(model: gpytorch.models.ExactGP, cache: dict[str, Any] | None = None) -> torch.Tensor:
    """``-MLL / n`` of ``model`` on its training data by one Cholesky, with the exact gradient in closed form.

    The loss is ``(r^T a + log det K̂ + n log 2 pi) / (2n)`` with ``K̂ = s^2 K + sigma^2 I``, ``r = y - m``,
    ``a = K̂^{-1} r`` (Rasmussen & Williams 2006, eq. 5.8), and its derivative (eq. 5.9)
    ``d/dtheta = tr((K̂^{-1} - a a^T) dK̂/dtheta) / (2n)``, ``d/dm = -a / n``. The trace with the kernel
    derivative is :meth:`StationaryKernelOperator.weighted_derivative`; ``K̂^{-1}`` comes from
    ``torch.cholesky_inverse``. Returns a 0-dim tensor equal to the loss whose ``backward()`` puts that gradient
    on the model's raw parameters (through their constraints), as ``-ExactMarginalLogLikelihood`` would.

    Args:
        model: an ``ExactGP`` whose ``covar_module`` is a ``ScaleKernel`` over a plain RBF/Matérn kernel and whose
            likelihood is a ``GaussianLikelihood``, without priors; any mean module.
        cache: a dict kept across calls (the operator's dense-kernel buffers).

    Memory: ``K`` (and ``k'/r`` for Matérn), the factor and the inverse: 3-4 ``n x n`` buffers.

    Example:
        The same value and gradient as GPyTorch's ``-ExactMarginalLogLikelihood`` on its Cholesky path:

        >>> import gpytorch, torch
        >>> from gpnys.baselines.exact import cholesky_loss
        >>> from gpnys.gp import ExactGPModel
        >>> _ = torch.manual_seed(0)
        >>> X = torch.rand(100, 2, dtype=torch.float64)
        >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(100, dtype=torch.float64)
        >>> model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").double()
        >>> loss = cholesky_loss(model)
        >>> loss.backward()
        >>> grads = [p.grad.clone() for p in model.parameters()]
        >>> model.zero_grad()
        >>> mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        >>> with gpytorch.settings.max_cholesky_size(10_000):
        ...     ref = -mll(model(X), y)
        ...     ref.backward()
        >>> abs(loss.item() - ref.item()) < 1e-12
        True
        >>> all(torch.allclose(g, p.grad, atol=1e-12) for g, p in zip(grads, model.parameters()))
        True
    """
    kern, lik = model.covar_module, model.likelihood
    if not (isinstance(kern, gpytorch.kernels.ScaleKernel) and supported(kern.base_kernel)
            and type(lik) is gpytorch.likelihoods.GaussianLikelihood and not list(model.named_priors())):
        raise ValueError("cholesky_loss needs ScaleKernel(RBF or Matérn) with a GaussianLikelihood and no priors")
    X, y = model.train_inputs[0], model.train_targets
    n = X.shape[0]
    s2, ls, noise = kern.outputscale, kern.base_kernel.lengthscale, lik.noise.reshape(-1)[0]
    mean = model.mean_module(X)
    op = StationaryKernelOperator(X, s2, ls, base=kern.base_kernel, cache={} if cache is None else cache,
                                  dense_limit_bytes=1 << 62)
    with torch.no_grad():
        K = op._dense()[0]
        A = K * s2.detach()
        A.diagonal().add_(noise.detach())
        L = safe_cholesky(A, "cholesky_loss: K + noise I")
        del A
        r = (y - mean.detach())[:, None]
        alpha = torch.cholesky_solve(r, L)
        value = 0.5 * ((r * alpha).sum() + 2.0 * L.diagonal().log().sum()) / n + 0.5 * math.log(2 * math.pi)
        W = torch.cholesky_inverse(L)
        del L
        W.sub_(alpha @ alpha.mT)  # K̂^{-1} - a a^T
        g_noise = 0.5 * W.diagonal().sum() / n
        g_s2, g_ls = op.weighted_derivative(lambda rows, cols: W[rows][:, cols])  # noqa: F821 (overwrites W)
        g_s2, g_ls = 0.5 * g_s2 / n, 0.5 * g_ls / n
        del W
    # value + <theta - stop_grad(theta), gradient>: the value of the loss, the gradient of the closed form
    return (value + (s2 - s2.detach()) * g_s2 + ((ls - ls.detach()) * g_ls).sum()
            + (noise - noise.detach()) * g_noise - ((mean - mean.detach()) * alpha[:, 0]).sum() / n)
