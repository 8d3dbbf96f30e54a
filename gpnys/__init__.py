"""gpnys: fast and correct Gaussian-process hyperparameter optimisation on large data.

Preconditioners (AFN, Nyström, FSAI) for GPyTorch's CG + stochastic Lanczos quadrature, with a one-line
switch for existing ``ExactGP`` models::

    with gpnys.use_preconditioner(model, gpnys.AFNPreconditioner):
        ...  # the usual GPyTorch training loop
"""

import warnings

with warnings.catch_warnings():
    # GPyTorch's linear_operator decorates functions with torch.jit.script as it is imported, which torch deprecates
    # on every import (a DeprecationWarning in 2.13, a FutureWarning in 2.15): nothing a user can act on, and it
    # made the CLI's one-line errors three lines. Only this import is quieted; the warning shows where the user
    # imports GPyTorch first.
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", message=r"`?torch\.jit\.script`? is deprecated", category=category)
    import gpytorch  # noqa: F401

from gpnys import datasets, landmarks  # noqa: E402
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
