"""Train a batch of independent GPs (BoTorch's two-output SingleTaskGP: inputs (2, n, d)) under gpnys's hook:
each output gets its own preconditioner and estimate, and the losses match GPyTorch's Cholesky path to within
their standard errors.

At these sizes the default solver ``"auto"`` would take GPyTorch's Cholesky (faster for small n; exact, no error
bars): the script forces the preconditioned path with ``EstimatorSettings(solver="iterative")``.

    python examples/batch_mode.py [--n 400]      (under a minute on 2 CPU cores)
"""

from __future__ import annotations

import argparse

import gpytorch
import torch
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP

import gpnys


def main(n: int = 400, steps: int = 20) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 3, generator=g, dtype=torch.float64)
    Y = torch.stack([torch.sin(6 * X[:, 0]), torch.cos(4 * X[:, 1]) + X[:, 2]], -1)
    Y = Y + 0.05 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    model = SingleTaskGP(X, Y)  # two outputs: a batch of two GPs
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    # BoTorch's fit (L-BFGS-B within the parameters' bounds); fixed probes make every evaluation the same function.
    # "auto" would take Cholesky at this n because it is faster there; "iterative" shows the preconditioned path
    with gpnys.use_preconditioner(model, settings=gpnys.EstimatorSettings(probe_seed=0, solver="iterative")) as hook:
        fit_gpytorch_mll(mll, optimizer_kwargs={"options": {"maxiter": steps}})
    se = [e.std_error / n for e in hook.batch_estimates]
    model.train()
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6):
        exact = -mll(model(*model.train_inputs), model.train_targets)
    settings = gpnys.EstimatorSettings(probe_seed=1, solver="iterative")
    with torch.no_grad(), gpnys.use_preconditioner(model, settings=settings) as hook:
        ours = -mll(model(*model.train_inputs), model.train_targets)
    print(f"path: {hook.last_estimate.path} ({hook.last_estimate.path_reason})")
    for i in range(2):
        e = hook.batch_estimates[i]
        print(f"output {i}: gpnys {float(ours[i]):.5f} ± {e.std_error / n:.1e} ({e.cg_iterations} CG iterations)  "
              f"Cholesky {float(exact[i]):.5f}")
    return {"gpnys": ours.tolist(), "cholesky": exact.tolist(),
            "std_error": [e.std_error / n for e in hook.batch_estimates], "training_std_error": se}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=400)
    main(parser.parse_args().n)
