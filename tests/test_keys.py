"""In-memory cache keys (:mod:`gpnys.keys`): a tensor's key changes with its memory or version, never by chance."""

import gc

import pytest
import torch

from gpnys.keys import TensorKey, same_objects


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tensor_key_follows_edits_views_and_copies(dtype):
    y = torch.arange(6, dtype=dtype)
    key = TensorKey(y)
    assert key == TensorKey(y) and key == TensorKey(y.reshape(2, 3).reshape(-1)) and key == TensorKey(y.detach())
    assert key != TensorKey(y.clone()) and key != TensorKey(y.to(torch.float16)) and key != TensorKey(y[1:])
    y[0] = 7.0  # an in-place edit
    assert key != TensorKey(y)
    with pytest.raises(TypeError):
        hash(key)


def test_tensor_key_holds_its_memory():
    """A key of ``data_ptr`` and ``_version`` alone matched a new tensor allocated where a freed one was (version
    0 both): the key holds its tensor, so no new tensor of the same size lands at its address."""
    y = torch.randn(300, dtype=torch.float64)
    key, address = TensorKey(y), y.data_ptr()
    del y
    gc.collect()
    fresh = [torch.randn(300, dtype=torch.float64) for _ in range(50)]
    assert all(t.data_ptr() != address for t in fresh)
    assert all(key != TensorKey(t) for t in fresh)


def test_same_objects_is_identity():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert same_objects((a, b), [a, b]) and not same_objects((a, b), (a, torch.nn.Linear(2, 2)))
    assert not same_objects(None, (a,)) and not same_objects((a,), (a, b))
