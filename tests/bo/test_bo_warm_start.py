"""BO warm starts: ``PreconditionedSingleTaskGP.warm_start_from`` and ``condition_on_observations`` start the next
iteration's fit from the previous hyperparameters and its solves from the previous ``K̂⁻¹ (y − m)``. The starts
change only the work, never the answer: posteriors are checked against ``SingleTaskGP``'s Cholesky ones."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("botorch")
from botorch.models import SingleTaskGP  # noqa: E402
from test_bo import data, exact_mll, fit, hartmann6  # noqa: E402

from gpnys.bo import PreconditionedSingleTaskGP  # noqa: E402

OPTIONS = {"max_cholesky_size": 0, "posterior_cholesky_size": 0, "posterior_tolerance": 1e-8, "k": 60, "w": 10}


def _data(n, dtype, seed=0):
    """Hartmann-6 values at ``n`` seeded uniform points (the prefix of a larger draw is a smaller draw)."""
    return data(n, 6, dtype=dtype, seed=seed, f=hartmann6)


def _posterior(model, Xt):
    with torch.no_grad():
        p = model.posterior(Xt)
    return p.mean, p.variance


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_warm_start_keeps_hyperparameters_and_the_exact_posterior(dtype):
    X, Y = _data(260, dtype)
    old = fit(PreconditionedSingleTaskGP(X[:240], Y[:240], **OPTIONS), maxiter=15)
    with torch.no_grad():
        old.posterior(X[:3])  # its α, the seed of the next model's solves
    new = PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(old)
    for name in ("covar_module", "likelihood", "mean_module"):
        for (k, a), (_, b) in zip(getattr(new, name).state_dict().items(), getattr(old, name).state_dict().items()):
            assert torch.equal(a, b), (name, k)
    assert new._gpnys_seed is not None and new._gpnys_seed.shape == (260,)
    assert torch.equal(new._gpnys_seed[240:], torch.zeros(20, dtype=dtype))
    ref = SingleTaskGP(X, Y)
    ref.load_state_dict(new.state_dict())
    Xt = torch.rand(9, 6, dtype=dtype, generator=torch.Generator().manual_seed(3))
    (m, v), (mr, vr) = _posterior(new, Xt), _posterior(ref, Xt)
    tol = 1e-6 if dtype == torch.float64 else 2e-3
    torch.testing.assert_close(m, mr, rtol=tol, atol=tol)
    torch.testing.assert_close(v, vr, rtol=tol, atol=tol)


def test_the_seeded_solve_is_no_slower_and_gives_the_same_posterior():
    X, Y = _data(300, torch.float64)
    old = fit(PreconditionedSingleTaskGP(X[:295], Y[:295], **OPTIONS), maxiter=15)
    Xt = X[:4]
    with torch.no_grad():
        old.posterior(Xt)
    cold = PreconditionedSingleTaskGP(X, Y, **OPTIONS)
    for name in ("covar_module", "likelihood", "mean_module"):  # the same hyperparameters, no seed
        getattr(cold, name).load_state_dict(getattr(old, name).state_dict())
    warm = PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(old)
    (mc, vc), (mw, vw) = _posterior(cold, Xt), _posterior(warm, Xt)
    assert warm.alpha_iterations <= cold.alpha_iterations, (warm.alpha_iterations, cold.alpha_iterations)
    torch.testing.assert_close(mw, mc, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(vw, vc, rtol=1e-6, atol=1e-7)


def test_warm_fit_skips_the_subset_start_and_reaches_the_same_optimum():
    X, Y = _data(320, torch.float64)
    opts = {**OPTIONS, "fit_subset": 100}
    old = fit(PreconditionedSingleTaskGP(X[:300], Y[:300], **opts))
    cold = fit(PreconditionedSingleTaskGP(X, Y, **opts))
    warm = PreconditionedSingleTaskGP(X, Y, **opts).warm_start_from(old)
    fit(warm)
    assert not warm._gpnys_warm_fit  # one fit only: a later refit starts as usual
    # fewer full-data evaluations from the previous optimum than from BoTorch's initialisation
    assert warm.hook().builds < cold.hook().builds, (warm.hook().builds, cold.hook().builds)
    loss_cold, loss_warm = (float(-exact_mll(m)) for m in (cold, warm))
    assert abs(loss_warm - loss_cold) <= 5e-3 * abs(loss_cold), (loss_warm, loss_cold)
    # both at SingleTaskGP's Cholesky optimum (the cold fit's first L-BFGS-B run stops on its own short of it, on
    # these points, and a fresh run from there goes on: PreconditionedSingleTaskGP.custom_fit)
    loss_ref = float(-exact_mll(fit(SingleTaskGP(X, Y))))
    assert max(loss_cold, loss_warm) <= loss_ref + 5e-3 * abs(loss_ref), (loss_cold, loss_warm, loss_ref)


def test_fit_restarts_share_the_callers_iteration_budget():
    """The fresh L-BFGS-B runs after one that stopped on its own count against the caller's maxiter."""
    X, Y = _data(320, torch.float64)
    steps = []
    model = PreconditionedSingleTaskGP(X, Y, **OPTIONS)
    fit(model, optimizer_kwargs={"options": {"maxiter": 3},
                                 "callback": lambda params, result: steps.append(result.step)})
    assert 1 <= len(steps) <= 3 and model.fit_restarts <= 2


def test_condition_on_observations_seeds_the_new_solve():
    X, Y = _data(280, torch.float64)
    model = PreconditionedSingleTaskGP(X[:270], Y[:270], **OPTIONS)
    model.eval()
    with torch.no_grad():
        model.posterior(X[:2])
    new = model.condition_on_observations(X[270:], Y[270:])
    assert new._gpnys_seed is not None and new._gpnys_seed.shape == (280,)
    ref = SingleTaskGP(X, Y, outcome_transform=None)
    ref.load_state_dict({k: v for k, v in new.state_dict().items() if not k.startswith("outcome_transform")},
                        strict=False)
    Xt = torch.rand(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        mean = new.posterior(Xt).mean
        # the new data in the old model's outcome scale, as condition_on_observations appends them
        Yt = model.outcome_transform(Y)[0] if hasattr(model, "outcome_transform") else Y
        ref.set_train_data(new.train_inputs[0], Yt.squeeze(-1), strict=False)
        expected = ref.posterior(Xt).mean
        if hasattr(model, "outcome_transform"):
            expected = model.outcome_transform.untransform(expected)[0]
    torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-6)


def test_warm_start_refuses_nothing_it_cannot_use():
    """A previous model with other points (not a prefix) or a plain SingleTaskGP: hyperparameters only."""
    X, Y = _data(200, torch.float64)
    other = PreconditionedSingleTaskGP(X[50:150], Y[50:150], **OPTIONS)
    with torch.no_grad():
        other.posterior(X[:2])
    new = PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(other)
    assert new._gpnys_seed is None
    new2 = PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(SingleTaskGP(X[:100], Y[:100]))
    assert new2._gpnys_seed is None and new2._gpnys_warm_fit


def test_warm_start_is_reproducible():
    X, Y = _data(240, torch.float64)
    old = fit(PreconditionedSingleTaskGP(X[:230], Y[:230], **OPTIONS), maxiter=10)
    runs = []
    for _ in range(2):
        m = fit(PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(old), maxiter=10)
        runs.append(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.cuda
def test_warm_start_on_device(cuda_device):
    X, Y = _data(220, torch.float64)
    X, Y = X.to(cuda_device), Y.to(cuda_device)
    old = PreconditionedSingleTaskGP(X[:200], Y[:200], **OPTIONS)
    with torch.no_grad():
        old.posterior(X[:2])
    new = PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(old)
    assert new._gpnys_seed.device == X.device
    ref = SingleTaskGP(X, Y)
    ref.load_state_dict(new.state_dict())
    (m, v), (mr, vr) = _posterior(new, X[:5]), _posterior(ref, X[:5])
    torch.testing.assert_close(m, mr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(v, vr, rtol=1e-6, atol=1e-6)


def test_warm_state_round_trips_through_a_checkpoint(tmp_path):
    """``warm_state()`` saved and loaded seeds the next model exactly as the model itself does."""
    X, Y = _data(230, torch.float64)
    old = PreconditionedSingleTaskGP(X[:220], Y[:220], **OPTIONS)
    with torch.no_grad():
        old.posterior(X[:2])
    torch.save(old.warm_state(), tmp_path / "state.pt")
    from_model = PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(old)
    from_file = PreconditionedSingleTaskGP(X, Y, **OPTIONS).warm_start_from(torch.load(tmp_path / "state.pt"))
    assert torch.equal(from_model._gpnys_seed, from_file._gpnys_seed)
    for a, b in zip(from_model.parameters(), from_file.parameters()):
        assert torch.equal(a, b)
