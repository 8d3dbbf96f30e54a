"""Preconditioners for ``K + mu I``: Nyström, FSAI, AFN, pivoted Cholesky, rank estimation and the switch."""

from gpnys.precond.base import NumericalWarning, Preconditioner

__all__ = ["Preconditioner", "NumericalWarning"]
