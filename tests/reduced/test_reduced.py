"""Reduced GP posteriors (LLA / NCR / GSA), their exact errors and the GPyTorch-compatible model, against dense
references on small real data (concrete) and against GPyTorch's exact GP and SGPR."""

import warnings

import gpytorch
import pytest
import torch

from gpnys import datasets
from gpnys.checks import NumericalWarning
from gpnys.gp.training import ExactGPModel
from gpnys.gp.training import predict as exact_predict
from gpnys.kernels import make_kernel
from gpnys.reduced import (
    ExactPosterior,
    GSAPosterior,
    LLAPosterior,
    NCRPosterior,
    ReducedGP,
    RFFPosterior,
    landmark_rkhs_error,
    nystrom_krr,
    nytro,
    reduced_posterior,
    rkhs_error,
)

DS = datasets.load("concrete", n=300, seed=0)
X, Y, Z = DS.train_x, DS.train_y, DS.test_x[:60]
NOISE, MEAN = 0.05, 0.1


def kernel(dtype=torch.float64, name="matern52", ard=True):
    k = make_kernel(name, ard_num_dims=X.shape[1] if ard else None).to(dtype)
    k.base_kernel.lengthscale = torch.linspace(0.8, 2.0, X.shape[1]) if ard else 1.5
    k.outputscale = 1.2
    return k


def exact_model(k, dtype=torch.float64):
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    lik.noise = NOISE
    model = ExactGPModel(X.to(dtype), Y.to(dtype), lik, kernel=k, mean="constant").to(dtype)
    model.mean_module.constant.data.fill_(MEAN)
    return model


def dense(k, A, B):
    with torch.no_grad():
        return k(A, B).to_dense()


class SGPR(gpytorch.models.ExactGP):
    """GPyTorch's SGPR (``InducingPointKernel``) on the test data."""

    def __init__(self, k, C, lik):
        super().__init__(X, Y, lik)
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.InducingPointKernel(k, inducing_points=C.clone(), likelihood=lik)

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def sgpr_model(k, C):
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    lik.noise = NOISE
    sgpr = SGPR(k, C, lik).double()
    sgpr.mean_module.constant.data.fill_(MEAN)
    return sgpr


@pytest.fixture(scope="module")
def ref():
    """GPyTorch's exact GP (Cholesky) predictive mean and latent variance at Z."""
    k = kernel()
    model = exact_model(k)
    with gpytorch.settings.skip_posterior_variances(False):
        mean, var = exact_predict(model, Z)
    return k, mean, var - NOISE


@pytest.mark.parametrize("cls", [LLAPosterior, NCRPosterior, GSAPosterior])
def test_m_equals_n_is_the_exact_posterior(cls, ref):
    k, mean, var = ref
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)  # concrete has duplicated rows: K_mm is singular
        post = cls(k, X, Y, NOISE, X, prior_mean=MEAN)
    assert float((post.mean(Z) - mean).abs().max() / mean.abs().max()) < 1e-6
    assert float((post.variance(Z) - var).abs().max() / var.abs().max()) < 1e-6


def test_exact_posterior_matches_gpytorch_and_pcg(ref):
    k, mean, var = ref
    chol = ExactPosterior(k, X, Y, NOISE, prior_mean=MEAN, method="cholesky")
    assert float((chol.mean(Z) - mean).abs().max()) < 1e-8
    assert float((chol.variance(Z) - var).abs().max()) < 1e-8
    cg = ExactPosterior(k, X, Y, NOISE, prior_mean=MEAN, method="pcg", tol=1e-10)
    assert cg.iterations > 0
    assert float((cg.alpha - chol.alpha).norm() / chol.alpha.norm()) < 1e-6
    assert float((cg.variance(Z) - var).abs().max()) < 1e-6


def test_lla_equals_ncr_and_gpytorch_sgpr():
    """NCR = LLA ([SPA] Prop 2) and both = GPyTorch's SGPR predictive mean (and DTC variance = SGPR's with
    ``sgpr_diagonal_correction`` on; the mean does not depend on that setting here)."""
    k, C = kernel(), X[::7][:40]
    lla, ncr = LLAPosterior(k, X, Y, NOISE, C, prior_mean=MEAN), NCRPosterior(k, X, Y, NOISE, C, prior_mean=MEAN)
    assert float((lla.mean(Z) - ncr.mean(Z)).abs().max() / lla.mean(Z).abs().max()) < 1e-6

    sgpr = sgpr_model(k, C)
    sgpr.eval()
    for correction in (False, True):
        with gpytorch.settings.sgpr_diagonal_correction(correction), torch.no_grad():
            out = sgpr(Z)
        assert float((lla.mean(Z) - out.mean).abs().max() / out.mean.abs().max()) < 1e-6
    assert float((lla.variance(Z) - out.variance).abs().max()) < 1e-6  # correction on: DTC


@pytest.mark.parametrize("rtol", [None, 1e-8])
def test_ncr_holds_its_precision_on_an_ill_conditioned_kmm(rtol):
    """RBF, length-scale 3 on [0, 4]², m = 100: ``K_mm``'s eigenvalues span the working precision. NCR solved
    ``(K_mn K_nm + σ² K_mm)⁺`` by a pseudo-inverse of that matrix, whose spectrum is about ``K_mm``'s squared: it
    lost the small directions (an RKHS error of 0.18 where LLA's was 9e-4; with ``rtol=1e-8``, 55 against 0.65,
    and its mean 1.25 off). As a least-squares problem it matches LLA (default) and is no worse than it."""
    g = torch.Generator().manual_seed(0)
    Xb = 4 * torch.rand(1500, 2, dtype=torch.float64, generator=g)
    yb = torch.sin(2 * Xb[:, 0]) * torch.cos(Xb[:, 1]) + 0.1 * torch.randn(1500, dtype=torch.float64, generator=g)
    Zb = 4 * torch.rand(300, 2, dtype=torch.float64, generator=g)
    k = make_kernel("rbf").double()
    k.base_kernel.lengthscale = 3.0
    exact = ExactPosterior(k, Xb, yb, 0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)  # K_mm is numerically rank-deficient
        lla = reduced_posterior("lla", k, Xb, yb, 0.01, m=100, rtol=rtol)
        ncr = reduced_posterior("ncr", k, Xb, yb, 0.01, m=100, rtol=rtol)
    err_lla, err_ncr = rkhs_error(lla, exact), rkhs_error(ncr, exact)
    assert err_ncr <= max(err_lla, 1e-3), (err_ncr, err_lla)
    if rtol is None:
        assert float((lla.mean(Zb) - ncr.mean(Zb)).abs().max()) < 1e-7


def test_sor_and_dtc_variances_match_dense_formulas():
    k, C = kernel(), X[:50]
    Q = lambda A, B: dense(k, A, C) @ torch.linalg.solve(dense(k, C, C), dense(k, C, B))
    Qxx = Q(X, X) + NOISE * torch.eye(X.shape[0], dtype=X.dtype)
    sor = Q(Z, Z).diagonal() - (Q(Z, X) * torch.linalg.solve(Qxx, Q(X, Z)).mT).sum(1)
    dtc = sor + dense(k, Z, Z).diagonal() - Q(Z, Z).diagonal()
    assert float((LLAPosterior(k, X, Y, NOISE, C, variance="sor").variance(Z) - sor).abs().max()) < 1e-8
    assert float((LLAPosterior(k, X, Y, NOISE, C).variance(Z) - dtc).abs().max()) < 1e-8


def test_gsa_coefficients_and_variance():
    k, C = kernel(), X[:30]
    wb = GSAPosterior(k, X, Y, NOISE, C, prior_mean=MEAN, coef="woodbury")
    mn = GSAPosterior(k, X, Y, NOISE, C, prior_mean=MEAN)  # the default: min_norm
    Kt = dense(k, X, C) @ torch.linalg.pinv(dense(k, C, C), hermitian=True) @ dense(k, C, X)
    A = Kt + NOISE * torch.eye(X.shape[0], dtype=X.dtype)
    r = Y - MEAN
    assert float((wb.mean(Z) - MEAN - dense(k, Z, X) @ torch.linalg.solve(A, r)).abs().max()) < 1e-6
    G = wb.Phi.mT
    assert float((G @ mn.alpha - wb.w).abs().max()) < 1e-8  # solves [SPA] (3) ...
    assert float((mn.alpha - torch.linalg.pinv(G) @ wb.w).abs().max()) < 1e-6  # ... with the minimum norm
    y_perp = r - torch.linalg.pinv(G) @ (G @ r)  # the two GSA choices differ by k_z^T y_perp / sigma^2
    diff = dense(k, Z, X) @ y_perp / NOISE
    assert float((wb.mean(Z) - mn.mean(Z) - diff).abs().max()) < 1e-6 * float(diff.abs().max())
    naive = dense(k, Z, Z).diagonal() - (dense(k, Z, X) * torch.linalg.solve(A, dense(k, X, Z)).mT).sum(1)
    assert bool((naive < 0).any())  # the naive variance does go negative here ...
    with pytest.warns(NumericalWarning, match="negative"):
        v = wb.variance(Z)
    assert float((v - naive.clamp_min(0)).abs().max()) < 1e-6 * float(naive.abs().max())  # ... and is clamped


def test_rkhs_errors_against_dense_expansions():
    """|f - f*|_H from [SPA] (15)/(19) vs the dense quadratic form of the joint expansion over [X; C]."""
    k, C = kernel(), X[::5][:45]
    ex = ExactPosterior(k, X, Y, NOISE, prior_mean=MEAN)
    P = torch.cat([X, C])
    Kp = dense(k, P, P)

    def norm(c):
        return float(c @ Kp @ c).__pow__(0.5)

    zeros_c, zeros_x = torch.zeros(C.shape[0], dtype=X.dtype), torch.zeros(X.shape[0], dtype=X.dtype)
    lla = LLAPosterior(k, X, Y, NOISE, C, prior_mean=MEAN)
    e_lla = norm(torch.cat([-ex.alpha, lla.features.A @ lla.w]))
    assert rkhs_error(lla, ex) == pytest.approx(e_lla, rel=1e-6)
    ncr = NCRPosterior(k, X, Y, NOISE, C, prior_mean=MEAN)
    assert rkhs_error(ncr, ex) == pytest.approx(e_lla, rel=1e-6)
    assert landmark_rkhs_error(k, C, ncr.beta, ex) == pytest.approx(norm(torch.cat([-ex.alpha, ncr.beta])), rel=1e-6)
    for coef in ("woodbury", "min_norm"):
        gsa = GSAPosterior(k, X, Y, NOISE, C, prior_mean=MEAN, coef=coef)
        assert rkhs_error(gsa, ex) == pytest.approx(norm(torch.cat([gsa.alpha - ex.alpha, zeros_c])), rel=1e-6)
    assert norm(torch.cat([zeros_x, zeros_c])) == 0.0
    assert rkhs_error(LLAPosterior(k, X, Y, NOISE, X, prior_mean=MEAN), ex) < 1e-3 * e_lla  # m = n: exact


def test_duplicated_landmarks_warn_and_match_unique():
    k, C = kernel(), X[:20]
    unique = LLAPosterior(k, X, Y, NOISE, C)
    with pytest.warns(NumericalWarning, match="rank-deficient"):
        dup = LLAPosterior(k, X, Y, NOISE, torch.cat([C, C[:5]]))
    assert dup.features.s == unique.features.s
    assert float((dup.mean(Z) - unique.mean(Z)).abs().max()) < 1e-8
    assert float((dup.variance(Z) - unique.variance(Z)).abs().max()) < 1e-8


def test_rank_truncation_is_nsl():
    k, C = kernel(), X[:40]
    full, trunc = LLAPosterior(k, X, Y, NOISE, C), LLAPosterior(k, X, Y, NOISE, C, rank=10)
    assert trunc.features.s == 10 and trunc.Phi.shape == (X.shape[0], 10)
    assert float((trunc.mean(Z) - full.mean(Z)).abs().max()) > 1e-3  # truncation (s < rank) is not NCR


@pytest.mark.parametrize("method", ["lla", "ncr", "gsa", "rff"])
def test_functional_api_float32_and_seeds(method):
    k64, k32 = kernel(), kernel(torch.float32)
    kw = {"m": 40, "landmarks": None if method == "rff" else "uniform", "prior_mean": MEAN}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)
        a = reduced_posterior(method, k64, X, Y, NOISE, seed=1, **kw)
        b = reduced_posterior(method, k64, X, Y, NOISE, seed=1, **kw)
        c = reduced_posterior(method, k64, X, Y, NOISE, seed=2, **kw)
        f = reduced_posterior(method, k32, X.float(), Y.float(), NOISE, seed=1, **kw)
    assert torch.equal(a.mean(Z), b.mean(Z))
    assert not torch.equal(a.mean(Z), c.mean(Z))
    assert f.mean(Z.float()).dtype == torch.float32
    tol = 5e-2 if method == "gsa" else 1e-3  # GSA's alpha is a residual / sigma^2: float32 loses more
    assert float((f.mean(Z.float()).double() - a.mean(Z)).abs().max()) < tol * float(a.mean(Z).abs().max())


def test_bad_inputs():
    k = kernel()
    for kw, match in [({"m": 0}, "m"), ({"m": X.shape[0] + 1}, "m"), ({"m": 2.5}, "m")]:
        with pytest.raises(ValueError, match=match):
            reduced_posterior("lla", k, X, Y, NOISE, **kw)
    with pytest.raises(ValueError, match="method"):
        reduced_posterior("svgp", k, X, Y, NOISE)
    with pytest.raises(ValueError, match="noise"):
        LLAPosterior(k, X, Y, 0.0, X[:10])
    with pytest.raises(ValueError, match="y"):
        LLAPosterior(k, X, Y[:-1], NOISE, X[:10])
    bad = X.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="X"):
        LLAPosterior(k, bad, Y, NOISE, X[:10])
    with pytest.raises(ValueError, match="landmarks"):
        LLAPosterior(k, X, Y, NOISE, X[:10, :3])
    with pytest.raises(ValueError, match="landmarks"):
        LLAPosterior(k, X[:5], Y[:5], NOISE, X[:10])
    with pytest.raises(ValueError, match="coef"):
        GSAPosterior(k, X, Y, NOISE, X[:10], coef="pinv")
    with pytest.raises(ValueError, match="rank"):
        LLAPosterior(k, X, Y, NOISE, X[:10], rank=11)
    for kw, match in [({"rtol": -1.0}, "rtol"), ({"rtol": float("nan")}, "rtol"), ({"rtol": 2.0}, "rtol"),
                      ({"prior_mean": float("nan")}, "prior_mean")]:
        for cls in (LLAPosterior, NCRPosterior, GSAPosterior):
            with pytest.raises(ValueError, match=match):
                cls(k, X, Y, NOISE, X[:10], **kw)
    with pytest.raises(ValueError, match="prior_mean"):
        ExactPosterior(k, X, Y, NOISE, prior_mean=float("inf"))
    # test points: NaN, wrong columns, none (they returned NaN, a torch error, a torch.cat error)
    posteriors = [cls(k, X, Y, NOISE, X[:10]) for cls in (LLAPosterior, NCRPosterior, GSAPosterior)]
    posteriors.append(ExactPosterior(k, X, Y, NOISE))
    bad_Z = Z[:3].clone()
    bad_Z[1, 0] = float("nan")
    for post in posteriors:
        for Zb, match in [(bad_Z, "Z contains NaN"), (Z[:3, :1], "Z must have d="), (Z[:0], "Z must be")]:
            for what in ("mean", "variance"):
                if hasattr(post, what):
                    with pytest.raises(ValueError, match=match):
                        getattr(post, what)(Zb)
    # an RKHS distance needs an RKHS posterior on the same inputs
    exact = posteriors[-1]
    with pytest.raises(ValueError, match="RFF"):
        rkhs_error(reduced_posterior("rff", k, X, Y, NOISE, m=20), exact)
    moved = X.clone()
    moved[0, 0] += 0.5
    with pytest.raises(ValueError, match="same training inputs"):
        rkhs_error(LLAPosterior(k, moved, Y, NOISE, X[:10]), exact)


@pytest.mark.parametrize("tol", [1.0, 2.0, 0.0, -1e-8, float("nan"), "small"])
@pytest.mark.parametrize("method", ["pcg", "cholesky"])
def test_exact_posterior_tol_outside_the_unit_interval_names_tol(method, tol):
    """A PCG tolerance of 1 or more stops PCG before its first step: ``tol = 2`` returned ``alpha = 0`` silently.
    Checked on every path (``"auto"`` takes PCG above ``DENSE_MAX``)."""
    with pytest.raises(ValueError, match=r"\btol must be in \(0, 1\)"):
        ExactPosterior(kernel(), X, Y, NOISE, method=method, tol=tol)


#: the constructors of :mod:`gpnys.reduced` that take ``(X, y)``, as ``build(X, y, landmarks)``
BUILDERS = {
    "lla": lambda X_, y_, C: LLAPosterior(kernel(), X_, y_, NOISE, C),
    "ncr": lambda X_, y_, C: NCRPosterior(kernel(), X_, y_, NOISE, C),
    "gsa": lambda X_, y_, C: GSAPosterior(kernel(), X_, y_, NOISE, C),
    "exact": lambda X_, y_, C: ExactPosterior(kernel(), X_, y_, NOISE),
    "rff": lambda X_, y_, C: RFFPosterior(kernel(), X_, y_, NOISE, 10),
    "nystrom_krr": lambda X_, y_, C: nystrom_krr(kernel(), X_, y_, C, 0.1),
    "nytro": lambda X_, y_, C: nytro(kernel(), X_, y_, C, t_max=2, stop="none"),
}
TAKE_LANDMARKS = ("lla", "ncr", "gsa", "nystrom_krr", "nytro")


@pytest.mark.parametrize("name", BUILDERS)
def test_y_or_landmarks_of_another_dtype_name_the_argument(name):
    """float64 X with float32 y met in a matrix product as a ``RuntimeError`` (LLA, NCR, GSA, RFF): each
    constructor takes y (and landmark points) in X's dtype, and the exact reference casts y to it;
    ``reduced_posterior`` promotes mixed dtypes before it calls them."""
    build = BUILDERS[name]
    for X_, y_ in ((X, Y.float()), (X.float(), Y)):
        if name == "exact":  # the reference casts y to X's dtype, as it always has
            assert build(X_, y_, X_[:10]).alpha.dtype == X_.dtype
            continue
        with pytest.raises(ValueError, match=r"^y must have X's dtype"):
            build(X_, y_, X_[:10])
    if name in TAKE_LANDMARKS:
        with pytest.raises(ValueError, match=r"^landmarks must have X's dtype float64, got float32"):
            build(X, Y, X[:10].float())


def test_reduced_posterior_promotes_landmark_points():
    """float32 landmark points with float64 data and kernel: promoted to float64, as X and y are."""
    C = X[:40].float()
    post = reduced_posterior("lla", kernel(), X, Y, NOISE, landmarks=C)
    ref = reduced_posterior("lla", kernel(), X, Y, NOISE, landmarks=C.double())
    assert post.features.landmarks.dtype == torch.float64
    assert torch.equal(post.mean(Z), ref.mean(Z))


def test_reduced_gp_model_interface(ref):
    k, mean, var = ref
    model = ReducedGP.from_exact(exact_model(kernel()), method="lla", m=X.shape[0], landmarks="fps")
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)
        out = model(Z)
        pred = model.likelihood(model(Z))
    assert isinstance(out, gpytorch.distributions.MultivariateNormal)
    assert float((out.mean - mean).abs().max()) < 1e-6
    assert float((pred.variance - var - NOISE).abs().max()) < 1e-6
    model.train()
    with pytest.raises(RuntimeError, match="eval"):
        model(Z)


def test_reduced_gp_objectives_and_training():
    """Titsias' bound equals GPyTorch's SGPR training loss; with every point a landmark both objectives are the
    exact -MLL / n; training lowers the bound."""
    k = kernel()
    model = ReducedGP.from_exact(exact_model(k), method="lla", m=40, landmarks="fps")
    C = X[::7][:40]

    sgpr = sgpr_model(k, C)
    lik = sgpr.likelihood
    sgpr.train()
    sg = -gpytorch.mlls.ExactMarginalLogLikelihood(lik, sgpr)(sgpr(X), Y)
    assert float(model.loss(C, "titsias")) == pytest.approx(float(sg), rel=1e-8)
    em = exact_model(kernel())
    em.train()
    with gpytorch.settings.max_cholesky_size(10_000):
        exact = float(-gpytorch.mlls.ExactMarginalLogLikelihood(em.likelihood, em)(em(X), Y))
    full = X[torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(0))[:X.shape[0] // 3]]
    assert float(model.loss(full, "dtc")) > exact - 1e-9  # fewer landmarks: DTC evidence differs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)
        assert float(model.loss(X, "titsias")) == pytest.approx(exact, rel=1e-5)
    trace = model.fit(iters=15, lr=0.05)
    assert trace[-1] < trace[0] - 1e-3
    model.eval()
    assert torch.isfinite(model(Z).mean).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fit_refuses_non_finite_targets_before_any_step(bad):
    """NaN or inf in the targets: a ValueError naming them, and no parameter moved."""
    import gpytorch

    from gpnys.gp.training import ExactGPModel, fit
    from gpnys.reduced import ReducedGP

    X = torch.rand(40, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.sin(4 * X).sum(1)
    y[7] = bad
    exact = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood().double(), kernel="matern32").double()
    reduced = ReducedGP(X, y, gpytorch.likelihoods.GaussianLikelihood().double(),
                        gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double(), method="lla", m=10)
    for model, call, name in ((exact, lambda: fit(exact, iters=2, progress=False), "train_targets"),
                              (reduced, lambda: reduced.fit(iters=2), "train_y")):
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=name):
            call()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_rff_takes_no_landmarks():
    with pytest.raises(ValueError, match="landmarks"):
        reduced_posterior("rff", kernel(), X, Y, NOISE, m=20, landmarks="fps")
    with pytest.raises(ValueError, match="landmarks"):
        reduced_posterior("rff", kernel(), X, Y, NOISE, m=20, landmarks=X[:5])


def test_reduced_gp_refuses_per_point_noise():
    """FixedNoiseGaussianLikelihood: a ValueError, not the first point's noise used for every point."""
    lik = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=torch.full((X.shape[0],), 0.1, dtype=X.dtype))
    with pytest.raises(ValueError, match="likelihood"):
        ReducedGP(X, Y, lik, kernel(), method="lla", m=20)


def test_from_exact_finds_the_kernel_and_mean_under_any_name():
    """ReducedGP.from_exact reads the kernel the model's forward() evaluates (not necessarily covar_module) and
    the model's one mean module (the README's model calls it ``mean``), and refuses a forward() that transforms
    the inputs."""
    from gpnys.gp.discover import training_kernel

    class Renamed(gpytorch.models.ExactGP):
        def __init__(self, x, y, scale=1.0):
            super().__init__(x, y, gpytorch.likelihoods.GaussianLikelihood())
            self.mean = gpytorch.means.ConstantMean()
            self.cov = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            self.scale = scale

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean(x), self.cov(self.scale * x))

    m = Renamed(X, Y).double()
    m.likelihood.noise = NOISE
    m.mean.constant = 0.7
    k, seen = training_kernel(m)
    assert k is m.cov and torch.equal(seen, m.train_inputs[0])
    r = ReducedGP.from_exact(m, method="lla", m=X.shape[0]).eval()  # every point a landmark: the exact GP
    with torch.no_grad():
        exact_mean = ExactPosterior(m.cov, X, Y, NOISE, prior_mean=0.7).mean(Z)
        torch.testing.assert_close(r(Z).mean, exact_mean, rtol=1e-6, atol=1e-6)
    m.second = gpytorch.means.ZeroMean()
    with pytest.raises(ValueError, match="has 2"):
        ReducedGP.from_exact(m)
    with pytest.raises(ValueError, match="transforms the inputs"):
        ReducedGP.from_exact(Renamed(X, Y, scale=20.0).double())


def test_reduced_posterior_takes_mixed_dtypes():
    """float32 points with float64 targets and kernel: promoted to float64, as GPyTorch does."""
    post = reduced_posterior("lla", kernel(), X.float(), Y, NOISE, m=40, landmarks="fps")
    ref = reduced_posterior("lla", kernel(), X.float().double(), Y, NOISE, m=40, landmarks="fps")
    mean = post.mean(Z.float())
    assert mean.dtype == torch.float64
    torch.testing.assert_close(mean, ref.mean(Z.float().double()))


def test_records_compare_means_in_the_units_of_test_rmse():
    """``mean_rmse_vs_exact`` is in original target units, like ``test_rmse`` (it was in the standardised scale:
    0.53 beside a test RMSE of 0.16 on elevators): a scale of 10 on y scales it by 10."""
    from gpnys.datasets import Standardizer
    from gpnys.reduced.evaluate import evaluate_method

    k = kernel()
    exact = ExactPosterior(k, X, Y, NOISE)
    d = X.shape[1]
    unit = Standardizer(torch.zeros(d, dtype=X.dtype), torch.ones(d, dtype=X.dtype), torch.tensor(0.0).to(X),
                        torch.tensor(1.0).to(X))
    tenfold = Standardizer(unit.x_mean, unit.x_std, torch.tensor(3.0).to(X), torch.tensor(10.0).to(X))
    records = [evaluate_method("lla", k, X, Y, Z, DS.test_y[:60], NOISE, m=20, exact=exact, transform=t)
               for t in (unit, tenfold)]
    assert records[0]["mean_rmse_vs_exact"] > 0
    assert abs(records[1]["mean_rmse_vs_exact"] / records[0]["mean_rmse_vs_exact"] - 10.0) < 1e-9
