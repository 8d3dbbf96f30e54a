"""Fantasy posteriors without an ``(n + q) x (n + q)`` factorisation: Gaussian conditioning of a joint posterior.

A GP conditioned on ``q`` extra noisy observations ``y_q`` at ``X_q`` (noise variances ``s``) has, at test points
``X_t``, the posterior of the base model's joint posterior over ``[X_t, X_q]`` (mean ``μ``, covariance ``Σ``)
conditioned on ``y_q = f(X_q) + ε`` (the conditional of a joint Gaussian, Rasmussen & Williams 2006, eq. A.6):

``μ_t|q = μ_t + Σ_tq C⁻¹ (y_q − μ_q)``,  ``Σ_t|q = Σ_tt − Σ_tq C⁻¹ Σ_qt``,  ``C = Σ_qq + diag(s)`` (``q x q``).

This is what GPyTorch's fantasy update computes by updating an ``(n + q) x (n + q)`` factor; here only the base
posterior at ``t + q`` points (PCG or Cholesky, whichever the base model takes) and a ``q x q`` Cholesky are needed,
and ``Σ_t|q`` does not depend on ``y_q``, so every fantasy shares it.
"""

from __future__ import annotations

import torch
from gpytorch.distributions import MultivariateNormal
from linear_operator.operators import DenseLinearOperator
from linear_operator.utils.cholesky import psd_safe_cholesky

__all__ = ["condition_joint", "condition_blocks", "latent_mvn"]


def condition_joint(joint: MultivariateNormal, t: int, targets: torch.Tensor,
                    noise: torch.Tensor) -> MultivariateNormal:
    """The first ``t`` points of ``joint`` conditioned on noisy observations of its last ``q`` (module docstring).

    Args:
        joint: latent posterior over ``[X_t, X_q]``: mean ``(*b, t + q)``, covariance ``(*b, t + q, t + q)``.
        t: how many leading points are predicted.
        targets: ``y_q`` ``(*b, q)`` (broadcast against ``b``).
        noise: observation-noise variances ``s`` ``(*b, q)`` (broadcast against ``b``).

    Returns:
        The latent posterior at ``X_t``: mean ``(*b, t)``, covariance ``(*b, t, t)``; differentiable w.r.t. the
        joint's mean and covariance, ``targets`` and ``noise``.

    Example:
        Conditioning a joint posterior on one point equals the posterior of the data with that point appended.

        >>> import torch
        >>> from gpytorch.distributions import MultivariateNormal
        >>> from gpnys.bo.fantasy import condition_joint
        >>> S = torch.tensor([[1.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
        >>> post = condition_joint(MultivariateNormal(torch.zeros(2, dtype=torch.float64), S), 1,
        ...                        torch.tensor([2.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))
        >>> round(float(post.mean), 6), round(float(post.variance), 6)  # 0.5 / 2 * 2, 1 - 0.25 / 2
        (0.5, 0.875)
    """
    mean, cov = joint.mean, joint.covariance_matrix
    return condition_blocks(mean[..., :t], cov[..., :t, :t], mean[..., t:], cov[..., :t, t:], cov[..., t:, t:],
                            targets, noise)


def condition_blocks(mu_t: torch.Tensor, S_tt: torch.Tensor, mu_q: torch.Tensor, S_tq: torch.Tensor,
                     S_qq: torch.Tensor, targets: torch.Tensor, noise: torch.Tensor) -> MultivariateNormal:
    """:func:`condition_joint` from the joint posterior's blocks, each with its own batch shape (broadcast): the
    mean and covariance at ``X_t`` ``(*b_t, t)``, ``(*b_t, t, t)``; at ``X_q`` ``(*b_q, q)``, ``(*b_q, q, q)``; the
    cross-covariance ``(*b, t, q)``; ``targets`` and ``noise`` ``(*b, q)``.

    Example:
        >>> import torch
        >>> from gpnys.bo.fantasy import condition_blocks
        >>> one = torch.ones(1, 1, dtype=torch.float64)
        >>> post = condition_blocks(torch.zeros(1, dtype=torch.float64), one, torch.zeros(1, dtype=torch.float64),
        ...                         0.5 * one, one, torch.tensor([2.0], dtype=torch.float64), torch.ones(1))
        >>> round(float(post.mean), 6), round(float(post.variance), 6)
        (0.5, 0.875)
    """
    if mu_q.shape[-1] == 0:  # no points to condition on: the prior blocks, in the fantasies' batch
        batch = torch.broadcast_shapes(mu_t.shape[:-1], targets.shape[:-1])
        return latent_mvn(mu_t.expand(*batch, -1), S_tt.expand(*batch, *S_tt.shape[-2:]))
    C = S_qq + torch.diag_embed(noise.to(S_qq))  # (broadcast to the targets' batch: one q x q factor each)
    A = torch.cholesky_solve(S_tq.mT, psd_safe_cholesky(C))  # C⁻¹ Σ_qt, (*b, q, t)
    mu = mu_t + ((targets - mu_q).unsqueeze(-2) @ A).squeeze(-2)
    S = S_tt - S_tq @ A
    return latent_mvn(mu, S)


def latent_mvn(mean: torch.Tensor, cov: torch.Tensor) -> MultivariateNormal:
    """``N(mean (*b, q), cov (*b, q, q))``, the covariance symmetrised and held as a linear operator, as GPyTorch's own
    posteriors hold theirs: a dense tensor would make torch factorise it at once, without jitter, and a joint
    posterior at many nearby points is positive definite only up to rounding and the solves' errors. BoTorch's
    samplers factorise it with jitter where needed (``psd_safe_cholesky``).

    Example:
        >>> import torch
        >>> from gpnys.bo.fantasy import latent_mvn
        >>> cov = torch.ones(2, 2, dtype=torch.float64)  # singular: torch's MultivariateNormal would reject it
        >>> latent_mvn(torch.zeros(2, dtype=torch.float64), cov).variance.tolist()
        [1.0, 1.0]
    """
    return MultivariateNormal(mean, DenseLinearOperator(0.5 * (cov + cov.mT)))
