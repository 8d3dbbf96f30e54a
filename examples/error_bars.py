"""Error bars on the marginal likelihood, a requested accuracy, and training that stops at the noise.

1. one value + gradient of -MLL/n with gpnys, its standard errors, and Cholesky's answer beside it; then the same
   with the fixed floor of 10 Lanczos steps (``lanczos_share=None``): the quadrature test stops CG earlier with the
   same answer;
2. the same with ``target_rel_error`` (``--accuracy`` on the command line): more probes, smaller errors;
3. Adam under the one-line switch until the gradient is within its noise (the RMS of g / SE at most 1).

Run: python examples/error_bars.py [--n 1500] [--accuracy 3e-3]
"""

from __future__ import annotations

import argparse

import gpytorch
import torch

import gpnys
from gpnys import datasets
from gpnys.baselines.mll import evaluate
from gpnys.gp.estimator import gradient_at_noise
from gpnys.gp.training import ExactGPModel, fit


def show(name: str, out: dict) -> None:
    se = out.get("loss_std_error", 0.0)
    its = out["extra"].get("cg_iterations_max")
    print(f"{name:>10}: loss {out['loss']:.6f} ± {se:.1e}   d/d raw_noise {out['grad']['raw_noise']:+.5f}"
          f" ± {out.get('grad_std_error', {}).get('raw_noise', 0.0):.1e}   ({out['time_s']:.2f} s"
          + ("" if its is None else f", {its} CG iterations") + ")")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=1500)
    ap.add_argument("--accuracy", type=float, default=3e-3)
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args(argv)
    ds = datasets.load("elevators", n=args.n, seed=0)
    X, y = ds.train_x, ds.train_y
    common = {"kernel": "matern32", "lengthscale": 2.0, "noise": 0.1}

    show("Cholesky", evaluate(X, y, "exact", **common))
    evaluate(X, y, "auto", seed=0, **common)  # a warm-up: the first call's one-off set-up would skew the timings
    show("gpnys", evaluate(X, y, "auto", seed=0, **common))
    show("floor 10", evaluate(X, y, "auto", seed=0, settings=gpnys.EstimatorSettings(lanczos_share=None), **common))
    acc = evaluate(X, y, "auto", seed=0, settings=gpnys.EstimatorSettings(target_rel_error=args.accuracy), **common)
    show(f"τ={args.accuracy:g}", acc)
    print(f"            ({acc['extra']['probes']} probes to reach it)")

    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").to(X)
    # at a few hundred points "auto" would take Cholesky (exact, no error bars: gpnys.gp.path); the error bars are
    # the point here
    with gpnys.use_preconditioner(model, "auto", settings=gpnys.EstimatorSettings(solver="iterative")) as hook:
        res = fit(model, iters=args.iters, lr=0.1, progress=False,
                  settings=lambda n: torch.enable_grad(), stop=lambda: gradient_at_noise(model, hook.last_estimate))
    est = hook.last_estimate
    print(f"Adam: {res.iterations} of {args.iters} steps, stopped: {res.stopped}; final loss {res.loss_trace[-1]:.4f}"
          f" ± {est.std_error / est.n:.1e}")


if __name__ == "__main__":
    main()
