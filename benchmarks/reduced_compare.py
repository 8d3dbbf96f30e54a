"""Nyström-reduced GP posteriors against the full GP on elevators, bike and kin40k: RKHS error and test RMSE against
the number of landmarks, random Fourier features and NYTRO.

Run:  python benchmarks/reduced_compare.py --threads 2      (~15 min on 2 cores)
      python benchmarks/reduced_compare.py --quick          (n = 300; run by the test suite)

Per data set (split 0 of the data set's own test mask; a seeded subsample of ``--n`` training rows so the full GP
is one dense Cholesky; at most ``--n-test`` test rows), RBF ARD kernel with hyperparameters from an exact-MLL fit
(gpnys ``auto`` preconditioned training, ``--fit-iters`` Adam steps on a ``--fit-n`` subsample; cached in
``results/reduced_hyper.json``, ``--refit`` to redo):

1. GSA (both coefficient choices) vs LLA (= NCR; NCR is checked against LLA at one m) — exact RKHS error
   ``|f - f*|_H`` ([SPA] eq. (15), (19): W. Li, M. Liu, D. Zhang, "Geometric Interpretation of Running
   Nyström-Based Kernel Machines and Error Analysis") and test RMSE vs m, for every landmark rule (uniform, fps,
   kmeans, leverage). Is [SPA]'s conjecture "GSA is more accurate than LLA" true here?
2. Nyström (LLA, uniform landmarks, as in Yang et al. 2012) vs random Fourier features at equal budgets:
   ``m`` landmarks vs ``m`` frequencies (``2m`` features), ``--seeds`` seeds each.
3. NYTRO vs Nyström KRR (= the NCR mean at ``sigma^2 = n lambda``): test RMSE along NYTRO's path (every step)
   and along the Tikhonov path at ``lambda = 1 / (gamma t)``, with their times (``--nytro-m`` uniform landmarks).

Prints tables, writes ``results/reduced_compare.json`` and ``results/reduced_compare.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import warnings
from pathlib import Path

import gpytorch
import torch

from gpnys import datasets
from gpnys.baselines.provenance import provenance
from gpnys.checks import NumericalWarning
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.training import ExactGPModel, fit, hyperparameters
from gpnys.kernels import make_kernel
from gpnys.landmarks import select_landmarks
from gpnys.reduced import ExactPosterior, nystrom_krr, nytro
from gpnys.reduced.evaluate import evaluate_method
from gpnys.reduced.nytro import predict as nytro_predict

RESULTS = Path(__file__).resolve().parent / "results"
RULES = ("uniform", "fps", "kmeans", "leverage")


def fitted_hyper(name: str, args) -> dict:
    """Exact-MLL hyperparameters (gpnys auto training), cached per (data set, fit-n, iters)."""
    path = RESULTS / ("reduced_hyper_quick.json" if args.quick else "reduced_hyper.json")
    cache = json.loads(path.read_text()) if path.exists() and not args.refit else {}
    key = f"{name}/n={args.fit_n}/iters={args.fit_iters}/seed={args.seed}"
    if key not in cache:
        ds = datasets.load(name, split=0, n=args.fit_n, seed=args.seed)
        lik = gpytorch.likelihoods.GaussianLikelihood().to(ds.train_x)
        model = ExactGPModel(ds.train_x, ds.train_y, lik, kernel="rbf", ard=True, mean="constant").to(ds.train_x)
        t0 = time.perf_counter()
        with use_preconditioner(model, "auto", seed=args.seed):
            fit(model, iters=args.fit_iters, lr=0.1, progress=False, seed=args.seed,
                settings=lambda n: contextlib.nullcontext())
        cache[key] = {**hyperparameters(model), "fit_s": time.perf_counter() - t0}
        RESULTS.mkdir(exist_ok=True)
        path.write_text(json.dumps(cache, indent=1))
    return cache[key]


def kernel_from(h: dict, d: int) -> gpytorch.kernels.Kernel:
    k = make_kernel("rbf", ard_num_dims=d).double()
    k.base_kernel.lengthscale = torch.as_tensor(h["lengthscale"], dtype=torch.float64)
    k.outputscale = h["outputscale"]
    return k


def run_dataset(name: str, args) -> dict:
    h = fitted_hyper(name, args)
    ds = datasets.load(name, split=0, n=args.n, seed=args.seed, n_test=args.n_test)
    X, y, Xt, yt = ds.train_x, ds.train_y, ds.test_x, ds.test_y
    k, noise, mean = kernel_from(h, X.shape[1]), h["noise"], h["mean"]
    t0 = time.perf_counter()
    exact = ExactPosterior(k, X, y, noise, prior_mean=mean, seed=args.seed)
    exact_s = time.perf_counter() - t0
    common = {"noise": noise, "prior_mean": mean, "exact": exact, "transform": ds.transform}
    out = {"data": ds.describe(), "n": ds.n, "n_test": int(Xt.shape[0]), "hyperparameters": h, "exact_s": exact_s,
           "exact": evaluate_method("exact", k, X, y, Xt, yt, **common), "approaches": [], "rff": [], "nytro": None}
    print(f"\n{ds.describe()}: noise {noise:.3g}, outputscale {h['outputscale']:.3g}; exact RMSE "
          f"{out['exact']['test_rmse']:.4f}, NLL {out['exact']['test_nll']:.4f} (|f*|_H = {exact.quad ** 0.5:.3g})")
    print(f"{'rule':>9} {'m':>5} {'method':>12} {'|f-f*|_H':>10} {'RMSE':>9} {'NLL':>8} {'fit s':>7}")
    ms = [m for m in args.m if m <= ds.n]
    for rule in RULES:
        for m in ms:
            for method, opts in (("lla", {}), ("gsa", {"coef": "woodbury"}), ("gsa", {"coef": "min_norm"})) + (
                    (("ncr", {}),) if m == ms[0] else ()):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", NumericalWarning)
                    rec = evaluate_method(method, k, X, y, Xt, yt, m=m, landmarks=rule, seed=args.seed, **common,
                                          **opts)
                rec.update(coef=opts.get("coef"), warnings=[str(w.message)[:160] for w in caught])
                out["approaches"].append(rec)
                label = method + (f"-{opts['coef']}" if opts else "")
                nll = f"{rec['test_nll']:8.3f}" if rec["test_nll"] is not None else f"{'-':>8}"
                print(f"{rule:>9} {m:>5} {label:>12} {rec['error_vs_exact']:10.4g} {rec['test_rmse']:9.4f} {nll} "
                      f"{rec['fit_s']:7.2f}")
    print(f"{'m':>5} {'seed':>4} {'Nystrom RMSE':>12} {'RFF RMSE':>9} {'|dmean| Nys':>11} {'|dmean| RFF':>11}")
    for m in ms:
        for s in range(args.seeds):
            pair = {meth: evaluate_method(meth, k, X, y, Xt, yt, m=m, landmarks="uniform", seed=args.seed + s,
                                          **common) for meth in ("lla", "rff")}
            keys = ("test_rmse", "test_nll", "mean_rmse_vs_exact", "fit_s")
            out["rff"].append({"m": m, "seed": args.seed + s, **{f"{a}_{b}": pair[a][b] for a in pair for b in keys}})
            r = out["rff"][-1]
            print(f"{m:>5} {s:>4} {r['lla_test_rmse']:12.4f} {r['rff_test_rmse']:9.4f} "
                  f"{r['lla_mean_rmse_vs_exact']:11.4f} {r['rff_mean_rmse_vs_exact']:11.4f}")
    out["nytro"] = nytro_path(k, ds, mean, args)
    return out


def nytro_path(k, ds, mean: float, args) -> dict:
    """NYTRO's path (80/20 train/validation split) and the Tikhonov path at lambda = 1/(gamma t)."""
    X, y, Xt, yt = ds.train_x, ds.train_y - mean, ds.test_x, ds.test_y - mean
    perm = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(args.seed))
    val, tr = perm[: X.shape[0] // 5], perm[X.shape[0] // 5 :]
    C, _ = select_landmarks(X[tr], min(args.nytro_m, tr.numel()), "uniform", seed=args.seed)
    sd = float(ds.transform.y_std) if hasattr(ds.transform, "y_std") else 1.0
    t0 = time.perf_counter()
    path = nytro(k, X[tr], y[tr], C, t_max=args.nytro_t, X_val=X[val], y_val=y[val], Z=Xt, stop="best")
    t_nytro = time.perf_counter() - t0
    rmse_path = ((path.predictions - yt).square().mean(1).sqrt() * sd).tolist()
    ts = sorted({max(1, round(args.nytro_t ** (i / 15))) for i in range(16)})
    lam = torch.tensor([path.lam(t) for t in ts], dtype=X.dtype)
    t0 = time.perf_counter()
    alphas = nystrom_krr(k, X[tr], y[tr], C, lam)
    t_krr = time.perf_counter() - t0
    krr_rmse = [float((nytro_predict(k, C, a, Xt) - yt).square().mean().sqrt()) * sd for a in alphas]
    best_krr = min(range(len(ts)),
                   key=lambda i: float((nytro_predict(k, C, alphas[i], X[val]) - y[val]).square().mean()))
    res = {"m": C.shape[0], "gamma": path.gamma, "t_max": args.nytro_t, "t_stop": path.t_stop,
           "nytro_s": t_nytro, "nytro_s_per_step": t_nytro / args.nytro_t, "test_rmse_path": rmse_path,
           "test_rmse_at_stop": rmse_path[path.t_stop - 1], "krr_t": ts, "krr_lambda": lam.tolist(),
           "krr_test_rmse": krr_rmse, "krr_s": t_krr, "krr_best_t_by_validation": ts[best_krr],
           "krr_test_rmse_at_best": krr_rmse[best_krr]}
    print(f"NYTRO m = {res['m']}: {args.nytro_t} steps in {t_nytro:.2f} s, validation-best t = {path.t_stop}, "
          f"test RMSE {res['test_rmse_at_stop']:.4f}; Nyström KRR path ({len(ts)} lambdas) {t_krr:.2f} s, "
          f"validation-best t = {ts[best_krr]}, test RMSE {res['krr_test_rmse_at_best']:.4f}")
    return res


def plot(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")
    names = list(results)
    fig, axes = plt.subplots(len(names), 4, figsize=(17, 3.6 * len(names)), squeeze=False)
    styles = {"lla": "-", "gsa-woodbury": ":", "gsa-min_norm": "--"}
    for row, name in zip(axes, names):
        r = results[name]
        for rule, color in zip(RULES, ("C0", "C1", "C2", "C3")):
            for label, ls in styles.items():
                pts = [a for a in r["approaches"] if a["landmarks"] == rule
                       and (a["method"] + (f"-{a['coef']}" if a.get("coef") else "")) == label]
                if pts:
                    row[0].plot([a["m"] for a in pts], [a["error_vs_exact"] for a in pts], ls, color=color,
                                marker=".", label=f"{label} ({rule})")
                    row[1].plot([a["m"] for a in pts], [a["test_rmse"] for a in pts], ls, color=color, marker=".")
        row[1].axhline(r["exact"]["test_rmse"], color="k", lw=0.8, label="exact GP")
        for key, label in (("lla_test_rmse", "Nyström (m landmarks)"), ("rff_test_rmse", "RFF (2m features)")):
            ms = sorted({e["m"] for e in r["rff"]})
            row[2].plot(ms, [sum(e[key] for e in r["rff"] if e["m"] == m) / sum(e["m"] == m for e in r["rff"])
                             for m in ms], marker="o", label=label)
        row[2].axhline(r["exact"]["test_rmse"], color="k", lw=0.8, label="exact GP")
        ny = r["nytro"]
        row[3].plot(range(1, len(ny["test_rmse_path"]) + 1), ny["test_rmse_path"], label="NYTRO path (t)")
        row[3].plot(ny["krr_t"], ny["krr_test_rmse"], "o", label="Nyström KRR at lambda = 1/(gamma t)")
        row[3].axvline(ny["t_stop"], color="C0", lw=0.6, ls="--")
        row[3].axhline(r["exact"]["test_rmse"], color="k", lw=0.8, label="exact GP")
        for ax, title, xl, yl in ((row[0], "RKHS error to the full GP", "m", "|f - f*|_H"),
                                  (row[1], "test RMSE", "m", "RMSE"), (row[2], "Nyström vs RFF", "m", "test RMSE"),
                                  (row[3], f"NYTRO, m = {ny['m']}", "t (steps)", "test RMSE")):
            ax.set(xscale="log", title=f"{name}: {title}", xlabel=xl, ylabel=yl)
            ax.legend(fontsize=6)
        row[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="elevators n = 300, m = 20,50, 50 NYTRO steps")
    ap.add_argument("--data", default="elevators,bike,kin40k")
    ap.add_argument("--n", type=int, default=10000, help="training subsample (full GP by dense Cholesky)")
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--m", default="100,200,500,1000,2000")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the Nyström-vs-RFF comparison")
    ap.add_argument("--fit-n", type=int, default=5000)
    ap.add_argument("--fit-iters", type=int, default=30)
    ap.add_argument("--refit", action="store_true")
    ap.add_argument("--nytro-m", type=int, default=1000)
    ap.add_argument("--nytro-t", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.data, args.n, args.n_test, args.m, args.seeds = "elevators", 300, 200, "20,50", 1
        args.fit_n, args.fit_iters, args.nytro_m, args.nytro_t = 300, 3, 50, 50
    args.m = [int(v) for v in args.m.split(",")]
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    prov = provenance(__file__, argv, "cpu")
    results = {name: run_dataset(name, args) for name in args.data.split(",")}
    torch.set_num_threads(threads)
    RESULTS.mkdir(exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / (
        "reduced_compare_quick.json" if args.quick else "reduced_compare.json")
    path.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "provenance": prov, "results": results},
                               indent=1))
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
