"""Bad flag values exit 2 with one line naming the flag, before any work; a computation that fails on its numbers or
its memory exits 2 with one line too; ``--json`` is strict JSON; without ``--n`` `pcg` and `mll` keep
``min(2000, rows)`` training rows."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch

from gpnys import datasets
from gpnys.cli import common
from gpnys.cli.main import main

DATA = ["--data", "concrete", "--n", "200"]

pytestmark = pytest.mark.filterwarnings("ignore::gpnys.solvers.pcg.ConvergenceWarning")


def _reject(token: str) -> None:
    raise ValueError(f"not strict JSON: {token}")


def strict_json(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity."""
    return json.loads(text, parse_constant=_reject)


def fails(argv: list[str], capsys) -> tuple[str, str]:
    """Run the command, expect exit status 2; its stdout and its one stderr line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"gpnys {argv[0]}: error: ") and "Traceback" not in err, err
    return out, lines[0]


@pytest.mark.parametrize("argv, flag", [
    # absurd values that used to raise deep inside (OverflowError, KeyError, NotPSDError, NaN, a failed Cholesky)
    (["mll", "--method", "auto", "--dense-gib", "inf"], "--dense-gib"),
    (["mll", "--method", "auto", "--dense-gib", "1e300"], "--dense-gib"),
    (["mll", "--method", "auto", "--block-mib", str(2**70)], "--block-mib"),
    (["mll", "--method", "auto", "--probes", "1"], "--probes"),
    (["mll", "--method", "exact", "--outputscale", "1e300"], "--outputscale"),
    (["mll", "--method", "exact", "--noise", "1e300"], "--noise"),
    (["classify", "--steps", "1", "--lengthscale", "1e-300"], "--lengthscale"),
    (["mll", "--method", "exact", "--dtype", "float32", "--lengthscale", "1e20"], "--lengthscale"),
    # GPyTorch's softplus constraint cannot hold them (an infinite raw parameter: a loss of -inf, exit 0)
    (["mll", "--method", "exact", "--noise", "1e150"], "--noise"),
    (["mll", "--method", "exact", "--dtype", "float32", "--outputscale", "100"], "--outputscale"),
    # values that used to reach the JSON as Infinity
    (["fit", "--iters", "2", "--probes", "1", "--solver", "iterative", "--json"], "--probes"),
    (["pcg", "--lengthscale", "inf", "--json"], "--lengthscale"),
    (["classify", "--steps", "0", "--lengthscale", "1e300", "--json"], "--lengthscale"),
    (["reduce", "--lengthscale", "1", "--outputscale", "1", "--noise", "0.1", "--method", "exact,lla", "--m", "20",
      "--mean", "1e200"], "--mean"),
    # the estimator's flags are checked with --precond none too, and the variance flags need a preconditioner
    (["fit", "--precond", "none", "--probes", "0"], "--probes"),
    (["fit", "--precond", "none", "--cg-tol", "nan"], "--cg-tol"),
    (["fit", "--precond", "none", "--variance-rel-error", "-1"], "--variance-rel-error"),
    (["fit", "--precond", "none", "--variance-rel-error", "0.1"], "--variance-rel-error"),
    (["fit", "--precond", "none", "--variance-method", "pcg"], "--variance-method"),
    (["fit", "--precond", "none", "--solver", "iterative"], "--solver"),
    (["mll", "--method", "auto", "--solver", "cholesky"], "--solver"),
    (["fit", "--precond", "none", "--k", "5000"], "--k"),
    # no silent clipping
    (["pcg", "--precond", "nystrom", "--rank", "0"], "--rank"),
    (["pcg", "--precond", "nystrom", "--rank", "1000"], "--rank"),
    (["classify", "--steps", "0", "--n-test", "100000"], "--n-test"),
    (["pcg", "--lengthscale", ","], "--lengthscale"),
    # the flag, not the library's argument, is named
    (["pcg", "--noise", "0"], "--noise"),
    (["mll", "--n", "0"], "--n"),
    (["fit", "--n", "100000"], "--n 100000"),
    (["mll", "--split", "-1"], "--split"),
    (["mll", "--method", "afn", "--k", "0"], "--k"),
    (["mll", "--method", "afn", "--w", "0"], "--w"),
    (["mll", "--method", "afn", "--k", "5000"], "--k"),
    (["pcg", "--tol", "0"], "--tol"),
    (["pcg", "--maxiter", "-1"], "--maxiter"),
    (["pcg", "--w", "5000"], "--w"),
    (["mll", "--method", "afn", "--cg-tol", "inf"], "--cg-tol"),
    (["mll", "--lengthscale", "1e300"], "--lengthscale"),
    (["classify", "--outputscale", "1e300"], "--outputscale"),
    (["mll", "--seed", "99999999999999999999"], "--seed"),
    (["reduce", "--lengthscale", "1", "--outputscale", "1", "--noise", "inf"], "--noise"),
    (["reduce", "--lengthscale", "1", "--outputscale", "1", "--noise", "0.1", "--mean", "nan"], "--mean"),
    # one row cannot be standardised (nor fitted): at least 2
    (["mll", "--method", "exact", "--n", "1"], "--n"),
    (["classify", "--n", "1"], "--n"),
    (["classify", "--steps", "0", "--w", "500"], "--w"),
    # an empty comma list would run nothing
    (["pcg", "--precond", ","], "--precond"),
    (["mll", "--method", ","], "--method"),
    (["reduce", "--method", ",", "--lengthscale", "1", "--outputscale", "1", "--noise", "0.1", "--m", "10"],
     "--method"),
    (["reduce", "--landmarks", ",", "--method", "lla", "--lengthscale", "1", "--outputscale", "1", "--noise", "0.1",
      "--m", "10"], "--landmarks"),
])
def test_bad_flag_exits_2_with_one_line_naming_it(argv, flag, capsys):
    out, err = fails(argv[:1] + DATA + argv[1:], capsys)
    assert flag in err and out == "", err


HYP = ["--lengthscale", "1", "--outputscale", "1", "--noise", "0.1", "--m", "10", "--method", "lla"]


@pytest.mark.parametrize("argv, flag", [
    # with --no-error-bars GPyTorch's estimator rebuilds the preconditioner at every step
    (["fit", "--iters", "1", "--reuse-tolerance", "0.1", "--no-error-bars"], "--reuse-tolerance"),
    # GPyTorch's own Cholesky fit computes the variances by Cholesky
    (["fit", "--iters", "1", "--precond", "none", "--variance-method", "cached"], "--variance-method"),
    (["fit", "--iters", "1", "--precond", "none", "--variance-rel-error", "0.1"], "--variance-rel-error"),
    # only the cached variances have an error bound to recompute by
    (["fit", "--iters", "1", "--variance-method", "pcg", "--variance-rel-error", "0.1"], "--variance-rel-error"),
    (["fit", "--iters", "1", "--variance-method", "cholesky", "--variance-rel-error", "0.1"], "--variance-rel-error"),
    # given hyperparameters are not fitted
    (["reduce", *HYP, "--fit-iters", "50"], "--fit-iters"),
    (["reduce", *HYP, "--lr", "5"], "--lr"),
    # sizes that the chosen preconditioners do not read
    (["fit", "--iters", "1", "--precond", "pivchol", "--w", "5"], "--w"),
    (["fit", "--iters", "1", "--precond", "fsai", "--k", "10"], "--k"),
    (["fit", "--iters", "1", "--precond", "nystrom", "--w", "5"], "--w"),
    (["fit", "--iters", "1", "--precond", "none", "--k", "10"], "--k"),
    (["mll", "--method", "exact,gpytorch", "--k", "10"], "--k"),
    (["mll", "--method", "exact,fsai", "--k", "10"], "--k"),
    (["pcg", "--precond", "fsai", "--k", "10"], "--k"),
    (["pcg", "--precond", "nystrom", "--rank", "5", "--k", "10"], "--k"),
    (["pcg", "--precond", "afn", "--rank", "5"], "--rank"),
    (["pcg", "--precond", "pivchol", "--w", "5"], "--w"),
    # the estimator's flags set the preconditioned path, which a Cholesky run or a comparison without a gpnys method
    # never evaluates
    (["fit", "--iters", "1", "--precond", "none", "--probes", "30"], "--probes"),
    (["fit", "--iters", "1", "--precond", "none", "--no-error-bars"], "--no-error-bars"),
    (["fit", "--iters", "1", "--precond", "none", "--solver", "cholesky", "--cg-tol", "0.1"], "--cg-tol"),
    (["mll", "--method", "exact,gpytorch", "--accuracy", "0.01"], "--accuracy"),
    (["fit", "--iters", "1", "--solver", "cholesky", "--probes", "8"], "--probes"),
    (["mll", "--method", "exact", "--kernel-backend", "torch"], "--kernel-backend"),
    # TF32 is a mode of float32 Triton tiles on CUDA
    (["fit", "--iters", "1", "--tf32"], "--tf32"),
    (["mll", "--method", "afn", "--dtype", "float32", "--tf32", "--kernel-backend", "torch"], "--tf32"),
    # the Adam steps are the only use of the subsample
    (["classify", "--steps", "0", "--reduced", "10", "--subsample", "50"], "--subsample"),
])
def test_a_flag_without_effect_exits_2_naming_it(argv, flag, capsys):
    out, err = fails(argv[:1] + DATA + argv[1:], capsys)
    assert flag in err and out == "", err


@pytest.mark.parametrize("argv", [["fit", "--iters", "1"], ["mll", "--method", "afn"], ["mll", "--method", "exact"]])
def test_a_kernel_backend_this_device_lacks_exits_2(argv, monkeypatch, capsys):
    """``--kernel-backend triton`` on CPU tensors (outside Triton's interpreter) exits before any work, also where
    the run would take Cholesky or the backend would never be built."""
    if torch.cuda.is_available():
        pytest.skip("triton runs on this machine's CUDA tensors")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the test suite runs Triton's interpreter on CPU tensors
    out, err = fails(argv[:1] + DATA + argv[1:] + ["--kernel-backend", "triton"], capsys)
    assert "--kernel-backend triton" in err and out == "", err


def test_kernel_backend_keops_without_pykeops_exits_2(capsys):
    from gpnys.kernels.backends import keops

    if keops.available():
        pytest.skip("pykeops is installed")
    _, err = fails(["fit", *DATA, "--iters", "1", "--kernel-backend", "keops"], capsys)
    assert "--kernel-backend keops" in err and "pykeops" in err, err


def test_k_is_the_rank_of_pivchol(capsys):
    """``--k`` sets the rank of ``pivchol`` (default 15); a ``--method`` list hands each method the sizes it reads."""
    assert main(["fit", *DATA, "--iters", "1", "--precond", "pivchol", "--k", "40", "--solver", "iterative",
                 "--json"]) == 0
    assert strict_json(capsys.readouterr().out)["steps"][0]["rank"] == 40
    assert main(["mll", *DATA, "--method", "pivchol,afn,fsai", "--k", "30", "--w", "7", "--json"]) == 0
    ranks = {rec["method"]: rec["extra"]["rank"] for rec in strict_json(capsys.readouterr().out)}
    assert ranks == {"pivchol": 30, "afn": 30, "fsai": 0}


def test_too_large_a_synthetic_n_names_the_flag(monkeypatch, capsys):
    _, err = fails(["pcg", "--data", "synthetic3d", "--n", "99999999999999999999", "--precond", "none"], capsys)
    assert "--n 99999999999999999999" in err, err

    def load(*args, **kwargs):
        raise ValueError("Maximum allowed dimension exceeded")  # numpy's own words, without the n

    monkeypatch.setattr(datasets, "load", load)
    _, err = fails(["fit", "--data", "synthetic3d", "--n", "300", "--iters", "1"], capsys)
    assert "--n 300" in err and "Maximum allowed dimension exceeded" in err, err


def test_the_whole_lengthscale_list_is_checked_before_any_solve(capsys):
    out, err = fails(["pcg", *DATA, "--lengthscale=1,-1"], capsys)
    assert out == "" and "--lengthscale" in err and "-1" in err


def test_synthetic_data_needs_n(capsys):
    _, err = fails(["fit", "--data", "synthetic3d", "--iters", "1"], capsys)
    assert "--n" in err


def test_a_file_with_one_training_row_is_an_error_without_warnings(tmp_path, capsys):
    path = tmp_path / "two.csv"
    path.write_text("1,2,3\n4,5,6\n")  # a 90/10 split of two rows: one training row
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "degrees of freedom is <= 0" would raise here
        _, err = fails(["mll", "--data", str(path), "--method", "exact"], capsys)
        tf = datasets.Standardizer.fit(torch.ones(1, 3), torch.ones(1))
    assert "--data" in err and "at least 2" in err
    assert torch.equal(tf.x_std, torch.ones(3)) and float(tf.y_std) == 1.0


def test_training_that_diverges_names_the_learning_rate(capsys):
    _, err = fails(["fit", *DATA, "--iters", "3", "--lr", "1e300", "--precond", "none", "--json"], capsys)
    assert "numerical failure" in err and "--lr" in err, err
    _, err = fails(["classify", "--data", "concrete", "--n", "100", "--steps", "1", "--lengthscale", "2", "--lr",
                    "1e300"], capsys)
    assert "--lr 1e+300" in err, err  # "Adam diverged after 1 step(s) (...)" or a numerical failure


@pytest.mark.filterwarnings("ignore::linear_operator.utils.warnings.NumericalWarning")
def test_a_numerical_failure_names_the_scales(capsys):
    """Scales inside their range can still leave K + noise I indefinite in floating point (float32, the
    preconditioned path; the exact reference itself runs in float64)."""
    _, err = fails(["mll", *DATA, "--method", "auto", "--dtype", "float32", "--lengthscale",
                    "80", "--outputscale", "80", "--noise", "2e-6"], capsys)
    assert "numerical failure" in err and "--outputscale 80" in err, err


def test_out_of_memory_is_one_line_naming_n(monkeypatch, capsys):
    def allocate(*args, **kwargs):
        raise MemoryError("Unable to allocate 24.8 GiB for an array with shape (300, 300)")

    monkeypatch.setattr("gpnys.cli.mll.evaluate", allocate)
    _, err = fails(["mll", "--data", "synthetic3d", "--n", "300", "--method", "exact"], capsys)
    assert "out of memory" in err and "MemoryError" in err and "--n" in err, err


@pytest.mark.parametrize("error", [KeyError("raw_noise"), NotImplementedError("later")])
def test_programming_errors_keep_their_traceback(error, monkeypatch):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr("gpnys.cli.mll.evaluate", broken)
    with pytest.raises(type(error)):
        main(["mll", *DATA, "--method", "exact"])


def test_emit_json_is_strict(capsys):
    common.emit_json({"loss": float("nan"), "se": [1.0, float("inf")], "t": torch.tensor([2.0, -float("inf")]),
                      "nested": {"x": (float("-inf"),)}, "n": 3, "ok": True, "dev": torch.device("cpu")})
    out = strict_json(capsys.readouterr().out)
    assert out == {"loss": None, "se": [1.0, None], "t": [2.0, None], "nested": {"x": [None]}, "n": 3, "ok": True,
                   "dev": "cpu"}


def test_a_run_prints_strict_json(capsys):
    assert main(["pcg", *DATA, "--precond", "none,nystrom", "--rank", "20", "--maxiter", "5", "--json"]) == 0
    records = strict_json(capsys.readouterr().out)
    assert [r["rank"] for r in records] == [0, 20]


def test_default_n_is_all_rows_below_2000(tmp_path, capsys):
    path = tmp_path / "small.csv"
    gen = torch.Generator().manual_seed(0)
    path.write_text("\n".join(",".join(f"{v:.6f}" for v in row) for row in torch.rand(150, 3, generator=gen).tolist()))
    assert main(["mll", "--data", str(path), "--method", "exact", "--json"]) == 0
    (rec,) = strict_json(capsys.readouterr().out)
    assert rec["n"] == 135  # 150 rows less the 15 of the test split
    assert main(["pcg", "--data", str(path), "--precond", "none", "--maxiter", "2", "--json"]) == 0
    assert strict_json(capsys.readouterr().out)[0]["n"] == 135
    _, err = fails(["mll", "--data", str(path), "--n", "2000", "--method", "exact"], capsys)
    assert "2000" in err and "135" in err


def test_default_n_caps_at_the_subcommand_default():
    """Above the cap, the default is the same seeded subsample as an explicit ``--n``."""
    args = argparse.Namespace(data="concrete", split=1, n=None, seed=3, dtype="float64", device=None,
                              no_standardize=False, _default_n=100)
    ds = common.load_data(args)
    ref = datasets.load("concrete", split=1, n=100, seed=3)
    assert ds.n == 100 and torch.equal(ds.train_x, ref.train_x) and torch.equal(ds.test_y, ref.test_y)


def test_cholesky_training_with_pcg_variances_runs(capsys):
    """``--solver cholesky --variance-method pcg``: the hook trains by Cholesky and predicts with the variances asked
    for (exit 0)."""
    assert main(["fit", *DATA, "--iters", "1", "--solver", "cholesky", "--variance-method", "pcg", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["variance_method"] == "pcg", out
