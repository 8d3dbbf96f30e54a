"""GPyTorch integration: exact GP models, training loops, prediction metrics."""

from gpnys.gp import calibration  # noqa: F401  (installs the path cost model's calibration)
from gpnys.gp.exact import ExactGPModel, FitResult, fit, gaussian_nll, predict

__all__ = ["ExactGPModel", "FitResult", "fit", "predict", "gaussian_nll"]
