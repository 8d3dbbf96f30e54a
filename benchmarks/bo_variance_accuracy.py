"""Accuracy and cost of ``PreconditionedSingleTaskGP``'s PCG posterior variances and their gradients, per
``posterior_variance_rtol`` (docs/bo.md, "Posterior").

Run:  python benchmarks/bo_variance_accuracy.py --n 5000 --noise 1e-4 [--float32]
      python benchmarks/bo_variance_accuracy.py --quick      (n = 300, 3 steps; run by the test suite)

Hartmann-6 (``negate=True``) at ``--n`` scrambled-Sobol points, float64 (``--float32``: the model in float32, and
float32 ``SingleTaskGP``'s errors for comparison), ``Standardize``, BoTorch's RBF ARD kernel at
the length-scales a fit found at n = 5000 (benchmarks/bo_gradient.py), the noise ``--noise``; the PCG posterior forced
(``posterior_cholesky_size=0``). One model (one posterior preconditioner) serves every setting, its warm blocks
cleared between them. Per setting: one cold posterior at 128 random points (``optimize_acqf``'s raw samples), then
``--steps + 1`` warm ones at 5 points moving by shrinking random steps (an L-BFGS run over 5 restarts), each with the
gradient of the variances w.r.t. the points. Errors against ``SingleTaskGP`` (float64 Cholesky) at the same
hyperparameters: the largest relative variance error, and the gradient's largest error over its largest component.
"""

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from botorch.models import SingleTaskGP
from botorch.models.transforms.outcome import Standardize
from botorch.test_functions import Hartmann
from torch.quasirandom import SobolEngine

from gpnys.baselines.provenance import provenance
from gpnys.bo import PreconditionedSingleTaskGP

LENGTHSCALE = (0.286, 0.369, 0.466, 0.342, 0.333, 0.317)
RESULTS = Path(__file__).resolve().parent / "results"


def variance_and_gradient(model, x):
    x = x.clone().to(model.train_inputs[0].dtype).requires_grad_(True)
    variance = model.posterior(x).variance
    (grad,) = torch.autograd.grad(variance.sum(), x)
    return variance.detach().reshape(-1).double(), grad.double()


def errors(got, ref):
    return (float(((got[0] - ref[0]).abs() / ref[0]).max()),
            float((got[1] - ref[1]).abs().max() / ref[1].abs().max()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--noise", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rtol", default="none,1e-4,1e-3", help="posterior_variance_rtol values ('none': unchecked)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--float32", action="store_true")
    ap.add_argument("--quick", action="store_true", help="n = 300, 3 steps")
    ap.add_argument("--out", default=None, help="JSON (default: benchmarks/results/bo_variance_accuracy.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.steps = 300, 3
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    X = SobolEngine(6, scramble=True, seed=0).draw(args.n, dtype=torch.float64)
    Y = Hartmann(dim=6, negate=True)(X).unsqueeze(-1)
    dtype = torch.float32 if args.float32 else torch.float64
    model = PreconditionedSingleTaskGP(X.to(dtype), Y.to(dtype), outcome_transform=Standardize(m=1),
                                       max_cholesky_size=0, posterior_cholesky_size=0)
    with torch.no_grad():
        model.covar_module.lengthscale = torch.tensor([LENGTHSCALE], dtype=dtype)
        model.likelihood.noise = args.noise
    model.eval()
    ref = SingleTaskGP(X, Y, outcome_transform=Standardize(m=1))
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref.eval()
    g = torch.Generator().manual_seed(3)
    raw = torch.rand(128, 1, 6, dtype=torch.float64, generator=g)
    steps = torch.randn(args.steps, 5, 1, 6, dtype=torch.float64, generator=g)
    path = [raw[:5]]
    for k in range(args.steps):
        path.append((path[-1] + 0.02 / (1 + k) * steps[k]).clamp(0, 1))
    start = time.perf_counter()
    variance_and_gradient(model, raw[:1])  # builds the posterior preconditioner
    build = time.perf_counter() - start
    ref_raw, ref_last = variance_and_gradient(ref, raw), variance_and_gradient(ref, path[-1])
    print(f"Hartmann-6, n = {args.n}, noise {args.noise:g}, {dtype}, {args.threads} threads (posterior "
          f"preconditioner {build:.1f} s)")
    print("| posterior_variance_rtol | cold: PCG it. | variance err. | gradient err. | warm: PCG it. (per call) | "
          "s | variance err. | gradient err. | posterior_variance_error |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for rtol in args.rtol.split(","):
        model._gpnys_config["posterior_variance_rtol"] = None if rtol == "none" else float(rtol)
        model._gpnys_posterior = None  # no warm blocks from the previous setting (the preconditioner stays)
        cold = errors(variance_and_gradient(model, raw), ref_raw)
        cold_it = model.posterior_iterations
        its, start = [], time.perf_counter()
        for x in path:
            out = variance_and_gradient(model, x)
            its.append(model.posterior_iterations)
        seconds = time.perf_counter() - start
        warm = errors(out, ref_last)
        bound = "-" if model.posterior_variance_error is None else f"{model.posterior_variance_error:.1e}"
        print(f"| {rtol} | {cold_it} | {cold[0]:.1e} | {cold[1]:.1e} | {sum(its)} ({its[0]}, {its[1]}, ... "
              f"{its[-1]}) | {seconds:.1f} | {warm[0]:.1e} | {warm[1]:.1e} | {bound} |", flush=True)
        rows.append({"rtol": rtol, "cold_iterations": cold_it, "cold_variance_error": cold[0],
                     "cold_gradient_error": cold[1], "warm_iterations": sum(its), "warm_s": seconds,
                     "warm_variance_error": warm[0], "warm_gradient_error": warm[1],
                     "posterior_variance_error": model.posterior_variance_error})
    if args.float32:
        single = SingleTaskGP(X.float(), Y.float(), outcome_transform=Standardize(m=1))
        single.load_state_dict(model.state_dict())
        single.eval()
        cold = errors(variance_and_gradient(single, raw), ref_raw)
        warm = errors(variance_and_gradient(single, path[-1]), ref_last)
        print(f"| float32 SingleTaskGP | - | {cold[0]:.1e} | {cold[1]:.1e} | - | - | {warm[0]:.1e} | {warm[1]:.1e} "
              "| - |")
        rows.append({"rtol": "float32 SingleTaskGP", "cold_variance_error": cold[0], "cold_gradient_error": cold[1],
                     "warm_variance_error": warm[0], "warm_gradient_error": warm[1]})
    out = {"n": args.n, "noise": args.noise, "dtype": str(dtype), "threads": args.threads, "steps": args.steps,
           "preconditioner_s": build, "rows": rows, "provenance": provenance(__file__, argv)}
    path = Path(args.out) if args.out else RESULTS / "bo_variance_accuracy.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
