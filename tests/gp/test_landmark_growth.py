"""AFN's landmarks grow with the CG iterations where the kernel is recomputed on the fly
(``EstimatorSettings.grow_landmarks``): ``k`` doubles after an evaluation that needed that many iterations, up to
``MAX_GROWTH`` times the default, half of ``n`` and the memory budget; a stored kernel, Nyström's choice and a
``k`` the caller set never grow; every grown step stays within its error bars of Cholesky."""

from __future__ import annotations

import copy

import gpytorch
import pytest
import torch

import gpnys
import gpnys.gp.preconditioners as preconditioners
from gpnys.gp import ExactGPModel
from gpnys.gp import settings as gp_settings
from gpnys.gp.preconditioners import MAX_GROWTH, PreconditionerCache
from gpnys.gp.settings import EstimatorSettings
from gpnys.precond.cache import PointCache

N = 400


@pytest.fixture
def small_defaults(monkeypatch):
    """AFN's default landmark count 20 instead of 500, so that growth fits in a few hundred points."""
    for name in ("afn", "auto"):
        monkeypatch.setitem(gp_settings.GP_DEFAULTS, name, {"k": 20, "w": 10})


def _points(n, seed=1):
    X = 4 * torch.rand(n, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
    return PointCache(X), kernel, torch.tensor(1e-3, dtype=torch.float64)


def test_the_cache_doubles_k_until_its_bounds():
    points, kernel, noise = _points(400)
    cache = PreconditionerCache("afn", {"k": 20, "w": 10}, grow_landmarks=10)
    assert cache.get(points, kernel, noise)[0].rank == 20
    cache.observe(9, recomputed=True)  # too few iterations
    cache.observe(30, recomputed=False)  # a stored kernel: an iteration is cheap against a build
    assert cache.growths == [] and cache.get(points, kernel, noise)[0].rank == 20 and len(cache.history) == 1
    ranks = []
    for iterations in (20, 16, 12, 11):  # each grown k's trial needs fewer iterations than the evaluation before
        cache.observe(iterations, recomputed=True)
        ranks.append(int(cache.get(points, kernel, noise)[0].rank))  # rebuilt at the same hyperparameters
    assert ranks == [40, 80, 80, 80] and cache.growths == [40, 80] and MAX_GROWTH * 20 == 80
    assert [r.rank for r in cache.history] == [20, 40, 80] and not cache.growth_stopped


def test_a_growth_that_does_not_lower_the_iterations_is_undone():
    points, kernel, noise = _points(400)
    cache = PreconditionerCache("afn", {"k": 20, "w": 10}, grow_landmarks=10)
    cache.get(points, kernel, noise)
    cache.observe(20, recomputed=True)
    assert cache.get(points, kernel, noise)[0].rank == 40
    cache.observe(21, recomputed=True)  # the trial: no fewer iterations at 40 landmarks
    assert cache.growth_stopped and cache.growths == [40, 20]
    assert cache.get(points, kernel, noise)[0].rank == 20
    cache.observe(50, recomputed=True)  # stopped for good on these points
    assert cache.get(points, kernel, noise)[0].rank == 20 and [r.rank for r in cache.history] == [20, 40, 20]


def test_growth_stops_at_half_of_n_and_at_the_memory_budget(monkeypatch):
    points, kernel, noise = _points(100)
    for fits, growths in ((None, [40, 50]), (2 * 8 * 100 * 30, [30])):  # half of n = 100; the budget holds k <= 30
        if fits is not None:
            monkeypatch.setattr(preconditioners, "default_dense_bytes", lambda device: fits)
        cache = PreconditionerCache("afn", {"k": 20, "w": 10}, grow_landmarks=1)
        for iterations in (9, 8, 7, 6):
            cache.get(points, kernel, noise)
            cache.observe(iterations, recomputed=True)
        assert cache.growths == growths and not cache.growth_stopped


def test_an_override_after_growth_gets_the_landmarks_it_asks_for():
    """A stronger preconditioner for posterior solves (``options={"k": ...}``) after growth: its own ``k``, not the
    training slot's grown count."""
    points, kernel, noise = _points(400)
    cache = PreconditionerCache("auto", {"k": 20, "w": 10}, grow_landmarks=1)
    assert cache.get(points, kernel, noise)[0].choice == "afn"
    cache.observe(9, recomputed=True)
    assert cache.get(points, kernel, noise)[0].rank == 40
    P = cache.get(points, kernel, noise, options={"k": 100})[0]
    assert P.choice == "afn" and P.rank == 100 and cache.get(points, kernel, noise)[0].rank == 40


def test_a_reused_preconditioner_does_not_grow():
    """A stale preconditioner (``reuse_tolerance``) needs more iterations as the hyperparameters move away from its
    build: that is a reason to rebuild it, not to grow it."""
    points, kernel, noise = _points(400)
    cache = PreconditionerCache("afn", {"k": 20, "w": 10}, grow_landmarks=10, reuse_tolerance=0.2)
    P = cache.get(points, kernel, noise)[0]
    cache.observe(12, recomputed=True)  # a fresh build's evaluation: grows
    assert cache.growths == [40]
    Q = cache.get(points, kernel, noise)[0]
    cache.observe(8, recomputed=True)  # the trial: fewer iterations, kept
    kernel.base_kernel.lengthscale = 1.05 * kernel.base_kernel.lengthscale.detach()
    assert cache.get(points, kernel, noise)[0] is Q and cache.stale and Q is not P
    cache.observe(30, recomputed=True)
    assert cache.growths == [40] and cache.get(points, kernel, noise)[0].rank == 40


def test_nystrom_and_other_preconditioners_do_not_grow():
    points, kernel, _ = _points(1000)
    kernel.base_kernel.lengthscale = 3.0  # a smooth kernel at noise 0.1: Algorithm 5 picks Nyström below k = 100
    noise = torch.tensor(0.1, dtype=torch.float64)
    for method, options, kind in (("auto", {"k": 100, "w": 10}, "nystrom"), ("fsai", {"w": 10}, "fsai")):
        cache = PreconditionerCache(method, options, grow_landmarks=1)
        P = cache.get(points, kernel, noise)[0]
        cache.observe(50, recomputed=True)
        assert cache.history[0].kind == kind and P.rank < 100, (method, P.rank)
        assert cache.growths == [] and cache.get(points, kernel, noise)[0] is P, method


def _model(dtype, n=N):
    g = torch.Generator().manual_seed(0)
    X = 3 * torch.rand(n, 2, generator=g, dtype=torch.float64)
    y = torch.sin(2 * X[:, 0]) + X[:, 1] + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    model = ExactGPModel(X.to(dtype), y.to(dtype), gpytorch.likelihoods.GaussianLikelihood(),
                         kernel="matern32").to(dtype)
    model.likelihood.noise = 1e-4  # AFN needs 8 CG iterations at k = 20, 6 at 40, 5 at 80 (float64)
    return model, X.to(dtype), y.to(dtype)


def _fit(model, X, y, steps, explicit=None, dense_bytes=0, method="afn", **settings):
    """Adam steps under the hook with the kernel on the fly (``dense_bytes=0``); per step the loss, its standard
    error, the preconditioner's rank, and Cholesky's loss in float64 at the same hyperparameters."""
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    settings = EstimatorSettings(solver="iterative", probe_seed=0, **settings)
    rows, states = [], []
    options = {} if explicit is None else {"k": explicit}
    with gpnys.memory_budget(dense_bytes=dense_bytes), \
            gpnys.use_preconditioner(model, method, settings=settings, **options) as hook:
        for _ in range(steps):
            opt.zero_grad()
            loss = -mll(model(X), y)
            loss.backward()
            est = hook.last_estimate
            rows.append((float(loss.detach()), est.std_error / est.n, hook.history[-1].rank, hook.history[-1].kind))
            states.append({k: v.clone() for k, v in model.state_dict().items()})
            opt.step()
    exact = copy.deepcopy(model).double()
    exact_mll = gpytorch.mlls.ExactMarginalLogLikelihood(exact.likelihood, exact)
    out = []
    for row, state in zip(rows, states):
        exact.load_state_dict({k: v.double() for k, v in state.items()})
        with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6), \
                gpytorch.settings.fast_computations(log_prob=False):
            out.append((*row, float(-exact_mll(exact(X.double()), y.double()))))
    return out, hook


def _grew(rows, cache):
    """The ranks of a fit's builds follow the cache's growths: 20 first, then each growth (an undone one goes back
    and stops growth for good)."""
    ranks = [r[2] for r in rows]
    assert ranks[0] == 20 and max(ranks) > 20, ranks
    changes = [b for a, b in zip(ranks, ranks[1:]) if b != a]
    # the last evaluation's decision (a growth, or one undone) shows only in the next build
    assert cache.growths[: len(changes)] == changes and len(cache.growths) <= len(changes) + 1, (ranks, cache.growths)
    ks = [20, *cache.growths]
    assert cache.growth_stopped == any(b < a for a, b in zip(ks, ks[1:])), (ks, cache.growth_stopped)
    assert set(ks) <= {20, 40, 80}


def test_a_fit_on_the_fly_grows_k_and_every_step_stays_within_its_error_bars(small_defaults, dtype):
    model, X, y = _model(dtype)
    rows, hook = _fit(model, X, y, steps=4, grow_landmarks=2)
    _grew(rows, hook.preconditioners)
    rounding = 0.0 if dtype == torch.float64 else 1e-4
    for loss, se, _, _, exact in rows:
        assert abs(loss - exact) <= 4 * se + rounding, (loss, exact, se)


def test_auto_grows_its_afn_branch_and_keeps_its_switch(small_defaults):
    """``auto``'s ``k`` is also Algorithm 5's Nyström / AFN switch: growth gives its AFN branch more landmarks
    (``afn_k``) and leaves the switch, so the grown builds stay AFN."""
    model, X, y = _model(torch.float64)
    rows, hook = _fit(model, X, y, steps=3, method="auto", grow_landmarks=2)
    _grew(rows, hook.preconditioners)
    assert {r[3] for r in rows} == {"afn"}, rows
    cache = hook.preconditioners
    assert cache.training_options["k"] == 20 and cache.training_options["afn_k"] == cache.growths[-1]
    assert "afn_k" not in cache.options  # an override of the options starts from the caller's
    for loss, se, _, _, exact in rows:
        assert abs(loss - exact) <= 4 * se, (loss, exact, se)


def test_a_stored_kernel_an_explicit_k_or_growth_off_keep_k(small_defaults):
    # a stored kernel with either backend (Triton's computes a cutoff plan to weigh against the stored kernel)
    for kwargs in ({"dense_bytes": None, "grow_landmarks": 2},
                   {"dense_bytes": None, "grow_landmarks": 2, "kernel_backend": "triton"},
                   {"explicit": 20, "grow_landmarks": 2},
                   {"explicit": 20, "method": "auto", "grow_landmarks": 2}, {"grow_landmarks": None}):
        model, X, y = _model(torch.float64)
        rows, hook = _fit(model, X, y, steps=2, **kwargs)
        assert [r[2] for r in rows] == [20, 20] and hook.preconditioners.growths == [], kwargs


def test_growth_is_reproducible(small_defaults):
    runs = [_fit(*_model(torch.float64), steps=3, grow_landmarks=2)[0] for _ in range(2)]
    assert runs[0] == runs[1] and max(r[2] for r in runs[0]) > 20


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "15"])
def test_bad_grow_landmarks_is_a_value_error(bad):
    with pytest.raises(ValueError, match="grow_landmarks"):
        EstimatorSettings(grow_landmarks=bad)


@pytest.mark.cuda
def test_growth_on_device(small_defaults, cuda_device):
    model, X, y = _model(torch.float64)
    model, X, y = model.to(cuda_device), X.to(cuda_device), y.to(cuda_device)
    rows, hook = _fit(model, X, y, steps=3, grow_landmarks=2)
    _grew(rows, hook.preconditioners)
    for loss, se, _, _, exact in rows:
        assert abs(loss - exact) <= 4 * se, (loss, exact, se)
