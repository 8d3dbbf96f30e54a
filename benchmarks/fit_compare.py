"""End-to-end fits, exact Cholesky vs GPyTorch vs HiGP vs gpnys ``auto``: training time, loss trace, test RMSE and NLL.

Run:  python benchmarks/fit_compare.py --iters 40  (elevators split 0, all ~15k training points; ~75 min)
      python benchmarks/fit_compare.py --data synthetic3d --no-standardize --n 50000 --iters 10 --methods higp,auto \
          --gpytorch-cholesky-steps 0 --eval-points 2   (HiGP's H2 mode against gpnys on 3-D points, 2 cores)
      python benchmarks/fit_compare.py --quick     (n = 400, 3 steps; run by the test suite)

Matérn-3/2, the same Adam steps (``--lr``, ``--iters``) from GPyTorch's default initialisation (lengthscale =
outputscale = softplus(0) = 0.693, noise 0.693 + 1e-4), standardised data. exact: ARD, constant mean, Cholesky
(``gpnys.baselines.exact.cholesky_loss``: one Cholesky and ``cholesky_inverse`` per step with the gradient in closed
form, the same loss and gradient as GPyTorch's Cholesky path to ~1e-14, 4-5x faster than it at n = 15k; predictions by
GPyTorch's Cholesky path). GPyTorch's own Cholesky training (autograd through the factorisation) is also timed,
on ``--gpytorch-cholesky-steps`` steps only (about 4 min and 18 GB per step at the full split), and its training
time reported as the median step time x the step budget. gpytorch: the same model under ``max_cholesky_size(0)``, else
GPyTorch's defaults (CG tolerance 1, 10 probes, rank-15 pivoted Cholesky); prediction by its recommended large-n path,
``fast_pred_var()`` (LOVE) with ``max_cholesky_size(0)``. auto: the same model under ``gpnys.use_preconditioner(model,
"auto")``, trained as ``gpnys fit`` does; ``hook.predict``. higp: ``higp.gprproblem.setup`` + ``higp.GPRModel`` +
``torch.optim.Adam`` stepped as ``higp.gpr_torch_minimize`` does; isotropic (HiGP has no ARD), zero mean, HiGP's default
estimator (rank 50 Nyström, 10 Lanczos steps, 10 probes seeded from the wall clock); Adam acts on HiGP's raw parameters
softplus^-1 of (lengthscale, sqrt(outputscale), noise); ``higp.gpr_prediction`` with ``higp.ezgpr_torch``'s settings
(its ``prediction_stddev`` is that of y, noise included: checked against Cholesky in HiGP's exact mode).

Loss = -MLL / n before each step (HiGP: total / n). Training time counts the steps only: test-RMSE checkpoints (steps
1, iters/4, ..., iters = final prediction) are timed apart. RMSE / NLL in original units of y.

t/t_ex: training time over the exact (closed-form Cholesky) fit's; t/t_gch: over GPyTorch's Cholesky training
(extrapolated as above).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import gpytorch
import numpy as np
import torch

from gpnys import datasets
from gpnys.baselines.exact import cholesky_loss
from gpnys.baselines.higp_adapter import _inv_softplus, _quiet_stdout, _softplus
from gpnys.baselines.provenance import provenance
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.training import (
    ExactGPModel,
    fit,
    gaussian_nll,
    hyperparameters,
)
from gpnys.gp.training import predict as gp_predict

RESULTS = Path(__file__).resolve().parent / "results"
HIGP_TRAIN = {"afn_rank": 50, "afn_lfil": 0, "niter": 10, "nvec": 10}  # HiGP's defaults
HIGP_PRED = {"afn_rank": 50, "afn_lfil": 0, "niter": 500, "tol": 1e-5}  # higp.ezgpr_torch's prediction settings


def _model(ds) -> ExactGPModel:
    lik = gpytorch.likelihoods.GaussianLikelihood().to(ds.train_x)
    return ExactGPModel(ds.train_x, ds.train_y, lik, kernel="matern32", ard=True, mean="constant").to(ds.train_x)


def _gp_method(model, args, settings, predict_fn, info, step_info=None, pre_eval=None, loss=None) -> SimpleNamespace:
    """A GPyTorch-model method: ``gpnys.gp.training.fit`` with ``settings`` (and ``loss``);
    ``predict_fn(x, variance)``."""
    def train(on_step):
        fit(model, iters=args.iters, lr=args.lr, progress=False, seed=args.seed, settings=settings, on_step=on_step,
            loss=loss)

    def predict(x, variance):
        with gpytorch.settings.skip_posterior_variances(not variance):
            out = predict_fn(x, variance)
        model.train()  # back to training mode (fit sets it only once)
        return out

    return SimpleNamespace(train=train, predict=predict, hyper=lambda: hyperparameters(model), info=info,
                           step_info=step_info, pre_eval=pre_eval)


@contextlib.contextmanager
def exact_method(ds, args):
    model, cache = _model(ds), {}
    yield _gp_method(model, args, None, lambda x, v: gp_predict(model, x),
                     {"train": "Cholesky, closed-form gradient (gpnys.baselines.exact.cholesky_loss)",
                      "predict": "GPyTorch Cholesky"}, loss=lambda m: cholesky_loss(m, cache))
    cache.clear()


def time_gpytorch_cholesky(ds, args) -> dict:
    """GPyTorch's own Cholesky training (autograd), timed on ``args.gpytorch_cholesky_steps`` steps."""
    model, stamps = _model(ds), [time.perf_counter()]
    fit(model, iters=args.gpytorch_cholesky_steps, lr=args.lr, progress=False, seed=args.seed,
        on_step=lambda t, loss: stamps.append(time.perf_counter()))
    step_s = np.diff(stamps).tolist()
    return {"steps_timed": len(step_s), "step_s": step_s, "median_step_s": float(np.median(step_s)),
            "train_time_s_extrapolated": float(np.median(step_s)) * args.iters}


@contextlib.contextmanager
def gpytorch_method(ds, args):
    model, mcs = _model(ds), gpytorch.settings.max_cholesky_size

    def pred(x, v):
        with mcs(0), gpytorch.settings.fast_pred_var():
            return gp_predict(model, x, settings=contextlib.nullcontext())

    yield _gp_method(model, args, lambda n: mcs(0), pred,
                     {"train": "max_cholesky_size(0), GPyTorch defaults", "predict": "fast_pred_var (LOVE)"})


@contextlib.contextmanager
def auto_method(ds, args):
    model = _model(ds)
    with use_preconditioner(model, "auto", seed=args.seed) as hook:
        yield _gp_method(model, args, lambda n: contextlib.nullcontext(), lambda x, v: hook.predict(x, variance=v),
                         {"train": "use_preconditioner(auto)", "predict": "hook.predict"},
                         step_info=lambda: {"path": hook.path, **({"precond": hook.history[-1].kind,
                                                                    "rank": hook.history[-1].rank}
                                                                   if hook.path == "iterative" and hook.history
                                                                   else {})},
                         pre_eval=hook.preconditioner)


@contextlib.contextmanager
def higp_method(ds, args):
    import higp

    arr = lambda t: np.ascontiguousarray(t.detach().cpu().numpy().astype(np.float64).T)  # HiGP wants (d, n)
    X, y, n, nt, state = arr(ds.train_x), arr(ds.train_y), ds.n, torch.get_num_threads(), {}
    kw = {"kernel_type": higp.Matern32Kernel, "nthreads": nt, "seed": args.seed + 1}
    h0 = hyperparameters(_model(ds))  # GPyTorch's default init, mapped to HiGP's raw (l, f, s)
    raw0 = [_inv_softplus(v) for v in (h0["lengthscale"][0], math.sqrt(h0["outputscale"]), h0["noise"])]

    def train(on_step):
        with _quiet_stdout():
            problem = higp.gprproblem.setup(data=X, label=y, **kw, **HIGP_TRAIN)
        state["model"] = model = higp.GPRModel(problem, *raw0, dtype=torch.float64)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        for t in range(args.iters):
            with _quiet_stdout():
                loss = float(model.calc_loss_grad()) + 2.0 * math.pi / n  # it returns (total - 2 pi) / n
            opt.step()
            on_step(t, loss)

    def predict(x, variance):
        with _quiet_stdout():
            pr = higp.gpr_prediction(data_train=X, label_train=y, data_prediction=arr(x),
                                     gp_params=state["model"].get_params(), **kw, **HIGP_PRED)
        return torch.as_tensor(pr.prediction_mean), torch.as_tensor(pr.prediction_stddev) ** 2

    def hyper():
        ls, f, s = (_softplus(float(v)) for v in state["model"].get_params())
        return {"lengthscale": ls, "outputscale": f * f, "noise": s}

    info = {"train": f"higp {HIGP_TRAIN}, isotropic, zero mean", "predict": f"higp {HIGP_PRED}", "nthreads": nt}
    yield SimpleNamespace(train=train, predict=predict, hyper=hyper, step_info=None, pre_eval=None, info=info)
    with _quiet_stdout():
        state.clear()  # HiGP prints on deallocation


METHODS = {"exact": exact_method, "gpytorch": gpytorch_method, "higp": higp_method, "auto": auto_method}


def _metrics(ds, mean, var) -> dict:
    tf, y = ds.transform, ds.transform.inverse_y(ds.test_y)
    out = {"rmse": float((tf.inverse_y(mean) - y).square().mean().sqrt()),
           "rmse_standardized": float((mean - ds.test_y).square().mean().sqrt())}
    if var is not None:
        out.update(nll=gaussian_nll(y, tf.inverse_y(mean), tf.inverse_variance(var)),
                   nll_standardized=gaussian_nll(ds.test_y, mean, var))
    return out


def run_method(name, ds, args, checks) -> dict:
    """Train with ``name``, timing the steps only; test RMSE at ``checks``; final hyperparameters, RMSE, NLL."""
    if name == "higp" and importlib.util.find_spec("higp") is None:
        return {"method": name, "skipped": "higp is not installed (pip install higp)"}
    rec: dict = {"method": name, "loss_trace": [], "time_trace": [], "checkpoints": [], "steps": [], "eval_time_s": 0.0}
    with METHODS[name](ds, args) as m:
        rec["settings"], start = m.info, time.perf_counter()

        def on_step(t, loss):
            due = t + 1 in checks and t + 1 < args.iters
            if m.step_info:
                rec["steps"].append(m.step_info())
            if due and m.pre_eval:
                m.pre_eval()  # auto: the next step's preconditioner, on the training clock (that step reuses it)
            now = time.perf_counter()
            rec["loss_trace"].append(loss)
            rec["time_trace"].append(now - start - rec["eval_time_s"])
            if due:
                rmse = _metrics(ds, m.predict(ds.test_x, False)[0], None)
                rec["checkpoints"].append({"step": t + 1, "train_s": rec["time_trace"][-1], **rmse})
                rec["eval_time_s"] += time.perf_counter() - now

        m.train(on_step)
        rec["train_time_s"], t0 = rec["time_trace"][-1], time.perf_counter()
        rec["hyperparameters"] = m.hyper()
        if not checks:  # --eval-points 0: training only
            return rec
        mean, var = m.predict(ds.test_x, True)
        rec["predict_time_s"] = time.perf_counter() - t0
        final = _metrics(ds, mean, var)
        rec["checkpoints"].append({"step": args.iters, "train_s": rec["train_time_s"],
                                   **{k: final[k] for k in ("rmse", "rmse_standardized")}})
        rec.update({f"test_{k}": v for k, v in final.items()}, hyperparameters=m.hyper())
    return rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="n = 400, 3 steps")
    ap.add_argument("--data", default="elevators", help="a bundled data set or synthetic3d (default elevators)")
    ap.add_argument("--no-standardize", action="store_true", help="keep the data's units (synthetic3d: unit density)")
    ap.add_argument("--n", type=int, default=None, help="training subsample (default: the full split)")
    ap.add_argument("--iters", type=int, default=None, help="Adam steps (default 50; --quick 3)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="exact,gpytorch,higp,auto")
    ap.add_argument("--threads", type=int, default=2, help="torch (and HiGP) threads")
    ap.add_argument("--eval-points", type=int, default=5, help="test-RMSE checkpoints, the final one included (1: the "
                    "final prediction only; 0: no prediction, training and hyperparameters only)")
    ap.add_argument("--gpytorch-cholesky-steps", type=int, default=2,
                    help="steps of GPyTorch's own Cholesky training to time (0: skip)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/fit_compare[_quick].json)")
    args = ap.parse_args(argv)
    args.n, args.iters = (400 if args.quick and args.n is None else args.n), args.iters or (3 if args.quick else 50)
    k = args.eval_points  # checkpoints 1, ..., iters evenly spaced; the last is the final prediction (0: none)
    if k <= 1:
        checks = {args.iters} if k == 1 else set()
    else:
        checks = {round(1 + i * (args.iters - 1) / (k - 1)) for i in range(k)}
    threads, results = torch.get_num_threads(), {}
    torch.set_num_threads(args.threads)
    record = provenance(__file__, argv)  # with the run's threads (main restores the caller's at the end)
    ds = datasets.load(args.data, split=0, n=args.n, seed=args.seed, standardize=not args.no_standardize)
    fit(_model(datasets.load("elevators", n=64)), iters=1, progress=False)  # untimed warm-up: torch's first call ~1 s
    print(f"{ds.describe()}; Matern-3/2, Adam lr {args.lr}, {args.iters} steps, {args.threads} threads")
    gpy_chol = time_gpytorch_cholesky(ds, args) if args.gpytorch_cholesky_steps > 0 else None
    if gpy_chol:
        print(f"  GPyTorch Cholesky: {gpy_chol['median_step_s']:.2f} s/step over {gpy_chol['steps_timed']} steps, "
              f"x {args.iters} = {gpy_chol['train_time_s_extrapolated']:.1f} s")
    for name in args.methods.split(","):
        results[name] = run_method(name, ds, args, checks)
        print(f"  {name}: " + (results[name].get("skipped") or f"trained in {results[name]['train_time_s']:.2f} s"))
    torch.set_num_threads(threads)  # restore (main is also called in-process by the tests)
    ref = results.get("exact", {"skipped": "not run"})
    for r in results.values():
        if "skipped" not in r and "skipped" not in ref and "test_rmse" in r and "test_rmse" in ref:
            r.update({f"{k}_rel_diff": abs(r[f"test_{k}"] - ref[f"test_{k}"]) / abs(ref[f"test_{k}"])
                      for k in ("rmse", "nll", "nll_standardized")}, time_ratio=r["train_time_s"] / ref["train_time_s"])
        if "skipped" not in r and gpy_chol:
            r["time_ratio_gpytorch_cholesky"] = r["train_time_s"] / gpy_chol["train_time_s_extrapolated"]
    print(f"{'method':>9} {'ls min/med/max':>20} {'outsc':>7} {'noise':>8} {'RMSE':>8} {'NLL':>8} {'train s':>8} "
          f"{'pred s':>7} {'dRMSE':>7} {'dNLL':>7} {'t/t_ex':>7} {'t/t_gch':>7}")
    for name, r in ((k, v) for k, v in results.items() if "skipped" not in v):
        h, ls = r["hyperparameters"], np.atleast_1d(r["hyperparameters"]["lengthscale"])
        rel = " ".join(f"{r[k]:7.2%}" if k in r else f"{'-':>7}" for k in ("rmse_rel_diff", "nll_rel_diff"))
        rel += "".join(f" {r[k]:7.3f}" if k in r else f" {'-':>7}"
                       for k in ("time_ratio", "time_ratio_gpytorch_cholesky"))
        print(f"{name:>9} {min(ls):6.3g}/{np.median(ls):6.3g}/{max(ls):6.3g} {h['outputscale']:7.3g} "
              f"{h['noise']:8.3g} {r.get('test_rmse', math.nan):8.5f} {r.get('test_nll', math.nan):8.4f} "
              f"{r['train_time_s']:8.2f} {r.get('predict_time_s', math.nan):7.2f} {rel}")
    out = {"data": ds.name, "split": ds.split, "n_train": ds.n, "n_test": int(ds.test_x.shape[0]), "kernel": "matern32",
           **{k: getattr(args, k) for k in ("iters", "lr", "seed", "threads")}, "gpytorch_cholesky": gpy_chol,
           "results": results, "provenance": record}
    path = Path(args.out) if args.out else RESULTS / ("fit_compare_quick.json" if args.quick else "fit_compare.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    plot(results, path.with_suffix(".png"), ds.describe())
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in results.items():
        if "skipped" not in r:
            a0.plot(r["time_trace"], r["loss_trace"], marker=".", label=name)
            if r["checkpoints"]:
                a1.plot(*zip(*((c["train_s"], c["rmse"]) for c in r["checkpoints"])), marker="o", label=name)
    for ax, ylabel in ((a0, "training loss (-MLL / n)"), (a1, "test RMSE (original units)")):
        ax.set(xscale="log", xlabel="training wall time (s)", ylabel=ylabel)
        ax.tick_params(axis="x", which="minor", labelbottom=False)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
