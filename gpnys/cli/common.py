"""Flags and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpnys import datasets
from gpnys.distributed import rank_and_size
from gpnys.gp.settings import SOLVERS, EstimatorSettings
from gpnys.kernels import KERNEL_NAMES
from gpnys.kernels.backends import select_backend

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def comma_choices(allowed: tuple[str, ...] | list[str], what: str) -> Callable[[str], list[str]]:
    """argparse type: a non-empty comma-separated list whose items must be in ``allowed``."""

    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"expected a comma list of {what}s from {sorted(allowed)}, got nothing")
        bad = [v for v in names if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad}; choose from {sorted(allowed)}")
        return names

    return parse


def add_data_args(p: argparse.ArgumentParser, default_n: int | None = None) -> None:
    """``--data --split --n --no-standardize``; without ``--n`` :func:`load_data` keeps ``min(default_n, rows)``
    training rows (all of them when ``default_n`` is None)."""
    p.add_argument("--data", default="elevators", help="bundled name, synthetic3d, or a .csv/.csv.gz path")
    p.add_argument("--split", type=int, default=0, help="train/test split 0-9 (default 0)")
    default = ("all training rows" if default_n is None
               else f"min({default_n}, the training rows); synthetic3d: {default_n}")
    p.add_argument("--n", "--num-points", dest="n", type=int, default=None,
                   help=f"seeded subsample of n >= 2 training rows (default: {default}; --num-points under torchrun, "
                   "whose own parser takes --n for an abbreviation of its --nnodes)")
    p.add_argument("--no-standardize", action="store_true", help="keep raw inputs and targets")
    p.set_defaults(_default_n=default_n)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel", choices=sorted(KERNEL_NAMES), default="matern32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu); on CUDA the kernel products run as fused "
                        "Triton kernels")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    add_budget_args(p)


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """``--block-mib`` / ``--dense-gib``: the memory budget (``gpnys.cli.main.budget_from_args`` reads them)."""
    p.add_argument("--block-mib", type=int, default=None,
                   help="memory budget: MiB per temporary block (default 32 on CPU, 1/16 of the free GPU memory "
                        "up to 1024 on CUDA; gpnys.memory_budget)")
    p.add_argument("--dense-gib", type=float, default=None,
                   help="memory budget: cache the dense kernel up to this many GiB, else on the fly (default 4 on "
                        "CPU, half the free GPU memory on CUDA)")


def parse_device(text: str | None) -> torch.device | None:
    """``--device``: a torch device that exists here (``ValueError`` naming the flag otherwise)."""
    if text is None:
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: not a torch device: {text!r} (e.g. cpu, cuda, cuda:0)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise ValueError(f"--device {text}: only cpu and cuda devices are supported")
    return device


def add_estimator_args(p: argparse.ArgumentParser) -> None:
    """Flags of the gpnys MLL estimator (preconditioner size, CG tolerance, probes)."""
    p.add_argument("--k", type=int, default=None,
                   help="afn: landmarks; auto: landmarks and Nyström-AFN switch (default 500 for both, see "
                        "gpnys.gp.settings.GP_DEFAULTS); nystrom: its rank estimate's switch; pivchol, ran, sketch: "
                        "the rank; fsai, none: exits 2")
    p.add_argument("--w", type=int, default=None,
                   help="FSAI nonzeros per row (afn, auto, fsai; default 30 for afn/auto); other preconditioners: "
                        "exits 2")
    p.add_argument("--cg-tol", type=float, default=EstimatorSettings.cg_tolerance, help="CG tolerance")
    p.add_argument("--probes", type=int, default=EstimatorSettings.num_probes, help="SLQ probe vectors")
    p.add_argument("--lanczos-steps", type=int, default=EstimatorSettings.lanczos_steps,
                   help="Lanczos quadrature steps (also GPyTorch's minimum CG iterations)")
    p.add_argument("--lanczos-share", type=float, default=EstimatorSettings.lanczos_share, metavar="SHARE",
                   help="stop the quadrature before --lanczos-steps once its truncation estimate is below SHARE of "
                        "the probes' standard error and the solve with y has converged (0: always --lanczos-steps)")
    p.add_argument("--probe-dist", choices=("rademacher", "gaussian"), default=EstimatorSettings.probes,
                   help="probe distribution (covariance P either way)")
    p.add_argument("--control-variate", choices=("auto", "diag", "frozen", "full", "none"),
                   default=EstimatorSettings.control_variate,
                   help="log-det gradient control variate for AFN ('none' also disables it for Nyström)")
    p.add_argument("--kernel-backend", choices=("auto", "torch", "triton", "keops"), default="auto",
                   help="on-the-fly kernel products: auto = fused Triton kernels on CUDA, torch tiles on CPU; keops "
                        "only on request")
    p.add_argument("--tf32", action="store_true",
                   help="let float32 Triton tile products use TF32 tensor cores (about 1e-3 relative error)")
    p.add_argument("--accuracy", type=float, default=None, metavar="REL",
                   help="add probes in batches until the standard errors of the loss and of the gradient (norm) are "
                        "below REL relative (e.g. 1e-3); default: one batch of --probes")
    p.add_argument("--max-probes", type=int, default=EstimatorSettings.max_probes,
                   help="cap on probes per evaluation with --accuracy")
    p.add_argument("--no-error-bars", action="store_true",
                   help="GPyTorch's CG/SLQ estimator with the gpnys preconditioner, without standard errors")
    p.add_argument("--solver", choices=SOLVERS, default=None,
                   help="auto: Cholesky where a cost model calibrated on this device predicts it faster (with "
                        "--precond auto), else the preconditioned path; cholesky / iterative force one "
                        "(default: $GPNYS_SOLVER, else auto)")
    p.add_argument("--reuse-tolerance", type=float, default=None, metavar="REL",
                   help="reuse the preconditioner across steps while the length-scales and noise/outputscale move "
                        "less than REL (relative) from those it was built for (e.g. 0.1); default: rebuild")
    p.add_argument("--grow-landmarks", type=int, default=EstimatorSettings.grow_landmarks, metavar="ITERS",
                   help="with the kernel recomputed on the fly, double AFN's default landmarks after an evaluation "
                        "of at least ITERS CG iterations (up to 4x; 0: never)")
    p.add_argument("--prune-tol", type=float, default=None,
                   help="skip kernel blocks whose entries are all below this (times the outputscale) when the kernel "
                        "is recomputed on the fly (default: machine epsilon; 0: compute every entry)")
    p.set_defaults(_estimator_defaults={dest: p.get_default(dest) for dest in ESTIMATOR_FLAGS})


#: the destinations of :func:`add_estimator_args`' flags that only the preconditioned path reads (``--k``, ``--w``
#: and ``--solver`` are checked where they are read: :func:`precond_options` and each subcommand)
ESTIMATOR_FLAGS = ("cg_tol", "probes", "lanczos_steps", "lanczos_share", "probe_dist", "control_variate",
                   "kernel_backend", "tf32", "accuracy", "max_probes", "no_error_bars", "reuse_tolerance",
                   "grow_landmarks", "prune_tol")


#: the estimator flags that only the training loss's estimate reads (the predictions never do)
TRAINING_FLAGS = ("probes", "lanczos_steps", "lanczos_share", "probe_dist", "control_variate", "accuracy",
                  "max_probes", "no_error_bars", "reuse_tolerance", "grow_landmarks")


def check_estimator_unused(args: argparse.Namespace, what: str, dests: Sequence[str] = ESTIMATOR_FLAGS) -> None:
    """A ``ValueError`` naming the first estimator flag of ``dests`` (default: all, :data:`ESTIMATOR_FLAGS`) set away
    from its default, for a run that evaluates no preconditioned path (``what``: the flag that chose that;
    :data:`TRAINING_FLAGS` for one that still predicts through it)."""
    for dest, default in args._estimator_defaults.items():
        value = getattr(args, dest)
        if dest in dests and value != default:
            shown = "" if isinstance(value, bool) else f" {value}"
            raise ValueError(f"{_flag(dest)}{shown} has no effect with {what}: it sets the preconditioned "
                             "(CG + SLQ) estimate of the loss, which this run does not use")


def estimator_from_args(args: argparse.Namespace) -> EstimatorSettings:
    """The estimator's settings from the flags of :func:`add_estimator_args` (their ranges are
    :data:`SHARED_FLAGS`', checked by :func:`check_flags`; :func:`precond_options` maps --k / --w to each
    preconditioner's options). A ``ValueError`` for flags that cannot take effect together, or a ``--kernel-backend``
    that cannot run on ``--device``."""
    if args.accuracy is not None and args.no_error_bars:
        raise ValueError("--accuracy needs the error bars; drop --no-error-bars")
    if args.reuse_tolerance is not None and args.no_error_bars:
        raise ValueError("--reuse-tolerance needs the error bars (GPyTorch's estimator rebuilds the preconditioner "
                         "at every step); drop --no-error-bars")
    if args.kernel_backend != "auto":
        try:
            select_backend(torch.device("cpu" if args.device is None else args.device), args.kernel_backend)
        except ValueError as err:
            raise ValueError(f"--kernel-backend {args.kernel_backend}: {err}") from None
    if args.tf32:
        device = torch.device("cpu" if args.device is None else args.device)
        backend = select_backend(device, None if args.kernel_backend == "auto" else args.kernel_backend)
        if args.dtype != "float32" or backend != "triton":
            raise ValueError(f"--tf32 has no effect here: it applies to float32 Triton tile products (--dtype "
                             f"float32 on CUDA), not --dtype {args.dtype} with the {backend} kernel backend on "
                             f"{device.type}")
    cv = args.control_variate
    settings = EstimatorSettings(error_bars=not args.no_error_bars, target_rel_error=args.accuracy,
                                 max_probes=args.max_probes, cg_tolerance=args.cg_tol, num_probes=args.probes,
                                 lanczos_steps=args.lanczos_steps, lanczos_share=args.lanczos_share or None,
                                 probes=args.probe_dist,
                                 variance_reduction=cv != "none", control_variate="auto" if cv == "none" else cv,
                                 kernel_prune_tol=args.prune_tol,
                                 kernel_backend=None if args.kernel_backend == "auto" else args.kernel_backend,
                                 kernel_tf32=args.tf32, solver=args.solver, reuse_tolerance=args.reuse_tolerance,
                                 grow_landmarks=args.grow_landmarks or None,
                                 kernel_group=True if rank_and_size()[1] > 1 else None)  # under torchrun
    return settings


#: the preconditioner option that the estimator's ``--k`` / ``--w`` set, by preconditioner (one without a flag does
#: not read it): AFN's landmarks (with ``auto`` also its Nyström / AFN switch, with ``nystrom`` the switch of its rank
#: estimate) and FSAI's nonzeros per row; for ``pivchol``, ``ran`` and ``sketch`` ``--k`` is the rank
SIZE_OPTIONS: dict[str, dict[str, str]] = {
    "auto": {"k": "k", "w": "w"}, "afn": {"k": "k", "w": "w"}, "nystrom": {"k": "k"}, "fsai": {"w": "w"},
    "pivchol": {"k": "rank"}, "ran": {"k": "rank"}, "sketch": {"k": "rank"},
}


def precond_options(args: argparse.Namespace, names: Sequence[str], what: str) -> dict[str, dict[str, int]]:
    """The options of each preconditioner in ``names`` from ``--k`` / ``--w`` (:data:`SIZE_OPTIONS`); a
    ``ValueError`` naming a given flag that none of them reads (``what``: the flag that chose them)."""
    given = {key: getattr(args, key) for key in ("k", "w") if getattr(args, key, None) is not None}
    for key, value in given.items():
        if not any(key in SIZE_OPTIONS.get(name, {}) for name in names):
            readers = ", ".join(name for name, keys in SIZE_OPTIONS.items() if key in keys)
            raise ValueError(f"--{key} {value} has no effect with {what}: only {readers} read it")
    return {name: {SIZE_OPTIONS[name][key]: value for key, value in given.items() if key in SIZE_OPTIONS.get(name, {})}
            for name in names}


def _finite(obj: Any) -> Any:
    """``obj`` with tensors and numpy values as Python lists and numbers, and every non-finite float as ``None``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    if hasattr(obj, "tolist"):
        return _finite(obj.tolist())  # tensors, numpy arrays and scalars
    return obj


def emit_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON: NaN and infinities (also inside lists, dicts and tensors) become ``null``;
    anything else that JSON has no type for is written as its ``str``."""
    json.dump(_finite(obj), sys.stdout, indent=2, default=str, allow_nan=False)
    sys.stdout.write("\n")


@dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: an integer (``integer``) or a finite float from ``low`` to ``high`` (either
    excluded with ``low_open`` / ``high_open``). A ``scale`` (a length-scale, outputscale or noise) must also lie
    in ``[sqrt(tiny), min(sqrt(max), log(max))]`` of ``--dtype``, so that its square is a finite, nonzero number
    there and GPyTorch's softplus constraint can hold it (its inverse overflows above ``log(max)``), and a
    ``magnitude`` (a prior mean) within ``±sqrt(max)``, so that its square is finite; scales and ``suspect`` flags
    are the ones a numerical failure's message names."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    scale: bool = False
    magnitude: bool = False
    suspect: bool = False

    def check(self, flag: str, value: Any, dtype: torch.dtype) -> None:
        """A ``ValueError`` naming ``flag`` unless ``value`` is in the range."""
        low, high, low_open, high_open = self.low, self.high, self.low_open, self.high_open
        if self.scale or self.magnitude:
            info = torch.finfo(dtype)
            # a scale is set through GPyTorch's softplus constraint, whose inverse log(exp(x) - 1) overflows to an
            # infinite raw parameter above log(max) (709.8 in float64): --noise 1e150 gave a loss of -inf, exit 0
            tiny, huge = ((math.sqrt(info.tiny), min(math.sqrt(info.max), math.log(info.max))) if self.scale
                          else (-math.sqrt(info.max), math.sqrt(info.max)))
            low, low_open = (tiny, False) if low is None or low < tiny else (low, low_open)
            high, high_open = (huge, False) if high is None or high > huge else (high, high_open)
        if self.integer:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and math.isfinite(value)
        ok = ok and (low is None or value > low or value == low and not low_open)
        ok = ok and (high is None or value < high or value == high and not high_open)
        if not ok:
            kind = "an integer" if self.integer else "a finite number"
            lo, hi = (f"{v}" if self.integer or v is None else f"{v:g}" for v in (low, high))
            if low is not None and high is not None:
                where = f" in {'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
            elif low is not None:
                where = f" {'>' if low_open else '>='} {lo}"
            else:
                where = "" if high is None else f" {'<' if high_open else '<='} {hi}"
            why = (f" for --dtype {str(dtype).removeprefix('torch.')} "
                   f"({'a scale that GPyTorch can hold' if self.scale else 'a value whose square is finite'})"
                   if self.scale or self.magnitude else "")
            raise ValueError(f"{flag} must be {kind}{where}{why}, got {value}")


def count(low: int, high: int | None = None) -> Range:
    """An integer flag in ``[low, high]``."""
    return Range(low, high, integer=True)


POSITIVE = Range(0.0, low_open=True)
NONNEGATIVE = Range(0.0)
SCALE = Range(0.0, low_open=True, scale=True)
#: an optimiser's learning rate: positive and finite, and named when training fails numerically
LEARNING_RATE = Range(0.0, low_open=True, suspect=True)
#: ``--seed`` and the seeds derived from it (``seed + repeat``, ``seed + 1000 split``) fit every generator's range
SEED_MAX = 2**32 - 1

#: the memory budget's flags in bytes fit a 64-bit integer
BUDGET_BYTES_MAX = 2**63 - 1

#: the ranges of the flags that :func:`add_data_args`, :func:`add_common_args` and :func:`add_estimator_args` add,
#: by destination; a subcommand's own ``FLAGS`` add to (and override) them
SHARED_FLAGS: dict[str, Range] = {
    "n": count(2), "split": count(0, datasets.NUM_SPLITS - 1), "seed": count(0, SEED_MAX),
    "block_mib": count(1, BUDGET_BYTES_MAX >> 20), "dense_gib": Range(0.0, BUDGET_BYTES_MAX / 2**30, high_open=True),
    "k": count(1), "w": count(1), "cg_tol": POSITIVE, "probes": count(2), "lanczos_steps": count(1),
    "lanczos_share": Range(0.0, 1.0, high_open=True), "prune_tol": NONNEGATIVE, "reuse_tolerance": NONNEGATIVE,
    "grow_landmarks": count(0),
    "accuracy": Range(0.0, 1.0, low_open=True, high_open=True), "max_probes": count(2),
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flags(args: argparse.Namespace, ranges: Mapping[str, Range]) -> None:
    """The one range check of the command line: a ``ValueError`` naming the first flag of ``ranges`` (by
    destination) whose value is out of its :class:`Range`. Flags the subcommand lacks, or left unset (``None``), are
    skipped; a list (``pcg --lengthscale 1,2``) is checked item by item, all before any work."""
    dtype = DTYPES[getattr(args, "dtype", "float64")]
    for dest, rule in ranges.items():
        value = getattr(args, dest, None)
        for item in value if isinstance(value, list) else [value]:
            if item is not None:
                rule.check(_flag(dest), item, dtype)


def check_at_most(n: int, args: argparse.Namespace, *dests: str) -> None:
    """A ``ValueError`` naming the first flag of ``dests`` whose value exceeds ``n``, the training rows."""
    for dest in dests:
        value = getattr(args, dest, None)
        if value is not None and value > n:
            raise ValueError(f"{_flag(dest)} must be <= {n} (the training rows), got {value}")


def load_data(args: argparse.Namespace, standardize: bool | None = None,
              n_test: int | None = None) -> datasets.Dataset:
    """The data set of ``--data --split --n --seed --dtype --device`` (standardised unless ``--no-standardize`` or
    ``standardize=False``), with ``n_test`` seeded test rows. Without ``--n``: ``min(default_n, rows)`` training
    rows (:func:`add_data_args`); an explicit ``--n`` above the rows, or fewer than 2 rows, is an error."""
    kw = {"split": args.split, "seed": args.seed, "dtype": DTYPES[args.dtype], "device": args.device,
          "standardize": not args.no_standardize if standardize is None else standardize, "n_test": n_test}
    n, cap = args.n, getattr(args, "_default_n", None)
    if n is None and cap is None and args.data in datasets.SYNTHETIC:
        raise ValueError(f"--n is required for --data {args.data}")
    if n is None and cap is not None and args.data not in datasets.SYNTHETIC:
        try:  # the same seeded subsample as --n cap ...
            ds = datasets.load(args.data, n=cap, **kw)
        except ValueError:  # ... unless the split has fewer rows: all of them (any other error recurs here)
            ds = datasets.load(args.data, **kw)
    else:
        try:
            ds = datasets.load(args.data, n=cap if n is None else n, **kw)
        except (ValueError, OverflowError) as err:  # the data set's message names its argument n: the user typed --n
            if n is None:
                raise
            if isinstance(err, ValueError) and str(err).startswith("n="):
                raise ValueError(f"--n {n} {str(err).removeprefix(f'n={n} ')}") from None
            if args.data in datasets.SYNTHETIC:  # numpy's ("Maximum allowed dimension exceeded"): too large an n
                raise ValueError(f"--n {n} is too large for --data {args.data} ({err})") from None
            raise
    if ds.n < 2:
        raise ValueError(f"--data {args.data}: split {ds.split} has {ds.n} training row(s); at least 2 are needed")
    if n_test is not None and n_test > ds.test_x.shape[0]:
        raise ValueError(f"--n-test must be <= {ds.test_x.shape[0]} (the test rows of {ds.name!r} split {ds.split}), "
                         f"got {n_test}")
    return ds


#: exceptions of a computation that failed on its numbers or its memory (torch's and linear_operator's
#: ``RuntimeError``s such as ``NotPSDError`` and ``NanError``, overflow, an allocation), reported on one line
NUMERICAL_ERRORS = (RuntimeError, ArithmeticError, MemoryError)


def failure_message(exc: BaseException, args: argparse.Namespace, ranges: Mapping[str, Range]) -> str:
    """One line for a computation that raised one of :data:`NUMERICAL_ERRORS`: the exception's type and text, and
    the flags to look at (the memory ones, or the given scales and learning rate of ``ranges``)."""
    text = " ".join(str(exc).split()) or "no message"
    what = f"{type(exc).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"
    if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
        return f"out of memory ({what}); try a smaller --n or memory budget (--block-mib, --dense-gib)"
    suspects = []
    for dest, rule in ranges.items():
        value = getattr(args, dest, None)
        if (rule.scale or rule.suspect) and value is not None:
            shown = ",".join(f"{v:g}" for v in value) if isinstance(value, list) else f"{value:g}"
            suspects.append(f"{_flag(dest)} {shown}")
    return f"numerical failure ({what})" + (f"; check {', '.join(suspects)}" if suspects else "")
