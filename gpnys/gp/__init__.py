"""GPyTorch integration: exact GP models, training loops, prediction metrics (the references they are compared
against are :mod:`gpnys.baselines`)."""

from gpnys.gp import calibration  # noqa: F401  (installs the path cost model's calibration)
from gpnys.gp.training import ExactGPModel, FitResult, fit, gaussian_nll, predict

__all__ = ["ExactGPModel", "FitResult", "fit", "predict", "gaussian_nll"]
