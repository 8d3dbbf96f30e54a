"""Compute backends of the on-the-fly kernel operator, behind one interface and chosen in one place.

A backend evaluates the unit-variance stationary kernel ``K = k(Z, Z)`` of scaled points ``Z`` (``(n, d)``) without
storing it, for the two passes :class:`~gpnys.kernels.operator.StationaryKernelOperator` needs:

* ``matmul(Z, R, plan)``: ``K R`` (``R: (n, t)``);
* ``derivative_sums(Z, U, V, plan)``: ``s = sum_ij w_ij k_ij`` and ``g_d = sum_ij w_ij h_ij (z_id - z_jd)^2``
  with ``w_ij = u_i . v_j`` — the outputscale and length-scale derivatives of ``sum_t u_t^T K v_t`` up to the
  factors the operator applies (its module docstring);
* ``column_derivative_sums(Z, U, V, plan, isotropic)``: the same two sums for each column pair ``(u_j, v_j)``
  alone (the trace estimator's per-probe terms, for its standard error).

``plan`` is a :class:`~gpnys.kernels.cutoff.LeafPlan` (``Z`` and the vectors are then in its working order and
only the listed leaf pairs are computed) or ``None`` (every pair). ``rows = (a, b)`` restricts a pass to the rows
``a <= i < b`` of the working order (``a`` and ``b`` multiples of :data:`LEAF`, or ``b = n``): the product returns
those rows of ``K R``, the sums run over the pairs ``(i, j)`` with ``i`` in the range. A row-partitioned operator
(:mod:`.partitioned`) gives each process one range. Kernel formulas come from :mod:`gpnys.kernels.formulas`.

===========  =================================================================  ===============================
backend      what                                                               chosen
===========  =================================================================  ===============================
``torch``    row / leaf tiles in torch, in place (:mod:`.torch_tiles`)          CPU (default); any device
``triton``   fused Triton kernels, K never leaves registers (:mod:`.triton_fused`)  CUDA (default, when triton
                                                                                    imports); CPU tensors only
                                                                                    under ``TRITON_INTERPRET=1``
``keops``    KeOps reductions (:mod:`.keops`); no cutoff skipping                only when asked for
===========  =================================================================  ===============================

KeOps is never chosen automatically: some pykeops / CUDA combinations crash the process at the first reduction,
and a segfault cannot be caught (docs/gpu.md, "Compute backends").
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from gpnys.kernels.formulas import Formula

if TYPE_CHECKING:
    from gpnys.kernels.cutoff import LeafPlan

__all__ = ["BACKENDS", "LEAF", "KernelBackend", "check_rows", "select_backend", "make_backend",
           "triton_available"]

BACKENDS = ("torch", "triton", "keops")

#: row granularity of a partial pass (``rows=``): the cutoff plan's leaf and the Triton tile
LEAF = 64

Rows = tuple[int, int]


def check_rows(n: int, rows: Rows | None) -> Rows:
    """``rows`` (``None``: all ``n``) as ``(a, b)``; ``ValueError`` unless a range of whole :data:`LEAF`-point blocks
    within ``[0, n]`` (``b = n`` may end a partial block)."""
    if rows is None:
        return 0, n
    a, b = (int(r) for r in rows)
    if a % LEAF or (b % LEAF and b != n) or not 0 <= a <= b <= n:
        raise ValueError(f"rows must be a range of whole {LEAF}-point blocks within [0, {n}], got {rows}")
    return a, b


class KernelBackend(ABC):
    """Products and derivative sums of the unit kernel ``k(Z, Z)`` (module docstring).

    Args:
        formula: the kernel's row of :data:`gpnys.kernels.formulas.FORMULAS`.
        tf32: let float32 tile products use TF32 tensor cores (Triton on CUDA only; ~1e-3 relative error).
    """

    name: str = ""

    def __init__(self, formula: Formula, tf32: bool = False) -> None:
        self.formula = formula
        self.tf32 = bool(tf32)

    @abstractmethod
    def matmul(self, Z: torch.Tensor, R: torch.Tensor, plan: LeafPlan | None, rows: Rows | None = None) -> torch.Tensor:
        """``k(Z, Z) @ R`` for ``Z: (n, d)``, ``R: (n, t)`` (working order): ``(n, t)``, or its rows ``rows``
        (``(b - a, t)``)."""

    @abstractmethod
    def derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                        rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, g)``: ``()`` and ``(d,)`` tensors in at least float64 (module docstring)."""

    def column_derivative_sums(self, Z: torch.Tensor, U: torch.Tensor, V: torch.Tensor, plan: LeafPlan | None,
                               isotropic: bool = False, rows: Rows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`derivative_sums` of each column pair ``(U[:, j], V[:, j])`` alone: ``s (t,)`` and ``g (t, d)``
        (``(t, 1)``, summed over the dimensions, when ``isotropic``), in at least float64. This default makes one
        :meth:`derivative_sums` pass per column; the torch tiles and Triton do all columns in one pass."""
        acc = torch.promote_types(Z.dtype, torch.float64)
        t, d = U.shape[1], Z.shape[1]
        s, g = Z.new_zeros(t, dtype=acc), Z.new_zeros(t, d, dtype=acc)
        for j in range(t):
            s[j], g[j] = self.derivative_sums(Z, U[:, j : j + 1], V[:, j : j + 1], plan, rows)
        return s, (g.sum(1, keepdim=True) if isotropic else g)


def triton_available() -> bool:
    """Whether ``triton`` is importable."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def select_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend name for tensors on ``device``: ``backend`` when given (validated), else ``"triton"`` on CUDA
    when triton is importable, else ``"torch"``. Raises ``ValueError`` for an unknown name, for ``"keops"``
    without pykeops, for ``"triton"`` without triton, and for ``"triton"`` on CPU tensors outside the interpreter."""
    device = torch.device(device)
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or None), got {backend!r}")
    if backend == "keops":
        from gpnys.kernels.backends import keops

        if not keops.available():
            raise ValueError("backend='keops' (keops=True) needs pykeops (pip install pykeops)")
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs triton (pip install triton)")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"backend='triton' runs on CUDA tensors, or on {device.type} tensors under "
                             "TRITON_INTERPRET=1 (set before triton is first imported)")
    return backend


def make_backend(name: str, formula: Formula, tf32: bool = False) -> KernelBackend:
    """An instance of backend ``name`` (one of :data:`BACKENDS`, as returned by :func:`select_backend`)."""
    if name == "torch":
        from gpnys.kernels.backends.torch_tiles import TorchTiles

        return TorchTiles(formula, tf32)
    if name == "triton":
        from gpnys.kernels.backends.triton_fused import TritonBackend

        return TritonBackend(formula, tf32)
    if name == "keops":
        from gpnys.kernels.backends.keops import KeOpsBackend

        return KeOpsBackend(formula, tf32)
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
