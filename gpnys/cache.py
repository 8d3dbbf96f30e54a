"""The on-disk cache of what gpnys measures once per machine: ``$GPNYS_CACHE_DIR`` (default ``~/.cache/gpnys``),
one JSON file per kind of measurement, each a dict of entries keyed by device, dtype and thread count.

Three kinds use it: the path cost model (``costs.json``, :mod:`gpnys.gp.path`), the faster form of the thin
products (``thin_products.json``, :func:`gpnys.linalg.thin_form`) and Triton's installation hash
(``triton_key.json``, :func:`gpnys.launch.reuse_triton_key`). Reading them back makes every later process on the
machine decide as the first did, where a timing of its own, beside other jobs, could decide otherwise. A missing or
corrupt file reads as empty; an unwritable one warns and the value is kept in memory only. Writers of one file take
turns (an advisory ``fcntl`` lock, where the platform has it), so that processes writing at once keep each other's
entries.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

try:  # POSIX; elsewhere writers do not take turns
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["cache_dir", "device_name", "entry_key", "read_entry", "read_or_make", "write_entry"]


def cache_dir() -> Path:
    """``$GPNYS_CACHE_DIR``, default ``~/.cache/gpnys``.

    Example:
        >>> from gpnys.cache import cache_dir, read_entry
        >>> cache_dir().is_absolute(), read_entry("costs.json", "no such key")
        (True, None)
    """
    return Path(os.environ.get("GPNYS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpnys"))


def device_name(device: torch.device | str = "cpu") -> str:
    """The GPU's name for a CUDA ``device``, else the CPU's model name (``/proc/cpuinfo``, or what ``platform``
    knows).

    Example:
        >>> from gpnys.cache import device_name
        >>> isinstance(device_name("cpu"), str)
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _cpu_name()


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def entry_key(device: torch.device, dtype: torch.dtype) -> str:
    """The key of a measurement: device type and name (the GPU's, or the CPU's model: a cache folder shared between
    machines keeps each one's), dtype, the current thread count and torch's version (another build times
    differently)."""
    return (f"{device.type}:{device_name(device)}:{dtype}:threads={torch.get_num_threads()}:"
            f"torch={torch.__version__}")


def _read(name: str) -> dict:
    try:
        stored = json.loads((cache_dir() / name).read_text())
    except (OSError, ValueError, RecursionError):  # unreadable, corrupt, or nested past the parser's depth
        return {}
    return stored if isinstance(stored, dict) else {}


def read_entry(name: str, key: str) -> Any:
    """The entry ``key`` of the cache file ``name`` (e.g. ``"costs.json"``), or ``None``."""
    return _read(name).get(key)


def write_entry(name: str, key: str, value: Any, what: str,
                merge: Callable[[Any, Any], Any] | None = None) -> None:
    """Set the entry ``key`` of the cache file ``name`` to ``value`` (JSON), or to ``merge(stored, value)`` where
    an entry is stored (e.g. to keep another process's measurements in it). The file is read, changed and written
    whole to a temporary file renamed over the old one while this process holds the file's lock, so that a
    concurrent reader sees either file and a concurrent writer's entry is kept; where the folder is unwritable, a
    ``RuntimeWarning`` naming ``what`` (e.g. ``"the path costs"``)."""
    path = cache_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            stored = _read(name)
            old = stored.get(key)
            stored[key] = value if merge is None or old is None else merge(old, value)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1))
            tmp.replace(path)
    except OSError as err:
        warnings.warn(f"gpnys: could not cache {what} in {path} ({err}); they are kept for this process",
                      RuntimeWarning, stacklevel=3)


def read_or_make(name: str, key: str, parse: Callable[[Any], Any], make: Callable[[], Any], what: str,
                 stored: Callable[[Any], Any] = lambda value: value,
                 merge: Callable[[Any, Any], Any] | None = None) -> Any:
    """``parse(entry)`` of the entry ``key`` of the cache file ``name``, else (``parse`` raised ``TypeError``,
    ``KeyError``, ``ValueError`` or ``AttributeError``: absent or damaged) ``make()``, written as ``stored(value)``
    (:func:`write_entry` with ``merge``). One process makes an entry at a time (an advisory lock of its own, which
    readers and writers of the file do not wait for): one that finds another making it waits and reads its entry.
    Two calibrations at once timed each other, and the slower, 2.6-6x inflated costs stayed in the cache."""
    errors = (TypeError, KeyError, ValueError, AttributeError)
    try:
        return parse(read_entry(name, key))
    except errors:
        pass
    path = cache_dir() / name
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path, ".making"):
        try:
            return parse(read_entry(name, key))  # made by another process meanwhile
        except errors:
            value = make()
        write_entry(name, key, stored(value), what, merge)
    return value


@contextlib.contextmanager
def _locked(path: Path, suffix: str = ".lock") -> Iterator[None]:
    """Hold the advisory lock ``path`` + ``suffix`` of the cache file ``path``; without ``fcntl``, or where the lock
    file cannot be opened (an unwritable folder: the write that follows warns), nothing."""
    try:
        handle = open(path.with_suffix(path.suffix + suffix), "a") if fcntl is not None else None
    except OSError:
        handle = None
    if handle is None:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
