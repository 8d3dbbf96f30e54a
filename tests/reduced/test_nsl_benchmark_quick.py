"""The NSL SVM benchmark's --quick mode and the NSL SVM example run and report sensible numbers."""

import json
import math

from helpers import load_script


def test_nsl_svm_quick(tmp_path):
    out = tmp_path / "nsl_svm.json"
    res = load_script("benchmarks", "nsl_svm").main(["--quick", "--threads", "1", "--out", str(out)])
    assert out.exists() and out.with_suffix(".png").exists()
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"breast_cancer", "digits", "elevators", "synthetic"}
    for name, r in res["results"].items():
        assert {"gpnys kmeans", "gpnys uniform", "sklearn Nystroem"} <= set(r["methods"]), name
        ex = r["exact_svc"]
        assert 0.6 < ex["accuracy"] <= 1 and ex["n"] <= 2000 and ex["time_s"] > 0
        for rows in r["methods"].values():
            assert [row["m"] for row in rows] == [20, 50]
            assert all(0.5 < row["accuracy"] <= 1 and math.isfinite(row["time_s"]) for row in rows)
        best = max(row["accuracy"] for row in r["methods"]["gpnys kmeans"])
        assert best > ex["accuracy"] - 0.05, name  # 50 k-means landmarks come close to the exact SVM
    assert {"GSA krr", "LLA krr"} <= set(res["results"]["digits"]["methods"])


def test_nsl_svm_example(capsys):
    """The example's cross-validated NSL pipeline comes within 1 % of the exact SVC on digits (9 vs rest)."""
    res = load_script("examples", "nsl_svm").main(["--m", "25,100"])
    assert res["m"] in (25, 100) and res["nsl_accuracy"] >= res["svc_accuracy"] - 0.01
    assert "exact SVC" in capsys.readouterr().out
