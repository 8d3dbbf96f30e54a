"""Every ``>>>`` example in the package's docstrings runs and prints what it says, and the public entry points
have one."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gpnys

#: optional dependencies whose absence skips a module's examples (gpnys.kernels.backends.keops needs pykeops)
OPTIONAL = {"pykeops"}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(gpnys.__path__, "gpnys."))


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs {exc.name}")
        raise


def _examples() -> list[tuple[str, str]]:
    out = []
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # reported by test_examples_run's import
        for test in doctest.DocTestFinder(exclude_empty=True).find(module):
            if test.examples:
                out.append((name, test.name))
    return out


@pytest.mark.parametrize("module_name, test_name", _examples())
def test_examples_run(module_name, test_name):
    module = _import(module_name)
    (test,) = [t for t in doctest.DocTestFinder().find(module) if t.name == test_name]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda s: print(s, end=""))
    assert runner.failures == 0, f"{test_name}: {runner.failures} of {runner.tries} examples failed (output above)"


PUBLIC_ENTRY_POINTS = [
    "gpnys.gp.hook.use_preconditioner",
    "gpnys.gp.settings.EstimatorSettings",
    "gpnys.precond.afn.AFNPreconditioner",
    "gpnys.precond.make_preconditioner",
    "gpnys.solvers.pcg.pcg",
    "gpnys.bo.model.PreconditionedSingleTaskGP",
    "gpnys.bo.model.PreconditionedFantasyGP",
    "gpnys.reduced.reduced_posterior",
    "gpnys.reduced.ReducedGP",
    "gpnys.reduced.NystromFeatures",
    "gpnys.classify.LaplaceGPClassifier",
    "gpnys.datasets.load",
    "gpnys.landmarks.fps",
]


@pytest.mark.parametrize("path", PUBLIC_ENTRY_POINTS)
def test_public_entry_points_have_examples(path):
    module_name, _, attr = path.rpartition(".")
    obj = getattr(importlib.import_module(module_name), attr)
    doc = obj.__doc__ or ""
    assert ">>>" in doc, f"{path} has no example in its docstring"
