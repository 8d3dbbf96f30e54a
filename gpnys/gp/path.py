"""Which path an MLL evaluation takes: GPyTorch's dense Cholesky or gpnys's preconditioned CG + SLQ.

At small n a Cholesky factorisation is exact and costs less than building a preconditioner and running CG; at
large n it is ``O(n³)`` time and ``O(n²)`` memory and the preconditioned path wins. Where the switch lies depends on
the device, the dtype and the thread count, so it is not a fixed threshold: a small cost model,

* Cholesky value + gradient: ``a n³ + b n²`` seconds,
* preconditioned value + gradient (preconditioner build included, as in a training step): ``c n² + e n`` seconds,

is fitted to timings of both paths on a synthetic problem at two sizes (:func:`calibrate`), once per device, dtype
and thread count, and cached in memory and on disk (``$GPNYS_CACHE_DIR/costs.json``, default
``~/.cache/gpnys``). :func:`choose_path` compares the predictions (the preconditioned one scaled by what the caller
measured of its own evaluations) and keeps Cholesky only where its matrices fit the memory budget
(:func:`gpnys.budget.dense_limit_bytes`). ``EstimatorSettings.solver`` (or ``GPNYS_SOLVER``) forces either path.

The cubic is extrapolated from small sizes, where a GPU is bound by latency rather than throughput: on one GPU in
float64 it predicted 0.93 s for a value + gradient at n = 10 000 that took about a tenth of that. A Cholesky
evaluation's cost hardly depends on the problem, a preconditioned one's does (its CG iterations), so a caller that
has timed its own preconditioned evaluations (a hook, :class:`PathChooser`) asks, wherever the two predictions then
lie within :data:`PROBE_FACTOR` of each other, for Cholesky to be measured once at that size (the calibration's
problem, one value + gradient); the measurement scales the cubic within a factor :data:`MEASURED_SPAN` of it
(:attr:`PathCosts.measured`, cached with the costs). Conversely, where Cholesky is predicted faster by less than
:data:`ITERATIVE_PROBE_FACTOR`, a training caller times the preconditioned path once on its own problem first, and
so does one whose own warm Cholesky evaluations come within :data:`MEASURED_PROBE_FACTOR` of the preconditioned
prediction (the cubic from two small sizes can be several times off: a noisy calibration kept a caller at n = 3 000
on a Cholesky twice as slow as the preconditioned path).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gpnys.budget import dense_limit_bytes
from gpnys.cache import cache_dir, entry_key, read_entry, read_or_make, write_entry
from gpnys.linalg import synchronize

__all__ = ["PathCosts", "calibrate", "install_calibration", "install_measurer", "measure_exact", "path_costs",
           "choose_path", "cholesky_fits", "DENSE_MATRICES", "POSTERIOR_MATRICES", "CHOLESKY_BELOW", "uses_costs",
           "cache_file", "fit_costs", "costs_key", "PathChooser", "measured_scale", "near_switch"]

#: the cost model's file in the cache folder (:mod:`gpnys.cache`)
COSTS_FILE = "costs.json"
#: the paths' costs as measured by this version of gpnys: raised when either path's cost changes, so that a cache
#: calibrated by an older version is not read (2: AFN's full control variate keeps its graph, 706b21d)
COSTS_VERSION = 2

#: Cholesky's working set for one value + gradient, in ``n x n`` matrices: GPyTorch's peak above what it held
#: was 8.4 of them for RBF and 12.4 for Matérn, isotropic or ARD (docs/scaling.md, "The memory budget")
DENSE_MATRICES = 13
#: ... for one posterior (mean and variance at a few points, BoTorch's exact path): 6.3-6.8 of them
POSTERIOR_MATRICES = 7
#: a path is left for the other only when the other is predicted this much faster (no flip-flopping near the switch)
HYSTERESIS = 1.25
#: below this many points ``auto`` takes Cholesky without consulting the cost model: its value + gradient takes
#: milliseconds there, less than building any preconditioner, and the model's two-size fits say least about it
CHOLESKY_BELOW = 300
#: Cholesky is measured at the size in question where the two predictions lie within this factor of each other (a
#: measurement is cached on disk for its size span, so it is paid once per machine, dtype and span)
PROBE_FACTOR = 10.0
#: a measurement at size m scales the predictions at sizes within this factor of m
MEASURED_SPAN = 2.0
#: a training caller that has not timed its preconditioned path takes it once where Cholesky is predicted faster by
#: less than this factor (the preconditioned path's cost depends on the problem; the calibration's may be far harder)
ITERATIVE_PROBE_FACTOR = 2.0
#: ... and where its own warm Cholesky evaluations took more than 1/this of the preconditioned prediction (the
#: calibration's preconditioned problem is often harder than the caller's: 4.7 s predicted for 1.2 s at n = 3 000;
#: at n = 600 a Cholesky takes a tenth of it, and no probe spends the preconditioned path's seconds there)
MEASURED_PROBE_FACTOR = 3.0
_memo: dict[str, "PathCosts"] = {}
_calibrator: Callable[[torch.device, torch.dtype], "PathCosts"] | None = None
#: times one Cholesky value + gradient at ``n`` (:mod:`gpnys.gp.calibration` installs it; ``None``: never measure)
_measurer: Callable[[int, torch.device, torch.dtype], float] | None = None


@dataclass
class PathCosts:
    """Seconds of one MLL value + gradient on one device, dtype and thread count.

    Attributes:
        exact: ``(a, b)``: Cholesky path ``a n³ + b n²``, scaled near a measured size (``measured``).
        iterative: ``(c, e)``: preconditioned path ``c n² + e n`` (a training step: preconditioner built anew).
        sizes: the calibration sizes ``(n1, n2)`` of each path; key: device, dtype and threads.
        measured: ``{m: seconds}`` of Cholesky measured at sizes ``m``; each scales ``exact_s`` within a factor
            :data:`MEASURED_SPAN` of ``m`` (the nearest one).

    Example:
        >>> from gpnys.gp.path import PathCosts
        >>> costs = PathCosts(exact=(1e-9, 0.0), iterative=(1e-6, 0.0), sizes=((1, 2), (1, 2)), key="x")
        >>> round(costs.exact_s(1000), 9), round(costs.iterative_s(1000), 9)  # the switch lies at n = 1000
        (1.0, 1.0)
        >>> costs.exact_s(500) < costs.iterative_s(500)  # below it Cholesky is cheaper
        True
        >>> costs.measured[2000] = 2.0  # measured at n = 2 000: a quarter of the cubic's 8 s
        >>> round(costs.exact_s(3000), 6), round(costs.exact_s(5000), 6)  # scaled within a factor 2 of 2 000 only
        (6.75, 125.0)
        >>> costs.exact_s(3000, measured=False)  # the cubic alone
        27.0
    """

    exact: tuple[float, float]
    iterative: tuple[float, float]
    sizes: tuple[tuple[int, int], tuple[int, int]]
    key: str
    measured: dict[int, float] = field(default_factory=dict)

    def _cubic(self, n: int) -> float:
        a, b = self.exact
        return a * n**3 + b * n**2

    def near_measured(self, n: int) -> int | None:
        """The measured size nearest ``n`` (in ratio) within :data:`MEASURED_SPAN`, or ``None``."""
        near = min(self.measured, key=lambda m: abs(math.log(m / max(n, 1))), default=None)
        return near if near is not None and max(near / n, n / near) <= MEASURED_SPAN else None

    def exact_s(self, n: int, measured: bool = True) -> float:
        """Cholesky's seconds at ``n``: the cubic, scaled by the nearest measurement (``measured``)."""
        m = self.near_measured(n) if measured else None
        scale = 1.0 if m is None else self.measured[m] / max(self._cubic(m), 1e-12)
        return self._cubic(n) * scale

    def iterative_s(self, n: int) -> float:
        c, e = self.iterative
        return c * n**2 + e * n


def cache_file() -> Path:
    """``$GPNYS_CACHE_DIR/costs.json`` (default ``~/.cache/gpnys/costs.json``; :mod:`gpnys.cache`)."""
    return cache_dir() / COSTS_FILE


def costs_key(device: torch.device, dtype: torch.dtype) -> str:
    """The cache key of :class:`PathCosts`: device (and GPU name), dtype and thread count
    (:func:`gpnys.cache.entry_key`), and :data:`COSTS_VERSION`."""
    return f"{entry_key(device, dtype)}:costs={COSTS_VERSION}"


def fit_costs(sizes: tuple[int, int], seconds: tuple[float, float], powers: tuple[int, int]) -> tuple[float, float]:
    """``(p, q)`` with ``seconds = p n^powers[0] + q n^powers[1]`` through the two points, both non-negative: where
    either comes out negative (timing noise, or times that grow more slowly than the leading power between these
    sizes, as a GPU's latency-bound small problems do), the leading term alone is fitted through the larger size.
    Below the sizes that then under-predicts; :data:`CHOLESKY_BELOW` keeps tiny problems off the model."""
    (n1, n2), (t1, t2), (u, v) = sizes, seconds, powers
    det = n1**u * n2**v - n2**u * n1**v
    p = (t1 * n2**v - t2 * n1**v) / det
    q = (n1**u * t2 - n2**u * t1) / det
    if p <= 0 or q < 0:
        return t2 / n2**u, 0.0
    return p, q


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> PathCosts:
    """Time both paths on a synthetic problem at two sizes each and fit :class:`PathCosts` (not cached; see
    :func:`path_costs`). The timing drives the hook, a layer above this module, so it lives in
    :mod:`gpnys.gp.calibration`, which installs itself here when :mod:`gpnys.gp` is imported."""
    if _calibrator is None:
        raise RuntimeError("gpnys.gp.path: no calibration installed (import gpnys.gp.calibration)")
    return _calibrator(torch.device(device), dtype)


def install_calibration(fn: Callable[[torch.device, torch.dtype], PathCosts]) -> None:
    """Make ``fn`` the calibration :func:`calibrate` runs (:mod:`gpnys.gp.calibration` installs its own)."""
    global _calibrator
    _calibrator = fn


def path_costs(device: torch.device | str, dtype: torch.dtype) -> PathCosts:
    """:class:`PathCosts` for ``device`` and ``dtype`` at the current thread count: from memory, else from
    :func:`cache_file`, else :func:`calibrate` (then written there; an unwritable cache only warns).

    Example:
        >>> import torch
        >>> from gpnys.gp.path import path_costs
        >>> costs = path_costs("cpu", torch.float64)  # calibrated on first use on this machine, then cached
        >>> costs.exact_s(100) < costs.exact_s(1000), costs.iterative_s(100) < costs.iterative_s(1000)
        (True, True)
    """
    device = torch.device(device)
    key = costs_key(device, dtype)
    if key in _memo:
        return _memo[key]

    def parse(entry: Any) -> PathCosts:
        return PathCosts(exact=_coefficients(entry["exact"]), iterative=_coefficients(entry["iterative"]),
                         sizes=tuple(tuple(int(n) for n in s) for s in entry["sizes"]), key=key,
                         measured=_measurements(entry.get("measured")))

    def make() -> PathCosts:
        if read_entry(COSTS_FILE, key) is not None:
            warnings.warn(f"gpnys: the path costs stored in {cache_file()} under {key!r} are damaged; "
                          "calibrating again", RuntimeWarning, stacklevel=4)
        return calibrate(device, dtype)

    costs = read_or_make(COSTS_FILE, key, parse, make, "the path costs", stored=asdict,
                         merge=_with_stored_measurements)
    _memo[key] = costs
    return costs


def _coefficients(raw: object) -> tuple[float, float]:
    """A cost model's two stored coefficients, as :func:`fit_costs` makes them: finite, non-negative, not both 0
    (``ValueError`` otherwise: a damaged entry is calibrated again, not trusted)."""
    if (not isinstance(raw, (list, tuple)) or len(raw) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in raw)):
        raise ValueError(f"cost coefficients must be two numbers, got {raw!r}")  # not a string's or bools' digits
    a, b = (float(v) for v in raw)
    if not (math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0 and a + b > 0):
        raise ValueError(f"cost coefficients must be finite, non-negative and not both 0, got {raw!r}")
    return a, b


def _measurements(raw: object) -> dict[int, float]:
    """The cache file's Cholesky measurements ``{size: seconds}``: positive sizes and finite positive seconds only
    (anything else in a hand-edited or damaged file is dropped, not trusted)."""
    out: dict[int, float] = {}
    for m, t in (raw.items() if isinstance(raw, dict) else ()):
        try:
            m, t = int(m), float(t)
        except (TypeError, ValueError):
            continue
        if m > 0 and math.isfinite(t) and t > 0:
            out[m] = t
    return out


def install_measurer(fn: Callable[[int, torch.device, torch.dtype], float] | None) -> None:
    """Make ``fn(n, device, dtype)`` (seconds of one Cholesky value + gradient at ``n``) the measurement
    :func:`choose_path` takes near the switch; ``None`` never measures (:mod:`gpnys.gp.calibration` installs its
    own)."""
    global _measurer
    _measurer = fn


def measure_exact(costs: PathCosts, n: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Measure Cholesky at ``n`` into ``costs.measured`` (and the cache file), unless a measurement within
    :data:`MEASURED_SPAN` exists or no measurer is installed; returns whether it measured."""
    if _measurer is None or costs.near_measured(n) is not None:
        return False
    costs.measured[n] = float(_measurer(n, device, dtype))
    write_entry(COSTS_FILE, costs.key, asdict(costs), "the path costs", merge=_with_stored_measurements)
    return True


def _with_stored_measurements(stored: Any, new: dict) -> dict:
    """``new`` (a :class:`PathCosts` as a dict) with the measurements of the ``stored`` entry it lacks: another
    process may have measured at other sizes since this one read the file."""
    if not isinstance(stored, dict):
        return new
    return {**new, "measured": {**_measurements(stored.get("measured")), **_measurements(new.get("measured"))}}


def measured_scale(seconds: float, n: int, batch: int, device: torch.device, dtype: torch.dtype) -> float:
    """A caller's measured ``seconds`` of one preconditioned evaluation over :class:`PathCosts`' prediction: its
    ``iterative_scale`` (:func:`choose_path`)."""
    return seconds / max(batch * path_costs(device, dtype).iterative_s(n), 1e-12)


def near_switch(n: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether Cholesky's prediction at ``n`` is at most :data:`PROBE_FACTOR` times the preconditioned path's, where
    a measurement could change the choice."""
    costs = path_costs(device, dtype)
    return costs.exact_s(n, measured=False) <= PROBE_FACTOR * costs.iterative_s(n)


def uses_costs(solver: str, method: object) -> bool:
    """Whether :func:`choose_path` decides by :class:`PathCosts` (``solver="auto"`` with the ``"auto"``
    preconditioner), so that a caller's timings of its preconditioned evaluations inform it."""
    return solver == "auto" and method == "auto"


def cholesky_fits(n: int, batch: int, device: torch.device, dtype: torch.dtype,
                  matrices: int = DENSE_MATRICES) -> tuple[bool, str]:
    """Whether Cholesky's working set, ``matrices`` ``n x n`` matrices per marginal of ``batch``
    (:data:`DENSE_MATRICES` for a value + gradient, :data:`POSTERIOR_MATRICES` for a posterior), fits
    :func:`~gpnys.budget.dense_limit_bytes` on ``device``; returns ``(fits, reason)``.

    Example:
        >>> import torch, gpnys
        >>> from gpnys.gp.path import cholesky_fits
        >>> cpu = torch.device("cpu")
        >>> with gpnys.memory_budget(dense_bytes=2**30):  # 1 GiB; 13 float64 matrices of 3 000^2 take 0.87 GiB
        ...     [cholesky_fits(n, 1, cpu, torch.float64)[0] for n in (3000, 4000)]
        [True, False]
    """
    need = matrices * batch * n * n * torch.empty((), dtype=dtype).element_size()
    limit = dense_limit_bytes(device)
    if need > limit:
        return False, f"Cholesky needs {need / 2**30:.3g} GiB, above the memory budget ({limit / 2**30:.3g} GiB)"
    return True, f"Cholesky needs {need / 2**30:.3g} GiB, within the memory budget ({limit / 2**30:.3g} GiB)"


def choose_path(n: int, batch: int, device: torch.device, dtype: torch.dtype, solver: str, method: object,
                current: str | None = None, iterative_scale: float = 1.0, partitioned: bool = False,
                measure: bool = False) -> tuple[str, str]:
    """``("cholesky" | "iterative", reason)`` for an evaluation of ``batch`` marginals of ``n`` points.

    ``solver`` ``"cholesky"`` / ``"iterative"`` force a path; ``"auto"`` decides by :class:`PathCosts` for
    ``method="auto"`` (a named preconditioner asks for the preconditioned path) where Cholesky's
    :data:`DENSE_MATRICES` ``n x n`` matrices fit :func:`~gpnys.budget.dense_limit_bytes`. ``current``: the path of
    the previous evaluation, left only for one predicted :data:`HYSTERESIS` times faster; ``iterative_scale``: the
    caller's measured over predicted time of its own preconditioned evaluations. ``measure`` (a caller whose
    ``iterative_scale`` is measured): Cholesky's prediction takes a measurement near ``n``, and where the two
    predictions lie within :data:`PROBE_FACTOR` of each other and none exists, Cholesky is measured at ``n`` first
    (:func:`measure_exact`; once per size span, device, dtype and thread count). Without ``measure`` the cubic alone
    decides, as a measured Cholesky set against an unmeasured (often pessimistic) preconditioned prediction would
    lean to Cholesky. ``partitioned``: a process group splits the kernel by rows; ``"auto"`` then
    takes the preconditioned path on every rank, since ranks deciding by their own cost caches and timings could
    take different paths and wait for each other's collectives.

    Example:
        >>> import torch
        >>> from gpnys.gp.path import choose_path
        >>> cpu, f64 = torch.device("cpu"), torch.float64
        >>> choose_path(500, 1, cpu, f64, "cholesky", "auto")
        ('cholesky', "settings.solver='cholesky'")
        >>> choose_path(500, 1, cpu, f64, "auto", "afn")[0]  # a named preconditioner
        'iterative'
    """
    if solver in ("cholesky", "iterative"):
        return solver, f"settings.solver={solver!r}"
    if not uses_costs(solver, method):
        return "iterative", f"method {method!r} names a preconditioner"
    if partitioned:
        return "iterative", "a process group splits the kernel by rows: the preconditioned path on every rank"
    fits, why = cholesky_fits(n, batch, device, dtype)
    if not fits:
        return "iterative", why
    if n < CHOLESKY_BELOW:
        return "cholesky", f"{n} points, below {CHOLESKY_BELOW}: Cholesky costs less than any preconditioner"
    costs = path_costs(device, dtype)

    def predicted() -> tuple[float, float]:  # a measurement near n only for a caller that timed its own path
        return batch * costs.exact_s(n, measured=measure), batch * costs.iterative_s(n) * iterative_scale

    exact, iterative = predicted()
    if (measure and max(exact, iterative) <= PROBE_FACTOR * min(exact, iterative)
            and measure_exact(costs, n, device, dtype)):
        exact, iterative = predicted()  # the cubic extrapolated; measured near the switch (module docstring)
    path = "cholesky" if exact <= iterative else "iterative"
    if current is not None and path != current:
        faster, slower = sorted((exact, iterative))
        if faster * HYSTERESIS > slower:
            path = current
    measured = costs.near_measured(n) if measure else None
    at = "" if measured is None else f", Cholesky measured at n = {measured}"
    return path, f"predicted {exact:.3g} s Cholesky, {iterative:.3g} s preconditioned ({costs.key}{at})"


#: ``(n, batch, device, dtype)`` of an evaluation, as :func:`choose_path` sees it
Problem = tuple[int, int, torch.device, torch.dtype]


class PathChooser:
    """The path of one caller's evaluations (a hook's): :func:`choose_path` with the previous choice as
    ``current``, and the caller's own measured over predicted seconds of its preconditioned evaluations as
    ``iterative_scale`` (from its second timing, then a running average, :meth:`timed`); once that is measured,
    :func:`choose_path` may measure Cholesky near the switch (``measure``, in training). Until then, up to two
    training evaluations take the preconditioned path where Cholesky is predicted faster by less than
    :data:`ITERATIVE_PROBE_FACTOR` (the calibration's problem may be far harder than the caller's); the first
    timing holds one-off costs (first uses in the process), so the second replaces it.

    Args:
        solver: ``EstimatorSettings.solver``; method: the preconditioner's name or class;
        problem: returns the ``(n, batch, device, dtype)`` of the next evaluation; partitioned: a process group
        splits the kernel (:func:`choose_path`).

    Attributes:
        path: ``"cholesky"`` / ``"iterative"`` of the latest choice (``None`` before); reason: why;
        iterative_scale: measured / predicted seconds of the preconditioned evaluations so far; timings: how many
        were timed; timed_iterative: whether a warm one was (the second on).

    Example:
        >>> import torch
        >>> from gpnys.gp.path import PathChooser
        >>> paths = PathChooser("cholesky", "auto", lambda: (500, 1, torch.device("cpu"), torch.float64))
        >>> paths.choose(), paths.path
        (('cholesky', "settings.solver='cholesky'"), 'cholesky')
    """

    def __init__(self, solver: str, method: object, problem: Callable[[], Problem], partitioned: bool = False) -> None:
        self.solver, self.method, self.problem, self.partitioned = solver, method, problem, partitioned
        self.path: str | None = None
        self.reason = ""
        self.iterative_scale = 1.0
        self.timings = 0  # preconditioned evaluations timed; the first holds one-off costs (imports, first uses)
        self.probes = 0  # evaluations that took the preconditioned path to be timed
        self.exact_timings = 0  # Cholesky evaluations timed, and the latest warm one's seconds and size
        self.exact_seconds: tuple[float, Problem] | None = None

    @property
    def timed_iterative(self) -> bool:
        """Whether :attr:`iterative_scale` holds a warm measurement (from the second timed evaluation on)."""
        return self.timings >= 2

    def choose(self, training: bool = False) -> tuple[str, str]:
        """``(path, reason)`` of the next evaluation, kept in :attr:`path` and :attr:`reason`. ``training``: an
        evaluation that may time the preconditioned path or measure Cholesky (class docstring); a prediction does
        neither."""
        measure = training and self.timed_iterative
        path, reason = choose_path(*self.problem(), self.solver, self.method, current=self.path,
                                   iterative_scale=self.iterative_scale, partitioned=self.partitioned,
                                   measure=measure)
        if (training and path == "cholesky" and not measure and self.probes < 2 and self._decides()
                and reason.startswith("predicted")):
            problem = self.problem()
            n, batch, device, dtype = problem
            costs = path_costs(device, dtype)
            seen = self.exact_seconds[0] if self.exact_seconds and self.exact_seconds[1] == problem else None
            predicted = batch * costs.iterative_s(n) * self.iterative_scale
            if seen is not None and predicted <= MEASURED_PROBE_FACTOR * seen:
                self.probes += 1
                path, reason = "iterative", ("timing the preconditioned path on this problem: Cholesky took "
                                             f"{seen:.3g} s here, within {MEASURED_PROBE_FACTOR:g}x of the "
                                             f"preconditioned prediction; {reason}")
            elif costs.iterative_s(n) <= ITERATIVE_PROBE_FACTOR * costs.exact_s(n, measured=False):
                self.probes += 1
                path, reason = "iterative", f"timing the preconditioned path on this problem: {reason}"
        self.path, self.reason = path, reason
        return path, reason

    def _decides(self) -> bool:
        """Whether the cost model and this caller's timings decide (``auto`` on one process)."""
        return uses_costs(self.solver, self.method) and not self.partitioned

    @contextlib.contextmanager
    def timed_exact(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """:meth:`timed` for a Cholesky evaluation: its seconds, from the second one on (warm), are kept in
        :attr:`exact_seconds` with the problem's size, which :meth:`choose` weighs against the preconditioned
        prediction."""
        problem = self.problem()
        yield _stamp(self._record_exact, problem) if self._decides() else (lambda out: out)

    @contextlib.contextmanager
    def timed(self) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        """Time a preconditioned evaluation, value and gradient as the cost model predicts them: the block yields
        ``stamp``, which the caller applies to the evaluation's output; the time runs from the block's start to the
        end of the backward pass through that output. Its ratio to the prediction, averaged into
        :attr:`iterative_scale`, scales the model's later predictions for this caller. An evaluation without a
        backward (under ``no_grad``) is not comparable and not counted."""
        problem = self.problem()
        # nothing to weigh where Cholesky cannot be chosen: no calibration for an unread scale
        yield (_stamp(self._record, problem) if self._decides() and cholesky_fits(*problem)[0]
               else (lambda out: out))

    def _record(self, seconds: float, problem: Problem) -> None:
        ratio = measured_scale(seconds, *problem)
        # the first timing holds one-off costs: the second replaces it, later ones average in
        self.iterative_scale = 0.5 * (self.iterative_scale + ratio) if self.timings >= 2 else ratio
        self.timings += 1

    def _record_exact(self, seconds: float, problem: Problem) -> None:
        self.exact_timings += 1
        if self.exact_timings >= 2:  # the first holds one-off costs
            self.exact_seconds = (seconds, problem)


def _stamp(record: Callable[[float, Problem], None], problem: Problem) -> Callable[[torch.Tensor], torch.Tensor]:
    """The stamp of :meth:`PathChooser.timed`: applied to an evaluation's output, it calls ``record(seconds,
    problem)`` with the seconds from now to the end of the backward pass through it (none without a backward)."""
    t0 = time.perf_counter()

    def stamp(out: torch.Tensor) -> torch.Tensor:
        forward = time.perf_counter() - t0
        if not (torch.is_grad_enabled() and out.requires_grad):
            return out
        return _BackwardEnd.apply(out, lambda backward: record(forward + backward, problem))

    return stamp


class _BackwardEnd(torch.autograd.Function):
    """The identity, whose backward calls ``done(seconds)`` once the whole backward pass has finished (autograd's
    end-of-pass callback): the seconds from when the gradient reached this output."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, done: Callable[[float], None]) -> torch.Tensor:
        ctx.done, ctx.device = done, out.device
        return out.clone()  # (a 0-dim or (b,) log-likelihood; GPyTorch edits it in place)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start, done, device = time.perf_counter(), ctx.done, ctx.device

        def finished() -> None:
            synchronize(device)
            done(time.perf_counter() - start)

        torch.autograd.Variable._execution_engine.queue_callback(finished)
        return grad, None
