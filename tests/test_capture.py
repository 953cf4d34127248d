"""`clustersim capture` on CPU with gloo: each workload runs on 1-4 real ranks at tiny sizes and
its bundle re-reads (manifest, one Kineto trace per rank, parquet tables)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from simulator.capture.cli import capture_app  # noqa: E402
from simulator.errors import UserError  # noqa: E402
from simulator.topology.placement import Mesh  # noqa: E402
from simulator.trace.bundle import load_manifest  # noqa: E402

runner = CliRunner()


def capture(*args: str) -> None:
    res = runner.invoke(capture_app, list(args), catch_exceptions=True)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    assert res.exit_code == 0, res.output


def events(bundle: Path, rank: int) -> list[dict]:
    with gzip.open(bundle / f"rank{rank}.trace.json.gz", "rt") as f:
        trace = json.load(f)
    assert trace["schemaVersion"] == 1
    assert trace["distributedInfo"]["rank"] == rank
    return trace["traceEvents"]


def names(evs: list[dict]) -> Counter:
    return Counter(e.get("name") for e in evs if e.get("ph") == "X")


def check_bundle(bundle: Path, world: int, workload: str, spawned: bool = True) -> None:
    m = load_manifest(bundle)
    assert m.workload == workload and m.world_size == world and m.backend == "gloo"
    assert m.trace_files == [f"rank{r}.trace.json.gz" for r in range(world)]
    assert len(m.devices) == world and sum(m.device_counts.values()) == world
    assert m.torch_version and m.hosts
    files = {p.name for p in bundle.iterdir()}
    # Each spawned rank's stderr (torch profiler noise) is kept in the bundle, off the terminal.
    logs = {f"rank{r}.stderr.log" for r in range(world)} if spawned else set()
    assert files == {"manifest.json", *m.trace_files, *m.tables, *logs}
    # no temporary sibling is left behind
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(f".{bundle.name}.")]


def test_collectives_sweep(tmp_path: Path) -> None:
    out = tmp_path / "coll"
    capture("collectives", "--out", str(out), "--nproc", "2", "--min-bytes", "1024", "--max-bytes", "16384",
            "--iters", "3", "--warmup-iters", "1")
    check_bundle(out, 2, "collectives")
    df = pd.read_parquet(out / "collectives.parquet")
    assert list(df.columns) == ["collective", "size_bytes", "count", "dtype", "redop", "in_place", "time_us",
                                "algbw_GBps", "busbw_GBps", "nranks", "group_size", "backend"]
    sizes = [1024, 2048, 4096, 8192, 16384]
    assert len(df) == 6 * len(sizes)
    assert set(df["collective"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast"}
    assert (df["group_size"] == 2).all() and (df["nranks"] == 2).all() and (df["dtype"] == "float").all()
    for coll, g in df.groupby("collective"):
        assert sorted(g["size_bytes"]) == sizes
    expected = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                "send_recv": lambda n: 1.0, "broadcast": lambda n: 1.0}
    for row in df.itertuples():
        assert row.busbw_GBps == pytest.approx(row.algbw_GBps * expected[row.collective](row.group_size), rel=1e-12)
    assert ((df["algbw_GBps"] - df["size_bytes"] / 1e9 / (df["time_us"] * 1e-6)).abs() < 1e-9).all()
    # nccl-tests' count: per rank for all-gather / reduce-scatter, per peer for all-to-all
    per_rank = df["collective"].isin(["all_gather", "reduce_scatter", "all_to_all"])
    assert (df.loc[per_rank, "count"] * 2 * 4 == df.loc[per_rank, "size_bytes"]).all()
    assert (df.loc[~per_rank, "count"] * 4 == df.loc[~per_rank, "size_bytes"]).all()
    assert (df["time_us"] > 0).all()

    for rank in range(2):
        evs = events(out, rank)
        c = names(evs)
        assert c["aten::ones"] > 0  # aten ops are recorded
        # c10d ops carry the tensor shapes (gloo writes no record_param_comms): check message sizes there
        for sweep, op in (("all_reduce", "c10d::allreduce_"), ("broadcast", "c10d::broadcast_"),
                          ("all_gather", "c10d::_allgather_base_"), ("reduce_scatter", "c10d::_reduce_scatter_base_"),
                          ("all_to_all", "c10d::alltoall_base_"), ("send_recv", "c10d::send"),
                          ("send_recv", "c10d::recv_")):
            assert c[f"sweep:{sweep}:16384B:g2"] == 1
            assert c[op] == (1 + 3) * len(sizes), (op, c[op])  # 1 warm-up + 3 timed calls per size
        dims = {op: sorted(str(e["args"]["Input Dims"][:2]) for e in evs if e.get("name") == op)[::4]
                for op in ("c10d::allreduce_", "c10d::_allgather_base_", "c10d::_reduce_scatter_base_")}
        assert dims["c10d::allreduce_"] == sorted(str([[[s // 4]], []]) for s in sizes)
        # all-gather (out, in): each rank contributes size / n; reduce-scatter (out, in) the reverse
        assert dims["c10d::_allgather_base_"] == sorted(str([[s // 4], [s // 8]]) for s in sizes)
        assert dims["c10d::_reduce_scatter_base_"] == sorted(str([[s // 8], [s // 4]]) for s in sizes)
        # gloo's own annotation runs on its worker thread, around the transfer
        assert c["gloo:all_reduce"] >= c["c10d::allreduce_"] and c["gloo:all_to_all"] == c["c10d::alltoall_base_"]


def test_compute_grid(tmp_path: Path) -> None:
    out = tmp_path / "comp"
    capture("compute", "--out", str(out), "--hidden-sizes", "128", "--tokens", "32", "--tp-sizes", "1,2",
            "--vocab-sizes", "128", "--adamw-numels", "4096", "--min-time-s", "0.0005", "--max-repeats", "5")
    check_bundle(out, 1, "compute")
    df = pd.read_parquet(out / "compute.parquet")
    for col in ("op", "shape", "params", "flops", "bytes", "dtype", "time_us", "repeats"):
        assert col in df.columns
    ops = Counter(df["op"])
    assert ops["gemm"] == 2 * 4 * 3  # 2 TP splits x 4 projections x fwd/dgrad/wgrad
    assert ops["sdpa"] == 2 * 2 and ops["cross_entropy"] == 1 and ops["adamw"] == 1
    for op in ("layernorm", "rmsnorm", "gelu", "swiglu"):
        assert ops[op] == 1
    g = df[df["op"] == "gemm"]
    assert (g["flops"] == 2.0 * g["m"] * g["n"] * g["k"]).all()
    qkv = g[(g["role"] == "qkv") & (g["pass"] == "fwd") & (g["tp"] == 2)].iloc[0]
    assert (qkv["m"], qkv["k"], qkv["n"]) == (32, 128, 192)
    assert (df["time_us"] > 0).all() and (df["repeats"] >= 3).all()
    c = names(events(out, 0))
    assert c["aten::mm"] > 0 and c["compute:gemm:qkv:fwd:32x128x192"] == 1
    assert c["aten::_scaled_dot_product_flash_attention_for_cpu"] > 0 or c["aten::scaled_dot_product_attention"] > 0


def test_train_tp2_pp2_1f1b(tmp_path: Path) -> None:
    out = tmp_path / "tp2pp2"
    capture("train", "--out", str(out), "--nproc", "4", "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--zero", "3",
            "--steps", "2", "--warmup-steps", "0", "--num-layers", "2", "--hidden-size", "32", "--seq-length", "16",
            "--vocab-size", "64")
    check_bundle(out, 4, "train")
    m = load_manifest(out)
    assert m.scenario["parallelism"] == {"tp": 2, "pp": 2, "vpp": 1, "cp": 1, "ep": 1, "dp": 1, "zero": 3,
                                         "sequence_parallel": False}
    assert m.scenario["batch"] == {"micro_batch_size": 1, "global_batch_size": 4, "seq_length": 16}
    assert m.scenario["schedule"] == "1f1b" and m.scenario["model"]["num_layers"] == 2
    assert [s.step for s in m.step_times] == [0, 1] and all(s.wall_s > 0 for s in m.step_times)
    mesh = Mesh(tp=2, cp=1, ep=1, dp=1, pp=2)
    for rank in range(4):
        evs = events(out, rank)
        c = names(evs)
        assert c["aten::mm"] > 0 and c["ProfilerStep#0"] == 1 and c["ProfilerStep#1"] == 1
        # TP: row-parallel outputs are all-reduced over the TP pair
        assert c["c10d::allreduce_"] > 0
        # PP: 2 steps x 4 microbatches of [mb, seq, hidden] cross the stage boundary each way
        # (activations forward, their gradients back); the rest is the first step's shape exchange
        p2p = Counter((e["name"], str(e["args"]["Input Dims"][0])) for e in evs
                      if e.get("name") in ("c10d::send", "c10d::recv_"))
        assert p2p[("c10d::send", "[[1, 16, 32]]")] == 8 and p2p[("c10d::recv_", "[[1, 16, 32]]")] == 8
        pp_rank = int(mesh.coords[rank][0])
        pgs = {pg["pg_desc"]: pg["ranks"] for pg in json.loads(json.dumps(_trace_meta(out, rank)["pg_config"]))}
        tp_group = next(list(map(int, g)) for g in mesh.groups("tp") if rank in g)
        pp_group = next(list(map(int, g)) for g in mesh.groups("pp") if rank in g)
        assert pgs["mesh_tp"] == tp_group and pgs["mesh_pp"] == pp_group
        assert pp_rank in (0, 1)

    # and the bundle re-imports through the Kineto importer
    from simulator.trace.loader import load_trace

    ts = load_trace(out)
    assert ts.ranks == [0, 1, 2, 3] and ts.world_size == 4
    ops = ts.ops
    assert {"gemm", "communication"} <= set(ops["op_class"].dropna())
    for rank in range(4):
        mine = ops[ops["rank"] == rank]
        assert {"all_reduce", "send", "recv"} <= set(mine["collective"].dropna())
        sends = mine[(mine["collective"] == "send") & (mine["msg_bytes"] == 1 * 16 * 32 * 4)]
        assert len(sends) == 8


def _trace_meta(bundle: Path, rank: int) -> dict:
    with gzip.open(bundle / f"rank{rank}.trace.json.gz", "rt") as f:
        return json.load(f)["distributedInfo"]


def test_train_moe_ep2_fsdp(tmp_path: Path) -> None:
    out = tmp_path / "moe"
    capture("train", "--out", str(out), "--nproc", "2", "--ep", "2", "--num-experts", "4", "--top-k", "2", "--zero", "3",
            "--mlp", "swiglu", "--steps", "2", "--warmup-steps", "0", "--num-layers", "2", "--hidden-size", "32",
            "--seq-length", "16", "--vocab-size", "64")
    check_bundle(out, 2, "train")
    m = load_manifest(out)
    assert m.scenario["model"]["num_experts"] == 4 and m.scenario["model"]["mlp"] == "swiglu"
    assert m.scenario["parallelism"]["ep"] == 2 and m.scenario["parallelism"]["dp"] == 2
    for rank in range(2):
        c = names(events(out, rank))
        # per step, layer and microbatch: token counts, dispatch and combine forward, both again backward
        assert c["c10d::alltoall_base_"] == 2 * 2 * 2 * 5
        # FSDP2: parameters all-gathered, gradients reduce-scattered over the dp pair
        assert c["c10d::_allgather_base_"] > 0 and c["c10d::_reduce_scatter_base_"] > 0
        # torchtitan's default optimizer.implementation: torch's fused AdamW, once a parameter group a step
        assert c["aten::_fused_adamw_"] > 0 and c["aten::_foreach_addcdiv_"] == 0
    assert m.scenario["framework"] == "torchtitan" and m.scenario["optimizer"] == {"implementation": "fused"}


def test_train_llama_runs_and_declares_torchtitans_recipe(tmp_path: Path) -> None:
    """A SwiGLU capture is torchtitan's Llama 3 on torchtitan's stack, and its scenario says so:
    RoPE through complex pairs (view_as_complex), grouped-query K/V repeated out (expand), full bf16
    training (bf16 parameters, no fp32 copy) with FSDP2 reducing gradients in fp32, and the AdamW
    implementation asked for; the scenario it records builds as a torchtitan run."""
    from simulator.scenario import build_scenario

    out = tmp_path / "llama"
    capture("train", "--out", str(out), "--nproc", "2", "--zero", "3", "--mlp", "swiglu", "--dtype", "bf16",
            "--optimizer", "foreach", "--num-kv-heads", "2", "--steps", "1", "--warmup-steps", "0", "--num-layers", "2",
            "--hidden-size", "32", "--seq-length", "16", "--vocab-size", "64")
    check_bundle(out, 2, "train")
    m = load_manifest(out)
    sc = m.scenario
    assert (sc["framework"], sc["training_dtype"], sc["torch_compile"], sc["recompute"]) == \
        ("torchtitan", "bfloat16", False, "none")
    assert sc["optimizer"] == {"implementation": "foreach"} and sc["attention_kernel"] == "default"  # no GPU kernel on CPU
    assert sc["torch_version"] == m.torch_version  # what its eager kernels fuse
    built = build_scenario(sc | {"cluster": {"gpus": 2}})  # validate adds the cluster the bundle ran on
    assert built.framework == "torchtitan" and built.model.kv_heads == 2
    for rank in range(2):
        evs = events(out, rank)
        c = names(evs)
        # q and k, 2 layers, 2 microbatches, forward and backward (view_as_real's gradient)
        assert c["aten::view_as_complex"] == 2 * 2 * 2 * 2
        assert c["aten::expand"] >= 2 * 2 * 2  # k and v, two layers
        assert c["aten::_foreach_addcdiv_"] > 0 and c["aten::_fused_adamw_"] == 0
        rs = [e for e in evs if e.get("name") == "c10d::_reduce_scatter_base_"]
        assert rs and all(e["args"]["Input type"][0] == "float" for e in rs)  # fp32 reduction of bf16 gradients
        mm = [e for e in evs if e.get("name") == "aten::mm"]
        assert mm and all(e["args"]["Input type"][0] == "c10::BFloat16" for e in mm)


def test_bad_requests_fail_before_spawning(tmp_path: Path) -> None:
    existing = tmp_path / "exists"
    existing.mkdir()
    bad = [
        (["train", "--out", str(existing)], "already exists"),
        (["train", "--out", str(tmp_path / "a"), "--nproc", "4", "--tp", "3"], "--nproc 4"),
        (["train", "--out", str(tmp_path / "a"), "--nproc", "2", "--cp", "2"], "--cp 2"),
        (["train", "--out", str(tmp_path / "a"), "--nproc", "4", "--tp", "2", "--ep", "2", "--num-experts", "4"], "--tp 2"),
        (["train", "--out", str(tmp_path / "a"), "--nproc", "2", "--pp", "2", "--schedule", "dualpipe"], "dualpipe"),
        (["train", "--out", str(tmp_path / "a"), "--nproc", "2", "--pp", "2", "--num-layers", "3"], "--num-layers 3"),
        (["train", "--out", str(tmp_path / "a"), "--nproc", "2", "--tp", "2", "--mlp", "swiglu"], "--sequence-parallel"),
        (["train", "--out", str(tmp_path / "a"), "--nproc", "1", "--optimizer", "adam8bit"], "--optimizer 'adam8bit'"),
        (["collectives", "--out", str(tmp_path / "a"), "--nproc", "1"], "at least 2 ranks"),
        (["bogus", "--out", str(tmp_path / "a")], "bogus"),
    ]
    for args, text in bad:
        with pytest.raises(UserError, match=text.replace("-", r"\-")) as exc:
            capture(*args)
        assert "\n" not in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_force_replaces_only_a_bundle(tmp_path: Path, monkeypatch) -> None:
    """--force replaced any folder, the working folder included (its files deleted, then a false
    error): it now replaces only a bundle an earlier capture wrote, or an empty folder."""
    from simulator.capture.harness import check_out_dir

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    cases = [(precious, "not a trace bundle"), (Path("."), "the working folder"), (tmp_path, "the working folder"),
             (afile / "out", "is a file, not a folder"), ("", "--out is empty")]
    for out, text in cases:
        with pytest.raises(UserError, match=text) as exc:
            check_out_dir(out, True)
        assert "\n" not in str(exc.value)
    with pytest.raises(UserError, match=r"already exists \(a folder\): choose another folder$"):
        check_out_dir(precious, False)  # no advice to --force a folder that is not a bundle
    assert (precious / "thesis.txt").read_text() == "years of work"
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text("{}")
    check_out_dir(bundle, True)  # an earlier capture's bundle may be replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    check_out_dir(empty, True)
    with pytest.raises(UserError, match="--timeout-s 1e-06 must be at least 1 second"):
        capture("collectives", "--out", str(tmp_path / "c"), "--nproc", "2", "--timeout-s", "0.000001")


def test_failed_capture_leaves_no_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLUSTERSIM_CAPTURE_FAIL_RANK", "1")
    with pytest.raises(RuntimeError, match="injected failure"):
        capture("collectives", "--out", str(tmp_path / "x"), "--nproc", "2", "--max-bytes", "1024", "--iters", "1",
                "--warmup-iters", "0", "--collectives", "all_reduce")
    assert list(tmp_path.iterdir()) == []


def test_torchrun_mode_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One rank as torchrun would start it: the harness reads RANK/WORLD_SIZE/LOCAL_RANK itself.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "tr"
    capture("compute", "--out", str(out), "--hidden-sizes", "64", "--tokens", "16", "--tp-sizes", "1",
            "--vocab-sizes", "64", "--adamw-numels", "256", "--min-time-s", "0", "--max-repeats", "3")
    check_bundle(out, 1, "compute", spawned=False)
    capture("compute", "--out", str(out), "--force", "--hidden-sizes", "64", "--tokens", "16", "--tp-sizes", "1",
            "--vocab-sizes", "64", "--adamw-numels", "256", "--min-time-s", "0", "--max-repeats", "3")
    check_bundle(out, 1, "compute", spawned=False)


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, simulator, simulator.capture.cli, simulator.trace.bundle; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
