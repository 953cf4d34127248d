"""CPU (gloo) captures of torch's real parallel stack: collectives take their kind and sizes from
the c10d op that issued each gloo span, and DTensor ops count the work done on the local shard."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

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
