"""Gaussian-process classifiers on gpnys's preconditioned solvers (:mod:`gpnys.classify.laplace`)."""

from gpnys.classify.laplace import LaplaceGPClassifier

__all__ = ["LaplaceGPClassifier"]
