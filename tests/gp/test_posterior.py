"""``gpnys.gp.posterior.PCGPosterior``: solves against a dense reference, and the warm blocks it keeps."""

import pytest
import torch

import gpnys
from gpnys.gp.posterior import WARM_BLOCKS, PCGPosterior


def system(n=60, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 2, generator=g, dtype=dtype)
    A = torch.exp(-torch.cdist(X, X) ** 2 / 0.1) + 1e-2 * torch.eye(n, dtype=dtype)
    return A, g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_solves_match_dense_and_keep_one_warm_block_per_shape(dtype):
    A, g = system(dtype=dtype)
    post = PCGPosterior(lambda V: A @ V, lambda V: V, maxiter=500)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    blocks = [torch.randn(A.shape[0], c, generator=g, dtype=dtype) for c in range(1, WARM_BLOCKS + 3)]
    for R in blocks:
        x = post.solve(R, tol).x
        torch.testing.assert_close(x, torch.linalg.solve(A, R), rtol=1e3 * tol, atol=1e3 * tol * float(x.abs().max()))
    assert [shape[1] for shape in post._warm] == [c.shape[1] for c in blocks[-WARM_BLOCKS:]]
    cold = post.iterations
    again = post.solve(blocks[-WARM_BLOCKS] + 1e-6, tol)  # an older shape, moved a little: from its own block
    assert post.iterations < cold
    torch.testing.assert_close(again.x, torch.linalg.solve(A, blocks[-WARM_BLOCKS] + 1e-6), rtol=1e3 * tol,
                               atol=1e3 * tol * float(again.x.abs().max()))


def test_warm_blocks_stay_within_the_memory_budget():
    A, g = system()
    post = PCGPosterior(lambda V: A @ V, lambda V: V, maxiter=500)
    n = A.shape[0]
    with gpnys.memory_budget(dense_bytes=4 * 2 * n * 3 * 8):  # a quarter of it: one (R, B) pair of 3 columns
        for c in (3, 2, 1):
            post.solve(torch.randn(n, c, generator=g, dtype=A.dtype), 1e-8)
    assert [shape[1] for shape in post._warm] == [2, 1]  # 3 + 2 columns would pass the quarter
    with gpnys.memory_budget(dense_bytes=1024):  # below one block: the newest is kept all the same
        post.solve(torch.randn(n, 5, generator=g, dtype=A.dtype), 1e-8)
    assert [shape[1] for shape in post._warm] == [5]
