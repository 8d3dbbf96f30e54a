"""The wall time of one BO iteration (fit + qLogEI, or qLogEHVI for two objectives) at large n, gpnys's
PreconditionedSingleTaskGP vs SingleTaskGP, and how closely their posteriors agree.

Run:  python benchmarks/bo_compare.py --n 5000 --threads 2     (quiet machine)
      python benchmarks/bo_compare.py --warm-from benchmarks/results/bo_loop_ckpt --seeds 0,1,2 --threads 2
      python benchmarks/bo_compare.py --n 5000 --device cuda     (data and models on a GPU)
      python benchmarks/bo_compare.py --n 5000 --outputs 2       (two objectives: one model with two outputs)
      python benchmarks/bo_compare.py --quick                    (n = 150, gpnys forced on; the tests run it)

Data: ``--n`` scrambled-Sobol points in [0, 1]^6 and Hartmann-6 values (``negate=True``), float64. For each model,
from BoTorch's default initialisation (same modules, priors and ``Standardize``): ``fit_gpytorch_mll`` (L-BFGS-B),
then ``optimize_acqf`` with qLogEI (q = 1, ``--num-restarts`` 5, ``--raw-samples`` 128). ``--outputs 2``: two
objectives, Hartmann-6 and its mirror image ``f(1 - x)``, in one model with two outputs (``train_Y (n, 2)``), and
qLogEHVI (reference point ``(-0.1, -0.1)``, the observed Pareto front's partitioning) instead. SingleTaskGP runs on
BoTorch's own path (importing BoTorch turns GPyTorch's fast computations off, so it is Cholesky at every size).
Then the posterior check: the gpnys model takes SingleTaskGP's fitted hyperparameters and both predict at
``--n-test`` uniform random points; relative errors of the posterior mean and variance against SingleTaskGP. The
check's model takes PCG for its posterior at every size (``posterior_cholesky_size=0``) wherever it trains
preconditioned, so that it checks the solves and not another Cholesky (before 2026-11-29 it took Cholesky up to
10 000 points: the stored checks at n <= 10 000 show 0 PCG iterations).

An untimed warm-up fit on 64 points runs first (torch imports its symbolic-shape machinery on the first
broadcast, ~1-10 s, once per process).

``--warm-from DIR`` times a *warm* iteration instead (as a BO loop runs after its first): each model's campaign
checkpoint of ``examples/bo_large_n.py`` (data after its last iteration, hyperparameters from its last fit) starts
the fit, as the next iteration of that loop would (gpnys without its subset start, as the loop does), for each seed of
``--seeds``; JSON ``bo_compare_warm_n{n}.json``.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from botorch.acquisition.logei import qLogExpectedImprovement
from botorch.acquisition.multi_objective.logei import qLogExpectedHypervolumeImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.optim import optimize_acqf
from botorch.test_functions import Hartmann
from botorch.utils.multi_objective.box_decompositions.non_dominated import FastNondominatedPartitioning
from gpytorch.mlls import ExactMarginalLogLikelihood
from torch.quasirandom import SobolEngine

from gpnys.baselines.provenance import provenance
from gpnys.bo import PreconditionedSingleTaskGP

RESULTS = Path(__file__).resolve().parent / "results"
#: ``--outputs 2``: qLogEHVI's reference point, below both objectives' values (Hartmann-6 negated is >= 0)
REF_POINT = (-0.1, -0.1)
ACQ = {1: "qLogEI", 2: "qLogEHVI"}


def objectives(X: torch.Tensor, outputs: int) -> torch.Tensor:
    """``(n, outputs)``: Hartmann-6 (negated, maximised), and with two outputs its mirror image ``f(1 - x)``."""
    f = Hartmann(dim=6, negate=True).to(X)
    return torch.stack([f(X), f(1 - X)][:outputs], dim=-1)


def acquisition(model, Y: torch.Tensor):
    """qLogEI at the best observed value (one output), or qLogEHVI over the observed Pareto front (two)."""
    if Y.shape[-1] == 1:
        return qLogExpectedImprovement(model, best_f=Y.max())
    ref = torch.tensor(REF_POINT, dtype=Y.dtype, device=Y.device)
    return qLogExpectedHypervolumeImprovement(model, ref_point=ref,
                                              partitioning=FastNondominatedPartitioning(ref_point=ref, Y=Y))


def one_iteration(model, Y: torch.Tensor, args, timeout: float | None) -> dict:
    """Fit from the model's initialisation, then one ``optimize_acqf`` (:func:`acquisition`); times and results."""
    bounds = torch.stack([torch.zeros(6), torch.ones(6)]).to(Y)  # on Y's device and dtype
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model),
                         optimizer_kwargs={"timeout_sec": timeout} if timeout else None)
    t1 = time.perf_counter()
    cand, value = optimize_acqf(acquisition(model, Y), bounds=bounds, q=1,
                                num_restarts=args.num_restarts, raw_samples=args.raw_samples)
    t2 = time.perf_counter()
    f = objectives(cand, Y.shape[-1]).reshape(-1).tolist()
    noise = model.likelihood.noise.detach().reshape(-1)[: Y.shape[-1]].tolist()
    rec = {"fit_s": t1 - t0, "acq_s": t2 - t1, "total_s": t2 - t0, "acq_value": float(value),
           "candidate_value": f[0] if len(f) == 1 else f,
           "lengthscale": model.covar_module.lengthscale.detach().reshape(-1).tolist(),
           "noise": noise[0] if len(noise) == 1 else noise,
           "fit_warnings": sorted({f"{w.category.__name__}: {str(w.message)[:120]}" for w in caught})}
    if isinstance(model, PreconditionedSingleTaskGP):
        rec["path"] = "preconditioned" if model.uses_preconditioner() else "cholesky"
        rec["path_reason"] = model.path_reason
    if isinstance(model, PreconditionedSingleTaskGP) and model.uses_preconditioner():
        h = model.hook()
        h = h if h.elements is None else h.elements[0]  # two outputs: the first output's preconditioner
        rec.update(builds=h.builds, cg_applications=h.applications, precond=[r.kind for r in h.history[-1:]],
                   estimates=h.estimates, fit_stopped=model.fit_stopped,
                   rank=h.history[-1].rank if h.history else None, posterior_iterations=posterior_iterations(model),
                   posterior_exact=model.posterior_exact(), posterior_path_reason=model.posterior_path_reason)
    return rec


def posterior_iterations(model: PreconditionedSingleTaskGP) -> int:
    """PCG iterations of the latest posterior solve, the largest over the outputs."""
    return max([model.posterior_iterations] + [m.posterior_iterations for m in model.output_models])


def warm_iterations(args, argv: list[str] | None = None) -> dict:
    """``--warm-from``: one warm iteration per model and seed from the loop's checkpoints (module docstring)."""
    res: dict = {"n_init": args.n, "num_restarts": args.num_restarts, "raw_samples": args.raw_samples,
                 "threads": torch.get_num_threads(), "warm_from": args.warm_from, "seeds": {}}
    device = torch.device("cpu")
    for seed in [int(v) for v in args.seeds.split(",") if v]:
        per = {}
        for name in args.methods.split(","):
            saved = torch.load(Path(args.warm_from) / f"{name}_n{args.n}_q1_seed{seed}.pt", weights_only=False)
            X, Y = saved["X"], saved["Y"]
            device = X.device
            torch.manual_seed(seed)
            model = (SingleTaskGP(X, Y) if name == "singletask" else
                     PreconditionedSingleTaskGP(X, Y, max_cholesky_size=args.max_cholesky_size, fit_subset=None))
            model.load_state_dict(saved["state"], strict=False)
            per[name] = dict(one_iteration(model, Y, args, None), n=X.shape[0], start_iteration=len(saved["records"]))
            r = per[name]
            print(f"seed {seed} {name:>10}: n = {r['n']}, warm fit {r['fit_s']:7.2f} s, qLogEI {r['acq_s']:6.2f} s, "
                  f"total {r['total_s']:7.2f} s", flush=True)
        if {"singletask", "gpnys"} <= set(per):
            per["time_ratio"] = per["gpnys"]["total_s"] / per["singletask"]["total_s"]
            print(f"seed {seed}: gpnys / SingleTaskGP warm iteration {per['time_ratio']:.3f}", flush=True)
        res["seeds"][str(seed)] = per
    both = [v for v in res["seeds"].values() if "time_ratio" in v]
    if both:
        res["time_ratio_mean_iteration"] = (sum(v["gpnys"]["total_s"] for v in both)
                                            / sum(v["singletask"]["total_s"] for v in both))
        print(f"mean warm iteration, gpnys / SingleTaskGP: {res['time_ratio_mean_iteration']:.3f}")
    res["provenance"] = provenance(__file__, argv, device)
    path = Path(args.out) if args.out else RESULTS / f"bo_compare_warm_n{args.n}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")
    return res


def posterior_check(ref: SingleTaskGP, model: PreconditionedSingleTaskGP, n_test: int, seed: int) -> dict:
    """Mean / variance of ``model`` with ``ref``'s hyperparameters vs ``ref`` at ``n_test`` random points."""
    model.load_state_dict(ref.state_dict())
    train_X = ref.train_inputs[0]
    Xt = torch.rand(n_test, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)).to(train_X)
    out = {}
    with torch.no_grad():
        t0 = time.perf_counter()
        pr = ref.posterior(Xt)
        mr, vr = pr.mean.reshape(-1), pr.variance.reshape(-1)
        t1 = time.perf_counter()
        pm = model.posterior(Xt)
        mm, vm = pm.mean.reshape(-1), pm.variance.reshape(-1)
        t2 = time.perf_counter()
    em = (mm - mr).abs() / mr.abs().max()
    ev = (vm - vr).abs() / vr
    out.update(n_test=n_test, ref_predict_s=t1 - t0, gpnys_predict_s=t2 - t1,
               mean_rel_err_max=float(em.max()), mean_rel_err_median=float(em.median()),
               var_rel_err_max=float(ev.max()), var_rel_err_median=float(ev.median()),
               posterior_iterations=posterior_iterations(model))
    return out


def singletask_posterior_bytes(args) -> int:
    """Memory of ``SingleTaskGP``'s posterior on ``--raw-samples`` points with two outputs: GPyTorch's batched exact
    path broadcasts its ``(m, n, n)`` prediction cache over the batch, ``raw_samples m n²`` numbers (8.2 GB at
    n = 2 000, 51.2 GB at n = 5 000); 0 for one output, whose cache is not broadcast."""
    return 0 if args.outputs == 1 else args.raw_samples * args.outputs * args.n**2 * 8


def fmt(value: float | list[float], spec: str) -> str:
    """A number, or a list of them (one per output), formatted with ``spec``."""
    return format(value, spec) if not isinstance(value, list) else "/".join(format(v, spec) for v in value)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [m for m in ("singletask", "gpnys") if "fit_s" in res["methods"].get(m, {})]
    fit = [res["methods"][m]["fit_s"] for m in names]
    acq = [res["methods"][m]["acq_s"] for m in names]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(names, fit, label="fit_gpytorch_mll")
    ax.bar(names, acq, bottom=fit, label=f"optimize_acqf ({ACQ[res['outputs']]})")
    ax.set_ylabel("wall time (s)")
    ax.set_title(f"one BO iteration, Hartmann-6{' and its mirror' if res['outputs'] > 1 else ''}, n = {res['n']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=None, help="training points (default 5000; --quick: 150)")
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--outputs", type=int, choices=(1, 2), default=1, help="objectives (module docstring)")
    ap.add_argument("--memory-gib", type=float, default=20.0,
                    help="skip SingleTaskGP where its posterior is predicted to need more (singletask_posterior_bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="singletask,gpnys")
    ap.add_argument("--num-restarts", type=int, default=5)
    ap.add_argument("--raw-samples", type=int, default=128)
    ap.add_argument("--max-cholesky-size", type=int, default=None, help="gpnys threshold (default GPyTorch's, 4096)")
    ap.add_argument("--singletask-timeout", type=float, default=None,
                    help="stop SingleTaskGP's L-BFGS-B after this many seconds (its time is then a lower bound)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="torch device of the data and models (e.g. cuda)")
    ap.add_argument("--warm-from", default=None, help="checkpoint directory of examples/bo_large_n.py: time a warm "
                    "iteration from each model's last state")
    ap.add_argument("--seeds", default="0,1,2", help="campaign seeds for --warm-from")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.n = args.n or (150 if args.quick else 5000)
    if args.quick:
        args.n_test, args.num_restarts, args.raw_samples = 100, 2, 16
        args.max_cholesky_size = 0 if args.max_cholesky_size is None else args.max_cholesky_size
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    Xw = torch.rand(64, 6, dtype=torch.float64)
    fit_gpytorch_mll(ExactMarginalLogLikelihood(*(lambda m: (m.likelihood, m))(SingleTaskGP(Xw, objectives(Xw, 1)))))
    if args.warm_from:
        res = warm_iterations(args, argv)
        torch.set_num_threads(threads)
        return res
    X = SobolEngine(6, scramble=True, seed=args.seed).draw(args.n, dtype=torch.float64)
    X, Y = X.to(args.device), objectives(X, args.outputs).to(args.device)
    models = {"singletask": lambda: SingleTaskGP(X, Y),
              "gpnys": lambda **kw: PreconditionedSingleTaskGP(X, Y, max_cholesky_size=args.max_cholesky_size, **kw)}
    res: dict = {"n": args.n, "d": 6, "outputs": args.outputs, "seed": args.seed, "device": str(X.device),
                 "num_restarts": args.num_restarts, "raw_samples": args.raw_samples,
                 "threads": torch.get_num_threads(), "methods": {}, "provenance": provenance(__file__, argv, X.device)}
    fitted = {}
    for name in args.methods.split(","):
        need = singletask_posterior_bytes(args) if name == "singletask" else 0
        if need > args.memory_gib * 2**30:
            res["methods"][name] = {"skipped": f"its acquisition's first batch needs {need / 2**30:.1f} GiB "
                                               f"(> --memory-gib {args.memory_gib})"}
            print(f"{name:>10}: not run, {res['methods'][name]['skipped']}", flush=True)
            continue
        torch.manual_seed(args.seed)
        fitted[name] = models[name]()
        res["methods"][name] = one_iteration(fitted[name], Y, args,
                                             args.singletask_timeout if name == "singletask" else None)
        r = res["methods"][name]
        print(f"{name:>10}: fit {r['fit_s']:8.2f} s, {ACQ[args.outputs]} {r['acq_s']:7.2f} s, "
              f"total {r['total_s']:8.2f} s, "
              f"noise {fmt(r['noise'], '.3g')}, candidate f = {fmt(r['candidate_value'], '.4f')}"
              + (f", {r['precond']} rank {r['rank']}, {r['builds']} builds" if "builds" in r else "")
              + (f"; path {r['path']}: {r['path_reason']}" if "path" in r else ""), flush=True)
    if {"singletask", "gpnys"} <= set(fitted):
        ms = res["methods"]
        res["time_ratio"] = ms["gpnys"]["total_s"] / ms["singletask"]["total_s"]
        chk = posterior_check(fitted["singletask"], models["gpnys"](posterior_cholesky_size=0), args.n_test, args.seed)
        res["posterior_check"] = chk
        print(f"gpnys / SingleTaskGP wall time (fit + {ACQ[args.outputs]}): {res['time_ratio']:.3f}")
        print(f"posterior at {chk['n_test']} points, SingleTaskGP's hyperparameters: mean rel. err max "
              f"{chk['mean_rel_err_max']:.2e} (median {chk['mean_rel_err_median']:.1e}), variance rel. err max "
              f"{chk['var_rel_err_max']:.2e} (median {chk['var_rel_err_median']:.1e}); predict "
              f"{chk['gpnys_predict_s']:.2f} s vs {chk['ref_predict_s']:.2f} s, {chk['posterior_iterations']} PCG it.")
    torch.set_num_threads(threads)
    tag = "" if args.outputs == 1 else f"_m{args.outputs}"
    path = Path(args.out) if args.out else RESULTS / (f"bo_compare_quick{tag}.json" if args.quick
                                                      else f"bo_compare_n{args.n}{tag}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    plot(res, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return res


if __name__ == "__main__":
    main()
