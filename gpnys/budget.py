"""One memory budget for every blocked computation in gpnys.

Kernel products, preconditioner setup (landmark distances, kNN, ``K12`` column blocks, FSAI local blocks) and
reduced-posterior features never hold an ``n x n`` matrix unless it fits; they work on temporary blocks whose
size comes from here. Two numbers:

* ``block_bytes``: the size of one temporary block (default 32 MiB). Peak memory of a blocked pass is a small
  multiple of it plus the ``O(n t)`` inputs and outputs.
* ``dense_bytes``: the dense kernel matrix ``K(X, X)`` (and, for Matérn, its companion ``k'/r``) is cached when it
  fits in this many bytes (default 4 GiB); above, every product recomputes row blocks on the fly.

Set them for a block of code with :func:`memory_budget` (a context manager, like ``gpytorch.settings``)::

    with gpnys.memory_budget(block_bytes=8 << 20, dense_bytes=0):   # 8 MiB blocks, never cache K
        loss.backward()

Sizes are counted in float64 entries (8 bytes) whatever the dtype, so float32 blocks use half the budget.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["memory_budget", "block_elems", "block_rows", "block_bytes", "dense_limit_bytes", "DEFAULT_BLOCK_BYTES", "DEFAULT_DENSE_BYTES"]

DEFAULT_BLOCK_BYTES = 32 << 20
DEFAULT_DENSE_BYTES = 4 << 30
_ENTRY_BYTES = 8

_state = {"block_bytes": DEFAULT_BLOCK_BYTES, "dense_bytes": DEFAULT_DENSE_BYTES}


def _validate(value: int | None, name: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@contextlib.contextmanager
def memory_budget(block_bytes: int | None = None, dense_bytes: int | None = None) -> Iterator[None]:
    """Within the block, temporary blocks use at most ``block_bytes`` (>= 8) and the dense kernel is cached only
    up to ``dense_bytes`` (>= 0; 0: always on the fly). ``None`` keeps the current value."""
    new = {"block_bytes": _validate(block_bytes, "block_bytes", _ENTRY_BYTES),
           "dense_bytes": _validate(dense_bytes, "dense_bytes", 0)}
    old = dict(_state)
    _state.update({k: v for k, v in new.items() if v is not None})
    try:
        yield
    finally:
        _state.update(old)


def block_elems(parts: int = 1) -> int:
    """Entries of one temporary block, divided among ``parts`` simultaneous buffers (at least 1)."""
    return max(1, _state["block_bytes"] // (_ENTRY_BYTES * parts))


def block_rows(width: int, cap: int | None = None, parts: int = 1) -> int:
    """Rows of ``width`` entries that fit in one block (:func:`block_elems`), at least 1 and at most ``cap``."""
    rows = max(1, block_elems(parts) // max(1, width))
    return rows if cap is None else max(1, min(cap, rows))


def block_bytes() -> int:
    """Size of one temporary block in bytes."""
    return _state["block_bytes"]


def dense_limit_bytes() -> int:
    """Largest dense kernel cache in bytes (see the module docstring)."""
    return _state["dense_bytes"]
