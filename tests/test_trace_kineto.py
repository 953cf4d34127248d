"""Golden facts about the reference Kineto traces (checked by hand against the raw JSON), the
hand-made new-NCCL trace and a real 2-rank gloo capture."""

import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest

from simulator.trace.kineto import import_kineto
from simulator.trace.loader import load_trace
from simulator.trace.optable import OPTABLE_COLUMN_NAMES

REF = Path(__file__).parent / "data" / "reference" / "kineto"
DATA = Path(__file__).parent / "data" / "trace"


def _load(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_kineto(REF / name)


@pytest.fixture(scope="module")
def nccl_data():
    return _load("hta_nccl_data_a100_rank0of2.json.gz")


@pytest.fixture(scope="module")
def a100():
    return _load("hta_a100_rank0of16.json.gz")


@pytest.fixture(scope="module")
def sampled0():
    return _load("hta_sampled_rank0of128.json.gz")


def _coll_counts(ops):
    c = ops[ops["op_class"] == "communication"]
    g = c.groupby(["collective", "msg_bytes"], observed=True).size()
    return {(k[0], int(k[1])): int(v) for k, v in g.items()}


def test_columns(nccl_data):
    assert tuple(nccl_data.ops.columns) == OPTABLE_COLUMN_NAMES


def test_nccl_data_new_style(nccl_data):
    t = nccl_data
    ops = t.ops
    assert (t.n_events, len(ops), t.rank, t.world_size, t.backend) == (40573, 3774, 0, 2, "nccl")
    assert t.devices == ["NVIDIA A100-PG509-200"]
    assert ops["category"].value_counts().to_dict() == {"kernel": 2700, "gpu_memcpy": 960, "gpu_memset": 114}
    comm = ops[ops["op_class"] == "communication"]
    assert comm["name"].astype(str).str.split("(").str[0].value_counts().to_dict() == {
        "ncclKernel_AllReduce_RING_LL_Sum_float": 15, "ncclKernel_Broadcast_RING_LL_Sum_int8_t": 6}
    assert set(comm["stream"]) == {40}
    assert _coll_counts(ops) == {
        ("all_reduce", 8196000): 3, ("all_reduce", 9724160): 3, ("all_reduce", 26255360): 3,
        ("all_reduce", 26550272): 3, ("all_reduce", 31502336): 3,
        ("broadcast", 424): 3, ("broadcast", 212480): 3,
    }
    assert set(comm["group_size"]) == {2}
    assert set(comm["group_ranks"]) == {"[0, 1]"}
    assert set(comm["coll_source"]) == {"kernel_args"}
    assert set(comm["cpu_op"]) == {"record_param_comms"}  # linked by External id
    # the kernel in FORMATS.md §2.3: allreduce of 6637568 floats
    k = comm[comm["external_id"] == 12945].iloc[0]
    assert (k["correlation"], k["msg_bytes"], k["dtype"], k["dur_us"]) == (60047, 6637568 * 4, "float32", 2636.669)
    # relative ts + baseTimeNanoseconds -> epoch ns
    assert k["start_abs_ns"] == 1711964646000000000 + 4458677009853422
    assert sorted(ops["step"].unique()) == [4, 5, 6]


def test_a100_old_style(a100):
    ops = a100.ops
    assert (a100.n_events, len(ops), a100.rank, a100.world_size) == (108936, 7747, 0, 16)
    assert a100.devices == ["NVIDIA A100-SXM4-80GB"]
    assert ops["category"].value_counts().to_dict() == {"kernel": 6080, "gpu_memcpy": 1390, "gpu_memset": 277}
    comm = ops[ops["op_class"] == "communication"]
    assert len(comm) == 80 and set(comm["name"].str.startswith("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t")) == {True}
    assert comm["collective"].value_counts().to_dict() == {
        "all_to_all": 45, "all_gather": 10, "all_reduce": 10, "reduce_scatter": 10, "send_recv": 5}
    counts = _coll_counts(ops)
    assert counts[("all_reduce", 1791693584)] == 5      # 447923396 floats
    assert counts[("all_reduce", 1465344)] == 5
    assert counts[("reduce_scatter", 100663296)] == 5   # input [65536, 384] float
    assert counts[("all_gather", 16777216)] == 5        # 524288 floats in, x 8 ranks out
    assert counts[("all_to_all", 384)] == 5             # 48 longs
    # group size of *_base collectives from the c10d op's output/input ratio
    assert set(comm[comm["collective"].isin(["all_gather", "reduce_scatter"])]["group_size"]) == {8}
    assert comm[comm["collective"] == "all_reduce"]["group_size"].isna().all()
    assert sorted(comm["stream"].unique()) == [84, 285, 363]
    assert sorted(s for s in ops["step"].unique() if s >= 0) == [550, 551, 552, 553, 554]
    assert a100.origin_ns == 1683564901549715000  # absolute epoch µs -> ns


def test_a100_warns_about_unlinked_kernels():
    with pytest.warns(UserWarning, match=r"962 of 7747 GPU events have no launching CPU op"):
        import_kineto(REF / "hta_a100_rank0of16.json.gz")


def test_sampled_rank0(sampled0):
    ops = sampled0.ops
    assert (sampled0.n_events, len(ops), sampled0.rank, sampled0.world_size) == (4855, 1204, 0, 128)
    assert sampled0.devices == ["GPU 0 (unnamed)"]  # no deviceProperties in this file
    assert _coll_counts(ops) == {
        ("all_gather", 1073741824): 2,   # 16777216 int8 in, group 64
        ("all_reduce", 22866616): 1, ("all_reduce", 78473228): 1, ("all_reduce", 105033720): 1,
        ("all_reduce", 107822144): 1,
        ("all_to_all", 3072): 1, ("all_to_all", 11386880): 1, ("all_to_all", 419430400): 2,
    }
    ag = ops[ops["collective"] == "all_gather"]
    assert set(ag["group_size"]) == {64} and set(ag["dtype"]) == {"int8"}
    # 432 before fbgemm embedding/permute kernels stopped matching "gemm" (46 of them)
    assert int((ops["op_class"] == "gemm").sum()) == 386


def test_sampled_pair_as_folder(tmp_path):
    for r in (0, 1):
        shutil.copy(REF / f"hta_sampled_rank{r}of128.json.gz", tmp_path / f"worker{r}.json.gz")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = load_trace(tmp_path)
    assert ts.ranks == [0, 1] and ts.world_size == 128
    assert ts.devices == ["GPU 0 (unnamed)", "GPU 1 (unnamed)"]
    assert ts.ops.groupby("rank").size().to_dict() == {0: 1204, 1: 1154}
    # one time base for the job: rank 0 starts first here
    assert ts.ops["start_us"].min() == 0.0
    first = ts.ops.groupby("rank")["start_abs_ns"].min()
    assert first[1] - first[0] == 153000


def test_new_nccl_handmade():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = import_kineto(DATA / "nccl_devkernel_new.json")
    ops = t.ops.set_index("correlation")
    assert (t.rank, t.devices) == (5, ["NVIDIA H100 80GB HBM3"])
    gemm = ops.loc[501]
    assert (gemm["op_class"], gemm["cpu_op"], gemm["flops"], gemm["bytes"], gemm["dtype"]) == (
        "gemm", "aten::mm", 2 * 4096 * 1024 * 2048, 2 * (4096 * 1024 + 1024 * 2048 + 4096 * 2048), "bfloat16")
    rs = ops.loc[502]
    assert (rs["collective"], rs["msg_bytes"], rs["out_msg_bytes"], rs["group_size"], rs["seq"], rs["pg_name"], rs["dtype"]) == (
        "reduce_scatter", 16777216, 2097152, 8, 17, "3", "bfloat16")
    assert rs["coll_source"] == "record_param_comms"
    send = ops.loc[503]
    assert (send["collective"], send["msg_bytes"], send["stream"]) == ("send", 2097152, 44)
    assert ops.loc[504, "op_class"] == "memcpy"
    assert list(t.ops["step"]) == [3, 3, 3, 3]
    assert t.ops["start_us"].tolist() == [0.0, 199.5, 549.5, 699.5]


def test_gloo_cpu_bundle():
    ts = load_trace(DATA / "gloo_bundle")
    assert ts.manifest is not None and ts.manifest.backend == "gloo"
    assert (ts.ranks, ts.devices, ts.world_size, len(ts.ops)) == ([0, 1], ["cpu", "cpu"], 2, 106)
    ops = ts.ops
    assert ops.groupby("op_class", observed=True).size().to_dict() == {
        "gemm": 4, "attention": 4, "elementwise": 18, "norm": 4, "optimizer": 2, "communication": 18, "other": 56}
    r0 = ops[(ops["rank"] == 0) & (ops["op_class"] == "communication")]
    assert _coll_counts(r0) == {
        ("all_gather", 8000): 1, ("all_reduce", 20): 1, ("all_reduce", 4000): 2, ("reduce_scatter", 4000): 1,
        ("all_to_all", 4000): 1, ("broadcast", 4000): 1, ("send", 1024): 1}
    assert set(r0["group_size"]) == {2}
    assert r0["collective"].value_counts()["barrier"] == 1
    r1 = ops[(ops["rank"] == 1) & (ops["collective"] == "recv")]
    assert r1["msg_bytes"].tolist() == [1024]
    lin = ops[(ops["name"] == "aten::linear") & (ops["rank"] == 0)].iloc[0]
    assert (lin["flops"], lin["bytes"], lin["dur_us"]) == (2 * 64 * 64 * 128, 81920.0, 19065.392)
    sdpa = ops[(ops["name"] == "aten::scaled_dot_product_attention") & (ops["rank"] == 0)].iloc[0]
    assert sdpa["flops"] == 2 * 4 * 2 * 16 * 16 * (64 + 64)
    assert ops[ops["dtype"] == "bfloat16"]["collective"].tolist() == ["all_reduce", "all_reduce"]


def test_unknown_collective_is_named():
    with pytest.warns(UserWarning, match=r"unknown collective names kept as collective 'other': 'gloo:frobnicate' x1"):
        t = import_kineto(DATA / "unknown_collective.json")
    assert t.rank == 3
    assert t.ops["collective"].tolist()[1:] == ["other", "all_reduce"]
    assert pd.isna(t.ops["collective"].iloc[0])
    assert t.ops["msg_bytes"].tolist()[2] == 512
    assert t.ops["flops"].tolist()[0] == 2 * 64 * 32 * 16


def test_kernels_without_cpu_ops(tmp_path):
    """A trace profiled with activities=[CUDA] only (no cpu_op): the kernels import, classed by
    their names (it raised IndexError)."""
    import gzip
    import json

    with gzip.open(REF / "hta_nccl_data_a100_rank0of2.json.gz", "rt") as f:
        trace = json.load(f)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") != "cpu_op"]
    path = tmp_path / "kernels_only.json"
    path.write_text(json.dumps(trace))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = import_kineto(path)
    kernels = t.ops[t.ops["kind"] == "kernel"] if "kind" in t.ops else t.ops
    assert len(kernels) > 1000
    assert {"gemm", "communication"} <= set(t.ops["op_class"])
    assert any("no launching CPU op" in str(w.message) for w in caught)
