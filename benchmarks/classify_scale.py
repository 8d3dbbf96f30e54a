"""Laplace GP classification at n = 50 000 on the CPU: the Nyström-kernel Laplace classifier against GPyTorch's
variational classifier, by test accuracy against time.

Run:  python benchmarks/classify_scale.py --threads 2      (n = 50 000; about 15 minutes on 2 cores)
      python benchmarks/classify_scale.py --quick          (n = 2 000; seconds; run by the test suite)

Data: the synthetic set of ``nsl_svm.py`` (``sklearn.datasets.make_classification``: 20 inputs, 10 informative,
4 clusters per class, 10 % label noise), 50 000 training and 10 000 test rows, inputs standardised on the training
rows. Kernel: ``ScaleKernel(MaternKernel(nu=1.5))``, length-scale started at the median heuristic, outputscale 1.

1. **gpnys**: :class:`~gpnys.classify.ReducedLaplaceClassifier` with ``--m`` k-means landmarks: ``--steps`` Adam
   steps (lr ``--lr``) on ``-log q / n`` of a seeded ``--subsample``-row subsample, then the mode, ``log q`` and
   its gradient on every row, then prediction. Time: all of it, landmarks included.
2. **GPyTorch SVGP, minibatch** (``VariationalStrategy`` with ``--m`` learned inducing points,
   ``BernoulliLikelihood``, ``VariationalELBO``, batches of ``--batch`` rows, Adam lr ``--svgp-lr`` = 0.01:
   GPyTorch's SVGP recipe):
   test accuracy every ``--every`` iterations up to ``--svgp-iters``.
3. **GPyTorch SVGP, full batch** (Adam lr 0.05, as ``laplace.py``) up to ``--full-iters`` iterations.

Reported: each SVGP's seconds to first reach gpnys's test accuracy, and gpnys's time over it. The exact-kernel
:class:`~gpnys.classify.LaplaceGPClassifier` is not run here: at this n one kernel product takes seconds on 2 cores
and an evaluation about 100 of them (``laplace.py``).

Prints a table, writes ``results/classify_scale.json`` and ``results/classify_scale.png`` (accuracy against time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmarks: the data and the SVGP baseline
from laplace import make_kernel, svgp  # noqa: E402
from nsl_svm import load  # noqa: E402

from gpnys.baselines.provenance import provenance  # noqa: E402
from gpnys.classify import ReducedLaplaceClassifier  # noqa: E402
from gpnys.reduced.nystrom_features import median_lengthscale  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def reached(rows: list[dict], accuracy: float) -> float | None:
    """The first ``seconds`` at which ``rows`` reach ``accuracy`` (``None``: never)."""
    return next((r["seconds"] for r in rows if r["accuracy"] >= accuracy), None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--m", type=int, default=500, help="landmarks (gpnys) and inducing points (SVGP)")
    ap.add_argument("--steps", type=int, default=30, help="gpnys's Adam steps on the hyperparameters")
    ap.add_argument("--lr", type=float, default=0.2, help="gpnys's Adam learning rate")
    ap.add_argument("--subsample", type=int, default=5000, help="gpnys's training rows for the Adam steps")
    ap.add_argument("--batch", type=int, default=1024, help="SVGP minibatch rows")
    ap.add_argument("--svgp-lr", type=float, default=0.01, help="the minibatch SVGP's Adam learning rate")
    ap.add_argument("--svgp-iters", type=int, default=3000)
    ap.add_argument("--every", type=int, default=100, help="SVGP iterations between accuracy checks")
    ap.add_argument("--full-iters", type=int, default=100, help="full-batch SVGP iterations (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.m, args.steps, args.subsample, args.svgp_iters, args.every, args.full_iters = 50, 3, 500, 40, 20, 10
    if args.threads:
        torch.set_num_threads(args.threads)
    Xtr, ytr, Xte, yte, desc = load("synthetic", SimpleNamespace(quick=args.quick, synthetic_test=10000), args.seed)
    f64 = torch.float64
    Xtr, ytr, Xte, yte = (torch.as_tensor(a, dtype=f64) for a in (Xtr, ytr, Xte, yte))
    ell = median_lengthscale(Xtr, seed=args.seed)

    kernel = make_kernel(ell)
    t0 = time.perf_counter()
    clf = ReducedLaplaceClassifier(kernel, m=args.m, landmarks="kmeans", optimizer_steps=args.steps, lr=args.lr,
                                   subsample=min(args.subsample, Xtr.shape[0]), seed=args.seed).fit(Xtr, ytr)
    acc = float((clf.predict(Xte).double() == yte).double().mean())
    t_gpnys = time.perf_counter() - t0

    mini = svgp(Xtr, ytr, Xte, yte, ell, args.m, args.svgp_iters, args.every, args.seed, batch=args.batch,
                lr=args.svgp_lr)
    full = svgp(Xtr, ytr, Xte, yte, ell, args.m, args.full_iters, max(1, args.full_iters // 10), args.seed) \
        if args.full_iters else []
    out = {"data": desc, "n": Xtr.shape[0], "test": Xte.shape[0], "m": args.m, "steps": args.steps, "lr": args.lr,
           "subsample": args.subsample, "threads": torch.get_num_threads(),
           "gpnys": {"seconds": t_gpnys, "test_accuracy": acc, "log_q": clf.log_marginal_likelihood_,
                     "rank": clf.rank_, "newton_iterations": clf.newton_iterations_, "history": clf.history_,
                     "hyperparameters": {"lengthscale": float(clf.kernel_.base_kernel.lengthscale.detach()),
                                         "outputscale": float(clf.kernel_.outputscale.detach())}},
           "svgp_minibatch": {"batch": args.batch, "lr": args.svgp_lr, "rows": mini,
                              "seconds_to_gpnys_accuracy": reached(mini, acc)},
           "svgp_full_batch": {"rows": full, "seconds_to_gpnys_accuracy": reached(full, acc)},
           "provenance": provenance(__file__, argv)}
    print(f"{desc}: n = {Xtr.shape[0]}, {Xte.shape[0]} test rows, Matérn-3/2, m = {args.m}")
    print(f"{'method':<34}{'seconds':>10}{'test acc':>10}{'to gpnys acc (s)':>18}{'gpnys / it':>12}")
    print(f"{'gpnys reduced Laplace':<34}{t_gpnys:10.2f}{acc:10.4f}")
    for name, key in (("SVGP minibatch " + str(args.batch), "svgp_minibatch"), ("SVGP full batch", "svgp_full_batch")):
        rows, at = out[key]["rows"], out[key]["seconds_to_gpnys_accuracy"]
        if not rows:
            continue
        last = rows[-1]
        ratio = f"{t_gpnys / at:12.2f}" if at else f"{'never':>12}"
        print(f"{name + ' (' + str(last['iteration']) + ' it.)':<34}{last['seconds']:10.2f}{last['accuracy']:10.4f}"
              f"{'—' if at is None else round(at, 2):>18}{ratio}")
    path = Path(args.out) if args.out else RESULTS / "classify_scale.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for rows, label in ((mini, f"SVGP, batches of {args.batch}"), (full, "SVGP, full batch")):
            if rows:
                ax.plot([r["seconds"] for r in rows], [r["accuracy"] for r in rows], "o-", ms=3, label=label)
        ax.plot([t_gpnys], [acc], "s", color="C3", label="gpnys reduced Laplace")
        ax.set_xlabel("seconds (train + predict)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"synthetic, n = {Xtr.shape[0]}, m = {args.m}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
        plt.close(fig)
    except ImportError:
        pass
    return out


if __name__ == "__main__":
    main()
