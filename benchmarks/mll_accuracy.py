"""The accuracy and time of one -MLL/n value + gradient on elevators: exact Cholesky vs GPyTorch's default vs HiGP
vs gpnys.

Run:  python benchmarks/mll_accuracy.py                   (n = 10000, lengthscales 0.3,1,3, 5 seeds)
      python benchmarks/mll_accuracy.py --quick           (n = 500, 2 seeds; run by the test suite)
      python benchmarks/mll_accuracy.py --n 8000 --methods auto:diag,auto:frozen --lengthscale 1
                                                          (a gpnys method with a control variate family)

For each length-scale, Cholesky (float64) once, then GPyTorch's default CG + SLQ, HiGP's defaults (when installed)
and gpnys (``auto`` by default) over several seeds, the methods in turn within each seed; reports the median loss
relative error, the median error of each gradient component (|g - g*| / max(|g*|, 0.1 ||g*||_2)), the median time
and the median over seeds of each method's time over GPyTorch's. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from functools import partial
from pathlib import Path

import torch

from gpnys import datasets
from gpnys.baselines.higp_adapter import evaluate_higp
from gpnys.baselines.mll import evaluate, grad_errors
from gpnys.baselines.provenance import provenance
from gpnys.gp.settings import EstimatorSettings

RESULTS = Path(__file__).resolve().parent / "results"


def runner(method: str):
    """The evaluation of ``method``: HiGP's, or :func:`evaluate`'s, with ``METHOD:FAMILY`` a gpnys method whose
    control variate is that family."""
    if method == "higp":
        return evaluate_higp
    name, _, family = method.partition(":")
    settings = EstimatorSettings(control_variate=family) if family else None
    return partial(evaluate, method=name, settings=settings)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--lengthscale", default="0.3,1,3")
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--kernel", default="rbf")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--methods", default="gpytorch,higp,auto",
                    help="gpytorch (its defaults), higp (AFN authors' package, defaults), any gpnys method, or one "
                         "as METHOD:FAMILY with a control variate family (EstimatorSettings.control_variate)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n, seeds = (500, 2) if args.quick else (args.n, args.seeds)
    ds = datasets.load("elevators", n=n, seed=0)
    out: dict = {"n": n, "kernel": args.kernel, "noise": args.noise, "rows": [],
                 "provenance": provenance(__file__, argv, ds.train_x.device)}
    print(f"elevators n = {n}, {args.kernel}, noise {args.noise}, outputscale 1, {seeds} seeds (medians)")
    print(f"{'ls':>5} {'method':>9} {'time s':>8} {'loss err':>9} {'ls err':>8} {'os err':>8} {'noise err':>9} "
          f"{'/ gpytorch':>9}")
    for ls in (float(v) for v in args.lengthscale.split(",")):
        common = {"kernel": args.kernel, "lengthscale": ls, "noise": args.noise}
        ref = evaluate(ds.train_x, ds.train_y, "exact", **common)
        print(f"{ls:>5g} {'exact':>9} {ref['time_s']:8.2f}")
        out["rows"].append({"lengthscale": ls, "method": "exact", "time_s": ref["time_s"], "loss": ref["loss"],
                            "grad": ref["grad"]})
        methods = []
        for method in args.methods.split(","):
            if method == "higp" and importlib.util.find_spec("higp") is None:
                print(f"{ls:>5g} {'higp':>9} skipped (pip install higp)")
                continue
            methods.append(method)
        # seed by seed, every method in turn: a machine whose speed drifts over minutes then slows them alike
        recs: dict[str, list] = {m: [] for m in methods}
        for s in range(seeds):
            for method in methods:
                recs[method].append(runner(method)(ds.train_x, ds.train_y, seed=s, **common))
        for method in methods:
            lerr = [abs(r["loss"] - ref["loss"]) / abs(ref["loss"]) for r in recs[method]]
            gerr = [grad_errors(r["grad"], ref["grad"]) for r in recs[method]]
            med = {k: statistics.median(g[k] for g in gerr) for k in gerr[0]}
            row = {"lengthscale": ls, "method": method, "time_s": statistics.median(r["time_s"] for r in recs[method]),
                   "loss_rel_error": statistics.median(lerr), "grad_rel_error": med, "seeds": seeds,
                   "per_seed": [{"loss_rel_error": le, "grad_rel_error": ge, "time_s": r["time_s"],
                                 "extra": r["extra"]} for le, ge, r in zip(lerr, gerr, recs[method])]}
            if "gpytorch" in recs and method != "gpytorch":  # the median of the per-seed ratios (same seed, adjacent)
                row["time_over_gpytorch"] = statistics.median(
                    r["time_s"] / g["time_s"] for r, g in zip(recs[method], recs["gpytorch"]))
            out["rows"].append(row)
            ratio = f"{row['time_over_gpytorch']:7.2f}x" if "time_over_gpytorch" in row else ""
            print(f"{ls:>5g} {method:>9} {row['time_s']:8.2f} {row['loss_rel_error']:9.1e} "
                  f"{med['raw_lengthscale']:8.2%} {med['raw_outputscale']:8.2%} {med['raw_noise']:9.2%} {ratio}")
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / ("mll_accuracy_quick.json" if args.quick else "mll_accuracy.json")
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
