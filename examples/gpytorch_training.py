"""An ordinary GPyTorch training loop, switched to gpnys in one line, next to the same loop on Cholesky.

The model, likelihood, optimiser and loop are plain GPyTorch; only the ``with gpnys.use_preconditioner(...)``
line differs. Prints both fits' hyperparameters, test RMSE / NLL and time, and what the preconditioner did.

At this size the default solver ``"auto"`` would take GPyTorch's own Cholesky too (a cost model calibrated on your
machine predicts it faster for small n), so the script forces the preconditioned path
(``EstimatorSettings(solver="iterative")``); ``--solver auto`` shows the path ``auto`` takes, and why.

Run: python examples/gpytorch_training.py [--data elevators] [--n 2000] [--iters 30] [--ard] [--solver auto]
     (one to two minutes on 2 CPU cores, more when they are busy)
"""

from __future__ import annotations

import argparse
import time

import gpytorch
import torch

import gpnys
from gpnys import datasets
from gpnys.gp.training import gaussian_nll


class GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood, ard):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        kern = gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=x.shape[1] if ard else None)
        self.covar_module = gpytorch.kernels.ScaleKernel(kern)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def train(ds, iters: int, ard: bool, use_gpnys: bool, solver: str = "iterative") -> dict:
    torch.manual_seed(0)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = GP(ds.train_x, ds.train_y, likelihood, ard).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    n = ds.train_x.shape[0]
    # "auto" would take Cholesky at this n because it is faster there; "iterative" shows the preconditioned path
    settings = gpnys.EstimatorSettings(solver=solver)
    ctx = (gpnys.use_preconditioner(model, "auto", settings=settings) if use_gpnys
           else gpytorch.settings.max_cholesky_size(n + 1))
    t0 = time.perf_counter()
    with ctx as hook:  # <- the one line
        model.train()
        for _ in range(iters):
            opt.zero_grad()
            loss = -mll(model(ds.train_x), ds.train_y)
            loss.backward()
            opt.step()
        train_s = time.perf_counter() - t0
        if use_gpnys:
            mean, var = hook.predict(ds.test_x)
        else:
            model.eval()
            with torch.no_grad():
                pred = likelihood(model(ds.test_x))
                mean, var = pred.mean, pred.variance
    out = {
        "train_s": train_s,
        "loss": float(loss.detach()),
        "noise": float(likelihood.noise.detach()),
        "outputscale": float(model.covar_module.outputscale.detach()),
        "rmse": float((mean - ds.test_y).square().mean().sqrt()),
        "nll": gaussian_nll(ds.test_y, mean, var),
    }
    if use_gpnys:
        out["preconditioners"] = sorted({(r.kind, r.rank) for r in hook.history})
        out["builds"], out["cg_applications"] = hook.builds, hook.applications
        out["path"] = hook.path  # "cholesky" where auto's cost model predicts it faster (gpnys.gp.path)
        out["path_reason"] = hook.path_reason
        est = hook.last_estimate.per_point()
        out["loss_std_error"], out["cg_iterations"] = est["loss_std_error"], est["cg_iterations"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="elevators")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--ard", action="store_true")
    ap.add_argument("--solver", choices=("iterative", "auto"), default="iterative",
                    help="iterative: the preconditioned path (default); auto: Cholesky where predicted faster")
    args = ap.parse_args(argv)
    ds = datasets.load(args.data, split=0, n=args.n, seed=0)
    print(ds.describe())
    res = {}
    for name, flag in (("cholesky", False), ("gpnys", True)):
        r = res[name] = train(ds, args.iters, args.ard, flag, args.solver)
        se = f" ± {r['loss_std_error']:.1e}" if flag else ""
        print(f"{name:9s} loss {r['loss']:.4f}{se}  noise {r['noise']:.4f}  outputscale {r['outputscale']:.4f}  "
              f"test RMSE {r['rmse']:.4f}  NLL {r['nll']:.4f}  ({r['train_s']:.1f} s)")
    g = res["gpnys"]
    print(f"gpnys took the {g['path']} path ({g['path_reason']}), built {g['builds']} preconditioners "
          f"(kind, rank) {g['preconditioners']}, {g['cg_applications']} applications; last step "
          f"{g['cg_iterations']} CG iterations (losses per point, standardised units)")
    return res


if __name__ == "__main__":
    main()
