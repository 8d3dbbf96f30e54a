"""Nyström preconditioners for ``K + mu I`` in the numerically stable eigen-form (AFN paper eqs. 7-8).

A rank-``k`` Nyström approximation is built directly as ``K_nys = U diag(lam) U^T`` (AFN paper eq. 7) with
``U (n, k)`` orthonormal, following the stable construction of Frangella, Tropp & Udell (2023, "Randomized
Nyström preconditioning", SIMAX, Algorithm 2.1), which the AFN paper defers to for eq. (7). Two test matrices
``Omega (n, k)`` are offered:

* ``sampling="column"``: ``Omega`` selects ``k`` landmark columns (FPS, uniform, or caller-given indices),
  so ``Y = K Omega = K(X, X_k)`` is just ``k`` kernel columns (sampling-based Nyström, eq. 4/6).
* ``sampling="sketch"``: ``Omega`` is an orthonormalised Gaussian matrix and ``Y = K Omega`` is a blocked
  kernel product (projection-based / randomized Nyström, eq. 3).

Both use the same steps, with a tiny shift ``nu`` that makes the core Cholesky well defined::

    nu    = sqrt(n) * eps(dtype) * ||Y||_F
    Y_nu  = Y + nu * Omega
    C     = chol(Omega^T Y_nu)                (k x k, lower)
    B     = Y_nu C^{-T}                       (n x k, triangular solve)
    B     = U diag(sigma) V^T                 (thin SVD)
    lam   = max(sigma^2 - nu, 0)

Choices made against the AFN authors' C code (H2Pack, ``Nys_precond_build_``), following Frangella et al.:

* ``nu`` uses ``finfo(dtype).eps * ||Y||_F``, the dtype's unit roundoff scaled by the norm. This bounds the float
  spacing ``eps(||Y||_F)`` of Frangella et al. from above within a factor 2, and is available for any dtype and
  device. The C code takes the spacing of the *squared* norm ``||K1||_F^2`` (its variable ``K1_fnorm`` is
  squared), a quirk that makes ``nu`` scale with ``||K1||_F^2``, far larger for big ``n k``; not copied.
* ``Y_nu = Y + nu Omega`` is used in ``B`` (the C code uses the unshifted ``K1``). With the shift,
  ``B B^T = Y_nu (Omega^T Y_nu)^{-1} Y_nu^T`` is the exact Nyström approximation of ``K + nu I``, so
  ``sigma^2 - nu`` undoes the shift; with ``k = n`` this reproduces ``K`` to rounding error.
* ``B`` is factored by a thin SVD (the C code uses ``eig(B^T B)``, which squares the condition number).
* For the sketch, ``Omega`` is always orthonormalised (QR), as in Frangella et al.

The preconditioner is ``P = U diag(d) U^T + c (I - U U^T)`` with

* ``scaling="stable"`` (eq. 8): ``d = lam + mu``, ``c = mu``, i.e. ``P = K_nys + mu I`` and
  ``P^{-1} = U (Lam + mu I)^{-1} U^T + (1/mu)(I - U U^T)``;
* ``scaling="ran"`` (the RAN baseline of Sec. 5): ``d = (lam + mu)/(lam_k + mu)``,
  ``c = 1``, i.e. ``P^{-1} = (lam_k + mu) U (Lam + mu I)^{-1} U^T + (I - U U^T)`` with ``lam_k = min(lam)``.

At full rank (``k = n``, the default of ``make_preconditioner``'s ``ran`` and ``sketch`` for ``n <= 3000``) the
RAN form is ``P = (K + mu I) / (lam_n + mu)`` to rounding, with ``lam_n`` at the rounding level: a multiple of
``K + mu I``, so nothing is capped or truncated. PCG does not see the scale; the estimator's error bars
(:func:`gpnys.gp.estimator.ritz_log_square`) do not either (docs/accuracy.md, "The floor's centre").

The naive Sherman-Morrison-Woodbury inverse of eq. (4) is deliberately not offered: it inverts the
ill-conditioned ``K11`` and cancels catastrophically, which is why the AFN paper (§2, after eq. (8)) calls it
unstable. Nothing of size ``n x n`` is ever formed: memory is ``O(n k)``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import gpytorch
import torch

from gpnys import landmarks as _landmarks
from gpnys.checks import validate_choice, validate_count, validate_seed
from gpnys.collectives import RowGroup
from gpnys.kernels.entries import KernelEntries, evaluate
from gpnys.linalg import safe_cholesky, small_dense, synchronize, thin_matmul
from gpnys.precond.base import Preconditioner

__all__ = ["NystromPreconditioner", "SAMPLINGS", "SCALINGS", "LANDMARKS"]

#: :meth:`NystromPreconditioner.differentiable_terms` follows the build only where the build clamped no eigenvalue
#: or its shift ``nu`` is below this share of the noise shift ``mu`` (else the control variate is left out:
#: unbiased, with more variance)
FAMILY_NU_SHARE = 1e-3

SAMPLINGS = ("column", "sketch")
SCALINGS = ("stable", "ran")
LANDMARKS = ("fps", "uniform")


class NystromPreconditioner(Preconditioner):
    """Rank-``k`` Nyström preconditioner ``P ~ K + mu I`` in eigen-form (AFN paper eqs. 7, 8; RAN of Sec. 5).

    Args:
        X: ``(n, d)`` points (their dtype and device are used throughout).
        kernel: a GPyTorch stationary kernel; a ``ScaleKernel``'s outputscale is stripped (unit-variance
            ``K``; pass ``mu = noise / outputscale``).
        mu: regularisation ``mu > 0``.
        k: rank, ``1 <= k <= n``.
        landmarks: ``"fps"`` or ``"uniform"``; landmark rule for ``sampling="column"`` (ignored for
            ``"sketch"`` and when ``landmark_indices`` is given).
        sampling: ``"column"`` (sampled kernel columns) or ``"sketch"`` (Gaussian test matrix).
        scaling: ``"stable"`` (eq. 8, ``P = K_nys + mu I``) or ``"ran"`` (RAN scaling of Sec. 5).
        seed: seed for uniform landmarks and for the Gaussian sketch (a ``torch.Generator`` on X's device).
        diag: optional per-point shifts ``(n,)`` (known per-point noise; stable scaling only): the construction runs on
            ``S K S`` with ``S = D^{-1/2}`` and shift 1, so ``P = S^{-1} (U Lam U^T + I) S^{-1}`` approximates
            ``K + D``; ``mu`` then only labels the preconditioner.
        landmark_indices: optional ``(m,)`` integer tensor, ``m >= k``, of distinct row indices of ``X``
            (e.g. a cached FPS order); the first ``k`` are used. Only with ``sampling="column"``.
        group: split the build by rows over the ranks of a ``torch.distributed`` group (``True``: the default
            group; docs/scaling.md, "Across processes and GPUs"). Each rank evaluates its rows of ``Y`` (column
            sampling) or of the product ``K Omega`` (sketch; ``Omega`` orthonormalised by TSQR, its core summed over
            the ranks), and of ``B``, whose thin SVD is a TSQR
            (:meth:`~gpnys.collectives.RowGroup.tall_svd`); ``U`` is gathered, the ``k x k`` core's
            factor is computed on every rank. The same preconditioner as one process, to rounding.

    Attributes:
        U: ``(n, k)`` orthonormal basis of the Nyström range.
        lam: ``(k,)`` Nyström eigenvalues ``Lambda_hat``, non-increasing and ``>= 0``.
        range_eigs: ``(k,)`` eigenvalues ``d`` of ``P`` on ``range(U)``.
        complement_eig: eigenvalue ``c`` of ``P`` on the orthogonal complement of ``range(U)``.
        nu: the stabilising shift used in the construction.
        landmark_indices: ``(k,)`` long tensor of the landmarks (``None`` for ``sampling="sketch"``).

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.precond import NystromPreconditioner
        >>> from gpnys.solvers import pcg
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.RBFKernel().double()
        >>> A = kernel(X).to_dense().detach() + 1e-2 * torch.eye(200, dtype=torch.float64)  # K + mu I
        >>> b = torch.randn(200, dtype=torch.float64, generator=g)

        At full rank (``k = n``) the Nyström approximation reproduces ``K``, so ``P = K + mu I``:

        >>> torch.allclose(NystromPreconditioner(X, kernel, mu=1e-2, k=200).matmul(b), A @ b)
        True

        At rank 40 (FPS landmarks), ``P = U diag(lam) U^T + mu I`` (inverted by eq. 8) cuts the CG iterations:

        >>> P = NystromPreconditioner(X, kernel, mu=1e-2, k=40)
        >>> torch.allclose(P.matmul(b), P.U @ (P.lam * (P.U.mT @ b)) + 1e-2 * b)
        True
        >>> torch.allclose(P.solve(P.matmul(b)), b)
        True
        >>> pcg(lambda V: A @ V, b, P).iterations < pcg(lambda V: A @ V, b).iterations
        True
    """

    kind = "nystrom"

    def __init__(
        self,
        X: torch.Tensor,
        kernel: gpytorch.kernels.Kernel,
        mu: float,
        k: int,
        landmarks: str = "fps",
        sampling: str = "column",
        scaling: str = "stable",
        seed: int = 0,
        landmark_indices: torch.Tensor | None = None,
        diag: torch.Tensor | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self._start(X, mu, diag)
        n = self.n
        self.k = validate_count(k, "k", low=1, high=n, high_name="n")
        self.sampling = validate_choice(sampling, "sampling", SAMPLINGS)
        self.scaling = validate_choice(scaling, "scaling", SCALINGS)
        validate_choice(landmarks, "landmarks", LANDMARKS)
        seed = validate_seed(seed)
        if landmark_indices is not None and self.sampling != "column":
            raise ValueError("landmark_indices can only be given with sampling='column'")
        if self.diag is not None and self.scaling != "stable":
            raise ValueError("diag (per-point shifts) needs scaling='stable'")
        #: ``D^{-1/2}`` ``(n,)`` with per-point shifts: the factors are those of ``D^{-1/2} K D^{-1/2} + I``
        self.s = None if self.diag is None else self.diag.rsqrt()
        self.seed = seed
        self.rank = self.k
        ranks = RowGroup.of(group)
        #: the ranks splitting the build's rows (``None``: one process, or a group of one)
        self._ranks = ranks if ranks is not None and ranks.size > 1 else None

        synchronize(self.device)
        t0 = time.perf_counter()
        self.X = X
        entries = KernelEntries(X, kernel)
        if self.sampling == "column":
            if landmark_indices is not None:
                idx = self._check_indices(landmark_indices, n, self.k, X.device)
                self.landmarks = "given"
            else:
                self.landmarks = landmarks
                if landmarks == "fps":
                    idx = _landmarks.fps(X, self.k).indices
                else:
                    idx = _landmarks.uniform(n, self.k, seed=seed, device=X.device)
            self.landmark_indices: torch.Tensor | None = idx
            U, lam, nu = self._build_column(entries, idx)
        else:
            self.landmarks = None
            self.landmark_indices = None
            U, lam, nu = self._build_sketch(entries, seed)
        self.U = U
        self.lam = lam
        self.nu = nu
        self.lam_min = float(lam[-1])
        self.lam_max = float(lam[0])
        if self.s is not None:  # P = D^{1/2} (U Lam U^T + I) D^{1/2}: eq. (8) for the scaled kernel, mu = 1
            self.range_eigs = lam + 1.0
            self.complement_eig = 1.0
        elif self.scaling == "stable":  # eq. (8): P = U (Lam + mu) U^T + mu (I - U U^T)
            self.range_eigs = lam + self.mu
            self.complement_eig = self.mu
        else:  # RAN: P = U (Lam + mu)/(lam_k + mu) U^T + (I - U U^T)
            self.range_eigs = (lam + self.mu) / (self.lam_min + self.mu)
            self.complement_eig = 1.0
        synchronize(self.device)
        self.setup_s = time.perf_counter() - t0

    def differentiable_terms(
        self, kernel: gpytorch.kernels.Kernel, mu: torch.Tensor, Z: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log det P(theta)`` and the per-probe ``z_j^T P(theta)^{-1} z_j`` (``(t,)``) with autograd (column
        sampling, stable scaling).

        Same landmarks and shift ``nu`` as this preconditioner, rebuilt from the differentiable ``kernel`` and
        ``mu``: ``B = Y_nu C^{-T}`` with ``C = chol(K11 + nu I)`` and its thin QR ``B = Q R``, then
        ``P = Q (R R^T - nu I) Q^T + mu I``, the eq. (8) preconditioner as built (``lam = sigma^2 - nu``: the shift
        undone). With ``M = R R^T - nu I + mu I``: ``log det P = (n - k) log mu + log det M`` and
        ``z^T P^{-1} z = (|z|^2 - |Q^T z|^2) / mu + |chol(M)^{-1} Q^T z|^2``. Used for the log-det gradient control
        variate (see :meth:`gpnys.precond.afn.AFNPreconditioner.differentiable_terms`), which is unbiased only
        where this family equals the preconditioner the probes were drawn from: without the shift undone it was
        off by ``nu`` on the landmarks' span, which in float32 (``nu`` about ``sqrt(n) eps ||Y||_F``) reaches the
        noise level and biased the gradients by many standard errors.

        Raises:
            NotImplementedError: for the sketch sampling or the RAN scaling, and where the build clamped an
                eigenvalue ``sigma^2 - nu`` at 0 with ``nu`` above :data:`FAMILY_NU_SHARE` of ``mu`` (float32 at
                a high rank): the control variate is then left out.
        """
        if self.sampling != "column" or self.scaling != "stable":
            raise NotImplementedError("differentiable terms exist for column sampling with the stable scaling only")
        X, idx = self.X, self.landmark_indices
        per_point = mu.dim() > 0  # (n,) shifts: the same family on S K S + I, S = D^{-1/2}, P = S^{-1} (.) S^{-1}
        m = torch.ones((), dtype=X.dtype, device=X.device) if per_point else mu
        if self.nu > FAMILY_NU_SHARE * float(m.detach().min()) and bool((self.lam == 0).any()):
            # the build clamped sigma^2 - nu at 0 in some directions (rounding): a smooth family cannot follow the
            # clamp, and where nu is not small against the shift the mismatch would bias the control variate
            raise NotImplementedError("the Nystrom build clamped eigenvalues at a shift nu not small against mu")
        ar = torch.arange(self.k, device=X.device)
        Y = evaluate(kernel, X, X[idx])
        if per_point:
            sv = mu.rsqrt()
            Y, Z = sv[:, None] * Y * sv[idx], sv[:, None] * Z
        Y = Y.index_put((idx, ar), Y[idx, ar] + self.nu)
        C = torch.linalg.cholesky(0.5 * (Y[idx] + Y[idx].mT))
        B = torch.linalg.solve_triangular(C.mT, Y, upper=True, left=False)
        Q, R = torch.linalg.qr(B)
        eye = torch.eye(self.k, dtype=X.dtype, device=X.device)
        core = R @ R.mT + (m - self.nu) * eye
        Lm = torch.linalg.cholesky(0.5 * (core + core.mT))
        logdet = (self.n - self.k) * torch.log(m) + 2.0 * Lm.diagonal().log().sum()
        if per_point:
            logdet = logdet + mu.log().sum()
        W = Q.mT @ Z
        inner = torch.linalg.solve_triangular(Lm, W, upper=False)
        quad = (Z.square().sum(0) - W.square().sum(0)) / m + inner.square().sum(0)
        return logdet, quad

    # ----------------------------------------------------------------------------------------- building
    @staticmethod
    def _check_indices(idx: torch.Tensor, n: int, k: int, device: torch.device) -> torch.Tensor:
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1:
            raise ValueError(f"landmark_indices must be a 1-D integer tensor, got {getattr(idx, 'shape', type(idx))}")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise ValueError(f"landmark_indices must be an integer tensor, got {idx.dtype}")
        if idx.numel() < k:
            raise ValueError(f"landmark_indices has {idx.numel()} entries, fewer than k={k}")
        idx = idx[:k].to(device=device, dtype=torch.long)
        if bool((idx < 0).any()) or bool((idx >= n).any()):
            raise ValueError(f"landmark_indices must lie in [0, {n})")
        if torch.unique(idx).numel() != k:
            raise ValueError("landmark_indices must be distinct (the first k entries)")
        return idx

    def _factor(self, Y_nu: Callable[[int, int], torch.Tensor], core: Callable[[], torch.Tensor],
                nu: float, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Shared tail of the stable construction: ``C = chol(core)``, ``B = Y_nu C^{-T}``, SVD, shift back.

        ``Y_nu(a, b)``: rows ``[a, b)`` of ``Y_nu (n, k)``; ``core()``: ``Omega^T Y_nu (k, k)``. With a group each
        rank computes ``C`` and its rows of ``B`` inside the TSQR's first gather (an error there is raised on every
        rank, not left to the group's timeout), the SVD is a TSQR (:meth:`RowGroup.tall_svd`), and the ranks'
        ``inputs`` are compared. Returns ``U (n, k)``, ``lam (k,)``.
        """

        def b_rows(a: int, b: int) -> torch.Tensor:  # B C^T = Y_nu
            c = core()
            C = safe_cholesky(0.5 * (c + c.mT), "Nystrom core chol(Omega^T Y_nu)", self.shifts)
            return torch.linalg.solve_triangular(C.mT, Y_nu(a, b), upper=True, left=False)

        # Thin SVD of B (more accurate than the eig(B^T B) shortcut of the AFN authors' C code, which squares the
        # condition number); through B = QR first when B is tall, which a GPU's SVD of an (n, k) matrix with n >> k
        # needs. On CUDA the QR-iteration driver: torch's default there (Jacobi, gesvdj) stops at a tolerance and
        # leaves U further from orthonormal, an error P's solve(matmul(v)) amplifies by cond(P) (docs/gpu.md).
        driver = "gesvd" if self.X.is_cuda else None
        if self._ranks is not None:
            U, sigma = self._ranks.tall_svd("Nystrom B", self.n, self.k, b_rows, inputs, driver)
            return U, (sigma.square() - nu).clamp_min(0)
        B = b_rows(0, self.n)
        if B.shape[0] > 2 * B.shape[1]:
            Q, R = torch.linalg.qr(B)
            with small_dense(R.shape[-1], R.device):
                Ur, sigma, _ = torch.linalg.svd(R, driver=driver)
            U = Q @ Ur
        else:
            U, sigma, _ = torch.linalg.svd(B, full_matrices=False, driver=driver)
        lam = (sigma.square() - nu).clamp_min(0)
        return U, lam

    def _nu(self, norm: float) -> float:
        """``nu = sqrt(n) * eps(dtype) * ||Y||_F`` (Frangella et al. use ``eps(||Y||_F)``; see module notes)."""
        nu = math.sqrt(self.n) * torch.finfo(self.dtype).eps * norm
        return nu if nu > 0 else torch.finfo(self.dtype).tiny

    def _inputs(self, *more: torch.Tensor) -> list[torch.Tensor]:
        """What every rank of a split build must hold alike (checked on each gather): the points, the shifts,
        ``more`` (the landmarks, the sketch)."""
        return [self.X] + ([] if self.s is None else [self.s[:, None]]) + list(more)

    def _columns(self, entries: KernelEntries, rows: slice, idx: torch.Tensor) -> torch.Tensor:
        """``K1[rows] = K(X[rows], X_k)`` (of ``D^{-1/2} K D^{-1/2}`` with per-point shifts), a fresh tensor."""
        Y = entries(rows, idx)
        if self.s is not None:
            Y = self.s[rows, None] * Y * self.s[idx]
        return Y.clone() if Y._is_view() else Y  # never write into a kernel's cached storage

    def _build_column(self, entries: KernelEntries, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Column Nyström: ``Omega = I[:, idx]``, ``Y = K(X, X_k)``. Returns ``U (n, k)``, ``lam (k,)``, ``nu``.
        With a group each rank evaluates its rows of ``Y`` only, and one gather adds the ranks' ``||Y_r||_F^2``."""
        ar = torch.arange(self.k, device=idx.device)
        if self._ranks is None:
            Y = self._columns(entries, slice(None), idx)  # (n, k) = K1
            nu = self._nu(float(torch.linalg.matrix_norm(Y)))
            Y[idx, ar] += nu  # Y_nu = Y + nu * Omega: shift the landmark rows only
            return (*self._factor(lambda a, b: Y[a:b], lambda: Y[idx], nu, []), nu)  # core = K11 + nu I
        a, b = self._ranks.rows(self.n)
        inputs = self._inputs(idx.to(self.dtype)[:, None])  # the ranks' landmarks compared too
        mine: dict[str, torch.Tensor] = {}

        def square_norm() -> torch.Tensor:
            mine["Y"] = self._columns(entries, slice(a, b), idx)
            return mine["Y"].square().sum().reshape(1)

        sq = self._ranks.gather_sum("Nystrom ||Y||", square_norm, lambda: self.X.new_zeros(1), inputs)
        nu = self._nu(float(sq[0].sqrt()))

        def core() -> torch.Tensor:  # K11 + nu I, on every rank
            c = self._columns(entries, idx, idx)
            c[ar, ar] += nu
            return c

        def y_nu(a_: int, b_: int) -> torch.Tensor:  # this rank's rows, shifted on its landmark rows (once)
            Y, here = mine.pop("Y"), (idx >= a_) & (idx < b_)
            Y[idx[here] - a_, ar[here]] += nu
            return Y

        return (*self._factor(y_nu, core, nu, inputs), nu)

    def _build_sketch(self, entries: KernelEntries, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Randomized Nyström: orthonormalised Gaussian ``Omega (n, k)``, ``Y = K Omega`` (blocked)."""
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        Omega = torch.randn(self.n, self.k, dtype=self.dtype, device=self.device, generator=gen)
        ranks = self._ranks
        if ranks is None:
            Omega, _ = torch.linalg.qr(Omega)
        else:  # an orthonormal basis of the same range by TSQR (P depends on range(Omega) only)
            Omega = ranks.tall_svd("Nystrom sketch", self.n, self.k, lambda a, b: Omega[a:b], self._inputs(Omega))[0]
        Y = (entries.matmul(Omega, group=ranks) if self.s is None
             else self.s[:, None] * entries.matmul(self.s[:, None] * Omega, group=ranks))
        nu = self._nu(float(torch.linalg.matrix_norm(Y)))
        Y = Y + nu * Omega
        if ranks is None:
            U, lam = self._factor(lambda a, b: Y[a:b], lambda: Omega.mT @ Y, nu, [])
            return U, lam, nu
        a, b = ranks.rows(self.n)
        inputs = self._inputs(Omega)
        core = ranks.gather_sum("Nystrom sketch core", lambda: Omega[a:b].mT @ Y[a:b],
                               lambda: Omega.new_zeros(self.k, self.k), inputs)  # Omega^T Y_nu, O(n k^2 / P)
        U, lam = self._factor(lambda a_, b_: Y[a_:b_], lambda: core, nu, inputs)
        return U, lam, nu

    # ----------------------------------------------------------------------------------------- applying
    def _eigen_apply(self, R: torch.Tensor, range_vals: torch.Tensor, comp_val: float) -> torch.Tensor:
        """``(U diag(r) U^T + c (I - U U^T)) R`` computed as ``U ((r - c) * (U^T R)) + c R``. ``(n, t)``"""
        UtR = thin_matmul(self.U.mT, R)
        return thin_matmul(self.U, (range_vals - comp_val)[:, None] * UtR) + comp_val * R

    def _scaled(self, R: torch.Tensor, power: float) -> torch.Tensor:
        """``D^{power/2} R``: the per-point scaling around the eigen-form (``R`` unchanged without ``diag``)."""
        if self.s is None:
            return R
        return R / self.s[:, None] if power > 0 else R * self.s[:, None]  # s = D^{-1/2}

    def landmark_rows(self) -> torch.Tensor | None:
        """The ``(k,)`` landmark rows of ``X`` (``None`` for ``sampling="sketch"``)."""
        return self.landmark_indices

    def _solve(self, R: torch.Tensor) -> torch.Tensor:
        """``P^{-1} R``: stable ``U (Lam+mu)^{-1} U^T R + (1/mu)(I - U U^T) R`` (eq. 8) or the RAN form; with per-point
        shifts ``D^{-1/2}`` on both sides. ``(n, t)``"""
        inner = self._eigen_apply(self._scaled(R, -1), 1.0 / self.range_eigs, 1.0 / self.complement_eig)
        return self._scaled(inner, -1)

    def inverse_estimate(self, R: torch.Tensor, floor: float | None = None) -> torch.Tensor:
        """``(K + D)^{-1} R`` stood in for by the stable form's inverse (eq. 8) at the shift ``c = min(mu, floor)``,
        ``U (Lam + c)^{-1} U^T R + (I - U U^T) R / c``: ``K_nys <= K`` makes it an upper bound on ``(K + D)^{-1}``
        for every ``D >= c I``. ``P^{-1}`` itself understated a solve's error: the RAN form's by up to
        ``(lam_k + mu) / mu`` (float32 noise gradients 16 standard errors off at noise 1e-3), and a Nyström built for
        the mean of per-point noise by ``mean / min`` on the low-noise points (gradients 7 standard errors off with
        noise over three decades). With per-point shifts of its own (``diag``) it is ``P^{-1}``."""
        c = self.mu if floor is None else min(self.mu, float(floor))
        if self.s is not None or (self.scaling == "stable" and c == self.mu):
            return self.solve(R)
        return self._apply(lambda V: self._eigen_apply(V, 1.0 / (self.lam + c), 1.0 / c), R)

    def _matmul(self, R: torch.Tensor) -> torch.Tensor:
        """``P R`` (stable: ``U Lam U^T R + mu R``; with per-point shifts ``D^{1/2}`` on both sides). ``(n, t)``"""
        return self._scaled(self._eigen_apply(self._scaled(R, 1), self.range_eigs, self.complement_eig), 1)

    def _sample(self, Z: torch.Tensor) -> torch.Tensor:
        """``F Z`` with ``F F^T = P``: the symmetric square root ``U (sqrt(d) - sqrt(c)) U^T Z + sqrt(c) Z``, with
        per-point shifts after ``D^{1/2}``. ``(n, num)``"""
        return self._scaled(self._eigen_apply(Z, self.range_eigs.sqrt(), math.sqrt(self.complement_eig)), 1)

    def logdet(self) -> torch.Tensor:
        """``log det P = sum_i log d_i + (n - k) log c`` exactly (``+ sum log D_i`` with per-point shifts; 0-dim)."""
        comp = torch.tensor(self.complement_eig, dtype=self.dtype, device=self.device)
        out = self.range_eigs.log().sum() + (self.n - self.k) * comp.log()
        return out if self.diag is None else out + self.diag.log().sum()

    def summary(self) -> dict[str, Any]:
        """Base facts plus ``sampling``, ``landmarks``, ``scaling``, ``lam_max``, ``lam_min``, ``nu``, ``seed``."""
        out = super().summary()
        out.update(
            sampling=self.sampling,
            landmarks=self.landmarks,
            scaling=self.scaling,
            lam_max=self.lam_max,
            lam_min=self.lam_min,
            nu=self.nu,
            seed=self.seed,
        )
        return out
