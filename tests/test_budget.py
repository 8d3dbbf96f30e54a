"""The memory budget (:mod:`gpnys.budget`): scoping, validation, identical results under any block size, and a
peak-memory check of the on-the-fly kernel operator at a size whose dense kernel would need gigabytes."""

import json
import os
import subprocess
import sys
import textwrap

import gpytorch
import pytest
import torch
from helpers import points

from gpnys import budget, memory_budget
from gpnys.kernels.system import kernel_system
from gpnys.precond.afn import AFNPreconditioner


def test_scoped_and_restored():
    before = (budget.block_elems(), budget.dense_limit_bytes())
    with memory_budget(block_bytes=8 * 1000, dense_bytes=0):
        assert budget.block_elems() == 1000 and budget.block_elems(4) == 250 and budget.dense_limit_bytes() == 0
        assert budget.block_bytes() == 8000
        assert budget.block_rows(30) == 33 and budget.block_rows(30, cap=10) == 10 and budget.block_rows(5000) == 1
        assert budget.block_rows(30, parts=2) == 16
        with memory_budget(dense_bytes=123):  # None keeps the other value
            assert budget.block_elems() == 1000 and budget.dense_limit_bytes() == 123
        assert budget.dense_limit_bytes() == 0
    assert (budget.block_elems(), budget.dense_limit_bytes()) == before
    with pytest.raises(RuntimeError), memory_budget(block_bytes=8 * 10):
        raise RuntimeError("restored even on error")
    assert (budget.block_elems(), budget.dense_limit_bytes()) == before


@pytest.mark.parametrize("kwargs, name", [
    ({"block_bytes": 4}, "block_bytes"),
    ({"block_bytes": 1.5e6}, "block_bytes"),
    ({"block_bytes": True}, "block_bytes"),
    ({"dense_bytes": -1}, "dense_bytes"),
])
def test_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name), memory_budget(**kwargs):
        pass


def kernel(dtype):
    k = gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=3).to(dtype)
    k.lengthscale = torch.tensor([0.4, 0.6, 0.8], dtype=dtype)
    return k


def test_kernel_system_follows_budget(dtype):
    X = points(300, 3, dtype=dtype, seed=1)
    V = torch.randn(300, 3, dtype=dtype, generator=torch.Generator().manual_seed(2))
    dense = kernel_system(X, kernel(dtype), 0.1)
    with memory_budget(dense_bytes=0, block_bytes=8 * 300 * 7):
        fly = kernel_system(X, kernel(dtype), 0.1)
    assert dense.dense and not fly.dense
    with torch.no_grad():
        ref = kernel(dtype)(X).to_dense() @ V + 0.1 * V
        for A in (dense, fly):  # relative to the largest entry: the on-the-fly path (the kernel operator's
            # matmul-form distances) and GPyTorch's round small entries differently in float32
            assert float((A(V) - ref).abs().max()) <= 100 * torch.finfo(dtype).eps * float(ref.abs().max())



def test_the_stored_kernel_is_filled_in_cache_sized_blocks(dtype):
    """On a CPU the dense fill takes at most 2 MiB of rows (and no more than the budget's blocks); the stored
    kernel of 1 200 points, filled in 218-row blocks, equals GPyTorch's, with its length-scale derivative."""
    from gpnys.kernels.operator import StationaryKernelOperator

    assert budget.fill_rows(1200, "cpu") == budget.CPU_FILL_BLOCK_BYTES // (8 * 1200) == 218
    with memory_budget(block_bytes=8 * 1200 * 5):
        assert budget.fill_rows(1200, "cpu") == 5
    X = points(1200, 3, dtype=dtype, seed=3)
    k = kernel(dtype)
    s2 = torch.tensor(1.0, dtype=dtype)
    op = StationaryKernelOperator(X, s2, k.lengthscale.detach(), base=k, cache={})
    K, _ = op._dense()  # the stored unit kernel, filled block by block
    with torch.no_grad():
        ref = k(X).to_dense()
    assert float((K - ref).abs().max()) <= 100 * torch.finfo(dtype).eps

def test_afn_setup_is_independent_of_the_block_size():
    """K12 column blocks, the kNN distance blocks and the FSAI batches all shrink with the budget; the factor does
    not change (same arithmetic per entry). Float64 only: in float32 the blocked matmul-form distances round
    differently, which flips near-tied kNN neighbours (a different, equally valid FSAI pattern)."""
    dtype = torch.float64
    X = points(400, 3, dtype=dtype, seed=4)
    R = torch.randn(400, 2, dtype=dtype, generator=torch.Generator().manual_seed(5))
    ref = AFNPreconditioner(X, kernel(dtype), 1e-2, k=60, w=12)
    with memory_budget(block_bytes=8 * 500):
        small = AFNPreconditioner(X, kernel(dtype), 1e-2, k=60, w=12)
    # rounding only (batched products of other shapes: measured 2.5e-12); another pattern would differ by ~1e-2
    torch.testing.assert_close(small.solve(R), ref.solve(R), rtol=1e-9, atol=0)
    torch.testing.assert_close(small.logdet(), ref.logdet(), rtol=1e-9, atol=0)


PEAK_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch, gpytorch
    from gpnys import memory_budget
    from gpnys.kernels.operator import StationaryKernelOperator
    torch.set_num_threads(1)
    n = int(sys.argv[1])
    X = torch.rand(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    V = torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    base = gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=3).double()
    s2, ls = torch.tensor(1.0, dtype=torch.float64, requires_grad=True), base.lengthscale
    block = int(sys.argv[2])
    with memory_budget(block_bytes=block, dense_bytes=0):  # warm-up: first-call allocations of the ops used
        w = StationaryKernelOperator(X[:64], s2, ls, base=base, cache={})
        w._bilinear_derivative(V[:64], V[:64]), w.matmul(V[:64])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with memory_budget(block_bytes=block, dense_bytes=0):
        op = StationaryKernelOperator(X, s2, ls, base=base, cache={})
        with torch.no_grad():
            KV = op.matmul(V)
        _, d_s2, d_ls = op._bilinear_derivative(V, V)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_increase_kib": after - before, "finite": bool(torch.isfinite(KV).all()
                      and torch.isfinite(d_ls).all()), "dense": op._dense() is not None}))
""")


def test_on_the_fly_peak_memory_stays_within_budget():
    """n = 12 000, Matérn-3/2: a dense K would take 1.15 GB (K and H together 2.3 GB). With 4 MiB blocks and no
    dense cache, one matmul and one hyperparameter gradient raise the peak RSS by far less than that.

    The pass reuses one workspace of three blocks and allocates no (b, n) temporary per row block: when it did,
    glibc kept the freed blocks in its heap and the peak RSS of this loop reached 1.9 GB at n = 16 000 (measured
    before the workspace; 27 MB after). The default allocator settings are used here on purpose."""
    n = 12_000
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(n), str(4 << 20)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    assert rec["finite"] and not rec["dense"]
    dense_kib = n * n * 8 // 1024
    assert rec["peak_increase_kib"] < 120 * 1024, rec
    assert rec["peak_increase_kib"] < dense_kib / 3, (rec, dense_kib)


def test_budgets_of_two_threads_stay_their_own():
    """Two threads whose budget blocks interleave: each reads its own, neither leaks into the other or outlives its
    block (a process-wide budget had left the first thread's 1 KiB blocks in place for the whole process)."""
    import threading

    from gpnys.budget import DEFAULT_BLOCK_BYTES, DEFAULT_DENSE_BYTES, block_bytes, dense_limit_bytes

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with memory_budget(block_bytes=1 << 10, dense_bytes=0):
            a_in.set()
            b_in.wait()
            seen["main while first inside"] = dense_limit_bytes()
        a_out.set()

    def second():
        a_in.wait()
        with memory_budget(block_bytes=1 << 20):
            seen["second, first inside"] = block_bytes()
            b_in.set()
            a_out.wait()
            seen["second, first gone"] = block_bytes()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["second, first inside"] == seen["second, first gone"] == 1 << 20
    assert seen["main while first inside"] == 0  # the first thread's own view
    assert block_bytes() == DEFAULT_BLOCK_BYTES and dense_limit_bytes() == DEFAULT_DENSE_BYTES


def test_a_thread_without_a_budget_of_its_own_reads_the_open_one():
    """Autograd runs a CUDA backward on a device thread outside its caller's context: a thread that set no budget of
    its own reads the latest open block, as a process-wide budget would, and the default once it closes."""
    import threading

    from gpnys.budget import DEFAULT_BLOCK_BYTES, block_bytes

    seen = []

    def reader():
        seen.append(block_bytes())

    with memory_budget(block_bytes=1 << 12):
        t = threading.Thread(target=reader)
        t.start()
        t.join()
    t = threading.Thread(target=reader)
    t.start()
    t.join()
    assert seen == [1 << 12, DEFAULT_BLOCK_BYTES]
