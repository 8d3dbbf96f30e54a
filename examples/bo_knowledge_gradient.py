"""Knowledge-gradient Bayesian optimisation with many observations: BoTorch's one-shot ``qKnowledgeGradient`` on a
``PreconditionedSingleTaskGP``, whose fantasy models are conditioned posteriors instead of GPyTorch's
``(n + q) x (n + q)`` fantasy updates (docs/bo.md, "Fantasies").

The script

1. fits the hyperparameters on ``--fit-n`` of the ``--n`` Hartmann-6 points (BoTorch's ``fit_gpytorch_mll``) and
   starts the model of all the points from them (``warm_start_from``; fitting at large n: docs/bo.md);
2. checks one qKG value and gradient against ``SingleTaskGP``'s at the same hyperparameters, on ``--check-n`` of the
   points (``SingleTaskGP``'s fantasies need ``fantasies x restarts`` matrices of ``(n + 1)²``: at n = 2000, 16
   fantasies and 4 points, 13 GiB and about a minute, so the check runs on a subset);
3. runs ``optimize_acqf`` with qKG on all ``--n`` points and prints the candidate's value and the time (qKG picks
   the point whose observation is worth most to the posterior mean's maximum, not the one where f is largest).

Run: python examples/bo_knowledge_gradient.py [--n 3000] [--fantasies 32] [--device cuda]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from botorch.acquisition import qKnowledgeGradient
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.optim import optimize_acqf
from botorch.sampling import SobolQMCNormalSampler
from botorch.test_functions import Hartmann
from gpytorch.mlls import ExactMarginalLogLikelihood
from torch.quasirandom import SobolEngine

from gpnys.bo import PreconditionedFantasyGP, PreconditionedSingleTaskGP


def check_against_single_task_gp(model: PreconditionedSingleTaskGP, X, Y, m: int, fantasies: int) -> dict:
    """qKG value and gradient of a copy of ``model`` on the first ``m`` points against ``SingleTaskGP``'s."""
    ref, small = SingleTaskGP(X[:m], Y[:m]), PreconditionedSingleTaskGP(X[:m], Y[:m])
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("outcome_transform")}
    for gp in (ref, small):  # the fitted hyperparameters; each keeps its own Standardize of Y[:m]
        gp.load_state_dict(state, strict=False)
    x0 = torch.rand(2, 1 + fantasies, X.shape[-1], generator=torch.Generator().manual_seed(1), dtype=X.dtype)
    out = []
    for gp in (ref, small):
        x = x0.to(X.device).requires_grad_(True)
        value = qKnowledgeGradient(gp, sampler=SobolQMCNormalSampler(torch.Size([fantasies]), seed=0),
                                   num_fantasies=None)(x)
        value.sum().backward()
        out.append((value.detach(), x.grad))
    (v_ref, g_ref), (v, g) = out
    return {"value_rel_err": float(((v - v_ref) / v_ref).abs().max()),
            "grad_rel_err": float((g - g_ref).abs().max() / g_ref.abs().max())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--fit-n", type=int, default=1000)
    ap.add_argument("--check-n", type=int, default=300)
    ap.add_argument("--fantasies", type=int, default=32)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--raw-samples", type=int, default=64)
    ap.add_argument("--maxiter", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore", category=UserWarning)  # BoTorch's notes on optimize_acqf's initial conditions

    f = Hartmann(dim=6, negate=True)
    X = SobolEngine(6, scramble=True, seed=0).draw(args.n, dtype=torch.float64)
    X, Y = X.to(args.device), f(X).unsqueeze(-1).to(args.device)
    m = min(args.fit_n, args.n)
    subset = PreconditionedSingleTaskGP(X[:m], Y[:m])
    t0 = time.perf_counter()
    fit_gpytorch_mll(ExactMarginalLogLikelihood(subset.likelihood, subset))
    fit_s = time.perf_counter() - t0
    model = PreconditionedSingleTaskGP(X, Y).warm_start_from(subset)
    print(f"fit on {m} of the {args.n} points: {fit_s:.1f} s")

    check = check_against_single_task_gp(model, X, Y, min(args.check_n, args.n), args.fantasies)
    print(f"qKG against SingleTaskGP on {min(args.check_n, args.n)} points: value rel. error "
          f"{check['value_rel_err']:.1e}, gradient {check['grad_rel_err']:.1e}")

    acq = qKnowledgeGradient(model, num_fantasies=args.fantasies)
    fantasy = model.fantasize(X[:1], SobolQMCNormalSampler(torch.Size([args.fantasies]), seed=0))
    assert isinstance(fantasy, PreconditionedFantasyGP)
    bounds = torch.stack([torch.zeros(6), torch.ones(6)]).to(X)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    candidate, value = optimize_acqf(acq, bounds=bounds, q=1, num_restarts=args.restarts,
                                     raw_samples=args.raw_samples, options={"maxiter": args.maxiter})
    acq_s = time.perf_counter() - t0
    best = float(Y.max())
    found = float(f(candidate.cpu()).reshape(-1)[0])
    print(f"qKG optimize_acqf ({args.fantasies} fantasies, {args.restarts} restarts, {args.raw_samples} raw "
          f"samples): {acq_s:.1f} s; candidate f = {found:.4f} (best observed {best:.4f}; the optimum is 3.3224); "
          f"posterior: {model.posterior_path_reason or 'SingleTaskGP path'}")
    return {"fit_s": fit_s, "acq_s": acq_s, "kg_value": float(value), "candidate_value": found, "best_value": best,
            **check}


if __name__ == "__main__":
    main()
