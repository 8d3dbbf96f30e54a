"""Adaptive factorized Nyström (AFN) preconditioner: Zhao, Xu, Huang, Chow & Xi (2024), "An adaptive factorized
Nyström preconditioner for regularized kernel matrices" (the AFN paper), Algorithms 2 and 3 (§3.2 of the paper).

With the ``k`` landmarks ordered first, ``K + mu I`` is approximated by (eq. 9/12)

    M = R_f R_f^T,    R_f = [[L, 0], [V, G^{-1}]],

where ``L = chol(K11 + mu I)`` (``k x k``), ``V = K12^T L^{-T}`` (``(n-k) x k``) and ``G`` is the FSAI factor
(Algorithm 1) of the Schur complement ``S = K22 + mu I - V V^T``, evaluated only on a causal kNN pattern
of the non-landmarks. ``R_f`` is lower triangular with a positive diagonal, so ``M`` is SPD, and

* ``solve``: ``w1 = L^{-1} r1; s2 = G^T G (r2 - V w1); s1 = L^{-T}(w1 - V^T s2)`` (Algorithm 3 with ``V`` stored
  in place of ``K12``, since ``V^T = L^{-1} K12``: two triangular solves with ``L`` instead of four),
* ``matmul``: ``M r = R_f (R_f^T r)`` (two sparse triangular solves with ``G``),
* ``logdet() = 2 sum log L_ii - 2 sum log G_ii``, ``sample`` draws ``R_f Z``.

Memory is ``O(k^2 + n k + n w)``: no ``n x n`` matrix is ever formed.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import gpytorch
import torch

from gpnys.budget import block_rows, dense_limit_bytes
from gpnys.checks import validate_choice, validate_count, validate_seed
from gpnys.collectives import RowGroup, gather_rows
from gpnys.kernels.entries import evaluate
from gpnys.kernels.operator import supported
from gpnys.linalg import add_diag, safe_cholesky, shift_at, thin_matmul
from gpnys.precond.base import Preconditioner
from gpnys.precond.cache import PointCache
from gpnys.precond.fsai import SparseTriangular, fsai_factor, resolve_pattern_inputs

__all__ = ["AFNPreconditioner", "LANDMARK_RULES"]

LANDMARK_RULES = ("auto", "fps", "uniform")
CV_FULL_BUDGET = 2e9  # (n-k) w^2 k above which schur="auto" uses the frozen control variate
CV_ROW_ARRAYS = 8  # (rows, k) arrays a diag-family row's graph holds, forward and backward (an upper bound)
CV_FAMILIES = ("auto", "full", "diag", "frozen")
#: a float64 build forms the Schur blocks' landmark part in float32 where the smallest shift is at least this many times
#: that product's float32 rounding (:func:`schur_product_dtype`)
SCHUR_ROUNDING_MARGIN = 100.0


def schur_product_dtype(dtype: torch.dtype, mu_min: float, k: int, w: int, v2_max: float,
                        rows: int) -> torch.dtype:
    """The dtype of the Schur blocks' landmark part ``V_s V_sᵀ`` (AFN paper Algorithm 2, step 5; ``(w, k)`` rows
    ``V_s`` with ``|V_i|² <= v2_max``, of a Schur complement with ``rows`` rows): float32 for a float64 build whose
    smallest shift ``mu_min`` is at least :data:`SCHUR_ROUNDING_MARGIN` times that product's float32 rounding,
    ``w sqrt(k) eps32 v2_max`` in a block's norm, and whose pattern is not complete (``w < rows``: a complete one
    makes ``M = K + mu I``, kept to float64 rounding), else ``dtype``.

    A block's eigenvalues are at least the shift, so the rounding moves them by at most 1 %: the FSAI factor stays
    SPD and about as good. The preconditioner stays exact as used: ``solve``, ``logdet`` and ``sample`` all follow
    the ``L``, ``V`` and ``G`` built, whatever rounding shaped ``G``. The build's largest product then gathers half
    the bytes and runs at the CPU's float32 rate (docs/scaling.md).

    Example:
        >>> import torch
        >>> from gpnys.precond.afn import schur_product_dtype
        >>> schur_product_dtype(torch.float64, 0.1, 500, 30, 1.0, 7500)
        torch.float32
        >>> schur_product_dtype(torch.float64, 1e-4, 500, 30, 1.0, 7500)  # a shift below the margin
        torch.float64
    """
    if dtype != torch.float64 or w >= rows:
        return dtype
    rounding = w * math.sqrt(k) * torch.finfo(torch.float32).eps * v2_max
    return torch.float32 if mu_min >= SCHUR_ROUNDING_MARGIN * rounding else dtype


def _landmark_part(Vs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``V_s V_sᵀ`` per block (``(b, w, k) -> (b, w, w)``) formed in ``dtype`` (:func:`schur_product_dtype`) from
    :func:`schur_operand`, returned in ``Vs``'s dtype; with autograd."""
    low = schur_operand(Vs, dtype)
    return (low @ low.mT).to(Vs.dtype)


def schur_operand(V: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``V`` (a gathered batch: batch-sized copies only) in the Schur product's ``dtype``, with the entries
    below ``sqrt(tiny)`` of that dtype set to 0 on a CPU. Their products are subnormal numbers, which take a CPU's
    slow path: at a short length-scale most of ``V`` is (elevators n = 8 000, RBF, ℓ = 0.3: 87 % of the entries below
    float32's ``sqrt(tiny)``, and AFN's batched Schur products took 2.4 s instead of 0.2 s). A row of ``V`` has norm
    at most 1 (``V_i V_iᵀ <= k(x_i, x_i)``), so a block entry loses at most ``k sqrt(tiny)``: 5e-17 in float32 at
    k = 500, far below the product's rounding. GPUs take subnormals at full speed: there ``V`` is left as it is.

    Example:
        >>> import torch
        >>> from gpnys.precond.afn import schur_operand
        >>> schur_operand(torch.tensor([0.5, 1e-20, -1e-30], dtype=torch.float64), torch.float32).tolist()
        [0.5, 0.0, 0.0]
    """
    low = V.to(dtype)
    if low.device.type != "cpu":
        return low
    return low.masked_fill(low.abs() < math.sqrt(torch.finfo(dtype).tiny), 0.0)


def _gather_rows(V: torch.Tensor, I: torch.Tensor) -> torch.Tensor:
    """``V[I]`` for ``V: (m, k)``, ``I: (b, w)`` -> ``(b, w, k)``: ``index_select`` copies whole rows and its adjoint
    is ``index_add``, faster forward than advanced indexing (docs/scaling.md)."""
    return V.index_select(0, I.reshape(-1)).view(*I.shape, V.shape[1])


class AFNPreconditioner(Preconditioner):
    """AFN preconditioner ``M ~ K + mu I`` (AFN paper Algorithm 2 build, Algorithm 3 apply).

    Args:
        X: ``(n, d)`` points, ``n >= 2``. Everything is computed in ``X``'s dtype and device.
        kernel: a GPyTorch stationary kernel; a ``ScaleKernel``'s outputscale is stripped (pass
            ``mu = noise / outputscale``).
        mu: regularisation ``> 0``.
        k: landmark count, ``1 <= k <= n``; ``min(k, n - 1)`` landmarks are used so that the Schur complement
            is never empty. ``k > n`` raises ``ValueError``.
        w: FSAI nonzeros per row of ``G`` (paper: 100), ``1 <= w <= n`` (``w > n`` raises ``ValueError``).
            The Schur complement has only ``n - k`` rows, so ``w`` is silently clamped to ``n - k``; with
            ``w >= n - k`` the FSAI is exact and ``M = K + mu I`` up to rounding.
        landmarks: ``"auto"`` (FPS if ``d <= 10`` else uniform, as in the paper), ``"fps"`` or ``"uniform"``.
        seed: seed of uniform landmark draws.
        cache: optional :class:`PointCache` for ``X`` (FPS order, uniform draws and kNN patterns reused).
        diag: optional per-point shifts ``mu_i > 0`` ``(n,)`` (known per-point noise over the outputscale): ``M ~ K +
            diag(mu_i)``, with ``L = chol(K11 + D1)`` and the Schur complement ``K22 + D2 - V V^T``; ``mu`` then only
            labels the preconditioner. ``solve``, ``logdet`` and ``sample`` stay exact for this ``M``.
        group: split the build over the ranks of a ``torch.distributed`` group (``True``: the default group): each
            rank computes its rows of ``V`` (its columns of ``K12``) and of ``G``, and gathers the others'; ``L``,
            the landmarks and the pattern are computed on every rank. ``None``: all here.

    Attributes:
        landmark_idx: ``(k,)`` landmark rows of X; rest_idx: ``(n-k,)`` the others in data order;
        L: ``(k, k)``; V: ``(n-k, k)``; factor: :class:`SparseTriangular` holding ``G`` (``(n-k, n-k)`` CSR).
        schur_dtype: the dtype the Schur blocks' landmark part ``V_s V_sᵀ`` was formed in
        (:func:`schur_product_dtype`).

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.precond import AFNPreconditioner
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(150, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.RBFKernel().double()
        >>> kernel.lengthscale = 0.5
        >>> A = kernel(X).to_dense().detach() + 0.01 * torch.eye(150, dtype=torch.float64)  # K + mu I
        >>> v = torch.randn(150, dtype=torch.float64, generator=g)

        With ``w >= n - k`` the FSAI of the Schur complement is exact, so ``M = K + mu I``:

        >>> P = AFNPreconditioner(X, kernel, mu=0.01, k=30, w=120)
        >>> torch.allclose(P.solve(v), torch.linalg.solve(A, v))
        True
        >>> torch.allclose(P.logdet(), torch.logdet(A))
        True

        A sparse ``G`` (``w = 10`` nonzeros per row) approximates ``K + mu I``; ``solve`` inverts ``matmul`` exactly:

        >>> P = AFNPreconditioner(X, kernel, mu=0.01, k=30, w=10)
        >>> torch.allclose(P.solve(P.matmul(v)), v)
        True
    """

    kind = "afn"

    @torch.no_grad()
    def __init__(
        self,
        X: torch.Tensor,
        kernel: gpytorch.kernels.Kernel,
        mu: float,
        k: int = 2000,
        w: int = 100,
        landmarks: str = "auto",
        seed: int = 0,
        cache: PointCache | None = None,
        diag: torch.Tensor | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        t0 = self._start(X, mu, diag)
        ranks = RowGroup.of(group)
        #: the ranks splitting the build's rows (``None``: one process, or a group of one)
        self._ranks = ranks if ranks is not None and ranks.size > 1 else None
        n, d = X.shape
        if n < 2:
            raise ValueError(f"X must have at least 2 points for AFN, got n={n}")
        k = validate_count(k, "k", 1, n)
        w = validate_count(w, "w", 1, n)
        validate_choice(landmarks, "landmarks", LANDMARK_RULES)
        self.k = min(k, n - 1)
        self.w = min(w, n - self.k)
        self.rank = self.k
        self.landmarks_requested = landmarks
        self.landmarks = ("fps" if d <= 10 else "uniform") if landmarks == "auto" else landmarks
        self.seed = validate_seed(seed)
        ke, cache, scale = resolve_pattern_inputs(X, kernel, cache)
        hits0 = cache.hits

        # Algorithm 2, steps 1-2: landmarks first, the rest in data order.
        if self.landmarks == "fps":
            lm = cache.fps(self.k)
            order_key: tuple = ("afn-rest", "fps", self.k)
        else:
            lm = cache.uniform(self.k, self.seed)
            order_key = ("afn-rest", "uniform", self.k, self.seed)
        keep = torch.ones(n, dtype=torch.bool, device=X.device)
        keep[lm] = False
        rest = keep.nonzero().squeeze(1)
        self.landmark_idx, self.rest_idx = lm, rest
        self.perm = torch.cat([lm, rest])

        # Step 3: L = chol(K11 + mu I) (+ D1 for per-point shifts), shifted (with a NumericalWarning) only if not
        # numerically SPD.
        self.L = safe_cholesky(add_diag(ke(lm, lm), self._shift(lm)), "AFN: K11 + mu I", self.shifts)

        # Step 4 and V = K12^T L^{-T} ((n-k, k)), one block of K12's columns at a time (this rank's, with a group).
        cb = block_rows(self.k, device=X.device)

        def v_rows(a: int, b: int) -> torch.Tensor:
            out = torch.empty(b - a, self.k, dtype=X.dtype, device=X.device)
            for c in range(a, b, cb):
                K12 = ke(lm, rest[c : min(c + cb, b)])
                out[c - a : c - a + K12.shape[1]] = torch.linalg.solve_triangular(self.L, K12, upper=False).T
            return out

        check = [X, self.L[-1:]]  # every rank's points, and a row of L (hyperparameters, shift, landmarks)
        self.V = gather_rows(ranks, "AFN V rows", n - self.k, v_rows, check, (self.k,))

        # Step 5: FSAI of S = K22 + mu I - V V^T (+ D2 for per-point shifts) on the causal kNN pattern of X_r (in
        # X_r's order).
        idx, valid = cache.knn(order_key, rest, self.w, scale)
        self.X, self.pattern = X, (idx, valid)
        mu_r = self._shift(rest)
        mu_min = float(mu_r.min()) if isinstance(mu_r, torch.Tensor) else float(mu_r)
        #: the dtype of the Schur blocks' landmark part, in the build and in the ``"full"`` control variate family
        self.schur_dtype = schur_product_dtype(X.dtype, mu_min, self.k, self.w,
                                               float(self.V.square().sum(1).max()) if self.V.numel() else 0.0,
                                               n - self.k)
        V = self.V.to(self.schur_dtype)  # gathered at that precision: half the bytes in float32

        def schur_blocks(I: torch.Tensor) -> torch.Tensor:  # S[s, s] for I: (b, w) -> (b, w, w)
            Vs = schur_operand(_gather_rows(V, I), V.dtype)
            Kb = add_diag(ke.batched(rest[I]), shift_at(mu_r, I))
            if Vs.dtype == Kb.dtype:
                return torch.baddbmm(Kb, Vs, Vs.mT, alpha=-1.0)
            return Kb.sub_(torch.bmm(Vs, Vs.mT))

        # gathered V rows per batch: half a block (16 MiB by default); the gather is memory-bound, so a buffer that
        # stays in cache for the following bmm is faster per row than larger batches (docs/scaling.md)
        batch = block_rows(self.w * (self.w + self.k), parts=2, device=X.device)
        G = fsai_factor(schur_blocks, idx, valid, batch=batch, shifts=self.shifts, what="AFN: Schur block",
                         group=ranks, inputs=check)
        self.factor = SparseTriangular(G)
        self.cache_hits = cache.hits - hits0
        self.setup_s = time.perf_counter() - t0

    @property
    def G(self) -> torch.Tensor:
        """FSAI factor of the Schur complement: ``(n-k, n-k)`` sparse CSR, lower triangular."""
        return self.factor.G

    def _split(self, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Rp = R[self.perm]
        return Rp[: self.k], Rp[self.k :]

    def _merge(self, top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.n, top.shape[1], dtype=top.dtype, device=top.device)
        out[self.perm] = torch.cat([top, bottom])
        return out

    def landmark_rows(self) -> torch.Tensor:
        """The ``(k,)`` landmark rows of ``X`` (``landmark_idx``)."""
        return self.landmark_idx

    def _solve(self, R: torch.Tensor) -> torch.Tensor:
        r1, r2 = self._split(R)
        w1 = torch.linalg.solve_triangular(self.L, r1, upper=False)
        s2 = self.factor.tmm(self.factor.mm(r2 - thin_matmul(self.V, w1)))
        s1 = torch.linalg.solve_triangular(self.L.mT, w1 - thin_matmul(self.V.mT, s2), upper=True)
        return self._merge(s1, s2)

    def schur_quad(self, R2: torch.Tensor) -> torch.Tensor:
        """``r^T M^{-1} r = ||G r_2||^2`` per column for ``r`` that vanishes on the landmarks, given by its
        non-landmark rows ``R2 = R[rest_idx]`` (``(n-k, t)``): ``M^{-1}``'s lower-right block is ``G^T G``, so the
        ``L`` and ``V`` parts of :meth:`solve` drop out. ``(t,)``"""
        return self.factor.mm(R2).square().sum(0)

    def _matmul(self, R: torch.Tensor) -> torch.Tensor:
        r1, r2 = self._split(R)
        u1 = self.L.mT @ r1 + thin_matmul(self.V.mT, r2)  # R_f^T r
        u2 = self.factor.tsolve(r2)
        return self._merge(self.L @ u1, thin_matmul(self.V, u1) + self.factor.solve(u2))  # R_f u

    def _sample(self, Z: torch.Tensor) -> torch.Tensor:
        z1, z2 = Z[: self.k], Z[self.k :]  # Z is i.i.d., so no permutation is needed on input
        return self._merge(self.L @ z1, thin_matmul(self.V, z1) + self.factor.solve(z2))

    def logdet(self) -> torch.Tensor:
        return 2.0 * self.L.diagonal().log().sum() - 2.0 * self.factor.logdiag()

    def control_family(self, schur: str = "auto") -> str:
        """The family :meth:`differentiable_terms` builds for ``schur``: ``"auto"`` is ``"full"`` while ``(n - k) w² k
        <= 2e9`` (:data:`CV_FULL_BUDGET`), else ``"frozen"``, which removed as much variance as ``"diag"`` at a lower
        cost wherever both were measured (docs/training.md); any other name is itself.

        Example:
            >>> import torch, gpytorch
            >>> from gpnys.precond.afn import AFNPreconditioner
            >>> X = torch.rand(100, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
            >>> P = AFNPreconditioner(X, gpytorch.kernels.RBFKernel().double(), mu=0.1, k=20, w=10)
            >>> P.control_family("auto"), P.control_family("diag")
            ('full', 'diag')
        """
        validate_choice(schur, "schur", CV_FAMILIES)
        if schur != "auto":
            return schur
        return "full" if (self.n - self.k) * self.w**2 * self.k <= CV_FULL_BUDGET else "frozen"

    def differentiable_terms(
        self, kernel: gpytorch.kernels.Kernel, mu: torch.Tensor, Z: torch.Tensor, schur: str = "full",
        split: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log det P(theta)`` and the per-probe ``z_j^T P(theta)^{-1} z_j``, differentiable in the kernel's
        parameters and ``mu``.

        The same landmarks and FSAI pattern as this preconditioner, rebuilt with autograd from ``kernel`` (a
        unit-variance kernel) and the tensor ``mu``. Uses ``P^{-1} = R^{-T} R^{-1}`` with
        ``R^{-1} z = [L^{-1} z1; G (z2 - V L^{-1} z1)]``, so only products with G (no sparse triangular solves)
        and ``log det P = 2 sum log L_ii - 2 sum log G_ii`` are needed. The FSAI rows' graph (``O(n w k)``) is kept
        where it fits the dense budget, else recomputed in checkpointed batches, so memory stays O(nk + nw). Used as
        the control variate of the log-determinant gradient (Wenger et al. 2022):
        ``tr(K^{-1} dK) = d log det P + tr(K^{-1} dK - P^{-1} dP)``.
        Diagonal shifts recorded during the build are not replayed (they only occur in degenerate cases).

        With ``schur="diag"`` only ``L`` and ``V`` are rebuilt and the FSAI part follows the Schur complement's
        diagonal: ``G(theta) = G D^{-1/2}`` with ``D_i = S_ii(theta) / S_ii`` (``S_ii = K_ii + mu - |V_i|^2``),
        i.e. the family ``P(theta) = [[L L^T, L V^T], [V L^T, V V^T + D^{1/2} (G^T G)^{-1} D^{1/2}]]``, equal to
        ``P`` at the current hyperparameters. Any such family gives an unbiased control variate (its
        derivative only decides how much variance is removed); this one costs ``O(n k (k + t))`` instead of
        the full rebuild's ``O(n w^2 k)`` forward and backward. Its autograd graph holds about
        :data:`CV_ROW_ARRAYS` ``(n - k, k)`` arrays; above the dense budget the rows run in checkpointed batches
        (:meth:`_family_batches`), ``O(block + n t)``.

        ``schur="frozen"`` is the same family with ``|V_i|^2`` in ``S_ii`` held at its current value (the landmark
        term of the Schur diagonal no longer moves with theta). ``V`` is then never rebuilt: ``V L^{-1} z1 =
        K21 (K11 + mu I)^{-1} z1`` costs ``O(k^2 t + n k t)``, and the ``(n-k) x k`` triangular solve and its
        backward (``O(n k^2)``, most of the ``diag`` cost) are gone; the family still equals ``P`` at the
        current hyperparameters, so the control variate stays unbiased.

        Args:
            kernel: unit-variance GPyTorch kernel with the current (differentiable) hyperparameters.
            mu: 0-dim tensor, ``noise / outputscale``, or ``(n,)`` per-point shifts when the preconditioner was
                built with ``diag`` (the same family: ``K11 + D1`` and the Schur complement with ``D2``).
            Z: ``(n, t)`` fixed probe vectors.
            schur: ``"full"`` (rebuild the FSAI rows), ``"diag"`` (diagonal-scaled FSAI, see above), ``"frozen"``
                (``diag`` with the landmark part of the Schur diagonal held) or ``"auto"``
                (:meth:`control_family`).
            split: with a build split over a process group, the ``diag`` and ``frozen`` families' non-landmark rows
                are split too (:meth:`_split_schur_terms`; a kernel in the formula table). Only where no per-probe
                Jacobian is taken through these terms: their backward gathers across the ranks.

        Returns:
            ``(logdet, quad)``: a 0-dim tensor and a ``(t,)`` one, carrying gradients.
        """
        from torch.utils.checkpoint import checkpoint

        X, lm, rest = self.X, self.landmark_idx, self.rest_idx
        schur = self.control_family(schur)
        L = torch.linalg.cholesky(add_diag(evaluate(kernel, X[lm], X[lm]), shift_at(mu, lm)))
        Zp = Z[self.perm]
        w1 = torch.linalg.solve_triangular(L, Zp[: self.k], upper=False)
        if split and self._ranks is not None and schur in ("diag", "frozen") and supported(kernel):
            return self._split_schur_terms(kernel, mu, Zp, L, w1, schur)
        if schur in ("diag", "frozen"):
            def family_rows(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
                I = rest[a:b]
                return self._family_rows(evaluate(kernel, X[I], X[lm]), evaluate(kernel, X[I], X[I], diag=True),
                                         shift_at(mu, I), Zp[self.k + a : self.k + b], L, w1, a, b, schur)

            sx, log_scale = self._family_batches(family_rows, 0, self.n - self.k)
            # ||G s x||^2 with the fixed sparse G out of the graph: value ||y||^2, derivative 2 (G^T y)^T d(s x)
            # (a sparse product has no batching rule, so it would stop the per-probe Jacobian's vmap)
            with torch.no_grad():
                y = self.factor.mm(sx)
                gty = self.factor.tmm(y)
            quad = w1.square().sum(0) + y.square().sum(0) + 2.0 * (gty * (sx - sx.detach())).sum(0)
            logdet = 2.0 * L.diagonal().log().sum() - 2.0 * self.factor.logdiag() - 2.0 * log_scale
            return logdet, quad
        V = torch.linalg.solve_triangular(L, evaluate(kernel, X[lm], X[rest]), upper=False).mT
        x = Zp[self.k :] - V @ w1
        idx, valid = self.pattern
        w = idx.shape[1]
        eye_w = torch.eye(w, dtype=X.dtype, device=X.device)

        def rows(I: torch.Tensor, M: torch.Tensor, V: torch.Tensor, x: torch.Tensor, mu: torch.Tensor):
            P = X[rest[I]]
            Vs = _gather_rows(V, I)
            S = add_diag(evaluate(kernel, P, P), shift_at(mu, I)) - _landmark_part(Vs, self.schur_dtype)
            S = torch.where(M[:, :, None] & M[:, None, :], S, eye_w)
            Lb = torch.linalg.cholesky(S)
            e = torch.zeros(S.shape[0], w, 1, dtype=S.dtype, device=S.device)
            e[:, -1] = 1.0
            g = torch.linalg.solve_triangular(Lb.mT, e, upper=True)[..., 0]  # last rows of Lb^{-1} (Alg. 1)
            Gx = (g[:, :, None] * torch.where(M[:, :, None], x[I], 0.0)).sum(1)
            return g[:, -1].log().sum(), Gx.square().sum(0)

        batch = block_rows(w * (w + self.k), parts=2, device=X.device)
        # the rows' autograd graph (their gathered V rows and Schur blocks, about 2 w k + 4 w^2 entries a row) kept
        # where it fits the dense budget, else recomputed per batch in the backward (torch's checkpoint, whose
        # first call in a process also imports torch._dynamo: 1.6 s on a 2-core CPU)
        keep = idx.shape[0] * (2 * w * self.k + 4 * w * w) * 8 <= dense_limit_bytes(X.device)
        logg = X.new_zeros(())
        quad = w1.square().sum(0)
        for a in range(0, idx.shape[0], batch):
            args = (idx[a : a + batch], valid[a : a + batch], V, x, shift_at(mu, rest))
            lg, q = rows(*args) if keep else checkpoint(rows, *args, use_reentrant=False)
            logg = logg + lg
            quad = quad + q
        return 2.0 * L.diagonal().log().sum() - 2.0 * logg, quad

    def _family_rows(self, K21: torch.Tensor, kdiag: torch.Tensor | float, mu: torch.Tensor, Zr: torch.Tensor,
                     L: torch.Tensor, w1: torch.Tensor, a: int, b: int,
                     schur: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[a, b)`` of the non-landmarks in the ``diag`` / ``frozen`` family (:meth:`differentiable_terms`):
        ``(s x (b - a, t), sum log s)`` with ``x = z2 - V L^{-1} z1``, ``s = D^{-1/2}`` (1 in value), from
        ``K21 = K(X_rest[a:b], X_lm)`` ``(b - a, k)``, ``K_ii`` (``kdiag``) and the shifts ``mu``, all with autograd."""
        if schur == "frozen":  # V w1 = K21 (K11 + mu I)^{-1} z1, no (n-k) x k triangular solve; |V_i|^2 held
            x = Zr - K21 @ torch.linalg.solve_triangular(L.mT, w1, upper=True)
            v2 = self.V[a:b].square().sum(1)
        else:
            V = torch.linalg.solve_triangular(L, K21.mT, upper=False).mT
            x, v2 = Zr - V @ w1, V.square().sum(1)
        d = kdiag + mu - v2
        scale = (d / d.detach()).rsqrt()  # D^{-1/2}, equal to 1 in value
        return scale[:, None] * x, scale.log().sum()

    def _family_batches(self, rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], a: int,
                        b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows(a, b)`` (:meth:`_family_rows`), in activation-checkpointed batches when its autograd graph
        (about ``CV_ROW_ARRAYS`` arrays of ``(b - a, k)``, forward and backward) would exceed the dense budget
        (:func:`gpnys.budget.dense_limit_bytes`): each batch then keeps only its ``(rows, t)`` output and recomputes
        its ``(rows, k)`` arrays during the backward (``torch.utils.checkpoint``; one more forward of the rows),
        so the family's memory is ``O(block + n t)`` instead of ``O(n k)``. Same values and gradients."""
        width = CV_ROW_ARRAYS * self.k
        if (b - a) * width * 8 <= dense_limit_bytes(self.X.device):  # sizes in float64 entries, as the budget's
            return rows(a, b)
        from torch.utils.checkpoint import checkpoint

        step = block_rows(width, device=self.X.device)
        parts = [checkpoint(rows, c, min(c + step, b), use_reentrant=False, preserve_rng_state=False)
                 for c in range(a, b, step)]
        return torch.cat([p[0] for p in parts]), torch.stack([p[1] for p in parts]).sum()

    def _split_schur_terms(self, kernel: gpytorch.kernels.Kernel, mu: torch.Tensor, Zp: torch.Tensor,
                           L: torch.Tensor, w1: torch.Tensor, schur: str) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`differentiable_terms`' ``diag`` / ``frozen`` families with the non-landmark rows split over the ranks
        (docs/scaling.md, "Across processes and GPUs"): each rank computes its rows of ``s x`` (``O(n k (k + t) / P)``,
        from the formula table's kernel of the shared length-scale), one gather assembles their values for the sparse
        ``G`` products, and the zero-valued terms that carry the rows' derivatives are added over the ranks with
        autograd (:meth:`RowGroup.split_sum`). ``Zp``: the permuted probes; ``L``, ``w1``: the landmark factor and
        ``L^{-1} z1``, computed alike on every rank. Same values and gradients as one process, to rounding."""
        from gpnys.kernels.formulas import k_of_r

        ranks, X, lm, rest, k = self._ranks, self.X, self.landmark_idx, self.rest_idx, self.k
        nu = None if isinstance(kernel, gpytorch.kernels.RBFKernel) else float(kernel.nu)
        t, m, inputs = Zp.shape[1], rest.shape[0], [X, Zp]
        a, b = ranks.rows(m)
        centre = X.mean(0)  # the kernel operator's centring (distances are translation invariant)
        out: dict[str, torch.Tensor] = {}

        def partial(ls: torch.Tensor, mu: torch.Tensor, L: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
            rows: dict[str, torch.Tensor] = {}

            def family_rows(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
                Zr, Zl = (X[rest[a:b]] - centre) / ls.reshape(-1), (X[lm] - centre) / ls.reshape(-1)
                K21 = k_of_r(torch.cdist(Zr, Zl), nu)  # unit-variance stationary kernel: K_ii = 1
                return self._family_rows(K21, 1.0, shift_at(mu, rest[a:b]), Zp[k + a : k + b], L, w1, a, b, schur)

            def sx_rows(a: int, b: int) -> torch.Tensor:  # this rank's rows of s x, kept with their graph
                rows["sx"], rows["log_scale"] = self._family_batches(family_rows, a, b)
                return rows["sx"].detach()

            sx = ranks.gather_rows("AFN control variate rows", m, sx_rows, inputs, (t,))
            with torch.no_grad():
                out["y"] = self.factor.mm(sx)
                gty = self.factor.tmm(out["y"])
            if "sx" not in rows:  # no rows on this rank
                return Zp.new_zeros(t + 1)
            sxr = rows["sx"]  # value 0: 2 (G^T y)^T d(s x) and -2 sum log s over this rank's rows
            return torch.cat([2.0 * (gty[a:b] * (sxr - sxr.detach())).sum(0), -2.0 * rows["log_scale"].reshape(1)])

        try:
            total = ranks.split_sum("AFN control variate", partial, (kernel.lengthscale, mu, L, w1),
                                    lambda: Zp.new_zeros(t + 1), inputs)
        except (torch.linalg.LinAlgError, NotImplementedError) as err:  # the hook would recover from these on this
            # rank alone, while the others raise RuntimeError naming it: raise alike everywhere
            raise RuntimeError(f"AFN control variate: this rank's rows failed: {err}") from err
        quad = w1.square().sum(0) + out["y"].square().sum(0) + total[:t]
        logdet = 2.0 * L.diagonal().log().sum() - 2.0 * self.factor.logdiag() + total[t]
        return logdet, quad

    def frozen_derivatives(self, kernel: gpytorch.kernels.Kernel, mu: torch.Tensor,
                           Z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The ``"frozen"`` family's per-probe ``q_j = z_jᵀ P(θ)⁻¹ z_j`` (:meth:`differentiable_terms`) with its
        derivatives in closed form: ``(q (t,), ∂q/∂l (t, d_l), ∂q/∂mu (t,) or (t, n))``, ``d_l`` the length-scale's
        entries (1: isotropic), ``mu`` scalar or per point (input order). No autograd.

        With ``A = K11 + mu``, ``u = A⁻¹ z1``, ``x = z2 - K21 u``, ``g = Gᵀ G x`` and ``v = A⁻¹ K21ᵀ g``:
        ``dq = (2v - u)ᵀ dK11 u - 2 gᵀ dK21 u + Σ dmu_i ∂q/∂mu_i`` (the held Schur diagonal's scale adds
        ``-g_i x_i / S_ii`` per non-landmark), and each ``Σ_ab W_ab ∂K_ab/∂l_d`` with a rank-one ``W`` is a
        :meth:`~gpnys.kernels.backends.torch_tiles.TorchTiles.column_sums` over the ``k x k`` and ``(n-k) x k``
        blocks: ``O(n k t d)`` flops. A backward pass per probe through the family instead costs ``O(k³)``
        (the Cholesky's backward) each, most of a BoTorch evaluation (docs/bo.md).
        ``None`` for a kernel outside the formula table (then autograd it is)."""
        from gpnys.kernels.backends.torch_tiles import TorchTiles
        from gpnys.kernels.formulas import k_and_h, k_of_r2

        if not supported(kernel):
            return None
        nu = None if isinstance(kernel, gpytorch.kernels.RBFKernel) else float(kernel.nu)
        lm, rest, k = self.landmark_idx, self.rest_idx, self.k
        with torch.no_grad():
            ls = kernel.lengthscale.detach().reshape(-1)
            mu = mu.detach()
            Zs = (self.X - self.X.mean(0)) / ls  # scaled, centred (as the kernel operator)
            Zl, Zr = Zs[lm], Zs[rest]
            acc = torch.promote_types(Zs.dtype, torch.float64)

            def block(Za: torch.Tensor, Zb: torch.Tensor, h: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
                r2 = torch.cdist(Za.to(acc), Zb.to(acc)).square()
                if not h:  # K alone (the first pass over K21)
                    return k_of_r2(r2, nu).to(Zs.dtype), None
                kv, hv = k_and_h(r2, nu)
                if nu == 0.5:  # h's pole only ever multiplies (z_a - z_b)^2 = 0: zero, as the kernel operator does
                    hv = hv.masked_fill(r2 <= torch.finfo(Zs.dtype).eps * float(Zs.abs().max()) ** 2, 0.0)
                return kv.to(Zs.dtype), hv

            K11, H11 = block(Zl, Zl)
            A = add_diag(K11, shift_at(mu, lm))
            L = torch.linalg.cholesky(A)
            Zp = Z.detach()[self.perm]
            z1, z2 = Zp[:k], Zp[k:]
            u = torch.cholesky_solve(z1, L)
            t = Z.shape[1]

            def sums(Za, Zb, Kt, Ht, U, V) -> torch.Tensor:  # (t, d_l): sum_ab U_aj V_bj H_ab (za_d - zb_d)^2
                tile = (slice(0, Za.shape[0]), slice(None), Kt, Ht.to(Kt.dtype), Za, Zb)
                return TorchTiles.column_sums(Zs, iter([tile]), U, V, isotropic=ls.numel() == 1,
                                              same_points=Za is Zb)[1]

            # the (n - k) x k block K21 (and H21) in row chunks of one memory block, twice (x needs all of
            # K21 u before g exists): O(n k d) recomputed against O(n k) float64 storage, which with its
            # temporaries would be the peak of an evaluation. With a group, each rank its rows: one gather of
            # x's rows, one of the sums (docs/scaling.md, "Across processes and GPUs")
            chunk, m, ranks = block_rows(k, parts=4, device=Zs.device), Zr.shape[0], self._ranks
            inputs = [self.X, Z]

            def parts(a: int, b: int) -> list[slice]:
                return [slice(c, min(c + chunk, b)) for c in range(a, b, chunk)]

            def x_rows(a: int, b: int) -> torch.Tensor:
                return torch.cat([z2[c] - thin_matmul(block(Zr[c], Zl, h=False)[0], u) for c in parts(a, b)])

            x = gather_rows(ranks, "AFN frozen rows", m, x_rows, inputs, (t,)) if m else z2
            d0 = 1.0 + shift_at(mu, rest) - self.V.square().sum(1)  # the held Schur diagonal
            y = self.factor.mm(x)
            g = self.factor.tmm(y)

            def row_sums() -> torch.Tensor:  # K21^T g (k, t) and the rows' length-scale sums (t, d_l)
                K12g = z1.new_zeros(k, t, dtype=acc)
                gd = Zs.new_zeros(t, ls.numel(), dtype=acc)
                for c in parts(*((0, m) if ranks is None else ranks.rows(m))):
                    K21, H21 = block(Zr[c], Zl)
                    K12g += thin_matmul(K21.mT, g[c])
                    gd += sums(Zr[c], Zl, K21, H21, -2.0 * g[c], u)
                return torch.cat([K12g.reshape(-1), gd.reshape(-1)])

            both = row_sums() if ranks is None else ranks.gather_sum(
                "AFN frozen sums", row_sums, lambda: Zs.new_zeros(k * t + t * ls.numel(), dtype=acc), inputs)
            K12g, gd = both[: k * t].reshape(k, t).to(Zs.dtype), both[k * t :].reshape(t, ls.numel())
            v = torch.cholesky_solve(K12g, L)
            q = (z1 * u).sum(0) + y.square().sum(0)
            gd = gd + sums(Zl, Zl, K11, H11, 2.0 * v - u, u)
            d_ls = (-gd / ls.to(gd.dtype)).to(Zs.dtype)  # dK/dl_d = -h (dz_d)^2 / l_d
            # d q / d mu_i: landmarks -u_i^2 + 2 v_i u_i, the rest -g_i x_i / S_ii (through the scale D^{-1/2})
            per = torch.empty(Z.shape[0], t, dtype=Zs.dtype, device=Zs.device)
            per[:k] = 2.0 * v * u - u.square()
            per[k:] = -g * x / d0[:, None]
            if mu.dim() == 0:
                d_mu = per.sum(0)
            else:
                d_mu = torch.empty_like(per).index_copy_(0, self.perm, per).mT  # (t, n), input order
            return q, d_ls, d_mu

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(
            landmarks=self.landmarks,
            landmarks_requested=self.landmarks_requested,
            k=self.k,
            w=self.w,
            nnz=self.factor.nnz,
            cache_hits=self.cache_hits,
        )
        return out
