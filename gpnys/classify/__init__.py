"""Gaussian processes with non-Gaussian likelihoods (Laplace approximation) on gpnys's preconditioned solvers:
:class:`LaplaceGP` (Bernoulli labels with a logit or probit link, Poisson counts, Student-t noise) and
:class:`LaplaceGPClassifier` (:mod:`gpnys.classify.laplace`, :mod:`gpnys.classify.likelihoods`), and the same
models on a rank-``s`` Nyström kernel, :class:`ReducedLaplaceGP` and :class:`ReducedLaplaceClassifier`
(:mod:`gpnys.classify.reduced`). All four follow scikit-learn's estimator protocol (:mod:`gpnys.classify.estimator`);
the two classifiers are scikit-learn classifiers (``clone``, ``Pipeline``, ``GridSearchCV``)."""

from gpnys.classify.laplace import LaplaceGP, LaplaceGPClassifier
from gpnys.classify.likelihoods import Bernoulli, BernoulliProbit, LaplaceLikelihood, Poisson, StudentT
from gpnys.classify.reduced import ReducedLaplaceClassifier, ReducedLaplaceGP

__all__ = ["LaplaceGP", "LaplaceGPClassifier", "ReducedLaplaceGP", "ReducedLaplaceClassifier", "LaplaceLikelihood",
           "Bernoulli", "BernoulliProbit", "Poisson", "StudentT"]
