"""GPyTorch exact-GP training on a GPU: the usual Adam loop, switched to gpnys in one line.

The model is plain GPyTorch (ScaleKernel(Matérn-3/2), constant mean, GaussianLikelihood) on synthetic 3-D points
with unit density, moved to the device with ``.to(device)`` as any GPyTorch model. Inside
``gpnys.use_preconditioner`` the kernel products and their derivatives run as fused Triton kernels on CUDA
(``kernel_backend``: torch tiles on the CPU), block-sparse over the leaf pairs within the kernel's cutoff radius,
and the memory budget comes from the device's free memory (docs/gpu.md). Prints the backend, the loss per step and
the predictive variances' time.

Run:  python examples/gpu_training.py                          (CUDA: n = 200 000, 10 steps)
      python examples/gpu_training.py --n 2000 --steps 2       (seconds, on the CPU when there is no GPU)
      python examples/gpu_training.py --n 1000000 --steps 50   (the 10^6-point fit of docs/gpu.md)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gpytorch
import torch

import gpnys
from gpnys import datasets
from gpnys.kernels.backends import select_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_n import GP  # noqa: E402  (the same plain GPyTorch model as examples/large_n.py)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--predict", type=int, default=2000, help="test points for predictive variances")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ds = datasets.load("synthetic3d", n=args.n, seed=0, standardize=False, dtype=dtype, device=device)
    y = (ds.train_y - ds.train_y.mean()) / ds.train_y.std()
    model = GP(ds.train_x, y).to(device=device, dtype=dtype)
    model.covar_module.base_kernel.lengthscale = 1.0
    model.likelihood.noise = 0.1
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    backend = select_backend(device)
    print(f"n = {args.n} on {device} ({args.dtype}); kernel backend: {backend}")
    losses, t0 = [], time.perf_counter()
    with gpnys.use_preconditioner(model, "auto") as hook:  # <- the one line
        for step in range(args.steps):
            opt.zero_grad()
            loss = -mll(model(ds.train_x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            sync(device)
            print(f"step {step + 1:3d}: loss {losses[-1]:.5f}  ({time.perf_counter() - t0:.1f} s)")
        train_s = time.perf_counter() - t0
        test_x = ds.test_x[: args.predict]
        t1 = time.perf_counter()
        mean, var = hook.predict(test_x)
        sync(device)
        predict_s = time.perf_counter() - t1
    print(f"training {train_s:.1f} s; predictive mean and variance at {test_x.shape[0]} points {predict_s:.1f} s; "
          f"lengthscale {float(model.covar_module.base_kernel.lengthscale.detach()):.3f}, "
          f"noise {float(model.likelihood.noise.detach()):.4f}")
    return {"backend": backend, "losses": losses, "train_s": train_s, "predict_s": predict_s,
            "mean": mean.detach(), "var": var.detach()}


if __name__ == "__main__":
    main()
