"""Kernel cutoff (gpnys.kernels.cutoff) and the pruned on-the-fly path of StationaryKernelOperator.

References: dense distance matrices (which pairs are within the radius), GPyTorch's dense kernel and the
operator's own unpruned path (``prune_tol=0``). Points are spread so that most pairs are beyond the cutoff.
"""

import math

import gpytorch
import pytest
import torch

from gpnys import memory_budget
from gpnys.kernels import KERNEL_NAMES, make_kernel
from gpnys.kernels.cutoff import cutoff_radius, leaf_plan, spatial_order
from gpnys.kernels.formulas import unit_kernel
from gpnys.kernels.operator import StationaryKernelOperator

NAMES = list(KERNEL_NAMES)


def spread(n, d=2, dtype=torch.float64, seed=0, density=1.0):
    """Uniform points with the given density in a square/cube of edge (n / density)^(1/d)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, d, generator=g, dtype=torch.float64) * (n / density) ** (1.0 / d)).to(dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tol", [1e-3, 1e-8, 2.2e-16])
def test_cutoff_radius_is_where_the_kernel_falls_below_tol(name, tol):
    nu = KERNEL_NAMES[name]
    r = cutoff_radius(nu, tol)
    assert unit_kernel(r, nu) <= tol < unit_kernel(r * (1 - 1e-9), nu)
    # against GPyTorch's kernel (unit length-scale) at r and slightly inside
    kern = make_kernel(name).base_kernel.double()
    kern.lengthscale = 1.0
    x = torch.tensor([[0.0], [r], [r * 0.99]], dtype=torch.float64)
    k = kern(x[:1], x[1:]).to_dense().reshape(-1)
    assert float(k[0]) <= tol * (1 + 1e-6) and float(k[1]) > tol


def test_cutoff_radius_edges():
    assert cutoff_radius(1.5, 0.0) == math.inf
    assert cutoff_radius(None, 1.0) == 0.0


@pytest.mark.parametrize("n,leaf", [(1, 4), (100, 7), (1000, 64), (1000, 1000), (999, 64)])
def test_spatial_order_is_a_permutation_with_compact_leaves(n, leaf):
    X = spread(n)
    perm = spatial_order(X, leaf)
    assert torch.equal(torch.sort(perm).values, torch.arange(n))
    if n >= 10 * leaf:  # leaves are much smaller than the same number of random points' boxes
        P = X[perm][: (n // leaf) * leaf].reshape(-1, leaf, 2)
        R = X[torch.randperm(n, generator=torch.Generator().manual_seed(1))][: (n // leaf) * leaf].reshape(-1, leaf, 2)
        area = lambda B: (B.amax(1) - B.amin(1)).prod(1).mean()  # noqa: E731
        assert float(area(P)) < 0.1 * float(area(R))


@pytest.mark.parametrize("d", [1, 2, 3])
def test_leaf_plan_covers_every_pair_within_the_radius(d):
    n, leaf, radius = 700, 16, 3.0
    X = spread(n, d, seed=d)
    perm = spatial_order(X, leaf)
    plan = leaf_plan(X, perm, leaf, radius)
    P = X[perm]
    close = torch.cdist(P, P) <= radius
    covered = torch.zeros(n, n, dtype=torch.bool)
    for i in range(plan.num_leaves):
        covered[plan.rows(i).start : plan.rows(i).stop, plan.cols(i)] = True
    assert not (close & ~covered).any()
    assert plan.fraction == pytest.approx(covered.sum().item() / n**2)
    assert plan.fraction < 0.9  # it does skip something here
    # the plan is symmetric: leaf j is listed for i iff i is listed for j
    assert torch.equal(covered, covered.T)


# -- the vectorised spatial_order / leaf_plan against the original one-node-at-a-time versions ------------------


def _spatial_order_ref(X, leaf):
    """The original work-list k-d tree (one argsort and one host sync per node)."""
    n = X.shape[0]
    perm = torch.arange(n, device=X.device)
    todo = [(0, n)]
    while todo:
        a, b = todo.pop()
        if b - a <= leaf:
            continue
        seg = perm[a:b]
        P = X[seg]
        axis = int((P.amax(0) - P.amin(0)).argmax())
        perm[a:b] = seg[torch.argsort(P[:, axis], stable=True)]
        mid = a + max(1, math.ceil((b - a) / (2 * leaf))) * leaf
        todo += [(a, mid), (mid, b)]
    return perm


def _leaf_plan_ref(Z, perm, leaf, radius):
    """The original leaf plan (one ``nonzero`` per leaf, integer matmul for the covered pairs; CPU only).
    Returns ``(near_ptr, near_idx, fraction)``."""
    n, d = Z.shape
    L = -(-n // leaf)
    P = Z[perm]
    pad = L * leaf - n
    if pad:
        P = torch.cat([P, P[-1:].expand(pad, d)])
    P = P.reshape(L, leaf, d)
    lo, hi = P.amin(1), P.amax(1)
    ptr, idx, pairs = [0], [], 0
    sizes = torch.full((L,), leaf, dtype=torch.long)
    sizes[-1] = n - (L - 1) * leaf
    chunk = max(1, (1 << 22) // max(1, L * d))
    r2 = radius * radius
    for a in range(0, L, chunk):
        gap = (lo[None, :, :] - hi[a : a + chunk, None, :]).clamp(min=0) + (lo[a : a + chunk, None, :] - hi[None, :, :]).clamp(min=0)
        near = gap.square().sum(-1) <= r2
        counts = near.sum(1)
        pairs += int((near.to(sizes.dtype) @ sizes * sizes[a : a + chunk]).sum())
        for row, c in zip(near, counts.tolist()):
            idx.append(row.nonzero().squeeze(1))
            ptr.append(ptr[-1] + c)
    return ptr, torch.cat(idx), pairs / float(n * n)


def points(kind, n, d, dtype, seed=0):
    """Test point sets: uniform, integer grid (many tied coordinates and exact box gaps), duplicated points,
    all points equal."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        X = torch.rand(n, d, generator=g, dtype=torch.float64) * n ** (1.0 / d)
    elif kind == "grid":
        X = torch.randint(0, 6, (n, d), generator=g).double()
    elif kind == "duplicates":
        X = (torch.rand(-(-n // 5), d, generator=g, dtype=torch.float64) * 10).repeat_interleave(5, 0)[:n]
        X = X[torch.randperm(n, generator=g)]
    else:  # "same"
        X = torch.full((n, d), 1.5, dtype=torch.float64)
    return X.to(dtype)


KINDS = ["uniform", "grid", "duplicates", "same"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [1, 3, 9])
@pytest.mark.parametrize("n,leaf", [(1, 4), (5, 8), (100, 7), (1000, 16), (2049, 64), (3001, 37)])
def test_spatial_order_equals_the_one_node_at_a_time_tree(kind, d, n, leaf, dtype):
    X = points(kind, n, d, dtype, seed=n + d)
    assert torch.equal(spatial_order(X, leaf), _spatial_order_ref(X, leaf))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [1, 3, 9])
@pytest.mark.parametrize("n,leaf,radius", [(1, 4, 1.0), (100, 7, 1.5), (1000, 16, 2.0), (3001, 37, 3.0),
                                           (2500, 8, 0.0)])
def test_leaf_plan_equals_the_one_leaf_at_a_time_plan(kind, d, n, leaf, radius, dtype):
    """Same CSR lists and covered share, bit for bit (grid points hit ``gap == radius`` exactly)."""
    X = points(kind, n, d, dtype, seed=n + d)
    perm = spatial_order(X, leaf)
    plan = leaf_plan(X, perm, leaf, radius)
    ptr, idx, fraction = _leaf_plan_ref(X, perm, leaf, radius)
    assert plan.near_ptr == ptr and all(type(p) is int for p in plan.near_ptr)
    assert plan.near_idx.dtype == torch.long and torch.equal(plan.near_idx, idx)
    assert plan.fraction == fraction
    assert plan.near_ptr_t.dtype == torch.long and plan.near_ptr_t.shape == (plan.num_leaves + 1,)
    assert torch.equal(plan.near_ptr_t, torch.tensor(plan.near_ptr))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["uniform", "grid", "duplicates"])
@pytest.mark.parametrize("d", [1, 3, 9])
def test_spatial_order_and_leaf_plan_on_cuda_equal_cpu(kind, d, dtype):
    n, leaf, radius = 20_011, 64, 3.0
    X = points(kind, n, d, dtype, seed=d)
    perm = spatial_order(X, leaf)
    plan = leaf_plan(X, perm, leaf, radius)
    dev = torch.device("cuda")
    perm_g = spatial_order(X.to(dev), leaf)
    assert perm_g.device.type == "cuda" and torch.equal(perm_g.cpu(), perm)
    plan_g = leaf_plan(X.to(dev), perm_g, leaf, radius)
    assert plan_g.near_idx.device.type == "cuda" and plan_g.near_ptr_t.device.type == "cuda"
    assert plan_g.near_ptr == plan.near_ptr
    assert torch.equal(plan_g.near_idx.cpu(), plan.near_idx)
    assert torch.equal(plan_g.near_ptr_t.cpu(), plan.near_ptr_t)
    assert plan_g.fraction == plan.fraction


def operator(X, name, ls, prune_tol=None, ard=False):
    kern = make_kernel(name, X.shape[1] if ard else None).to(X.dtype)
    kern.outputscale = 1.7
    kern.base_kernel.lengthscale = ls
    s2, base = kern.outputscale, kern.base_kernel
    return StationaryKernelOperator(X, s2, base.lengthscale, base=base, cache={}, prune_tol=prune_tol), kern


def exact_kernel(X, name, ls, s2):
    """``s2 k(X, X)`` in float64 from explicit coordinate differences (no expanded-form cancellation), with
    autograd to ``ls`` (``(d,)`` or scalar) and ``s2``."""
    nu = KERNEL_NAMES[name]
    D2 = (((X[:, None, :] - X[None, :, :]) / ls) ** 2).sum(-1)
    if nu is None:
        return s2 * torch.exp(-0.5 * D2)
    pos = D2 > 0
    r = torch.sqrt(torch.where(pos, D2, torch.ones_like(D2)))
    a = math.sqrt(2 * nu) * r
    poly = {0.5: torch.ones_like(a), 1.5: 1 + a, 2.5: 1 + a + a * a / 3}[nu]
    return s2 * torch.where(pos, poly * torch.exp(-a), torch.ones_like(a))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ard", [False, True])
def test_pruned_operator_equals_dense_kernel(name, ard, dtype):
    """Matmul and hyperparameter derivative with the cutoff (machine-epsilon default) against an exact float64
    dense kernel, while the plan skips most entries.

    The points span |z| ~ 100 length-scales, where distances in expanded (matmul) form lose ~eps |z|^2: GPyTorch's
    and the unpruned float32 products are 4e-4 to 8e-3 off here (measured), the pruned one, which centres every tile
    on its leaf, 2e-5 (Matérn-1/2, with its kink at r = 0: 2e-4); in float64 the unpruned length-scale derivative is
    ~1e-9 off, the pruned one ~1e-12."""
    X64 = spread(1500, 2, density=0.05)  # edge 173: most pairs beyond even Matérn-1/2's cutoff (36 l)
    V64 = torch.randn(1500, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    X, V = X64.to(dtype), V64.to(dtype)
    ls = [0.7, 1.1] if ard else 0.9
    with memory_budget(dense_bytes=0, block_bytes=1 << 16):
        op, kern = operator(X, name, ls, ard=ard)
        plan = op.plan()
        assert plan is not None and plan.fraction < 0.5
        got = op.matmul(V).double()
        _, ds2, dls = op._bilinear_derivative(V, V)
    # the operator's own hyperparameter values (GPyTorch's setters round 1.7 and 0.9 through float32)
    ls_t = kern.base_kernel.lengthscale.detach().double().reshape(-1).clone().requires_grad_(True)
    s2_t = kern.outputscale.detach().double().clone().requires_grad_(True)
    K = exact_kernel(X64, name, ls_t, s2_t)
    ref = K.detach() @ V64
    (V64 * (K @ V64)).sum().backward()
    tol = 1e-3 if dtype == torch.float32 else 1e-11
    assert float((got - ref).abs().max()) <= tol * float(ref.abs().max())
    gtol = 1e-3 if dtype == torch.float32 else 1e-10
    assert float((ds2.double() - s2_t.grad).abs()) <= gtol * float(s2_t.grad.abs())
    assert float((dls.double().reshape(-1) - ls_t.grad.reshape(-1)).abs().max()) <= gtol * float(ls_t.grad.abs().max())


def test_pruned_operator_error_is_bounded_by_the_tolerance():
    """A loose prune_tol: every skipped entry is <= tol * outputscale, so the product error is at most
    tol * s2 * n * max|v| per row (a bound that can fail, checked against the dense kernel)."""
    X = spread(1200, 3, density=0.02)  # edge 39, cutoff radius 7.3
    V = torch.randn(1200, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tol = 1e-4
    with memory_budget(dense_bytes=0):
        op, kern = operator(X, "matern32", 1.0, prune_tol=tol)
        assert op.plan() is not None
        with torch.no_grad():
            K = kern(X).to_dense()
            ref = K @ V
            err = (op.matmul(V) - ref).abs().max()
            skipped = (K.abs() <= tol * 1.7).sum(1).max()
        assert float(err) <= tol * 1.7 * float(skipped) * float(V.abs().max())
        assert float(err) > 0  # something was skipped


def test_pruned_path_is_reproducible_and_follows_the_block_budget():
    X = spread(2000, 2, density=0.2)
    V = torch.randn(2000, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    outs = []
    for block in (1 << 12, 1 << 20, 1 << 12):
        with memory_budget(dense_bytes=0, block_bytes=block):
            op, _ = operator(X, "rbf", 0.8)
            outs.append((op.matmul(V), op._bilinear_derivative(V, V)[2]))
    assert torch.equal(outs[0][0], outs[2][0]) and torch.equal(outs[0][1], outs[2][1])
    assert torch.allclose(outs[0][0], outs[1][0], rtol=0, atol=1e-12)


def test_prune_tol_is_validated():
    X = spread(10)
    base = gpytorch.kernels.RBFKernel().double()
    with pytest.raises(ValueError, match="prune_tol"):
        StationaryKernelOperator(X, torch.tensor(1.0, dtype=torch.float64), base.lengthscale, base=base, cache={},
                                 prune_tol=-1.0)
    with pytest.raises(ValueError, match="prune_tol"):
        StationaryKernelOperator(X, torch.tensor(1.0, dtype=torch.float64), base.lengthscale, base=base, cache={},
                                 prune_tol=float("nan"))


def test_plan_is_skipped_when_it_saves_little():
    """Points within one cutoff radius of each other: nothing to skip, so no plan (the full row-block path)."""
    X = spread(500, 2) / 10
    with memory_budget(dense_bytes=0):
        op, _ = operator(X, "matern32", 1.0)
        assert op.plan() is None


def test_kernel_system_recomputes_through_the_cut_operator(dtype):
    """gpnys pcg / prediction solves: KernelSystem off the dense cache uses the operator (and its cutoff plan) and
    equals the dense system; a kernel the operator does not support (RQ) falls back to GPyTorch's blocks."""
    from gpnys.kernels.system import kernel_system

    X64 = spread(1200, 2, density=0.05)
    X = X64.to(dtype)
    V = torch.randn(1200, 2, generator=torch.Generator().manual_seed(5), dtype=dtype)
    kern = make_kernel("matern32").to(dtype)
    kern.base_kernel.lengthscale = 0.9
    dense = kernel_system(X64, kern.double(), 0.1)
    kern = kern.to(dtype)
    with memory_budget(dense_bytes=0):
        fly = kernel_system(X, kern, 0.1)
        assert not fly.dense and fly._op is not None and fly._op.plan() is not None
        out = fly(V)
    ref = dense(V.double())
    tol = 1e-4 if dtype == torch.float32 else 1e-11
    assert float((out.double() - ref).abs().max()) <= tol * float(ref.abs().max())
    rq = gpytorch.kernels.RQKernel().to(dtype)
    with memory_budget(dense_bytes=0):
        other = kernel_system(X[:100], rq, 0.1)
    assert other._op is None
    with torch.no_grad():
        ref_rq = rq(X[:100]).to_dense() @ V[:100] + 0.1 * V[:100]
    assert float((other(V[:100]) - ref_rq).abs().max()) <= 1e-5 * float(ref_rq.abs().max())
