"""Dense linear algebra in the form the CPU runs fastest and most reliably, and the factorisations every layer shares.

Safe Cholesky (:func:`safe_cholesky`): a factor of an SPD matrix that escalates a diagonal shift, with a
:class:`~gpnys.checks.NumericalWarning`, rather than returning NaNs; diagonal shifts (:func:`add_diag`,
:func:`shift_at`) and i.i.d. draws (:func:`draw`) for probes and samples.

Small factorisations (:func:`small_dense`). Eigenvalue, Cholesky and QR factorisations of ``m x m`` matrices with
``m`` up to a few hundred (rank estimation, preconditioner cores, Lanczos tridiagonals) run on one thread: with
several, MKL's threads spin against any other busy process on the machine, and a 300 x 300 ``eigvalsh`` took 2.6 s
instead of 8.5 ms on 2 cores (benchmarks/small_n.py; docs/scaling.md). Alone on the machine one thread costs them
little at these sizes.

Thin products (:func:`thin_matmul`). ``A @ B`` with a large ``A (m, k)`` and a thin ``B (k, t)`` (t ~ 5-64 columns:
the probes of the MLL estimator, the CG block, a q-batch) runs far below memory bandwidth in some of the forms
``A @ B`` and ``(Bᵀ Aᵀ)ᵀ`` (the same values, ``Aᵀ`` a view), with ``B``'s columns as they are or zero-padded to a
multiple of 4, and which one is fastest depends on the BLAS build and the machine, so it is timed once per machine
and cached on disk (:mod:`gpnys.cache`). The hot products of the kernel operator, the kernel system and the Nyström
/ AFN preconditioners go through it. The forms round differently, so the ranks of a process group must use the same
one: :func:`gpnys.distributed.init` gives every rank rank 0's timed choice (:func:`settle_thin_forms`), and a group
initialised otherwise takes the direct form untimed.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Iterator

import torch

from gpnys.cache import entry_key, read_entry, write_entry
from gpnys.checks import NumericalWarning

__all__ = ["thin_matmul", "THIN_FORMS", "thin_form", "machine_thin_form", "time_thin_forms", "settle_thin_forms",
           "small_dense", "SINGLE_THREAD_MAX", "safe_cholesky", "add_diag", "shift_at", "draw"]

#: the thin-product choices' file in the cache folder (:mod:`gpnys.cache`)
THIN_PRODUCTS_FILE = "thin_products.json"

#: factorisations of ``m x m`` with ``m`` at most this run on one CPU thread (module docstring)
SINGLE_THREAD_MAX = 512


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


def thin_matmul(A: torch.Tensor, B: torch.Tensor, form: str | None = None) -> torch.Tensor:
    """``A @ B`` for ``A (..., m, k)`` and ``B (..., k, t)``, contiguous ``(..., m, t)``, in the form of
    :data:`THIN_FORMS` this device's BLAS runs fastest (:func:`thin_form`), or in ``form``; a 1-D ``B`` or a single
    column is multiplied directly.

    Example:
        >>> import torch
        >>> from gpnys.linalg import thin_matmul
        >>> A, B = torch.rand(300, 200, dtype=torch.float64), torch.rand(200, 17, dtype=torch.float64)
        >>> torch.allclose(thin_matmul(A, B), A @ B), thin_matmul(A, B).is_contiguous()
        (True, True)
    """
    if form is not None and form not in THIN_FORMS:
        raise ValueError(f"form must be one of {THIN_FORMS} (or None), got {form!r}")
    if B.dim() == 1 or B.shape[-1] == 1:
        return A @ B
    return _apply_form(form or thin_form(A.dtype, A.device), A, B)


#: the forms of a thin product: ``A @ B`` or ``(Bᵀ Aᵀ)ᵀ`` (the same values, ``Aᵀ`` a view), each with ``B``'s
#: columns as they are or zero-padded to a multiple of :data:`PAD_COLUMNS`
THIN_FORMS = ("direct", "transposed", "direct-padded", "transposed-padded")

#: the padded forms' column multiple (MKL's double-precision kernels on a 2-core AMD EPYC ran 13-15 columns at
#: 1.5-2.7x the time of 16; docs/scaling.md, "Why the defaults are what they are")
PAD_COLUMNS = 4


def _apply_form(form: str, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    t = B.shape[-1]
    if form.endswith("-padded") and t % PAD_COLUMNS:
        B = torch.nn.functional.pad(B, (0, PAD_COLUMNS - t % PAD_COLUMNS))
    out = A @ B if form.startswith("direct") else (B.mT @ A.mT).mT
    return out[..., :t].contiguous()


_forms: dict[tuple[torch.dtype, str], str] = {}


def thin_form(dtype: torch.dtype, device: torch.device | str) -> str:
    """The form of :data:`THIN_FORMS` that :func:`thin_matmul` takes on this device and dtype: this machine's
    choice (:func:`machine_thin_form`), or the one settled for every rank of a process group
    (:func:`settle_thin_forms`). Under an initialised ``torch.distributed`` group without a settled choice,
    ``"direct"``, untimed: ranks timing on their own, under different loads, could choose differently and round
    differently."""
    key = (dtype, str(torch.device(device)))
    if key not in _forms:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return "direct"
        _forms[key] = machine_thin_form(dtype, device)
    return _forms[key]


def machine_thin_form(dtype: torch.dtype, device: torch.device | str) -> str:
    """This machine's form for ``dtype`` on ``device`` at the current thread count: read from
    ``thin_products.json`` in the cache folder (:mod:`gpnys.cache`), else timed (:func:`time_thin_forms`) and
    written there, so that every process on the machine rounds alike."""
    name = entry_key(torch.device(device), dtype)
    stored = read_entry(THIN_PRODUCTS_FILE, name)
    if stored not in THIN_FORMS:  # absent, corrupt, or written by an older gpnys
        stored = time_thin_forms(dtype, device)
        write_entry(THIN_PRODUCTS_FILE, name, stored, "the thin products' form")
    return stored


def time_thin_forms(dtype: torch.dtype, device: torch.device | str) -> str:
    """The fastest of :data:`THIN_FORMS` for a large ``A`` and 17 columns, timed on a 2048 x 2048 product (about
    0.1 s in all); another form than ``"direct"`` only if it is 10 % faster. Which wins depends on the BLAS build
    and the machine: the transposed form ran 2.8x faster on one 2-core CPU with torch 2.13, the direct one 1.6x
    faster on another with the same wheel (docs/scaling.md, "Why the defaults are what they are")."""
    g = torch.Generator(device=device).manual_seed(0)
    A = torch.rand(2048, 2048, generator=g, dtype=dtype, device=device)
    B = torch.rand(2048, 17, generator=g, dtype=dtype, device=device)

    def best(form: str) -> float:
        times = []
        for _ in range(4):
            if A.is_cuda:
                torch.cuda.synchronize(A.device)
            t0 = time.perf_counter()
            _apply_form(form, A, B)
            if A.is_cuda:
                torch.cuda.synchronize(A.device)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    times = {form: best(form) for form in THIN_FORMS}
    fastest = min(times, key=times.__getitem__)
    return fastest if times[fastest] < 0.9 * times["direct"] else "direct"


def settle_thin_forms(device: torch.device | str, choices: dict[torch.dtype, str]) -> None:
    """Fix :func:`thin_form` on ``device`` to ``choices`` (``{torch.float32: "direct", ...}``, rank 0's;
    :func:`gpnys.distributed.init`)."""
    for dtype, form in choices.items():
        if form not in THIN_FORMS:
            raise ValueError(f"choices must map dtypes to one of {THIN_FORMS}, got {form!r} for {dtype}")
        _forms[(dtype, str(torch.device(device)))] = form


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
