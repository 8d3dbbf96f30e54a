"""AFN setup time on elevators (all 16 599 rows, standardised), Matérn-3/2, mu = n * 1e-6, the setting of Zhao et al.
2024 (the AFN paper), Table 3(b).

Run:  python benchmarks/afn_setup.py [--threads 2] [--lengthscale 10,20]
      python benchmarks/afn_setup.py --quick       (600 rows, k = 100, w = 20; run by the test suite)

Builds AFN (k = 2000, w = 100 by default) at each length-scale on one PointCache, so the first build pays for
the landmarks and kNN pattern and later ones reuse them (isotropic kernel). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gpytorch
import torch

from gpnys import datasets
from gpnys.baselines.provenance import provenance
from gpnys.precond import AFNPreconditioner, PointCache

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lengthscale", default="10,20")
    ap.add_argument("--k", type=int, default=2000)
    ap.add_argument("--w", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    data, _ = datasets.load_array("elevators")
    X = torch.as_tensor(data[:, :-1])
    X = (X - X.mean(0)) / X.std(0)
    k, w = args.k, args.w
    if args.quick:
        X, k, w = X[:600], 100, 20
    mu = X.shape[0] * 1e-6
    kernel = gpytorch.kernels.MaternKernel(nu=1.5).double()
    cache = PointCache(X)
    rows = []
    print(f"AFN setup, elevators n = {X.shape[0]}, d = {X.shape[1]}, k = {k}, w = {w}, mu = {mu:.4g}, "
          f"threads = {torch.get_num_threads()}")
    for ls in (float(v) for v in args.lengthscale.split(",")):
        kernel.lengthscale = ls
        t0 = time.perf_counter()
        P = AFNPreconditioner(X, kernel, mu, k=k, w=w, cache=cache)
        setup = time.perf_counter() - t0
        s = P.summary()
        rows.append({"lengthscale": ls, "setup_s": setup, "k": s["k"], "w": s["w"], "nnz": s["nnz"],
                     "cache_hits": s["cache_hits"], "shifts": s["shifts"], "threads": torch.get_num_threads()})
        print(f"  lengthscale {ls:8g}: setup {setup:6.1f} s  (nnz(G) {s['nnz']}, cache hits {s['cache_hits']})")
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / ("afn_setup_quick.json" if args.quick else "afn_setup.json")
    out.write_text(json.dumps({"n": X.shape[0], "d": X.shape[1], "mu": mu, "rows": rows,
                               "provenance": provenance(__file__, argv)}, indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
