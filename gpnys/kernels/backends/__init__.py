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

import torch

from gpnys.checks import validate_choice
from gpnys.collectives import LEAF
from gpnys.kernels.backends.base import KernelBackend, check_rows
from gpnys.kernels.formulas import Formula
from gpnys.launch import interpreting, triton_available

__all__ = ["BACKENDS", "LEAF", "KernelBackend", "check_rows", "select_backend", "make_backend",
           "triton_available"]

BACKENDS = ("torch", "triton", "keops")


def select_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend name for tensors on ``device``: ``backend`` when given (validated), else ``"triton"`` on CUDA
    when triton is importable, else ``"torch"``. Raises ``ValueError`` for an unknown name, for ``"keops"``
    without pykeops, for ``"triton"`` without triton, and for ``"triton"`` on CPU tensors outside the interpreter."""
    device = torch.device(device)
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    validate_choice(backend, "backend", BACKENDS, also="(or None)")
    if backend == "keops":
        from gpnys.kernels.backends import keops

        if not keops.available():
            raise ValueError("backend='keops' needs pykeops (pip install pykeops)")
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs triton (pip install triton)")
        if device.type != "cuda" and not interpreting():
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
