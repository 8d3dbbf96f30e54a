"""Quickstart: a plain GPyTorch exact GP trained with gpnys's one-line hook.

Model, likelihood, optimiser and loop are ordinary GPyTorch. Inside ``with gpnys.use_preconditioner(model)``
the loss and its gradients come from preconditioned CG and stochastic Lanczos quadrature, each with a standard
error (``hook.last_estimate``); the final loss is checked against GPyTorch's Cholesky at the same hyperparameters.

At this size the default solver ``"auto"`` would take GPyTorch's own Cholesky (a cost model calibrated on your
machine predicts it faster for small n: exact, standard error 0), so the script forces the preconditioned path
(``EstimatorSettings(solver="iterative")``); ``--solver auto`` shows the path ``auto`` takes, and why.

Run: python examples/quickstart.py [--n 1000] [--iters 20] [--solver auto]     (under a minute on 2 CPU cores)
"""

import argparse

import gpytorch
import torch

import gpnys
from gpnys import datasets


class GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, likelihood):
        super().__init__(x, y, likelihood)
        self.mean_module = gpytorch.means.ConstantMean()
        kern = gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=x.shape[1])
        self.covar_module = gpytorch.kernels.ScaleKernel(kern)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--solver", choices=("iterative", "auto"), default="iterative",
                    help="iterative: the preconditioned path (default); auto: Cholesky where predicted faster")
    args = ap.parse_args(argv)
    torch.manual_seed(0)  # the estimator's random probes
    ds = datasets.load("elevators", split=0, n=args.n, seed=0)  # float64, standardised on the training rows
    print(ds.describe())
    likelihood = gpytorch.likelihoods.GaussianLikelihood().double()
    model = GP(ds.train_x, ds.train_y, likelihood).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.train()
    # "auto" would take Cholesky at this n because it is faster here; "iterative" shows the preconditioned path
    settings = gpnys.EstimatorSettings(solver=args.solver)
    with gpnys.use_preconditioner(model, settings=settings) as hook:  # <- the one line (preconditioner "auto")
        for step in range(args.iters):
            opt.zero_grad()
            loss = -mll(model(ds.train_x), ds.train_y)
            loss.backward()
            opt.step()
            if step % 5 == 0:
                est = hook.last_estimate.per_point()  # loss / n and its standard error
                print(f"step {step:3d}  loss {est['loss']:.4f} ± {est['loss_std_error']:.1e}  "
                      f"({est['cg_iterations']} CG iterations)")
        with torch.no_grad():  # the loss at the trained hyperparameters
            loss = -mll(model(ds.train_x), ds.train_y)
        est = hook.last_estimate.per_point()
        mean, _ = hook.predict(ds.test_x)
    model.train()
    with gpytorch.settings.max_cholesky_size(10**9), torch.no_grad():
        exact = float(-mll(model(ds.train_x), ds.train_y))
    rmse = float((mean - ds.test_y).square().mean().sqrt())
    print(f"path: {hook.last_estimate.path} ({hook.last_estimate.path_reason})")
    se = est["loss_std_error"]
    print(f"final loss {float(loss):.5f} ± {se:.1e}; Cholesky at the same hyperparameters {exact:.5f}"
          + (f" ({(float(loss) - exact) / se:+.1f} standard errors)" if se > 0 else " (exact: the same path)"))
    print(f"test RMSE (standardised) {rmse:.4f}; preconditioners (kind, rank) "
          f"{sorted({(r.kind, r.rank) for r in hook.history})}")
    return {"loss": float(loss), "loss_std_error": est["loss_std_error"], "cholesky_loss": exact, "rmse": rmse}


if __name__ == "__main__":
    main()
