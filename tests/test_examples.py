"""The runnable examples run (at small sizes) and report sensible numbers."""

import pytest
from helpers import load_script


def load(name):
    return load_script("examples", name)


def test_quickstart_hook_loss_matches_cholesky(capsys):
    """The quickstart trains under the one-line hook; its final loss is GPyTorch's Cholesky loss at the same
    hyperparameters to within three of its standard errors (plus 1e-4), and it prints the loss ± its error."""
    import math

    res = load("quickstart").main(["--n", "600", "--iters", "6"])
    assert abs(res["loss"] - res["cholesky_loss"]) <= 3 * res["loss_std_error"] + 1e-4
    assert 0 <= res["loss_std_error"] < 1e-2 and math.isfinite(res["rmse"]) and 0 < res["rmse"] < 1
    out = capsys.readouterr().out
    assert "±" in out and "Cholesky" in out and "test RMSE" in out


def test_preconditioned_cg_example():
    rows = {r["precond"]: r for r in load("preconditioned_cg").main(["--n", "800", "--lengthscale", "3"])}
    assert all(r["converged"] for r in rows.values())
    assert rows["afn"]["iterations"] * 3 <= rows["none"]["iterations"]


def test_gpytorch_training_example_matches_cholesky():
    res = load("gpytorch_training").main(["--data", "concrete", "--n", "400", "--iters", "5"])
    ch, gp = res["cholesky"], res["gpnys"]
    if gp["path"] == "iterative":  # the suite's default (tests/conftest.py)
        assert gp["builds"] == 6 and gp["cg_applications"] > 0  # one per step, one for the final hyperparameters
    else:  # auto's cost model took GPyTorch's Cholesky at this n
        assert gp["builds"] == 0 and gp["path"] == "cholesky"
    assert abs(gp["rmse"] - ch["rmse"]) / ch["rmse"] < 0.02
    assert abs(gp["noise"] - ch["noise"]) / ch["noise"] < 0.02


def test_reduced_posteriors_example():
    res = load("reduced_posteriors").main(["--data", "concrete", "--n", "300", "--m", "40", "--iters", "1"])
    assert res


def test_large_n_example_matches_cholesky_at_the_first_step():
    """The example trains on the fly (dense cache off); its first loss equals GPyTorch's Cholesky loss at the same
    initial hyperparameters (stochastic estimate: 1 % tolerance), and the kernel share is reported."""
    mod = load("large_n")
    # growth after any step (--grow-landmarks 1): AFN's 500 landmarks become 1 000 at the second step
    rows = mod.main(["--n", "3000", "--steps", "2", "--dtype", "float64", "--block-mib", "4", "--grow-landmarks", "1"])
    assert len(rows) == 2 and all(0 < r["kernel_fraction"] <= 1 for r in rows)
    if rows[0]["path"] == "iterative":  # the suite's default (tests/conftest.py)
        assert [(r["precond"], r["rank"]) for r in rows] == [("afn", 500), ("afn", 1000)], rows
    exact = initial_cholesky_loss(mod, 3000)
    assert abs(rows[0]["loss"] - exact) <= 1e-2 * abs(exact)


def initial_cholesky_loss(mod, n):
    """GPyTorch's Cholesky loss of the large-n examples' model at their initial hyperparameters."""
    import gpytorch
    import torch

    ds = mod.datasets.load("synthetic3d", n=n, seed=0, standardize=False)
    y = (ds.train_y - ds.train_y.mean()) / ds.train_y.std()
    model = mod.GP(ds.train_x, y).double()
    model.covar_module.base_kernel.lengthscale = 1.0
    model.likelihood.noise = 0.1
    model.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(model.likelihood, model)
    with gpytorch.settings.max_cholesky_size(10**6), torch.no_grad():
        return float(-mll(model(ds.train_x), y))


def test_gpu_training_example_runs_on_the_cpu():
    """Without a GPU the example trains on the CPU through the torch tiles; its first loss equals GPyTorch's
    Cholesky loss at the initial hyperparameters (stochastic estimate: 1 % tolerance)."""
    mod = load("gpu_training")
    res = mod.main(["--n", "600", "--steps", "2", "--predict", "50", "--device", "cpu", "--dtype", "float64"])
    assert res["backend"] == "torch" and len(res["losses"]) == 2
    assert res["mean"].shape == (50,) and bool((res["var"] > 0).all())
    assert abs(res["losses"][0] - initial_cholesky_loss(mod, 600)) <= 1e-2 * abs(res["losses"][0])


def test_known_noise_example():
    """AFN on K + D itself needs a fraction of the PCG iterations of AFN on K + mean(D) I, and training with
    FixedNoiseGaussianLikelihood under the hook ends where Cholesky ends."""
    res = load("known_noise").main(["--n", "500", "--iters", "2"])
    its = res["pcg_iterations"]
    assert its["per-point (diag=D)"] * 3 <= its["mean(D) I"]
    assert abs(res["gpnys"]["loss"] - res["cholesky"]["loss"]) <= 1e-3 * abs(res["cholesky"]["loss"])
    assert abs(res["gpnys"]["lengthscale"] - res["cholesky"]["lengthscale"]) <= 1e-2 * res["cholesky"]["lengthscale"]


def test_error_bars_example(capsys):
    load("error_bars").main(["--n", "300", "--accuracy", "1e-2", "--iters", "4"])
    out = capsys.readouterr().out
    assert "±" in out and "probes to reach it" in out and "Adam:" in out


def test_predictive_variances_example(capsys):
    """Cached variances: every error within its bound; with a requested accuracy every bound meets it."""
    res = load("predictive_variances").main(["--n", "1200", "--test", "200", "--rel-error", "0.02"])
    ref, noise = res.pop("reference"), res.pop("noise")
    for name, r in res.items():
        assert bool(((r["variance"] - ref).abs() <= r["bound"] + 1e-10).all()), name
    refined = res["cached, refined"]
    assert bool((refined["bound"] <= 0.02 * (refined["variance"] - noise) * (1 + 1e-9)).all())
    assert "bound / variance" in capsys.readouterr().out


def test_batch_mode_example_matches_cholesky(capsys):
    pytest.importorskip("botorch")
    res = load("batch_mode").main(n=200, steps=5)
    for ours, exact, se in zip(res["gpnys"], res["cholesky"], res["std_error"]):
        assert abs(ours - exact) <= 4 * se + 1e-6, (ours, exact, se)
    assert "output 1" in capsys.readouterr().out


def test_laplace_classification_example():
    res = load("laplace_classification").main(["--n", "400", "--steps", "6"])
    assert res["end"] > res["start"] + 3 * res["end_std_error"]  # training raised log q beyond its error bars
    assert res["accuracy"] > 0.8


def test_reduced_laplace_classification_example():
    res = load("reduced_laplace_classification").main(["--n", "2000", "--m", "60", "--steps", "10", "--subsample",
                                                       "500"])
    assert res["end"] > res["start"] + 10  # training raised the exact log q
    assert res["accuracy"] > 0.85 and 1 <= res["rank"] <= 60


def test_laplace_student_t_example():
    res = load("laplace_student_t").main(["--n", "400", "--steps", "8"])
    assert res["rmse_student_t"] < 0.5 * res["rmse_gaussian"]  # the outliers pull the Gaussian GP, not the t
    assert res["scale"] < 0.3 < res["gaussian_noise_sd"]


def test_laplace_poisson_example():
    res = load("laplace_poisson").main(["--n", "400", "--steps", "6"])
    assert res["end"] > res["start"] + 3 * res["end_std_error"]  # training raised log q beyond its error bars
    assert res["rmse"] < 0.5 * res["rate_sd"]  # the predicted rates follow the true ones


def test_bo_knowledge_gradient_example():
    """qKG on the fantasy models: its value and gradient match SingleTaskGP's, and optimize_acqf finds a point."""
    res = load("bo_knowledge_gradient").main(["--n", "400", "--fit-n", "200", "--check-n", "200", "--fantasies", "8",
                                              "--restarts", "2", "--raw-samples", "16", "--maxiter", "10"])
    assert res["value_rel_err"] < 1e-8 and res["grad_rel_err"] < 1e-6
    assert res["kg_value"] > 0 and 0 < res["candidate_value"] <= 3.3224


def test_bo_multi_objective_example():
    """A two-output model: its posterior matches SingleTaskGP's, and qLogEHVI iterations do not lose hypervolume."""
    res = load("bo_multi_objective").main(["--n", "500", "--iters", "1", "--max-cholesky-size", "200"])
    assert res["mean_rel_err"] < 1e-8 and res["var_rel_err"] < 5e-2
    assert res["n"] == 502 and res["hypervolumes"][1] >= res["hypervolumes"][0]
