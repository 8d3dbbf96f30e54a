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
