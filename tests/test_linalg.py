"""gpnys.linalg.thin_matmul: every form of the product equals A @ B (to rounding) for every shape it is used on."""

import pytest
import torch

from gpnys import linalg
from gpnys.linalg import THIN_FORMS, thin_matmul


@pytest.mark.parametrize("form", THIN_FORMS)
@pytest.mark.parametrize("shape", [(300, 300, 17), (120, 40, 5), (40, 120, 1), (50, 50, 64), (64, 30, 3)])
def test_thin_matmul_equals_matmul(shape, form, dtype):
    m, k, t = shape
    g = torch.Generator().manual_seed(0)
    A = torch.randn(m, k, generator=g, dtype=dtype)
    B = torch.randn(k, t, generator=g, dtype=dtype)
    out = thin_matmul(A, B, form)
    assert out.shape == (m, t) and out.is_contiguous() and out.dtype == dtype
    eps = torch.finfo(dtype).eps
    scale = float((A.abs() @ B.abs()).max())
    torch.testing.assert_close(out, A @ B, rtol=0, atol=10 * k * eps * scale)
    assert thin_matmul(A.mT, torch.randn(m, 3, generator=g, dtype=dtype), form).shape == (k, 3)


@pytest.mark.parametrize("form", THIN_FORMS)
def test_thin_matmul_vector_and_batch(form, dtype):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(2, 30, 20, generator=g, dtype=dtype)
    for t in (4, 7):
        B = torch.randn(2, 20, t, generator=g, dtype=dtype)
        out = thin_matmul(A, B, form)
        assert out.shape == (2, 30, t) and out.is_contiguous()
        torch.testing.assert_close(out, A @ B)
    v = torch.randn(20, generator=g, dtype=dtype)
    torch.testing.assert_close(thin_matmul(A[0], v, form), A[0] @ v)


def test_thin_matmul_takes_the_device_form_and_rejects_an_unknown_one(monkeypatch):
    """Without ``form``, the form this device timed (here pinned); a form outside ``THIN_FORMS`` is a ValueError."""
    A, B = torch.rand(40, 30, dtype=torch.float64), torch.rand(30, 5, dtype=torch.float64)
    monkeypatch.setattr(linalg, "_forms", {(torch.float64, "cpu", torch.get_num_threads()): "transposed-padded"})
    applied = []
    original = linalg._apply_form
    monkeypatch.setattr(linalg, "_apply_form", lambda form, *a: applied.append(form) or original(form, *a))
    torch.testing.assert_close(thin_matmul(A, B), A @ B)
    assert applied == ["transposed-padded"]
    with pytest.raises(ValueError, match="form"):
        thin_matmul(A, B, "padded")


def test_process_group_ranks_share_one_form_of_the_thin_products(tmp_path, monkeypatch):
    """The forms round differently: under a process group ``thin_form`` is untimed (the direct form) until
    ``gpnys.distributed.init`` settles rank 0's timed choice on every rank."""
    import torch.distributed as dist

    import gpnys.distributed as gd

    monkeypatch.setattr(linalg, "_forms", {})
    monkeypatch.setattr(linalg, "_settled", {})
    monkeypatch.setattr(linalg, "CALIBRATION_SIZE", {"cpu": 512})  # and its choice stays out of the suite's cache:
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path / "cache"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert linalg.thin_form(torch.float64, torch.device("cpu")) == "direct" and linalg._forms == {}
        gd.init(seed=None)  # already initialised: settles the forms only
        cpu = str(torch.device("cpu"))
        assert set(linalg._settled) == {(torch.float32, cpu), (torch.float64, cpu)} and linalg._forms == {}
        timed = linalg.time_thin_forms(torch.float64, "cpu")  # (a fresh timing may differ; the settled one holds)
        assert timed in THIN_FORMS
        settled = linalg._settled[(torch.float64, cpu)]
        assert linalg.thin_form(torch.float64, torch.device("cpu")) == settled
        other = next(form for form in THIN_FORMS if form != settled)
        linalg.settle_thin_forms("cpu", {torch.float64: other})
        assert linalg.thin_form(torch.float64, torch.device("cpu")) == other
        with pytest.raises(ValueError, match="choices"):
            linalg.settle_thin_forms("cpu", {torch.float64: True})
    finally:
        dist.destroy_process_group()


def test_the_thin_products_form_is_timed_once_per_machine_and_read_back(tmp_path, monkeypatch):
    """Every later process on the machine takes the first one's choice from the cache folder instead of timing
    again (a timing beside other jobs could choose another form, which rounds differently)."""
    import json

    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linalg, "_forms", {})
    calls = []
    monkeypatch.setattr(linalg, "time_thin_forms", lambda dtype, device: calls.append(dtype) or "transposed-padded")
    assert linalg.thin_form(torch.float64, torch.device("cpu")) == "transposed-padded" and calls == [torch.float64]
    stored = json.loads((tmp_path / linalg.THIN_PRODUCTS_FILE).read_text())
    assert list(stored.values()) == ["transposed-padded"] and "float64" in next(iter(stored))
    monkeypatch.setattr(linalg, "_forms", {})  # a new process: read back, not timed
    monkeypatch.setattr(linalg, "time_thin_forms", lambda dtype, device: calls.append(dtype) or "direct")
    assert linalg.thin_form(torch.float64, torch.device("cpu")) == "transposed-padded" and calls == [torch.float64]
    A, B = torch.rand(300, 200, dtype=torch.float64), torch.rand(200, 17, dtype=torch.float64)
    torch.testing.assert_close(linalg.thin_matmul(A, B), A @ B)
    for stale in ("{not json", json.dumps({next(iter(stored)): True})):  # corrupt, or an older gpnys's bool: retimed
        (tmp_path / linalg.THIN_PRODUCTS_FILE).write_text(stale)
        monkeypatch.setattr(linalg, "_forms", {})
        assert linalg.thin_form(torch.float64, torch.device("cpu")) == "direct"
    assert len(calls) == 3


def test_the_thin_products_form_follows_the_thread_count(tmp_path, monkeypatch):
    """The cache file keeps a form per thread count, and so does the process: a form chosen at one thread count
    is not taken at another."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linalg, "_forms", {})
    forms = iter(["transposed", "split+direct-padded"])
    monkeypatch.setattr(linalg, "time_thin_forms", lambda dtype, device: next(forms))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert linalg.thin_form(torch.float64, torch.device("cpu")) == "transposed"
        torch.set_num_threads(2)
        assert linalg.thin_form(torch.float64, torch.device("cpu")) == "split+direct-padded"
        torch.set_num_threads(1)
        assert linalg.thin_form(torch.float64, torch.device("cpu")) == "transposed"
    finally:
        torch.set_num_threads(threads)


def test_the_timed_form_is_one_of_the_forms_and_direct_unless_clearly_faster(monkeypatch):
    """``time_thin_forms`` keeps ``direct`` unless another form is 10 % faster (a tie would flip between runs), and
    splits the stored kernels' products only if that is 10 % faster than the torch form chosen."""
    monkeypatch.setattr(linalg, "CALIBRATION_SIZE", {"cpu": 128})  # the clock is what decides here
    # 4 runs per torch form in order, then 4 of the split form on top of the chosen one
    clock = iter([0.0, 1.0] * 4 + [0.0, 0.95] * 4 + [0.0, 0.5] * 4 + [0.0, 0.92] * 4 + [0.0, 0.46] * 4)
    monkeypatch.setattr(linalg.time, "perf_counter", lambda: next(clock))
    assert linalg.time_thin_forms(torch.float64, "cpu") == "direct-padded"
    clock = iter([0.0, 1.0] * 4 + [0.0, 0.95] * 8 + [0.0, 0.92] * 8)
    monkeypatch.setattr(linalg.time, "perf_counter", lambda: next(clock))
    assert linalg.time_thin_forms(torch.float64, "cpu") == "direct"
    clock = iter([0.0, 1.0] * 4 + [0.0, 0.95] * 4 + [0.0, 0.5] * 8 + [0.0, 0.44] * 4)
    monkeypatch.setattr(linalg.time, "perf_counter", lambda: next(clock))
    assert linalg.time_thin_forms(torch.float64, "cpu") == "split+direct-padded"


@pytest.mark.parametrize("shape", [(300, 17), (1, 3), (5, 2), (257, 64), (2500, 7)])
def test_a_split_form_reads_a_symmetric_matrix_by_columns_and_equals_the_product(shape, dtype, monkeypatch):
    """``"split+..."`` with ``symmetric=True`` computes ``(Bᵀ A)ᵀ`` through numpy's BLAS: equal to ``A @ B`` for a
    symmetric ``A``, bit for bit whatever torch's thread count (the blocks are fixed)."""
    monkeypatch.setattr(linalg, "SPLIT_MIN_ROWS", 1)  # small shapes too, edge blocks included
    m, t = shape
    g = torch.Generator().manual_seed(2)
    A = torch.randn(m, m, generator=g, dtype=dtype)
    A = A + A.mT
    B = torch.randn(m, t, generator=g, dtype=dtype)
    eps = torch.finfo(dtype).eps
    scale = float((A.abs() @ B.abs()).max())
    threads = torch.get_num_threads()
    outs = []
    try:
        for k in (1, 2, 3):
            torch.set_num_threads(k)
            out = thin_matmul(A, B, "split+direct", symmetric=True)
            assert out.shape == (m, t) and out.is_contiguous() and out.dtype == dtype
            torch.testing.assert_close(out, A @ B, rtol=0, atol=10 * m * eps * scale)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_split_form_takes_its_torch_form_elsewhere_and_leaves_numpys_blas_threads_as_they_were(monkeypatch, dtype):
    """Only a symmetric square ``A`` of at least ``SPLIT_MIN_ROWS`` rows that autograd need not record is split; a
    product autograd must record, a non-symmetric or smaller one and a batch take the torch form named after
    ``split+``, with their gradients. numpy's BLAS runs on one thread only during a split product."""
    from threadpoolctl import threadpool_info

    before = [(i["filepath"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"]
    monkeypatch.setattr(linalg, "SPLIT_MIN_ROWS", 64)
    g = torch.Generator().manual_seed(3)
    A = torch.randn(64, 64, generator=g, dtype=dtype)
    A = A + A.mT
    B = torch.randn(64, 5, generator=g, dtype=dtype, requires_grad=True)
    applied = []
    original = linalg._apply_form
    monkeypatch.setattr(linalg, "_apply_form", lambda form, *a: applied.append(form) or original(form, *a))
    split = []
    original_split = linalg._split_product
    monkeypatch.setattr(linalg, "_split_product", lambda *a: split.append(1) or original_split(*a))
    out = thin_matmul(A, B, "split+transposed", symmetric=True)
    assert out.requires_grad and not split
    out.sum().backward()
    torch.testing.assert_close(B.grad, A.sum(1)[:, None].expand(64, 5))
    with torch.no_grad():
        torch.testing.assert_close(thin_matmul(A, B, "split+transposed", symmetric=True), A @ B)
        assert len(split) == 1
        torch.testing.assert_close(thin_matmul(A[:40], B, "split+transposed", symmetric=True), A[:40] @ B)
        torch.testing.assert_close(thin_matmul(A, B, "split+transposed"), A @ B)
        torch.testing.assert_close(thin_matmul(A[None], B[None], "split+transposed", symmetric=True), A[None] @ B)
        monkeypatch.setattr(linalg, "SPLIT_MIN_ROWS", 65)  # a stored kernel below the split's size
        torch.testing.assert_close(thin_matmul(A, B, "split+transposed", symmetric=True), A @ B)
        assert len(split) == 1
    assert [(i["filepath"], i["num_threads"]) for i in threadpool_info() if i["user_api"] == "blas"] == before


def _split_in_child(A, B):  # numpy arrays both ways: torch's tensor pickling shares memory through file descriptors
    torch.set_num_threads(2)
    return thin_matmul(torch.from_numpy(A), torch.from_numpy(B), "split+direct", symmetric=True).numpy()


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="needs os.register_at_fork")
def test_a_split_form_works_in_a_forked_child():
    """A child forked after a split product gets a fresh pool and lock (it inherits neither's threads)."""
    import multiprocessing

    g = torch.Generator().manual_seed(5)
    A = torch.randn(2100, 2100, generator=g, dtype=torch.float64)
    A = A + A.mT
    B = torch.randn(2100, 3, generator=g, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parent = thin_matmul(A, B, "split+direct", symmetric=True)
        with multiprocessing.get_context("fork").Pool(1) as pool:
            child = pool.apply_async(_split_in_child, (A.numpy(), B.numpy())).get(timeout=120)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.from_numpy(child), parent)
