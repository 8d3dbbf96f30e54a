"""Calibration of the path cost model (:mod:`gpnys.gp.path`): both paths timed on this device.

A synthetic problem (4-D, ARD Matérn-3/2, noise 0.01) is evaluated (value + gradient) under the hook with the path
forced, at two sizes per path, and :class:`~gpnys.gp.path.PathCosts` is fitted through the medians. About 4 s on 2
CPU cores. Near the switch, Cholesky is measured at the size in question on the same problem
(:func:`measure_cholesky`). It drives the hook, which decides by the cost model, so it sits above both and installs
itself into :mod:`gpnys.gp.path` on import (:func:`gpnys.gp.path.install_calibration`,
:func:`gpnys.gp.path.install_measurer`).
"""

from __future__ import annotations

import time
import warnings

import gpytorch
import torch

from gpnys.budget import default_budget
from gpnys.checks import validate_count
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.path import PathCosts, costs_key, fit_costs, install_calibration, install_measurer
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel
from gpnys.linalg import synchronize

__all__ = ["calibrate", "measure_cholesky"]


def _problem(n: int, device: torch.device, dtype: torch.dtype) -> tuple[gpytorch.models.ExactGP, torch.Tensor,
                                                                         torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    X = torch.rand(n, 4, generator=g, dtype=torch.float64)
    y = torch.sin(4 * X[:, 0]) + X[:, 1] + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    X, y = X.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)
    model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32", ard=True)
    model = model.to(device=device, dtype=dtype)
    model.covar_module.base_kernel.lengthscale = 0.4
    model.likelihood.noise = 0.01
    return model, X, y


def _time_path(n: int, device: torch.device, dtype: torch.dtype, solver: str, reps: int = 2,
               warm_up: bool = True) -> float:
    """Median seconds of a value + gradient on the synthetic problem over ``reps`` repetitions (after one untimed
    one, with ``warm_up``); each repetition moves the length-scale (a training step: the preconditioner is
    rebuilt). Under the device's default memory budget: the result is cached for the whole machine."""
    times = []
    # a gradient, also where the caller decides under no_grad or inference_mode (a BoTorch posterior's path)
    with warnings.catch_warnings(), torch.inference_mode(False), torch.enable_grad(), default_budget():
        warnings.simplefilter("ignore")
        model, X, y = _problem(n, device, dtype)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
        with use_preconditioner(model, settings=EstimatorSettings(solver=solver, probe_seed=0)):
            for rep in range(reps + warm_up):
                model.covar_module.base_kernel.lengthscale = 0.4 * (1 + 0.05 * rep)
                model.zero_grad()
                synchronize(device)
                t0 = time.perf_counter()
                (-mll(model(X), y)).backward()
                synchronize(device)
                times.append(time.perf_counter() - t0)
    kept = times[1:] if warm_up else times
    return sorted(kept)[len(kept) // 2]


def calibrate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> PathCosts:
    """Time both paths at two sizes each (module docstring) and fit :class:`~gpnys.gp.path.PathCosts`.

    Example:
        >>> import torch
        >>> from gpnys.gp.calibration import calibrate
        >>> costs = calibrate("cpu", torch.float64)  # a few seconds
        >>> costs.exact_s(300) < costs.exact_s(3000)
        True
    """
    device = torch.device(device)
    big = device.type == "cuda"
    exact_sizes = (1000, 2000) if big else (300, 600)
    iter_sizes = (2000, 4000) if big else (500, 1000)
    exact = fit_costs(exact_sizes, tuple(_time_path(n, device, dtype, "cholesky") for n in exact_sizes), (3, 2))
    iterative = fit_costs(iter_sizes, tuple(_time_path(n, device, dtype, "iterative") for n in iter_sizes), (2, 1))
    return PathCosts(exact=exact, iterative=iterative, sizes=(exact_sizes, iter_sizes), key=costs_key(device, dtype))


def measure_cholesky(n: int, device: torch.device | str, dtype: torch.dtype) -> float:
    """Seconds of one Cholesky value + gradient at ``n`` on the calibration's problem, after a warm-up at a small
    size (the measurement :func:`gpnys.gp.path.choose_path` takes near the switch).

    Example:
        >>> import torch
        >>> from gpnys.gp.calibration import measure_cholesky
        >>> 0 < measure_cholesky(200, "cpu", torch.float64) < 10
        True
    """
    n = validate_count(n, "n")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    device = torch.device(device)
    _time_path(64, device, dtype, "cholesky", reps=1)  # the dense solvers' set-up (a GPU's handles), untimed
    return _time_path(n, device, dtype, "cholesky", reps=1, warm_up=False)


install_calibration(calibrate)
install_measurer(measure_cholesky)
