"""Quickstart: train an exact GP on a bundled data set and report test metrics.

Run: python examples/quickstart.py [--data energy] [--iters 50]
"""

import argparse
import math

import gpytorch
import torch

from gpnys import datasets
from gpnys.gp import ExactGPModel, fit, gaussian_nll, predict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", default="energy")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    ds = datasets.load(args.data, split=0)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ExactGPModel(ds.train_x, ds.train_y, lik, kernel="matern32").double()
    res = fit(model, iters=args.iters, lr=0.1, progress=False)
    mean, var = predict(model, ds.test_x)
    rmse = float(torch.sqrt((mean - ds.test_y).square().mean()))
    print(f"{ds.describe()}")
    print(f"final loss {res.loss_trace[-1]:.4f}; test RMSE (standardised) {rmse:.4f}; "
          f"test NLL (standardised) {gaussian_nll(ds.test_y, mean, var):.4f}")
    assert math.isfinite(rmse)


if __name__ == "__main__":
    main()
