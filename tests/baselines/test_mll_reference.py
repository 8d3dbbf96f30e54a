"""``gpnys.baselines.mll.evaluate("exact")`` is a float64 reference, also for float32 data, and ``gpnys mll
--dtype float32`` measures the other methods against it."""

import json

import pytest
import torch

from gpnys import datasets
from gpnys.baselines.mll import _model, evaluate, grad_errors
from gpnys.cli.main import main

HYP = {"kernel": "rbf", "lengthscale": 3.0, "outputscale": 1.0, "noise": 1e-2}


def _rounded_hyperparameters(X32, y32):
    """The hyperparameters a float32 model holds for :data:`HYP`, exactly, as float64 tensors (a Python float
    would pass through float32 in GPyTorch's setters)."""
    m = _model(X32, y32, HYP["kernel"], HYP["lengthscale"], HYP["outputscale"], HYP["noise"], False).double()
    with torch.no_grad():
        return {"kernel": HYP["kernel"], "lengthscale": m.covar_module.base_kernel.lengthscale.reshape(()),
                "outputscale": m.covar_module.outputscale.reshape(()), "noise": m.likelihood.noise.reshape(())}


def test_float32_exact_is_the_float64_evaluation():
    ds = datasets.load("elevators", n=400, seed=0, dtype=torch.float32)
    X32, y32 = ds.train_x, ds.train_y
    ex32 = evaluate(X32, y32, "exact", **HYP)
    ref = evaluate(X32.double(), y32.double(), "exact", **_rounded_hyperparameters(X32, y32))
    assert ex32["loss"] == pytest.approx(ref["loss"], rel=1e-10)
    for k, v in ref["grad"].items():
        assert ex32["grad"][k] == pytest.approx(v, rel=1e-9, abs=1e-10)
    assert ex32["loss_std_error"] == 0.0


def test_cli_float32_errors_are_against_float64(capsys):
    args = ["mll", "--data", "elevators", "--n", "400", "--kernel", "rbf", "--lengthscale", "3", "--noise", "1e-2",
            "--dtype", "float32", "--method", "exact,auto", "--json"]
    assert main(args) == 0
    recs = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    ds = datasets.load("elevators", n=400, seed=0, dtype=torch.float32)
    X32, y32 = ds.train_x, ds.train_y
    ref = evaluate(X32.double(), y32.double(), "exact", **_rounded_hyperparameters(X32, y32))
    assert recs["exact"]["loss"] == pytest.approx(ref["loss"], rel=1e-10)
    auto = recs["auto"]
    assert auto["loss_rel_error"] == pytest.approx(abs(auto["loss"] - ref["loss"]) / abs(ref["loss"]), rel=1e-6,
                                                   abs=1e-12)
    for k, v in grad_errors(auto["grad"], ref["grad"]).items():
        assert auto["grad_rel_error"][k] == pytest.approx(v, rel=1e-6, abs=1e-9)
