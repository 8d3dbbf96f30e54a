"""The exact GP posterior and the exact error of a reduced posterior against it ([SPA] §III, eq. (15), (19)).

The full-GP predictor of the centred targets is ``f* = sum_i alpha*_i k(x_i, .)`` with
``alpha* = (K + sigma^2 I)^{-1} (y - m)`` — a dense Cholesky solve for small n, AFN/Nyström-preconditioned CG
(gpnys's ``auto`` preconditioner) above ``dense_max``. Distances in the RKHS ``H`` of ``k`` (outputscale
included), from the closed forms of the SPA paper (§III-D: Prop 3, eq. (15) and (19)):

* LLA (= SPA), any ``alpha_hat`` with ``G alpha_hat = w_hat``:
  ``|f_LLA - f*|^2 = |w_hat|^2 + alpha*^T K alpha* - 2 w_hat^T G alpha*``  ([SPA] eq. (15), ``O(ns)`` form);
* GSA: ``|f_GSA - f*|^2 = (alpha* - alpha_hat)^T K (alpha* - alpha_hat)``  ([SPA] eq. (19));
* a landmark expansion ``f = k(., C) beta`` (NCR, NYTRO, Nyström KRR):
  ``|f - f*|^2 = beta^T K_mm beta - 2 beta^T K_mn alpha* + alpha*^T K alpha*``.

These differences of large terms cancel to the error's square: they are computed in at least float64 (on the
caller's data and coefficients, float32 ones included), and so is the dense exact posterior.

``alpha*^T K alpha* = alpha*^T (y - m) - sigma^2 |alpha*|^2`` costs no extra product. Random Fourier features do
not live in ``H`` (their kernel is not ``k``): for them no RKHS distance is defined.
"""

from __future__ import annotations

import math

import gpytorch
import torch

from gpnys.kernels.blocks import kernel_block, kernel_diag
from gpnys.kernels.entries import KernelEntries
from gpnys.linalg import safe_cholesky
from gpnys.precond.strategy import AutoPreconditioner
from gpnys.reduced.gsa import GSAPosterior
from gpnys.reduced.lla import LLAPosterior, kernel_in, validate_regression, validate_test_points
from gpnys.reduced.ncr import NCRPosterior
from gpnys.solvers.pcg import pcg

__all__ = ["ExactPosterior", "rkhs_error", "landmark_rkhs_error", "DENSE_MAX"]

#: the exact posterior uses a dense Cholesky up to this n (K: 800 MB in float64), preconditioned CG above
DENSE_MAX = 10_000


class ExactPosterior:
    """The full GP posterior of ``y = f(x) + eps`` at fixed hyperparameters.

    Args:
        kernel: GPyTorch kernel (outputscale included); X: ``(n, d)``; y: ``(n,)`` (cast to X's dtype);
            noise: ``sigma^2``.
        prior_mean: constant prior mean.
        method: ``"cholesky"``, ``"pcg"`` (gpnys ``auto`` preconditioner) or ``"auto"`` (Cholesky up to
            :data:`DENSE_MAX`).
        tol: PCG relative residual tolerance, in ``(0, 1)``.

    The Cholesky path (kernel matrix, factor, solves, predictions) runs in at least float64, on the caller's
    (e.g. float32-rounded) data and hyperparameters: a float32 factor of an ill-conditioned ``K + sigma^2 I`` is
    off by up to percents. Tensors are returned in the caller's dtype. The PCG path runs in ``X``'s dtype.

    Attributes:
        alpha: ``(n,)`` ``= (K + sigma^2 I)^{-1} (y - m)`` (``X``'s dtype).
        quad: ``alpha^T K alpha`` (``|f*|_H^2``, from the float64 ``alpha`` on the Cholesky path).
        iterations: PCG iterations (0 for Cholesky).

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.reduced import ExactPosterior
        >>> exact = ExactPosterior(kernel, X, y, noise=0.01)  # n <= DENSE_MAX: a dense Cholesky
        >>> A = k(X, X) + 0.01 * torch.eye(200, dtype=torch.float64)
        >>> torch.allclose(exact.mean(Z), k(Z, X) @ torch.linalg.solve(A, y))
        True
        >>> reduction = (k(Z, X) * torch.linalg.solve(A, k(X, Z)).mT).sum(1)
        >>> torch.allclose(exact.variance(Z), k(Z, Z).diagonal() - reduction)
        True
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, noise: float,
                 prior_mean: float = 0.0, method: str = "auto", tol: float = 1e-8, seed: int = 0) -> None:
        if isinstance(X, torch.Tensor) and isinstance(y, torch.Tensor) and y.is_floating_point():
            y = y.to(X.dtype)  # the reference takes y in X's precision (it works in the promoted dtype)
        validate_regression(X, y, noise, prior_mean=prior_mean)
        try:
            tol_value = float(tol)
        except (TypeError, ValueError):
            tol_value = math.nan
        if not 0 < tol_value < 1:  # at 1 and above PCG stops before its first step: alpha = 0
            raise ValueError(f"tol must be in (0, 1) (PCG's relative residual), got {tol!r}")
        if method not in ("auto", "cholesky", "pcg"):
            raise ValueError(f"method must be 'auto', 'cholesky' or 'pcg', got {method!r}")
        self.kernel, self.X, self.noise, self.prior_mean = kernel, X, float(noise), float(prior_mean)
        self.method = ("cholesky" if X.shape[0] <= DENSE_MAX else "pcg") if method == "auto" else method
        self.tol, self.iterations = tol_value, 0
        # the dense reference in at least float64: a float32 Cholesky of K + sigma^2 I loses percents of |f*|_H^2
        dense = self.method == "cholesky"
        self._work = torch.promote_types(X.dtype, torch.float64) if dense else X.dtype
        self._X_work = X.to(self._work)
        self._kernel_work = kernel_in(kernel, self._work) if dense else kernel
        r = y.to(self._work) - self.prior_mean
        self._entries = KernelEntries(self._X_work, self._kernel_work)  # unit-variance kernel and its outputscale
        self.L = None
        if dense:
            A = kernel_block(self._kernel_work, self._X_work, self._X_work)
            A.diagonal().add_(self.noise)
            self.L = safe_cholesky(A, "ExactPosterior: K + noise I")
            alpha = torch.cholesky_solve(r[:, None], self.L)[:, 0]
        else:
            s2 = self._entries.outputscale
            self._precond = AutoPreconditioner(X, kernel, self.noise / s2, seed=seed)
            alpha = self.solve(r[:, None])[:, 0]
        self._alpha = alpha  # in the working dtype, for the RKHS distances
        self.alpha = alpha.to(X.dtype)
        self.quad = float(alpha @ r - self.noise * alpha.square().sum())

    def kernel_matmul(self, V: torch.Tensor) -> torch.Tensor:
        """``K V`` (outputscale included) for ``V (n, t)``, in row blocks, in the working dtype (at least
        float64 on the Cholesky path), returned in ``V``'s."""
        return (self._entries.outputscale * self._entries.matmul(V.to(self._work))).to(V.dtype)

    def solve(self, B: torch.Tensor) -> torch.Tensor:
        """``(K + sigma^2 I)^{-1} B`` for ``B (n, t)``, in ``B``'s dtype."""
        if self.L is not None:
            return torch.cholesky_solve(B.to(self._work), self.L).to(B.dtype)
        s2 = self._entries.outputscale
        res = pcg(lambda V: self._entries.matmul(V) + (self.noise / s2) * V, B / s2, self._precond, tol=self.tol,
                  maxiter=2000)
        self.iterations += int(res.iterations)
        return res.x

    def _test_points(self, Z: torch.Tensor) -> tuple[torch.dtype, torch.Tensor, torch.Tensor, gpytorch.kernels.Kernel]:
        """Checked test points ``Z (nz, d)`` in the working dtype with this posterior's: ``(dtype, Z, X, kernel)``."""
        validate_test_points(Z, self.X.shape[1])
        work = torch.promote_types(Z.dtype, self._work)
        return work, Z.to(work), self._X_work.to(work), kernel_in(self._kernel_work, work)

    def mean(self, Z: torch.Tensor) -> torch.Tensor:
        """Posterior mean ``(nz,)``."""
        work, Zw, Xw, kernel = self._test_points(Z)
        Kzx = kernel_block(kernel, Zw, Xw).to(work)
        return (self.prior_mean + Kzx @ self._alpha.to(work)).to(torch.promote_types(Z.dtype, self.X.dtype))

    def variance(self, Z: torch.Tensor, block: int = 512) -> torch.Tensor:
        """Latent posterior variance ``k_zz - k_z^T (K + sigma^2 I)^{-1} k_z`` (``(nz,)``), test points in blocks."""
        work, Zw, Xw, kernel = self._test_points(Z)
        out = []
        for i in range(0, Z.shape[0], block):
            Kxz = kernel_block(kernel, Xw, Zw[i : i + block]).to(work)
            if self.L is not None:
                red = torch.linalg.solve_triangular(self.L.to(work), Kxz, upper=False).square().sum(0)
            else:
                red = (Kxz * self.solve(Kxz)).sum(0)
            out.append(kernel_diag(kernel, Zw[i : i + block]).to(work) - red)
        return torch.cat(out).clamp_min(0.0).to(torch.promote_types(Z.dtype, self.X.dtype))


def landmark_rkhs_error(kernel: gpytorch.kernels.Kernel, landmarks: torch.Tensor, beta: torch.Tensor,
                        exact: ExactPosterior) -> float:
    """``|k(., C) beta - f*|_H`` for landmarks ``C (m, d)`` and coefficients ``beta (m,)``.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import ExactPosterior, NCRPosterior, landmark_rkhs_error, rkhs_error
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> exact, ncr = ExactPosterior(kernel, X, y, 0.01), NCRPosterior(kernel, X, y, 0.01, C)
        >>> d = torch.cat([ncr.beta, -exact.alpha])  # k(., C) beta - k(., X) alpha*, in the RKHS norm
        >>> P = torch.cat([C, X])
        >>> abs(landmark_rkhs_error(kernel, C, ncr.beta, exact) - float(d @ k(P, P) @ d) ** 0.5) < 1e-8
        True
        >>> abs(landmark_rkhs_error(kernel, C, ncr.beta, exact) - rkhs_error(ncr, exact)) < 1e-12
        True
    """
    work = _rkhs_dtype(beta)
    kernel = kernel_in(kernel, work)
    C, beta = landmarks.to(work), beta.to(work)
    Kmm = kernel_block(kernel, C, C)
    Kmn_a = kernel_block(kernel, C, exact.X.to(work)) @ exact._alpha.to(work)
    sq = float(beta @ (Kmm @ beta)) - 2.0 * float(beta @ Kmn_a) + exact.quad
    return math.sqrt(max(sq, 0.0))


def _rkhs_dtype(t: torch.Tensor) -> torch.dtype:
    """At least float64: the RKHS distances are differences of large terms that cancel to the error's square."""
    return torch.promote_types(t.dtype, torch.float64)


def rkhs_error(posterior: LLAPosterior, exact: ExactPosterior) -> float:
    """``|f - f*|_H`` for an LLA, NCR or GSA posterior built on the same data (module docstring).

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.landmarks import fps
        >>> from gpnys.reduced import ExactPosterior, GSAPosterior, LLAPosterior, NCRPosterior, rkhs_error
        >>> C = X[fps(X, 30).indices]  # 30 landmarks
        >>> exact = ExactPosterior(kernel, X, y, 0.01)
        >>> gsa = GSAPosterior(kernel, X, y, 0.01, C)
        >>> d = exact.alpha - gsa.alpha  # [SPA] eq. (19): (alpha* - alpha)^T K (alpha* - alpha)
        >>> abs(rkhs_error(gsa, exact) - float(d @ k(X, X) @ d) ** 0.5) < 1e-8
        True

        LLA (eq. (15), ``O(n s)``) and NCR (a landmark expansion) are the same function ([SPA] Prop 2):

        >>> lla, ncr = LLAPosterior(kernel, X, y, 0.01, C), NCRPosterior(kernel, X, y, 0.01, C)
        >>> abs(rkhs_error(lla, exact) - rkhs_error(ncr, exact)) < 1e-6
        True
    """
    if not isinstance(posterior, LLAPosterior):  # RFF's features are not a subspace of the kernel's RKHS
        raise ValueError(f"posterior: an RKHS distance is defined for the LLA, NCR and GSA posteriors, not for "
                         f"{type(posterior).__name__}")
    if posterior.X is not exact.X and (posterior.X.shape != exact.X.shape or not torch.equal(posterior.X, exact.X)):
        raise ValueError("posterior and exact must be built on the same training inputs X")
    work = _rkhs_dtype(posterior.w)
    if isinstance(posterior, GSAPosterior):
        d = exact._alpha.to(work) - posterior.alpha.to(work)
        sq = float(d @ exact.kernel_matmul(d[:, None])[:, 0])
    elif isinstance(posterior, NCRPosterior):
        return landmark_rkhs_error(posterior.kernel, posterior.features.landmarks, posterior.beta, exact)
    else:
        w, alpha = posterior.w.to(work), exact._alpha.to(work)
        if posterior.Phi.dtype == work:
            proj = posterior.Phi.mT @ alpha
        else:  # features rounded to a lower precision meet alpha's large entries: recomputed
            proj = posterior.features.transpose_matmul(posterior.X, alpha)
        sq = float(w @ w) + exact.quad - 2.0 * float(w @ proj)
    return math.sqrt(max(sq, 0.0))
