"""Shared test helpers: seeded point sets, kernels and dense reference matrices.

Imported as ``from helpers import ...``: ``tests/`` has no ``__init__.py``, so pytest's default (prepend) import
mode puts this directory on ``sys.path`` when it collects the test modules.
"""

import contextlib
import copy

import gpytorch
import torch

KERNELS = {
    "rbf": gpytorch.kernels.RBFKernel,
    "matern32": lambda: gpytorch.kernels.MaternKernel(nu=1.5),
    "matern": lambda: gpytorch.kernels.MaternKernel(nu=1.5),  # alias of "matern32" (test ids in test_nystrom)
}


def points(n, d=3, dtype=torch.float64, seed=0, scale=1.0):
    """n uniform points in [0, scale]^d drawn from a CPU generator seeded with ``seed``."""
    return torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def make_kernel(name, lengthscale, dtype=None):
    """A unit-variance "rbf" or "matern32" (Matern nu = 1.5) kernel with the given length-scale.

    With ``dtype`` the kernel is converted first, so the length-scale is set in that precision; without it the
    parameters keep GPyTorch's default dtype.
    """
    kern = KERNELS[name]()
    if dtype is not None:
        kern = kern.to(dtype)
    kern.lengthscale = lengthscale
    return kern


@contextlib.contextmanager
def cv_rows_checkpointed(batched=True):
    """AFN's control-variate rows forced into checkpointed blocks (no dense budget, 64 KiB blocks), or kept in one
    piece (a budget no test reaches); yields the list that counts the ``torch.utils.checkpoint`` calls."""
    from unittest import mock

    from torch.utils import checkpoint as ckpt

    import gpnys
    import gpnys.precond.afn as afn

    calls, real = [], ckpt.checkpoint
    with mock.patch.object(afn, "dense_limit_bytes", lambda device=None: 0 if batched else 1 << 40), \
            mock.patch.object(ckpt, "checkpoint", lambda *a, **kw: calls.append(1) or real(*a, **kw)), \
            gpnys.memory_budget(block_bytes=1 << 16):
        yield calls


def dense_A(X, kern, mu):
    """Dense K(X, X) + mu I in the dtype of X."""
    with torch.no_grad():
        K = kern(X).to_dense().to(X.dtype)
    return K + mu * torch.eye(X.shape[0], dtype=X.dtype)


def dense_P(P):
    """The preconditioner as a dense matrix: P applied to the identity."""
    return P.matmul(torch.eye(P.n, dtype=P.dtype, device=P.device))


def load_script(folder: str, name: str):
    """Import ``<repo>/<folder>/<name>.py`` (benchmarks and examples are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cholesky_loss(model, X, y):
    """GPyTorch's exact ``-MLL / n`` (Cholesky, no gradient) of ``model``'s hyperparameters on the data ``(X, y)``,
    on a copy of the model (it may hold other training data)."""
    ref = copy.deepcopy(model)
    ref.set_train_data(X, y, strict=False)
    ref.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(ref.likelihood, ref)
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6):
        return float(-mll(ref(X), y))
