import math

import pytest
import torch

from gpnys import datasets, landmarks
from gpnys.checks import NumericalWarning
from gpnys.kernels import make_kernel
from gpnys.reduced.nytro import landmark_factor, nystrom_krr, nytro, predict


@pytest.fixture(scope="module")
def data():
    return datasets.load("concrete", n=300, seed=0)


def rbf(lengthscale=2.0, outputscale=1.0, dtype=torch.float64):
    kern = make_kernel("rbf").to(dtype)
    kern.base_kernel.lengthscale = lengthscale
    kern.outputscale = outputscale
    return kern


def blocks(kern, X, C):
    with torch.no_grad():
        return kern(X, C).to_dense(), kern(C, C).to_dense()


def pick(X, m, seed=0):
    return X[landmarks.uniform(X.shape[0], m, seed=seed)]


def test_fitted_values_are_the_spectral_filter(data):
    X, y = data.train_x, data.train_y
    kern = rbf(2.0, outputscale=1.3)
    C = pick(X, 40)
    path = nytro(kern, X, y, C, t_max=60, stop="none")
    assert path.alpha.shape == (60, 40) and path.t_stop == 60 and path.gamma == pytest.approx(1 / 1.3)
    assert path.lam(10) == pytest.approx(1.3 / 10)
    Knm, Kmm = blocks(kern, X, C)
    G = Knm @ torch.linalg.pinv(Kmm, hermitian=True) @ Knm.mT  # A A^T
    n = X.shape[0]
    S = torch.eye(n, dtype=X.dtype) - path.gamma / n * G
    for t in (1, 2, 7, 60):
        ref = y - torch.linalg.matrix_power(S, t) @ y  # [I - (I - (gamma/n) A A^T)^t] y
        torch.testing.assert_close(Knm @ path.alpha[t - 1], ref, rtol=0, atol=1e-8)
    torch.testing.assert_close(path.alpha_stop, path.alpha[-1])


def test_converges_to_nystrom_least_squares(data):
    X, y = data.train_x, data.train_y
    kern = rbf(2.0)
    C = pick(X, 5, seed=1)
    Knm, Kmm = blocks(kern, X, C)
    n = X.shape[0]
    smax = float(torch.linalg.matrix_norm(Knm @ torch.linalg.cholesky(torch.linalg.inv(Kmm)), ord=2)) ** 2
    path = nytro(kern, X, y, C, t_max=1500, gamma=n / smax, stop="none")  # step 1 / ||A^T A||
    ref = torch.linalg.lstsq(Knm, y[:, None]).solution[:, 0]  # K_mm has full rank: alpha = R beta is no restriction
    torch.testing.assert_close(path.alpha[-1], ref, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(Knm @ path.alpha[-1], Knm @ ref, rtol=0, atol=1e-8)


def test_nystrom_krr_matches_dense_formula(data):
    X, y = data.train_x, data.train_y
    kern = rbf(2.0, outputscale=0.8)
    C = pick(X, 40)
    Knm, Kmm = blocks(kern, X, C)
    n = X.shape[0]
    lams = torch.tensor([1e-6, 1e-3, 1e-1], dtype=X.dtype)
    path = nystrom_krr(kern, X, y, C, lams)
    assert path.shape == (3, 40)
    for i, lam in enumerate(lams.tolist()):
        ref = torch.linalg.pinv(Knm.mT @ Knm + lam * n * Kmm, hermitian=True) @ (Knm.mT @ y)
        one = nystrom_krr(kern, X, y, C, lam)
        assert one.shape == (40,)
        scale = float(ref.abs().max())
        torch.testing.assert_close(one, ref, rtol=0, atol=1e-8 * max(1.0, scale))
        torch.testing.assert_close(path[i], one, rtol=0, atol=1e-10 * max(1.0, scale))
    assert nystrom_krr(kern, X, y, C, [1e-3]).shape == (1, 40)


def test_nytro_tracks_nkrls_at_matched_lambda(data):
    # both are spectral filters of A A^T; g_t(s) and s / (s + n / (gamma t)) differ by at most 1/2 for every s
    X, y = data.train_x, data.train_y
    kern = rbf(2.0)
    C = pick(X, 30)
    path = nytro(kern, X, y, C, t_max=200, stop="none")
    Knm, _ = blocks(kern, X, C)
    for t in (5, 50, 200):
        krr = nystrom_krr(kern, X, y, C, path.lam(t))
        diff = Knm @ (path.alpha[t - 1] - krr)
        assert float(diff.norm()) <= 0.5 * float(y.norm())


def test_duplicated_landmarks_warn_and_predict_like_unique(data):
    X, y, Z = data.train_x, data.train_y, data.test_x
    kern = rbf(2.0)
    C = pick(X, 20)
    Cdup = torch.cat([C, C[:5]])
    with pytest.warns(NumericalWarning, match="5 of 25"):
        path = nytro(kern, X, y, Cdup, t_max=30, stop="none", Z=Z)
    with pytest.warns(NumericalWarning, match="5 of 25"):
        krr = nystrom_krr(kern, X, y, Cdup, 1e-3)
    assert path.rank == 20 and torch.isfinite(path.alpha).all() and torch.isfinite(krr).all()
    ref = nytro(kern, X, y, C, t_max=30, stop="none", Z=Z)
    torch.testing.assert_close(path.predictions, ref.predictions, rtol=0, atol=1e-8)
    torch.testing.assert_close(predict(kern, Cdup, krr, Z), predict(kern, C, nystrom_krr(kern, X, y, C, 1e-3), Z),
                               rtol=0, atol=1e-8)


def test_stop_rules(data):
    X, y, Xv, yv = data.train_x, data.train_y, data.test_x, data.test_y
    kern = rbf(2.0)
    C = pick(X, 30)
    full = nytro(kern, X, y, C, t_max=200, X_val=Xv, y_val=yv, stop="none")
    assert full.val_rmse.shape == (200,)
    torch.testing.assert_close(full.val_rmse, (predict(kern, C, full.alpha, Xv) - yv).square().mean(1).sqrt())
    assert full.val_rmse0 == pytest.approx(float(yv.square().mean().sqrt()))
    # threshold: stops at the first step whose relative decrease is below tau; the path ends there
    th = nytro(kern, X, y, C, t_max=200, X_val=Xv, y_val=yv, stop="threshold", tau=0.01)
    e = torch.cat([torch.tensor([full.val_rmse0], dtype=X.dtype), full.val_rmse])
    rel = (e[:-1] - e[1:]) / e[:-1]
    first = int(torch.nonzero(rel < 0.01)[0]) + 1
    assert 1 < th.t_stop == first < 200 and th.alpha.shape == (first, 30)
    torch.testing.assert_close(th.alpha, full.alpha[:first])
    torch.testing.assert_close(th.alpha_stop, full.alpha[first - 1])
    assert nytro(kern, X, y, C, t_max=200, X_val=Xv, y_val=yv).t_stop <= first  # tau = 5%: earlier still
    # best: validation targets that step 37 fits exactly -> argmin at t = 37
    target = predict(kern, C, full.alpha[36], Xv)
    best = nytro(kern, X, y, C, t_max=200, X_val=Xv, y_val=target, stop="best", Z=Xv)
    assert best.t_stop == 37 and best.alpha.shape == (200, 30)
    assert int(torch.argmin(best.val_rmse)) == 36
    torch.testing.assert_close(best.alpha_stop, full.alpha[36])
    torch.testing.assert_close(best.predictions[36], target)


def test_float32(data):
    X, y = data.train_x.float(), data.train_y.float()
    kern = rbf(2.0, dtype=torch.float32)
    C = pick(X, 30)
    path = nytro(kern, X, y, C, t_max=100, X_val=data.test_x.float(), y_val=data.test_y.float(), stop="best")
    assert path.alpha.dtype == torch.float32 and torch.isfinite(path.alpha).all()
    assert float(path.val_rmse.min()) < path.val_rmse0
    Knm, _ = blocks(kern, X, C)
    assert float((Knm @ path.alpha[-1] - y).norm()) < float(y.norm())
    ref = nytro(rbf(2.0), data.train_x, data.train_y, pick(data.train_x, 30), t_max=100, stop="none")
    torch.testing.assert_close(path.alpha[-1].double(), ref.alpha[-1], rtol=1e-3, atol=1e-3)
    krr = nystrom_krr(kern, X, y, C, torch.tensor([1e-2, 1e-4]))
    assert krr.dtype == torch.float32 and torch.isfinite(krr).all()


def test_seeded(data):
    X, y = data.train_x, data.train_y
    kern = rbf(2.0)
    a = nytro(kern, X, y, pick(X, 20, seed=3), t_max=20, stop="none")
    b = nytro(kern, X, y, pick(X, 20, seed=3), t_max=20, stop="none")
    c = nytro(kern, X, y, pick(X, 20, seed=4), t_max=20, stop="none")
    assert torch.equal(a.alpha, b.alpha) and not torch.allclose(a.alpha, c.alpha)


def test_landmark_factor_is_pseudo_inverse_root(data):
    kern = rbf(2.0)
    C = pick(data.train_x, 25)
    R = landmark_factor(kern, C).A
    _, Kmm = blocks(kern, C, C)
    torch.testing.assert_close(R @ R.mT, torch.linalg.pinv(Kmm, hermitian=True), rtol=1e-8, atol=1e-8)


def test_bad_input(data):
    X, y, Xv, yv = data.train_x[:50], data.train_y[:50], data.test_x[:10], data.test_y[:10]
    kern = rbf(2.0)
    C = X[:5]
    with pytest.raises(ValueError, match="m=51 landmarks exceed"):
        nytro(kern, X, y, torch.cat([X, X[:1]]), stop="none")
    with pytest.raises(ValueError, match="landmarks"):
        nytro(kern, X, y, X[:0], stop="none")
    with pytest.raises(ValueError, match="landmarks"):
        nystrom_krr(kern, X, y, X[:0], 0.1)
    for t_max in (0, -3, 2.5):
        with pytest.raises(ValueError, match="t_max"):
            nytro(kern, X, y, C, t_max=t_max, stop="none")
    for gamma in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="gamma"):
            nytro(kern, X, y, C, gamma=gamma, stop="none")
    bad = y.clone()
    bad[3] = math.nan
    with pytest.raises(ValueError, match="y contains NaN"):
        nytro(kern, X, bad, C, stop="none")
    with pytest.raises(ValueError, match="y contains NaN"):
        nystrom_krr(kern, X, bad, C, 0.1)
    with pytest.raises(ValueError, match="y_val contains NaN"):
        nytro(kern, X, y, C, X_val=Xv, y_val=torch.full_like(yv, math.nan))
    with pytest.raises(ValueError, match="y must have shape"):
        nytro(kern, X, y[:40], C, stop="none")
    with pytest.raises(ValueError, match="landmarks must have d=8"):
        nystrom_krr(kern, X, y, C[:, :3], 0.1)
    with pytest.raises(ValueError, match="X_val must have d=8"):
        nytro(kern, X, y, C, X_val=Xv[:, :3], y_val=yv)
    with pytest.raises(ValueError, match="y_val must have shape"):
        nytro(kern, X, y, C, X_val=Xv, y_val=yv[:4])
    with pytest.raises(ValueError, match="X_val and y_val"):
        nytro(kern, X, y, C, X_val=Xv)
    with pytest.raises(ValueError, match="validation set"):
        nytro(kern, X, y, C, stop="best")
    with pytest.raises(ValueError, match="stop must be"):
        nytro(kern, X, y, C, stop="early")
    with pytest.raises(ValueError, match="tau"):
        nytro(kern, X, y, C, X_val=Xv, y_val=yv, tau=0)
    with pytest.raises(ValueError, match="Z must have d=8"):
        nytro(kern, X, y, C, stop="none", Z=Xv[:, :2])
    for lam in (0.0, -1.0, math.nan, torch.tensor([1e-3, 0.0]), [], torch.ones(2, 2)):
        with pytest.raises(ValueError, match="lam"):
            nystrom_krr(kern, X, y, C, lam)
    alpha = nystrom_krr(kern, X, y, C, 0.1)
    with pytest.raises(ValueError, match="alpha must have shape"):
        predict(kern, C, alpha[:3], Xv)
    with pytest.raises(ValueError, match="Z must have d=8"):
        predict(kern, C, alpha, Xv[:, :2])


def test_divergence_is_reported(data):
    X, y = data.train_x[:50], data.train_y[:50]
    with pytest.warns(NumericalWarning, match="diverged"):
        path = nytro(rbf(2.0), X, y, X[:5], t_max=200, gamma=1e4, stop="none")
    assert not torch.isfinite(path.alpha[-1]).all()
