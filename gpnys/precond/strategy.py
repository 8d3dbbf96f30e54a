"""The AFN paper's overall strategy (Algorithm 5) and a by-name factory for every preconditioner.

Algorithm 5: estimate the numerical rank k of K for the current kernel parameters (Algorithm 4,
:func:`gpnys.landmarks.rank.estimate_rank`); if ``k < max_k`` use the column Nyström preconditioner of rank k
with FPS landmarks, applied in the stable form of eq. (8); otherwise AFN with ``max_k`` landmarks
(the paper's §3.3 text says AFN is built when the rank "exceeds 2000", its Algorithm 5 ``k >= 2000``; as there
and in the authors' C code, ``k < max_k`` -> Nyström).

Re-run at every hyperparameter step: construct a new :class:`AutoPreconditioner` per step and pass the same
:class:`~gpnys.precond.cache.PointCache` so the FPS order and kNN patterns (which depend only on X) are reused.
"""

from __future__ import annotations

import time
from typing import Any

import gpytorch
import torch

from gpnys.checks import validate_choice, validate_count
from gpnys.landmarks.rank import RankEstimate, estimate_rank
from gpnys.precond.afn import AFNPreconditioner
from gpnys.precond.base import Preconditioner
from gpnys.precond.cache import PointCache
from gpnys.precond.fsai import FSAIPreconditioner
from gpnys.precond.nystrom import NystromPreconditioner
from gpnys.precond.pivchol import PivotedCholeskyPreconditioner

__all__ = ["AutoPreconditioner", "make_preconditioner", "held_rank", "PRECONDITIONERS", "DIAG_PRECONDITIONERS",
           "HOOK_DIAG_PRECONDITIONERS", "RANK_HOLD"]

#: names accepted by :func:`make_preconditioner` (``"none"`` gives ``None``: plain CG)
PRECONDITIONERS = ("none", "pivchol", "nystrom", "ran", "sketch", "fsai", "afn", "auto")
#: the names that take per-point diagonal shifts (``diag=``, known per-point noise); the others use the scalar ``mu``
DIAG_PRECONDITIONERS = ("nystrom", "fsai", "afn", "auto")
#: the ones the training hook gives them to (AFN and FSAI precondition ``K + D`` better built on ``D`` itself;
#: Nyström's scaled form can be worse, see :class:`AutoPreconditioner`)
HOOK_DIAG_PRECONDITIONERS = ("fsai", "afn", "auto")
#: a new rank estimate within this share of the previous build's rank (or within 1) keeps that rank
#: (:func:`held_rank`); a quarter held ranks far enough from the estimate that the estimator's noise grew and a
#: fit stalled 12 nats short of the optimum
RANK_HOLD = 0.05


def held_rank(k: int, previous: int | None) -> int:
    """The rank to build: the previous build's ``previous`` while the new estimate ``k`` stays within
    :data:`RANK_HOLD` of it (or within 1), else ``k``. Along an optimiser's path the estimate (Algorithm 4) flips
    between neighbouring values (73 and 74 for a noise change of 1e-8); each flip moves the estimated loss by about its
    standard error, a step L-BFGS-B's line search reads as a rise. Holding the rank keeps the estimate smooth in
    the hyperparameters; the answer stays unbiased at any rank (the preconditioner only preconditions).

    Example:
        >>> held_rank(74, 73), held_rank(80, 73), held_rank(50, None)
        (73, 80, 50)
    """
    if previous is not None and abs(int(k) - int(previous)) <= max(1.0, RANK_HOLD * int(previous)):
        return int(previous)
    return int(k)


class AutoPreconditioner(Preconditioner):
    """Algorithm 5: Nyström (FPS, rank k) if the estimated rank ``k < max_k``, else AFN (``max_k`` landmarks).

    Args:
        X: ``(n, d)`` points.
        kernel: GPyTorch kernel (a ``ScaleKernel`` is unwrapped).
        mu: shift ``> 0``.
        max_k: the switch threshold and AFN landmark cap (paper: 2000).
        afn_k: landmarks of the AFN branch when it is taken (default ``max_k``): more landmarks for a kernel whose
            rank is far above the threshold, without moving the switch (:mod:`gpnys.gp.preconditioners`, "Landmarks
            that grow").
        w: FSAI nonzeros per row inside AFN (paper: 100).
        m: rank-estimation subsample size (Algorithm 4).
        reps: rank-estimation repetitions (the authors' code uses 3).
        seed: seeds the rank-estimation subsamples and uniform landmarks.
        cache: reuse FPS order / kNN patterns across hyperparameter steps on the same X.
        diag: optional per-point shifts ``(n,)`` (known per-point noise), passed to AFN when it is chosen; the rank
            estimate and Nyström use ``mu`` (pass their mean): Nyström on ``D^{-1/2} K D^{-1/2} + I`` can precondition
            worse than on ``K + mean(D) I`` when ``D`` spans more than a decade at a low rank, while AFN built on ``D``
            does better (docs/preconditioners.md, "Known per-point noise").
        group: split the chosen build over the ranks of a ``torch.distributed`` group (:class:`AFNPreconditioner`,
            :class:`NystromPreconditioner`); the rank estimate (``m`` points) is computed on every rank.

    Attributes:
        estimate: the :class:`RankEstimate`; inner: the chosen preconditioner; choice: ``"nystrom"``/``"afn"``.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.precond import AutoPreconditioner
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.RBFKernel().double()
        >>> P = AutoPreconditioner(X, kernel, mu=0.01)

        With ``n <= m`` the rank estimate is the exact numerical rank ``#{lambda_i(K) > 0.1 mu}``, here below
        ``max_k``, so Algorithm 5 picks the Nyström preconditioner of that rank:

        >>> eigenvalues = torch.linalg.eigvalsh(kernel(X).to_dense().detach())
        >>> P.choice, P.rank == int((eigenvalues > 0.1 * 0.01).sum())
        ('nystrom', True)
    """

    kind = "auto"

    def __init__(
        self,
        X: torch.Tensor,
        kernel: gpytorch.kernels.Kernel,
        mu: float,
        max_k: int = 2000,
        w: int = 100,
        m: int = 500,
        reps: int = 3,
        seed: int = 0,
        cache: PointCache | None = None,
        diag: torch.Tensor | None = None,
        group: Any = None,
        previous_rank: int | None = None,
        afn_k: int | None = None,
    ) -> None:
        super().__init__()
        t0 = self._start(X, mu, diag)
        max_k = validate_count(max_k, "max_k", 1)
        afn_k = max_k if afn_k is None else validate_count(afn_k, "afn_k", 1)
        cache = cache if cache is not None else PointCache(X)
        t_rank = time.perf_counter()
        self.estimate: RankEstimate = estimate_rank(X, kernel, self.mu, m=m, reps=reps, max_k=max_k, seed=seed,
                                                    decide_only=True)
        self.rank_s = time.perf_counter() - t_rank
        k = held_rank(int(self.estimate.k), previous_rank)  # also holds the Nyström / AFN switch near max_k
        if k < max_k or self.n < 2:  # AFN needs two points; at n = 1 a rank-1 Nyström factor is exact
            k = max(1, min(k, self.n))
            self.choice = "nystrom"
            self.inner: Preconditioner = NystromPreconditioner(
                X, kernel, self.mu, k, landmarks="fps", landmark_indices=cache.fps(k), group=group
            )
        else:
            self.choice = "afn"
            self.inner = AFNPreconditioner(X, kernel, self.mu, k=min(afn_k, self.n), w=min(w, self.n), seed=seed,
                                           cache=cache, diag=self.diag, group=group)
        self.rank = self.inner.rank
        self.shifts = self.inner.shifts
        self.setup_s = time.perf_counter() - t0

    def _solve(self, R: torch.Tensor) -> torch.Tensor:
        return self.inner._solve(R)

    def inverse_estimate(self, R: torch.Tensor, floor: float | None = None) -> torch.Tensor:
        return self.inner.inverse_estimate(R, floor)

    @property
    def chosen(self) -> Preconditioner:
        """The Nyström or AFN preconditioner this one chose (``inner``)."""
        return self.inner

    def landmark_rows(self) -> torch.Tensor | None:
        return self.inner.landmark_rows()

    def _matmul(self, R: torch.Tensor) -> torch.Tensor:
        return self.inner._matmul(R)

    def _sample(self, Z: torch.Tensor) -> torch.Tensor:
        return self.inner._sample(Z)

    def logdet(self) -> torch.Tensor:
        return self.inner.logdet()

    def summary(self) -> dict[str, Any]:
        out = self.inner.summary()
        out.update(
            kind="auto",
            choice=self.choice,
            estimated_rank=int(self.estimate.k),
            rank_branch=self.estimate.branch,
            rank_s=self.rank_s,
            setup_s=self.setup_s,
        )
        return out


def _default(value: int | None, default: int) -> int:
    """``value`` unless it is None (``0`` stays 0, so that validation rejects it instead of a silent default)."""
    return default if value is None else value


def make_preconditioner(
    name: str,
    X: torch.Tensor,
    kernel: gpytorch.kernels.Kernel,
    mu: float,
    cache: PointCache | None = None,
    seed: int = 0,
    rank: int | None = None,
    k: int = 2000,
    w: int | None = None,
    diag: torch.Tensor | None = None,
    group: Any = None,
    previous_rank: int | None = None,
    afn_k: int | None = None,
) -> Preconditioner | None:
    """Build a preconditioner of ``K + mu I`` by name (of ``K + diag(mu_i)`` with per-point shifts ``diag (n,)``, for
    the names in :data:`DIAG_PRECONDITIONERS`; ``mu`` is then their mean).

    ``none`` -> ``None`` (plain CG); ``pivchol`` -> GPyTorch's pivoted Cholesky (``rank``, default 15);
    ``nystrom`` -> column Nyström, FPS landmarks, eq. (8), rank = ``rank`` or the Algorithm 4 estimate;
    ``ran`` -> the paper's RAN baseline (uniform landmarks, RAN scaling, ``rank`` default 3000, capped at n);
    ``sketch`` -> Gaussian-sketch randomized Nyström (Frangella-Tropp-Udell), RAN scaling, same rank rule;
    ``fsai`` -> FSAI of K + mu I (``w`` default 400); ``afn`` -> AFN (``k`` landmarks, ``w`` default 100);
    ``auto`` -> :class:`AutoPreconditioner` (switch threshold ``k``, AFN branch ``afn_k`` landmarks (default ``k``),
    ``w`` default 100).

    ``group`` (a ``torch.distributed`` group, ``True`` for the default one) splits the FSAI, AFN and Nyström builds
    (``nystrom``, ``ran``, ``sketch``, ``auto``) by rows over its ranks; ``pivchol`` is computed on every rank.
    ``previous_rank``: the rank of the previous build along a path of hyperparameters; ``nystrom`` (without
    ``rank``) and ``auto`` keep it while their estimate stays near it (:func:`held_rank`).

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.precond import make_preconditioner
        >>> from gpnys.solvers import pcg
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> kernel.outputscale, noise = 2.0, 0.02
        >>> A = kernel(X).to_dense().detach() + noise * torch.eye(200, dtype=torch.float64)  # K + noise I
        >>> b = torch.randn(200, dtype=torch.float64, generator=g)
        >>> make_preconditioner("none", X, kernel, mu=noise / 2.0) is None
        True

        The outputscale is stripped: ``P`` approximates ``A / outputscale``, with ``mu = noise / outputscale``.

        >>> P = make_preconditioner("afn", X, kernel, mu=noise / 2.0, k=50, w=20)
        >>> P.kind, P.rank
        ('afn', 50)
        >>> res = pcg(lambda V: A @ V, b, lambda R: P.solve(R) / 2.0, tol=1e-10)
        >>> torch.allclose(res.x, torch.linalg.solve(A, b))
        True
        >>> res.iterations < pcg(lambda V: A @ V, b, tol=1e-10).iterations
        True
    """
    validate_choice(name, "preconditioner", PRECONDITIONERS)
    if diag is not None and name not in DIAG_PRECONDITIONERS:
        raise ValueError(f"diag (per-point shifts) is taken by {DIAG_PRECONDITIONERS}, not by {name!r}")
    if afn_k is not None and name != "auto":
        raise ValueError(f"afn_k (the AFN branch's landmarks) is taken by 'auto' only, not by {name!r}; pass k")
    n = X.shape[0]
    if name == "none":
        return None
    if name == "pivchol":
        return PivotedCholeskyPreconditioner(X, kernel, mu, rank=min(_default(rank, 15), n))
    if name == "nystrom":
        if rank is None:
            rank = held_rank(estimate_rank(X, kernel, mu, max_k=k, seed=seed).k, previous_rank)
        r = max(1, min(int(rank), n))
        lm = cache.fps(r) if cache is not None else None
        return NystromPreconditioner(X, kernel, mu, r, landmarks="fps", landmark_indices=lm, diag=diag, group=group)
    if name in ("ran", "sketch"):
        r = min(_default(rank, 3000), n)
        if name == "ran":
            return NystromPreconditioner(X, kernel, mu, r, landmarks="uniform", scaling="ran", seed=seed, group=group)
        return NystromPreconditioner(X, kernel, mu, r, sampling="sketch", scaling="ran", seed=seed, group=group)
    if name == "fsai":
        return FSAIPreconditioner(X, kernel, mu, w=min(_default(w, 400), n), cache=cache, diag=diag, group=group)
    wd = min(100, n) if w is None else w  # a default never exceeds n; an explicit w is validated
    if name == "afn":
        return AFNPreconditioner(X, kernel, mu, k=min(k, n), w=wd, seed=seed, cache=cache, diag=diag, group=group)
    return AutoPreconditioner(X, kernel, mu, max_k=k, w=wd, seed=seed, cache=cache, diag=diag, group=group,
                              previous_rank=previous_rank, afn_k=afn_k)
