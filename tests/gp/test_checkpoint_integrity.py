"""Fit checkpoints fail loudly: a truncated, empty, garbage or bit-flipped file, or one written for another data set,
size, dtype, model or configuration (smoothness, constraint, prior, active dimensions, frozen values), raises a
``ValueError`` naming the file (and the difference), as do fewer ``iters`` than it holds and a missing directory; a
resumed fit takes the call's learning rate, and a finished run (stopped early too) reruns to the same result."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpnys.baselines.exact import cholesky_loss
from gpnys.gp import ExactGPModel, fit, predict
from gpnys.gp.training import FitResult, _save_checkpoint, read_checkpoint


def _model(n=40, seed=0, dtype=torch.float64, d=2, kernel="matern32"):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=torch.float64).to(dtype)
    y = torch.sin(5 * X[:, 0].double()).to(dtype)
    return ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel=kernel).to(dtype)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "fit.pt"
    fit(_model(), iters=2, progress=False, checkpoint=path)
    return path


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "flipped bit"])
def test_damaged_file_is_a_value_error_naming_it(checkpoint, damage):
    raw = bytearray(checkpoint.read_bytes())
    if damage == "empty":
        raw = bytearray()
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage":
        raw = bytearray(b"\x00\x01garbage" * 50)
    else:
        raw[len(raw) // 2] ^= 0x10
    checkpoint.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=str(checkpoint.name)) as info:
        fit(_model(), iters=3, progress=False, checkpoint=checkpoint)
    assert "checkpoint" in str(info.value)


@pytest.mark.parametrize("other, field", [
    (dict(seed=1), "inputs"),            # another data set of the same size
    (dict(n=41), "n"),                   # another n
    (dict(dtype=torch.float32), "dtype"),
    (dict(kernel="rbf"), "modules"),     # another kernel
])
def test_checkpoint_of_another_model_is_refused(checkpoint, other, field):
    with pytest.raises(ValueError, match=f"{checkpoint.name}.*{field}"):
        fit(_model(**other), iters=3, progress=False, checkpoint=checkpoint)


def test_resume_takes_the_calls_learning_rate(checkpoint):
    """From the same two-step checkpoint, one more Adam step at lr 1e-3 and at 1e-1: Adam's step is about lr per
    parameter, so the second moves the parameters about 100 times further (a kept lr would move them alike)."""
    ref = _model()
    fit(ref, iters=2, progress=False)  # where the checkpoint stands (the exact path is deterministic)
    start = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    moved = {}
    for lr in (1e-3, 1e-1):
        path = checkpoint.parent / f"copy_{lr}.pt"
        path.write_bytes(checkpoint.read_bytes())
        model = _model()
        result = fit(model, iters=3, lr=lr, progress=False, checkpoint=path)
        assert len(result.loss_trace) == 3
        moved[lr] = float((torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - start).norm())
    assert moved[1e-1] > 30 * moved[1e-3] > 0, moved


def _configured(kernel="matern32", noise_floor=1e-4, prior_rate=6.0, active_dims=None, frozen_noise=None):
    """A model whose untrained settings vary: the kernel's smoothness and active dimensions, the noise's lower bound,
    a length-scale prior's rate and a frozen noise."""
    g = torch.Generator().manual_seed(0)
    X = torch.rand(40, 2, generator=g, dtype=torch.float64)
    lik = gpytorch.likelihoods.GaussianLikelihood(noise_constraint=gpytorch.constraints.GreaterThan(noise_floor))
    nu = {"matern12": 0.5, "matern32": 1.5, "matern52": 2.5}[kernel]
    base = gpytorch.kernels.MaternKernel(nu=nu, active_dims=active_dims,
                                         lengthscale_prior=gpytorch.priors.GammaPrior(3.0, prior_rate))
    model = ExactGPModel(X, torch.sin(5 * X[:, 0]), lik, kernel=gpytorch.kernels.ScaleKernel(base)).double()
    if frozen_noise is not None:
        model.likelihood.noise = frozen_noise
        model.likelihood.noise_covar.raw_noise.requires_grad_(False)
    return model


@pytest.mark.parametrize("other, entry", [
    (dict(kernel="matern52"), "covar_module.base_kernel.nu"),
    (dict(kernel="matern12"), "covar_module.base_kernel.nu"),
    (dict(noise_floor=1e-2), "raw_noise_constraint.lower_bound"),
    (dict(prior_rate=2.0), "lengthscale_prior.rate"),
    (dict(active_dims=[1]), "covar_module.base_kernel.active_dims"),
    (dict(frozen_noise=0.1), "likelihood.noise_covar.raw_noise"),
])
def test_checkpoint_of_another_configuration_is_refused_before_loading(tmp_path, other, entry):
    """Same modules and parameter shapes, another setting that changes the loss: refused, naming the setting, and
    the model keeps its own (loading the checkpoint would overwrite a constraint's bounds with the stored ones)."""
    path = tmp_path / "fit.pt"
    fit(_configured(), iters=2, progress=False, checkpoint=path)
    model = _configured(**other)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"{path.name}.*configuration.*{entry}") as info:
        fit(model, iters=4, progress=False, checkpoint=path)
    assert "this model's" in str(info.value)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_identically_built_models_resume_and_match_a_straight_run(tmp_path):
    """No false difference: a model built alike (priors, constraints, active dimensions, a frozen noise) resumes,
    and so does the same model object after a prediction (its prediction cache is not configuration); both end where
    a straight run ends."""
    build = dict(active_dims=[0, 1], frozen_noise=0.05)
    straight = _configured(**build)
    ref = fit(straight, iters=4, progress=False)
    path = tmp_path / "fit.pt"
    fit(_configured(**build), iters=2, progress=False, checkpoint=path)
    resumed = _configured(**build)
    res = fit(resumed, iters=4, progress=False, checkpoint=path)
    assert res.loss_trace == ref.loss_trace
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters()))
    predict(resumed, resumed.train_inputs[0][:3])
    assert fit(resumed, iters=5, progress=False, checkpoint=path).iterations == 5


def test_fewer_iters_than_the_checkpoint_holds_is_refused(checkpoint):
    """The fixture's file holds 2 steps: iters=1 cannot return 1 step, so it names iters and the 2 steps."""
    with pytest.raises(ValueError, match=r"iters=1 .*2 steps"):
        fit(_model(), iters=1, progress=False, checkpoint=checkpoint)
    assert fit(_model(), iters=2, progress=False, checkpoint=checkpoint).iterations == 2  # exactly what it holds


def test_rerun_of_a_run_stopped_early_returns_its_result_without_steps(tmp_path):
    path = tmp_path / "fit.pt"
    first_model = _model()
    first = fit(first_model, iters=10, progress=False, stop=lambda: True, checkpoint=path)
    assert first.iterations == 1 and first.stopped == "gradient at noise level"
    calls = []
    model = _model()
    again = fit(model, iters=10, progress=False, checkpoint=path, stop=lambda: True,
                on_step=lambda t, v: calls.append(t))
    assert (again.iterations, again.stopped, again.loss_trace) == (first.iterations, first.stopped, first.loss_trace)
    assert calls == []  # not one step more
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), first_model.parameters()))


def _rising(flag):
    """The exact loss, 10 higher once ``flag["on"]``: the L-BFGS step after it looks uphill."""
    return lambda m: cholesky_loss(m) + (10.0 if flag["on"] else 0.0)


def test_lbfgs_line_search_failure_after_a_resume_ends_where_a_straight_run_ends(tmp_path):
    """The loss rises after step 1, so step 2 fails and the parameters go back to where step 1 started: a run
    resumed between the two must know that point (the checkpoint holds it) and save its end as finished."""
    flag = {"on": False}
    kw = dict(optimizer="lbfgs", progress=False, loss=_rising(flag))
    straight = _model()
    ref = fit(straight, iters=10, on_step=lambda t, v: flag.update(on=t >= 1), **kw)
    assert ref.stopped == "line search failed" and ref.iterations == 2
    flag["on"] = False
    path = tmp_path / "fit.pt"
    assert fit(_model(), iters=2, checkpoint=path, **kw).stopped is None
    flag["on"] = True
    resumed = _model()
    res = fit(resumed, iters=10, checkpoint=path, **kw)
    assert (res.stopped, res.loss_trace) == (ref.stopped, ref.loss_trace)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters()))
    again_model = _model()
    again = fit(again_model, iters=10, checkpoint=path, **kw)
    assert (again.stopped, again.loss_trace) == (ref.stopped, ref.loss_trace)
    assert all(torch.equal(a, b) for a, b in zip(again_model.parameters(), straight.parameters()))


def test_checkpoint_in_a_missing_directory_is_refused_before_any_step(tmp_path):
    steps = []
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"checkpoint.*{missing}.*does not exist"):
        fit(_model(), iters=3, progress=False, checkpoint=missing / "fit.pt", on_step=lambda t, v: steps.append(t))
    assert steps == [] and not missing.exists()
    with pytest.raises(ValueError, match="checkpoint must be a file path"):
        fit(_model(), iters=3, progress=False, checkpoint="")


def test_checkpoint_of_permuted_targets_is_refused(tmp_path):
    """The same values in another order (two swaps 97 positions apart, which position weights repeating every 97
    entries had missed) are another data set."""
    path = tmp_path / "fit.pt"
    model = _model(n=200)
    fit(model, iters=2, progress=False, checkpoint=path)
    swapped = _model(n=200)
    y = swapped.train_targets.clone()
    y[[0, 97, 5, 102]] = y[[97, 0, 102, 5]]
    swapped.set_train_data(targets=y, strict=False)
    with pytest.raises(ValueError, match=f"{path.name}.*outputs"):
        fit(swapped, iters=3, progress=False, checkpoint=path)


class _TaskModel(gpytorch.models.ExactGP):
    """A Hadamard multitask model: inputs ``(X, task index)``."""

    def __init__(self, X, task, y):
        super().__init__((X, task), y, gpytorch.likelihoods.GaussianLikelihood())
        self.mean_module = gpytorch.means.ConstantMean()
        self.covar_module = gpytorch.kernels.RBFKernel()
        self.task_covar_module = gpytorch.kernels.IndexKernel(num_tasks=2, rank=1)

    def forward(self, x, i):
        return gpytorch.distributions.MultivariateNormal(
            self.mean_module(x), self.covar_module(x).mul(self.task_covar_module(i)))


def test_checkpoint_of_other_task_indices_is_refused(tmp_path):
    g = torch.Generator().manual_seed(0)
    X = torch.rand(40, 1, generator=g, dtype=torch.float64)
    task = (torch.arange(40) % 2)[:, None]
    y = torch.sin(5 * X[:, 0]) + task[:, 0]
    path = tmp_path / "fit.pt"
    fit(_TaskModel(X, task, y).double(), iters=2, progress=False, checkpoint=path)
    with pytest.raises(ValueError, match=f"{path.name}.*inputs"):
        fit(_TaskModel(X, 1 - task, y).double(), iters=3, progress=False, checkpoint=path)


def test_checkpoint_of_an_older_format_is_refused(checkpoint):
    """A checkpoint whose fingerprint predates the current format (no ``format`` entry) names what it lacks."""
    state = read_checkpoint(checkpoint)
    old = {k: v for k, v in state["fingerprint"].items() if k != "format"}
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    result = FitResult(loss_trace=list(state["loss_trace"]), steps=list(state["steps"]))
    _save_checkpoint(checkpoint, old, model, opt, result, state["elapsed_s"], None)
    with pytest.raises(ValueError, match=f"{checkpoint.name}.*records no format"):
        fit(_model(), iters=3, progress=False, checkpoint=checkpoint)
