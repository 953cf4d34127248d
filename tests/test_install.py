"""A new user's first hour: a clean clone's tests read nothing beside it, a regular install runs from any
folder with the data it ships, and ``clustersim --version`` says what is installed."""

from __future__ import annotations

import json
import os
import shutil
import site as sitelib
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import simulator
from simulator.cli import app
from simulator.version import package_version

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "tests" / "data" / "scenarios" / "small-llama.yaml"


# ---------------------------------------------------------------------------------------------
# The guard in conftest.py: reading outside the repository fails the test
# ---------------------------------------------------------------------------------------------

def test_guard_catches_reads_beside_the_repository(read_guard, tmp_path):
    shared = ROOT.parent / "shared" / "reference" / "MANIFEST.md"  # the development data a clone lacks
    sibling = ROOT.parent / "another-checkout" / "tests" / "data" / "x.json"
    ancestors_shared = [a / "shared" / "x" for a in ROOT.parents]
    with read_guard.expect() as caught:
        for path in [shared, sibling, *ancestors_shared]:
            try:
                path.read_bytes()
            except OSError:
                pass  # most do not exist here; the attempt is what counts
        try:
            os.listdir(ROOT.parent / "shared")
        except OSError:
            pass
        # A child process handed a path beside the repository (it would read it where the hook cannot see).
        subprocess.run([sys.executable, "-c", "pass", f"--log={shared}"], check=True)
        # Relative to the child's working folder: ../shared from the repository.
        subprocess.run([sys.executable, "-c", "pass", "../shared/reference/MANIFEST.md"], check=True, cwd=ROOT)
    # A clone right in the temporary folder leaves its non-checkout siblings alone (library scratch).
    sibling_flagged = 0 if read_guard.temp_prefixes else 1
    assert len(caught) == 1 + sibling_flagged + len(ancestors_shared) + 3, caught
    assert any("MANIFEST.md" in c and c.startswith("open") for c in caught)
    assert any(c.startswith("os.listdir") for c in caught)
    assert any(c.startswith("subprocess.Popen argument") for c in caught)

    # Outside expect() the read raises, and not as an OSError that a fallback could swallow.
    guard_error = sys.modules[type(read_guard).__module__].OutsideRepoRead
    assert not issubclass(guard_error, OSError)
    try:
        with pytest.raises(guard_error):
            shared.read_bytes()
    finally:
        read_guard.violations.clear()  # the deliberate read must not fail this test at teardown


def test_guard_allows_the_repository_the_interpreter_and_tmp(read_guard, tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with read_guard.expect() as caught:
        (tmp_path / "a.txt").read_text()
        SCENARIO.read_text()
        Path(json.__file__).read_text()  # the standard library
        Path(pytest.__file__).read_text()  # site-packages
        subprocess.run([sys.executable, "-c", "pass", str(SCENARIO)], check=True, cwd=tmp_path)
        (tmp_path / "b").mkdir()
        subprocess.run([sys.executable, "-c", "pass", "../a.txt"], check=True, cwd=tmp_path / "b")
    assert caught == []
    assert not read_guard.forbidden(str(ROOT / "tests" / "data" / "reference" / "MANIFEST.md"))
    assert read_guard.forbidden(str(ROOT.parent / "shared" / "reference" / "MANIFEST.md"))
    # Hidden folders beside the clone are caches and settings (~/.cache when it sits in a home folder).
    assert not read_guard.forbidden(str(ROOT.parent / ".cache" / "x"))


def test_guard_fails_a_test_that_reads_shared_even_if_it_swallows_the_error(tmp_path):
    """End to end: a pytest run with this conftest, on tests that read ../shared, fails both."""
    shared = ROOT.parent / "shared" / "reference" / "MANIFEST.md"
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("conftest_guard", {str(ROOT / "tests" / "conftest.py")!r})
        mod = importlib.util.module_from_spec(spec)
        sys.modules["conftest_guard"] = mod
        spec.loader.exec_module(mod)
        read_guard = mod.read_guard
        _no_reads_outside_repository = mod._no_reads_outside_repository
        pytest_runtest_makereport = mod.pytest_runtest_makereport
    """))
    (tmp_path / "test_reads_shared.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        SHARED = Path({str(shared)!r})

        def test_plain_read():
            if SHARED.exists():
                SHARED.read_text()
            else:
                open(SHARED)

        def test_swallowed_read():
            try:
                SHARED.read_text()
            except Exception:
                pass

        def test_reads_inside_is_fine(tmp_path):
            (tmp_path / "x").write_text("ok")
            assert (tmp_path / "x").read_text() == "ok"
    """))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "-o", "addopts=",
                        str(tmp_path / "test_reads_shared.py"), "--rootdir", str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**os.environ, "COLUMNS": "400"})
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "FAILED test_reads_shared.py::test_plain_read - conftest_guard.OutsideRepoRead" in out, out
    # Its exception swallowed, the test still fails, at teardown.
    assert "ERROR test_reads_shared.py::test_swallowed_read - Failed: read outside the repository" in out, out
    assert "PASSED test_reads_shared.py::test_reads_inside_is_fine" in out, out
    assert "ERROR test_reads_shared.py::test_plain_read" not in out, out  # one report per read
    assert "1 failed" in out and "1 error" in out, out


# ---------------------------------------------------------------------------------------------
# clustersim --version
# ---------------------------------------------------------------------------------------------

def test_version_flag_prints_the_package_version():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # One source: pyproject reads simulator.__version__.
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "simulator.__version__"}
    for flag in ("--version", "-V"):
        res = CliRunner().invoke(app, [flag])
        assert res.exit_code == 0, res.output
        assert res.output.strip() == f"clustersim {simulator.__version__}"
    assert package_version() == simulator.__version__


# ---------------------------------------------------------------------------------------------
# A regular install, run from another folder
# ---------------------------------------------------------------------------------------------

# Runs the installed console script in this process, recording the data files it opens.
_DRIVER = """
import json, os, runpy, sys
opened = []
def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        opened.append(os.path.abspath(os.fsdecode(args[0])))
sys.addaudithook(hook)
script, log, *argv = sys.argv[1:]
sys.argv = [script, *argv]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    import simulator
    data = {"opened": [p for p in opened if p.endswith((".json", ".yaml", ".yml", ".csv", ".py"))],
            "simulator": simulator.__file__}
    with open(log, "w") as f:
        json.dump(data, f)
"""


def _copy_source(dst: Path) -> None:
    """What a clone holds for the build (pyproject, README, the package), without caches or build output."""
    dst.mkdir()
    shutil.copy(ROOT / "pyproject.toml", dst)
    shutil.copy(ROOT / "README.md", dst)
    shutil.copytree(ROOT / "simulator", dst / "simulator", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


@pytest.mark.timeout(240)
def test_regular_install_runs_from_any_folder(tmp_path):
    """pip install (not editable) into a fresh venv; `clustersim simulate --json` from an unrelated folder."""
    src = tmp_path / "src"
    _copy_source(src)  # build from a copy: an in-tree build would write build/ and *.egg-info into the repo
    venv = tmp_path / "venv"
    # The dependencies come from this environment (no network needed): --system-site-packages gives
    # the base interpreter's, and a .pth file this environment's own site-packages when the tests run
    # in a venv themselves (a venv made from a venv sees only the base interpreter's packages).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, env=env, check=True).stdout.strip())
    outer = [p for p in dict.fromkeys([*sitelib.getsitepackages(), sysconfig.get_paths()["purelib"],
                                       sysconfig.get_paths()["platlib"]]) if Path(p).is_dir()]
    (site / "_this_environment.pth").write_text("".join(f"{p}\n" for p in outer))
    # This environment's pip, run by the venv's python, installs into the venv; --ignore-installed so a
    # clustersim installed in this environment (an editable checkout) does not satisfy it.
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--ignore-installed",
                        str(src)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    installed = site / "simulator"
    # Every data file of the package was installed (a new data folder needs package-data in pyproject).
    shipped = sorted(str(p.relative_to(src)) for p in (src / "simulator").rglob("*")
                     if p.is_file() and p.suffix != ".py")
    assert shipped, "the package ships no data files?"
    missing = [s for s in shipped if not (site / s).is_file()]
    assert not missing, f"not installed (add them to [tool.setuptools.package-data]): {missing}"

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    shutil.copy(SCENARIO, inputs / "small.yaml")  # names shipped profile h100-sxm-80gb and topology dgx-h100-fattree
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    clustersim = venv / "bin" / "clustersim"

    r = subprocess.run([str(clustersim), "--version"], capture_output=True, text=True, env=env, cwd=run_dir)
    assert r.returncode == 0 and r.stdout.strip() == f"clustersim {simulator.__version__}", r.stdout + r.stderr

    driver, log = tmp_path / "driver.py", tmp_path / "opened.json"
    driver.write_text(_DRIVER)
    r = subprocess.run([str(py), str(driver), str(clustersim), str(log), "simulate", str(inputs / "small.yaml"),
                        "--json", "--no-dashboard"], capture_output=True, text=True, env=env, cwd=run_dir, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)  # exactly one JSON object
    assert report["name"] == "small-llama" and report["gpus"] == 64
    assert report["step_time_s"] > 0 and 0 < report["mfu"] < 1

    seen = json.loads(log.read_text())
    assert Path(seen["simulator"]).resolve().is_relative_to(installed.resolve())
    opened = [Path(p).resolve() for p in seen["opened"]]
    profile = installed.resolve() / "data" / "profiles" / "h100-sxm-80gb.json"
    topology = installed.resolve() / "data" / "topologies" / "dgx-h100-fattree.yaml"
    assert profile in opened and topology in opened, seen["opened"]
    # Nothing came from the source tree: not the repository, not the copy it was built from.
    assert not [p for p in opened if p.is_relative_to(ROOT) or p.is_relative_to(src.resolve())], seen["opened"]
    # And nothing was written where it ran.
    assert list(run_dir.iterdir()) == []

    # A user's own file still overrides the shipped one (a path relative to where it runs).
    slow = inputs / "slow-nics.yaml"
    slow.write_text(topology.read_text().replace("nic_gbps: 400", "nic_gbps: 25"))
    assert slow.read_text() != topology.read_text()
    r = subprocess.run([str(py), str(driver), str(clustersim), str(log), "simulate", str(inputs / "small.yaml"),
                        "--topology", "../inputs/slow-nics.yaml", "--json", "--no-dashboard"],
                       capture_output=True, text=True, env=env, cwd=run_dir, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    opened = [Path(p).resolve() for p in json.loads(log.read_text())["opened"]]
    assert slow.resolve() in opened and topology not in opened
    # 16x less scale-out bandwidth: the cross-node dp and pp traffic of this layout slows the step.
    assert json.loads(r.stdout)["step_time_s"] > report["step_time_s"] * 1.05
    assert list(run_dir.iterdir()) == []


def test_guard_for_a_clone_right_in_the_temporary_folder(tmp_path, monkeypatch):
    """CI may clone into the temporary folder itself: libraries' scratch files there (dask, Chromium,
    torch) are not data, but a shared/ folder or another checkout beside the clone still are."""
    import tempfile

    from conftest import ReadGuard

    # A stand-in temporary folder, so nothing is created beside the real clone.
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    guard = ReadGuard(tmp_path / "clustersim-clone")
    (tmp_path / "checkout" / ".git").mkdir(parents=True)
    assert not guard.forbidden(str(tmp_path / "dask-scratch-space" / "worker-1"))
    assert not guard.forbidden(str(tmp_path / "clustersim-rank0-abc" / "trace.json"))
    assert not guard.forbidden(str(tmp_path / "clustersim-clone-2" / "x"))  # no .git: scratch, not a checkout
    assert guard.forbidden(str(tmp_path / "shared" / "reference" / "x.json"))
    assert guard.forbidden(str(tmp_path / "checkout" / "data.json"))
