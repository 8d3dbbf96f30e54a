"""Numerical-rank estimation of a kernel matrix from small subsamples (AFN paper, Algorithm 4, §3.3).

The numerical rank of ``K`` is ``#{ lambda_i(K) > 0.1 mu }``, i.e. ``#{ eig(K + mu I) > 1.1 mu }``: the
AFN paper's §2 writes "eigenvalues of K + mu I" above ``0.1 mu``, which would count every eigenvalue, so the
eigenvalues are those of ``K`` (as in the paper's Fig. 5 caption, "1.1 x mu", and the authors' code). It decides
between the Nyström preconditioner (small rank) and AFN (Algorithm 5), sizes the reduced models' ``m = auto``
(:func:`gpnys.landmarks.rules.choose_m`), and is cheap to estimate: only ``m x m``
kernel matrices (``m`` = 500 by default) are formed.

The estimate is biased, in known directions (measured accuracy: docs/preconditioners.md):

* on small sets (``n < max_k``) it over-estimates: the numerical rank is not extensive, and the scaled
  subsample, a smaller cube at the same density, has relatively more boundary, hence a larger rank per point;
* when the Nyström test of step 1 is met at a tiny ``r`` (one dominant eigenvalue, as on standardised
  high-dimensional data) the eigen-count step decides, and by construction it returns the rank of a
  ``max_k``-point subsample, smaller than the rank of X when ``n > max_k``; ``refine_n = n`` over-estimates
  instead. The ``(m/n)^(1/d)`` scaling also assumes that the points fill a d-dimensional region, which data on
  a lower-dimensional manifold in high dimension do not.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import gpytorch
import torch

from gpnys.checks import validate_count, validate_mu, validate_points, validate_seed
from gpnys.kernels.entries import KernelEntries
from gpnys.landmarks.farthest import fps
from gpnys.linalg import small_dense

__all__ = ["RankEstimate", "estimate_rank", "nystrom_rel_error", "numerical_rank"]

BRANCHES = ("scaled-nystrom", "eigen-count")


@dataclass
class RankEstimate:
    """Output of :func:`estimate_rank`.

    Attributes:
        k: the estimated numerical rank, in ``[1, n]``.
        r_per_rep: smallest FPS-Nyström rank ``r`` reaching the error tolerance, one per repetition.
        branch: ``"scaled-nystrom"`` (``k = ceil(max r * n / m) >= max_k``, returned as is) or
            ``"eigen-count"`` (refined by counting eigenvalues ``> 0.1 mu`` of subsample kernel matrices).
        m: subsample size actually used (``min(m, n)``).
        details: everything else (k from the Nyström branch, eigen counts per repetition, scale factors,
            ``nu`` shifts, emulated subsample size, seconds).
    """

    k: int
    r_per_rep: list[int]
    branch: str
    m: int
    details: dict[str, Any] = field(default_factory=dict)


def numerical_rank(eigenvalues: torch.Tensor, mu: float, c: float = 0.1) -> int:
    """``#{lambda_i > c * mu}`` for eigenvalues of ``K``, not of ``K + mu I``: the rank rule compares against ``mu``
    (``#{eig(K + mu I) > (1 + c) mu}``; the AFN paper's §2 literally counts eigenvalues of ``K + mu I``, all of
    which exceed ``0.1 mu``).

    Example:
        >>> import torch
        >>> from gpnys.landmarks.rank import numerical_rank
        >>> numerical_rank(torch.tensor([2.0, 0.5, 0.05, 0.001]), mu=0.1)  # eigenvalues above 0.01
        3
    """
    return int((eigenvalues > c * mu).sum())


def _flush(A: torch.Tensor) -> torch.Tensor:
    """Zero the entries below ``sqrt(tiny)``: they cannot matter at any tolerance used here, but they
    breed subnormal floats (e.g. ``exp(-r^2/l^2)`` for tiny ``l``) that slow BLAS/LAPACK down ~10x."""
    return A.masked_fill(A.abs() < torch.finfo(A.dtype).tiny ** 0.5, 0.0)


def _nu_shift(K: torch.Tensor) -> float:
    """``sqrt(m) * eps(||K||_F)``: the tiny diagonal shift of the AFN authors' C code (H2Pack, ``AFNi_rank_est``)."""
    m = K.shape[0]
    fro = torch.linalg.matrix_norm(K)
    return math.sqrt(m) * float(torch.nextafter(fro, fro + 1) - fro)


def _shifted_cholesky(K: torch.Tensor, nu: float) -> tuple[torch.Tensor, float]:
    """Lower Cholesky factor of ``K + nu I``, escalating ``nu`` x10 until it factors. ``((m, m), nu used)``"""
    eye = torch.eye(K.shape[0], dtype=K.dtype, device=K.device)
    shift = max(nu, torch.finfo(K.dtype).tiny)
    for _ in range(60):
        L, info = torch.linalg.cholesky_ex(K + shift * eye)
        if int(info) == 0:
            return _flush(L), shift
        shift *= 10.0
    raise RuntimeError("rank estimation: Cholesky of the subsample kernel matrix failed for every shift")


def _schur_rel_errors(K: torch.Tensor, nu: float) -> tuple[Callable[[int], float], float]:
    """Return ``(err, nu_used)`` with ``err(r) = ||K - C_r W_r^{-1} C_r^T||_F / ||K||_F``, ``C_r = K[:, :r]``.

    Stable Cholesky form: with ``K + nu I = L L^T``, the Nyström approximation from the leading ``r``
    columns is ``L[:, :r] L[:, :r]^T`` and its error is the Schur complement ``L22 L22^T``,
    ``L22 = L[r:, r:]`` -- i.e. the residual after ``r`` steps of a Cholesky factorisation with the given
    (FPS) pivot order, like a pivoted Cholesky whose pivots are chosen geometrically. One ``O(m^3/3)``
    factorisation serves every ``r``; each ``err(r)`` then costs ``O((m - r)^3)``. The shift ``nu`` only
    perturbs the error by ``<= nu sqrt(m) / ||K||_F``.
    """
    L, used = _shifted_cholesky(K, nu)
    fro = float(torch.linalg.matrix_norm(K))

    def err(r: int) -> float:
        L22 = L[r:, r:]
        if L22.numel() == 0:
            return 0.0
        return float(torch.linalg.matrix_norm(L22 @ L22.mT)) / fro

    return err, used


def nystrom_rel_error(K: torch.Tensor, r: int, nu: float = 0.0) -> float:
    """``||K - C_r W_r^{-1} C_r^T||_F / ||K||_F`` for the leading ``r`` columns of ``K (m, m)`` (PSD).

    Computed from the Cholesky factor of ``K + nu I`` (see :func:`_schur_rel_errors`); ``nu`` is raised
    x10 until the factorisation succeeds.
    """
    return _schur_rel_errors(K, nu)[0](r)


def _smallest_rank(K: torch.Tensor, tol: float, nu: float) -> tuple[int, float]:
    """Binary search on ``[1, m]`` for the smallest ``r`` with Nyström relative error ``< tol``.

    The Nyström error with nested columns is non-increasing in ``r`` (Schur complements shrink in the
    Loewner order), so the search is exact up to rounding. ``r = m`` if no smaller rank works.
    Returns ``(r, nu used)``.
    """
    err, used = _schur_rel_errors(K, nu)
    lo, hi = 1, K.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if err(mid) < tol:
            hi = mid
        else:
            lo = mid + 1
    return lo, used


def estimate_rank(
    X: torch.Tensor,
    kernel: gpytorch.kernels.Kernel,
    mu: float,
    m: int = 500,
    reps: int = 3,
    max_k: int = 2000,
    tol: float = 0.1,
    seed: int = 0,
    work_dtype: torch.dtype | None = None,
    refine_n: int | None = None,
    decide_only: bool = False,
) -> RankEstimate:
    """Estimate the numerical rank ``#{lambda_i(K) > 0.1 mu}`` of ``K = k(X, X)``: AFN paper Algorithm 4.

    Where the paper leaves a step open (the error norm, the search for ``r``, repetitions, the ``k < max_k``
    branch), this follows the AFN authors' C code (H2Pack, ``AFNi_rank_est``):

    1. Scaled Nyström step, per repetition (``reps`` fresh seeded uniform subsamples of ``m`` points):
       scale the subsample by ``(m / n)^(1/d)`` (same point density as X; this assumes the points fill a
       d-dimensional region), form ``K_m (m x m)``, order it by FPS (Algorithm 6) on the scaled points, and
       binary-search the smallest ``r`` with ``||K_m - C_r W_r^{-1} C_r^T||_F / ||K_m||_F < tol``
       (Frobenius norm; ``K_m`` shifted by ``nu = sqrt(m) eps(||K_m||_F)``, raised x10 until its Cholesky
       factorisation succeeds; see :func:`nystrom_rel_error`).
       ``k = ceil(max_r r * n / m)`` (max over repetitions; the paper's line 6 tests ``k`` before defining it,
       read here as ``r n / m``).
    2. If ``k >= max_k`` return ``min(k, n)`` (branch ``"scaled-nystrom"``; Algorithm 5's ``k >= 2000``, the
       authors' code's ``est_rank < max_k`` -> Nyström).
    3. Otherwise refine (branch ``"eigen-count"``): per repetition draw ``m`` fresh points, scale them by
       ``(m / N)^(1/d)`` with ``N = min(n, max(max_k, m))`` so that the subsample emulates an N-point
       subsample of X, count eigenvalues of ``K_m`` greater than ``0.1 mu`` (i.e. eig(K + mu I) > 1.1 mu),
       take the max over repetitions and return ``ceil(count * N / m)`` clipped to ``[1, n]``.

    Choices and deviations (documented because the paper leaves them open):

    * ``N = min(n, max(max_k, m))`` where the code uses ``max(max_k, m)``: for ``n < max_k`` the code's
      scaling would emulate a point set *denser* than X (Fig. 5 setup: n = 1000, true rank 243-246,
      m = 500: ~440 with the code's rule, ~300 with this one); for ``n >= max_k`` both agree.
    * If ``n <= m`` the whole set is used, unscaled, once (repetitions would be identical); the
      eigen-count branch is then the exact numerical rank of ``K``.
    * The ``m x m`` work (kernel block, Cholesky, eigenvalues) runs in ``work_dtype``, by default the
      wider of X's dtype and float64: counting eigenvalues ``> 0.1 mu`` needs an absolute accuracy below
      ``0.1 mu``, which float32 (``eps * ||K_m|| ~ 1e-7 m``) does not give for small ``mu``. Pass
      ``work_dtype=X.dtype`` to stay in X's dtype (e.g. on devices without float64).
    * FPS starts at the point nearest the centroid (Algorithm 6); subsamples are drawn with
      ``torch.randperm`` from a generator seeded with ``seed`` on X's device, so results are reproducible
      for a given device.

    Cost per repetition: ``O(m^2 d)`` kernel entries, ``O(m^2 d)`` FPS, one ``O(m^3 / 3)`` Cholesky plus
    ``O(log m)`` Schur-complement norms of at most ``O(m^3)`` each for the binary search, ``O(m^3)``
    eigenvalues; memory ``O(m^2)``. Nothing of size ``n x n`` or ``n x m`` is formed.

    Args:
        X: ``(n, d)`` points.
        kernel: GPyTorch kernel (isotropic or ARD lengthscale); a ``ScaleKernel`` is unwrapped, so ``mu``
            is relative to the unit-variance kernel (``mu = noise / outputscale``).
        mu: regularisation ``mu > 0``.
        m: subsample size (``>= 2``); reps: repetitions (``>= 1``); max_k: the Nyström/AFN switch (2000).
        tol: relative Frobenius Nyström error threshold, ``0 < tol < 1`` (paper: 0.1).
        seed: seed of the subsampling.
        work_dtype: dtype of the ``m x m`` computations (see above).
        refine_n: ``N``, the size of the point set the eigen-count refinement emulates; default
            ``min(n, max(max_k, m))`` as above. ``refine_n = n`` estimates the rank of X itself instead of
            that of a ``max_k``-point subsample (larger when ``n > max_k``; see the module notes).
        decide_only: for a caller that only compares ``k`` with ``max_k`` (the Nyström / AFN switch): step 1 stops
            at the first repetition whose ``k`` reaches ``max_k``, since the maximum over repetitions can only
            grow. The branch is the same; ``k`` is then a lower bound of the full estimate
            (``details["reps"]`` says how many repetitions ran).

    Returns:
        :class:`RankEstimate`.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.landmarks import estimate_rank
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> kernel.outputscale = 2.0
        >>> est = estimate_rank(X, kernel, mu=0.01)  # mu = noise / outputscale

        With ``n <= m`` the whole set is used and the rank is exact: the eigenvalues of the unit-variance ``K``
        above ``0.1 mu``.

        >>> eigenvalues = torch.linalg.eigvalsh(kernel.base_kernel(X).to_dense().detach())
        >>> est.branch, est.k == int((eigenvalues > 0.1 * 0.01).sum())
        ('eigen-count', True)
    """
    t0 = time.perf_counter()
    validate_points(X)
    mu = validate_mu(mu)
    m = validate_count(m, "m", 2)
    reps = validate_count(reps, "reps", 1)
    max_k = validate_count(max_k, "max_k", 1)
    if not (0.0 < float(tol) < 1.0):
        raise ValueError(f"tol must be in (0, 1), got {tol!r}")
    if refine_n is not None:
        refine_n = validate_count(refine_n, "refine_n", min(int(m), X.shape[0]), X.shape[0], "n")
    seed = validate_seed(seed)
    n, d = X.shape
    if work_dtype is None:
        work_dtype = torch.promote_types(X.dtype, torch.float64)
    unit = KernelEntries(X, kernel).kernel
    if any(t.is_floating_point() and t.dtype != work_dtype for t in (*unit.parameters(), *unit.buffers())):
        # the kernel in the working precision too: not every kernel promotes its float32 parameters against
        # float64 points (PolynomialKernel's addmm with its offset fails)
        unit = copy.deepcopy(unit).to(work_dtype)
    gen = torch.Generator(device=X.device).manual_seed(int(seed))
    whole = n <= m
    m_used = n if whole else m
    n_reps = 1 if whole else reps
    with small_dense(m_used, X.device):  # m x m work on one thread (gpnys.linalg)
        def subsample() -> torch.Tensor:
            if whole:
                return X.to(work_dtype)
            idx = torch.randperm(n, generator=gen, device=X.device)[:m_used]
            return X[idx].to(work_dtype)

        def kmat(P: torch.Tensor) -> torch.Tensor:
            K = KernelEntries(P, unit).points(P, P)
            return _flush(0.5 * (K + K.mT))

        # Step 1: scaled Nyström ranks.
        scale1 = (m_used / n) ** (1.0 / d)
        r_per_rep: list[int] = []
        nus: list[float] = []
        for _ in range(n_reps):
            P = subsample() * scale1
            order = fps(P, m_used).indices
            K = kmat(P[order])
            r, nu = _smallest_rank(K, float(tol), _nu_shift(K))
            nus.append(nu)
            r_per_rep.append(r)
            if decide_only and math.ceil(r * n / m_used) >= max_k:
                break
        k_nys = math.ceil(max(r_per_rep) * n / m_used)
        details: dict[str, Any] = {
            "n": n,
            "d": d,
            "k_nystrom": k_nys,
            "scale_nystrom": scale1,
            "nu": nus,
            "whole_set": whole,
            "reps": len(r_per_rep),
            "max_k": max_k,
            "tol": float(tol),
            "work_dtype": str(work_dtype),
        }
        if k_nys >= max_k:
            details["seconds"] = time.perf_counter() - t0
            return RankEstimate(k=min(k_nys, n), r_per_rep=r_per_rep, branch="scaled-nystrom", m=m_used,
                                details=details)

        # Step 3: eigen-count refinement on a subsample emulating N points of X.
        N = n if whole else (refine_n if refine_n is not None else min(n, max(max_k, m_used)))
        scale2 = (m_used / N) ** (1.0 / d)
        counts: list[int] = []
        for _ in range(n_reps):
            K = kmat(subsample() * scale2)
            counts.append(numerical_rank(torch.linalg.eigvalsh(K), mu))
        k = min(max(math.ceil(max(counts) * N / m_used), 1), n)
        details.update(counts=counts, emulated_n=N, scale_eigen=scale2, seconds=time.perf_counter() - t0)
        return RankEstimate(k=k, r_per_rep=r_per_rep, branch="eigen-count", m=m_used, details=details)
