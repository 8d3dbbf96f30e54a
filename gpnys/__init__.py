"""gpnys: fast and correct Gaussian-process hyperparameter optimisation on large data.

Preconditioners (AFN, Nyström, FSAI) for GPyTorch's CG + stochastic Lanczos quadrature, kernel
operators that never store n x n, Nyström-reduced posteriors, a BoTorch model and a CLI.
"""

from gpnys import datasets, landmarks

__version__ = "0.1.0"

__all__ = ["datasets", "landmarks", "__version__"]
