"""BoTorch integration: :class:`gpnys.bo.PreconditionedSingleTaskGP` against BoTorch's own ``SingleTaskGP``.

Importing BoTorch turns GPyTorch's fast computations off and raises ``max_cholesky_size`` to 4096, so a plain
``SingleTaskGP`` on a few hundred points is the dense Cholesky reference. ``max_cholesky_size=0`` forces the
preconditioned path (CG + SLQ training with the gpnys preconditioner, PCG posterior); a small ``k`` (< n) keeps
the preconditioner inexact so PCG really iterates.
"""

import copy
import math
import warnings
from pathlib import Path

import gpytorch
import pytest
import torch

pytest.importorskip("botorch")

from botorch.acquisition import qUpperConfidenceBound
from botorch.acquisition.logei import qLogExpectedImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.models.transforms.input import Normalize
from botorch.models.transforms.outcome import Standardize
from botorch.optim import optimize_acqf
from botorch.test_functions import Hartmann
from gpytorch.mlls import ExactMarginalLogLikelihood
from helpers import load_script

import gpnys
from gpnys.bo import PreconditionedSingleTaskGP
from gpnys.gp.path import DENSE_MATRICES, POSTERIOR_MATRICES, cholesky_fits

USES_BOTORCH = True  # conftest: run under BoTorch's global GPyTorch settings
PRECOND = {"k": 40, "w": 10, "posterior_cholesky_size": 0}  # k < n: an inexact preconditioner, so PCG iterates


# -- helpers ------------------------------------------------------------------------------------------------
def sinsum(X):
    """Smooth test function on the unit cube, ``(n, d) -> (n, 1)``."""
    return (torch.sin(3.0 * X) + 0.5 * torch.cos(5.0 * X[..., :1] * X[..., 1:2])).sum(-1, keepdim=True)


def hartmann6(X):
    return Hartmann(dim=6).to(X)(X).unsqueeze(-1)


def data(n, d, dtype=torch.float64, seed=0, noise_std=0.01, f=sinsum):
    """``(X (n, d) uniform on the unit cube, Y = f(X) + noise (n, 1))`` from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=dtype)
    Y = f(X) + noise_std * torch.randn(n, 1, generator=g, dtype=dtype)
    return X, Y


def points_at(m, d, dtype=torch.float64, seed=1, batch=()):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*batch, m, d, generator=g, dtype=dtype)


def set_hypers(model, noise=1e-3, lengthscale=None, constant=0.1):
    """Noise, ARD lengthscales (default evenly spaced in [0.3, 0.7]) and constant mean, set explicitly."""
    d = model.train_inputs[0].shape[-1]
    dtype = model.train_inputs[0].dtype
    if lengthscale is None:
        lengthscale = torch.linspace(0.3, 0.7, d, dtype=dtype)
    model.likelihood.noise = torch.tensor(noise, dtype=dtype)
    model.covar_module.lengthscale = torch.as_tensor(lengthscale, dtype=dtype).reshape(1, d)
    model.mean_module.constant = torch.tensor(constant, dtype=dtype)
    return model


def pair(X, Y, noise=1e-3, lengthscale=None, transforms=None, **kwargs):
    """(dense ``SingleTaskGP`` reference, ``PreconditionedSingleTaskGP``) with identical hyperparameters.

    ``transforms``: a function returning fresh ``{"input_transform": ..., "outcome_transform": ...}`` kwargs
    (each model gets its own instances; the state dict copies their learnt statistics)."""
    transforms = transforms or dict
    ref = set_hypers(SingleTaskGP(X, Y, **transforms()), noise, lengthscale)
    options = {"max_cholesky_size": 0, "posterior_tolerance": 1e-8, **PRECOND, **kwargs}
    model = PreconditionedSingleTaskGP(X, Y, **transforms(), **options)
    model.load_state_dict(ref.state_dict())
    return ref, model


def rel_error(actual, expected):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float(((actual - expected).abs() / expected.abs()).max())


def assert_rel(actual, expected, rtol, what=""):
    """Element-wise relative agreement: ``|a - e| <= rtol |e|`` everywhere."""
    err = rel_error(actual, expected)
    assert err <= rtol, f"{what}: max relative error {err:.3g} > {rtol:g}"


def fit(model, maxiter=None, **kwargs):
    """``fit_gpytorch_mll`` on the model's ``ExactMarginalLogLikelihood`` (the model's ``custom_fit`` for ours)."""
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    if maxiter is not None:
        kwargs["optimizer_kwargs"] = {"options": {"maxiter": maxiter}}
    fit_gpytorch_mll(mll, **kwargs)
    return model


def exact_mll(model):
    """``ExactMarginalLogLikelihood`` of ``model`` at its training data (train mode, no fast computations)."""
    model.train()
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    with torch.no_grad():
        return float(mll(model(*model.train_inputs), model.train_targets))


def lengthscale(model):
    return model.covar_module.lengthscale.detach().reshape(-1)


# -- 1. posterior agreement at the same hyperparameters -----------------------------------------------------
def test_posterior_mean_and_variance_match_single_task_gp():
    n, d = 250, 4
    X, Y = data(n, d)
    ref, model = pair(X, Y)
    assert model.uses_preconditioner()
    Xt = points_at(100, d)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert p.mean.shape == (100, 1) and p.variance.shape == (100, 1)
    assert model.posterior_iterations > 0  # PCG really iterated (k < n)
    hook = model.hook()
    assert hook.builds >= 1 and hook.history[-1].rank <= PRECOND["k"]  # the gpnys preconditioner was built
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance")
    # a second batch of the same shape takes the warm-started solve: as accurate
    Xt2 = points_at(100, d, seed=3)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt2), model.posterior(Xt2)
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean (warm start)")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance (warm start)")


def test_posterior_caches_follow_hyperparameters_and_data():
    """alpha, the warm start and the preconditioner are cached; none may go stale. The tolerance (1e-4) is
    loose on purpose: stale caches give errors of order one."""
    n, d = 250, 4
    X, Y = data(n, d)
    ref, model = pair(X, Y)
    Xt = points_at(50, d)
    with torch.no_grad():
        model.posterior(Xt)
    builds = model.hook().builds
    set_hypers(ref, noise=5e-3, lengthscale=[0.25, 0.4, 0.5, 0.8], constant=-0.2)
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert model.hook().builds > builds  # rebuilt for the new hyperparameters
    assert_rel(p.mean, p_ref.mean, 1e-4, "mean after new hyperparameters")
    assert_rel(p.variance, p_ref.variance, 1e-4, "variance after new hyperparameters")

    X2, Y2 = data(n + 30, d, seed=20)
    y2 = (Y2.squeeze(-1) - Y2.mean()) / Y2.std()
    for m in (ref, model):
        m.set_train_data(X2, y2, strict=False)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert model.hook().train_x.shape == (n + 30, d)
    assert_rel(p.mean, p_ref.mean, 1e-4, "mean after new data")
    assert_rel(p.variance, p_ref.variance, 1e-4, "variance after new data")


def test_posterior_follows_a_replaced_kernel_module():
    """A kernel module replaced after a posterior (the whole kernel, then a sub-kernel of another class with the
    same values): the posterior is the new kernel's at once, not that of the old one the hook and ``α`` were made
    with (errors of order one)."""
    n, d = 200, 4
    X, Y = data(n, d)
    _, model = pair(X, Y)
    Xt = points_at(40, d)
    with torch.no_grad():
        model.posterior(Xt)
    model.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d)).to(X)
    model.covar_module.base_kernel.lengthscale = torch.linspace(0.2, 0.5, d, dtype=X.dtype)
    model.covar_module.outputscale = 2.0
    for step in ("kernel", "sub-kernel"):
        ref = SingleTaskGP(X, Y, covar_module=copy.deepcopy(model.covar_module))
        ref.load_state_dict(model.state_dict())
        with torch.no_grad():
            p_ref, p = ref.eval().posterior(Xt), model.eval().posterior(Xt)
        assert_rel(p.mean, p_ref.mean, 1e-6, f"mean after a new {step}")
        assert_rel(p.variance, p_ref.variance, 1e-6, f"variance after a new {step}")
        base = gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=d).to(X)
        base.load_state_dict(model.covar_module.base_kernel.state_dict())  # the same values: only the object differs
        model.covar_module.base_kernel = base


def settings_kernel(setting, d, **kwargs):
    """A kernel with a plain setting (an attribute, not a parameter) that :func:`change_setting` changes: Matérn's
    ``nu`` (2.5), or ``active_dims`` (0, 1) of an RBF kernel."""
    if setting == "nu":
        return gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=d, **kwargs)
    return gpytorch.kernels.RBFKernel(ard_num_dims=2, active_dims=(0, 1), **kwargs)


def change_setting(kernel, setting):
    """Matérn's ``nu`` 2.5 -> 0.5, or ``active_dims`` (0, 1) -> (1, 2)."""
    if setting == "nu":
        kernel.nu = 0.5
    else:
        kernel.active_dims = torch.tensor([1, 2])


@pytest.mark.parametrize("reset", [True, False], ids=["train-eval", "no-reset"])
@pytest.mark.parametrize("setting", ["nu", "active_dims"])
def test_posterior_follows_kernel_settings(setting, reset):
    """A kernel's plain setting changed after a posterior (Matérn's ``nu``, ``active_dims``: attributes, not
    parameters): the next posterior is the new kernel's, after ``train()`` / ``eval()`` (which clears every cache,
    as it clears SingleTaskGP's) and without (the caches' keys hold the kernel's settings). The reference is
    SingleTaskGP after ``train()`` / ``eval()``. Stale caches gave mean errors of 0.7 (nu) and 4e2 (active_dims)."""
    n, d = 200, 3
    X, Y = data(n, d)
    ref = SingleTaskGP(X, Y, covar_module=settings_kernel(setting, d))
    ref.likelihood.noise = 1e-3
    ref.covar_module.lengthscale = 0.4
    model = PreconditionedSingleTaskGP(X, Y, covar_module=settings_kernel(setting, d), max_cholesky_size=0,
                                       posterior_tolerance=1e-8, **PRECOND)
    model.load_state_dict(ref.state_dict())
    Xt = points_at(30, d)
    with torch.no_grad():
        model.posterior(Xt)  # α, the hook and the posterior system at the old setting
    hook = model.hook()
    for m in (ref, model):
        change_setting(m.covar_module, setting)
    ref.train()
    ref.eval()
    if reset:
        model.train()
        model.eval()
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert_rel(p.mean, p_ref.mean, 1e-6, f"mean after a new {setting}")
    assert_rel(p.variance, p_ref.variance, 1e-6, f"variance after a new {setting}")
    assert model.hook() is not hook  # made anew for the new setting


def test_train_clears_the_posterior_caches():
    """``train()`` drops α, the posterior system and the hook, as GPyTorch's ``train()`` drops SingleTaskGP's
    prediction cache (a change that no cache key sees is then picked up); ``fit_gpytorch_mll`` keeps the hook it
    trains with (its ``train()`` / ``eval()`` calls come while the hook is in use), and the posterior after it."""
    n, d = 200, 3
    X, Y = data(n, d)
    ref, model = pair(X, Y)
    Xt = points_at(10, d)
    with torch.no_grad():
        model.posterior(Xt)
    hook = model.hook()
    model.eval()  # already in eval mode: nothing changes
    assert model.hook() is hook
    model.train()
    assert model.hook() is not hook and model.hook().builds == 0
    fit(model, maxiter=3)
    hook = model.hook()
    assert hook.builds >= 1  # the training preconditioners of the fit
    with torch.no_grad():
        p = model.posterior(Xt)
    assert model.hook() is hook
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        p_ref = ref.posterior(Xt)
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean after a fit")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance after a fit")


@pytest.mark.parametrize("outputs", [1, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_test_inputs_name_x(bad, outputs):
    """NaN or inf in the test inputs of a PCG posterior: a ValueError naming ``X`` before any solve (not one about
    the solver's internal right-hand sides), and the next posterior at finite points is SingleTaskGP's."""
    n, d = 200, 3
    X, Y = data(n, d)
    Y = torch.cat([Y, -Y], dim=-1)[:, :outputs]
    ref = SingleTaskGP(X, Y)
    ref.likelihood.noise = 1e-3
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, posterior_tolerance=1e-8, **PRECOND)
    model.load_state_dict(ref.state_dict())
    Xt = points_at(4, d)
    with torch.no_grad():
        model.posterior(Xt)
    Xbad = Xt.clone()
    Xbad[2, 1] = bad
    with pytest.raises(ValueError, match=r"^X\b"):
        model.posterior(Xbad)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean after the error")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance after the error")


def test_joint_covariance_matches_single_task_gp():
    n, d = 250, 4
    X, Y = data(n, d)
    ref, model = pair(X, Y)
    Xq = points_at(3, d, batch=(4,), seed=2)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xq), model.posterior(Xq)
    c_ref, c = p_ref.distribution.covariance_matrix, p.distribution.covariance_matrix
    assert c.shape == c_ref.shape == (4, 3, 3)
    assert model.posterior_iterations > 0
    torch.testing.assert_close(c, c_ref, rtol=0, atol=1e-8)
    torch.testing.assert_close(p.mean, p_ref.mean, rtol=1e-6, atol=0)


def test_joint_posterior_at_many_nearby_points():
    """A joint PCG posterior at many nearby points is positive definite only up to rounding and the solves' errors:
    it is held lazily (as GPyTorch holds its own), so building it does not fail on an eager Cholesky, and BoTorch's
    sampler factorises it with jitter as it does SingleTaskGP's."""
    X, Y = data(300, 2, seed=21, noise_std=0.0)
    ref, model = pair(X, Y, noise=1e-6)
    Xt = 0.5 + 0.02 * points_at(150, 2, seed=22)  # 150 points in a 0.02-wide square
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
        c_ref, c = p_ref.distribution.covariance_matrix, p.distribution.covariance_matrix
        assert float(torch.linalg.eigvalsh(c).min()) < 0  # not positive definite as computed: the case at hand
        samples = p.rsample(torch.Size([4]))
    assert samples.shape == (4, 150, 1) and bool(torch.isfinite(samples).all())
    # the covariance's error scales like tol² |k*|² / σ² = 1e-16 / 1e-6 here (docs/bo.md), the entries like 4e-8
    torch.testing.assert_close(c, c_ref, rtol=0, atol=1e-9)


def test_posterior_gradient_matches_single_task_gp():
    """The gradient w.r.t. the test inputs (``B`` held fixed) is what ``optimize_acqf`` uses."""
    n, d = 250, 4
    X, Y = data(n, d)
    ref, model = pair(X, Y)
    Xt = points_at(100, d)
    grads = []
    for m in (ref, model):
        x = Xt.clone().requires_grad_(True)
        post = m.posterior(x)
        (post.mean.sum() + post.variance.sum()).backward()
        grads.append(x.grad)
    assert model.posterior_iterations > 0 and model.hook().builds >= 1
    assert_rel(grads[1], grads[0], 1e-5, "d(mean + variance)/dX")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_posterior_cholesky_below_its_threshold(cholesky_shapes, dtype):
    """Up to ``posterior_cholesky_size`` the posterior is BoTorch's exact path: one n x n factorisation for all the
    calls at fixed hyperparameters, mean / variance / joint covariance / gradient as SingleTaskGP's; training
    still forms none; above the threshold PCG again."""
    n, d = 250, 4
    X, Y = data(n, d, dtype=dtype, seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BoTorch's InputDataWarning about float32
        ref, model = pair(X, Y, posterior_cholesky_size=n, precond="afn")  # auto: its rank estimate factors min(n, 500)
    fit(model, maxiter=2)
    assert not [s for s in cholesky_shapes if s[-1] >= n]  # training: no n x n Cholesky
    model.load_state_dict(ref.state_dict())
    Xt, Xq = points_at(40, d, dtype=dtype), points_at(3, d, batch=(2,), dtype=dtype, seed=2)
    outs, factorisations = [], []
    for m in (ref, model):
        cholesky_shapes.clear()
        m.eval()
        x = Xt.clone().requires_grad_(True)
        post = m.posterior(x)
        (post.mean.sum() + post.variance.sum()).backward()
        with torch.no_grad():
            joint = m.posterior(Xq).distribution.covariance_matrix
        outs.append((post.mean.detach(), post.variance.detach(), x.grad, joint))
        factorisations.append(len([s for s in cholesky_shapes if s[-1] >= n]))
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for a, b in zip(outs[1], outs[0]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert model.posterior_iterations == 0  # no PCG
    assert 1 <= factorisations[1] <= factorisations[0], factorisations  # GPyTorch's caches, as in SingleTaskGP
    pcg_model = pair(X, Y, posterior_cholesky_size=n - 1)[1]
    with torch.no_grad():
        pcg_model.posterior(Xt)
    assert pcg_model.posterior_iterations > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_posterior_path_follows_the_memory_budget(dtype):
    """``posterior_cholesky_size=None`` (the default): BoTorch's exact path where Cholesky's working set fits the
    dense memory budget, PCG where one byte more is needed; either matches SingleTaskGP's posterior, and the choice
    stays with the model's size, device and dtype when the budget moves."""
    n, d = 250, 4
    X, Y = data(n, d, dtype=dtype, seed=8)
    need = POSTERIOR_MATRICES * n * n * torch.empty((), dtype=dtype).element_size()
    Xt = points_at(40, d, dtype=dtype)
    tol = (1e-6, 1e-6) if dtype == torch.float64 else (1e-3, 1e-2)
    for budget, exact in ((need, True), (need - 1, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # BoTorch's InputDataWarning about float32
            ref, model = pair(X, Y, noise=1e-2, posterior_cholesky_size=None)
        with gpnys.memory_budget(dense_bytes=budget), torch.no_grad():
            p_ref, p = ref.posterior(Xt), model.posterior(Xt)
        assert model.posterior_exact() is exact, model.posterior_path_reason  # decided once, outside the budget too
        assert (model.posterior_iterations == 0) is exact
        assert ("within the memory budget" in model.posterior_path_reason) is exact, model.posterior_path_reason
        assert_rel(p.mean, p_ref.mean, tol[0], f"mean (exact={exact})")
        assert_rel(p.variance, p_ref.variance, tol[1], f"variance (exact={exact})")


def test_cholesky_fits_against_the_budget():
    cpu = torch.device("cpu")
    need = DENSE_MATRICES * 2 * 100 * 100 * 4  # two float32 marginals of 100 points
    with gpnys.memory_budget(dense_bytes=need):
        assert cholesky_fits(100, 2, cpu, torch.float32)[0]
        assert not cholesky_fits(101, 2, cpu, torch.float32)[0]
        assert not cholesky_fits(100, 2, cpu, torch.float64)[0]
        fits, reason = cholesky_fits(100, 3, cpu, torch.float32)
        assert not fits and "above the memory budget" in reason
        assert cholesky_fits(100, 3, cpu, torch.float32, POSTERIOR_MATRICES)[0]  # a posterior holds fewer


@pytest.mark.parametrize("kernel", ["rbf", "matern32"])
def test_cholesky_working_set_holds_gpytorchs_peak(kernel):
    """:data:`DENSE_MATRICES` covers what GPyTorch's Cholesky value + gradient holds at its peak (a fresh process's
    resident high-water mark, reset before the evaluation, less what it held then), isotropic and ARD."""
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the resident high-water mark")
    code = f"""
import torch, gpytorch
from gpnys.gp.training import ExactGPModel

def resident(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field))
    return int(line.split()[1]) * 1024

n = 3000
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
X, y = torch.rand(n, 5, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="{kernel}", ard=True).double()
mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from the current set
before = resident("VmRSS:")
with gpytorch.settings.max_cholesky_size(10**9):
    (-mll(model(X), y)).backward()
print((resident("VmHWM:") - before) / (n * n * 8))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    matrices = float(out.stdout.strip().splitlines()[-1])
    assert 6 < matrices <= DENSE_MATRICES, out.stdout


# -- 2. no n x n Cholesky on the preconditioned path -------------------------------------------------------
@pytest.mark.parametrize("precond, n", [("afn", 200), ("auto", 600)])  # "auto" estimates the rank on 500 points
def test_no_n_by_n_cholesky_on_preconditioned_path(cholesky_shapes, precond, n):
    d = 4
    X, Y = data(n, d, seed=3)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, precond=precond, **PRECOND)
    fit(model, maxiter=3)
    with torch.no_grad():
        _ = model.posterior(points_at(20, d)).variance
        model.posterior(points_at(3, d, batch=(2,))).rsample(torch.Size([4]))
    assert model._gpnys_hook.builds >= 1 and model.posterior_iterations > 0
    assert cholesky_shapes, "the patch saw no Cholesky at all (the preconditioner's k x k factor is expected)"
    big = [s for s in cholesky_shapes if s[-1] >= n]
    assert not big, f"{len(big)} Cholesky factorisations of size >= n = {n}: {sorted(set(big))}"


def test_cholesky_patch_sees_single_task_gp(cholesky_shapes):
    """The same patch records BoTorch's ``n x n`` Cholesky in ``SingleTaskGP``: the check above can fail."""
    n, d = 200, 4
    X, Y = data(n, d, seed=3)
    ref = SingleTaskGP(X, Y)
    fit(ref, maxiter=2)
    assert (n, n) in [s[-2:] for s in cholesky_shapes]
    cholesky_shapes.clear()
    with torch.no_grad():
        _ = ref.posterior(points_at(20, d)).variance
    assert (n, n) in [s[-2:] for s in cholesky_shapes]


# -- 3. at most max_cholesky_size points: exactly SingleTaskGP ------------------------------------------------
@pytest.mark.parametrize("max_cholesky_size", [None, 10_000])  # None: GPyTorch's setting, 4096 under BoTorch
def test_below_threshold_is_single_task_gp(max_cholesky_size):
    n, d = 120, 3
    X, Y = data(n, d, seed=4)
    ref, model = pair(X, Y, max_cholesky_size=max_cholesky_size)
    assert not model.uses_preconditioner()
    Xt = points_at(50, d)
    Xq = points_at(3, d, batch=(2,))
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
        torch.testing.assert_close(p.mean, p_ref.mean, rtol=1e-12, atol=0)
        torch.testing.assert_close(p.variance, p_ref.variance, rtol=1e-12, atol=0)
        torch.testing.assert_close(model.posterior(Xq).distribution.covariance_matrix,
                                   ref.posterior(Xq).distribution.covariance_matrix, rtol=1e-12, atol=1e-15)
    fit(ref, maxiter=5)
    fit(model, maxiter=5)
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
    with torch.no_grad():
        model.posterior(Xt)
    assert model._gpnys_hook is None and model.posterior_iterations == 0  # no hook was ever built


# -- 4. fit_gpytorch_mll ---------------------------------------------------------------------------------------
def test_fit_matches_single_task_gp():
    n, d = 250, 3
    X, Y = data(n, d, seed=5, noise_std=0.05)
    ref = SingleTaskGP(X, Y)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, k=100, w=15)
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name  # the same default initialisation
    fit(ref)
    fit(model)
    assert model._gpnys_hook.builds > 1  # rebuilt as the hyperparameters moved
    assert model._gpnys_hook.applications > 0
    assert_rel(lengthscale(model), lengthscale(ref), 0.02, "fitted lengthscales")
    assert_rel(model.likelihood.noise.detach(), ref.likelihood.noise.detach(), 0.02, "fitted noise")

    # the preconditioned MLL value (CG + SLQ) against the exact one at the same hyperparameters
    ref.load_state_dict(model.state_dict())
    exact = exact_mll(ref)
    model.train()
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    with model.preconditioned() as hook, torch.no_grad():
        applications = hook.applications
        value = float(mll(model(*model.train_inputs), model.train_targets))
        assert hook.applications > applications  # the value came from preconditioned CG
    assert abs(value - exact) <= 1e-3 * abs(exact), (value, exact)


def test_fit_keeps_converged_attempt_and_ignores_global_rng():
    """With an inexact preconditioner (k = 50 of n = 250, d = 6) the estimated MLL is deterministic (fixed probe
    seed) but its gradient is not exactly its derivative, so L-BFGS-B can end near the optimum with an
    ABNORMAL line-search termination. The fit must keep that near-optimal result: its exact MLL close to the
    exact fit's, and the same hyperparameters whatever the global RNG state."""
    n, d = 250, 6
    X, Y = data(n, d, seed=5, f=hartmann6)
    ref = fit(SingleTaskGP(X, Y))
    best = exact_mll(ref)
    fitted, values = [], []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        model = fit(PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, k=50, w=10))
        fitted.append({k: v.detach().clone() for k, v in model.named_parameters()})
        ref2 = SingleTaskGP(X, Y)
        ref2.load_state_dict(model.state_dict())
        values.append(exact_mll(ref2))
    assert all(v >= best - 2e-3 * abs(best) for v in values), (values, best)
    for name, p in fitted[0].items():
        assert torch.equal(p, fitted[1][name]), (name, p, fitted[1][name])


def test_default_posterior_tolerance_and_separate_posterior_preconditioner():
    """The default tolerance (1e-6) meets a 1e-3 accuracy goal with room to spare; the posterior solves use
    their own (stronger) preconditioner, built once, beside the training one."""
    n, d = 250, 4
    X, Y = data(n, d)
    ref, model = pair(X, Y, posterior_tolerance=1e-6, posterior_options={"k": 80, "w": 20})
    Xt = points_at(100, d)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean")
    assert_rel(p.variance, p_ref.variance, 1e-4, "variance at the default tolerance")
    hook = model.hook()
    assert [r.rank for r in hook.history] == [80]  # only the posterior preconditioner, with its own k
    with model.preconditioned(), torch.no_grad():  # as in fit_gpytorch_mll: the hook in use outlives train() / eval()
        model.train()
        ExactMarginalLogLikelihood(model.likelihood, model)(model(*model.train_inputs), model.train_targets)
        model.eval()
    assert model.hook() is hook
    assert [r.rank for r in hook.history] == [80, PRECOND["k"]]  # training used the training options
    with torch.no_grad():
        model.posterior(Xt)
    assert hook.builds == 2  # the posterior preconditioner was cached


def test_default_landmarks_capped_per_use():
    """The ``afn`` / ``auto`` landmark defaults (train k = 1500, posterior k = 3500) are capped at n/2 for training
    and 0.7 n for the posterior preconditioner; the caller's options win over both."""
    X, Y = data(200, 3)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0)
    assert model._options("train", 200) == {"k": 100, "w": 30}
    assert model._options("posterior", 200) == {"k": 140, "w": 90}
    assert model._options("posterior", 10_000) == {"k": 3500, "w": 90}
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, k=60, posterior_options={"w": 12})
    assert model._options("train", 200) == {"k": 60, "w": 30}
    assert model._options("posterior", 200) == {"k": 60, "w": 12}
    assert PreconditionedSingleTaskGP(X, Y, precond="fsai")._options("posterior", 200) == {}


def test_fit_subset_start():
    """``fit_subset``: Cholesky fit on a seeded subset, then the preconditioned full-data fit from there; the
    result is a full-data optimum (exact MLL as good as SingleTaskGP's fit) and reproducible."""
    n, d = 300, 3
    X, Y = data(n, d, seed=5, noise_std=0.05)
    best = exact_mll(fit(SingleTaskGP(X, Y)))
    fitted = []
    for _ in range(2):
        model = fit(PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, k=100, w=15, fit_subset=100))
        ref = SingleTaskGP(X, Y)
        ref.load_state_dict(model.state_dict())
        assert exact_mll(ref) >= best - 1e-3 * abs(best), (exact_mll(ref), best)
        fitted.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(fitted[0], fitted[1])
    assert model.train_inputs[0].shape[0] == n  # the subset stage worked on a copy


def test_fit_stops_at_the_noise_level():
    """On the preconditioned path L-BFGS-B ends once the gradient is within its noise (a chi-square test at 5 %) (a clean
    stop, no retries), at a full-data optimum; a user's callback still runs."""
    n, d = 300, 3
    X, Y = data(n, d, seed=5, noise_std=0.05)
    best = exact_mll(fit(SingleTaskGP(X, Y)))
    steps = []
    model = fit(PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, k=100, w=15),
                optimizer_kwargs={"callback": lambda params, result: steps.append(result.step)})
    assert model.fit_stopped == "gradient at noise level" and steps
    ref = SingleTaskGP(X, Y)
    ref.load_state_dict(model.state_dict())
    assert exact_mll(ref) >= best - 1e-3 * abs(best), (exact_mll(ref), best)


# -- 5. acquisition ------------------------------------------------------------------------------------------
def test_acquisition_optimisation():
    n, d = 200, 4
    X, Y = data(n, d, seed=6)
    _, model = pair(X, Y)
    bounds = torch.stack([torch.zeros(d), torch.ones(d)]).to(X)

    torch.manual_seed(0)
    acqf = qLogExpectedImprovement(model, best_f=Y.max())
    cand, value = optimize_acqf(acqf, bounds=bounds, q=1, num_restarts=2, raw_samples=16)
    assert cand.shape == (1, d)
    assert bool(((cand >= 0) & (cand <= 1)).all()) and bool(torch.isfinite(value).all())
    assert model.posterior_iterations > 0 and model.hook().builds >= 1

    acqf = qUpperConfidenceBound(model, beta=0.2)
    cand, value = optimize_acqf(acqf, bounds=bounds, q=3, num_restarts=2, raw_samples=16)
    assert cand.shape == (3, d)
    assert bool(((cand >= 0) & (cand <= 1)).all()) and bool(torch.isfinite(value).all())

    with torch.no_grad():
        samples = model.posterior(points_at(3, d, batch=(4,))).rsample(torch.Size([8]))
    assert samples.shape == (8, 4, 3, 1) and bool(torch.isfinite(samples).all())


# -- 6. input and outcome transforms -------------------------------------------------------------------------
def box_transforms(d):
    return lambda: {"input_transform": Normalize(d=d), "outcome_transform": Standardize(m=1)}


def test_input_and_outcome_transforms():
    n, d = 200, 3
    X01, Y = data(n, d, seed=7)
    X, Y = X01 * 10 + 5, 3.0 * Y + 7.0
    ref, model = pair(X, Y, transforms=box_transforms(d))
    Xt = points_at(60, d) * 10 + 5
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert model.posterior_iterations > 0
    assert float(model.hook().train_x.max()) <= 1.0 + 1e-12  # the hook sees the normalised inputs
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance")


def test_fit_with_transforms():
    n, d = 200, 3
    X01, Y = data(n, d, seed=7)
    X, Y = X01 * 10 + 5, 3.0 * Y + 7.0
    model = PreconditionedSingleTaskGP(X, Y, **box_transforms(d)(), max_cholesky_size=0, **PRECOND)
    fit(model, maxiter=10)
    hook = model._gpnys_hook
    assert hook is not None and hook.builds >= 1 and hook.applications > 0
    assert float(hook.train_x.min()) >= -1e-12 and float(hook.train_x.max()) <= 1.0 + 1e-12
    with torch.no_grad():
        post = model.posterior(points_at(20, d) * 10 + 5)
    assert bool(torch.isfinite(post.mean).all()) and bool((post.variance > 0).all())


# -- 7. conditioning (fantasy models: test_bo_fantasy.py) -------------------------------------------------------
@pytest.mark.parametrize("transformed", [False, True], ids=["plain", "transforms"])
def test_condition_on_observations(transformed):
    n, d = 200, 3
    X, Y = data(n, d, seed=8)
    Xn, Yn = data(5, d, seed=9)
    Xt = points_at(40, d)
    if transformed:
        X, Xn, Xt, Y, Yn = X * 10 + 5, Xn * 10 + 5, Xt * 10 + 5, 3 * Y + 7, 3 * Yn + 7
    ref, model = pair(X, Y, transforms=box_transforms(d) if transformed else None)
    with torch.no_grad():
        before = model.posterior(Xt)
        mean0, var0 = before.mean.clone(), before.variance.clone()
        ref.posterior(Xt)  # GPyTorch needs its prediction caches before conditioning
        ref_c = ref.condition_on_observations(Xn, Yn)
        new = model.condition_on_observations(Xn, Yn)
    assert type(new) is PreconditionedSingleTaskGP and new is not model
    assert new.train_inputs[0].shape == (n + 5, d) and new.train_targets.shape == (n + 5,)
    assert new.uses_preconditioner()
    with torch.no_grad():
        p_ref, p = ref_c.posterior(Xt), new.posterior(Xt)
    assert new.posterior_iterations > 0
    assert_rel(p.mean, p_ref.mean, 1e-6, "conditioned mean")
    assert_rel(p.variance, p_ref.variance, 1e-6, "conditioned variance")
    # the original model is unchanged
    assert model.train_inputs[0].shape == (n, d) and model.train_targets.shape == (n,)
    with torch.no_grad():
        after = model.posterior(Xt)
    torch.testing.assert_close(after.mean, mean0, rtol=1e-12, atol=0)
    torch.testing.assert_close(after.variance, var0, rtol=1e-12, atol=0)


# -- 8. bad input --------------------------------------------------------------------------------------------
def _outcome(fn):
    """``("raise", exception type)`` or ``("ok", sorted warning categories)`` of calling ``fn``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return "raise", type(exc)
    return "ok", sorted({w.category.__name__ for w in caught})


def _bad_cases():
    X, Y = data(50, 3, seed=12)
    Y_nan = Y.clone()
    Y_nan[3, 0] = float("nan")
    return {"nan": (X, Y_nan), "n-mismatch": (X, Y[:-1]), "ndim-mismatch": (X[0], Y)}


@pytest.mark.parametrize("case", ["nan", "n-mismatch", "ndim-mismatch"])
def test_bad_data_behaves_like_single_task_gp(case):
    Xb, Yb = _bad_cases()[case]
    ours = {"max_cholesky_size": 0, "k": 10, "w": 5}
    expected = _outcome(lambda: SingleTaskGP(Xb, Yb))
    if expected[0] == "raise":
        with pytest.raises(expected[1]):
            PreconditionedSingleTaskGP(Xb, Yb, **ours)
        return
    # SingleTaskGP accepts it (same warnings here); the error comes at first use, and must be the same type
    assert _outcome(lambda: PreconditionedSingleTaskGP(Xb, Yb, **ours)) == expected
    Xt = points_at(4, Xb.shape[-1])
    for use in (lambda m: m.posterior(Xt).mean, lambda m: fit(m, maxiter=2)):
        expected = _outcome(lambda use=use: use(SingleTaskGP(Xb, Yb)))
        assert expected[0] == "raise", case
        # the same error type, or (on the preconditioned path, which validates first) a ValueError naming the data
        with pytest.raises((expected[1], ValueError)) as info:
            use(PreconditionedSingleTaskGP(Xb, Yb, **ours))
        if info.type is ValueError and expected[1] is not ValueError:
            assert "train_" in str(info.value)


@pytest.mark.parametrize("kwargs, name", [
    ({"precond": "bogus"}, "precond"),
    ({"precond": "none"}, "precond"),
    ({"posterior_tolerance": 0}, "posterior_tolerance"),
    ({"posterior_tolerance": float("nan")}, "posterior_tolerance"),
    ({"posterior_variance_rtol": 0}, "posterior_variance_rtol"),
    ({"posterior_variance_rtol": float("inf")}, "posterior_variance_rtol"),
    ({"max_cholesky_size": -1}, "max_cholesky_size"),
    ({"max_cholesky_size": 2.5}, "max_cholesky_size"),
    ({"max_cholesky_size": "100"}, "max_cholesky_size"),
    ({"fit_subset": 0}, "fit_subset"),
    ({"fit_subset": 2.5}, "fit_subset"),
    ({"posterior_cholesky_size": -1}, "posterior_cholesky_size"),
    ({"posterior_cholesky_size": 1.5}, "posterior_cholesky_size"),
    ({"posterior_cholesky_size": True}, "posterior_cholesky_size"),
])
def test_bad_arguments(kwargs, name):
    X, Y = data(20, 2)
    with pytest.raises(ValueError, match=name):
        PreconditionedSingleTaskGP(X, Y, **kwargs)


# -- 9. float32 ----------------------------------------------------------------------------------------------
def _float32_pair(n=200, d=3):
    X, Y = data(n, d, dtype=torch.float32, seed=13)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BoTorch's InputDataWarning about float32
        return pair(X, Y, noise=1e-2)


def test_float32_posterior():
    ref, model = _float32_pair()
    Xt = points_at(60, 3, dtype=torch.float32)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert p.mean.dtype == p.variance.dtype == torch.float32
    assert model.posterior_iterations > 0
    assert_rel(p.mean, p_ref.mean, 1e-3, "float32 mean")
    assert_rel(p.variance, p_ref.variance, 1e-2, "float32 variance")


def test_posterior_after_a_dtype_change():
    """A float32 posterior, then ``model.double()`` (inputs whose values are exact in float64, so equal by value):
    the hook and its float32 preconditioner are rebuilt, and the posterior is SingleTaskGP's in float64."""
    ref, model = _float32_pair()
    Xt = points_at(30, 3, dtype=torch.float32)
    with torch.no_grad():
        model.posterior(Xt)
    ref, model = ref.double(), model.double()
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt.double()), model.posterior(Xt.double())
    assert model.hook().train_x.dtype == p.mean.dtype == torch.float64
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean after double()")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance after double()")


def _variance_and_gradient(model, Xt):
    """The posterior variances at ``Xt (t, 1, d)`` (flattened) and their gradient w.r.t. ``Xt``, in float64."""
    x = Xt.clone().requires_grad_(True)
    variance = model.posterior(x).variance
    (grad,) = torch.autograd.grad(variance.sum(), x)
    return variance.detach().double().reshape(-1), grad.double()


def _accuracy_warnings(caught):
    return [w for w in caught if "posterior_variance_rtol" in str(w.message)]


@pytest.mark.parametrize("known", [False, True], ids=["learnt-noise-1e-4", "known-noise-1e-6"])
def test_default_variances_and_gradients_at_the_noise_floor(known):
    """At BoTorch's noise floor (1e-4, or known noise 1e-6) and the default posterior settings, the PCG variances are
    within 1e-4 of ``SingleTaskGP``'s (float64 Cholesky) at every point and their gradients w.r.t. the points within
    1e-4 of the largest component; ``posterior_variance_error`` bounds the variances' error. At the tolerance alone
    (1e-6) they were 1.7e-2 / 2.9e-3 off (noise 1e-4) and 0.75 / 0.15 (known noise 1e-6)."""
    n, d = 400, 3
    X, Y = data(n, d, noise_std=0.0)
    noise = 1e-6 if known else 1e-4
    Yvar = torch.full_like(Y, noise) if known else None
    ref = set_hypers(SingleTaskGP(X, Y, Yvar, outcome_transform=None), noise)
    if known:  # (set_hypers gave it one noise variance)
        ref.likelihood.noise = Yvar.squeeze(-1)
    model = PreconditionedSingleTaskGP(X, Y, Yvar, outcome_transform=None, max_cholesky_size=0,
                                       posterior_cholesky_size=0)
    model.load_state_dict(ref.state_dict())
    ref.eval(), model.eval()
    Xt = points_at(100, d, batch=(), seed=4).unsqueeze(-2)  # 100 points, q = 1, as optimize_acqf evaluates them
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v, g = _variance_and_gradient(model, Xt)
    v_ref, g_ref = _variance_and_gradient(ref, Xt)
    assert model.posterior_iterations > 0
    err = (v - v_ref).abs() / v_ref
    assert float(err.max()) <= 1e-4, f"variance: max relative error {float(err.max()):.3g}"
    g_err = float((g - g_ref).abs().max() / g_ref.abs().max())
    assert g_err <= 1e-4, f"d(variance)/dX: error {g_err:.3g} of the largest component"
    assert float(err.max()) <= model.posterior_variance_error <= 1e-4  # the bound holds, and meets its target
    assert model.posterior_gradient_error <= 1e-4
    assert not _accuracy_warnings(caught)


@pytest.mark.parametrize("outputs", [1, 2])
def test_float32_variance_gradients_and_one_accuracy_warning(outputs):
    """float32 at noise 1e-2: the PCG variance gradients are as accurate as float32 ``SingleTaskGP``'s (within 3e-4 of
    the largest component of the float64 ones; 4.8e-3 when the solves stopped at 1000 eps), the variances within
    ``posterior_variance_error``, and the 1e-4 target, which float32's rounding does not allow, is missed with one
    ``NumericalWarning`` per model, naming float64, not one per call (nor per output)."""
    n, d = 400, 3
    X, Y = data(n, d, noise_std=0.0)
    Y = torch.cat([Y, torch.cos(3 * X[:, :1])], -1)[:, :outputs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BoTorch's InputDataWarning about float32
        ref = set_hypers(SingleTaskGP(X, Y, outcome_transform=None), 1e-2)
        model = PreconditionedSingleTaskGP(X.float(), Y.float(), outcome_transform=None, max_cholesky_size=0,
                                           posterior_cholesky_size=0)
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    ref.eval(), model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (4, 5):  # two acquisition calls
            Xt = points_at(100, d, seed=seed).unsqueeze(-2)
            v, g = _variance_and_gradient(model, Xt.float())
    v_ref, g_ref = _variance_and_gradient(ref, Xt)
    g_err = float((g - g_ref).abs().max() / g_ref.abs().max())
    assert g_err <= 3e-4, f"float32 d(variance)/dX: error {g_err:.3g} of the largest component"
    err = float(((v - v_ref).abs() / v_ref).max())
    assert 1e-4 < err <= model.posterior_variance_error, (err, model.posterior_variance_error)
    ours = _accuracy_warnings(caught)
    assert len(ours) == 1 and issubclass(ours[0].category, gpnys.NumericalWarning), [str(w.message) for w in ours]
    assert "float64" in str(ours[0].message)


# -- 10. reproducibility -------------------------------------------------------------------------------------
def test_fit_is_reproducible():
    n, d = 150, 3
    X, Y = data(n, d, seed=14)
    fitted = []
    for _ in range(2):
        torch.manual_seed(0)
        model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, seed=3, **PRECOND)
        fit(model, maxiter=15)
        assert model._gpnys_hook.builds > 1
        fitted.append(dict(model.named_parameters()))
    for name, p in fitted[0].items():
        assert torch.equal(p, fitted[1][name]), name


# -- 11. the hook under BoTorch's global settings ------------------------------------------------------------
def test_hook_builds_under_botorch_settings():
    n, d = 200, 3
    X, Y = data(n, d, seed=15)
    y = Y.squeeze(-1)

    class GP(gpytorch.models.ExactGP):
        def __init__(self, x, y, likelihood):
            super().__init__(x, y, likelihood)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(torch.float64)
    gp = GP(X, y, likelihood).to(torch.float64)
    gp.covar_module.base_kernel.lengthscale = 0.4
    likelihood.noise = 1e-2
    gp.train()
    mll = ExactMarginalLogLikelihood(likelihood, gp)
    assert not gpytorch.settings.fast_computations.log_prob.on()  # BoTorch's global setting
    with (gpytorch.settings.fast_computations(log_prob=False, solves=False),
          gpnys.use_preconditioner(gp, "afn", k=30, w=10) as hook):
        loss = -mll(gp(X), y)
        loss.backward()
    assert hook.builds >= 1 and hook.applications >= 1
    assert math.isfinite(float(loss.detach()))
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in gp.parameters())
    # the hook left the likelihood and the global settings as they were
    assert "marginal" not in vars(likelihood)
    assert not gpytorch.settings.fast_computations.log_prob.on()
    # and the estimate is close to the exact (Cholesky) value
    with torch.no_grad():
        exact = -mll(gp(X), y)
    assert abs(float(loss) - float(exact)) <= 1e-2 * abs(float(exact)), (float(loss), float(exact))


# -- the example and the benchmark (their --quick modes) ---------------------------------------------------
@pytest.fixture(scope="module")
def bo_loop_checkpoint(tmp_path_factory):
    """The example's quick loop cut after one iteration (both methods): its checkpoint directory and records."""
    tmp = tmp_path_factory.mktemp("bo_loop")
    out = load_script("examples", "bo_large_n").main(["--quick", "--iters", "1", "--checkpoint", str(tmp / "ckpt"),
                                                       "--json", str(tmp / "first.json")])
    return tmp / "ckpt", {r["method"]: r["records"] for r in out["runs"]}


def test_bo_large_n_example_quick_and_resumes_from_its_checkpoint(tmp_path, bo_loop_checkpoint):
    """The quick loop runs both methods (JSON and PNG written); a campaign resumed from the one-iteration checkpoint
    continues exactly as the uninterrupted one."""
    import shutil

    main = load_script("examples", "bo_large_n").main
    out = main(["--quick", "--iters", "2", "--json", str(tmp_path / "bo.json")])
    assert (tmp_path / "bo.json").exists() and (tmp_path / "bo.png").exists()
    full = {r["method"]: r for r in out["runs"]}
    assert set(full) == {"gpnys", "singletask"}
    for r in full.values():
        assert len(r["records"]) == 2 and r["best"] >= r["initial_best"]
    assert all(rec["builds"] >= 1 for rec in full["gpnys"]["records"])  # the preconditioned path ran

    ckpt, first = bo_loop_checkpoint
    shutil.copytree(ckpt, tmp_path / "ckpt")  # the fixture's checkpoint stays at one iteration for other tests
    resumed = main(["--quick", "--methods", "gpnys", "--iters", "2", "--checkpoint", str(tmp_path / "ckpt"),
                    "--json", str(tmp_path / "resumed.json")])["runs"][0]["records"]
    assert len(first["gpnys"]) == 1 and len(resumed) == 2
    assert resumed[0] == first["gpnys"][0]  # the saved record, times included, not a rerun
    # the same data, hyperparameters and RNG state: the resumed campaign continues exactly as the uninterrupted one
    for a, b in zip(resumed, full["gpnys"]["records"]):
        assert (a["n"], a["best"]) == (b["n"], b["best"])
        assert abs(a["noise"] - b["noise"]) <= 1e-9 * b["noise"]
    # the two-iteration checkpoint read with --iters 1: its first iteration, not a rerun (campaigns compared alike)
    cut = main(["--quick", "--methods", "gpnys", "--iters", "1", "--checkpoint", str(tmp_path / "ckpt"),
                "--json", str(tmp_path / "cut.json")])["runs"][0]
    assert cut["records"] == resumed[:1] and cut["wall_s"] == resumed[0]["wall_s"] and cut["best"] == resumed[0]["best"]


@pytest.mark.parametrize("outputs", [1, 2])
def test_bo_compare_quick(tmp_path, outputs):
    res = load_script("benchmarks", "bo_compare").main(["--quick", "--outputs", str(outputs),
                                                        "--out", str(tmp_path / "bo.json")])
    assert (tmp_path / "bo.png").exists()
    assert res["methods"]["gpnys"]["builds"] >= 1 and res["methods"]["gpnys"]["path"] == "preconditioned"
    assert len(res["methods"]["gpnys"]["noise"] if outputs > 1 else [0]) == outputs
    chk = res["posterior_check"]
    assert chk["mean_rel_err_max"] < 1e-6 and chk["var_rel_err_max"] < 1e-4


def test_bo_compare_warm_iteration_from_checkpoints(tmp_path, bo_loop_checkpoint):
    """--warm-from: one iteration per model from the loop's checkpoints, each model from its own last state."""
    ckpt = str(bo_loop_checkpoint[0])
    res = load_script("benchmarks", "bo_compare").main(["--quick", "--n", "120", "--warm-from", ckpt, "--seeds", "0",
                                                        "--out", str(tmp_path / "warm.json")])
    per = res["seeds"]["0"]
    for name in ("singletask", "gpnys"):
        saved = torch.load(Path(ckpt) / f"{name}_n120_q1_seed0.pt", weights_only=False)
        assert per[name]["n"] == saved["X"].shape[0] == 121 and per[name]["start_iteration"] == 1
        assert per[name]["total_s"] >= per[name]["fit_s"] > 0
    assert per["gpnys"]["builds"] >= 1  # the preconditioned fit ran (quick: max_cholesky_size 0)
    assert res["time_ratio_mean_iteration"] == pytest.approx(per["time_ratio"])
    assert (tmp_path / "warm.json").exists()


def test_bo_gradient_quick(tmp_path):
    res = load_script("benchmarks", "bo_gradient").main(["--quick", "--out", str(tmp_path / "g.json")])
    rows = res["rows"]
    assert len(rows) == 2 * 2 * 2  # noises x control variates x probe seeds
    for r in rows:
        assert r["trace_inv"] > 0 and r["alpha_sq"] > 0
        assert r["loss_rel_err"] < 1e-2, r["loss_rel_err"]  # n = 300, k = 150 landmarks: a good preconditioner
        assert max(r["grad_err"]) < 0.25, r["grad_err"]
    # common random numbers: the diag and frozen families share the probes, so their losses agree (to rounding:
    # the threaded BLAS may sum in another order)
    by = {(r["noise"], r["seed"], r["control_variate"]): r["loss"] for r in rows}
    assert all(abs(by[(nz, s, "diag")] - by[(nz, s, "frozen")]) <= 1e-12 for nz, s, _ in by)


@pytest.mark.parametrize("n", [3, 10, 25])
def test_default_preconditioner_options_at_tiny_n(n):
    """The BO defaults (k = 1500 / 3500, w = 30 / 90) are capped at the data: n <= 30 on the preconditioned path
    trains and predicts (BoTorch's own SingleTaskGP tests use n = 10), and equals SingleTaskGP."""
    g = torch.Generator().manual_seed(n)
    X = torch.rand(n, 2, generator=g, dtype=torch.float64)
    Y = torch.sin(6 * X).sum(-1, keepdim=True)
    ref = set_hypers(SingleTaskGP(X, Y), noise=1e-2)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0)
    model.load_state_dict(ref.state_dict())
    Xt = torch.rand(7, 2, generator=g, dtype=torch.float64)
    with torch.no_grad():
        post, post_ref = model.posterior(Xt), ref.posterior(Xt)
        assert_rel(post.mean, post_ref.mean, 1e-6, "mean")
        assert_rel(post.variance, post_ref.variance, 1e-4, "variance")
    fit(model, maxiter=3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_unsupported_cases_above_the_threshold_say_so():
    """Batched inputs ``(b, n, d)`` above max_cholesky_size: SingleTaskGP's Cholesky, with a warning, not silently;
    the answer is SingleTaskGP's. (Multi-output models are preconditioned: tests/bo/test_bo_multi_output.py.)"""
    from gpnys.checks import NumericalWarning

    X, Y = data(40, 2, seed=3)
    Xb, Yb = torch.stack([X, X + 0.1]), torch.stack([Y, 2 * Y])
    model = PreconditionedSingleTaskGP(Xb, Yb, max_cholesky_size=10)
    ref = SingleTaskGP(Xb, Yb)
    model.load_state_dict(ref.state_dict())
    Xt = points_at(5, 2)
    with pytest.warns(NumericalWarning, match="Cholesky"), torch.no_grad():
        mean = model.posterior(Xt).mean
    with torch.no_grad():
        torch.testing.assert_close(mean, ref.posterior(Xt).mean)


def known_noise(n, seed=4):
    """Heteroscedastic known variances in [1e-3, 5e-2], ``(n, 1)``."""
    g = torch.Generator().manual_seed(seed)
    return 1e-3 + 4.9e-2 * torch.rand(n, 1, generator=g, dtype=torch.float64)


def test_known_noise_takes_the_preconditioned_path():
    """train_Yvar (FixedNoiseGaussianLikelihood) above the threshold: K + D by CG/SLQ and PCG, no Cholesky; the
    posterior is SingleTaskGP's at the same hyperparameters and the MLL value is the exact one."""
    n, d = 250, 3
    X, Y = data(n, d, seed=6, noise_std=0.1)
    Yvar = known_noise(n)
    ref = SingleTaskGP(X, Y, train_Yvar=Yvar)
    ref.covar_module.lengthscale = torch.tensor([[0.3, 0.5, 0.7]], dtype=X.dtype)
    # 64 probes: with 16 the estimate's own spread over probe seeds is ~1 % here, with known or learnt noise alike
    model = PreconditionedSingleTaskGP(X, Y, train_Yvar=Yvar, max_cholesky_size=0, posterior_tolerance=1e-8,
                                       settings=gpnys.EstimatorSettings(num_probes=64, probe_seed=0), **PRECOND)
    model.load_state_dict(ref.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpnys.checks.NumericalWarning)  # no "falls back to Cholesky"
        assert model.uses_preconditioner()
        Xt = points_at(60, d)
        with torch.no_grad():
            p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert model.posterior_iterations > 0
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance")
    exact = exact_mll(ref)
    model.train()
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    with model.preconditioned() as hook, torch.no_grad():
        value = float(mll(model(*model.train_inputs), model.train_targets))
        assert hook.applications > 0
        P, _ = hook.preconditioner()
        assert P.inner.diag is not None  # AFN built on K + D / s^2 (auto chose AFN at k = 40)
    assert abs(value - exact) <= 5e-3 * abs(exact), (value, exact)


def test_known_noise_change_reaches_the_posterior_mean():
    """Known noise set anew after a posterior (a plain tensor of the likelihood, neither parameter nor buffer): the
    cached ``α`` follows it, and mean and variance are those of a SingleTaskGP with the new noise."""
    n, d = 250, 3
    X, Y = data(n, d, seed=6, noise_std=0.1)
    model = PreconditionedSingleTaskGP(X, Y, train_Yvar=known_noise(n), max_cholesky_size=0, posterior_tolerance=1e-8,
                                       **PRECOND)
    model.covar_module.lengthscale = torch.tensor([[0.3, 0.5, 0.7]], dtype=X.dtype)
    Xt = points_at(30, d)
    with torch.no_grad():
        model.eval().posterior(Xt)
    model.likelihood.noise = known_noise(n, seed=9).squeeze(-1) * 10  # in the outcome-transformed scale
    ref = SingleTaskGP(X, Y, train_Yvar=known_noise(n))
    ref.load_state_dict(model.state_dict())
    ref.likelihood.noise = model.likelihood.noise
    with torch.no_grad():
        p_ref, p = ref.eval().posterior(Xt), model.posterior(Xt)
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean after new known noise")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance after new known noise")


def test_known_noise_fit_matches_single_task_gp():
    """fit_gpytorch_mll with train_Yvar on the preconditioned path (and from a Cholesky fit on a subset, whose known
    noise is the subset's) reaches SingleTaskGP's fit; the training data and noise stay whole."""
    n, d = 250, 3
    X, Y = data(n, d, seed=6, noise_std=0.1)
    Yvar = known_noise(n)
    ref = fit(SingleTaskGP(X, Y, train_Yvar=Yvar))
    for subset in (None, 100):
        model = fit(PreconditionedSingleTaskGP(X, Y, train_Yvar=Yvar, max_cholesky_size=0, k=100, w=15,
                                               fit_subset=subset))
        assert model._gpnys_hook.applications > 0
        assert_rel(lengthscale(model), lengthscale(ref), 0.05, f"fitted lengthscales (subset {subset})")
        # the whole known noise is kept (as SingleTaskGP stores it: standardised with the outcomes)
        torch.testing.assert_close(model.likelihood.noise, ref.likelihood.noise)


def test_a_used_model_deep_copies_and_pickles():
    """After a fit and a PCG posterior the model holds its hook, solves and sparse factors: ``copy.deepcopy``,
    ``pickle`` and ``torch.save`` leave them behind (they hold closures and CSR tensors) and the copy's posterior
    is the original's."""
    import io
    import pickle

    X, Y = data(150, 3)
    model = PreconditionedSingleTaskGP(X, Y, precond="afn", max_cholesky_size=0, posterior_cholesky_size=0,
                                       fit_subset=None)
    fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model), optimizer_kwargs={"options": {"maxiter": 3}})
    Xt = points_at(4, 3)
    with torch.no_grad():
        ref = model.posterior(Xt)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), torch.load(buffer, weights_only=False)]
    assert model._gpnys_hook is not None and model._gpnys_posterior is not None  # the original keeps its caches
    for other in copies:
        with torch.no_grad():
            post = other.posterior(Xt)
        torch.testing.assert_close(post.mean, ref.mean, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(post.variance, ref.variance, rtol=1e-4, atol=1e-8)


def test_given_settings_keep_the_fixed_probes():
    """``settings=EstimatorSettings(solver="iterative")`` (no ``probe_seed``) still trains on fixed probes seeded by
    ``seed``: the same fit whatever the global RNG, which it leaves untouched."""
    X, Y = data(300, 3)

    def fit(global_seed):
        torch.manual_seed(global_seed)
        model = PreconditionedSingleTaskGP(X, Y, fit_subset=None, settings=gpnys.EstimatorSettings(solver="iterative"))
        with gpytorch.settings.max_cholesky_size(100):
            fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model),
                             optimizer_kwargs={"options": {"maxiter": 5}})
        draw = torch.rand(1)
        torch.manual_seed(global_seed)
        return model.covar_module.lengthscale.detach(), bool(torch.equal(draw, torch.rand(1)))

    (a, untouched_a), (b, untouched_b) = fit(0), fit(1)
    assert torch.equal(a, b) and untouched_a and untouched_b


def test_torch_optimizer_runs_once_with_its_step_limit():
    """BoTorch's torch optimizer (``fit_gpytorch_mll_torch``) runs as set up: ``step_limit`` steps, no L-BFGS-B
    restarts on the preconditioned path (the restarts are L-BFGS-B's)."""
    from botorch.optim.fit import fit_gpytorch_mll_torch

    X, Y = data(200, 3)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, fit_subset=None)
    steps = []
    fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model), optimizer=fit_gpytorch_mll_torch,
                     optimizer_kwargs={"step_limit": 20, "callback": lambda params, result: steps.append(result.step)})
    assert len(steps) == 20 and model.fit_restarts == 0


@pytest.mark.parametrize("outputs", [1, 2])
def test_a_trial_point_without_a_loss_reads_as_an_infinite_loss(outputs):
    """A length-scale whose softplus underflowed to 0 (a long L-BFGS-B step on a kernel without a lower bound):
    under the hook alone a ``HyperparameterError`` (a ``ValueError``) naming it; in the fit's loss (BoTorch's
    ``get_loss_closure``, single-output and the m outputs' batched fit) an infinite loss with a zero gradient,
    from which the line search steps back, where the error ended the fit before. Outside the fit the mll is as
    BoTorch built it."""
    from botorch.optim.closures import get_loss_closure, get_loss_closure_with_grads
    from gpytorch.kernels import MaternKernel, ScaleKernel

    from gpnys.bo.model import _finite_loss
    from gpnys.checks import HyperparameterError

    X, Y = data(200, 3, seed=1)
    Y = Y if outputs == 1 else torch.cat([Y, Y.square()], -1)
    batch = torch.Size([outputs]) if outputs > 1 else torch.Size()
    kernel = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=3, batch_shape=batch), batch_shape=batch)
    model = PreconditionedSingleTaskGP(X, Y, covar_module=kernel, max_cholesky_size=0, fit_subset=None)
    mll = ExactMarginalLogLikelihood(model.likelihood, model)
    params = {name: p for name, p in mll.named_parameters() if p.requires_grad}
    with model.preconditioned(), _finite_loss(mll):
        loss, grads = get_loss_closure_with_grads(mll, params)()
        assert math.isfinite(float(loss)) and any(bool(g.abs().sum() > 0) for g in grads)
        with torch.no_grad():
            model.covar_module.base_kernel.raw_lengthscale[..., -1, 2] = -1e4  # softplus(-1e4) = 0.0
        per_output = get_loss_closure(mll)()
        assert per_output.shape == batch and bool((per_output == math.inf).all())
        loss, grads = get_loss_closure_with_grads(mll, params)()
        assert float(loss) == math.inf and all(bool((g == 0).all()) for g in grads)
    assert "compute_custom_loss" not in vars(mll)
    with model.preconditioned():
        mll.train()
        with pytest.raises(HyperparameterError, match="lengthscale"):
            mll(model(*model.train_inputs), model.train_targets)
    assert issubclass(HyperparameterError, ValueError)


def test_float32_posterior_at_the_noise_floor_takes_the_exact_path():
    """float32 at BoTorch's noise floor (1e-4): the PCG solves break down, and their answer would be wrong (a
    variance of 0.19 where the exact one is 6e-6); the posterior takes BoTorch's exact path instead, with one
    warning, and matches ``SingleTaskGP``'s float32 posterior."""
    X, Y = data(1000, 3, dtype=torch.float32, noise_std=0.0)
    model = PreconditionedSingleTaskGP(X, Y, input_transform=Normalize(d=3), outcome_transform=Standardize(m=1),
                                       max_cholesky_size=0, posterior_cholesky_size=0)
    with torch.no_grad():
        model.covar_module.lengthscale = torch.full_like(model.covar_module.lengthscale, 0.4)
        model.likelihood.noise = 1e-4
    ref = SingleTaskGP(X.double(), Y.double(), input_transform=Normalize(d=3), outcome_transform=Standardize(m=1))
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    model.eval(), ref.eval()
    Xt = points_at(20, 3, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        post = model.posterior(Xt)
    ours = [w for w in caught if "exact Cholesky path" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, gpnys.NumericalWarning)
    with torch.no_grad():
        exact = ref.posterior(Xt.double())
    torch.testing.assert_close(post.mean.double(), exact.mean, rtol=0, atol=1e-3)
    torch.testing.assert_close(post.variance.double(), exact.variance, rtol=0, atol=1e-4)


def test_float32_fantasies_at_the_noise_floor_take_the_exact_path():
    """The fantasy models' PCG solves fail as the posterior's do (float32, noise 1e-4): the base model takes
    BoTorch's exact path for them too (it stays there at these data and hyperparameters), and the fantasy
    posterior is finite with positive variances."""
    from botorch.sampling import SobolQMCNormalSampler

    X, Y = data(1000, 3, dtype=torch.float32, noise_std=0.0)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, posterior_cholesky_size=0)
    with torch.no_grad():
        model.covar_module.lengthscale = torch.full_like(model.covar_module.lengthscale, 0.4)
        model.likelihood.noise = 1e-4
    model.eval()
    Xq, Xt = points_at(2, 3, dtype=torch.float32, seed=3), points_at(5, 3, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        fantasy = model.fantasize(Xq, SobolQMCNormalSampler(torch.Size([2]), seed=0))
        post = fantasy.posterior(Xt)
    assert any("exact Cholesky path" in str(w.message) for w in caught)
    assert bool(torch.isfinite(post.mean).all()) and bool((post.variance > 0).all())
    assert model.posterior_exact() and "exact path" in model.posterior_path_reason


def test_fits_reach_single_task_gps_optimum_where_the_estimate_used_to_stall():
    """Two fits on the preconditioned path that ended far short of ``SingleTaskGP``'s optimum, without a warning:

    - a rank estimate that flipped between neighbouring values (73 and 74 for a noise change of 1e-8) moved the
      estimated loss by about its standard error at every trial point; each line search failed and the fit ended
      19 nats short. The rank is now held along the path (``gpnys.precond.strategy.held_rank``);
    - two outputs, a kernel without priors: BoTorch's batched L-BFGS-B stopped the first output after 7
      iterations (relative reduction below ``ftol``), 340 nats short; the m outputs' fit now restarts as the
      single output's does, while its runs gain more than the loss's standard error, with Newton's step on the
      constant mean between runs. It still ends 7 nats short (noise-free data at BoTorch's noise floor: the
      estimate's gradient noise meets the gradient along a flat valley) and says so in a warning."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(300, 3, dtype=torch.float64, generator=g) * 4
    Y = 10 * (X.sin().sum(-1, keepdim=True) + 0.05 * torch.randn(300, 1, dtype=torch.float64, generator=g)) + 3

    def transforms():
        return {"input_transform": Normalize(d=3), "outcome_transform": Standardize(m=1)}

    ours = fit(PreconditionedSingleTaskGP(X, Y, **transforms(), max_cholesky_size=100, fit_subset=None))
    ref = fit(SingleTaskGP(X, Y, **transforms()))
    both = [SingleTaskGP(X, Y, **transforms()) for _ in range(2)]
    for model, fitted in zip(both, (ours, ref)):
        model.load_state_dict(fitted.state_dict())
    gap = 300 * (exact_mll(both[1]) - exact_mll(both[0]))
    assert gap < 1.0, f"{gap:.2f} nats short of SingleTaskGP"

    from gpytorch.kernels import MaternKernel, ScaleKernel

    X = torch.rand(200, 3, dtype=torch.float64, generator=g)
    Y = torch.stack([torch.sin(6 * X[:, 0]), torch.randn(200, dtype=torch.float64, generator=g)], -1)
    batch = torch.Size([2])

    def kernel():
        return ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=3, batch_shape=batch), batch_shape=batch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = fit(PreconditionedSingleTaskGP(X, Y, covar_module=kernel(), max_cholesky_size=0, fit_subset=None))
    told = [w for w in caught if issubclass(w.category, gpnys.NumericalWarning) and "above its noise" in str(w.message)]
    assert (ours.fit_stopped == "gradient at noise level") != bool(told), (ours.fit_stopped, told)
    ref = fit(SingleTaskGP(X, Y, covar_module=kernel()))
    values = []
    for fitted in (ours, ref):
        model = SingleTaskGP(X, Y, covar_module=kernel())
        model.load_state_dict(fitted.state_dict())
        model.train()
        mll = ExactMarginalLogLikelihood(model.likelihood, model)
        with torch.no_grad():
            values.append(mll(model(*model.train_inputs), model.train_targets))
    gaps = 200 * (values[1] - values[0])
    assert bool((gaps < 12.0).all()), f"{gaps.tolist()} nats short of SingleTaskGP"


# -- edge cases a read-only review found ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_condition_on_observations_with_noise_on_a_learnt_noise_model(dtype):
    """``noise=`` for one set of new points of a one-output model whose noise is learnt: a fantasy model that holds
    the given noise in the mean and the covariance alike, as the batched call does (the reference: SingleTaskGP
    with known noise, the learnt one on the old points and the given one on the new). It had followed GPyTorch's
    fantasy update, whose means give the new points the learnt noise (2.2 against 3.0 at noise 1e-5 there)."""
    X, Y = data(200, 3, seed=4, dtype=dtype)
    plain = dict(outcome_transform=None)  # noise= and train_Yvar in one scale
    ref, model = pair(X, Y, noise=1e-2, posterior_cholesky_size=0, transforms=lambda: plain)
    model.eval()
    Xn = points_at(3, 3, seed=6, dtype=dtype)
    Yn, noise = torch.full((3, 1), 3.0, dtype=dtype), torch.full((3, 1), 1e-5, dtype=dtype)
    exact = SingleTaskGP(torch.cat([X, Xn]).double(), torch.cat([Y, Yn]).double(), train_Yvar=torch.cat([
        ref.likelihood.noise.detach().expand(200, 1), noise]).double(), **plain)  # in float64 for either dtype
    exact.load_state_dict({k: v.double() for k, v in ref.state_dict().items() if not k.startswith("likelihood")},
                          strict=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpnys.NumericalWarning)
        got = model.condition_on_observations(Xn, Yn, noise=noise)
        batched = model.condition_on_observations(Xn[None], Yn[None], noise=noise[None])
    T = torch.cat([Xn, points_at(5, 3, seed=7, dtype=dtype)])
    with torch.no_grad():
        p, p_exact, p_batched = got.posterior(T), exact.eval().posterior(T.double()), batched.posterior(T)
    tol = 1e-9 if dtype == torch.float64 else 2e-3  # float32: 3e-4 (mean) and 7e-7 (variance) off
    torch.testing.assert_close(p.mean.double(), p_exact.mean, rtol=0, atol=tol)
    torch.testing.assert_close(p.variance.double(), p_exact.variance, rtol=0, atol=tol / 100)
    torch.testing.assert_close(p.mean, p_batched.mean[0], rtol=0, atol=tol)
    assert float((p.mean[:3] - 3.0).abs().max()) < 0.05  # the given noise pins the new points (learnt: 2.2)


def test_condition_on_observations_with_noise_on_two_learnt_noises():
    """``m = 2`` outputs: GPyTorch's fantasy update, as SingleTaskGP's (one warning that says what it holds), until
    ``train()`` drops its caches; the model then predicts by its own path again."""
    X, Y = data(200, 3, seed=4)
    ref, model = pair(X, Y.repeat(1, 2), noise=1e-2, posterior_cholesky_size=0)
    ref.eval(), model.eval()
    Xn = points_at(3, 3, seed=6)
    Yn, noise = torch.zeros(3, 2, dtype=torch.float64), torch.full((3, 2), 1e-5, dtype=torch.float64)
    ref.posterior(Xn)  # its prediction caches, which BoTorch's conditioning extends
    expected = ref.condition_on_observations(Xn, Yn, noise=noise)
    with pytest.warns(gpnys.NumericalWarning, match="2 outputs whose noise is learnt.*means give the new points"):
        got = model.condition_on_observations(Xn, Yn, noise=noise)
    T = torch.cat([Xn, points_at(5, 3, seed=7)])
    with torch.no_grad():
        p, p_ref = got.posterior(T), expected.posterior(T)
    assert_rel(p.mean, p_ref.mean, 1e-6, "mean")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance")
    got.train()
    got.eval()  # GPyTorch dropped the fantasy caches: the model's own path, at the learnt noise on every point
    plain = SingleTaskGP(got.train_inputs[0][0], got.train_targets.mT)
    plain.load_state_dict(ref.state_dict())
    with torch.no_grad():
        p, p_plain = got.posterior(T), plain.eval().posterior(T)
    assert not got._gpnys_exact_fantasy and got.output_models
    assert_rel(p.variance, p_plain.variance, 1e-6, "variance after train()")


def test_fit_with_another_mll_than_gpnys_estimates():
    """``fit_gpytorch_mll`` on the preconditioned path with an mll that never runs gpnys's estimator (BoTorch's
    leave-one-out pseudo-likelihood): L-BFGS-B's own stop stands (it had raised on the missing estimate)."""
    from gpytorch.mlls import LeaveOneOutPseudoLikelihood

    X, Y = data(150, 3, seed=5)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0)
    mll = LeaveOneOutPseudoLikelihood(model.likelihood, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_gpytorch_mll(mll)  # (no iteration cap: the run ends on its own, and the check after it runs)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_posterior_and_fantasies_at_zero_points():
    """A PCG posterior at zero test points is empty, as SingleTaskGP's; fantasies of zero points keep the
    fantasy batch."""
    from botorch.sampling import SobolQMCNormalSampler

    X, Y = data(200, 3, seed=8)
    ref, model = pair(X, Y, noise=1e-2, posterior_cholesky_size=0)
    E = torch.zeros(0, 3, dtype=torch.float64)
    with torch.no_grad():
        assert model.posterior(E).mean.shape == ref.posterior(E).mean.shape == (0, 1)
    for m in (model, ref):
        fantasy = m.fantasize(E, SobolQMCNormalSampler(torch.Size([2]), seed=0))
        with torch.no_grad():
            assert fantasy.posterior(X[:4]).mean.shape == (2, 4, 1)


def test_a_direct_call_of_a_two_output_model_checks_the_output_dimension():
    """``model(x)`` of an ``m``-output model in eval mode takes ``x (*b, 1 | m, q, d)``; another size there raises
    (output ``i`` had silently taken ``x[..., i, :, :]`` and dropped the rest)."""
    X, Y = data(60, 3, seed=9)
    model = PreconditionedSingleTaskGP(X, torch.cat([Y, -Y], -1))
    model.eval()
    with torch.no_grad():
        assert model(points_at(5, 3, batch=(4, 1))).mean.shape == (4, 2, 5)
        with pytest.raises(ValueError, match="1 or 2"):
            model(points_at(5, 3, batch=(4,)))

