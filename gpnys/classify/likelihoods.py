"""Likelihoods of the Laplace approximation (:mod:`gpnys.classify.laplace`): ``log p(y|f)`` of independent
observations and its first three derivatives in the latent ``f``.

The Laplace approximation (Rasmussen & Williams 2006, §3.4) needs ``∇ log p(y|f)`` (the Newton step),
``W = -∇∇ log p(y|f)`` (diagonal, non-negative for a log-concave likelihood, so that ``B = I + W^½ K W^½`` is
SPD) and ``∇³ log p(y|f)`` (the implicit term of the hyperparameters' gradient, §5.5.1, eq. (5.23)). Bernoulli and
Poisson are log-concave in ``f``. The Student-t is not (its ``-∇∇ log p`` is negative for outliers), so
:class:`StudentT` gives its Fisher information, the expected ``-∇∇ log p``, as ``W``: positive, so ``B`` stays SPD.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from gpnys.checks import validate_points, validate_positive

__all__ = ["LaplaceLikelihood", "Bernoulli", "BernoulliProbit", "Poisson", "StudentT", "LIKELIHOODS",
           "resolve_likelihood", "check_observations"]


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
        diagonal). ``∇³ log p`` is ``-∂W/∂f`` for whichever ``W`` is given."""

    def moments(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance of an observation whose latent value is ``N(mean, var)`` (``(m,)`` each)."""
        raise NotImplementedError(f"{type(self).__name__} has no predictive moments")

    def parameters(self) -> list[torch.Tensor]:
        """The likelihood's trainable tensors (none by default); :class:`~gpnys.classify.LaplaceGP` trains them with
        the kernel's."""
        return []

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return []

    def to(self, dtype: torch.dtype, device: torch.device) -> "LaplaceLikelihood":
        """Its tensors in ``dtype`` on ``device`` (in place); returns ``self``."""
        return self


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
        pi, rest = torch.sigmoid(f), torch.sigmoid(-f)  # 1 - π from σ(-f): no cancellation for large f
        W = pi * rest
        return y * rest - (1 - y) * pi, W, -W * (rest - pi)

    def moderated(self, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """The link's argument of the averaged ``P(y = 1)`` of a latent ``N(mean, var)``: ``μ / √(1 + π v / 8)``
        (MacKay's probit approximation, R&W §3.4.2), ``P(y = 1) = σ(·)``."""
        return mean / torch.sqrt(1 + math.pi * var / 8)

    def moments(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``P(y = 1)`` by the probit approximation ``σ(μ / √(1 + π v / 8))`` (R&W §3.4.2) and its Bernoulli
        variance."""
        p1 = torch.sigmoid(self.moderated(mean, var))
        return p1, p1 * (1 - p1)


#: Below ``z = -PROBIT_TAIL`` the probit's ``r + z`` comes from Laplace's continued fraction, not ``r`` and ``z``.
PROBIT_TAIL = 3.0
#: Terms of that continued fraction: within 1e-16 relative of ``r + z`` for ``z ≤ -3`` (against 50-digit mpmath).
PROBIT_TAIL_TERMS = 60


def _probit_ratio_tail(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``T₁, T₂, T₃`` of Laplace's continued fraction ``N(x) / Φ(-x) = x + T₁``, ``T_k = k / (x + T_{k+1})``,
    for ``x > 0``. ``T₁ = r + z`` at ``z = -x``, free of the cancellation ``r - x`` has far in the tail.

    Written here because torch and scipy give the Mills ratio (``erfcx``) but not its difference from ``x``.
    """
    t = torch.zeros_like(x)
    terms = {}
    for k in range(PROBIT_TAIL_TERMS, 0, -1):
        t = k / (x + t)
        if k <= 3:
            terms[k] = t
    return terms[1], terms[2], terms[3]


class BernoulliProbit(Bernoulli):
    """Labels ``y ∈ {0, 1}``, probit link: ``log p(y|f) = log Φ(z)``, ``z = y' f``, ``y' = 2y - 1`` (R&W eq. (3.16));
    with ``r = N(z) / Φ(z)``: ``∇ = y' r``, ``W = r² + z r``, ``∇³ = y' r (2r² + 3zr + z² - 1)``.

    Storage trick: far in the misclassified tail (``z < -3``) ``r → -z``, so ``r + z`` and ``∇³`` cancel (in
    float32 ``W`` was 2.99 for 1.00 at ``z = -100`` and ``∇³`` 47 % off at ``z = -10``). There ``a = r + z`` is
    Laplace's continued fraction ``1 / (x + 2 / (x + 3 / (x + …)))``, ``x = -z``, whose tail terms ``c = T₂``,
    ``d = T₃`` give ``W = r a`` and ``∇³ = y' r a² c (d - c)`` without a difference of near-equal numbers. Both
    branches run in float64 and return the input's dtype.

    Example:
        >>> import torch
        >>> from gpnys.classify.likelihoods import BernoulliProbit
        >>> g, W, t = BernoulliProbit().derivatives(torch.zeros(2, dtype=torch.float64), torch.tensor([0.0, 1.0]))
        >>> [round(v, 4) for v in g.tolist()], [round(v, 4) for v in W.tolist()]
        ([-0.7979, 0.7979], [0.6366, 0.6366])
    """

    name = "bernoulli_probit"

    def log_prob(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.special.log_ndtr((2 * y - 1) * f).sum()

    def derivatives(self, f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wide = torch.promote_types(f.dtype, torch.float64)
        s = (2 * y - 1).to(wide)
        z = s * f.to(wide)
        r = torch.exp(-0.5 * z * z - 0.5 * math.log(2 * math.pi) - torch.special.log_ndtr(z))  # N(z) / Φ(z)
        a, third = r + z, r * (2 * r * r + 3 * z * r + z * z - 1)
        tail = z < -PROBIT_TAIL
        if bool(tail.any()):
            x = torch.where(tail, -z, torch.ones_like(z))  # 1 keeps the untaken branch finite
            a_tail, c, d = _probit_ratio_tail(x)
            a = torch.where(tail, a_tail, a)
            r = torch.where(tail, x + a_tail, r)
            third = torch.where(tail, r * a_tail * a_tail * c * (d - c), third)
        return (s * r).to(f.dtype), (r * a).to(f.dtype), (s * third).to(f.dtype)

    def moderated(self, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """``μ / √(1 + v)``: ``P(y = 1) = Φ(·)`` exactly (R&W eq. (3.82))."""
        return mean / torch.sqrt(1 + var)

    def moments(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``P(y = 1) = Φ(μ / √(1 + v))``, exact for the probit link (R&W eq. (3.82)), and its Bernoulli variance."""
        p1 = torch.special.ndtr(self.moderated(mean, var))
        return p1, p1 * (1 - p1)


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


class StudentT(LaplaceLikelihood):
    """Robust regression ``y = f + ε`` with Student-t noise of ``df = ν`` degrees of freedom and scale ``σ``:
    ``log p(y|f) = log Γ((ν+1)/2) - log Γ(ν/2) - ½ log(ν π σ²) - (ν+1)/2 log(1 + r²/(ν σ²))``, ``r = y - f``;
    ``∇ = (ν+1) r / (ν σ² + r²)``.

    Not log-concave: ``-∇∇ log p = (ν+1)(ν σ² - r²) / (ν σ² + r²)²`` is negative for ``r² > ν σ²``, where
    ``B = I + W^½ K W^½`` would not be SPD. ``W`` is therefore the Fisher information ``E[-∇∇ log p] =
    (ν+1) / ((ν+3) σ²)`` (constant in ``f``, so ``∇³ = 0`` here): the Newton steps become Fisher scoring, which
    converges to the same mode (the stationarity ``f = K ∇ log p`` does not involve ``W``), and ``log q`` and the
    predictive variances use ``(K⁻¹ + W)⁻¹`` with this ``W`` (a Fisher–Laplace approximation; Vanhatalo, Jylänki
    and Vehtari 2009 discuss the observed-information Laplace approximation for this likelihood and its negative
    ``W``). The scale is trained with the kernel (``train_scale``); ``df`` stays fixed.

    Example:
        >>> import torch
        >>> from gpnys.classify.likelihoods import StudentT
        >>> lik = StudentT(df=4.0, scale=0.5)
        >>> g, W, t = lik.derivatives(torch.zeros(2, dtype=torch.float64), torch.tensor([0.0, 1.0]))
        >>> [round(v, 4) for v in g.tolist()], [round(v, 4) for v in W.tolist()], t.tolist()
        ([0.0, 2.5], [2.8571, 2.8571], [0.0, 0.0])
    """

    name = "studentt"

    def __init__(self, df: float = 4.0, scale: float = 1.0, train_scale: bool = True) -> None:
        self.df = validate_positive(df, "df")
        #: ``log σ`` (trained when ``train_scale``)
        self.raw_scale = torch.tensor(math.log(validate_positive(scale, "scale")), requires_grad=bool(train_scale))

    @property
    def scale(self) -> torch.Tensor:
        """``σ`` (0-dim, carries autograd)."""
        return self.raw_scale.exp()

    def check(self, y: torch.Tensor) -> torch.Tensor:
        return _finite_1d(y)

    def log_prob(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nu, s2 = self.df, self.scale.to(f.dtype).square()
        r2 = (y - f).square()
        const = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)
        return (const - 0.5 * s2.log() - (nu + 1) / 2 * torch.log1p(r2 / (nu * s2))).sum()

    def derivatives(self, f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nu, s2 = self.df, self.scale.to(f.dtype).square()
        r = y - f
        W = ((nu + 1) / ((nu + 3) * s2)).expand_as(f)
        return (nu + 1) * r / (nu * s2 + r.square()), W, torch.zeros_like(f)

    def moments(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``E[y] = μ`` and ``Var[y] = v + σ² ν / (ν - 2)`` (infinite for ``ν ≤ 2``)."""
        noise = self.scale.detach().square() * self.df / (self.df - 2) if self.df > 2 else math.inf
        return mean, var + noise

    def parameters(self) -> list[torch.Tensor]:
        return [self.raw_scale] if self.raw_scale.requires_grad else []

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [("likelihood.raw_scale", self.raw_scale)] if self.raw_scale.requires_grad else []

    def to(self, dtype: torch.dtype, device: torch.device) -> "StudentT":
        if self.raw_scale.dtype != dtype or self.raw_scale.device != torch.device(device):
            train = self.raw_scale.requires_grad
            self.raw_scale = self.raw_scale.detach().to(dtype=dtype, device=device).requires_grad_(train)
        return self


#: the likelihoods by name
LIKELIHOODS: dict[str, type[LaplaceLikelihood]] = {"bernoulli": Bernoulli, "bernoulli_probit": BernoulliProbit,
                                                   "poisson": Poisson, "studentt": StudentT}


def resolve_likelihood(likelihood: str | LaplaceLikelihood) -> LaplaceLikelihood:
    """A :class:`LaplaceLikelihood` from a name in :data:`LIKELIHOODS` or an instance; ``ValueError`` otherwise."""
    if isinstance(likelihood, str) and likelihood in LIKELIHOODS:
        likelihood = LIKELIHOODS[likelihood]()
    if not isinstance(likelihood, LaplaceLikelihood):
        raise ValueError(f"likelihood must be one of {sorted(LIKELIHOODS)} or a LaplaceLikelihood, got "
                         f"{likelihood!r}")
    return likelihood


def check_observations(X: torch.Tensor, y: torch.Tensor, likelihood: LaplaceLikelihood) -> torch.Tensor:
    """``y`` ``(n,)`` for the points ``X`` ``(n, d)``, as a floating tensor in ``likelihood``'s support (booleans
    become 0/1 in ``X``'s dtype); a ``ValueError`` naming ``X`` or ``y`` otherwise."""
    validate_points(X, "X")
    if not isinstance(y, torch.Tensor) or y.dim() != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"y must be a 1-D tensor of {X.shape[0]} observations, got {getattr(y, 'shape', type(y))}")
    if y.dtype == torch.bool:
        y = y.to(X.dtype if X.is_floating_point() else torch.get_default_dtype())
    return likelihood.check(y)
