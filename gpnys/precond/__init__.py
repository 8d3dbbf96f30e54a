"""Preconditioners for ``K + mu I``: Nyström, FSAI, AFN, pivoted Cholesky and the switch (the rank estimate it
uses is :func:`gpnys.landmarks.rank.estimate_rank`).

Every class implements :class:`~gpnys.precond.base.Preconditioner` (``solve``, ``matmul``, ``logdet``,
``sample``, ``rank``, ``summary``).
"""

from gpnys.precond.afn import AFNPreconditioner
from gpnys.precond.base import Preconditioner
from gpnys.precond.cache import PointCache
from gpnys.precond.fsai import FSAIPreconditioner
from gpnys.precond.nystrom import NystromPreconditioner
from gpnys.precond.pivchol import PivotedCholeskyPreconditioner
from gpnys.precond.strategy import (
    PRECONDITIONERS,
    AutoPreconditioner,
    make_preconditioner,
)

__all__ = [
    "Preconditioner",
    "PointCache",
    "NystromPreconditioner",
    "FSAIPreconditioner",
    "AFNPreconditioner",
    "PivotedCholeskyPreconditioner",
    "AutoPreconditioner",
    "make_preconditioner",
    "PRECONDITIONERS",
]
