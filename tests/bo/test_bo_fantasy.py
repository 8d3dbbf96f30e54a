"""Fantasy models of :class:`gpnys.bo.PreconditionedSingleTaskGP` against BoTorch's ``SingleTaskGP`` fantasies.

At every size, ``fantasize`` / batched ``condition_on_observations`` return a
:class:`gpnys.bo.PreconditionedFantasyGP`: the base posterior at ``[X_t, X_q]`` conditioned on the fantasy targets,
without an ``(n + q) x (n + q)`` factorisation. Its posteriors, nested fantasies, one-shot knowledge gradient and
integrated-variance acquisition must equal those of ``SingleTaskGP`` (whose fantasy update is GPyTorch's exact
one) at the same hyperparameters and sampler seed, on each base path: PCG (``posterior_cholesky_size=0``),
BoTorch's Cholesky above ``max_cholesky_size`` (``None``, which fits here), and below it.
"""

import gpytorch
import pytest
import torch

pytest.importorskip("botorch")

from botorch.acquisition import qKnowledgeGradient, qNegIntegratedPosteriorVariance  # noqa: E402
from botorch.models import SingleTaskGP  # noqa: E402
from botorch.sampling import SobolQMCNormalSampler  # noqa: E402
from helpers import load_script  # noqa: E402
from test_bo import box_transforms, data, known_noise, pair, points_at  # noqa: E402

from gpnys.bo import PreconditionedFantasyGP, PreconditionedSingleTaskGP  # noqa: E402

USES_BOTORCH = True  # conftest: run under BoTorch's global GPyTorch settings
N, D = 240, 3
#: the base model's posterior: PCG; BoTorch's Cholesky above max_cholesky_size; below it (a SingleTaskGP but for
#: its fantasies)
PATHS = {"pcg": {"posterior_cholesky_size": 0}, "cholesky": {"posterior_cholesky_size": None},
         "below": {"max_cholesky_size": None}}


def sampler(m, seed=1):
    return SobolQMCNormalSampler(torch.Size([m]), seed=seed)


def models(path, dtype=torch.float64, transforms=True, noise=1e-3):
    """(``SingleTaskGP`` float64 reference, ``PreconditionedSingleTaskGP`` in ``dtype``), same hyperparameters and
    transform statistics, data scaled off the unit cube so that the transforms matter."""
    X, Y = data(N, D, seed=8)
    X, Y = X * 4 - 1, 3 * Y + 7
    ref, model = pair(X, Y, noise, transforms=box_transforms(D) if transforms else None, posterior_tolerance=1e-10,
                      **PATHS[path])
    assert model.uses_preconditioner() is (path != "below")
    return ref, model.to(dtype)


def assert_close(actual, expected, rtol, what):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    actual, expected = actual.detach().double(), expected.detach()
    err = float(((actual - expected) / expected.abs().clamp_min(1e-3)).abs().max())
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("path", list(PATHS))
def test_fantasy_posterior_matches_single_task_gp(path, dtype):
    """In float32 the noise is 1e-2: at 1e-3 the base PCG posterior's own float32 variance error reaches 27 % here
    (docs/bo.md), and the fantasy adds no more than that."""
    ref, model = models(path, dtype, noise=1e-3 if dtype == torch.float64 else 1e-2)
    Xq, Xt = points_at(2, D, seed=10, batch=(3,)) * 4 - 1, points_at(5, D, seed=11) * 4 - 1
    f_ref = ref.fantasize(Xq, sampler(4))
    fantasy = model.fantasize(Xq.to(dtype), sampler(4))
    assert type(fantasy) is PreconditionedFantasyGP and fantasy.batch_shape == f_ref.batch_shape == (4, 3)
    with torch.no_grad():
        p_ref, p = f_ref.posterior(Xt), fantasy.posterior(Xt.to(dtype))
        p_noisy = fantasy.posterior(Xt.to(dtype), observation_noise=True)
    rtol = (1e-8, 1e-7) if dtype == torch.float64 else (1e-4, 1e-2)
    assert p.mean.dtype == dtype
    assert_close(p.mean, p_ref.mean, rtol[0], "fantasy mean")
    assert_close(p.variance, p_ref.variance, rtol[1], "fantasy variance")
    # the fantasies differ in their targets only: one covariance for all, and observation noise adds the noise
    torch.testing.assert_close(p.variance[0], p.variance[-1], rtol=rtol[1], atol=0)
    noise = model.likelihood.noise * model.outcome_transform.stdvs ** 2
    torch.testing.assert_close(p_noisy.variance - p.variance, noise.expand_as(p.variance), rtol=1e-3, atol=0)
    # the data it holds: the base data with the points appended, as in GPyTorch's fantasy model
    assert fantasy.train_targets.shape == f_ref.train_targets.shape == (4, 3, N + 2)
    torch.testing.assert_close(fantasy.train_targets.detach().double(), f_ref.train_targets.detach(), rtol=rtol[0],
                               atol=rtol[0])
    assert fantasy.train_inputs[0].shape == (4, 3, N + 2, D)


@pytest.mark.parametrize("path", list(PATHS))
def test_get_fantasy_model_matches_single_task_gp(path):
    """GPyTorch's ``get_fantasy_model`` (transformed inputs and targets) on every posterior path: on the PCG path,
    whose posterior builds no GPyTorch caches, it raised "call the model on some data first" after a posterior."""
    ref, model = models(path, transforms=False)
    Xq, Xt = points_at(3, D, seed=10), points_at(5, D, seed=11)
    yq = torch.linspace(-1.0, 1.0, 3, dtype=torch.float64)
    outs = []
    for m in (ref, model):
        m.eval()
        with torch.no_grad():
            m.posterior(Xt)
            new = m.get_fantasy_model(Xq, yq)
            assert new.train_inputs[0].shape == (N + 3, D)
            outs.append(new.posterior(Xt))
    assert_close(outs[1].mean, outs[0].mean, 1e-8, "mean")
    assert_close(outs[1].variance, outs[0].variance, 1e-7, "variance")


@pytest.mark.parametrize("path", list(PATHS))
def test_fantasy_of_a_fantasy(path):
    ref, model = models(path)
    Xq = points_at(2, D, seed=10, batch=(3,))
    X2 = points_at(1, D, seed=12, batch=(4, 3))  # one more point per fantasy and batch
    f_ref = ref.fantasize(Xq, sampler(4)).fantasize(X2, sampler(2, seed=2))
    fantasy = model.fantasize(Xq, sampler(4)).fantasize(X2, sampler(2, seed=2))
    assert fantasy.batch_shape == f_ref.batch_shape == (2, 4, 3)
    Xt = points_at(6, D, seed=13)
    with torch.no_grad():
        p_ref, p = f_ref.posterior(Xt), fantasy.posterior(Xt)
    assert_close(p.mean, p_ref.mean, 1e-8, "nested mean")
    assert_close(p.variance, p_ref.variance, 1e-7, "nested variance")
    assert fantasy._gpnys_fantasy[0] is model  # conditioned on both sets at once, from the one base model


@pytest.mark.parametrize("path", list(PATHS))
def test_knowledge_gradient_and_its_gradient(path):
    """One-shot qKG differentiates through the fantasy points, their sampled targets and the fantasy posterior."""
    ref, model = models(path, transforms=False)
    X = points_at(2 + 4, D, seed=14, batch=(5,))
    values, grads = [], []
    for m in (ref, model):
        x = X.clone().requires_grad_(True)
        v = qKnowledgeGradient(m, sampler=sampler(4, seed=3), num_fantasies=None)(x)
        v.sum().backward()
        values.append(v.detach())
        grads.append(x.grad)
    assert_close(values[1], values[0], 1e-8, "qKG")
    err = float((grads[1] - grads[0]).abs().max() / grads[0].abs().max())
    assert err <= 1e-5, f"qKG gradient: {err:.3g}"


def test_pcg_solves_each_fantasy_point_once(monkeypatch):
    """By PCG the fantasy posterior solves ``X_t``'s columns and ``X_q``'s in one run, ``X_q`` once for the ``f``
    fantasies that share it: ``f b t + b q`` columns, not ``f b (t + q)``."""
    import gpnys.gp.posterior as posterior

    _, model = models("pcg", transforms=False)
    f, b, q, t = 4, 3, 2, 5
    fantasy = model.fantasize(points_at(q, D, seed=10, batch=(b,)), sampler(f))
    columns, solve = [], posterior.PCGPosterior.solve

    def counting(self, R, *args, **kwargs):
        columns.append(R.shape[1])
        return solve(self, R, *args, **kwargs)

    monkeypatch.setattr(posterior.PCGPosterior, "solve", counting)
    with torch.no_grad():
        fantasy.posterior(points_at(t, D, seed=11, batch=(f, b)))
    assert columns == [f * b * t + b * q]


def test_alternating_shapes_keep_their_warm_starts():
    """A qKG evaluation solves at ``X_q`` (``fantasize``) and then at ``[X_t, X_q]`` per fantasy: the PCG posterior
    keeps one warm block per shape, so the next evaluation, a little further on, starts both from there."""
    ref, model = models("pcg", transforms=False)
    X = points_at(2 + 4, D, seed=14, batch=(5,))
    acq, acq_ref = (qKnowledgeGradient(m, sampler=sampler(4, seed=3), num_fantasies=None) for m in (model, ref))
    with torch.no_grad():
        acq(X)
        cold = model.posterior_iterations
        moved = (X + 1e-4).clamp(0, 1)
        value = acq(moved)
        warm = model.posterior_iterations
        assert_close(value, acq_ref(moved), 1e-8, "qKG from warm starts")
    assert warm < cold, (warm, cold)


@pytest.mark.parametrize("path", list(PATHS))
def test_integrated_variance_gradient(path):
    """qNIPV depends on ``X`` only through the fantasy covariance. The gradient equals finite differences and
    ``SingleTaskGP``'s with GPyTorch's ``detach_test_caches`` off; with it on (GPyTorch's default), GPyTorch's fantasy
    update detaches its covariance cache and ``SingleTaskGP``'s gradient misses that term."""
    ref, model = models(path, transforms=False)
    mc = points_at(40, D, seed=15)
    X = points_at(2, D, seed=16, batch=(3,))

    def value_and_grad(m, detach=True):
        x = X.clone().requires_grad_(True)
        with gpytorch.settings.detach_test_caches(detach):
            v = qNegIntegratedPosteriorVariance(m, mc_points=mc)(x)
        v.sum().backward()
        return v.detach(), x.grad

    v, g = value_and_grad(model)
    v_ref, g_ref = value_and_grad(ref, detach=False)
    assert_close(v, v_ref, 1e-8, "qNIPV")
    assert float((g - g_ref).abs().max() / g_ref.abs().max()) <= 1e-5
    h = 1e-5
    e = torch.zeros_like(X)
    e[0, 0, 0] = h
    acq = qNegIntegratedPosteriorVariance(model, mc_points=mc)
    with torch.no_grad():
        fd = (acq(X + e) - acq(X - e))[0] / (2 * h)
    assert abs(float(g[0, 0, 0] - fd)) <= 1e-4 * abs(float(fd)) + 1e-9
    _, g_detached = value_and_grad(ref, detach=True)
    assert float((g_detached - g_ref).abs().max()) > 10 * float((g - g_ref).abs().max())  # the check can tell


def test_no_n_plus_q_cholesky(cholesky_shapes):
    """PCG base: no factorisation of size >= n at all; Cholesky base: its one n x n factor, none of n + q."""
    Xq, Xt = points_at(2, D, seed=10, batch=(3,)), points_at(5, D, seed=11)
    for path, allowed in (("pcg", set()), ("cholesky", {N}), ("below", {N})):
        _, model = models(path)
        with torch.no_grad():
            model.posterior(Xt)
            cholesky_shapes.clear()
            model.fantasize(Xq, sampler(4)).posterior(Xt).variance
        big = {s[-1] for s in cholesky_shapes if s[-1] >= N}
        assert big <= allowed, (path, big)
    ref, _ = models("cholesky")
    cholesky_shapes.clear()
    with torch.no_grad():
        ref.posterior(Xt)
        ref.fantasize(Xq, sampler(4)).posterior(Xt).variance
    assert any(s[-1] >= N + 2 for s in cholesky_shapes)  # the patch sees GPyTorch's (n + q) factorisation


def test_known_noise_fantasies():
    X, Y = data(N, D, seed=8)
    Yvar = known_noise(N)
    ref = SingleTaskGP(X, Y, train_Yvar=Yvar)
    ref.covar_module.lengthscale = torch.tensor([[0.3, 0.5, 0.7]], dtype=X.dtype)
    model = PreconditionedSingleTaskGP(X, Y, train_Yvar=Yvar, max_cholesky_size=0, posterior_cholesky_size=0,
                                       posterior_tolerance=1e-10, k=40, w=10)
    model.load_state_dict(ref.state_dict())
    Xq, Xt = points_at(2, D, seed=10, batch=(3,)), points_at(5, D, seed=11)
    noise = torch.full((3, 2, 1), 2e-2, dtype=torch.float64)
    f_ref = ref.fantasize(Xq, sampler(4), observation_noise=noise)
    fantasy = model.fantasize(Xq, sampler(4), observation_noise=noise)
    with torch.no_grad():
        p_ref, p = f_ref.posterior(Xt), fantasy.posterior(Xt)
    assert_close(p.mean, p_ref.mean, 1e-8, "known-noise fantasy mean")
    assert_close(p.variance, p_ref.variance, 1e-7, "known-noise fantasy variance")
    with pytest.raises(ValueError, match="noise"):
        model.condition_on_observations(Xq, torch.zeros(4, 3, 2, 1, dtype=torch.float64))
    # nearly noise-free fantasy observations (GPyTorch rounds known noise below 1e-6 up to 1e-6; gpnys takes 0 as 0)
    Yq = torch.randn(4, 3, 2, 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    tiny = torch.full((3, 2, 1), 1e-6, dtype=torch.float64)
    with torch.no_grad():
        p_ref = ref.condition_on_observations(Xq, Yq, noise=tiny).posterior(Xt)
        p = model.condition_on_observations(Xq, Yq, noise=tiny).posterior(Xt)
        p0 = model.condition_on_observations(Xq, Yq, noise=torch.zeros_like(tiny)).posterior(Xt)
    assert_close(p.mean, p_ref.mean, 1e-7, "nearly noise-free fantasy mean")
    assert_close(p.variance, p_ref.variance, 1e-5, "nearly noise-free fantasy variance")
    assert bool(torch.isfinite(p0.mean).all()) and bool((p0.variance > 0).all())
    assert_close(p0.mean, p.mean, 1e-2, "noise-free against 1e-6")
    # with observation noise, and a fantasy of the fantasy: both take the mean of all n + q noise variances
    X2 = points_at(1, D, seed=12, batch=(4, 3))
    with torch.no_grad():
        p_ref, p = f_ref.posterior(Xt, observation_noise=True), fantasy.posterior(Xt, observation_noise=True)
        assert_close(p.variance, p_ref.variance, 1e-7, "known-noise fantasy variance with observation noise")
        p_ref = f_ref.fantasize(X2, sampler(2, seed=2)).posterior(Xt)
        p = fantasy.fantasize(X2, sampler(2, seed=2)).posterior(Xt)
    assert_close(p.mean, p_ref.mean, 1e-7, "known-noise nested fantasy mean")
    assert_close(p.variance, p_ref.variance, 1e-6, "known-noise nested fantasy variance")


def test_a_changed_base_model_is_refused():
    """A fantasy model holds targets and noise of its base model's state: once the base model's hyperparameters,
    data, device or dtype change, its posteriors raise instead of mixing the two states; as it was, it predicts."""
    _, model = models("pcg")
    Xq, Xt = points_at(2, D, seed=10, batch=(3,)), points_at(5, D, seed=11)
    fantasy = model.fantasize(Xq, sampler(4))
    with torch.no_grad():
        before = fantasy.posterior(Xt).mean.clone()
    ell = model.covar_module.lengthscale.detach().clone()
    model.covar_module.lengthscale = 0.1
    with pytest.raises(RuntimeError, match="has changed since"):
        fantasy.posterior(Xt)
    with pytest.raises(RuntimeError, match="has changed since"):
        fantasy.fantasize(Xq, sampler(2))
    model.covar_module.lengthscale = ell
    with torch.no_grad():
        torch.testing.assert_close(fantasy.posterior(Xt).mean, before, rtol=1e-12, atol=0)
    X, Y = data(N + 5, D, seed=9)
    model.set_train_data(model.train_inputs[0][:-1], model.train_targets[:-1], strict=False)
    with pytest.raises(RuntimeError, match="has changed since"):
        fantasy.posterior(Xt)
    _, model = models("cholesky")
    fantasy = model.fantasize(Xq, sampler(4))
    model.to(torch.float32)
    with pytest.raises(RuntimeError, match="has changed since"):
        fantasy.posterior(Xt.float())


def test_learnt_noise_with_given_noise():
    """``noise=`` with a learnt noise: the fantasy points take the given variances, in the mean and the covariance
    alike. The reference is ``SingleTaskGP`` with known noise equal to the learnt one, whose fantasy update takes
    ``noise=`` throughout; ``SingleTaskGP`` with a learnt noise takes it in the covariance only (GPyTorch 1.15's
    ``GaussianLikelihood`` fantasy keeps the learnt noise for the mean)."""
    ref, model = models("pcg", transforms=False)
    X, Y = data(N, D, seed=8)
    X, Y = X * 4 - 1, 3 * Y + 7
    stdv = ref.outcome_transform.stdvs.reshape(())
    fixed = SingleTaskGP(X, Y, train_Yvar=(ref.likelihood.noise.detach() * stdv**2).expand(N, 1))
    fixed.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("likelihood")}, strict=False)
    Xq, Xt = points_at(2, D, seed=10, batch=(3,)) * 4 - 1, points_at(5, D, seed=11) * 4 - 1
    Yq = 7 + torch.randn(4, 3, 2, 1, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    noise = torch.full((3, 2, 1), 0.3, dtype=torch.float64)
    with torch.no_grad():
        for m in (ref, fixed):
            m.posterior(Xt)  # GPyTorch's fantasy update needs its caches
        p_fixed = fixed.condition_on_observations(Xq, Yq, noise=noise).posterior(Xt)
        p_ref = ref.condition_on_observations(Xq, Yq, noise=noise).posterior(Xt)
        p = model.condition_on_observations(Xq, Yq, noise=noise).posterior(Xt)
    assert_close(p.mean, p_fixed.mean, 1e-8, "fantasy mean, given noise")
    assert_close(p.variance, p_fixed.variance, 1e-7, "fantasy variance, given noise")
    assert_close(p.variance, p_ref.variance, 1e-7, "fantasy variance against SingleTaskGP's")
    assert float((p_ref.mean - p_fixed.mean).abs().max()) > 1e-3  # SingleTaskGP's mean kept the learnt noise


def test_base_model_unchanged_and_reproducible():
    _, model = models("pcg")
    Xq, Xt = points_at(2, D, seed=10, batch=(3,)), points_at(5, D, seed=11)
    with torch.no_grad():
        before = model.posterior(Xt)
        mean0, var0 = before.mean.clone(), before.variance.clone()
        first = model.fantasize(Xq, sampler(4)).posterior(Xt)
        after = model.posterior(Xt)
    torch.testing.assert_close(after.mean, mean0, rtol=1e-12, atol=0)
    torch.testing.assert_close(after.variance, var0, rtol=1e-12, atol=0)
    assert model.train_targets.shape == (N,) and model.batch_shape == torch.Size([])
    _, again = models("pcg")  # a fresh model, same seeds: the same fantasies
    with torch.no_grad():
        second = again.fantasize(Xq, sampler(4)).posterior(Xt)
    torch.testing.assert_close(second.mean, first.mean, rtol=1e-9, atol=0)
    torch.testing.assert_close(second.variance, first.variance, rtol=1e-9, atol=0)


def test_fantasy_bad_input():
    _, model = models("pcg", transforms=False)
    Xq = points_at(2, D, seed=10, batch=(3,))
    with pytest.raises(ValueError, match="Y"):
        model.condition_on_observations(Xq, torch.zeros(4, 3, 3, 1, dtype=torch.float64))  # q = 3 != 2
    with pytest.raises(ValueError, match="Y"):
        model.condition_on_observations(Xq, torch.full((4, 3, 2, 1), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="X"):
        model.condition_on_observations(points_at(2, D + 1, batch=(3,)), torch.zeros(4, 3, 2, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="X"):
        model.condition_on_observations(Xq[0, 0], torch.zeros(4, 3, 2, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="noise"):
        model.condition_on_observations(Xq, torch.zeros(4, 3, 2, 1, dtype=torch.float64),
                                        noise=torch.full((3, 2, 1), -1e-3, dtype=torch.float64))
    fantasy = model.fantasize(Xq, sampler(4))
    with pytest.raises(NotImplementedError, match="only predicts"):
        fantasy.train()(points_at(2, D))
    with pytest.raises(NotImplementedError, match="only predicts"):
        fantasy.eval()(points_at(2, D), points_at(2, D))
    assert fantasy.posterior(points_at(2, D)).mean.shape == (4, 3, 2, 1)  # posterior() puts it in eval mode
    with pytest.raises(RuntimeError, match="cannot change device or dtype"):
        fantasy.to(torch.float32)
    with pytest.raises(NotImplementedError, match="does not train"):
        fantasy.custom_fit(None)
    with pytest.raises(TypeError, match="made by"):
        PreconditionedFantasyGP(Xq[0], torch.zeros(2, 1))


def test_bo_fantasy_benchmark_quick(tmp_path):
    res = load_script("benchmarks", "bo_fantasy").main(["--quick", "--out", str(tmp_path / "fantasy.json")])
    (row,) = res["rows"]
    assert {"singletask", "gpnys", "gpnys-pcg"} <= set(row) and row["singletask"]["peak_gib"] > 0
    for method in ("gpnys", "gpnys-pcg"):
        assert row[method]["error_reference"] == "singletask"
        assert row[method]["value_rel_err"] < 1e-6 and row[method]["grad_rel_err"] < 1e-4, row[method]
    assert (tmp_path / "fantasy.png").exists()
