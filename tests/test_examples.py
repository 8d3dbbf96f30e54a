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
