"""Warm starts along a training run: the same Adam steps with the solve with ``y - m`` started from the previous
step's solution ("warm") and from zero ("cold"), and warm with the preconditioner reused across steps while the
hyperparameters move less than ``--reuse-tolerance`` ("reuse"); per step the CG iterations, seconds and
preconditioner builds, and the losses of the runs against each other and against Cholesky at the end.

Run:  python benchmarks/warm_start.py                 (elevators n = 8 000, Matérn-3/2, 10 Adam steps; ~5 minutes)
      python benchmarks/warm_start.py --quick         (n = 500, 3 steps; the test suite)

All runs use the preconditioned path (``solver="iterative"``), fixed probes (``probe_seed``) and the same seed,
alternating step by step in one process (a drifting machine speed hits all alike). Writes
``benchmarks/results/warm_start.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _steps(runs: dict, steps: int, X, y, iterations: list) -> None:
    """``steps`` Adam steps of both runs, alternating (the machine's drift hits both alike), each step's seconds,
    loss, standard error and CG iterations appended to its run's ``rows``."""
    for step in range(steps):
        for run in runs.values():
            iterations.clear()
            t0 = time.perf_counter()
            run["opt"].zero_grad()
            loss = -run["mll"](run["model"](X), y)
            loss.backward()
            run["opt"].step()
            est = run["ctx"].last_estimate
            run["rows"].append({"step": step, "seconds": time.perf_counter() - t0, "loss": float(loss.detach()),
                                "loss_std_error": est.std_error / est.n, "y_solve_iterations": iterations[0][0],
                                "probe_iterations_max": max(iterations[0][1:]), "builds": run["ctx"].builds})


def main(argv: list[str] | None = None) -> dict:
    import gpytorch
    import torch

    import gpnys
    import gpnys.gp.estimator as estimator
    from gpnys import datasets
    from gpnys.baselines.provenance import provenance
    from gpnys.gp import ExactGPModel
    from gpnys.gp.settings import EstimatorSettings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--data", default="elevators")
    p.add_argument("--n", type=int, default=8000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--reuse-tolerance", type=float, default=0.1,
                   help="the reuse run's EstimatorSettings.reuse_tolerance (relative hyperparameter change)")
    p.add_argument("--out", default=str(RESULTS / "warm_start.json"))
    args = p.parse_args(argv)
    n, steps = (500, 3) if args.quick else (args.n, args.steps)
    ds = datasets.load(args.data, n=n, seed=0)
    X, y = ds.train_x, ds.train_y
    runs = {}
    iterations: list[int] = []
    real = estimator.pcg
    # both hooks stay open for the whole run; the stack leaves them last-in first-out, so that each restores the
    # GPyTorch settings it found (leaving them in entry order would leave the inner one's settings behind)
    with contextlib.ExitStack() as stack:
        for name, warm, reuse in (("warm", True, None), ("cold", False, None), ("reuse", True, args.reuse_tolerance)):
            torch.manual_seed(0)
            model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32").double()
            mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
            settings = EstimatorSettings(solver="iterative", warm_start=warm, probe_seed=0, reuse_tolerance=reuse)
            runs[name] = {"model": model, "mll": mll, "opt": torch.optim.Adam(model.parameters(), lr=0.1),
                          "ctx": stack.enter_context(gpnys.use_preconditioner(model, settings=settings)), "rows": []}
        estimator.pcg = lambda *a, **k: (lambda r: iterations.append(r.iterations_per_column.tolist()) or r)(
            real(*a, **k))
        stack.callback(setattr, estimator, "pcg", real)
        _steps(runs, steps, X, y, iterations)
    out = {"data": args.data, "n": n, "steps": steps, "reuse_tolerance": args.reuse_tolerance,
           "provenance": provenance(__file__, argv, "cpu"), **{name: run["rows"] for name, run in runs.items()}}
    print(f"{args.data} n = {n}, Matérn-3/2, {steps} Adam steps (y-solve / probes' largest CG iterations; builds so "
          f"far)")
    print(f"{'step':>4} {'warm s':>8} {'its':>7} {'cold s':>8} {'its':>7} {'reuse s':>8} {'its':>7} {'builds':>6} "
          f"{'warm-cold / se':>15}")
    for w, c, r in zip(out["warm"], out["cold"], out["reuse"]):
        z = abs(w["loss"] - c["loss"]) / max((w["loss_std_error"] ** 2 + c["loss_std_error"] ** 2) ** 0.5, 1e-300)
        print(f"{w['step']:4d} {w['seconds']:8.3f} {w['y_solve_iterations']:3d}/{w['probe_iterations_max']:<3d} "
              f"{c['seconds']:8.3f} {c['y_solve_iterations']:3d}/{c['probe_iterations_max']:<3d} "
              f"{r['seconds']:8.3f} {r['y_solve_iterations']:3d}/{r['probe_iterations_max']:<3d} {r['builds']:6d} "
              f"{z:15.2f}")
    later = slice(1, None)  # the first step has nothing to start from
    out["median_step_s"] = {k: statistics.median(r["seconds"] for r in out[k][later] or out[k]) for k in runs}
    out["total_s"] = {k: sum(r["seconds"] for r in out[k]) for k in runs}
    out["ratio_warm_to_cold"] = out["median_step_s"]["warm"] / out["median_step_s"]["cold"]
    out["ratio_reuse_to_warm"] = out["total_s"]["reuse"] / out["total_s"]["warm"]
    # the end of each run against Cholesky at its own final hyperparameters
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**7), \
            gpytorch.settings.fast_computations(log_prob=False):
        out["final_cholesky_loss"] = {k: float(-run["mll"](run["model"](X), y)) for k, run in runs.items()}
    print(f"median step after the first: warm {out['median_step_s']['warm']:.3f} s, cold "
          f"{out['median_step_s']['cold']:.3f} s ({out['ratio_warm_to_cold']:.2f}x); all steps: reuse "
          f"{out['total_s']['reuse']:.2f} s against warm {out['total_s']['warm']:.2f} s "
          f"({out['ratio_reuse_to_warm']:.2f}x, {out['reuse'][-1]['builds']} builds against "
          f"{out['warm'][-1]['builds']})")
    print("final Cholesky loss: " + ", ".join(f"{k} {v:.5f}" for k, v in out["final_cholesky_loss"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
