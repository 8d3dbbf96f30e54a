"""The dense backend (the operator's stored kernel) answers as the torch tiles recompute: products, derivative sums
and per-column sums, float32 and float64, with and without the stored derivative matrix ``D``."""

from __future__ import annotations

import pytest
import torch

from gpnys.kernels.backends.dense import DenseBackend
from gpnys.kernels.backends.torch_tiles import TorchTiles, squared_norms
from gpnys.kernels.formulas import formula


@pytest.mark.parametrize("nu", [None, 1.5])
def test_dense_backend_matches_the_recomputing_tiles(nu, dtype):
    g = torch.Generator().manual_seed(0)
    n, d, t = 150, 3, 4
    Z = (2 * torch.rand(n, d, generator=g, dtype=torch.float64)).to(dtype)
    U = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    V = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    f = formula(nu)
    tiles = TorchTiles(f)
    K = torch.empty(n, n, dtype=dtype)
    H = None if nu is None else torch.empty(n, n, dtype=dtype)
    tiles.fill(Z, Z, squared_norms(Z), slice(0, n), slice(None), (K, H), Z.new_empty(n * n).view(n, n),
               float(Z.abs().max()), None)
    be = DenseBackend(f, K, H, None, block=64)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    # the distances from the padded coordinates' one product (the operator's dense fill) give the same tiles
    sq = squared_norms(Z)
    for rows in (slice(0, 70), slice(70, n)):
        m = rows.stop - rows.start
        Kp, Hp = torch.empty(m, n, dtype=dtype), None if H is None else torch.empty(m, n, dtype=dtype)
        tiles.fill(Z[rows], Z, sq, rows, slice(None), (Kp, Hp), Z.new_empty(m, n), float(Z.abs().max()),
                   padded=tiles.padded(Z, sq))
        assert torch.allclose(Kp, K[rows], rtol=tol, atol=tol)
        assert H is None or torch.allclose(Hp, H[rows], rtol=tol, atol=tol * float(H.abs().max()))
    ref = tiles.matmul(Z, V, None)
    assert torch.allclose(be.matmul(Z, V, None), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    for got, want in zip(be.derivative_sums(Z, U, V, None), tiles.derivative_sums(Z, U, V, None)):
        assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    for iso in (False, True):
        for got, want in zip(be.column_derivative_sums(Z, U, V, None, iso),
                             tiles.column_derivative_sums(Z, U, V, None, iso)):
            assert got.shape == want.shape
            assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    # an isotropic float64 kernel with D = A o R² / 2 stored (the fill writes it with K): the derivative's sum over
    # dimensions by two products
    if dtype == torch.float64:
        R2 = torch.cdist(Z, Z).square()
        A = -K if H is None else H
        D = (A * R2 / 2).fill_diagonal_(0.0)
        filled = [torch.empty(n, n, dtype=dtype) for _ in range(3)]
        tiles.fill(Z, Z, squared_norms(Z), slice(0, n), slice(None), (filled[0], None if H is None else filled[1]),
                   Z.new_empty(n * n).view(n, n), float(Z.abs().max()), filled[2])
        assert torch.allclose(filled[2], D, rtol=1e-10, atol=1e-12 * float(D.abs().max()))
        assert torch.allclose(filled[0], K, rtol=1e-12, atol=1e-14)
        fast = DenseBackend(f, K, H, D, block=64)
        s, g_iso = fast.derivative_sums(Z, U, V, None)
        s_ref, g_ref = tiles.derivative_sums(Z, U, V, None)
        assert torch.allclose(s, s_ref, rtol=1e-10) and g_iso.shape == (1,)
        assert torch.allclose(g_iso, g_ref.sum().reshape(1), rtol=1e-8)
        assert torch.allclose(fast.column_derivative_sums(Z, U, V, None, True)[1],
                              tiles.column_derivative_sums(Z, U, V, None, True)[1], rtol=1e-8)


def test_last_product_answers_only_for_its_own_columns(dtype):
    """A derivative pass whose ``U`` is the last full product's leading columns reads ``K U`` from it (the same
    per-column sums as multiplying again, to rounding); a ``U`` that differs in one entry, or a product modified in
    place since, is multiplied afresh; and a changed ``K`` never answers from the old product."""
    from gpnys.kernels.backends.dense import LastProduct

    g = torch.Generator().manual_seed(1)
    n, t = 120, 5
    Z = torch.rand(n, 2, generator=g, dtype=torch.float64).to(dtype)
    U = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    V = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    K = torch.exp(-0.5 * torch.cdist(Z, Z).square())
    D = (-K * torch.cdist(Z, Z).square() / 2).fill_diagonal_(0.0)  # A o R² / 2, as the fill stores it
    f = formula(None)
    plain = DenseBackend(f, K, None, D, block=64)
    want = plain.column_derivative_sums(Z, U, V, None, True)
    last = LastProduct()
    be = DenseBackend(f, K, None, D, block=64, last=last)
    B = torch.cat([U, U.abs()], 1)  # the true residual's product: X and |X|
    KB = be.matmul(Z, B, None)
    assert last.lookup(U) is not None and torch.equal(last.lookup(U), KB[:, :t])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for got, ref in zip(be.column_derivative_sums(Z, U, V, None, True), want):
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol * float(ref.abs().max()))
    other = U.clone()
    other[3, 2] += 1.0
    assert last.lookup(other) is None and last.lookup(torch.cat([U, V], 1)) is None  # wider than recorded
    KB.mul_(2.0)  # the caller changed the product: it no longer answers
    assert last.lookup(U) is None
    be.matmul(Z, B, None)
    last.clear()
    assert last.lookup(U) is None



@pytest.mark.parametrize("nu", [None, 0.5, 1.5, 2.5])
def test_fill_keeps_kernel_entries_normal(nu, dtype):
    """Points many length-scales apart: the tiles hold no subnormal numbers (each would take the CPU's slow path in
    every product), the kernel beyond :func:`normal_range` is its value there, and every entry is within
    ``2^20 tiny`` of the exact kernel."""
    from gpnys.kernels.cutoff import SUBNORMAL_MARGIN, normal_range
    from gpnys.kernels.formulas import k_and_h

    g = torch.Generator().manual_seed(3)
    n = 120
    Z = (torch.rand(n, 2, generator=g, dtype=torch.float64) * 4 * normal_range(nu, dtype) ** 0.5).to(dtype)
    tiles = TorchTiles(formula(nu))
    K, H = torch.empty(n, n, dtype=dtype), None if nu is None else torch.empty(n, n, dtype=dtype)
    sq = squared_norms(Z)
    tiles.fill(Z, Z, sq, slice(0, n), slice(None), (K, H), Z.new_empty(n, n), float(Z.abs().max()),
               padded=tiles.padded(Z, sq))
    tiny = torch.finfo(dtype).tiny
    for M in (K, H):
        if M is not None:
            assert not bool(((M != 0) & (M.abs() < tiny)).any())
    r2 = torch.cdist(Z.double(), Z.double()).square()
    assert bool((r2 > normal_range(nu, dtype)).float().mean() > 0.3)  # most pairs beyond the range
    exact, _ = k_and_h(r2, nu)
    far = r2 > 1.01 * normal_range(nu, dtype)  # clear of the expanded form's rounding of r² (|z| is large here)
    floor = SUBNORMAL_MARGIN * tiny
    assert float((K.double() - exact)[far].abs().max()) <= 1.01 * floor
    assert float(K.double()[far].min()) >= 0.99 * floor and bool((K.diagonal() == 1).all())


def test_half_precision_tiles_are_not_clamped():
    """float16's smallest normal number is 6e-5: a floor of 2^20 of them would be above the kernel itself, so its
    tiles keep their distances (the kernel of points 3 apart is exp(-4.5), not 1); bfloat16 shares float32's range."""
    from gpnys.kernels.cutoff import normal_range

    assert normal_range(None, torch.float16) == float("inf")
    assert normal_range(None, torch.bfloat16) == normal_range(None, torch.float32)
    Z = torch.tensor([[0.0], [3.0]], dtype=torch.float16)
    tiles = TorchTiles(formula(None))
    K = torch.empty(2, 2, dtype=torch.float16)
    sq = squared_norms(Z)
    tiles.fill(Z, Z, sq, slice(0, 2), slice(None), (K, None), Z.new_empty(2, 2), 3.0, padded=tiles.padded(Z, sq))
    torch.testing.assert_close(K[0, 1].float(), torch.tensor(4.5).neg().exp(), rtol=2e-3, atol=0)
