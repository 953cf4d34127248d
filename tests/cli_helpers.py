"""Shared by the CLI tests: run `clustersim` as a user would (a subprocess from a folder of the
test's own) and check the one-line error rule; a scenario that simulates in well under a second."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# 4 layers, 8 GPUs, the alpha-beta network.
TINY_SCENARIO = {
    "name": "tiny",
    "model": {"name": "tiny", "num_layers": 4, "hidden_size": 512, "ffn_hidden_size": 1376,
              "num_attention_heads": 8, "vocab_size": 32000},
    "parallelism": {"tp": 2, "pp": 2, "zero": 1, "sequence_parallel": True},
    "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 512},
    "schedule": "1f1b",
    "network": "alpha-beta",
    "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}


def clustersim(args: list, cwd: Path, *, columns: int = 160, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`clustersim ARGS` from ``cwd`` (this checkout's code): its exit status, stdout and stderr.
    ``columns``: the terminal width help is drawn at; ``python_flags``: the interpreter's own
    (``-X importtime`` lists what a run imports, on stderr)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS=str(columns))
    return subprocess.run([sys.executable, *python_flags, "-m", "simulator.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_line_error(p: subprocess.CompletedProcess, pattern: str) -> None:
    """Exit 2, one `error:` line on stderr matching ``pattern``, no traceback, nothing on stdout."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in p.stderr and p.stdout == ""
