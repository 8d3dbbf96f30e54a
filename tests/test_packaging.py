"""The package as a user installs it: the built wheel, its metadata and its dependency ranges.

A wheel built with ``python -m build`` is installed into a fresh virtual environment that already has torch and the
other dependencies (made visible through a ``.pth`` file, as a user's environment would have them), without a
package index: pip must find every requirement satisfied and install gpnys alone. The README's example then runs
there, importing the installed gpnys, not this checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import site
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

import pytest

from test_readme import readme_example

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("build")

#: the newest releases on the package index on 2026-11-28; the wheel's ranges must admit them
NEWEST = {"torch": "2.15.0", "gpytorch": "1.15.2", "linear_operator": "0.6.1", "botorch": "0.18.1",
          "numpy": "2.5.5", "scipy": "1.18.1", "tqdm": "4.70.1", "scikit-learn": "1.9.1", "threadpoolctl": "3.8.0"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # one build at a time: each pytest-xdist worker that runs a test of this module builds the wheel, and two
    # setuptools builds in the checkout's build/ directory remove each other's files
    with open(Path(tempfile.gettempdir()) / "gpnys-wheel-build.lock", "w") as lock:
        with contextlib.suppress(ImportError):  # POSIX; elsewhere the builds are not serialised
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
                               "--outdir", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the wheel did not build:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (path,) = out.glob("gpnys-*.whl")
    return path


def _fresh_env(root: Path) -> Path:
    """A virtual environment without pip; returns its python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    return root / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    """pip for ``python``, offline and without this machine's pip configuration (its constraints and links)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args, "--no-index",
                           "--disable-pip-version-check"], capture_output=True, text=True, timeout=300, env=env)


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def test_wheel_metadata(wheel):
    import gpnys

    assert wheel.name.startswith(f"gpnys-{gpnys.__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    assert any(n.startswith("gpnys/data/elevators/") for n in names), "bundled data sets missing from the wheel"
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_ranges_admit_newest_releases(wheel, tmp_path):
    """pip, offline, in an environment holding the newest releases (as bare metadata): nothing but gpnys to install,
    torch left as it is."""
    required = {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in _requires(wheel)
                if "extra ==" not in r}
    assert required <= {k.replace("_", "-") for k in NEWEST}, f"NEWEST lacks {required - set(NEWEST)}"
    python = _fresh_env(tmp_path / "env")
    sp = _site_packages(python)
    for name, version in NEWEST.items():
        info = sp / f"{name.replace('-', '_')}-{version}.dist-info"  # the directory name normalised
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")
    report = tmp_path / "report.json"
    run = _pip(python, "install", "--dry-run", "--report", str(report), str(wheel))
    assert run.returncode == 0, run.stdout + run.stderr
    install = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert install == ["gpnys"], install
    # and the extras' pins: triton's current release satisfies the cuda extra's range
    triton = next(r for r in _requires(wheel) if r.startswith("triton"))
    assert re.match(r"triton\s*>=\s*3\.3\b", triton) and "<" not in triton.split(";")[0], triton


def test_wheel_installs_beside_torch_and_runs_readme_example(wheel, tmp_path):
    python = _fresh_env(tmp_path / "env")
    # the environment "already has torch": this interpreter's packages, less the checkout's own gpnys
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in Path(site.getsitepackages()[0]).iterdir():
        if entry.name.lower().startswith(("gpnys", "__editable__", "_gpnys")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    (_site_packages(python) / "deps.pth").write_text(f"{deps}\n")
    run = _pip(python, "install", str(wheel))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Successfully installed gpnys" in run.stdout
    script = tmp_path / "example.py"
    script.write_text("import gpnys, sys\nprint('GPNYS_AT', gpnys.__file__)\n" + readme_example())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"  # as the suite's own processes: a shared 2-core runner stalls small BLAS calls
    out = subprocess.run([str(python), str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    where = next(line for line in out.stdout.splitlines() if line.startswith("GPNYS_AT"))
    assert str(tmp_path / "env") in where and str(ROOT) not in where, where
    assert re.search(r"loss -?\d+\.\d+ ± \d", out.stdout), out.stdout
