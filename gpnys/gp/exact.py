"""Transitional: :func:`gpnys.gp.training.predict` under its former module path, for :mod:`gpnys.gp.prediction`'s
import. Removed once that import names :mod:`gpnys.gp.training`."""

from gpnys.gp.training import predict

__all__ = ["predict"]
