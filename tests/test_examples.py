"""The runnable examples run (at small sizes) and report sensible numbers."""

import sys

from helpers import load_script


def load(name):
    return load_script("examples", name)


def test_quickstart_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--iters", "3"])
    load("quickstart").main()
    assert "test RMSE" in capsys.readouterr().out


def test_preconditioned_cg_example():
    rows = {r["precond"]: r for r in load("preconditioned_cg").main(["--n", "800", "--lengthscale", "3"])}
    assert all(r["converged"] for r in rows.values())
    assert rows["afn"]["iterations"] * 3 <= rows["none"]["iterations"]


def test_gpytorch_training_example_matches_cholesky():
    res = load("gpytorch_training").main(["--data", "concrete", "--n", "400", "--iters", "5"])
    ch, gp = res["cholesky"], res["gpnys"]
    assert gp["builds"] == 6 and gp["cg_applications"] > 0  # one per step, one for the final hyperparameters
    assert abs(gp["rmse"] - ch["rmse"]) / ch["rmse"] < 0.02
    assert abs(gp["noise"] - ch["noise"]) / ch["noise"] < 0.02


def test_reduced_posteriors_example():
    res = load("reduced_posteriors").main(["--data", "concrete", "--n", "300", "--m", "40", "--iters", "1"])
    assert res
