"""CPU (gloo) captures of torch's real parallel stack: collectives take their kind and sizes from
the c10d op that issued each gloo span, their groups from the bundle's layout, and DTensor ops
count the work done on the local shard."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from simulator.cli import app
from simulator.errors import UserError
from simulator.topology.placement import Mesh
from simulator.trace.kineto import import_kineto
from simulator.trace.loader import load_trace

ROOT = Path(__file__).resolve().parents[1]
TP_PP = ROOT / "traces" / "cpu-gloo-train-tp2-pp2"
DP_TP = ROOT / "traces" / "cpu-gloo-train-dp2-tp2"


def _load(path: Path):
    if not path.exists():
        pytest.skip(f"needs the shipped bundle {path.name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_trace(path) if path.is_dir() else import_kineto(path)


def test_fsdp_reduce_scatter_is_named_from_its_c10d_op():
    ops = _load(DP_TP).ops
    comm = ops[ops["op_class"] == "communication"]
    # gloo runs reduce_scatter_tensor as an all_reduce of the whole input; the span says all_reduce
    for rank in range(4):
        r = comm[comm["rank"] == rank]
        assert r["collective"].value_counts().to_dict() == {
            "all_reduce": 156, "all_gather": 66, "reduce_scatter": 15, "barrier": 6}
        rs = r[r["collective"] == "reduce_scatter"]
        assert len(rs) == 15 and set(rs["name"]) == {"gloo:all_reduce"}
        assert sorted(set(zip(rs["in_msg_bytes"], rs["out_msg_bytes"], rs["group_size"]))) == [
            (1050624, 525312, 2), (1576960, 788480, 2)]
        assert rs["msg_bytes"].value_counts().to_dict() == {1576960: 12, 1050624: 3}
        assert set(rs["dtype"]) == {"float32"} and set(rs["coll_source"]) == {"annotation+c10d_op"}
        ag = r[r["collective"] == "all_gather"]
        # _allgather_base_ output/input ratio gives the group size, hence the gathered size
        assert ag["msg_bytes"].value_counts().to_dict() == {1576960: 48, 1050624: 12, 524288: 6}
        assert set(zip(ag["in_msg_bytes"], ag["group_size"])) == {(788480, 2), (525312, 2), (262144, 2)}
        ar = r[r["collective"] == "all_reduce"]
        assert len(ar) == 156 and set(ar["msg_bytes"]) == {131072}
        assert r["collective"].value_counts()["barrier"] == 6
    # the span keeps its own duration (the gloo worker's time), not the enqueueing c10d op's
    first = comm[(comm["rank"] == 0) & (comm["collective"] == "reduce_scatter")].iloc[0]
    assert first["dur_us"] == 24714.394


def test_dtensor_gemm_counts_local_shard():
    t = _load(TP_PP / "rank0.trace.json.gz")
    gemm = t.ops[t.ops["op_class"] == "gemm"]
    # hidden 256, ffn 1024, 128 tokens, tp 2: every projection runs on half its global weight
    qkv_o = (2 * 128 * 256 * (256 // 2), 4 * (128 * 256 + 256 * 128 + 128 * 128))
    fc = (2 * 128 * 256 * (1024 // 2), 4 * (128 * 256 + 256 * 512 + 128 * 512))
    assert set(zip(gemm["flops"], gemm["bytes"])) == {qkv_o, fc}
    assert gemm["name"].astype(str).value_counts().to_dict() == {"aten::mm": 288, "aten::linear": 144}
    # the first column-parallel linear: global weight [256, 256], local [128, 256]; the row keeps
    # the outer op's time, which encloses the DTensor dispatch and the local mm
    lin = gemm.iloc[0]
    assert (lin["name"], lin["flops"], lin["bytes"], lin["dur_us"]) == ("aten::linear", 8388608.0, 327680.0, 3346.083)
    assert gemm["flops"].sum() == 7247757312.0


def test_dtensor_local_work_on_fsdp_tp():
    t = _load(DP_TP / "rank0.trace.json.gz")
    gemm = t.ops[t.ops["op_class"] == "gemm"]
    assert len(gemm) == 450 and gemm["flops"].sum() == 7851737088.0
    assert set(gemm["flops"]) == {8388608.0, 33554432.0}


# --- collective groups of a complete gloo capture ------------------------------------------------
# gloo records no process group per call (no record_param_comms on CPU), only each rank's
# pg_config: the groups come from the layout the bundle's manifest records.

def _comm(ops):
    return ops[(ops["op_class"] == "communication") & ops["msg_bytes"].notna()]


def test_gloo_bundle_groups_come_from_its_own_layout():
    c = _comm(_load(TP_PP).ops)
    # every sized call matched across its group's members (before: all the lower envelope, group ?)
    assert set(c["transfer_source"].astype(str)) == {"instance"} and c["transfer_why"].isna().all()
    assert set(c["group_size"]) == {2}
    inst = c.groupby("coll_instance").agg(ranks=("rank", lambda s: tuple(sorted(s))),
                                          kinds=("collective", lambda s: tuple(sorted(map(str, s)))))
    # all-reduces and all-gathers on the TP pairs; each send with the recv of its PP peer
    assert inst.value_counts().to_dict() == {
        ((0, 1), ("all_reduce", "all_reduce")): 156, ((2, 3), ("all_reduce", "all_reduce")): 156,
        ((2, 3), ("all_gather", "all_gather")): 12,
        ((0, 2), ("recv", "send")): 24, ((1, 3), ("recv", "send")): 24}
    # a recv issued while its batch's send span is still open keeps its c10d op's peer
    p2p = c[c["collective"].isin(["send", "recv"])]
    assert p2p["peer"].notna().all()
    for _, x in c.groupby("coll_instance"):
        s, d = x["start_us"].to_numpy(), x["dur_us"].to_numpy()
        if set(x["collective"]) == {"send", "recv"}:
            r = x[x["collective"] == "recv"].iloc[0]
            t = r["start_us"] + r["dur_us"] - s.max()  # from the later start to the recv's end
        else:
            t = d[s.argmax()]  # from the last member's start to its end
        assert np.allclose(x["transfer_us"], np.minimum(max(t, 0.0), d))
    # a barrier is no layout dimension's (a job barriers its world): its group stays unknown
    ops = _load(TP_PP).ops
    bar = ops[ops["collective"] == "barrier"]
    assert len(bar) == 24 and bar["group_size"].isna().all() and set(bar["transfer_why"].astype(str)) == {"ambiguous"}


def test_trace_info_shows_the_captured_groups():
    r = CliRunner().invoke(app, ["trace", "info", str(TP_PP), "--json"])
    assert r.exit_code == 0, r.output
    groups = {c["name"]: c["group_size"] for c in json.loads(r.output)["collectives"]}
    assert groups == {"all_gather": 2, "all_reduce": 2, "barrier": None, "recv": 2, "send": 2}


def _notes(paths, mesh=None):
    from simulator.calibrate.fit import read_sources

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [n for n in read_sources(paths, None, mesh=mesh).notes if "lower envelope" in n]


def test_calibrate_envelope_note_only_when_true():
    # the complete capture: no note (before: "4 collective size(s) ... (pass the other ranks'
    # traces, or --scenario for the groups)" although all ranks were there)
    assert _notes([TP_PP]) == []
    # tp=2 x dp=2: two 2-rank dimensions, and gloo names neither: the note says so, and not "--scenario"
    (note,) = _notes([DP_TP])
    assert "several of its dimensions could hold them" in note and "--scenario" not in note
    # a --scenario given for a bundle is its layout (it was dropped): tp=4 is not the job's
    (note,) = _notes([TP_PP], Mesh(tp=4, cp=1, ep=1, dp=1, pp=1))
    assert "no group of their kind and size among the ranks' process groups: give the --scenario the job ran" in note
    with pytest.raises(UserError, match="the scenario's layout has 8 ranks but the traces in .* come from a job of 4"):
        _notes([TP_PP], Mesh(tp=2, cp=1, ep=1, dp=2, pp=2))


def test_calibrate_scenario_advice_works_for_a_plain_folder(tmp_path):
    # The same ranks as a plain Kineto folder (no manifest, so no layout): the note's advice
    # (--scenario with the job's layout) is what removes it.
    if not TP_PP.exists():
        pytest.skip(f"needs the shipped bundle {TP_PP.name}")
    for k in range(4):
        shutil.copy(TP_PP / f"rank{k}.trace.json.gz", tmp_path / f"worker{k}.json.gz")
    (note,) = _notes([tmp_path])
    assert note.endswith("their calls record no process group (gloo records none): pass --scenario with the layout the job ran")
    sc = json.loads((TP_PP / "manifest.json").read_text())["scenario"]
    (tmp_path / "job.yaml").write_text(json.dumps({**sc, "cluster": {"gpus": 4}, "model": {**sc["model"], "top_k": 0}}))
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["calibrate", str(tmp_path), "--scenario", str(tmp_path / "job.yaml"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "lower envelope" not in r.output and out.exists()
