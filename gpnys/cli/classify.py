"""``gpnys classify``: Laplace-approximate GP binary classification (:class:`gpnys.classify.LaplaceGPClassifier`, or
with ``--reduced M`` :class:`gpnys.classify.ReducedLaplaceClassifier` on the Nyström kernel of ``M`` landmarks).

The labels are the data set's last column: ``--labels median`` (default) thresholds a regression target at its
training median (label ``y > median``); ``--labels binary`` takes a column of 0/1 labels as it is. Inputs are
standardised on the training rows. The kernel's hyperparameters start at ``--lengthscale`` (default: the median
heuristic) and ``--outputscale`` and are trained by ``--steps`` Adam steps on ``-log q / n`` (0: kept); the command
reports ``log q`` and its gradient with standard errors (exact, without standard errors, for ``--reduced``), the
trained hyperparameters and the test accuracy.
"""

from __future__ import annotations

import argparse
import time

import torch

from gpnys import datasets
from gpnys.classify import LaplaceGPClassifier, ReducedLaplaceClassifier
from gpnys.cli.common import (
    LEARNING_RATE,
    SCALE,
    Range,
    add_common_args,
    add_data_args,
    check_at_most,
    count,
    emit_json,
    load_data,
)
from gpnys.distributed import rank_and_size
from gpnys.kernels import make_kernel

NAME = "classify"
HELP = "Laplace GP binary classification: train the kernel by log q's gradient, report log q and test accuracy"
#: --k, --w and --probes: as the estimator's (gpnys.cli.common.SHARED_FLAGS)
FLAGS: dict[str, Range] = {"steps": count(0), "lr": LEARNING_RATE, "lengthscale": SCALE, "outputscale": SCALE,
                           "n_test": count(1), "reduced": count(1), "subsample": count(1)}


def add_parser(p: argparse.ArgumentParser) -> None:
    add_data_args(p)
    add_common_args(p)
    p.add_argument("--labels", choices=("median", "binary"), default="median",
                   help="median: the target > its training median (default); binary: the target holds 0/1 labels")
    p.add_argument("--link", choices=("logit", "probit"), default="logit", help="the Bernoulli likelihood's link")
    p.add_argument("--steps", type=int, default=10, help="Adam steps on the hyperparameters (0: keep them)")
    p.add_argument("--lr", type=float, default=0.1, help="Adam's learning rate")
    p.add_argument("--lengthscale", type=float, default=None, help="initial length-scale (default: median heuristic)")
    p.add_argument("--outputscale", type=float, default=1.0, help="initial outputscale")
    p.add_argument("--k", type=int, default=None, help="AFN landmarks (default min(500, n))")
    p.add_argument("--w", type=int, default=None, help="FSAI nonzeros per row (default min(30, n))")
    p.add_argument("--probes", type=int, default=None,
                   help="SLQ probes for log det B and the gradient's traces (default 32)")
    p.add_argument("--n-test", type=int, default=None, help="a seeded subset of the test rows")
    p.add_argument("--reduced", type=int, default=None, metavar="M",
                   help="Laplace on the Nyström kernel of M landmarks (ReducedLaplaceClassifier: O(n M²) a Newton "
                        "step, exact log q and gradient) instead of the exact kernel")
    p.add_argument("--landmarks", choices=("kmeans", "fps", "uniform"), default=None,
                   help="--reduced's landmark rule (default kmeans)")
    p.add_argument("--subsample", type=int, default=None,
                   help="--reduced: run the Adam steps on this many seeded rows, then fit every row")


def _labels(y: torch.Tensor, how: str, threshold: torch.Tensor) -> torch.Tensor:
    if how == "median":
        return (y > threshold).to(y.dtype)
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("--labels binary: the data's last column must hold 0/1 labels only")
    return y


def run(args: argparse.Namespace) -> int:
    ds = load_data(args, standardize=False, n_test=args.n_test)  # the labels keep their values
    X, Xt = ds.train_x, ds.test_x
    if not args.no_standardize:
        tf = datasets.Standardizer.fit(X, ds.train_y)
        X, Xt = tf.transform_x(X), tf.transform_x(Xt)
    threshold = ds.train_y.median()
    y, yt = _labels(ds.train_y, args.labels, threshold), _labels(ds.test_y, args.labels, threshold)
    check_at_most(X.shape[0], args, "k", "w", "reduced", "subsample")
    exact = args.reduced is None
    landmarks = None if exact else args.landmarks or "kmeans"
    if exact:
        for flag, value in (("--subsample", args.subsample), ("--landmarks", args.landmarks)):
            if value is not None:
                raise ValueError(f"{flag} needs --reduced")
    else:
        for flag, value in (("--k", args.k), ("--w", args.w), ("--probes", args.probes)):
            if value is not None:
                raise ValueError(f"{flag} sets the exact kernel's preconditioner or probes; --reduced has none")
        if rank_and_size()[1] > 1:
            raise ValueError("--reduced runs in one process: its products are O(n M) and split no kernel")
        if args.subsample is not None and args.steps == 0:
            raise ValueError("--subsample sets the rows of the Adam steps; --steps 0 takes none")
    kernel = make_kernel(args.kernel).to(X)
    lengthscale = args.lengthscale
    if lengthscale is None:
        # imported here, not at the top: its module imports scikit-learn (~2 s), which no other subcommand needs
        from gpnys.reduced.nystrom_features import median_lengthscale

        lengthscale = median_lengthscale(X, seed=args.seed)
    kernel.base_kernel.lengthscale = lengthscale
    kernel.outputscale = args.outputscale
    options = {key: value for key, value in (("k", args.k), ("w", args.w)) if value is not None}
    if exact:
        clf = LaplaceGPClassifier(kernel, link=args.link, precond_options=options, num_probes=args.probes or 32,
                                  seed=args.seed, optimizer_steps=args.steps, lr=args.lr,
                                  group=True if rank_and_size()[1] > 1 else None)  # under torchrun
    else:
        clf = ReducedLaplaceClassifier(kernel, link=args.link, m=args.reduced, landmarks=landmarks,
                                       optimizer_steps=args.steps, lr=args.lr, subsample=args.subsample,
                                       seed=args.seed)
    t0 = time.perf_counter()
    try:
        clf.fit(X, y)
    except ValueError as exc:  # the start passed; an Adam step then took the hyperparameters where q has no value
        steps = len(getattr(clf, "history_", []))
        if not steps:
            raise
        raise ValueError(f"Adam diverged after {steps} step(s) ({type(exc).__name__}: {exc}); try a smaller "
                         f"--lr than {args.lr:g}") from exc
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    accuracy = float((clf.predict(Xt).to(yt.dtype) == yt).double().mean()) if yt.numel() else None
    predict_s = time.perf_counter() - t0
    record = {
        "data": ds.describe(), "labels": args.labels, "n": X.shape[0], "n_test": Xt.shape[0], "kernel": args.kernel,
        "link": args.link, "steps": args.steps, "seed": args.seed, "reduced": args.reduced,
        "landmarks": landmarks, "subsample": args.subsample,
        "rank": None if exact else clf.rank_,
        "log_marginal_likelihood": clf.log_marginal_likelihood_, "std_error": clf.mll_std_error_ if exact else None,
        "gradient": {k: v.reshape(-1).tolist() for k, v in clf.mll_gradient_.items()},
        "gradient_std_error": {k: v.reshape(-1).tolist() for k, v in clf.mll_gradient_std_error_.items()}
        if exact else None,
        "lengthscale": clf.kernel_.base_kernel.lengthscale.detach().reshape(-1).tolist(),
        "outputscale": float(clf.kernel_.outputscale.detach()), "test_accuracy": accuracy,
        "newton_iterations": clf.newton_iterations_, "train_s": train_s, "predict_s": predict_s,
        "processes": rank_and_size()[1],
        "history": clf.history_,
    }
    if args.json:
        emit_json(record)
        return 0
    print(f"data: {record['data']}; labels: {args.labels}"
          + ("" if exact else f"; Nyström kernel of {args.reduced} {landmarks} landmarks (rank {clf.rank_})"))
    error = f" ± {record['std_error']:.2g}" if exact else ""
    print(f"log q = {record['log_marginal_likelihood']:.4f}{error} after {args.steps} Adam steps "
          f"({train_s:.2f} s); length-scale {record['lengthscale']}, outputscale {record['outputscale']:.4g}")
    for name, g in record["gradient"].items():
        errors = f" ± {[f'{v:.2g}' for v in record['gradient_std_error'][name]]}" if exact else ""
        print(f"  d log q / d {name}: {[f'{v:.4g}' for v in g]}{errors}")
    if accuracy is not None:
        print(f"test accuracy {accuracy:.4f} on {Xt.shape[0]} rows ({predict_s:.2f} s)")
    return 0
