"""``gpnys fit``: train GP hyperparameters on a data set and report test RMSE / NLL."""

from __future__ import annotations

import argparse
import contextlib
import time

import gpytorch
import torch

from gpnys.cli.common import (
    LEARNING_RATE,
    POSITIVE,
    TRAINING_FLAGS,
    Range,
    add_common_args,
    add_data_args,
    add_estimator_args,
    check_at_most,
    check_estimator_unused,
    count,
    emit_json,
    estimator_from_args,
    load_data,
    precond_options,
)
from gpnys.gp.estimator import gradient_at_noise
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import VARIANCE_METHODS
from gpnys.gp.training import (
    OPTIMIZERS,
    ExactGPModel,
    fit,
    gaussian_nll,
    hyperparameters,
    predict,
)
from gpnys.precond.strategy import PRECONDITIONERS

NAME = "fit"
HELP = "train an exact GP (ScaleKernel over RBF/Matérn) and report hyperparameters, test RMSE and NLL"
FLAGS: dict[str, Range] = {"iters": count(0), "lr": LEARNING_RATE, "variance_rel_error": POSITIVE}


def add_parser(p: argparse.ArgumentParser) -> None:
    add_data_args(p)
    add_common_args(p)
    p.add_argument("--ard", action="store_true", help="one length-scale per input dimension")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    p.add_argument("--mean", choices=("constant", "zero"), default="constant")
    p.add_argument("--precond", choices=("none",) + tuple(n for n in PRECONDITIONERS if n != "none"),
                   default="auto",
                   help="none = exact Cholesky; otherwise GPyTorch CG + SLQ with this gpnys preconditioner "
                        "(default auto: AFN paper Algorithm 5)")
    add_estimator_args(p)
    p.add_argument("--variance-method", choices=VARIANCE_METHODS, default="auto",
                   help="predictive variances: cached (landmark root + local correction, per-point error bound), "
                        "pcg or cholesky (exact); auto: cached when it costs under a tenth of the cheaper exact one")
    p.add_argument("--variance-rel-error", type=float, default=None, metavar="REL",
                   help="recompute by PCG the cached variances whose error bound exceeds REL of the variance")
    p.add_argument("--no-stop-at-noise", action="store_true",
                   help="run all --iters even when the gradient is within its noise, a chi-square test of g = 0 "
                   "at 5 %% (default: stop)")


def run(args: argparse.Namespace) -> int:
    settings = estimator_from_args(args)  # checked for --precond none too, which refuses any of them set
    opts = precond_options(args, [args.precond], f"--precond {args.precond}")[args.precond]
    # GPyTorch's own Cholesky fit computes the variances by Cholesky too (with --solver cholesky the hook still
    # predicts, and honours --variance-method)
    exact = "--precond none" if args.precond == "none" else None
    if exact is not None:
        for flag, value in (("--variance-method", None if args.variance_method in ("auto", "cholesky")
                             else args.variance_method), ("--variance-rel-error", args.variance_rel_error),
                            ("--solver", "iterative" if args.solver == "iterative" else None)):
            if value is not None:
                raise ValueError(f"{flag} {value} needs a preconditioned fit; {exact} trains and computes the "
                                 "variances by Cholesky")
        check_estimator_unused(args, exact)
    elif args.solver == "cholesky":  # every step by Cholesky; the predictions may still run through the hook
        check_estimator_unused(args, "--solver cholesky", TRAINING_FLAGS)
    if args.variance_rel_error is not None and args.variance_method not in ("auto", "cached"):
        raise ValueError(f"--variance-rel-error applies to the cached variances (--variance-method cached or auto); "
                         f"--variance-method {args.variance_method} computes them exactly")
    ds = load_data(args)
    check_at_most(ds.n, args, "k", "w")
    if not args.json:
        print(f"data: {ds.describe()}")
        if ds.subsampled and args.precond == "none":
            print(
                f"note: the exact (Cholesky) baseline trains on a seeded subsample of {ds.n} training rows "
                f"(--n {ds.n}, --seed {args.seed}); the test set is the full split."
            )
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(ds.train_x)
    model = ExactGPModel(ds.train_x, ds.train_y, likelihood, kernel=args.kernel, ard=args.ard, mean=args.mean)
    model = model.to(ds.train_x)
    if args.precond == "none":
        res = fit(model, iters=args.iters, lr=args.lr, optimizer=args.optimizer, progress=not args.json,
                  seed=args.seed)
        t_pred = time.perf_counter()
        mean, var = predict(model, ds.test_x)
        predict_s = time.perf_counter() - t_pred
        bound = mean_bound = None
    else:
        settings.variance_method, settings.variance_rel_error = args.variance_method, args.variance_rel_error
        if args.optimizer == "lbfgs":  # common random numbers: a deterministic objective for the line search
            settings.probe_seed = args.seed
        with use_preconditioner(model, args.precond, settings=settings, seed=args.seed, **opts) as hook:
            last = {"apps": 0}

            def on_step(t: int, loss: float) -> dict:
                apps, last["apps"] = hook.applications - last["apps"], hook.applications
                out = {"path": hook.path, "cg_iters": apps}
                if hook.path == "iterative" and hook.history:
                    out.update(precond=hook.history[-1].kind, rank=hook.history[-1].rank, builds=hook.builds,
                               reused=hook.preconditioners.stale)
                est = hook.last_estimate
                if est is not None:
                    worst = max((float(v.max()) for v in est.grad_std_error.values() if v.numel()), default=0.0)
                    out.update(loss_se=est.std_error / est.n, grad_se=worst / est.n, probes=est.probes)
                return out

            stop = None if args.no_stop_at_noise or not settings.error_bars else (
                lambda: gradient_at_noise(model, hook.last_estimate))
            res = fit(model, iters=args.iters, lr=args.lr, optimizer=args.optimizer, progress=not args.json,
                      seed=args.seed, settings=lambda n: contextlib.nullcontext(), on_step=on_step, stop=stop)
            t_pred = time.perf_counter()
            mean, var = hook.predict(ds.test_x)
            predict_s = time.perf_counter() - t_pred
            bound, mean_bound = hook.variance_bound, hook.mean_bound
    tf = ds.transform
    y = tf.inverse_y(ds.test_y)
    mean_o, var_o = tf.inverse_y(mean), tf.inverse_variance(var)
    out = {
        "data": ds.name,
        "split": ds.split,
        "n_train": ds.n,
        "n_test": int(ds.test_x.shape[0]),
        "subsampled": ds.subsampled,
        "kernel": args.kernel,
        "ard": args.ard,
        "method": "exact" if args.precond == "none" else f"cg+slq/{args.precond}",
        "precond": args.precond,
        # the path of the last training evaluation ("cholesky" or "iterative", gpnys.gp.path) and why
        "path": "cholesky" if args.precond == "none" else hook.path,
        "path_reason": "--precond none" if args.precond == "none" else hook.path_reason,
        "hyperparameters": hyperparameters(model),
        "test_rmse": float(torch.sqrt((mean_o - y).square().mean())),
        "test_nll": gaussian_nll(y, mean_o, var_o),
        "test_rmse_standardized": float(torch.sqrt((mean - ds.test_y).square().mean())),
        "test_nll_standardized": gaussian_nll(ds.test_y, mean, var),
        "train_time_s": res.train_time_s,
        "predict_time_s": predict_s,
        "variance_method": "cholesky" if args.precond == "none" else hook.variance_method_used,
        # the variances' error bounds relative to the returned variance of y (0 for Cholesky)
        "variance_rel_bound_median": 0.0 if bound is None else float((bound / var).median()),
        "variance_rel_bound_max": 0.0 if bound is None else float((bound / var).max()),
        # the means' estimated error bound, in target units (None: GPyTorch's own prediction, or Cholesky)
        "mean_bound_max": None if mean_bound is None else float((tf.inverse_y(mean + mean_bound) - mean_o).abs().max()),
        "loss_trace": res.loss_trace,
        "steps": res.steps,
        "iterations": res.iterations,
        "stopped": res.stopped,
    }
    if args.json:
        emit_json(out)
        return 0
    print("learned hyperparameters (standardised units):")
    for key, val in out["hyperparameters"].items():
        shown = ", ".join(f"{v:.4g}" for v in val) if isinstance(val, list) else f"{val:.4g}"
        print(f"  {key:12s} {shown}")
    print(f"final loss (-MLL / n): {res.loss_trace[-1] if res.loss_trace else float('nan'):.4f}")
    print(f"test RMSE: {out['test_rmse']:.5g} (standardised {out['test_rmse_standardized']:.4f})")
    print(f"test NLL:  {out['test_nll']:.4f} (standardised {out['test_nll_standardized']:.4f})")
    if res.stopped:
        print(f"stopped after {res.iterations} of {args.iters} iterations: {res.stopped}")
    print(f"train time: {res.train_time_s:.1f} s for {res.iterations} {args.optimizer} iterations; "
          f"prediction (mean and variance at {out['n_test']} points, variances by {out['variance_method']}): "
          f"{predict_s:.1f} s; variance error bound / variance: median {out['variance_rel_bound_median']:.1e}, "
          f"max {out['variance_rel_bound_max']:.1e}")
    return 0
