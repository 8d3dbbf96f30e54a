"""KeOps reductions of StationaryKernelOperator (gpnys.kernels.backends.keops), forced on the CPU.

The operator never picks KeOps by itself (pykeops segfaults on CUDA 13); ``backend="keops"`` runs the same formulas
through KeOps's CPU backend, which is what these tests compare with the torch tiles and GPyTorch's dense kernel. Skipped
when pykeops is not installed (it is an optional dependency: ``pip install pykeops``; it compiles each formula
with the system C++ compiler on first use).
"""

import gpytorch
import pytest
import torch

from gpnys import memory_budget
from gpnys.kernels import make_kernel
from gpnys.kernels.operator import StationaryKernelOperator

pytest.importorskip("pykeops")

CASES = [("rbf", torch.float64), ("matern12", torch.float64), ("matern32", torch.float32), ("matern52", torch.float64)]


def build(X, name, keops, ard=False):
    kern = make_kernel(name, X.shape[1] if ard else None).to(X.dtype)
    kern.outputscale = 1.3
    kern.base_kernel.lengthscale = [0.6, 0.9, 1.2] if ard else 0.8
    op = StationaryKernelOperator(X, kern.outputscale, kern.base_kernel.lengthscale, base=kern.base_kernel,
                                  cache={}, backend="keops" if keops else None)
    return op, kern


@pytest.mark.parametrize("name,dtype", CASES)
def test_keops_product_and_derivative_match_the_torch_tiles(name, dtype):
    g = torch.Generator().manual_seed(0)
    X = (torch.rand(300, 3, generator=g, dtype=torch.float64) * 4).to(dtype)
    V = torch.randn(300, 4, generator=g, dtype=torch.float64).to(dtype)
    with memory_budget(dense_bytes=0):
        ko, kern = build(X, name, True, ard=True)
        to, _ = build(X, name, False, ard=True)
        with torch.no_grad():
            ref = kern(X).to_dense() @ V
        tol = 1e-4 if dtype == torch.float32 else 1e-11
        scale = float(ref.abs().max())
        assert float((ko.matmul(V) - ref).abs().max()) <= tol * scale
        _, ks2, kls = ko._bilinear_derivative(V, V)
        _, ts2, tls = to._bilinear_derivative(V, V)
    gtol = 1e-4 if dtype == torch.float32 else 1e-10
    assert float((ks2 - ts2).abs()) <= gtol * float(ts2.abs())
    assert float((kls - tls).abs().max()) <= gtol * float(tls.abs().max())


def test_keops_is_off_on_cpu_by_default_and_validated(monkeypatch):
    X = torch.rand(20, 3, dtype=torch.float64)
    op, _ = build(X, "rbf", None)
    assert op.keops is False  # never chosen unless forced
    from gpnys.kernels.backends import keops

    monkeypatch.setattr(keops, "available", lambda: False)
    base = gpytorch.kernels.RBFKernel().double()
    with pytest.raises(ValueError, match="pykeops"):
        StationaryKernelOperator(X, torch.tensor(1.0, dtype=torch.float64), base.lengthscale, base=base, cache={},
                                 backend="keops")
