"""Bayesian optimisation with many observations: gpnys's PreconditionedSingleTaskGP vs BoTorch's SingleTaskGP.

A BO loop on Hartmann-6 (BoTorch's test function, maximised: ``negate=True``, optimum 3.32237) started from
``--n-init`` scrambled-Sobol points. Each iteration: build the model on all data so far, warm-start it from the
previous iteration's model (``--starts warm``, the default: as BoTorch users do, the outcome transform is refitted
and the kernel/likelihood/mean parameters are carried over; gpnys's ``warm_start_from`` also skips the subset
start and seeds its solves), or not (``cold``), ``fit_gpytorch_mll``, maximise qLogEI with
``optimize_acqf`` and evaluate the candidate(s). Both models see the same initial design per seed.

Prints best value and per-iteration fit / acquisition time for each model; writes a JSON (``--json``) and a PNG of
best-so-far vs wall time (``--png``, else next to the JSON, else ``bo_large_n.png``; ``--quick`` writes a PNG only
when ``--json`` or ``--png`` names where).

Run:  python examples/bo_large_n.py --quick                       (about a minute on 2 CPU cores; the tests run it)
      python examples/bo_large_n.py --n-init 5000 --iters 10 --seeds 0,1,2 --threads 2 \\
          --json benchmarks/results/bo_loop.json                     (the run in docs/bo.md)
      python examples/bo_large_n.py --methods gpnys --starts warm,cold --n-init 30000 --device cuda \\
          --json benchmarks/results/bo_warm_cold.json     (warm-started iterations against cold ones)
      add --checkpoint DIR to save every iteration and resume an interrupted campaign from DIR
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from botorch.acquisition.logei import qLogExpectedImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.optim import optimize_acqf
from botorch.test_functions import Hartmann
from gpytorch.mlls import ExactMarginalLogLikelihood
from torch.quasirandom import SobolEngine

from gpnys.bo import PreconditionedSingleTaskGP

MODELS = {"gpnys": PreconditionedSingleTaskGP, "singletask": SingleTaskGP}


def hyper_state(model) -> dict[str, torch.Tensor]:
    """The model's trainable state (kernel, likelihood, mean), without the outcome transform's buffers."""
    return {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("outcome_transform")}


def checkpoint_path(args, method: str, seed: int, start: str = "warm") -> Path | None:
    """Where ``--checkpoint`` keeps one campaign's state (data, hyperparameters, records, RNG) between runs."""
    if not args.checkpoint:
        return None
    tag = "" if start == "warm" else f"_{start}"
    return Path(args.checkpoint) / f"{method}{tag}_n{args.n_init}_q{args.q}_seed{seed}.pt"


def run_loop(method: str, seed: int, args, start: str = "warm") -> dict:
    """One BO campaign; returns per-iteration records (n, fit_s, acq_s, best) and the chosen points' values.

    ``start="warm"``: each iteration's model starts from the previous one (gpnys: ``warm_start_from``, i.e. its
    hyperparameters, no subset start, and its solution as the first solve's start; SingleTaskGP: its
    hyperparameters); ``"cold"``: from BoTorch's default initialisation every time.

    With ``--checkpoint DIR`` the state after every iteration is saved there, and a later run with the same
    options resumes from it (same data, hyperparameters and RNG state, so the same iterations follow): a
    campaign longer than one run or job can be finished in several. Each record keeps the time of its own iteration.
    A checkpoint with more iterations than ``--iters`` gives its first ``--iters`` (campaigns compared alike).
    """
    device = torch.device(args.device)
    f = Hartmann(dim=6, negate=True).to(device)
    bounds = torch.stack([torch.zeros(6), torch.ones(6)]).to(device=device, dtype=torch.float64)
    X = SobolEngine(6, scramble=True, seed=seed).draw(args.n_init, dtype=torch.float64).to(device)
    Y = f(X).unsqueeze(-1)
    initial_best = float(Y.max())
    kw = {"max_cholesky_size": args.max_cholesky_size} if method == "gpnys" else {}
    state, records, wall = None, [], 0.0
    torch.manual_seed(seed)
    ckpt = checkpoint_path(args, method, seed, start)
    if ckpt is not None and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False, map_location=device)
        X, Y, state, records = saved["X"], saved["Y"], saved["state"], saved["records"]
        wall = records[-1]["wall_s"] if records else 0.0
        torch.set_rng_state(saved["rng"])
        print(f"  {method:>10} seed {seed}: resumed after iteration {len(records)} from {ckpt}", flush=True)
    for it in range(len(records), args.iters):
        t0 = time.perf_counter()
        model = MODELS[method](X, Y, **kw)
        if start == "warm" and state is not None and method == "gpnys":
            model.warm_start_from(state)  # hyperparameters, no subset start, the previous solution
        elif start == "warm" and state is not None:
            model.load_state_dict(state, strict=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # BoTorch's optimisation warnings are reported by its own retry logic
            fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
        t1 = time.perf_counter()
        acq = qLogExpectedImprovement(model, best_f=Y.max())
        cand, _ = optimize_acqf(acq, bounds=bounds, q=args.q, num_restarts=args.num_restarts,
                                raw_samples=args.raw_samples)
        t2 = time.perf_counter()
        X, Y = torch.cat([X, cand]), torch.cat([Y, f(cand).unsqueeze(-1)])
        wall += t2 - t0
        rec = {"iteration": it + 1, "n": X.shape[0] - args.q, "fit_s": t1 - t0, "acq_s": t2 - t1, "wall_s": wall,
               "best": float(Y.max()), "noise": float(model.likelihood.noise.detach().reshape(-1)[0])}
        if method == "gpnys" and model.uses_preconditioner():
            h = model.hook()
            rec.update(precond=h.history[-1].kind if h.history else None, rank=h.history[-1].rank if h.history else None,
                       builds=h.builds, posterior_iterations=model.posterior_iterations,
                       fit_restarts=model.fit_restarts, fit_stopped=model.fit_stopped,
                       posterior_exact=model.posterior_exact(), posterior_path_reason=model.posterior_path_reason)
        records.append(rec)
        state = model.warm_state() if method == "gpnys" else hyper_state(model)
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"X": X, "Y": Y, "state": state, "records": records, "rng": torch.get_rng_state()}, ckpt)
        print(f"  {method:>10} {start} seed {seed} it {it + 1:2d}: n={rec['n']} fit {rec['fit_s']:7.2f} s, "
              f"acq {rec['acq_s']:6.2f} s, best {rec['best']:.5f}"
              + (f" ({rec.get('precond')}, rank {rec.get('rank')})" if "precond" in rec else ""), flush=True)
    best = float(Y.max())
    if len(records) > args.iters:  # a checkpoint of a longer campaign: its first --iters iterations, to compare alike
        records = records[: args.iters]
        best, wall = records[-1]["best"], records[-1]["wall_s"]
    return {"method": method, "start": start, "seed": seed, "records": records, "best": best, "wall_s": wall,
            "initial_best": initial_best}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    colors = {"gpnys": "C0", "singletask": "C1"}
    for r in runs:
        t = [0.0] + [x["wall_s"] for x in r["records"]]
        b = [r["initial_best"]] + [x["best"] for x in r["records"]]
        ax.step(t, b, where="post", color=colors[r["method"]], alpha=0.8,
                ls="-" if r.get("start", "warm") == "warm" else ":",
                label=f"{r['method']} ({r.get('start', 'warm')})" if r["seed"] == runs[0]["seed"] else None)
    ax.axhline(3.32237, color="k", lw=0.5, ls="--")
    ax.set_xlabel("wall time (s): fit + acquisition")
    ax.set_ylabel("best Hartmann-6 value")
    ax.set_title(f"BO from {runs[0]['records'][0]['n']} points (qLogEI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="n-init 120, 2 iterations, gpnys forced on (about a minute); no PNG unless --json / --png")
    ap.add_argument("--n-init", type=int, default=2000)
    ap.add_argument("--iters", type=int, default=None, help="BO iterations (default 10; --quick: 2)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--methods", default="gpnys,singletask")
    ap.add_argument("--q", type=int, default=1)
    ap.add_argument("--num-restarts", type=int, default=5)
    ap.add_argument("--raw-samples", type=int, default=128)
    ap.add_argument("--max-cholesky-size", type=int, default=None,
                    help="gpnys's Cholesky threshold (default: GPyTorch's setting, 4096 with BoTorch)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="torch device of the data and models (e.g. cuda)")
    ap.add_argument("--starts", default="warm", help="warm, cold or warm,cold: each iteration's model from the "
                    "previous one, or from BoTorch's default initialisation (both: the warm/cold time ratio)")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--checkpoint", default=None,
                    help="directory: save each campaign after every iteration and resume from it when present")
    ap.add_argument("--png", default=None, help="plot path (default: next to --json, else bo_large_n.png)")
    args = ap.parse_args(argv)
    if args.quick:
        args.n_init, args.num_restarts, args.raw_samples = 120, 2, 16
        args.max_cholesky_size = 0 if args.max_cholesky_size is None else args.max_cholesky_size
    if args.iters is None:
        args.iters = 2 if args.quick else 10
    for name in args.methods.split(","):
        if name not in MODELS:
            raise ValueError(f"--methods: unknown model {name!r}; choose from {sorted(MODELS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    starts = [s for s in args.starts.split(",") if s]
    if not starts or set(starts) - {"warm", "cold"}:
        ap.error(f"--starts takes warm, cold or warm,cold; got {args.starts!r}")
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in args.methods.split(","):
            for start in starts:
                runs.append(run_loop(name, seed, args, start))
    print(f"\n{'model':>10} {'start':>5} {'seed':>4} {'best':>8} {'wall s':>8} {'fit s/it':>9} {'acq s/it':>9}")
    for r in runs:
        n = len(r["records"])
        print(f"{r['method']:>10} {r['start']:>5} {r['seed']:4d} {r['best']:8.5f} {r['wall_s']:8.1f} "
              f"{sum(x['fit_s'] for x in r['records']) / n:9.2f} {sum(x['acq_s'] for x in r['records']) / n:9.2f}")
    ratios = {}
    for name in args.methods.split(","):
        by = {s: sum(r["wall_s"] for r in runs if r["method"] == name and r["start"] == s) for s in starts}
        if len(by) == 2 and by["cold"] > 0:
            ratios[name] = by["warm"] / by["cold"]
            print(f"{name}: warm / cold wall time {ratios[name]:.3f}")
    out = {"n_init": args.n_init, "iters": args.iters, "q": args.q, "num_restarts": args.num_restarts,
           "raw_samples": args.raw_samples, "threads": torch.get_num_threads(), "device": args.device,
           "starts": starts, "warm_over_cold": ratios, "runs": runs}
    png = Path(args.png) if args.png else (Path(args.json).with_suffix(".png") if args.json else Path("bo_large_n.png"))
    if args.quick and not (args.png or args.json):
        png = None  # a quick look writes nothing into the current directory
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    if png is not None:
        plot(runs, png)
    written = [str(p) for p in (png, args.json) if p]
    if written:
        print("wrote " + " and ".join(written))
    return out


if __name__ == "__main__":
    main()
