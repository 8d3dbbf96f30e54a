"""Approximate ridge leverage scores (Alaoui & Mahoney 2015; Musco & Musco 2017) and sampling by them.

The ridge is ``lambda = noise``, the GP's own regulariser (``K + sigma^2 I``). Which leverage scores [SPA] uses is
not stated (its §IV-A defers to its refs. [24, 33]); the choices made here are documented in
:func:`ridge_leverage_scores`. Nothing of size ``n x n`` is formed: the scores need ``k(X, S)`` (``n x s``, in row
blocks) and ``s x s`` matrices only.
"""

from __future__ import annotations

import gpytorch
import torch

from gpnys.checks import validate_count, validate_points
from gpnys.kernels.blocks import kernel_block, kernel_diag
from gpnys.landmarks.common import validate_kernel, validate_noise, validate_seed
from gpnys.landmarks.sampling import uniform

__all__ = ["ridge_leverage_scores", "leverage_sample"]

_MULTINOMIAL_MAX = 1 << 24  # torch.multinomial's category limit; Gumbel-top-k beyond it (same distribution)


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
        >>> from gpnys.landmarks import ridge_leverage_scores
        >>> K = k(X, X)

        With the whole set as the sketch (``rank K_SS = rank K``) the scores are exact:

        >>> tau = ridge_leverage_scores(X, kernel, noise=0.01, sketch_size=200)
        >>> torch.allclose(tau, (K @ torch.linalg.inv(K + 0.01 * torch.eye(200, dtype=torch.float64))).diagonal())
        True
    """
    validate_points(X)
    validate_kernel(kernel)
    lam = validate_noise(noise)
    seed = validate_seed(seed)
    n = X.shape[0]
    s = min(n, 500) if sketch_size is None else validate_count(sketch_size, "sketch_size", 1, n, "n")
    if rtol is not None and not (0 <= float(rtol) < 1):
        raise ValueError(f"rtol must be in [0, 1), got {rtol!r}")
    sketch = uniform(n, s, seed=seed, device=X.device)
    return _scores(X, kernel, lam, sketch, rtol).to(X.dtype)


def _sample_without_replacement(p: torch.Tensor, m: int, gen: torch.Generator) -> torch.Tensor:
    """``m`` distinct indices drawn successively with probabilities ``∝ p`` (``p > 0``). ``(m,)`` long"""
    if p.shape[0] <= _MULTINOMIAL_MAX:
        return torch.multinomial(p, m, replacement=False, generator=gen)
    # Gumbel-top-k (Vieira 2014; Kool et al. 2019): the same distribution as successive sampling.
    u = torch.rand(p.shape, generator=gen, dtype=p.dtype, device=p.device).clamp_min(torch.finfo(p.dtype).tiny)
    return torch.topk(p.log() - (-u.log()).log(), m).indices


def leverage_sample(X: torch.Tensor, m: int, kernel: gpytorch.kernels.Kernel, lam: float, gen: torch.Generator,
                    sketch_size: int | None = None) -> torch.Tensor:
    """``m`` distinct rows of ``X (n, d)`` drawn successively with probabilities ``∝`` their approximate ridge
    leverage scores at ``lambda = lam`` (sketch of ``min(n, 2 m)`` rows by default, drawn from ``gen``). ``(m,)``
    long."""
    n = X.shape[0]
    s = min(n, 2 * m) if sketch_size is None else validate_count(sketch_size, "sketch_size", 1, n, "n")
    sketch = torch.randperm(n, generator=gen, device=X.device)[:s]
    tau = _scores(X, kernel, lam, sketch, None)
    # Every exact score is > 0 for k_ii > 0; the floor only guards rounding so that m distinct draws exist.
    p = tau.clamp_min(torch.finfo(tau.dtype).eps * float(tau.max().clamp_min(torch.finfo(tau.dtype).tiny)))
    return _sample_without_replacement(p, m, gen)
