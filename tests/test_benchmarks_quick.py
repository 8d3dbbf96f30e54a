"""Every benchmark's --quick mode runs, so benchmarks cannot rot."""

import importlib.util
import json
import math
import statistics

import pytest

from helpers import load_script


def load(name):
    return load_script("benchmarks", name)


#: JSON beside the results that is not one: a cache of fitted hyperparameters, a distributed worker's record
NOT_RESULTS = ("reduced_hyper", "worker_")


@pytest.fixture(autouse=True)
def results_carry_provenance(tmp_path):
    """Every result JSON a benchmark wrote names its command, date, commit, device and versions
    (:func:`gpnys.baselines.provenance.provenance`)."""
    yield
    for path in tmp_path.rglob("*.json"):
        if path.stem.startswith(NOT_RESULTS):
            continue
        data = json.loads(path.read_text())
        rec = data.get("provenance", data.get("meta", {}).get("provenance")) if isinstance(data, dict) else None
        assert isinstance(rec, dict), f"{path.name} has no provenance"
        assert rec["command"].startswith("python benchmarks/") and rec["date"].endswith("UTC"), path.name
        assert rec["device_name"] and rec["versions"]["torch"] and rec["threads"] >= 1, path.name
        assert "commit" in rec and "dirty" in rec, path.name


def test_pcg_tables_quick(tmp_path):
    out = tmp_path / "pcg.json"
    res = load("pcg_tables").main(["--quick", "--out", str(out)])
    assert out.exists() and out.with_suffix(".png").exists()
    data = json.loads(out.read_text())
    assert set(data["tables"]) == {"1a", "1b", "2", "3b"}
    for table in res["tables"].values():
        for row in table["rows"]:
            assert set(row["results"]) >= {"none", "afn", "auto", "pivchol15", "ran", "sketch", "fsai"}
            for r in row["results"].values():
                assert r["iterations"] >= 0 and r["setup_s"] >= 0


def test_afn_setup_quick(tmp_path):
    rows = load("afn_setup").main(["--quick", "--out", str(tmp_path / "afn.json")])
    assert len(rows) == 2 and all(r["setup_s"] > 0 and r["k"] == 100 for r in rows)
    assert rows[1]["cache_hits"] > 0  # the second length-scale reuses landmarks and the kNN pattern


def test_mll_accuracy_quick(tmp_path):
    out = load("mll_accuracy").main(["--quick", "--lengthscale", "1", "--out", str(tmp_path / "mll.json")])
    rows = {r["method"]: r for r in out["rows"]}
    higp = {"higp"} if importlib.util.find_spec("higp") is not None else set()
    assert set(rows) == {"exact", "gpytorch", "auto"} | higp
    assert rows["auto"]["loss_rel_error"] < 1e-3 and max(rows["auto"]["grad_rel_error"].values()) < 0.02
    # the time over GPyTorch's is the median of the per-seed ratios (the methods run in turn within a seed)
    ratios = [a["time_s"] / g["time_s"] for a, g in zip(rows["auto"]["per_seed"], rows["gpytorch"]["per_seed"])]
    assert rows["auto"]["time_over_gpytorch"] == pytest.approx(statistics.median(ratios))


def test_mll_accuracy_quick_with_a_control_variate_family(tmp_path):
    """``METHOD:FAMILY`` runs the gpnys method with that family: the same loss (the family moves only the gradient)."""
    out = load("mll_accuracy").main(["--quick", "--lengthscale", "1", "--methods", "afn:diag,afn:frozen",
                                     "--out", str(tmp_path / "mll.json")])
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"exact", "afn:diag", "afn:frozen"}
    assert rows["afn:diag"]["loss_rel_error"] == pytest.approx(rows["afn:frozen"]["loss_rel_error"], rel=1e-9)
    assert max(rows["afn:frozen"]["grad_rel_error"].values()) < 0.05


def test_fit_compare_quick(tmp_path):
    out = tmp_path / "fit.json"
    load("fit_compare").main(["--quick", "--threads", "1", "--out", str(out)])
    assert out.exists() and out.with_suffix(".png").exists()
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"exact", "gpytorch", "higp", "auto"}

    def numbers(v):
        if isinstance(v, dict):
            return [x for w in v.values() for x in numbers(w)]
        if isinstance(v, list):
            return [x for w in v for x in numbers(w)]
        return [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else []

    for name, rec in results.items():
        if "skipped" in rec:  # HiGP is optional
            assert name == "higp"
            continue
        for key in ("test_rmse", "test_nll", "train_time_s", "predict_time_s", "rmse_rel_diff", "nll_rel_diff",
                    "time_ratio"):
            assert key in rec, (name, key)
        assert len(rec["loss_trace"]) == len(rec["time_trace"]) == 3 and rec["checkpoints"][-1]["step"] == 3
        assert all(math.isfinite(x) for x in numbers(rec)), name


def test_reduced_compare_quick(tmp_path):
    out = tmp_path / "reduced.json"
    res = load("reduced_compare").main(["--quick", "--threads", "1", "--out", str(out)])
    assert out.exists() and out.with_suffix(".png").exists()
    r = res["elevators"]
    lla = {(a["landmarks"], a["m"]): a for a in r["approaches"] if a["method"] == "lla"}
    ncr = [a for a in r["approaches"] if a["method"] == "ncr"]
    assert ncr and all(abs(a["error_vs_exact"] - lla[(a["landmarks"], a["m"])]["error_vs_exact"])
                       <= 1e-6 * a["error_vs_exact"] for a in ncr)  # NCR = LLA ([SPA] Prop 2)
    assert all(a["error_vs_exact"] > 0 for a in r["approaches"])
    assert len(r["nytro"]["test_rmse_path"]) == r["nytro"]["t_max"]


def test_scale_quick(tmp_path):
    """Two on-the-fly MLL runs in child processes: time, peak RSS and the cutoff share are recorded."""
    out = tmp_path / "scale.json"
    res = load("scale").main(["--quick", "--threads", "1", "--dtypes", "float64", "--lengthscale", "0.3",
                              "--out", str(out)])
    rows = res["rows"]
    assert [r["n"] for r in rows] == [3000, 6000]
    for r in rows:
        assert r["kernel_storage"] == "on-the-fly" and r["peak_rss_mib"] > 0 and r["wall_s"] > 0
        assert math.isfinite(r["loss"]) and r["costs"]["product_s"] > 0
        assert r["extra"]["kernel_fraction"] == pytest.approx(r["costs"]["kernel_fraction"])
    assert 0 < rows[-1]["extra"]["kernel_fraction"] < 0.75  # unit density, l = 0.3: the cutoff skips entries
    assert out.exists() and out.with_suffix(".png").exists()
    assert res["knn"][0]["same_pattern"]


def test_gpu_quick(tmp_path):
    """The GPU benchmark on the CPU: products by torch tiles and (interpreted) Triton, MLL rows against
    Cholesky, short fits; every row in the JSON."""
    from gpnys.kernels.backends import triton_available

    out = tmp_path / "gpu.json"
    load("gpu").main(["--quick", "--out", str(out)])
    assert out.exists() and out.with_suffix(".png").exists()
    data = json.loads(out.read_text())
    rec = data["provenance"]
    assert rec["device_name"] and rec["versions"]["torch"] and "--quick" in rec["command"]
    products = data["products"]
    for backend in ("torch", "triton"):
        rows = [r for r in products if r["backend"] == backend]
        assert [r["n"] for r in rows] == [300, 600], backend
        if backend == "triton" and not triton_available():
            assert all(r["status"] == "skipped" for r in rows)
            continue
        assert all(r["status"] == "ok" and math.isfinite(r["time_s"]) and r["time_s"] > 0 for r in rows), rows
        assert all(r["entries_per_s"] == pytest.approx(r["n"] ** 2 / r["time_s"]) for r in rows)
    triton_rows = [r for r in products if r["backend"].startswith("triton") and r["n"] == 300 and r["status"] == "ok"]
    assert all(r["rel_error_vs_torch"] < 1e-4 for r in triton_rows)
    mll = [r for r in data["mll"] if r["method"] == "gpnys"]
    assert {r["data"] for r in mll} == {"kin40k", "synthetic3d"}
    for r in mll:
        assert r["status"] == "ok" and r["reference"] == "gpytorch_cholesky", r
        assert r["loss_abs_error"] < 1e-2 and math.isfinite(r["grad_max_rel_error"])
    assert any(r["method"] == "gpnys_prune0" and r["status"] == "ok" for r in data["mll"])
    fits = {r["method"]: r for r in data["fit"]}
    assert set(fits) == {"gpnys", "gpytorch_cg", "cholesky"}
    for r in fits.values():
        assert r["status"] == "ok" and len(r["loss_trace"]) == 3 and math.isfinite(r["final_loss"]), r
        assert r["wall_s"] > 0 and r["hyperparameters"]["noise"] > 0
    # per-step diagnostics of the gpnys fit (to explain a slow step): its CG iterations, probes and preconditioner
    info = fits["gpnys"]["step_info"]
    assert len(info) == 3 and all(i["cg_iterations"] > 0 and i["probes"] > 0 and i["precond"] for i in info), info
    assert fits["cholesky"]["step_info"] == [None] * 3


def test_gpu_fit_resumes_from_its_checkpoint(tmp_path):
    """The long fit's ``--fit-checkpoint``: a run cut after 2 steps, rerun for 4, continues the traces and the
    clock of the first and ends where one straight 4-step run ends."""
    gpu = load("gpu")
    base = ["--quick", "--parts", "fit", "--real-sizes", "", "--fit-synthetic-sizes", "", "--fit-1e6",
            "--fit-1e6-n", "300", "--dtype", "float64"]
    ck = tmp_path / "fit.pt"
    rows = []
    for steps, name, extra in (("2", "a", ["--fit-checkpoint", str(ck)]), ("4", "b", ["--fit-checkpoint", str(ck)]),
                               ("4", "c", [])):
        out = tmp_path / f"{name}.json"
        gpu.main(base + ["--fit-1e6-steps", steps, "--out", str(out)] + extra)
        rows.append(json.loads(out.read_text())["fit"][0])
    first, resumed, straight = rows
    assert first["status"] == resumed["status"] == "ok" and resumed["resumed_at_step"] == 2
    assert resumed["loss_trace"][:2] == first["loss_trace"] and resumed["time_trace"][:2] == first["time_trace"]
    assert len(resumed["time_trace"]) == 4 and resumed["time_trace"] == sorted(resumed["time_trace"])
    assert resumed["step_info"][:2] == first["step_info"] and len(resumed["step_info"]) == 4
    assert resumed["loss_trace"] == pytest.approx(straight["loss_trace"], rel=1e-3)
    assert resumed["hyperparameters"]["lengthscale"] == pytest.approx(straight["hyperparameters"]["lengthscale"],
                                                                      rel=1e-3)


def test_gpu_paths_quick(tmp_path):
    """The GPU benchmark's ``paths`` part on the CPU: every other public path once (builds, PCG, hook, prediction,
    reduced posterior, BoTorch model, CLI subprocess), each an ``ok`` row with finite results."""
    out = tmp_path / "gpu_paths.json"
    load("gpu").main(["--quick", "--parts", "paths", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["products"] == data["mll"] == data["fit"] == []
    rows = {r["path"]: r for r in data["paths"]}
    assert list(rows) == ["fps", "knn", "cutoff_plan", "afn", "nystrom", "fsai", "pivchol", "auto", "pcg",
                          "hook_mll", "predict", "reduced", "botorch", "cli"]
    for name, r in rows.items():
        assert r["status"] == "ok" and r["n"] == 600 and r["finite"] is True, r
        assert math.isfinite(r["time_s"]) and 0 <= r["time_s"] <= r["wall_s"], r
    for name in ("predict", "reduced", "botorch"):
        assert rows[name]["positive_variance"] is True and rows[name]["m"] == (10 if name == "botorch" else 50)
    assert rows["fps"]["k"] == 500 and rows["knn"]["w"] == 30
    assert all(rows[name]["rank"] == 500 for name in ("afn", "nystrom", "pivchol"))
    assert rows["pcg"]["rel_residual"] < 1e-4 and rows["pcg"]["iterations"] > 0
    assert rows["botorch"]["preconditioned"] and rows["cli"]["exit_code"] == 0


def test_error_bars_quick(tmp_path):
    out = load("error_bars").main(["--quick", "--out", str(tmp_path / "eb.json")])
    cov = out["coverage"]
    assert len(cov["z_loss"]) == out["seeds"] == 6 and all(abs(z) < 10 for z in cov["z_loss"])
    assert cov["loss"] >= 0.5 and min(cov["grad"].values()) >= 0.5  # a loose floor at 6 seeds; RESULTS has 20
    assert out["accuracy"]["median_probes"] >= 16 and out["accuracy"]["share_within"] >= 0.5
    assert (tmp_path / "eb.png").exists() and len(out["hand_tuned"]) == 2


def test_variances_quick(tmp_path):
    res = load("variances").main(["--quick", "--out", str(tmp_path / "var.json")])
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["cached"]["covered"] == 1.0 and rows["cholesky"]["rel_err_max"] == 0.0
    assert (tmp_path / "var.png").exists()


def test_frontier_quick(tmp_path):
    res = load("frontier").main(["--quick", "--out", str(tmp_path / "fr.json")])
    case = res["cases"][0]
    assert {r["method"] for r in case["rows"]} >= {"gpnys", "gpytorch"}
    assert all("loss_rel_error" in r for r in case["rows"] if r["method"] == "gpnys")
    assert set(case["checks"]) == {"loss_rel_error", "grad_rel_error"} and (tmp_path / "fr.png").exists()
    # --refresh gpnys re-measures gpnys only: the peers' rows are the first run's, the case stays one case
    # (with two estimator seeds: root mean square errors over them, the per-seed ones kept)
    again = load("frontier").main(["--quick", "--out", str(tmp_path / "fr.json"), "--refresh", "gpnys",
                                   "--seeds", "0,1", "--max-time", "1e6"])
    assert len(again["cases"]) == 1
    kept = [r for r in again["cases"][0]["rows"] if r["method"] != "gpnys"]
    assert kept == [dict(r, command=r["command"]) for r in case["rows"] if r["method"] != "gpnys"]
    fresh = [r for r in again["cases"][0]["rows"] if r["method"] == "gpnys"]
    assert len(fresh) == len([r for r in case["rows"] if r["method"] == "gpnys"])
    assert all("--refresh" in r["command"] for r in fresh)
    for r in fresh:
        assert r["seeds"] == [0, 1] and len(r["times_s"]) == 2
        rms = (sum(e * e for e in r["loss_rel_errors"]) / 2) ** 0.5
        assert abs(r["loss_rel_error"] - rms) <= 1e-12 and min(r["loss_rel_errors"]) <= r["loss_rel_error"]
        assert r["loss_rel_errors"][0] != r["loss_rel_errors"][1]  # different probes, different draws
    # a cap below every setting: nothing runs, each row says so, and no budget is checked
    capped = load("frontier").main(["--quick", "--out", str(tmp_path / "fr.json"), "--refresh", "gpnys",
                                    "--max-time", "1e-9"])
    rows = [r for r in capped["cases"][0]["rows"] if r["method"] == "gpnys"]
    assert rows and all(r.get("over_max_time") for r in rows) and capped["cases"][0]["max_time_s"] == 1e-9
    # --beyond runs just the rows over the cap, at the seeds, with no cap; every other row is kept as it was
    beyond = load("frontier").main(["--quick", "--out", str(tmp_path / "fr.json"), "--refresh", "gpnys",
                                    "--beyond", "--seeds", "0,1"])
    case = beyond["cases"][0]
    rows = [r for r in case["rows"] if r["method"] == "gpnys"]
    assert len(rows) == len(fresh) and not any(r.get("over_max_time") for r in rows)
    assert all(r["seeds"] == [0, 1] and "--beyond" in r["command"] for r in rows)
    assert [r for r in case["rows"] if r["method"] != "gpnys"] == [r for r in capped["cases"][0]["rows"]
                                                                    if r["method"] != "gpnys"]
    assert case["max_time_s"] is None and set(case["checks"]) == {"loss_rel_error", "grad_rel_error"}


def test_distributed_quick(tmp_path):
    """The distributed benchmark at n = 2000: P = 1 without a group, P = 1 and 2 with one (gloo); identical results,
    the communication counted, the cost model's rows."""
    out = tmp_path / "distributed.json"
    load("distributed").main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [(r["procs"], r["plain"]) for r in runs] == [(1, True), (1, False), (2, False)]
    assert runs[0]["collectives"] == 0 and runs[2]["collectives"] > 0 and runs[2]["mib_received"] > 0
    for build in ("build", "nystrom"):  # AFN, Nyström
        assert runs[0][f"{build}_mib_received"] == 0 and runs[2][f"{build}_mib_received"] > 0
        assert all(r[f"{build}_logdet_diff"] <= 1e-10 for r in runs)
    assert all(0 < r["apply_share"] < 1 for r in runs)
    for r in runs[1:]:
        assert r["loss_diff"] <= 1e-10 * abs(runs[0]["loss"]) and r["grad_diff"] <= 1e-9
    assert {(m["n"], m["gpus"]) for m in data["cost_model"]} >= {(10_000_000, 8), (1_000_000, 1)}
    # memory per rank: the evaluation's peak at n and at --mem-n (n / 5), and the model's GiB per rank from them
    # (quick: P = 1 with a group is timed only)
    assert all(r["mem_n"] == 400 and r["eval_mib"] > 0 and r["mem_n_eval_mib"] > 0 for r in (runs[0], runs[2]))
    assert runs[1]["bytes_per_point"] is None
    mem = data["memory_model"]
    assert mem["replicated_bytes_per_point"] > 0 and mem["split_bytes_per_point"] >= 0
    ten = {m["gpus"]: m["rank_gib"] for m in data["cost_model"] if m["n"] == 10_000_000}
    assert ten[1] >= ten[8] > 0
    assert out.with_suffix(".png").exists()

    # the model alone from that run, with another single-GPU time; and the memory from two worker records
    bench = load("distributed")
    model = tmp_path / "model.json"
    bench.main(["--model-from", str(out), "--gpu-mll-1e6-s", "17", "--out", str(model)])
    again = json.loads(model.read_text())
    assert again["memory_model"] == mem
    row = next(m for m in again["cost_model"] if (m["n"], m["gpus"]) == (10_000_000, 8))
    assert row["no_cutoff_s"] == pytest.approx(17 * 100 / 8 + row["allgather_s"])
    recs = [tmp_path / "worker_a.json", tmp_path / "worker_b.json"]
    for path, n, mib in zip(recs, (200_000, 40_000), (2731.5, 1103.0)):
        path.write_text(json.dumps({"procs": 1, "plain": True, "n": n, "eval_mib": mib}))
    bench.main(["--model-from", str(out), "--memory-from", ",".join(map(str, recs)), "--out", str(model)])
    got = json.loads(model.read_text())["memory_model"]
    assert got["replicated_bytes_per_point"] == pytest.approx((2731.5 - 1103.0) * 2**20 / 160_000)
    recs[1].write_text(json.dumps({"procs": 1, "plain": True, "n": 200_000, "eval_mib": 1.0}))  # one size twice
    with pytest.raises(SystemExit, match="two sizes"):
        bench.main(["--model-from", str(out), "--memory-from", ",".join(map(str, recs)), "--out", str(model)])


def test_ab_quick(tmp_path):
    """This tree against itself: the same loss and gradient to the bit (same seeds, same code), ratios near 1."""
    out = load("ab").main(["--quick", "--out", str(tmp_path / "ab.json")])
    (row,) = out["rows"]
    assert row["loss_rel_diff"] == 0.0 and row["grad_rel_diff"] == 0.0
    assert row["calls_before"] == row["calls_after"] and row["calls_after"]["matmul"] > 0
    assert row["before_s"] > 0 and row["product_after_s"] > 0 and (tmp_path / "ab.json").exists()
    with pytest.raises(SystemExit):
        load("ab").main(["--cases", "kin40k:10:rbf", "--before-path", "."])


def test_kernel_model_quick(tmp_path):
    """The static model compiles this tree's product kernel for sm_90 (in a child: the test process interprets the
    kernels) and counts a positive, spill-free instruction budget per tile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "km.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "kernel_model.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["kernels"]
    assert row["columns"] == 17 and 200 < row["after_instructions"] < 5000 and row["after_spill_stores"] == 0


def test_small_n_quick(tmp_path):
    res = load("small_n").main(["--quick", "--out", str(tmp_path / "small_n.json")])
    for runs in res["fits"].values():
        assert runs["cholesky (--precond none)"]["path"] == "cholesky"
        assert runs["preconditioned (--solver iterative)"]["path"] == "iterative"
        # the same model either way: the preconditioned fit's test RMSE within 2 % of Cholesky's
        base = runs["cholesky (--precond none)"]["test_rmse"]
        assert abs(runs["auto"]["test_rmse"] - base) <= 0.02 * base
    assert {r["op"] for r in res["factorisations"]["busy"]} == {"eigvalsh", "eigh", "cholesky", "qr"}


def test_thin_products_quick(tmp_path):
    """Every form timed at every column count for both dtypes, each row naming its fastest form, the timed choice
    one of the forms; JSON and PNG written."""
    from gpnys.linalg import THIN_FORMS

    out = tmp_path / "thin.json"
    bench = load("thin_products")
    res = bench.main(["--quick", "--out", str(out)])
    assert set(res["dtypes"]) == {"float64", "float32"} and set(res["chosen"].values()) <= set(THIN_FORMS)
    for rows in res["dtypes"].values():
        assert [r["t"] for r in rows] == [2, 5, 17]
        for r in rows:
            assert all(r[form] > 0 for form in bench.FORMS)
            assert r[r["fastest"]] == min(r[form] for form in bench.FORMS)
    assert json.loads(out.read_text())["n"] == 512 and out.with_suffix(".png").exists()


def test_warm_start_quick(tmp_path):
    res = load("warm_start").main(["--quick", "--out", str(tmp_path / "warm.json")])
    assert len(res["warm"]) == len(res["cold"]) == len(res["reuse"]) == 3

    def agree(a, b):  # within the two estimates' error bars, or the solves' relative tolerance where those vanish
        bars = 4 * (a["loss_std_error"] ** 2 + b["loss_std_error"] ** 2) ** 0.5
        return abs(a["loss"] - b["loss"]) <= bars + 1e-8 * abs(b["loss"])

    # the same trajectory, and no more y-solve iterations when warm
    for w, c in zip(res["warm"], res["cold"]):
        assert agree(w, c), (w, c)
        assert w["y_solve_iterations"] <= c["y_solve_iterations"]
    # preconditioner reuse: fewer builds; the same hyperparameters up to the first reused step (whose estimate, from a
    # stale preconditioner, lies within its wider error bars); after it the trajectories part, ending at the same
    # Cholesky loss
    builds = [r["builds"] for r in res["reuse"]]
    assert builds[-1] < res["warm"][-1]["builds"]
    first_reused = next(i for i in range(1, len(builds)) if builds[i] == builds[i - 1])
    for w, r in zip(res["warm"][:first_reused + 1], res["reuse"]):
        assert agree(w, r), (w, r)
    final = res["final_cholesky_loss"]
    assert abs(final["reuse"] - final["warm"]) <= 1e-3 * abs(final["warm"]), final


def test_laplace_quick(tmp_path):
    res = load("laplace").main(["--quick", "--out", str(tmp_path / "laplace.json")])
    # gpnys's log q and gradient against the dense Cholesky Laplace, within their own error bars
    assert res["log_q_error_in_std_errors"] <= 4 and res["gradient_errors_in_std_errors_max"] <= 4.5
    assert 0.6 <= res["gpnys"]["test_accuracy"] <= 1.0 and len(res["gpnys"]["history"]) == res["steps"]
    assert res["svgp"]["rows"] and all(0.0 <= r["accuracy"] <= 1.0 for r in res["svgp"]["rows"])
    assert (tmp_path / "laplace.png").exists()
    # without the dense reference (large n): gpnys and SVGP only, the same trained model for the same seed
    bare = load("laplace").main(["--quick", "--no-dense", "--out", str(tmp_path / "bare.json")])
    assert bare["dense"] is None and bare["log_q_error_per_point"] is None
    assert all(v["dense"] is None for v in bare["gradient"].values())
    assert bare["gpnys"]["log_q"] == res["gpnys"]["log_q"] and bare["svgp"]["rows"]


def test_classify_scale_quick(tmp_path):
    res = load("classify_scale").main(["--quick", "--out", str(tmp_path / "scale.json")])
    assert 0.6 <= res["gpnys"]["test_accuracy"] <= 1.0 and len(res["gpnys"]["history"]) == res["steps"]
    assert 1 <= res["gpnys"]["rank"] <= res["m"]
    for key in ("svgp_minibatch", "svgp_full_batch"):
        rows = res[key]["rows"]
        assert rows and all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
        at = res[key]["seconds_to_gpnys_accuracy"]
        assert at is None or at in [r["seconds"] for r in rows if r["accuracy"] >= res["gpnys"]["test_accuracy"]]
    assert (tmp_path / "scale.png").exists()


def test_bo_variance_accuracy_quick(tmp_path):
    """The PCG posterior's variances and their gradients at the default ``posterior_variance_rtol`` meet it against
    ``SingleTaskGP`` in float64."""
    out = load("bo_variance_accuracy").main(["--quick", "--threads", "1", "--rtol", "none,1e-4",
                                            "--out", str(tmp_path / "bo_var.json")])
    rows = {r["rtol"]: r for r in out["rows"]}
    assert (tmp_path / "bo_var.json").exists() and set(rows) == {"none", "1e-4"}
    checked = rows["1e-4"]
    assert max(checked["cold_variance_error"], checked["warm_variance_error"]) <= 1e-4
    assert checked["warm_gradient_error"] <= 1e-3


def test_first_call_quick(tmp_path):
    """A fresh process's first evaluation and its warm ones, on the CPU: every time recorded, the record's
    difference its first minus its warm time."""
    out = tmp_path / "first_call.json"
    res = load("first_call").main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(res))
    assert [r["caches"] for r in data["rows"]] == ["empty", "filled"]  # the second process finds them on disk
    for row in data["rows"]:
        assert row["first_s"] > 0 and row["warm_s"] > 0
        assert row["extra_s"] == pytest.approx(row["first_s"] - row["warm_s"])
