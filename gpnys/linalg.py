"""Dense linear algebra in the form the CPU runs fastest and most reliably, and the factorisations every layer shares.

Safe Cholesky (:func:`safe_cholesky`): a factor of an SPD matrix that escalates a diagonal shift, with a
:class:`~gpnys.checks.NumericalWarning`, rather than returning NaNs; diagonal shifts (:func:`add_diag`,
:func:`shift_at`) and i.i.d. draws (:func:`draw`) for probes and samples.

Small factorisations (:func:`small_dense`). Eigenvalue, Cholesky and QR factorisations of ``m x m`` matrices with
``m`` up to a few hundred (rank estimation, preconditioner cores, Lanczos tridiagonals) run on one thread: with
several, MKL's threads spin against any other busy process on the machine and can take hundreds of times longer
(benchmarks/small_n.py; the measurements in docs/scaling.md). Alone on the machine one thread costs them little at
these sizes.

Thin products (:func:`thin_matmul`). ``A @ B`` with a large ``A (m, k)`` and a thin ``B (k, t)`` (t ~ 5-64 columns:
the probes of the MLL estimator, the CG block, a q-batch) runs far below memory bandwidth in some of the forms
``A @ B`` and ``(Bᵀ Aᵀ)ᵀ`` (the same values, ``Aᵀ`` a view), with ``B``'s columns as they are or zero-padded to a
multiple of 4, or for a stored kernel through numpy's BLAS (``"split+..."``, :func:`_split_product`), and which one
is fastest depends on the BLAS build and the machine, so it is timed once per machine and cached on disk
(:mod:`gpnys.cache`). The hot products of the kernel operator, the kernel system and the Nyström
/ AFN preconditioners go through it. The forms round differently, so the ranks of a process group must use the same
one: :func:`gpnys.distributed.init` gives every rank rank 0's timed choice (:func:`settle_thin_forms`), and a group
initialised otherwise takes the direct form untimed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import torch

from gpnys.cache import entry_key, read_or_make
from gpnys.checks import NumericalWarning, validate_choice

__all__ = ["synchronize", "thin_matmul", "THIN_FORMS", "TORCH_FORMS", "thin_form", "machine_thin_form",
           "time_thin_forms", "settle_thin_forms", "small_dense", "SINGLE_THREAD_MAX", "safe_cholesky", "add_diag",
           "shift_at", "draw"]

#: the thin-product choices' file in the cache folder (:mod:`gpnys.cache`)
THIN_PRODUCTS_FILE = "thin_products.json"

#: factorisations of ``m x m`` with ``m`` at most this run on one CPU thread (module docstring)
SINGLE_THREAD_MAX = 512


def synchronize(device: torch.device | str) -> None:
    """Wait for ``device``'s queued work (a GPU's; a no-op elsewhere), so that a wall-clock timing around it times
    the work and not its queue.

    Example:
        >>> from gpnys.linalg import synchronize
        >>> synchronize("cpu")  # nothing is queued on a CPU
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def small_dense(m: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block on one CPU thread when ``m <= SINGLE_THREAD_MAX`` (module docstring); a no-op on other
    devices, for larger ``m`` and when torch already uses one thread. Restores the thread count on exit.

    Example:
        >>> import torch
        >>> from gpnys.linalg import small_dense
        >>> threads = torch.get_num_threads()
        >>> A = torch.eye(100, dtype=torch.float64) * 2
        >>> with small_dense(100):
        ...     inside = torch.get_num_threads()
        ...     eigenvalues = torch.linalg.eigvalsh(A)
        >>> inside, torch.get_num_threads() == threads, float(eigenvalues[0])
        (1, True, 2.0)
    """
    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or m > SINGLE_THREAD_MAX or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def thin_matmul(A: torch.Tensor, B: torch.Tensor, form: str | None = None, symmetric: bool = False) -> torch.Tensor:
    """``A @ B`` for ``A (..., m, k)`` and ``B (..., k, t)``, contiguous ``(..., m, t)``, in the form of
    :data:`THIN_FORMS` this device's BLAS runs fastest (:func:`thin_form`), or in ``form``; a 1-D ``B`` or a single
    column is multiplied directly. ``symmetric``: the caller's promise that ``A`` is symmetric (a stored kernel),
    which lets a ``"split+..."`` form read it by columns (:func:`_split_product`).

    Example:
        >>> import torch
        >>> from gpnys.linalg import thin_matmul
        >>> A, B = torch.rand(300, 200, dtype=torch.float64), torch.rand(200, 17, dtype=torch.float64)
        >>> torch.allclose(thin_matmul(A, B), A @ B), thin_matmul(A, B).is_contiguous()
        (True, True)
    """
    if form is not None:
        validate_choice(form, "form", THIN_FORMS, also="(or None)")
    if B.dim() == 1 or B.shape[-1] == 1:
        return A @ B
    return _apply_form(form or thin_form(A.dtype, A.device), A, B, symmetric)


#: torch's forms of a thin product: ``A @ B`` or ``(Bᵀ Aᵀ)ᵀ`` (the same values, ``Aᵀ`` a view), each with ``B``'s
#: columns as they are or zero-padded to a multiple of :data:`PAD_COLUMNS`
TORCH_FORMS = ("direct", "transposed", "direct-padded", "transposed-padded")

#: every form :func:`thin_matmul` takes: torch's, and ``"split+<torch form>"``, where a symmetric ``A`` (a stored
#: kernel) goes through numpy's BLAS in blocks over the threads (:func:`_split_product`) and any other through the
#: torch form named
THIN_FORMS = TORCH_FORMS + tuple(f"split+{form}" for form in TORCH_FORMS)

#: the padded forms' column multiple (MKL's double-precision kernels on a 2-core AMD EPYC ran 13-15 columns at
#: 1.5-2.7x the time of 16; docs/scaling.md, "Why the defaults are what they are")
PAD_COLUMNS = 4


def _apply_form(form: str, A: torch.Tensor, B: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    t = B.shape[-1]
    if form.startswith("split+"):
        if symmetric and _splittable(A, B):
            return _split_product(A, B)
        form = form[len("split+"):]  # not a stored kernel, or a batch, a GPU, a product autograd must record
    if form.endswith("-padded") and t % PAD_COLUMNS:
        B = torch.nn.functional.pad(B, (0, PAD_COLUMNS - t % PAD_COLUMNS))
    out = A @ B if form.startswith("direct") else (B.mT @ A.mT).mT
    return out[..., :t].contiguous()


#: :func:`_split_product` takes a stored kernel from this many rows: below, torch's form was as fast or faster
#: (the timings in docs/scaling.md, "Why the defaults are what they are")
SPLIT_MIN_ROWS = 2048


def _splittable(A: torch.Tensor, B: torch.Tensor) -> bool:
    """Whether :func:`_split_product` takes ``A @ B``: a square ``A`` of at least :data:`SPLIT_MIN_ROWS` rows and a
    ``B``, 2-D CPU float32 / float64 tensors of one dtype that autograd need not record and numpy can view (no
    negative or conjugate bit)."""
    return (A.dim() == 2 and B.dim() == 2 and A.shape[0] == A.shape[1] and A.shape[0] >= SPLIT_MIN_ROWS
            and A.device.type == "cpu" and B.device.type == "cpu"
            and A.dtype == B.dtype and A.dtype in (torch.float32, torch.float64)
            and not (torch.is_grad_enabled() and (A.requires_grad or B.requires_grad))
            and not (A.is_neg() or B.is_neg() or A.is_conj() or B.is_conj()))


class _SplitPool:
    """The worker threads of :func:`_split_product` (one fewer than torch's thread count: the caller runs a group
    of blocks itself), made again when torch's thread count changes and, with the lock, after a fork (a child
    inherits the objects but not the threads, and a lock held at the fork would never be released); the lock keeps
    concurrent callers from interleaving their BLAS thread limits."""

    def __init__(self) -> None:
        self._controller = None
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self._workers: int | None = None
        self._pool: ThreadPoolExecutor | None = None

    def get(self, workers: int) -> ThreadPoolExecutor | None:
        """A pool of ``workers`` threads (``None`` for none)."""
        if self._workers != workers:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gpnys-thin") if workers else None
            self._workers = workers
        return self._pool

    def single_threaded(self):
        """numpy's BLAS on one thread per call, for the duration of the context (threadpoolctl)."""
        if self._controller is None:
            from threadpoolctl import ThreadpoolController

            self._controller = ThreadpoolController()
        return self._controller.limit(limits=1, user_api="blas")


_split_pool = _SplitPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_split_pool.reset)


#: :func:`_split_product`'s block of output columns: fixed, so that the values do not depend on the thread count
#: (smaller blocks were slower, larger ones no faster: docs/scaling.md)
SPLIT_BLOCK = 1024


def _split_product(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A @ B`` for a symmetric ``A (m, m)`` as ``(Bᵀ A)ᵀ`` through numpy's BLAS: blocks of :data:`SPLIT_BLOCK`
    columns of ``A`` (the faster order for a thin ``B``), each a single-threaded BLAS call, dealt out over torch's
    thread count (this thread and a pool).

    Written by hand because torch's CPU wheels bind MKL, whose thin products ran at a third of the peak of its own
    square products on an AMD EPYC, where numpy's OpenBLAS ran them 1.1-1.9x faster (docs/scaling.md, "Why the
    defaults are what they are"); and numpy's BLAS on its own threads lets them spin after each call against
    torch's, so each block runs on one BLAS thread in a thread of ours."""
    m, t = A.shape[0], B.shape[-1]
    An, lhs = A.detach().numpy(), np.ascontiguousarray(B.detach().numpy().T)
    out = np.empty((t, m), dtype=An.dtype)
    starts = range(0, m, SPLIT_BLOCK)
    groups = max(1, min(torch.get_num_threads(), len(starts)))

    def run(g: int) -> None:
        for a in starts[g::groups]:
            np.matmul(lhs, An[:, a : a + SPLIT_BLOCK], out=out[:, a : a + SPLIT_BLOCK])

    with _split_pool.lock, _split_pool.single_threaded():
        pool = _split_pool.get(max(0, torch.get_num_threads() - 1))
        futures = [pool.submit(run, g) for g in range(1, groups)] if pool is not None else []
        run(0)
        for f in futures:
            f.result()
    return torch.from_numpy(out).mT.contiguous()


#: this process's forms, per dtype, device and thread count (the cache file's key); and those settled for a group
_forms: dict[tuple[torch.dtype, str, int], str] = {}
_settled: dict[tuple[torch.dtype, str], str] = {}


def thin_form(dtype: torch.dtype, device: torch.device | str) -> str:
    """The form of :data:`THIN_FORMS` that :func:`thin_matmul` takes on this device and dtype: this machine's
    choice (:func:`machine_thin_form`), or the one settled for every rank of a process group
    (:func:`settle_thin_forms`). Under an initialised ``torch.distributed`` group without a settled choice,
    ``"direct"``, untimed: ranks timing on their own, under different loads, could choose differently and round
    differently."""
    device = str(torch.device(device))
    if (dtype, device) in _settled:
        return _settled[(dtype, device)]
    key = (dtype, device, torch.get_num_threads())
    if key not in _forms:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return "direct"
        _forms[key] = machine_thin_form(dtype, device)
    return _forms[key]


def machine_thin_form(dtype: torch.dtype, device: torch.device | str) -> str:
    """This machine's form for ``dtype`` on ``device`` at the current thread count: read from
    ``thin_products.json`` in the cache folder (:mod:`gpnys.cache`), else timed (:func:`time_thin_forms`) and
    written there, so that every process on the machine rounds alike."""
    name = f"{entry_key(torch.device(device), dtype)}:{'/'.join(THIN_FORMS)}"  # a new form is timed again

    def parse(stored: object) -> str:
        if stored not in THIN_FORMS:  # absent, corrupt, or written by an older gpnys
            raise ValueError(stored)
        return stored

    return read_or_make(THIN_PRODUCTS_FILE, name, parse, lambda: time_thin_forms(dtype, device),
                        "the thin products' form")


#: the side of :func:`time_thin_forms`'s product per device type (else 2048): on a CPU past the last-level cache,
#: as the hot products are (float32 at 2048 fitted a 32 MiB cache and timed the split form even with the direct one,
#: which it beat by 1.6x at 8 000)
CALIBRATION_SIZE = {"cpu": 4096}


def time_thin_forms(dtype: torch.dtype, device: torch.device | str) -> str:
    """The fastest of :data:`THIN_FORMS` for a large symmetric ``A`` (a stored kernel) and 17 columns, timed on a
    :data:`CALIBRATION_SIZE` square product (on a CPU about 1 s in all); another form than ``"direct"`` only if it
    is 10 % faster. Which wins depends on the BLAS build and the machine: the transposed form ran 2.8x faster on
    one 2-core CPU with torch 2.13, the direct one 1.6x faster on another with the same wheel (docs/scaling.md,
    "Why the defaults are what they are")."""
    g = torch.Generator(device=device).manual_seed(0)
    size = CALIBRATION_SIZE.get(torch.device(device).type, 2048)
    A = torch.rand(size, size, generator=g, dtype=dtype, device=device)
    A = A + A.mT
    B = torch.rand(size, 17, generator=g, dtype=dtype, device=device)

    def best(form: str) -> float:
        times = []
        for _ in range(4):
            synchronize(A.device)
            t0 = time.perf_counter()
            _apply_form(form, A, B, symmetric=True)
            synchronize(A.device)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    times = {form: best(form) for form in TORCH_FORMS}
    fastest = min(times, key=times.__getitem__)
    chosen = fastest if times[fastest] < 0.9 * times["direct"] else "direct"
    if torch.device(device).type == "cpu" and best(f"split+{chosen}") < 0.9 * times[chosen]:
        return f"split+{chosen}"
    return chosen


def settle_thin_forms(device: torch.device | str, choices: dict[torch.dtype, str]) -> None:
    """Fix :func:`thin_form` on ``device`` to ``choices`` (``{torch.float32: "direct", ...}``, rank 0's;
    :func:`gpnys.distributed.init`)."""
    for dtype, form in choices.items():
        if form not in THIN_FORMS:
            raise ValueError(f"choices must map dtypes to one of {THIN_FORMS}, got {form!r} for {dtype}")
        _settled[(dtype, str(torch.device(device)))] = form


def shift_at(shift: float | torch.Tensor, index: torch.Tensor) -> float | torch.Tensor:
    """A diagonal shift at the rows ``index``: a scalar (number or 0-dim tensor) as it is, per-point shifts
    ``(n,)`` indexed (same shape as ``index``)."""
    return shift if not isinstance(shift, torch.Tensor) or shift.dim() == 0 else shift[index]


def add_diag(M: torch.Tensor, shift: float | torch.Tensor) -> torch.Tensor:
    """``M + diag(shift)`` over the last two dimensions (out of place, autograd-safe): ``shift`` is a number or a
    0-dim tensor (times the identity) or per-row shifts ``(..., m)`` for ``M (..., m, m)``."""
    s = torch.as_tensor(shift, dtype=M.dtype, device=M.device)
    return M + torch.diag_embed(s.expand(M.shape[:-1]))


def safe_cholesky(
    A: torch.Tensor, what: str, shifts: list[float] | None = None, max_tries: int = 10
) -> torch.Tensor:
    """Lower Cholesky factor of SPD ``A`` (``(..., m, m)``), escalating a diagonal shift on failure.

    On failure the shift of each failed block starts at ``10 eps(dtype) * mean|diag A|`` and grows 10x per
    try; blocks that factor are left unshifted. Each shift used is appended to ``shifts`` and reported by a
    :class:`NumericalWarning`. Raises ``RuntimeError`` (never returns NaNs) if ``max_tries`` do not help.

    Example:
        >>> import torch, warnings
        >>> from gpnys.linalg import safe_cholesky
        >>> A = torch.ones(3, 3, dtype=torch.float64)  # rank one: not numerically SPD
        >>> shifts = []
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # a NumericalWarning names the shift
        ...     L = safe_cholesky(A, "example", shifts)
        >>> len(shifts), shifts[0] < 1e-14, torch.allclose(L @ L.mT, A)
        (1, True, True)
    """
    with small_dense(A.shape[-1] if A.dim() == 2 else SINGLE_THREAD_MAX + 1, A.device):  # a batch keeps its threads
        L, info = torch.linalg.cholesky_ex(A)
    if not bool((info > 0).any()):
        return L
    eps = torch.finfo(A.dtype).eps
    scale = A.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(torch.finfo(A.dtype).tiny)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    shift = torch.zeros_like(scale)
    factor = 10.0 * eps
    for _ in range(max_tries):
        failed = info > 0
        shift = torch.where(failed, factor * scale, shift)
        L, info = torch.linalg.cholesky_ex(A + shift[..., None, None] * eye)
        used = float(shift.max())
        if shifts is not None:
            shifts.append(used)
        warnings.warn(
            f"{what}: Cholesky failed (not numerically SPD); added a diagonal shift up to {used:.3g} "
            f"to {int(failed.sum())} block(s)",
            NumericalWarning,
            stacklevel=3,
        )
        if not bool((info > 0).any()):
            return L
        factor *= 10.0
    raise RuntimeError(f"{what}: Cholesky failed even after {max_tries} diagonal shifts")


def draw(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator | None = None,
    distribution: str = "gaussian",
) -> torch.Tensor:
    """i.i.d. standard Gaussian (``"gaussian"``) or random-sign (``"rademacher"``) entries of ``shape``."""
    if distribution == "gaussian":
        return torch.randn(shape, dtype=dtype, device=device, generator=generator)
    if distribution == "rademacher":
        return torch.randint(0, 2, shape, device=device, generator=generator).to(dtype).mul_(2).sub_(1)
    raise ValueError(f"distribution must be 'gaussian' or 'rademacher', got {distribution!r}")
