"""gpnys.gp.problem: the training problem on its own (no interception): its system against the dense K̂, its
preconditioner, its data sync and bad input; and the hook's read-only view of it."""

import gpytorch
import pytest
import torch

from gpnys.gp.hook import PreconditionerHook
from gpnys.gp.problem import TrainingProblem
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel
from tests.helpers import points


def _model(n=120, dtype=torch.float64, seed=0):
    X = points(n, d=2, dtype=dtype, seed=seed)
    y = torch.sin(4 * X[:, 0]) + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    m = ExactGPModel(X, y, lik, kernel="matern32").to(dtype)
    m.covar_module.base_kernel.lengthscale = 0.4
    m.covar_module.outputscale = 1.3
    lik.noise = 0.05
    return m, X, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_system_is_the_dense_training_covariance(dtype):
    m, X, _ = _model(dtype=dtype)
    problem = TrainingProblem(m, "afn", EstimatorSettings(), 0, {"k": 30, "w": 10}, X)
    A, M = problem.system(X)
    V = torch.randn(X.shape[0], 3, generator=torch.Generator().manual_seed(1), dtype=dtype)
    with torch.no_grad():
        K_hat = m.covar_module(X).to_dense() + 0.05 * torch.eye(X.shape[0], dtype=dtype)
    tol = 1e-8 if dtype == torch.float64 else 1e-4  # the expanded distance form: ~1e-10 in float64
    assert torch.allclose(A(V), K_hat @ V, rtol=tol, atol=tol)
    # M is P̂⁻¹ of the preconditioner P of K + μI (μ = σ²/s²): P̂ = s² P, and AFN's P is an approximation of it
    P, s2 = problem.preconditioner()
    assert float(s2) == pytest.approx(1.3, rel=1e-5)
    assert problem.builds == 1 and problem.history[-1].kind == "afn"
    rel = float(torch.linalg.matrix_norm(M(K_hat) - torch.eye(X.shape[0], dtype=dtype)) / X.shape[0] ** 0.5)
    assert rel < 0.5  # a useful preconditioner: P̂⁻¹ K̂ near the identity


def test_same_seed_same_preconditioner_and_sync_follows_new_data():
    m, X, y = _model()
    a = TrainingProblem(m, "auto", EstimatorSettings(), 3, {}, X)
    b = TrainingProblem(m, "auto", EstimatorSettings(), 3, {}, X)
    R = torch.randn(X.shape[0], 2, generator=torch.Generator().manual_seed(2), dtype=X.dtype)
    assert torch.equal(a.system(X)[1](R), b.system(X)[1](R))
    assert not a.sync_data()
    X2, y2 = X[:80].clone(), y[:80].clone()
    m.set_train_data(X2, y2, strict=False)
    assert a.sync_data() and a.train_x.shape == (80, 2) and a.warm_start is None


def test_bad_input_names_the_argument():
    m, X, _ = _model()
    with pytest.raises(ValueError, match="train_inputs"):
        TrainingProblem(m, "auto", EstimatorSettings(), 0, {}, torch.full_like(X, float("nan")))
    with pytest.raises(ValueError, match="k"):
        TrainingProblem(m, "afn", EstimatorSettings(), 0, {"k": 10 * X.shape[0]}, X)


def test_the_hook_reads_the_problem_and_cannot_write_it():
    m, X, _ = _model()
    hook = PreconditionerHook(m, "auto")
    assert hook.train_x is hook.problem.train_x and hook.builds == 0 and hook.last_estimate is None
    with pytest.raises(AttributeError, match="read-only"):
        hook.last_estimate = None
    with pytest.raises(AttributeError):
        hook.no_such_member
