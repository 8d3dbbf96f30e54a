"""How accurate the training loss and gradient of ``PreconditionedSingleTaskGP`` are near BoTorch's noise floor:
errors against Cholesky across noise levels, control variates and probe seeds.

Run:  python benchmarks/bo_gradient.py --threads 2                 (n = 5000, ~3 minutes)
      python benchmarks/bo_gradient.py --quick                     (n = 300, the tests run it)

Hartmann-6 (``negate=True``) at ``--n`` scrambled-Sobol points, float64, BoTorch's default modules (``Standardize``,
RBF ARD kernel, noise bounded below by 1e-4 without a softplus, a log-normal noise prior). Fixed hyperparameters:
the length-scales ``--lengthscale`` and each noise in ``--noise``. For each noise:

* the exact loss ``-MLL / n`` and gradient by Cholesky (BoTorch's path), and the exact ``tr K̂⁻¹`` and ``αᵀα``
  (``α = K̂⁻¹ (y - m)``, by ``cholesky_inverse``), whose difference is the data part of the noise gradient;
* the gpnys estimate (``model.preconditioned()``: CG + SLQ with the BO training preconditioner) for each control
  variate in ``--control-variates`` (``none``: GPyTorch's plain estimate) and each probe seed, and its errors:
  loss relative error and, per component, ``|g - g*| / max(|g*|, 0.1 ||g*||)`` (as
  :func:`gpnys.baselines.mll.grad_errors`).

When the noise is tiny that difference is a few per cent of either trace, and the Hutchinson estimate of
``tr K̂⁻¹`` carries its error into it (docs/bo.md, "The noise gradient at the noise floor").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
from botorch.test_functions import Hartmann
from gpytorch.mlls import ExactMarginalLogLikelihood
from torch.quasirandom import SobolEngine

from gpnys.baselines.provenance import provenance
from gpnys.bo import PreconditionedSingleTaskGP
from gpnys.gp.settings import EstimatorSettings

RESULTS = Path(__file__).resolve().parent / "results"
#: the length-scales a gpnys fit of this problem found at n = 5000 (``bo_compare.py --n 5000``: the point where its
#: noise gradient was measured)
LENGTHSCALE = "0.286,0.369,0.466,0.342,0.333,0.317"


def make_model(X, Y, noise: float, lengthscale: torch.Tensor, cv: str, seed: int, args) -> PreconditionedSingleTaskGP:
    settings = EstimatorSettings(probe_seed=seed, num_probes=args.probes, variance_reduction=cv != "none",
                                 control_variate="auto" if cv == "none" else cv)
    model = PreconditionedSingleTaskGP(X, Y, settings=settings, max_cholesky_size=0)
    model.likelihood.noise = torch.tensor(noise, dtype=X.dtype)
    model.covar_module.lengthscale = lengthscale.reshape(1, -1)
    return model.train()


def loss_and_grad(model, preconditioned: bool) -> tuple[float, torch.Tensor, float]:
    """``-MLL / n`` (priors included) and its gradient over all parameters (sorted by name), seconds."""
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    t0 = time.perf_counter()
    with model.preconditioned() if preconditioned else contextlib.nullcontext():
        loss = -mll(model(*model.train_inputs), model.train_targets)
        loss.backward()
    grads = [p.grad.reshape(-1) for _, p in sorted(model.named_parameters())]
    return float(loss.detach()), torch.cat(grads), time.perf_counter() - t0


def noise_terms(model) -> dict:
    """Exact ``tr K̂⁻¹`` and ``αᵀα`` (Cholesky; ``α = K̂⁻¹ (y - m)``), the two traces whose difference is the
    data part of the noise gradient, and ``σ² tr K̂⁻¹`` (about the number of eigenvalues of ``K̂`` near ``σ²``)."""
    X = model.train_inputs[0]
    n = X.shape[0]
    with torch.no_grad():
        r = model.train_targets - model.mean_module(X)
        K = model.covar_module(X).to_dense() + model.likelihood.noise * torch.eye(n, dtype=X.dtype)
        Ki = torch.cholesky_inverse(torch.linalg.cholesky(K))
        alpha = Ki @ r
        tr, quad = float(Ki.diagonal().sum()), float(alpha @ alpha)
    return {"trace_inv": tr, "alpha_sq": quad, "noise_times_trace": float(model.likelihood.noise) * tr}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--noise", default="1.55e-4,1e-3,1e-2")
    ap.add_argument("--lengthscale", default=LENGTHSCALE)
    ap.add_argument("--control-variates", default="diag,frozen")
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.seeds, args.noise = 300, 2, "1.55e-4,1e-2"
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    X = SobolEngine(6, scramble=True, seed=0).draw(args.n, dtype=torch.float64)
    Y = Hartmann(dim=6, negate=True)(X).unsqueeze(-1)
    ls = torch.tensor([float(v) for v in args.lengthscale.split(",")], dtype=X.dtype)
    names = [f"{name}[{i}]" if p.numel() > 1 else name  # one entry per gradient component
             for name, p in sorted(make_model(X, Y, 1e-2, ls, "diag", 0, args).named_parameters())
             for i in range(p.numel())]
    i_noise = names.index("likelihood.noise_covar.raw_noise")
    res: dict = {"n": args.n, "probes": args.probes, "lengthscale": ls.tolist(), "parameters": names,
                 "threads": torch.get_num_threads(), "rows": [], "provenance": provenance(__file__, argv)}
    print(f"Hartmann-6, n = {args.n}, {args.probes} probes; error columns: loss rel. error, worst gradient "
          f"component, noise component (|g - g*| / max(|g*|, 0.1 |g*|))")
    for noise in (float(v) for v in args.noise.split(",")):
        ref_model = make_model(X, Y, noise, ls, "diag", 0, args)
        l0, g0, t0 = loss_and_grad(ref_model, preconditioned=False)
        terms = noise_terms(ref_model)
        print(f"noise {noise:g}: exact loss {l0:.6f}, noise gradient {g0[i_noise]:.4g}; tr K^-1 "
              f"{terms['trace_inv']:.4e}, a'a {terms['alpha_sq']:.4e}, noise * tr K^-1 {terms['noise_times_trace']:.1f}"
              f" ({t0:.1f} s)")
        den = torch.maximum(g0.abs(), 0.1 * g0.norm())
        for cv in args.control_variates.split(","):
            for seed in range(args.seeds):
                loss, g, t = loss_and_grad(make_model(X, Y, noise, ls, cv, seed, args), preconditioned=True)
                err = ((g - g0).abs() / den).tolist()
                row = {"noise": noise, "control_variate": cv, "seed": seed, "time_s": t, "loss": loss, "exact_loss": l0,
                       "loss_rel_err": abs(loss - l0) / abs(l0), "grad": g.tolist(), "exact_grad": g0.tolist(),
                       "grad_err": err, **terms}
                res["rows"].append(row)
                print(f"  {cv:>6} seed {seed}: {t:5.2f} s, loss {row['loss_rel_err']:.1e}, worst "
                      f"{max(err):7.1%}, noise {err[i_noise]:7.1%}")
    torch.set_num_threads(threads)
    path = Path(args.out) if args.out else RESULTS / ("bo_gradient_quick.json" if args.quick
                                                      else f"bo_gradient_n{args.n}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
