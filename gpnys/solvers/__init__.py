"""Iterative solvers on callables: preconditioned CG with per-column iteration counts and Lanczos coefficients.
The kernel system they usually solve is :func:`gpnys.kernels.system.kernel_system`."""

from gpnys.solvers.pcg import ConvergenceWarning, NonFiniteError, PCGResult, pcg

__all__ = ["pcg", "PCGResult", "ConvergenceWarning", "NonFiniteError"]
