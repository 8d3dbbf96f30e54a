"""``gpnys mll``: one value + gradient of -MLL/n by several estimators, with errors against Cholesky."""

from __future__ import annotations

import argparse
import importlib.util

from gpnys import budget
from gpnys.baselines.higp_adapter import evaluate_higp  # imports higp itself only when called
from gpnys.baselines.mll import METHODS, NOISE_LOWER_BOUND, evaluate, grad_errors
from gpnys.cli.common import (
    SCALE,
    Range,
    add_common_args,
    add_data_args,
    add_estimator_args,
    check_at_most,
    check_estimator_unused,
    comma_choices,
    count,
    emit_json,
    estimator_from_args,
    load_data,
    precond_options,
)
from gpnys.kernels.backends import select_backend
from gpnys.kernels.product import caches_dense

NAME = "mll"
HELP = "negative MLL per point and its raw-parameter gradient: exact Cholesky vs GPyTorch default vs gpnys"
FLAGS: dict[str, Range] = {"repeats": count(1), "lengthscale": SCALE, "outputscale": SCALE,
                           "noise": Range(NOISE_LOWER_BOUND, low_open=True, scale=True)}


def add_parser(p: argparse.ArgumentParser) -> None:
    add_data_args(p, default_n=2000)
    add_common_args(p)
    p.add_argument("--lengthscale", type=float, default=1.0)
    p.add_argument("--outputscale", type=float, default=1.0)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--method", type=comma_choices(METHODS + ("higp",), "method"), default=["exact", "gpytorch", "auto"])
    p.add_argument("--repeats", type=int, default=1, help="repeats of the stochastic methods (seeds S, S+1, ...)")
    add_estimator_args(p)


def run(args: argparse.Namespace) -> int:
    if args.solver == "cholesky":
        raise ValueError("--solver cholesky: gpnys mll evaluates each gpnys --method on its preconditioned path; "
                         "the Cholesky reference is --method exact")
    settings = estimator_from_args(args)
    gpnys_methods = [m for m in args.method if m not in ("exact", "gpytorch", "higp")]
    if not gpnys_methods:
        check_estimator_unused(args, f"--method {','.join(args.method)}")
    opts = precond_options(args, gpnys_methods, f"--method {','.join(args.method)}")
    ds = load_data(args)
    check_at_most(ds.n, args, "k", "w")
    common = {"kernel": args.kernel, "lengthscale": args.lengthscale, "outputscale": args.outputscale,
              "noise": args.noise}
    records, ref = [], None
    n = ds.train_x.shape[0]
    dev = ds.train_x.device
    storage = {"kernel_storage": "dense" if caches_dense(n, ds.train_x.element_size(), args.kernel != "rbf", device=dev)
               else "on-the-fly", "block_bytes": budget.block_bytes(dev), "dense_bytes": budget.dense_limit_bytes(dev),
               "kernel_backend": select_backend(dev, settings.kernel_backend)}
    for method in args.method:
        if method == "higp":
            if importlib.util.find_spec("higp") is None:
                records.append({"method": "higp", "skipped": "higp is not installed (pip install higp)"})
                continue
            for r in range(args.repeats):  # HiGP defaults: rank-50 preconditioner, 10 Lanczos steps x 10 probes
                rec = evaluate_higp(ds.train_x, ds.train_y, seed=args.seed + r, **common)
                rec["seed"] = args.seed + r
                records.append(rec)
            continue
        reps = 1 if method == "exact" else args.repeats
        for r in range(reps):
            kw = {} if method in ("exact", "gpytorch") else {"settings": settings, **opts[method]}
            rec = evaluate(ds.train_x, ds.train_y, method, seed=args.seed + r, **common, **kw)
            rec["seed"] = args.seed + r
            rec["n"] = n
            if method not in ("exact", "gpytorch"):  # gpnys's training kernel operator (memory budget)
                rec.update(storage)
            if method == "exact":
                ref = rec
            records.append(rec)
    if ref is not None:
        for rec in records:
            if "loss" in rec and rec is not ref:
                rec["loss_rel_error"] = abs(rec["loss"] - ref["loss"]) / abs(ref["loss"])
                rec["grad_rel_error"] = grad_errors(rec["grad"], ref["grad"])
    if args.json:
        emit_json(records)
        return 0
    print(f"data: {ds.describe()}; kernel {args.kernel}, lengthscale {args.lengthscale}, "
          f"outputscale {args.outputscale}, noise {args.noise}")
    print(f"gpnys kernel operator: {storage['kernel_storage']} "
          f"(dense cache limit {storage['dense_bytes'] / 2**30:g} GiB, "
          f"blocks of {storage['block_bytes'] / 2**20:g} MiB, {storage['kernel_backend']} backend)")
    for rec in records:
        if "skipped" in rec:
            print(f"{rec['method']:9s} skipped: {rec['skipped']}")
            continue
        errs = ""
        if "grad_rel_error" in rec:
            e = rec["grad_rel_error"]
            errs = (f"  loss err {rec['loss_rel_error']:.1e}  grad err ls {e['raw_lengthscale']:.1%} "
                    f"os {e['raw_outputscale']:.1%} noise {e['raw_noise']:.1%}")
        frac = rec.get("extra", {}).get("kernel_fraction")
        cut = f"  kernel entries computed {frac:.1%}" if frac is not None and frac < 1.0 else ""
        se = f" ± {rec['loss_std_error']:.1e}" if rec.get("loss_std_error") else ""
        if rec.get("grad_std_error") and rec["method"] != "exact":
            worst = max(max(v) if isinstance(v, list) else v for v in rec["grad_std_error"].values())
            se += f" (grad SE <= {worst:.1e}, {rec['extra'].get('probes', 0)} probes)"
        print(f"{rec['method']:9s} seed {rec['seed']}: loss {rec['loss']:.6f}{se}  "
              f"time {rec['time_s']:.2f}s{errs}{cut}")
    return 0
