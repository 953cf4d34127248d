"""Start-up cost of the CLI: wall and CPU time of `clustersim` commands that do little else.

Every command pays the interpreter and its imports before it does any work: `--version`,
`simulate --help`, a bad flag (one error line), and a tiny scenario's simulate (8 GPUs, the
alpha-beta network; its own work is ~0.1 s of the total). Each runs in a fresh child from a
temporary folder, as a user's shell would start it. Medians over --repeat runs (this machine is
shared: expect noise; CPU time, user + system, is the steadier figure).

    python bench/bench_cli_startup.py [--repeat 9] [--baseline PATH]

--baseline runs another checkout's code too (PYTHONPATH), each command alternating between the
two so that the machine's load falls on both alike. Both checkouts' modules are compiled first
(as an installed package's are), so neither pays for compiling.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO / "tests"))
from cli_helpers import TINY_SCENARIO  # noqa: E402  (the CLI tests' tiny scenario: 8 GPUs, alpha-beta network)

COMMANDS = {
    "--version": ["--version"],
    "simulate --help": ["simulate", "--help"],
    "bad flag (exit 2)": ["simulate", "--bogus"],
    "tiny simulate": ["simulate", "tiny.yaml", "--no-dashboard", "--report", "r.json"],
}


def run_once(args: list[str], repo: Path, folder: Path) -> tuple[float, float]:
    """(wall s, CPU s of the child) for one `python -m simulator.cli ARGS`."""
    env = dict(os.environ, PYTHONPATH=str(repo), COLUMNS="120")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "simulator.cli", *args], cwd=folder, env=env, capture_output=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to time alongside this one")
    a = ap.parse_args()
    repos = [REPO] + ([a.baseline.resolve()] if a.baseline else [])
    for repo in repos:
        if not (repo / "simulator" / "cli.py").is_file():
            sys.exit(f"error: --baseline {str(a.baseline)!r} has no simulator/cli.py: give a ClusterSim checkout")
        compileall.compile_dir(repo / "simulator", quiet=2)
    print(f"median of {a.repeat} runs; CPU s = user + system of the child" + (f"; baseline {repos[1]}" if a.baseline else ""))
    head = f"{'command':<20} {'wall s':>8} {'CPU s':>8}"
    print(head + (f" {'base wall':>10} {'base CPU':>9}" if a.baseline else ""))
    with tempfile.TemporaryDirectory(prefix="clustersim-startup-") as tmp:
        folder = Path(tmp)
        (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY_SCENARIO))
        for name, args in COMMANDS.items():
            runs: dict[Path, list[tuple[float, float]]] = {r: [] for r in repos}
            for _ in range(a.repeat):
                for repo in repos:
                    runs[repo].append(run_once(args, repo, folder))
            cols = [f"{statistics.median(w for w, _ in runs[r]):8.2f} {statistics.median(c for _, c in runs[r]):8.2f}" for r in repos]
            print(f"{name:<20} " + "  ".join(cols))


if __name__ == "__main__":
    main()
