"""The preconditioner control variate of the log-determinant gradient (Wenger et al. 2022, eq. 9).

With probes ``z_j ~ N(0, P̂)``, ``C(θ) = log det P̂(θ) + (1/t) Σ_j z_jᵀ P̂(θ)⁻¹ z_j`` has gradient
``∂ log det P̂ − (1/t) Σ_j b_jᵀ ∂P̂ b_j`` (``b_j = P̂⁻¹ z_j``) of mean zero; subtracting it from the trace estimator
``(1/t) Σ_j (K̂⁻¹ z_j)ᵀ ∂K̂ b_j`` leaves ``tr(P̂⁻¹∂P̂) + tr(K̂⁻¹∂K̂ − P̂⁻¹∂P̂)``, exact in its first term, so the
variance vanishes as ``P̂ → K̂``. ``P̂ = s² P(θ)`` is the preconditioner's differentiable family
(:meth:`~gpnys.precond.afn.AFNPreconditioner.differentiable_terms`, Nyström's likewise) at the current
hyperparameters, with ``mu = noise / s²`` per point where ``P`` took per-point shifts.
"""

from __future__ import annotations

from typing import Any

import gpytorch
import torch

from gpnys.kernels.entries import split_outputscale
from gpnys.precond.afn import AFNPreconditioner
from gpnys.precond.base import Preconditioner

__all__ = ["family_parameters", "control_variate_terms", "frozen_jacobian_terms"]


def family_parameters(P: Any, kernel: gpytorch.kernels.Kernel,
                      noise: torch.Tensor) -> tuple[gpytorch.kernels.Kernel, torch.Tensor | None, torch.Tensor]:
    """``(base, s², mu)`` of ``P``'s differentiable family (with autograd): the unit-variance kernel, the outputscale
    (``None`` without a ``ScaleKernel``) and ``mu = noise / s²`` in the form ``P`` was built for: per point when it
    took ``diag``, else the mean noise. ``noise``: the training noise variances, 0-dim or ``(n,)``."""
    base, _ = split_outputscale(kernel)
    s2 = kernel.outputscale.reshape(()) if isinstance(kernel, gpytorch.kernels.ScaleKernel) else None
    level = noise if P.diag is not None or noise.dim() == 0 else noise.mean()
    return base, s2, (level / s2 if s2 is not None else level)


def control_variate_terms(P: Preconditioner, kernel: gpytorch.kernels.Kernel, noise: torch.Tensor, Z: torch.Tensor,
                          schur: str, split: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(log det P̂(θ), [z_jᵀ P̂(θ)⁻¹ z_j]_j)`` (0-dim and ``(t,)``, with autograd) for probes ``Z`` ``(n, t)``;
    ``None`` when the family cannot be differentiated. ``schur``: AFN's family; ``split``: AFN's rows split over
    the ranks of its process group (for a caller that takes no per-probe Jacobian through the terms)."""
    P = P.chosen  # AutoPreconditioner: the Nyström or AFN it chose
    if not hasattr(P, "differentiable_terms"):
        return None
    base, s2, mu = family_parameters(P, kernel, noise)
    try:
        kw = {"schur": schur, "split": split} if isinstance(P, AFNPreconditioner) else {}
        logdet, quad = P.differentiable_terms(base, mu, Z, **kw)
    except (NotImplementedError, torch.linalg.LinAlgError):  # e.g. RAN scaling, or K11 too ill-conditioned
        return None
    if s2 is not None:
        logdet = logdet + Z.shape[0] * torch.log(s2)
        quad = quad / s2
    return logdet, quad


def frozen_jacobian_terms(P: Preconditioner, kernel: gpytorch.kernels.Kernel, noise: torch.Tensor,
                          Z: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The per-probe Jacobian of AFN's ``"frozen"`` terms ``[z_jᵀ P̂(θ)⁻¹ z_j]_j`` in closed form
    (:meth:`~gpnys.precond.afn.AFNPreconditioner.frozen_derivatives`), as ``(tensor, (t, *tensor.shape))`` pairs:
    the length-scale, ``mu = noise / s²`` and ``s²``, whose chain to the raw parameters the caller takes by autograd.
    ``None`` without an AFN preconditioner or for a kernel outside the formula table."""
    P = P.chosen
    if not isinstance(P, AFNPreconditioner):
        return None
    base, s2, mu = family_parameters(P, kernel, noise)
    out = P.frozen_derivatives(base, mu, Z)
    if out is None:
        return None
    q, d_ls, d_mu = out
    ls = base.lengthscale
    scale = 1.0 if s2 is None else 1.0 / s2.detach()
    pairs = [(ls, scale * d_ls.reshape(-1, *ls.shape)), (mu, scale * d_mu)]
    if s2 is not None:
        pairs.append((s2, -q * scale**2))  # the terms are q / s²
    return [(o, g) for o, g in pairs if o.requires_grad]
