import pytest
import torch

DTYPES = [torch.float32, torch.float64]


@pytest.fixture(params=DTYPES, ids=["float32", "float64"])
def dtype(request):
    return request.param
