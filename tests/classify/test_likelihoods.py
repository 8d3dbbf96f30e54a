"""The Laplace likelihoods' derivatives against autograd of their log densities, and their checks of y."""

from __future__ import annotations

import pytest
import torch

from gpnys.classify.likelihoods import Bernoulli, BernoulliProbit, Poisson


@pytest.mark.parametrize("lik, y", [(Bernoulli(), torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])),
                                    (BernoulliProbit(), torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])),
                                    (Poisson(), torch.tensor([0.0, 3.0, 1.0, 7.0, 2.0]))],
                         ids=["bernoulli", "probit", "poisson"])
def test_derivatives_match_autograd(lik, y, dtype):
    y = y.to(dtype)
    f = torch.tensor([-2.0, -0.3, 0.0, 0.8, 2.5], dtype=dtype, requires_grad=True)
    (g1,) = torch.autograd.grad(lik.log_prob(f, y), f, create_graph=True)
    (g2,) = torch.autograd.grad(g1.sum(), f, create_graph=True)  # separable: the Hessian's diagonal
    (g3,) = torch.autograd.grad(g2.sum(), f)
    grad, W, third = lik.derivatives(f.detach(), y)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, g1.detach(), **tol)
    torch.testing.assert_close(W, -g2.detach(), **tol)
    torch.testing.assert_close(third, g3, **tol)


@pytest.mark.parametrize("lik, y", [
    (Poisson(), torch.tensor([0.0, -1.0, 2.0])),
    (Poisson(), torch.tensor([0.0, 1.5, 2.0])),
    (Poisson(), torch.tensor([0.0, float("nan"), 2.0])),
    (Poisson(), torch.ones(2, 2)),
    (Bernoulli(), torch.tensor([0.0, 2.0, 1.0])),
    (Bernoulli(), torch.tensor([1.0, 1.0, 1.0])),
    (BernoulliProbit(), torch.tensor([0.0, 0.5, 1.0])),
])
def test_bad_observations_name_y(lik, y):
    with pytest.raises(ValueError, match=r"\by\b"):
        lik.check(y)


def test_poisson_moments_against_monte_carlo():
    g = torch.Generator().manual_seed(0)
    mean, var = torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.4], dtype=torch.float64)
    f = mean + var.sqrt() * torch.randn(400_000, dtype=torch.float64, generator=g)
    y = torch.poisson(f.exp(), generator=g)
    m, v = Poisson.moments(mean, var)
    assert abs(float(m) - float(y.mean())) < 4 * float(y.std()) / 400_000**0.5
    assert abs(float(v) / float(y.var()) - 1) < 0.02


@pytest.mark.parametrize("lik", [Bernoulli(), BernoulliProbit()], ids=["logit", "probit"])
def test_derivatives_far_in_the_tails_against_50_digits(lik, dtype):
    """Both labels, latents from 3 000 misclassified to 30 correctly classified: every derivative within a few
    ulps of mpmath's 50-digit value in the working dtype. ``r + z`` and ``∇³`` of the probit cancel in the
    misclassified tail unless taken from a continued fraction, and float32's ``W`` there came out negative."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    zs = [-3000.0, -1000.0, -100.0, -30.0, -10.0, -4.0, -3.0, -2.5, -1.0, 0.0, 1.0, 3.0, 8.0, 20.0]

    def exact(z):  # (∇, W, ∇³) of log p at y = 1, latent z
        z = mpmath.mpf(z)
        if isinstance(lik, BernoulliProbit):
            r = mpmath.npdf(z) / mpmath.ncdf(z)
            return r, r * (r + z), r * (2 * r * r + 3 * z * r + z * z - 1)
        p, q = 1 / (1 + mpmath.exp(-z)), 1 / (1 + mpmath.exp(z))
        return q, p * q, -p * q * (q - p)

    rtol = 3e-6 if dtype == torch.float32 else 1e-11
    tiny = torch.finfo(dtype).tiny
    for label, sign in ((1.0, 1.0), (0.0, -1.0)):  # y = 0 mirrors y = 1 at -f, with ∇ and ∇³ negated
        f = sign * torch.tensor(zs, dtype=dtype)
        got = lik.derivatives(f, torch.full_like(f, label))
        assert bool((got[1] >= 0).all())
        for k, (name, value) in enumerate(zip(("grad", "W", "third"), got)):
            want = torch.tensor([float(exact(z)[k]) * (sign if k != 1 else 1.0) for z in zs], dtype=torch.float64)
            shown = want.abs() > tiny / rtol  # values float32 cannot hold are not asked of it
            torch.testing.assert_close(value.to(torch.float64)[shown], want[shown], rtol=rtol, atol=0,
                                       msg=lambda m, name=name: f"{name}, y = {label}: {m}")


def test_probit_far_in_the_tails_and_its_exact_predictive_probability():
    lik = BernoulliProbit()
    f = torch.tensor([-40.0, 40.0], dtype=torch.float64)
    grad, W, third = lik.derivatives(f, torch.tensor([1.0, 0.0], dtype=torch.float64))  # both badly misclassified
    assert bool(torch.isfinite(grad).all() & torch.isfinite(W).all() & torch.isfinite(third).all())
    torch.testing.assert_close(grad, torch.tensor([40.0, -40.0], dtype=torch.float64), rtol=1e-3, atol=0)  # r ~ |z|
    torch.testing.assert_close(W, torch.ones(2, dtype=torch.float64), rtol=1e-3, atol=0)  # W -> 1 as z -> -inf
    # P(y = 1) = E[Φ(f)] over f ~ N(μ, v) is Φ(μ / √(1 + v)): against Monte Carlo
    g = torch.Generator().manual_seed(0)
    mean, var = torch.tensor([0.7, -1.2], dtype=torch.float64), torch.tensor([0.5, 2.0], dtype=torch.float64)
    draws = mean + var.sqrt() * torch.randn(200_000, 2, generator=g, dtype=torch.float64)
    p1, _ = lik.moments(mean, var)
    torch.testing.assert_close(p1, torch.special.ndtr(draws).mean(0), rtol=0, atol=3e-3)
