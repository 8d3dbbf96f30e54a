"""The preconditioner interface shared by every gpnys preconditioner, plus input checks and safe Cholesky.

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
import math
import time
import warnings
from typing import Any

import torch

from gpnys.linalg import SINGLE_THREAD_MAX, small_dense

__all__ = ["Preconditioner", "NumericalWarning", "validate_points", "validate_mu", "safe_cholesky", "add_diag",
           "shift_at"]


class NumericalWarning(RuntimeWarning):
    """Numerical trouble that gpnys recovered from (a diagonal shift, a fallback); see ``summary()``."""


def validate_points(X: torch.Tensor, name: str = "X") -> None:
    """Raise ``ValueError`` unless ``X`` is a finite, non-empty ``(n, d)`` floating tensor."""
    if not isinstance(X, torch.Tensor) or X.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (n, d), got {getattr(X, 'shape', type(X))}")
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(X.shape)}")
    if not X.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {X.dtype}")
    if not torch.isfinite(X).all():
        raise ValueError(f"{name} contains NaN or inf")


def validate_training_data(X: torch.Tensor, y: torch.Tensor, names: tuple[str, str] = ("train_x", "train_y")) -> None:
    """Raise ``ValueError`` naming the argument unless ``X`` passes :func:`validate_points` and ``y`` is a finite
    ``(n,)`` floating tensor with ``X``'s ``n`` (checked before any optimiser step touches a parameter)."""
    validate_points(X, names[0])
    if not isinstance(y, torch.Tensor) or y.dim() != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"{names[1]} must be a 1-D tensor of {X.shape[0]} targets, got {getattr(y, 'shape', type(y))}")
    if not y.is_floating_point():
        raise ValueError(f"{names[1]} must be a floating tensor, got {y.dtype}")
    if not torch.isfinite(y).all():
        raise ValueError(f"{names[1]} contains NaN or inf")


def validate_positive(value: float, name: str) -> float:
    """Return ``value`` as a float; raise ``ValueError`` naming ``name`` unless it is positive and finite."""
    try:
        val = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a positive number, got {value!r}") from exc
    if not (val > 0 and math.isfinite(val)):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return val


def validate_mu(mu: float) -> float:
    """Return ``mu`` as a float; raise ``ValueError`` unless it is positive and finite."""
    return validate_positive(mu, "mu")


def shift_at(shift: float | torch.Tensor, index: torch.Tensor) -> float | torch.Tensor:
    """A diagonal shift at the rows ``index``: a scalar (number or 0-dim tensor) as it is, per-point shifts
    ``(n,)`` indexed (same shape as ``index``)."""
    return shift if not isinstance(shift, torch.Tensor) or shift.dim() == 0 else shift[index]


def add_diag(M: torch.Tensor, shift: float | torch.Tensor) -> torch.Tensor:
    """``M + diag(shift)`` over the last two dimensions (out of place, autograd-safe): ``shift`` is a number or a
    0-dim tensor (times the identity) or per-row shifts ``(..., m)`` for ``M (..., m, m)``."""
    s = torch.as_tensor(shift, dtype=M.dtype, device=M.device)
    return M + torch.diag_embed(s.expand(M.shape[:-1]))


def validate_count(value: int, name: str, low: int = 1, high: int | None = None, high_name: str = "n") -> int:
    """Return ``value`` as an int in ``[low, high]``; raise ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
        isinstance(value, float) and value.is_integer()
    ):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value} exceeds {high_name}={high}")
    return value


def safe_cholesky(
    A: torch.Tensor, what: str, shifts: list[float] | None = None, max_tries: int = 10
) -> torch.Tensor:
    """Lower Cholesky factor of SPD ``A`` (``(..., m, m)``), escalating a diagonal shift on failure.

    On failure the shift of each failed block starts at ``10 eps(dtype) * mean|diag A|`` and grows 10x per
    try; blocks that factor are left unshifted. Each shift used is appended to ``shifts`` and reported by a
    :class:`NumericalWarning`. Raises ``RuntimeError`` (never returns NaNs) if ``max_tries`` do not help.

    Example:
        >>> import torch, warnings
        >>> from gpnys.precond.base import safe_cholesky
        >>> A = torch.ones(3, 3, dtype=torch.float64)  # rank one: not numerically SPD
        >>> shifts = []
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # a NumericalWarning names the shift
        ...     L = safe_cholesky(A, "example", shifts)
        >>> len(shifts), shifts[0] < 1e-14, torch.allclose(L @ L.mT, A)
        (1, True, True)
    """
    with small_dense(A.shape[-1] if A.dim() == 2 else SINGLE_THREAD_MAX + 1, A.device):  # a batch keeps its threads
        L, info = torch.linalg.cholesky_ex(A)
    if not bool((info > 0).any()):
        return L
    eps = torch.finfo(A.dtype).eps
    scale = A.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(torch.finfo(A.dtype).tiny)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    shift = torch.zeros_like(scale)
    factor = 10.0 * eps
    for _ in range(max_tries):
        failed = info > 0
        shift = torch.where(failed, factor * scale, shift)
        L, info = torch.linalg.cholesky_ex(A + shift[..., None, None] * eye)
        used = float(shift.max())
        if shifts is not None:
            shifts.append(used)
        warnings.warn(
            f"{what}: Cholesky failed (not numerically SPD); added a diagonal shift up to {used:.3g} "
            f"to {int(failed.sum())} block(s)",
            NumericalWarning,
            stacklevel=3,
        )
        if not bool((info > 0).any()):
            return L
        factor *= 10.0
    raise RuntimeError(f"{what}: Cholesky failed even after {max_tries} diagonal shifts")


def draw(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None = None,
    distribution: str = "gaussian",
) -> torch.Tensor:
    """i.i.d. standard Gaussian (``"gaussian"``) or random-sign (``"rademacher"``) entries of ``shape``."""
    if distribution == "gaussian":
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)
    if distribution == "rademacher":
        return torch.randint(0, 2, shape, device=device, generator=generator).to(dtype).mul_(2).sub_(1)
    raise ValueError(f"distribution must be 'gaussian' or 'rademacher', got {distribution!r}")


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
            if not isinstance(diag, torch.Tensor) or diag.shape != (self.n,):
                raise ValueError(f"diag must be a tensor of {self.n} per-point shifts, got "
                                 f"{tuple(getattr(diag, 'shape', ())) or type(diag).__name__}")
            if not bool((torch.isfinite(diag) & (diag > 0)).all()):
                raise ValueError("diag must be positive and finite")
            self.diag = diag.detach().to(dtype=X.dtype, device=X.device)
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
        if R.shape[0] != self.n:
            raise ValueError(f"R must have {self.n} rows, got shape {tuple(R.shape)}")
        vec = R.dim() == 1
        out = fn(R[:, None] if vec else R)
        return out[:, 0] if vec else out

    def solve(self, R: torch.Tensor) -> torch.Tensor:
        """``P^{-1} R`` for ``R: (n,)`` or ``(n, t)``."""
        return self._apply(self._solve, R)

    def matmul(self, R: torch.Tensor) -> torch.Tensor:
        """``P R`` for ``R: (n,)`` or ``(n, t)``."""
        return self._apply(self._matmul, R)

    def sample(
        self, num: int = 1, generator: torch.Generator | None = None, distribution: str = "gaussian"
    ) -> torch.Tensor:
        """``num`` independent draws ``R z`` with ``P = R R^T``: shape ``(n, num)``.

        ``distribution="gaussian"`` (``z ~ N(0, I)``, so draws from ``N(0, P)``) or ``"rademacher"`` (``z`` of
        random signs: covariance ``P`` too, and in the whitened space the Hutchinson trace estimator loses the
        diagonal's share of its variance, ``2 sum_{i != j} A_ij^2`` instead of ``2 ||A||_F^2``).
        """
        return self._sample(draw((self.n, int(num)), self.dtype, self.device, generator, distribution))

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
