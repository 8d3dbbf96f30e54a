"""The preconditioners of one training point set: built for the current hyperparameters, kept while they hold.

:class:`PreconditionerCache` owns what :class:`~gpnys.gp.hook.PreconditionerHook` once did by hand: the
hyperparameter key of a build, the build itself (``make_preconditioner`` or a user's class) for ``K + mu I`` with
``mu = noise / s²``, one slot per option set (the training options, and e.g. a stronger one for posterior solves),
and the fallback to GPyTorch's pivoted Cholesky when a build fails.

Reuse across training steps (``reuse_tolerance``). A preconditioner only preconditions: CG and SLQ run on the true
``K̂``, so ``P`` built at earlier hyperparameters still gives an exact answer, only more iterations. While every
length-scale and ``mu`` lies within ``reuse_tolerance`` (relative) of those ``P`` was built for, and the CG
iterations have not grown past ``refresh_growth`` times those of its first evaluation, the training slot returns the
stored ``P`` with the current outputscale (``P̂ = s² P``). Such a ``P`` is :attr:`PreconditionerCache.stale`: its
differentiable family at the current hyperparameters is no longer the distribution the probes come from, so the
estimator drops the control variate for that evaluation (the plain estimator stays unbiased; its standard errors
say what the variance costs).

Landmarks that grow (``grow_landmarks``). Where the kernel is recomputed on the fly, a CG iteration costs a pass over
the kernel's entries, while AFN's ``k`` landmarks (Zhao et al. 2024, §3) cost ``O(n k)`` entries once per build. An
evaluation that needs ``grow_landmarks`` or more CG iterations with AFN holding all its ``k`` landmarks doubles ``k``
for the following builds, up to :data:`MAX_GROWTH` times the default, half of ``n`` (AFN's FSAI part keeps
the other half) and what the memory budget holds
(:func:`gpnys.budget.default_dense_bytes`: ``2 n k`` entries of 8 bytes). The first evaluation with the grown ``k``
is its trial: where it needs as many iterations as the evaluation that asked for it, the growth is undone and ``k``
stays there for the rest of the fit (more landmarks do not always help AFN's sparse part). ``k`` starts again from
the default on new data. The count of iterations is the same on every rank of a process group, so the
ranks grow alike; the memory bound is the smallest of the ranks'. A stored kernel makes an iteration cheap against a
build, so it never grows ``k``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import gpytorch
import torch

from gpnys.budget import default_dense_bytes
from gpnys.checks import NumericalWarning
from gpnys.collectives import CollectiveError, RowGroup, partitioned
from gpnys.kernels.entries import split_outputscale
from gpnys.keys import TensorKey
from gpnys.precond.afn import AFNPreconditioner
from gpnys.precond.base import Preconditioner
from gpnys.precond.cache import PointCache
from gpnys.precond.fsai import FSAIPreconditioner
from gpnys.precond.pivchol import PivotedCholeskyPreconditioner
from gpnys.precond.strategy import HOOK_DIAG_PRECONDITIONERS, AutoPreconditioner, make_preconditioner

__all__ = ["PreconditionerCache", "StepRecord", "MAX_GROWTH"]

#: the most landmarks growth gives AFN, as a multiple of its default ``k``: 4 x 500 = 2 000, the AFN paper's ``k``
MAX_GROWTH = 4


@dataclass
class StepRecord:
    """One preconditioner build: hyperparameters it was built for and what was chosen."""

    mu: float
    outputscale: float
    rank: int
    kind: str
    setup_s: float
    fallback: bool = False


class PreconditionerCache:
    """Preconditioners ``P`` of ``K + mu I`` for one point set, keyed on the hyperparameters.

    Args:
        method: a name of :data:`~gpnys.precond.strategy.PRECONDITIONERS` or a
            :class:`~gpnys.precond.base.Preconditioner` subclass (called as ``cls(X, kernel, mu, **options)``).
        options: the training preconditioner's options (e.g. ``{"k": 500, "w": 30}``).
        seed: the seed of a named preconditioner's randomness.
        group: a process group the FSAI / AFN / Nyström rows are built over (``None``: one process).
        history: the list each build's :class:`StepRecord` is appended to (a hook keeps one across data changes).
        reuse_tolerance: reuse the training preconditioner while the hyperparameters stay within this relative
            change of those it was built for (module docstring); ``None``: rebuild on every change.
        refresh_growth: rebuild once an evaluation's CG iterations exceed this multiple of those of the
            preconditioner's first evaluation (:meth:`observe`).
        grow_landmarks: double AFN's landmarks (``options["k"]`` of ``afn``, ``afn_k`` of ``auto``; a default the
            caller did not set) after an evaluation with the kernel recomputed on the fly that needed at least this
            many CG iterations, on trial (module docstring); ``None``: never.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.gp.preconditioners import PreconditionerCache
        >>> from gpnys.precond.cache import PointCache
        >>> X = torch.rand(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> cache = PreconditionerCache("afn", {"k": 50, "w": 10})
        >>> P, s2 = cache.get(PointCache(X), kernel, torch.tensor(0.01, dtype=torch.float64))
        >>> Q, _ = cache.get(PointCache(X), kernel, torch.tensor(0.01, dtype=torch.float64))
        >>> Q is P, len(cache.history), P.kind  # same hyperparameters: the same preconditioner
        (True, 1, 'afn')
    """

    def __init__(self, method: str | type[Preconditioner], options: dict[str, Any], seed: int = 0,
                 group: Any = None, history: list[StepRecord] | None = None, reuse_tolerance: float | None = None,
                 refresh_growth: float = 1.5, grow_landmarks: int | None = None) -> None:
        self.method, self.options, self.seed, self.group = method, dict(options), seed, group
        self.grow_landmarks = grow_landmarks
        #: the landmark counts ``k`` took after the first, in order (:meth:`observe`; an undone growth adds the
        #: count it went back to)
        self.growths: list[int] = []
        #: a growth that did not lower the CG iterations was undone, and ``k`` stays as it is
        self.growth_stopped = False
        self._trial: tuple[int, int] | None = None  # (k before, iterations that asked) of a growth on trial
        self._start_k = self.options.get("k")
        self._grown: dict[str, int] = {}  # the training slot's grown landmarks ({"k": ...} or {"afn_k": ...})
        self.history: list[StepRecord] = [] if history is None else history
        self.reuse_tolerance, self.refresh_growth = reuse_tolerance, float(refresh_growth)
        #: the training preconditioner was built for other hyperparameters than the last request's
        self.stale = False
        #: requests served by a stale preconditioner
        self.reuses = 0
        self._first_iterations: int | None = None  # CG iterations of the fresh preconditioner's first evaluation
        self._refresh = False
        self._rebuild = False  # the training slot is rebuilt at the next request, whatever its key
        #: (key, (P, s²)) of the training options, and of other option sets by their sorted items
        self._slots: dict[tuple | None, tuple[tuple, tuple[Preconditioner, torch.Tensor]]] = {}

    @property
    def training_options(self) -> dict[str, Any]:
        """The training slot's options: ``options`` with the landmarks grown so far (an override of :meth:`get`
        starts from ``options`` alone)."""
        return {**self.options, **self._grown}

    @property
    def current(self) -> tuple[Preconditioner, torch.Tensor] | None:
        """``(P, s²)`` last built with the training options, or ``None``."""
        slot = self._slots.get(None)
        return None if slot is None else slot[1]

    def get(self, points: PointCache, kernel: gpytorch.kernels.Kernel, noise: torch.Tensor,
            options: dict[str, Any] | None = None) -> tuple[Preconditioner, torch.Tensor]:
        """``(P, s²)`` for the points, ``kernel`` (its outputscale ``s²``, 0-dim) and the noise variances ``noise``
        (0-dim, or ``(n,)`` per point: ``P`` then takes ``diag = noise / s²`` where it can, else their mean);
        rebuilt only when a hyperparameter changed. ``options`` override the training options, in a slot of their
        own."""
        training = self.training_options
        opts = training if not options else {**self.options, **options}
        slot = None if opts == training else tuple(sorted(opts.items()))
        X = points.X
        with torch.no_grad():
            _, s2f = split_outputscale(kernel)
            level = noise if noise.dim() == 0 else noise.mean()
            mu = float(level.detach()) / s2f
            key = self._key(kernel, mu, s2f, noise, points)
            cached = self._slots.get(slot)
            if slot is None:
                self.stale = cached is not None and key != cached[0] and self._reusable(cached[0], key)
                if self.stale:
                    self.reuses += 1
                    P = cached[1][0]
                    return P, torch.as_tensor(s2f, dtype=X.dtype, device=X.device)
            if cached is None or key != cached[0] or (slot is None and self._rebuild):
                if slot is None:
                    self._first_iterations, self._refresh, self._rebuild = None, False, False
                t0 = time.perf_counter()
                previous = None if cached is None else cached[1][0]
                P, fallback = self._build(points, kernel, mu, opts, self._diag(noise.detach(), s2f), previous)
                s2 = torch.as_tensor(s2f, dtype=X.dtype, device=X.device)
                cached = self._slots[slot] = (key, (P, s2))
                self.history.append(StepRecord(mu, s2f, int(P.rank), P.summary().get("choice", P.kind),
                                               time.perf_counter() - t0, fallback))
        return cached[1]

    def observe(self, iterations: int, recomputed: bool = False) -> None:
        """Record the CG iterations of an evaluation with the training preconditioner: the first one after a build
        sets the reference; one above ``refresh_growth`` times it asks the next request to rebuild. With the kernel
        ``recomputed`` on the fly, ``grow_landmarks`` or more iterations double AFN's ``k``; the first evaluation
        after a growth that needs as many iterations as the one before undoes it and stops growth (module
        docstring)."""
        first = self._first_iterations is None
        if first:
            self._first_iterations = int(iterations)
        elif iterations > self.refresh_growth * max(self._first_iterations, 1):
            self._refresh = True
        trial, self._trial = (self._trial, None) if first else (None, self._trial)
        if trial is not None and iterations >= trial[1]:
            self._set_landmarks(trial[0])
            self.growth_stopped = True
        elif (recomputed and self.grow_landmarks is not None and not self.growth_stopped and not self.stale
              and iterations >= self.grow_landmarks):  # (a stale preconditioner's count rises with its age)
            self._grow(int(iterations))

    @property
    def _landmark_key(self) -> str:
        """The option that holds AFN's landmarks: ``afn_k`` of ``auto`` (whose ``k`` stays the Nyström / AFN switch
        of Algorithm 5, so that more landmarks never turn AFN into a Nyström factor of the estimated rank), ``k``
        of ``afn``."""
        return "afn_k" if self.method == "auto" else "k"

    def _set_landmarks(self, k: int) -> None:
        """AFN's landmarks for the next builds (:attr:`_landmark_key`): the next request builds."""
        self._grown = {self._landmark_key: int(k)}
        self.growths.append(int(k))
        self._rebuild = True  # (the built one stays the previous build: auto's rank hint, held_rank)

    def _grow(self, iterations: int) -> None:
        """Double AFN's landmarks (:attr:`_landmark_key`) within their bounds when the training preconditioner is AFN
        with all of them; the next request builds with them."""
        current = self.current
        k = self.training_options.get(self._landmark_key, self._start_k)
        if current is None or k is None or self._start_k is None:
            return
        P = current[0]
        if P.summary().get("choice", P.kind) != "afn" or int(P.rank) != int(k):
            return
        group = RowGroup.of(self.group) if partitioned(self.group) and isinstance(self.method, str) else None
        # 2 n k entries of 8 bytes (module docstring); every rank of a group holds the whole gathered V
        fits = default_dense_bytes(P.device) // (2 * 8 * max(P.n, 1))
        grown = min(2 * int(k), MAX_GROWTH * int(self._start_k), P.n // 2, int(fits))
        if group is not None:
            grown = group.minimum("landmark growth", grown)
        if grown > k:
            self._set_landmarks(grown)
            self._trial = (int(k), iterations)

    def _reusable(self, built: tuple, key: tuple) -> bool:
        """Whether a preconditioner built for the hyperparameter key ``built`` may serve ``key``."""
        tol = self.reuse_tolerance
        if tol is None or self._refresh or self._rebuild or built[3:] != key[3:] or len(built[0]) != len(key[0]):
            return False
        pairs = list(zip(built[0], key[0])) + [(built[1], key[1])]
        return all(abs(new - old) <= tol * abs(old) for old, new in pairs)

    @staticmethod
    def _key(kernel: gpytorch.kernels.Kernel, mu: float, s2: float, noise: torch.Tensor, points: PointCache) -> tuple:
        """``(length-scales, mu, s², known noise, kernel family, points)``: a preconditioner serves only the same
        kernel family (type, ``nu`` and the values of its other hyperparameters) on the same points (new data, or
        columns another ``active_dims`` selects)."""
        base, _ = split_outputscale(kernel)
        ls = getattr(base, "lengthscale", None)
        ls_key = tuple(ls.detach().reshape(-1).tolist()) if ls is not None else ()
        per_point = TensorKey(noise) if noise.dim() == 1 else ()  # known noise replaced, or edited in place
        # every other hyperparameter of the kernel (a period, an RQ alpha, a sub-kernel's length-scale) by value
        others = [p.detach().reshape(-1) for name, p in base.named_parameters() if name != "raw_lengthscale"]
        family = (type(base), getattr(base, "nu", None), tuple(torch.cat(others).tolist()) if others else ())
        return (ls_key, mu, s2, per_point, family, TensorKey(points.X))

    def _diag(self, noise: torch.Tensor, s2: float) -> torch.Tensor | None:
        """Per-point shifts ``D / s^2`` ``(n,)`` for a preconditioner that takes them (``diag=``), else ``None``:
        Nyström, pivoted Cholesky and the RAN / sketch variants are built for the mean noise. Either way ``P`` only
        preconditions: CG and SLQ run on the true ``K + D``, so the answer stays exact."""
        method = self.method
        takes = (method in HOOK_DIAG_PRECONDITIONERS if isinstance(method, str)
                 else issubclass(method, (AFNPreconditioner, FSAIPreconditioner, AutoPreconditioner)))
        return noise / s2 if noise.dim() == 1 and takes else None

    def _build(self, points: PointCache, kernel: gpytorch.kernels.Kernel, mu: float, options: dict[str, Any],
               diag: torch.Tensor | None = None,
               previous: Preconditioner | None = None) -> tuple[Preconditioner, bool]:
        X = points.X.detach()
        extra = {} if diag is None else {"diag": diag}
        if (previous is not None and self.method in ("auto", "nystrom") and options.get("rank") is None
                and previous.kind == self.method):
            extra["previous_rank"] = int(previous.rank)  # a rank held along the optimiser's path (held_rank)
        if self.group is not None and isinstance(self.method, str):
            extra["group"] = self.group  # FSAI / AFN / Nyström rows built per rank (docs/scaling.md)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default", NumericalWarning)
                if isinstance(self.method, str):
                    P = make_preconditioner(self.method, X, kernel, mu, cache=points, seed=self.seed, **options,
                                            **extra)
                else:
                    P = self.method(X, kernel, mu, **options, **extra)
            if not torch.isfinite(P.logdet()):
                raise RuntimeError("non-finite log det")
            return P, False
        except CollectiveError:  # a dead rank: no fallback on one rank can recover the others
            raise
        except (RuntimeError, torch.linalg.LinAlgError) as exc:
            warnings.warn(
                f"gpnys: building the {self.method!r} preconditioner failed ({exc}); falling back to GPyTorch's "
                "pivoted Cholesky (rank 100)",
                NumericalWarning,
                stacklevel=4,
            )
            return PivotedCholeskyPreconditioner(X, kernel, mu, rank=min(100, X.shape[0])), True
