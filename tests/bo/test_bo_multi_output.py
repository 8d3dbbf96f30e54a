"""Multi-output :class:`gpnys.bo.PreconditionedSingleTaskGP` (``train_Y (n, m)``, BoTorch's batch of ``m``
independent GPs on inputs ``(m, n, d)``) against BoTorch's own multi-output ``SingleTaskGP``.

Above the threshold each output trains through its own preconditioner and estimate (the hook's batch mode) and
its posterior comes from PCG (one single-output model per output, ``output_models``); the answers must be
``SingleTaskGP``'s at the same hyperparameters, acquisitions included. Fantasies and conditioning take BoTorch's
own path.
"""

import copy
import warnings

import gpytorch
import pytest
import torch

pytest.importorskip("botorch")

from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement  # noqa: E402
from botorch.models import SingleTaskGP  # noqa: E402
from botorch.models.transforms.input import Normalize  # noqa: E402
from botorch.models.transforms.outcome import Standardize  # noqa: E402
from botorch.sampling import SobolQMCNormalSampler  # noqa: E402
from gpytorch.mlls import ExactMarginalLogLikelihood  # noqa: E402
from test_bo import assert_rel, change_setting, data, fit, known_noise, points_at, settings_kernel  # noqa: E402

import gpnys  # noqa: E402
from gpnys.bo import PreconditionedSingleTaskGP  # noqa: E402

USES_BOTORCH = True  # conftest: run under BoTorch's global GPyTorch settings
N, D = 240, 3
#: k < n: an inexact preconditioner, so PCG iterates ("auto" would estimate the rank on up to 500 points, here all)
PRECOND = {"max_cholesky_size": 0, "posterior_cholesky_size": 0, "posterior_tolerance": 1e-10, "precond": "afn",
           "k": 40, "w": 10}


def two_outputs(n=N, d=D, seed=0, dtype=torch.float64):
    """``(X (n, d), Y (n, 2))``: two smooth functions of every input, plus noise."""
    X, Y1 = data(n, d, seed=seed, dtype=dtype)
    Y2 = (torch.cos(4 * X) * torch.linspace(0.5, 1.5, d, dtype=dtype)).sum(-1, keepdim=True)
    return X, torch.cat([Y1, Y2 + 0.01 * torch.randn(n, 1, generator=torch.Generator().manual_seed(seed + 1),
                                                      dtype=dtype)], dim=-1)


def set_outputs(model, noise=(1e-3, 4e-3), constant=(0.1, -0.2)):
    """Each output's own ARD length-scales, noise and constant mean."""
    X = model.train_inputs[0]
    ls = torch.stack([torch.linspace(0.3, 0.7, X.shape[-1]), torch.linspace(0.8, 0.4, X.shape[-1])]).to(X)
    model.covar_module.lengthscale = ls[:, None, :]
    if not isinstance(model.likelihood, gpytorch.likelihoods.FixedNoiseGaussianLikelihood):
        model.likelihood.noise = torch.tensor(noise).to(X)[:, None]
    model.mean_module.constant = torch.tensor(constant).to(X)
    return model


def pair(X, Y, transforms=False, posterior_cholesky_size=0, **kwargs):
    """(``SingleTaskGP`` reference, ``PreconditionedSingleTaskGP`` on the PCG path), same hyperparameters."""
    def extra():
        return {"input_transform": Normalize(d=X.shape[-1]), "outcome_transform": Standardize(m=Y.shape[-1])} \
            if transforms else {}

    ref = set_outputs(SingleTaskGP(X, Y, **kwargs, **extra()))
    options = {**PRECOND, "posterior_cholesky_size": posterior_cholesky_size}
    model = PreconditionedSingleTaskGP(X, Y, **kwargs, **extra(), **options)
    model.load_state_dict(ref.state_dict())
    return ref, model


def test_multi_output_posterior_matches_single_task_gp(cholesky_shapes):
    """Marginals at (q, d) and joint covariances at (b, q, d): one PCG posterior per output, no n x n Cholesky."""
    X, Y = two_outputs()
    ref, model = pair(X, Y)
    assert model.uses_preconditioner() and not model.posterior_exact()
    Xt, Xq = points_at(50, D), points_at(3, D, batch=(4,), seed=2)
    with torch.no_grad():
        p_ref, q_ref = ref.posterior(Xt), ref.posterior(Xq)
        cholesky_shapes.clear()
        p, q = model.posterior(Xt), model.posterior(Xq)
    assert p.mean.shape == p_ref.mean.shape == (50, 2) and q.mean.shape == (4, 3, 2)
    assert_rel(p.mean, p_ref.mean, 1e-8, "mean")
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance")
    c_ref, c = q_ref.distribution.covariance_matrix, q.distribution.covariance_matrix
    assert c.shape == c_ref.shape == (4, 6, 6)
    torch.testing.assert_close(c, c_ref, rtol=0, atol=1e-9)
    outputs = model.output_models
    assert len(outputs) == 2 and all(m.posterior_iterations > 0 for m in outputs)  # PCG iterated, per output
    assert all(m.hook().history[-1].rank <= PRECOND["k"] for m in outputs)
    assert max((s[-1] for s in cholesky_shapes), default=0) < N


def test_multi_output_exact_posterior_per_output(cholesky_shapes):
    """Where the m factors fit the budget (posterior_cholesky_size=None) each output takes Cholesky on its own,
    never GPyTorch's batched exact path (its (m, n, n) cache would be broadcast over the batch of X): n x n
    factorisations only, no (m, n, n) one, and SingleTaskGP's answer."""
    X, Y = two_outputs()
    ref, model = pair(X, Y, posterior_cholesky_size=None)
    Xq = points_at(3, D, batch=(16, 1), seed=2)
    with torch.no_grad():
        q_ref = ref.posterior(Xq)
        cholesky_shapes.clear()
        q = model.posterior(Xq)
    assert model.posterior_exact() and all(m.posterior_exact() for m in model.output_models)
    assert (N, N) in cholesky_shapes and all(len(s) == 2 for s in cholesky_shapes if s[-1] >= N)
    torch.testing.assert_close(q.mean, q_ref.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(q.distribution.covariance_matrix, q_ref.distribution.covariance_matrix,
                               rtol=1e-8, atol=1e-10)


def _variant(name, d):
    """SingleTaskGP keywords of the module variants BoTorch users pass to a two-output model."""
    two = torch.Size([2])
    return {
        "active_dims": {"covar_module": gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=2, batch_shape=two, active_dims=[0, 2]), batch_shape=two)},
        "linear_mean": {"mean_module": gpytorch.means.LinearMean(d, batch_shape=two)},
        "shared_noise": {"likelihood": gpytorch.likelihoods.GaussianLikelihood()},
        "shared_kernel": {"covar_module": gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=d)},
    }[name]


@pytest.mark.parametrize("variant", ["active_dims", "linear_mean", "shared_noise", "shared_kernel"])
def test_multi_output_module_variants(variant):
    """A kernel on some input columns (GPyTorch's kernel slicing would move its active_dims), a mean whose
    parameters do not lead with the batch dimension, one noise for both outputs, one kernel for both: the posterior
    by PCG per output is SingleTaskGP's, and the training estimate is the exact loss within its error bars."""
    X, Y = two_outputs()
    torch.manual_seed(0)
    ref = SingleTaskGP(X, Y, **_variant(variant, D))
    model = PreconditionedSingleTaskGP(X, Y, **_variant(variant, D), **PRECOND)
    with torch.no_grad():
        for p in ref.parameters():  # away from the defaults (BoTorch's raw noise is the noise: keep its sign)
            p.mul_(1 + 0.5 * torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
            p.add_(0.1 if p.shape[-1] == 1 and p.dim() == 1 else 0.0)  # LinearMean's bias, ConstantMean's constant
    model.load_state_dict(ref.state_dict())
    Xt = points_at(20, D, seed=4)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    scale = float(p_ref.mean.abs().max())
    torch.testing.assert_close(p.mean, p_ref.mean, rtol=0, atol=1e-8 * scale)
    assert_rel(p.variance, p_ref.variance, 1e-5, "variance")
    model.train()
    ref.train()
    with torch.no_grad(), model.preconditioned() as hook:
        ours = float(ExactMarginalLogLikelihood(model.likelihood, model)(model(*model.train_inputs),
                                                                         model.train_targets).sum())
    with torch.no_grad():
        exact = float(ExactMarginalLogLikelihood(ref.likelihood, ref)(ref(*ref.train_inputs), ref.train_targets).sum())
    assert abs(ours - exact) <= max(4 * hook.last_estimate.std_error / N, 1e-6), (ours, exact)


def test_multi_output_posterior_per_output_below_the_threshold():
    """Below max_cholesky_size (the default, 4096 under BoTorch) the model is a SingleTaskGP but for its posterior,
    which is taken per output by Cholesky: GPyTorch's batched path would broadcast its (m, n, n) cache over the
    acquisition's batch."""
    X, Y = two_outputs()
    ref = set_outputs(SingleTaskGP(X, Y))
    model = PreconditionedSingleTaskGP(X, Y)
    model.load_state_dict(ref.state_dict())
    assert not model.uses_preconditioner()
    Xq = points_at(3, D, batch=(8, 1), seed=2)
    with torch.no_grad():
        q_ref, q = ref.posterior(Xq), model.posterior(Xq)
    assert len(model.output_models) == 2 and all(m.posterior_exact() for m in model.output_models)
    torch.testing.assert_close(q.mean, q_ref.mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(q.distribution.covariance_matrix, q_ref.distribution.covariance_matrix,
                               rtol=1e-8, atol=1e-10)


def test_multi_output_acquisition_value_and_gradient():
    """qLogNEHVI (two objectives) and its gradient w.r.t. the candidates, as optimize_acqf takes them."""
    X, Y = two_outputs()
    ref, model = pair(X, Y, transforms=True)
    values, grads = [], []
    for m in (ref, model):
        acqf = qLogNoisyExpectedHypervolumeImprovement(
            m, ref_point=[-3.0, -3.0], X_baseline=X[:30], prune_baseline=False, cache_root=False,
            sampler=SobolQMCNormalSampler(torch.Size([64]), seed=0))
        x = points_at(2, D, batch=(3,), seed=5).requires_grad_(True)
        value = acqf(x)
        value.sum().backward()
        values.append(value.detach())
        grads.append(x.grad)
    assert_rel(values[1], values[0], 1e-6, "qLogNEHVI")
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-5 * float(grads[0].abs().max()))


def test_output_models_follow_hyperparameters_and_data():
    """The per-output models are kept while data and hyperparameters stay (their preconditioners are not rebuilt)
    and made anew when either changes."""
    X, Y = two_outputs()
    ref, model = pair(X, Y)
    Xt = points_at(20, D)
    with torch.no_grad():
        model.posterior(Xt)
        first = model.output_models
        builds = [m.hook().builds for m in first]
        model.posterior(Xt + 0.01)
    assert model.output_models[0] is first[0] and [m.hook().builds for m in first] == builds
    for m in (ref, model):
        m.covar_module.lengthscale = m.covar_module.lengthscale * 1.3
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert model.output_models[0] is not first[0]
    assert_rel(p.variance, p_ref.variance, 1e-6, "variance after new hyperparameters")
    X2, Y2 = two_outputs(N + 20, seed=3)
    for m in (ref, model):
        m.set_train_data(X2.expand(2, -1, -1), Y2.T, strict=False)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt)
    assert_rel(p.mean, p_ref.mean, 1e-8, "mean after new data")


@pytest.mark.parametrize("path", ["default", "pcg"])
@pytest.mark.parametrize("setting", ["nu", "active_dims"])
def test_output_models_follow_kernel_settings(setting, path):
    """Two outputs, a kernel's plain setting changed after a posterior (Matérn's ``nu``, ``active_dims``): the next
    posterior is the new kernel's, without ``train()`` / ``eval()`` (the output models' key holds the kernel's
    settings) and after (``train()`` drops the output models, as it drops SingleTaskGP's prediction cache),
    against SingleTaskGP after ``train()`` / ``eval()``. At the default settings (exact posteriors per output)
    stale output models gave mean errors of 0.044 (nu) and 0.30 (active_dims)."""
    X, Y = two_outputs()
    two = torch.Size([2])
    ref = SingleTaskGP(X, Y, covar_module=settings_kernel(setting, D, batch_shape=two))
    ref.likelihood.noise = torch.tensor([[1e-3], [4e-3]]).to(X)
    ref.covar_module.lengthscale = torch.tensor([0.4, 0.6]).to(X)[:, None, None]
    options = PRECOND if path == "pcg" else {}
    model = PreconditionedSingleTaskGP(X, Y, covar_module=settings_kernel(setting, D, batch_shape=two), **options)
    model.load_state_dict(ref.state_dict())
    Xt = points_at(30, D)
    with torch.no_grad():
        model.posterior(Xt)  # output models of the old setting
    assert model.output_models and model.posterior_exact() is (path == "default")
    for m in (ref, model):
        change_setting(m.covar_module, setting)
    ref.train()
    ref.eval()
    for reset in (False, True):
        if reset:
            model.train()
            assert model.output_models == []
            model.eval()
        with torch.no_grad():
            p_ref, p = ref.posterior(Xt), model.posterior(Xt)
        how = "after train() / eval()" if reset else "without train() / eval()"
        assert_rel(p.mean, p_ref.mean, 1e-7, f"mean after a new {setting}, {how}")
        assert_rel(p.variance, p_ref.variance, 1e-6, f"variance after a new {setting}, {how}")


def test_output_models_follow_a_replaced_kernel_and_known_noise():
    """The per-output models are made anew for a kernel module replaced by one of another class with the same state
    (the same values: only the objects differ) and for new known noise (outside the ``state_dict``)."""
    X, Y = two_outputs()
    _, model = pair(X, Y, train_Yvar=torch.cat([known_noise(N), known_noise(N, seed=5)], -1))
    Xt = points_at(20, D)
    with torch.no_grad():
        model.posterior(Xt)
    old = model.covar_module
    model.covar_module = gpytorch.kernels.MaternKernel(
        nu=0.5, ard_num_dims=D, batch_shape=old.batch_shape, lengthscale_prior=copy.deepcopy(old.lengthscale_prior),
        lengthscale_constraint=copy.deepcopy(old.raw_lengthscale_constraint)).to(X)
    model.covar_module.load_state_dict(old.state_dict())
    for change in ("kernel", "known noise"):
        ref = SingleTaskGP(X, Y, train_Yvar=torch.ones_like(Y), covar_module=copy.deepcopy(model.covar_module))
        ref.load_state_dict(model.state_dict())
        ref.likelihood.noise = model.likelihood.noise
        with torch.no_grad():
            p_ref, p = ref.eval().posterior(Xt), model.posterior(Xt)
        assert_rel(p.mean, p_ref.mean, 1e-6, f"mean after new {change}")
        assert_rel(p.variance, p_ref.variance, 1e-6, f"variance after new {change}")
        model.likelihood.noise = model.likelihood.noise * 20


@pytest.mark.parametrize("noise", ["learnt", "known"])
def test_multi_output_training_estimate_matches_exact(noise):
    """Under the hook (batch mode: one preconditioner and estimate per output) the MLL and its gradient are the
    exact ones to within their error bars."""
    X, Y = two_outputs()
    kwargs = {"train_Yvar": torch.cat([known_noise(N), known_noise(N, seed=5)], -1)} if noise == "known" else {}
    ref, model = pair(X, Y, **kwargs)
    losses, grads = [], []
    for m in (ref, model):
        m.train()
        m.zero_grad()
        mll = ExactMarginalLogLikelihood(m.likelihood, m)
        with (model.preconditioned() if m is model else gpytorch.settings.max_cholesky_size(10**6)) as hook:
            loss = -mll(m(*m.train_inputs), m.train_targets).sum()
            loss.backward()
        losses.append(float(loss.detach()))
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
    assert hook.problem.elements is not None and len(hook.batch_estimates) == 2
    assert all(e.probes > 0 for e in hook.batch_estimates)  # the estimator ran for both outputs
    se = hook.last_estimate.std_error / N
    assert abs(losses[1] - losses[0]) <= max(4 * se, 1e-6), (losses, se)
    for name, g in grads[0].items():
        tol = 0.05 * float(g.abs().max()) + 1e-6
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=tol, msg=name)


def test_multi_output_fit(cholesky_shapes):
    """fit_gpytorch_mll on the preconditioned path (BoTorch's batched L-BFGS-B, one problem per output), from the
    subset start: no n x n Cholesky, each output's preconditioner rebuilt as it moves, and each output's exact MLL
    at the fitted hyperparameters at most 1e-3 per point above SingleTaskGP's fit."""
    X, Y = two_outputs(300)
    ref = SingleTaskGP(X, Y)
    model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, fit_subset=150, precond="afn", k=100, w=15)
    fit(ref)
    cholesky_shapes.clear()
    fit(model)
    assert max((s[-1] for s in cholesky_shapes), default=0) < 300
    assert all(e.builds > 1 for e in model.hook().problem.elements)

    def per_output_loss(state):
        exact = SingleTaskGP(X, Y)
        exact.load_state_dict(state)
        exact.train()
        with torch.no_grad():
            return -ExactMarginalLogLikelihood(exact.likelihood, exact)(exact(*exact.train_inputs), exact.train_targets)

    # no worse than SingleTaskGP's fit per output (here its batched L-BFGS-B stops 0.046 higher on output 0)
    ours, theirs = per_output_loss(model.state_dict()), per_output_loss(ref.state_dict())
    assert float((ours - theirs).max()) <= 1e-3, (ours, theirs)


def test_multi_output_fit_is_reproducible():
    X, Y = two_outputs(150, seed=4)
    fitted = []
    for _ in range(2):
        torch.manual_seed(0)
        model = PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, seed=3, k=40, w=10)
        fit(model, maxiter=10)
        fitted.append({k: v.detach().clone() for k, v in model.named_parameters()})
    for name, p in fitted[0].items():
        assert torch.equal(p, fitted[1][name]), name


def test_multi_output_conditioning_and_fantasies_take_botorch_path():
    """condition_on_observations and fantasize on m outputs: BoTorch's own (exact) update, SingleTaskGP's answer,
    without a "not preconditioned" warning (the path is documented)."""
    X, Y = two_outputs()
    ref, model = pair(X, Y)
    Xn, Yn = points_at(2, D, seed=6), torch.tensor([[0.3, -0.1], [1.2, 0.4]], dtype=X.dtype)
    Xt = points_at(10, D, seed=7)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", gpnys.checks.NumericalWarning)
        for m in (ref, model):
            m.posterior(Xt)  # GPyTorch's fantasy update needs the base model's caches
        new_ref, new = ref.condition_on_observations(Xn, Yn), model.condition_on_observations(Xn, Yn)
        assert_rel(new.posterior(Xt).mean, new_ref.posterior(Xt).mean, 1e-8, "conditioned mean")
        f_ref = ref.fantasize(Xn, SobolQMCNormalSampler(torch.Size([4]), seed=1))
        f = model.fantasize(Xn, SobolQMCNormalSampler(torch.Size([4]), seed=1))
        assert f.batch_shape == f_ref.batch_shape == (4,)
        assert_rel(f.posterior(Xt).mean, f_ref.posterior(Xt).mean, 1e-6, "fantasy mean")


def test_subset_output_after_posteriors():
    """BoTorch's subset_output (a deep copy) after posteriors have built caches: one output is a single-output
    model on the preconditioned path, with SingleTaskGP's subset posterior."""
    X, Y = two_outputs()
    ref, model = pair(X, Y)
    Xt = points_at(10, D, seed=3)
    with torch.no_grad():
        model.posterior(Xt)
        sub, sub_ref = model.subset_output([1]), ref.subset_output([1])
        assert sub.num_outputs == 1 and sub.uses_preconditioner() and model.output_models  # the original keeps its
        assert_rel(sub.posterior(Xt).mean, sub_ref.posterior(Xt).mean, 1e-8, "subset mean")
        assert_rel(sub.posterior(Xt).variance, sub_ref.posterior(Xt).variance, 1e-6, "subset variance")


def test_multi_output_warm_start():
    """warm_start_from copies each output's hyperparameters and seeds the solves with the previous (m, n) solution,
    new rows at 0; the first posterior solve then starts from it."""
    X, Y = two_outputs()
    ref, old = pair(X[:200], Y[:200])
    with torch.no_grad():
        old.posterior(points_at(5, D))
    state = old.warm_state()
    assert state["gpnys_solution"].shape == (2, 200)
    new = PreconditionedSingleTaskGP(X, Y, **PRECOND).warm_start_from(old)
    torch.testing.assert_close(new.covar_module.lengthscale, old.covar_module.lengthscale)
    assert new._gpnys_seed.shape == (2, N) and bool((new._gpnys_seed[:, 200:] == 0).all())
    ref = set_outputs(SingleTaskGP(X, Y))
    with torch.no_grad():
        p_ref, p = ref.posterior(points_at(5, D)), new.posterior(points_at(5, D))
    assert_rel(p.mean, p_ref.mean, 1e-8, "warm-started mean")
    for i, model in enumerate(new.output_models):  # the posterior's first solve started from the seed, before a fit
        torch.testing.assert_close(model._gpnys_seed, new._gpnys_seed[i])


@pytest.mark.parametrize("idcs", [[1, 0], [1]])
def test_subset_output_keeps_each_outputs_warm_start(idcs):
    """subset_output of a warm-started model seeds each kept output from its own previous solution (output 1 had
    started from output 0's), and its posterior is SingleTaskGP's subset posterior."""
    X, Y = two_outputs()
    Y = Y * torch.tensor([1.0, 10.0], dtype=Y.dtype)
    ref, old = pair(X[:200], Y[:200])
    with torch.no_grad():
        old.posterior(points_at(5, D))
    new = PreconditionedSingleTaskGP(X, Y, **PRECOND).warm_start_from(old)
    sub = new.subset_output(idcs)
    expected = new._gpnys_seed[idcs]
    torch.testing.assert_close(sub._gpnys_seed, expected[0] if len(idcs) == 1 else expected, rtol=0, atol=0)
    sub_ref = set_outputs(SingleTaskGP(X, Y)).subset_output(idcs)
    with torch.no_grad():
        assert_rel(sub.posterior(points_at(5, D)).mean, sub_ref.posterior(points_at(5, D)).mean, 1e-8, "subset mean")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_multi_output_dtypes(dtype):
    """float32: the posterior to float32's accuracy (noise 1e-2, as the single-output float32 tests use)."""
    X, Y = two_outputs(dtype=dtype)
    ref, model = pair(X.double(), Y.double())
    model = model.to(dtype)
    for m in (ref, model):
        m.likelihood.noise = torch.tensor([[1e-2], [2e-2]]).to(m.train_inputs[0])
    Xt = points_at(30, D)
    with torch.no_grad():
        p_ref, p = ref.posterior(Xt), model.posterior(Xt.to(dtype))
    assert p.mean.dtype == dtype
    tol = 1e-3 if dtype == torch.float32 else 1e-8
    scale = float(p_ref.mean.abs().max())
    torch.testing.assert_close(p.mean.double(), p_ref.mean, rtol=0, atol=tol * scale)
    assert_rel(p.variance.double(), p_ref.variance, 100 * tol, "variance")


@pytest.mark.parametrize("case", ["nan", "yvar-shape"])
def test_multi_output_bad_input_is_single_task_gp_error(case):
    """NaN targets in one output, or one noise column for two outputs: SingleTaskGP's own error, at construction."""
    X, Y = two_outputs(40)
    kwargs = {"train_Yvar": torch.full((40, 1), 1e-3, dtype=X.dtype)} if case == "yvar-shape" else {}
    if case == "nan":
        Y = Y.clone()
        Y[3, 1] = float("nan")
    with pytest.raises(Exception) as expected:
        SingleTaskGP(X, Y, **kwargs)
    with pytest.raises(expected.type, match=str(expected.value)[:20]):
        PreconditionedSingleTaskGP(X, Y, max_cholesky_size=0, **kwargs)


def test_batched_inputs_still_take_single_task_gp_path():
    """Inputs with batch dimensions (b, n, d) are not preconditioned: SingleTaskGP's Cholesky, one warning."""
    X, Y = two_outputs(40)
    Xb, Yb = torch.stack([X, X + 0.1]), torch.stack([Y, -Y])
    ref = SingleTaskGP(Xb, Yb)
    model = PreconditionedSingleTaskGP(Xb, Yb, max_cholesky_size=10)
    model.load_state_dict(ref.state_dict())
    with pytest.warns(gpnys.checks.NumericalWarning, match="batched inputs"), torch.no_grad():
        mean = model.posterior(points_at(5, D)).mean
    with torch.no_grad():
        torch.testing.assert_close(mean, ref.posterior(points_at(5, D)).mean)
