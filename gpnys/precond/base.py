"""The preconditioner interface shared by every gpnys preconditioner.

Every preconditioner approximates ``A = K + mu I`` with ``K`` a unit-variance kernel matrix on points
``X (n, d)`` and ``mu > 0`` (in a GP, ``mu = noise / outputscale``), and exposes:

* ``solve(R)`` = ``P^{-1} R`` and ``matmul(R)`` = ``P R`` for ``R: (n,)`` or ``(n, t)``;
* ``logdet()`` = ``log det P`` exactly;
* ``sample(num)`` = ``num`` draws from ``N(0, P)``, shape ``(n, num)``;
* ``rank`` and ``summary()`` (kind, rank, landmarks rule, nnz, shifts added, setup seconds).

No preconditioner forms an ``n x n`` dense matrix.
"""

from __future__ import annotations

import abc
import time
from typing import Any

import torch

from gpnys.checks import validate_count, validate_mu, validate_points
from gpnys.linalg import draw, shift_at

__all__ = ["Preconditioner"]


class Preconditioner(abc.ABC):
    """Abstract preconditioner ``P ~ K + mu I``. Subclasses set ``n``, ``rank``, ``dtype``, ``device``."""

    kind: str = "base"
    n: int
    rank: int
    mu: float
    setup_s: float = 0.0
    #: per-point shifts ``mu_i`` ``(n,)`` on the diagonal instead of ``mu`` (``P ~ K + diag(mu_i)``: known per-point
    #: noise), for the preconditioners that take ``diag=``; ``None``: ``mu`` everywhere
    diag: torch.Tensor | None = None

    def __init__(self) -> None:
        self.shifts: list[float] = []

    def _start(self, X: torch.Tensor, mu: float, diag: torch.Tensor | None = None) -> float:
        """Validate ``X (n, d)``, ``mu`` and ``diag``; record ``n``, ``dtype``, ``device``, ``mu``, ``diag``; return the
        setup start time."""
        t0 = time.perf_counter()
        validate_points(X)
        self.mu = validate_mu(mu)
        self.n, self.dtype, self.device = X.shape[0], X.dtype, X.device
        if diag is not None:
            if not isinstance(diag, torch.Tensor) or diag.shape != (self.n,) or not diag.is_floating_point():
                raise ValueError(f"diag must be a floating tensor of {self.n} per-point shifts, got "
                                 f"{tuple(getattr(diag, 'shape', ())) or type(diag).__name__} "
                                 f"{getattr(diag, 'dtype', '')}")
            shifts = diag.detach().to(dtype=X.dtype, device=X.device)  # checked as X's dtype holds them
            if not bool((torch.isfinite(shifts) & (shifts > 0)).all()):
                raise ValueError(f"diag must be positive and finite in {X.dtype}")
            self.diag = shifts
        return t0

    def _shift(self, index: torch.Tensor) -> float | torch.Tensor:
        """The diagonal shift of the rows ``index``: ``mu``, or ``diag[index]`` (same shape as ``index``)."""
        return shift_at(self.mu if self.diag is None else self.diag, index)

    @abc.abstractmethod
    def _solve(self, R: torch.Tensor) -> torch.Tensor:
        """``P^{-1} R`` for ``R: (n, t)``."""

    @abc.abstractmethod
    def _matmul(self, R: torch.Tensor) -> torch.Tensor:
        """``P R`` for ``R: (n, t)``."""

    @abc.abstractmethod
    def _sample(self, Z: torch.Tensor) -> torch.Tensor:
        """``F Z`` for a factor ``F F^T = P`` and standard normal ``Z: (n, num)``."""

    @abc.abstractmethod
    def logdet(self) -> torch.Tensor:
        """``log det P`` (0-dim tensor)."""

    def _apply(self, fn: Any, R: torch.Tensor) -> torch.Tensor:
        if not isinstance(R, torch.Tensor) or R.dim() not in (1, 2) or R.shape[0] != self.n:
            raise ValueError(f"R must have {self.n} rows, (n,) or (n, t), got {getattr(R, 'shape', type(R))}")
        if R.dtype != self.dtype or R.device != self.device:
            raise ValueError(f"R must have the preconditioner's dtype and device ({self.dtype}, {self.device}), got "
                             f"{R.dtype}, {R.device}")
        vec = R.dim() == 1
        out = fn(R[:, None] if vec else R)
        return out[:, 0] if vec else out

    def solve(self, R: torch.Tensor) -> torch.Tensor:
        """``P^{-1} R`` for ``R: (n,)`` or ``(n, t)``."""
        return self._apply(self._solve, R)

    def matmul(self, R: torch.Tensor) -> torch.Tensor:
        """``P R`` for ``R: (n,)`` or ``(n, t)``."""
        return self._apply(self._matmul, R)

    def inverse_estimate(self, R: torch.Tensor, floor: float | None = None) -> torch.Tensor:
        """A stand-in for ``(K + D)^{-1} R`` (``R: (n,)`` or ``(n, t)``) where an error estimate needs one (a solve's
        error ``K̂⁻¹ρ`` from its residual ``ρ``), for the shifts ``D`` this preconditioner was built for (``mu I``,
        or ``diag``); ``floor``: the smallest true shift, where the true ``D`` is per point but ``P`` was built for
        their mean. ``P^{-1} R`` here; a preconditioner scaled away from ``K + D``, or built for the mean, overrides
        it."""
        return self.solve(R)

    def sample(
        self, num: int = 1, generator: torch.Generator | None = None, distribution: str = "gaussian"
    ) -> torch.Tensor:
        """``num`` independent draws ``R z`` with ``P = R R^T``: shape ``(n, num)``.

        ``distribution="gaussian"`` (``z ~ N(0, I)``, so draws from ``N(0, P)``) or ``"rademacher"`` (``z`` of
        random signs: covariance ``P`` too, and in the whitened space the Hutchinson trace estimator loses the
        diagonal's share of its variance, ``2 sum_{i != j} A_ij^2`` instead of ``2 ||A||_F^2``).
        """
        return self._sample(draw((self.n, validate_count(num, "num", 0)), self.dtype, self.device, generator,
                                 distribution))

    @property
    def chosen(self) -> "Preconditioner":
        """The preconditioner that applies: this one; :class:`~gpnys.precond.strategy.AutoPreconditioner` answers with
        the Nyström or AFN it chose."""
        return self

    def landmark_rows(self) -> torch.Tensor | None:
        """``(k,)`` rows of ``X`` this preconditioner is built on (AFN's landmarks, a column Nyström's), else
        ``None``."""
        return None

    def summary(self) -> dict[str, Any]:
        """Facts for reports: kind, n, rank, mu, diagonal shifts added, setup seconds (+ subclass extras)."""
        return {
            "kind": self.kind,
            "n": self.n,
            "rank": self.rank,
            "mu": self.mu,
            "shifts": list(self.shifts),
            "setup_s": self.setup_s,
        }
