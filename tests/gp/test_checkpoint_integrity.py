"""Fit checkpoints fail loudly: a truncated, empty, garbage or bit-flipped file, or one written for another data set,
size, dtype or model, raises a ``ValueError`` naming the file (and the difference); a resumed fit takes the call's
learning rate."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpnys.gp import ExactGPModel, fit


def _model(n=40, seed=0, dtype=torch.float64, d=2, kernel="matern32"):
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, d, generator=g, dtype=torch.float64).to(dtype)
    y = torch.sin(5 * X[:, 0].double()).to(dtype)
    return ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood(), kernel=kernel).to(dtype)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "fit.pt"
    fit(_model(), iters=2, progress=False, checkpoint=path)
    return path


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "flipped bit"])
def test_damaged_file_is_a_value_error_naming_it(checkpoint, damage):
    raw = bytearray(checkpoint.read_bytes())
    if damage == "empty":
        raw = bytearray()
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage":
        raw = bytearray(b"\x00\x01garbage" * 50)
    else:
        raw[len(raw) // 2] ^= 0x10
    checkpoint.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=str(checkpoint.name)) as info:
        fit(_model(), iters=3, progress=False, checkpoint=checkpoint)
    assert "checkpoint" in str(info.value)


@pytest.mark.parametrize("other, field", [
    (dict(seed=1), "inputs"),            # another data set of the same size
    (dict(n=41), "n"),                   # another n
    (dict(dtype=torch.float32), "dtype"),
    (dict(kernel="rbf"), "modules"),     # another kernel
])
def test_checkpoint_of_another_model_is_refused(checkpoint, other, field):
    with pytest.raises(ValueError, match=f"{checkpoint.name}.*{field}"):
        fit(_model(**other), iters=3, progress=False, checkpoint=checkpoint)


def test_resume_takes_the_calls_learning_rate(checkpoint):
    """From the same two-step checkpoint, one more Adam step at lr 1e-3 and at 1e-1: Adam's step is about lr per
    parameter, so the second moves the parameters about 100 times further (a kept lr would move them alike)."""
    ref = _model()
    fit(ref, iters=2, progress=False)  # where the checkpoint stands (the exact path is deterministic)
    start = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    moved = {}
    for lr in (1e-3, 1e-1):
        path = checkpoint.parent / f"copy_{lr}.pt"
        path.write_bytes(checkpoint.read_bytes())
        model = _model()
        result = fit(model, iters=3, lr=lr, progress=False, checkpoint=path)
        assert len(result.loss_trace) == 3
        moved[lr] = float((torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - start).norm())
    assert moved[1e-1] > 30 * moved[1e-3] > 0, moved
