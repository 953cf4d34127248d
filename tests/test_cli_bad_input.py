"""Bad input found by a CLI fuzzing pass (fuzz9): each case ends with one ``error:`` line, exit 2,
no traceback and no file written. CLI cases run `python -m simulator.cli` in a subprocess from a
temporary folder, so the exit status, stderr and the files left behind are those of `clustersim`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"

# 4 layers, 8 GPUs, the alpha-beta network: simulates in well under a second.
TINY = {
    "name": "tiny",
    "model": {"name": "tiny", "num_layers": 4, "hidden_size": 512, "ffn_hidden_size": 1376,
              "num_attention_heads": 8, "vocab_size": 32000},
    "parallelism": {"tp": 2, "pp": 2, "zero": 1, "sequence_parallel": True},
    "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 512},
    "schedule": "1f1b",
    "network": "alpha-beta",
    "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}


def clustersim(args: list, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160")
    return subprocess.run([sys.executable, "-m", "simulator.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(p: subprocess.CompletedProcess, pattern: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


@pytest.mark.parametrize("flags", [["--fail-node", "-1"], ["--fail-node", "0", "--fail-node", "-3"]])
def test_negative_failed_node_is_refused(tmp_path, tiny, flags):
    # Was exit 0 with "failed node(s) -1" and a goodput for a node that does not exist.
    p = clustersim(["simulate", tiny, "--no-dashboard", "--report", tmp_path / "r.json", *flags], tmp_path)
    assert_one_line_error(p, r"perturbations\.failures\.nodes\.\d: Input should be greater than or equal to 0")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tiny.yaml"]
