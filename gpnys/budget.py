"""One memory budget for every blocked computation in gpnys.

Kernel products, preconditioner setup (landmark distances, kNN, ``K12`` column blocks, FSAI local blocks) and
reduced-posterior features never hold an ``n x n`` matrix unless it fits; they work on temporary blocks whose
size comes from here. Two numbers:

* ``block_bytes``: the size of one temporary block (default 32 MiB on CPU; on a CUDA device
  :data:`CUDA_BLOCK_SHARE` of its free memory, at most :data:`CUDA_MAX_BLOCK_BYTES`). Peak memory of a blocked
  pass is a small multiple of it plus the ``O(n t)`` inputs and outputs.
* ``dense_bytes``: the dense kernel matrix ``K(X, X)`` (and, for Matérn, its companion ``k'/r``) is cached when it
  fits in this many bytes (default 4 GiB on CPU; on a CUDA device :data:`CUDA_DENSE_SHARE` of its free memory);
  above, every product recomputes the kernel on the fly.

The CPU defaults suit a workstation's RAM; a GPU has less memory per flop and far more bandwidth, so its defaults
come from the free memory of the device the data lives on (pass ``device=``): ``torch.cuda.mem_get_info`` plus
what torch's caching allocator holds unused. A value set with
:func:`memory_budget` applies to every device.

Set them for a block of code with :func:`memory_budget` (a context manager, like ``gpytorch.settings``)::

    with gpnys.memory_budget(block_bytes=8 << 20, dense_bytes=0):   # 8 MiB blocks, never cache K
        loss.backward()

Sizes are counted in float64 entries (8 bytes) whatever the dtype, so float32 blocks use half the budget.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Iterator

import torch

__all__ = ["memory_budget", "default_budget", "block_elems", "block_rows", "fill_rows", "block_bytes",
           "dense_limit_bytes", "default_dense_bytes",
           "DEFAULT_BLOCK_BYTES", "DEFAULT_DENSE_BYTES", "CUDA_BLOCK_SHARE", "CUDA_MAX_BLOCK_BYTES", "CUDA_DENSE_SHARE",
           "CPU_FILL_BLOCK_BYTES"]

DEFAULT_BLOCK_BYTES = 32 << 20
DEFAULT_DENSE_BYTES = 4 << 30
#: on CUDA, one temporary block takes this share of the device's free memory ...
CUDA_BLOCK_SHARE = 1 / 16
#: ... but at most this many bytes (larger blocks stop paying once a tile fills the GPU)
CUDA_MAX_BLOCK_BYTES = 1 << 30
#: on CUDA, the dense kernel cache may take this share of the device's free memory
CUDA_DENSE_SHARE = 0.5
#: on a CPU, the stored kernel is filled in blocks of at most this many bytes, so that its elementwise passes
#: (distances, ``exp``, the derivative's matrix) run in the cache instead of streaming each pass through memory
#: (docs/scaling.md, "Why the defaults are what they are")
CPU_FILL_BLOCK_BYTES = 2 << 20
_ENTRY_BYTES = 8

_DEFAULT: dict[str, int | None] = {"block_bytes": None, "dense_bytes": None}  # None: the device's default
#: the budget of the thread or task that set one (module docstring): a context variable, so that a
#: :func:`memory_budget` in one thread neither reaches another that set its own nor, on exit, overwrites it
_STATE: contextvars.ContextVar[dict[str, int | None] | None] = contextvars.ContextVar("gpnys_memory_budget",
                                                                                       default=None)
#: the open budget blocks of the process, in entry order: a thread that set none (autograd's device threads, which
#: run a backward outside its caller's context) reads the latest, as a process-wide budget would
_OPEN: list[tuple[object, dict[str, int | None]]] = []
_OPEN_LOCK = threading.Lock()


def _current() -> dict[str, int | None]:
    own = _STATE.get()
    if own is not None:
        return own
    with _OPEN_LOCK:
        return _OPEN[-1][1] if _OPEN else _DEFAULT


def _validate(value: int | None, name: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@contextlib.contextmanager
def memory_budget(block_bytes: int | None = None, dense_bytes: int | None = None) -> Iterator[None]:
    """Within the block, temporary blocks use at most ``block_bytes`` (>= 8) and the dense kernel is cached only
    up to ``dense_bytes`` (>= 0; 0: always on the fly). ``None`` keeps the current value.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys import memory_budget
        >>> from gpnys.budget import DEFAULT_BLOCK_BYTES, block_bytes, block_rows
        >>> from gpnys.kernels.entries import KernelEntries
        >>> X = torch.rand(300, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> entries = KernelEntries(X, gpytorch.kernels.RBFKernel().double())
        >>> V = torch.eye(300, dtype=torch.float64)[:, :5]
        >>> dense = entries(slice(None), slice(None)) @ V
        >>> with memory_budget(block_bytes=8 << 10, dense_bytes=0):  # 8 KiB blocks: 3 rows of 300 entries
        ...     rows, product = block_rows(300), entries.matmul(V)  # K recomputed block by block
        >>> rows, torch.allclose(product, dense)
        (3, True)
        >>> block_bytes() == DEFAULT_BLOCK_BYTES  # restored on exit
        True
    """
    new = {"block_bytes": _validate(block_bytes, "block_bytes", _ENTRY_BYTES),
           "dense_bytes": _validate(dense_bytes, "dense_bytes", 0)}
    with _budget({k: v for k, v in new.items() if v is not None}):
        yield


@contextlib.contextmanager
def default_budget() -> Iterator[None]:
    """Within the block, the device's default budget, whatever :func:`memory_budget` the caller is in: for a
    measurement cached for the whole machine (the path costs), which must not depend on one caller's budget.

    Example:
        >>> from gpnys import memory_budget
        >>> from gpnys.budget import DEFAULT_BLOCK_BYTES, block_bytes, default_budget
        >>> with memory_budget(block_bytes=8 << 10), default_budget():
        ...     block_bytes() == DEFAULT_BLOCK_BYTES
        True
    """
    with _budget({"block_bytes": None, "dense_bytes": None}):
        yield


@contextlib.contextmanager
def _budget(values: dict[str, int | None]) -> Iterator[None]:
    """The budget updated with ``values`` within the block (``None``: the device default), restored on exit."""
    merged = {**_current(), **values}
    token, entry = _STATE.set(merged), (object(), merged)
    with _OPEN_LOCK:
        _OPEN.append(entry)
    try:
        yield
    finally:
        _STATE.reset(token)
        with _OPEN_LOCK:
            _OPEN.remove(entry)


def _cuda_free(device: torch.device | str | None) -> int | None:
    """Free bytes of ``device`` when it is a CUDA device, else ``None``."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    # the driver's free memory plus what torch's caching allocator holds unused (it hands that out first): the
    # budget must not shrink because an earlier pass left blocks in the cache
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(torch.cuda.mem_get_info(device)[0]) + int(cached)


def block_bytes(device: torch.device | str | None = None) -> int:
    """Size of one temporary block in bytes, for data on ``device`` (``None``: the CPU default)."""
    own = _current()["block_bytes"]
    if own is not None:
        return own
    free = _cuda_free(device)
    if free is None:
        return DEFAULT_BLOCK_BYTES
    return max(DEFAULT_BLOCK_BYTES, min(CUDA_MAX_BLOCK_BYTES, int(free * CUDA_BLOCK_SHARE)))


def dense_limit_bytes(device: torch.device | str | None = None) -> int:
    """Largest dense kernel cache in bytes, for data on ``device`` (``None``: the CPU default)."""
    own = _current()["dense_bytes"]
    if own is not None:
        return own
    return default_dense_bytes(device)


def default_dense_bytes(device: torch.device | str | None = None) -> int:
    """The device's own dense limit, whatever :func:`memory_budget` set: :data:`DEFAULT_DENSE_BYTES` on a CPU,
    :data:`CUDA_DENSE_SHARE` of the free memory on CUDA. It bounds long-lived factors such as AFN's landmark columns,
    which ``dense_bytes=0`` (asked for to keep the kernel on the fly) should not forbid."""
    free = _cuda_free(device)
    return DEFAULT_DENSE_BYTES if free is None else int(free * CUDA_DENSE_SHARE)


def block_elems(parts: int = 1, device: torch.device | str | None = None) -> int:
    """Entries of one temporary block, divided among ``parts`` simultaneous buffers (at least 1)."""
    return max(1, block_bytes(device) // (_ENTRY_BYTES * parts))


def block_rows(width: int, cap: int | None = None, parts: int = 1, device: torch.device | str | None = None) -> int:
    """Rows of ``width`` entries that fit in one block (:func:`block_elems`), at least 1 and at most ``cap``."""
    rows = max(1, block_elems(parts, device) // max(1, width))
    return rows if cap is None else max(1, min(cap, rows))


def fill_rows(width: int, device: torch.device | str | None = None) -> int:
    """Rows of ``width`` entries per block of an elementwise fill of a stored matrix: :func:`block_rows`, and on a
    CPU at most :data:`CPU_FILL_BLOCK_BYTES` (at least 1).

    Example:
        >>> from gpnys.budget import fill_rows
        >>> fill_rows(8000, "cpu")  # 2 MiB of float64 rows
        32
    """
    rows = block_rows(width, device=device)
    if device is None or torch.device(device).type == "cpu":
        rows = max(1, min(rows, CPU_FILL_BLOCK_BYTES // (_ENTRY_BYTES * max(1, width))))
    return rows
