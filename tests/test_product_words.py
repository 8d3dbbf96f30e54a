"""The product speaks only of itself: no development-process words in the tracked files.

Code, docs, results, tests and file names cite papers, versions, dates or commits; "session N", "issue N", "target N"
and the name of the private algorithm notes point at nothing a user can open. Only ``CHANGELOG.md`` (the history) is
exempt.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXEMPT = {"CHANGELOG.md"}
NOTES = "dig" + "est"  # spelled in two parts, so that this file passes its own check
WORDS = re.compile(r"\bsessions?[ \t_-]*#?\d|\bissues?[ \t_-]*#?\d|\btargets?[ \t_-]*#?\d|" + NOTES, re.I)
NAMES = re.compile(r"session|issue[_-]?\d|_s\d+(?:[._/]|$)", re.I)
SKIP_DIRS = {".git", ".venv", "site", "build", "dist", ".pytest_cache", ".hypothesis", "__pycache__", ".devrun"}


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        return [p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file outside build folders
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not SKIP_DIRS & set(p.relative_to(ROOT).parts)]


def test_no_process_words_in_file_contents():
    hits = []
    for rel in tracked_files():
        if rel in EXEMPT:
            continue
        path = ROOT / rel
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # images and other binaries
        for number, line in enumerate(text.splitlines(), 1):
            if WORDS.search(line):
                hits.append(f"{rel}:{number}: {line.strip()[:100]}")
    assert not hits, f"{len(hits)} lines with process words:\n" + "\n".join(hits[:40])


def test_no_process_words_in_file_names():
    bad = [rel for rel in tracked_files() if NAMES.search(rel) and rel not in EXEMPT]
    assert not bad, f"file names with process words: {bad[:40]}"
