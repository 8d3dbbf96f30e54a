"""The first MLL evaluation in a fresh process against the following ones: what a BO loop that starts a new process
per iteration pays.

Run:  python benchmarks/first_call.py --device cuda                 (kin40k n = 25 000, float64, 3 processes)
      python benchmarks/first_call.py --quick                       (CPU, n = 600; the tests run it)

``--processes`` fresh Python processes run one after another. Each imports gpnys, loads the data onto the device
(the CUDA context starts there, timed apart as ``setup_s``) and times ``--calls`` MLL value + gradient evaluations
(``-MLL/n`` under ``use_preconditioner(model, "auto")``, ScaleKernel(Matérn-3/2) at fixed
hyperparameters, a new model per call so that no solve is reused). The first process starts with empty on-disk
caches (Triton's compiled kernels in ``TRITON_CACHE_DIR``, gpnys's path costs in ``GPNYS_CACHE_DIR``, both in a
fresh temporary folder unless ``--keep-caches``); the later ones find them filled, as every process after the first
on a machine does. Reported per process: the first call, the median of the others ("warm") and their difference,
the target being at most 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def child(spec: dict) -> dict:
    """One fresh process: setup, then ``spec["calls"]`` timed evaluations."""
    t0 = time.perf_counter()
    import gpytorch
    import torch

    from gpnys import datasets
    from gpnys.gp import ExactGPModel
    from gpnys.gp.hook import use_preconditioner

    t_import = time.perf_counter() - t0
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    t1 = time.perf_counter()
    ds = datasets.load(spec["data"], n=spec["n"], seed=0, dtype=dtype, device=device)
    X, y = ds.train_x, ds.train_y
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setup = time.perf_counter() - t1
    times, paths = [], []
    for _ in range(spec["calls"]):
        model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").to(X)
        model.covar_module.base_kernel.lengthscale = spec["lengthscale"]
        model.likelihood.noise = spec["noise"]
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        with use_preconditioner(model, "auto", seed=0) as hook:
            loss = -mll(model(X), y)
            loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        paths.append(hook.path)
    return {"import_s": t_import, "setup_s": setup, "times_s": times, "paths": paths, "n": int(X.shape[0]),
            "loss": float(loss.detach())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU, n = 600, 2 processes of 3 calls")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--data", default="kin40k")
    ap.add_argument("--n", type=int, default=None, help="training points (default 25 000; quick 600)")
    ap.add_argument("--processes", type=int, default=None, help="fresh processes (default 3; quick 2)")
    ap.add_argument("--calls", type=int, default=4, help="evaluations per process (first + warm ones)")
    ap.add_argument("--lengthscale", type=float, default=1.0)
    ap.add_argument("--noise", type=float, default=0.01)
    ap.add_argument("--keep-caches", action="store_true", help="use the machine's own caches (not emptied)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/first_call[_quick].json)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return {}
    if args.calls < 2:
        ap.error("--calls must be at least 2 (a first call and a warm one)")
    import torch  # (after the child branch: the parent needs it only for the device and its record)

    from gpnys.baselines.provenance import provenance

    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    n = args.n or (600 if args.quick else 25_000)
    processes = args.processes or (2 if args.quick else 3)
    spec = {"device": device, "dtype": args.dtype, "data": args.data, "n": n, "calls": args.calls,
            "lengthscale": args.lengthscale, "noise": args.noise}
    record = provenance(__file__, argv, device)
    env = dict(os.environ)
    tmp = None
    if not args.keep_caches:
        tmp = tempfile.TemporaryDirectory(prefix="gpnys_first_call_")
        env.update(TRITON_CACHE_DIR=os.path.join(tmp.name, "triton"), GPNYS_CACHE_DIR=os.path.join(tmp.name, "gpnys"))
    rows = []
    print(f"{'process':>7} {'caches':>7} {'import s':>8} {'setup s':>8} {'first s':>8} {'warm s':>8} "
          f"{'extra s':>8}  paths")
    for p in range(processes):
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                             text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"process {p} failed:\n{out.stderr[-3000:]}")
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        first, warm = rec["times_s"][0], statistics.median(rec["times_s"][1:])
        rec.update(process=p, caches="empty" if p == 0 and tmp else "filled", first_s=first, warm_s=warm,
                   extra_s=first - warm)
        rows.append(rec)
        print(f"{p:>7} {rec['caches']:>7} {rec['import_s']:>8.2f} {rec['setup_s']:>8.2f} {first:>8.3f} {warm:>8.3f} "
              f"{first - warm:>8.3f}  {','.join(rec['paths'])}", flush=True)
    if tmp is not None:
        tmp.cleanup()
    res = {"meta": dict(spec), "rows": rows, "provenance": record}
    out_path = Path(args.out) if args.out else RESULTS / ("first_call_quick.json" if args.quick else "first_call.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1))
    later = [r["extra_s"] for r in rows[1:]]
    if later:
        print(f"first call above a warm one, caches filled: {max(later):.3f} s (worst of {len(later)}); "
              f"wrote {out_path}")
    return res


if __name__ == "__main__":
    main()
