"""The Triton backend: launches the fused kernels of :mod:`.triton_kernels` (CUDA; CPU tensors under the interpreter).

Tiles are ``BLOCK = 64`` points square, the cutoff plan's leaf size, so a block-sparse pass walks the plan's CSR
leaf lists directly. Right-hand sides go in column blocks of ``BT = 16 .. 64``, or, for ``2^m + 1`` of them,
one ``2^m`` block and one elementwise column (``TAIL``). float32 tile products use full
FP32 (``input_precision="ieee"``) unless TF32 is asked for; float64 runs in FP64 throughout.

Numerical trouble cannot be silent: if a kernel fails to compile or launch (say, an FP64 ``tl.dot`` on a GPU or a
Triton build without it), :class:`TritonBackend` warns once and answers with the torch tiles instead
(:func:`gpnys.launch.guarded_launch`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gpnys.collectives import LEAF
from gpnys.kernels.backends.base import KernelBackend, check_rows
from gpnys.kernels.cutoff import LeafPlan
from gpnys.launch import guarded_launch

__all__ = ["TritonBackend", "BLOCK"]

#: points per tile side (= :attr:`StationaryKernelOperator.LEAF`, the cutoff plan's leaf)
BLOCK = LEAF


def _pow2(x: int, lo: int, hi: int) -> int:
    p = lo
    while p < x and p < hi:
        p *= 2
    return p


class TritonBackend(KernelBackend):
    """Fused Triton products and derivative sums (module docstring)."""

    name = "triton"

    def _constants(self, dtype: torch.dtype) -> dict[str, Any]:
        import triton.language as tl

        f = self.formula
        p = f.p + (0.0,) * (3 - len(f.p))
        q = f.q + (0.0,) * (2 - len(f.q))
        if len(f.p) > 3 or len(f.q) > 2:  # pragma: no cover - the table has degree <= 2
            raise ValueError("the Triton kernels take kernel polynomials of degree <= 2")
        prec = "tf32" if self.tf32 and dtype == torch.float32 else "ieee"
        return dict(DT=tl.float64 if dtype == torch.float64 else tl.float32, PREC=prec, RBF=f.rbf,
                    SINGULAR=f.singular, C=f.c, C2=f.c2, P0=p[0], P1=p[1], P2=p[2], NP=max(1, len(f.p)),
                    Q0=q[0], Q1=q[1], NQ=max(1, len(f.q)))

    @staticmethod
    def _lists(Z: torch.Tensor, plan: LeafPlan | None) -> tuple[bool, torch.Tensor, torch.Tensor, int]:
        nblocks = -(-Z.shape[0] // BLOCK)
        if plan is None:
            dummy = torch.zeros(1, dtype=torch.int64, device=Z.device)
            return False, dummy, dummy, nblocks
        if plan.leaf != BLOCK:
            raise ValueError(f"the Triton backend needs a cutoff plan with leaf {BLOCK}, got {plan.leaf}")
        return True, plan.near_ptr_t.to(Z.device), plan.near_idx.to(device=Z.device, dtype=torch.int64), nblocks

    def _guarded(self, fused: Callable[..., Any], name: str, Z: torch.Tensor, *args: Any) -> Any:
        """``fused(Z, *args)``, or the torch tiles' pass ``name`` once a kernel failed for this key (one warning).
        The row range (the last of ``args``) is validated first: a bad argument is not a kernel failure."""
        from gpnys.kernels.backends.torch_tiles import TorchTiles

        check_rows(Z.shape[0], args[-1])
        return guarded_launch("kernel", Z.device, Z.dtype, self.tf32, lambda: fused(Z, *args),
                              lambda: getattr(TorchTiles(self.formula, self.tf32), name)(Z, *args), "the torch tiles")

    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self._guarded(self._matmul, "matmul", Z, R, plan, rows)

    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._guarded(self._derivative_sums, "derivative_sums", Z, U, V, plan, rows)

    def column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                               isotropic: bool = False,
                               rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._guarded(self._column_sums, "column_derivative_sums", Z, U, V, plan, isotropic, rows)

    @staticmethod
    def _blocks(n: int, rows: tuple[int, int] | None) -> tuple[int, int]:
        """``(first row block, number of row blocks)`` of a pass over ``rows`` (all when ``None``)."""
        a, b = check_rows(n, rows)
        return a // BLOCK, (-(-b // BLOCK) - a // BLOCK) if b > a else 0

    @staticmethod
    def _coords(Z: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``ZT (d, npad)``: ``Z`` transposed and zero-padded to whole tiles (the kernels' unmasked coordinate loads),
        and the constants that go with it: ``D = d``, ``HOIST`` (the row block's coordinates stay in registers: float32
        and ``d <= 4``; more spill on sm_90)."""
        n, d = Z.shape
        ZT = Z.new_zeros(d, -(-n // BLOCK) * BLOCK)
        ZT[:, :n] = Z.mT
        return ZT, dict(D=d, HOIST=d <= 4 and Z.dtype == torch.float32)

    @staticmethod
    def _padded(R: torch.Tensor, npad: int, dtype: torch.dtype) -> torch.Tensor:
        """``R (n, t)`` as a contiguous ``(npad, t)`` block of ``dtype``, zero below row ``n`` (unmasked loads)."""
        if R.shape[0] == npad:
            return R.to(dtype).contiguous()
        out = R.new_zeros(npad, R.shape[1], dtype=dtype)
        out[: R.shape[0]] = R
        return out

    @staticmethod
    def _columns(t: int, hi: int, dtype: torch.dtype) -> tuple[int, int]:
        """``(BT, TAIL)``: in float32, ``t = 2^m + 1`` columns (``16 <= 2^m <= hi``) go as one ``2^m``-wide block
        plus one elementwise column; other counts in blocks of ``BT = 16 .. hi`` (the last one padded). (In float64
        the elementwise column's ``(64, 64)`` accumulator spills registers on sm_90.)"""
        if dtype == torch.float32 and 16 < t <= hi + 1 and (t - 1) & (t - 2) == 0:
            return t - 1, 1
        return _pow2(t, 16, hi), 0

    def _operands(self, Z: torch.Tensor, mats: tuple[torch.Tensor, ...], hi: int
                  ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, Any], int]:
        """What a pass launches with: ``ZT`` (:meth:`_coords`), ``mats`` (``(n, t)`` each) zero-padded to its rows
        (:meth:`_padded`), the compile-time constants (``BLOCK``, ``D``, ``HOIST``, ``BT`` and ``TAIL`` of
        :meth:`_columns` for column blocks of at most ``hi``, the formula's) and the number of column blocks."""
        t = mats[0].shape[1]
        ZT, consts = self._coords(Z)
        bt, tail = self._columns(t, hi, Z.dtype)
        consts.update(BLOCK=BLOCK, BT=bt, TAIL=tail, **self._constants(Z.dtype))
        return ZT, [self._padded(A, ZT.shape[1], Z.dtype) for A in mats], consts, -(-(t - tail) // bt)

    def _column_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                     isotropic: bool, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One launch over (row block, column block, plane): plane 0 gives ``s``, planes ``1..`` give ``g``
        (:func:`~.triton_kernels.column_kernel`); ``(1 + d)`` products' work, or 2 when ``isotropic``."""
        from gpnys.kernels.backends.triton_kernels import column_kernel

        n, d = Z.shape
        t = U.shape[1]
        planes = 2 if isotropic else 1 + d
        sparse, ptr, idx, nblocks = self._lists(Z, plan)
        row0, local = self._blocks(n, rows)
        out = torch.zeros(nblocks, planes, t, dtype=torch.float64, device=Z.device)
        if local and t:
            ZT, (U, V), consts, blocks = self._operands(Z, (U, V), 64)
            column_kernel[(local, blocks, planes)](ZT, U, V, out, n, ZT.shape[1], t, ptr, idx, nblocks, row0, planes,
                                                   SPARSE=sparse, ISO=isotropic, **consts)
        total = out.sum(0)  # (planes, t)
        return total[0], total[1:].mT

    def _matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None,
                rows: tuple[int, int] | None = None) -> torch.Tensor:
        from gpnys.kernels.backends.triton_kernels import kv_kernel

        n, t = Z.shape[0], R.shape[1]
        row0, local = self._blocks(n, rows)
        a, b = check_rows(n, rows)
        out = R.new_empty(b - a, t, dtype=Z.dtype)
        if local == 0 or t == 0:
            return out.zero_()
        sparse, ptr, idx, nblocks = self._lists(Z, plan)
        ZT, (R,), consts, blocks = self._operands(Z, (R,), 64)
        kv_kernel[(local, blocks)](ZT, R, out, n, ZT.shape[1], t, ptr, idx, nblocks, row0, SPARSE=sparse, **consts)
        return out

    def _derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                         rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from gpnys.kernels.backends.triton_kernels import derivative_kernel

        n, d = Z.shape
        t = U.shape[1]
        sparse, ptr, idx, nblocks = self._lists(Z, plan)
        row0, local = self._blocks(n, rows)
        dp = _pow2(d, 1, 1 << 30)
        s = torch.zeros(nblocks, dtype=torch.float64, device=Z.device)
        g = torch.zeros(nblocks, dp, dtype=torch.float64, device=Z.device)
        if local and t:
            ZT, (U, V), consts, _ = self._operands(Z, (U, V), 32)  # (one program loops over the column blocks)
            derivative_kernel[(local,)](ZT, U, V, s, g, n, ZT.shape[1], t, ptr, idx, nblocks, row0, SPARSE=sparse,
                                        DP=dp, **consts)
        return s.sum(), g.sum(0)[:d]
