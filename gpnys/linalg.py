"""Dense linear algebra in the form the CPU runs fastest and most reliably.

Small factorisations (:func:`small_dense`). Eigenvalue, Cholesky and QR factorisations of ``m x m`` matrices with
``m`` up to a few hundred (rank estimation, preconditioner cores, Lanczos tridiagonals) run on one thread: with
several, MKL's threads spin against any other busy process on the machine, and a 300 x 300 ``eigvalsh`` took 2.6 s
instead of 8.5 ms on 2 cores (benchmarks/small_factorisations.py; docs/scaling.md). Alone on the machine one thread
costs them little at these sizes.


``A @ B`` with a large ``A (m, k)`` and a thin ``B (k, t)`` (t ~ 5-64 columns: the probes of the MLL estimator, the
CG block, a q-batch) is computed by torch's CPU BLAS far below memory bandwidth; the same product written as
``(Bᵀ Aᵀ)ᵀ`` (the same values, ``Aᵀ`` a view) is not (timings: docs/scaling.md). The hot products of the kernel
operator, the kernel system and the Nyström / AFN preconditioners go through :func:`thin_matmul`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["thin_matmul", "small_dense", "SINGLE_THREAD_MAX"]

#: factorisations of ``m x m`` with ``m`` at most this run on one CPU thread (module docstring)
SINGLE_THREAD_MAX = 512


@contextlib.contextmanager
def small_dense(m: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the block on one CPU thread when ``m <= SINGLE_THREAD_MAX`` (module docstring); a no-op on other
    devices, for larger ``m`` and when torch already uses one thread. Restores the thread count on exit.

    Example:
        >>> import torch
        >>> from gpnys.linalg import small_dense
        >>> threads = torch.get_num_threads()
        >>> A = torch.eye(100, dtype=torch.float64) * 2
        >>> with small_dense(100):
        ...     inside = torch.get_num_threads()
        ...     eigenvalues = torch.linalg.eigvalsh(A)
        >>> inside, torch.get_num_threads() == threads, float(eigenvalues[0])
        (1, True, 2.0)
    """
    threads = torch.get_num_threads()
    if torch.device(device).type != "cpu" or m > SINGLE_THREAD_MAX or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def thin_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``A @ B`` for ``A (..., m, k)`` and ``B (..., k, t)`` as ``(Bᵀ Aᵀ)ᵀ``, contiguous ``(..., m, t)``; a 1-D ``B``
    is multiplied directly."""
    if B.dim() == 1:
        return A @ B
    return (B.mT @ A.mT).mT.contiguous()
