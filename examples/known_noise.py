"""Known per-point noise (GPyTorch's ``FixedNoiseGaussianLikelihood``, BoTorch's ``train_Yvar``) under gpnys.

Heteroscedastic data: each target has its own known noise variance, spread over two decades. The script

1. builds the AFN preconditioner of ``K + D`` two ways, on ``D`` itself (``diag=``, what the hook does) and on
   ``mean(D) I``, and counts the PCG iterations of one solve with each;
2. trains the same GPyTorch model with ``gpnys.use_preconditioner`` and with Cholesky for a few Adam steps and
   prints both losses and length-scales.

Run: python examples/known_noise.py [--n 3000] [--iters 10]
"""

from __future__ import annotations

import argparse

import gpytorch
import torch

import gpnys
from gpnys.precond.strategy import make_preconditioner
from gpnys.solvers.pcg import pcg


class GP(gpytorch.models.ExactGP):
    def __init__(self, x, y, noise):
        super().__init__(x, y, gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=noise))
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` points in the unit square, targets with known noise variances log-uniform in [1e-3, 1e-1]."""
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64)
    noise = 1e-3 * 100 ** torch.rand(n, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) * torch.cos(4 * X[:, 1]) + noise.sqrt() * torch.randn(n, generator=g, dtype=X.dtype)
    return X, y, noise


def pcg_iterations(X, y, noise, lengthscale: float = 0.2, k: int = 200, w: int = 30) -> dict[str, int]:
    """Iterations of one PCG solve of ``(K + D) x = y`` with AFN built on ``D`` and on ``mean(D) I``."""
    kern = gpytorch.kernels.MaternKernel(nu=1.5).double()
    kern.lengthscale = lengthscale
    with torch.no_grad():
        A = kern(X).to_dense() + torch.diag(noise)
    out = {}
    for label, diag in (("per-point (diag=D)", noise), ("mean(D) I", None)):
        P = make_preconditioner("afn", X, kern, float(noise.mean()), k=k, w=w, diag=diag)
        out[label] = pcg(lambda V: A @ V, y[:, None], precond=P, tol=1e-8, maxiter=2000).iterations
    return out


def train(X, y, noise, iters: int, use_gpnys: bool) -> dict:
    torch.manual_seed(0)
    model = GP(X, y, noise).double()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ctx = gpnys.use_preconditioner(model, "afn") if use_gpnys else gpytorch.settings.max_cholesky_size(len(y) + 1)
    with ctx:  # <- the one line
        model.train()
        for _ in range(iters):
            opt.zero_grad()
            loss = -mll(model(X), y)
            loss.backward()
            opt.step()
    with gpytorch.settings.max_cholesky_size(len(y) + 1), torch.no_grad():  # the final loss, exactly
        model.train()
        exact = float(-mll(model(X), y))
    kern = model.covar_module
    return {"loss": exact, "lengthscale": float(kern.base_kernel.lengthscale.detach()),
            "outputscale": float(kern.outputscale.detach())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    X, y, noise = data(args.n)
    its = pcg_iterations(X, y, noise)
    print("PCG iterations, AFN (k = 200, w = 30), relative residual 1e-8:")
    for label, it in its.items():
        print(f"  {label:>20}: {it}")
    fits = {"gpnys": train(X, y, noise, args.iters, True), "cholesky": train(X, y, noise, args.iters, False)}
    print(f"\n{args.iters} Adam steps (exact loss at the end):")
    for name, r in fits.items():
        print(f"  {name:>8}: loss {r['loss']:.5f}, lengthscale {r['lengthscale']:.4f}, "
              f"outputscale {r['outputscale']:.4f}")
    return {"pcg_iterations": its, **fits}


if __name__ == "__main__":
    main()
