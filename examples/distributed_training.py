"""GPyTorch exact-GP training with the kernel split across processes (torch.distributed), the same loop on each.

Every rank loads the same data and builds the same plain GPyTorch model; ``gpnys.distributed.init`` joins the
process group torchrun set up (gloo on CPUs, NCCL on GPUs) and seeds every rank alike, and
``gpnys.distributed.settings()`` makes each rank compute only its rows of every kernel product and derivative sum
(docs/scaling.md). The losses, gradients and hyperparameters are then those of one process; rank 0 prints them.

Run:  torchrun --nproc-per-node 2 examples/distributed_training.py --num-points 20000   (two CPU processes)
      torchrun --nproc-per-node 8 examples/distributed_training.py --num-points 1000000 --device cuda
      python examples/distributed_training.py --n 2000 --steps 2                 (one process: the same numbers)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gpytorch
import torch

import gpnys
import gpnys.distributed as gd
from gpnys import datasets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_n import GP  # noqa: E402  (the same plain GPyTorch model as examples/large_n.py)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", "--num-points", dest="n", type=int, default=20_000,
                    help="training points (--num-points under torchrun: its parser takes --n for --nnodes)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    under_torchrun = gd.launched()
    if under_torchrun:
        rank, size = gd.init(backend="nccl" if args.device == "cuda" else "gloo", seed=0)
        device = gd.device()
        settings = gd.settings()  # <- the kernel split by rows over the ranks
    else:
        rank, size, device, settings = 0, 1, torch.device(args.device), gpnys.EstimatorSettings()
        torch.manual_seed(0)
    ds = datasets.load("synthetic3d", n=args.n, seed=0, standardize=False, dtype=torch.float64, device=device)
    y = (ds.train_y - ds.train_y.mean()) / ds.train_y.std()
    model = GP(ds.train_x, y).to(device=device, dtype=torch.float64)
    model.covar_module.base_kernel.lengthscale = 1.0
    model.likelihood.noise = 0.1
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, t0 = [], time.perf_counter()
    with gpnys.use_preconditioner(model, "auto", settings=settings):
        for step in range(args.steps):
            opt.zero_grad()
            loss = -mll(model(ds.train_x), y)
            loss.backward()  # every rank holds the whole gradient: the derivative sums were all-reduced
            opt.step()
            losses.append(float(loss.detach()))
            if gd.is_main():
                print(f"step {step + 1:3d}: loss {losses[-1]:.8f}  ({time.perf_counter() - t0:.1f} s, {size} ranks)")
    ls = float(model.covar_module.base_kernel.lengthscale.detach())
    if gd.is_main():
        print(f"lengthscale {ls:.6f}, noise {float(model.likelihood.noise.detach()):.6f}")
    if under_torchrun:
        torch.distributed.destroy_process_group()
    return {"rank": rank, "size": size, "losses": losses, "lengthscale": ls}


if __name__ == "__main__":
    main()
