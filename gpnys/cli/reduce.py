"""``gpnys reduce``: Nyström-reduced GPs (GSA / LLA / NCR / NYTRO), RFF and the exact GP on one split.

Every run is one :func:`gpnys.reduced.evaluate.evaluate_method` record; the exact posterior is built once and
shared by all runs so that ``error_vs_exact`` (RKHS distance to the full GP's predictor) and
``mean_rmse_vs_exact`` are filled. Hyperparameters are given (``--lengthscale --outputscale --noise [--mean]``)
or fitted first by exact-MLL training with gpnys's preconditioned CG + SLQ.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import gpytorch
import torch
from tqdm.auto import tqdm

from gpnys.cli.common import (
    LEARNING_RATE,
    SCALE,
    Range,
    add_common_args,
    add_data_args,
    comma_choices,
    count,
    emit_json,
    load_data,
)
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.training import ExactGPModel, fit, hyperparameters
from gpnys.kernels import make_kernel
from gpnys.landmarks import RULES
from gpnys.reduced.error import ExactPosterior
from gpnys.reduced.evaluate import EVAL_METHODS, evaluate_method

NAME = "reduce"
HELP = "reduced GPs (gsa, lla, ncr, nytro), random Fourier features and the exact GP: test metrics and error vs exact"

FLAGS: dict[str, Range] = {"lengthscale": SCALE, "outputscale": SCALE, "noise": SCALE, "mean": Range(magnitude=True),
                           "fit_iters": count(0), "lr": LEARNING_RATE}

#: the hyperparameter fit's defaults (``--fit-iters``, ``--lr``)
FIT_ITERS, FIT_LR = 30, 0.1

#: methods that do not iterate over landmark rules
_NO_RULE = ("exact", "rff")


def _m_list(text: str) -> list[int | str]:
    """argparse type: ``auto`` or a comma list of integers (``auto`` may appear in the list)."""
    out: list[int | str] = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        if item == "auto":
            out.append("auto")
            continue
        try:
            out.append(int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected 'auto' or a comma list of integers, got {item!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected 'auto' or a comma list of integers, got nothing")
    return out


def _unique(items: list[Any]) -> list[Any]:
    return list(dict.fromkeys(items))


def add_parser(p: argparse.ArgumentParser) -> None:
    add_data_args(p)
    add_common_args(p)
    p.add_argument("--method", type=comma_choices(EVAL_METHODS, "method"), default=["exact", "lla", "ncr", "gsa"],
                   help=f"comma list of {', '.join(EVAL_METHODS)} (default exact,lla,ncr,gsa)")
    p.add_argument("--m", type=_m_list, default=["auto"],
                   help="landmarks (rff: frequencies, 2m features): comma list of integers in [1, n], or auto "
                        "(numerical rank of the kernel matrix; default)")
    p.add_argument("--landmarks", type=comma_choices(RULES, "landmark rule"), default=["fps"],
                   help=f"comma list of landmark rules: {', '.join(RULES)} (default fps; not used by exact, rff)")
    p.add_argument("--gsa-coef", choices=("min_norm", "woodbury"), default="min_norm",
                   help="GSA coefficient: min_norm ([SPA] Algorithm 1; default) or woodbury (the Nyström GP's, which "
                        "can explode when the landmark kernel is ill-conditioned)")
    p.add_argument("--no-error", action="store_true",
                   help="skip the exact posterior (error_vs_exact and mean_rmse_vs_exact stay null) "
                        "unless 'exact' is among the methods")
    hyp = p.add_argument_group("hyperparameters",
                               "give --lengthscale, --outputscale and --noise (isotropic kernel) to skip fitting; "
                               "otherwise an exact GP (constant mean) is trained first")
    hyp.add_argument("--lengthscale", type=float, default=None)
    hyp.add_argument("--outputscale", type=float, default=None)
    hyp.add_argument("--noise", type=float, default=None)
    hyp.add_argument("--mean", type=float, default=None, help="constant prior mean with given hyperparameters "
                                                                "(default 0)")
    hyp.add_argument("--ard", action="store_true", help="fit one length-scale per input dimension")
    hyp.add_argument("--fit-iters", type=int, default=None,
                     help=f"Adam iterations of the hyperparameter fit (default {FIT_ITERS})")
    hyp.add_argument("--lr", type=float, default=None,
                     help=f"Adam learning rate of the hyperparameter fit (default {FIT_LR})")


def _given_hyperparameters(args: argparse.Namespace) -> dict[str, float] | None:
    """The hyperparameters from the flags (their ranges checked by ``FLAGS``); ``None`` when they are to be
    fitted (``--fit-iters`` and ``--lr`` then default to :data:`FIT_ITERS` and :data:`FIT_LR`)."""
    names = ("lengthscale", "outputscale", "noise")
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if not given:
        if args.mean is not None:
            raise ValueError("--mean applies only with given --lengthscale, --outputscale and --noise "
                             "(a fit learns the mean)")
        args.fit_iters = FIT_ITERS if args.fit_iters is None else args.fit_iters
        args.lr = FIT_LR if args.lr is None else args.lr
        return None
    missing = [f"--{k}" for k in names if k not in given]
    if missing:
        raise ValueError(f"give all of --lengthscale, --outputscale and --noise (or none of them to fit them); "
                         f"missing {', '.join(missing)}")
    if args.ard:
        raise ValueError("--ard applies only when the hyperparameters are fitted (given ones are isotropic)")
    for flag, value in (("--fit-iters", args.fit_iters), ("--lr", args.lr)):
        if value is not None:
            raise ValueError(f"{flag} {value:g} applies only when the hyperparameters are fitted (they are given)")
    return {**given, "mean": 0.0 if args.mean is None else float(args.mean)}


def _runs(methods: list[str], ms: list[int | str], rules: list[str]) -> list[tuple[str, int | str, str | None]]:
    """``(method, m, rule)`` for each m x each method x each rule; exact once, rff once per m."""
    runs: list[tuple[str, int | str, str | None]] = []
    for i, m in enumerate(ms):
        for method in methods:
            if method == "exact":
                if i == 0:
                    runs.append(("exact", m, None))
            elif method == "rff":
                runs.append(("rff", m, None))
            else:
                runs.extend((method, m, rule) for rule in rules)
    return runs


def run(args: argparse.Namespace) -> int:
    methods, ms, rules = _unique(args.method), _unique(args.m), _unique(args.landmarks)
    given = _given_hyperparameters(args)
    ds = load_data(args)
    X, y = ds.train_x, ds.train_y
    for m in ms:
        if m != "auto" and not 1 <= m <= ds.n:
            raise ValueError(f"--m must be 'auto' or integers in [1, n={ds.n}], got {m}")
    if not args.json:
        print(f"data: {ds.describe()}")
    fit_info: dict[str, Any] = {}
    if given is None:
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(X)
        model = ExactGPModel(X, y, likelihood, kernel=args.kernel, ard=args.ard, mean="constant").to(X)
        with use_preconditioner(model, "auto", seed=args.seed):
            res = fit(model, iters=args.fit_iters, lr=args.lr, settings=lambda n: contextlib.nullcontext(),
                      progress=not args.json, seed=args.seed)
        hyp = hyperparameters(model)
        kernel = model.covar_module
        for prm in kernel.parameters():
            prm.requires_grad_(False)
        fit_info = {"iters": args.fit_iters, "lr": args.lr, "train_time_s": res.train_time_s,
                    "final_loss": res.loss_trace[-1] if res.loss_trace else None}
    else:
        hyp = given
        kernel = make_kernel(args.kernel).to(X)
        kernel.base_kernel.lengthscale = given["lengthscale"]
        kernel.outputscale = given["outputscale"]
        for prm in kernel.parameters():
            prm.requires_grad_(False)
    noise, prior_mean = float(hyp["noise"]), float(hyp.get("mean", 0.0))

    exact, exact_s = None, None
    with torch.no_grad():
        if "exact" in methods or not args.no_error:
            t0 = time.perf_counter()
            exact = ExactPosterior(kernel, X, y, noise, prior_mean=prior_mean, seed=args.seed)
            exact_s = time.perf_counter() - t0
        records = []
        for method, m, rule in tqdm(_runs(methods, ms, rules), desc="reduce", disable=args.json, leave=True):
            rec = evaluate_method(method, kernel, X, y, ds.test_x, ds.test_y, noise, prior_mean=prior_mean, m=m,
                                  landmarks=rule, seed=args.seed, exact=exact, transform=ds.transform,
                                  **({"coef": args.gsa_coef} if method == "gsa" else {}))
            if method == "exact":
                rec["fit_s"] = exact_s  # the shared posterior's build time, not the reuse
            records.append(rec)
    out = {
        "data": ds.name,
        "split": ds.split,
        "n_train": ds.n,
        "n_test": int(ds.test_x.shape[0]),
        "subsampled": ds.subsampled,
        "kernel": args.kernel,
        "ard": bool(args.ard),
        "seed": args.seed,
        "hyperparameters_source": "given" if given is not None else "fit",
        "hyperparameters": hyp,
        "fit": fit_info or None,
        "exact_method": exact.method if exact is not None else None,
        "records": records,
    }
    if args.json:
        emit_json(out)
        return 0
    src = ("given" if given is not None
           else f"fitted ({args.fit_iters} Adam iterations, {fit_info['train_time_s']:.1f} s)")
    print(f"hyperparameters ({src}, standardised units):")
    for key, val in hyp.items():
        shown = ", ".join(f"{v:.4g}" for v in val) if isinstance(val, list) else f"{val:.4g}"
        print(f"  {key:12s} {shown}")

    def num(v: float | None, fmt: str) -> str:
        width = int(fmt.split(".")[0])
        return f"{'-':>{width}s}" if v is None else format(v, fmt)

    header = (f"{'method':7s} {'m':>6s} {'landmarks':9s} {'test_rmse':>10s} {'test_nll':>9s} {'err_vs_exact':>12s} "
              f"{'mean_rmse_vs_ex':>15s} {'fit_s':>8s} {'predict_s':>9s}")
    print(header)
    print("-" * len(header))
    for r in records:
        print(f"{r['method']:7s} {r['m']:6d} {r['landmarks'] or '-':9s} {num(r['test_rmse'], '10.5g')} "
              f"{num(r['test_nll'], '9.4f')} {num(r['error_vs_exact'], '12.3e')} "
              f"{num(r['mean_rmse_vs_exact'], '15.3e')} {r['fit_s']:8.3f} {r['predict_s']:9.3f}")
    if exact is None:
        print("(--no-error: no exact posterior, errors against it not computed)")
    return 0
