"""``gpnys classify``: the command's record is the classifier's own result on the same data, its log q agrees with a
dense Cholesky Laplace, and a bad flag exits 2 with one line naming it."""

from __future__ import annotations

import json

import gpytorch
import pytest
import torch

from gpnys import datasets
from gpnys.baselines.laplace import dense_laplace
from gpnys.classify import LaplaceGPClassifier, ReducedLaplaceClassifier
from gpnys.cli.main import main

DATA = ["classify", "--data", "concrete", "--n", "300", "--seed", "0"]


def run_json(args, capsys):
    assert main(DATA + args + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def concrete_problem():
    """The command's data (standardised inputs, labels above the median) and its kernel at ℓ = 2, outputscale 1."""
    ds = datasets.load("concrete", n=300, seed=0, standardize=False)
    X = ds.train_x
    X = (X - X.mean(0)) / X.std(0)
    y = (ds.train_y > ds.train_y.median()).double()
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
    kernel.base_kernel.lengthscale, kernel.outputscale = 2.0, 1.0
    return X, y, kernel


def test_record_matches_the_classifier_and_the_dense_reference(capsys):
    rec = run_json(["--steps", "2", "--lengthscale", "2.0", "--k", "100"], capsys)
    X, y, kernel = concrete_problem()
    clf = LaplaceGPClassifier(kernel, precond_options={"k": 100}, num_probes=32, optimizer_steps=2).fit(X, y)
    assert rec["log_marginal_likelihood"] == clf.log_marginal_likelihood_  # same seed, same run
    assert rec["lengthscale"] == clf.kernel_.base_kernel.lengthscale.detach().reshape(-1).tolist()  # trained
    assert len(rec["history"]) == 2 and 0.5 < rec["test_accuracy"] <= 1.0
    with torch.no_grad():
        ref = float(dense_laplace(clf.kernel_(X).to_dense(), y).log_q)
    assert abs(rec["log_marginal_likelihood"] - ref) <= 4 * rec["std_error"] + 1e-6 * abs(ref)
    assert set(rec["gradient"]) == {"raw_outputscale", "base_kernel.raw_lengthscale"}


def test_reduced_record_matches_the_classifier_and_the_dense_reference(capsys):
    rec = run_json(["--steps", "3", "--lengthscale", "2.0", "--reduced", "40", "--landmarks", "fps", "--subsample",
                    "200"], capsys)
    X, y, kernel = concrete_problem()
    clf = ReducedLaplaceClassifier(kernel, m=40, landmarks="fps", optimizer_steps=3, subsample=200).fit(X, y)
    assert rec["log_marginal_likelihood"] == clf.log_marginal_likelihood_
    assert rec["std_error"] is None and rec["gradient_std_error"] is None and rec["reduced"] == 40
    assert rec["rank"] == clf.rank_ and rec["landmarks"] == "fps"
    with torch.no_grad():  # the dense Laplace on the same Nyström features
        Phi = clf._fmap(X)
        ref = float(dense_laplace(Phi @ Phi.mT, y).log_q)
    assert abs(rec["log_marginal_likelihood"] - ref) <= 1e-8 * abs(ref)
    assert set(rec["gradient"]) == {"raw_outputscale", "base_kernel.raw_lengthscale"}


def test_text_output(capsys):
    assert main(DATA + ["--steps", "0", "--k", "50"]) == 0
    out = capsys.readouterr().out
    assert "log q =" in out and "test accuracy" in out


@pytest.mark.parametrize("args, flag", [
    (["--steps", "-1"], "--steps"),
    (["--lr", "0"], "--lr"),
    (["--lengthscale", "-2"], "--lengthscale"),
    (["--outputscale", "nan"], "--outputscale"),
    (["--probes", "1"], "--probes"),
    (["--k", "301"], "--k"),
    (["--labels", "binary"], "--labels"),
    (["--reduced", "0"], "--reduced"),
    (["--reduced", "301"], "--reduced"),
    (["--reduced", "20", "--subsample", "400"], "--subsample"),
    (["--subsample", "100"], "--subsample"),
    (["--landmarks", "fps"], "--landmarks"),
    (["--reduced", "20", "--k", "50"], "--k"),
    (["--reduced", "20", "--probes", "8"], "--probes"),
])
def test_bad_flags_exit_2_naming_the_flag(args, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(DATA + args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err
