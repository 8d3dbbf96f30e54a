"""The cost-aware path of ``auto`` (gpnys.gp.path): Cholesky where a calibrated cost model predicts it faster and it
fits the memory budget, the preconditioned path elsewhere; either forced by ``solver``; the choice and its reason in
``hook.last_estimate``. Costs are injected here, so that no test depends on this machine's timings."""

from __future__ import annotations

import json
import warnings

import gpytorch
import pytest
import torch

import gpnys
from gpnys.gp import ExactGPModel, calibration
from gpnys.gp import path as gpath
from gpnys.gp.path import PathCosts, choose_path
from gpnys.gp.settings import EstimatorSettings

#: the switch of these costs lies at n = 1000 (Cholesky n^3 1e-9 s, preconditioned n^2 1e-6 s)
COSTS = PathCosts(exact=(1e-9, 0.0), iterative=(1e-6, 0.0), sizes=((300, 600), (500, 1000)), key="test")


@pytest.fixture
def costs(monkeypatch):
    """``auto`` left to the cost model (the suite forces the preconditioned path), with :data:`COSTS` and no
    measurement near the switch (:func:`gpnys.gp.path.measure_exact`)."""
    monkeypatch.delenv("GPNYS_SOLVER", raising=False)
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: COSTS)
    monkeypatch.setattr(gpath, "_measurer", None)


def _model(n=200, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 3, generator=g, dtype=torch.float64)
    y = torch.sin(5 * X[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    X, y = X.to(dtype), y.to(dtype)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32", ard=True).to(dtype)
    model.likelihood.noise = 0.05
    return model, X, y


def _value_and_grads(model, X, y, hook=None, **kw):
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.train()
    model.zero_grad()
    if hook is None:
        with gpytorch.settings.max_cholesky_size(10**6):
            loss = -mll(model(X), y)
            loss.backward()
        h = None
    else:
        with gpnys.use_preconditioner(model, hook, **kw) as h:
            loss = -mll(model(X), y)
            loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}, h


def test_fit_recovers_the_cost_coefficients():
    for (u, v), (p, q) in (((3, 2), (2e-10, 3e-8)), ((2, 1), (1e-7, 4e-4))):
        sizes = (300, 600)
        times = tuple(p * n**u + q * n**v for n in sizes)
        fp, fq = gpath.fit_costs(sizes, times, (u, v))
        assert fp == pytest.approx(p, rel=1e-9) and fq == pytest.approx(q, rel=1e-6)
    # timing noise that makes the lower-order term negative: the leading term alone, through the larger size
    assert gpath.fit_costs((300, 600), (1.0, 1.5), (2, 1)) == (1.5 / 600**2, 0.0)
    # times that grow more slowly than n^2 (a negative leading term): the same
    assert gpath.fit_costs((500, 1000), (0.50, 0.55), (2, 1)) == (0.55 / 1000**2, 0.0)


def test_choose_path(costs):
    cpu, f64 = torch.device("cpu"), torch.float64
    assert choose_path(500, 1, cpu, f64, "auto", "auto")[0] == "cholesky"
    assert choose_path(2000, 1, cpu, f64, "auto", "auto")[0] == "iterative"
    assert choose_path(500, 1, cpu, f64, "iterative", "auto") == ("iterative", "settings.solver='iterative'")
    assert choose_path(5000, 1, cpu, f64, "cholesky", "afn")[0] == "cholesky"
    assert choose_path(500, 1, cpu, f64, "auto", "afn")[0] == "iterative"  # a named preconditioner
    path, reason = choose_path(500, 1, cpu, f64, "auto", "auto")
    assert "Cholesky" in reason and "test" in reason
    with gpnys.memory_budget(dense_bytes=gpath.DENSE_MATRICES * 500 * 500 * 8 - 1):  # its matrices no longer fit
        path, reason = choose_path(500, 1, cpu, f64, "auto", "auto")
        assert path == "iterative" and "memory budget" in reason
    # hysteresis: near the switch the current path is kept; far from it, left
    assert choose_path(1050, 1, cpu, f64, "auto", "auto", current="cholesky")[0] == "cholesky"
    assert choose_path(1050, 1, cpu, f64, "auto", "auto")[0] == "iterative"
    assert choose_path(2000, 1, cpu, f64, "auto", "auto", current="cholesky")[0] == "iterative"
    # the hook's own measurements: a preconditioned path 4x slower than predicted moves the switch up
    assert choose_path(2000, 1, cpu, f64, "auto", "auto", iterative_scale=4.0)[0] == "cholesky"


def test_a_process_group_takes_the_preconditioned_path_on_every_rank(costs, tmp_path):
    """Under a kernel group ``auto`` does not consult the ranks' own costs or timings (which could differ between
    ranks and send them down different paths); a forced path stays forced."""
    import torch.distributed as dist

    import gpnys.distributed as gd

    cpu, f64 = torch.device("cpu"), torch.float64
    path, reason = choose_path(500, 1, cpu, f64, "auto", "auto", partitioned=True)
    assert path == "iterative" and "process group" in reason
    assert choose_path(500, 1, cpu, f64, "cholesky", "auto", partitioned=True)[0] == "cholesky"
    model, X, y = _model()
    exact, _, _ = _value_and_grads(model, X, y)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        loss, _, hook = _value_and_grads(model, X, y, "auto", settings=gd.settings(solver="auto", probe_seed=0))
    finally:
        dist.destroy_process_group()
    est = hook.last_estimate
    assert est.path == "iterative" and "process group" in est.path_reason and hook.builds == 1
    assert hook.paths.iterative_scale == 1.0  # no timing feeds a per-rank decision
    assert abs(loss - exact) <= 4 * est.std_error / est.n


def test_solver_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="solver"):
        EstimatorSettings(solver="fast")
    monkeypatch.setenv("GPNYS_SOLVER", "cholesky")
    assert EstimatorSettings().solver == "cholesky"
    monkeypatch.setenv("GPNYS_SOLVER", "nonsense")
    with pytest.raises(ValueError, match="solver"):
        EstimatorSettings()


def test_auto_takes_cholesky_at_small_n_exactly(costs, dtype):
    model, X, y = _model(400, dtype=dtype)
    exact, g_exact, _ = _value_and_grads(model, X, y)
    loss, grads, hook = _value_and_grads(model, X, y, "auto")
    est = hook.last_estimate
    assert est.path == "cholesky" and est.std_error == 0.0 and "predicted" in est.path_reason
    assert hook.builds == 0 and hook.path == "cholesky"  # no preconditioner at all
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert loss == pytest.approx(exact, abs=tol) and est.value / est.n == pytest.approx(exact, abs=tol)
    for k in g_exact:
        torch.testing.assert_close(grads[k], g_exact[k], rtol=tol, atol=tol)


def test_auto_takes_the_preconditioned_path_above_the_switch(costs, monkeypatch):
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: PathCosts((1e-3, 0.0), (1e-9, 0.0),
                                                                             ((1, 2), (1, 2)), "test"))
    model, X, y = _model(400)
    exact, _, _ = _value_and_grads(model, X, y)
    loss, _, hook = _value_and_grads(model, X, y, "auto", settings=EstimatorSettings(probe_seed=0))
    est = hook.last_estimate
    assert est.path == "iterative" and hook.builds == 1 and est.std_error > 0
    assert abs(loss - exact) <= 4 * est.std_error / est.n
    assert hook.paths.iterative_scale != 1.0  # the hook timed its evaluation against the prediction


def test_forced_paths_and_named_preconditioners(costs):
    model, X, y = _model()
    _, _, hook = _value_and_grads(model, X, y, "auto", settings=EstimatorSettings(solver="iterative"))
    assert hook.last_estimate.path == "iterative"
    _, _, hook = _value_and_grads(model, X, y, "afn")
    assert hook.last_estimate.path == "iterative" and "names a preconditioner" in hook.last_estimate.path_reason
    _, _, hook = _value_and_grads(model, X, y, "afn", settings=EstimatorSettings(solver="cholesky"))
    assert hook.last_estimate.path == "cholesky"


def test_cholesky_path_names_every_gradient_error_bar(costs):
    """The Cholesky path's gradient standard errors are zeros under the names the preconditioned path gives."""
    model, X, y = _model()
    _, _, hook = _value_and_grads(model, X, y, "auto", settings=EstimatorSettings(solver="cholesky"))
    exact = hook.last_estimate.grad_std_error
    _, _, hook = _value_and_grads(model, X, y, "auto", settings=EstimatorSettings(solver="iterative"))
    iterative = hook.last_estimate.grad_std_error
    assert exact.keys() == iterative.keys() and len(exact) == 4
    assert all(bool((v == 0).all()) and v.shape == iterative[k].shape for k, v in exact.items())


def test_predictions_on_the_cholesky_path_are_gpytorchs(costs):
    model, X, y = _model()
    X_test = torch.rand(20, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with gpnys.use_preconditioner(model) as hook:
        mean, var = hook.predict(X_test)
    ref_mean, ref_var = gpnys.gp.predict(model, X_test)
    assert hook.variance_method_used == "cholesky" and bool((hook.variance_bound < 1e-12 * ref_var).all())
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(var, ref_var)


def test_batch_model_on_the_cholesky_path(costs):
    from test_batch_mode import B, N, _loss_and_grads
    from test_batch_mode import _model as batch_model

    model, X, y = batch_model("rbf", torch.float64)
    exact, g_exact, _ = _loss_and_grads(model, X, y)
    monkey_settings = EstimatorSettings()  # solver "auto" now that GPNYS_SOLVER is unset
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.zero_grad()
    with gpnys.use_preconditioner(model, settings=monkey_settings) as hook:
        loss = -mll(model(X), y)
        loss.sum().backward()
    assert [e.path for e in hook.batch_estimates] == ["cholesky"] * B
    torch.testing.assert_close(loss.detach(), exact)
    assert hook.last_estimate.n == B * N
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_exact[k])


@pytest.mark.parametrize("n", [1, 2, 50, 299])
def test_tiny_n_takes_cholesky_whatever_the_costs_say(costs, monkeypatch, n):
    """Below :data:`~gpnys.gp.path.CHOLESKY_BELOW` points ``auto`` takes Cholesky without the cost model (whose
    two-size fits can under-predict the preconditioned path there): no preconditioner, the exact loss."""
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: pytest.fail("the cost model was consulted"))
    cpu, f64 = torch.device("cpu"), torch.float64
    path, reason = choose_path(n, 1, cpu, f64, "auto", "auto")
    assert path == "cholesky" and f"below {gpath.CHOLESKY_BELOW}" in reason
    assert choose_path(n, 1, cpu, f64, "iterative", "auto")[0] == "iterative"  # a forced path is kept
    if n >= 2:
        model, X, y = _model(n)
        exact, _, _ = _value_and_grads(model, X, y)
        loss, _, hook = _value_and_grads(model, X, y, "auto")
        assert hook.builds == 0 and hook.last_estimate.path == "cholesky"
        assert loss == pytest.approx(exact, abs=1e-12)


@pytest.mark.parametrize("damage", [[2e-9], "ab", "12", [True, False], [float("nan"), 0.0], [-1.0, 0.0], [0.0, 0.0]])
def test_damaged_path_costs_are_calibrated_again(monkeypatch, tmp_path, damage):
    """A stored cost model that is not two finite, non-negative coefficients is not trusted: one warning, and the
    costs are calibrated again and rewritten."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpath, "_memo", {})
    monkeypatch.setattr(gpath, "calibrate", lambda device, dtype: COSTS)
    key = gpath.costs_key(torch.device("cpu"), torch.float64)
    entry = {"exact": damage, "iterative": [1e-6, 0.0], "sizes": [[300, 600], [500, 1000]]}
    gpath.cache_file().write_text(json.dumps({key: entry}))
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert gpath.path_costs("cpu", torch.float64) is COSTS
    assert json.loads(gpath.cache_file().read_text())[key]["exact"] == list(COSTS.exact)


def test_no_timing_or_calibration_where_cholesky_cannot_be_chosen(costs, monkeypatch):
    """Where Cholesky's working set exceeds the memory budget the preconditioned evaluations are not timed: the
    scale they would give is never read, and timing it would calibrate the cost model for nothing."""
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: pytest.fail("the cost model was consulted"))
    model, X, y = _model(400)
    with gpnys.memory_budget(dense_bytes=0):
        _, _, hook = _value_and_grads(model, X, y, "auto")
    assert hook.last_estimate.path == "iterative" and "memory budget" in hook.path_reason
    assert hook.paths.timings == 0 and hook.paths.iterative_scale == 1.0


def test_calibration_runs_under_the_default_budget(monkeypatch):
    """The path costs are cached for the whole machine, so they are timed under the device's default budget, not
    under the caller's ``memory_budget``."""
    from gpnys.budget import default_dense_bytes, dense_limit_bytes

    seen = []

    def fake_problem(n, device, dtype):
        seen.append(dense_limit_bytes(device))
        raise RuntimeError("stop")

    monkeypatch.setattr(calibration, "_problem", fake_problem)
    with gpnys.memory_budget(dense_bytes=0), pytest.raises(RuntimeError, match="stop"):
        calibration._time_path(300, torch.device("cpu"), torch.float64, "cholesky")
    assert seen == [default_dense_bytes(torch.device("cpu"))] and dense_limit_bytes() == default_dense_bytes()


def test_path_costs_are_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpath, "_memo", {})
    calls = []
    monkeypatch.setattr(gpath, "calibrate", lambda device, dtype: calls.append(1) or PathCosts(
        (1e-9, 0.0), (1e-6, 0.0), ((1, 2), (3, 4)), gpath.costs_key(torch.device(device), dtype)))
    first = gpath.path_costs("cpu", torch.float64)
    assert calls == [1] and gpath.cache_file().exists()
    assert gpath.path_costs("cpu", torch.float64) is first  # memory
    monkeypatch.setattr(gpath, "_memo", {})
    again = gpath.path_costs("cpu", torch.float64)  # disk: no second calibration
    assert calls == [1] and again.exact == first.exact and again.sizes == ((1, 2), (3, 4))
    gpath.cache_file().write_text("{not json")  # a corrupt cache is calibrated afresh and rewritten
    monkeypatch.setattr(gpath, "_memo", {})
    gpath.path_costs("cpu", torch.float64)
    assert calls == [1, 1] and json.loads(gpath.cache_file().read_text())
    # costs an older gpnys calibrated (stored under its key, without COSTS_VERSION) are not read
    from gpnys.cache import entry_key

    old = {entry_key(torch.device("cpu"), torch.float64): {"exact": [1.0, 0.0], "iterative": [1.0, 0.0],
                                                             "sizes": [[1, 2], [3, 4]]}}
    gpath.cache_file().write_text(json.dumps(old))
    monkeypatch.setattr(gpath, "_memo", {})
    assert gpath.path_costs("cpu", torch.float64).exact == (1e-9, 0.0) and calls == [1, 1, 1]
    assert gpath.costs_key(torch.device("cpu"), torch.float64).endswith(f":costs={gpath.COSTS_VERSION}")


def test_unwritable_cache_warns_once_and_keeps_the_costs(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(blocker / "sub"))  # a directory below a file cannot be made
    monkeypatch.setattr(gpath, "_memo", {})
    monkeypatch.setattr(gpath, "calibrate", lambda device, dtype: COSTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpath.path_costs("cpu", torch.float64) is COSTS
        assert gpath.path_costs("cpu", torch.float64) is COSTS
    assert sum("could not cache" in str(w.message) for w in caught) == 1


def test_calibration_fits_this_machine(monkeypatch, tmp_path):
    """A real (small) calibration: positive coefficients, Cholesky cheaper than the preconditioned path at
    n = 300 and dearer at n = 20 000 on the CPU."""
    monkeypatch.setattr(calibration, "_time_path", lambda n, device, dtype, solver, reps=2: (
        2e-10 * n**3 + 1e-7 * n**2 if solver == "cholesky" else 1.5e-7 * n**2 + 6e-4 * n))
    costs = gpath.calibrate("cpu", torch.float64)
    assert costs.exact[0] > 0 and costs.iterative[0] > 0
    assert costs.exact_s(300) < costs.iterative_s(300) and costs.exact_s(20_000) > costs.iterative_s(20_000)


def test_the_cholesky_measurement_refuses_bad_arguments():
    for n in (0, -5, 2.5, "400"):
        with pytest.raises(ValueError, match="n must"):
            calibration.measure_cholesky(n, "cpu", torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        calibration.measure_cholesky(100, "cpu", torch.int64)


def test_one_real_timing_runs():
    t = calibration._time_path(60, torch.device("cpu"), torch.float64, "cholesky", reps=1)
    assert 0 < t < 60


@pytest.mark.cuda
def test_cholesky_path_on_device(cuda_device, costs):
    model, X, y = _model()
    exact, _, _ = _value_and_grads(model, X, y)
    model, X, y = model.to(cuda_device), X.to(cuda_device), y.to(cuda_device)
    loss, grads, hook = _value_and_grads(model, X, y, "auto")
    assert hook.last_estimate.path == "cholesky"
    assert loss == pytest.approx(exact, abs=1e-10)


def test_bo_model_above_gpytorchs_threshold_asks_the_cost_model(costs):
    """``PreconditionedSingleTaskGP(max_cholesky_size=None)`` above GPyTorch's threshold: Cholesky where the cost
    model predicts it faster (here below n = 1000), the preconditioned path above; an int threshold, a forced
    solver and a named preconditioner are obeyed; the posterior on the Cholesky side is SingleTaskGP's to rounding."""
    botorch = pytest.importorskip("botorch")
    from gpnys.bo import PreconditionedSingleTaskGP

    g = torch.Generator().manual_seed(1)
    for n, expected in ((600, False), (1500, True)):
        X = torch.rand(n, 2, generator=g, dtype=torch.float64)
        Y = X.sum(-1, keepdim=True).sin()
        with gpytorch.settings.max_cholesky_size(100):
            model = PreconditionedSingleTaskGP(X, Y)
            assert model.uses_preconditioner() is expected, model.path_reason
            assert "predicted" in model.path_reason
            assert PreconditionedSingleTaskGP(X, Y, max_cholesky_size=100).uses_preconditioner()
            forced = PreconditionedSingleTaskGP(X, Y, settings=EstimatorSettings(solver="iterative"))
            assert forced.uses_preconditioner() and "solver" in forced.path_reason
            named = PreconditionedSingleTaskGP(X, Y, precond="afn")  # as in the hook: the preconditioned path
            assert named.uses_preconditioner() and "names a preconditioner" in named.path_reason
            if not expected:
                ref = botorch.models.SingleTaskGP(X, Y)
                ref.load_state_dict(model.state_dict())
                Xt = torch.rand(7, 2, generator=g, dtype=torch.float64)
                with torch.no_grad():
                    a, b = model.posterior(Xt), ref.posterior(Xt)
                torch.testing.assert_close(a.mean, b.mean, rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(a.variance, b.variance, rtol=1e-9, atol=1e-9)


def _overestimating_costs():
    """Cholesky predicted 4.6875e-9 n^3 s (0.3 s at n = 400, where it takes milliseconds: a latency-bound GPU's
    extrapolation), the preconditioned path 6.25e-9 n^2 s (1 ms, so that a hook's first evaluation takes it; it
    takes tenths of a second, within PROBE_FACTOR of Cholesky's prediction, so the hook has Cholesky measured)."""
    return PathCosts(exact=(4.6875e-9, 0.0), iterative=(6.25e-9, 0.0), sizes=((1, 2), (1, 2)), key="test-probe")


def test_cholesky_is_measured_near_the_switch_once_per_span(monkeypatch, tmp_path):
    """Where the predictions lie within PROBE_FACTOR and the caller measured its own preconditioned cost, Cholesky
    is measured at that size; the measurement scales the cubic within MEASURED_SPAN of it (no second measurement
    there), is cached on disk with the costs, and moves the decision; far from the switch, or for a caller that
    measured nothing, nothing is measured."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPNYS_SOLVER", raising=False)
    costs = _overestimating_costs()
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: costs)
    calls = []
    monkeypatch.setattr(gpath, "_measurer", lambda n, device, dtype: calls.append(n) or 0.01)
    cpu, f64 = torch.device("cpu"), torch.float64
    timed = {"iterative_scale": 100.0}  # the caller's preconditioned evaluations took 0.1 s at n = 400
    assert choose_path(400, 1, cpu, f64, "auto", "auto", **timed)[0] == "iterative" and calls == []
    path, reason = choose_path(400, 1, cpu, f64, "auto", "auto", measure=True, **timed)
    assert calls == [400] and path == "cholesky" and "measured at n = 400" in reason
    assert costs.exact_s(400) == pytest.approx(0.01) and costs.exact_s(700) == pytest.approx(0.01 * (700 / 400) ** 3)
    assert choose_path(700, 1, cpu, f64, "auto", "auto", measure=True, **timed)[0] == "cholesky" and calls == [400]
    assert choose_path(2, 1, cpu, f64, "auto", "auto", measure=True, **timed)[0] == "cholesky" and calls == [400]
    stored = json.loads(gpath.cache_file().read_text())["test-probe"]
    assert stored["measured"] == {"400": 0.01}
    monkeypatch.setattr(gpath, "_memo", {})
    monkeypatch.undo()  # path_costs reads the cache file back, with the measurement
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpath, "costs_key", lambda device, dtype: "test-probe")
    monkeypatch.setattr(gpath, "_memo", {})
    again = gpath.path_costs("cpu", torch.float64)
    assert again.measured == {400: 0.01} and again.exact_s(400) == pytest.approx(0.01)
    real = gpath.path_costs
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: again)
    # a caller that measured nothing of its own decides by the cubic alone: a measured Cholesky set against an
    # unmeasured preconditioned prediction would lean to Cholesky
    path, reason = choose_path(400, 1, cpu, f64, "auto", "auto", **timed)
    assert path == "iterative" and "measured" not in reason
    # damaged measurements in the cache file are dropped, not trusted (a size 0 made every choice raise)
    stored = json.loads(gpath.cache_file().read_text())
    stored["test-probe"]["measured"] = {"0": 1.0, "-3": 1.0, "500": "nan", "600": -1, "x": 2, "700": 0.5}
    gpath.cache_file().write_text(json.dumps(stored))
    monkeypatch.setattr(gpath, "_memo", {})
    monkeypatch.setattr(gpath, "path_costs", real)
    assert gpath.path_costs("cpu", torch.float64).measured == {700: 0.5}


def test_two_processes_measuring_at_once_keep_both_measurements(monkeypatch, tmp_path):
    """Two processes read the same cost entry, then each measures Cholesky at its own size: the second write keeps
    the first's measurement (it was lost when each wrote its whole entry)."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpath, "_measurer", lambda n, device, dtype: n * 1e-5)
    first, second = _overestimating_costs(), _overestimating_costs()  # both as read before either measured
    assert gpath.measure_exact(first, 400, torch.device("cpu"), torch.float64)
    assert gpath.measure_exact(second, 2000, torch.device("cpu"), torch.float64)
    stored = json.loads(gpath.cache_file().read_text())["test-probe"]
    assert stored["measured"] == {"400": 0.004, "2000": 0.02}
    assert second.measured == {2000: 0.02}  # this process's own copy is its own until it reads the file again


def _timed_at(monkeypatch, scale):
    """Every timing of the preconditioned path reads as ``scale`` times the cost model's prediction (the hook's and
    the BoTorch model's), so that no decision rests on this machine's speed."""
    monkeypatch.setattr(gpath, "measured_scale", lambda seconds, n, batch, device, dtype: scale)
    try:
        import gpnys.bo.model as bo_model
    except ImportError:  # no BoTorch
        return
    monkeypatch.setattr(bo_model, "measured_scale", lambda seconds, n, batch, device, dtype: scale)


def _evaluations(model, X, y, count=3, **settings):
    """``count`` value + gradient evaluations in one ``auto`` hook: their paths and reasons, and the last one's loss
    and gradients."""
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.train()
    paths = []
    with gpnys.use_preconditioner(model, "auto", settings=EstimatorSettings(probe_seed=0, **settings)) as hook:
        for _ in range(count):
            model.zero_grad()
            loss = -mll(model(X), y)
            loss.backward()
            paths.append((hook.path, hook.path_reason))
    return paths, float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}, hook


def test_a_measured_cholesky_takes_the_exact_path_where_the_cubic_overestimated(monkeypatch, tmp_path, dtype):
    """The hook's first two evaluations are preconditioned and timed (the first holds one-off costs); Cholesky,
    measured then at n = 400 (one value + gradient on the calibration's problem), takes well under its predicted
    0.3 s, and the third evaluation is Cholesky's, exactly. A BoTorch model's one-off decision measures nothing."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPNYS_SOLVER", raising=False)
    costs = _overestimating_costs()
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: costs)
    _timed_at(monkeypatch, 100.0)  # the preconditioned path takes 0.1 s: Cholesky's 0.3 s is within PROBE_FACTOR
    model, X, y = _model(n=400, dtype=dtype)
    exact, g_exact, _ = _value_and_grads(model, X, y)
    paths, loss, grads, hook = _evaluations(model, X, y)
    assert [p for p, _ in paths[:2]] == ["iterative", "iterative"] and hook.paths.timings == 2
    assert paths[2][0] == "cholesky" and "measured at n = 400" in paths[2][1], paths
    assert 0 < costs.measured[400] < 0.3
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert loss == pytest.approx(exact, abs=tol)
    for k in g_exact:
        torch.testing.assert_close(grads[k], g_exact[k], rtol=tol, atol=tol)
    costs.measured.clear()
    with torch.inference_mode():  # a caller deciding without gradients still measures with one
        path = choose_path(400, 1, X.device, dtype, "auto", "auto", iterative_scale=100.0, measure=True)[0]
    assert path == "cholesky" and 0 < costs.measured[400] < 0.3
    costs.measured.clear()
    pytest.importorskip("botorch")
    from gpnys.bo import PreconditionedSingleTaskGP

    with gpytorch.settings.max_cholesky_size(100):
        bo = PreconditionedSingleTaskGP(X.double(), X[:, :1].sin().double())
        assert bo.uses_preconditioner() and "Cholesky measured" not in bo.path_reason and not costs.measured


def test_a_bo_fit_decides_again_after_one_timed_evaluation(monkeypatch, tmp_path):
    """PreconditionedSingleTaskGP(max_cholesky_size=None) decides before any evaluation, from the calibration alone
    (here the preconditioned path); its fit times the preconditioned path, has Cholesky measured at n = 400,
    turns to Cholesky and fits as SingleTaskGP does, to the same hyperparameters. Far from the switch it spends no
    evaluation on it."""
    botorch = pytest.importorskip("botorch")
    from botorch.fit import fit_gpytorch_mll

    from gpnys.bo import PreconditionedSingleTaskGP

    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPNYS_SOLVER", raising=False)
    # Cholesky predicted 0.3 s, the preconditioned path 0.1 s; timed at 0.3 s
    costs = PathCosts(exact=(4.6875e-9, 0.0), iterative=(6.25e-7, 0.0), sizes=((1, 2), (1, 2)), key="test-bo")
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: costs)
    _timed_at(monkeypatch, 3.0)
    g = torch.Generator().manual_seed(1)
    X = torch.rand(400, 2, generator=g, dtype=torch.float64)
    Y = (3 * X).sin().sum(-1, keepdim=True)
    with gpytorch.settings.max_cholesky_size(100):
        model = PreconditionedSingleTaskGP(X, Y)
        assert model.uses_preconditioner()
        torch.manual_seed(0)  # BoTorch's fit draws its retries' start values from the global generator
        fit_gpytorch_mll(gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model))
        assert not model.uses_preconditioner(), model.path_reason
        reason = model.path_reason
        assert "Cholesky measured at n = 400" in reason and "after timing the preconditioned path" in reason
        ref = botorch.models.SingleTaskGP(X, Y)
        torch.manual_seed(0)
        fit_gpytorch_mll(gpytorch.mlls.ExactMarginalLogLikelihood(ref.likelihood, ref))
        torch.testing.assert_close(model.covar_module.lengthscale, ref.covar_module.lengthscale, rtol=1e-6, atol=0)
        torch.testing.assert_close(model.likelihood.noise, ref.likelihood.noise, rtol=1e-6, atol=0)
        costs.measured = {}
        named = PreconditionedSingleTaskGP(X, Y, precond="afn")  # a named preconditioner: nothing timed or measured
        assert named.uses_preconditioner()
        assert not named._cholesky_after_timing(gpytorch.mlls.ExactMarginalLogLikelihood(named.likelihood, named))
        assert not costs.measured and "names a preconditioner" in named.path_reason, named.path_reason
        costs.exact, costs.measured = (1.0, 0.0), {}  # Cholesky 6.4e7 s: far from the switch
        far = PreconditionedSingleTaskGP(X, Y)
        assert far.uses_preconditioner()
        assert not far._cholesky_after_timing(gpytorch.mlls.ExactMarginalLogLikelihood(far.likelihood, far))
        assert not costs.measured and "after timing" not in far.path_reason


def test_the_preconditioned_path_is_timed_once_where_cholesky_is_predicted_a_little_faster(monkeypatch, tmp_path):
    """Cholesky predicted 0.5 s and the preconditioned path 0.75 s at n = 400 (the calibration's problem far harder than
    this one): the hook's first two training evaluations time the preconditioned path (tenths of a second), also
    without error bars; Cholesky is then measured (5 s, injected) and the preconditioned path kept, within its error
    bars of the exact loss. A prediction, or Cholesky predicted more than twice as fast, times nothing."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPNYS_SOLVER", raising=False)
    costs = PathCosts(exact=(0.5 / 400**3, 0.0), iterative=(0.75 / 400**2, 0.0), sizes=((1, 2), (1, 2)), key="probe")
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: costs)
    monkeypatch.setattr(gpath, "_measurer", lambda n, device, dtype: 5.0)
    _timed_at(monkeypatch, 0.2)  # the preconditioned path takes 0.15 s
    model, X, y = _model(n=400)
    exact, _, _ = _value_and_grads(model, X, y)
    paths, loss, _, hook = _evaluations(model, X, y)
    assert paths[0][0] == "iterative" and paths[0][1].startswith("timing the preconditioned path"), paths
    assert paths[1][0] == "iterative" and "0.15 s preconditioned" in paths[1][1], paths  # now predicted faster
    assert paths[2][0] == "iterative" and "measured at n = 400" in paths[2][1], paths
    assert abs(loss - exact) <= 4 * hook.last_estimate.std_error / 400
    costs.measured.clear()
    paths, _, _, hook = _evaluations(model, X, y, error_bars=False)  # GPyTorch's own CG under the hook: timed too
    assert hook.paths.timings == 3 and "measured at n = 400" in paths[2][1], paths
    costs.measured.clear()
    chooser = gpath.PathChooser("auto", "auto", lambda: (400, 1, torch.device("cpu"), torch.float64))
    assert chooser.choose()[0] == "cholesky"  # a prediction's choice
    costs.iterative = (2.5 / 400**2, 0.0)
    assert chooser.choose(training=True)[0] == "cholesky"  # 2.5x: beyond ITERATIVE_PROBE_FACTOR


@pytest.mark.cuda
def test_measured_cholesky_on_device(cuda_device, monkeypatch, tmp_path):
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GPNYS_SOLVER", raising=False)
    costs = _overestimating_costs()
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: costs)
    _timed_at(monkeypatch, 100.0)
    model, X, y = _model(n=400)
    exact, _, _ = _value_and_grads(model, X, y)
    model, X, y = model.to(cuda_device), X.to(cuda_device), y.to(cuda_device)
    paths, loss, _, _ = _evaluations(model, X, y)
    assert [p for p, _ in paths] == ["iterative", "iterative", "cholesky"] and 0 < costs.measured[400] < 0.3
    assert loss == pytest.approx(exact, abs=1e-10)


def test_the_hooks_timing_covers_the_backward_pass(costs, monkeypatch):
    """The cost model predicts a value and its gradient, so a timed evaluation runs from its start to the end of the
    backward pass through its output; an evaluation without a backward (``no_grad``) is not counted."""
    import time

    seen = []
    monkeypatch.setattr(gpath, "measured_scale", lambda seconds, *problem: seen.append(seconds) or 1.0)
    chooser = gpath.PathChooser("auto", "auto", lambda: (400, 1, torch.device("cpu"), torch.float64))

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.2)
            return 2 * g

    x = torch.ones((), dtype=torch.float64, requires_grad=True)
    with chooser.timed() as stamp:
        out = stamp(SlowBackward.apply(x))
    assert seen == []  # not before the backward
    (3 * out).backward()
    assert len(seen) == 1 and seen[0] >= 0.2 and chooser.timings == 1 and float(x.grad) == 6.0
    with torch.no_grad(), chooser.timed() as stamp:
        stamp(SlowBackward.apply(x))
    assert len(seen) == 1 and chooser.timings == 1


@pytest.mark.parametrize("error_bars", [True, False])
def test_the_record_follows_a_switch_to_the_preconditioned_path(costs, error_bars):
    """Cholesky at first, then the preconditioned path once Cholesky no longer fits the memory budget: the last
    estimate describes the second evaluation, also without error bars (GPyTorch's own estimator: NaN standard
    errors). It had kept the Cholesky evaluation's value, path and reason, with a standard error of 0."""
    import math

    model, X, y = _model(n=400)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpnys.use_preconditioner(model, settings=EstimatorSettings(error_bars=error_bars, probe_seed=0)) as hook:
        (-mll(model(X), y)).backward()
        assert hook.last_estimate.path == "cholesky"
        with gpnys.memory_budget(dense_bytes=1 << 20):  # Cholesky's matrices no longer fit
            loss = float(-mll(model(X), y))
        est = hook.last_estimate
    assert hook.path == est.path == "iterative" and est.path_reason == hook.path_reason
    assert "memory budget" in est.path_reason and abs(est.value / 400 - loss) < 1e-12
    assert math.isnan(est.std_error) != error_bars


def test_a_slow_cholesky_of_its_own_has_the_preconditioned_path_timed(monkeypatch):
    """The cost model predicts Cholesky 50x faster than the preconditioned path, so auto takes it; the hook times its
    own warm Cholesky evaluations, and where they come within MEASURED_PROBE_FACTOR of the preconditioned
    prediction it times that path (a noisy calibration had kept a caller at n = 3 000 on a Cholesky twice as slow
    for good). A Cholesky well below it keeps the path."""
    monkeypatch.delenv("GPNYS_SOLVER", raising=False)
    costs = PathCosts(exact=(0.01 / 400**3, 0.0), iterative=(0.5 / 400**2, 0.0), sizes=((1, 2), (1, 2)), key="seen")
    monkeypatch.setattr(gpath, "path_costs", lambda device, dtype: costs)
    monkeypatch.setattr(gpath, "_measurer", None)
    model, X, y = _model(n=400)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    model.train()
    with gpnys.use_preconditioner(model, "auto", settings=EstimatorSettings(probe_seed=0)) as hook:
        for _ in range(2):
            (-mll(model(X), y)).backward()
            assert hook.path == "cholesky"
        paths = hook.paths
        assert paths.exact_timings == 2 and 0 < paths.exact_seconds[0] < 0.5 / gpath.MEASURED_PROBE_FACTOR
        for seen, expected in ((0.1, "cholesky"), (0.2, "iterative")):
            paths.exact_seconds = (seen, paths.exact_seconds[1])
            (-mll(model(X), y)).backward()
            assert hook.path == expected, hook.path_reason
    assert "Cholesky took 0.2 s here" in hook.path_reason
