"""Every public path of gpnys on a CUDA device, against dense float64 references.

Each test takes the ``cuda_device`` fixture (``tests/conftest.py``): ``torch.device("cuda")``, or the device named
by ``GPNYS_CUDA_SUITE_DEVICE``. Without CUDA the tests are skipped; ``GPNYS_CUDA_SUITE_DEVICE=cpu pytest -m cuda``
runs the same logic on the CPU (where the kernel operator's default backend is torch tiles instead of Triton).

Everything under test lives on ``cuda_device``; every reference is built in float64 on CPU copies (dense Cholesky
/ ``torch.linalg``), so it never depends on the device code it checks. The BoTorch model is in
``tests/bo/test_cuda_bo.py`` (it needs the module-wide ``USES_BOTORCH`` settings of conftest).

Tolerances: float64 ones are a few orders of magnitude above the measured errors (CPU mode) and far below any
real error; float32 ones follow the rounding of the computation (noted where it is large).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings

import gpytorch
import pytest
import torch
from helpers import points

import gpnys
from gpnys import datasets, memory_budget
from gpnys.checks import NumericalWarning
from gpnys.cli.main import main
from gpnys.gp.training import ExactGPModel, fit
from gpnys.gp.training import predict as exact_predict
from gpnys.kernels import make_kernel as make_scale_kernel
from gpnys.kernels.backends import triton_available
from gpnys.kernels.cutoff import cutoff_radius, leaf_plan, spatial_order
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.kernels.system import kernel_system
from gpnys.precond import AutoPreconditioner, PointCache, make_preconditioner
from gpnys.reduced import reduced_posterior
from gpnys.reduced.nytro import nytro

pytestmark = pytest.mark.cuda

F64 = torch.float64
CPU = torch.device("cpu")


# -- helpers ----------------------------------------------------------------------------------------------------
def on(device, *tensors, dtype=None):
    """``tensors`` moved to ``device`` (and ``dtype``)."""
    out = tuple(t.to(device=device, dtype=dtype or t.dtype) for t in tensors)
    return out[0] if len(out) == 1 else out


def ref64(t: torch.Tensor) -> torch.Tensor:
    """A float64 CPU copy (the reference side)."""
    return t.detach().to(device=CPU, dtype=F64)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |a - ref| / max |ref|`` in float64 on the CPU."""
    a, ref = ref64(a), ref64(ref)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    return float((a - ref).abs().max() / ref.abs().max())


def assert_on(device: torch.device, *tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.device.type == device.type, (t.device, device)


def matern32_dense(X: torch.Tensor, lengthscale, outputscale=1.0) -> torch.Tensor:
    """``s^2 k(X, X)`` for Matérn-3/2 from explicit coordinate differences (float64 in, float64 out)."""
    D2 = sum(((X[:, None, j] - X[None, :, j]) / lengthscale) ** 2 for j in range(X.shape[1]))
    r = torch.sqrt(torch.where(D2 > 0, D2, torch.ones_like(D2)))
    k = torch.where(D2 > 0, (1 + math.sqrt(3) * r) * torch.exp(-math.sqrt(3) * r), torch.ones_like(D2))
    return outputscale * k


def unit_kernel(name: str, lengthscale: float, dtype: torch.dtype, device: torch.device):
    """A unit-variance RBF or Matérn-3/2 GPyTorch kernel with the given length-scale, on ``device``."""
    base = gpytorch.kernels.RBFKernel() if name == "rbf" else gpytorch.kernels.MaternKernel(nu=1.5)
    base = base.to(device=device, dtype=dtype)
    base.lengthscale = lengthscale
    return base


def dense_kernel64(kern: gpytorch.kernels.Kernel, A: torch.Tensor, B: torch.Tensor | None = None) -> torch.Tensor:
    """``kern(A, B)`` evaluated on float64 CPU copies of the kernel and the points."""
    import copy

    k64 = copy.deepcopy(kern).to(device=CPU, dtype=F64)
    with torch.no_grad():
        return k64(ref64(A), ref64(A if B is None else B)).to_dense()


# -- 1. preconditioners -----------------------------------------------------------------------------------------
N_P, MU_P, LS_P = 300, 1e-2, 2.0
PRECOND_OPTIONS = {
    "afn": {"k": 60, "w": 20},
    "nystrom": {"rank": 60},
    "fsai": {"w": 20},
    "pivchol": {"rank": 60},
    "auto": {"max_k": 60, "w": 20, "m": 200},  # AutoPreconditioner's own arguments
}


def cube_points(n: int) -> torch.Tensor:
    """n uniform points at unit density in 3-D (float64, CPU)."""
    return points(n, 3, dtype=F64, seed=0, scale=n ** (1.0 / 3))


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_thin_product_form_on_device(cuda_device, dtype, t):
    """``thin_matmul`` in each of ``THIN_FORMS`` on the device equals the float64 product; the form this device's
    timing picks is one of them."""
    from gpnys import linalg

    g = torch.Generator().manual_seed(0)
    A64, B64 = torch.randn(300, 200, generator=g, dtype=F64), torch.randn(200, t, generator=g, dtype=F64)
    A, B = on(cuda_device, A64, B64, dtype=dtype)
    tol = 1e-12 if dtype == F64 else 1e-5
    for form in linalg.THIN_FORMS:
        out = linalg.thin_matmul(A, B, form)
        assert_on(cuda_device, out)
        assert out.shape == (300, t) and out.is_contiguous() and out.dtype == dtype
        assert rel(out, A64 @ B64) < tol, form
    assert linalg.time_thin_forms(dtype, cuda_device) in linalg.THIN_FORMS


@pytest.mark.parametrize("name", list(PRECOND_OPTIONS))
def test_preconditioner_identities_on_device(cuda_device, name, dtype):
    X64 = cube_points(N_P)
    X = on(cuda_device, X64, dtype=dtype)
    kern = unit_kernel("matern32", LS_P, dtype, cuda_device)
    if name == "auto":  # Algorithm 5 itself (the factory's "auto" runs in the hook and CLI tests)
        P = AutoPreconditioner(X, kern, MU_P, cache=PointCache(X), **PRECOND_OPTIONS[name])
        assert P.choice in ("nystrom", "afn") and P.summary()["estimated_rank"] == P.estimate.k
    else:
        P = make_preconditioner(name, X, kern, MU_P, cache=PointCache(X), **PRECOND_OPTIONS[name])
    V = on(cuda_device, torch.randn(N_P, 3, generator=torch.Generator().manual_seed(1), dtype=F64), dtype=dtype)
    PV, back, logdet, S = P.matmul(V), P.solve(P.matmul(V)), P.logdet(), P.sample(2)
    assert_on(cuda_device, PV, back, logdet, S)
    assert PV.dtype == back.dtype == logdet.dtype == S.dtype == dtype and S.shape == (N_P, 2)
    err_solve = float((ref64(back) - ref64(V)).norm() / ref64(V).norm())
    # the dense P (P applied to the identity on the device), its log-determinant by float64 LU on the CPU
    Pd = ref64(P.matmul(torch.eye(N_P, dtype=dtype, device=cuda_device)))
    asym = float((Pd - Pd.T).abs().max() / Pd.abs().max())
    Pd = 0.5 * (Pd + Pd.T)
    sign, ref_logdet = torch.linalg.slogdet(Pd)
    assert float(sign) == 1.0
    err_logdet = abs(float(logdet) - float(ref_logdet))
    # and it approximates A = K + mu I (dense float64 kernel): P^{-1} A is better conditioned than A
    A = dense_kernel64(kern, X64) + MU_P * torch.eye(N_P, dtype=F64)
    cond_ratio = float(torch.linalg.cond(torch.linalg.solve(Pd, A)) / torch.linalg.cond(A))
    tol = 1e-9 if dtype == F64 else 2e-3
    assert err_solve < tol
    assert asym < (1e-12 if dtype == F64 else 1e-5)
    # float32: the reference is the slogdet of the float32 dense P (measured <= 6.7e-4)
    assert err_logdet < (1e-9 * N_P if dtype == F64 else 5e-3)
    assert cond_ratio < 0.1


@pytest.mark.parametrize("name", ["afn", "nystrom", "fsai", "pivchol"])
def test_preconditioner_on_device_equals_cpu_float64(cuda_device, name):
    """The deterministic preconditioners (FPS landmarks, kNN patterns, pivots) built on the device in float64 are
    the ones built on the CPU: the same landmarks and the same dense P to rounding."""
    X64 = cube_points(N_P)
    Pdev = make_preconditioner(name, on(cuda_device, X64), unit_kernel("matern32", LS_P, F64, cuda_device), MU_P,
                               **PRECOND_OPTIONS[name])
    Pcpu = make_preconditioner(name, X64, unit_kernel("matern32", LS_P, F64, CPU), MU_P, **PRECOND_OPTIONS[name])
    idx = {"afn": "landmark_idx", "nystrom": "landmark_indices", "pivchol": "pivots"}.get(name)
    if idx is not None:
        assert torch.equal(getattr(Pdev, idx).cpu(), getattr(Pcpu, idx))
    I = torch.eye(N_P, dtype=F64)
    err = rel(Pdev.matmul(on(cuda_device, I)), Pcpu.matmul(I))
    assert err < 1e-10
    assert abs(float(Pdev.logdet()) - float(Pcpu.logdet())) < 1e-9 * N_P


# -- 2. PCG with the kernel system -----------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["dense", "on-the-fly"])
def test_pcg_kernel_system_on_device(cuda_device, storage, dtype):
    n, mu = 500, 1e-1
    X64 = cube_points(n)
    X = on(cuda_device, X64, dtype=dtype)
    kern = unit_kernel("matern32", 1.5, dtype, cuda_device)
    b64 = torch.rand(n, generator=torch.Generator().manual_seed(2), dtype=F64) - 0.5
    b = on(cuda_device, b64, dtype=dtype)
    tol = 1e-10 if dtype == F64 else 1e-5
    with memory_budget(dense_bytes=0) if storage == "on-the-fly" else contextlib.nullcontext():
        A = kernel_system(X, kern, mu)
        assert A.dense == (storage == "dense")
        if storage == "on-the-fly":
            assert A._op is not None  # the stationary operator (Triton on CUDA), not GPyTorch's blocks
        P = make_preconditioner("afn", X, kern, mu, k=80, w=20)
        res = gpnys.pcg(A, b, precond=P, tol=tol, maxiter=1000)
        AV = A(b)
    assert_on(cuda_device, res.x, AV)
    assert res.x.dtype == dtype and bool(res.converged.all()) and res.iterations > 1
    A64 = dense_kernel64(kern, X64) + mu * torch.eye(n, dtype=F64)
    x_ref = torch.linalg.solve(A64, b64)
    err_x = float((ref64(res.x) - x_ref).norm() / x_ref.norm())
    err_Ab = rel(AV, A64 @ b64)
    assert err_Ab < (1e-12 if dtype == F64 else 1e-5)
    assert err_x < (1e-8 if dtype == F64 else 1e-4)


# -- 3. the kernel operator on the fly: cutoff plan and Triton ------------------------------------------------
N_OP = 3000


@pytest.fixture(scope="module")
def strip_points():
    """3000 points in [0, 200] x [0, 3] (float64, CPU): at length-scale 1 most pairs are beyond the cutoff."""
    g = torch.Generator().manual_seed(0)
    return torch.rand(N_OP, 2, generator=g, dtype=F64) * torch.tensor([200.0, 3.0], dtype=F64)


@pytest.fixture(scope="module")
def strip_reference(strip_points):
    """``(U, V, K V, sum U o K V, d/dl sum U o K V)`` for the unit Matérn-3/2 kernel at l = 1 (float64, CPU): the
    distances from explicit coordinate differences, the length-scale derivative by autograd."""
    X = strip_points
    g = torch.Generator().manual_seed(3)
    U, V = torch.randn(N_OP, 3, generator=g, dtype=F64), torch.randn(N_OP, 3, generator=g, dtype=F64)
    R = torch.sqrt(sum((X[:, None, j] - X[None, :, j]) ** 2 for j in range(X.shape[1])))
    ls = torch.tensor(1.0, dtype=F64, requires_grad=True)
    a = math.sqrt(3) * R / ls
    K = (1 + a) * torch.exp(-a)
    (U * (K @ V)).sum().backward()
    KV = K.detach() @ V
    return U, V, KV, float((U * KV).sum()), float(ls.grad)


def assert_no_triton_fallback(device: torch.device, dtype: torch.dtype) -> None:
    """The Triton backend answers a failed compile/launch with the torch tiles (and one warning): make it fail."""
    if device.type == "cuda" and triton_available():
        from gpnys.launch import failed

        assert not failed("kernel", device, dtype), "Triton kernels failed; torch tiles answered"


@pytest.mark.parametrize("prune_tol", [None, 0.0], ids=["cutoff", "no-cutoff"])
def test_kernel_operator_on_the_fly(cuda_device, strip_points, strip_reference, prune_tol, dtype):
    U64, V64, KV, ds2_ref, dls_unit = strip_reference
    X = on(cuda_device, strip_points, dtype=dtype)
    U, V = on(cuda_device, U64, V64, dtype=dtype)
    kern = make_scale_kernel("matern32").to(device=cuda_device, dtype=dtype)
    kern.outputscale = 1.7
    kern.base_kernel.lengthscale = 1.0
    with memory_budget(dense_bytes=0):
        op = StationaryKernelOperator(X, kern.outputscale, kern.base_kernel.lengthscale, base=kern.base_kernel,
                                      cache={}, prune_tol=prune_tol)
        expected = "triton" if cuda_device.type == "cuda" and triton_available() else "torch"
        assert op.backend.name == expected
        plan = op.plan()
        if prune_tol is None:
            assert plan is not None and plan.fraction < 0.5
        else:
            assert plan is None
        got = op.matmul(V)
        d_x, d_s2, d_ls = op._bilinear_derivative(U, V)
    assert_no_triton_fallback(cuda_device, dtype)
    assert d_x is None
    assert_on(cuda_device, got, d_s2, d_ls)
    assert got.dtype == d_s2.dtype == d_ls.dtype == dtype
    # the reference at the operator's own outputscale (GPyTorch's setter rounds 1.7 in float32); l = 1 is exact
    s2 = float(kern.outputscale.detach())
    err_mm = rel(got, s2 * KV)
    err_s2 = abs(float(d_s2) - ds2_ref) / abs(ds2_ref)
    err_ls = abs(float(d_ls.reshape(())) - s2 * dls_unit) / abs(s2 * dls_unit)
    # |z| reaches 100 length-scales. The torch tiles without the cutoff use the expanded distance form on globally
    # centred points, which loses ~eps |z|^2 (measured float32 6.6e-4 / 1.3e-3 / 2.9e-4, float64 7.8e-13 / 2.3e-12 /
    # 3.2e-12 for product / outputscale / length-scale derivative); with the cutoff every tile is centred on its
    # leaf (float32 <= 9e-6, float64 <= 3e-15), and so are the Triton kernels' tiles with or without it (measured
    # under TRITON_INTERPRET=1: float32 <= 1e-5, float64 <= 4.3e-15).
    centred = prune_tol is None or op.backend.name == "triton"
    if dtype == F64:
        tol = 1e-12 if centred else 1e-10
    else:
        tol = 1e-3 if centred else 2e-2
    assert err_mm < tol and err_s2 < tol and err_ls < tol


def test_leaf_plan_on_device_equals_cpu(cuda_device, strip_points, dtype):
    X = on(cuda_device, strip_points, dtype=dtype)
    Z = X - X.mean(0)  # length-scale 1
    Zc = Z.cpu()
    leaf = StationaryKernelOperator.LEAF
    perm = spatial_order(Z, leaf)
    perm_c = spatial_order(Zc, leaf)
    assert_on(cuda_device, perm)
    assert torch.equal(perm.cpu(), perm_c)
    radius = cutoff_radius(1.5, torch.finfo(dtype).eps)
    plan, plan_c = leaf_plan(Z, perm, leaf, radius), leaf_plan(Zc, perm_c, leaf, radius)
    assert plan.leaf == plan_c.leaf and plan.num_leaves == plan_c.num_leaves
    assert list(plan.near_ptr) == list(plan_c.near_ptr)
    assert torch.equal(plan.near_idx.cpu(), plan_c.near_idx)
    assert plan.fraction == plan_c.fraction and 0 < plan.fraction < 0.5
    # every pair within the radius is covered (dense distances in float64 on the CPU)
    P = ref64(Zc)[perm_c]
    covered = torch.zeros(N_OP, N_OP, dtype=torch.bool)
    for i in range(plan_c.num_leaves):
        covered[plan_c.rows(i), plan_c.cols(i)] = True
    assert not ((torch.cdist(P, P) <= radius) & ~covered).any()


# -- 4. the training hook ----------------------------------------------------------------------------------------
def hook_model(ds, dtype, device):
    X, y = ds.train_x, ds.train_y
    lik = gpytorch.likelihoods.GaussianLikelihood().to(device=device, dtype=dtype)
    m = ExactGPModel(X, y, lik, kernel="matern32").to(device=device, dtype=dtype)
    m.covar_module.base_kernel.lengthscale = 1.5
    m.covar_module.outputscale = 1.0
    lik.noise = 0.1
    return m


def cpu64_copy(model):
    """The same model (state dict) on float64 CPU copies of its data: the Cholesky reference."""
    X, y = ref64(model.train_inputs[0]), ref64(model.train_targets)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    ref = ExactGPModel(X, y, lik, kernel="matern32").double()
    ref.load_state_dict({k: ref64(v) for k, v in model.state_dict().items()})
    return ref


def exact_loss(model) -> float:
    """GPyTorch's exact -MLL / n (Cholesky) of a float64 CPU copy."""
    ref = cpu64_copy(model)
    ref.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(ref.likelihood, ref)
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6), \
            gpytorch.settings.fast_computations(False, False, False):
        return float(-mll(ref(*ref.train_inputs), ref.train_targets))


def test_hook_training_and_prediction_on_the_fly(cuda_device, dtype):
    ds = datasets.load("elevators", n=800, seed=0, dtype=dtype, device=cuda_device)  # d = 18
    ds64 = datasets.load("elevators", n=800, seed=0)  # the loader on the CPU in float64: the same rows
    assert_on(cuda_device, ds.train_x, ds.train_y, ds.test_x)
    assert ds.train_x.dtype == dtype and ds.train_x.shape == (800, 18)
    assert rel(ds.train_x, ds64.train_x) < (1e-12 if dtype == F64 else 1e-5)
    assert rel(ds.train_y, ds64.train_y) < (1e-12 if dtype == F64 else 1e-5)
    m = hook_model(ds, dtype, cuda_device)
    loss0 = exact_loss(m)
    test_x = ds.test_x[:200]
    with memory_budget(dense_bytes=0):
        with gpnys.use_preconditioner(m, "auto", k=300, w=20) as hook:
            res = fit(m, iters=3, lr=0.05, progress=False, seed=0, settings=lambda n: contextlib.nullcontext())
            op = hook.stationary_operator(m.train_inputs[0])
            assert op is not None and op._dense() is None  # the on-the-fly operator was the training kernel
            assert hook.kernel_fraction is not None
            mean, var = hook.predict(test_x)
    assert_no_triton_fallback(cuda_device, dtype)
    assert hook.builds == 3 + 1  # one per Adam step, one for the prediction's hyperparameters
    assert hook.history[-1].kind in ("afn", "nystrom")
    err_loss = abs(res.loss_trace[0] - loss0) / abs(loss0)
    assert all(math.isfinite(v) for v in res.loss_trace)
    assert_on(cuda_device, mean, var)
    assert mean.dtype == var.dtype == dtype
    ref = cpu64_copy(m)  # the hyperparameters after the Adam steps
    mean_ref, var_ref = exact_predict(ref, ref64(test_x))
    err_mean = rel(mean, mean_ref)
    err_var = float(((ref64(var) - var_ref) / var_ref).abs().max())
    assert err_loss < 2e-2
    assert err_mean < (1e-4 if dtype == F64 else 2e-3)
    assert err_var < 3e-3
    # the Adam steps moved the hyperparameters downhill on the exact loss
    assert exact_loss(m) < loss0


# -- 5. reduced posteriors and NYTRO ---------------------------------------------------------------------------
NOISE_R, MEAN_R = 0.05, 0.1


@pytest.fixture(scope="module")
def concrete():
    return datasets.load("concrete", n=300, seed=0)  # d = 8, float64 on the CPU


def reduced_kernel(d, dtype, device):
    k = make_scale_kernel("matern52", ard_num_dims=d).to(device=device, dtype=dtype)
    k.base_kernel.lengthscale = torch.linspace(0.8, 2.0, d, dtype=dtype, device=device)
    k.outputscale = 1.2
    return k


def exact_mean64(kern, X, y, Z):
    """Exact GP predictive mean by dense float64 Cholesky on the CPU."""
    K = dense_kernel64(kern, X) + NOISE_R * torch.eye(X.shape[0], dtype=F64)
    L = torch.linalg.cholesky(K)
    alpha = torch.cholesky_solve((ref64(y) - MEAN_R)[:, None], L)[:, 0]
    return MEAN_R + dense_kernel64(kern, Z, X) @ alpha


@pytest.mark.parametrize("method", ["lla", "ncr", "gsa"])
def test_reduced_posterior_on_device_equals_cpu(cuda_device, concrete, method, dtype):
    X64, y64, Z64 = concrete.train_x, concrete.train_y, concrete.test_x[:60]
    C64 = X64[torch.randperm(X64.shape[0], generator=torch.Generator().manual_seed(0))[:40]]
    X, y, Z, C = on(cuda_device, X64, y64, Z64, C64, dtype=dtype)
    d = X64.shape[1]
    post = reduced_posterior(method, reduced_kernel(d, dtype, cuda_device), X, y, NOISE_R, landmarks=C,
                             prior_mean=MEAN_R)
    ref = reduced_posterior(method, reduced_kernel(d, F64, CPU), X64, y64, NOISE_R, landmarks=C64, prior_mean=MEAN_R)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)  # GSA's naive variance is clamped at 0 (test_reduced)
        mean, var = post.mean(Z), post.variance(Z)
        mean_ref, var_ref = ref.mean(Z64), ref.variance(Z64)
    assert_on(cuda_device, mean, var)
    assert mean.dtype == var.dtype == dtype
    err_mean, err_var = rel(mean, mean_ref), rel(var, var_ref)
    # GSA's alpha is a residual / sigma^2 and amplifies rounding the most (test_reduced: float32 vs float64 5e-2)
    if dtype == F64:
        tol = 1e-8 if method == "gsa" else 1e-9
    else:
        tol = 5e-2 if method == "gsa" else 1e-3
    assert err_mean < tol and err_var < tol


def test_reduced_posterior_landmark_rules_on_device(cuda_device, concrete):
    """``landmarks="fps"`` chooses the same points on the device as on the CPU (float64), so the posteriors agree."""
    X64, y64, Z64 = concrete.train_x, concrete.train_y, concrete.test_x[:60]
    X, y, Z = on(cuda_device, X64, y64, Z64)
    d = X64.shape[1]
    post = reduced_posterior("lla", reduced_kernel(d, F64, cuda_device), X, y, NOISE_R, m=40, landmarks="fps",
                             prior_mean=MEAN_R)
    ref = reduced_posterior("lla", reduced_kernel(d, F64, CPU), X64, y64, NOISE_R, m=40, landmarks="fps",
                            prior_mean=MEAN_R)
    assert rel(post.mean(Z), ref.mean(Z64)) < 1e-9
    assert rel(post.variance(Z), ref.variance(Z64)) < 1e-9


def test_rff_posterior_on_device(cuda_device, concrete, dtype):
    """RFF draws come from a generator on the data's device (they differ between devices): the reference is the
    dense float64 Bayesian linear model on the device's own frequencies, on the CPU."""
    X64, y64, Z64 = concrete.train_x, concrete.train_y, concrete.test_x[:60]
    X, y, Z = on(cuda_device, X64, y64, Z64, dtype=dtype)
    kern = reduced_kernel(X64.shape[1], dtype, cuda_device)
    post = reduced_posterior("rff", kern, X, y, NOISE_R, m=100, prior_mean=MEAN_R, seed=3)
    mean, var = post.mean(Z), post.variance(Z)
    assert_on(cuda_device, mean, var, post.features.G)
    assert mean.dtype == var.dtype == dtype
    Omega = ref64(post.features.frequencies())  # (D, d) at the kernel's length-scales
    D = Omega.shape[0]
    s2 = float(kern.outputscale.detach())

    def phi(A):
        P = A @ Omega.T
        return torch.cat([P.cos(), P.sin()], 1) * math.sqrt(s2 / D)

    Phi, Phz = phi(X64), phi(Z64)
    M = Phi.T @ Phi + NOISE_R * torch.eye(2 * D, dtype=F64)
    w = torch.linalg.solve(M, Phi.T @ (y64 - MEAN_R))
    mean_ref = MEAN_R + Phz @ w
    var_ref = NOISE_R * (Phz * torch.linalg.solve(M, Phz.T).T).sum(1)
    err_mean, err_var = rel(mean, mean_ref), rel(var, var_ref)
    assert err_mean < (1e-9 if dtype == F64 else 1e-3)
    assert err_var < (1e-9 if dtype == F64 else 1e-3)


def test_lla_with_every_point_a_landmark_is_the_exact_gp(cuda_device, concrete, dtype):
    X64, y64, Z64 = concrete.train_x, concrete.train_y, concrete.test_x[:60]
    X, y, Z = on(cuda_device, X64, y64, Z64, dtype=dtype)
    kern = reduced_kernel(X64.shape[1], dtype, cuda_device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumericalWarning)  # concrete has duplicated rows: K_mm is singular
        post = reduced_posterior("lla", kern, X, y, NOISE_R, landmarks=X, prior_mean=MEAN_R)
        mean = post.mean(Z)
    assert_on(cuda_device, mean)
    err = rel(mean, exact_mean64(kern, X64, y64, Z64))
    assert err < (1e-6 if dtype == F64 else 1e-3)


def test_nytro_on_device_equals_cpu(cuda_device, concrete, dtype):
    X64, y64 = concrete.train_x, concrete.train_y
    Xv64, yv64, Z64 = concrete.test_x, concrete.test_y, concrete.test_x[:60]
    C64 = X64[torch.randperm(X64.shape[0], generator=torch.Generator().manual_seed(1))[:40]]
    X, y, Xv, yv, Z, C = on(cuda_device, X64, y64, Xv64, yv64, Z64, C64, dtype=dtype)
    kern = make_scale_kernel("rbf").to(device=cuda_device, dtype=dtype)
    kern.base_kernel.lengthscale = 2.0
    kern64 = make_scale_kernel("rbf").double()
    kern64.base_kernel.lengthscale = 2.0
    path = nytro(kern, X, y, C, t_max=40, stop="none", X_val=Xv, y_val=yv, Z=Z)
    ref = nytro(kern64, X64, y64, C64, t_max=40, stop="none", X_val=Xv64, y_val=yv64, Z=Z64)
    assert_on(cuda_device, path.alpha, path.val_rmse, path.predictions)
    assert path.alpha.shape == ref.alpha.shape == (40, 40) and path.rank == ref.rank
    err_alpha, err_pred = rel(path.alpha, ref.alpha), rel(path.predictions, ref.predictions)
    err_rmse = rel(path.val_rmse, ref.val_rmse)
    tol = 1e-9 if dtype == F64 else 1e-3
    assert err_alpha < tol and err_pred < tol and err_rmse < tol
    if dtype == F64:  # the threshold rule stops at the same step
        th = nytro(kern, X, y, C, t_max=200, X_val=Xv, y_val=yv, stop="threshold", tau=0.01)
        th_ref = nytro(kern64, X64, y64, C64, t_max=200, X_val=Xv64, y_val=yv64, stop="threshold", tau=0.01)
        assert th.t_stop == th_ref.t_stop


# -- 7. the CLI ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [[], ["--dense-gib", "0"]], ids=["dense", "on-the-fly"])
def test_cli_mll_on_device(cuda_device, capsys, budget):
    argv = ["mll", "--device", str(cuda_device), "--n", "400", "--method", "exact,auto", "--k", "100", "--w", "20",
            "--json", *budget]
    assert main(argv) == 0
    recs = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(recs) == {"exact", "auto"}
    auto = recs["auto"]
    expected = "triton" if cuda_device.type == "cuda" and triton_available() else "torch"
    assert auto["kernel_backend"] == expected
    assert auto["kernel_storage"] == ("on-the-fly" if budget else "dense")
    # the exact record is the Cholesky loss of the same data (float64 CPU reference, written out)
    ds = datasets.load("elevators", n=400, seed=0)
    noise = float(torch.tensor(0.1, dtype=torch.float32))  # GPyTorch's setter goes through a float32 tensor
    K = matern32_dense(ds.train_x, 1.0) + noise * torch.eye(400, dtype=F64)
    L = torch.linalg.cholesky(K)
    a = torch.cholesky_solve(ds.train_y[:, None], L)[:, 0]
    ref = float(0.5 * ds.train_y @ a + torch.log(L.diagonal()).sum() + 200 * math.log(2 * math.pi)) / 400
    assert recs["exact"]["loss"] == pytest.approx(ref, rel=1e-10)
    assert auto["loss_rel_error"] < 1e-2
    assert all(math.isfinite(v) for v in auto["grad_rel_error"].values())


def test_cli_fit_on_device(cuda_device, capsys):
    common = ["fit", "--device", str(cuda_device), "--data", "concrete", "--n", "300", "--iters", "2", "--json"]
    assert main(common + ["--precond", "auto", "--k", "100", "--w", "20"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert main(common + ["--precond", "none"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert ours["method"] == "cg+slq/auto" and len(ours["loss_trace"]) == 2 and len(ours["steps"]) == 2
    assert all(s["cg_iters"] > 0 for s in ours["steps"])
    assert ours["loss_trace"] == pytest.approx(exact["loss_trace"], rel=1e-3)
    assert ours["test_rmse"] == pytest.approx(exact["test_rmse"], rel=1e-3)
    assert math.isfinite(ours["test_nll"]) and math.isfinite(exact["test_nll"])


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["rbf", "periodic"])
def test_batch_mode_on_device(cuda_device, kernel, dtype):
    """A batch-mode model on the device: each element's loss within its error bar of the float64 Cholesky loss on
    CPU copies (RBF through the per-element kernel operator, periodic through GPyTorch's evaluated batch)."""
    from test_batch_mode import B, N, _loss_and_grads, _model

    model, X, y = _model(kernel, torch.float64)
    exact, _, _ = _loss_and_grads(model, X, y)
    model, X, y = _model(kernel, dtype)
    model, X, y = model.to(cuda_device), X.to(cuda_device), y.to(cuda_device)
    loss, grads, hook = _loss_and_grads(model, X, y, gpnys.EstimatorSettings(probe_seed=0))
    assert loss.device.type == cuda_device.type and len(hook.batch_estimates) == B
    rounding = 1e-6 if dtype == torch.float64 else 2e-3
    for i, est in enumerate(hook.batch_estimates):
        assert abs(float(loss[i]) - float(exact[i])) <= 4 * est.std_error / N + rounding
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
