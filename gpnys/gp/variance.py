"""Predictive variances at many test points from a cached landmark root, with a per-point error bound.

:class:`LocalVariance` is the ``"cached"`` variance method of :meth:`gpnys.gp.hook.PreconditionerHook.predict`.
It never forms a length-``n`` kernel column per test point beyond the one the predictive mean needs, and never an
``n x n`` factorisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import gpytorch
import torch

from gpnys.budget import block_elems
from gpnys.checks import validate_count
from gpnys.kernels.entries import k_of_points, split_outputscale
from gpnys.kernels.operator import _nu, supported
from gpnys.linalg import safe_cholesky

__all__ = ["LocalVariance", "VarianceEstimate", "VARIANCE_NEIGHBOURS", "ROUNDING_FACTOR", "rounding_error"]

#: ``(w, w2)``: the neighbours a test point is conditioned on exactly, and the wider neighbourhood on which the
#: remainder is estimated. Larger values cut the error at a cost of ``O(w2 w k + w³)`` per point; the default's
#: errors are in docs/accuracy.md ("Predictive variances with error bounds").
VARIANCE_NEIGHBOURS: tuple[int, int] = (50, 200)

#: ``c`` of the rounding term ``c eps s² (1 + ||x||₁)²`` in :class:`LocalVariance`'s bound: the largest measured
#: ratio of the float32 ``σ²_G``'s error to ``eps s² (1 + ||x||₁)²`` was 1.6 over RBF and Matérn kernels, 50 to 1 000
#: landmarks, noise 1e-6 to 1e-2 (docs/accuracy.md, "Predictive variances with error bounds").
ROUNDING_FACTOR = 4.0


@dataclass
class VarianceEstimate:
    """Latent predictive variances at ``m`` points, ``(m,)`` each.

    Attributes:
        variance: the estimate ``σ²_G − r̂`` (clamped at 0).
        bound: per-point error bound ``|σ² − variance| <= bound`` (see :class:`LocalVariance`: rigorous on the upper
            side, an estimate on the lower).
        upper: the Galerkin variance ``σ²_G >= σ²`` (a rigorous upper bound, up to rounding).
    """

    variance: torch.Tensor
    bound: torch.Tensor
    upper: torch.Tensor


def rounding_error(scale: float | torch.Tensor, weights_l1: torch.Tensor) -> torch.Tensor:
    """First-order rounding of a predictive variance ``k(x, x) − k_Sᵀ x`` computed in ``weights_l1``'s dtype, with
    ``x = K̂_SS⁻¹ k_S`` the kriging weights (``||x||₁``: ``weights_l1``, ``(m,)``) and ``scale`` the size of the kernel
    entries (``s²``): entries rounded by ``eps · scale`` move it by about ``eps · scale · (1 + ||x||₁)²``, times
    :data:`ROUNDING_FACTOR`. ``(m,)``.

    Example:
        >>> import torch
        >>> from gpnys.gp.variance import rounding_error
        >>> float(rounding_error(1.0, torch.tensor([1.0])) / torch.finfo(torch.float32).eps)  # 4 x (1 + 1)²
        16.0
    """
    return ROUNDING_FACTOR * torch.finfo(weights_l1.dtype).eps * scale * (1 + weights_l1).square()


class LocalVariance:
    """Latent predictive variance ``σ²(x) = k(x, x) − k_xᵀ K̂⁻¹ k_x`` (``K̂ = K + σ² I`` or ``K + D``) at many points.

    Math. For a point set ``S`` of training points and ``c = k_x − K̂_{:,S} K̂_SS⁻¹ k_S`` (so ``c_S = 0``),
    block elimination gives exactly

        ``k_xᵀ K̂⁻¹ k_x = k_Sᵀ K̂_SS⁻¹ k_S + cᵀ K̂⁻¹ c``.

    Here ``S = Z ∪ N(x)``: the ``k`` landmarks ``Z`` of the preconditioner and the ``w`` training points nearest to
    ``x`` in the length-scale metric. The first term gives ``σ²_G(x) = k(x, x) − k_Sᵀ K̂_SS⁻¹ k_S``, the variance
    given the points ``S`` only, which is never below ``σ²(x)`` (a rigorous upper bound). The remainder
    ``r = cᵀ K̂⁻¹ c >= 0`` is estimated with the preconditioner, ``r̂ = c̃ᵀ P̂⁻¹ c̃``, with ``c`` restricted to the
    ``w2`` nearest non-landmarks (``c`` decays away from ``x``). The estimate is ``σ²_G − r̂``; the remainder is at
    most ``r_max = min(r̂ / λ, ||c̃||² / min σ²)`` (for a full ``c``, ``cᵀ K̂⁻¹ c`` lies in ``[r̂ / λ_max, r̂ / λ_min]``
    and below ``||c||² / λ_min(K̂)``; ``λ <= 1`` estimates ``λ_min(P̂⁻¹ K̂)``, from the mean solve's Lanczos run), and
    the bound is ``max(r̂, r_max − r̂)``: rigorous above (``σ²_G``), an estimate below (``c̃`` for ``c``), plus the
    rounding of ``σ²_G = k(x, x) − k_Sᵀ x`` in floating point, ``x = K̂_SS⁻¹ k_S``: entries of ``K̂_SS`` and ``k_S``
    rounded by about ``eps s²`` move it by about ``eps s² (1 + ||x||₁)²`` (first order; :data:`ROUNDING_FACTOR`
    times that is added). Distances are taken as differences of centred points, and ``k(z, z) = s²`` is set
    exactly: ``|a|² + |b|² − 2aᵀb`` loses near pairs' distances to cancellation, which the Matérn-1/2 cusp
    magnifies.

    Storage trick. The landmark root ``F = L_Z⁻¹ K̂_{Z,X}`` (``k x n``, ``L_Z L_Zᵀ = K̂_ZZ``) is built once
    (``k² n`` flops; LOVE-style, but from the landmarks instead of one Lanczos vector, which reduces the error
    less; docs/accuracy.md). Per point, only ``w2`` columns of ``F``, a ``w2 x w`` kernel block and one ``w x w``
    Cholesky of the local Schur complement ``K̂_NN − F_Nᵀ F_N`` are formed, plus one application of ``P̂⁻¹``:
    ``O(k² + w2 w k + w³)`` flops and ``P̂⁻¹``'s cost per point, against ``n²`` per PCG iteration per point.

    Args:
        X: ``(n, d)`` training inputs the kernel sees.
        kernel: an RBF / Matérn kernel, bare or under a ``ScaleKernel`` (:func:`gpnys.kernels.operator.supported`).
        noise: ``σ²`` (0-dim) or per-point ``(n,)``.
        landmarks: ``(k,)`` long, distinct rows of ``X``.
        precond: ``R -> P̂⁻¹ R`` for ``(n, t)`` blocks.
        quad: optional ``C -> diag(Cᵀ P̂⁻¹ C)`` for ``C (n, t)`` that vanishes on the landmarks (cheaper than
            ``precond`` for AFN: :meth:`~gpnys.precond.afn.AFNPreconditioner.schur_quad`).
        lambda_min: lower estimate of the smallest eigenvalue of ``P̂⁻¹ K̂`` (values above 1 count as 1).
        neighbours: ``(w, w2)``, ``1 <= w <= w2 <= n - k``; clipped to ``n - k``.
    """

    def __init__(self, X: torch.Tensor, kernel: gpytorch.kernels.Kernel, noise: torch.Tensor,
                 landmarks: torch.Tensor, precond: Callable[[torch.Tensor], torch.Tensor], lambda_min: float,
                 neighbours: tuple[int, int] = VARIANCE_NEIGHBOURS,
                 quad: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        n = X.shape[0]
        w, w2 = neighbours
        validate_count(w, "neighbours[0]", 1, n)
        validate_count(w2, "neighbours[1]", 1, n)
        if w > w2:
            raise ValueError(f"neighbours must satisfy w <= w2, got {neighbours!r}")
        if not lambda_min > 0:
            raise ValueError(f"lambda_min must be positive, got {lambda_min!r}")
        base, s2 = split_outputscale(kernel)
        if not supported(base):
            raise ValueError(f"kernel must be an RBF or Matérn kernel (under a ScaleKernel), got {type(base).__name__}")
        self.X, self.nu, self.s2 = X, _nu(base), s2
        self.quad = quad if quad is not None else (lambda C: (C * precond(C)).sum(0))
        self.ls = base.lengthscale.detach().reshape(-1).to(X.dtype)  # (1,) or (d,)
        # (n, d) in length-scale units (the kernel's and the neighbours' metric), centred: the distances' rounding
        # grows with the points' norms
        self.centre = X.mean(0)
        self.Xs = (X - self.centre) / self.ls
        self.noise = noise.expand(n) if noise.dim() == 0 else noise
        self.landmarks = landmarks
        rest = torch.ones(n, dtype=torch.bool, device=X.device)
        rest[landmarks] = False
        self.rest = rest.nonzero().squeeze(1)
        self.w2 = min(w2, self.rest.numel())
        self.w = min(w, self.w2)
        self.lam = min(float(lambda_min), 1.0)
        self.noise_min = float(self.noise.min())
        with torch.no_grad():
            Z = self.Xs[landmarks]
            Kzz = self._k(Z, Z)
            Kzz.diagonal().copy_(self.s2 + self.noise[landmarks])  # k(z, z) = s² exactly, not from a rounded r² > 0
            self.Lz = safe_cholesky(Kzz, "landmark block K̂_ZZ")
            Kzx = self._k(Z, self.Xs)
            Kzx[torch.arange(landmarks.numel(), device=X.device), landmarks] = self.s2 + self.noise[landmarks]
            self.F = torch.linalg.solve_triangular(self.Lz, Kzx, upper=False).T.contiguous()  # (n, k): rows gather fast

    @staticmethod
    def flops(n: int, k: int, d: int, m: int, neighbours: tuple[int, int] = VARIANCE_NEIGHBOURS) -> float:
        """Rough flop count of building the cache (``n k²``) and evaluating ``m`` points: per point the distances
        (``2 n d``), ``P̂⁻¹`` (about ``2 n k``), the local Schur block (``2 w2 w k``) and its Cholesky (``w³/3``)."""
        w, w2 = neighbours
        return float(n) * k * k + m * (2.0 * n * (d + k) + 2.0 * w2 * w * k + w ** 3 / 3)

    def _k(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """``s² k(A, B)`` for scaled points ``A (..., p, d)``, ``B (..., q, d)``: ``(..., p, q)``."""
        return self.s2 * k_of_points(A, B, self.nu)

    def __call__(self, T: torch.Tensor, kxx: torch.Tensor | None = None) -> VarianceEstimate:
        """Variances at ``T (m, d)``; ``kxx``: ``k(x, x)`` at ``T`` ``(m,)`` if already computed."""
        with torch.no_grad():
            T = (T.to(self.X.dtype) - self.centre) / self.ls
            kxx = T.new_full((T.shape[0],), self.s2) if kxx is None else kxx  # stationary: k(x, x) = s²
            # blocks of test points: the (b, n - k) distances and the (b, w2, k) gathered root columns
            width = max(self.rest.numel(), self.w2 * self.F.shape[1])
            b = max(16, block_elems(device=T.device) // width)
            parts = [self._block(T[i:i + b]) for i in range(0, T.shape[0], b)]
            upper = kxx - torch.cat([p[0] for p in parts])
            r = torch.cat([p[1] for p in parts]).clamp_min(0.0)
            # cᵀK̂⁻¹c <= min(r̂ / λ_min, ||c||² / min σ²); the estimate is σ²_G − r̂ and σ²_G is an upper bound
            r_max = torch.minimum(r / self.lam, torch.cat([p[2] for p in parts]) / self.noise_min)
            # float rounding of σ²_G: about eps s² (1 + ||x||₁)² for the weights x = K̂_SS⁻¹ k_S (docstring)
            bound = torch.maximum(r, r_max - r) + rounding_error(self.s2, torch.cat([p[3] for p in parts]))
        return VarianceEstimate((upper - r).clamp_min(0.0), bound, upper)

    def _block(self, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_Sᵀ K̂_SS⁻¹ k_S, r̂, ||c̃||², ||K̂_SS⁻¹ k_S||₁)`` for a block of scaled points ``T (b, d)``, each
        ``(b,)``."""
        X, F, w = self.Xs, self.F, self.w
        b, n = T.shape[0], X.shape[0]
        dist = torch.cdist(T, X[self.rest])
        N2 = self.rest[dist.topk(self.w2, largest=False).indices]  # (b, w2), nearest first
        N = N2[:, :w]
        aZ = torch.linalg.solve_triangular(self.Lz, self._k(X[self.landmarks], T), upper=False)  # (k, b)
        F2 = F[N2]  # (b, w2, k)
        FN = F2[:, :w]
        c0 = self._k(X[N2], T[:, None, :])[..., 0] - (F2 @ aZ.T[..., None])[..., 0]  # (b, w2): k_x after Z
        K2 = self._k(X[N2], X[N])  # (b, w2, w)
        K2[:, :w].diagonal(dim1=-2, dim2=-1).copy_(self.s2 + self.noise[N])
        S2 = K2 - F2 @ FN.mT  # Schur complement rows N2, columns N
        L = safe_cholesky(S2[:, :w], "local Schur complement")
        u = torch.cholesky_solve(c0[:, :w, None], L)  # (b, w, 1)
        quad = aZ.square().sum(0) + (c0[:, :w] * u[..., 0]).sum(1)
        # the weights x = K̂_SS⁻¹ k_S, (x_Z, u): the landmarks' part by one more triangular solve
        xZ = torch.linalg.solve_triangular(self.Lz.mT, aZ - (FN.mT @ u)[..., 0].T, upper=True)  # (k, b)
        x1 = xZ.abs().sum(0) + u[..., 0].abs().sum(1)
        c = c0 - (S2 @ u)[..., 0]  # remainder on N2 (zero on N up to round-off)
        C = X.new_zeros(n, b)
        C.scatter_(0, N2.T, c.T)
        return quad, self.quad(C), c.square().sum(1), x1
