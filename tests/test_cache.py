"""The on-disk cache (:mod:`gpnys.cache`): entries written by processes at once are all kept."""

from __future__ import annotations

import json
import subprocess
import sys

from gpnys.cache import cache_dir, read_entry, read_or_make, write_entry

MAKER = """
import sys, time
from gpnys.cache import read_or_make
def make():
    print("made", flush=True)
    time.sleep(1.0)  # a calibration: a second process arriving meanwhile waits and reads this one's entry
    return sys.argv[1]
print(read_or_make("made.json", "k", lambda v: v if isinstance(v, str) else int(None), make, "a test entry"))
"""

WRITER = """
import sys
from gpnys.cache import write_entry
for i in range(150):
    write_entry("race.json", f"{sys.argv[1]}-{i}", i, "a test entry")
"""


def test_processes_writing_at_once_keep_every_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, name]) for name in ("a", "b", "c")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    stored = json.loads((cache_dir() / "race.json").read_text())
    assert stored == {f"{name}-{i}": i for name in "abc" for i in range(150)}


def test_one_process_makes_an_entry_and_the_others_read_it(monkeypatch, tmp_path):
    """Two processes missing the same entry at once: one makes it, the other waits and reads it (two calibrations
    at once had timed each other, and the inflated costs stayed in the cache). A damaged entry is made again."""
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", MAKER, name], stdout=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert sum(out.count("made") for out in outs) == 1 and outs[0][-1] == outs[1][-1] == read_entry("made.json", "k")
    write_entry("made.json", "k", 7, "a test entry")  # damaged: not a string
    assert read_or_make("made.json", "k", lambda v: v if isinstance(v, str) else int(None), lambda: "c", "x") == "c"
    assert read_entry("made.json", "k") == "c"


def test_merge_combines_the_stored_entry_with_the_new_one(monkeypatch, tmp_path):
    monkeypatch.setenv("GPNYS_CACHE_DIR", str(tmp_path))
    write_entry("m.json", "k", {"a": 1}, "a test entry")
    write_entry("m.json", "k", {"b": 2}, "a test entry", merge=lambda old, new: {**old, **new})
    write_entry("m.json", "other", 3, "a test entry", merge=lambda old, new: 1 / 0)  # nothing stored: no merge
    assert read_entry("m.json", "k") == {"a": 1, "b": 2} and read_entry("m.json", "other") == 3


def test_entry_key_names_the_machine_and_the_torch_build(monkeypatch):
    """A cache folder shared between machines or kept across a torch upgrade keeps each one's measurements apart:
    the key holds the CPU's model (or the GPU's name), the dtype, the thread count and torch's version."""
    import torch

    from gpnys import cache

    cpu = torch.device("cpu")
    key = cache.entry_key(cpu, torch.float64)
    assert cache.device_name(cpu) in key and f"torch={torch.__version__}" in key and "torch.float64" in key
    monkeypatch.setattr(cache, "_cpu_name", lambda: "another CPU")
    assert cache.entry_key(cpu, torch.float64) != key
