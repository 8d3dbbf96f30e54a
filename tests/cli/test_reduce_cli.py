"""``gpnys reduce``: reduced GPs, RFF and the exact GP through the command line."""

import json
import math

import pytest

from gpnys.cli.main import main

DATA = ["reduce", "--data", "concrete", "--n", "200"]
HYP = ["--lengthscale", "1.0", "--outputscale", "1.0", "--noise", "0.1"]
FIELDS = ("method", "m", "landmarks", "test_rmse", "test_nll", "error_vs_exact", "mean_rmse_vs_exact", "fit_s",
          "predict_s")

pytestmark = pytest.mark.filterwarnings("ignore::gpnys.checks.NumericalWarning")


def run_json(args, capsys):
    assert main(DATA + args + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def by(records, method, **kw):
    return [r for r in records if r["method"] == method and all(r[k] == v for k, v in kw.items())]


def test_reduce_json_records(capsys):
    out = run_json(HYP + ["--method", "exact,gsa,lla,ncr,nytro,rff", "--m", "30,60", "--landmarks", "uniform,fps"],
                   capsys)
    assert out["data"] == "concrete" and out["n_train"] == 200 and out["n_test"] > 0
    assert out["hyperparameters_source"] == "given" and out["fit"] is None
    assert out["hyperparameters"] == {"lengthscale": 1.0, "outputscale": 1.0, "noise": 0.1, "mean": 0.0}
    recs = out["records"]
    # exact once; rff once per m; gsa/lla/ncr/nytro per m x rule
    assert len(recs) == 1 + 2 * (1 + 4 * 2)
    for r in recs:
        for key in FIELDS:
            assert key in r
        assert r["test_rmse"] > 0 and r["fit_s"] >= 0 and r["predict_s"] >= 0
        assert r["mean_rmse_vs_exact"] is not None
    (ex,) = by(recs, "exact")
    assert ex["error_vs_exact"] == 0.0 and ex["m"] == 200 and ex["landmarks"] is None
    assert math.isfinite(ex["test_nll"])
    for r in by(recs, "rff"):
        assert r["error_vs_exact"] is None and r["landmarks"] is None and math.isfinite(r["test_nll"])
    for r in by(recs, "nytro"):
        assert r["test_nll"] is None and r["error_vs_exact"] > 0
    for m in (30, 60):
        for rule in ("uniform", "fps"):
            (lla,) = by(recs, "lla", m=m, landmarks=rule)
            (ncr,) = by(recs, "ncr", m=m, landmarks=rule)
            assert ncr["test_rmse"] == pytest.approx(lla["test_rmse"], rel=1e-6)
            assert ncr["test_nll"] == pytest.approx(lla["test_nll"], rel=1e-6)
            assert ncr["error_vs_exact"] == pytest.approx(lla["error_vs_exact"], rel=1e-6)
            assert lla["error_vs_exact"] > 0


def test_reduce_full_rank_lla_equals_exact(capsys):
    recs = run_json(HYP + ["--method", "exact,lla", "--m", "200", "--landmarks", "uniform"], capsys)["records"]
    (ex,), (lla,) = by(recs, "exact"), by(recs, "lla")
    assert lla["m"] == 200
    assert lla["test_rmse"] == pytest.approx(ex["test_rmse"], rel=1e-6)
    assert lla["test_nll"] == pytest.approx(ex["test_nll"], rel=1e-6)
    assert lla["mean_rmse_vs_exact"] < 1e-6 * ex["test_rmse"]


def test_reduce_m_auto_and_no_error(capsys):
    out = run_json(HYP + ["--method", "lla,rff", "--m", "auto", "--no-error"], capsys)
    (lla,), (rff,) = by(out["records"], "lla"), by(out["records"], "rff")
    assert 1 <= lla["m"] <= 200 and lla["landmarks"] == "fps" and rff["m"] == lla["m"]
    assert out["exact_method"] is None
    assert lla["error_vs_exact"] is None and lla["mean_rmse_vs_exact"] is None


def test_reduce_fits_hyperparameters(capsys):
    out = run_json(["--fit-iters", "2", "--method", "exact,lla", "--m", "40"], capsys)
    assert out["hyperparameters_source"] == "fit" and out["fit"]["iters"] == 2
    hyp = out["hyperparameters"]
    assert set(hyp) == {"lengthscale", "outputscale", "noise", "mean"} and hyp["noise"] > 0
    (lla,) = by(out["records"], "lla")
    assert lla["error_vs_exact"] > 0 and lla["m"] == 40


def test_reduce_fit_defaults_apply_only_to_a_fit(capsys):
    """``--fit-iters`` and ``--lr`` default to 30 and 0.1 for a fit, and exit 2 with given hyperparameters."""
    out = run_json(["--fit-iters", "1", "--method", "lla", "--m", "20", "--no-error"], capsys)
    assert out["fit"]["iters"] == 1 and out["fit"]["lr"] == 0.1
    with pytest.raises(SystemExit) as exc:
        main(DATA + HYP + ["--method", "lla", "--m", "20", "--lr", "0.1", "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--lr" in err[0], err


def test_reduce_table(capsys):
    assert main(DATA + HYP + ["--method", "exact,lla,rff", "--m", "40"]) == 0
    text = capsys.readouterr().out
    assert "hyperparameters (given" in text and "test_rmse" in text and "err_vs_exact" in text
    assert sum(line.split()[0] in ("exact", "lla", "rff") for line in text.splitlines() if line.strip()) == 3


@pytest.mark.parametrize(
    "argv,name",
    [
        (HYP + ["--m", "0"], "--m"),
        (HYP + ["--m", "201"], "--m"),
        (HYP + ["--m", "ten"], "--m"),
        (HYP + ["--method", "foo"], "method"),
        (HYP + ["--landmarks", "grid"], "landmark"),
        (["--lengthscale", "1", "--outputscale", "1", "--noise", "-1"], "noise"),
        (["--lengthscale", "1", "--noise", "0.1"], "--outputscale"),
        (HYP + ["--ard"], "--ard"),
        (["--fit-iters", "-1"], "iters"),
    ],
)
def test_reduce_bad_input_names_the_argument(argv, name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(DATA + argv + ["--json"])
    assert exc.value.code == 2
    assert name in capsys.readouterr().err


def test_default_gsa_is_min_norm_and_within_twice_lla(capsys):
    """Elevators, n = 2000, m = 300, noise 0.05, l = 2, Matérn-3/2, FPS landmarks: the default GSA
    (min_norm) predicts within 2x LLA's test RMSE; --gsa-coef woodbury is the one that explodes there."""
    argv = ["reduce", "--data", "elevators", "--n", "2000", "--m", "300", "--noise", "0.05", "--lengthscale", "2",
            "--outputscale", "1", "--kernel", "matern32", "--method", "lla,gsa", "--no-error", "--json"]
    rmse = {}
    for coef in (None, "woodbury"):
        assert main(argv + ([] if coef is None else ["--gsa-coef", coef])) == 0
        recs = {r["method"]: r["test_rmse"] for r in json.loads(capsys.readouterr().out)["records"]}
        rmse[coef] = recs
    assert rmse[None]["gsa"] <= 2 * rmse[None]["lla"]
    assert rmse["woodbury"]["gsa"] > 5 * rmse[None]["lla"]
