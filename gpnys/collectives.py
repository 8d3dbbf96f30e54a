"""Row-split collectives over a ``torch.distributed`` group: the ground floor of every multi-process pass.

Rank ``r`` of ``P`` owns the rows ``[r c, (r + 1) c)`` of an ``n``-row quantity, ``c = ceil(n / P)`` rounded up to a
whole leaf (:data:`LEAF`), so that a kernel's cutoff plan splits by leaves and Triton by tiles. :class:`RowGroup`
gathers rows computed per rank (:meth:`RowGroup.gather_rows`), adds partial results in rank order
(:meth:`RowGroup.gather_sum`: every rank the same bits) and factors tall matrices by TSQR
(:meth:`RowGroup.tall_svd`). Each gather carries :data:`SAMPLE_ROWS` evenly spaced rows of the vectors its rank used,
compared exactly, and ranks that disagree raise ``ValueError`` rather than return a result of mixed vectors. A
collective that fails (a rank died, or the group's timeout passed) raises :class:`CollectiveError` naming the pass and
the rank. A group of one rank exchanges and compares nothing. :data:`STATS` counts this rank's collectives.

Communication is torch.distributed's (gloo between CPU processes, NCCL between GPUs). Written by hand because no
library splits these passes by rows with rank-ordered, bit-identical sums.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["RowGroup", "CollectiveError", "gather_rows", "row_range", "resolve_group", "STATS", "reset_stats", "LEAF",
           "Rows", "SAMPLE_ROWS", "signature"]

#: row granularity of a split and of a partial kernel pass (``rows=``): the cutoff plan's leaf and the Triton tile
LEAF = 64

Rows = tuple[int, int]

#: process-wide counters of this rank's collectives (for benchmarks: operators are rebuilt by GPyTorch, so they
#: cannot keep their own): calls, bytes this rank received, seconds spent inside the collectives
STATS: dict[str, float] = {"collectives": 0, "bytes_received": 0, "seconds": 0.0}


#: rows of each input compared across the ranks (module docstring)
SAMPLE_ROWS = 16


def reset_stats() -> None:
    """Zero :data:`STATS`."""
    STATS.update(collectives=0, bytes_received=0, seconds=0.0)


def partitioned(group: Any) -> bool:
    """Whether ``kernel_group`` asks for a row partition: ``True`` or a process group (``None`` and ``False`` do
    not)."""
    return group is not None and group is not False


def resolve_group(group: Any) -> Any:
    """``group``: ``True`` (the default group) or a process group; raises ``ValueError`` when torch.distributed is
    not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("kernel_group needs torch.distributed initialised (torch.distributed.init_process_group, "
                         "e.g. under torchrun)")
    return dist.group.WORLD if group is True else group


# one output tensor for every rank's block (torch >= 2.13's name; all_gather_into_tensor before)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def row_range(n: int, rank: int, size: int) -> Rows:
    """Rank ``rank``'s rows ``[a, b)`` of ``n`` among ``size`` ranks (module docstring); possibly empty."""
    chunk = -(-(-(-n // size)) // LEAF) * LEAF
    a = min(rank * chunk, n)
    return a, min(a + chunk, n)


def _added(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' blocks added in rank order (every rank the same bits; an all-reduce's order would be the
    library's)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _is_batched(x: torch.Tensor) -> bool:
    """Whether ``x`` is a batched tensor: ``autograd.grad(is_grads_batched=True)`` (torch's legacy vmap) or
    ``torch.func.vmap``. Checked alike on every rank before any collective, so that a caller such as the estimator's
    Jacobian falls back to one backward pass per row on all ranks. (torch's private predicates, hence guarded.)"""
    functorch = getattr(torch._C, "_functorch", None)
    checks = [getattr(functorch, name, None) for name in ("is_legacy_batchedtensor", "is_batchedtensor")]
    return any(bool(check(x)) for check in checks if check is not None)


class _SplitSum(torch.autograd.Function):
    """:meth:`RowGroup.split_sum`: forward, every rank's ``compute(*shared)`` added in rank order; backward, every
    rank's gradient of its own partial with respect to ``shared``, added in rank order, so each rank holds the
    gradient of all ranks' rows. One gather each way, and an error on one rank, forward or backward, rides it."""

    @staticmethod
    def forward(ctx: Any, ranks: "RowGroup", what: str, compute: Callable[..., torch.Tensor],
                zeros: Callable[[], torch.Tensor], inputs: list[torch.Tensor], *shared: torch.Tensor) -> torch.Tensor:
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in shared]
        kept: dict[str, torch.Tensor] = {}

        def local() -> torch.Tensor:  # the rank's own graph, from the shared tensors as leaves
            with torch.enable_grad():
                kept["local"] = compute(*leaves)
            return kept["local"].detach()

        parts = ranks._gather_computed(what, local, zeros, inputs)  # (raises on every rank if one failed)
        ctx.ranks, ctx.what, ctx.local, ctx.leaves = ranks, what, kept["local"], leaves
        return _added(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():  # create_graph: a double backward through the ranks' sum is not offered
            raise RuntimeError("gpnys row partition: no double backward through a sum over the ranks")
        if _is_batched(grad):  # a vmapped backward (is_grads_batched): a collective has no batching rule
            raise RuntimeError("gpnys row partition: no batched backward through a sum over the ranks")
        leaves, local = ctx.leaves, ctx.local
        need = [x for x in leaves if x.requires_grad]
        acc = functools.reduce(torch.promote_types, [x.dtype for x in leaves])

        def zeros() -> torch.Tensor:
            return torch.zeros(sum(x.numel() for x in need), dtype=acc, device=grad.device)

        def flat() -> torch.Tensor:  # this rank's gradient of its own partial, flattened
            if not (need and local.requires_grad):
                return zeros()
            gs = torch.autograd.grad(local, need, grad, retain_graph=True, allow_unused=True)
            return torch.cat([(torch.zeros_like(x) if g is None else g).reshape(-1).to(acc) for x, g in zip(need, gs)])

        total = _added(ctx.ranks._gather_computed(f"{ctx.what} gradients", flat, zeros, []))
        out, i = [], 0
        for x in leaves:
            if x.requires_grad:
                out.append(total[i : i + x.numel()].view_as(x).to(x.dtype))
                i += x.numel()
            else:
                out.append(None)
        return (None, None, None, None, None, *out)


class CollectiveError(RuntimeError):
    """A collective failed (a rank died, or the group's timeout passed): not recoverable by a fallback on one
    rank, so callers that recover from numerical ``RuntimeError`` must re-raise it."""


class RowGroup:
    """The ranks of a process group splitting ``n`` rows (:func:`row_range`): collectives that raise instead of
    hanging, with the exact input check of the module docstring. Shared by :class:`PartitionedBackend` and the
    per-rank preconditioner builds (AFN's ``K12`` columns, the FSAI rows)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:  # torch's collectives return at once on a non-member, leaving this rank's answer unset
            raise ValueError(f"kernel_group: this process (global rank {dist.get_rank()}) is not a member of the "
                             "process group it was given; pass a group every calling rank belongs to")

    @classmethod
    def of(cls, group: Any) -> "RowGroup | None":
        """``None`` for ``None`` / ``False``, a :class:`RowGroup` as it is, else one over :func:`resolve_group`."""
        if group is None or group is False:
            return None
        return group if isinstance(group, RowGroup) else cls(resolve_group(group))

    def rows(self, n: int) -> Rows:
        """This rank's rows ``[a, b)`` of ``n``."""
        return row_range(n, self.rank, self.size)

    def _collective(self, what: str, fn: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args, group=self.group)
            STATS["seconds"] += time.perf_counter() - t0  # (gloo returns when done; NCCL when enqueued)
            STATS["collectives"] += 1
        except Exception as err:  # noqa: BLE001 - gloo / NCCL raise RuntimeError, DistBackendError, ...
            raise CollectiveError(f"gpnys row partition: the {what} collective failed on rank {self.rank} of "
                                  f"{self.size} (a rank died or the group's timeout passed): {err}") from err

    def agree(self, what: str, failure: BaseException | None, signature: dict[str, Any] | None = None) -> None:
        """Every rank's verdict on its own input, exchanged once (``failure``: this rank's error, or ``None``): a
        rank that rejected its input re-raises its error here, and every other rank raises a ``ValueError`` naming
        it, at once, instead of waiting for it in the next collective until the group's timeout. ``signature``
        (plain values, e.g. :func:`signature` of the data and the settings) must be the same on every rank, else
        every rank raises a ``ValueError`` naming the first entry that differs: a gather of blocks sized or typed
        differently would abort a gloo process outright, and data that differ outside the gathers' sample rows
        would give each rank its own answer."""
        if self.size == 1:
            if failure is not None:
                raise failure
            return
        verdicts: list[Any] = [None] * self.size
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        self._collective(what, dist.all_gather_object, verdicts, (mine, signature))
        if failure is not None:
            raise failure
        bad = [(r, v) for r, (v, _) in enumerate(verdicts) if v is not None]
        if bad:
            rank, verdict = bad[0]
            raise ValueError(f"rank {rank} of {self.size} rejected its {what}: {verdict}")
        ours = verdicts[0][1] or {}
        for rank, (_, theirs) in enumerate(verdicts[1:], 1):
            theirs = theirs or {}
            for key in dict.fromkeys([*ours, *theirs]):
                a, b = ours.get(key), theirs.get(key)
                if a == b:
                    continue
                if isinstance(a, tuple) and isinstance(b, tuple) and a[:2] == b[:2]:  # a tensor's signature
                    detail = f"{key} ({a[0]}, shape {a[1]}) holds other values on rank {rank} than on rank 0"
                elif isinstance(a, tuple) and isinstance(b, tuple):
                    detail = f"{key} is {a[0]} of shape {a[1]} on rank 0 and {b[0]} of shape {b[1]} on rank {rank}"
                else:
                    detail = f"{key} is {a!r} on rank 0 and {b!r} on rank {rank}"
                raise ValueError(f"gpnys row partition: the ranks hold different {what}: {detail}; every rank must "
                                 "pass the same data, settings and options")

    def minimum(self, what: str, value: int) -> int:
        """The smallest of every rank's ``value``: a choice each rank makes from its own device (its free memory)
        that all of them must then make alike. One all-gather of plain integers."""
        if self.size == 1:
            return int(value)
        values: list[Any] = [None] * self.size
        self._collective(what, dist.all_gather_object, values, int(value))
        return min(values)

    def gather(self, what: str, local: torch.Tensor, inputs: list[torch.Tensor],
               failure: BaseException | None = None) -> list[torch.Tensor]:
        """All ranks' ``local`` blocks (equal shapes), after checking that every rank used the same ``inputs`` and
        that none failed computing its block (``failure``: this rank's error, re-raised here after the gather, so
        that the ranks stay in step; the others raise ``RuntimeError`` naming it)."""
        if self.size == 1:  # nothing to exchange or compare: on a GPU a collective and its host read cost a
            if failure is not None:  # host synchronisation each (docs/scaling.md)
                raise failure
            return [local]
        # exact sample rows, not sums: a sum's rounding depends on the rank's thread count, a sample's bits do not
        check = torch.cat([x[torch.linspace(0, x.shape[0] - 1, min(x.shape[0], SAMPLE_ROWS), device=x.device).long()]
                           .reshape(-1) for x in inputs] + [local.new_tensor([float(failure is not None)])])
        flat = torch.cat([local.reshape(-1), check.to(local.dtype)])
        parts = [torch.empty_like(flat) for _ in range(self.size)]
        self._collective(what, dist.all_gather, parts, flat)
        STATS["bytes_received"] += (self.size - 1) * flat.numel() * flat.element_size()
        sums = [p[-check.numel():] for p in parts]
        # one host read for every rank's failure flag and every input comparison (each read waits for the GPU)
        # the same NaN on every rank is the same input: compared as equal values or both NaN
        status = torch.stack([p[-1] != 0 for p in parts] + [
            ((s != sums[0]) & ~(s.isnan() & sums[0].isnan())).any() for s in sums[1:]]).tolist()
        failed = [r for r in range(self.size) if status[r]]
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError(f"gpnys row partition: rank {failed[0]} of {self.size} failed computing its {what} "
                               "(its own error names the cause)")
        if any(status[self.size:]):
            raise ValueError(f"gpnys row partition: the ranks passed different inputs to the {what}; every "
                             "rank must hold the same inputs and hyperparameters and run the same thread count "
                             "(seed each rank's generator identically, e.g. torch.manual_seed(seed) on all)")
        return [p[: local.numel()].view_as(local) for p in parts]

    def gather_rows(self, what: str, n: int, compute: Callable[[int, int], torch.Tensor],
                    inputs: list[torch.Tensor], tail: tuple[int, ...] = ()) -> torch.Tensor:
        """``(n, *tail)``: every rank computes its rows ``compute(a, b)`` (``(b - a, *tail)``, called only for a
        non-empty range) into its block of the result, and one ``all_gather_single`` fills the others' blocks on
        all ranks, after a small gather of the input checks; ``inputs[0]`` gives dtype and device. An error in
        ``compute`` is raised on its rank after the checks' gather, and a ``RuntimeError`` on the others."""
        if self.size == 1:  # (gather's shortcut, without the copy into a padded block)
            return compute(0, n) if n else inputs[0].new_zeros(0, *tail)
        a, b = self.rows(n)
        chunk = row_range(n, 0, self.size)[1]
        # every rank's rows land in one buffer, this rank's block in place (all_gather_single): (n, *tail) received
        # once, where a list of blocks and their concatenation held it twice (2 n k at AFN's V: 40 GB at n = 10^7)
        out = inputs[0].new_empty(self.size * chunk, *tail)
        mine = out[self.rank * chunk : (self.rank + 1) * chunk]  # rows past n (the last ranks') are cut below

        def fill() -> torch.Tensor:
            if b > a:
                mine[: b - a] = compute(a, b)
            return out.new_zeros(0)

        # the input checks and failure flags first, in a small gather of their own: a failure stops every rank
        # before the rows travel, and the rows need no room for the checks
        self._gather_computed(f"{what} checks", fill, lambda: out.new_zeros(0), inputs)
        self._collective(what, _all_gather_single, out, mine)
        STATS["bytes_received"] += (self.size - 1) * mine.numel() * mine.element_size()
        return out[:n]

    def _gather_computed(self, what: str, compute: Callable[[], torch.Tensor], zeros: Callable[[], torch.Tensor],
                         inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`gather` of this rank's ``compute()``; an error in it rides the gather (``zeros()`` standing in
        for the block), so that no rank waits for the group's timeout."""
        failure = None
        try:
            local = compute()
        except Exception as err:  # noqa: BLE001 - any error: the other ranks wait in the gather otherwise
            failure, local = err, zeros()
        return self.gather(what, local, inputs, failure)

    def gather_sum(self, what: str, compute: Callable[[], torch.Tensor], zeros: Callable[[], torch.Tensor],
                   inputs: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's ``compute()`` (equal shapes), added in rank order on all ranks, so that every rank holds the
        same bits (an all-reduce's order would be the library's). An error in ``compute`` rides the gather as in
        :meth:`gather_rows`, ``zeros()`` standing in for the failed block."""
        return _added(self._gather_computed(what, compute, zeros, inputs))

    def split_sum(self, what: str, compute: Callable[..., torch.Tensor], shared: tuple[torch.Tensor, ...],
                  zeros: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's ``compute(*shared)`` (equal shapes; its share of a sum over rows) added in rank order on all
        ranks, differentiable in ``shared`` (tensors computed alike on every rank, with autograd): the backward
        hands each rank's partial the same upstream gradient and adds the ranks' gradients with respect to
        ``shared``, so every rank holds the whole gradient — the conjugate ``f`` / ``g`` pair of Megatron-LM's
        tensor parallelism (Shoeybi et al. 2019) in one function. Every rank must run the same backward passes (they
        do, with replicated losses); a double or batched (``is_grads_batched``) backward through it raises
        ``RuntimeError`` on every rank before any collective. An error in ``compute`` or in its
        backward on one rank is raised there after the gather, and a ``RuntimeError`` naming it on the others."""
        return _SplitSum.apply(self, what, compute, zeros, inputs, *shared)

    def tall_svd(self, what: str, n: int, k: int, compute: Callable[[int, int], torch.Tensor],
                 inputs: list[torch.Tensor], driver: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Thin SVD ``B = U diag(sigma) W^T`` of an ``(n, k)`` matrix whose rows ``[a, b)`` this rank computes
        (``compute(a, b)``): ``U (n, k)`` on every rank, ``sigma (k,)`` descending. By TSQR (Demmel, Grigori, Hoemmen
        & Langou 2012): ``B_r = Q_r R_r`` on each rank, one gather of the ``k x k`` factors ``R_r``, the stacked
        ``[R_0; ...; R_{P-1}] = Q' R`` and ``R = U_R diag(sigma) W^T`` on every rank, ``U_r = Q_r Q'_r U_R`` and one
        gather of ``U``'s rows: ``O(n k^2 / P)`` per rank, ``P k^2 + n k`` values received. ``compute`` is called
        once on every rank, with an empty range ``a = b`` on a rank without rows, so that an error in the work it
        shares (say, a factor every rank needs) rides the gather too; ``inputs[0]`` gives dtype and device.
        ``driver``: as ``torch.linalg.svd``'s, for the ``k x k`` SVD."""
        a, b = self.rows(n)
        like = inputs[0]
        local: dict[str, torch.Tensor] = {}

        def r_factor() -> torch.Tensor:
            local["Q"], R_r = torch.linalg.qr(compute(a, b))  # (m, min(m, k)), (min(m, k), k)
            R = like.new_zeros(k, k)
            R[: R_r.shape[0]] = R_r  # a short block's R padded with zero rows
            return R

        Rs = self._gather_computed(f"{what} R factors", r_factor, lambda: like.new_zeros(k, k), inputs)
        Q2, R = torch.linalg.qr(torch.cat(Rs))
        U_R, sigma, _ = torch.linalg.svd(R, driver=driver)
        W = Q2[self.rank * k : (self.rank + 1) * k] @ U_R  # (k, k): this rank's Q'_r U_R
        U = self.gather_rows(f"{what} U rows", n, lambda a_, b_: local["Q"] @ W[: local["Q"].shape[1]], inputs, (k,))
        return U, sigma

def signature(**tensors: torch.Tensor | None) -> dict[str, Any]:
    """Plain values that identify each tensor exactly, for :meth:`RowGroup.agree`: dtype, shape and two integer sums
    of its bit patterns (plain and position-weighted, wrapping in int64): exact and independent of the summation
    order, so every rank gets the same numbers for the same bits, and a changed entry or a swap of two changes
    them. One host read per tensor."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if t is None:
            out[name] = None
            continue
        flat = t.detach().contiguous().reshape(-1)
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        ints = flat.view(bits).to(torch.int64)
        weights = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=ints.device)
        sums = torch.stack([ints.sum(), (ints * weights).sum()]).tolist() if ints.numel() else [0, 0]
        out[name] = (str(t.dtype), tuple(t.shape), *sums)
    return out


def gather_rows(group: RowGroup | None, what: str, n: int, compute: Callable[[int, int], torch.Tensor],
                inputs: list[torch.Tensor], tail: tuple[int, ...] = ()) -> torch.Tensor:
    """``compute(0, n)`` without a group, else :meth:`RowGroup.gather_rows` (the same rows, split over the ranks)."""
    return compute(0, n) if group is None else group.gather_rows(what, n, compute, inputs, tail)
