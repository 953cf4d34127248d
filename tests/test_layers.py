"""The package's layers hold (issue 13): `lint-imports` checks the contracts in .importlinter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_layer_contracts_hold():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: pip install -e '.[dev]' (import-linter is a dev dependency)")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([exe, "--config", str(ROOT / ".importlinter")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_low_layers_do_not_import_calibration():
    # The Profile is a low-level package: workload, network and engine read it without calibrate.
    code = ("import sys, simulator.workload.program, simulator.network.fabric, simulator.engine.core; "
            "print(any(m.startswith('simulator.calibrate') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
