"""Ranks fail loudly and fast at start-up: a rank launched with another WORLD_SIZE makes every rank raise a
``ValueError`` saying so within seconds (the process group alone would wait out its timeout), and a consistent
launch still joins."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

SCRIPT = ("import gpnys.distributed as gd, torch.distributed as dist\n"
          "rank, size = gd.init('gloo', timeout_s=60)\n"
          "dist.barrier(); print('joined', rank, size); dist.destroy_process_group()\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(sizes: list[int]) -> tuple[list[subprocess.CompletedProcess], float]:
    port = _free_port()
    procs = []
    start = time.monotonic()
    for rank, size in enumerate(sizes):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out, time.monotonic() - start


def test_consistent_launch_joins():
    results, _ = _launch([2, 2])
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-500:] for r in results]
    assert all("joined" in r.stdout for r in results)


@pytest.mark.parametrize("sizes", [[2, 3], [3, 2]])
def test_world_size_mismatch_raises_on_every_rank_at_once(sizes):
    results, seconds = _launch(sizes)
    assert all(r.returncode != 0 for r in results)
    for r in results:
        assert "ValueError" in r.stderr and "WORLD_SIZE is" in r.stderr, r.stderr[-800:]
    assert seconds < 30  # not the group's 60 s timeout
