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
