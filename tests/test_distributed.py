"""The row-partitioned kernel across two gloo processes on the CPU against one process (float64)."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gpnys.collectives import row_range
from gpnys.kernels import make_kernel
from gpnys.kernels.backends import LEAF
from gpnys.kernels.backends.torch_tiles import TorchTiles
from gpnys.kernels.formulas import formula
from gpnys.kernels.operator import StationaryKernelOperator

WORKER = Path(__file__).with_name("distributed_worker.py")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode: str, out: Path, size: int = 2, timeout: float = 240, extra_env: dict | None = None) -> list:
    """``size`` worker processes (one rank each) on the same gloo group; returns their exit codes."""
    port = _free_port()
    procs = []
    for rank in range(size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    codes = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        codes.append(p.returncode)
        if p.returncode not in (0, 3):
            print(err[-3000:])
    return codes


def reference(mode: str, out: Path, extra_env: dict | None = None) -> dict:
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, **(extra_env or {})}
    subprocess.run([sys.executable, str(WORKER), mode, str(out)], env=env, check=True, timeout=240)
    return torch.load(out, weights_only=False)


def _close(a, b, tol=1e-10):
    if isinstance(a, (list, tuple)):
        return all(_close(x, y, tol) for x, y in zip(a, b))
    if a is None or isinstance(a, float):
        return a == b or abs(a - b) <= tol * max(1.0, abs(b))
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


def test_row_ranges_cover_the_rows_in_whole_leaves():
    for n in (1, 63, 64, 300, 1000):
        for size in (1, 2, 3, 8):
            ranges = [row_range(n, r, size) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a1 == b0 for (_, b0), (a1, _) in zip(ranges, ranges[1:]))
            assert all(a % LEAF == 0 or a == b == n for a, b in ranges)


@pytest.mark.parametrize("plan", [False, True], ids=["dense", "cutoff"])
def test_partial_passes_add_up_to_the_full_pass(dtype, plan):
    """``rows=`` on the torch tiles (the building block of a rank's share): row blocks of the product stack to
    the whole product; the sums over the row ranges add up to the whole sums."""
    g = torch.Generator().manual_seed(0)
    X = (torch.rand(400, 2, generator=g, dtype=torch.float64) * torch.tensor([300.0 if plan else 3.0, 4.0])).to(dtype)
    V = torch.randn(400, 3, generator=g, dtype=torch.float64).to(dtype)
    kern = make_kernel("matern32").to(dtype)
    op = StationaryKernelOperator(X, kern.outputscale, kern.base_kernel.lengthscale, base=kern.base_kernel,
                                  cache={}, dense_limit_bytes=0, backend="torch")
    perm, Z, p = op._working()
    assert (p is not None) == plan
    Vw = V if perm is None else V[perm]
    tiles = TorchTiles(formula(1.5))
    full = tiles.matmul(Z, Vw, p)
    ranges = [row_range(400, r, 3) for r in range(3)]
    parts = [tiles.matmul(Z, Vw, p, r) for r in ranges]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # the full product mirrors its upper tiles: a cutoff tile K[J, I] then comes from leaf I's centring, not J's,
    # which in float32 rounds the expanded distances differently (each within ~1e-4 of float64 here)
    ptol = 3e-4 if plan and dtype == torch.float32 else tol
    assert float((torch.cat(parts) - full).abs().max()) <= ptol * float(full.abs().max())
    # the symmetric product's split: shares of the upper tiles add up to the whole product, also with more ranks
    # than 64-point leaves (7 here, the last one partial): every rank's share is then a valid, possibly empty range
    for n_small, size in ((100, 8), (100, 13)):  # 2 leaves: ranks past the last leaf start where it starts
        assert tiles.upper_split(n_small, None, size)[1:-1] == [64] * (size - 1)
    for size in (2, 3, 8, 13):
        cuts = tiles.upper_split(400, p, size)
        assert cuts[0] == 0 and cuts[-1] == 400 and cuts == sorted(cuts)
        assert all(c % LEAF == 0 for c in cuts[:-1])
        shares = [tiles.upper_matmul(Z, Vw, p, (a, b)) for a, b in zip(cuts, cuts[1:])]
        assert float((sum(shares) - full).abs().max()) <= tol * float(full.abs().max())
    # the whole per-probe sums are symmetric too (upper tiles and their mirrors), the row ranges' are not: in
    # float32 the tiles' kernel values then round differently (the sums themselves are float64)
    # (each within ~1e-4 of float64 on the length-scale sums here, symmetric or by rows)
    stol = 1e-10 if dtype == torch.float64 else 5e-4 if plan else 1e-5
    cuts = tiles.upper_split(400, p, 3)
    Uw = torch.flip(Vw, [0]) + 0.5  # U != V: the mirrored terms swap them
    for fn, upper in ((tiles.derivative_sums, tiles.upper_derivative_sums),
                      (lambda *a: tiles.column_derivative_sums(*a[:4], False, *a[4:]),
                       lambda *a: tiles.upper_column_derivative_sums(*a[:4], False, *a[4:]))):
        whole = fn(Z, Uw, Vw, p)
        split = [fn(Z, Uw, Vw, p, r) for r in ranges]
        # (float32: a share's tiles start elsewhere, so some pairs come as K[j, i] instead of K[i, j])
        shares = [upper(Z, Uw, Vw, p, (a, b)) for a, b in zip(cuts, cuts[1:])]
        for i in range(2):
            total = sum(s[i] for s in split)
            assert float((total - whole[i]).abs().max()) <= stol * float(whole[i].abs().max())
            total = sum(s[i] for s in shares)
            assert float((total - whole[i]).abs().max()) <= min(stol, 1e-6) * float(whole[i].abs().max())


def test_two_gloo_ranks_give_one_process_passes(tmp_path):
    ref = reference("passes", tmp_path / "ref.pt")
    assert run_ranks("passes", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert ref["cutoff_fraction"] is not None and ref["cutoff_fraction"] < 0.75  # the plan split by leaves
    passes = ("matmul", "derivative_sums", "column_derivative_sums")
    assert ref["calls"]["matmul"] == 0 and all(got["calls"][k] >= 2 for k in passes), got["calls"]
    # the torch tiles' product is symmetric: each rank its share of the upper tiles, summed (gather_sum)
    assert got["calls"]["gather_sum"] >= sum(got["calls"][k] for k in passes), got["calls"]
    for key in ref:
        if key != "calls":
            assert _close(got[key], ref[key]), key


def test_two_gloo_ranks_give_one_process_mll_value_and_gradient(tmp_path):
    ref = reference("mll", tmp_path / "ref.pt")
    assert run_ranks("mll", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    # the gradient's kernel terms all come from the per-probe pass (a^T dK a rides along as its column 0)
    assert got["calls"]["matmul"] > 0 and got["calls"]["column_derivative_sums"] > 0, got["calls"]
    assert got["calls"]["derivative_sums"] == 0, got["calls"]
    assert got["calls"]["gather_rows"] >= 2, got["calls"]  # the AFN build split too
    assert got["calls"]["gather_sum"] >= got["calls"]["matmul"], got["calls"]
    assert _close(got["loss"], ref["loss"]) and _close(got["grads"], ref["grads"])
    assert ref["std_error"] is not None and _close(got["std_error"], ref["std_error"], 1e-8)


def test_two_gloo_ranks_grow_afns_landmarks_alike(tmp_path):
    """Landmark growth under a row partition: the ranks agree on every grown ``k`` (their memory bounds by one
    all-gather), and the losses are the one process's."""
    ref = reference("grow", tmp_path / "ref.pt")
    assert run_ranks("grow", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert ref["ranks"] == got["ranks"] and max(ref["ranks"]) > 20 and ref["growths"] == got["growths"], (ref, got)
    assert _close(got["losses"], ref["losses"])


def test_two_gloo_ranks_give_the_one_process_laplace_classifier(tmp_path):
    ref = reference("laplace", tmp_path / "ref.pt")
    assert run_ranks("laplace", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    # the Newton solves' products, the AFN builds and the gradient's per-probe pass were all split
    assert got["calls"]["matmul"] > 0 and got["calls"]["column_derivative_sums"] > 0, got["calls"]
    assert got["calls"]["gather_rows"] >= 2, got["calls"]
    for key in ("f_hat", "log_q", "std_error", "grads", "proba"):
        assert _close(got[key], ref[key], 1e-8), key


def test_two_gloo_ranks_split_the_control_variate_rows(tmp_path):
    """AFN's diag and frozen control-variate families with their non-landmark rows split over the ranks (their
    derivatives added in the backward, RowGroup.split_sum), and the frozen family's closed-form per-probe rows
    (the error bars') split too: the one-process loss, gradient and standard errors to 1e-10, also over several
    probe batches (a requested accuracy: a backward per batch). A backward that keeps each rank's own rows'
    gradient (no sum) is 1e-3 off; closed-form rows without the ranks' sum put the gradients' errors 0.1 off."""
    ref = reference("mll_cv", tmp_path / "ref.pt")
    assert run_ranks("mll_cv", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert ref["calls"]["split_sum"] == 0 and got["calls"]["split_sum"] == 5, got["calls"]
    # rows gathered: 4 AFN builds x 2 (V, G), 5 x the split terms' s x, 5 x the frozen closed-form rows' x
    assert got["calls"]["gather_rows"] == 18, got["calls"]
    assert ref["target_probes"] == got["target_probes"] == 16 and ref["diag_probes"] == 8
    # checkpointed batches of 34 rows (64 KiB of 8 x 30 float64 entries): 270 rows in one process, rank 0's 192
    assert ref["batched_checkpoints"] == 8 and got["batched_checkpoints"] == 6
    for name in ("diag", "frozen", "target", "batched"):
        assert _close(got[f"{name}_loss"], ref[f"{name}_loss"]) and _close(got[f"{name}_grads"], ref[f"{name}_grads"])
        assert _close(got[f"{name}_std_error"], ref[f"{name}_std_error"], 1e-8)
        assert _close(got[f"{name}_grad_se"], ref[f"{name}_grad_se"], 1e-8)


@pytest.mark.cuda
def test_one_nccl_rank_gives_the_plain_mll_on_cuda(tmp_path, cuda_device):
    """The multi-GPU path on one GPU (P = 1 over NCCL; gloo where the suite runs on the CPU) against no group."""
    env = {"GPNYS_TEST_DEVICE": cuda_device.type}
    ref = reference("mll", tmp_path / "ref.pt", env)
    assert run_ranks("mll", tmp_path / "dist.pt", size=1, extra_env=env) == [0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert got["calls"]["matmul"] > 0 and got["calls"]["gather_rows"] >= 2, got["calls"]
    assert _close(got["loss"], ref["loss"]) and _close(got["grads"], ref["grads"])


def test_two_gloo_ranks_build_the_one_process_preconditioners(tmp_path):
    """AFN's V rows (its K12 columns), the FSAI rows of G and Nyström's rows of Y and B (its SVD a TSQR)
    computed per rank and gathered: the same factors and the same solve / matmul / log det as one process, with
    scalar and per-point shifts."""
    ref = reference("precond", tmp_path / "ref.pt")
    assert run_ranks("precond", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    # gathered rows: 2 AFN x 2, FSAI, 4 Nyström U, the sketch's Omega; sums: 3 column Nyström ||Y||, the sketch's
    # split K Omega and its core
    assert ref["calls"]["gather_rows"] == 0 and got["calls"]["gather_rows"] == 10, got["calls"]
    assert got["calls"]["gather_sum"] == 5 and got["calls"]["matmul"] == 1, got["calls"]
    assert ref["nystrom_lam"].shape == (120,) and float(ref["nystrom_lam"][-1]) > 0
    for key in ref:
        if key != "calls":
            assert (ref[key] is None) == (got[key] is None), key
            if ref[key] is not None:
                assert _close(got[key], ref[key]), key
    assert float(ref["afn_G"].diagonal().min()) > 0 and ref["afn_V"].shape == (260, 40)


def test_tsqr_over_three_ranks_one_without_rows(tmp_path):
    """RowGroup.tall_svd (Nyström's SVD) with 64, 36 (< k = 40) and 0 rows: every rank holds the same orthonormal
    U and the singular values of a graded matrix (10^0 .. 10^-8) to float64 rounding; a rank whose rows fail raises
    its error, the others a RuntimeError naming it; ranks passing different landmarks raise ValueError."""
    assert run_ranks("tsqr", tmp_path / "dist.pt", size=3) == [0, 0, 0]
    got = [torch.load(f"{tmp_path / 'dist.pt'}.{r}", weights_only=False) for r in range(3)]
    assert [tuple(g["rows"]) for g in got] == [(0, 64), (64, 100), (100, 100)]
    B, U, sigma = got[0]["B"], got[0]["U"], got[0]["sigma"]
    ref = torch.linalg.svdvals(B)
    assert float(((sigma - ref) / ref).abs().max()) <= 1e-6 and float((sigma - ref).abs().max()) <= 1e-13
    assert float((U.mT @ U - torch.eye(40, dtype=U.dtype)).abs().max()) <= 1e-13
    assert float((B - U @ (U.mT @ B)).abs().max()) <= 1e-13 * float(B.abs().max())
    assert all(torch.equal(g["U"], U) and torch.equal(g["sigma"], sigma) for g in got[1:])
    assert "LinAlgError" in got[1]["error"].split(":")[0] and "rank 1's rows failed" in got[1]["error"]
    for g in (got[0], got[2]):
        assert g["error"].startswith("RuntimeError") and "rank 1 of 3 failed computing its failing R" in g["error"]
    assert all(g["mismatch"].startswith("ValueError") and "same inputs" in g["mismatch"] for g in got)
    # RowGroup.split_sum (the control variate's): sum_r 2 (r + 1) q^2 = 12 q^2 on every rank, gradient 24 q
    for g in got:
        assert torch.equal(g["split_value"], torch.tensor([12.0, 48.0], dtype=torch.float64))
        assert torch.equal(g["split_grad"], torch.tensor([24.0, 48.0], dtype=torch.float64))
        assert "no batched backward" in g["batched"] and "no double backward" in g["double"]


def test_a_failure_on_one_rank_raises_on_every_rank_without_a_hang(tmp_path):
    t0 = time.perf_counter()
    assert run_ranks("fail", tmp_path / "dist.pt", extra_env={"GPNYS_TEST_TIMEOUT": "60"}, timeout=120) == [0, 0]
    mine, other = (torch.load(f"{tmp_path / 'dist.pt'}.{r}", weights_only=False)["error"] for r in (1, 0))
    assert "LinAlgError" in mine.split(":")[0] and "not positive definite" in mine
    assert other.startswith("RuntimeError") and "rank 1 of 2 failed computing its test rows" in other
    # the same for the derivative sums' gather: rank 1's own error there, a RuntimeError naming it on rank 0
    mine, other = (torch.load(f"{tmp_path / 'dist.pt'}.{r}", weights_only=False) for r in (1, 0))
    assert mine["sums_error"].startswith("OutOfMemoryError") and "rank 1 ran out of memory" in mine["sums_error"]
    assert (other["sums_error"].startswith("RuntimeError")
            and "rank 1 of 2 failed computing its per-probe derivative sums" in other["sums_error"])
    assert other["sums_seconds"] < 30
    # and for a split sum's backward (the control variate's): its gradient gather carries rank 1's error
    assert mine["split_sum"] == other["split_sum"] == 12.0  # two ranks' 2 * (1 + 1 + 1)
    assert "OutOfMemoryError" in mine["backward_error"].split(":")[0] and "backward ran out" in mine["backward_error"]
    assert (other["backward_error"].startswith("RuntimeError")
            and "rank 1 of 2 failed computing its test sum gradients" in other["backward_error"])
    assert other["backward_seconds"] < 30
    assert time.perf_counter() - t0 <= 60  # well before the group's 60 s timeout: no rank waited for it


def test_a_rank_that_rejects_its_input_tells_the_others_at_once(tmp_path):
    assert run_ranks("reject", tmp_path / "dist.pt", extra_env={"GPNYS_TEST_TIMEOUT": "60"}, timeout=120) == [0, 0]
    mine, other = (torch.load(f"{tmp_path / 'dist.pt'}.{r}", weights_only=False) for r in (1, 0))
    assert mine["error"].startswith("ValueError") and "train_targets" in mine["error"]
    assert other["error"].startswith("ValueError") and "rank 1 of 2 rejected its input" in other["error"]
    assert "train_targets" in other["error"] and other["seconds"] < 30  # not the group's 60 s timeout


@pytest.mark.parametrize("how, says", [("dtype", "inputs is torch.float64 of shape (300, 3) on rank 0 and "
                                               "torch.float32"),
                                      ("probes", "settings.num_probes is '16' on rank 0 and '8' on rank 1"),
                                      ("row", "inputs (torch.float64, shape (300, 3)) holds other values on rank 1"),
                                      ("lengthscale", "model.covar_module.base_kernel.raw_lengthscale (torch.float64, "
                                                      "shape (1, 1)) holds other values on rank 1"),
                                      ("kernel", "module covar_module.base_kernel is 'MaternKernel' on rank 0 and "
                                                 "'RBFKernel' on rank 1"),
                                      ("threads", "threads is 1 on rank 0 and 2 on rank 1")])
def test_ranks_that_disagree_raise_naming_what(tmp_path, how, says):
    """Data, settings, hyperparameters (on the Cholesky path, where no collective meets them), the kernel or the
    thread count that differ between the ranks: a ValueError on every rank naming what differs, on entering the
    hook. Before, other dtypes or settings sized the gathers differently and gloo aborted a rank (SIGABRT), an input
    entry outside the gathers' sample rows gave each rank its own gradient, and other hyperparameters on the Cholesky
    path gave each rank its own loss."""
    assert run_ranks(f"disagree-{how}", tmp_path / "dist.pt", extra_env={"GPNYS_TEST_TIMEOUT": "60"},
                     timeout=120) == [0, 0]
    for r in (0, 1):
        got = torch.load(f"{tmp_path / 'dist.pt'}.{r}", weights_only=False)
        assert got["error"] is not None and got["error"].startswith("ValueError") and says in got["error"], got


def test_a_nan_in_one_ranks_rows_raises_on_every_rank(tmp_path):
    assert run_ranks("nan", tmp_path / "dist.pt", extra_env={"GPNYS_TEST_TIMEOUT": "60"}, timeout=120) == [0, 0]
    for r in (0, 1):
        got = torch.load(f"{tmp_path / 'dist.pt'}.{r}", weights_only=False)
        assert got["error"] is not None and got["error"].startswith("NonFiniteError"), (r, got)
        assert "lengthscale=" in got["error"] and "noise=" in got["error"]


def test_the_same_nan_on_every_rank_is_not_a_mismatch(tmp_path):
    """A NaN in the same entry of every rank's input is the same input: the product comes back with NaNs, as in one
    process, where the check had compared NaN != NaN and reported different inputs."""
    assert run_ranks("samenan", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert got["error"] is None, got


def test_a_rank_outside_the_kernel_group_is_told(tmp_path):
    """Both ranks pass a group of rank 0 alone: rank 1 gets a ValueError saying it is not a member (torch's
    collectives had returned at once there, and an IndexError followed)."""
    assert run_ranks("notmember", tmp_path / "dist.pt", timeout=120) == [0, 0]
    got = torch.load(f"{tmp_path / 'dist.pt'}.1", weights_only=False)
    assert got["error"] is not None and "not a member" in got["error"], got


def test_ranks_with_different_vectors_raise(tmp_path):
    assert run_ranks("mismatch", tmp_path / "dist.pt") == [0, 0]
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert got["error"] is not None and got["error"].startswith("ValueError") and "same inputs" in got["error"]


def test_a_dead_rank_raises_on_the_other_within_the_timeout(tmp_path):
    t0 = time.perf_counter()
    codes = run_ranks("die", tmp_path / "dist.pt", extra_env={"GPNYS_TEST_TIMEOUT": "20"}, timeout=120)
    assert codes[1] == 3
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    assert got["error"] is not None and got["error"].startswith("CollectiveError") and "rank 0 of 2" in got["error"]
    assert got["seconds"] <= 60 and time.perf_counter() - t0 <= 120


def test_group_without_process_group_is_refused():
    kern = make_kernel("rbf").double()
    X = torch.rand(10, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        StationaryKernelOperator(X, kern.outputscale, kern.base_kernel.lengthscale, base=kern.base_kernel, cache={},
                                 group=True)
    import gpnys.distributed as gd

    with pytest.raises(ValueError, match="torchrun"):
        gd.init()
    assert gd.rank_and_size() == (0, 1) and gd.is_main()


def _torchrun(args: list, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_mll_under_torchrun_matches_one_process():
    """``torchrun --nproc-per-node 2 -m gpnys.cli.main mll``: one JSON document (rank 0's), the same loss as one
    process."""
    import json

    argv = ["mll", "--data", "concrete", "--num-points", "300", "--method", "auto", "--dtype", "float64",
            "--probes", "8", "--dense-gib", "0", "--json"]
    one = subprocess.run([sys.executable, "-m", "gpnys.cli.main", *argv], capture_output=True, text=True,
                         timeout=300, check=True)
    two = _torchrun(["-m", "gpnys.cli.main", *argv])
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)  # rank 1 printed nothing: one document
    ra, rb = a[0] if isinstance(a, list) else a, b[0] if isinstance(b, list) else b
    assert rb["method"] == ra["method"] == "auto"
    assert abs(rb["loss"] - ra["loss"]) <= 1e-10 * abs(ra["loss"])


def test_cli_classify_under_torchrun_matches_one_process():
    """``torchrun --nproc-per-node 2 -m gpnys.cli.main classify``: rank 0's JSON, the one-process fit."""
    import json

    argv = ["classify", "--data", "concrete", "--num-points", "300", "--steps", "1", "--probes", "8", "--k", "40",
            "--dense-gib", "0", "--json"]
    one = subprocess.run([sys.executable, "-m", "gpnys.cli.main", *argv], capture_output=True, text=True,
                         timeout=300, check=True)
    two = _torchrun(["-m", "gpnys.cli.main", *argv])
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert (a["processes"], b["processes"]) == (1, 2)
    assert abs(b["log_marginal_likelihood"] - a["log_marginal_likelihood"]) <= 1e-8 * abs(a["log_marginal_likelihood"])
    assert b["test_accuracy"] == a["test_accuracy"]


def test_example_under_torchrun_matches_one_process(capsys):
    from helpers import load_script

    one = load_script("examples", "distributed_training").main(["--n", "600", "--steps", "2"])
    two = _torchrun([str(Path(__file__).resolve().parents[1] / "examples" / "distributed_training.py"),
                     "--num-points", "600", "--steps", "2"])
    assert two.returncode == 0, two.stderr[-3000:]
    lines = [ln for ln in two.stdout.splitlines() if ln.startswith("step")]
    assert len(lines) == 2 and all("2 ranks" in ln for ln in lines)  # rank 0 alone printed
    losses = [float(ln.split("loss ")[1].split()[0]) for ln in lines]
    assert losses == pytest.approx(one["losses"], rel=1e-7, abs=1e-8)  # printed to 8 decimals
