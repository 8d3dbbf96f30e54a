"""Training across processes and GPUs with ``torch.distributed``: the kernel split by rows (docs/scaling.md).

Run the same script on every rank (``torchrun --nproc-per-node P script.py``); each rank holds the data and the
model, computes its rows of every kernel product and derivative sum, and the collectives of
:mod:`gpnys.collectives` assemble the results, so every rank sees the numbers one process would::

    import gpnys, gpnys.distributed as gd

    rank, size = gd.init(seed=0)                          # process group from torchrun's environment, same seed
    model = MyExactGP(train_x, train_y).to(gd.device())   # cuda:LOCAL_RANK under NCCL, else the CPU
    with gpnys.use_preconditioner(model, "auto", settings=gd.settings()):
        ...                                               # the usual loop: identical on every rank
    if gd.is_main():
        print(...)                                        # rank 0 reports

What is split: the training kernel operator's recomputed passes (``K V``, the closed-form derivative sums and the
per-probe sums of the error bars), the row blocks of the AFN, FSAI and Nyström builds (Nyström's thin SVD by
TSQR), and the rows of AFN's control variate (``diag`` / ``frozen`` families, its derivatives added over the ranks
in the backward, and the frozen family's closed-form per-probe rows). What is replicated: the small ``k x k`` factors, the rank estimate, PCG and SLQ on ``(n, t)``
vectors, the optimiser step. Results match one process
to rounding (tested to 1e-10 in float64 with two gloo processes).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from gpnys.gp.settings import EstimatorSettings
from gpnys.linalg import machine_thin_form, settle_thin_forms

__all__ = ["init", "launched", "settings", "device", "is_main", "rank_and_size", "DEFAULT_TIMEOUT_S"]

#: seconds a collective waits for the other ranks before raising (instead of hanging on a dead rank)
DEFAULT_TIMEOUT_S = 300.0


def init(backend: str | None = None, seed: int | None = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) unless it is already, seed torch's generator identically on every rank (the
    probes must agree), and return ``(rank, world size)``.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; ``None``: NCCL when CUDA is available, else gloo. Under NCCL each rank
            uses ``cuda:LOCAL_RANK``.
        seed: passed to ``torch.manual_seed`` on every rank; ``None`` leaves the generator alone.
        timeout_s: how long a collective waits for the other ranks before it raises.
    """
    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this torch build")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(f"gpnys.distributed.init needs torchrun's environment; missing {', '.join(missing)} "
                             "(launch with torchrun --nproc-per-node P, or initialise the process group yourself)")
        name = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if name not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {backend!r}")
        if name == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = datetime.timedelta(seconds=float(timeout_s))
        store = _checked_store(rank, size, timeout)
        dist.init_process_group(name, store=store, rank=rank, world_size=size, timeout=timeout)
    _settle_thin_products()
    if seed is not None:
        torch.manual_seed(int(seed))
    return rank_and_size()


def _settle_thin_products() -> None:
    """Every rank adopts rank 0's machine's form of the thin products (:func:`gpnys.linalg.machine_thin_form`,
    cached on disk): the forms round differently, and ranks timing on their own under different loads had chosen
    differently, so that their replicated vectors differed and the row partition's input check failed."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    choices = [None]
    if dist.get_rank() == 0:
        choices[0] = {dtype: machine_thin_form(dtype, device) for dtype in (torch.float32, torch.float64)}
    dist.broadcast_object_list(choices, src=0)
    settle_thin_forms(device, choices[0])


def _checked_store(rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """The rendezvous store, after every rank has shown it the same ``WORLD_SIZE``: a rank launched with another
    size raises a ``ValueError`` that says so, on itself at once and on every other rank within a second, instead of
    the process group waiting out its timeout. Under torchrun's agent the store is the agent's."""
    if not 0 <= rank < size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE), got RANK={rank}, WORLD_SIZE={size}")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, is_master=rank == 0 and not agent, timeout=timeout, wait_for_workers=False)
    prefix = "gpnys/world_size/"

    def mismatch(r: int) -> str | None:  # rank r's size against this rank's, once r has checked in
        theirs = int(store.get(f"{prefix}{r}"))
        return None if theirs == size else (f"WORLD_SIZE is {size} on rank {rank} but {theirs} on rank {r}: launch "
                                            "every rank alike")

    store.set(f"{prefix}{rank}", str(size))
    if rank != 0:
        store.wait([f"{prefix}0"], timeout)
        message = mismatch(0)
        if message:
            store.set("gpnys/abort", message)
            raise ValueError(message)
    deadline = time.monotonic() + timeout.total_seconds()
    keys = [f"{prefix}{r}" for r in range(size)]
    while not store.check(keys):  # every rank of this size has checked in, or one has said why it will not
        if store.check(["gpnys/abort"]):
            raise ValueError(store.get("gpnys/abort").decode())
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if not store.check([f"{prefix}{r}"])]
            raise ValueError(f"ranks {missing} of WORLD_SIZE={size} did not start within {timeout.total_seconds():g} s")
        time.sleep(0.05)
    for r in range(size):
        message = mismatch(r)
        if message:
            raise ValueError(message)
    return store


def launched() -> bool:
    """Whether this process was started as one of several ranks (torchrun's ``RANK`` and ``WORLD_SIZE > 1``)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank_and_size() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """Whether this process reports (rank 0, or no process group)."""
    return rank_and_size()[0] == 0


def device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` under NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def settings(group: Any = True, **kwargs: Any) -> EstimatorSettings:
    """:class:`~gpnys.gp.settings.EstimatorSettings` (``kwargs``) with the kernel split over ``group`` (``True``:
    the default group)."""
    return EstimatorSettings(kernel_group=group, **kwargs)
