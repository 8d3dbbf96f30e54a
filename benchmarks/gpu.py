"""gpnys on a GPU: kernel product throughput, one MLL value + gradient against exact and CG baselines, short fits
and every other public path, with times and peak memory.

Run:  python benchmarks/gpu.py                                  (CUDA: all parts, default sizes; the parts took 1 to 4
                                                               minutes each on an H100, see RESULTS.md)
      python benchmarks/gpu.py --parts product --keops          (+ KeOps products in a child process)
      python benchmarks/gpu.py --parts fit --fit-1e6 --real-sizes "" --fit-synthetic-sizes ""   (the 1e6 fit only)
      python benchmarks/gpu.py --parts paths                    (every other public path at 1e6 points, one row each)
      python benchmarks/gpu.py --quick                          (CPU, tiny sizes, Triton interpreted; run by the tests)

Four parts (``--parts``: default ``product,mll,fit``; ``paths`` on request), every timing synchronised
(``torch.cuda.synchronize``) on CUDA and every peak memory read with ``torch.cuda.max_memory_allocated`` after a
reset (``None`` on the CPU):

1. product: one unit Matérn-3/2 product ``K V`` (``V``: 32 columns or ``--product-columns``, ``--product-dtype``
   float32) on ``synthetic3d`` (unit density, l = 1) with no cutoff (``prune_tol=0``, ``dense_limit_bytes=0``: every
   entry recomputed), for each backend of :class:`~gpnys.kernels.operator.StationaryKernelOperator`: ``torch`` tiles,
   ``triton`` (when ``select_backend(device, "triton")`` accepts it), ``triton_tf32`` and, with ``--keops``, ``keops``
   in a child process (pykeops segfaults on CUDA 13: a crash is recorded as ``crashed``). Median of ``--repeats`` after
   one warm-up; entries/s = n^2 / time; relative error (Frobenius) against the torch tiles at the smallest n. A
   ``triton`` row whose kernels failed and fell back to the torch tiles is marked ``fallback``.
2. mll: ``-MLL/n`` and its raw-parameter gradient at fixed hyperparameters (ScaleKernel(Matérn-3/2), Gaussian
   likelihood, zero mean; ``--lengthscale``, ``--outputscale``, ``--noise``) by
   ``gpnys`` (``use_preconditioner(model, "auto")``, default backend; at the synthetic sizes also ``gpnys_prune0``,
   ``EstimatorSettings(kernel_prune_tol=0)``: every pair, and ``gpnys_prune0_floor10``, the same with the fixed
   floor of 10 Lanczos steps, ``lanczos_share=None``: the estimator before commit 16cf2ec), ``gpytorch_cholesky``
   (GPyTorch's exact path, float64, only where 3 n^2 x 8 bytes fit in the free memory, else ``skipped (memory)``),
   ``cholesky_closed`` (the same exact loss by :func:`gpnys.baselines.exact.cholesky_loss`, float64, closed-form
   gradient, where 4 n^2 x 8 bytes fit), ``gpytorch_cg`` (``max_cholesky_size(0)``, GPyTorch's defaults; an OOM is
   recorded as ``OOM``) and, with ``--keops``, ``gpytorch_keops`` (``gpytorch.kernels.keops.MaternKernel`` under
   ``max_cholesky_size(0)``, in a child process). Errors are against ``gpytorch_cholesky`` where it ran, else
   ``cholesky_closed``: |loss - ref| and the largest gradient error |g - g*| / max(|g*|, 0.1 ||g*||)
   (:func:`gpnys.baselines.mll.grad_errors`). Data: kin40k (``--real-data``, standardised, 8-D) at 10k, 25k and its
   whole training split (36 000), and ``synthetic3d`` (not standardised) at 200k and 1e6.
3. fit: ``--fit-steps`` Adam steps (lr ``--lr``) from GPyTorch's initialisation (constant mean) by ``gpnys``,
   ``gpytorch_cg`` and ``cholesky`` (closed-form gradient, float64, where it fits) at the real sizes and synthetic
   200k; ``--fit-1e6`` adds synthetic 1e6 with gpnys and ``--fit-1e6-steps`` (50) steps (the aim: a 50-step Adam
   fit on 10^6 points within one hour). Wall time (steps only), final loss and hyperparameters; the ETA is printed
   after the first step. A fit whose ETA exceeds ``--fit-max-seconds`` stops there (``stopped``; not the 1e6 fit).
4. paths: every other public path once on ``synthetic3d`` at ``--paths-n`` (1e6) points, ``--dtype``,
   ScaleKernel(Matérn-3/2) at ``--lengthscale``, ``--outputscale``, ``--noise``: FPS (500 landmarks), the causal kNN
   pattern (w = 30), the kernel operator's cutoff plan (its share of the entries), the builds of ``afn`` (k = 500,
   w = 30), ``nystrom`` and ``pivchol`` (rank 500), ``fsai`` (w = 30) and ``auto`` (the hook's defaults) by
   ``make_preconditioner`` (rank, finite log det), one PCG solve ``K̂ x = y`` with the hook's system (iterations,
   true relative residual), one -MLL + gradient under the hook, ``hook.predict`` with variances at
   ``--paths-test`` (2000) test points after one training evaluation, a ``ReducedGP`` (LLA, 1000 FPS landmarks)
   with the exact model's hyperparameters, ``PreconditionedSingleTaskGP(max_cholesky_size=0,
   posterior_cholesky_size=0).posterior`` at 256 test points (hyperparameters loaded, no fit) and the CLI (``python -m
   gpnys.cli.main mll --method auto --device ...`` in a child process: exit code, last line). One row per path: status,
   seconds (``time_s`` the path's own call, ``wall_s`` with its setup, e.g. the preconditioner before PCG or the
   training evaluation before a prediction), peak memory, ``finite`` (and ``positive_variance`` for predictions; ``not
   finite`` is a failed row). Quick: 600 points, 50 test points (10 for BoTorch). Importing BoTorch rewrites GPyTorch's
   global defaults, so this part runs last.

Every size that raises (OOM, ...) is recorded with its error text and the run goes on. A measurement whose time,
projected from the previous size of the same method (x n^2, x n for gpnys with its cutoff), exceeds
``--max-seconds`` is skipped, and so is every measurement (but the ``--fit-1e6`` fit) that would start after
``--budget-s`` (1800) of the run. Untimed warm-ups come first (Triton / KeOps compilation, cuBLAS start-up): at
about 4096 points and, for gpnys, 20 480 points on the fly (a cutoff plan's block-sparse kernels), each congruent to
n mod 1024 so that Triton's size specialisation compiles the variants the timed call runs. The JSON is rewritten
after every row, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import os
import sys

import torch


def _wants_interpreter(argv: list[str]) -> bool:
    """``--quick`` on the CPU: Triton kernels run on CPU tensors only under its interpreter."""
    cpu = "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))
    return "--quick" in argv and (cpu or not torch.cuda.is_available())


# triton.jit reads TRITON_INTERPRET when a kernel module is imported: set it before gpnys (and triton) load
if _wants_interpreter(sys.argv[1:]):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import gpytorch  # noqa: E402

from gpnys import datasets, memory_budget  # noqa: E402
from gpnys.baselines.exact import cholesky_loss  # noqa: E402
from gpnys.baselines.mll import grad_errors  # noqa: E402
from gpnys.baselines.provenance import provenance  # noqa: E402
from gpnys.gp.hook import use_preconditioner  # noqa: E402
from gpnys.gp.settings import GP_DEFAULTS, EstimatorSettings  # noqa: E402
from gpnys.gp.training import ExactGPModel, fit, hyperparameters, read_checkpoint  # noqa: E402
from gpnys.kernels.backends import select_backend, triton_available  # noqa: E402
from gpnys.kernels.operator import StationaryKernelOperator  # noqa: E402
from gpnys.kernels.product import caches_dense  # noqa: E402
from gpnys.landmarks import fps  # noqa: E402
from gpnys.precond.cache import PointCache  # noqa: E402
from gpnys.precond.knn import causal_knn  # noqa: E402
from gpnys.precond.strategy import make_preconditioner  # noqa: E402
from gpnys.reduced import ReducedGP  # noqa: E402
from gpnys.solvers.pcg import pcg  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"float32": torch.float32, "float64": torch.float64}
CHILD_TAG = "GPU_BENCH_CHILD "
PRODUCT_COLUMNS = 32
WARMUP_N = 4096
REFERENCES = ("gpytorch_cholesky", "cholesky_closed")  # the error reference: the first of these that ran


# -- device helpers -------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def cleanup(device: torch.device) -> None:
    """Return freed CUDA memory to the device (after an OOM the traceback's tensors go with ``gc``)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def free_bytes(device: torch.device) -> int:
    """Free memory of ``device`` (CUDA: ``mem_get_info``; CPU: ``MemAvailable``)."""
    cleanup(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30  # unknown: assume a small machine


def classify(err: BaseException) -> str:
    msg = str(err).lower()
    oom = isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in msg or "can't allocate memory" in msg
    return "OOM" if oom else "error"


def guarded(fn: Callable[[], dict], device: torch.device) -> dict:
    """``fn()`` (a record; status ``ok`` unless it says otherwise) or ``{"status": "OOM"/"error", "error": ...}``."""
    try:
        rec = fn()
        rec.setdefault("status", "ok")
    except Exception as err:  # noqa: BLE001 - every failure is a result here
        rec = {"status": classify(err), "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    cleanup(device)
    return rec


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def load_data(data: str, n: int | None, dtype: torch.dtype, device: torch.device, seed: int):
    """``(X, y)`` on ``device``: ``synthetic3d`` unstandardised (unit density), real data standardised; ``n``
    ``None``: the whole training split."""
    ds = datasets.load(data, n=n, seed=seed, standardize=data != "synthetic3d", dtype=dtype, device=device)
    return ds.train_x, ds.train_y


# -- child processes (KeOps) ----------------------------------------------------------------------------------
def keops_missing() -> str | None:
    """Skip text when pykeops is not installed (GPyTorch's KeOps kernels would quietly fall back to its own)."""
    return None if importlib.util.find_spec("pykeops") else "skipped (pykeops is not installed: pip install pykeops)"


def run_child(spec: dict, timeout: float) -> dict:
    """Run ``spec`` in a fresh interpreter (``--child``); a signal (segfault) is ``crashed``, never fatal here."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"child ran past {timeout:.0f} s"}
    tail = (proc.stderr or "")[-1500:]
    if proc.returncode < 0:
        return {"status": "crashed", "error": f"child killed by signal {-proc.returncode}; stderr tail: {tail}"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    return {"status": "error", "error": f"child exit code {proc.returncode}, no result; stderr tail: {tail}"}


def child_main(spec: dict) -> None:
    device = torch.device(spec["device"])
    if spec["task"] == "product":
        rec = guarded(lambda: product_run("keops", spec["n"], DTYPES[spec["dtype"]], device, spec["seed"],
                                          spec["repeats"], ref_torch=spec["ref"], columns=spec["columns"]), device)
    else:
        dtype, hypers = DTYPES[spec["dtype"]], spec["hypers"]
        data, n, seed = spec["data"], spec["n"], spec["seed"]

        def go():
            X, y = load_data(data, n, dtype, device, seed)
            w = min(X.shape[0], spec["warmup_n"])
            mll_eval(X[:w], y[:w], "gpytorch_keops", hypers, seed)  # KeOps compiles its formulas here
            cleanup(device)
            return mll_eval(X, y, "gpytorch_keops", hypers, seed)

        rec = guarded(go, device)
    print(CHILD_TAG + json.dumps(rec), flush=True)


# -- part 1: products -----------------------------------------------------------------------------------------
def unit_matern(X: torch.Tensor, lengthscale: float) -> gpytorch.kernels.MaternKernel:
    """A unit-variance Matérn-3/2 kernel with ``lengthscale`` in ``X``'s dtype, on its device."""
    base = gpytorch.kernels.MaternKernel(nu=1.5).to(X)
    base.lengthscale = lengthscale
    return base


def unit_operator(X: torch.Tensor, base: gpytorch.kernels.Kernel, **kw: Any) -> StationaryKernelOperator:
    """``base(X, X)`` (outputscale 1) as gpnys's kernel operator; ``kw``: its backend / cutoff / memory options."""
    return StationaryKernelOperator(X, torch.ones((), dtype=X.dtype, device=X.device), base.lengthscale.detach(),
                                    base=base, cache={}, **kw)


def product_run(backend: str, n: int, dtype: torch.dtype, device: torch.device, seed: int, repeats: int,
                tf32: bool = False, keep: bool = False, ref_torch: bool = False,
                columns: int = PRODUCT_COLUMNS) -> dict:
    """One ``K V`` (``V``: ``columns`` columns) timed: median of ``repeats`` after a warm-up. ``keep``: return the
    product under ``"_out"``; ``ref_torch``: also the relative error against the torch tiles (the KeOps child)."""
    X, _ = load_data("synthetic3d", n, dtype, device, seed)
    base = unit_matern(X, 1.0)

    def operator(name: str, tf: bool) -> StationaryKernelOperator:
        return unit_operator(X, base, backend=name, prune_tol=0.0, dense_limit_bytes=0, tf32=tf)

    op = operator(backend, tf32)
    V = torch.randn(X.shape[0], columns, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64).to(device=device, dtype=dtype)
    rec: dict[str, Any] = {"n": X.shape[0]}
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reset_peak(device)
        op.matmul(V)  # warm-up (compilation)
        times, out = [], None
        for _ in range(repeats):
            t, out = timed(lambda: op.matmul(V), device)
            times.append(t)
        rec["peak_mem_mib"] = peak_mib(device)
        if ref_torch:
            ref = operator("torch", False).matmul(V)
            rec["rel_error_vs_torch"] = rel_error(out, ref)
    msgs = [str(w.message) for w in caught if "Triton kernel failed" in str(w.message)]
    if backend == "triton" and (msgs or triton_failed(device, dtype, tf32)):
        # (a TF32 failure is recorded under its own key: the FP32 rows keep their Triton kernels)
        rec.update(status="fallback", error="the Triton kernels failed; the torch tiles answered: "
                   + ("; ".join(msgs) or "earlier failure"))
    rec.update(time_s=statistics.median(times), times_s=times, entries_per_s=X.shape[0] ** 2 / statistics.median(times))
    if keep:
        rec["_out"] = out
    return rec


def triton_failed(device: torch.device, dtype: torch.dtype, tf32: bool = False) -> bool:
    """Whether gpnys's Triton kernels failed for ``(device, dtype, tf32)`` and its torch tiles answer instead."""
    from gpnys.launch import failed

    return failed("kernel", device, dtype, tf32)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def part_products(args, bench) -> None:
    device, dtype = args.device, DTYPES[args.product_dtype]
    variants = [("torch", "torch", False), ("triton", "triton", False), ("triton_tf32", "triton", True)]
    bench.header("product", f"K V, unit Matern-3/2, l = 1, {args.product_columns} columns, {args.product_dtype}, "
                 f"no cutoff, median of {args.repeats} after a warm-up",
                 f"{'backend':>12} {'n':>8} {'status':>16} {'time s':>9} {'entries/s':>10} {'rel err':>9} "
                 f"{'peak MiB':>9}")
    outs: dict[str, torch.Tensor] = {}
    for i, n in enumerate(args.product_sizes):
        for label, backend, tf32 in variants + ([("keops", "keops", False)] if args.keops else []):
            row = {"backend": label, "n": n, "dtype": args.product_dtype, "tf32": tf32,
                   "columns": args.product_columns}
            skip = bench.projected_skip("product", "synthetic3d", label, n, 2, args.repeats + 1)
            if backend == "triton" and not skip:
                try:
                    select_backend(device, "triton")
                except ValueError as err:
                    skip = f"skipped ({err})"
            if backend == "keops" and not skip:
                skip = keops_missing()
            if skip:
                row.update(status="skipped", error=skip)
            elif backend == "keops":
                row.update(run_child({"task": "product", "n": n, "dtype": args.product_dtype, "device": str(device),
                                      "seed": args.seed, "repeats": args.repeats, "ref": i == 0,
                                      "columns": args.product_columns},
                                     timeout=3 * args.max_seconds + 600))
            else:
                row.update(guarded(lambda: product_run(backend, n, dtype, device, args.seed, args.repeats, tf32,
                                                       keep=i == 0, columns=args.product_columns), device))
                out = row.pop("_out", None)
                if out is not None:
                    if label == "torch":
                        outs["torch"] = out
                    elif "torch" in outs:
                        row["rel_error_vs_torch"] = rel_error(out, outs["torch"])
                    del out
            bench.add("products", row, ("product", "synthetic3d", label))
            print(f"{label:>12} {n:>8} {row['status']:>16} {fmt(row.get('time_s'), '9.4f')} "
                  f"{fmt(row.get('entries_per_s'), '10.3g')} {fmt(row.get('rel_error_vs_torch'), '9.1e')} "
                  f"{fmt(row.get('peak_mem_mib'), '9.0f')}" + note(row), flush=True)
        outs.clear()  # only the smallest size is compared
        cleanup(device)


# -- part 2: one MLL value + gradient -------------------------------------------------------------------------
def make_model(X, y, hypers: dict | None, keops: bool = False, mean: str = "zero") -> ExactGPModel:
    """ScaleKernel(Matérn-3/2) with a Gaussian likelihood at ``hypers`` (``None``: GPyTorch's initialisation)."""
    if keops:
        kernel: Any = gpytorch.kernels.ScaleKernel(gpytorch.kernels.keops.MaternKernel(nu=1.5))
    else:
        kernel = "matern32"
    if hypers is None:
        lik = gpytorch.likelihoods.GaussianLikelihood()
    else:
        lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(1e-6))
    model = ExactGPModel(X, y, lik, kernel=kernel, mean=mean).to(X)
    return model if hypers is None else load_hypers(model, hypers)


def load_hypers(model, hypers: dict):
    """``model`` (ScaleKernel ``covar_module``, Gaussian likelihood) with ``hypers`` loaded."""
    model.covar_module.base_kernel.lengthscale = hypers["lengthscale"]
    model.covar_module.outputscale = hypers["outputscale"]
    model.likelihood.noise = hypers["noise"]
    return model


def gpnys_settings(args, prune0: bool, floor10: bool = False) -> EstimatorSettings:
    """The gpnys rows' settings: ``prune0`` computes every pair (no cutoff); ``floor10`` keeps the fixed floor of 10
    Lanczos steps (``lanczos_share=None``: the estimator before commit 16cf2ec, a same-run baseline)."""
    return EstimatorSettings(kernel_backend=args.gpnys_backend, kernel_prune_tol=0.0 if prune0 else None,
                             lanczos_share=None if floor10 else EstimatorSettings.lanczos_share,
                             grow_landmarks=args.grow_landmarks or None)


def mll_eval(X, y, method: str, hypers: dict, seed: int, settings: EstimatorSettings | None = None,
             options: dict | None = None) -> dict:
    """``-MLL/n`` and its raw-parameter gradient by ``method``; synchronised time and peak memory. ``options``: the
    gpnys rows' preconditioner options (e.g. ``{"k": 1000}``)."""
    device, n = X.device, X.shape[0]
    if method in REFERENCES:
        X, y = X.double(), y.double()
    model = make_model(X, y, hypers, keops=method == "gpytorch_keops")
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    torch.manual_seed(seed)
    extra: dict[str, Any] = {}
    hook_box: list = []
    if method == "gpytorch_cholesky":
        ctx: Any = gpytorch.settings.max_cholesky_size(n + 1)
    elif method in ("gpytorch_cg", "gpytorch_keops"):
        ctx = gpytorch.settings.max_cholesky_size(0)
    elif method == "cholesky_closed":
        ctx = contextlib.nullcontext()
    else:
        ctx = use_preconditioner(model, "auto", settings=settings, seed=seed, **(options or {}))

    def run():
        with ctx as hook:
            hook_box.append(hook)
            loss = cholesky_loss(model) if method == "cholesky_closed" else -mll(model(X), y)
            loss.backward()
        return loss

    reset_peak(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        elapsed, loss = timed(run, device)
    peak = peak_mib(device)
    if method.startswith("gpnys"):
        hook = hook_box[0]
        rec = hook.history[-1] if hook.history else None  # None on auto's Cholesky path (gpnys.gp.path)
        s = settings or EstimatorSettings()
        kc = hook.kernels.cache  # the training kernel operator's: the dense K, or the on-the-fly path's plan
        extra = {"path": hook.path, "precond": rec and rec.kind, "rank": rec and rec.rank,
                 "setup_s": rec and rec.setup_s, "cg_iterations": hook.applications,
                 "kernel_fraction": hook.kernel_fraction,
                 "backend": select_backend(device, s.kernel_backend),
                 "kernel_storage": "dense" if kc.get("K") is not None else "on-the-fly" if "plan_key" in kc else None}
        if extra["backend"] == "triton":
            extra["triton_fallback"] = triton_failed(device, X.dtype)
    msgs = sorted({f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught})
    if msgs:
        extra["warnings"] = msgs

    def g(p: torch.Tensor) -> float | list[float]:
        v = p.grad.detach().reshape(-1)
        return v.tolist() if v.numel() > 1 else float(v)

    grad = {"raw_lengthscale": g(model.covar_module.base_kernel.raw_lengthscale),
            "raw_outputscale": g(model.covar_module.raw_outputscale),
            "raw_noise": g(model.likelihood.noise_covar.raw_noise)}
    return {"n": n, "loss": float(loss.detach()), "grad": grad, "time_s": elapsed, "peak_mem_mib": peak,
            "extra": extra}


def memory_skip(method: str, n: int, itemsize: int, device: torch.device) -> str | None:
    """``skipped (memory)`` text for the dense methods whose estimate exceeds the free memory, else ``None``."""
    need = {"gpytorch_cholesky": 3 * n * n * 8, "cholesky_closed": 4 * n * n * 8}.get(method)
    if need is None and method == "gpytorch_cg" and device.type != "cuda":
        need = n * n * itemsize  # one dense kernel; on CUDA the allocation just fails (OOM), on a CPU it may swap
    if need is None:
        return None
    free = free_bytes(device)
    if need > free:
        return f"skipped (memory): needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


class Warmups:
    """Untimed first calls (Triton / cuBLAS / KeOps start-up) once per (data, method, dtype, on-the-fly)."""

    def __init__(self, args):
        self.args, self.done = args, set()

    def __call__(self, data: str, X, y, method: str, settings: EstimatorSettings | None) -> None:
        n = X.shape[0]
        on_the_fly = method.startswith("gpnys") and not caches_dense(
            n, X.element_size(), True, settings.dense_limit_bytes if settings else None, X.device)
        key = (data, method, X.dtype, on_the_fly)
        if key in self.done or method == "gpytorch_keops":
            return
        self.done.add(key)
        # sizes congruent to n mod 1024: Triton specialises on n % 16 and (n / 64) % 16, so these compile the very
        # variants the timed call runs
        w = min(n, self.args.warmup_n + n % 1024)
        if on_the_fly:  # exercise the recomputed path (and its Triton kernels) at the small size too
            settings = dataclasses.replace(settings or EstimatorSettings(), dense_limit_bytes=0)
        guarded(lambda: mll_eval(X[:w], y[:w], method, self.args.hypers, self.args.seed, settings), X.device)
        if method.startswith("gpnys") and n > w:
            # and the block-sparse kernels: a cutoff plan needs more points than a cube of a few length-scales
            w2 = min(n, 5 * self.args.warmup_n + n % 1024)
            s2 = dataclasses.replace(settings or EstimatorSettings(), dense_limit_bytes=0)
            guarded(lambda: mll_eval(X[:w2], y[:w2], method, self.args.hypers, self.args.seed, s2), X.device)


def mll_points(args) -> list[tuple[str, int | None]]:
    return [(args.real_data, n) for n in args.real_sizes] + [("synthetic3d", n) for n in args.synthetic_sizes]


def part_mll(args, bench) -> None:
    device, dtype = args.device, DTYPES[args.dtype]
    h = args.hypers
    bench.header("mll", f"-MLL/n + gradient, ScaleKernel(Matern-3/2), l = {h['lengthscale']}, outputscale "
                 f"{h['outputscale']}, noise {h['noise']}, {args.dtype} (Cholesky float64)",
                 f"{'data':>11} {'n':>8} {'method':>17} {'status':>16} {'time s':>8} {'peak MiB':>9} {'loss':>12} "
                 f"{'|dloss|':>8} {'max dgrad':>9} {'CG it':>5} {'entries':>7}")
    warm = Warmups(args)
    for data, n_req in mll_points(args):
        rows: list[dict] = []
        try:
            X, y = load_data(data, n_req, dtype, device, args.seed)
        except Exception as err:  # noqa: BLE001
            bench.add("mll", {"data": data, "n": n_req, "method": "data", "status": classify(err),
                              "error": f"{type(err).__name__}: {err}"})
            print(f"{data:>11} {str(n_req):>8} loading failed: {err}", flush=True)
            continue
        n = X.shape[0]
        methods = ["gpytorch_cholesky", "cholesky_closed"] + ([f"gpnys_k{k}" for k in args.afn_ks] or ["gpnys"])
        methods += ["gpnys_prune0", "gpnys_prune0_floor10"] if data == "synthetic3d" else []
        methods += ["gpytorch_cg"] + (["gpytorch_keops"] if args.keops else [])
        methods = [m for m in methods if not args.mll_methods or re.sub(r"_k\d+$", "", m) in args.mll_methods]
        ref = None
        for method in methods:
            settings = (gpnys_settings(args, method.startswith("gpnys_prune0"), method.endswith("floor10"))
                        if method.startswith("gpnys") else None)
            row: dict[str, Any] = {"data": data, "n": n, "d": X.shape[1], "method": method,
                                   "dtype": "float64" if method in REFERENCES else args.dtype}
            cutoff = method.startswith("gpnys") and not method.startswith("gpnys_prune0")
            # auto's AFN branch with k landmarks, Algorithm 5's switch left at its default (what growth does): k as
            # the switch would hand a kernel of estimated rank below k to a Nystrom factor of that rank
            options = {"afn_k": int(method.split("_k")[1])} if method.startswith("gpnys_k") else None
            exponent = 1 if cutoff and data == "synthetic3d" else 2
            skip = memory_skip(method, n, X.element_size(), device) or bench.projected_skip(
                "mll", data, method, n, exponent, 1) or (keops_missing() if method == "gpytorch_keops" else None)
            if skip:
                row.update(status="skipped", error=skip)
            elif method == "gpytorch_keops":
                row.update(run_child({"task": "mll", "data": data, "n": n_req, "dtype": args.dtype,
                                      "device": str(device), "seed": args.seed, "hypers": h,
                                      "warmup_n": args.warmup_n},
                                     timeout=3 * args.max_seconds + 600))
            else:
                warm(data, X, y, method, settings)
                row.update(guarded(functools.partial(mll_eval, X, y, method, h, args.seed, settings, options), device))
            if row["status"] == "ok" and ref is None and method in REFERENCES:
                ref = row
            if ref is not None and row["status"] == "ok" and row is not ref:
                errs = grad_errors(row["grad"], ref["grad"])
                row.update(reference=ref["method"], loss_abs_error=abs(row["loss"] - ref["loss"]),
                           loss_rel_error=abs(row["loss"] - ref["loss"]) / abs(ref["loss"]), grad_rel_error=errs,
                           grad_max_rel_error=max(errs.values()))
            rows.append(row)
            bench.add("mll", row, ("mll", data, method))
            ex = row.get("extra", {})
            frac = ex.get("kernel_fraction")
            print(f"{data:>11} {n:>8} {method:>17} {row['status']:>16} {fmt(row.get('time_s'), '8.2f')} "
                  f"{fmt(row.get('peak_mem_mib'), '9.0f')} {fmt(row.get('loss'), '12.7f')} "
                  f"{fmt(row.get('loss_abs_error'), '8.1e')} {fmt(row.get('grad_max_rel_error'), '9.2%')} "
                  f"{fmt(ex.get('cg_iterations'), '5d')} {fmt(frac, '7.1%')}" + note(row), flush=True)
        del X, y
        cleanup(device)


# -- part 3: a short fit --------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def _step_info(hook: Any) -> dict | None:
    """The latest step's diagnostics from a gpnys hook (``None`` for the other methods): CG iterations and probes of
    its last MLL estimate, and the preconditioner of its last build (choice, rank, seconds)."""
    if hook is None:
        return None
    est, rec = hook.last_estimate, (hook.history[-1] if hook.history else None)
    return {"cg_iterations": None if est is None else est.cg_iterations,
            "probes": None if est is None else est.probes, "builds": hook.builds,
            "precond": None if rec is None else rec.kind, "rank": None if rec is None else rec.rank,
            "build_s": None if rec is None else rec.setup_s, "kernel_fraction": hook.kernel_fraction}


def fit_run(data: str, n_req: int | None, method: str, steps: int, args, bench, row: dict,
            max_seconds: float | None, checkpoint: str | None = None) -> dict:
    """``steps`` Adam steps; fills ``row`` as it goes (saved after every step). With ``checkpoint`` (a file),
    a run stopped by a time limit resumes there: the traces and the clock continue from the last saved step."""
    device = args.device
    dtype = torch.float64 if method == "cholesky" else DTYPES[args.dtype]
    X, y = load_data(data, n_req, dtype, device, args.seed)
    n = X.shape[0]
    row.update(n=n, dtype=str(dtype).replace("torch.", ""), steps=steps, loss_trace=[], time_trace=[])
    if checkpoint and os.path.exists(checkpoint):  # (fit restores the model; only the step clock is read here)
        done = read_checkpoint(checkpoint)
        row.update(loss_trace=list(done["loss_trace"]), time_trace=[s["t_s"] for s in done["steps"]],
                   step_info=[s.get("info") for s in done["steps"]], resumed_at_step=len(done["loss_trace"]))
    model = make_model(X, y, None, mean="constant")
    cache: dict = {}
    loss_fn = (lambda m: cholesky_loss(m, cache)) if method == "cholesky" else None
    if method == "gpnys":
        ctx: Any = use_preconditioner(model, "auto", settings=gpnys_settings(args, False), seed=args.seed)
        settings: Any = lambda _n: contextlib.nullcontext()  # noqa: E731
    elif method == "gpytorch_cg":
        ctx, settings = contextlib.nullcontext(), lambda _n: gpytorch.settings.max_cholesky_size(0)
    else:
        ctx, settings = contextlib.nullcontext(), None  # gpnys.gp.training.fit's Cholesky settings
    start, hook = [0.0], [None]

    def on_step(t: int, loss: float) -> dict:
        sync(device)  # (``fit`` already read the loss back, which waits for the step)
        row["time_trace"].append(time.perf_counter() - start[0])
        row["loss_trace"].append(loss)
        info = _step_info(hook[0])  # what the step cost: CG iterations, probes, the preconditioner built
        row.setdefault("step_info", []).append(info)
        bench.save()
        if t == 0:
            eta = row["time_trace"][0] * steps
            row["eta_after_step1_s"] = eta
            print(f"    {method} {data} n = {n}: step 1 took {row['time_trace'][0]:.2f} s, ETA {eta:.0f} s "
                  f"for {steps} steps", flush=True)
            if max_seconds is not None and eta > max_seconds and steps > 1:
                raise _Stop(f"stopped after step 1: ETA {eta:.0f} s > {max_seconds:.0f} s (--fit-max-seconds)")
        if checkpoint and t % 5 == 4:
            print(f"    step {t + 1}: {row['time_trace'][-1]:.1f} s, loss {loss:.5f}", flush=True)
        return {"t_s": row["time_trace"][-1], "info": info}  # kept in the checkpoint

    reset_peak(device)
    with ctx as hook[0]:
        sync(device)
        start[0] = time.perf_counter() - (row["time_trace"][-1] if row["time_trace"] else 0.0)
        try:
            fit(model, iters=steps, lr=args.lr, progress=False, seed=args.seed, settings=settings, on_step=on_step,
                loss=loss_fn, checkpoint=checkpoint)
            status, err = "ok", None
        except _Stop as stop:
            status, err = "stopped", str(stop)
    wall = row["time_trace"][-1] if row["time_trace"] else None
    out = {"status": status, "wall_s": wall, "steps_done": len(row["loss_trace"]),
           "s_per_step": wall / len(row["time_trace"]) if wall else None,
           "final_loss": row["loss_trace"][-1] if row["loss_trace"] else None,
           "hyperparameters": hyperparameters(model), "peak_mem_mib": peak_mib(device)}
    if err:
        out["error"] = err
    return out


def part_fit(args, bench) -> None:
    bench.header("fit", f"Adam lr {args.lr}, GPyTorch's initialisation, constant mean, {args.dtype} "
                 "(Cholesky float64, closed-form gradient)",
                 f"{'data':>11} {'n':>8} {'method':>12} {'status':>16} {'steps':>5} {'wall s':>8} {'s/step':>7} "
                 f"{'final loss':>11} {'lengthscale':>11} {'outputsc':>8} {'noise':>8}")
    points = [(args.real_data, n, args.fit_steps) for n in args.real_sizes]
    points += [("synthetic3d", n, args.fit_steps) for n in args.fit_synthetic_sizes]
    if args.fit_1e6:
        points.append(("synthetic3d", args.fit_1e6_n, args.fit_1e6_steps))
    warm = Warmups(args)
    with contextlib.suppress(Exception):  # untimed: the first optimiser step imports and initialises (~1 s)
        Xw, yw = load_data(args.real_data, 64, DTYPES[args.dtype], args.device, args.seed)
        fit(make_model(Xw, yw, None, mean="constant"), iters=1, progress=False)
    for data, n_req, steps in points:
        big = args.fit_1e6 and n_req == args.fit_1e6_n and steps == args.fit_1e6_steps
        for method in (["gpnys"] if big else ["gpnys", "gpytorch_cg", "cholesky"]):
            row: dict[str, Any] = {"data": data, "n": n_req, "method": method, "status": "running"}
            bench.add("fit", row)
            itemsize = DTYPES[args.dtype].itemsize
            n_est = n_req or 0
            if n_req is None:
                with contextlib.suppress(Exception):
                    n_est = datasets.load(data, standardize=False).train_x.shape[0]
            skip = memory_skip({"cholesky": "cholesky_closed"}.get(method, method), n_est, itemsize, args.device)
            skip = skip or (None if big else bench.projected_skip("fit", data, method, n_est,
                                                                 1 if method == "gpnys" else 2, 1))
            if skip:
                row.update(status="skipped", error=skip)
            else:
                if method == "gpnys":  # compile / start-up outside the timed steps
                    Xw, yw = load_data(data, min(n_est, args.warmup_n) if n_est else args.warmup_n,
                                       DTYPES[args.dtype], args.device, args.seed)
                    settings = gpnys_settings(args, False)
                    if not caches_dense(n_est, itemsize, True, None, args.device):
                        settings = dataclasses.replace(settings, dense_limit_bytes=0)
                    warm(data, Xw, yw, "gpnys", settings)
                    del Xw, yw
                row.update(guarded(lambda: fit_run(data, n_req, method, steps, args, bench, row,
                                                   None if big else args.fit_max_seconds,
                                                   args.fit_checkpoint if big else None), args.device))
            if row.get("status") == "ok":
                bench.record_time(("fit", data, method), row["n"], row["wall_s"])
            bench.save()
            hp = row.get("hyperparameters", {})
            print(f"{data:>11} {str(row['n']):>8} {method:>12} {row['status']:>16} {row.get('steps_done', 0):>5} "
                  f"{fmt(row.get('wall_s'), '8.2f')} {fmt(row.get('s_per_step'), '7.2f')} "
                  f"{fmt(row.get('final_loss'), '11.6f')} {fmt(hp.get('lengthscale'), '11.4g')} "
                  f"{fmt(hp.get('outputscale'), '8.4g')} {fmt(hp.get('noise'), '8.4g')}" + note(row), flush=True)
            cleanup(args.device)


# -- part 4: every other public path at one size --------------------------------------------------------------
PATH_PRECONDS = {"afn": {"k": 500, "w": 30}, "nystrom": {"rank": 500}, "fsai": {"w": 30}, "pivchol": {"rank": 500},
                 "auto": GP_DEFAULTS["auto"]}
PATH_COMMON = {"path", "n", "dtype", "status", "time_s", "wall_s", "peak_mem_mib", "finite", "error"}


def all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def predictive(mean: torch.Tensor, var: torch.Tensor) -> dict:
    return {"m": mean.numel(), "finite": all_finite(mean, var), "positive_variance": bool((var > 0).all())}


def path_row(fn: Callable[[], dict], device: torch.device) -> dict:
    """``fn()`` (a record) timed (synchronised) with its peak memory and distinct warnings: ``wall_s`` is the whole
    call, ``time_s`` the record's own where it timed its core call itself; a record with ``finite`` false has
    status ``not finite``."""
    def go() -> dict:
        reset_peak(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wall, rec = timed(fn, device)
        rec.setdefault("time_s", wall)
        rec.update(wall_s=wall, peak_mem_mib=peak_mib(device))
        msgs = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
        if msgs:
            rec["warnings"] = msgs[:8]
        if rec.get("finite") is False:
            rec.setdefault("status", "not finite")
        return rec

    return guarded(go, device)


def path_runs(X, y, T, args) -> dict[str, Callable[[], dict]]:
    """One callable per path (a record each) on the training points ``X, y`` and test points ``T``."""
    n, device, h, seed = X.shape[0], X.device, args.hypers, args.seed
    base, mu = unit_matern(X, h["lengthscale"]), h["noise"] / h["outputscale"]
    settings = gpnys_settings(args, False)

    def landmarks() -> dict:
        r = fps(X, min(500, n))
        return {"k": r.indices.numel(), "finite": all_finite(r.fill_distances),
                "fill_distance": float(r.fill_distances[-1])}

    def knn() -> dict:
        idx, valid = causal_knn(X, min(30, n))
        return {"w": idx.shape[1], "finite": bool(torch.equal(idx[:, -1], torch.arange(n, device=device))),
                "valid_share": float(valid.float().mean())}

    def cutoff_plan() -> dict:
        op = unit_operator(X, base, backend=args.gpnys_backend)
        plan = op.plan()
        return {"backend": op.backend.name, "fraction": None if plan is None else plan.fraction,
                "finite": plan is None or 0 < plan.fraction <= 1}

    def precond(name: str) -> Callable[[], dict]:
        def build() -> dict:
            P = make_preconditioner(name, X, base, mu, cache=PointCache(X), seed=seed, **PATH_PRECONDS[name])
            return {"rank": int(P.rank), "choice": getattr(P, "choice", name), "finite": all_finite(P.logdet())}
        return build

    def solve() -> dict:
        model = make_model(X, y, h)
        with use_preconditioner(model, "auto", settings=settings, seed=seed) as hook:
            A, M = hook.system(X)
            b = y[:, None]
            t, res = timed(lambda: pcg(A, b, precond=M, x0=M(b), tol=1e-5), device)
            rel = float((A(res.x) - b).norm() / b.norm())
        return {"time_s": t, "precond": hook.history[-1].kind if hook.history else None,
                "rank": hook.history[-1].rank if hook.history else None,
                "iterations": res.iterations, "rel_residual": rel, "finite": math.isfinite(rel)}

    def hook_mll() -> dict:
        rec = mll_eval(X, y, "gpnys", h, seed, settings)
        grads = [v for g in rec["grad"].values() for v in (g if isinstance(g, list) else [g])]
        return {**rec, "finite": all(map(math.isfinite, [rec["loss"], *grads])), "precond": rec["extra"]["precond"],
                "cg_iterations": rec["extra"]["cg_iterations"]}

    def predict() -> dict:
        model = make_model(X, y, h)
        with use_preconditioner(model, "auto", settings=settings, seed=seed) as hook:
            mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
            with torch.no_grad():
                mll_s, _ = timed(lambda: mll(model(X), y), device)  # training evaluation: the hook's kernel operator
            t, (mean, var) = timed(lambda: hook.predict(T, variance=True), device)
        return {"time_s": t, "mll_s": mll_s, "variance_method": hook.variance_method_used,
                "variance_iterations": hook.variance_iterations, **predictive(mean, var)}

    def reduced() -> dict:
        model = ReducedGP.from_exact(make_model(X, y, h), method="lla", m=min(1000, n)).eval()
        dist = model(T)
        return {"method": "lla", "landmarks": min(1000, n), **predictive(dist.mean, dist.variance)}

    def bo() -> dict:
        if importlib.util.find_spec("botorch") is None:
            return {"status": "skipped (botorch is not installed)"}
        from gpnys.bo import PreconditionedSingleTaskGP  # (importing BoTorch changes GPyTorch's global defaults)

        covar = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5))
        model = PreconditionedSingleTaskGP(X, y[:, None], covar_module=covar, outcome_transform=None,
                                           max_cholesky_size=0, posterior_cholesky_size=0, seed=seed)  # the PCG path
        load_hypers(model, h)
        model.mean_module.constant = 0.0
        model.eval()
        with torch.no_grad():
            post = model.posterior(T[:args.paths_q])
            mean, var = post.mean, post.variance
        return {"preconditioned": model.uses_preconditioner(), "precond": model.hook().history[-1].kind,
                "posterior_iterations": model.posterior_iterations, **predictive(mean, var)}

    def cli() -> dict:
        cmd = [sys.executable, "-m", "gpnys.cli.main", "mll", "--data", "synthetic3d", "--no-standardize", "--n",
               str(n), "--device", str(device), "--dtype", str(X.dtype).replace("torch.", ""), "--method", "auto",
               "--seed", str(seed)] + [f"--{k}={v}" for k, v in h.items()]
        cmd += ["--kernel-backend", args.gpnys_backend] if args.gpnys_backend else []
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * args.max_seconds + 600)
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        loss = re.search(r"loss (\S+)", last)
        rec = {"exit_code": proc.returncode, "last_line": last,
               "finite": proc.returncode == 0 and loss is not None and math.isfinite(float(loss.group(1)))}
        if proc.returncode:
            rec.update(status="error", error=f"exit code {proc.returncode}: {proc.stderr[-1500:]}")
        return rec

    return {"fps": landmarks, "knn": knn, "cutoff_plan": cutoff_plan,
            **{name: precond(name) for name in PATH_PRECONDS},
            "pcg": solve, "hook_mll": hook_mll, "predict": predict, "reduced": reduced, "botorch": bo, "cli": cli}


def part_paths(args, bench) -> None:
    device, n_req = args.device, args.paths_n
    h = args.hypers
    bench.header("paths", f"every other public path on synthetic3d, n = {n_req}, ScaleKernel(Matern-3/2), l = "
                 f"{h['lengthscale']}, outputscale {h['outputscale']}, noise {h['noise']}, {args.dtype}, "
                 f"{args.paths_test} test points",
                 f"{'path':>11} {'n':>8} {'status':>16} {'time s':>8} {'wall s':>8} {'peak MiB':>9} {'finite':>6}  "
                 "details")
    try:
        ds = datasets.load("synthetic3d", n=n_req, seed=args.seed, standardize=False, dtype=DTYPES[args.dtype],
                           device=device, n_test=args.paths_test)
    except Exception as err:  # noqa: BLE001
        bench.add("paths", {"path": "data", "n": n_req, "status": classify(err),
                            "error": f"{type(err).__name__}: {err}"})
        print(f"{'data':>11} {n_req:>8} loading failed: {err}", flush=True)
        return
    X, y, T = ds.train_x, ds.train_y, ds.test_x
    n = X.shape[0]
    Warmups(args)("synthetic3d", X, y, "gpnys", gpnys_settings(args, False))  # untimed: Triton compilation
    for name, fn in path_runs(X, y, T, args).items():
        row: dict[str, Any] = {"path": name, "n": n, "dtype": args.dtype}
        skip = bench.projected_skip("paths", "synthetic3d", name, n, 1, 1)
        row.update({"status": "skipped", "error": skip} if skip else path_row(fn, device))
        bench.add("paths", row)
        details = ", ".join(f"{k} {format(v, '.3g') if isinstance(v, float) else str(v)[:90]}"
                            for k, v in row.items() if k not in PATH_COMMON and not isinstance(v, (dict, list)))
        print(f"{name:>11} {n:>8} {row['status']:>16} {fmt(row.get('time_s'), '8.3f')} "
              f"{fmt(row.get('wall_s'), '8.3f')} {fmt(row.get('peak_mem_mib'), '9.0f')} "
              f"{str(row.get('finite', '-')):>6}  {details}" + note(row), flush=True)
        cleanup(device)


# -- bookkeeping ----------------------------------------------------------------------------------------------
def fmt(v: Any, spec: str) -> str:
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return f"{'-':>{width}}"
    return format(v, spec)


def note(row: dict) -> str:
    return f"  [{row['error'][:160]}]" if row.get("error") else ""


class Bench:
    """Rows of every part, the JSON written after each row, and the projected-time guard."""

    def __init__(self, args, meta: dict, record: dict):
        self.args, self.out = args, args.out
        self.res: dict[str, Any] = {"meta": meta, "provenance": record, "products": [], "mll": [], "fit": [],
                                    "paths": []}
        self.times: dict[tuple, tuple[int, float]] = {}
        self.start = time.perf_counter()

    def header(self, part: str, title: str, cols: str) -> None:
        print(f"\n== {part}: {title}\n{cols}", flush=True)

    def add(self, part: str, row: dict, key: tuple | None = None) -> None:
        if not any(r is row for r in self.res[part]):
            self.res[part].append(row)
        if key is not None and row.get("status") == "ok" and row.get("time_s") is not None:
            self.record_time(key, row["n"], row["time_s"])
        self.save()

    def record_time(self, key: tuple, n: int, t: float) -> None:
        self.times[key] = (n, t)

    def projected_skip(self, part: str, data: str, method: str, n: int, exponent: float, calls: int) -> str | None:
        spent = time.perf_counter() - self.start
        if spent > self.args.budget_s:
            return f"skipped (the run has taken {spent:.0f} s > --budget-s {self.args.budget_s:g})"
        prev = self.times.get((part, data, method))
        if prev is None or not n or prev[0] >= n:
            return None
        proj = prev[1] * (n / prev[0]) ** exponent * calls
        if proj > self.args.max_seconds:
            return f"skipped (projected {proj:.3g} s from n = {prev[0]} > --max-seconds {self.args.max_seconds:g})"
        return None

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.res, indent=1, default=str))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    a0, a1, a2 = axes
    methods = list(dict.fromkeys(r["method"] for part in ("mll", "fit") for r in res[part]))
    color = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for label in dict.fromkeys(r["backend"] for r in res["products"]):
        pts = [(r["n"], r["entries_per_s"]) for r in res["products"]
               if r["backend"] == label and r.get("entries_per_s")]
        if pts:
            a0.loglog(*zip(*pts), "o-", label=label)
    a0.set(xlabel="n", ylabel="kernel entries / s (one K V, 32 columns)", title="product throughput")
    for ax, part, key in ((a1, "mll", "time_s"), (a2, "fit", "wall_s")):
        for (data, method) in dict.fromkeys((r["data"], r["method"]) for r in res[part]):
            pts = [(r["n"], r[key]) for r in res[part] if (r["data"], r["method"]) == (data, method)
                   and r.get("status") == "ok"]
            if pts:
                ax.loglog(*zip(*pts), "o-" if data == "synthetic3d" else "s--", color=color[method],
                          label=f"{method} ({data})")
    a1.set(xlabel="n", ylabel="time of one -MLL/n + gradient (s)", title="MLL value + gradient")
    a2.set(xlabel="n", ylabel="fit wall time (s)", title="short Adam fit")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(res["provenance"]["device_name"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sizes(text: str) -> list[int | None]:
    """``"10000,25000,all"`` -> ``[10000, 25000, None]`` (``all``: the whole training split)."""
    return [None if v.strip() == "all" else int(float(v)) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        child_main(json.loads(argv[1]))
        return {}
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU-sized smoke run (the test suite's)")
    ap.add_argument("--parts", default="product,mll,fit")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="MLL / fit dtype (default float32; quick "
                    "float64); the Cholesky references are float64")
    ap.add_argument("--product-dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--product-columns", type=int, default=PRODUCT_COLUMNS,
                    help="columns of V in the product part (17: CG with 16 probes)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; quick 1: small problems stall on busy cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None, help="timed product repeats after a warm-up (3; quick 1)")
    ap.add_argument("--warmup-n", type=int, default=None,
                    help=f"points of the untimed MLL warm-ups (default {WARMUP_N}; quick 128)")
    ap.add_argument("--product-sizes", default=None, help="default 10000,50000,200000,1000000 (quick 300,600)")
    ap.add_argument("--real-data", default="kin40k")
    ap.add_argument("--real-sizes", default=None, help="default 10000,25000,all (quick 300); 'all' = whole split")
    ap.add_argument("--synthetic-sizes", default=None, help="MLL synthetic3d sizes (default 200000,1000000; quick 500)")
    ap.add_argument("--mll-methods", default="", help="mll part: only these methods (comma-separated: gpnys, "
                    "gpnys_prune0, gpnys_prune0_floor10, gpytorch_cholesky, cholesky_closed, gpytorch_cg); default all")
    ap.add_argument("--afn-ks", default="", help="mll part: one gpnys row per landmark count k of auto's AFN branch "
                    "(afn_k; e.g. 500,1000,2000: rows gpnys_k500, ...) instead of the hook's default")
    ap.add_argument("--fit-synthetic-sizes", default=None, help="fit synthetic3d sizes (default 200000; quick none)")
    ap.add_argument("--lengthscale", type=float, default=1.0)
    ap.add_argument("--outputscale", type=float, default=1.0)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--gpnys-backend", default=None, choices=["torch", "triton", "keops"],
                    help="gpnys's kernel backend (default: its own choice, Triton on CUDA)")
    ap.add_argument("--keops", action="store_true", help="also KeOps rows, each in a child process")
    ap.add_argument("--dense-gib", type=float, default=None,
                    help="the dense kernel cache's budget in GiB for every row (0: every kernel recomputed on the fly; "
                         "default: the device's, gpnys.budget)")
    ap.add_argument("--grow-landmarks", type=int, default=EstimatorSettings.grow_landmarks,
                    help="gpnys rows: CG iterations at which AFN's landmarks double (0: never; docs/training.md)")
    ap.add_argument("--fit-steps", type=int, default=None, help="Adam steps (default 20; quick 3)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--fit-1e6", action="store_true", help="also the gpnys fit on synthetic3d n = 1e6")
    ap.add_argument("--fit-1e6-steps", type=int, default=50)
    ap.add_argument("--fit-1e6-n", type=int, default=1_000_000, help="its size (a small one tests the checkpoints)")
    ap.add_argument("--fit-checkpoint", default=None,
                    help="the 1e6 fit's checkpoint file: saved after every step; a rerun resumes from it")
    ap.add_argument("--fit-max-seconds", type=float, default=600.0,
                    help="stop a fit (not the 1e6 one) whose ETA after step 1 exceeds this")
    ap.add_argument("--max-seconds", type=float, default=600.0,
                    help="skip a measurement whose time projected from the previous size exceeds this")
    ap.add_argument("--budget-s", type=float, default=1800.0,
                    help="skip every measurement (but the --fit-1e6 fit) that would start after this many seconds")
    ap.add_argument("--paths-n", type=int, default=None, help="paths part: synthetic3d points (default 1e6; quick 600)")
    ap.add_argument("--paths-test", type=int, default=None, help="paths part: test points (default 2000; quick 50)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu[_quick].json)")
    ap.add_argument("--png", default=None, help="PNG path (default: the JSON's with .png)")
    args = ap.parse_args(argv)
    q = args.quick
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if q and args.device.type == "cpu" and "gpnys.kernels.backends.triton_kernels" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (in-process callers: before the kernels are imported)
    args.dtype = args.dtype or ("float64" if q else "float32")
    args.repeats = args.repeats or (1 if q else 3)
    if args.product_columns < 1:
        ap.error("--product-columns must be positive")
    args.warmup_n = args.warmup_n or (128 if q else WARMUP_N)
    args.threads = args.threads or (1 if q else None)
    args.product_sizes = sizes(args.product_sizes or ("300,600" if q else "10000,50000,200000,1000000"))
    args.real_sizes = sizes(args.real_sizes if args.real_sizes is not None else ("300" if q else "10000,25000,all"))
    args.synthetic_sizes = sizes(args.synthetic_sizes if args.synthetic_sizes is not None
                                 else ("500" if q else "200000,1000000"))
    args.fit_synthetic_sizes = sizes(args.fit_synthetic_sizes if args.fit_synthetic_sizes is not None
                                     else ("" if q else "200000"))
    args.fit_steps = args.fit_steps or (3 if q else 20)
    args.paths_n = args.paths_n or (600 if q else 1_000_000)
    args.paths_test = args.paths_test or (50 if q else 2000)
    args.paths_q = 10 if q else 256  # BoTorch posterior batch
    args.mll_methods = [m for m in args.mll_methods.split(",") if m]
    args.afn_ks = sizes(args.afn_ks)
    args.hypers = {"lengthscale": args.lengthscale, "outputscale": args.outputscale, "noise": args.noise}
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - {"product", "mll", "fit", "paths"}:
        ap.error(f"--parts takes product, mll, fit, paths; got {args.parts!r}")
    args.out = Path(args.out) if args.out else RESULTS / ("gpu_quick.json" if q else "gpu.json")
    png = Path(args.png) if args.png else args.out.with_suffix(".png")
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    record = provenance(__file__, argv, dev)
    meta = {"device": str(dev), "quick": q, "parts": parts,
            "dtype": args.dtype, "product_dtype": args.product_dtype, "threads": torch.get_num_threads(),
            "hyperparameters": args.hypers, "seed": args.seed, "repeats": args.repeats, "warmup_n": args.warmup_n,
            "fit_steps": args.fit_steps, "paths_n": args.paths_n, "paths_test": args.paths_test,
            "lr": args.lr, "gpnys_backend": args.gpnys_backend, "grow_landmarks": args.grow_landmarks,
            "dense_gib": args.dense_gib,
            "keops": args.keops,
            "triton_available": triton_available(), "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "max_seconds": args.max_seconds}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        meta.update(cuda_capability=f"{props.major}.{props.minor}", cuda_total_mib=props.total_memory / 2**20)
    bench = Bench(args, meta, record)
    ver = record["versions"]
    print(f"device {dev} ({record['device_name']}), torch {ver['torch']}, triton {ver['triton']}, gpytorch "
          f"{ver['gpytorch']}, {meta['threads']} threads")
    t0 = time.perf_counter()
    budget = (memory_budget(dense_bytes=int(args.dense_gib * 2**30)) if args.dense_gib is not None
              else contextlib.nullcontext())
    try:
        with budget:
            for part, fn in (("product", part_products), ("mll", part_mll), ("fit", part_fit), ("paths", part_paths)):
                if part in parts:
                    fn(args, bench)
    finally:
        torch.set_num_threads(threads)  # (main is also called in-process by the tests)
        from gpnys import launch

        bench.res["meta"].update(total_s=time.perf_counter() - t0, finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                 triton_failed=sorted(str(k) for k in launch._FAILED))
        bench.save()
    plot(bench.res, png)
    print(f"\ntotal {time.perf_counter() - t0:.1f} s; wrote {args.out} and {png}")
    return bench.res


if __name__ == "__main__":
    main()
