import json
import math

import gpytorch
import pytest
import torch

from gpnys import datasets
from gpnys.cli.main import main
from gpnys.gp.training import ExactGPModel, fit, gaussian_nll, hyperparameters, predict


def dense_neg_mll(x, y, lengthscale, outputscale, noise, mean, nu=1.5):
    """-log N(y | mean, s^2 K + sigma^2 I) / n with the Matérn-3/2 kernel written out."""
    r = torch.cdist(x, x) / lengthscale
    K = outputscale * (1 + math.sqrt(3) * r) * torch.exp(-math.sqrt(3) * r)
    A = K + noise * torch.eye(len(y), dtype=x.dtype)
    L = torch.linalg.cholesky(A)
    a = torch.cholesky_solve((y - mean)[:, None], L)[:, 0]
    n = len(y)
    return float(0.5 * (y - mean) @ a + torch.log(torch.diagonal(L)).sum() + 0.5 * n * math.log(2 * math.pi)) / n


@pytest.mark.parametrize("optimizer", ["adam", "lbfgs"])
def test_fit_loss_matches_dense_reference(optimizer):
    ds = datasets.load("energy", n=120, seed=0)
    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    model = ExactGPModel(ds.train_x, ds.train_y, lik, kernel="matern32").double()
    h0 = hyperparameters(model)
    ref0 = dense_neg_mll(ds.train_x, ds.train_y, h0["lengthscale"], h0["outputscale"], h0["noise"], h0["mean"])
    res = fit(model, iters=15, lr=0.1, optimizer=optimizer, progress=False)
    assert res.loss_trace[0] == pytest.approx(ref0, rel=1e-10)
    h = hyperparameters(model)
    ref = dense_neg_mll(ds.train_x, ds.train_y, h["lengthscale"], h["outputscale"], h["noise"], h["mean"])
    assert ref < ref0  # training decreased the exact loss
    mean, var = predict(model, ds.test_x)
    assert mean.shape == var.shape == ds.test_y.shape and bool((var > 0).all())


def test_fit_is_reproducible_and_float32(dtype):
    ds = datasets.load("concrete", n=80, seed=1, dtype=dtype)

    def run():
        lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
        m = ExactGPModel(ds.train_x, ds.train_y, lik, kernel="rbf", ard=True).to(dtype)
        return fit(m, iters=5, progress=False).loss_trace, m

    a, m = run()
    b, _ = run()
    assert a == b
    assert len(hyperparameters(m)["lengthscale"]) == ds.d


def test_fit_bad_arguments():
    ds = datasets.load("energy", n=30)
    m = ExactGPModel(ds.train_x, ds.train_y, gpytorch.likelihoods.GaussianLikelihood())
    with pytest.raises(ValueError, match="optimizer"):
        fit(m, optimizer="sgd")
    with pytest.raises(ValueError, match="lr"):
        fit(m, lr=0.0)
    with pytest.raises(ValueError, match="iters"):
        fit(m, iters=-1)
    with pytest.raises(ValueError, match="mean"):
        ExactGPModel(ds.train_x, ds.train_y, gpytorch.likelihoods.GaussianLikelihood(), mean="linear")
    with pytest.raises(ValueError, match="kernel"):
        ExactGPModel(ds.train_x, ds.train_y, gpytorch.likelihoods.GaussianLikelihood(), kernel="cosine")


def test_gaussian_nll_reference():
    y, m, v = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0]), torch.tensor([1.0, 4.0])
    ref = 0.5 * (math.log(2 * math.pi) + 1.0) / 2 + 0.5 * math.log(2 * math.pi * 4.0) / 2
    assert gaussian_nll(y, m, v) == pytest.approx(ref)


def test_cli_fit_json(capsys):
    assert main(["fit", "--data", "energy", "--n", "100", "--iters", "4", "--kernel", "matern52", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("hyperparameters", "test_rmse", "test_nll", "train_time_s", "loss_trace"):
        assert key in out
    assert len(out["loss_trace"]) == 4 and out["subsampled"] and out["n_train"] == 100
    assert out["test_rmse"] > 0 and math.isfinite(out["test_nll"])


def test_cli_fit_text(capsys):
    assert main(["fit", "--data", "airfoil", "--n", "60", "--iters", "2", "--ard", "--optimizer", "lbfgs"]) == 0
    text = capsys.readouterr().out
    assert "seeded subsample" in text and "test RMSE" in text and "test NLL" in text


def test_cli_bad_input_is_a_clean_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--data", "energy", "--split", "12"])
    assert exc.value.code == 2
    assert "split" in capsys.readouterr().err


def test_cli_fit_with_preconditioner_reports_steps(capsys):
    args = ["fit", "--data", "concrete", "--n", "400", "--iters", "3", "--precond", "afn", "--k", "100", "--w", "20",
            "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precond"] == "afn" and out["method"] == "cg+slq/afn" and len(out["steps"]) == 3
    for step in out["steps"]:
        assert step["precond"] == "afn" and step["rank"] == 100 and step["cg_iters"] > 0
    # same data and steps with exact Cholesky: the preconditioned run lands on the same loss trace
    assert main(args[:7] + ["--json"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert out["loss_trace"] == pytest.approx(exact["loss_trace"], rel=1e-3)
    assert out["test_rmse"] == pytest.approx(exact["test_rmse"], rel=1e-3)


def test_cli_mll_reports_the_kernel_storage_and_follows_the_budget(capsys):
    """`--dense-gib 0` moves gpnys's kernel operator to on-the-fly row blocks (reported in the JSON); the estimate
    is the same as with the dense cache (same probes; only the blocked summation order differs)."""
    base = ["mll", "--data", "concrete", "--n", "200", "--method", "auto", "--json"]
    records = {}
    for extra in ([], ["--dense-gib", "0", "--block-mib", "1"]):
        assert main(base + extra) == 0
        (rec,) = json.loads(capsys.readouterr().out)
        records[rec["kernel_storage"]] = rec
    dense, fly = records["dense"], records["on-the-fly"]
    assert fly["dense_bytes"] == 0 and fly["block_bytes"] == 1 << 20 and dense["dense_bytes"] == 4 << 30
    assert fly["loss"] == pytest.approx(dense["loss"], rel=1e-8)


def test_cli_mll_cutoff_reports_the_share_of_entries_and_matches_the_full_kernel(capsys):
    """synthetic3d at unit density (no input standardisation), l = 0.2, on the fly: the cutoff plan computes a
    fraction of the entries (reported), and the estimate equals the one with every entry (`--prune-tol 0`), same
    probes."""
    base = ["mll", "--data", "synthetic3d", "--n", "3000", "--no-standardize", "--lengthscale", "0.2",
            "--method", "auto", "--dense-gib", "0", "--json"]
    assert main(base) == 0
    (cut,) = json.loads(capsys.readouterr().out)
    assert main(base + ["--prune-tol", "0"]) == 0
    (full,) = json.loads(capsys.readouterr().out)
    assert 0 < cut["extra"]["kernel_fraction"] < 0.9 and full["extra"]["kernel_fraction"] == 1.0
    assert cut["loss"] == pytest.approx(full["loss"], rel=1e-9)
    for key in ("raw_lengthscale", "raw_outputscale", "raw_noise"):
        assert cut["grad"][key] == pytest.approx(full["grad"][key], rel=1e-7)
    assert main(base[:-1]) == 0
    assert "kernel entries computed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,name",
    [
        (["mll", "--prune-tol", "-1", "--method", "auto"], "prune-tol"),
        (["fit", "--reuse-tolerance", "-0.5"], "reuse-tolerance"),
        (["fit", "--grow-landmarks", "-1"], "grow-landmarks"),
        (["mll", "--noise", "-1"], "noise"),
        (["mll", "--noise", "nan"], "noise"),
        (["mll", "--lengthscale", "0"], "lengthscale"),
        (["mll", "--outputscale", "-2"], "outputscale"),
        (["mll", "--method", "exact,bogus"], "method"),
        (["mll", "--repeats", "0"], "repeats"),
        (["mll", "--probes", "0", "--method", "afn"], "probes"),
        (["mll", "--cg-tol", "-1", "--method", "afn"], "cg-tol"),
        (["mll", "--n", "0"], "n"),
        (["mll", "--k", "5000", "--method", "afn"], "k"),
        (["mll", "--block-mib", "0"], "block-mib"),
        (["mll", "--dense-gib", "-1"], "dense-gib"),
        (["fit", "--precond", "bogus"], "precond"),
        (["fit", "--precond", "afn", "--w", "0"], "w"),
        (["fit", "--precond", "auto", "--lanczos-steps", "0"], "lanczos-steps"),
        (["fit", "--lr", "-1"], "lr"),
        (["fit", "--data", "/nonexistent/file.csv"], "file"),
    ],
)
def test_cli_mll_and_fit_bad_input_name_the_argument(argv, name, capsys):
    """Bad input to `gpnys mll` / `gpnys fit` exits with status 2 and a message naming the argument."""
    data = [] if "--data" in argv else ["--data", "concrete"]
    cmd = argv[:1] + data + ["--n", "200"] + (["--iters", "1"] if argv[0] == "fit" else []) + argv[1:]
    with pytest.raises(SystemExit) as exc:
        main(cmd)
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_cli_fit_lbfgs_with_preconditioner_tracks_cholesky(capsys):
    """L-BFGS (strong Wolfe line search) through the gpnys estimator ends near the Cholesky L-BFGS fit."""
    common = ["fit", "--data", "concrete", "--n", "300", "--iters", "8", "--optimizer", "lbfgs", "--json"]
    main(common + ["--precond", "none"])
    exact = json.loads(capsys.readouterr().out)
    main(common + ["--precond", "afn", "--k", "100", "--w", "20"])
    ours = json.loads(capsys.readouterr().out)
    assert ours["loss_trace"][-1] < ours["loss_trace"][0]
    assert abs(ours["loss_trace"][-1] - exact["loss_trace"][-1]) < 0.02 * abs(exact["loss_trace"][-1])
    assert abs(ours["test_rmse"] - exact["test_rmse"]) < 0.02 * exact["test_rmse"]


@pytest.mark.parametrize("argv, flag", [
    (["mll", "--noise", "1e-7", "--n", "50"], "--noise"),
    (["mll", "--lengthscale", "0", "--n", "50"], "--lengthscale"),
    (["mll", "--seed", "-5", "--n", "50"], "--seed"),
    (["fit", "--seed", "-1", "--iters", "1"], "--seed"),
    (["pcg", "--device", "nonsense", "--n", "50"], "--device"),
    (["mll", "--device", "cuda:7", "--n", "50"], "--device"),
])
def test_cli_errors_exit_2_with_one_line_naming_the_flag(argv, flag, capsys):
    if flag == "--device" and "cuda" in argv[2] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the device")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_cli_unwritable_output_exits_2(tmp_path):
    """Standard output on a full device: one line, exit 2, no traceback."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "gpnys.cli.main", "pcg", "--n", "60", "--json"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "standard output" in proc.stderr


@pytest.mark.parametrize("argv, flag", [(["fit", "--lr", "abc"], "--lr"), (["fit", "--kernel", "foo"], "--kernel"),
                                        (["fit", "--foo"], "--foo"), (["mll", "--n"], "--n"), (["nope"], "command"),
                                        (["--foo", "fit"], "--foo"), (["fit", "--iters", "-1"], "--iters"),
                                        (["fit", "--lr", "0"], "--lr"), (["reduce", "--lr", "nan"], "--lr"),
                                        (["reduce", "--fit-iters", "-1"], "--fit-iters")])
def test_argument_errors_are_one_line_naming_the_flag(argv, flag, capsys):
    """argparse's own errors (a bad value, an unknown flag) and out-of-range values exit 2 with one line,
    ``gpnys <command>: error: ...``, naming the flag (not argparse's whole usage block, nor the library's argument
    name)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    lines = err.strip().splitlines()
    prefix = f"gpnys {argv[0]}: error:" if argv[0] in ("fit", "mll", "reduce") else "gpnys: error:"
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith(prefix), err


def test_grow_landmarks_flag_reaches_the_settings():
    """``--grow-landmarks N`` sets ``EstimatorSettings.grow_landmarks`` (0: never grow; default 15)."""
    import argparse

    from gpnys.cli.common import add_estimator_args, estimator_from_args

    p = argparse.ArgumentParser()
    add_estimator_args(p)
    assert [estimator_from_args(p.parse_args(argv)).grow_landmarks
            for argv in ([], ["--grow-landmarks", "0"], ["--grow-landmarks", "7"])] == [15, None, 7]
