"""Layouts people have (per-rank subfolders at any depth, gz or not, ranks from distributedInfo
or the path), bad rank sets as one line + exit 2, nccl-tests world sizes, and collectives
split into transfer and waiting on the real traces."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from simulator.cli import app
from simulator.errors import UserError
from simulator.topology.placement import Mesh
from simulator.trace.collectives import annotate_transfers
from simulator.trace.loader import load_trace, rank_from_path
from simulator.trace.nccl_tests import import_nccl_tests
from simulator.trace.optable import make_optable

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "tests" / "data" / "reference"
KIN = REF / "kineto"
sys.path.insert(0, str(ROOT))
from bench.make_rank_set import make_rank_set  # noqa: E402


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


@pytest.fixture(scope="module")
def two_rank_set(tmp_path_factory):
    """The real 2-rank nccl_data trace as ranks 0 and 1 of its own job, in rank_k/ folders."""
    d = tmp_path_factory.mktemp("two")
    make_rank_set(KIN / "hta_nccl_data_a100_rank0of2.json.gz", d / "prof", 2, "logs/rank_{k}")
    return d / "prof"


def test_nested_rank_folders_and_skipped_files(two_rank_set):
    (two_rank_set / "logs" / "config.json").write_text('{"lr": 0.1}')
    ts = _quiet(load_trace, two_rank_set)
    assert ts.ranks == [0, 1] and ts.world_size == 2
    assert ts.warnings[0] == "skipped 1 file(s) that are not Kineto traces: logs/config.json"
    assert ts.ops.groupby("rank").size().to_dict() == {0: 3774, 1: 3774}


def test_rank_from_path_when_distributed_info_is_missing(tmp_path):
    with gzip.open(KIN / "hta_sampled_rank0of128.json.gz", "rt") as f:
        d = json.load(f)
    d.pop("distributedInfo")
    for k, sub in enumerate(("worker0", "worker1")):
        p = tmp_path / "tb" / sub
        p.mkdir(parents=True)
        target = p / "host_1.pt.trace.json"   # plain JSON next to gz elsewhere
        target.write_text(json.dumps(d))
    ts = _quiet(load_trace, tmp_path / "tb")
    assert ts.ranks == [0, 1] and ts.world_size is None
    assert rank_from_path(Path("/x/run/rank3of16.json.gz"), Path("/x")) == (3, 16)
    assert rank_from_path(Path("/x/iteration_10/rank_5/a.pt.trace.json"), Path("/x")) == (5, None)
    assert rank_from_path(Path("/x/traces/7/a.json"), Path("/x")) == (7, None)


def test_rank_gap_duplicate_truncated_are_one_line_exit_2(tmp_path):
    gap = tmp_path / "gap"
    make_rank_set(KIN / "hta_sampled_rank0of128.json.gz", gap, 3, "rank_{k}")
    shutil.rmtree(gap / "rank_1")
    with pytest.raises(UserError, match=r"holds ranks 0\.\.2 but not rank\(s\) 1"):
        _quiet(load_trace, gap)
    dup = tmp_path / "dup"
    for sub in ("step_1", "step_2"):
        (dup / sub).mkdir(parents=True)
        shutil.copy(KIN / "hta_sampled_rank0of128.json.gz", dup / sub / "trace.json.gz")
    with pytest.raises(UserError, match="both hold rank 0"):
        _quiet(load_trace, dup)
    trunc = tmp_path / "trunc"
    (trunc / "rank_0").mkdir(parents=True)
    raw = (KIN / "hta_sampled_rank0of128.json.gz").read_bytes()
    (trunc / "rank_0" / "t.json.gz").write_bytes(raw[: len(raw) // 2])
    runner = CliRunner()
    for bad in (gap, dup, trunc):
        r = runner.invoke(app, ["trace", "info", str(bad)])
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output


def test_nccl_tests_world_size_from_header(tmp_path):
    # a 16-rank log that lists only 4 '# Rank' lines is still 16 ranks (busbw/algbw says so)
    src = (REF / "nccl-tests" / "azure-ndv4-a100-40gb-16gpu_all_reduce_perf.txt").read_text().splitlines()
    kept = [ln for ln in src if "#   Rank" not in ln or any(f"Rank  {k} " in ln for k in range(4))]
    p = tmp_path / "cut_all_reduce_perf.txt"
    p.write_text("\n".join(kept) + "\n")
    r = import_nccl_tests(p)
    assert r.nranks == 16 and any("busbw/algbw says 16" in w for w in r.warnings)
    # no collective in the log or its name: one line naming --collective, then --collective works
    anon = tmp_path / "run.log"
    anon.write_text((REF / "nccl-tests" / "p5-2nodes-16gpu_all_reduce_perf.txt").read_text())
    with pytest.raises(UserError, match="pass --collective"):
        import_nccl_tests(anon)
    assert import_nccl_tests(anon, collective="all_reduce").nranks == 16
    out = CliRunner().invoke(app, ["trace", "info", str(anon), "--collective", "all_reduce", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["world_size"] == 16
    # calibrate's --collective reaches the NCCL model's fit too (it asked for the flag it was given)
    from simulator.calibrate.nccl_fit import read_log

    assert read_log(anon, 8, "all_reduce").op == "all_reduce"
    prof = tmp_path / "p5.json"
    out = CliRunner().invoke(app, ["calibrate", str(anon), "--collective", "all_reduce", "--base", "h100-sxm-80gb",
                                   "--topology", "p5-efa", "--out", str(prof), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(prof.read_text())["comm"]["nccl"]["system"] == "p5-efa"
    # --json: one object on stdout, the profile written and what calibrate noted
    printed = json.loads(out.stdout)
    assert printed["out"] == str(prof) and printed["profile"] == json.loads(prof.read_text())
    assert isinstance(printed["notes"], list) and isinstance(printed["warnings"], list)
    # 4 processes x nGpus 4 by mpirun prefixes, a collective whose busbw does not tell n
    lines = ["[1,%d]<stdout>:# nThread 1 nGpus 4 minBytes 8 maxBytes 8 step: 2(factor)" % k for k in range(4)]
    lines += ["[1,0]<stdout>:#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
              "[1,0]<stdout>:     1048576        262144     float    none       0    50.00   20.97   20.97      0    50.00   20.97   20.97      0"]
    b = tmp_path / "broadcast_perf.txt"
    b.write_text("\n".join(lines) + "\n")
    assert import_nccl_tests(b).nranks == 16
    # the launcher's command line: -np 4 processes x -g 4 GPUs, no prefixes, no Rank lines
    cmd = ["$ mpirun -np 4 --host a:2,b:2 ./build/broadcast_perf -b 1M -e 1M -g 4",
           "# nThread 1 nGpus 4 minBytes 1048576 maxBytes 1048576 step: 2(factor)"] + [ln.split(">:", 1)[1] for ln in lines[4:]]
    c = tmp_path / "cmd.log"
    c.write_text("\n".join(cmd) + "\n")
    assert import_nccl_tests(c, collective="broadcast").nranks == 16
    # nothing tells: a clear line, and calibrate refuses it in one line
    bare = tmp_path / "bare.log"
    bare.write_text("\n".join(ln.split(">:", 1)[1] for ln in lines[4:]) + "\n")
    r = import_nccl_tests(bare, collective="broadcast")
    assert r.nranks is None and any("cannot tell how many ranks" in w for w in r.warnings)


def test_single_rank_lower_envelope_on_real_trace():
    ts = _quiet(load_trace, KIN / "hta_nccl_data_a100_rank0of2.json.gz")
    c = ts.ops[ts.ops["op_class"] == "communication"]
    assert set(c["transfer_source"].astype(str)) == {"envelope"}
    env = c.groupby(["collective", "msg_bytes"], observed=True)["dur_us"].transform("min")
    assert np.allclose(c["transfer_us"], env)
    assert np.allclose(c["transfer_us"] + c["wait_us"], c["dur_us"]) and (c["wait_us"] >= 0).all()
    # 5 all-reduce sizes x 3 calls: their shortest calls waited least
    assert round(float(c.loc[c["msg_bytes"] == 8196000, "transfer_us"].iloc[0]), 3) == round(7561.821 / 3, 3)


def test_all_ranks_instances_from_pg_config(two_rank_set):
    ts = _quiet(load_trace, two_rank_set)
    c = ts.ops[ts.ops["op_class"] == "communication"]
    assert set(c["transfer_source"].astype(str)) == {"instance"}
    assert c["coll_instance"].nunique() == 21 and c.groupby("coll_instance").size().eq(2).all()


def _calls(rank, start, dur, size, ranks=None, gsize=2, coll="all_reduce"):
    n = len(rank)
    return make_optable({
        "rank": np.asarray(rank, dtype=np.int32), "op_class": pd.Categorical(["communication"] * n),
        "collective": pd.Categorical([coll] * n), "msg_bytes": pd.array([size] * n, dtype="Int64"),
        "group_size": pd.array([gsize if gsize else pd.NA] * n, dtype="Int32"),
        "group_ranks": pd.Categorical(ranks if ranks else [None] * n),
        "start_us": np.asarray(start, float), "dur_us": np.asarray(dur, float)}, n)


def test_concurrent_same_size_calls_of_different_groups_are_not_merged():
    # Two TP pairs (0,1) and (2,3) all-reduce the same size at the same time; rank 1 and rank 3 arrive late.
    ops = _calls([0, 1, 2, 3], [0, 300, 10, 200], [400, 100, 290, 100], 4096,
                 ["[0, 1]", "[0, 1]", "[2, 3]", "[2, 3]"])
    annotate_transfers(ops)
    assert ops["coll_instance"].nunique() == 2
    assert ops["transfer_us"].tolist() == [100.0, 100.0, 100.0, 100.0]
    assert ops["wait_us"].tolist() == [300.0, 0.0, 190.0, 0.0]
    # No group records: the layout tells (tp=2 x dp=4: only TP groups have 2 ranks) ...
    bare = _calls([0, 1, 2, 3], [0, 300, 10, 200], [400, 100, 290, 100], 4096)
    annotate_transfers(bare, mesh=Mesh(tp=2, cp=1, ep=1, dp=4, pp=1))
    assert bare["coll_instance"].nunique() == 2 and set(bare["transfer_source"].astype(str)) == {"instance"}
    # ... but with tp=2 and dp=2 both of size 2 it cannot: the lower envelope, never a merge
    amb = _calls([0, 1, 2, 3], [0, 300, 10, 200], [400, 100, 290, 100], 4096)
    annotate_transfers(amb, mesh=Mesh(tp=2, cp=1, ep=1, dp=2, pp=1))
    assert set(amb["transfer_source"].astype(str)) == {"envelope"} and amb["transfer_us"].tolist() == [100.0] * 4



def _p2p(rank, coll, peer, start, dur, size=16384):
    n = len(rank)
    return make_optable({
        "rank": np.asarray(rank, dtype=np.int32), "op_class": pd.Categorical(["communication"] * n),
        "collective": pd.Categorical(coll), "msg_bytes": pd.array([size] * n, dtype="Int64"),
        "peer": pd.array(peer, dtype="Int32"), "start_us": np.asarray(start, float), "dur_us": np.asarray(dur, float)}, n)


def test_send_recv_pair_with_their_peer_on_the_pipeline_group():
    # pp=4 (ranks 0..3 one pipeline): stage 1 sends forward to 2 and backward to 0, same size; the
    # peer (c10d dst/src, an index into the group) tells which recv is whose. The forward send is
    # eager (ends before its recv starts): the transfer runs from the later start to the recv's end.
    ops = _p2p([1, 2, 1, 0], ["send", "recv", "send", "recv"], [2, 1, 0, 1],
               [100, 150, 500, 300], [20, 30, 400, 250])
    annotate_transfers(ops, mesh=Mesh(tp=1, cp=1, ep=1, dp=1, pp=4))
    assert set(ops["transfer_source"].astype(str)) == {"instance"} and ops["group_size"].tolist() == [2] * 4
    assert ops["coll_instance"].tolist()[0] == ops["coll_instance"].tolist()[1] != ops["coll_instance"].tolist()[2]
    # 1->2: recv 150..180, so 30; 1->0: send starts at 500, recv ends at 550, so 50 (rank 0 waited 200)
    assert ops["transfer_us"].tolist() == [20.0, 30.0, 50.0, 50.0]
    assert ops["wait_us"].tolist() == [0.0, 0.0, 350.0, 200.0]
    # without the peer, a 4-rank group cannot say whose recv a send is: the envelope, and why
    blind = _p2p([1, 2, 1, 0], ["send", "recv", "send", "recv"], [None] * 4, [100, 150, 500, 300], [20, 30, 400, 250])
    annotate_transfers(blind, mesh=Mesh(tp=1, cp=1, ep=1, dp=1, pp=4))
    assert set(blind["transfer_source"].astype(str)) == {"envelope"} and set(blind["transfer_why"].astype(str)) == {"ambiguous"}


def test_layout_groups_are_checked_against_the_calls_and_pg_config():
    # tp=2 x pp=2 layout: an all-reduce of unknown size is TP's (pipeline groups carry point-to-point only)
    ops = _calls([0, 1, 2, 3], [0, 300, 10, 200], [400, 100, 290, 100], 4096, gsize=None)
    annotate_transfers(ops, mesh=Mesh(tp=2, cp=1, ep=1, dp=1, pp=2))
    assert ops["coll_instance"].nunique() == 2 and ops["group_size"].tolist() == [2] * 4
    # calls of an inferred group that never ran together (rank 0 ended before rank 1 started)
    # are not one instance: the layout is not the job's
    apart = _calls([0, 1, 2, 3], [0, 300, 10, 200], [100, 100, 290, 100], 4096, gsize=None)
    annotate_transfers(apart, mesh=Mesh(tp=2, cp=1, ep=1, dp=1, pp=2))
    assert apart["transfer_why"].tolist()[:2] == ["unmatched"] * 2 and apart["transfer_why"][2:].isna().all()
    assert apart["transfer_source"].astype(str).tolist() == ["envelope", "envelope", "instance", "instance"]
    # pg_config lists every group a rank is in: a layout group none of them is was not the job's
    pg = {r: {"0": (0, 1, 2, 3), "1": (r % 2, r % 2 + 2)} for r in range(4)}
    other = _calls([0, 1, 2, 3], [0, 300, 10, 200], [400, 100, 290, 100], 4096, gsize=None)
    annotate_transfers(other, pg, mesh=Mesh(tp=2, cp=1, ep=1, dp=1, pp=2))
    assert set(other["transfer_why"].astype(str)) == {"not_in_layout"}


def test_nccl_rows_no_run_measures_are_named(tmp_path):
    """A time of 0 or 1e308 us, or a size past 1 PiB, is no measurement: the line is named (a zero
    time raised ValueError in the fit, a huge size OverflowError)."""
    src = (REF / "nccl-tests" / "p4de-2nodes-16gpu_all_reduce_perf.txt").read_text().splitlines()
    rows = [i for i, l in enumerate(src) if l.split(":", 1)[-1].split() and l.split(":", 1)[-1].split()[0].isdigit()]
    first = rows[0]
    tok = src[first].split()
    for what, edit, match in (("zero", lambda t: t[:6] + ["0.00"] + t[7:], r"time 0\.0 us is not a positive time"),
                              ("huge", lambda t: t[:1] + ["9" * 26] + t[2:], r"size 9+ is outside")):
        lines = list(src)
        lines[first] = " ".join(edit(tok))
        for i in rows[1:]:
            lines[i] = ""
        p = tmp_path / f"{what}_all_reduce_perf.txt"
        p.write_text("\n".join(lines) + "\n")
        with pytest.raises(UserError, match=match):
            import_nccl_tests(p)
