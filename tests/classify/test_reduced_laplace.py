"""ReducedLaplaceGP / ReducedLaplaceClassifier against the dense Laplace approximation (Rasmussen & Williams 2006,
Algorithm 3.1, Cholesky of B) on the same Nyström kernel K̃ = K_nm K_mm⁻¹ K_mn, and, with every point a landmark,
on the exact kernel. Gradients against autograd through the dense Newton iteration."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch
from sklearn.exceptions import NotFittedError

from gpnys.baselines.laplace import dense_laplace
from gpnys.classify import ReducedLaplaceClassifier, ReducedLaplaceGP, StudentT
from gpnys.landmarks import select

F64 = torch.float64


def labels(n, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, dtype=dtype, generator=g)
    y = (torch.sin(6 * X[:, 0]) + X[:, 1] > 0.8).to(dtype)
    flip = torch.rand(n, generator=g) < 0.1
    y[flip] = 1 - y[flip]
    return X, y


def observations(name, n, dtype=F64, seed=0):
    """``(X, y, likelihood)`` for each likelihood."""
    if name in ("bernoulli", "bernoulli_probit"):
        return (*labels(n, dtype, seed), name)
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, dtype=dtype, generator=g)
    f = 1 + torch.sin(6 * X[:, 0])
    if name == "poisson":
        return X, torch.poisson(f.exp(), generator=g), name
    y = f + 0.3 * torch.randn(n, dtype=dtype, generator=g)
    y[::17] += 4.0  # outliers
    return X, y, StudentT(df=4.0, scale=0.4)


def make_kernel(dtype=F64, lengthscale=0.3):
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).to(dtype)
    k.base_kernel.lengthscale, k.outputscale = lengthscale, 2.0
    return k


def nystrom_kernel(kernel, X, C):
    """K̃ = K_nm K_mm⁻¹ K_mn with autograd (K_mm full rank here)."""
    Kx = kernel(X, C).to_dense()
    return Kx @ torch.linalg.solve(kernel(C, C).to_dense(), Kx.mT)


LIKELIHOODS = ("bernoulli", "bernoulli_probit", "poisson", "studentt")


@pytest.mark.parametrize("name", LIKELIHOODS)
def test_mode_log_q_and_gradient_match_the_dense_laplace_on_the_nystrom_kernel(name):
    X, y, lik = observations(name, 200)
    kernel = make_kernel()
    C = select(X, 25, "fps")[0]
    gp = ReducedLaplaceGP(kernel, likelihood=copy.deepcopy(lik) if not isinstance(lik, str) else lik, landmarks=C,
                          rtol=1e-14).fit(X, y)
    assert gp.rank_ == 25 and gp.dropped_ == 0
    ref_lik = gp.likelihood_ if not isinstance(lik, str) else None
    ref_kernel = copy.deepcopy(kernel)
    ref_params = [p for _, p in ref_kernel.named_parameters()]
    if name == "studentt":
        ref_lik = copy.deepcopy(gp.likelihood_)
        ref_params += ref_lik.parameters()
    ref = dense_laplace(nystrom_kernel(ref_kernel, X, C), y, likelihood=ref_lik or gp.likelihood_)
    assert (gp.f_hat_ - ref.f.detach()).abs().max() < 1e-7
    log_q = float(ref.log_q.detach())
    assert abs(gp.log_marginal_likelihood_ - log_q) < 1e-8 * abs(log_q)
    expected = torch.autograd.grad(ref.log_q, ref_params)
    got = list(gp.mll_gradient_.values())
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert torch.allclose(g.reshape(-1), e.reshape(-1), rtol=1e-6, atol=1e-8), (g, e)


def test_every_point_a_landmark_is_the_exact_laplace():
    X, y = labels(80)
    kernel = make_kernel(lengthscale=0.1)  # well conditioned: no direction of K is cut off
    gp = ReducedLaplaceClassifier(kernel, landmarks=X, rtol=1e-14).fit(X, y)
    assert gp.rank_ == 80
    with torch.no_grad():
        ref = dense_laplace(kernel(X).to_dense(), y)
    assert abs(gp.log_marginal_likelihood_ - float(ref.log_q)) < 1e-7 * abs(float(ref.log_q))
    assert (gp.f_hat_ - ref.f).abs().max() < 1e-6


def central_differences(fit, params, h=1e-6):
    """``∂ log q / ∂p`` of ``fit()`` (a fitted model's log q) for every entry of ``params``, by central differences."""
    out = []
    for p in params:
        flat = p.data.reshape(-1)
        for i in range(flat.numel()):
            old = float(flat[i])
            flat[i] = old + h
            up = fit().log_marginal_likelihood_
            flat[i] = old - h
            down = fit().log_marginal_likelihood_
            flat[i] = old
            out.append((up - down) / (2 * h))
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("case", ["rank", "duplicates"])
def test_gradient_with_directions_cut_off_matches_central_differences(case):
    """With directions of K_mm dropped (``rank=`` keeps the top 10 of 30; duplicated landmarks fall below ``rtol``)
    the gradient includes the kept directions' turn towards the dropped ones."""
    X, y = labels(150)
    kernel = make_kernel()
    C = select(X, 30, "fps")[0]
    options = {"landmarks": C, "rank": 10} if case == "rank" else {"landmarks": torch.cat([C[:20], C[:10]])}
    fit = lambda: ReducedLaplaceClassifier(kernel, newton_tol=1e-12, **options).fit(X, y)  # noqa: E731
    clf = fit()
    assert clf.dropped_ == (20 if case == "rank" else 10)
    got = torch.cat([g.reshape(-1) for g in clf.mll_gradient_.values()])
    expected = central_differences(fit, [p for p in kernel.parameters()])
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got, expected)


def test_a_kernel_without_trainable_parameters_keeps_them_and_warns():
    X, y = labels(100)
    kernel = make_kernel()
    for p in kernel.parameters():
        p.requires_grad_(False)
    with pytest.warns(UserWarning, match="has a trainable parameter; no step is taken"):
        clf = ReducedLaplaceClassifier(kernel, m=20, optimizer_steps=3).fit(X, y)
    assert clf.mll_gradient_ == {} and clf.history_ == []
    assert float(kernel.base_kernel.lengthscale) == pytest.approx(0.3)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_newton_converges_in_both_precisions(dtype, recwarn):
    X, y = labels(2000, dtype)
    clf = ReducedLaplaceClassifier(make_kernel(dtype), m=100, landmarks="fps").fit(X, y)
    assert 2 <= clf.newton_iterations_ <= 20 < clf.max_newton
    assert not [w for w in recwarn if "max_newton" in str(w.message)]


@pytest.mark.parametrize("variance", ["dtc", "sor"])
def test_predictions_match_the_dense_laplace_on_the_nystrom_kernel(variance):
    X, y = labels(200)
    kernel = make_kernel()
    C = select(X, 30, "fps")[0]
    clf = ReducedLaplaceClassifier(kernel, landmarks=C, rtol=1e-14, variance=variance).fit(X, y)
    Xs = torch.rand(40, 2, dtype=F64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        K_all = nystrom_kernel(kernel, torch.cat([X, Xs]), C)
        n = X.shape[0]
        ref = dense_laplace(K_all[:n, :n], y)
        kss = K_all[n:, n:].diagonal()  # |φ*|², the Nyström prior variance
        mean, var = ref.latent(K_all[:n, n:], kss)
        if variance == "dtc":
            var = var + kernel(Xs, diag=True) - kss
    m, v = clf.predict_latent(Xs)
    assert torch.allclose(m, mean, atol=1e-7) and torch.allclose(v, var, atol=1e-7)
    p = clf.predict_proba(Xs)
    assert torch.allclose(p[:, 1], torch.sigmoid(mean / torch.sqrt(1 + torch.pi * var / 8)), atol=1e-7)
    assert torch.equal(clf.predict(Xs), (mean > 0).long())


def test_rank_truncation_is_the_dense_laplace_on_the_truncated_features():
    X, y = labels(150)
    kernel = make_kernel()
    C = select(X, 30, "fps")[0]
    clf = ReducedLaplaceClassifier(kernel, landmarks=C, rank=10).fit(X, y)
    assert clf.rank_ == 10
    with torch.no_grad():
        Phi = clf._fmap(X)
        ref = dense_laplace(Phi @ Phi.mT, y)
    assert abs(clf.log_marginal_likelihood_ - float(ref.log_q)) < 1e-8 * abs(float(ref.log_q))


def test_training_raises_log_q_and_the_subsample_path_runs():
    X, y = labels(400)
    kernel = make_kernel(lengthscale=1.0)
    before = ReducedLaplaceClassifier(copy.deepcopy(kernel), m=40, landmarks="uniform").fit(X, y)
    clf = ReducedLaplaceClassifier(kernel, m=40, landmarks="uniform", optimizer_steps=15, lr=0.1).fit(X, y)
    assert len(clf.history_) == 15
    assert clf.log_marginal_likelihood_ > before.log_marginal_likelihood_ + 1.0
    sub = ReducedLaplaceClassifier(make_kernel(lengthscale=1.0), m=40, landmarks="uniform", optimizer_steps=15,
                                   lr=0.1, subsample=200).fit(X, y)
    assert sub.log_marginal_likelihood_ > before.log_marginal_likelihood_ + 1.0
    assert float(sub.kernel_.base_kernel.lengthscale.detach()) < 1.0  # the subsample's steps moved the hyperparameters


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_same_seed_same_result_and_float32_agrees(dtype):
    X, y = labels(300)
    runs = [ReducedLaplaceClassifier(make_kernel(dtype), m=40, landmarks="kmeans", optimizer_steps=3, subsample=150,
                                     seed=3).fit(X.to(dtype), y.to(dtype)) for _ in range(2)]
    assert torch.equal(runs[0].landmarks_, runs[1].landmarks_) and torch.equal(runs[0].w_, runs[1].w_)
    assert runs[0].log_marginal_likelihood_ == runs[1].log_marginal_likelihood_
    assert runs[0].w_.dtype == dtype
    other = ReducedLaplaceClassifier(make_kernel(dtype), m=40, landmarks="kmeans", seed=4).fit(X.to(dtype), y.to(dtype))
    assert not torch.equal(other.landmarks_, runs[0].landmarks_)
    if dtype == torch.float32:  # against the same fit in float64, on the same landmarks
        ref = ReducedLaplaceClassifier(make_kernel(), landmarks=runs[0].landmarks_.double(), optimizer_steps=3,
                                       subsample=150, seed=3).fit(X, y)
        assert abs(runs[0].log_marginal_likelihood_ - ref.log_marginal_likelihood_) < 1e-3 * abs(
            ref.log_marginal_likelihood_)
        assert (runs[0].predict_proba(X[:50]).double() - ref.predict_proba(X[:50])).abs().max() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("name", ["bernoulli", "studentt"])
def test_fit_trains_copies_of_the_kernel_and_likelihood_and_refits_identically(dtype, name):
    X, y, lik = observations(name, 150, dtype)
    kernel = make_kernel(dtype)
    given = copy.deepcopy(kernel.state_dict())
    gp = ReducedLaplaceGP(kernel, likelihood=lik, m=20, landmarks="fps", optimizer_steps=3)
    mean, var = gp.fit(X, y).predict_latent(X[:30])
    assert all(torch.equal(value, given[key]) for key, value in kernel.state_dict().items())  # untouched
    assert not torch.equal(gp.kernel_.outputscale.detach(), kernel.outputscale.detach())  # kernel_: trained
    if name == "studentt":  # the scale is trained on likelihood_; the given likelihood keeps its own
        assert float(lik.scale.detach()) == pytest.approx(0.4)
        assert float(gp.likelihood_.scale.detach()) != pytest.approx(0.4)
    again = gp.fit(X, y).predict_latent(X[:30])
    assert torch.equal(again[0], mean) and torch.equal(again[1], var)


def test_bad_input_names_the_argument():
    X, y = labels(50)
    k = make_kernel()
    with pytest.raises(ValueError, match="y holds 3 classes"):
        ReducedLaplaceClassifier(k, m=10).fit(X, torch.arange(50, dtype=F64) % 3)
    with pytest.raises(ValueError, match="y holds one class"):
        ReducedLaplaceClassifier(k, m=10).fit(X, torch.ones(50, dtype=F64))
    Xn = X.clone()
    Xn[3, 0] = float("nan")
    with pytest.raises(ValueError, match="X"):
        ReducedLaplaceClassifier(k, m=10).fit(Xn, y)
    with pytest.raises(ValueError, match="y contains NaN"):
        ReducedLaplaceClassifier(k, m=10).fit(X, torch.full((50,), float("nan"), dtype=F64))
    with pytest.raises(ValueError, match="y must be a 1-D tensor of 50"):
        ReducedLaplaceClassifier(k, m=10).fit(X, y[:40])
    with pytest.raises(ValueError, match="m must be <= n"):
        ReducedLaplaceClassifier(k, m=60).fit(X, y)
    with pytest.raises(ValueError, match="subsample must be <= n"):
        ReducedLaplaceClassifier(k, m=10, subsample=60, optimizer_steps=1).fit(X, y)
    with pytest.raises(ValueError, match="rank=11 exceeds m=10"):
        ReducedLaplaceClassifier(k, m=10, rank=11).fit(X, y)
    with pytest.raises(ValueError, match="landmarks must have d = 2"):
        ReducedLaplaceClassifier(k, landmarks=torch.rand(5, 3, dtype=F64)).fit(X, y)
    for kwargs, match in (({"landmarks": "grid"}, "landmarks must be one of"), ({"variance": "fitc"}, "variance"),
                          ({"link": "cauchit"}, "link"), ({"m": 0}, "m must be >= 1"), ({"lr": -1.0}, "lr"),
                          ({"rtol": 1.0}, r"rtol must be in \(0, 1\)"), ({"rank": 0}, "rank must be >= 1"),
                          ({"m": 4, "landmarks": X[:5]}, "m = 4 disagrees"),
                          ({"rtol": "small"}, "rtol"), ({"subsample": 0}, "subsample")):
        with pytest.raises(ValueError, match=match):  # checked by fit, as scikit-learn's estimators do
            ReducedLaplaceClassifier(k, **kwargs).fit(X, y)
    with pytest.raises(TypeError, match="likelihood"):  # the classifier is Bernoulli: no such argument
        ReducedLaplaceClassifier(k, likelihood="poisson")
    with pytest.raises(ValueError, match="kernel"):
        ReducedLaplaceGP("rbf").fit(X, y)
    with pytest.raises(NotFittedError, match="fit"):
        ReducedLaplaceClassifier(k).predict_proba(X)
    clf = ReducedLaplaceClassifier(k, m=10).fit(X, y)
    with pytest.raises(ValueError, match="X must have 2 columns"):
        clf.predict(X[:, :1])


@pytest.mark.cuda
def test_reduced_laplace_on_the_cuda_device(cuda_device):
    X, y = labels(300)
    kernel = make_kernel()
    C = select(X, 30, "fps")[0]
    ref = ReducedLaplaceClassifier(copy.deepcopy(kernel), landmarks=C, optimizer_steps=2).fit(X, y)
    clf = ReducedLaplaceClassifier(copy.deepcopy(kernel).to(cuda_device), landmarks=C.to(cuda_device),
                                   optimizer_steps=2).fit(X.to(cuda_device), y.to(cuda_device))
    assert clf.w_.device.type == torch.device(cuda_device).type
    assert abs(clf.log_marginal_likelihood_ - ref.log_marginal_likelihood_) < 1e-8 * abs(ref.log_marginal_likelihood_)
    for name, g in ref.mll_gradient_.items():
        assert torch.allclose(clf.mll_gradient_[name].cpu(), g, rtol=1e-6, atol=1e-9)
    assert torch.allclose(clf.predict_proba(X[:20].to(cuda_device)).cpu(), ref.predict_proba(X[:20]), atol=1e-9)


def test_float32_separable_labels_at_a_large_outputscale_reach_the_mode():
    """Float32, separable labels, outputscale 1e6 (n = 400, m = 40): Newton's rounding slack was 64 eps (|ψ| + n),
    3e-3, above all the gain left where ψ is -0.08, and it stopped with f̂ 34 % from the mode and log q 3 off, with no
    warning. ψ in float64 with the iterates' own rounding as the slack reaches the float64 fit's mode."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(400, 2, dtype=F64, generator=g)
    y = (torch.sin(6 * X[:, 0]) + X[:, 1] > 0.8).to(F64)
    kernel = make_kernel()
    kernel.outputscale = 1e6
    gp32 = ReducedLaplaceGP(copy.deepcopy(kernel).float(), m=40, landmarks="fps", rtol=1e-3).fit(X.float(), y.float())
    gp64 = ReducedLaplaceGP(kernel, m=40, landmarks=gp32.landmarks_.double(), rtol=1e-3).fit(X, y)
    assert gp32.rank_ == gp64.rank_
    assert float((gp32.f_hat_.double() - gp64.f_hat_).abs().max()) < 1e-3 * float(gp64.f_hat_.abs().max())
    log_q = gp64.log_marginal_likelihood_
    assert abs(gp32.log_marginal_likelihood_ - log_q) < 1e-3 * abs(log_q)


def test_float32_student_t_of_small_df_reaches_the_mode():
    """Student-t, df = 1.5, outliers, float32 (n = 400, m = 40): ψ's rounding slack as a 1-norm, 64 eps |∇log p|ᵀ|f|,
    let a step lower ψ by 1e-3 and Newton stop with f̂ 0.6 % from the float64 mode and a gradient entry 5 % off; as a
    2-norm (the roundings' signs are independent) it is 7e-4 and 0.9 %."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(400, 2, dtype=F64, generator=g)
    y = 1 + torch.sin(6 * X[:, 0]) + 0.3 * torch.randn(400, dtype=F64, generator=g)
    y[::17] += 4.0
    kernel = make_kernel()
    gp32 = ReducedLaplaceGP(copy.deepcopy(kernel).float(), likelihood=StudentT(df=1.5, scale=0.3), m=40,
                            landmarks="fps", rtol=1e-3).fit(X.float(), y.float())
    gp64 = ReducedLaplaceGP(kernel, likelihood=StudentT(df=1.5, scale=0.3), m=40, landmarks=gp32.landmarks_.double(),
                            rtol=1e-3).fit(X, y)
    assert float((gp32.f_hat_.double() - gp64.f_hat_).abs().max()) < 2e-3 * float(gp64.f_hat_.abs().max())


def peaked_counts(n, dtype):
    """Counts of log-rate ``4 + 2 sin(6x)`` on ``[0, 1]``: a mode in about [2, 6]."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(n, 1, dtype=F64, generator=g)
    y = torch.poisson(torch.exp(4 + 2 * torch.sin(6 * X[:, 0])), generator=g)
    return X.to(dtype), y.to(dtype)


def test_a_far_warm_start_gives_way_to_the_cold_start(dtype):
    """One Adam step of lr 2 (length-scale 1 → 0.21, outputscale 0.5 → 1.76) puts the previous mode's landmark
    coefficients, under the new kernel, at ``f0 = K_nm β0`` in about [−91, 106] for a mode in [2, 6]: ``W = e^f`` up
    to 1e46, where ``H``'s Cholesky failed. Its ``ψ`` is below ``ψ(0)``, so Newton starts at zero and the fit is a
    fresh one at the trained hyperparameters."""
    X, y = peaked_counts(200, dtype)
    kernel = make_kernel(dtype, lengthscale=1.0)
    kernel.outputscale = 0.5
    gp = ReducedLaplaceGP(kernel, likelihood="poisson", m=60, landmarks="fps", optimizer_steps=1, lr=2.0).fit(X, y)
    fresh = ReducedLaplaceGP(copy.deepcopy(gp.kernel_), likelihood="poisson", landmarks=gp.landmarks_).fit(X, y)
    log_q = fresh.log_marginal_likelihood_
    assert abs(gp.log_marginal_likelihood_ - log_q) <= 1e-9 * abs(log_q)
    assert (gp.f_hat_ - fresh.f_hat_).abs().max() <= 1e-6 * float(fresh.f_hat_.abs().max())
    assert gp.newton_iterations_ == fresh.newton_iterations_


def test_a_near_warm_start_saves_newton_steps(dtype):
    """A small hyperparameter move (one Adam step of lr 0.01): the warm start is kept, and Newton reaches the fresh
    fit's mode and ``log q`` in fewer steps than from zero."""
    X, y = peaked_counts(200, dtype)
    kernel = make_kernel(dtype, lengthscale=1.0)
    kernel.outputscale = 0.5
    gp = ReducedLaplaceGP(kernel, likelihood="poisson", m=60, landmarks="fps", optimizer_steps=1, lr=0.01).fit(X, y)
    fresh = ReducedLaplaceGP(copy.deepcopy(gp.kernel_), likelihood="poisson", landmarks=gp.landmarks_).fit(X, y)
    assert gp.newton_iterations_ < fresh.newton_iterations_ - 2
    log_q = fresh.log_marginal_likelihood_
    assert abs(gp.log_marginal_likelihood_ - log_q) <= (1e-10 if dtype == F64 else 1e-5) * abs(log_q)
    assert (gp.f_hat_ - fresh.f_hat_).abs().max() <= (1e-8 if dtype == F64 else 1e-4) * float(fresh.f_hat_.abs().max())
