"""``hook.predict`` at its edges, against GPyTorch's exact prediction (Cholesky, float64 where the dtype allows):
learnt additional noise on known noise, Cholesky variances without a cached kernel, batch-mode models, an
outputscale of 0, ``test_x`` shapes and bad values, and the attributes that describe the latest call."""

import gpytorch
import pytest
import torch

from gpnys import use_preconditioner
from gpnys.checks import HyperparameterError
from gpnys.gp import ExactGPModel
from gpnys.gp.settings import EstimatorSettings

N = 300
SOLVERS = ["cholesky", "iterative"]
# the means and variances, relative to the reference's largest: float64 PCG at variance_tolerance 1e-8 and the
# exact path agree to ~1e-9; float32 to its rounding (observed <= 3e-5 here)
TOL = {torch.float32: 2e-4, torch.float64: 1e-6}


def _data(dtype, n=N, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=torch.float64)
    y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return X.to(dtype), y.to(dtype)


def _reference(model, T):
    """GPyTorch's exact prediction of ``y`` at ``T``."""
    model.eval()
    with torch.no_grad(), gpytorch.settings.fast_computations(False, False, False), \
            gpytorch.settings.max_cholesky_size(10 ** 7):
        pred = model.likelihood(model(T))
        return pred.mean, pred.variance


def _rel(a, ref):
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


def _settings(solver, **kw):
    return EstimatorSettings(solver=solver, variance_method="pcg", variance_tolerance=1e-8, **kw)


@pytest.mark.parametrize("solver", SOLVERS)
def test_learnt_additional_noise_is_added_at_new_points(solver, dtype):
    """``FixedNoiseGaussianLikelihood(learn_additional_noise=True)``: GPyTorch's variance of ``y`` at a new point is
    the latent one plus the learnt ``second_noise`` (0.3 here, against latent variances of ~3e-3)."""
    X, y = _data(dtype)
    T, _ = _data(dtype, n=20, seed=5)
    lik = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=torch.full((N,), 0.01, dtype=dtype),
                                                            learn_additional_noise=True).to(dtype)
    lik.second_noise = 0.3
    model = ExactGPModel(X, y, lik).to(dtype)
    mean_ref, var_ref = _reference(model, T)
    with use_preconditioner(model, "afn", settings=_settings(solver)) as hook:
        mean, var = hook.predict(T)
    assert _rel(mean, mean_ref) < TOL[dtype] and _rel(var, var_ref) < TOL[dtype]
    assert float(var.min()) > 0.3


def test_cholesky_variances_without_the_dense_kernel_take_pcg_with_one_warning():
    X, y = _data(torch.float64)
    T, _ = _data(torch.float64, n=20, seed=5)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    model.likelihood.noise = 0.01
    mean_ref, var_ref = _reference(model, T)
    settings = EstimatorSettings(solver="iterative", variance_method="cholesky", variance_tolerance=1e-8,
                                 dense_limit_bytes=1000)
    with use_preconditioner(model, "afn", settings=settings) as hook:
        with pytest.warns(RuntimeWarning, match="variance_method='cholesky'"):
            mean, var = hook.predict(T)
        assert hook.variance_method_used == "pcg"
        assert bool(((var - var_ref).abs() <= hook.variance_bound + 1e-12).all())
        assert _rel(mean, mean_ref) < TOL[torch.float64]


@pytest.mark.parametrize("solver", SOLVERS)
def test_batch_mode_model_with_an_unbatched_kernel(solver):
    """Inputs ``(2, n, d)`` with a plain kernel: GPyTorch's own prediction, ``(2, m)``."""
    X = torch.stack([_data(torch.float64, n=200, seed=s)[0] for s in (0, 1)])
    y = torch.stack([_data(torch.float64, n=200, seed=s)[1] for s in (0, 1)])
    T = torch.stack([_data(torch.float64, n=10, seed=s)[0] for s in (5, 6)])
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(batch_shape=torch.Size([2]))).double()
    mean_ref, var_ref = _reference(model, T)
    with use_preconditioner(model, "afn", settings=_settings(solver)) as hook:
        mean, var = hook.predict(T)
    assert mean.shape == var.shape == (2, 10)
    assert _rel(mean, mean_ref) < 1e-6 and _rel(var, var_ref) < 1e-6


@pytest.mark.parametrize("solver", SOLVERS)
def test_outputscale_zero_predicts_the_prior(solver, dtype):
    X, y = _data(dtype)
    T, _ = _data(dtype, n=5, seed=5)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).to(dtype)
    model.covar_module.raw_outputscale.data.fill_(-1e4)  # softplus underflows to exactly 0
    assert float(model.covar_module.outputscale) == 0.0
    with use_preconditioner(model, "afn", settings=_settings(solver)) as hook:
        with pytest.warns(match="outputscale is 0"):
            mean, var = hook.predict(T)
    torch.testing.assert_close(mean, model.mean_module.constant.detach().expand(5))
    torch.testing.assert_close(var, model.likelihood.noise.detach().expand(5))


@pytest.mark.parametrize("solver", SOLVERS)
def test_test_x_shapes_and_bad_values(solver):
    X, y = _data(torch.float64, d=1)
    T, _ = _data(torch.float64, n=12, d=1, seed=5)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    with use_preconditioner(model, "afn", settings=_settings(solver)) as hook:
        mean, var = hook.predict(T)
        one_d = hook.predict(T[:, 0])  # m points of a model on one input dimension, as in GPyTorch
        batched = hook.predict(T.reshape(3, 4, 1))  # (..., m, d): each marginal is its own point's
        assert hook.variance_bound.shape == hook.mean_bound.shape == (3, 4)
        empty = hook.predict(T[:0])
        for got, want in ((one_d, (mean, var)), (batched, (mean.reshape(3, 4), var.reshape(3, 4)))):
            torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
        assert empty[0].shape == empty[1].shape == (0,)
        bad = {"NaN or inf": T.clone().fill_(float("nan")), r"\(m, 1\)": torch.rand(5, 3, dtype=torch.float64),
               "floating": T.long(), "device": T.to("meta")}
        single = hook.predict(T.float())  # float32 points for a float64 model: promoted, as GPyTorch does
        torch.testing.assert_close(single[0], hook.predict(T.float().double())[0], rtol=0, atol=0)
        for match, value in bad.items():
            with pytest.raises(ValueError, match=match) as caught:
                hook.predict(value)
            assert "test_x" in str(caught.value)
        model.covar_module.base_kernel.raw_lengthscale.data.fill_(float("nan"))
        with pytest.raises(HyperparameterError, match="lengthscale"):
            hook.predict(T)


@pytest.mark.parametrize("method", ["pcg", "cached"])
def test_an_explicit_variance_method_is_honoured_on_the_cholesky_path(method):
    X, y = _data(torch.float64)
    T, _ = _data(torch.float64, n=8, seed=5)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    mean_ref, var_ref = _reference(model, T)
    settings = EstimatorSettings(solver="cholesky", variance_method=method, variance_tolerance=1e-8)
    with use_preconditioner(model, "afn", settings=settings, k=20) as hook:
        mean, var = hook.predict(T)
        assert hook.paths.choose()[0] == "cholesky" and hook.variance_method_used == method
        assert bool(((var - var_ref).abs() <= hook.variance_bound + 1e-12).all())
        assert _rel(mean, mean_ref) < TOL[torch.float64]


def test_attributes_describe_the_latest_call():
    X, y = _data(torch.float64)
    T, _ = _data(torch.float64, n=8, seed=5)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
    with use_preconditioner(model, "afn", settings=_settings("iterative"), k=20) as hook:  # PCG iterates
        first = hook.predict(T)
        assert hook.variance_method_used == "pcg" and hook.variance_iterations > 0
        assert hook.prediction_time["variance_s"] > 0
        again = hook.predict(T)  # the same seed and data: the same answer
        torch.testing.assert_close(again[0], first[0], rtol=0, atol=0)
        torch.testing.assert_close(again[1], first[1], rtol=0, atol=0)
        mean, var = hook.predict(T, variance=False)
        assert var is None and hook.variance_method_used is None and hook.variance_iterations == 0
        assert hook.prediction_time["variance_s"] == 0.0 and hook.variance_bound is None
        torch.testing.assert_close(mean, first[0], rtol=1e-12, atol=1e-12)


def _composite(name):
    M12, RBF, Scale = gpytorch.kernels.MaternKernel, gpytorch.kernels.RBFKernel, gpytorch.kernels.ScaleKernel
    return {"sum": Scale(M12(nu=0.5)) + Scale(RBF()), "product": Scale(M12(nu=0.5) * RBF()),
            "active_dims": Scale(M12(nu=0.5, active_dims=[0])) + Scale(RBF(active_dims=[1]))}[name]


@pytest.mark.parametrize("name", ["sum", "product", "active_dims"])
def test_float32_composite_kernels_within_their_bounds(name):
    """Sums and products of Matérn-½ and RBF kernels in float32 on points in ``[5, 6]²`` (GPyTorch's float32
    distances lose near pairs there: 16–34 of 200 variances outside their bound when the entries were GPyTorch's),
    against the same model in float64."""
    g = torch.Generator().manual_seed(0)
    X = (5 + torch.rand(280, 2, generator=g, dtype=torch.float64)).float()
    y = (torch.sin(6 * X[:, 0].double()) + 0.03 * torch.randn(280, generator=g, dtype=torch.float64)).float()
    T = (5 + torch.rand(200, 2, generator=g, dtype=torch.float64)).float()
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel=_composite(name)).float()
    for module in model.covar_module.modules():
        if getattr(module, "raw_lengthscale", None) is not None:
            module.lengthscale = 0.2
    model.likelihood.noise = 1e-3
    ref = ExactGPModel(X.double(), y.double(), gpytorch.likelihoods.GaussianLikelihood(),
                       kernel=_composite(name)).double()
    ref.load_state_dict(model.state_dict())
    mean_ref, var_ref = _reference(ref, T.double())
    with use_preconditioner(model, "afn", settings=EstimatorSettings(solver="cholesky")) as hook:
        mean, var = hook.predict(T)
    assert bool(((mean.double() - mean_ref).abs() <= hook.mean_bound.double()).all())
    assert bool(((var.double() - var_ref).abs() <= hook.variance_bound.double()).all())


@pytest.mark.cuda
def test_cuda_learnt_additional_noise(cuda_device):
    X, y = (t.to(cuda_device) for t in _data(torch.float64))
    T = _data(torch.float64, n=20, seed=5)[0].to(cuda_device)
    lik = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise=torch.full((N,), 0.01, dtype=torch.float64,
                                                                             device=cuda_device),
                                                            learn_additional_noise=True)
    model = ExactGPModel(X, y, lik).double().to(cuda_device)
    model.likelihood.second_noise = 0.3
    mean_ref, var_ref = _reference(model, T)
    with use_preconditioner(model, "afn", settings=_settings("iterative")) as hook:
        mean, var = hook.predict(T)
    assert _rel(mean, mean_ref) < 1e-6 and _rel(var, var_ref) < 1e-6
