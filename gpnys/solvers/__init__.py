"""Iterative solvers: preconditioned CG with per-column iteration counts, and the kernel system product."""

from gpnys.solvers.pcg import (
    ConvergenceWarning,
    KernelSystem,
    NonFiniteError,
    PCGResult,
    kernel_system,
    pcg,
)

__all__ = ["pcg", "PCGResult", "ConvergenceWarning", "NonFiniteError", "KernelSystem", "kernel_system"]
