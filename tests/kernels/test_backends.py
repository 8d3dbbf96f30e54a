"""Kernel compute backends (gpnys.kernels.backends) and the formula table (gpnys.kernels.formulas).

The Triton kernels run here on CPU tensors through Triton's interpreter (conftest sets ``TRITON_INTERPRET=1`` when
there is no GPU); the ``cuda``-marked tests run the compiled kernels on a GPU. References are GPyTorch's dense
kernel and autograd through it.
"""

import copy
import math
import warnings

import gpytorch
import pytest
import torch

from gpnys import memory_budget
from gpnys.kernels import backends, make_kernel
from gpnys.kernels.backends import keops as keops_backend
from gpnys.kernels.backends import select_backend
from gpnys.kernels.backends.torch_tiles import k_and_h_inplace
from gpnys.kernels.cutoff import cutoff_radius
from gpnys.kernels.formulas import FORMULAS, formula, k_and_h, unit_kernel
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.kernels.product import FUSED_SHARE

pytest.importorskip("triton")

NAMES = ["rbf", "matern12", "matern32", "matern52"]
NUS = {"rbf": None, "matern12": 0.5, "matern32": 1.5, "matern52": 2.5}
TOL = {torch.float32: 5e-5, torch.float64: 1e-11}
GTOL = {torch.float32: 2e-4, torch.float64: 1e-9}


# -- the formula table -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_formulas_match_gpytorch_and_their_derivative(name):
    r = torch.linspace(0.0, 6.0, 301, dtype=torch.float64)[1:]
    base = make_kernel(name).base_kernel.double()
    base.lengthscale = 1.0
    with torch.no_grad():
        ref = base(torch.zeros(1, 1, dtype=torch.float64), r[:, None]).to_dense()[0]
    k, h = k_and_h(r.square(), NUS[name])
    torch.testing.assert_close(k, ref, rtol=1e-13, atol=1e-15)
    rr = r.clone().requires_grad_(True)
    kk, _ = k_and_h(rr.square(), NUS[name])
    (dk,) = torch.autograd.grad(kk.sum(), rr)
    torch.testing.assert_close(h, dk / r, rtol=1e-10, atol=1e-14)  # h = k'(r) / r
    assert all(math.isclose(unit_kernel(float(x), NUS[name]), float(y), rel_tol=1e-13) for x, y in zip(r, k))


@pytest.mark.parametrize("name", NAMES)
def test_inplace_tiles_agree_with_the_table(name, dtype):
    r = torch.linspace(0.0, 8.0, 257, dtype=dtype)
    f = formula(NUS[name])
    k_ref, h_ref = k_and_h(r.square(), NUS[name])
    k, h = torch.empty_like(r), (None if f.rbf else torch.empty_like(r))
    k_and_h_inplace(r.clone(), f, k, h)
    torch.testing.assert_close(k, k_ref, rtol=10 * torch.finfo(dtype).eps, atol=0)
    if h is not None:
        if f.singular:  # the pole of Matérn-1/2 is stored as 0
            h_ref = torch.where(r > 0, h_ref, torch.zeros_like(h_ref))
        torch.testing.assert_close(h, h_ref, rtol=10 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("name", ["rbf", "matern12"])
@pytest.mark.parametrize("sparse", [False, True], ids=["every-pair", "plan"])
def test_torch_symmetric_product_matches_row_tiles_and_dense(name, sparse, dtype):
    """The torch tiles' full product computes the upper triangle's tiles only and mirrors them. It must equal the
    row-by-row pass (``rows=``: every tile, no mirroring) to rounding and the dense kernel, with blocks small enough
    that every pass has many tiles and a plan's column lists come in chunks (the diagonal block then straddles
    them); odd n leaves a partial last block."""
    g = torch.Generator().manual_seed(11)
    n = 333
    X64 = torch.rand(n, 2, generator=g, dtype=torch.float64) * torch.tensor([200.0 if sparse else 3.0, 4.0])
    X64[7] = X64[300]  # coincident points (Matérn-1/2's pole is zeroed on the diagonal and on duplicates)
    X, V = X64.to(dtype), torch.randn(n, 5, generator=g, dtype=torch.float64).to(dtype)
    kern = make_kernel(name).to(dtype)
    kern.base_kernel.lengthscale = 1.0
    with memory_budget(dense_bytes=0, block_bytes=1 << 13):
        op = op_for(X, kern, "torch", prune_tol=None)
        perm, Z, plan = op._working()
        assert (plan is not None) == sparse
        Vw = V if perm is None else V[perm]
        tiles = op.backend
        full = tiles.matmul(Z, Vw, plan)  # the symmetric product
        by_rows = torch.cat([tiles.matmul(Z, Vw, plan, (a, min(a + 64, n))) for a in range(0, n, 64)])
        assert sum(1 for _ in tiles.upper_tiles(Z, plan)) > 5
        assert torch.equal(full, tiles.matmul(Z, Vw, plan))  # repeatable to the bit
        # the per-probe derivative sums mirror their upper tiles too, with U and V swapped: U != V here
        Uw = torch.flip(Vw, [0]) + 0.5
        sums = {iso: tiles.column_derivative_sums(Z, Uw, Vw, plan, iso) for iso in (False, True)}
        sums_by_rows = {iso: [tiles.column_derivative_sums(Z, Uw, Vw, plan, iso, (a, min(a + 64, n)))
                              for a in range(0, n, 64)] for iso in (False, True)}
        # and the sums of sum_j u_j^T K v_j (GPyTorch's own derivative pass): U V^T plus the mirror's V U^T
        whole = tiles.derivative_sums(Z, Uw, Vw, plan)
        whole_by_rows = [tiles.derivative_sums(Z, Uw, Vw, plan, (a, min(a + 64, n))) for a in range(0, n, 64)]
    for iso in (False, True):
        for i in range(2):
            rows_total = sum(part[i] for part in sums_by_rows[iso])
            assert float((sums[iso][i] - rows_total).abs().max()) <= GTOL[dtype] * float(rows_total.abs().max())
    for i in range(2):
        rows_total = sum(part[i] for part in whole_by_rows)
        assert float((whole[i] - rows_total).abs().max()) <= GTOL[dtype] * float(rows_total.abs().max())
        assert float((whole[i] - sums[False][i].sum(0)).abs().max()) <= GTOL[dtype] * float(whole[i].abs().max())
    with torch.no_grad():
        s_ref = (Uw.double() * (kern.base_kernel(Z.double()).to_dense() @ Vw.double())).sum(0)
    assert float((sums[False][0] - s_ref).abs().max()) <= GTOL[dtype] * float(s_ref.abs().max())
    assert torch.allclose(sums[True][1][:, 0], sums[False][1].sum(1), rtol=GTOL[dtype], atol=0)
    with torch.no_grad():
        ref = kern.base_kernel(Z.double()).to_dense() @ Vw.double()
    scale = float(ref.abs().max())
    assert float((full.double() - by_rows.double()).abs().max()) <= TOL[dtype] * scale
    # float32 at |z| ~ 100: the expanded distance loses ~eps |z|^2 (test_cutoff's dense comparison, same bound)
    assert float((full.double() - ref).abs().max()) <= (1e-3 if dtype == torch.float32 else TOL[dtype]) * scale


def test_formula_rejects_other_smoothness():
    with pytest.raises(ValueError, match="nu"):
        formula(3.5)
    assert set(FORMULAS) == {None, 0.5, 1.5, 2.5}
    assert cutoff_radius(1.5, 1e-16) > cutoff_radius(None, 1e-16) > 0


# -- choosing the backend --------------------------------------------------------------------------------------
def test_selection_is_torch_on_cpu_triton_on_cuda_and_never_keops(monkeypatch):
    monkeypatch.setattr(keops_backend, "available", lambda: True)  # even with pykeops installed
    assert select_backend(torch.device("cpu")) == "torch"
    assert select_backend(torch.device("cuda", 0)) == "triton"  # only inspects the device type
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    assert select_backend(torch.device("cuda")) == "torch"
    assert select_backend("cpu", "keops") == "keops"


def test_selection_errors(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend("cpu", "cuda")
    monkeypatch.setattr(keops_backend, "available", lambda: False)
    with pytest.raises(ValueError, match="pykeops"):
        select_backend("cpu", "keops")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        select_backend("cpu", "triton")
    X = torch.rand(10, 2, dtype=torch.float64)
    base = gpytorch.kernels.RBFKernel().double()
    with pytest.raises(ValueError, match="backend must be one of"):
        StationaryKernelOperator(X, torch.tensor(1.0, dtype=torch.float64), base.lengthscale, base=base, cache={},
                                 backend="cuda")


# -- the Triton kernels against dense references ---------------------------------------------------------------
def setup(name, dtype, ard, n=150, spread=5.0, seed=0, device="cpu", t=5):
    g = torch.Generator().manual_seed(seed)
    X = (torch.rand(n, 3, generator=g, dtype=torch.float64) * spread + 2.0).to(dtype)
    U = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    V = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    kern = make_kernel(name, 3 if ard else None).to(dtype)
    kern.outputscale = 1.3
    kern.base_kernel.lengthscale = torch.tensor([0.5, 0.8, 1.1]) if ard else 0.7
    return X.to(device), U.to(device), V.to(device), kern.to(device)


def op_for(X, kern, backend, prune_tol=0.0, **kw):
    return StationaryKernelOperator(X, kern.outputscale, kern.base_kernel.lengthscale, base=kern.base_kernel,
                                    cache={}, backend=backend, prune_tol=prune_tol, dense_limit_bytes=0, **kw)


def autograd_reference(X, kern, U, V, name):
    """``sum_t u_t^T K v_t`` and its gradient in (outputscale, lengthscale), through GPyTorch's dense unit kernel in
    float64 at ``X / l`` (so the reference's own rounding is negligible)."""
    unit = make_kernel(name).base_kernel.to(X.device).double()
    unit.lengthscale = 1.0
    s2 = kern.outputscale.detach().double().clone().requires_grad_(True)
    ls = kern.base_kernel.lengthscale.detach().double().clone().requires_grad_(True)
    X64, U64, V64 = X.double(), U.double(), V.double()
    Z = X64 / ls.reshape(-1)
    if name == "matern12":  # GPyTorch's distance has an infinite derivative at r = 0: explicit differences
        r2 = (Z[:, None, :] - Z[None, :, :]).square().sum(-1)
        r = torch.where(r2 > 0, r2.clamp_min(1e-300).sqrt(), torch.zeros_like(r2))
        K = s2 * torch.exp(-r)
    else:
        K = s2 * unit(Z).to_dense()
    loss = (U64 * (K @ V64)).sum()
    g_s2, g_ls = torch.autograd.grad(loss, [s2, ls])
    with torch.no_grad():
        return K.detach(), g_s2, g_ls


def check_every_pass(X, U, V, kern, name, dtype, backend, expect):
    """The product, the derivative sums and the per-column sums of ``backend`` (``expect``: the one chosen) against
    dense float64 references, with no fallback warning."""
    K, g_s2, g_ls = autograd_reference(X, kern, U, V, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the torch tiles
        op = op_for(X, kern, backend)
        assert op.backend.name == expect
        with torch.no_grad():
            KV = op.matmul(V)
        _, d_s2, d_ls = op._bilinear_derivative(U, V)
        _, c_s2, c_ls = op.column_derivatives(U, V)
    ref = K @ V.double()
    assert float((KV.double() - ref).abs().max()) <= TOL[dtype] * float(ref.abs().max())
    assert float((d_s2.double() - g_s2).abs()) <= GTOL[dtype] * float(g_s2.abs())
    assert float((d_ls.double() - g_ls).abs().max()) <= GTOL[dtype] * float(g_ls.abs().max())
    ref_s2, ref_ls = per_column_reference(X, kern, U, V, name)
    assert float((c_s2.double() - ref_s2).abs().max()) <= GTOL[dtype] * float(ref_s2.abs().max())
    assert float((c_ls.double() - ref_ls).abs().max()) <= GTOL[dtype] * float(ref_ls.abs().max())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
def test_triton_product_and_derivative_match_dense_autograd(name, ard, dtype):
    X, U, V, kern = setup(name, dtype, ard)
    K, g_s2, g_ls = autograd_reference(X, kern, U, V, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the torch tiles would warn
        op = op_for(X, kern, "triton")
        assert op.backend.name == "triton" and op.plan() is None
        with torch.no_grad():
            KV = op.matmul(V)
        _, d_s2, d_ls = op._bilinear_derivative(U, V)
    ref = K @ V.double()
    assert KV.dtype == dtype and d_s2.dtype == dtype
    assert float((KV.double() - ref).abs().max()) <= TOL[dtype] * float(ref.abs().max())
    assert float((d_s2.double() - g_s2).abs()) <= GTOL[dtype] * float(g_s2.abs())
    assert d_ls.shape == kern.base_kernel.lengthscale.shape
    assert float((d_ls.double() - g_ls).abs().max()) <= GTOL[dtype] * float(g_ls.abs().max())


def per_column_reference(X, kern, U, V, name):
    """:func:`autograd_reference`'s gradient for each column pair ``(u_j, v_j)`` alone: ``(t,)`` and ``(t, *l)``."""
    refs = [autograd_reference(X, kern, U[:, j : j + 1], V[:, j : j + 1], name)[1:] for j in range(U.shape[1])]
    return torch.stack([r[0] for r in refs]), torch.stack([r[1] for r in refs])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ard", [False, True], ids=["iso", "ard"])
def test_triton_column_derivatives_match_dense_autograd_per_column(name, ard, dtype):
    """The fused per-probe sums (one launch, planes K and H o R^2 or H o dz_d^2) against a dense float64 autograd
    gradient of each column's ``u_j^T K v_j``."""
    X, U, V, kern = setup(name, dtype, ard)
    ref_s2, ref_ls = per_column_reference(X, kern, U, V, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to the torch tiles
        _, d_s2, d_ls = op_for(X, kern, "triton").column_derivatives(U, V)
    assert d_s2.dtype == dtype and d_s2.shape == (5,) and d_ls.shape == (5, *kern.base_kernel.lengthscale.shape)
    assert float((d_s2.double() - ref_s2).abs().max()) <= GTOL[dtype] * float(ref_s2.abs().max())
    assert float((d_ls.double() - ref_ls).abs().max()) <= GTOL[dtype] * float(ref_ls.abs().max())


@pytest.mark.parametrize("name", ["matern12", "matern32"])
@pytest.mark.parametrize("d,t", [(3, 17), (10, 33)], ids=["d3-t17", "d10-t33"])
def test_triton_tail_column_and_unhoisted_coordinates_match_dense(name, d, t, dtype):
    """``t = 2^m + 1`` columns (one ``2^m`` block and the last column elementwise) and ``d > 4`` (coordinates
    loaded per tile, not kept in registers): product, derivative and per-column sums against dense float64
    references, with ``n`` not a multiple of the tile."""
    from gpnys.kernels.backends.triton_fused import TritonBackend

    f32 = dtype == torch.float32
    assert TritonBackend._columns(t, 32, dtype)[1] == f32  # the elementwise column: float32 only
    assert TritonBackend._coords(torch.zeros(5, d, dtype=dtype))[1]["HOIST"] == (d <= 4 and f32)
    g = torch.Generator().manual_seed(7)
    n = 150
    X = (torch.rand(n, d, generator=g, dtype=torch.float64) * 3.0).to(dtype)
    U = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    V = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    kern = make_kernel(name, d).to(dtype)
    kern.outputscale = 1.3
    kern.base_kernel.lengthscale = torch.linspace(0.6, 1.4, d)
    check_every_pass(X, U, V, kern, name, dtype, "triton", "triton")  # (the per-column check includes the last)


@pytest.mark.parametrize("name,t", [("rbf", 3), ("matern32", 3), ("matern32", 17)])
def test_triton_block_sparse_plan_matches_torch_tiles_and_dense(name, t, dtype):
    """Points spread far beyond the cutoff radius: the plan skips leaf pairs, on both backends alike (``t = 17``:
    with the elementwise last column)."""
    g = torch.Generator().manual_seed(3)
    n = 400
    X = (torch.rand(n, 2, generator=g, dtype=torch.float64) * torch.tensor([300.0, 4.0])).to(dtype)
    V = torch.randn(n, t, generator=g, dtype=torch.float64).to(dtype)
    kern = make_kernel(name).to(dtype)
    kern.outputscale = 0.9
    kern.base_kernel.lengthscale = 1.0
    tri = op_for(X, kern, "triton", prune_tol=None)
    tor = op_for(X, kern, "torch", prune_tol=None)
    plan = tri.plan()
    assert plan is not None and plan.fraction < 0.75
    with torch.no_grad():
        ref = copy.deepcopy(kern).double()(X.double()).to_dense() @ V.double()  # float64: |x| ~ 300
        a, b = tri.matmul(V), tor.matmul(V)
    scale = float(ref.abs().max())
    assert float((a.double() - ref).abs().max()) <= TOL[dtype] * scale
    # the torch tiles' float32 distances are centred expanded forms: at |x| ~ 300 and 17 columns they are 5.4e-5 off
    loose = 3 if dtype == torch.float32 and t == 17 else 1
    assert float((a.double() - b.double()).abs().max()) <= loose * TOL[dtype] * scale
    _, ts2, tls = tri._bilinear_derivative(V, V)
    _, ps2, pls = tor._bilinear_derivative(V, V)
    assert float((ts2 - ps2).abs()) <= GTOL[dtype] * float(ps2.abs())
    assert float((tls - pls).abs()) <= GTOL[dtype] * float(pls.abs())
    _, cs2, cls = tri.column_derivatives(V, V)  # per column, block-sparse alike
    _, qs2, qls = tor.column_derivatives(V, V)
    assert float((cs2 - qs2).abs().max()) <= GTOL[dtype] * float(qs2.abs().max())
    assert float((cls - qls).abs().max()) <= GTOL[dtype] * float(qls.abs().max())


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "plan"])
@pytest.mark.parametrize("dtype,t", [(torch.float64, 3), (torch.float32, 17)], ids=["f64-t3", "f32-t17"])
def test_triton_row_ranges_add_up_to_the_full_pass(sparse, dtype, t):
    """``rows=`` (a rank's share of a partitioned operator) on the Triton kernels: the row blocks of the product
    stack to the whole product, and the sums over the ranges add up to the whole sums (float32 with 17 columns:
    with the elementwise last column)."""
    g = torch.Generator().manual_seed(5)
    X = (torch.rand(200, 2, generator=g, dtype=torch.float64) * torch.tensor([300.0 if sparse else 3.0, 4.0])).to(dtype)
    V = torch.randn(200, t, generator=g, dtype=torch.float64).to(dtype)
    kern = make_kernel("matern32", 2).to(dtype)
    op = op_for(X, kern, "triton", prune_tol=None)
    perm, Z, plan = op._working()
    assert (plan is not None) == sparse
    Vw = V if perm is None else V[perm]
    be = op.backend
    ranges = [(0, 64), (64, 192), (192, 200)]
    full = be.matmul(Z, Vw, plan)
    assert torch.allclose(torch.cat([be.matmul(Z, Vw, plan, r) for r in ranges]), full, rtol=1e-13, atol=1e-13)
    for fn in (be.derivative_sums, lambda *a: be.column_derivative_sums(*a[:4], False, *a[4:])):
        whole = fn(Z, Vw, Vw, plan)
        parts = [fn(Z, Vw, Vw, plan, r) for r in ranges]
        for i in range(2):
            assert torch.allclose(sum(p[i] for p in parts), whole[i], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="whole 64-point blocks"):
        be.matmul(Z, Vw, plan, (10, 64))


def test_triton_odd_shapes_and_repeatability():
    """n not a multiple of the tile, one right-hand side, more columns than one column block, duplicate points;
    the same inputs give bitwise the same outputs."""
    X, _, _, kern = setup("matern12", torch.float64, True, n=70)
    X[5] = X[6]  # coincident points: h's pole must not leak
    g = torch.Generator().manual_seed(1)
    for t in (1, 70):
        V = torch.randn(70, t, generator=g, dtype=torch.float64)
        op = op_for(X, kern, "triton")
        with torch.no_grad():
            ref = kern(X).to_dense() @ V
            out = op.matmul(V)
            again = op_for(X, kern, "triton").matmul(V)
        assert float((out - ref).abs().max()) <= 1e-12 * float(ref.abs().max())
        assert torch.equal(out, again)
        d1 = op._bilinear_derivative(V, V)
        d2 = op_for(X, kern, "triton")._bilinear_derivative(V, V)
        assert torch.isfinite(d1[2]).all() and torch.equal(d1[1], d2[1]) and torch.equal(d1[2], d2[2])


def test_triton_failure_warns_and_falls_back_to_torch(monkeypatch):
    from gpnys import launch
    from gpnys.kernels.backends import triton_fused

    X, U, V, kern = setup("rbf", torch.float64, False, n=40)
    monkeypatch.setattr(launch, "_FAILED", set())

    def broken(*args, **kwargs):
        raise RuntimeError("no FP64 dot here")

    monkeypatch.setattr(triton_fused.TritonBackend, "_matmul", broken)
    op = op_for(X, kern, "triton")
    with pytest.warns(RuntimeWarning, match="torch tiles"), torch.no_grad():
        out = op.matmul(V)
    with torch.no_grad():
        torch.testing.assert_close(out, kern(X).to_dense() @ V, rtol=1e-12, atol=1e-12)


def test_tf32_is_opt_in():
    X, _, V, kern = setup("rbf", torch.float32, False, n=40)
    assert op_for(X, kern, "triton").backend._constants(torch.float32)["PREC"] == "ieee"
    op = op_for(X, kern, "triton", tf32=True)
    assert op.backend._constants(torch.float32)["PREC"] == "tf32"
    assert op.backend._constants(torch.float64)["PREC"] == "ieee"
    with torch.no_grad():  # the interpreter computes in full precision; on a GPU TF32 is ~1e-3 relative
        ref = kern(X).to_dense() @ V
        assert float((op.matmul(V) - ref).abs().max()) <= 1e-2 * float(ref.abs().max())


def test_triton_skips_the_dense_cache_when_the_cutoff_plan_is_small(dtype):
    """With the fused backend a plan computing <= FUSED_SHARE of the entries wins over a stored K (the torch tiles keep
    the cache); both give the dense kernel's product."""
    X, _, V, kern = setup("matern32", dtype, False, n=2000, spread=150.0)
    ref = kern(X).to_dense() @ V
    got = {}
    for backend in ("triton", "torch"):
        op = StationaryKernelOperator(X, kern.outputscale, kern.base_kernel.lengthscale, base=kern.base_kernel,
                                      cache={}, backend=backend, dense_limit_bytes=1 << 30)
        assert op.plan() is not None and op.plan().fraction <= FUSED_SHARE
        got[backend] = (op._dense() is None, op.matmul(V))
    assert got["triton"][0] and not got["torch"][0]
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for _, KV in got.values():
        assert float((KV - ref).norm() / ref.norm()) < tol


def test_budget_is_device_aware(monkeypatch):
    from gpnys import budget

    assert budget.dense_limit_bytes("cpu") == budget.DEFAULT_DENSE_BYTES == budget.dense_limit_bytes()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (38 << 30, 80 << 30))
    # torch's allocator holds 3 GiB of which 1 GiB is in use: the 2 GiB it caches count as free
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 30)
    assert budget.dense_limit_bytes("cuda") == int((40 << 30) * budget.CUDA_DENSE_SHARE)
    assert budget.block_bytes("cuda") == min(budget.CUDA_MAX_BLOCK_BYTES, int((40 << 30) * budget.CUDA_BLOCK_SHARE))
    with memory_budget(dense_bytes=123, block_bytes=800):  # an explicit budget applies to every device
        assert budget.dense_limit_bytes("cuda") == 123 and budget.block_bytes("cuda") == 800


# -- the same on a GPU, compiled ------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("t", [5, 17])
def test_cuda_triton_matches_dense_autograd(name, t, dtype, cuda_device):
    """Compiled: the inline ``ex2.approx.ftz`` exponentials, and with 17 columns the elementwise last column."""
    X, U, V, kern = setup(name, dtype, True, n=700, device=cuda_device, t=t)
    check_every_pass(X, U, V, kern, name, dtype, None, "triton" if cuda_device.type == "cuda" else "torch")


# -- the compiled path, without a GPU ---------------------------------------------------------------------------
COMPILE_SCRIPT = r'''
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpnys.kernels.backends import triton_kernels as K
from gpnys.kernels.backends.triton_fused import BLOCK, TritonBackend
from gpnys.kernels.formulas import formula

CASES = [  # (kernel, nu, dtype, sparse, flag, d, tail)
    ("kv", None, torch.float32, False, False, 3, 1), ("kv", 0.5, torch.float32, False, False, 9, 0),
    ("kv", 1.5, torch.float32, True, False, 3, 0), ("kv", 2.5, torch.float32, False, False, 1, 1),
    ("kv", 0.5, torch.float64, True, False, 2, 1), ("kv", None, torch.float32, True, True, 3, 0),
    ("derivative", 1.5, torch.float32, True, False, 3, 1), ("derivative", 2.5, torch.float64, False, False, 9, 0),
    ("derivative", None, torch.float32, False, False, 2, 0), ("derivative", 0.5, torch.float64, True, False, 3, 1),
    ("column", 1.5, torch.float32, True, True, 3, 1), ("column", 0.5, torch.float32, False, False, 9, 1),
    ("column", None, torch.float64, True, False, 2, 0), ("column", 2.5, torch.float64, False, True, 3, 0),
]
# sm_90 (H100, H200) every case; sm_80 (A100) those whose code differs by architecture: FP64 and TF32 tl.dot
JOBS = [(90, case) for case in CASES] + [
    (80, case) for case in CASES if case[2] == torch.float64 or (case[4] and case[0] != "column")]
for arch, (kind, nu, dtype, sparse, flag, d, tail) in JOBS:  # flag: TF32 (kv, derivative), isotropic (column)
    fn = {"kv": K.kv_kernel, "derivative": K.derivative_kernel, "column": K.column_kernel}[kind]
    p = "*fp32" if dtype == torch.float32 else "*fp64"
    ptrs = ["ZT", "V", "OUT"] if kind == "kv" else ["ZT", "U", "V"]
    sig = {a: p for a in ptrs}
    if kind == "derivative":
        sig.update(S_OUT="*fp64", G_OUT="*fp64")
    if kind == "column":
        sig.update(OUT="*fp64")
    sig.update(n="i32", npad="i32", t="i32", ptr="*i64", idx="*i64", nblocks="i32", row0="i32")
    if kind == "column":
        sig.update(planes="i32")
    tf32 = flag and kind != "column"
    consts = dict(SPARSE=sparse, BLOCK=BLOCK, BT=16 if tail else 32, D=d, HOIST=d <= 4 and dtype == torch.float32,
                  TAIL=tail,
                  **TritonBackend(formula(nu), tf32)._constants(dtype))
    if kind == "derivative":
        consts["DP"] = 16
    if kind == "column":
        consts["ISO"] = flag
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", arch, 32))
print("compiled", len(JOBS))
'''


def test_triton_kernels_compile_to_cubin_for_a100_and_h100(tmp_path):
    """Triton's full compiler (TTIR -> PTX -> cubin with the ptxas it ships) on the kernels for sm_80 and sm_90:
    no GPU is needed to compile, so CI checks what the interpreter cannot (types, FP64 ``tl.dot``, constexpr
    branches). Runs in a child process: the test session imports the kernels in interpreter mode."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 20" in proc.stdout
