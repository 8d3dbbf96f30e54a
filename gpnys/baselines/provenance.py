"""Where, when and by what code a benchmark ran: the record every benchmark's JSON carries.

``benchmarks/RESULTS.md`` gives each figure with its command, date, commit and device; :func:`provenance` is the one
place that reads them, so every JSON under ``benchmarks/results/`` can be traced back the same way.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from gpnys.cache import device_name

__all__ = ["provenance", "device_name", "versions", "git_commit"]

#: the packages whose versions a record names (``None`` where one is not installed)
PACKAGES = ("torch", "triton", "gpytorch", "linear_operator", "botorch", "numpy", "scipy", "higp", "pykeops",
            "gpnys")


def versions() -> dict[str, str | None]:
    """The installed versions of :data:`PACKAGES`, Python's and CUDA's (torch's build; ``None`` on a CPU build).

    Example:
        >>> from gpnys.baselines.provenance import versions
        >>> sorted(versions())[:3]
        ['botorch', 'cuda', 'gpnys']
    """
    out: dict[str, str | None] = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for pkg in PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit(folder: Path | str | None = None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git checkout holding ``folder`` (default: the imported gpnys, the code timed):
    the short hash, and whether tracked files differ from it; ``(None, None)`` outside a checkout.

    Example:
        >>> from gpnys.baselines.provenance import git_commit
        >>> commit, dirty = git_commit()
        >>> commit is None or len(commit) >= 7
        True
    """
    if folder is None:
        folder = Path(__file__).resolve().parents[1]  # the gpnys package this module belongs to

    def git(*args: str) -> str | None:
        try:
            run = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return run.stdout.strip() if run.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def provenance(script: str | Path, argv: Sequence[str] | None = None,
               device: torch.device | str = "cpu") -> dict[str, Any]:
    """The record of one benchmark run: its command (``python benchmarks/<script> <argv>``; ``argv`` defaults to
    ``sys.argv[1:]``), the UTC time of this call (a benchmark calls it once its results are in), the commit of the
    gpnys timed (and whether the checkout had uncommitted changes), the device's name, the CPU count and torch's
    thread count, the platform and the :func:`versions`.

    Example:
        >>> from gpnys.baselines.provenance import provenance
        >>> rec = provenance("benchmarks/mll_accuracy.py", ["--quick"])
        >>> rec["command"], sorted(rec)[:4]
        ('python benchmarks/mll_accuracy.py --quick', ['command', 'commit', 'cpus', 'date'])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    commit, dirty = git_commit()
    return {"command": shlex.join(["python", f"benchmarks/{Path(script).name}", *map(str, argv)]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "commit": commit, "dirty": dirty, "device": str(torch.device(device)), "device_name": device_name(device),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "platform": platform.platform(),
            "versions": versions()}
