"""Predictive variances at many test points, fast and with a per-point error bound: time and error of each variance
method against the exact posterior.

Run:  python benchmarks/variances.py                 (elevators, all 14 940 training rows)
      python benchmarks/variances.py --quick         (n = 600; run by the test suite)

Hyperparameters come from an exact (Cholesky) fit on a ``--fit-n`` subsample of the training split; then, on the
whole training split (elevators split 0: n = 14 940, the demo's), each method predicts at the test split (1659
points) and is compared with the exact posterior (one Cholesky of K̂):

* ``cholesky``: ``hook.predict`` with ``variance_method="cholesky"`` (the exact reference, timed);
* ``cached``: ``variance_method="cached"`` (:class:`gpnys.gp.variance.LocalVariance`), and ``cached+refine``
  (``variance_rel_error=--refine``: points whose bound exceeds that share are recomputed by PCG);
* ``love``: GPyTorch's ``fast_pred_var()`` (LOVE) with its defaults under CG (``max_cholesky_size(0)``);
* ``pcg``: ``variance_method="pcg"`` (exact to tolerance; off by default: ~20 n² m flops).

Columns: time of the whole prediction (mean and variances) and of the variances alone (``hook.prediction_time``;
for LOVE the whole call), the relative variance error (median, max) against
Cholesky, the test NLL and its difference, the share of points whose error is within the reported bound, and the
median bound relative to the variance. Prints a table, writes JSON and a PNG (error against bound).
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
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel, fit, gaussian_nll

RESULTS = Path(__file__).resolve().parent / "results"


def _model(X, y, kernel, state=None):
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    m = ExactGPModel(X, y, lik, kernel=kernel, ard=True).double()
    if state is not None:
        m.load_state_dict(state, strict=False)
    return m


def _gpnys(m, T, **settings):
    with use_preconditioner(m, "auto", settings=EstimatorSettings(**settings)) as hook:
        t0 = time.perf_counter()
        mean, var = hook.predict(T)
        t = time.perf_counter() - t0
    return t, mean, var, hook.variance_bound, hook.variance_method_used, hook.prediction_time["variance_s"]


def _love(m, T):
    m.eval()
    t0 = time.perf_counter()
    with torch.no_grad(), gpytorch.settings.fast_pred_var(), gpytorch.settings.max_cholesky_size(0):
        pred = m.likelihood(m(T))
        mean, var = pred.mean, pred.variance
    t = time.perf_counter() - t0
    return t, mean, var, None, "love", t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", default="elevators")
    ap.add_argument("--n", type=int, default=None, help="training rows (default: the whole split)")
    ap.add_argument("--kernel", default="matern32")
    ap.add_argument("--fit-n", type=int, default=2000, help="subsample of the exact hyperparameter fit")
    ap.add_argument("--fit-iters", type=int, default=60)
    ap.add_argument("--refine", type=float, default=0.05, help="variance_rel_error of cached+refine")
    ap.add_argument("--methods", default="cholesky,cached,cached+refine,love")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n = 600 if args.quick else args.n
    fit_n, fit_iters = (300, 5) if args.quick else (args.fit_n, args.fit_iters)
    ds = datasets.load(args.data, split=0)
    X, y, T, yt = (t.double() for t in (ds.train_x, ds.train_y, ds.test_x, ds.test_y))
    if n is not None:
        X, y = X[:n], y[:n]
    if args.quick:
        T, yt = T[:300], yt[:300]
    g = torch.Generator().manual_seed(0)
    sub = torch.randperm(X.shape[0], generator=g)[:fit_n]
    small = _model(X[sub], y[sub], args.kernel)
    t0 = time.perf_counter()
    with gpytorch.settings.max_cholesky_size(10**9):  # the exact fit: GPyTorch's Cholesky
        fit(small, iters=fit_iters, lr=0.1, progress=False)
    fit_s = time.perf_counter() - t0
    state = {k: v for k, v in small.state_dict().items()}
    print(f"{args.data}: n = {X.shape[0]}, d = {X.shape[1]}, {T.shape[0]} test points; hyperparameters from an "
          f"exact fit on {fit_n} rows ({fit_iters} Adam steps, {fit_s:.1f} s)", flush=True)

    runs = {
        "cholesky": lambda m: _gpnys(m, T, variance_method="cholesky", dense_limit_bytes=2**40),
        "cached": lambda m: _gpnys(m, T, variance_method="cached"),
        "cached+refine": lambda m: _gpnys(m, T, variance_method="cached", variance_rel_error=args.refine),
        "pcg": lambda m: _gpnys(m, T, variance_method="pcg"),
        "love": lambda m: _love(m, T),
    }
    methods = [s for s in args.methods.split(",") if s]
    if "cholesky" not in methods:
        methods.insert(0, "cholesky")
    rows, ref = [], None
    noise = None
    for name in methods:
        m = _model(X, y, args.kernel, state)
        noise = float(m.likelihood.noise.detach())
        t, mean, var, bound, used, tv = runs[name](m)
        if ref is None:
            ref = (mean, var)
        latent_ref = ref[1] - noise
        err = (var - ref[1]).abs() / latent_ref
        row = {"method": name, "used": used, "time_s": t, "variance_time_s": tv,
               "rel_err_median": float(err.median()), "rel_err_max": float(err.max()),
               "nll": gaussian_nll(yt, mean, var), "mean_max_diff": float((mean - ref[0]).abs().max())}
        row["nll_diff"] = row["nll"] - gaussian_nll(yt, *ref)
        if bound is not None:
            row["covered"] = float(((var - ref[1]).abs() <= bound * (1 + 1e-9) + 1e-12).double().mean())
            row["bound_over_var_median"] = float((bound / latent_ref).median())
            row["bound_over_var_max"] = float((bound / latent_ref).max())
            row["_err"], row["_bound"] = (err * latent_ref).tolist(), bound.tolist()
        rows.append(row)
        print(f"  {name}: {t:.2f} s, variance error median {row['rel_err_median']:.1e}, max {row['rel_err_max']:.1e}",
              flush=True)
    base = rows[0]["time_s"]
    print("\n| method | used | time s | variances alone s | vs Cholesky | var err median | var err max | NLL | ΔNLL | "
          "within bound | bound/var median |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        cov = f"{100 * r['covered']:.1f} %" if "covered" in r else "n/a"
        bnd = f"{r['bound_over_var_median']:.2e}" if "covered" in r else "n/a"
        print(f"| {r['method']} | {r['used']} | {r['time_s']:.2f} | {r['variance_time_s']:.2f} | "
              f"{r['time_s'] / base:.3f} | "
              f"{r['rel_err_median']:.2e} | {r['rel_err_max']:.2e} | {r['nll']:.4f} | {r['nll_diff']:+.1e} | "
              f"{cov} | {bnd} |")
    meta = {"data": args.data, "n": X.shape[0], "m": T.shape[0], "kernel": args.kernel, "noise": noise,
            "fit_n": fit_n, "fit_iters": fit_iters, "threads": torch.get_num_threads()}
    prov = provenance(__file__, argv, "cpu")
    out = Path(args.out) if args.out else RESULTS / ("variances_quick.json" if args.quick else "variances.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "provenance": prov,
                               "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]},
                              indent=1))
    _plot(rows, Path(args.png) if args.png else out.with_suffix(".png"))
    print(f"\nwrote {out}")
    return {"meta": meta, "provenance": prov, "rows": rows}


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for r in rows:
        if "_bound" in r and r["method"] != "cholesky":
            b = torch.tensor(r["_bound"]).clamp_min(1e-16)
            e = torch.tensor(r["_err"]).clamp_min(1e-16)
            ax.loglog(b, e, ".", ms=3, label=r["method"])
    lim = [1e-10, 1.0]
    ax.plot(lim, lim, "k--", lw=0.8, label="error = bound")
    ax.set_xlabel("reported bound")
    ax.set_ylabel("|variance - Cholesky|")
    ax.legend()
    ax.set_title("per-point variance error against its bound")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
