"""gpnys.linalg.thin_matmul: the transposed-form product equals A @ B (to rounding) for every shape it is used on."""

import pytest
import torch

from gpnys.linalg import thin_matmul


@pytest.mark.parametrize("shape", [(300, 300, 17), (120, 40, 5), (40, 120, 1), (50, 50, 64)])
def test_thin_matmul_equals_matmul(shape, dtype):
    m, k, t = shape
    g = torch.Generator().manual_seed(0)
    A = torch.randn(m, k, generator=g, dtype=dtype)
    B = torch.randn(k, t, generator=g, dtype=dtype)
    out = thin_matmul(A, B)
    assert out.shape == (m, t) and out.is_contiguous() and out.dtype == dtype
    eps = torch.finfo(dtype).eps
    scale = float((A.abs() @ B.abs()).max())
    torch.testing.assert_close(out, A @ B, rtol=0, atol=10 * k * eps * scale)
    assert thin_matmul(A.mT, torch.randn(m, 3, generator=g, dtype=dtype)).shape == (k, 3)


def test_thin_matmul_vector_and_batch(dtype):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(2, 30, 20, generator=g, dtype=dtype)
    B = torch.randn(2, 20, 4, generator=g, dtype=dtype)
    torch.testing.assert_close(thin_matmul(A, B), A @ B)
    v = torch.randn(20, generator=g, dtype=dtype)
    torch.testing.assert_close(thin_matmul(A[0], v), A[0] @ v)


def test_process_group_ranks_share_one_form_of_the_thin_products(tmp_path, monkeypatch):
    """The two forms round differently: under a process group ``transposed_faster`` is untimed (the direct form)
    until ``gpnys.distributed.init`` settles rank 0's timed choice on every rank."""
    import torch.distributed as dist

    import gpnys.distributed as gd
    from gpnys import linalg

    monkeypatch.setattr(linalg, "_transposed", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert linalg.transposed_faster(torch.float64, torch.device("cpu")) is False and linalg._transposed == {}
        gd.init(seed=None)  # already initialised: settles the forms only
        cpu = str(torch.device("cpu"))
        assert set(linalg._transposed) == {(torch.float32, cpu), (torch.float64, cpu)}
        timed = linalg.time_transposed(torch.float64, "cpu")  # (a fresh timing may differ; the settled one holds)
        assert isinstance(timed, bool)
        settled = linalg._transposed[(torch.float64, cpu)]
        assert linalg.transposed_faster(torch.float64, torch.device("cpu")) is settled
        linalg.settle_transposed("cpu", {torch.float64: not settled})
        assert linalg.transposed_faster(torch.float64, torch.device("cpu")) is (not settled)
    finally:
        dist.destroy_process_group()


def test_the_thin_products_form_is_timed_once_per_machine_and_read_back(tmp_path, monkeypatch):
    """Every later process on the machine takes the first one's choice from the cache folder instead of timing
    again (a timing beside other jobs could choose the other form, which rounds differently)."""
    import json

    from gpnys import linalg

    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linalg, "_transposed", {})
    calls = []
    monkeypatch.setattr(linalg, "time_transposed", lambda dtype, device: calls.append(dtype) or True)
    assert linalg.transposed_faster(torch.float64, torch.device("cpu")) is True and calls == [torch.float64]
    stored = json.loads((tmp_path / linalg.THIN_PRODUCTS_FILE).read_text())
    assert list(stored.values()) == [True] and "float64" in next(iter(stored))
    monkeypatch.setattr(linalg, "_transposed", {})  # a new process: read back, not timed
    monkeypatch.setattr(linalg, "time_transposed", lambda dtype, device: calls.append(dtype) or False)
    assert linalg.transposed_faster(torch.float64, torch.device("cpu")) is True and calls == [torch.float64]
    A, B = torch.rand(300, 200, dtype=torch.float64), torch.rand(200, 17, dtype=torch.float64)
    torch.testing.assert_close(linalg.thin_matmul(A, B), A @ B)
    (tmp_path / linalg.THIN_PRODUCTS_FILE).write_text("{not json")  # corrupt: timed afresh
    monkeypatch.setattr(linalg, "_transposed", {})
    assert linalg.transposed_faster(torch.float64, torch.device("cpu")) is False and len(calls) == 2
