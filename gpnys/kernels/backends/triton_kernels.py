"""Fused Triton kernels for the unit stationary kernel: the product ``K V`` and the derivative sums.

Imported lazily by :class:`gpnys.kernels.backends.TritonBackend` (``triton.jit`` decides at import time whether
it compiles for the GPU or runs under the interpreter, ``TRITON_INTERPRET=1``, which is how CI checks these
kernels on CPU tensors). Written by hand because no maintained library fuses distance, kernel formula and tile
product for GPyTorch's kernels without KeOps; ``torch.compile`` of the tile loop is slower (docs/gpu.md).

Each program owns one row block ``I`` (``BLOCK`` consecutive points of the working order) and loops over column
blocks ``J``: all of them (dense), or the leaves the cutoff plan lists for ``I`` (block-sparse, CSR
``ptr``/``idx``: :class:`gpnys.kernels.cutoff.LeafPlan` with ``leaf == BLOCK``). A tile ``K[I, J]`` lives in
registers only:

* ``r^2_ij = sum_d (z_id - z_jd)^2`` from explicit differences (exact zero diagonal, no expanded-form
  cancellation), then ``k`` and ``h = k'/r`` from :mod:`gpnys.kernels.formulas`'s coefficients (compile-time);
  the coordinates come transposed and zero-padded, ``ZT (D, npad)`` with ``npad`` a multiple of ``BLOCK``, so
  their loads need no masks, and the row block's own ``D`` coordinate vectors stay in registers for the whole loop
  (``HOIST``: float32, ``D <= 4``); ``V`` and ``U`` come zero-padded alike, so a padded point (finite) adds zeros;
* product: ``out[I] += K[I, J] @ V[J]`` (``tl.dot``, full-precision FP32 unless TF32 is asked for);
* derivative: ``W = U[I] V[J]^T``, ``s += sum W o K``, ``g_d += sum (W o H) o (z_Id - z_Jd)^2`` — the
  outputscale and per-dimension length-scale sums of :mod:`gpnys.kernels.operator` (FP32 tiles are reduced
  into FP64 row accumulators);
* column sums: the same sums for each column pair ``(u_j, v_j)`` alone (the trace estimator's per-probe terms):
  plane ``0`` accumulates ``K[I, J] @ V[J]``, plane ``1 + dd`` ``(H o (z_dd - z_dd')^2)[I, J] @ V[J]`` (one plane
  ``H o R^2`` when isotropic), and ends with ``sum_{i in I} u_ij (.)_ij`` per column.

``TAIL``: with ``t = 2^m + 1`` columns (16 probes and one solve, say) the last column is not padded into a
``2^(m+1)``-wide ``tl.dot`` but accumulated elementwise (``k * v_j`` in a ``(BLOCK, BLOCK)`` register tile, one
row sum at the end; float32 only): the column count of an FP32 dot is most of a tile's instructions, so the
padded half would nearly double them (docs/gpu.md, "The kernels' instruction budget").
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpnys.launch import interpreting

__all__ = ["kv_kernel", "derivative_kernel", "column_kernel"]


if interpreting():  # triton.jit reads the same switch

    @triton.jit
    def _exp2(x):
        """``2^x`` (the interpreter has no PTX)."""
        return tl.exp2(x)

else:

    @triton.jit
    def _exp2(x):
        """``2^x``; in FP32 one ``ex2.approx.ftz`` (MUFU.EX2): ``tl.exp2`` adds a range check and two rescaling
        multiplies per entry for subnormal results, values below 1.2e-38 that the kernel sums cannot see."""
        if x.dtype == tl.float32:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.exp2(x)


@triton.jit
def _kh(r2, RBF: tl.constexpr, SINGULAR: tl.constexpr, C: tl.constexpr, C2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
        P2: tl.constexpr, NP: tl.constexpr, Q0: tl.constexpr, Q1: tl.constexpr, NQ: tl.constexpr):
    """``(k, h)`` of the unit kernel at squared distances ``r2`` (``formulas.Formula`` as constants); the
    exponentials as ``2^(r * -C log2 e)``, the constant folded at compile time."""
    if RBF:
        k = _exp2(r2 * (-0.5 * 1.4426950408889634))
        h = -k
    else:
        r = tl.sqrt(r2)
        a = C * r
        e = _exp2(r * (-C * 1.4426950408889634))
        if NP == 1:
            k = P0 * e
        elif NP == 2:
            k = (P0 + P1 * a) * e
        else:
            k = (P0 + a * (P1 + P2 * a)) * e
        if SINGULAR:  # h = C^2 Q0 e / a, 0 at a = 0 (it multiplies (z_d - z'_d)^2 = 0 there)
            pos = a > 0.0
            h = tl.where(pos, (C2 * Q0) * e / tl.where(pos, a, 1.0), 0.0)
        elif NQ == 1:
            h = (C2 * Q0) * e
        else:
            h = C2 * (Q0 + Q1 * a) * e
    return k, h


@triton.jit
def _row_coords(ZT, rows, npad, D: tl.constexpr, HOIST: tl.constexpr):
    """The row block's coordinates: a tuple of ``D`` ``(BLOCK,)`` vectors, loaded once per program (``HOIST``), or
    ``()`` (loaded per tile by :func:`_diff`: with the tile layout a thread holds 32 rows, so more than 4 dimensions,
    or float64 ones, kept in registers spill on sm_90)."""
    zi = ()
    if HOIST:
        for dd in tl.static_range(D):
            zi = zi + (tl.load(ZT + dd * npad + rows),)
    return zi


@triton.jit
def _diff(zi, ZT, rows, cols, npad, p, dd, HOIST: tl.constexpr):
    """``(BLOCK, BLOCK)`` coordinate differences ``z_i,dd - z_j,dd`` (``ZT (D, npad)``, zero-padded) in the
    column-block loop's iteration ``p``."""
    if HOIST:
        a = zi[dd]
    else:  # the mask (always true) varies with p: Triton would hoist a loop-invariant load, and spill registers
        a = tl.load(ZT + dd * npad + rows, mask=rows < npad + p, other=0.0)
    return a[:, None] - tl.load(ZT + dd * npad + cols)[None, :]


@triton.jit
def _sq_dist(zi, ZT, rows, cols, npad, p, BLOCK: tl.constexpr, D: tl.constexpr, HOIST: tl.constexpr):
    """``(BLOCK, BLOCK)`` squared distances between rows ``rows`` and ``cols`` (explicit differences)."""
    if HOIST:
        diff = _diff(zi, ZT, rows, cols, npad, p, 0, HOIST)
        r2 = diff * diff
        for dd in tl.static_range(1, D):
            diff = _diff(zi, ZT, rows, cols, npad, p, dd, HOIST)
            r2 += diff * diff
    else:  # a loop, one dimension live at a time: unrolled, the loads of all of them come first, and spill
        r2 = tl.zeros((BLOCK, BLOCK), dtype=ZT.dtype.element_ty)
        for dd in range(0, D):
            diff = _diff(zi, ZT, rows, cols, npad, p, dd, HOIST)
            r2 += diff * diff
    return r2


@triton.jit
def _block_range(ptr, i, nblocks, SPARSE: tl.constexpr):
    """``[start, stop)`` of row block ``i``'s column-block list: the plan's CSR row, or every block (dense)."""
    start = 0
    stop = nblocks
    if SPARSE:
        start = tl.load(ptr + i)
        stop = tl.load(ptr + i + 1)
    return start, stop


@triton.jit
def _column_block(idx, p, offs, BLOCK: tl.constexpr, SPARSE: tl.constexpr):
    """Point indices of the ``p``-th column block (the plan's ``idx[p]``-th leaf, or block ``p``)."""
    j = p
    if SPARSE:
        j = tl.load(idx + p)
    return j * BLOCK + offs


# Sizes stay specialised (Triton compiles one variant per divisibility of n, n/64 and t by 16, kept in its disk
# cache): turning that off for n and the block count costs throughput of the product (docs/gpu.md).
@triton.jit
def kv_kernel(ZT, V, OUT, n, npad, t, ptr, idx, nblocks, row0,
              SPARSE: tl.constexpr, BLOCK: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HOIST: tl.constexpr,
              TAIL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
              RBF: tl.constexpr, SINGULAR: tl.constexpr, C: tl.constexpr, C2: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr,
              P2: tl.constexpr, NP: tl.constexpr, Q0: tl.constexpr, Q1: tl.constexpr, NQ: tl.constexpr):
    """``OUT[I, T] = sum_J K[I, J] V[J, T]`` for row block ``I = row0 + program_id(0)`` and column block ``T =
    program_id(1)`` of ``BT`` right-hand sides (and column ``t - 1`` elementwise when ``TAIL``: one column block
    then). ``ZT (D, npad)``, ``V (npad, t)`` zero-padded; ``OUT (m, t)`` holds the rows from block ``row0`` on."""
    i = tl.program_id(0) + row0
    tb = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    rows = i * BLOCK + offs
    main = t - TAIL
    tcol = tb * BT + tl.arange(0, BT)
    tmask = tcol < main
    zi = _row_coords(ZT, rows, npad, D, HOIST)
    acc = tl.zeros((BLOCK, BT), dtype=DT)
    tacc = tl.zeros((BLOCK, BLOCK), dtype=DT)
    start, stop = _block_range(ptr, i, nblocks, SPARSE)
    for p in range(start, stop):
        cols = _column_block(idx, p, offs, BLOCK, SPARSE)
        r2 = _sq_dist(zi, ZT, rows, cols, npad, p, BLOCK, D, HOIST)
        k, _ = _kh(r2, RBF, SINGULAR, C, C2, P0, P1, P2, NP, Q0, Q1, NQ)
        v = tl.load(V + cols[:, None] * t + tcol[None, :], mask=tmask[None, :], other=0.0)
        acc = tl.dot(k, v, acc, input_precision=PREC, out_dtype=DT)
        if TAIL:
            tacc += k * tl.load(V + cols * t + main)[None, :]
    rmask = rows < n
    out = OUT + (rows - row0 * BLOCK) * t
    tl.store(out[:, None] + tcol[None, :], acc, mask=rmask[:, None] & tmask[None, :])
    if TAIL:
        tl.store(out + main, tl.sum(tacc, axis=1), mask=rmask)


@triton.jit
def _add_length_sum(g_acc, a, zi, ZT, rows, cols, npad, p, dd, dims, HOIST: tl.constexpr):
    """``g_acc[dd] += sum a o (z_dd - z'_dd)^2`` over the tile (reduced in FP64)."""
    diff = _diff(zi, ZT, rows, cols, npad, p, dd, HOIST)
    return g_acc + tl.where(dims == dd, tl.sum(tl.sum(a * diff * diff, axis=1).to(tl.float64), axis=0), 0.0)


@triton.jit
def derivative_kernel(ZT, U, V, S_OUT, G_OUT, n, npad, t, ptr, idx, nblocks, row0,
                      SPARSE: tl.constexpr, BLOCK: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
                      HOIST: tl.constexpr, TAIL: tl.constexpr, DP: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                      RBF: tl.constexpr, SINGULAR: tl.constexpr, C: tl.constexpr, C2: tl.constexpr, P0: tl.constexpr,
                      P1: tl.constexpr, P2: tl.constexpr, NP: tl.constexpr, Q0: tl.constexpr, Q1: tl.constexpr,
                      NQ: tl.constexpr):
    """For row block ``I = row0 + program_id(0)``: ``S_OUT[I] = sum_{i in I, j} w_ij k_ij`` and
    ``G_OUT[I, dd] = sum_{i in I, j} w_ij h_ij (z_i,dd - z_j,dd)^2`` with ``w_ij = u_i . v_j`` (``U, V (n, t)``,
    zero-padded to ``npad`` rows, column ``t - 1`` of the inner product elementwise when ``TAIL``; ``DP >= D`` a power
    of two; outputs in FP64)."""
    i = tl.program_id(0) + row0
    offs = tl.arange(0, BLOCK)
    rows = i * BLOCK + offs
    main = t - TAIL
    dims = tl.arange(0, DP)
    zi = _row_coords(ZT, rows, npad, D, HOIST)
    s_acc = tl.zeros((BLOCK,), dtype=tl.float64)
    g_acc = tl.zeros((DP,), dtype=tl.float64)
    if TAIL:
        ut = tl.load(U + rows * t + main)
    start, stop = _block_range(ptr, i, nblocks, SPARSE)
    for p in range(start, stop):
        cols = _column_block(idx, p, offs, BLOCK, SPARSE)
        w = tl.zeros((BLOCK, BLOCK), dtype=DT)
        for t0 in range(0, main, BT):
            tcol = t0 + tl.arange(0, BT)
            tmask = tcol < main
            u = tl.load(U + rows[:, None] * t + tcol[None, :], mask=tmask[None, :], other=0.0)
            vt = tl.load(V + cols[None, :] * t + tcol[:, None], mask=tmask[:, None], other=0.0)
            w = tl.dot(u, vt, w, input_precision=PREC, out_dtype=DT)
        if TAIL:
            w += ut[:, None] * tl.load(V + cols * t + main)[None, :]
        r2 = _sq_dist(zi, ZT, rows, cols, npad, p, BLOCK, D, HOIST)
        k, h = _kh(r2, RBF, SINGULAR, C, C2, P0, P1, P2, NP, Q0, Q1, NQ)
        s_acc += tl.sum(w * k, axis=1).to(tl.float64)  # padded rows/cols have w = 0
        a = w * h
        if HOIST:
            for dd in tl.static_range(D):
                g_acc = _add_length_sum(g_acc, a, zi, ZT, rows, cols, npad, p, dd, dims, HOIST)
        else:  # a loop: unrolled over many dimensions, the kernel spills registers
            for dd in range(D):
                g_acc = _add_length_sum(g_acc, a, zi, ZT, rows, cols, npad, p, dd, dims, HOIST)
    tl.store(S_OUT + i, tl.sum(s_acc, axis=0))
    tl.store(G_OUT + i * DP + dims, g_acc)


@triton.jit
def _column_store(OUT, U, rows, tcol, tmask, acc, tacc, i, planes, q, t, main, TAIL: tl.constexpr):
    """``OUT[i, q, T] = sum_{r in I} U[r, T] acc[r, T]`` (and column ``main`` from ``tacc``'s row sums: ``TAIL``)."""
    u = tl.load(U + rows[:, None] * t + tcol[None, :], mask=tmask[None, :], other=0.0)
    tl.store(OUT + (i * planes + q) * t + tcol, tl.sum(u.to(tl.float64) * acc.to(tl.float64), axis=0), mask=tmask)
    if TAIL:
        ut = tl.load(U + rows * t + main).to(tl.float64)
        tl.store(OUT + (i * planes + q) * t + main, tl.sum(ut * tl.sum(tacc, axis=1).to(tl.float64), axis=0))


@triton.jit
def column_kernel(ZT, U, V, OUT, n, npad, t, ptr, idx, nblocks, row0, planes,
                  SPARSE: tl.constexpr, BLOCK: tl.constexpr, BT: tl.constexpr, D: tl.constexpr, HOIST: tl.constexpr,
                  TAIL: tl.constexpr, ISO: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                  RBF: tl.constexpr, SINGULAR: tl.constexpr, C: tl.constexpr, C2: tl.constexpr, P0: tl.constexpr,
                  P1: tl.constexpr, P2: tl.constexpr, NP: tl.constexpr, Q0: tl.constexpr, Q1: tl.constexpr,
                  NQ: tl.constexpr):
    """For row block ``I = row0 + program_id(0)``, column block ``T = program_id(1)`` and plane ``q = program_id(2)``:
    ``OUT[I, q, T] = sum_{i in I} U[i, T] o (M_q[I, :] @ V[:, T])[i]`` with ``M_0 = K``, and ``M_q = H o R^2``
    (``ISO``) or ``H o (z_{q-1} - z'_{q-1})^2``; column ``t - 1`` elementwise when ``TAIL`` (one column block then).
    ``U, V (npad, t)`` zero-padded; ``OUT (nblocks, planes, t)`` in FP64. (Both isotropic planes from one tile in
    one program would save a tile's elementwise work, but its two ``TAIL`` accumulators spill registers on sm_90.)"""
    i = tl.program_id(0) + row0
    tb = tl.program_id(1)
    q = tl.program_id(2)
    offs = tl.arange(0, BLOCK)
    rows = i * BLOCK + offs
    main = t - TAIL
    tcol = tb * BT + tl.arange(0, BT)
    tmask = tcol < main
    dsel = tl.maximum(q - 1, 0)
    zi = _row_coords(ZT, rows, npad, D, HOIST)
    zq = tl.load(ZT + dsel * npad + rows)
    acc = tl.zeros((BLOCK, BT), dtype=DT)
    tacc = tl.zeros((BLOCK, BLOCK), dtype=DT)
    start, stop = _block_range(ptr, i, nblocks, SPARSE)
    for p in range(start, stop):
        cols = _column_block(idx, p, offs, BLOCK, SPARSE)
        r2 = _sq_dist(zi, ZT, rows, cols, npad, p, BLOCK, D, HOIST)
        k, h = _kh(r2, RBF, SINGULAR, C, C2, P0, P1, P2, NP, Q0, Q1, NQ)
        if ISO:
            sq = r2
        else:
            diff = zq[:, None] - tl.load(ZT + dsel * npad + cols)[None, :]
            sq = diff * diff
        m = tl.where(q == 0, k, h * sq)
        v = tl.load(V + cols[:, None] * t + tcol[None, :], mask=tmask[None, :], other=0.0)
        acc = tl.dot(m, v, acc, input_precision=PREC, out_dtype=DT)
        if TAIL:
            tacc += m * tl.load(V + cols * t + main)[None, :]
    _column_store(OUT, U, rows, tcol, tmask, acc, tacc, i, planes, q, t, main, TAIL)  # (U's padded rows are 0)
