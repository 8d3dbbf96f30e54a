"""Likelihoods of the Laplace approximation (:mod:`gpnys.classify.laplace`): ``log p(y|f)`` of independent
observations and its first three derivatives in the latent ``f``.

The Laplace approximation (Rasmussen & Williams 2006, §3.4) needs ``∇ log p(y|f)`` (the Newton step),
``W = -∇∇ log p(y|f)`` (diagonal, non-negative for a log-concave likelihood, so that ``B = I + W^½ K W^½`` is
SPD) and ``∇³ log p(y|f)`` (the implicit term of the hyperparameters' gradient, §5.5.1, eq. (5.23)). Both
likelihoods here are log-concave in ``f``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

__all__ = ["LaplaceLikelihood", "Bernoulli", "Poisson", "LIKELIHOODS"]


class LaplaceLikelihood(ABC):
    """``log p(y|f) = Σ_i log p(y_i|f_i)`` with its derivatives in ``f`` (shapes ``(n,)``)."""

    name: str

    @abstractmethod
    def check(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` as a floating tensor, or a ``ValueError`` naming ``y`` (outside the support, NaN)."""

    @abstractmethod
    def log_prob(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``Σ_i log p(y_i | f_i)``, 0-dim."""

    @abstractmethod
    def derivatives(self, f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(∇ log p, W = -∇∇ log p, ∇³ log p)`` at ``f``, each ``(n,)`` (the Hessian and third derivative are
        diagonal)."""


def _finite_1d(y: torch.Tensor) -> torch.Tensor:
    if not isinstance(y, torch.Tensor) or y.dim() != 1:
        raise ValueError(f"y must be a 1-D tensor, got {getattr(y, 'shape', type(y))}")
    y = y.to(torch.float64) if not y.is_floating_point() else y
    if not bool(torch.isfinite(y).all()):
        raise ValueError("y contains NaN or inf")
    return y


class Bernoulli(LaplaceLikelihood):
    """Labels ``y ∈ {0, 1}``, logistic link: ``log p(y|f) = log σ(y' f)`` with ``y' = 2y - 1`` (R&W eq. (3.15));
    ``∇ = y - π``, ``W = π(1 - π)``, ``∇³ = -π(1 - π)(1 - 2π)`` with ``π = σ(f)``.

    Example:
        >>> import torch
        >>> from gpnys.classify.likelihoods import Bernoulli
        >>> g, W, t = Bernoulli().derivatives(torch.zeros(2, dtype=torch.float64), torch.tensor([0.0, 1.0]))
        >>> g.tolist(), W.tolist(), t.tolist()
        ([-0.5, 0.5], [0.25, 0.25], [-0.0, -0.0])
    """

    name = "bernoulli"

    def check(self, y: torch.Tensor) -> torch.Tensor:
        y = _finite_1d(y)
        if not bool(((y == 0) | (y == 1)).all()):
            raise ValueError("y must hold labels 0 and 1 only")
        if bool((y == y[0]).all()):
            raise ValueError("y holds a single class: both 0 and 1 are needed")
        return y

    def log_prob(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.logsigmoid((2 * y - 1) * f).sum()

    def derivatives(self, f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pi = torch.sigmoid(f)
        W = pi * (1 - pi)
        return y - pi, W, -W * (1 - 2 * pi)


class Poisson(LaplaceLikelihood):
    """Counts ``y ∈ {0, 1, 2, ...}``, log link (rate ``λ = e^f``): ``log p(y|f) = y f - e^f - log y!``;
    ``∇ = y - e^f``, ``W = e^f``, ``∇³ = -e^f``.

    Example:
        >>> import torch
        >>> from gpnys.classify.likelihoods import Poisson
        >>> g, W, t = Poisson().derivatives(torch.zeros(2, dtype=torch.float64), torch.tensor([0.0, 3.0]))
        >>> g.tolist(), W.tolist(), t.tolist()
        ([-1.0, 2.0], [1.0, 1.0], [-1.0, -1.0])
    """

    name = "poisson"

    def check(self, y: torch.Tensor) -> torch.Tensor:
        y = _finite_1d(y)
        if not bool(((y >= 0) & (y == y.round())).all()):
            raise ValueError("y must hold counts: non-negative integers")
        return y

    def log_prob(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (y * f - f.exp() - torch.lgamma(y + 1)).sum()

    def derivatives(self, f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rate = f.exp()
        return y - rate, rate, -rate

    @staticmethod
    def moments(mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance of a count whose log-rate is ``N(mean, var)``: ``E[y] = e^{μ + v/2}``,
        ``Var[y] = E[y] + (e^v - 1) e^{2μ + v}`` (a Poisson mixed over a log-normal rate)."""
        rate = torch.exp(mean + 0.5 * var)
        return rate, rate + torch.expm1(var) * rate**2


#: the likelihoods by name
LIKELIHOODS: dict[str, type[LaplaceLikelihood]] = {"bernoulli": Bernoulli, "poisson": Poisson}
