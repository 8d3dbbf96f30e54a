"""Fantasy-based acquisition at growing n: one-shot qKnowledgeGradient's value + gradient, gpnys's fantasy models
against ``SingleTaskGP``'s (GPyTorch's fantasy update), time and peak memory.

Run:  python benchmarks/bo_fantasy.py --sizes 1000,2000,5000,20000 --threads 2
      python benchmarks/bo_fantasy.py --device cuda --sizes 5000,30000,100000
      python benchmarks/bo_fantasy.py --quick          (n = 300; the tests run it)

Data: ``n`` scrambled-Sobol points in [0, 1]^6 with Hartmann-6 values (``negate=True``), float64, BoTorch's default
``Standardize``; fixed hyperparameters (length-scales 0.3-0.6, outputscale 1, noise 1e-3 in the standardised
scale), the same for every method. Workload: ``qKnowledgeGradient`` with ``--fantasies`` Sobol fantasies (seed 0)
and q = 1, evaluated with its gradient at ``--restarts`` random one-shot points ``(restarts, 1 + fantasies, 6)``,
``--repeats`` times, each a step of 1e-3 further along one random direction (as ``optimize_acqf``'s L-BFGS-B
steps move them): the first call builds the base model's posterior caches (a Cholesky or the PCG preconditioner),
the following ones are what each step of ``optimize_acqf`` pays (PCG from the previous step's solutions).

Methods: ``singletask`` (BoTorch's ``SingleTaskGP``: GPyTorch's fantasy update, ``(f, b, n + q, n + q)`` matrices);
``gpnys`` (``PreconditionedSingleTaskGP`` defaults: the base posterior by Cholesky where its working set fits the
memory budget, else PCG, and fantasies by conditioning, docs/bo.md); ``gpnys-pcg`` (its posterior by PCG at every
size, ``posterior_cholesky_size=0``, and ``max_cholesky_size=0``). Each case runs in its own process, so its peak
memory is its own (``ru_maxrss`` on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU). A ``singletask`` case
whose fantasy matrices alone (``7 f b (n + 1)² 8`` bytes, measured 6.5 of them at n = 2 000) would pass
``--memory-gib`` is skipped and recorded with that prediction. Errors: the qKG values and gradients against
``singletask``'s where it ran, else against ``gpnys``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("singletask", "gpnys", "gpnys-pcg")


def case(n: int, method: str, args: argparse.Namespace) -> dict:
    """One (n, method) case, in this process: times, peak memory, qKG values and gradients."""
    import warnings

    import torch
    from botorch.acquisition import qKnowledgeGradient
    from botorch.models import SingleTaskGP
    from botorch.sampling import SobolQMCNormalSampler
    from botorch.test_functions import Hartmann
    from torch.quasirandom import SobolEngine

    from gpnys.bo import PreconditionedSingleTaskGP

    warnings.simplefilter("ignore")  # BoTorch's input warnings; the numbers are checked against the reference
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), torch.float64
    X = SobolEngine(6, scramble=True, seed=args.seed).draw(n, dtype=dtype)
    Y = Hartmann(dim=6, negate=True)(X).unsqueeze(-1)
    X, Y = X.to(device), Y.to(device)
    options = {"gpnys": {}, "gpnys-pcg": {"max_cholesky_size": 0, "posterior_cholesky_size": 0}}
    model = SingleTaskGP(X, Y) if method == "singletask" else PreconditionedSingleTaskGP(X, Y, **options[method])
    model.covar_module.lengthscale = torch.linspace(0.3, 0.6, 6, dtype=dtype, device=device).reshape(1, 6)
    model.likelihood.noise = torch.tensor(1e-3, dtype=dtype, device=device)
    model.eval()
    acq = qKnowledgeGradient(model, sampler=SobolQMCNormalSampler(torch.Size([args.fantasies]), seed=0),
                             num_fantasies=None)
    g = torch.Generator().manual_seed(args.seed + 1)
    X0 = torch.rand(args.restarts, 1 + args.fantasies, 6, generator=g, dtype=dtype).to(device)
    step = 1e-3 * torch.nn.functional.normalize(torch.randn(X0.shape, generator=g, dtype=dtype), dim=-1).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for r in range(args.repeats):
        x = (X0 + r * step).clamp(0, 1).requires_grad_(True)
        t0 = time.perf_counter()
        value = acq(x)
        value.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    rec = {"first_s": times[0], "warm_s": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else None,
           "peak_gib": peak / 2**30, "values": value.detach().cpu().tolist(), "grad": x.grad.cpu().reshape(-1).tolist()}
    if method != "singletask":
        rec.update(posterior_exact=model.posterior_exact() if model.uses_preconditioner() else True,
                   path_reason=model.path_reason, posterior_path_reason=model.posterior_path_reason,
                   posterior_iterations=model.posterior_iterations)
    return rec


def predicted_gib(n: int, args: argparse.Namespace) -> float:
    """GPyTorch's fantasy matrices for ``singletask`` (module docstring)."""
    return 7 * args.fantasies * args.restarts * (n + 1) ** 2 * 8 / 2**30


def run_case(n: int, method: str, args: argparse.Namespace) -> dict:
    """:func:`case` in a fresh process (its own peak memory); a crash or timeout is recorded, not raised."""
    if method == "singletask" and predicted_gib(n, args) > args.memory_gib:
        return {"skipped": f"GPyTorch's fantasy matrices alone: {predicted_gib(n, args):.1f} GiB predicted > "
                           f"--memory-gib {args.memory_gib:g}"}
    cmd = [sys.executable, __file__, "--case", f"{n}:{method}", *args.passthrough]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"failed": f"over --case-timeout {args.case_timeout:g} s"}
    if proc.returncode != 0:
        why = "killed (out of memory)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
        return {"failed": why, "stderr": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def errors(rec: dict, ref: dict) -> tuple[float, float]:
    """Largest relative error of the qKG values, and of the gradient relative to its largest component."""
    v = max(abs(a - b) / abs(b) for a, b in zip(rec["values"], ref["values"]))
    scale = max(abs(b) for b in ref["grad"])
    return v, max(abs(a - b) for a, b in zip(rec["grad"], ref["grad"])) / scale


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for method in res["methods"]:
        rows = [(r["n"], r[method]) for r in res["rows"] if "first_s" in r[method]]
        if not rows:
            continue
        ns = [n for n, _ in rows]
        axes[0].plot(ns, [r["warm_s"] or r["first_s"] for _, r in rows], "o-", label=method)
        axes[1].plot(ns, [r["peak_gib"] for _, r in rows], "o-", label=method)
    for ax, label in zip(axes, ("qKG value + gradient, warm (s)", "peak memory (GiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("training points n")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"one-shot qKG, {res['fantasies']} fantasies x {res['restarts']} points, "
                 f"{res['provenance']['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="training sizes (default 1000,2000,5000,20000; --quick: 300)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--fantasies", type=int, default=16)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--memory-gib", type=float, default=20.0, help="skip singletask cases predicted above this")
    ap.add_argument("--case-timeout", type=float, default=900.0)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.fantasies, args.restarts, args.repeats = args.sizes or "300", 4, 2, 2
    args.passthrough = [f"--fantasies={args.fantasies}", f"--restarts={args.restarts}", f"--repeats={args.repeats}",
                        f"--seed={args.seed}", f"--device={args.device}"] + (
                           [f"--threads={args.threads}"] if args.threads else [])
    if args.case:
        n, method = args.case.split(":")
        print(json.dumps(case(int(n), method, args)))
        return {}
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    sizes = [int(s) for s in (args.sizes or "1000,2000,5000,20000").split(",")]
    from gpnys.baselines.provenance import provenance  # here: a case's process measures its own peak memory

    res: dict = {"fantasies": args.fantasies, "restarts": args.restarts, "repeats": args.repeats, "seed": args.seed,
                 "threads": args.threads, "device": args.device, "methods": methods, "rows": [],
                 "provenance": provenance(__file__, argv, args.device)}
    print(f"{'n':>7} {'method':>10} {'first s':>9} {'warm s':>9} {'peak GiB':>9} {'value err':>10} {'grad err':>10}")
    for n in sizes:
        row: dict = {"n": n}
        for method in methods:
            row[method] = run_case(n, method, args)
        ref = next((row[m] for m in ("singletask", "gpnys") if m in row and "values" in row[m]), None)
        for method in methods:
            r = row[method]
            if "values" in r and ref is not None and r is not ref:
                r["value_rel_err"], r["grad_rel_err"] = errors(r, ref)
                r["error_reference"] = "singletask" if ref is row.get("singletask") else "gpnys"
            if "first_s" in r:
                warm = f"{r['warm_s']:9.3f}" if r["warm_s"] is not None else f"{'':>9}"
                err = (f"{r['value_rel_err']:10.2e} {r['grad_rel_err']:10.2e}" if "value_rel_err" in r
                       else f"{'(ref)':>10} {'':>10}")
                print(f"{n:>7} {method:>10} {r['first_s']:9.3f} {warm} {r['peak_gib']:9.2f} {err}", flush=True)
            else:
                print(f"{n:>7} {method:>10} {r.get('skipped') or r.get('failed')}", flush=True)
        res["rows"].append(row)
    path = Path(args.out) if args.out else RESULTS / (
        "bo_fantasy_quick.json" if args.quick else f"bo_fantasy_{args.device.split(':')[0]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    plot(res, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return res


if __name__ == "__main__":
    main()
