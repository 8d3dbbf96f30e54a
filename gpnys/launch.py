"""Launching hand-written Triton kernels: whether Triton is there, and a guard that falls back, warning once.

Used by the kernel operator's Triton backend (:mod:`gpnys.kernels.backends.triton_fused`) and by farthest point
sampling (:mod:`gpnys.landmarks.fps`). Triton itself is imported only by the kernel modules, lazily.

Triton's installation hash. Before its first compile in a process, Triton hashes its own installation for the
keys of its disk cache (``triton.runtime.cache.triton_key``), about 500 MB of ``libtriton``: 0.4-0.7 s of every
process's first evaluation, even when every kernel is on disk. :func:`reuse_triton_key` keeps that hash in gpnys's
cache folder (``triton_key.json``, :mod:`gpnys.cache`) under a fingerprint of the same files (path, size, mtime
and inode of each, and Triton's version), and hands it to Triton while the fingerprint holds, as Triton's own
compile pools hand their workers the parent's key. Any reinstall changes the fingerprint and the hash is computed
afresh. ``GPNYS_TRITON_KEY_CACHE=0`` turns it off. Written by hand because Triton has no setting for it.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from gpnys.cache import read_entry, write_entry

__all__ = ["triton_available", "interpreting", "guarded_launch", "failed", "reuse_triton_key",
           "installation_fingerprint"]

#: the cache file of Triton's installation hash (module docstring)
TRITON_KEY_FILE = "triton_key.json"
#: the folders of a Triton installation its hash reads (and ``runtime/cache.py``, where the hash is computed)
_HASHED = ("compiler", "backends", "language", "_C")
_key_state: dict[str, Any] = {"done": False}

#: (kernels, device type, dtype, tf32) whose Triton launch failed: answered by the fallback from then on (one warning)
_FAILED: set[tuple[str, str, torch.dtype, bool]] = set()


def triton_available() -> bool:
    """Whether ``triton`` is importable."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``: kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _failure_key(kernels: str, device: torch.device, dtype: torch.dtype, tf32: bool) -> tuple:
    return kernels, device.type, dtype, bool(tf32) and dtype == torch.float32


def failed(kernels: str, device: torch.device, dtype: torch.dtype, tf32: bool = False) -> bool:
    """Whether the Triton ``kernels`` (``"kernel"``: the product and derivative; ``"fps"``) failed for this device,
    dtype and TF32 setting, so that their fallback answers."""
    return _failure_key(kernels, device, dtype, tf32) in _FAILED


def guarded_launch(kernels: str, device: torch.device, dtype: torch.dtype, tf32: bool, launch: Callable[[], Any],
                   fallback: Callable[[], Any], fallback_name: str) -> Any:
    """``launch()``, or ``fallback()`` once a Triton launch of ``kernels`` failed for this key: the first failure is
    recorded and warned about (``RuntimeWarning``), so an answer is never silently from another path."""
    key = _failure_key(kernels, device, dtype, tf32)
    if not _key_state["done"]:
        try:
            reuse_triton_key()
        except Exception as err:  # noqa: BLE001 - a cache's trouble must not cost the kernels; Triton hashes itself
            warnings.warn(f"gpnys: Triton's installation hash was not reused ({type(err).__name__}: {err})",
                          RuntimeWarning, stacklevel=5)
    if key not in _FAILED:
        try:
            return launch()
        except Exception as err:  # noqa: BLE001 - compile / launch errors surface as many types (CompilationError, ...)
            _FAILED.add(key)
            warnings.warn(f"Triton kernel failed ({kernels}) for {dtype} on {device.type} ({type(err).__name__}: "
                          f"{err}); using {fallback_name} instead", RuntimeWarning, stacklevel=5)
    return fallback()


def installation_fingerprint(root: Path, version: str) -> str:
    """A fingerprint of the files under ``root`` (a Triton installation's folder) that its hash reads: the path,
    size, modification time (ns) and inode of each file of :data:`_HASHED` (``__pycache__`` left out, which
    imports rewrite) and of ``runtime/cache.py``, and ``version``. A few hundred ``stat`` calls, some milliseconds."""
    lines = [f"{version}|{root}"]
    files = [root / "runtime" / "cache.py"]
    seen: set[str] = set()
    for sub in _HASHED:
        # linked folders followed, as Triton's own walk does (an editable install links its backends), once each
        for folder, dirs, names in os.walk(root / sub, followlinks=True):
            real = os.path.realpath(folder)
            if real in seen:
                dirs[:] = []
                continue
            seen.add(real)
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [Path(folder) / name for name in sorted(names)]
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        lines.append(f"{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}")  # stat follows links
    return uuid.uuid5(uuid.NAMESPACE_OID, "\n".join(lines)).hex  # a SHA-1 name of the listing


def reuse_triton_key(cache: ModuleType | None = None, root: Path | None = None, version: str | None = None) -> bool:
    """Hand Triton its installation hash from gpnys's cache (module docstring), computing and storing it where
    the fingerprint is new. Once per process (later calls return the first answer); nothing under Triton's
    interpreter, which never compiles, nor once Triton has computed the hash itself. Returns whether the cached
    hash is in use. ``cache``, ``root``, ``version``: Triton's ``runtime.cache`` module, folder and version
    (default: the installed Triton's).

    Example:
        >>> from gpnys.launch import reuse_triton_key
        >>> isinstance(reuse_triton_key(), bool)
        True
    """
    if _key_state["done"]:
        return _key_state["reused"]
    _key_state.update(done=True, reused=False)
    if os.environ.get("GPNYS_TRITON_KEY_CACHE", "1") == "0" or (cache is None and interpreting()):
        return False
    if cache is None:
        if not triton_available():
            return False
        import triton
        import triton.runtime.cache as cache

        root, version = Path(triton.__file__).parent, triton.__version__
    real = getattr(cache, "triton_key", None)
    info = getattr(real, "cache_info", None)
    if info is None or info().currsize:  # a Triton without it, or the hash already computed in this process
        return False
    fingerprint = installation_fingerprint(Path(root), str(version))
    key = read_entry(TRITON_KEY_FILE, fingerprint)
    if not isinstance(key, str):
        key = real()
        write_entry(TRITON_KEY_FILE, fingerprint, key, "Triton's installation hash")
    cache.triton_key = lambda: key
    _key_state["reused"] = True
    return True
