"""Gaussian processes with non-Gaussian likelihoods (Laplace approximation) on gpnys's preconditioned solvers:
:class:`LaplaceGP` (Bernoulli labels with a logit or probit link, Poisson counts, Student-t noise) and
:class:`LaplaceGPClassifier` (:mod:`gpnys.classify.laplace`, :mod:`gpnys.classify.likelihoods`)."""

from gpnys.classify.laplace import LaplaceGP, LaplaceGPClassifier
from gpnys.classify.likelihoods import Bernoulli, BernoulliProbit, LaplaceLikelihood, Poisson, StudentT

__all__ = ["LaplaceGP", "LaplaceGPClassifier", "LaplaceLikelihood", "Bernoulli", "BernoulliProbit", "Poisson",
           "StudentT"]
