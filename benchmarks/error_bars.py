"""Whether gpnys's standard errors cover the true error of the loss and gradient, and whether a requested accuracy
(``--accuracy``, ``target_rel_error``) is delivered, against Cholesky.

Run:  python benchmarks/error_bars.py                  (elevators n = 4000, Matérn-3/2, 20 seeds)
      python benchmarks/error_bars.py --quick          (n = 300, 6 seeds, accuracy 1e-2; run by the test suite)

On a real data set at fixed hyperparameters, Cholesky gives the reference loss and gradient once. Then

* **coverage**: gpnys (``auto``, one batch of probes) over ``--seeds`` seeds; the share of seeds with
  ``|estimate - Cholesky| <= 2 SE``, for the loss and for each gradient component (target >= 90 %);
* **requested accuracy**: ``target_rel_error = --accuracy`` over the same seeds: the share of seeds whose loss is
  within ``--accuracy`` relative of Cholesky (target >= 95 %), the share whose gradient is (in norm), and the median
  time, against the cheapest fixed probe count (hand-tuned, from a sweep) that reaches both shares.

Prints tables, writes JSON (and a PNG of the standardised errors, which should look like N(0, 1)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpnys import datasets
from gpnys.baselines.mll import evaluate
from gpnys.baselines.provenance import provenance
from gpnys.gp.settings import EstimatorSettings

RESULTS = Path(__file__).resolve().parent / "results"


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in d.values()])


def _run(X, y, common, seed, settings, opts) -> dict:
    t0 = time.perf_counter()
    out = evaluate(X, y, "auto", seed=seed, settings=settings, **common, **opts)
    out["wall_s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", default="elevators")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--kernel", default="matern32")
    ap.add_argument("--lengthscale", type=float, default=2.0)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--accuracy", type=float, default=1e-3)
    ap.add_argument("--sweep", default="16,32,64,128,256", help="fixed probe counts of the hand-tuned sweep")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    n, seeds = (300, 6) if args.quick else (args.n, args.seeds)
    tau = 1e-2 if args.quick else args.accuracy
    sweep = [8, 32] if args.quick else [int(v) for v in args.sweep.split(",")]
    opts = {"k": 60, "w": 15} if args.quick else {}
    ds = datasets.load(args.data, n=n, seed=0)
    X, y = ds.train_x, ds.train_y
    common = {"kernel": args.kernel, "lengthscale": args.lengthscale, "noise": args.noise, "ard": False}
    ref = evaluate(X, y, "exact", **common)
    g_ref = _flat(ref["grad"])
    names = [f"{k}[{i}]" if isinstance(v, list) else k for k, v in ref["grad"].items()
             for i in range(len(v) if isinstance(v, list) else 1)]
    out: dict = {"data": args.data, "n": n, "kernel": args.kernel, "lengthscale": args.lengthscale,
                 "noise": args.noise, "seeds": seeds, "exact_time_s": ref["time_s"], "device": str(X.device),
                 "torch_threads": torch.get_num_threads(), "provenance": provenance(__file__, argv, X.device)}

    # -- coverage ---------------------------------------------------------------------------------------------
    z_loss, z_grad, times = [], [], []
    for seed in range(seeds):
        r = _run(X, y, common, seed, EstimatorSettings(), opts)
        z_loss.append((r["loss"] - ref["loss"]) / r["loss_std_error"])
        z_grad.append(((_flat(r["grad"]) - g_ref) / _flat(r["grad_std_error"])).tolist())
        times.append(r["wall_s"])
    zg = torch.tensor(z_grad, dtype=torch.float64)  # (seeds, p)
    cover_loss = sum(abs(z) <= 2 for z in z_loss) / seeds
    cover_grad = ((zg.abs() <= 2).double().mean(0)).tolist()
    out["coverage"] = {"loss": cover_loss, "grad": dict(zip(names, cover_grad)), "z_loss": z_loss,
                       "z_grad": z_grad, "median_time_s": statistics.median(times)}
    print(f"{args.data} n = {n}, {args.kernel}, l = {args.lengthscale}, noise {args.noise}; Cholesky "
          f"{ref['time_s']:.2f} s")
    print(f"coverage over {seeds} seeds (|error| <= 2 SE; target >= 90 %), median {statistics.median(times):.2f} s:")
    print(f"  {'loss':28s} {cover_loss:6.0%}")
    for name, c in zip(names, cover_grad):
        print(f"  {name:28s} {c:6.0%}")

    # -- requested accuracy against hand-tuned probe counts ------------------------------------------------------


    def share_within(rows: list[dict]) -> float:
        return sum(abs(r["loss"] - ref["loss"]) <= tau * abs(ref["loss"]) for r in rows) / len(rows)

    def grad_share(rows: list[dict]) -> float:  # ||g - g*|| <= tau ||g*||
        return sum(float((_flat(r["grad"]) - g_ref).norm()) <= tau * float(g_ref.norm()) for r in rows) / len(rows)

    acc = [_run(X, y, common, s, EstimatorSettings(target_rel_error=tau), opts) for s in range(seeds)]
    out["accuracy"] = {"target": tau, "share_within": share_within(acc), "grad_share_within": grad_share(acc),
                       "median_time_s": statistics.median(r["wall_s"] for r in acc),
                       "median_probes": statistics.median(r["extra"]["probes"] for r in acc)}
    print(f"--accuracy {tau:g}: loss within {tau:g} of Cholesky in {out['accuracy']['share_within']:.0%} of seeds "
          f"(target >= 95 %), gradient within {tau:g} (norm) in {out['accuracy']['grad_share_within']:.0%}, "
          f"median {out['accuracy']['median_time_s']:.2f} s, "
          f"{out['accuracy']['median_probes']:.0f} probes")
    hand = []
    for probes in sweep:
        rows = [_run(X, y, common, s, EstimatorSettings(num_probes=probes), opts) for s in range(seeds)]
        rec = {"probes": probes, "share_within": share_within(rows), "grad_share_within": grad_share(rows),
               "median_time_s": statistics.median(r["wall_s"] for r in rows)}
        hand.append(rec)
        print(f"  fixed {probes:4d} probes: loss within {tau:g} in {rec['share_within']:.0%}, gradient in "
              f"{rec['grad_share_within']:.0%}, "
              f"median {rec['median_time_s']:.2f} s")
    out["hand_tuned"] = hand
    ok = [h for h in hand if h["share_within"] >= out["accuracy"]["share_within"]
          and h["grad_share_within"] >= out["accuracy"]["grad_share_within"]]
    if ok:
        best = min(ok, key=lambda h: h["median_time_s"])
        out["time_ratio_vs_hand_tuned"] = out["accuracy"]["median_time_s"] / best["median_time_s"]
        print(f"  cheapest fixed setting as accurate: {best['probes']} probes; --accuracy takes "
              f"{out['time_ratio_vs_hand_tuned']:.2f}x its time (target <= 1.5x)")
    else:
        out["time_ratio_vs_hand_tuned"] = None
        print("  no fixed setting of the sweep was as accurate")

    path = Path(args.out) if args.out else RESULTS / ("error_bars_quick.json" if args.quick else "error_bars.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    png = Path(args.png) if args.png else path.with_suffix(".png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist([z_loss, zg.reshape(-1).tolist()], bins=20, range=(-4, 4), density=True,
                label=["loss", "gradient components"])
        grid = torch.linspace(-4, 4, 200)
        ax.plot(grid, torch.exp(-grid**2 / 2) / (2 * torch.pi) ** 0.5, "k--", label="N(0, 1)")
        ax.set_xlabel("(estimate - Cholesky) / reported SE")
        ax.set_title(f"{args.data} n = {n}, {seeds} seeds")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)
    except ImportError:  # matplotlib is optional at run time
        png = None
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return out


if __name__ == "__main__":
    main()
