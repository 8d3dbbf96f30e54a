"""Flags and output helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from gpnys.distributed import rank_and_size
from gpnys.gp.settings import SOLVERS, EstimatorSettings
from gpnys.kernels import KERNEL_NAMES

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def comma_choices(allowed: tuple[str, ...] | list[str], what: str) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated list whose items must be in ``allowed``."""

    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in names if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {bad}; choose from {sorted(allowed)}")
        return names

    return parse


def add_data_args(p: argparse.ArgumentParser, default_n: int | None = None) -> None:
    p.add_argument("--data", default="elevators", help="bundled name, synthetic3d, or a .csv/.csv.gz path")
    p.add_argument("--split", type=int, default=0, help="train/test split 0-9 (default 0)")
    p.add_argument("--n", "--num-points", dest="n", type=int, default=default_n,
                   help="seeded subsample of n training rows (--num-points under torchrun, whose own parser takes "
                   "--n for an abbreviation of its --nnodes)")
    p.add_argument("--no-standardize", action="store_true", help="keep raw inputs and targets")


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


def check_fit_flags(iters: int, lr: float, iters_flag: str = "--iters") -> None:
    """A ``ValueError`` naming the flag for a negative iteration count or a learning rate that is not positive and
    finite (the library's ``fit`` names its own arguments, ``iters`` and ``lr``)."""
    if iters < 0:
        raise ValueError(f"{iters_flag} must be >= 0, got {iters}")
    if not (lr > 0 and lr < float("inf")):
        raise ValueError(f"--lr must be positive and finite, got {lr}")


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


def _plain(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def add_estimator_args(p: argparse.ArgumentParser) -> None:
    """Flags of the gpnys MLL estimator (preconditioner size, CG tolerance, probes)."""
    p.add_argument("--k", type=int, default=None,
                   help="AFN landmarks / Nyström-AFN switch (default 500 for afn/auto, see gpnys.gp.settings.GP_DEFAULTS)")
    p.add_argument("--w", type=int, default=None, help="FSAI nonzeros per row")
    p.add_argument("--cg-tol", type=float, default=EstimatorSettings.cg_tolerance, help="CG tolerance")
    p.add_argument("--probes", type=int, default=EstimatorSettings.num_probes, help="SLQ probe vectors")
    p.add_argument("--lanczos-steps", type=int, default=EstimatorSettings.lanczos_steps,
                   help="Lanczos quadrature steps (also GPyTorch's minimum CG iterations)")
    p.add_argument("--lanczos-share", type=float, default=EstimatorSettings.lanczos_share, metavar="SHARE",
                   help="stop the quadrature before --lanczos-steps once its truncation estimate is below SHARE of "
                        "the probes' standard error and the solve with y has converged (0: always --lanczos-steps)")
    p.add_argument("--probe-dist", choices=("rademacher", "gaussian"), default=EstimatorSettings.probes,
                   help="probe distribution (covariance P either way)")
    p.add_argument("--control-variate", choices=("auto", "diag", "frozen", "full", "none"), default=EstimatorSettings.control_variate,
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
    p.add_argument("--prune-tol", type=float, default=None,
                   help="skip kernel blocks whose entries are all below this (times the outputscale) when the kernel "
                        "is recomputed on the fly (default: machine epsilon; 0: compute every entry)")


def estimator_from_args(args: argparse.Namespace) -> tuple[EstimatorSettings, dict[str, int]]:
    """``(settings, preconditioner options)`` from the flags of :func:`add_estimator_args`."""
    for name in ("cg_tol", "probes", "lanczos_steps"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.lanczos_share < 1:
        raise ValueError(f"--lanczos-share must be in [0, 1), got {args.lanczos_share}")
    if args.prune_tol is not None and not args.prune_tol >= 0:
        raise ValueError(f"--prune-tol must be >= 0, got {args.prune_tol}")
    if args.reuse_tolerance is not None and not args.reuse_tolerance >= 0:
        raise ValueError(f"--reuse-tolerance must be >= 0, got {args.reuse_tolerance}")
    if args.accuracy is not None and not 0 < args.accuracy < 1:
        raise ValueError(f"--accuracy must be in (0, 1), got {args.accuracy}")
    if args.max_probes < 2:
        raise ValueError(f"--max-probes must be >= 2, got {args.max_probes}")
    if args.accuracy is not None and args.no_error_bars:
        raise ValueError("--accuracy needs the error bars; drop --no-error-bars")
    cv = args.control_variate
    settings = EstimatorSettings(error_bars=not args.no_error_bars, target_rel_error=args.accuracy,
                                 max_probes=args.max_probes, cg_tolerance=args.cg_tol, num_probes=args.probes,
                                 lanczos_steps=args.lanczos_steps, lanczos_share=args.lanczos_share or None,
                                 probes=args.probe_dist,
                                 variance_reduction=cv != "none", control_variate="auto" if cv == "none" else cv,
                                 kernel_prune_tol=args.prune_tol,
                                 kernel_backend=None if args.kernel_backend == "auto" else args.kernel_backend,
                                 kernel_tf32=args.tf32, solver=args.solver, reuse_tolerance=args.reuse_tolerance,
                                 kernel_group=True if rank_and_size()[1] > 1 else None)  # under torchrun
    return settings, {key: v for key, v in (("k", args.k), ("w", args.w)) if v is not None}


def emit_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=_plain)
    sys.stdout.write("\n")
