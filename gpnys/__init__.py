"""gpnys: fast and correct Gaussian-process hyperparameter optimisation on large data.

Preconditioners (AFN, Nyström, FSAI) for GPyTorch's CG + stochastic Lanczos quadrature, with a one-line
switch for existing ``ExactGP`` models::

    with gpnys.use_preconditioner(model, gpnys.AFNPreconditioner):
        ...  # the usual GPyTorch training loop
"""

from gpnys import datasets, landmarks
from gpnys.budget import memory_budget
from gpnys.checks import NumericalWarning
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import EstimatorSettings
from gpnys.precond import (
    AFNPreconditioner,
    AutoPreconditioner,
    FSAIPreconditioner,
    NystromPreconditioner,
    PivotedCholeskyPreconditioner,
)
from gpnys.solvers import pcg

__version__ = "0.2.0"

__all__ = [
    "datasets",
    "landmarks",
    "use_preconditioner",
    "EstimatorSettings",
    "AFNPreconditioner",
    "AutoPreconditioner",
    "FSAIPreconditioner",
    "NystromPreconditioner",
    "PivotedCholeskyPreconditioner",
    "pcg",
    "memory_budget",
    "NumericalWarning",
    "__version__",
]
