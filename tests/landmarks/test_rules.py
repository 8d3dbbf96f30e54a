"""Tests of gpnys.landmarks.rules and .leverage: landmark rules, approximate ridge leverage scores, m = auto."""

from __future__ import annotations

import pytest
import torch

from gpnys import datasets, landmarks
from gpnys.kernels import make_kernel
from gpnys.landmarks import RULES, choose_m, ridge_leverage_scores, select_landmarks
from gpnys.landmarks.rank import numerical_rank

F64 = torch.float64


def scale_kernel(lengthscale: float, outputscale: float = 1.0, dtype: torch.dtype = F64):
    kern = make_kernel("rbf").to(dtype)
    kern.base_kernel.lengthscale = lengthscale
    kern.outputscale = outputscale
    return kern


@pytest.fixture(scope="module")
def concrete() -> torch.Tensor:
    return datasets.load("concrete", n=300, seed=0).train_x


def exact_scores(X: torch.Tensor, kern, lam: float) -> torch.Tensor:
    """diag(K (K + lam I)^{-1}) = 1 - lam diag((K + lam I)^{-1}), dense, float64."""
    with torch.no_grad():
        K = kern(X.double()).to_dense().double()
    return 1 - lam * torch.linalg.inv(K + lam * torch.eye(X.shape[0], dtype=F64)).diagonal()


def ranks(v: torch.Tensor) -> torch.Tensor:
    return v.argsort().argsort().double()


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_returns_m_distinct_landmarks(rule, dtype):
    X = torch.rand(120, 3, generator=torch.Generator().manual_seed(0), dtype=dtype)
    C, idx = select_landmarks(X, 17, rule=rule, kernel=scale_kernel(0.3, 2.0, dtype), noise=0.01, seed=3)
    assert C.shape == (17, 3) and C.dtype == dtype
    assert torch.unique(C, dim=0).shape[0] == 17
    if rule == "kmeans":
        assert idx is None
    else:
        assert idx.dtype == torch.long and idx.shape == (17,)
        assert torch.unique(idx).numel() == 17 and int(idx.min()) >= 0 and int(idx.max()) < 120
        assert torch.equal(C, X[idx])


@pytest.mark.parametrize("rule", ["uniform", "fps", "kmeans"])
def test_rules_delegate_to_gpnys_landmarks(rule):
    X = torch.randn(80, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    C, idx = select_landmarks(X, 9, rule=rule, seed=5)
    C_ref, idx_ref = landmarks.select(X, 9, method=rule, seed=5)
    assert torch.equal(C, C_ref)
    assert (idx is None and idx_ref is None) or torch.equal(idx, idx_ref)


@pytest.mark.parametrize("rule", ["uniform", "leverage"])
def test_m_equals_n_takes_every_point_once(rule):
    X = torch.rand(25, 2, generator=torch.Generator().manual_seed(2), dtype=F64)
    _, idx = select_landmarks(X, 25, rule=rule, kernel=scale_kernel(0.5), noise=0.1)
    assert sorted(idx.tolist()) == list(range(25))


def test_leverage_scores_exact_with_full_sketch(concrete):
    # sketch_size = n: span of the sketch = span of all k(x_i, .), so the estimate is the exact score.
    for ls, os_, lam in [(3.0, 1.0, 0.1), (1.0, 2.5, 0.01), (0.5, 1.0, 1e-3)]:
        kern = scale_kernel(ls, os_)
        approx = ridge_leverage_scores(concrete, kern, lam, sketch_size=300, seed=1)
        assert approx.shape == (300,) and approx.dtype == F64
        torch.testing.assert_close(approx, exact_scores(concrete, kern, lam), rtol=0, atol=1e-8)


def test_leverage_scores_approximate_exact_ones_on_real_data(concrete):
    # Concrete (d = 8, standardised), RBF l = 3, noise 0.1: effective dimension ~60 of n = 300.
    kern, lam = scale_kernel(3.0), 0.1
    exact = exact_scores(concrete, kern, lam)
    d_eff = float(exact.sum())
    assert 40 < d_eff < 80
    for seed in range(3):
        approx = ridge_leverage_scores(concrete, kern, lam, sketch_size=200, seed=seed)
        assert corr(ranks(approx), ranks(exact)) > 0.95  # measured >= 0.997
        assert corr(approx, exact) > 0.9  # measured >= 0.95
        assert abs(float(approx.sum()) / d_eff - 1) < 0.1  # measured <= 0.05
        assert bool((approx >= 0).all()) and bool((approx <= 1).all())
    # A small sketch is a visibly worse estimate: the tolerances above can fail.
    small = ridge_leverage_scores(concrete, kern, lam, sketch_size=60, seed=0)
    assert abs(float(small.sum()) / d_eff - 1) > 0.1


def test_leverage_scores_bounded_by_diagonal_bound():
    # Exact scores satisfy tau_i <= k_ii / (k_ii + lam); far-away points reach it.
    X = torch.cat([torch.zeros(20, 2, dtype=F64), torch.tensor([[50.0, 50.0]], dtype=F64)])
    kern, lam = scale_kernel(1.0, 2.0), 0.5
    tau = ridge_leverage_scores(X, kern, lam, sketch_size=3, seed=0)
    torch.testing.assert_close(tau, exact_scores(X, kern, lam), rtol=0, atol=1e-10)
    assert abs(float(tau[-1]) - 2.0 / 2.5) < 1e-12


def clustered(seed: int = 0) -> torch.Tensor:
    """250 points in a tight cluster at the origin plus 50 points scattered over [-10, 10]^2 (rows 250-299)."""
    g = torch.Generator().manual_seed(seed)
    tight = 0.01 * torch.randn(250, 2, generator=g, dtype=F64)
    scattered = 20 * torch.rand(50, 2, generator=g, dtype=F64) - 10
    return torch.cat([tight, scattered])


def test_leverage_sampling_prefers_scattered_points():
    X, kern, m = clustered(), scale_kernel(0.5), 20
    lev = sum(int((select_landmarks(X, m, "leverage", kern, 0.01, seed=s)[1] >= 250).sum()) for s in range(5))
    uni = sum(int((select_landmarks(X, m, "uniform", seed=s)[1] >= 250).sum()) for s in range(5))
    # Uniform expects 5 * 20 / 6 ~ 17 scattered picks; leverage puts nearly all 100 picks there.
    assert uni < 40
    assert lev > 80 and lev > 2 * uni


def test_same_seed_same_landmarks_different_seed_different(dtype):
    X = torch.rand(200, 3, generator=torch.Generator().manual_seed(4), dtype=dtype)
    kern = scale_kernel(0.3, 1.0, dtype)
    for rule in ("uniform", "kmeans", "leverage"):
        a = select_landmarks(X, 15, rule, kern, 0.01, seed=7)[0]
        b = select_landmarks(X, 15, rule, kern, 0.01, seed=7)[0]
        c = select_landmarks(X, 15, rule, kern, 0.01, seed=8)[0]
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
    s1 = ridge_leverage_scores(X, kern, 0.01, sketch_size=30, seed=1)
    assert torch.equal(s1, ridge_leverage_scores(X, kern, 0.01, sketch_size=30, seed=1))
    assert not torch.equal(s1, ridge_leverage_scores(X, kern, 0.01, sketch_size=30, seed=2))


def test_float32_leverage_scores_close_to_float64(concrete):
    kern32, kern64, lam = scale_kernel(3.0, 1.0, torch.float32), scale_kernel(3.0), 0.1
    s32 = ridge_leverage_scores(concrete.float(), kern32, lam, sketch_size=300, seed=0)
    assert s32.dtype == torch.float32 and bool(torch.isfinite(s32).all())
    assert float((s32.double() - exact_scores(concrete, kern64, lam)).abs().max()) < 2e-3  # measured 4e-4
    C, idx = select_landmarks(concrete.float(), 30, "leverage", kern32, lam, seed=0)
    assert C.dtype == torch.float32 and torch.unique(idx).numel() == 30


def test_choose_m_in_range_and_grows_as_lengthscale_shrinks(concrete):
    ms = [choose_m(concrete, scale_kernel(ls), 0.01) for ls in (4.0, 2.0, 1.0, 0.5)]
    assert all(1 <= m <= 300 for m in ms)
    assert ms == sorted(ms) and ms[0] < ms[-1] - 50  # measured 112, 215, 274, 290
    assert choose_m(concrete, scale_kernel(4.0), 0.01, m_max=50) == 50
    assert choose_m(concrete, scale_kernel(4.0), 0.01, m_max=1000) == ms[0]


def test_choose_m_is_the_numerical_rank_of_the_unit_variance_kernel(concrete):
    # n = 300 <= estimate_rank's subsample size: the estimate is #{lambda_i(K_1) > 0.1 noise / outputscale}.
    X = concrete[:150]
    unit = scale_kernel(2.0).base_kernel
    with torch.no_grad():
        evals = torch.linalg.eigvalsh(unit(X).to_dense())
    for outputscale in (1.0, 4.0):
        m = choose_m(X, scale_kernel(2.0, outputscale), 0.02)
        assert m == numerical_rank(evals, 0.02 / outputscale)
    assert choose_m(X, unit, 0.02) == numerical_rank(evals, 0.02)


def test_bad_inputs():
    X = torch.rand(10, 2, dtype=F64)
    kern = scale_kernel(0.5)
    for m in (0, -1, 11, 2.5, True, "3"):
        with pytest.raises(ValueError, match="m"):
            select_landmarks(X, m)
    with pytest.raises(ValueError, match="rule"):
        select_landmarks(X, 3, rule="random")
    with pytest.raises(ValueError, match="empty"):
        select_landmarks(torch.empty(0, 2, dtype=F64), 1)
    for bad_value in (float("nan"), float("inf")):
        bad = X.clone()
        bad[3, 1] = bad_value
        with pytest.raises(ValueError, match="NaN or inf"):
            select_landmarks(bad, 3, "uniform")
        with pytest.raises(ValueError, match="NaN or inf"):
            ridge_leverage_scores(bad, kern, 0.1)
        with pytest.raises(ValueError, match="NaN or inf"):
            choose_m(bad, kern, 0.1)
    with pytest.raises(ValueError, match="kernel"):
        select_landmarks(X, 3, "leverage", noise=0.1)
    with pytest.raises(ValueError, match="noise"):
        select_landmarks(X, 3, "leverage", kernel=kern)
    for noise in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="noise"):
            select_landmarks(X, 3, "leverage", kernel=kern, noise=noise)
        with pytest.raises(ValueError, match="noise"):
            ridge_leverage_scores(X, kern, noise)
        with pytest.raises(ValueError, match="noise"):
            choose_m(X, kern, noise)
    with pytest.raises(ValueError, match="sketch_size"):
        ridge_leverage_scores(X, kern, 0.1, sketch_size=11)
    with pytest.raises(ValueError, match="m_max"):
        choose_m(X, kern, 0.1, m_max=0)
    with pytest.raises(ValueError, match="seed"):
        select_landmarks(X, 3, "uniform", seed=1.5)
