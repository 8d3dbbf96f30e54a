"""One HiGP value + gradient of the negative MLL, in the record format of :func:`gpnys.baselines.mll.evaluate`.

HiGP (``pip install higp``, the AFN authors' package) is imported lazily, so gpnys works without it.

Parameterisation (HiGP's C++ sources, ``cpp-src``; checked against the installed 2025.11.3 in exact mode):

* ``gp/nonneg_transform.cpp``: the raw ``(l, f, s)`` go through softplus (``transform 0``, the only one the
  Python setup selects: ``parse_gp_params`` in ``py-interface/higp_cext.c``), ``log(1 + exp(v))``.
* ``dense_kernel_matrix.cpp``: ``K = f^2 * k(X, X; l) + s * I`` (``K[i] = f2 * k_mat[i]``, ``dKdf = 2 * f *
  k_mat``, ``K[ii] += s``, ``dKds = I``), so ``f`` is the square root of GPyTorch's outputscale and ``s`` the
  noise variance itself; ``kernels/{gaussian,matern32,matern52}_kernel.cpp`` use the same ``k(d; l)`` as
  GPyTorch's RBF / Matérn-3/2 / Matérn-5/2 with lengthscale ``l``.
* ``gp/exact_gp.cpp`` and ``gp/precond_gp.cpp``: the loss is the *total* ``-log p(y) = 0.5 (y'K^-1 y +
  log|K| + n log 2 pi)`` (zero mean) and the gradient is of that total with respect to the raw ``(l, f, s)``.
  (``higp.GPRModel.calc_loss_grad`` rescales by ``1/n`` and subtracts ``2 pi``; it is not used here.)

So with GPyTorch's ``lengthscale = softplus(a)``, ``outputscale = softplus(b)``, ``noise = softplus(c) + 1e-6``
(``GreaterThan(1e-6)``, as :func:`gpnys.baselines.mll.evaluate` builds the likelihood), the loss is ``L / n`` and

    dloss/da = G_l / (n sigmoid(l_raw)) * sigmoid(a)
    dloss/db = G_f / (n sigmoid(f_raw)) / (2 sqrt(outputscale)) * sigmoid(b)
    dloss/dc = G_s / (n sigmoid(s_raw)) * sigmoid(c)

where ``G`` is HiGP's gradient and ``l_raw = softplus^-1(lengthscale)``, ``f_raw = softplus^-1(sqrt(outputscale))``,
``s_raw = softplus^-1(noise)``.

Estimator notes (from the same sources): ``afn_lfil = 0`` (HiGP's default) makes ``afn_precond_build`` fall back to
a rank-``afn_rank`` Nyström preconditioner on farthest-point-sampled landmarks; ``afn_lfil > 0`` gives AFN with an
FSAI Schur complement. Both the solve ``K^-1 y`` and the Lanczos quadrature run a fixed ``niter`` PCG steps. The
Rademacher probes are seeded by ``srand(time(NULL))`` inside ``lanquad`` (``precond_gp.cpp``), so ``seed`` cannot
make them reproducible; calls in the same wall-clock second reuse the same probes, which is why
:func:`evaluate_higp` waits for a new second between two iterative calls (outside the timed region).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from gpnys.baselines.mll import NOISE_LOWER_BOUND, validate_inputs

__all__ = ["HIGP_KERNELS", "evaluate_higp"]

#: gpnys kernel name -> HiGP kernel constant name (``higp.GaussianKernel`` = 1, ...)
HIGP_KERNELS = {"rbf": "GaussianKernel", "matern32": "Matern32Kernel", "matern52": "Matern52Kernel"}

_last_probe_second: int | None = None


def _softplus(v: float) -> float:
    return v if v > 20.0 else math.log1p(math.exp(v))


def _inv_softplus(x: float) -> float:
    """GPyTorch's ``inv_softplus``: ``x + log(-expm1(-x))``."""
    return x + math.log(-math.expm1(-x))


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null: HiGP's C code ``printf``s on every setup, call and deallocation.

    Flushes Python's and C's stdio buffers on both sides, so nothing printed here leaks out later (for example
    into ``gpnys mll --json`` output).
    """
    try:
        libc: Any = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - not a POSIX libc
        libc = None

    def flush() -> None:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        if libc is not None:
            libc.fflush(None)

    flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _wait_for_new_second() -> None:
    """Sleep until the wall-clock second differs from the end of the previous iterative HiGP call."""
    if _last_probe_second is None:
        return
    while int(time.time()) <= _last_probe_second:
        time.sleep(max(0.0, _last_probe_second + 1 - time.time()) + 1e-3)


def evaluate_higp(
    X: torch.Tensor,
    y: torch.Tensor,
    kernel: str = "rbf",
    lengthscale: float | torch.Tensor = 1.0,
    outputscale: float = 1.0,
    noise: float = 0.1,
    seed: int = 0,
    rank: int = 50,
    lanczos_steps: int = 10,
    probes: int = 10,
    *,
    lfil: int = 0,
    exact: bool = False,
    nthreads: int | None = None,
    ard: bool = False,
    **kw: Any,
) -> dict[str, Any]:
    """HiGP's ``-MLL / n`` and its gradient with respect to GPyTorch's raw parameters.

    Same inputs and record as :func:`gpnys.baselines.mll.evaluate` (zero mean, ``ScaleKernel`` over an isotropic
    kernel).

    Args:
        X: ``(n, d)`` inputs; y: ``(n,)`` targets. float32 inputs run HiGP in single precision, else double.
        kernel: ``rbf``, ``matern32`` or ``matern52`` (HiGP has no Matérn-1/2 and no ARD: ``ValueError``).
        lengthscale: positive.
        outputscale: positive.
        noise: positive, the total noise variance (GPyTorch's ``likelihood.noise``).
        seed: passed to HiGP's setup (as ``seed + 1``, HiGP ignores seeds <= 0); HiGP's SLQ probes are seeded
            from the wall clock regardless (see the module docstring).
        rank: ``afn_rank`` (HiGP default 50); lanczos_steps: ``niter`` (10), PCG / Lanczos steps for both the
            solve and the log-determinant; probes: ``nvec`` (10) Rademacher vectors.
        lfil: ``afn_lfil`` (HiGP default 0 = Nyström fallback; > 0 = AFN with FSAI fill level ``lfil``).
        exact: HiGP's ``exact_gp`` mode (dense eigendecomposition), for checking the parameter mapping.
        nthreads: HiGP OpenMP threads (default ``torch.get_num_threads()``).
        ard: must be False.
        **kw: further keyword arguments of ``higp.gprproblem.setup`` (e.g. ``mvtype``).

    Returns:
        ``{"method": "higp", "loss", "grad": {"raw_lengthscale", "raw_outputscale", "raw_noise"}, "time_s",
        "extra"}``; ``time_s`` covers only HiGP's loss + gradient call (preconditioner build included).
    """
    global _last_probe_second
    if kernel not in HIGP_KERNELS:
        raise ValueError(f"HiGP supports kernels {sorted(HIGP_KERNELS)} (Gaussian, Matern 3/2, Matern 5/2), "
                         f"got {kernel!r}")
    ls = torch.as_tensor(lengthscale, dtype=torch.float64).reshape(-1)
    if ard or ls.numel() != 1:
        raise ValueError("HiGP supports only an isotropic lengthscale (no ARD)")
    validate_inputs(X, y, ls, outputscale, noise)
    ls_val, os_val, noise_val = float(ls[0]), float(outputscale), float(noise)
    if not noise_val > NOISE_LOWER_BOUND:
        raise ValueError(f"noise must be > {NOISE_LOWER_BOUND}, got {noise_val}")
    for name, val in (("rank", rank), ("lanczos_steps", lanczos_steps), ("probes", probes)):
        if int(val) < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")

    import higp
    import numpy as np

    n = X.shape[0]
    np_dtype = np.float32 if X.dtype == torch.float32 else np.float64
    Xh = np.ascontiguousarray(X.detach().cpu().numpy().astype(np_dtype).T)  # HiGP wants d-by-n, row-major
    yh = np.ascontiguousarray(y.detach().cpu().numpy().astype(np_dtype))
    # HiGP raw parameters (softplus-transformed inside HiGP) and GPyTorch's raw parameters
    l_raw, f_raw, s_raw = _inv_softplus(ls_val), _inv_softplus(math.sqrt(os_val)), _inv_softplus(noise_val)
    a, b, c = _inv_softplus(ls_val), _inv_softplus(os_val), _inv_softplus(noise_val - NOISE_LOWER_BOUND)
    params = np.array([l_raw, f_raw, s_raw], dtype=np_dtype)
    l_raw, f_raw, s_raw = (float(v) for v in params)  # what HiGP sees (rounded in single precision)
    threads = int(nthreads) if nthreads is not None else torch.get_num_threads()

    kernel_type = getattr(higp, HIGP_KERNELS[kernel])
    with _quiet_stdout():
        t0 = time.perf_counter()
        problem = higp.gprproblem.setup(
            data=Xh, label=yh, kernel_type=kernel_type, nthreads=threads, exact_gp=int(bool(exact)),
            afn_rank=int(rank), afn_lfil=int(lfil), niter=int(lanczos_steps), nvec=int(probes), seed=int(seed) + 1,
            **kw,
        )
        setup_s = time.perf_counter() - t0
        if not exact:
            _wait_for_new_second()
        t0 = time.perf_counter()
        total, g = problem.grad(params)
        elapsed = time.perf_counter() - t0
        if not exact:
            _last_probe_second = int(time.time())
        del problem

    g_l, g_f, g_s = (float(v) / n for v in g)
    # chain rule: HiGP raw -> constrained value -> GPyTorch raw (module docstring)
    d_ls = g_l / _sigmoid(l_raw)
    d_os = g_f / _sigmoid(f_raw) / (2.0 * _softplus(f_raw))
    d_noise = g_s / _sigmoid(s_raw)
    grad = {
        "raw_lengthscale": d_ls * _sigmoid(a),
        "raw_outputscale": d_os * _sigmoid(b),
        "raw_noise": d_noise * _sigmoid(c),
    }
    extra = {
        "higp_version": _dist_version(),
        "kernel_type": HIGP_KERNELS[kernel],
        "exact": bool(exact),
        "precond": None if exact else ("nystrom" if int(lfil) <= 0 else "afn"),
        "rank": int(rank),
        "lfil": int(lfil),
        "lanczos_steps": int(lanczos_steps),
        "probes": int(probes),
        "nthreads": threads,
        "dtype": np.dtype(np_dtype).name,
        "setup_s": setup_s,
        "probe_seed": None if exact else "wall clock (HiGP seeds its probes with srand(time(NULL)))",
    }
    return {"method": "higp", "loss": float(total) / n, "grad": grad, "time_s": elapsed, "extra": extra}


def _dist_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("higp")
    except PackageNotFoundError:  # pragma: no cover - importable but not installed as a distribution
        return None
