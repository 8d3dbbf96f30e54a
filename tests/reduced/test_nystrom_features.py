"""NystromFeatures: scikit-learn protocol, features against dense GPyTorch blocks, NSL = LLA = NCR, landmarks."""

import warnings

import gpytorch
import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import Pipeline
from sklearn.svm import LinearSVC
from sklearn.utils.estimator_checks import check_estimator

from gpnys.reduced import LLAPosterior, NCRPosterior, NystromFeatures
from gpnys.reduced.nystrom_features import median_lengthscale


def circles(n=300, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    return X, (np.linalg.norm(X, axis=1) > 1.2).astype(int)


def blobs(n=600, k=6, d=3, seed=0, spread=0.15):
    rng = np.random.default_rng(seed)
    centres = 4 * rng.normal(size=(k, d))
    return centres[rng.integers(k, size=n)] + spread * rng.normal(size=(n, d))


def dense(kernel, A, B):
    with torch.no_grad():
        return kernel(torch.as_tensor(A), torch.as_tensor(B)).to_dense()


# -- scikit-learn protocol ---------------------------------------------------------------------------------------
def test_clone_and_params_round_trip():
    kern = gpytorch.kernels.MaternKernel(nu=1.5)
    est = NystromFeatures(kernel=kern, n_components=20, rank=10, landmarks="kmeans", basis="standard",
                          dtype="float32", random_state=3)
    params = est.get_params()
    assert params["n_components"] == 20 and params["rank"] == 10 and params["kernel"] is kern
    twin = clone(est)
    assert twin.get_params()["n_components"] == 20 and twin.get_params()["basis"] == "standard"
    assert twin.set_params(n_components=7) is twin and twin.n_components == 7 and est.n_components == 20
    assert not hasattr(twin, "A_")  # clone is unfitted
    X, _ = circles(100)
    ell = float(kern.lengthscale.detach())
    est.fit(X)
    # the user's kernel untouched
    assert float(kern.lengthscale.detach()) == ell and kern.lengthscale.dtype == torch.float32
    assert est.A_.dtype == torch.float32 and est.A_.shape == (20, 20) and est.rank_ == 10
    assert est.get_feature_names_out().shape == (20,)


def test_scikit_learn_estimator_checks():
    """scikit-learn's own conformance suite (clone, params, fit/transform idempotence, input validation, pickling,
    dtypes, error messages): every check passes."""
    import sklearn

    if tuple(int(v) for v in sklearn.__version__.split(".")[:2]) < (1, 6):
        pytest.skip("check_estimator(on_fail=None) needs scikit-learn >= 1.6")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank-deficient K_mm on the checks' tiny data sets
        results = check_estimator(NystromFeatures(n_components=5, random_state=0), on_fail=None)
    failed = [(r["check_name"], str(r["exception"])[:200]) for r in results if r["status"] == "failed"]
    assert len(results) > 30 and not failed, failed


def test_pipelines_and_grid_search():
    X, y = circles(400)
    Xte, yte = circles(200, seed=1)
    for model in (LinearSVC(C=10.0), LogisticRegression(C=100.0, max_iter=2000)):
        pipe = Pipeline([("nys", NystromFeatures(n_components=40, random_state=0)), ("clf", model)]).fit(X, y)
        assert pipe.score(Xte, yte) > 0.95
        lin = clone(model).fit(X, y)  # the raw linear model cannot separate a circle
        assert lin.score(Xte, yte) < 0.8
    grid = GridSearchCV(Pipeline([("nys", NystromFeatures(random_state=0)), ("clf", LinearSVC(C=10.0))]),
                        {"nys__n_components": [2, 30]}, cv=3).fit(X, y)
    assert grid.best_params_ == {"nys__n_components": 30} and grid.best_score_ > 0.9
    # a grid of numpy integers (np.arange), as scikit-learn users write them
    grid = GridSearchCV(Pipeline([("nys", NystromFeatures(random_state=0)), ("clf", LinearSVC(C=10.0))]),
                        {"nys__n_components": np.arange(10, 40, 10), "nys__rank": [None, np.int64(8)]},
                        cv=3, error_score="raise").fit(X, y)
    assert isinstance(grid.best_params_["nys__n_components"], np.integer) and grid.best_score_ > 0.9


# -- features against dense references ---------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["rbf", "matern32"])
def test_gram_is_the_nystrom_kernel(kernel):
    X, _ = circles(200)
    Z = np.random.default_rng(5).normal(size=(30, 2))
    nys = NystromFeatures(kernel=kernel, lengthscale=0.7, n_components=25, random_state=0).fit(X)
    C = nys.landmarks_.numpy()
    k = nys.kernel_
    Knm, Kzm, Kmm = dense(k, X, C), dense(k, Z, C), dense(k, C, C)
    ref = Knm @ torch.linalg.pinv(Kmm, hermitian=True) @ Kzm.mT
    Phi, Phz = nys.transform(X), nys.transform(Z)
    assert np.abs(Phi @ Phz.T - ref.numpy()).max() < 1e-8
    std = clone(nys).set_params(basis="standard").fit(X)  # same landmarks (same seed)
    assert Phi.shape == (200, 25) and std.transform(X).shape == (200, 25)
    assert np.abs(std.transform(X) @ std.transform(Z).T - ref.numpy()).max() < 1e-8
    # the standard basis is the symmetric root of K_mm^+: A A = K_mm^+ for that A
    assert torch.allclose(std.A_ @ std.A_, torch.linalg.pinv(Kmm, hermitian=True), atol=1e-6 * float(Kmm.norm()))


def test_rank_truncation_is_the_rank_s_nystrom_kernel():
    X, _ = circles(200)
    nys = NystromFeatures(lengthscale=1.0, n_components=30, rank=8, random_state=0).fit(X)
    C = nys.landmarks_
    evals, V = torch.linalg.eigh(dense(nys.kernel_, C, C))
    Ws = V[:, -8:] @ torch.diag(1 / evals[-8:]) @ V[:, -8:].mT  # W_(s)^+ of [NSL] eq. (1)
    Knm = dense(nys.kernel_, X, C).numpy()
    ref = Knm @ Ws.numpy() @ Knm.T
    for basis in ("orthonormal", "standard"):
        Phi = clone(nys).set_params(basis=basis).fit_transform(X)
        assert Phi.shape[1] == (8 if basis == "orthonormal" else 30)
        assert np.abs(Phi @ Phi.T - ref).max() < 1e-8


def test_median_heuristic_and_torch_input():
    X, _ = circles(150)
    Xt = torch.as_tensor(X)
    nys = NystromFeatures(n_components=10, random_state=0).fit(Xt)
    assert nys.lengthscale_ == pytest.approx(float(torch.pdist(Xt).median()), rel=1e-12)  # n <= 1000: all pairs
    assert median_lengthscale(Xt) == pytest.approx(nys.lengthscale_, rel=1e-12)  # of the centred rows
    out = nys.transform(Xt)
    assert isinstance(out, torch.Tensor) and out.device == Xt.device and out.shape == (150, 10)
    assert np.array_equal(out.numpy(), nys.transform(X))
    big = torch.tensor([[0.0], [1e20], [3e20]])  # float32: the squared distances overflow, the distances do not
    assert median_lengthscale(big) == pytest.approx(2e20, rel=1e-6)


@pytest.mark.parametrize("offset", [1e3, 1e4])
def test_float32_features_of_offset_data_are_float64s(offset):
    """Inputs near 1e4 hold three fewer digits in float32: with a stationary kernel the features are computed from
    the centred points (the centre taken in float64), and the float32 Gram matrix is float64's to 1e-4 (0.18 off at
    1e4 before). A linear kernel is not shift-invariant: its inputs are not centred."""
    rng = np.random.default_rng(0)
    X = offset + rng.random((300, 3))
    maps = [NystromFeatures(n_components=50, random_state=0, dtype=dt).fit(X) for dt in ("float64", "float32")]
    G64, G32 = (Phi.astype(np.float64) @ Phi.T.astype(np.float64) for Phi in (m.transform(X) for m in maps))
    assert np.abs(G64 - G32).max() <= 1e-4
    assert np.allclose(maps[0].landmarks_.numpy(), X[maps[0].landmark_indices_.numpy()], rtol=0, atol=1e-9)
    linear = NystromFeatures(gpytorch.kernels.LinearKernel().double(), n_components=3, random_state=0).fit(X)
    assert linear.center_ is None


def test_only_shift_invariant_kernels_are_centred_and_integer_tensors_are_taken():
    """A sum with a linear part is not shift-invariant: with every point a landmark its features reproduce the
    kernel exactly (they were 22.7 off when the sum counted as stationary). Integer tensors are taken by value, as
    integer arrays are."""
    K = gpytorch.kernels
    rng = np.random.default_rng(0)
    X = torch.as_tensor(3 + rng.random((40, 2)))
    for kernel, centred in ((K.RBFKernel() + K.LinearKernel(), False), (K.RBFKernel() * K.MaternKernel(), True),
                            (K.ScaleKernel(K.RBFKernel() + K.PeriodicKernel()), True)):
        nys = NystromFeatures(kernel.double(), n_components=40, random_state=0).fit(X)
        assert (nys.center_ is not None) == centred
        Phi = nys.transform(X)
        dense = nys.kernel_(X, X).to_dense().detach()
        assert float((Phi @ Phi.T - dense).abs().max()) <= 1e-6 * float(dense.abs().max()), kernel
    ints = torch.arange(60).reshape(30, 2) % 7
    out = NystromFeatures(n_components=9, random_state=0).fit(ints).transform(ints)
    assert out.dtype == torch.float64 and torch.equal(out, NystromFeatures(n_components=9, random_state=0)
                                                      .fit(ints.double()).transform(ints.double()))


# -- NSL = LLA = NCR ([NSL] §3.3, §3.5, Prop 3) ---------------------------------------------------------------------
def test_ridge_on_features_is_the_ncr_and_lla_mean():
    rng = np.random.default_rng(0)
    X = 4 * rng.random((250, 2))
    y = np.sin(X[:, 0]) + 0.1 * rng.normal(size=250)
    Z = 4 * rng.random((40, 2))
    lam = 0.05
    nys = NystromFeatures(lengthscale=0.8, n_components=30, landmarks="fps").fit(X)
    ridge = Ridge(alpha=lam, fit_intercept=False, solver="cholesky").fit(nys.transform(X), y)
    pred = ridge.predict(nys.transform(Z))
    kern = nys.kernel_
    Xt, yt, Zt = torch.as_tensor(X), torch.as_tensor(y), torch.as_tensor(Z)
    ncr = NCRPosterior(kern, Xt, yt, lam, nys.landmarks_).mean(Zt).numpy()
    lla = LLAPosterior(kern, Xt, yt, lam, nys.landmarks_).mean(Zt).numpy()
    assert np.abs(pred - ncr).max() < 1e-8 * max(1.0, np.abs(ncr).max())
    assert np.abs(pred - lla).max() < 1e-8 * max(1.0, np.abs(lla).max())
    std = clone(nys).set_params(basis="standard").fit(X)  # m features, same Gram: the same ridge predictor
    pred_std = Ridge(alpha=lam, fit_intercept=False, solver="cholesky").fit(std.transform(X), y)
    assert np.abs(pred_std.predict(std.transform(Z)) - ncr).max() < 1e-8 * max(1.0, np.abs(ncr).max())


def test_linear_svm_on_either_basis_is_the_same_classifier():
    """An L2-regularised linear SVM sees only inner products: the orthonormal and standard bases (rotated by
    ``V_s``) give the same decision function ([NSL] §3.3, eq. (16)-(17))."""
    X, y = circles(300)
    Z, _ = circles(100, seed=2)
    nys = NystromFeatures(n_components=30, random_state=1).fit(X)
    std = clone(nys).set_params(basis="standard").fit(X)
    svm = dict(C=5.0, loss="hinge", tol=1e-10, max_iter=200000, dual=True, intercept_scaling=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = LinearSVC(**svm).fit(nys.transform(X), y).decision_function(nys.transform(Z))
        b = LinearSVC(**svm).fit(std.transform(X), y).decision_function(std.transform(Z))
    assert np.abs(a - b).max() < 1e-6 * np.abs(a).max()


# -- landmarks -------------------------------------------------------------------------------------------------------
def test_kmeans_landmarks_beat_uniform_on_clustered_data():
    """Clustered Nyström ([NSL] §3.7): on a clustered set, k-means centres approximate K better than uniform rows
    at equal m (relative Frobenius error, mean over four seeds)."""
    errs = {"kmeans": [], "uniform": []}
    for seed in range(4):
        X = blobs(seed=seed)
        for rule in errs:
            nys = NystromFeatures(lengthscale=0.5, n_components=24, landmarks=rule, random_state=seed).fit(X)
            K = dense(nys.kernel_, X, X).numpy()
            Phi = nys.transform(X)
            errs[rule].append(np.linalg.norm(K - Phi @ Phi.T) / np.linalg.norm(K))
    assert np.mean(errs["kmeans"]) < 0.7 * np.mean(errs["uniform"]), errs


@pytest.mark.parametrize("rule", ["uniform", "fps", "kmeans", "leverage"])
def test_rules_and_seeded_reproducibility(rule):
    X, _ = circles(200)
    a = NystromFeatures(n_components=15, landmarks=rule, random_state=7).fit_transform(X)
    b = NystromFeatures(n_components=15, landmarks=rule, random_state=7).fit_transform(X)
    assert a.shape == (200, 15) and np.array_equal(a, b)
    if rule in ("uniform", "kmeans"):  # seeded rules move with the seed
        c = NystromFeatures(n_components=15, landmarks=rule, random_state=8).fit_transform(X)
        assert not np.array_equal(a, c)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dtypes(dtype):
    X, _ = circles(200)
    nys = NystromFeatures(n_components=20, dtype=dtype, random_state=0).fit(X)
    Phi = nys.transform(X)
    assert Phi.dtype == np.dtype(dtype) and nys.landmarks_.dtype == getattr(torch, dtype)
    ref = clone(nys).set_params(dtype="float64").fit_transform(X)
    tol = 1e-3 if dtype == "float32" else 1e-10
    assert np.abs(Phi @ Phi.T - ref @ ref.T).max() < tol


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_read_only_input_is_copied_without_a_warning(dtype):
    """A read-only array (a pandas frame's values, a memory map) is copied: torch warns when it shares one."""
    X, _ = circles(150)
    X = X.astype(dtype)
    X.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        nys = NystromFeatures(n_components=20, dtype=dtype, random_state=0).fit(X)
        Phi = nys.transform(X)
    assert not X.flags.writeable and np.array_equal(Phi, nys.transform(X.copy()))


# -- bad input --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("params, fit_x, match", [
    ({"n_components": 500}, None, "n_components"),
    ({"n_components": 0}, None, "n_components"),
    ({"n_components": 10, "rank": 11}, None, "rank"),
    ({"rank": 0}, None, "rank"),
    ({"landmarks": "random"}, None, "landmarks"),
    ({"basis": "cholesky"}, None, "basis"),
    ({"kernel": "laplace"}, None, "kernel"),
    ({"kernel": 3}, None, "kernel"),
    ({"lengthscale": -1.0}, None, "lengthscale"),
    ({"kernel": gpytorch.kernels.RBFKernel(), "lengthscale": 1.0}, None, "lengthscale"),
    ({"dtype": "float16"}, None, "dtype"),
    ({"landmarks": "leverage", "ridge": 0.0}, None, "ridge"),
    ({"random_state": -1}, None, "random_state"),
    ({}, np.array([[0.0, np.nan]] * 20), "X"),
    ({}, np.array([[0.0, np.inf]] * 20), "X"),
    ({}, np.zeros(20), "X"),
    ({}, np.zeros((0, 2)), "X"),
    ({}, np.array([["a", "b"]] * 20), "X"),
])
def test_bad_input_raises_naming_the_argument(params, fit_x, match):
    X = circles(100)[0] if fit_x is None else fit_x
    with pytest.raises(ValueError, match=match):
        NystromFeatures(**{"n_components": 10, **params}).fit(X)


def test_bad_transform_input():
    X, _ = circles(100)
    nys = NystromFeatures(n_components=10, random_state=0)
    with pytest.raises(ValueError, match="fitted"):  # NotFittedError is a ValueError
        nys.transform(X)
    nys.fit(X)
    with pytest.raises(ValueError, match="X has 3 features"):
        nys.transform(np.zeros((5, 3)))
    with pytest.raises(ValueError, match="NaN"):
        nys.transform(np.full((5, 2), np.nan))
