import math

import gpytorch
import pytest
import torch
from helpers import points
from scipy import stats

from gpnys.kernels import make_kernel
from gpnys.reduced.rff import RandomFourierFeatures, RFFPosterior


def kernel(name, lengthscale, outputscale=1.0, ard=None, dtype=torch.float64):
    kern = make_kernel(name, ard_num_dims=ard).to(dtype)
    kern.base_kernel.lengthscale = lengthscale
    kern.outputscale = outputscale
    return kern


def dense(kern, A, B=None):
    with torch.no_grad():
        return kern(A, A if B is None else B).to_dense().to(A.dtype)


@pytest.mark.parametrize(
    "name, lengthscale, ard",
    [("rbf", 0.7, None), ("matern32", 0.8, None), ("matern12", 1.0, None), ("matern52", 0.6, None),
     ("rbf", [0.4, 1.0, 2.5], 3), ("matern32", [0.5, 2.0, 1.0], 3)],
)
def test_features_approximate_kernel(name, lengthscale, ard):
    X = points(50, 3, scale=2.0)
    kern = kernel(name, torch.tensor(lengthscale, dtype=torch.float64), outputscale=1.7, ard=ard)
    rff = RandomFourierFeatures(kern, 3, 20000, seed=0, dtype=torch.float64)
    Phi = rff(X)
    assert Phi.shape == (50, 40000) and rff.num_features == 40000
    err = (Phi @ Phi.mT - dense(kern, X)).abs().max()
    assert float(err) < 0.05 * 1.7  # Monte-Carlo error ~ s^2 / sqrt(D) per entry
    torch.testing.assert_close(Phi.square().sum(1), torch.full((50,), 1.7, dtype=torch.float64))  # cos^2 + sin^2


def test_rbf_frequency_distribution():
    kern = kernel("rbf", torch.tensor([0.5, 2.0, 1.0, 4.0]), ard=4)
    rff = RandomFourierFeatures(kern, 4, 20000, seed=3, dtype=torch.float64)
    W = rff.frequencies() * kern.base_kernel.lengthscale.detach()  # Omega l = G ~ N(0, I)
    assert W.shape == (20000, 4)
    assert float(W.mean(0).abs().max()) < 0.05
    assert float((torch.cov(W.mT) - torch.eye(4, dtype=W.dtype)).abs().max()) < 0.05


@pytest.mark.parametrize("name, nu", [("matern12", 0.5), ("matern32", 1.5), ("matern52", 2.5)])
def test_matern_frequencies_are_student_t(name, nu):
    # each coordinate of Omega l is univariate Student-t with 2 nu degrees of freedom; the norm ||Omega l||^2 / d
    # follows F(d, 2 nu)
    kern = kernel(name, 1.3)
    rff = RandomFourierFeatures(kern, 3, 5000, seed=1, dtype=torch.float64)
    W = (rff.frequencies() * 1.3).numpy()
    assert stats.kstest(W[:, 0], "t", args=(2 * nu,)).pvalue > 1e-3
    assert stats.kstest((W**2).sum(1) / 3, "f", args=(3, 2 * nu)).pvalue > 1e-3
    assert stats.kstest(W[:, 0], "norm").pvalue < 1e-3  # not Gaussian


def test_hyperparameters_read_at_call_time():
    X = points(20, 2)
    kern = kernel("matern32", 0.5, outputscale=2.0)
    rff = RandomFourierFeatures(kern, 2, 100, seed=0, dtype=torch.float64)
    Phi = rff(X)
    kern.base_kernel.lengthscale = 1.0
    kern.outputscale = 0.5
    torch.testing.assert_close(rff(2 * X), 0.5 * Phi)  # same draws, frequencies halved, amplitude halved


def test_posterior_is_exact_gp_of_feature_kernel():
    X, Z = points(120, 3, seed=1), points(30, 3, seed=2)
    y = torch.sin(3 * X).sum(1)
    kern = kernel("matern52", 0.6, outputscale=1.5)
    noise, mu = 0.05, 0.3
    post = RFFPosterior(kern, X, y, noise, 40, seed=4, prior_mean=mu)
    assert post.method == "rff" and post.num_features == 80
    Phi, Phi_z = post.features(X), post.features(Z)
    K = Phi @ Phi.mT + noise * torch.eye(120, dtype=X.dtype)
    L = torch.linalg.cholesky(K)
    Kzx = Phi_z @ Phi.mT
    mean = mu + Kzx @ torch.cholesky_solve((y - mu)[:, None], L)[:, 0]
    var = (Phi_z.square().sum(1) - (Kzx * torch.cholesky_solve(Kzx.mT, L).mT).sum(1))
    torch.testing.assert_close(post.mean(Z), mean, rtol=0, atol=1e-8)
    torch.testing.assert_close(post.variance(Z), var, rtol=0, atol=1e-8)
    # with many features it approaches the exact GP of the kernel itself
    big = RFFPosterior(kern, X, y, noise, 1000, seed=4, prior_mean=mu)
    Kx = dense(kern, X) + noise * torch.eye(120, dtype=X.dtype)
    exact = mu + dense(kern, Z, X) @ torch.linalg.solve(Kx, y - mu)
    assert float((big.mean(Z) - exact).abs().max()) < 0.1 * float(y.abs().max())


def test_float32():
    X = points(60, 2, dtype=torch.float32)
    y = X.sum(1)
    kern = kernel("rbf", 0.5, dtype=torch.float32)
    post = RFFPosterior(kern, X, y, 0.1, 50, seed=0)
    assert post.Phi.dtype == torch.float32 and post.mean(X).dtype == torch.float32
    assert torch.isfinite(post.mean(X)).all() and bool((post.variance(X) >= 0).all())
    rff = RandomFourierFeatures(kern, 2, 2000, seed=0, dtype=torch.float32)
    assert float((rff(X) @ rff(X).mT - dense(kern, X)).abs().max()) < 0.15


def test_seeded():
    X = points(10, 3)
    kern = kernel("matern12", 1.0)
    a = RandomFourierFeatures(kern, 3, 30, seed=5, dtype=torch.float64)(X)
    b = RandomFourierFeatures(kern, 3, 30, seed=5, dtype=torch.float64)(X)
    c = RandomFourierFeatures(kern, 3, 30, seed=6, dtype=torch.float64)(X)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_bad_input():
    X, y = points(10, 3), torch.zeros(10, dtype=torch.float64)
    kern = kernel("rbf", 1.0)
    with pytest.raises(ValueError, match="num_frequencies"):
        RandomFourierFeatures(kern, 3, 0)
    with pytest.raises(ValueError, match="num_frequencies"):
        RFFPosterior(kern, X, y, 0.1, -2)
    with pytest.raises(ValueError, match="d="):
        RandomFourierFeatures(kernel("rbf", torch.ones(2), ard=2), 3, 10)
    with pytest.raises(ValueError, match="kernel"):
        RandomFourierFeatures(gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel()), 3, 10)
    with pytest.raises(ValueError, match="kernel"):
        RandomFourierFeatures(gpytorch.kernels.LinearKernel(), 3, 10)
    rff = RandomFourierFeatures(kern, 3, 10)
    with pytest.raises(ValueError, match="X must have d=3"):
        rff(points(5, 2))
    bad = X.clone()
    bad[2, 1] = math.nan
    with pytest.raises(ValueError, match="X contains NaN"):
        rff(bad)
    with pytest.raises(ValueError, match="X contains NaN"):
        RFFPosterior(kern, bad, y, 0.1, 10)
    for noise in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="noise"):
            RFFPosterior(kern, X, y, noise, 10)
    with pytest.raises(ValueError, match="y must have shape"):
        RFFPosterior(kern, X, y[:5], 0.1, 10)
    post = RFFPosterior(kern, X, y, 0.1, 10)
    with pytest.raises(ValueError, match="Z must have d=3"):
        post.mean(points(4, 1))
    with pytest.raises(ValueError, match="Z"):
        post.variance(torch.empty(0, 3, dtype=torch.float64))
