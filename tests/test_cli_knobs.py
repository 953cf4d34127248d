"""Every knob reachable from the CLI (issue 12): --set into presets, topologies and profiles,
the what-if flags, Megatron's long flag names, nccl-tests' flag names for `collective`, one JSON
object, no dashboard under --json unless asked, progress only on a terminal, plurals.

Commands run through the real CLI (typer's CliRunner in-process, or a subprocess where the exit
status and stderr of ``clustersim`` itself matter).
"""

from __future__ import annotations

import inspect
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import simulator.simulate
from simulator.profile import Profile
from simulator.cli import app, group_links
from simulator.scenario import ParallelConfig, Scenario, load_scenario
from simulator.topology.spec import TopologySpec
from simulator.words import plural

REPO = Path(__file__).resolve().parents[1]
# Llama-3-8B on two DGX H100 nodes: TP4 inside a node, PP2, DP2; simulates in well under a second.
SMALL = ["--model", "llama3-8b", "--gpus", "16", "--tp", "4", "--pp", "2", "--global-batch-size", "8",
         "--seq-length", "2048"]


class _Stop(Exception):
    pass


def scenario_of(args: list[str], monkeypatch: pytest.MonkeyPatch) -> Scenario:
    """The Scenario `clustersim simulate ARGS` would simulate (the simulation itself is skipped)."""
    seen: list[Scenario] = []

    def record(sc, mode="reduced", progress=None, fast_forward=False):
        seen.append(sc)
        raise _Stop

    monkeypatch.setattr(simulator.simulate, "simulate", record)
    res = CliRunner().invoke(app, ["simulate", *args, "--no-dashboard"])
    assert isinstance(res.exception, _Stop), res.output
    return seen[0]


def simulate_json(args: list[str], cwd: Path | None = None) -> dict:
    if cwd is not None:
        old = os.getcwd()
        os.chdir(cwd)
    try:
        res = CliRunner().invoke(app, ["simulate", *args, "--json"])
    finally:
        if cwd is not None:
            os.chdir(old)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def clustersim(*args: str, cwd: Path | None = None, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "simulator.cli", *args], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=stderr, timeout=300)


# ------------------------------------------------------------------------------------ --set paths

def test_set_reaches_into_a_preset_model(monkeypatch):
    sc = scenario_of([*SMALL, "--set", "model.num_layers=4"], monkeypatch)
    base = scenario_of(SMALL, monkeypatch)
    assert sc.model.num_layers == 4 and base.model.num_layers == 32
    # the rest of the preset is kept
    assert sc.model.model_dump(exclude={"num_layers"}) == base.model.model_dump(exclude={"num_layers"})


def test_set_model_field_changes_the_prediction():
    base = simulate_json(SMALL)
    small = simulate_json([*SMALL, "--set", "model.num_layers=4"])
    # 4 of 32 layers: the step is several times shorter (embedding and LM head stay)
    assert small["step_time_s"] < base["step_time_s"] / 3


def test_set_reaches_into_a_named_topology(monkeypatch):
    sc = scenario_of([*SMALL, "--set", "cluster.topology.node.nic_gbps=200"], monkeypatch)
    topo = sc.cluster.topology
    assert isinstance(topo, TopologySpec)
    assert topo.node.nic_gbps == 200 and topo.node.nvlink_GBps == 450
    # Named as changed, so reports do not present it as the stock topology.
    assert sc.cluster.topology_name == topo.name == "dgx-h100-fattree with node.nic_gbps=200"


def test_slower_nics_slow_a_cross_node_data_parallel_step():
    # TP8 inside a node, DP2 across two nodes: the gradient reduction crosses the NICs.
    args = ["--model", "llama3-8b", "--gpus", "16", "--tp", "8", "--pp", "1", "--global-batch-size", "4",
            "--seq-length", "2048", "--zero", "0"]
    fast = simulate_json(args)
    slow = simulate_json([*args, "--nic-gbps", "10"])
    assert slow["exposed_comm_s"]["dp"] > 2 * fast["exposed_comm_s"]["dp"]
    assert slow["step_time_s"] > fast["step_time_s"]


def test_a_latency_nccls_model_ignores_is_named_and_its_own_knob_works(monkeypatch):
    # Found by a metamorphic pass: a 1 ms NIC latency left the step bit-identical without a word
    # (NCCL's model times every transfer on a GPU with its own latencies).
    args = ["--model", "llama3-8b", "--gpus", "16", "--tp", "8", "--pp", "1", "--global-batch-size", "4",
            "--seq-length", "2048", "--zero", "0", "--findings-budget-s", "0"]
    res = CliRunner().invoke(app, ["simulate", *args, "--no-dashboard", "--set", "cluster.topology.node.nic_latency_us=1000"])
    assert res.exit_code == 0, res.output
    notes = [line for line in res.stderr.splitlines() if "nic_latency_us" in line and line.startswith("note: ")]
    assert notes and "is not used on NVIDIA H100 80GB HBM3" in notes[0] and "comm.nccl.net_latency_us" in notes[0]
    # On a torus there is no NCCL model: the links' latencies time it, and no note says otherwise.
    res = CliRunner().invoke(app, ["simulate", "--model", "llama3-8b", "--gpus", "64", "--tp", "2", "--pp", "1",
                                   "--global-batch-size", "64", "--seq-length", "2048", "--findings-budget-s", "0",
                                   "--topology", "torus-3d", "--no-dashboard", "--set", "cluster.topology.node.nic_latency_us=1000"])
    assert res.exit_code == 0, res.output
    assert "is not used on" not in res.stderr
    # The knob it names reaches into the profile's unset comm.nccl section (was "'cluster.gpu.comm.nccl'
    # is None, not a section") and slows the cross-node gradient all-reduce.
    base, slow = simulate_json(args), simulate_json([*args, "--set", "cluster.gpu.comm.nccl.net_latency_us=1000"])
    assert slow["exposed_comm_s"]["dp"] > base["exposed_comm_s"]["dp"] + 1e-3
    sc = scenario_of([*args, "--set", "cluster.gpu.comm.nccl.net_latency_us=1000"], monkeypatch)
    assert sc.cluster.gpu.comm.nccl.net_latency_us == 1000 and sc.cluster.gpu.comm.nccl.latency_scale == 1.0


def test_a_nic_faster_than_its_pcie_path_does_not_slow_the_step():
    # Was 0.31375 -> 0.31552 -> 0.31747 s at 800 -> 1,000 -> 1,200 Gb/s (64 H100, TP2 PP4 DP8): the
    # flows ran past the GPU-NIC PCIe path NCCL's time stops at, and the byte scaling that matches
    # them to NCCL's time inflated the collectives' NVLink phases against TP.
    scenario = str(REPO / "tests" / "data" / "scenarios" / "small-llama.yaml")
    steps = [simulate_json([scenario, "--findings-budget-s", "0", "--no-dashboard", "--nic-gbps", str(g)])["step_time_s"]
             for g in (400, 800, 1000, 1600)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(steps, steps[1:])), steps


def test_link_efficiencies_do_not_move_a_step_nccls_model_times():
    # Was: a lower nic_efficiency made the step faster (0.3: 0.32557 s, 1.0: 0.32649 s). Under
    # NCCL's model the isolated times are NCCL's; the efficiencies only shifted the byte scaling
    # between a collective's NVLink and NIC phases. NCCL's own scales are the knobs now.
    scenario = str(REPO / "tests" / "data" / "scenarios" / "small-llama.yaml")
    run = [scenario, "--findings-budget-s", "0", "--no-dashboard"]
    steps = {e: simulate_json([*run, "--set", f"cluster.gpu.comm.nic_efficiency={e}"])["step_time_s"] for e in (0.3, 1.0)}
    assert steps[0.3] == steps[1.0]
    slower = simulate_json([*run, "--set", "cluster.gpu.comm.nccl.inter_bw_scale=0.3"])["step_time_s"]
    assert slower > steps[1.0]


def test_oversubscribed_leaves_slow_a_data_parallel_step_nccl_times():
    # Was the same step at 1:1 and 32:1 (0.7650 s): NCCL's time assumes a non-blocking fabric,
    # and the flows were normalised to it on the oversubscribed one. 32 nodes, DP over 4+ leaves.
    args = ["--model", "llama3-8b", "--gpus", "256", "--tp", "8", "--pp", "1", "--global-batch-size", "256",
            "--seq-length", "4096", "--zero", "1", "--findings-budget-s", "0", "--no-dashboard"]
    steps = [simulate_json([*args, "--leaf-oversubscription", str(o)]) for o in (1, 8, 32)]
    dp = [s["exposed_comm_s"]["dp"] for s in steps]
    assert steps[0]["step_time_s"] < steps[1]["step_time_s"] < steps[2]["step_time_s"]
    assert dp[0] < dp[1] < dp[2] and dp[2] > 5 * dp[0]


def test_set_reaches_into_a_named_profile(monkeypatch):
    sc = scenario_of([*SMALL, "--set", "cluster.gpu.compute.peak_tflops=500"], monkeypatch)
    prof = sc.cluster.gpu
    assert isinstance(prof, Profile) and prof.name == "h100-sxm-80gb with compute.peak_tflops=500" and prof.compute.peak_tflops == 500
    # the profile says that this number is a what-if, not the datasheet's
    item = prof.provenance.items[-1]
    assert item.field == "compute.peak_tflops" and item.value == 500 and "what-if" in item.source


def test_lower_peak_flops_slow_the_step():
    base = simulate_json(SMALL)
    slow = simulate_json([*SMALL, "--peak-tflops", "300"])
    assert slow["step_time_s"] > 1.5 * base["step_time_s"]


def test_set_into_a_profile_kernel_model(monkeypatch):
    # (the class curves of a profile with a kernel model are not read: setting them is refused,
    # tests/test_cli_bad_input.py)
    sc = scenario_of([*SMALL, "--set", "cluster.gpu.compute.kernels.gemm_efficiency.bf16=0.5"], monkeypatch)
    assert sc.cluster.gpu.compute.kernels.gemm_efficiency["bf16"] == 0.5


@pytest.mark.parametrize("flag, value, path", [
    ("--nic-gbps", "200", "cluster.topology.node.nic_gbps"),
    ("--nvlink-GBps", "300", "cluster.topology.node.nvlink_GBps"),
    ("--leaf-oversubscription", "2", "cluster.topology.fabric.leaf_oversubscription"),
    ("--spine-oversubscription", "3", "cluster.topology.fabric.spine_oversubscription"),
    ("--peak-tflops", "500", "cluster.gpu.compute.peak_tflops"),
    ("--hbm-GBps", "2000", "cluster.gpu.compute.hbm_GBps"),
    ("--hbm-gib", "40", "cluster.gpu.hbm_gib"),
])
def test_what_if_flag_equals_its_set_path(flag, value, path, monkeypatch):
    by_flag = scenario_of([*SMALL, flag, value], monkeypatch)
    by_set = scenario_of([*SMALL, "--set", f"{path}={value}"], monkeypatch)
    base = scenario_of(SMALL, monkeypatch)
    assert by_flag.model_dump(mode="json") == by_set.model_dump(mode="json")
    assert by_flag.model_dump(mode="json") != base.model_dump(mode="json")
    node = by_flag.model_dump(mode="json")
    for key in path.split("."):
        node = node[key]
    assert node == float(value)


def test_what_if_flag_works_on_a_topology_file_and_an_inline_one(tmp_path, monkeypatch):
    (tmp_path / "s.yaml").write_text(
        "model: llama3-8b\nparallelism: {tp: 4, pp: 2}\nbatch: {global_batch_size: 8, seq_length: 2048}\n"
        "cluster:\n  gpus: 16\n  topology: {name: mine, node: {kind: dgx-h100, gpus_per_node: 8, nvlink_GBps: 450,"
        " nvlink_latency_us: 0.7, nics_per_node: 8, nic_gbps: 400, nic_latency_us: 2.0}}\n"
    )
    sc = scenario_of([str(tmp_path / "s.yaml"), "--nic-gbps", "100"], monkeypatch)
    assert sc.cluster.topology.name == "mine with node.nic_gbps=100" and sc.cluster.topology.node.nic_gbps == 100


@pytest.mark.parametrize("setting, names", [
    ("cluster.topology.node.nic_gbs=1", ["'cluster.topology.node.nic_gbs'", "nic_gbps", "nvlink_GBps"]),
    ("cluster.gpu.compute.peak_tflop=1", ["'cluster.gpu.compute.peak_tflop'", "peak_tflops", "hbm_GBps"]),
    ("model.num_layer=4", ["'model.num_layer'", "num_layers"]),
    ("parallelism.tpp=2", ["'parallelism.tpp'", "tp", "pp"]),
    ("topology.node.nic_gbps=1", ["'topology'", "cluster", "parallelism"]),
    ("cluster.topology.fabric.radixx=8", ["'cluster.topology.fabric.radixx'", "radix", "leaf_oversubscription"]),
    ("cluster.topology.node.nic_gbps=fast", ["nic_gbps", "fast"]),
    ("batch.seq_length.x=1", ["'batch.seq_length'", "not a section"]),
])
def test_bad_set_is_one_line_exit_2(setting, names):
    res = clustersim("simulate", *SMALL, "--no-dashboard", "--set", setting)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    for name in names:
        assert name in lines[0]


def test_oversubscription_on_a_torus_names_the_torus_keys():
    res = clustersim("simulate", *SMALL, "--topology", "torus-3d", "--no-dashboard", "--leaf-oversubscription", "2")
    assert res.returncode == 2
    assert "'cluster.topology.fabric.leaf_oversubscription'" in res.stderr and "link_GBps" in res.stderr


# ------------------------------------------------------------------------------------ aliases

@pytest.mark.parametrize("short, long, extra", [
    (["--tp", "2"], ["--tensor-model-parallel-size", "2"], []),
    (["--pp", "4"], ["--pipeline-model-parallel-size", "4"], []),
    (["--vpp", "2"], ["--virtual-pipeline-model-parallel-size", "2"], []),
    (["--cp", "2"], ["--context-parallel-size", "2"], []),
    (["--dp", "2"], ["--data-parallel-size", "2"], []),
    (["--recompute", "full"], ["--recompute-granularity", "full"], []),
    (["--recompute", "selective"], ["--recompute-granularity", "selective"], []),
    (["--micro-batch-size", "2"], ["--micro-batch-size", "2"], []),
    (["--global-batch-size", "16"], ["--global-batch-size", "16"], []),
    (["--seq-length", "4096"], ["--seq-length", "4096"], []),
    (["--ep", "2"], ["--expert-model-parallel-size", "2"], ["--model", "mixtral-8x7b"]),
])
def test_megatron_alias_gives_the_same_scenario(short, long, extra, monkeypatch):
    a = scenario_of([*SMALL, *extra, *short], monkeypatch)
    b = scenario_of([*SMALL, *extra, *long], monkeypatch)
    assert a.model_dump(mode="json") == b.model_dump(mode="json")
    assert a.model_dump(mode="json") != scenario_of([*SMALL, *extra], monkeypatch).model_dump(mode="json")


def test_layers_per_virtual_stage_translates_to_vpp(monkeypatch):
    # 32 layers, pp 2, 8 layers per chunk: vpp = 32 / (2 x 8) = 2, and Megatron interleaves.
    a = scenario_of([*SMALL, "--num-layers-per-virtual-pipeline-stage", "8"], monkeypatch)
    b = scenario_of([*SMALL, "--vpp", "2"], monkeypatch)
    assert a.parallelism.vpp == 2 and a.schedule == "interleaved-1f1b"
    assert a.model_dump(mode="json") == b.model_dump(mode="json")
    # an explicit schedule is kept
    c = scenario_of([*SMALL, "--num-layers-per-virtual-pipeline-stage", "4", "--schedule", "zb-h1"], monkeypatch)
    assert c.parallelism.vpp == 4 and c.schedule == "zb-h1"


def test_layers_per_virtual_stage_must_divide():
    res = clustersim("simulate", *SMALL, "--no-dashboard", "--num-layers-per-virtual-pipeline-stage", "5")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "--num-layers-per-virtual-pipeline-stage 5" in res.stderr and "num_layers=32" in res.stderr


def test_every_simulate_option_is_described():
    import typer.main

    cmd = typer.main.get_command(app).commands["simulate"]
    undescribed = [p.opts[0] for p in cmd.params if not getattr(p, "help", None) and p.param_type_name == "option"]
    assert undescribed == []
    helps = {p.opts[0]: p.help for p in cmd.params if p.param_type_name == "option"}
    assert "Sequences" in helps["--global-batch-size"] and "Sequences" in helps["--micro-batch-size"]
    assert "Gbit/s" in helps["--nic-gbps"] and "GByte/s" in helps["--nvlink-GBps"] and "GiB" in helps["--hbm-gib"]
    assert "TFLOP/s" in helps["--peak-tflops"] and "GByte/s" in helps["--hbm-GBps"]


def test_one_zero_default_across_commands():
    from simulator.capture.cli import capture_command

    capture_zero = inspect.signature(capture_command).parameters["zero"].default
    assert capture_zero == ParallelConfig.model_fields["zero"].default == load_scenario(None).parallelism.zero == 1


# ------------------------------------------------------------------------------------ dashboards

def test_json_writes_no_dashboard_unless_asked(tmp_path):
    out = simulate_json(SMALL, cwd=tmp_path)
    assert out["step_time_s"] > 0
    assert not (tmp_path / "dashboards").exists() and list(tmp_path.iterdir()) == []

    res = clustersim("simulate", *SMALL, "--json", "--dashboard", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["name"] == "llama3-8b-16xh100"  # still exactly one JSON object
    written = tmp_path / "dashboards" / "llama3-8b-16xh100-tp4-pp2-gbs8-seq2048.html"
    assert written.exists() and f"dashboard: {Path('dashboards') / written.name}" in res.stderr

    res = clustersim("simulate", *SMALL, "--dashboard", "elsewhere/d.html", "--json", cwd=tmp_path)
    assert res.returncode == 0 and (tmp_path / "elsewhere" / "d.html").exists()
    json.loads(res.stdout)


def test_cdn_without_a_dashboard_says_it_did_nothing(tmp_path):
    res = clustersim("simulate", *SMALL, "--json", "--cdn", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)  # still exactly one JSON object on stdout
    assert "note: --cdn changes only the dashboard, and none was written (--json writes one only with --dashboard PATH)" in res.stderr
    assert list(tmp_path.iterdir()) == []
    res = clustersim("simulate", *SMALL, "--no-dashboard", "--cdn", cwd=tmp_path)
    assert res.returncode == 0 and "none was written (--no-dashboard)" in res.stderr
    res = clustersim("simulate", *SMALL, "--cdn", cwd=tmp_path)
    assert res.returncode == 0 and "--cdn" not in res.stderr and (tmp_path / "dashboards" / "llama3-8b-16xh100-tp4-pp2-gbs8-seq2048.html").exists()


def test_without_json_a_dashboard_is_written_and_named(tmp_path):
    res = clustersim("simulate", *SMALL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "dashboards" / "llama3-8b-16xh100-tp4-pp2-gbs8-seq2048.html").exists()
    assert "dashboard: dashboards/llama3-8b-16xh100-tp4-pp2-gbs8-seq2048.html" in res.stderr
    # a what-if of the same run gets its own dashboard (they overwrote one another); --set takes 1e8
    res = clustersim("simulate", *SMALL, "--slow-gpu", "3=0.8", "--set", "parallelism.grad_bucket_params=1e8",
                     "--findings-budget-s", "0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in (tmp_path / "dashboards").iterdir())
    assert len(names) == 2 and "grad-bucket-params100000000-slow" in names[0] + names[1]


# ------------------------------------------------------------------------------------ progress

def test_no_progress_when_stderr_is_a_pipe(tmp_path):
    res = clustersim("simulate", *SMALL, "--no-dashboard", cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == ""


def _stderr_on_a_terminal(args: list[str], cwd: Path) -> tuple[str, str]:
    master, slave = pty.openpty()
    try:
        res = clustersim(*args, cwd=cwd, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    assert res.returncode == 0
    return res.stdout, b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal_but_not_with_json(tmp_path):
    stdout, err = _stderr_on_a_terminal(["simulate", *SMALL, "--no-dashboard"], tmp_path)
    assert "simulate" in err  # the spinner's label, drawn on the terminal
    assert "step time" in stdout and "simulate:" not in stdout  # results stay clean
    stdout, err = _stderr_on_a_terminal(["simulate", *SMALL, "--no-dashboard", "--json"], tmp_path)
    assert err == "" and json.loads(stdout)["gpus"] == 16


# ------------------------------------------------------------------------------------ small things

def test_plural():
    assert plural(1, "microbatch") == "1 microbatch" and plural(2, "microbatch") == "2 microbatches"
    assert plural(1, "GPU") == "1 GPU" and plural(1024, "GPU") == "1,024 GPUs" and plural(0, "point") == "0 points"


def test_summary_says_1_microbatch():
    # dp = 16 / (4 x 2) = 2 and 2 sequences: one microbatch per rank
    res = CliRunner().invoke(app, ["simulate", *SMALL, "--global-batch-size", "2", "--no-dashboard"])
    assert res.exit_code == 0, res.output
    assert "16 GPUs, 1 microbatch" in res.stdout and "microbatches" not in res.stdout.split("\n", 3)[1]


def test_summary_names_a_schedule_file_by_its_file_name(tmp_path):
    sched = tmp_path / "my.csv"
    sched.write_text((REPO / "tests/data/schedules/custom_interleaved_2ranks.csv").read_text())
    res = CliRunner().invoke(app, ["simulate", "--model", "llama3-8b", "--gpus", "8", "--tp", "4", "--pp", "2",
                                   "--vpp", "2", "--global-batch-size", "4", "--seq-length", "2048",
                                   "--schedule-file", str(sched), "--no-dashboard"])
    assert res.exit_code == 0, res.output
    assert "schedule file my.csv" in res.stdout


def test_near_identical_busy_links_fold_into_one_row():
    links = [{"name": f"leaf{i}->spine0", "kind": "leaf-spine", "utilization": 0.97 - 0.001 * i} for i in range(10)]
    links += [{"name": "gpu0->nvswitch0", "kind": "nvlink", "utilization": 0.5}]
    groups = group_links(links)
    assert [(g["name"], n) for g, n in groups] == [("leaf0->spine0", 10), ("gpu0->nvswitch0", 1)]
    # a clearly different utilization stays its own row
    assert len(group_links(links[:1] + [{"name": "x", "kind": "leaf-spine", "utilization": 0.5}])) == 2


def test_summary_folds_busy_links():
    res = CliRunner().invoke(app, ["simulate", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4",
                                   "--global-batch-size", "16", "--seq-length", "2048", "--no-dashboard"])
    assert res.exit_code == 0, res.output
    rows = [l for l in res.stdout.splitlines() if "busy link" in l]
    assert 1 <= len(rows) <= 3 and any(" links like " in r for r in rows)


# ------------------------------------------------------------------------------------ collective

def _collective(*args: str):
    res = CliRunner().invoke(app, ["collective", *args])
    assert res.exit_code == 0, res.output
    return res


def test_collective_takes_nccl_tests_flags():
    longs = json.loads(_collective("all_reduce", "--gpus", "16", "--min-bytes", "1M", "--max-bytes", "16M",
                                   "--factor", "4", "--json").stdout)
    nccl = json.loads(_collective("all_reduce_perf", "-g", "16", "-b", "1M", "-e", "16M", "-f", "4", "-n", "5",
                                  "-w", "1", "-o", "sum", "-d", "float", "--json").stdout)
    names = json.loads(_collective("allreduce", "--ngpus", "16", "--minbytes", "1M", "--maxbytes", "16M",
                                   "--stepfactor", "4", "--iters", "5", "--warmup_iters", "1", "--op", "sum",
                                   "--datatype", "float", "--json").stdout)
    assert longs["rows"] == nccl["rows"] == names["rows"] and len(longs["rows"]) == 3
    assert longs["collective"] == nccl["collective"] == names["collective"] == "all_reduce"


def test_collective_datatype_sets_the_element_count():
    f = json.loads(_collective("all_reduce", "-g", "8", "-b", "1M", "-e", "1M", "-d", "float", "--json").stdout)
    h = json.loads(_collective("all_reduce", "-g", "8", "-b", "1M", "-e", "1M", "-d", "bfloat16", "--json").stdout)
    assert h["rows"][0]["count"] == 2 * f["rows"][0]["count"] == 2 * (1 << 20) // 4
    table = _collective("all_reduce", "-g", "8", "-b", "1M", "-e", "1M", "-d", "half", "-o", "max").stdout
    row = [l for l in table.splitlines() if not l.startswith("#")][0].split()
    assert row[2:4] == ["half", "max"]


def test_collective_json_is_one_object_with_rows():
    res = _collective("all_gather", "-g", "16", "-b", "1M", "-e", "4M", "--json")
    obj = json.loads(res.stdout)
    assert isinstance(obj, dict) and res.stdout.strip().count("\n") == 0
    assert {"collective", "gpus", "topology", "gpu_profile", "assumptions", "rows"} <= set(obj)
    assert len(obj["rows"]) == 3 and all(r["busbw_GBps"] > 0 for r in obj["rows"])


def test_collective_without_gpu_says_what_it_assumes():
    res = _collective("all_reduce", "-g", "8", "-b", "1G", "-e", "1G")
    assert "no --gpu: assuming profile h100-sxm-80gb" in res.stderr
    with_gpu = _collective("all_reduce", "-g", "8", "-b", "1G", "-e", "1G", "--gpu", "h100-sxm-80gb")
    assert "no --gpu" not in with_gpu.stderr
    rows = lambda out: [l for l in out.splitlines() if not l.startswith("#")]
    assert rows(res.stdout) == rows(with_gpu.stdout)  # the assumed profile is the one named
    # a topology whose node kind has no shipped profile: ideal links, said so
    torus = _collective("all_reduce", "-g", "8", "--topology", "torus-3d", "-b", "1M", "-e", "1M", "--json")
    assert "ideal links" in json.loads(torus.stdout)["assumptions"] and "ideal links" in torus.stderr


@pytest.mark.parametrize("args, text", [
    (["allreduc", "-g", "8"], "unknown collective 'allreduc'"),
    (["all_reduce"], "--gpus N"),
    (["all_reduce", "-g", "8", "-d", "float128"], "--datatype 'float128'"),
    (["all_reduce", "-g", "8", "-o", "xor"], "--op 'xor'"),
])
def test_collective_bad_input_is_one_line(args, text):
    res = CliRunner().invoke(app, ["collective", *args])
    assert res.exit_code == 2 and text in res.output and res.output.strip().count("\n") == 0


# ------------------------------------------------------------------------------------ compare

def test_compare_prints_a_metric_table(tmp_path):
    base = ("model: llama3-8b\nparallelism: {tp: 4, pp: 2}\nbatch: {global_batch_size: 8, seq_length: 2048}\n"
            "cluster: {gpus: 16}\n")
    (tmp_path / "a.yaml").write_text("name: a\n" + base)
    (tmp_path / "b.yaml").write_text("name: b\n" + base.replace("tp: 4, pp: 2", "tp: 8, pp: 2"))
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"),
                                   "-o", str(tmp_path / "c.html")])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert any("B vs A" in l for l in lines)
    step = [l for l in lines if "step time" in l]
    assert len(step) == 1 and "%" in step[0]
    assert lines[-1] == f"dashboard: {tmp_path / 'c.html'}" and (tmp_path / "c.html").exists()


# ------------------------------------------------------------------------------------ sweep messages

def test_sweep_names_itself_once_and_says_where_the_best_timeline_went(tmp_path):
    res = clustersim("sweep", "--model", "llama3-8b", "--gpus", "16", "--tp", "2,4", "--pp", "1,2",
                     "--global-batch-size", "8", "--seq-length", "2048", "--top-k", "1", "--workers", "1",
                     "--no-progress", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("sweep: 4 points") and "sweep sweep" not in res.stdout
    best = Path("dashboards") / "sweep-sweep-best.html"
    assert f"timeline of the best point: {best}" in res.stderr and (tmp_path / best).exists()


def test_overridden_profile_and_topology_are_named_as_changed():
    """A dotted override inside a named GPU profile or topology renames it in reports, so a
    changed topology does not read as the stock one (the summary's layout line, dashboards)."""
    from simulator.scenario import build_scenario, default_scenario_dict

    sc = build_scenario(default_scenario_dict(), {"cluster.topology.node.nic_gbps": 200,
                                                  "cluster.gpu.compute.hbm_GBps": 4000})
    assert sc.cluster.topology_name == "dgx-h100-fattree with node.nic_gbps=200"
    assert sc.cluster.gpu_name == "h100-sxm-80gb with compute.hbm_GBps=4000"
    stock = build_scenario(default_scenario_dict(), {"parallelism.tp": 4})
    assert (stock.cluster.topology_name, stock.cluster.gpu_name) == ("dgx-h100-fattree", "h100-sxm-80gb")


def test_steady_fast_path_flag_gives_the_plain_step():
    """--steady-fast-path replays a verified steady period: the same step as the plain event loop
    (to float rounding), far fewer events, and the summary says how the step was made."""
    args = [*SMALL, "--global-batch-size", "64", "--findings-budget-s", "0"]
    plain = simulate_json(args)
    fast = simulate_json([*args, "--steady-fast-path"])
    assert fast["step_time_s"] == pytest.approx(plain["step_time_s"], rel=1e-9)
    assert fast["events"] < plain["events"] / 2, (fast["events"], plain["events"])
    res = CliRunner().invoke(app, ["simulate", *args, "--steady-fast-path", "--no-dashboard"])
    assert res.exit_code == 0, res.output
    assert "steady period replayed" in " ".join(res.output.split())


def test_set_torch_version_keeps_the_release_as_written(monkeypatch):
    # YAML would read 2.10 as the number 2.1: a torch release is text, so 2.10 stays 2.10 (fused RMSNorm).
    sc = scenario_of([*SMALL, "--set", "framework=torchtitan", "--set", "torch_compile=false", "--set",
                      "torch_version=2.10"], monkeypatch)
    assert sc.torch_version == "2.10" and sc.torch_fuses_rms_norm
    sc = scenario_of([*SMALL, "--set", "framework=torchtitan", "--set", "torch_version=2.8.0a0+5228986c39"], monkeypatch)
    assert sc.torch_version == "2.8.0a0+5228986c39" and not sc.torch_fuses_rms_norm
