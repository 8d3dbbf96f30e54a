"""Predictive variances at many points with a per-point error bound, and a requested accuracy.

An exact GP on elevators (Matérn-3/2, ARD) at hyperparameters from a short Cholesky fit on a subsample; then
``hook.predict`` at the test split with the cached method (``variance_method="cached"``), whose every variance comes
with ``hook.variance_bound``; then the same with ``variance_rel_error``, which recomputes by PCG the points whose
bound is too wide; both against the exact posterior (one Cholesky).

Run: python examples/predictive_variances.py [--n 4000] [--rel-error 0.02]
"""

from __future__ import annotations

import argparse
import time

import gpytorch

from gpnys import datasets
from gpnys.gp import ExactGPModel, fit
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import EstimatorSettings


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--rel-error", type=float, default=0.02)
    args = parser.parse_args(argv)
    ds = datasets.load("elevators", split=0)
    X, y = ds.train_x[: args.n].double(), ds.train_y[: args.n].double()
    T = ds.test_x[: args.test].double()
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ExactGPModel(X[:500], y[:500], lik, kernel="matern32", ard=True).double()
    with gpytorch.settings.max_cholesky_size(10**6):
        fit(model, iters=30, lr=0.1, progress=False)  # hyperparameters from 500 rows
    model.set_train_data(X, y, strict=False)
    out = {}
    for name, settings in (("cholesky", EstimatorSettings(variance_method="cholesky")),
                           ("cached", EstimatorSettings(variance_method="cached")),
                           ("cached, refined", EstimatorSettings(variance_method="cached",
                                                                 variance_rel_error=args.rel_error))):
        with use_preconditioner(model, "auto", settings=settings) as hook:
            t0 = time.perf_counter()
            mean, var = hook.predict(T)
            out[name] = (time.perf_counter() - t0, var, hook.variance_bound)
    ref = out["cholesky"][1]
    latent = ref - model.likelihood.noise.detach()
    print(f"elevators, n = {X.shape[0]}, {T.shape[0]} test points")
    for name, (t, var, bound) in out.items():
        err = (var - ref).abs() / latent
        inside = float(((var - ref).abs() <= bound + 1e-12).double().mean())
        print(f"{name:16s} {t:6.2f} s  variance error median {float(err.median()):.1e}, max {float(err.max()):.1e}; "
              f"bound / variance median {float((bound / latent).median()):.1e}; error within the bound at "
              f"{100 * inside:.1f} % of the points")
    res = {k: {"time_s": v[0], "variance": v[1], "bound": v[2]} for k, v in out.items()}
    return res | {"reference": ref, "noise": float(model.likelihood.noise.detach())}


if __name__ == "__main__":
    main()
