"""The runnable examples run (at small sizes) and report sensible numbers."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--iters", "3"])
    load("quickstart").main()
    assert "test RMSE" in capsys.readouterr().out


def test_preconditioned_cg_example():
    rows = {r["precond"]: r for r in load("preconditioned_cg").main(["--n", "800", "--lengthscale", "3"])}
    assert all(r["converged"] for r in rows.values())
    assert rows["afn"]["iterations"] * 3 <= rows["none"]["iterations"]
