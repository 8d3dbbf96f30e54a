"""The Triton kernel of farthest point sampling: all ``k`` steps in one program (see :func:`fps_kernel`).

Imported lazily by :func:`gpnys.landmarks.farthest.fps` on CUDA tensors (``triton.jit`` decides at import time
whether it compiles for the GPU or runs under the interpreter, ``TRITON_INTERPRET=1``, which is how CI checks it on
CPU tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fps_kernel"]


@triton.jit(do_not_specialize=["n", "d", "k", "start"])
def fps_kernel(X, MIND, IDX, FILL, n, d, k, start, BLOCK: tl.constexpr, DP: tl.constexpr):
    """Farthest point sampling (AFN paper Algorithm 6) in ONE program: ``k`` steps, each a pass over the ``n`` points
    in chunks of ``BLOCK`` (``X (n, d)`` row-major, ``d <= DP``). ``MIND (n,)`` holds the running squared distance to
    the selected set (selected points -1, so duplicates are never re-picked); ``IDX (k,)``, ``FILL (k,)`` receive
    the selection and ``max(MIND)`` after each step. Ties go to the lowest index. One launch instead of several
    per step: what small FPS runs (the rank estimate's 500-point subsamples) spend on a GPU is launch latency."""
    offs = tl.arange(0, BLOCK)
    dims = tl.arange(0, DP)
    dmask = dims < d
    last = start.to(tl.int32)
    for i in range(k):
        tl.store(IDX + i, last)
        xl = tl.load(X + last * d + dims, mask=dmask, other=0.0)
        best = tl.full([], -2.0, dtype=MIND.dtype.element_ty)
        arg = tl.full([], 0, dtype=tl.int32)
        for c0 in range(0, n, BLOCK):
            rows = c0 + offs
            rmask = rows < n
            x = tl.load(X + rows[:, None] * d + dims[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            diff = x - xl[None, :]
            d2 = tl.sum(diff * diff, axis=1)
            m = tl.minimum(tl.load(MIND + rows, mask=rmask, other=-1.0), d2)
            m = tl.where(rows == last, -1.0, m)
            tl.store(MIND + rows, m, mask=rmask)
            m = tl.where(rmask, m, -2.0)
            cmax = tl.max(m, axis=0)
            carg = tl.argmax(m, axis=0, tie_break_left=True)
            if cmax > best:  # strictly: an equal value in a later chunk has a higher index
                best = cmax
                arg = c0 + carg
        tl.store(FILL + i, best)
        last = arg
        tl.debug_barrier()  # this step's MIND stores before the next step's loads
