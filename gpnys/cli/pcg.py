"""``gpnys pcg``: solve (K + mu I) x = y by preconditioned CG for a grid of length-scales and preconditioners."""

from __future__ import annotations

import argparse
import time

from gpnys.cli.common import (
    POSITIVE,
    SCALE,
    Range,
    add_common_args,
    add_data_args,
    check_at_most,
    comma_choices,
    count,
    emit_json,
    load_data,
)
from gpnys.kernels import base_kernel
from gpnys.kernels.system import kernel_system
from gpnys.precond.cache import PointCache
from gpnys.precond.strategy import PRECONDITIONERS, make_preconditioner
from gpnys.solvers.pcg import pcg

NAME = "pcg"
HELP = "preconditioned CG on K + mu I: iterations, setup and solve seconds per preconditioner and length-scale"
FLAGS: dict[str, Range] = {"lengthscale": SCALE, "noise": SCALE, "tol": POSITIVE, "maxiter": count(0),
                           "rank": count(1)}


def _floats(text: str) -> list[float]:
    """argparse type: a non-empty comma-separated list of numbers."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


#: the size flags each preconditioner reads (gpnys.precond.strategy.make_preconditioner); nystrom reads --k (the
#: switch of its rank estimate) only without --rank
READS: dict[str, tuple[str, ...]] = {"none": (), "pivchol": ("rank",), "nystrom": ("rank", "k"), "ran": ("rank",),
                                     "sketch": ("rank",), "fsai": ("w",), "afn": ("k", "w"), "auto": ("k", "w")}


def _check_read(args: argparse.Namespace) -> None:
    """A ``ValueError`` naming the first given ``--k`` / ``--w`` / ``--rank`` that no preconditioner of ``--precond``
    reads."""
    for key in ("k", "w", "rank"):
        value = getattr(args, key)
        if value is None:
            continue
        nystrom_rank = args.rank is not None  # a given rank leaves nystrom's estimate (and --k) out
        if not any(key in READS[name] and not (name == "nystrom" and key == "k" and nystrom_rank)
                   for name in args.precond):
            readers = ", ".join(name + (" (without --rank)" if (name, key) == ("nystrom", "k") else "")
                                for name, keys in READS.items() if key in keys)
            raise ValueError(f"--{key} {value} has no effect with --precond {','.join(args.precond)}: only {readers} "
                             "read it")


def add_parser(p: argparse.ArgumentParser) -> None:
    add_data_args(p, default_n=2000)
    add_common_args(p)
    p.add_argument("--lengthscale", type=_floats, default=[1.0], help="comma-separated (GPyTorch convention)")
    p.add_argument("--noise", type=float, default=1e-2, help="mu, the shift of the unit-variance kernel matrix")
    p.add_argument("--precond", type=comma_choices(PRECONDITIONERS, "preconditioner"), default=["none", "afn", "auto"],
                   help=f"comma-separated: {sorted(PRECONDITIONERS)}")
    p.add_argument("--tol", type=float, default=1e-4, help="relative residual tolerance")
    p.add_argument("--maxiter", type=int, default=500)
    p.add_argument("--rank", type=int, default=None,
                   help="rank of nystrom, pivchol, ran, sketch (default: estimated, 15, min(3000, n))")
    p.add_argument("--k", type=int, default=None,
                   help="AFN landmark cap and Nyström/AFN switch threshold of afn, auto, nystrom (default 2000)")
    p.add_argument("--w", type=int, default=None,
                   help="FSAI nonzeros per row of fsai, afn, auto (default 100 in AFN, 400 in FSAI)")


def run(args: argparse.Namespace) -> int:
    _check_read(args)
    ds = load_data(args)
    check_at_most(ds.n, args, "rank", "w")  # --k is a cap: AFN takes min(k, n) landmarks
    X, b = ds.train_x, ds.train_y
    cache = PointCache(X)
    records = []
    for ls in args.lengthscale:
        kernel = base_kernel(args.kernel).to(X)
        kernel.lengthscale = ls
        matmul = kernel_system(X, kernel, args.noise)
        for name in args.precond:
            t0 = time.perf_counter()
            P = make_preconditioner(name, X, kernel, args.noise, cache=cache, seed=args.seed,
                                    rank=args.rank, k=2000 if args.k is None else args.k, w=args.w)
            setup = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = pcg(matmul, b, precond=P, tol=args.tol, maxiter=args.maxiter)
            solve = time.perf_counter() - t0
            rec = {
                "precond": name,
                "lengthscale": ls,
                "noise": args.noise,
                "n": ds.n,
                "rank": 0 if P is None else int(P.rank),
                "iterations": int(res.iterations),
                "converged": bool(res.converged.all()),
                "setup_s": setup,
                "solve_s": solve,
                "rel_residual": float(res.rel_residual.max()),
                "summary": {} if P is None else P.summary(),
            }
            records.append(rec)
            if not args.json:
                print(f"l={ls:<8g} {name:8s} rank={rec['rank']:<6d} iters={rec['iterations']:<4d} "
                      f"conv={str(rec['converged']):5s} setup={setup:7.2f}s solve={solve:7.2f}s "
                      f"relres={rec['rel_residual']:.2e}")
    if args.json:
        emit_json(records)
    return 0
