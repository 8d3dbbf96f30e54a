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


KILL_SCRIPT = """
import os, sys
from gpnys.kernels.backends.torch_tiles import TorchTiles
if os.environ["RANK"] == "1":  # this rank dies in its first kernel product
    TorchTiles.upper_matmul = TorchTiles.matmul = lambda *a, **k: os._exit(9)
from gpnys.cli.main import main
sys.exit(main(["mll", "--data", "concrete", "--num-points", "300", "--method", "auto", "--dense-gib", "0"]))
"""


def test_cli_reports_a_dead_rank_in_one_line():
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", KILL_SCRIPT], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    assert procs[1].returncode == 9
    assert procs[0].returncode == 1, outs[0][1][-2000:]
    lines = [line for line in outs[0][1].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpnys mll: error:") and "rank" in lines[0], lines[-5:]
