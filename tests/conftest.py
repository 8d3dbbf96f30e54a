import pytest
import torch

DTYPES = [torch.float32, torch.float64]


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
