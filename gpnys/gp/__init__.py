"""GPyTorch integration: exact GP models, training loops, prediction metrics."""

from gpnys.gp.exact import ExactGPModel, FitResult, fit, gaussian_nll, predict

__all__ = ["ExactGPModel", "FitResult", "fit", "predict", "gaussian_nll"]
