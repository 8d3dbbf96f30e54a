import os

import torch

# The Triton kernels run on CPU tensors only under Triton's interpreter, and triton.jit reads TRITON_INTERPRET when a
# kernel module is imported: set it before any test imports gpnys's Triton backend, unless a GPU runs them compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The iterative machinery is checked against Cholesky at small n, where the cost model's "auto" path would take
# Cholesky itself: the suite forces the preconditioned path (tests/gp/test_path.py checks "auto"'s choice). Cost
# calibrations go to a folder of this run, not the user's cache.
os.environ.setdefault("GPNYS_SOLVER", "iterative")
os.environ.setdefault("GPNYS_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gpnys-tests-{os.getpid()}"))
# Under pytest-xdist (``make test`` runs two workers) the workers share the machine's cores: one thread each, their
# child processes included, so that no BLAS or OpenMP pool spins against the other worker's; and a cache folder each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ["GPNYS_CACHE_DIR"] += "-" + os.environ["PYTEST_XDIST_WORKER"]

import pytest  # noqa: E402

DTYPES = [torch.float32, torch.float64]

#: the device of the ``cuda``-marked suite; ``GPNYS_CUDA_SUITE_DEVICE=cpu`` runs that suite's logic on the CPU
CUDA_SUITE_DEVICE = os.environ.get("GPNYS_CUDA_SUITE_DEVICE", "cuda")


def pytest_collection_modifyitems(config, items):
    """Skip ``cuda``-marked tests where their device is missing (CI never has a GPU)."""
    if CUDA_SUITE_DEVICE != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (pytest -m cuda on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_device():
    """The ``cuda`` suite's device (:data:`CUDA_SUITE_DEVICE`)."""
    return torch.device(CUDA_SUITE_DEVICE)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Small dense problems: one BLAS thread avoids OpenMP oversubscription on shared 2-core runners.

    Restores the previous setting at the end of the session.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=DTYPES, ids=["float32", "float64"])
def dtype(request):
    return request.param


# -- GPyTorch's global settings vs BoTorch ------------------------------------------------------------------
# Importing BoTorch rewrites linear_operator's global defaults (fast computations off, max_cholesky_size 4096, ...;
# botorch/__init__.py). Tests that compare against "GPyTorch's default" must not see that just because a BoTorch
# test module was imported earlier in the session, so every test runs under GPyTorch's own defaults (captured
# here, before any test module is imported) unless its module sets ``USES_BOTORCH = True``; those run under the
# values BoTorch 0.18 sets.
import gpytorch.settings as _gs  # noqa: E402
import linear_operator.settings as _ls  # noqa: E402

_SETTINGS = {
    "fast_covar_root_decomposition": (_ls._fast_covar_root_decomposition, "_default", False),
    "fast_log_prob": (_ls._fast_log_prob, "_default", False),
    "fast_solves": (_ls._fast_solves, "_default", False),
    "cholesky_max_tries": (_ls.cholesky_max_tries, "_global_value", 6),
    "max_cholesky_size": (_ls.max_cholesky_size, "_global_value", 4096),
    "max_eager_kernel_size": (_gs.max_eager_kernel_size, "_global_value", 4096),
}
_PRISTINE = {name: getattr(obj, attr) for name, (obj, attr, _) in _SETTINGS.items()}


@pytest.fixture(autouse=True)
def _gpytorch_global_settings(request):
    botorch = getattr(request.module, "USES_BOTORCH", False)
    if botorch:
        import botorch  # noqa: F401  (its import-time changes, if this is the first import)
    for name, (obj, attr, bo_value) in _SETTINGS.items():
        setattr(obj, attr, bo_value if botorch else _PRISTINE[name])
    yield
    for name, (obj, attr, _) in _SETTINGS.items():
        setattr(obj, attr, _PRISTINE[name])
