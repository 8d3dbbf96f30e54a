"""A bad-input matrix over the public entry points: each bad input raises a ValueError whose message names the
argument. The CLI's one-line exit-2 errors are in tests/cli/test_fit_cli.py."""

import gpytorch
import numpy as np
import pytest
import torch

import gpnys
from gpnys import datasets
from gpnys.checks import validate_choice, validate_training_data
from gpnys.gp.training import ExactGPModel, fit, predict
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.kernels.system import kernel_system
from gpnys.landmarks import fill_distance, kmeans
from gpnys.precond import (
    AFNPreconditioner,
    FSAIPreconditioner,
    NystromPreconditioner,
    PivotedCholeskyPreconditioner,
    make_preconditioner,
)
from gpnys.reduced import ReducedGP, reduced_posterior

N, D = 40, 2


def X_good():
    return torch.rand(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def y_good():
    return torch.rand(N, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def rbf():
    return gpytorch.kernels.RBFKernel().double()


def nan_X():
    X = X_good()
    X[3, 1] = float("nan")
    return X


def inf_y():
    y = y_good()
    y[5] = float("inf")
    return y


def model(X, y):
    return ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood().double(), kernel="rbf").double()


CASES = {
    # preconditioners: X, mu, sizes
    "afn nan X": (lambda: AFNPreconditioner(nan_X(), rbf(), 0.1, k=5, w=3), "X"),
    "afn mu 0": (lambda: AFNPreconditioner(X_good(), rbf(), 0.0, k=5, w=3), "mu"),
    "afn k > n": (lambda: AFNPreconditioner(X_good(), rbf(), 0.1, k=N + 1, w=3), "k"),
    "afn w > n": (lambda: AFNPreconditioner(X_good(), rbf(), 0.1, k=5, w=N + 1), "w"),
    "afn empty": (lambda: AFNPreconditioner(X_good()[:0], rbf(), 0.1, k=5, w=3), "X"),
    "nystrom rank > n": (lambda: NystromPreconditioner(X_good(), rbf(), 0.1, N + 1), "k"),
    "nystrom 1-D X": (lambda: NystromPreconditioner(X_good()[:, 0], rbf(), 0.1, 5), "X"),
    "fsai mu negative": (lambda: FSAIPreconditioner(X_good(), rbf(), -1.0, w=3), "mu"),
    "nystrom sampling tensor": (lambda: NystromPreconditioner(X_good(), rbf(), 0.1, 5, sampling=torch.ones(2)),
                                "sampling"),
    "pivchol rank 0": (lambda: PivotedCholeskyPreconditioner(X_good(), rbf(), 0.1, rank=0), "rank"),
    "make unknown": (lambda: make_preconditioner("bogus", X_good(), rbf(), 0.1), "preconditioner"),
    # solvers
    "kernel_system nan X": (lambda: kernel_system(nan_X(), rbf(), 0.1), "X"),
    "kernel_system mu 0": (lambda: kernel_system(X_good(), rbf(), 0.0), "mu"),
    "pcg nan B": (lambda: gpnys.pcg(kernel_system(X_good(), rbf(), 0.1), y_good() * float("nan")), "B"),
    "pcg tol 0": (lambda: gpnys.pcg(kernel_system(X_good(), rbf(), 0.1), y_good(), tol=0.0), "tol"),
    # kernel operator
    "operator prune_tol < 0": (lambda: StationaryKernelOperator(
        X_good(), torch.tensor(1.0, dtype=torch.float64), rbf().lengthscale, base=rbf(), cache={}, prune_tol=-1.0),
        "prune_tol"),
    "operator bad backend": (lambda: StationaryKernelOperator(
        X_good(), torch.tensor(1.0, dtype=torch.float64), rbf().lengthscale, base=rbf(), cache={}, backend="gpu"),
        "backend"),
    # training
    "hook nan X": (lambda: gpnys.use_preconditioner(model(nan_X(), y_good())).__enter__(), "train_inputs"),
    "hook inf y": (lambda: gpnys.use_preconditioner(model(X_good(), inf_y())).__enter__(), "train_targets"),
    "hook k > n": (lambda: gpnys.use_preconditioner(model(X_good(), y_good()), "afn", k=N + 5).__enter__(), "k"),
    "hook method": (lambda: gpnys.use_preconditioner(model(X_good(), y_good()), "bogus").__enter__(), "method"),
    "fit inf y": (lambda: fit(model(X_good(), inf_y()), iters=1, progress=False), "train_targets"),
    "fit lr 0": (lambda: fit(model(X_good(), y_good()), iters=1, lr=0.0, progress=False), "lr"),
    # reduced
    "reduced nan X": (lambda: reduced_posterior("lla", rbf(), nan_X(), y_good(), 0.1, m=5), "X"),
    "reduced noise 0": (lambda: reduced_posterior("lla", rbf(), X_good(), y_good(), 0.0, m=5), "noise"),
    "reduced m > n": (lambda: reduced_posterior("lla", rbf(), X_good(), y_good(), 0.1, m=N + 1), "m"),
    "reduced method": (lambda: reduced_posterior("bogus", rbf(), X_good(), y_good(), 0.1, m=5), "method"),
    "reduced y shape": (lambda: reduced_posterior("lla", rbf(), X_good(), y_good()[:-1], 0.1, m=5), "y"),
    "ReducedGP fit nan": (lambda: ReducedGP(X_good(), inf_y(), gpytorch.likelihoods.GaussianLikelihood().double(),
                                            gpytorch.kernels.ScaleKernel(rbf()).double(), m=5).fit(iters=1), "train_y"),
    "settings solver": (lambda: gpnys.EstimatorSettings(solver="dense"), "solver"),
    "settings cg tolerance": (lambda: gpnys.EstimatorSettings(cg_tolerance=-1.0), "cg_tolerance"),
    "settings cg iterations": (lambda: gpnys.EstimatorSettings(max_cg_iterations=0), "max_cg_iterations"),
    "settings lanczos steps": (lambda: gpnys.EstimatorSettings(lanczos_steps=0), "lanczos_steps"),
    "settings variance block": (lambda: gpnys.EstimatorSettings(variance_block=0), "variance_block"),
    "settings variance tolerance": (lambda: gpnys.EstimatorSettings(variance_tolerance=2.0), "variance_tolerance"),
    "settings one probe": (lambda: gpnys.EstimatorSettings(num_probes=1), "num_probes"),
    "settings max probes": (lambda: gpnys.EstimatorSettings(num_probes=64, max_probes=8, target_rel_error=0.01),
                            "max_probes"),
    "settings dense bytes": (lambda: gpnys.EstimatorSettings(dense_limit_bytes=-1), "dense_limit_bytes"),
    "settings probes": (lambda: gpnys.EstimatorSettings(probes="bogus"), "probes"),
    "settings probe seed": (lambda: gpnys.EstimatorSettings(probe_seed="a"), "probe_seed"),
    "settings backend": (lambda: gpnys.EstimatorSettings(kernel_backend="gpu"), "kernel_backend"),
    "targets device": (lambda: validate_training_data(X_good(), y_good().to("meta")), "train_y"),
    "hook seed": (lambda: gpnys.use_preconditioner(model(X_good(), y_good()), seed=float("nan")).__enter__(), "seed"),
    "afn kernel": (lambda: AFNPreconditioner(X_good(), None, 0.1, k=5, w=3), "kernel"),
    "pcg B rows": (lambda: gpnys.pcg(kernel_system(X_good(), rbf(), 0.1), torch.ones(N + 1, dtype=torch.float64)),
                   "B"),
    "pcg nan x0": (lambda: gpnys.pcg(kernel_system(X_good(), rbf(), 0.1), y_good(), x0=y_good() * float("nan")),
                   "x0"),
    "predict test_x d": (lambda: predict(model(X_good(), y_good()), torch.rand(3, D + 1, dtype=torch.float64)),
                         "test_x"),
    "predict nan test_x": (lambda: predict(model(X_good(), y_good()), nan_X()), "test_x"),
    "fill distance empty": (lambda: fill_distance(X_good(), X_good()[:0]), "landmarks"),
    "fill distance nan": (lambda: fill_distance(X_good(), nan_X()), "landmarks"),
    "fill distance d": (lambda: fill_distance(X_good(), X_good()[:, :1]), "landmarks"),
    "kmeans tol": (lambda: kmeans(X_good(), 3, tol=float("nan")), "tol"),
    # data and budget
    "datasets unknown": (lambda: datasets.load("no-such-data"), "data"),
    "datasets split": (lambda: datasets.load("concrete", split=None), "split"),
    "datasets split 10": (lambda: datasets.load("concrete", split=10), "split"),
    "datasets n nan": (lambda: datasets.load("concrete", n=float("nan")), "n"),
    "datasets seed": (lambda: datasets.load("concrete", seed=-1), "seed"),
    "datasets dtype": (lambda: datasets.load("concrete", dtype=torch.int64), "dtype"),
    "datasets huge n": (lambda: datasets.load("synthetic3d", n=10 ** 20), "n="),
    "budget negative": (lambda: gpnys.memory_budget(dense_bytes=-1).__enter__(), "dense_bytes"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_a_value_error_naming_the_argument(name):
    call, argument = CASES[name]
    with pytest.raises(ValueError) as info:
        call()
    assert argument in str(info.value), f"{name}: {info.value}"


def test_validate_choice_names_the_argument_and_lists_the_choices():
    assert validate_choice("b", "mode", ("a", "b")) == "b"
    with pytest.raises(ValueError, match=r"^mode must be one of \('a', 'b'\) or None, got 'c'$"):
        validate_choice("c", "mode", ("a", "b"), also="or None")
    with pytest.raises(ValueError, match=r"^kernel must be one of \['matern', 'rbf'\], got \['rbf'\]$"):
        validate_choice(["rbf"], "kernel", {"rbf": 1, "matern": 2})  # unhashable against a mapping: listed sorted
    with pytest.raises(ValueError, match="^landmarks must be one of"):
        validate_choice(np.ones(3), "landmarks", ("fps", "uniform"))  # an array has no single truth value
