"""Fixtures shared by the BoTorch tests."""

import pytest
import torch


@pytest.fixture
def cholesky_shapes(monkeypatch):
    """Record the shape of every matrix passed to ``torch.linalg.cholesky`` / ``cholesky_ex``.

    linear_operator's ``psd_safe_cholesky`` calls ``torch.linalg.cholesky_ex`` (looked up on the module at call
    time, so the patch sees it), as do gpnys' ``safe_cholesky`` and BoTorch's samplers."""
    shapes = []
    for name in ("cholesky", "cholesky_ex"):
        original = getattr(torch.linalg, name)

        def wrapped(A, *args, _original=original, **kwargs):
            shapes.append(tuple(A.shape))
            return _original(A, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, wrapped)
    return shapes
