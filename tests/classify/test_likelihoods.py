"""The Laplace likelihoods' derivatives against autograd of their log densities, and their checks of y."""

from __future__ import annotations

import pytest
import torch

from gpnys.classify.likelihoods import Bernoulli, Poisson


@pytest.mark.parametrize("lik, y", [(Bernoulli(), torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])),
                                    (Poisson(), torch.tensor([0.0, 3.0, 1.0, 7.0, 2.0]))], ids=["bernoulli", "poisson"])
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
