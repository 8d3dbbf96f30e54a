"""A kernel SVM through Nyström subspace learning: gpnys features + scikit-learn's LinearSVC in one Pipeline.

Run:  python examples/nsl_svm.py            (a few seconds)
      python examples/nsl_svm.py --m 200

[NSL] (W. Li, M. Liu, D. Zhang, "Nyström Subspace Learning for Large-scale SVMs") §3.3: LLA = NSL + linear SVM
learning. Map the data on the top-s orthonormal basis of the landmarks' span (Algorithm 1) and any off-the-shelf
linear SVM solves the Nyström kernel SVM (Algorithm 2). The example fits it on scikit-learn's digits ("9 vs rest"),
picks m by cross-validation, and compares with the exact RBF SVC at the same length-scale.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import GridSearchCV, train_test_split
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC, LinearSVC

from gpnys.reduced import NystromFeatures
from gpnys.reduced.nystrom_features import median_lengthscale


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="25,50,100", help="landmark counts tried by the grid search")
    ap.add_argument("--landmarks", default="kmeans", help="uniform, fps, kmeans or leverage")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    X, y = load_digits(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X, (y == 9).astype(int), test_size=0.3, random_state=args.seed, stratify=y)
    scaler = StandardScaler().fit(Xtr)
    ell = median_lengthscale(torch.as_tensor(scaler.transform(Xtr)))  # one kernel for every model below

    pipe = Pipeline([("scale", StandardScaler()),
                     ("nys", NystromFeatures(lengthscale=ell, landmarks=args.landmarks, random_state=args.seed)),
                     ("svm", LinearSVC(dual=True, max_iter=10_000))])  # dual CD: faster on dense n >> m features
    grid = GridSearchCV(pipe, {"nys__n_components": [int(m) for m in args.m.split(",")]}, cv=3)
    t0 = time.perf_counter()
    grid.fit(Xtr, ytr)
    nsl_acc, nsl_s = grid.score(Xte, yte), time.perf_counter() - t0
    m = grid.best_params_["nys__n_components"]

    t0 = time.perf_counter()
    svc = Pipeline([("scale", StandardScaler()), ("svm", SVC(gamma=1 / (2 * ell**2)))]).fit(Xtr, ytr)
    svc_acc, svc_s = svc.score(Xte, yte), time.perf_counter() - t0

    print(f"digits, 9 vs rest: {len(ytr)} training and {len(yte)} test rows, RBF length-scale {ell:.3g}")
    print(f"NSL: {args.landmarks} landmarks, m = {m} chosen by 3-fold CV among {args.m}: test accuracy "
          f"{nsl_acc:.4f} ({nsl_s:.2f} s with the grid search)")
    print(f"exact SVC: test accuracy {svc_acc:.4f} ({svc_s:.2f} s)")
    return {"m": m, "nsl_accuracy": float(nsl_acc), "svc_accuracy": float(svc_acc),
            "lengthscale": ell, "classes": np.unique(ytr).tolist()}


if __name__ == "__main__":
    main()
