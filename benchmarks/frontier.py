"""The accuracy–time frontier of one ``-MLL/n`` value + gradient, gpnys against GPyTorch and HiGP.

Run:  python benchmarks/frontier.py                  (elevators, bike, kin40k; n = 10 000; RBF and Matérn-3/2;
                                                      about 15 minutes per case on 2 cores, --resume continues)
      python benchmarks/frontier.py --refresh gpnys  (re-measure gpnys in the cases already in the JSON, keeping
                                                      the peers' rows: after a gpnys change)
      python benchmarks/frontier.py --quick          (elevators n = 500, RBF, a few settings; run by the tests)

For each data set (a seeded subset of ``--n`` training rows) and kernel, the hyperparameters are those an exact
(Cholesky) fit finds on a ``--fit-n`` subsample (isotropic with zero mean: HiGP has neither ARD nor a mean), and
Cholesky gives the reference loss and gradient at the full subset. Then every setting of each method runs once:

* **gpnys** (``auto``): landmarks k (300, 500, 1000) and probes (16, 64, 128) swept, CG tolerance 3e-2 (1e-1 saves
  about a tenth at the same errors, measured on elevators; k = 100 is dominated: 80 CG iterations);
* **GPyTorch** (its CG + SLQ, ``max_cholesky_size(0)``): pivoted-Cholesky rank 15/100/300, CG tolerance 1/0.01,
  probes 10/30, Lanczos steps 20/100;
* **HiGP** (when installed): AFN rank 50/1000, fill level 0/50, Lanczos steps 10/50, probes 10/50.

Errors: the loss's relative error and the worst gradient component's (``gpnys.baselines.mll.grad_errors``). With
``--seeds 0,1,2`` every setting runs once per estimator seed (the probes; data subset and hyperparameters stay
those of ``--seed``) and its error is the root mean square over the seeds (per gradient component, then the worst
component), its time the median: one draw of a stochastic estimator can land near the truth by luck.
``--max-time T`` keeps the seeds affordable: a setting that took more than ``T`` seconds in the case's earlier run
(the JSON, with ``--refresh``) or at its first seed is not run (further), and the target is checked at budgets up
to ``T`` only (recorded as the case's ``max_time_s``); ``--refresh ... --beyond`` then runs just those slower
settings at the same seeds, without a limit, and checks every budget. For a time
budget ``t`` a method's error is the best error among its settings that took at most ``t``; the target is that from
gpnys's cheapest setting up, gpnys's error is below both peers' at every budget (checked at every measured time),
for the loss and the gradient. Prints a table per case, writes JSON and a PNG (error against time, step frontiers).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import gpytorch
import torch

from gpnys import datasets
from gpnys.baselines.higp_adapter import evaluate_higp
from gpnys.baselines.mll import evaluate, grad_errors
from gpnys.baselines.provenance import provenance
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel, fit, hyperparameters

RESULTS = Path(__file__).resolve().parent / "results"

GPYTORCH_GRID = {"rank": (15, 100, 300), "cg_tol": (1.0, 0.01), "probes": (10, 30), "lanczos": (20, 100)}
HIGP_GRID = {"rank": (50, 1000), "lfil": (0, 50), "lanczos": (10, 50), "probes": (10, 50)}
GPNYS_GRID = {"k": (300, 500, 1000), "probes": (16, 64, 128), "cg_tol": (3e-2,)}
QUICK = {"gpnys": {"k": (50,), "probes": (8, 32), "cg_tol": (3e-2,)},
         "gpytorch": {"rank": (15,), "cg_tol": (1.0, 0.01), "probes": (10,), "lanczos": (20,)},
         "higp": {"rank": (50,), "lfil": (0,), "lanczos": (10,), "probes": (10,)}}


def _grid(spec: dict) -> list[dict]:
    return [dict(zip(spec, values)) for values in itertools.product(*spec.values())]


def _exact_hyperparameters(X, y, kernel: str, fit_n: int, iters: int, seed: int) -> dict:
    """Isotropic zero-mean exact fit (GPyTorch's Cholesky) on a seeded subsample."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(X.shape[0], generator=g)[:fit_n]
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    m = ExactGPModel(X[idx], y[idx], lik, kernel=kernel, mean="zero").double()
    with gpytorch.settings.max_cholesky_size(10**9):
        fit(m, iters=iters, lr=0.1, progress=False)
    h = hyperparameters(m)
    return {"lengthscale": float(h["lengthscale"]), "outputscale": float(h["outputscale"]), "noise": float(h["noise"])}


def _gpytorch(X, y, common, s):
    with gpytorch.settings.max_preconditioner_size(s["rank"]), gpytorch.settings.cg_tolerance(s["cg_tol"]), \
            gpytorch.settings.num_trace_samples(s["probes"]), \
            gpytorch.settings.max_lanczos_quadrature_iterations(s["lanczos"]):
        return evaluate(X, y, "gpytorch", **common)


def _gpnys(X, y, common, s):
    settings = EstimatorSettings(num_probes=s["probes"], cg_tolerance=s["cg_tol"])
    return evaluate(X, y, "auto", settings=settings, k=min(s["k"], X.shape[0] - 1), **common)


def _higp(X, y, common, s):
    return evaluate_higp(X, y, rank=min(s["rank"], X.shape[0] - 1), lfil=s["lfil"], lanczos_steps=s["lanczos"],
                         probes=s["probes"], **common)


def _measure(run, X, y, common: dict, s: dict, seeds: list[int], ref: dict, method: str, command: str,
             max_time: float = float("inf"), earlier: float | None = None) -> dict:
    """One setting at each estimator seed: median time, root-mean-square errors over the seeds (module docstring);
    a setting slower than ``max_time`` in the earlier run (``earlier`` seconds) or at its first seed is marked
    ``over_max_time`` and not run (further)."""
    times, losses, grads = [], [], []
    for seed in seeds:
        slow = [t for t in (earlier, *times[:1]) if t is not None and t > max_time]
        if slow:
            return {"method": method, "settings": s, "time_s": slow[0], "over_max_time": True, "command": command}
        t0 = time.perf_counter()
        try:
            r = run(X, y, {**common, "seed": seed}, s)
        except Exception as exc:  # a peer's setting that fails is recorded, not fatal
            return {"method": method, "settings": s, "error": f"{type(exc).__name__}: {exc}"[:200],
                    "time_s": time.perf_counter() - t0}
        times.append(r["time_s"])
        losses.append(abs(r["loss"] - ref["loss"]) / abs(ref["loss"]))
        grads.append(grad_errors(r["grad"], ref["grad"]))
    rms = lambda v: (sum(x * x for x in v) / len(v)) ** 0.5  # noqa: E731
    ge = {k: rms([g[k] for g in grads]) for k in grads[0]}
    row = {"method": method, "settings": s, "time_s": statistics.median(times), "loss_rel_error": rms(losses),
           "grad_rel_error": max(ge.values()), "grad_errors": ge, "command": command}
    if len(seeds) > 1:
        row.update(seeds=seeds, times_s=times, loss_rel_errors=losses,
                   grad_rel_errors=[max(g.values()) for g in grads])
    return row


def frontier(points: list[tuple[float, float]], budgets: list[float]) -> list[float]:
    """Best error among the points ``(time, error)`` within each budget (``inf`` before the cheapest)."""
    return [min((e for t, e in points if t <= b), default=float("inf")) for b in budgets]


def check(rows: list[dict], key: str, max_time: float = float("inf")) -> dict:
    """The target for one error ``key``: at every measured time from gpnys's cheapest setting up (to ``max_time``),
    gpnys's frontier is below each peer's. Returns ``{"met", "budgets", "<method>": frontier}``."""
    pts = {m: [(r["time_s"], r[key]) for r in rows if r["method"] == m] for m in {r["method"] for r in rows}}
    start = min(t for t, _ in pts["gpnys"])
    budgets = sorted({t for p in pts.values() for t, _ in p if start <= t <= max_time})
    out = {"budgets": budgets, **{m: frontier(p, budgets) for m, p in pts.items()}}
    peers = [m for m in pts if m != "gpnys"]
    out["met"] = all(g < out[m][i] for m in peers for i, g in enumerate(out["gpnys"]))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", default="elevators,bike,kin40k")
    ap.add_argument("--kernels", default="rbf,matern32")
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--fit-n", type=int, default=2000)
    ap.add_argument("--fit-iters", type=int, default=60)
    ap.add_argument("--methods", default="gpnys,gpytorch,higp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default=None, help="estimator seeds per setting, e.g. 0,1,2 (default: --seed only)")
    ap.add_argument("--max-time", type=float, default=None, help="skip settings slower than this many seconds and "
                    "check the target up to it (module docstring)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--resume", action="store_true", help="skip the cases already in the output JSON")
    ap.add_argument("--refresh", default="", help="methods to re-run in the cases already in the JSON (the other "
                    "methods' rows are kept, the case records which run measured which); implies --resume")
    ap.add_argument("--beyond", action="store_true", help="with --refresh: run, at --seeds, only the settings the "
                    "JSON marks over_max_time (slower than its --max-time), with no time limit, and keep every other "
                    "row: the check then covers every budget (module docstring)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    if args.beyond and (not args.refresh or args.max_time is not None):
        ap.error("--beyond needs --refresh and no --max-time")
    if args.threads:
        torch.set_num_threads(args.threads)
    data, kernels, n = args.data.split(","), args.kernels.split(","), args.n
    grids = {"gpnys": _grid(GPNYS_GRID), "gpytorch": _grid(GPYTORCH_GRID), "higp": _grid(HIGP_GRID)}
    fit_n, fit_iters = args.fit_n, args.fit_iters
    if args.quick:
        data, kernels, n, fit_n, fit_iters = ["elevators"], ["rbf"], 500, 300, 10
        grids = {m: _grid(g) for m, g in QUICK.items()}
    methods = [m for m in args.methods.split(",") if m]
    seeds = [int(v) for v in args.seeds.split(",") if v] if args.seeds else [args.seed]
    max_time = float("inf") if args.max_time is None else float(args.max_time)
    if not seeds:
        raise SystemExit("--seeds needs at least one seed")
    if "higp" in methods and importlib.util.find_spec("higp") is None:
        print("higp not installed (pip install higp): skipped")
        methods.remove("higp")
    runners = {"gpnys": _gpnys, "gpytorch": _gpytorch, "higp": _higp}
    out = Path(args.out) if args.out else RESULTS / ("frontier_quick.json" if args.quick else "frontier.json")
    record = provenance(__file__, argv)
    command = record["command"]  # each row and case records the run that measured it (--refresh keeps older ones)
    meta = {"threads": torch.get_num_threads(), "fit_n": fit_n, "fit_iters": fit_iters}
    # --resume: keep the cases already in the JSON (a checkpoint per case; the whole grid takes about an hour)
    refresh = [m for m in args.refresh.split(",") if m]
    cases = json.loads(out.read_text())["cases"] if (args.resume or refresh) and out.exists() else []
    done = {(c["data"], c["kernel"], c["n_requested"]): c for c in cases}
    for name, kernel in itertools.product(data, kernels):
        old = done.get((name, kernel, n))
        if old is not None and not refresh:
            print(f"{name} {kernel}: in {out} already (--resume)")
            continue
        ds = datasets.load(name, split=0)
        g = torch.Generator().manual_seed(args.seed)
        idx = torch.randperm(ds.train_x.shape[0], generator=g)[:n]
        X, y = ds.train_x[idx].double(), ds.train_y[idx].double()
        hyper = (old["hyperparameters"] if old is not None
                 else _exact_hyperparameters(X, y, kernel, min(fit_n, X.shape[0]), fit_iters, args.seed))
        common = {"kernel": kernel, **hyper, "seed": args.seed}
        ref = evaluate(X, y, "exact", **common)
        print(f"\n{name} n = {X.shape[0]}, {kernel}: lengthscale {hyper['lengthscale']:.3g}, outputscale "
              f"{hyper['outputscale']:.3g}, noise {hyper['noise']:.3g}; Cholesky {ref['time_s']:.1f} s")
        rows, run_methods = [], methods
        # --beyond: (method, settings) of the earlier run's rows over its --max-time, the ones to run
        slow = [(r["method"], r["settings"]) for r in old["rows"]
                if r["method"] in refresh and r.get("over_max_time")] if old is not None and args.beyond else []
        if old is not None:  # --refresh: keep the other methods' rows of the earlier run (--beyond: all but `slow`)
            rows = [dict(r, command=r.get("command", old["command"])) for r in old["rows"]
                    if (r["method"], r["settings"]) not in slow
                    and (args.beyond or r["method"] not in refresh)]
            run_methods = [m for m in methods if m in refresh]
        for method in run_methods:
            if args.beyond and not any(m == method for m, _ in slow):
                continue
            if not cases or old is not None:  # warm-up (imports, first-call allocations) outside the timings
                try:
                    runners[method](X, y, common, grids[method][0])
                except Exception:
                    pass
            for s in grids[method]:
                if args.beyond and (method, s) not in slow:
                    continue
                before = [r["time_s"] for r in (old or {}).get("rows", []) if r["method"] == method and
                          r["settings"] == s and not args.beyond]
                rows.append(_measure(runners[method], X, y, common, s, seeds, ref, method, command, max_time,
                                     before[0] if before else None))
        ok = [r for r in rows if "error" not in r and "over_max_time" not in r]
        print("| method | settings | time s | loss error | worst gradient error |")
        print("| --- | --- | ---: | ---: | ---: |")
        for r in sorted(ok, key=lambda r: (r["method"], r["time_s"])):
            print(f"| {r['method']} | {r['settings']} | {r['time_s']:.2f} | {r['loss_rel_error']:.1e} | "
                  f"{r['grad_rel_error']:.1%} |")
        for r in rows:
            if "error" in r:
                print(f"| {r['method']} | {r['settings']} | failed | {r['error']} | |")
        sys.stdout.flush()
        checks = {key: check(ok, key, max_time) for key in ("loss_rel_error", "grad_rel_error")} if len(
            {r["method"] for r in ok}) > 1 and any(r["method"] == "gpnys" for r in ok) else {}
        for key, c in checks.items():
            print(f"target ({key}): gpnys below every peer at every budget from its cheapest setting up: {c['met']}")
        case = {"data": name, "kernel": kernel, "n": X.shape[0], "n_requested": n, "hyperparameters": hyper,
                "reference": {"loss": ref["loss"], "time_s": ref["time_s"]}, "rows": rows, "checks": checks,
                "seeds": sorted({v for r in rows for v in r.get("seeds", [args.seed])}),
                "max_time_s": None if args.max_time is None else max_time, "command": command}
        if old is not None:
            cases[cases.index(old)] = case
        else:
            cases.append(case)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "cases": cases, "provenance": record}, indent=1))
        sys.stdout.flush()
    _plot(cases, Path(args.png) if args.png else out.with_suffix(".png"))
    print(f"\nwrote {out}")
    return {"meta": meta, "cases": cases, "provenance": record}


def _plot(cases: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, len(cases), figsize=(4 * len(cases), 7), squeeze=False)
    colors = {"gpnys": "C0", "gpytorch": "C1", "higp": "C2"}
    for j, case in enumerate(cases):
        ok = [r for r in case["rows"] if "error" not in r and "over_max_time" not in r]
        for i, key in enumerate(("loss_rel_error", "grad_rel_error")):
            ax = axes[i][j]
            for m in sorted({r["method"] for r in ok}):
                pts = sorted((r["time_s"], max(r[key], 1e-8)) for r in ok if r["method"] == m)
                ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o", ms=3, color=colors.get(m), alpha=0.5)
                best, fx, fy = float("inf"), [], []
                for t, e in pts:
                    best = min(best, e)
                    fx.append(t)
                    fy.append(best)
                ax.step(fx, fy, where="post", color=colors.get(m), label=m)
            if case.get("max_time_s"):  # the budgets checked end here
                ax.axvline(case["max_time_s"], color="0.6", ls="--", lw=0.8)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # overlapping 2x10^0, 3x10^0, ...
            ax.set_xlabel("time s")
            ax.set_ylabel("loss error" if i == 0 else "worst gradient error")
            if i == 0:
                ax.set_title(f"{case['data']} {case['kernel']} n={case['n']}, {len(case.get('seeds', [0]))} seeds",
                             fontsize=9)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
