"""Triton's installation hash kept in gpnys's cache (:func:`gpnys.launch.reuse_triton_key`): computed once per
installation, handed to Triton by later processes without hashing, computed afresh when a file changes."""

from __future__ import annotations

import functools
import os
import types
from pathlib import Path

import pytest
import torch

import gpnys.launch as launch


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh process's state: nothing decided yet, an empty cache folder, a fake Triton installation."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GPNYS_TRITON_KEY_CACHE", raising=False)
    monkeypatch.setattr(launch, "_key_state", {"done": False})
    root = tmp_path / "triton"
    for rel in ("runtime/cache.py", "compiler/compiler.py", "backends/nvidia/driver.py", "language/core.py",
                "_C/libtriton.so", "compiler/__pycache__/compiler.cpython-311.pyc"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * 100)
    return root


def _triton(calls: list):
    """A stand-in for ``triton.runtime.cache``: its ``triton_key`` is lru-cached like Triton's and counts calls."""

    @functools.lru_cache()
    def triton_key():
        calls.append(1)
        return "3.6.0-" + "ab" * 900

    return types.SimpleNamespace(triton_key=triton_key)


def test_the_hash_is_computed_once_per_installation(fresh, monkeypatch):
    calls = []
    first = _triton(calls)
    assert launch.reuse_triton_key(first, fresh, "3.6.0") and calls == [1]
    assert first.triton_key() == "3.6.0-" + "ab" * 900 and calls == [1]
    # a later process: the same key from the cache, Triton's own hash never called
    monkeypatch.setattr(launch, "_key_state", {"done": False})
    later = _triton(calls)
    assert launch.reuse_triton_key(later, fresh, "3.6.0") and later.triton_key() == first.triton_key()
    assert calls == [1]
    assert launch.reuse_triton_key(later, fresh, "3.6.0") and calls == [1]  # once per process


def test_a_changed_installation_is_hashed_afresh(fresh, monkeypatch):
    calls = []
    launch.reuse_triton_key(_triton(calls), fresh, "3.6.0")
    before = launch.installation_fingerprint(fresh, "3.6.0")
    (fresh / "compiler" / "__pycache__" / "compiler.cpython-311.pyc").write_bytes(b"y" * 7)  # imports rewrite it
    assert launch.installation_fingerprint(fresh, "3.6.0") == before
    (fresh / "_C" / "libtriton.so").write_bytes(b"z" * 101)  # a reinstall
    assert launch.installation_fingerprint(fresh, "3.6.0") != before
    assert launch.installation_fingerprint(fresh, "3.7.0") != before
    monkeypatch.setattr(launch, "_key_state", {"done": False})
    launch.reuse_triton_key(_triton(calls), fresh, "3.6.0")
    assert calls == [1, 1]


def test_nothing_is_replaced_when_off_or_already_hashed(fresh, monkeypatch):
    calls = []
    monkeypatch.setenv("GPNYS_TRITON_KEY_CACHE", "0")
    module = _triton(calls)
    original = module.triton_key
    assert not launch.reuse_triton_key(module, fresh, "3.6.0") and module.triton_key is original
    monkeypatch.delenv("GPNYS_TRITON_KEY_CACHE")
    monkeypatch.setattr(launch, "_key_state", {"done": False})
    original()  # Triton hashed itself already in this process
    assert not launch.reuse_triton_key(module, fresh, "3.6.0") and module.triton_key is original
    assert not os.path.exists(fresh.parent / "cache" / launch.TRITON_KEY_FILE)


def test_the_installed_triton_gets_its_own_hash_back(fresh, monkeypatch):
    """With the real Triton (where installed): the cached hash equals the one Triton computes."""
    cache = pytest.importorskip("triton.runtime.cache")
    triton = pytest.importorskip("triton")
    real = getattr(cache, "triton_key", None)
    if getattr(real, "cache_info", None) is None:
        pytest.skip("this Triton has no lru-cached triton_key")
    monkeypatch.setattr(cache, "triton_key", functools.lru_cache()(real.__wrapped__))
    assert launch.reuse_triton_key(cache, Path(triton.__file__).parent, triton.__version__)
    assert cache.triton_key() == real.__wrapped__()


def test_linked_folders_are_fingerprinted(fresh, tmp_path):
    """An editable Triton links its backends into the package: files behind the link count, as in Triton's hash."""
    target = tmp_path / "third_party" / "amd"
    target.mkdir(parents=True)
    (target / "compiler.py").write_bytes(b"a" * 10)
    (fresh / "backends" / "amd").symlink_to(target, target_is_directory=True)
    (target / "loop").symlink_to(target, target_is_directory=True)  # a cycle is walked once
    before = launch.installation_fingerprint(fresh, "3.6.0")
    (target / "compiler.py").write_bytes(b"b" * 11)
    assert launch.installation_fingerprint(fresh, "3.6.0") != before


def test_a_failing_cache_warns_and_the_kernel_still_launches(fresh, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(launch, "reuse_triton_key", broken)
    with pytest.warns(RuntimeWarning, match="not reused"):
        out = launch.guarded_launch("kernel", torch.device("cpu"), torch.float32, False, lambda: 7, lambda: 0, "x")
    assert out == 7 and not launch.failed("kernel", torch.device("cpu"), torch.float32)
