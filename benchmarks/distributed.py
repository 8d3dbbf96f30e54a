"""One MLL value + gradient, the kernel split by rows over P processes (torch.distributed): time, traffic, memory.

Then a cost model of the same evaluation on 1-8 GPUs at n = 10^6 .. 10^7.

Run:  python benchmarks/distributed.py                  (n = 50 000, P = 1, 2; ~10 minutes on 2 cores)
      python benchmarks/distributed.py --dtype float32 --dense-gib 0   (memory as a rank at 10^7 / 8 GPUs)
      python benchmarks/distributed.py --device cuda --procs 1 --n 200000 --dtype float32
                                                        (P = 1 over NCCL on one GPU against no group)
      python benchmarks/distributed.py --model-from RUN.json --memory-from A.json,B.json
                                                        (no runs: the model from a device run's records)
      python benchmarks/distributed.py --quick          (n = 2000; run by the test suite)

For P in ``--procs`` the script starts P worker processes of itself (one rank each, gloo over localhost, the
machine's ``--threads`` shared among them) that run the same evaluation on synthetic 3-D data (unit density,
Matérn-3/2, l = 1, outputscale 1, noise 0.1, ``auto`` preconditioner, error bars on): one untimed warm-up, then
``--repeats`` timed evaluations. Each rank counts its collectives (:data:`gpnys.collectives.STATS`:
calls, bytes received, seconds inside them); rank 0 reports. The baseline is the same evaluation without a process
group (``P = 1, plain``), in the same run.

Columns: seconds per evaluation (median), the share of it spent in collectives, MiB received per evaluation, the
share spent in the preconditioner's applies (the replicated work: what partitioned PCG vectors could split) and in
the forward of the control variate's differentiable terms (replicated too; their backward is not timed), the
loss / gradient difference from the plain run (the target: identical to rounding); then one AFN build
(``--build-k`` landmarks, w = 100) and one column Nyström build (rank ``--build-k``, FPS) with their rows split over
the ranks: seconds, rank 0's CPU seconds (the work split: the ranks share the machine's cores), MiB received, and
the log det's relative difference from the plain build.

Memory, in separate runs (one untimed evaluation each, no builds, at n and at ``--mem-n`` points): each rank's
peak above what it held before the evaluation (CPU: the resident set's high-water mark, reset through
``/proc/self/clear_refs`` after ``malloc_trim``, Linux only; CUDA: ``max_memory_allocated``); the difference gives
bytes per point per rank (:func:`memory_model`: replicated ``a`` and split ``b / P``, from P = 1 and 2).
``--dense-gib 0`` runs the workers under ``gpnys.memory_budget(dense_bytes=0)``, as a rank at 10^7 / 8 GPUs would
run by default (its rows' arrays exceed half the free memory): the control variate's rows in checkpointed batches.
``--block-mib`` sets their temporary blocks: a GPU's default (1 GiB) holds whole passes at 2 x 10^5 points, which a
rank at 10^7 runs in blocks, so ``--block-mib 32`` measures that rank's bytes per point.

Then a cost model for 1-8 GPUs at n = 10^6 .. 10^7: per evaluation, the single-GPU time measured by
``benchmarks/gpu.py --parts mll`` (``--gpu-mll-1e6-s``: one value + gradient at 10^6 on an H200, float32;
``--gpu-cutoff-1e6-s`` with the cutoff) scaled by ``(n / 10^6)^2`` (every pair) or ``n / 10^6`` (cutoff, fixed
density) and divided by P, plus the all-gathers: ``--products`` products of ``t`` columns, each receiving
``(P - 1) / P n t`` float32 values at ``--link-gbs`` GB/s; and the memory per rank against ``--gpu-gib``. Prints a
table, writes JSON (and a PNG of the model).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpnys.baselines.provenance import provenance
from gpnys.cli.common import add_budget_args

RESULTS = Path(__file__).resolve().parent / "results"


def worker(args) -> None:
    """One rank: the evaluations; rank 0 writes ``args.worker_out``."""
    import gpytorch

    import gpnys.distributed as gd
    from gpnys import collectives, datasets, use_preconditioner
    from gpnys.gp.settings import EstimatorSettings
    from gpnys.gp.training import ExactGPModel

    plain, cuda = args.plain, args.device == "cuda"
    rank, size = (0, 1) if plain else gd.init(backend="nccl" if cuda else "gloo", seed=args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.threads // (1 if plain else size)))
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    device = torch.device("cpu") if not cuda else torch.device("cuda") if plain else gd.device()
    ds = datasets.load("synthetic3d", n=args.n, seed=args.seed, standardize=False, dtype=dtype)
    X, y = ds.train_x.to(device), ds.train_y.to(device)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    model = ExactGPModel(X, y, lik, kernel="matern32").to(device=device, dtype=dtype)
    model.covar_module.base_kernel.lengthscale = 1.0
    model.covar_module.outputscale = 1.0
    lik.noise = 0.1
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    settings = EstimatorSettings(dense_limit_bytes=0) if plain else gd.settings(dense_limit_bytes=0)
    # the preconditioner builds alone, split by rows (AFN's K12 columns and FSAI rows; Nyström's Y and B rows,
    # its SVD a TSQR) or not: once each, timed
    from gpnys.precond import AFNPreconditioner, NystromPreconditioner
    from gpnys.precond.base import Preconditioner

    kern, group, k = model.covar_module.base_kernel, None if plain else True, min(args.build_k, args.n - 1)
    build = {}
    builds = () if args.memory_only else (
        ("build", lambda: AFNPreconditioner(X, kern, 0.1, k=k, w=min(100, args.n - 1), group=group)),
        ("nystrom", lambda: NystromPreconditioner(X, kern, 0.1, k, group=group)))
    for name, make in builds:
        collectives.reset_stats()
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        P = make()
        _sync(device)
        build.update({f"{name}_s": time.perf_counter() - t0, f"{name}_cpu_s": time.process_time() - c0,
                      f"{name}_logdet": float(P.logdet()),
                      f"{name}_mib_received": collectives.STATS["bytes_received"] / 2**20})
        del P
    # the replicated work of an evaluation: the preconditioner's applies (PCG's, SLQ's and the control variate's),
    # and the forward of the control variate's differentiable terms (its backward runs inside loss.backward())
    from gpnys.gp.problem import TrainingProblem

    applied = {"seconds": 0.0, "cv_seconds": 0.0}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(device)
                applied[key] += time.perf_counter() - t
        return wrapper
    Preconditioner.solve = timed(Preconditioner.solve, "seconds")
    TrainingProblem.control_variate_terms = timed(TrainingProblem.control_variate_terms, "cv_seconds")
    times, records, apply_s, cv_s = [], [], [], []
    base_mib = _reset_peak(device) if args.memory_only else None
    with use_preconditioner(model, "auto", settings=settings, seed=args.seed):
        for rep in range(1 if args.memory_only else args.repeats + 1):  # rep 0 warms up
            torch.manual_seed(args.seed + rep)
            collectives.reset_stats()
            applied.update(seconds=0.0, cv_seconds=0.0)
            for p in model.parameters():
                p.grad = None
            _sync(device)
            t0 = time.perf_counter()
            loss = -mll(model(X), y)
            loss.backward()
            _sync(device)
            dt = time.perf_counter() - t0
            if rep:  # rep 0 warms up
                times.append(dt)
                records.append(dict(collectives.STATS))
                apply_s.append(applied["seconds"])
                cv_s.append(applied["cv_seconds"])
    peak_mib = _peak_mib(device) if args.memory_only else None
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()
    if rank == 0 and args.memory_only:
        Path(args.worker_out).write_text(json.dumps({"procs": size, "plain": plain, "n": args.n, "eval_mib":
                                                     None if None in (peak_mib, base_mib) else peak_mib - base_mib}))
    elif rank == 0:
        med = statistics.median(times)
        share = statistics.median(r["seconds"] / t for r, t in zip(records, times))
        out = {"procs": size, "plain": plain, "n": args.n, "dtype": args.dtype, "device": str(device),
               "threads_per_rank": torch.get_num_threads(), "time_s": med, "times_s": times, "comm_share": share,
               "collectives": records[-1]["collectives"], "mib_received": records[-1]["bytes_received"] / 2**20,
               "comm_s": records[-1]["seconds"],
               "apply_share": statistics.median(a / t for a, t in zip(apply_s, times)),
               "cv_forward_share": statistics.median(a / t for a, t in zip(cv_s, times)),
               "loss": float(loss), "grad": grad, **build}
        Path(args.worker_out).write_text(json.dumps(out))
    if not plain:
        torch.distributed.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> float | None:
    """Start a peak-memory window: MiB in use now (CUDA: allocated by torch; CPU: resident set, after returning
    the heap's free pages to the system, Linux only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set (Linux >= 4.0)
        return _status_mib("VmRSS")
    except OSError:
        return None


def _peak_mib(device: torch.device) -> float | None:
    """The window's peak in MiB (CUDA: torch's allocations; CPU: the resident set's high-water mark)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        return _status_mib("VmHWM")
    except OSError:
        return None


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise OSError(f"{field} not in /proc/self/status")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, procs: int, plain: bool, out: Path, mem_n: int | None = None) -> dict:
    """Run ``procs`` worker processes (``plain``: one, without a process group); rank 0's record. ``mem_n``: one
    untimed evaluation at that n, no builds, for its memory only, with glibc's mmap threshold fixed at 64 KiB (its
    default moves up to 32 MiB after the first large free, and the heap then keeps freed blocks resident: the
    peak resident set varied by 50 % between runs; fixed, by 1 %)."""
    port = _port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-out", str(out),
           "--n", str(mem_n or args.n),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--seed", str(args.seed),
           "--dtype", args.dtype, "--build-k", str(args.build_k), "--device", args.device]
    cmd += ["--plain"] if plain else []
    cmd += [] if args.dense_gib is None else ["--dense-gib", str(args.dense_gib)]
    cmd += [] if args.block_mib is None else ["--block-mib", str(args.block_mib)]
    cmd += [] if mem_n is None else ["--memory-only"]
    ps = []
    for rank in range(procs):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(procs), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               **({} if mem_n is None else {"MALLOC_MMAP_THRESHOLD_": "65536"})}
        ps.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=args.timeout)[1] for p in ps]
    if any(p.returncode for p in ps):
        raise RuntimeError(f"a worker failed: {[e[-2000:] for e in errs if e]}")
    return json.loads(out.read_text())


def _bytes_per_point(big_mib: float | None, small_mib: float | None, n: int, small_n: int) -> float | None:
    """Bytes per point per rank: the slope of an evaluation's peak between ``small_n`` and ``n`` points."""
    return None if big_mib is None or small_mib is None else (big_mib - small_mib) * 2**20 / (n - small_n)


def memory_model(runs: list[dict]) -> dict | None:
    """Bytes per point per rank, ``a + b / P``: ``a`` replicated, ``b`` split over the ranks, from the measured
    slopes of one process (``s1``) and of two ranks (``s2``): ``a = 2 s2 - s1``, ``b = 2 (s1 - s2)``. Without a
    two-rank run (or where two ranks hold more per point than one) everything counts as replicated, an upper
    bound. ``intercept_mib``: the largest peak not proportional to n (blocks, workspaces)."""
    ok = [r for r in runs if r.get("bytes_per_point") is not None]
    one = next((r for r in ok if r["plain"]), None)
    if one is None:
        return None
    two = next((r for r in ok if r["procs"] == 2), None)
    s1 = one["bytes_per_point"]
    s2 = two["bytes_per_point"] if two is not None else None
    a, b = (2 * s2 - s1, 2 * (s1 - s2)) if s2 is not None and s1 / 2 <= s2 < s1 else (max(s1, s2 or 0.0), 0.0)
    intercept = max(r["mem_n_eval_mib"] - r["bytes_per_point"] * r["mem_n"] / 2**20 for r in ok)
    return {"replicated_bytes_per_point": a, "split_bytes_per_point": b, "intercept_mib": max(0.0, intercept),
            "from": "P = 1 and 2" if b > 0 else "P = 1 (all counted as replicated)"}


def cost_model(args, memory: dict | None = None) -> list[dict]:
    """Projected seconds per MLL evaluation on P GPUs (module docstring), and memory per rank (:func:`memory_model`)."""
    rows = []
    for n in (1_000_000, 3_000_000, 10_000_000):
        for procs in (1, 2, 4, 8):
            comm = args.products * (procs - 1) / procs * n * args.columns * 4 / (args.link_gbs * 1e9)
            dense = args.gpu_mll_1e6_s * (n / 1e6) ** 2 / procs + comm
            cut = args.gpu_cutoff_1e6_s * (n / 1e6) / procs + comm
            row = {"n": n, "gpus": procs, "no_cutoff_s": dense, "cutoff_s": cut, "allgather_s": comm}
            if memory is not None:
                per_point = memory["replicated_bytes_per_point"] + memory["split_bytes_per_point"] / procs
                row["rank_gib"] = (n * per_point + memory["intercept_mib"] * 2**20) / 2**30
                row["fits"] = row["rank_gib"] <= args.gpu_gib
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=None, help="points (default 50000; quick 2000)")
    ap.add_argument("--procs", default="1,2")
    ap.add_argument("--repeats", type=int, default=None, help="timed evaluations (default 3; quick 1)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads shared by the ranks")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--build-k", type=int, default=None,
                    help="AFN landmarks and Nyström rank of the timed builds (default 1000; quick 200)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: every rank on cuda:LOCAL_RANK over NCCL (P = 1 on a single GPU)")
    add_budget_args(ap)  # the workers' gpnys.memory_budget (module docstring)
    ap.add_argument("--mem-n", type=int, default=None,
                    help="a second, memory-only evaluation per P at this n, for bytes per point (default n / 5)")
    ap.add_argument("--gpu-gib", type=float, default=139.8,
                    help="memory per GPU in the model (H200: 139.8; H100: 79.2)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--gpu-mll-1e6-s", type=float, default=17.06,
                    help="seconds per value + gradient at 10^6 on one GPU, every pair, float32 (default: an H200's)")
    ap.add_argument("--gpu-cutoff-1e6-s", type=float, default=2.17,
                    help="the same with the default cutoff (default: an H200's)")
    ap.add_argument("--products", type=int, default=17, help="products (all-gathers) per evaluation in the model")
    ap.add_argument("--columns", type=int, default=17, help="columns per product in the model (probes + 1)")
    ap.add_argument("--link-gbs", type=float, default=100.0, help="all-gather bandwidth per GPU in the model")
    ap.add_argument("--model-from", default=None, metavar="JSON",
                    help="no runs: the cost model from this earlier run's JSON (its runs' memory) with this call's "
                         "model flags")
    ap.add_argument("--memory-from", default=None, metavar="A.json,B.json",
                    help="with --model-from: the memory per point from two memory-only worker records (one process, "
                         "two sizes) instead")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.n = args.n or (2000 if args.quick else 50_000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.build_k = args.build_k or (200 if args.quick else 1000)
    args.mem_n = args.mem_n or max(2, args.n // 5)
    if args.worker:
        from gpnys import memory_budget
        from gpnys.cli.main import budget_from_args

        with memory_budget(**budget_from_args(args)):
            worker(args)
        return 0
    if args.n < 1 or args.repeats < 1 or args.threads < 1:
        raise SystemExit("--n, --repeats and --threads must be positive")
    if not 2 <= args.mem_n < args.n:
        raise SystemExit("--mem-n must be at least 2 and below --n")
    procs = [int(p) for p in args.procs.split(",") if p]
    out = Path(args.out) if args.out else RESULTS / ("distributed_quick.json" if args.quick else "distributed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.model_from:
        return model_only(args, out, argv)
    tmp = out.with_suffix(".worker.tmp")
    rows = [launch(args, 1, True, tmp)]
    for p in procs:
        rows.append(launch(args, p, False, tmp))
    for r in rows:
        if args.quick and r["procs"] == 1 and not r["plain"]:  # (the memory model reads the plain and P = 2 rows)
            r.update(mem_n=args.mem_n, eval_mib=None, mem_n_eval_mib=None, bytes_per_point=None)
            continue
        big, small = (launch(args, r["procs"], r["plain"], tmp, mem_n=m)["eval_mib"] for m in (args.n, args.mem_n))
        r.update(mem_n=args.mem_n, eval_mib=big, mem_n_eval_mib=small,
                 bytes_per_point=_bytes_per_point(big, small, args.n, args.mem_n))
    tmp.unlink(missing_ok=True)
    base = rows[0]
    where = "one GPU per rank (NCCL)" if args.device == "cuda" else f"{args.threads} threads shared by the ranks (gloo)"
    print(f"one MLL value + gradient, synthetic3d n = {args.n}, Matérn-3/2, {args.dtype}, {where}")
    print("| P | s / evaluation | in collectives | MiB received | collectives | preconditioner applies "
          "| control variate (forward) | loss diff | max grad diff | AFN build s | CPU s | MiB received | log det diff "
          "| Nyström build s | CPU s | MiB received | log det diff |")
    print("| --- |" + " ---: |" * 17)
    for r in rows:
        r["loss_diff"] = abs(r["loss"] - base["loss"])
        r["grad_diff"] = max(abs(a - b) for a, b in zip(r["grad"], base["grad"]))
        label = f"{r['procs']}{' plain' if r['plain'] else ''}"
        cells = [label, f"{r['time_s']:.2f}", f"{r['comm_share']:.1%}", f"{r['mib_received']:.1f}",
                 str(r["collectives"]), f"{r['apply_share']:.1%}", f"{r['cv_forward_share']:.1%}",
                 f"{r['loss_diff']:.1e}", f"{r['grad_diff']:.1e}"]
        for name in ("build", "nystrom"):
            r[f"{name}_logdet_diff"] = (abs(r[f"{name}_logdet"] - base[f"{name}_logdet"])
                                        / max(1.0, abs(base[f"{name}_logdet"])))
            cells += [f"{r[f'{name}_s']:.2f}", f"{r[f'{name}_cpu_s']:.2f}", f"{r[f'{name}_mib_received']:.1f}",
                      f"{r[f'{name}_logdet_diff']:.1e}"]
        print("| " + " | ".join(cells) + " |")
    memory = memory_model(rows)
    print(f"\nmemory per rank (peak of an evaluation, above what was resident before it; {args.device}): "
          f"n = {args.mem_n} / {args.n}")
    for r in rows:
        bpp = r["bytes_per_point"]
        print(f"  P = {r['procs']}{' plain' if r['plain'] else ''}: "
              + ("not measured" if bpp is None else
                 f"{r['mem_n_eval_mib']:.0f} / {r['eval_mib']:.0f} MiB, {bpp:.0f} bytes per point"))
    if memory is not None:
        print(f"  model: {memory['replicated_bytes_per_point']:.0f} bytes per point replicated + "
              f"{memory['split_bytes_per_point']:.0f} / P split + {memory['intercept_mib']:.0f} MiB ({memory['from']})")
    model = print_model(args, memory)
    out.write_text(json.dumps({"runs": rows, "memory_model": memory, "cost_model": model,
                               "provenance": provenance(__file__, argv, args.device)}, indent=1))
    plot_model(model, out)
    print(f"wrote {out}")
    return 0


def print_model(args, memory: dict | None) -> list[dict]:
    """:func:`cost_model`'s rows, printed."""
    model = cost_model(args, memory)
    print("\ncost model per evaluation (s): n, GPUs, every pair, with the cutoff, all-gathers"
          + ("" if memory is None else f", GiB per rank (against {args.gpu_gib:g})"))
    for m in model:
        print(f"  {m['n']:>9} {m['gpus']} {m['no_cutoff_s']:10.1f} {m['cutoff_s']:8.2f} {m['allgather_s']:.4f}"
              + ("" if "rank_gib" not in m else f" {m['rank_gib']:8.1f}{'' if m['fits'] else ' (does not fit)'}"))
    return model


def model_only(args, out: Path, argv) -> int:
    """``--model-from``: the cost model from an earlier run's JSON, its memory from that run's records or from two
    memory-only worker records (``--memory-from``: one process at two sizes, as :func:`launch` writes them)."""
    runs = json.loads(Path(args.model_from).read_text())["runs"]
    if args.memory_from:
        recs = sorted((json.loads(Path(p).read_text()) for p in args.memory_from.split(",")), key=lambda r: r["n"])
        if len(recs) != 2 or recs[0]["n"] == recs[1]["n"] or recs[0]["procs"] != recs[1]["procs"]:
            raise SystemExit("--memory-from needs two records of one process count at two sizes")
        small, big = recs
        runs = [{"procs": big["procs"], "plain": big["plain"], "mem_n": small["n"], "eval_mib": big["eval_mib"],
                 "mem_n_eval_mib": small["eval_mib"],
                 "bytes_per_point": _bytes_per_point(big["eval_mib"], small["eval_mib"], big["n"], small["n"])}]
    memory = memory_model(runs)
    if memory is not None:
        print(f"memory: {memory['replicated_bytes_per_point']:.0f} bytes per point replicated + "
              f"{memory['split_bytes_per_point']:.0f} / P split + {memory['intercept_mib']:.0f} MiB ({memory['from']})")
    model = print_model(args, memory)
    out.write_text(json.dumps({"meta": {"model_from": args.model_from, "memory_from": args.memory_from},
                               "memory_model": memory, "cost_model": model,
                               "provenance": provenance(__file__, argv)}, indent=1))  # nothing ran on --device
    plot_model(model, out)
    print(f"wrote {out}")
    return 0


def plot_model(model: list[dict], out: Path) -> None:
    """The cost model against GPUs (``out`` with ``.png``), the 5-minute line marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for n in sorted({m["n"] for m in model}):
            pts = [m for m in model if m["n"] == n]
            ax.plot([m["gpus"] for m in pts], [m["no_cutoff_s"] for m in pts], "o-", label=f"n = {n:.0e}, every pair")
            ax.plot([m["gpus"] for m in pts], [m["cutoff_s"] for m in pts], "s--", label=f"n = {n:.0e}, cutoff")
        ax.axhline(300, color="k", lw=0.8, ls=":")
        ax.set(xlabel="GPUs", ylabel="s per MLL value + gradient (model)", yscale="log", xscale="log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover - matplotlib is a test dependency
        pass


if __name__ == "__main__":
    sys.exit(main())
