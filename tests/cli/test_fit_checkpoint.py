"""``gpnys.gp.training.fit(checkpoint=...)``: a fit stopped and resumed from its checkpoint ends where one straight
run ends (the exact path bitwise; gpnys's stochastic estimator too, as the random state travels with it)."""

import gpytorch
import pytest
import torch

from gpnys import datasets, use_preconditioner
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel, fit

DS = datasets.load("concrete", n=200, seed=0)


def _model(dtype, ard=True):
    X, y = DS.train_x.to(dtype), DS.train_y.to(dtype)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(X)
    return ExactGPModel(X, y, lik, kernel="matern32", ard=ard, mean="constant").to(X)


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("optimizer", ["adam", "lbfgs"])
def test_resumed_exact_fit_equals_one_straight_run(tmp_path, dtype, optimizer):
    straight = _model(dtype)
    ref = fit(straight, iters=6, lr=0.05, optimizer=optimizer, progress=False)
    ck = tmp_path / "fit.pt"
    part = _model(dtype)
    first = fit(part, iters=3, lr=0.05, optimizer=optimizer, progress=False, checkpoint=ck)
    assert ck.exists() and first.iterations == 3
    resumed = _model(dtype)  # a fresh process would build the model anew
    res = fit(resumed, iters=6, lr=0.05, optimizer=optimizer, progress=False, checkpoint=ck)
    assert res.iterations == ref.iterations == 6
    assert res.loss_trace == ref.loss_trace  # bitwise: the same arithmetic from the same state
    assert torch.equal(_params(resumed), _params(straight))
    assert res.train_time_s >= first.train_time_s
    again = fit(_model(dtype), iters=6, lr=0.05, optimizer=optimizer, progress=False, checkpoint=ck)
    assert again.iterations == 6 and again.loss_trace == ref.loss_trace  # finished: nothing more to run


def test_resumed_stochastic_fit_is_reproducible_and_close_to_a_straight_run(tmp_path):
    """gpnys's estimator draws fresh probes from torch's generator at each step, which the checkpoint restores; a
    resumed run rebuilds the hook's state (its PCG warm start), so it matches a straight run to the solver's
    tolerance, and two resumptions from one checkpoint match bitwise."""
    import shutil

    settings = EstimatorSettings(num_probes=8)

    def run(iters, ck=None):
        model = _model(torch.float64)
        with use_preconditioner(model, "afn", settings=settings, seed=0, k=30):
            res = fit(model, iters=iters, lr=0.05, progress=False, seed=3, checkpoint=ck,
                      settings=lambda n: gpytorch.settings.max_cholesky_size(0))
        return res, _params(model)

    ref, p_ref = run(4)
    ck, ck2 = tmp_path / "fit.pt", tmp_path / "copy.pt"
    run(2, ck)
    shutil.copy(ck, ck2)
    res, p = run(4, ck)
    res2, p2 = run(4, ck2)
    assert res.loss_trace == res2.loss_trace and torch.equal(p, p2)
    assert res.loss_trace[:2] == ref.loss_trace[:2]
    assert res.loss_trace == pytest.approx(ref.loss_trace, rel=1e-4)
    torch.testing.assert_close(p, p_ref, rtol=1e-3, atol=1e-4)  # steps of ~lr = 5e-2


def test_checkpoint_bad_input(tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        fit(_model(torch.float64), iters=1, progress=False, checkpoint=tmp_path)  # a directory
    other = tmp_path / "other.pt"
    torch.save({"weights": 1}, other)
    with pytest.raises(ValueError, match="not a gpnys fit checkpoint"):
        fit(_model(torch.float64), iters=1, progress=False, checkpoint=other)
    ck = tmp_path / "fit.pt"
    fit(_model(torch.float64), iters=1, progress=False, checkpoint=ck)
    with pytest.raises(ValueError, match="not a gpnys fit checkpoint"):  # another optimiser
        fit(_model(torch.float64), iters=2, optimizer="lbfgs", progress=False, checkpoint=ck)
    with pytest.raises(ValueError, match="does not match this model"):  # another length-scale shape
        fit(_model(torch.float64, ard=False), iters=2, progress=False, checkpoint=ck)
