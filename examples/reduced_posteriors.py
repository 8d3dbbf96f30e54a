"""Nyström-reduced GP posteriors (LLA, NCR, GSA) and random Fourier features next to the exact GP.

Trains an exact GP (constant mean, ScaleKernel over a Matérn-3/2) for a few Adam steps through GPyTorch's
CG + SLQ with the gpnys ``auto`` preconditioner, then, at those hyperparameters, builds the reduced posteriors
with ``gpnys.reduced.reduced_posterior`` (m FPS landmarks; RFF: m frequencies, 2m features) and prints, per
method, test RMSE / NLL (standardised units) and the RKHS distance ``|f - f*|_H`` of its predictive mean to the
exact GP's ([SPA] eq. (15)/(19)). Finally the same LLA posterior as a GPyTorch-style model,
``ReducedGP.from_exact(model, ...)`` with ``likelihood(model(test_x))``.

Run: python examples/reduced_posteriors.py [--data elevators] [--n 2000] [--m 200] [--iters 8]
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import gpytorch
import torch

import gpnys
from gpnys import datasets
from gpnys.checks import NumericalWarning
from gpnys.gp import ExactGPModel, gaussian_nll
from gpnys.reduced import ExactPosterior, ReducedGP, reduced_posterior, rkhs_error

#: (label, method, options for reduced_posterior)
VARIANTS = (
    ("lla", "lla", {}),  # DTC variance (default); variance="sor" for SoR
    ("ncr", "ncr", {}),
    ("gsa-woodbury", "gsa", {"coef": "woodbury"}),
    ("gsa-min_norm", "gsa", {"coef": "min_norm"}),
    ("rff", "rff", {}),
)


def train_exact(ds, iters: int) -> ExactGPModel:
    """A few Adam steps on the exact marginal likelihood with the gpnys preconditioner (the pattern of
    examples/gpytorch_training.py), from a starting point suited to standardised data."""
    torch.manual_seed(0)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ExactGPModel(ds.train_x, ds.train_y, likelihood, kernel="matern32").double()
    model.covar_module.base_kernel.lengthscale = 4.0
    model.covar_module.outputscale = 1.0
    likelihood.noise = 0.1
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with gpnys.use_preconditioner(model, "auto"):
        model.train()
        for _ in range(iters):
            opt.zero_grad()
            loss = -mll(model(ds.train_x), ds.train_y)
            loss.backward()
            opt.step()
    model.eval()
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="elevators")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--m", type=int, default=200)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--landmarks", default="fps", choices=("uniform", "fps", "kmeans", "leverage"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    ds = datasets.load(args.data, split=0, n=args.n, seed=0)
    print(ds.describe())

    t0 = time.perf_counter()
    model = train_exact(ds, args.iters)
    kernel = model.covar_module
    noise = float(model.likelihood.noise.detach())
    prior_mean = float(model.mean_module.constant.detach())
    print(f"exact GP: {args.iters} Adam steps with gpnys 'auto' ({time.perf_counter() - t0:.1f} s): "
          f"lengthscale {float(kernel.base_kernel.lengthscale.detach()):.3f}, "
          f"outputscale {float(kernel.outputscale.detach()):.3f}, noise {noise:.4f}")

    X, y, Xt, yt = ds.train_x, ds.train_y, ds.test_x, ds.test_y
    rows = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        exact = ExactPosterior(kernel, X, y, noise, prior_mean=prior_mean)  # Cholesky up to n = 10 000
        mean, var = exact.mean(Xt), exact.variance(Xt)
        rows["exact"] = {"rmse": float((mean - yt).square().mean().sqrt()),
                         "nll": gaussian_nll(yt, mean, var + noise), "rkhs_error": 0.0,
                         "fit_s": time.perf_counter() - t0}
        f_norm = math.sqrt(exact.quad)  # |f*|_H
        for label, method, options in VARIANTS:
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", NumericalWarning)
                rule = None if method == "rff" else args.landmarks
                post = reduced_posterior(method, kernel, X, y, noise, m=args.m, landmarks=rule, seed=0,
                                         prior_mean=prior_mean, **options)
                mean, var = post.mean(Xt), post.variance(Xt)
            rows[label] = {"rmse": float((mean - yt).square().mean().sqrt()),
                           "nll": gaussian_nll(yt, mean, var + noise),
                           "rkhs_error": None if method == "rff" else rkhs_error(post, exact),
                           "fit_s": time.perf_counter() - t0,
                           "warnings": [str(w.message).split(" (the GSA")[0] for w in caught]}

    print(f"\nm = {args.m} ({args.landmarks} landmarks; RFF: {args.m} frequencies = {2 * args.m} features), "
          f"n = {X.shape[0]}, {Xt.shape[0]} test points, |f*|_H = {f_norm:.2f}")
    print(f"{'method':14s} {'test RMSE':>9s} {'test NLL':>9s} {'|f - f*|_H':>10s} {'relative':>8s} {'build+predict s':>15s}")
    for label, r in rows.items():
        err = "n/a" if r["rkhs_error"] is None else f"{r['rkhs_error']:.3f}"
        rel = "n/a" if r["rkhs_error"] is None else f"{r['rkhs_error'] / f_norm:.3f}"
        print(f"{label:14s} {r['rmse']:9.4f} {r['nll']:9.4f} {err:>10s} {rel:>8s} {r['fit_s']:15.2f}")
        for w in r.get("warnings", []):
            print(f"{'':14s} warning: {w}")

    # The same LLA posterior as a GPyTorch-style model: hyperparameters copied from the trained exact GP.
    reduced = ReducedGP.from_exact(model, method="lla", m=args.m, landmarks=args.landmarks)
    reduced.eval()
    with torch.no_grad():
        latent = reduced(Xt)  # MultivariateNormal of f (diagonal covariance)
        pred = reduced.likelihood(latent)  # + noise
    rows["ReducedGP(lla)"] = {"rmse": float((pred.mean - yt).square().mean().sqrt()),
                              "nll": gaussian_nll(yt, pred.mean, pred.variance)}
    r = rows["ReducedGP(lla)"]
    print(f"\nReducedGP.from_exact(model, method='lla', m={args.m}): likelihood(model(test_x)) is a "
          f"{type(pred).__name__}; test RMSE {r['rmse']:.4f}, NLL {r['nll']:.4f} (the 'lla' row above)")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return rows


if __name__ == "__main__":
    main()
