"""NSL kernel SVMs: Nyström features + a linear SVM against scikit-learn's Nystroem and the exact kernel SVC.

Run:  OMP_NUM_THREADS=1 python benchmarks/nsl_svm.py --threads 1    (~6 min; one thread for torch, BLAS, libsvm
      and liblinear alike, so that the timings compare like with like)
      python benchmarks/nsl_svm.py --quick          (small sizes, < 30 s; run by the test suite)

Binary tasks (inputs standardised on the training rows):

* ``breast_cancer``: scikit-learn's bundled Wisconsin breast-cancer set (569 rows, 30 inputs), seeded 70/30 split.
* ``digits``: scikit-learn's bundled 8x8 digits (1797 rows, 64 inputs), one-vs-rest "is it a 9", seeded 70/30 split.
* ``elevators``: the bundled UCI regression set (``gpnys.datasets``, 16 599 rows, 18 inputs, split 0 of its test
  mask), its target thresholded at the median training target: label ``y > median``.
* ``synthetic``: ``sklearn.datasets.make_classification`` (``--synthetic-n`` rows, 20 inputs, 10 informative,
  4 clusters per class, 10 % label noise), 50 000 training and the rest test rows.

RBF kernel with the median-heuristic length-scale ``l`` of the training inputs (scikit-learn's ``gamma = 1/(2 l^2)``
for ``Nystroem`` and ``SVC``: the same kernel everywhere), and ``C = --C`` for every SVM. For each ``m`` in ``--m``:

(a) gpnys :class:`~gpnys.reduced.NystromFeatures` (orthonormal basis, [NSL] Algorithm 1-2) with k-means and
    uniform landmarks + ``LinearSVC`` (squared hinge; ``--linear-solver``: liblinear's dual coordinate descent,
    the default, or its primal trust-region Newton; both minimise the same objective, and on dense n x m
    features with n >> m the dual was the faster, docs/classification.md);
(b) ``sklearn.kernel_approximation.Nystroem`` (uniform landmarks) + the same ``LinearSVC``;
(c) the exact kernel ``SVC`` (hinge loss, libsvm) on at most ``--svc-cap`` training rows (a seeded subsample
    above it; the JSON and table state the n it ran at);
(d) on the two small sets, the kernel ridge classifier ``sign(f)`` with ``y in {-1, 1}`` by GSA ([NSL]'s
    "standard Nyström", eq. (18)/(23)) and by LLA (= NCR, eq. (16)/(24)), ridge ``--krr-ridge``, uniform landmarks.

Times are fit + predict (feature map, landmark selection and the linear solver included), wall clock, mean over
``--seeds`` seeds on the small sets and ``--large-seeds`` on the large ones (accuracy too). Prints a table, writes
``results/nsl_svm.json`` and ``results/nsl_svm.png`` (test accuracy against time, one panel per data set; [NSL]
Fig. 1 plots accuracy against m). The check per data set: the cheapest gpnys point within 1 % of the exact SVC's
accuracy and its share of the SVC's time, and gpnys's accuracy minus sklearn Nystroem's at every m.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits, make_classification
from sklearn.kernel_approximation import Nystroem
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC, LinearSVC

from gpnys import datasets
from gpnys.baselines.provenance import provenance
from gpnys.reduced import GSAPosterior, LLAPosterior, NystromFeatures
from gpnys.reduced.nystrom_features import median_lengthscale

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("breast_cancer", "digits", "elevators", "synthetic")
SMALL = ("breast_cancer", "digits")


def load(name: str, args, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    """``(X_train, y_train, X_test, y_test, description)``, inputs standardised on the training rows."""
    if name == "breast_cancer":
        X, y = load_breast_cancer(return_X_y=True)
        Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=seed, stratify=y)
        desc = "sklearn breast cancer (malignant vs benign)"
    elif name == "digits":
        X, y = load_digits(return_X_y=True)
        y = (y == 9).astype(int)
        Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=seed, stratify=y)
        desc = "sklearn digits, 9 vs rest"
    elif name == "elevators":
        data, mask = datasets.load_array("elevators")
        test = mask[:, 0]
        X, t = data[:, :-1], data[:, -1]
        Xtr, Xte, ttr, tte = X[~test], X[test], t[~test], t[test]
        if args.quick:
            Xtr, ttr = Xtr[:2000], ttr[:2000]
        thr = np.median(ttr)
        ytr, yte = (ttr > thr).astype(int), (tte > thr).astype(int)
        desc = "UCI elevators (gpnys.datasets), target > its training median"
    elif name == "synthetic":
        n_train = 2000 if args.quick else 50000
        n = n_train + (1000 if args.quick else args.synthetic_test)
        X, y = make_classification(n_samples=n, n_features=20, n_informative=10, n_redundant=4,
                                   n_clusters_per_class=4, flip_y=0.1, class_sep=1.0, random_state=seed)
        Xtr, Xte, ytr, yte = X[:n_train], X[n_train:], y[:n_train], y[n_train:]
        desc = "make_classification (20 inputs, 4 clusters per class, 10 % label noise)"
    else:
        raise ValueError(f"data must be among {DATASETS}, got {name!r}")
    sc = StandardScaler().fit(Xtr)
    return sc.transform(Xtr), ytr, sc.transform(Xte), yte, desc


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_features(make, Xtr, ytr, Xte, yte, C, solver="dual") -> tuple[float, float]:
    """Accuracy and fit + predict time of ``make()`` features + LinearSVC (``solver``: ``"dual"`` or ``"primal"``)."""
    def go():
        fmap = make()
        clf = LinearSVC(C=C, dual=solver == "dual", tol=1e-4, max_iter=10_000).fit(fmap.fit_transform(Xtr), ytr)
        return clf.predict(fmap.transform(Xte))
    pred, t = timed(go)
    return float((pred == yte).mean()), t


def run_krr(cls, Xtr, ytr, Xte, yte, ell, m, ridge, seed) -> tuple[float, float]:
    """Kernel ridge classifier ``sign(f)`` with GSA or LLA on ``m`` uniform landmarks."""
    from gpnys.kernels import base_kernel
    from gpnys.landmarks import select_landmarks

    def go():
        X, Z = torch.as_tensor(Xtr), torch.as_tensor(Xte)
        kern = base_kernel("rbf").double()
        kern.lengthscale = ell
        C, _ = select_landmarks(X, m, "uniform", seed=seed)
        post = cls(kern, X, torch.as_tensor(2.0 * ytr - 1), ridge, C)
        return (post.mean(Z) > 0).numpy().astype(int)
    pred, t = timed(go)
    return float((pred == yte).mean()), t


def run_dataset(name: str, args) -> dict:
    ms_all = [int(v) for v in args.m.split(",")]
    rows: dict[str, dict] = {}
    exact = []
    desc = ""
    for seed in range(args.seeds if name in SMALL else args.large_seeds):
        Xtr, ytr, Xte, yte, desc = load(name, args, seed)
        n = Xtr.shape[0]
        ms = [m for m in ms_all if m <= n // 2]
        ell = median_lengthscale(torch.as_tensor(Xtr), seed=seed)
        gamma = 1.0 / (2 * ell**2)
        methods = {
            "gpnys kmeans": lambda m: NystromFeatures(lengthscale=ell, n_components=m, landmarks="kmeans",
                                                     random_state=seed),
            "gpnys uniform": lambda m: NystromFeatures(lengthscale=ell, n_components=m, landmarks="uniform",
                                                      random_state=seed),
            "sklearn Nystroem": lambda m: Nystroem(gamma=gamma, n_components=m, random_state=seed),
        }
        for label, make in methods.items():
            for m in ms:
                acc, t = run_features(lambda: make(m), Xtr, ytr, Xte, yte, args.C, args.linear_solver)
                rows.setdefault(label, {}).setdefault(m, []).append((acc, t))
        if name in SMALL:
            for label, cls in (("GSA krr", GSAPosterior), ("LLA krr", LLAPosterior)):
                for m in ms:
                    acc, t = run_krr(cls, Xtr, ytr, Xte, yte, ell, m, args.krr_ridge, seed)
                    rows.setdefault(label, {}).setdefault(m, []).append((acc, t))
        n_svc = min(n, args.svc_cap)
        if n_svc < n:
            sub = np.random.default_rng(seed).choice(n, n_svc, replace=False)
            Xs, ys = Xtr[sub], ytr[sub]
        else:
            Xs, ys = Xtr, ytr
        pred, t = timed(lambda: SVC(C=args.C, kernel="rbf", gamma=gamma).fit(Xs, ys).predict(Xte))
        exact.append((float((pred == yte).mean()), t))
    out = {"description": desc, "n_train": int(n), "n_test": int(Xte.shape[0]), "d": int(Xtr.shape[1]),
           "lengthscale": ell, "gamma": gamma,
           "exact_svc": {"n": int(n_svc), "accuracy": float(np.mean([a for a, _ in exact])),
                         "time_s": float(np.mean([t for _, t in exact]))},
           "methods": {label: [{"m": m, "accuracy": float(np.mean([a for a, _ in v])),
                                "accuracy_std": float(np.std([a for a, _ in v])),
                                "time_s": float(np.mean([t for _, t in v]))} for m, v in by_m.items()]
                       for label, by_m in rows.items()}}
    out["check"] = target_check(out)
    return out


def target_check(res: dict) -> dict:
    """Per gpnys landmark rule: the cheapest m within 1 % (absolute) of the exact SVC's accuracy and its time ratio
    (target: <= 1/10); and the accuracy minus sklearn Nystroem's at every m (target: >= 0)."""
    ex = res["exact_svc"]
    sk = {r["m"]: r["accuracy"] for r in res["methods"]["sklearn Nystroem"]}
    out = {}
    for label in ("gpnys kmeans", "gpnys uniform"):
        ok = [r for r in res["methods"][label] if r["accuracy"] >= ex["accuracy"] - 0.01]
        best = min(ok, key=lambda r: r["time_s"]) if ok else None
        out[label] = {"within_1pct": None if best is None else {
                          "m": best["m"], "accuracy": best["accuracy"], "time_ratio": best["time_s"] / ex["time_s"]},
                      "met": best is not None and best["time_s"] <= 0.1 * ex["time_s"],
                      "accuracy_minus_sklearn": {r["m"]: r["accuracy"] - sk[r["m"]] for r in res["methods"][label]}}
    return out


def table(name: str, res: dict) -> str:
    ex = res["exact_svc"]
    lines = [f"\n{name}: {res['description']}; n_train={res['n_train']}, n_test={res['n_test']}, d={res['d']}, "
             f"l={res['lengthscale']:.3g} (gamma={res['gamma']:.3g})",
             f"  exact SVC (n={ex['n']}): accuracy {ex['accuracy']:.4f}, fit+predict {ex['time_s']:.2f} s",
             f"  {'method':<18}" + "".join(f"{'m=' + str(r['m']):>18}" for r in next(iter(res['methods'].values())))]
    for label, rs in res["methods"].items():
        lines.append(f"  {label:<18}" + "".join(f"{r['accuracy']:>9.4f} {r['time_s']:>6.2f}s " for r in rs))
    for label, chk in res["check"].items():
        w = chk["within_1pct"]
        ahead = chk["accuracy_minus_sklearn"]
        lines.append(f"  {label} within 1 % of exact SVC: " + (
            "never" if w is None else f"m={w['m']} (acc {w['accuracy']:.4f}) at {w['time_ratio']:.3f} x its time") +
            f" (<= 1/10: {'yes' if chk['met'] else 'no'}); >= sklearn Nystroem at {sum(v >= 0 for v in ahead.values())}"
            f" of {len(ahead)} m")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = list(results)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        res = results[name]
        for label, rs in res["methods"].items():
            ax.plot([r["time_s"] for r in rs], [r["accuracy"] for r in rs], "o-", ms=3, label=label)
        ex = res["exact_svc"]
        ax.plot([ex["time_s"]], [ex["accuracy"]], "k*", ms=10, label=f"exact SVC (n={ex['n']})")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("fit + predict time (s)")
        ax.set_ylabel("test accuracy")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: m = 20,50, 2000-row large sets, one seed")
    ap.add_argument("--data", default=",".join(DATASETS))
    ap.add_argument("--m", default="50,100,200,400,800")
    ap.add_argument("--C", type=float, default=1.0)
    ap.add_argument("--linear-solver", choices=("dual", "primal"), default="dual",
                    help="LinearSVC's solver: liblinear's dual coordinate descent or primal Newton (same objective)")
    ap.add_argument("--svc-cap", type=int, default=15000, help="largest n of the exact SVC")
    ap.add_argument("--synthetic-test", type=int, default=10000)
    ap.add_argument("--krr-ridge", type=float, default=1e-2)
    ap.add_argument("--seeds", type=int, default=5, help="seeds (splits, landmarks) of the two small sets")
    ap.add_argument("--large-seeds", type=int, default=1, help="seeds (landmarks) of elevators and synthetic")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.m, args.seeds, args.large_seeds, args.svc_cap = "20,50", 1, 1, min(args.svc_cap, 2000)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    prov = provenance(__file__, argv, "cpu")
    results = {}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LinearSVC's convergence notes; NumericalWarning of tiny K_mm modes
            for name in args.data.split(","):
                results[name] = run_dataset(name, args)
                print(table(name, results[name]), flush=True)
    finally:
        torch.set_num_threads(threads)
    path = Path(args.out) if args.out else RESULTS / ("nsl_svm_quick.json" if args.quick else "nsl_svm.json")
    meta = {"args": vars(args), "provenance": prov, "total_s": time.perf_counter() - t0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "results": results}, indent=1))
    plot(results, path.with_suffix(".png"))
    print(f"\nwrote {path} and {path.with_suffix('.png')} ({meta['total_s']:.0f} s)")
    return {**meta, "results": results}


if __name__ == "__main__":
    main()
