"""Dense linear algebra in the form the CPU runs fastest and most reliably.

Small factorisations (:func:`small_dense`). Eigenvalue, Cholesky and QR factorisations of ``m x m`` matrices with
``m`` up to a few hundred (rank estimation, preconditioner cores, Lanczos tridiagonals) run on one thread: with
several, MKL's threads spin against any other busy process on the machine, and a 300 x 300 ``eigvalsh`` took 2.6 s
instead of 8.5 ms on 2 cores (benchmarks/small_n.py; docs/scaling.md). Alone on the machine one thread costs them
little at these sizes.

Thin products (:func:`thin_matmul`). ``A @ B`` with a large ``A (m, k)`` and a thin ``B (k, t)`` (t ~ 5-64 columns:
the probes of the MLL estimator, the CG block, a q-batch) runs far below memory bandwidth in one of the forms
``A @ B`` and ``(Bᵀ Aᵀ)ᵀ`` (the same values, ``Aᵀ`` a view), and which one depends on the BLAS build and the
machine, so the faster is timed once per process. The hot products of the kernel operator, the kernel system and
the Nyström / AFN preconditioners go through it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch

__all__ = ["thin_matmul", "transposed_faster", "small_dense", "SINGLE_THREAD_MAX"]

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
    """``A @ B`` for ``A (..., m, k)`` and ``B (..., k, t)``, contiguous ``(..., m, t)``, in whichever of the forms
    ``A @ B`` and ``(Bᵀ Aᵀ)ᵀ`` this device's BLAS runs faster (:func:`transposed_faster`); a 1-D ``B`` is
    multiplied directly.

    Example:
        >>> import torch
        >>> from gpnys.linalg import thin_matmul
        >>> A, B = torch.rand(300, 200, dtype=torch.float64), torch.rand(200, 17, dtype=torch.float64)
        >>> torch.allclose(thin_matmul(A, B), A @ B), thin_matmul(A, B).is_contiguous()
        (True, True)
    """
    if B.dim() == 1 or not transposed_faster(A.dtype, A.device):
        return A @ B
    return (B.mT @ A.mT).mT.contiguous()


_transposed: dict[tuple[torch.dtype, str], bool] = {}


def transposed_faster(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``(Bᵀ Aᵀ)ᵀ`` beats ``A @ B`` for a large ``A`` and 17 columns on this device and dtype, timed once
    per process on a 2048 x 2048 product (a few tens of ms). Which form wins depends on the BLAS build and the
    machine: 2.8x for the transposed one on one 2-core CPU with torch 2.13, 1.6x for the direct one on another with
    the same wheel (docs/scaling.md, "Why the defaults are what they are")."""
    key = (dtype, str(device))
    if key not in _transposed:
        g = torch.Generator(device=device).manual_seed(0)
        A = torch.rand(2048, 2048, generator=g, dtype=dtype, device=device)
        B = torch.rand(2048, 17, generator=g, dtype=dtype, device=device)

        def best(form: Callable[[], torch.Tensor]) -> float:
            times = []
            for _ in range(4):
                if A.is_cuda:
                    torch.cuda.synchronize(A.device)
                t0 = time.perf_counter()
                form()
                if A.is_cuda:
                    torch.cuda.synchronize(A.device)
                times.append(time.perf_counter() - t0)
            return min(times[1:])

        _transposed[key] = best(lambda: (B.mT @ A.mT).mT.contiguous()) < 0.9 * best(lambda: A @ B)
    return _transposed[key]
