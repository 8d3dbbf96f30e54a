"""Row-partitioned kernel passes across the processes of a ``torch.distributed`` group (docs/scaling.md, "Across
processes and GPUs").

Every rank holds all of ``Z`` (``n x d``, small) and the right-hand sides; rank ``r`` of ``P`` owns the rows
``[r c, (r + 1) c)`` of the working order (:func:`gpnys.collectives.row_range`). Then

* ``K R``: each rank computes its rows with the wrapped backend (``rows=``) and ``all_gather`` assembles the
  ``(n, t)`` product on every rank (``n t`` values received per product); with the torch tiles' symmetric product
  each rank computes a share of the upper triangle's tiles instead (:meth:`TorchTiles.upper_split`, equal shares of
  entries) into an ``(n, t)`` partial product, and the partials are gathered and added in rank order
  (:meth:`RowGroup.gather_sum`: ``P n t`` values, half the kernel entries);
* the derivative sums (``sum_ij``, all pairs): each rank sums its rows' pairs, and the same gather (``d + 1``
  values per rank, ``t (d + 1)`` for the per-probe sums) lets every rank add them in rank order.

The rows, the rank-ordered sums and the checks that every rank passed the same vectors are
:mod:`gpnys.collectives`'s (:class:`~gpnys.collectives.RowGroup`), which the preconditioner builds use as well.
Everything downstream (PCG, SLQ, the preconditioner applies) runs unchanged on replicated vectors, so its results
match one process to rounding. Written by hand because no library partitions a recomputed kernel by rows.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from gpnys.collectives import RowGroup, Rows
from gpnys.kernels.backends.base import KernelBackend
from gpnys.kernels.cutoff import LeafPlan

__all__ = ["PartitionedBackend"]

class PartitionedBackend(KernelBackend):
    """``inner``'s passes split by rows over the ranks of ``group`` (module docstring)."""

    name = "partitioned"

    def __init__(self, inner: KernelBackend, group: Any) -> None:
        super().__init__(inner.formula, inner.tf32)
        self.inner, self.ranks = inner, RowGroup(group)

    def _share(self, n: int, plan: LeafPlan | None) -> Rows:
        """This rank's row blocks of the upper tiles (``inner.upper_split``: equal shares of the entries)."""
        cuts = self.inner.upper_split(n, plan, self.ranks.size)
        return cuts[self.ranks.rank], cuts[self.ranks.rank + 1]

    def _rank_pass(self, name: str, n: int, plan: LeafPlan | None, rows: Rows | None, *args: Any) -> Callable[[], Any]:
        """``inner.<name>(*args, rows)`` as a call for this rank: over its share of the upper tiles when the inner
        backend has the symmetric ``upper_<name>`` (the torch tiles), else over its rows."""
        mine = self._own_rows(n, rows)
        upper = getattr(self.inner, f"upper_{name}", None)
        if upper is None:
            return lambda: getattr(self.inner, name)(*args, mine)
        share = self._share(n, plan)
        return lambda: upper(*args, share)

    def _own_rows(self, n: int, rows: Rows | None) -> Rows:
        """This rank's :func:`row_range`; a caller's own ``rows`` cannot be split further."""
        if rows is not None:
            raise ValueError("a partitioned backend splits the rows itself (rows=None)")
        return self.ranks.rows(n)

    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None, rows: Rows | None = None) -> torch.Tensor:
        n = Z.shape[0]
        self._own_rows(n, rows)
        upper = getattr(self.inner, "upper_matmul", None)
        if upper is None:  # each rank's rows of K R, stacked
            return self.ranks.gather_rows("product", n, lambda a, b: self.inner.matmul(Z, R, plan, (a, b)), [R],
                                          (R.shape[1],))
        # the symmetric product (torch tiles): each rank its share of the upper triangle's tiles, summed
        share = self._share(n, plan)
        return self.ranks.gather_sum("product", lambda: upper(Z, R, plan, share), lambda: R.new_zeros(n, R.shape[1]),
                                     [R])

    def _sums(self, what: str, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]], shapes: tuple[tuple, tuple],
              Z: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's ``(s, g)`` from ``compute()`` over its rows, added in rank order on all ranks
        (:meth:`RowGroup.gather_sum`: an error in one rank's pass, say out of memory, is raised there and names
        it on the others, with no wait for the group's timeout)."""
        acc = torch.promote_types(Z.dtype, torch.float64)
        ns = math.prod(shapes[0])

        def flat() -> torch.Tensor:
            s, g = compute()
            return torch.cat([s.reshape(-1), g.reshape(-1)])

        total = self.ranks.gather_sum(what, flat, lambda: Z.new_zeros(ns + math.prod(shapes[1]), dtype=acc), inputs)
        return total[:ns].reshape(shapes[0]), total[ns:].reshape(shapes[1])

    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        compute = self._rank_pass("derivative_sums", Z.shape[0], plan, rows, Z, U, V, plan)
        return self._sums("derivative sums", compute, ((), (Z.shape[1],)), Z, [U, V])

    def column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                               isotropic: bool = False, rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        t = U.shape[1]
        compute = self._rank_pass("column_derivative_sums", Z.shape[0], plan, rows, Z, U, V, plan, isotropic)
        return self._sums("per-probe derivative sums", compute, ((t,), (t, 1 if isotropic else Z.shape[1])), Z,
                          [U, V])
