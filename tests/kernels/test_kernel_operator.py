"""StationaryKernelOperator against GPyTorch's dense kernel: values, closed-form derivative, row blocks, the
length-scale cache, and the hook's switch (``EstimatorSettings.kernel_operator``) end to end.

References are GPyTorch's own ``ScaleKernel(base)(X).to_dense()`` and autograd through it; where GPyTorch's
reference is itself inexact (Matérn-1/2, below) an exact direct-difference kernel in float64 is used as well.
Errors are measured relative to the largest entry of the reference (``rel_max``), so one tolerance covers a
whole tensor; the "measured" numbers in the comments are from this file's fixed seeds (torch 2.13 CPU,
gpytorch 1.15.2, linear_operator 0.6.1).
"""

import math

import gpytorch
import pytest
import torch
from helpers import points

from gpnys import budget, datasets, memory_budget
from gpnys.gp.hook import use_preconditioner
from gpnys.gp.settings import EstimatorSettings
from gpnys.gp.training import ExactGPModel, fit, hyperparameters
from gpnys.kernels import KERNEL_NAMES
from gpnys.kernels import make_kernel as make_scale_kernel
from gpnys.kernels.backends.torch_tiles import TorchTiles
from gpnys.kernels.operator import StationaryKernelOperator, supported

NAMES = list(KERNEL_NAMES)  # rbf, matern12, matern32, matern52
N, D = 200, 3
EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.float64: torch.finfo(torch.float64).eps}

# matmul / entries, relative to the largest reference entry, generic (no coincident) points. Measured worst over
# kernels x {iso, ARD}: float32 7.5e-6, float64 7.7e-15 (also over 5 seeds at length-scales 0.3-1.5: 7e-6 /
# 8e-15). Matérn-1/2 is included: with no nearly coincident pair its C0 kink at r = 0 only meets the diagonal,
# which the operator zeroes exactly (test_nearly_coincident_points covers the rest).
MATMUL_TOL = {torch.float32: 3e-5, torch.float64: 1e-12}
# raw-parameter gradients, relative to the largest reference component (the length-scale derivative is a
# cancelling sum of n^2 terms). Measured, operator vs. GPyTorch / vs. the exact kernel: float32 <= 1.4e-5 / 1.3e-5,
# float64 <= 1.5e-13 / 3.7e-13 (GPyTorch vs. the exact kernel: up to 2.4e-13 itself) -- except the case below.
# Scaled inputs here have |z| <= ~6. The operator sums A_ij (z_i - z_j)^2 in expanded form
# (z^T diag(A 1) z - 2 z^T A z), whose float32 cancellation grows with |z|^2: on [0, 10]^2 at l = 0.2
# (|z| ~ 35) its Matérn-3/2 length-scale derivative was 1.1e-2 off vs. GPyTorch's float32 1.1e-4, so a float32
# grid at much shorter length-scales would need a looser GRAD_TOL (reported, not asserted here).
GRAD_TOL = {torch.float32: 1e-4, torch.float64: 1e-11}
# ... except against GPyTorch's ARD Matérn-1/2: with ARD (or inputs requiring grad) GPyTorch's Matérn skips its
# custom autograd function, and its distance matrix then keeps the ~sqrt(eps)|z| cancellation error on the
# diagonal (it zeroes the diagonal only when no input requires grad), so its K_ii = exp(-r_ii) is off by
# ~sqrt(eps)|z| and so is its derivative: measured 3.3e-3 (float32) / 1.6e-8 (float64) between GPyTorch and the
# exact kernel, while the operator is within 1.1e-5 / 1.4e-14 of the exact kernel (asserted with GRAD_TOL).
GRAD_TOL_GPYTORCH_M12_ARD = {torch.float32: 2e-2, torch.float64: 2e-7}


def rel_max(a, ref):
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


def inputs(dtype, n=N, seed=0):
    """Uniform points in [3, 7]^3: off-centre, so the operator's centring of X is exercised."""
    return points(n, D, dtype=dtype, seed=seed, scale=4.0) + 3.0


def kernel_at(name, ard, dtype, lengthscale=None):
    kern = make_scale_kernel(name, D if ard else None).to(dtype)
    kern.outputscale = 1.7
    if lengthscale is None:
        lengthscale = torch.tensor([0.6, 1.0, 1.5], dtype=dtype) if ard else 0.9
    kern.base_kernel.lengthscale = lengthscale
    return kern


def operator(X, kern, cache=None, **kw):
    return StationaryKernelOperator(X, kern.outputscale, kern.base_kernel.lengthscale, base=kern.base_kernel,
                                    cache={} if cache is None else cache, **kw)


def dense_reference(X, kern):
    with torch.no_grad():
        return kern(X).to_dense()


def exact_kernel(X, kern):
    """``s^2 k(r)`` from explicit differences ``z_i - z_j`` (no ``|a|^2 + |b|^2 - 2ab`` cancellation), in X's dtype,
    differentiable in the kernel's parameters; ``r`` is exactly 0 for coincident points."""
    ls = kern.base_kernel.lengthscale.reshape(-1)
    Z = (X - X.mean(0)) / ls
    r2 = (Z[:, None, :] - Z[None, :, :]).square().sum(-1)
    r = torch.where(r2 > 0, r2.clamp_min(torch.finfo(X.dtype).tiny).sqrt(), torch.zeros_like(r2))
    base = kern.base_kernel
    nu = None if isinstance(base, gpytorch.kernels.RBFKernel) else float(base.nu)
    if nu is None:
        k = torch.exp(-0.5 * r2)
    else:
        a = math.sqrt(2 * nu) * r
        poly = {0.5: 1.0, 1.5: 1 + a, 2.5: 1 + a + a.square() / 3}[nu]
        k = poly * torch.exp(-a)
    return kern.outputscale * k


def uv(dtype, n=N, t=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(n, t, dtype=torch.float64, generator=g)
    V = torch.randn(n, t, dtype=torch.float64, generator=g)
    return U.to(dtype), V.to(dtype)


def raw_grads(kern):
    return {name: p.grad.detach().clone() for name, p in kern.named_parameters()}


def closed_form_grads(kern, op, U, V):
    """``_bilinear_derivative`` pushed back to the raw parameters through GPyTorch's constraints."""
    kern.zero_grad()
    d_x, d_s2, d_ls = op._bilinear_derivative(U, V)
    assert d_x is None
    assert d_s2.shape == kern.outputscale.shape and d_ls.shape == kern.base_kernel.lengthscale.shape
    torch.autograd.backward([kern.outputscale, kern.base_kernel.lengthscale], [d_s2, d_ls])
    return raw_grads(kern)


def autograd_grads(kern, K_fn, U, V):
    kern.zero_grad()
    (U * (K_fn() @ V)).sum().backward()
    return raw_grads(kern)


# -- 1. values -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
@pytest.mark.parametrize("name", NAMES)
def test_matmul_matches_dense_kernel(name, ard, dtype):
    X = inputs(dtype)
    kern = kernel_at(name, ard, dtype)
    op = operator(X, kern)
    K = dense_reference(X, kern)
    R = torch.randn(N, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        assert op.shape == (N, N) and op.dtype == dtype
        assert rel_max(op.matmul(R), K @ R) < MATMUL_TOL[dtype]
        assert rel_max(op.matmul(R[:, 0]), K @ R[:, 0]) < MATMUL_TOL[dtype]  # a vector right-hand side
        assert rel_max(op.to_dense(), K) < MATMUL_TOL[dtype]
        assert rel_max(op.mT.matmul(R), K @ R) < MATMUL_TOL[dtype]
        torch.testing.assert_close(op.diagonal(), K.diagonal(), rtol=MATMUL_TOL[dtype], atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_nearly_coincident_points(name, dtype):
    """Duplicated and 1e-4-apart rows. ``cdist``'s matmul form leaves an absolute error ~eps |z|^2 in r^2, so r
    of a coincident pair can come out as ~sqrt(eps) |z| instead of 0 (here one duplicate pair gets r = 6e-8 in
    float64). Smooth kernels are flat at r = 0 (error O(eps |z|^2)); Matérn-1/2 has slope -1 there, so its entries
    are only good to ~sqrt(eps) |z| (the operator zeroes r below sqrt(eps) max|z| for Matérn-1/2). Measured against
    the exact kernel (|z| <= 6.7), operator / GPyTorch's dense kernel: Matérn-1/2 5.9e-4 / 3.3e-3 (float32),
    1.6e-11 / 1.6e-11 (float64); smooth kernels <= 6.3e-6 / 9.8e-6 (float32), <= 1.6e-14 / 1.6e-14 (float64)."""
    X = inputs(torch.float64)
    X[-10:] = X[:10]
    X[-20:-10] = X[10:20] + 1e-4
    X = X.to(dtype)
    kern = kernel_at(name, False, dtype, lengthscale=0.5)
    with torch.no_grad():
        K = operator(X, kern).to_dense().double()
        exact = exact_kernel(X.double(), kernel_at(name, False, torch.float64, lengthscale=0.5))
    zmax = float(((X.double() - X.double().mean(0)) / 0.5).norm(dim=1).max())
    eps = EPS[dtype]
    tol = 4 * math.sqrt(eps) * zmax if name == "matern12" else 10 * eps * zmax**2
    assert float((K - exact).abs().max()) < tol
    torch.testing.assert_close(K.diagonal(), exact.diagonal(), rtol=0, atol=2 * eps)


@pytest.mark.parametrize("fly", [False, True])
def test_matern12_close_pairs_in_a_set_many_lengthscales_wide(fly, dtype):
    """Matérn-1/2 on 1-D points spanning 1e4 length-scales, with pairs 2e-4 apart: the expanded form's rounding
    threshold reaches ~5e-4 length-scales there, and its pairs had read k = 1 (an entry 2e-4 off; GPyTorch 2e-6).
    Their r now comes from explicit differences: entries within the dtype's rounding of the exact kernel, stored
    or recomputed."""
    g = torch.Generator().manual_seed(0)
    X = torch.cat([torch.rand(200, 1, generator=g, dtype=torch.float64) * 1e4, torch.tensor([[0.0], [1e4]],
                                                                                           dtype=torch.float64)])
    X = torch.cat([X, X[:20] + 2e-4]).to(dtype)
    kern = make_scale_kernel("matern12").to(dtype)
    kern.base_kernel.lengthscale = 1.0
    with torch.no_grad(), memory_budget(dense_bytes=0 if fly else None):
        K = operator(X, kern).to_dense().double()
    exact = exact_kernel(X.double(), kern.double())
    close = float(exact[torch.arange(20), torch.arange(202, 222)].min())
    assert close < 1 - 1e-4  # the pairs really are apart
    # the other pairs keep the expanded form's eps |z|^2 / (2r) (float64: 3e-7, GPyTorch's 5e-7 on 4000 such points)
    tol = 1e-5 if dtype == torch.float64 else 4e-3
    err = float((K - exact).abs().max())
    assert err < tol, err


def test_diagonal_is_differentiable_in_the_outputscale(dtype):
    """``op.diagonal()`` is ``s^2`` with its gradient, as the dense kernel's diagonal (it had been detached)."""
    X = inputs(dtype)
    kern = kernel_at("matern32", False, dtype)
    kern.zero_grad()
    operator(X, kern).diagonal().sum().backward()
    ours = kern.raw_outputscale.grad.clone()
    kern.zero_grad()
    kern(X).to_dense().diagonal().sum().backward()
    torch.testing.assert_close(ours, kern.raw_outputscale.grad)


@pytest.mark.parametrize("name", ["rbf", "matern32", "matern52"])
def test_float32_distances_of_far_out_duplicates(name):
    """Duplicate points far from the centre at a short length-scale (|z|^2 ~ 5000, the concrete data at l = 0.1):
    the expanded distance form cancels to u |z|^2 ~ 3e-4 in float32, GPyTorch's float32 kernel is off by ~1e-4
    there and a float32 loss lands 28 of its standard errors from float64's. The operator sums the expanded form in
    float64 and rounds once: its entries stay within 1e-6 of the float64 kernel."""
    X = datasets.load("concrete", n=300, seed=10).train_x
    assert float(torch.cdist(X, X).add(torch.eye(300, dtype=X.dtype)).min()) == 0.0  # duplicates
    kern = kernel_at(name, False, torch.float32, lengthscale=0.1065)
    with torch.no_grad():
        K = operator(X.float(), kern).to_dense().double()
        theirs = kern(X.float()).to_dense().double()
    exact = exact_kernel(X.double(), kernel_at(name, False, torch.float64, lengthscale=0.1065))
    assert float((theirs - exact).abs().max()) > 1e-5  # the cancellation is real at these points
    assert float((K - exact).abs().max()) < 1e-6


# -- 2. derivative -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_isotropic_derivative_from_the_cached_matrix(name):
    """An isotropic float64 kernel whose K (and H) and D = A o R² / 2 fit the dense budget caches D with K; its
    per-column derivatives equal those of the tile pass (budget without room for D) and autograd's."""
    dtype = torch.float64
    X = inputs(dtype)
    kern = kernel_at(name, False, dtype)
    U, V = uv(dtype)
    with_d = operator(X, kern)
    without = operator(X, kern, dense_limit_bytes=(1 if name == "rbf" else 2) * N * N * 8)
    got, ref = with_d.column_derivatives(U, V), without.column_derivatives(U, V)
    assert with_d.cache.get("D") is not None and without.cache.get("D") is None
    for a, b in zip(got[1:], ref[1:]):
        assert rel_max(a, b) < 1e-12
    grads = autograd_grads(kern, lambda: kern(X).to_dense(), U[:, :1], V[:, :1])
    ours = closed_form_grads(kern, with_d, U[:, :1], V[:, :1])
    for key in grads:
        assert rel_max(ours[key], grads[key]) < GRAD_TOL[dtype], key



@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
@pytest.mark.parametrize("name", NAMES)
def test_bilinear_derivative_matches_autograd(name, ard, dtype):
    X = inputs(dtype)
    kern = kernel_at(name, ard, dtype)
    op = operator(X, kern)
    U, V = uv(dtype)
    ours = closed_form_grads(kern, op, U, V)
    gpy = autograd_grads(kern, lambda: kern(X).to_dense(), U, V)
    tol = GRAD_TOL_GPYTORCH_M12_ARD[dtype] if (name, ard) == ("matern12", True) else GRAD_TOL[dtype]
    for key in gpy:
        assert rel_max(ours[key], gpy[key]) < tol, key
    # and the exact direct-difference kernel (in float64, on the same inputs) for every case
    kern64 = kernel_at(name, ard, torch.float64)
    kern64.load_state_dict({k: v.double() for k, v in kern.state_dict().items()})
    exact = autograd_grads(kern64, lambda: exact_kernel(X.double(), kern64), U.double(), V.double())
    for key in exact:
        assert rel_max(ours[key], exact[key]) < GRAD_TOL[dtype], key


@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
@pytest.mark.parametrize("name", NAMES)
def test_indexed_entries_match_the_exact_kernel(name, ard, dtype):
    """``op[rows, cols]`` (entries of index pairs, coincident ones included) and index-then-slice lookups give the
    exact kernel's entries and their raw-parameter gradients."""
    X = inputs(dtype)
    kern = kernel_at(name, ard, dtype)
    g = torch.Generator().manual_seed(3)
    rows, cols = torch.randint(N, (40,), generator=g), torch.randint(N, (40,), generator=g)
    cols[:5] = rows[:5]  # coincident pairs: Matérn-1/2's kink at r = 0
    op, K = operator(X, kern), exact_kernel(X, kern)
    ours = op[rows, cols]
    assert ours.shape == (40,) and ours.dtype == dtype
    assert rel_max(ours.detach(), K.detach()[rows, cols]) < MATMUL_TOL[dtype]
    assert rel_max(op[rows][:, cols[:7]].to_dense().detach(), K.detach()[rows][:, cols[:7]]) < MATMUL_TOL[dtype]
    weights = torch.randn(40, dtype=torch.float64, generator=g).to(dtype)
    kern.zero_grad()
    (weights * ours).sum().backward()
    got = raw_grads(kern)
    kern.zero_grad()
    (weights * exact_kernel(X, kern)[rows, cols]).sum().backward()
    ref = raw_grads(kern)
    for key in ref:
        assert torch.isfinite(got[key]).all() and rel_max(got[key], ref[key]) < GRAD_TOL[dtype], key


@pytest.mark.parametrize("name", ["rbf", "matern12", "matern52"])
def test_derivative_through_linear_operator_autograd(name):
    """GPyTorch reaches the derivative through ``LinearOperator.matmul``'s autograd function; also a single
    (1-D) pair of vectors, and the gradient with respect to the right-hand side."""
    dtype = torch.float64
    X = inputs(dtype)
    kern = kernel_at(name, True, dtype)
    U, V = uv(dtype)
    V = V.requires_grad_(True)
    kern.zero_grad()
    (U * operator(X, kern).matmul(V)).sum().backward()
    ours, dV = raw_grads(kern), V.grad.clone()
    V.grad = None
    exact = autograd_grads(kern, lambda: exact_kernel(X, kern), U, V)
    for key in exact:
        assert rel_max(ours[key], exact[key]) < GRAD_TOL[dtype], key
    assert rel_max(dV, V.grad) < MATMUL_TOL[dtype]
    one = closed_form_grads(kern, operator(X, kern), U[:, 0], V.detach()[:, 0])
    ref = autograd_grads(kern, lambda: exact_kernel(X, kern), U[:, :1], V.detach()[:, :1])
    for key in ref:
        assert rel_max(one[key], ref[key]) < GRAD_TOL[dtype], key


# -- 3. row blocks and the on-the-fly path -------------------------------------------------------------------
def assert_same_products(fly, cached, V, dtype):
    """The kernel rows are bitwise equal on both paths; the products differ only in the BLAS summation order
    (cached: one ``(Vᵀ K)ᵀ`` product, :func:`gpnys.linalg.thin_matmul`; on the fly: row blocks), i.e. by rounding
    relative to ``|K| |V|`` (``K >= 0`` here), not to the possibly cancelling entries of ``K V``."""
    scale = float(cached.matmul(V.abs()).max())
    torch.testing.assert_close(fly.matmul(V), cached.matmul(V), rtol=10 * EPS[dtype], atol=50 * EPS[dtype] * scale)


@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
@pytest.mark.parametrize("name", NAMES)
def test_on_the_fly_equals_cached(name, ard, dtype):
    X = inputs(dtype)
    kern = kernel_at(name, ard, dtype)
    U, V = uv(dtype)
    cached, fly = operator(X, kern), operator(X, kern, dense_limit_bytes=0)
    with torch.no_grad():
        assert fly._dense() is None and cached._dense() is not None
        assert_same_products(fly, cached, V, dtype)
    g_fly, g_cached = closed_form_grads(kern, fly, U, V), closed_form_grads(kern, cached, U, V)
    # an isotropic float64 cache sums through D = A o R² / 2: another order of a cancelling sum, whose rounding moves
    # with the BLAS's blocking (2.7e-13 relative on one thread of an AMD EPYC)
    rtol = (10_000 if dtype == torch.float64 and not ard else 1000) * EPS[dtype]
    for key in g_cached:
        torch.testing.assert_close(g_fly[key], g_cached[key], rtol=rtol, atol=0)


@pytest.mark.parametrize("rows", ["1", "7", "n", "n+1"])
@pytest.mark.parametrize("dense_limit_bytes", [0, None], ids=["on-the-fly", "cached"])
def test_row_block_edge_cases(rows, dense_limit_bytes, dtype):
    """Blocks of ``block_bytes / 8 / n`` rows (:func:`gpnys.memory_budget`): one row, a ragged last block
    (37 = 5 * 7 + 2), exactly n, and more than n rows (one short block); both the on-the-fly path and the blocked
    build of the cache."""
    n = 37
    block_rows = {"1": 1, "7": 7, "n": n, "n+1": n + 1}[rows]
    X = inputs(dtype, n=n, seed=3)
    kern = kernel_at("matern32", True, dtype)
    kw = {} if dense_limit_bytes is None else {"dense_limit_bytes": dense_limit_bytes}
    U, V = uv(dtype, n=n)
    with memory_budget(block_bytes=8 * n * block_rows):
        op = operator(X, kern, **kw)
        assert op._block_rows() == block_rows
        with torch.no_grad():
            assert rel_max(op.matmul(V), dense_reference(X, kern) @ V) < MATMUL_TOL[dtype]
            assert rel_max(op.to_dense(), dense_reference(X, kern)) < MATMUL_TOL[dtype]
        ours = closed_form_grads(kern, op, U, V)
    ref = autograd_grads(kern, lambda: kern(X).to_dense(), U, V)
    for key in ref:
        assert rel_max(ours[key], ref[key]) < GRAD_TOL[dtype], key


def test_dense_cache_follows_the_memory_budget(dtype):
    """``dense_limit_bytes=None`` reads the budget when the operator is built: dense_bytes = 0 gives the on-the-fly
    path with the same products and gradients as the cached one."""
    X = inputs(dtype)
    kern = kernel_at("matern52", True, dtype)
    U, V = uv(dtype)
    cached = operator(X, kern)
    with memory_budget(dense_bytes=0, block_bytes=8 * N * 5):
        fly = operator(X, kern)
        assert fly.dense_limit_bytes == 0 and fly._block_rows() == 5
        with torch.no_grad():
            assert fly._dense() is None and cached._dense() is not None
            assert_same_products(fly, cached, V, dtype)
        g_fly = closed_form_grads(kern, fly, U, V)
    g_cached = closed_form_grads(kern, cached, U, V)
    # 5-row blocks sum the gradient in another order (measured 6e-14 in float64; 2.4e-13 since the on-the-fly
    # sums take each upper tile's pairs with their mirrors, in the expanded form of (z_i - z_j)^2)
    for key in g_cached:
        torch.testing.assert_close(g_fly[key], g_cached[key], rtol=2000 * EPS[dtype], atol=0)


# -- 4. the cache --------------------------------------------------------------------------------------------
def test_cache_is_reused_and_refreshed_on_a_new_lengthscale(monkeypatch):
    dtype = torch.float64
    X = inputs(dtype)
    kern = kernel_at("matern52", True, dtype)
    computed_rows = []
    original_fill = TorchTiles.fill

    def counting_fill(self, Zr, Zc, sq, rows, cols, out, scratch, zmax, derivative=None, padded=None):
        computed_rows.append(rows.stop - rows.start)
        return original_fill(self, Zr, Zc, sq, rows, cols, out, scratch, zmax, derivative, padded)

    monkeypatch.setattr(TorchTiles, "fill", counting_fill)
    cache = {}
    first = operator(X, kern, cache=cache)
    K1, H1 = first._dense()
    assert sum(computed_rows) == N
    # GPyTorch rebuilds the operator from its representation: same cache, same length-scale -> same buffers,
    # nothing recomputed
    second = operator(X, kern, cache=cache)
    K2, H2 = second._dense()
    assert K2.data_ptr() == K1.data_ptr() and H2.data_ptr() == H1.data_ptr() and sum(computed_rows) == N
    R = torch.randn(N, 3, dtype=dtype, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_max(second.matmul(R), dense_reference(X, kern) @ R) < MATMUL_TOL[dtype]
    old_lengthscale = kern.base_kernel.lengthscale.detach().clone()
    # an optimiser step: the values are recomputed (into the same buffers) for the new length-scale
    kern.base_kernel.lengthscale = torch.tensor([0.4, 2.0, 0.8], dtype=dtype)
    third = operator(X, kern, cache=cache)
    K3, _ = third._dense()
    assert sum(computed_rows) == 2 * N and K3.data_ptr() == K1.data_ptr()
    U, V = uv(dtype)
    with torch.no_grad():
        assert rel_max(third.matmul(R), dense_reference(X, kern) @ R) < MATMUL_TOL[dtype]
    ours = closed_form_grads(kern, third, U, V)
    ref = autograd_grads(kern, lambda: kern(X).to_dense(), U, V)
    for key in ref:
        assert rel_max(ours[key], ref[key]) < GRAD_TOL[dtype], key
    # an operator still holding the old length-scale does not read the overwritten buffers as its own
    with torch.no_grad():
        assert rel_max(first.matmul(R), dense_reference(X, kernel_at("matern52", True, dtype, old_lengthscale))
                       @ R) < MATMUL_TOL[dtype]
        assert rel_max(third.matmul(R), dense_reference(X, kern) @ R) < MATMUL_TOL[dtype]



def check_per_column_derivatives_after_a_product(name, device):
    dtype = torch.float64
    X = inputs(dtype).to(device)
    kern = kernel_at(name, False, dtype).to(device)
    U, V = (t.to(device) for t in uv(dtype))
    cache: dict = {}

    def cold():
        return [t.detach() for t in operator(X, kern).column_derivatives(U, V)[1:]]

    op = operator(X, kern, cache=cache)
    with torch.no_grad():
        op.matmul(torch.cat([U, U.abs()], 1))
    stored = "last_product" in cache  # the dense route (a GPU may take the fused kernels instead)
    assert stored or device.type != "cpu"
    assert not stored or cache["last_product"].lookup(U) is not None
    for got, want in zip(op.column_derivatives(U, V)[1:], cold()):
        assert rel_max(got, want) < 1e-12
    kern.base_kernel.lengthscale = 0.5
    op = operator(X, kern, cache=cache)
    got = [t.detach() for t in op.column_derivatives(U, V)[1:]]
    assert not stored or cache["last_product"].lookup(U) is None  # the refill dropped the old product
    for g, want in zip(got, cold()):
        assert rel_max(g, want) < 1e-12


@pytest.mark.parametrize("name", ["rbf", "matern32"])
def test_per_column_derivatives_after_a_product_equal_cold_ones(name):
    """The stored kernel's last full product answers the next per-column derivative pass whose ``U`` it took
    (the estimator's true residual, then the per-probe sums): the same values as an operator without it, to
    rounding; after a new length-scale refills ``K`` the pass equals a cold one at that length-scale."""
    check_per_column_derivatives_after_a_product(name, torch.device("cpu"))


@pytest.mark.cuda
def test_cuda_per_column_derivatives_after_a_product_equal_cold_ones(cuda_device):
    check_per_column_derivatives_after_a_product("rbf", cuda_device)

def test_cache_is_not_shared_across_inputs():
    dtype = torch.float64
    kern = kernel_at("rbf", False, dtype)
    cache = {}
    operator(inputs(dtype, seed=0), kern, cache=cache).to_dense()
    X = inputs(dtype, seed=1)
    with torch.no_grad():
        assert rel_max(operator(X, kern, cache=cache).to_dense(), dense_reference(X, kern)) < MATMUL_TOL[dtype]


# -- 5. end to end through GPyTorch and the hook -------------------------------------------------------------
@pytest.fixture(scope="module")
def concrete300():
    return datasets.load("concrete", split=0, n=300, seed=0)  # d = 8


def gp_model(ds, name, ard, dtype, kernel=None):
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dtype)
    m = ExactGPModel(ds.train_x.to(dtype), ds.train_y.to(dtype), lik, kernel=kernel or name, ard=ard).to(dtype)
    base = m.covar_module.base_kernel
    base.lengthscale = torch.linspace(0.7, 2.0, ds.d, dtype=dtype) if ard else 1.0
    m.covar_module.outputscale = 1.3
    lik.noise = 0.05
    return m


def loss_and_grads(m, kernel_operator, seed=0):
    m.train()
    m.zero_grad()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(m.likelihood, m)
    torch.manual_seed(seed)  # the probes: the same draws with and without the operator
    with use_preconditioner(m, "afn", k=50, w=10, settings=EstimatorSettings(kernel_operator=kernel_operator)):
        loss = -mll(m(*m.train_inputs), m.train_targets)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def grad_errors(g, g_ref):
    """Per component ``|g - g_ref| / max(|g_ref|, 0.1 ||g_ref||)`` (as in test_hook), worst per parameter."""
    scale = 0.1 * torch.cat([v.reshape(-1) for v in g_ref.values()]).norm()
    return {k: float(((g[k] - g_ref[k]).abs() / torch.maximum(g_ref[k].abs(), scale)).max()) for k in g_ref}


@pytest.fixture
def derivative_calls(monkeypatch):
    """Calls of the operator's closed-form derivatives (the estimator's per-column pass, or GPyTorch's bilinear)."""
    calls = []
    for name in ("_bilinear_derivative", "column_derivatives"):
        def counting(self, left_vecs, right_vecs, _original=getattr(StationaryKernelOperator, name)):
            calls.append(left_vecs.shape)
            return _original(self, left_vecs, right_vecs)

        monkeypatch.setattr(StationaryKernelOperator, name, counting)
    return calls


# With the same seed both runs draw the same probes and run the same CG/Lanczos recurrences; the operator only
# changes round-off in K v and in the derivative. Measured differences (loss relative; worst gradient component
# as in grad_errors) for the configurations below:
#   float64: loss <= 4.1e-15, gradients <= 1.0e-13 -- except ARD Matérn-1/2, where the reference (GPyTorch's
#            kernel with autograd) is itself off by ~sqrt(eps) |z| on its diagonal (see GRAD_TOL_GPYTORCH_M12_ARD):
#            loss 4.5e-10, gradients 2.4e-7
#   float32: loss <= 8.4e-7, gradients <= 6.8e-5 (smooth kernels); Matérn-1/2 loss 1.1e-4, gradients 2.0e-3 (ARD),
#            1.1e-4 (isotropic) -- the reference's diagonal as above, and the concrete subset has duplicated rows,
#            where both kernels' r is ~sqrt(eps) |z| instead of 0 (test_nearly_coincident_points)
# Any error in the closed-form derivative (a missing factor, a wrong dimension) is O(1) in these gradients.
E2E_TOL = {  # (dtype, Matérn-1/2 with ARD or float32 Matérn-1/2) -> (loss, gradient)
    (torch.float64, False): (1e-12, 1e-9),
    (torch.float64, True): (1e-8, 1e-5),
    (torch.float32, False): (2e-5, 3e-4),
    (torch.float32, True): (1e-3, 2e-2),
}


@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
@pytest.mark.parametrize("name", NAMES)
def test_hook_loss_and_gradients_with_and_without_operator(concrete300, derivative_calls, name, ard, dtype):
    with_op = loss_and_grads(gp_model(concrete300, name, ard, dtype), True)
    used = len(derivative_calls)
    without = loss_and_grads(gp_model(concrete300, name, ard, dtype), False)
    assert used >= 1 and len(derivative_calls) == used  # really used when on, never when off
    rough = name == "matern12" and (ard or dtype == torch.float32)
    loss_tol, grad_tol = E2E_TOL[(dtype, rough)]
    assert abs(with_op[0] - without[0]) / abs(without[0]) < loss_tol
    errors = grad_errors(with_op[1], without[1])
    assert set(errors) == {"likelihood.noise_covar.raw_noise", "mean_module.raw_constant",
                           "covar_module.raw_outputscale", "covar_module.base_kernel.raw_lengthscale"}
    assert max(errors.values()) < grad_tol, errors


def test_hook_swaps_the_operator_in_only_while_training(concrete300):
    m = gp_model(concrete300, "matern32", True, torch.float64)
    with use_preconditioner(m, "afn", k=50, w=10) as hook:  # kernel_operator=True is the default
        m.train()
        lazy = m.likelihood(m(*m.train_inputs)).lazy_covariance_matrix._linear_op
        assert isinstance(lazy, StationaryKernelOperator)
        # EstimatorSettings.dense_limit_bytes defaults to None: the memory budget's limit
        assert lazy.X is m.train_inputs[0] and lazy.dense_limit_bytes == budget.dense_limit_bytes()
        m.eval()  # prediction keeps GPyTorch's kernel
        gpytorch_op = m.covar_module(m.train_inputs[0])
        assert hook.kernel_operator(gpytorch_op) is gpytorch_op


def test_training_trajectory_unchanged_by_the_operator(concrete300):
    """Several Adam steps (the cache is refreshed at every step): the same hyperparameters either way."""
    results = []
    for kernel_operator in (True, False):
        m = gp_model(concrete300, "rbf", True, torch.float64)
        settings = EstimatorSettings(kernel_operator=kernel_operator)

        def ctx(n, m=m, settings=settings):
            return use_preconditioner(m, "afn", k=50, w=10, settings=settings)

        trace = fit(m, iters=4, lr=0.1, progress=False, seed=0, settings=ctx)
        results.append((trace.loss_trace, hyperparameters(m)))
    (trace_op, h_op), (trace_ref, h_ref) = results
    assert trace_op == pytest.approx(trace_ref, rel=1e-10)
    for key in h_ref:
        assert h_op[key] == pytest.approx(h_ref[key], rel=1e-8), key


# -- 6. unsupported kernels: the hook falls back to GPyTorch -------------------------------------------------
def test_supported():
    for name in NAMES:
        assert supported(make_scale_kernel(name).base_kernel)
        assert supported(make_scale_kernel(name, ard_num_dims=4).base_kernel)
    assert not supported(gpytorch.kernels.RBFKernel(active_dims=[0, 2]))
    assert not supported(gpytorch.kernels.MaternKernel(nu=1.5, active_dims=torch.tensor([1])))
    assert not supported(gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2])))
    assert not supported(gpytorch.kernels.PeriodicKernel())
    assert not supported(gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()))  # the base kernel only


def test_active_dims_take_the_operator_on_the_selected_columns(concrete300, derivative_calls):
    """GPyTorch selects a kernel's active_dims before the lazy kernel tensor the hook reads, so the hook takes the
    kernel as it acts on those columns (``selected_kernel``): the closed-form operator on 4 of the 8 columns, with
    GPyTorch's loss and gradients (its own evaluation, ``kernel_operator=False``) to round-off, and Cholesky's to
    the estimator's accuracy. (Before 2026-11-30 such a kernel took GPyTorch's dense evaluation.)"""
    def model():
        kern = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5, active_dims=[0, 1, 2, 3]))
        return gp_model(concrete300, "matern32", False, torch.float64, kernel=kern)

    m = model()
    with use_preconditioner(m, "afn", k=50, w=10, settings=EstimatorSettings(kernel_operator=True)) as hook:
        m.train()
        cov = m.likelihood(m(*m.train_inputs)).lazy_covariance_matrix
        op = hook.kernel_operator(cov._linear_op)
        assert isinstance(op, StationaryKernelOperator) and op.X.shape == (300, 4)
    on = loss_and_grads(model(), True)
    assert derivative_calls  # the operator's closed-form derivative ran
    off = loss_and_grads(model(), False)
    assert abs(on[0] - off[0]) <= 1e-8 * abs(off[0]), (on[0], off[0])
    assert max(grad_errors(on[1], off[1]).values()) < 1e-6
    with gpytorch.settings.max_cholesky_size(10**6):
        exact = loss_and_grads(model(), False)  # the hook sets max_cholesky_size(0) inside; compare loosely
    assert math.isfinite(on[0]) and abs(on[0] - exact[0]) / abs(exact[0]) < 1e-2
    # and training runs under the hook
    m = model()
    trace = fit(m, iters=3, lr=0.1, progress=False,
                settings=lambda n: use_preconditioner(m, "afn", k=50, w=10))
    assert all(math.isfinite(v) for v in trace.loss_trace) and trace.loss_trace[-1] < trace.loss_trace[0]


def test_hook_uses_the_kernels_actual_inputs(concrete300):
    class Transformed(ExactGPModel):
        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(3.0 * x))

    def model():
        lik = gpytorch.likelihoods.GaussianLikelihood()
        return Transformed(concrete300.train_x, concrete300.train_y, lik, kernel="rbf").double()

    on, off = loss_and_grads(model(), True), loss_and_grads(model(), False)
    assert abs(on[0] - off[0]) / abs(off[0]) < 1e-8


@pytest.mark.parametrize("name", ["rbf", "matern32"])
def test_float32_lengthscale_derivative_survives_large_scaled_inputs(name):
    """Points in [0, 10]^2 at length-scale 0.2 (|z| up to 25): the expanded sum subtracts two ~|z|^2 terms whose
    difference is ~|z_i - z_j|^2. Accumulated in float32 this lost three digits (error 1.1e-2 before the fix);
    the operator now accumulates in float64 and is at least as accurate as GPyTorch's own float32 autograd."""
    g = torch.Generator().manual_seed(0)
    X = (torch.rand(300, 2, generator=g, dtype=torch.float64) * 10).float().double()  # exact in float32
    U = torch.randn(300, 1, generator=g, dtype=torch.float64).float().double()

    def grad(dtype, use_op):
        k = make_scale_kernel(name).to(dtype)
        k.base_kernel.lengthscale = 0.2
        Xd, Ud = X.to(dtype), U.to(dtype)
        if use_op:
            op = StationaryKernelOperator(Xd, k.outputscale, k.base_kernel.lengthscale, base=k.base_kernel, cache={})
            _, a, b = op._bilinear_derivative(Ud, Ud)
            torch.autograd.backward([k.outputscale, k.base_kernel.lengthscale], [a, b])
        else:
            (Ud * (k(Xd).to_dense() @ Ud)).sum().backward()
        return float(k.base_kernel.raw_lengthscale.grad)

    ref = grad(torch.float64, False)
    err_op = abs(grad(torch.float32, True) - ref) / abs(ref)
    err_gp = abs(grad(torch.float32, False) - ref) / abs(ref)
    assert err_op < 1e-4 and err_op <= 2 * err_gp


@pytest.mark.parametrize("dense_limit_bytes", [None, 0], ids=["cached", "on-the-fly"])
def test_matern12_near_pairs_are_not_taken_for_coincident(dense_limit_bytes):
    """float32 Matérn-1/2, pairs 5e-4 length-scales apart: their distances are summed in float64, so they keep
    their kernel value (a float32-sized coincidence threshold had set them to k = 1, 5e-4 off each, and 12 % off the
    length-scale gradient on two clusters)."""
    X = torch.tensor([[0.0], [1e-4], [2.0], [2.0001], [5.0]], dtype=torch.float32)
    kern = kernel_at("matern12", False, torch.float32, lengthscale=0.2)
    op = operator(X, kern, dense_limit_bytes=dense_limit_bytes)
    with torch.no_grad():
        K = op @ torch.eye(5, dtype=torch.float32)
    ref = exact_kernel(X.double(), kernel_at("matern12", False, torch.float64, lengthscale=0.2)).detach()
    assert rel_max(K, ref) < 1e-6


@pytest.mark.parametrize("d", [2, 5, 10])
def test_matern12_duplicates_are_coincident_in_any_dimension(d):
    """Exact duplicate points in d dimensions are at distance 0 (k = 1, no ``h = -exp(-r)/r`` blow-up in the
    length-scale derivative), wherever they are: the coincidence threshold follows the points' norms and d, not their
    largest coordinate."""
    g = torch.Generator().manual_seed(0)
    base = 3 + torch.rand(60, d, dtype=torch.float64, generator=g)
    X = torch.cat([base, base])
    kern = kernel_at("matern12", False, torch.float64, lengthscale=0.01)
    op = operator(X, kern)
    with torch.no_grad():
        K = op @ torch.eye(120, dtype=torch.float64)
    assert bool((K.diagonal(60) == kern.outputscale.detach()).all())  # every duplicate pair: k = 1
    U, V = uv(torch.float64, n=120)
    g_op = closed_form_grads(kern, op, U, V)
    g_ref = autograd_grads(kern, lambda: exact_kernel(X, kern), U, V)
    for key in g_ref:
        torch.testing.assert_close(g_op[key], g_ref[key], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dense_bytes", [None, 0], ids=["cached", "on-the-fly"])
def test_entries_and_system_apply_a_scale_kernels_own_active_dims(dense_bytes):
    """``ScaleKernel(RBFKernel(), active_dims=[0, 2])``: GPyTorch selects the columns before the base kernel runs, and
    so do the kernel entries and the kernel system (they had used every column)."""
    from gpnys.kernels.entries import KernelEntries
    from gpnys.kernels.system import KernelSystem

    X = points(120, 3, dtype=torch.float64, seed=3)
    kern = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(), active_dims=[0, 2]).double()
    kern.outputscale, kern.base_kernel.lengthscale = 1.5, 0.4
    ref = dense_reference(X, kern)
    entries = KernelEntries(X, kern)
    V = torch.randn(120, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), memory_budget(dense_bytes=dense_bytes):
        assert rel_max(entries.outputscale * entries(slice(None), slice(None)), ref) < 1e-12
        assert rel_max(entries.outputscale * entries.matmul(V), ref @ V) < 1e-12
        system = KernelSystem(X, kern, mu=0.1)
        assert rel_max(system(V), ref / kern.outputscale.detach() @ V + 0.1 * V) < 1e-12


def _composites(dtype):
    M, R, S = gpytorch.kernels.MaternKernel, gpytorch.kernels.RBFKernel, gpytorch.kernels.ScaleKernel
    kernels = {
        "scale": S(M(nu=1.5, ard_num_dims=D)),
        "sum": S(M(nu=0.5)) + S(R(ard_num_dims=D)),
        "product": S(M(nu=2.5) * R()),
        "active_dims": S(M(nu=0.5, active_dims=[0, 2])) + R(active_dims=[1]),
        "nested": S(S(R(active_dims=[2])) * (M(nu=1.5) + R())),
    }
    g = torch.Generator().manual_seed(4)
    for kern in kernels.values():
        for module in kern.modules():
            if getattr(module, "raw_lengthscale", None) is not None:
                module.lengthscale = 0.5 + torch.rand(module.lengthscale.shape, generator=g)
            if isinstance(module, gpytorch.kernels.ScaleKernel):
                module.outputscale = 0.5 + float(torch.rand((), generator=g))
    return {name: kern.to(dtype) for name, kern in kernels.items()}


@pytest.mark.parametrize("name", ["scale", "sum", "product", "active_dims", "nested"])
def test_difference_entries_of_composite_kernels(name, dtype):
    """Sums, products and scalings of RBF / Matérn kernels, each with its own ``active_dims``: GPyTorch's entries
    (in float64) to rounding; other kernels are ``None``."""
    from gpnys.kernels.entries import difference_entries

    kern = _composites(dtype)[name]
    A, B = inputs(dtype), inputs(dtype, n=30, seed=1)
    ref = _composites(torch.float64)[name]
    with torch.no_grad():
        want = ref(A.double(), B.double()).to_dense()
    got = difference_entries(kern, A, B)
    assert got.shape == (N, 30) and got.dtype == dtype
    assert rel_max(got, want) < MATMUL_TOL[dtype]
    assert difference_entries(kern + gpytorch.kernels.LinearKernel().to(dtype), A, B) is None
