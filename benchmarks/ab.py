"""The speed-up of a code change: one MLL value + gradient and one kernel product timed under two code revisions,
interleaved, with their losses and gradients compared.

Run:  python benchmarks/ab.py --before HEAD~1                         (kin40k 10 000 Matérn-3/2 and RBF ARD,
                                                                      synthetic3d 50 000 Matérn-3/2; ~20 minutes)
      python benchmarks/ab.py --before REV --cases kin40k:20000:matern32:iso --rounds 3
      python benchmarks/ab.py --before REV --no-error-bars          (GPyTorch's own estimator through the hook)
      python benchmarks/ab.py --before REV --cases elevators:8000:rbf:iso --dtype float64 --dense
                                                                      (the stored kernel, as the CPU takes it)
      python benchmarks/ab.py --quick                                 (this tree against itself; the test suite)

A shared machine's speed drifts between runs, often by more than a change gains, so a speed-up is measured by
running both revisions in alternation within one invocation: ``--rounds`` rounds, each running every
case once per revision, each run a fresh process (``PYTHONPATH`` pointing at that revision's tree) that times
``--repeats`` evaluations after a warm-up. The baseline revision is checked out with ``git worktree`` (``--before
REV``) or given as a directory (``--before-path``); the other is this checkout.

An evaluation is ``-ExactMarginalLogLikelihood`` and its backward through ``use_preconditioner(model, "auto")`` with
the error bars on, float32, the kernel recomputed on the fly (no dense cache; ``--dense``: stored where it fits
the memory budget, ``--dtype float64``), seeded identically in both revisions; a product is one ``K V`` with 17
columns on the same operator, recomputed. Each run also counts the torch tiles'
passes (products, derivative sums, per-probe sums) and their seconds.

Columns: per case and revision the median over rounds of the per-run medians; the ratio after / before; the loss
and the largest gradient difference between the revisions (relative), which show whether a change kept the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
CASES = "kin40k:10000:matern32:iso,kin40k:10000:rbf:ard,synthetic3d:50000:matern32:iso"


def child(args) -> None:
    """One run of one case in this process (the revision on ``PYTHONPATH``): JSON on stdout."""
    import collections
    import time

    import gpytorch
    import torch

    import gpnys
    from gpnys import datasets, use_preconditioner
    from gpnys.gp import ExactGPModel  # exported by every revision
    from gpnys.gp.settings import EstimatorSettings
    from gpnys.kernels.backends.torch_tiles import TorchTiles

    data, n, kernel, ard = args.case.split(":")
    torch.set_num_threads(args.threads)
    extra = {"standardize": False} if data == "synthetic3d" else {}
    ds = datasets.load(data, n=int(n), seed=0, dtype=getattr(torch, args.dtype), **extra)
    X, y = ds.train_x, ds.train_y
    lik = gpytorch.likelihoods.GaussianLikelihood()
    model = ExactGPModel(X, y, lik, kernel=kernel, ard=ard == "ard")
    model.covar_module.base_kernel.lengthscale = 1.0
    model.covar_module.outputscale = 1.0
    lik.noise = 0.1
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    calls: collections.Counter = collections.Counter()
    seconds: collections.Counter = collections.Counter()
    for name in ("matmul", "derivative_sums", "column_derivative_sums"):
        def counted(self, *a, _f=getattr(TorchTiles, name), _n=name, **k):
            t0 = time.perf_counter()
            try:
                return _f(self, *a, **k)
            finally:
                calls[_n] += 1
                seconds[_n] += time.perf_counter() - t0
        setattr(TorchTiles, name, counted)
    times = []
    settings = EstimatorSettings(dense_limit_bytes=None if args.dense else 0, error_bars=not args.no_error_bars)
    with use_preconditioner(model, "auto", settings=settings, seed=0):
        for rep in range(args.repeats + 1):
            calls.clear()
            seconds.clear()
            torch.manual_seed(rep)
            for p in model.parameters():
                p.grad = None
            t0 = time.perf_counter()
            loss = -mll(model(X), y)
            loss.backward()
            if rep:  # rep 0 warms up
                times.append(time.perf_counter() - t0)
    grad = [float(v) for p in model.parameters() for v in p.grad.reshape(-1)]
    from gpnys.kernels.operator import StationaryKernelOperator

    base = model.covar_module.base_kernel
    kop = StationaryKernelOperator(X, model.covar_module.outputscale, base.lengthscale, base=base, cache={},
                                   dense_limit_bytes=0, backend="torch")
    V = torch.randn(X.shape[0], 17, generator=torch.Generator().manual_seed(0), dtype=X.dtype)
    with torch.no_grad():
        kop.matmul(V)  # plan and warm-up
        t0 = time.perf_counter()
        kop.matmul(V)
        product_s = time.perf_counter() - t0
    print(json.dumps({"gpnys": str(Path(gpnys.__file__).parent), "median_s": statistics.median(times), "times_s": times,
                      "loss": float(loss), "grad": grad, "calls": dict(calls),
                      "pass_s": {k: round(v, 3) for k, v in seconds.items()}, "product_s": product_s}))


def run(root: Path, case: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--case", case, "--repeats", str(args.repeats),
           "--threads", str(args.threads), "--dtype", args.dtype] \
        + (["--no-error-bars"] if args.no_error_bars else []) + (["--dense"] if args.dense else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if Path(got["gpnys"]).resolve() != (root / "gpnys").resolve():
        raise RuntimeError(f"the child imported gpnys from {got['gpnys']}, not {root}")
    return got


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="the baseline revision (git worktree)")
    ap.add_argument("--before-path", default=None, help="the baseline's tree, already checked out")
    ap.add_argument("--cases", default=CASES, help="data:n:kernel:iso|ard, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-error-bars", action="store_true",
                    help="GPyTorch's own estimator through the hook (EstimatorSettings(error_bars=False))")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--dense", action="store_true",
                    help="keep the kernel stored where it fits the memory budget (the default estimator's CPU path at "
                         "moderate n) instead of recomputing it")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return None
    for name in ("rounds", "repeats", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.quick:
        args.cases, args.rounds, args.repeats = "synthetic3d:600:matern32:iso", 1, 1
        args.before_path = args.before_path or str(ROOT)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        parts = c.split(":")
        if len(parts) != 4 or not parts[1].isdigit() or parts[3] not in ("iso", "ard"):
            ap.error(f"--cases: {c!r} is not data:n:kernel:iso|ard")
    if (args.before is None) == (args.before_path is None):
        ap.error("--before: give one of --before REV or --before-path DIR")
    tmp = None
    if args.before is not None:
        tmp = tempfile.mkdtemp(prefix="gpnys-ab-")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", tmp, args.before], check=True)
        before = Path(tmp)
        label = subprocess.run(["git", "-C", tmp, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                               check=True).stdout.strip()
    else:
        before, label = Path(args.before_path).resolve(), str(args.before_path)
    try:
        runs: dict = {c: {"before": [], "after": []} for c in cases}
        for r in range(args.rounds):
            for c in cases:
                for version, root in (("before", before), ("after", ROOT)):
                    got = run(root, c, args)
                    runs[c][version].append(got)
                    print(f"round {r + 1}, {c}, {version}: {got['median_s']:.2f} s", file=sys.stderr)
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tmp], check=False)
    rows = []
    for c in cases:
        b, a = runs[c]["before"], runs[c]["after"]
        tb = statistics.median(x["median_s"] for x in b)
        ta = statistics.median(x["median_s"] for x in a)
        pb = statistics.median(x["product_s"] for x in b)
        pa = statistics.median(x["product_s"] for x in a)
        gb, ga = b[-1]["grad"], a[-1]["grad"]
        gscale = max(max(abs(g) for g in gb), 1e-300)
        rows.append({"case": c, "before_s": tb, "after_s": ta, "ratio": ta / tb, "product_before_s": pb,
                     "product_after_s": pa, "product_ratio": pa / pb,
                     "loss_rel_diff": abs(a[-1]["loss"] - b[-1]["loss"]) / max(abs(b[-1]["loss"]), 1e-300),
                     "grad_rel_diff": max(abs(x - y) for x, y in zip(ga, gb)) / gscale,
                     "calls_before": b[-1]["calls"], "calls_after": a[-1]["calls"],
                     "pass_s_before": b[-1]["pass_s"], "pass_s_after": a[-1]["pass_s"]})
    print(f"before = {label}, after = this tree; {args.rounds} rounds x {args.repeats} repeats, "
          f"{args.threads} threads, {args.dtype}, kernel {'stored' if args.dense else 'recomputed'}")
    head = f"{'case':34s} {'before s':>9s} {'after s':>8s} {'ratio':>6s} {'K V before':>10s} {'after':>7s} " \
           f"{'ratio':>6s} {'loss diff':>9s} {'grad diff':>9s}"
    print(head)
    for row in rows:
        print(f"{row['case']:34s} {row['before_s']:9.2f} {row['after_s']:8.2f} {row['ratio']:6.2f} "
              f"{row['product_before_s']:10.3f} {row['product_after_s']:7.3f} {row['product_ratio']:6.2f} "
              f"{row['loss_rel_diff']:9.1e} {row['grad_rel_diff']:9.1e}")
    out = Path(args.out) if args.out else RESULTS / ("ab_quick.json" if args.quick else "ab.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    from gpnys.baselines.provenance import provenance  # not at the top: a child imports the revision it times

    result = {"before": label, "rounds": args.rounds, "repeats": args.repeats, "threads": args.threads,
              "dtype": args.dtype, "dense": args.dense, "error_bars": not args.no_error_bars, "rows": rows,
              "runs": runs, "provenance": provenance(__file__, argv)}
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
