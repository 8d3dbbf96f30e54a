"""A GPyTorch ExactGP at large n: Adam steps on the marginal likelihood without an n x n matrix.

The model is plain GPyTorch (ScaleKernel(Matérn-3/2), constant mean, GaussianLikelihood) on synthetic 3-D points
with unit density. ``gpnys.use_preconditioner`` makes GPyTorch's CG + SLQ estimator use the ``auto``
preconditioner and gpnys's kernel operator; ``gpnys.memory_budget`` bounds its temporary blocks and the dense
cache. With ``dense_bytes=0`` the kernel is recomputed on every product, skipping the blocks whose entries are all
below machine epsilon (docs/scaling.md); the script prints the share of entries computed per product. Where a
step needs ``--grow-landmarks`` CG iterations or more (default 15), AFN's landmarks double for the next steps
(docs/training.md, "Landmarks that grow"): the rank column shows it.

Run:  python examples/large_n.py                    (n = 50 000, 3 Adam steps, float32: a few minutes)
      python examples/large_n.py --n 4000 --steps 2 (seconds)
"""

from __future__ import annotations

import argparse
import time

import gpytorch
import torch

import gpnys
from gpnys import datasets


class GP(gpytorch.models.ExactGP):
    def __init__(self, X: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(X, y, gpytorch.likelihoods.GaussianLikelihood())
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--block-mib", type=int, default=32)
    ap.add_argument("--grow-landmarks", type=int, default=gpnys.EstimatorSettings.grow_landmarks,
                    help="CG iterations at which AFN's landmarks double (0: never)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    # unit density (no input standardisation), standardised targets
    ds = datasets.load("synthetic3d", n=args.n, seed=0, standardize=False, dtype=dtype)
    y = (ds.train_y - ds.train_y.mean()) / ds.train_y.std()
    model = GP(ds.train_x, y).to(dtype)
    model.covar_module.base_kernel.lengthscale = 1.0
    model.likelihood.noise = 0.1
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    rows = []
    with gpnys.memory_budget(block_bytes=args.block_mib << 20, dense_bytes=0):
        settings = gpnys.EstimatorSettings(grow_landmarks=args.grow_landmarks or None)
        with gpnys.use_preconditioner(model, "auto", seed=0, settings=settings) as hook:
            for step in range(args.steps):
                t0 = time.perf_counter()
                opt.zero_grad()
                loss = -mll(model(ds.train_x), y)
                loss.backward()
                opt.step()
                rec = hook.history[-1] if hook.history else None  # None on auto's Cholesky path (small n)
                row = {"step": step, "loss": float(loss.detach()), "time_s": time.perf_counter() - t0,
                       "path": hook.path, "precond": rec and rec.kind, "rank": rec and rec.rank,
                       "kernel_fraction": hook.kernel_fraction,
                       "lengthscale": model.covar_module.base_kernel.lengthscale.detach().item(),
                       "noise": model.likelihood.noise.detach().item()}
                rows.append(row)
                print(f"step {step}: loss {row['loss']:.5f}  {row['time_s']:.1f} s  {row['precond']} rank {row['rank']}  "
                      f"kernel entries computed {row['kernel_fraction']:.1%}  lengthscale {row['lengthscale']:.3f}  "
                      f"noise {row['noise']:.4f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
