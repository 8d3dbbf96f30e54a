"""Small n on the CPU, alone and beside a busy process: dense factorisations by thread count, and ``gpnys fit``
with the cost-aware ``auto`` path against Cholesky (``--precond none``) and the forced preconditioned path.

Run:  python benchmarks/small_n.py                 (n = 600, ARD Matérn-3/2, 10 Adam steps; ~3 minutes on 2 cores)
      python benchmarks/small_n.py --quick         (n = 300, 3 steps, m = 64 and 128, fits idle only; the test suite)

The busy process is a second Python running float32 matrix products on all threads, as another job on a shared
machine would. Factorisations: median seconds of ``eigvalsh``, ``eigh``, ``cholesky`` and ``qr`` of an ``m x m``
SPD matrix on one thread, on all threads, and under gpnys's policy (:func:`gpnys.linalg.small_dense`). Fits: the
CLI in a fresh process (``--json``), its training seconds and test RMSE; the ratio is against ``--precond none``
under the same load. The cost model is calibrated (or read from its cache) before any timing, as it is once per
machine for a user. Writes ``benchmarks/results/small_n.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
BUSY = "import torch\nA = torch.randn(1500, 1500)\nwhile True:\n    A @ A\n"


@contextlib.contextmanager
def load(busy: bool):
    """A competing process running matrix products on every core while the block runs (``busy``)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        if proc is not None:
            time.sleep(2.0)  # let it spin up
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def factorisations(sizes: list[int], reps: int) -> list[dict]:
    import torch

    from gpnys.linalg import small_dense

    ops = {"eigvalsh": torch.linalg.eigvalsh, "eigh": torch.linalg.eigh, "cholesky": torch.linalg.cholesky,
           "qr": torch.linalg.qr}
    threads = torch.get_num_threads()
    rows = []
    for m in sizes:
        g = torch.Generator().manual_seed(m)
        A = torch.randn(m, m, generator=g, dtype=torch.float64)
        A = A @ A.T + m * torch.eye(m, dtype=torch.float64)
        for name, op in ops.items():
            row = {"op": name, "m": m}
            for label, ctx in (("one_thread", 1), ("all_threads", threads), ("gpnys", None)):
                times = []
                for _ in range(reps + 1):
                    if ctx is not None:
                        torch.set_num_threads(ctx)
                    t0 = time.perf_counter()
                    with small_dense(m) if ctx is None else contextlib.nullcontext():
                        op(A)
                    times.append(time.perf_counter() - t0)
                torch.set_num_threads(threads)
                row[label] = statistics.median(times[1:])
            rows.append(row)
    return rows


def fit_run(n: int, iters: int, precond: str, solver: str | None) -> dict:
    cmd = [sys.executable, "-m", "gpnys.cli.main", "fit", "--data", "concrete", "--n", str(n), "--ard",
           "--kernel", "matern32", "--iters", str(iters), "--precond", precond, "--json"]
    if solver is not None:
        cmd += ["--solver", solver]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    res = json.loads(out.stdout)
    return {"train_s": res["train_time_s"], "test_rmse": res["test_rmse"], "path": res["path"],
            "path_reason": res["path_reason"]}


def main(argv: list[str] | None = None) -> dict:
    from gpnys.baselines.provenance import provenance

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--n", type=int, default=600)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS / "small_n.json"))
    args = p.parse_args(argv)
    n, iters = (300, 3) if args.quick else (args.n, args.iters)
    sizes, reps = ([64, 128], 1) if args.quick else ([100, 300, 500, 1000], 5)
    fits = [("cholesky (--precond none)", "none", None), ("auto", "auto", "auto"),
            ("preconditioned (--solver iterative)", "auto", "iterative")]
    # the cost model, calibrated once per machine (cached on disk) before any timing, in a process like the fits'
    code = ("import json, torch; from gpnys.gp.path import path_costs; c = path_costs('cpu', torch.float64); "
            "print(json.dumps({'exact': c.exact, 'iterative': c.iterative, 'key': c.key}))")
    costs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    out: dict = {"n": n, "iters": iters, "costs": json.loads(costs), "provenance": provenance(__file__, argv, "cpu"),
                 "factorisations": {}, "fits": {}}
    for busy in (False, True):
        label = "busy" if busy else "idle"
        with load(busy):
            out["factorisations"][label] = factorisations(sizes, reps)
            if busy and args.quick:  # (the suite's run: the fits beside a busy process are the full run's)
                continue
            out["fits"][label] = {name: fit_run(n, iters, precond, solver) for name, precond, solver in fits}
    print(f"{'load':5} {'op':9} {'m':>5} {'1 thread':>10} {'all':>10} {'gpnys':>10}")
    for label, rows in out["factorisations"].items():
        for r in rows:
            print(f"{label:5} {r['op']:9} {r['m']:5d} {r['one_thread']:10.4f} {r['all_threads']:10.4f} "
                  f"{r['gpnys']:10.4f}")
    print(f"\ngpnys fit, concrete n = {n}, ARD Matérn-3/2, {iters} Adam steps")
    print(f"{'load':5} {'run':38} {'train s':>8} {'/ Cholesky':>10} {'RMSE':>8}  path")
    for label, runs in out["fits"].items():
        base = runs["cholesky (--precond none)"]["train_s"]
        for name, r in runs.items():
            r["ratio_to_cholesky"] = r["train_s"] / base
            print(f"{label:5} {name:38} {r['train_s']:8.3f} {r['ratio_to_cholesky']:10.2f} {r['test_rmse']:8.4f}  "
                  f"{r['path']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
