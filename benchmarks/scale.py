"""One -MLL/n value + gradient with ``auto`` at n = 50k, 100k, 200k: wall time and peak memory vs n.

Run:  python benchmarks/scale.py                       (synthetic3d 50k,100k,200k + kin40k; float32 and float64)
      python benchmarks/scale.py --sizes 200000 --dtypes float32 --reference
      python benchmarks/scale.py --sizes "" --out benchmarks/results/scale_kin40k.json   (kin40k only)
      python benchmarks/scale.py --sizes "" --no-kin40k --knn 20000:3,50000:3,200000:3,20000:18 --out ...knn.json
      python benchmarks/scale.py --quick                (n = 3000, 6000; run by the test suite)

Each point runs ``gpnys mll ... --method auto --json`` in a fresh process (so the peak RSS, read with
its own ``getrusage``), on synthetic 3-D points with unit density (``synthetic3d`` with ``--no-standardize``: a cube
of edge n^(1/3), the AFN paper's set, so the length-scale is in units of the mean spacing) and on UCI kin40k
(its 36 000 training points of split 0, d = 8, standardised). ``--reference`` adds, per point, a run
with tighter settings (CG tolerance 1e-3, 64 probes, 30 Lanczos steps; ``--reference-dtype``, float64 by default)
and reports the loss difference.
Prints a table, writes JSON and a PNG (time and peak RSS vs n).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpnys import datasets, memory_budget
from gpnys.baselines.provenance import provenance
from gpnys.cli.common import DTYPES
from gpnys.kernels import make_kernel
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.precond.knn import causal_knn

RESULTS = Path(__file__).resolve().parent / "results"
REFERENCE = ["--cg-tol", "1e-3", "--probes", "64", "--lanczos-steps", "30"]


# runs the CLI in the child and reports the child's own peak RSS (KiB on Linux) on stderr's last line
CHILD = ("import json, resource, sys; from gpnys.cli.main import main; rc = main(sys.argv[1:]); "
         "print(json.dumps({'peak_rss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), file=sys.stderr); "
         "sys.exit(rc)")


def run_mll(data: str, n: int | None, args: argparse.Namespace, extra: list[str]) -> dict:
    """One ``gpnys mll`` in a child process; returns its JSON record plus wall time and peak RSS (MiB)."""
    cmd = [sys.executable, "-c", CHILD, "mll", "--data", data, "--kernel", args.kernel,
           "--lengthscale", str(args.lengthscale), "--noise", str(args.noise), "--method", "auto",
           "--seed", str(args.seed), "--json", *extra]
    if n is not None:
        cmd += ["--n", str(n)]
    if data == "synthetic3d":  # keep the unit density of the AFN paper's set (length-scales in its units)
        cmd.append("--no-standardize")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed:\n{proc.stderr[-3000:]}")
    # the JSON document starts at the first line that opens a list (imports may print before it: pykeops does)
    rec = json.loads(proc.stdout[re.search(r"^\[$", proc.stdout, re.M).start():])[0]
    peak = json.loads(proc.stderr.strip().splitlines()[-1])["peak_rss_kib"]
    rec.update(wall_s=wall, peak_rss_mib=peak / 1024, cmd="gpnys " + " ".join(cmd[3:]))
    return rec


def pass_costs(data: str, n: int | None, dtype: str, args: argparse.Namespace, dense_bytes: int | None) -> dict:
    """The cost model's two terms at this point, in this process: one kernel product with 17 right-hand sides (16
    probes + y, what each CG iteration does) and one hyperparameter-derivative pass, plus the share of entries
    computed (the cutoff plan's, 1.0 without one)."""
    torch.set_num_threads(args.threads)
    ds = datasets.load(data, n=n, seed=args.seed, standardize=data != "synthetic3d", dtype=DTYPES[dtype])
    X = ds.train_x
    kern = make_kernel(args.kernel).to(X.dtype)
    kern.base_kernel.lengthscale = args.lengthscale
    V = torch.randn(X.shape[0], 17, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(X.dtype)
    with memory_budget(dense_bytes=dense_bytes), torch.no_grad():
        op = StationaryKernelOperator(X, kern.outputscale.detach(), kern.base_kernel.lengthscale.detach(),
                                      base=kern.base_kernel, cache={})
        t0 = time.perf_counter()
        plan = op.plan() if op._dense() is None else None
        t1 = time.perf_counter()
        op.matmul(V)
        t2 = time.perf_counter()
        op._bilinear_derivative(V, V)
        t3 = time.perf_counter()
    frac = 1.0 if plan is None else plan.fraction
    n_pts = X.shape[0]
    return {"plan_s": t1 - t0, "product_s": t2 - t1, "derivative_s": t3 - t2, "kernel_fraction": frac,
            "entries_per_s_product": frac * n_pts * n_pts / (t2 - t1)}


def knn_costs(sizes: list[int], d: int, w: int, threads: int) -> list[dict]:
    """Causal kNN pattern (FSAI, w nonzeros per row) by brute force and by the k-d tree chunks, on uniform points in
    ``[0, 1]^d``; whether both patterns agree."""
    torch.set_num_threads(threads)
    rows = []
    for n in sizes:
        X = torch.rand(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        t0 = time.perf_counter()
        tree = causal_knn(X, w, tree=True)
        t1 = time.perf_counter()
        brute = causal_knn(X, w, tree=False)
        t2 = time.perf_counter()
        rows.append({"n": n, "d": d, "w": w, "tree_s": t1 - t0, "brute_s": t2 - t1,
                     "same_pattern": bool(torch.equal(tree[0], brute[0]) and torch.equal(tree[1], brute[1]))})
        print(f"causal kNN n = {n}, d = {d}, w = {w}: k-d tree chunks {t1 - t0:.2f} s, brute force {t2 - t1:.2f} s, "
              f"same pattern: {rows[-1]['same_pattern']}", flush=True)
    return rows


def storage(rec: dict) -> str:
    """``dense``, ``on-the-fly`` or ``cut NN%`` (on the fly, computing NN % of the entries)."""
    frac = rec.get("extra", {}).get("kernel_fraction")
    if rec["kernel_storage"] == "dense" or frac is None or frac >= 1.0:
        return rec["kernel_storage"]
    return f"cut {100 * frac:.0f}%"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="50000,100000,200000")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--kernel", default="matern32")
    ap.add_argument("--lengthscale", type=float, default=1.0)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-kin40k", action="store_true", help="skip the kin40k point")
    ap.add_argument("--reference", action="store_true", help="also run the tighter reference per point")
    ap.add_argument("--reference-dtype", default="float64", help="dtype of the reference runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--knn", default="",
                    help="also time the causal kNN, e.g. '20000:3,50000:3,200000:3,20000:18' (n:d)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sizes = [3000, 6000] if args.quick else [int(v) for v in args.sizes.split(",") if v]
    dtypes = args.dtypes.split(",")
    # the quick mode forces the on-the-fly path (no dense cache) so the test exercises what large n uses
    budget = ["--dense-gib", "0"] if args.quick else []
    points = [("synthetic3d", n) for n in sizes]
    if not args.no_kin40k and not args.quick:
        points.append(("kin40k", datasets.load("kin40k", standardize=False).train_x.shape[0]))  # the whole split
    rows = []
    print(f"{args.kernel}, lengthscale {args.lengthscale}, noise {args.noise}, outputscale 1, {args.threads} threads")
    print(f"{'data':>12} {'n':>7} {'dtype':>7} {'wall s':>8} {'peak MiB':>9} {'precond':>8} {'rank':>5} {'CG it':>5} "
          f"{'setup s':>7} {'storage':>10} {'product s':>9} {'deriv s':>7} {'loss':>11} {'|loss-ref|':>10}")
    for data, n in points:
        for dt in dtypes:
            rec = run_mll(data, n, args, ["--dtype", dt, *budget])
            row = {"data": data, "dtype": dt, **rec, "costs": pass_costs(data, n, dt, args, 0 if budget else None)}
            if args.reference:
                ref = run_mll(data, n, args, ["--dtype", args.reference_dtype, *REFERENCE, *budget])
                row["reference"] = ref
                row["loss_abs_diff"] = abs(rec["loss"] - ref["loss"])
            rows.append(row)
            ex = rec.get("extra", {})
            diff = f"{row['loss_abs_diff']:10.2e}" if "loss_abs_diff" in row else f"{'':>10}"
            n_pts = rec["n"]
            print(f"{data:>12} {str(n_pts):>7} {dt:>7} {rec['wall_s']:8.1f} {rec['peak_rss_mib']:9.0f} "
                  f"{ex.get('precond', '?'):>8} {ex.get('rank', 0):>5} {ex.get('cg_iterations', 0):>5} "
                  f"{ex.get('setup_s', 0.0):7.1f} {storage(rec):>10} {row['costs']['product_s']:9.2f} "
                  f"{row['costs']['derivative_s']:7.2f} {rec['loss']:11.6f} {diff}", flush=True)
    specs = ["1500:3"] if args.quick else [v for v in args.knn.split(",") if v]
    knn = [r for spec in specs for r in knn_costs([int(spec.split(":")[0])], int(spec.split(":")[1]), 30, args.threads)]
    res = {"knn": knn, "kernel": args.kernel, "lengthscale": args.lengthscale, "noise": args.noise,
           "threads": args.threads,
           "reference_settings": " ".join(["--dtype", args.reference_dtype, *REFERENCE]) if args.reference else None,
           "provenance": provenance(__file__, argv, "cpu"), "rows": rows}
    out = Path(args.out) if args.out else RESULTS / ("scale_quick.json" if args.quick else "scale.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    if rows:
        _plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if rows else ""))
    return res


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for dt in sorted({r["dtype"] for r in rows}):
        sel = [r for r in rows if r["dtype"] == dt and r["data"] == "synthetic3d"]
        ns = [r["n"] for r in sel]
        a1.loglog(ns, [r["wall_s"] for r in sel], "o-", label=f"synthetic3d {dt}")
        a2.loglog(ns, [r["peak_rss_mib"] / 1024 for r in sel], "o-", label=f"synthetic3d {dt}")
        for r in rows:
            if r["dtype"] == dt and r["data"] != "synthetic3d":
                a1.loglog([r["n"]], [r["wall_s"]], "s", label=f"{r['data']} {dt}")
                a2.loglog([r["n"]], [r["peak_rss_mib"] / 1024], "s", label=f"{r['data']} {dt}")
    a1.set(xlabel="n", ylabel="wall time of one value + gradient (s)")
    a2.set(xlabel="n", ylabel="peak RSS (GiB)")
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
