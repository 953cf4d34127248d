"""`clustersim collective` refuses runs that would make millions of sizes or ranks (issue 16): one line,
exit 2, naming the limit, and nothing built first."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from simulator.cli import app
from simulator.errors import UserError
from simulator.network.cli import MAX_COLLECTIVE_RANKS, MAX_SIZES, sizes


def run(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["collective", "all_reduce", *args])
    if isinstance(result.exception, UserError):
        return 2, f"error: {result.exception}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.stderr + result.stdout


@pytest.mark.parametrize("args, match", [
    (["--gpus", "16", "-f", "1.0000001"], "at most 1,000"),
    (["--gpus", "16", "-f", "nan"], "finite number > 1"),
    (["--gpus", "16", "-f", "inf"], "finite number > 1"),
    (["--gpus", "16", "-f", "-inf"], "finite number > 1"),
    (["--gpus", "16", "-f", "1"], "> 1"),
    (["--gpus", "16", "-e", "2T"], "at most 1,099,511,627,776 bytes"),
    (["--gpus", "16", "-e", "9" * 400], "at most 1,099,511,627,776 bytes"),
    (["--gpus", "16", "-b", "9" * 400], "at most 1,099,511,627,776 bytes"),
    (["--gpus", "16", "-b", "nan"], "not a byte count"),
    (["--gpus", "16", "-e", "inf"], "not a byte count"),
    (["--gpus", "1000000"], "at most 131,072"),
    (["--gpus", str(2**63)], "at most 131,072"),
    (["--gpus", "1"], "at least 2"),
])
def test_unbounded_collective_runs_are_one_line(args, match):
    t0 = time.perf_counter()
    code, err = run(args)
    assert code == 2 and match in err, err
    assert len([line for line in err.strip().splitlines() if line.strip()]) == 1, err
    assert "Traceback" not in err
    assert time.perf_counter() - t0 < 10  # refused before any topology is built


def test_size_count_limit_is_exact():
    # nccl-tests' doubling: one size per power of two; 1.0001 over 30 doublings makes ~208,000.
    assert len(sizes(1, 2 ** 39, 2.0)) == 40
    with pytest.raises(UserError, match="at most 1,000"):
        sizes(1, 2 ** 30, 1.0001)


def test_the_suggested_factor_fits_the_limit():
    with pytest.raises(UserError) as info:
        sizes(8, 8 << 30, 1.0000001)
    suggested = float(str(info.value).split("use --factor ")[1].split()[0])
    assert len(sizes(8, 8 << 30, suggested)) <= MAX_SIZES


def test_a_normal_run_still_works():
    result = CliRunner().invoke(app, ["collective", "all_reduce", "--gpus", "16", "-b", "1M", "-e", "4M", "--json"])
    assert result.exit_code == 0, result.stdout
    rows = json.loads(result.stdout)["rows"]
    assert [r["size_bytes"] for r in rows] == [1 << 20, 2 << 20, 4 << 20]


def test_rank_limit_is_above_the_largest_published_jobs():
    assert MAX_COLLECTIVE_RANKS >= 100_000


def test_a_sendrecv_ring_across_nodes_runs_at_nic_speed():
    # nccl-tests' sendrecv ring on 16 GPUs has pairs 7->8 and 15->0 across nodes; they set the
    # step. Priced by the first pair (inside a node) it showed NVLink's 348 GB/s on 8, 16 and 32 GPUs.
    def busbw(gpus: int) -> float:
        res = CliRunner().invoke(app, ["collective", "sendrecv_perf", "-g", str(gpus), "-b", "64M", "-e", "64M",
                                       "-d", "bfloat16"])
        assert res.exit_code == 0, res.output
        row = next(ln.split() for ln in res.stdout.splitlines() if ln.strip().startswith("67108864"))
        return float(row[7])  # out-of-place busbw, GB/s

    one_node, two_nodes = busbw(8), busbw(16)
    assert one_node > 300  # NVLink 4 (450 GB/s a direction)
    assert 35 < two_nodes < 50  # one 400 Gb/s NIC (50 GB/s) a pair across nodes
