"""`clustersim collective`: nccl-tests layout and definitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.errors import UserError
from simulator.network.cli import collective_app, parse_size, simulate_sweep


def test_parse_size():
    assert parse_size("8") == 8 and parse_size("128K") == 128 << 10 and parse_size("8G") == 8 << 30
    with pytest.raises(UserError, match=r"size '8X' is not a byte count"):
        parse_size("8X")


def test_json_rows_follow_nccl_tests_definitions():
    res = CliRunner().invoke(collective_app, ["all_gather", "--gpus", "16", "--topology", "p4de-efa", "-b", "1M", "-e", "64M", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)  # one object, the rows inside
    rows = obj["rows"]
    assert obj["collective"] == "all_gather" and obj["gpus"] == 16
    assert [set(r) for r in rows] == [{"size_bytes", "count", "time_us", "algbw_GBps", "busbw_GBps", "algorithm"}] * len(rows)
    assert len(rows) == 7
    for r in rows:
        assert r["size_bytes"] % (16 * 4) == 0  # all_gather: count per rank x nranks x 4 bytes
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / 1e9 / (r["time_us"] * 1e-6))
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 15 / 16)


def test_table_layout_and_profile_note():
    res = CliRunner().invoke(collective_app, ["all_reduce", "--gpus", "8", "--topology", "dgx-h100-fattree",
                                              "--gpu", "h100-sxm-80gb", "-b", "8", "-e", "1G"])
    assert res.exit_code == 0, res.output
    lines = [l for l in res.stdout.splitlines() if l and not l.startswith("#")]
    assert len(lines) == 28
    tok = lines[-1].split()
    assert tok[:5] == ["1073741824", "268435456", "float", "sum", "-1"]
    assert tok[5] == tok[9] and float(tok[7]) == pytest.approx(450 * 0.82, rel=0.05)
    assert "#       size         count      type   redop    root     time   algbw   busbw #wrong" in res.stdout
    assert "Avg bus bandwidth" in res.stdout


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "alltoall", "sendrecv", "broadcast"])
def test_every_op_runs(op):
    rows, net, _ = simulate_sweep(op, 16, "dgx-h100-fattree", None, 1 << 20, 1 << 24, 4.0)
    assert len(rows) == 3 and all(r["time_us"] > 0 and r["busbw_GBps"] > 0 for r in rows)
    # bigger messages never get lower bus bandwidth
    assert [r["busbw_GBps"] for r in rows] == sorted(r["busbw_GBps"] for r in rows)


def test_bad_op_exits_2_with_one_line():
    res = CliRunner().invoke(collective_app, ["allreduc", "--gpus", "8"])
    assert res.exit_code == 2
    assert "unknown collective 'allreduc'" in res.output and res.output.strip().count("\n") == 0


def test_every_node_kind_default_profile_is_shipped_and_today_s_systems_have_one():
    """`collective` without --gpu assumes the profile of the topology's GPU: every mapping names a
    shipped profile, and the H200 / B200 / GB200 systems get theirs (they had ideal links)."""
    from simulator.network.cli import NODE_KIND_PROFILES, default_profile_for
    from simulator.profile import load_profile

    for kind, name in NODE_KIND_PROFILES.items():
        assert load_profile(name) is not None, kind
    assert default_profile_for("gb200-nvl72") == "gb200"
    assert default_profile_for("dgx-b200") == "b200"
    assert default_profile_for("dgx-h200") == "h200-sxm-141gb"
    assert default_profile_for("torus-3d") is None
    # the systems of the shipped nccl-tests logs take the profiles calibrated on those logs
    assert default_profile_for("p5-efa") == "h100-sxm-80gb-p5-efa"
    assert default_profile_for("azure-ndv4") == "a100-sxm-40gb"


def test_collective_without_gpu_meets_the_p5_log():
    """`collective --topology p5-efa` with no --gpu takes the p5 calibration and meets the p5
    log within the 10% target from 64 KiB (with NCCL's own constants it was up to 52% off)."""
    from simulator.calibrate.nccl_fit import read_log

    log = read_log(Path(__file__).parent / "data" / "reference" / "nccl-tests" / "p5-2nodes-16gpu_all_reduce_perf.txt", 8)
    measured = {int(s): t for s, t in zip(log.size_bytes, log.time_us)}
    res = CliRunner().invoke(collective_app, ["all_reduce", "-g", "16", "--topology", "p5-efa", "-b", "64K", "-e", "8G",
                                              "-f", "4", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["gpu_profile"] == "h100-sxm-80gb-p5-efa"
    errs = [r["time_us"] / measured[r["size_bytes"]] - 1 for r in out["rows"]]
    assert len(errs) == 9 and max(abs(e) for e in errs) <= 0.10, errs


def test_sizes_below_one_element_are_refused():
    res = CliRunner().invoke(collective_app, ["all_reduce", "-g", "8", "-b", "1", "-e", "1", "-d", "double"])
    assert res.exit_code == 2 and "less than one double element (8 bytes)" in res.output


def test_a_forced_nccl_algorithm_keeps_the_profiles_model():
    # Was: --algorithm dropped NCCL's model ("no NCCL model: give --gpu" with --gpu given) and
    # timed ideal links, so forcing the tree NCCL had picked came out 2.4x faster than the pick.
    def busbw(*extra):
        res = CliRunner().invoke(collective_app, ["all_reduce", "--gpus", "16", "--topology", "dgx-a100-fattree",
                                                  "--gpu", "a100-sxm-80gb", "-b", "8G", "-e", "8G", "--json", *extra])
        assert res.exit_code == 0, res.output
        (row,) = json.loads(res.stdout)["rows"]
        return row["busbw_GBps"], row["algorithm"]

    picked, algo = busbw()
    assert algo.startswith("tree/")
    assert busbw("--algorithm", "tree") == (picked, algo)  # NCCL_ALGO=Tree: NCCL's own pick
    ring, ring_algo = busbw("--algorithm", "ring")
    assert ring_algo.startswith("ring/") and ring <= picked  # NCCL picked the faster of the two
    # An algorithm NCCL does not have stays the flow model's, and --explain says so.
    res = CliRunner().invoke(collective_app, ["all_reduce", "--gpus", "16", "--topology", "dgx-a100-fattree", "--gpu",
                                              "a100-sxm-80gb", "-b", "8G", "-e", "8G", "--algorithm", "hierarchical", "--explain"])
    assert res.exit_code == 0 and "the flow model: NCCL has no such algorithm here" in res.stdout
