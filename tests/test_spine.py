"""The spine end to end: scenario -> workload -> engine -> report, against closed forms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from simulator.profile import load_profile
from simulator.engine.core import Engine
from simulator.errors import UserError
from simulator.network.alpha_beta import IdealNetwork, TierNetwork
from simulator.report.metrics import Report, rank_bubble_fraction
from simulator.scenario import build_scenario, load_scenario, resolve_model
from simulator.schedules import build_schedule
from simulator.simulate import simulate
from simulator.topology import load_topology
from simulator.workload.program import build_program, split_layers, synthetic_program

DATA = Path(__file__).parent / "data"


def small(**over) -> dict:
    d = {
        "name": "t",
        "model": "llama3-8b",
        "parallelism": {"tp": 2, "pp": 4, "zero": 1},
        "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 2048},
        "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
    }
    for k, v in over.items():
        d[k] = v
    return d


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 4])
def test_1f1b_bubble_matches_closed_form(p, m_per_p):
    m = m_per_p * p
    sched = build_schedule("1f1b", p, m)
    tl = Engine(synthetic_program(sched, F_s=1.0, B_s=2.0), IdealNetwork()).run()
    bubbles = [rank_bubble_fraction(tl, r) for r in tl.ranks]
    expected = (p - 1) / (m + p - 1)
    assert np.mean(bubbles) == pytest.approx(expected, rel=1e-9), f"{p=}, {m=}, {bubbles=}"
    assert tl.step_time_s == pytest.approx((m + p - 1) * 3.0)


def test_gpt3_175b_model_flops_match_narayanan_formula():
    sc = build_scenario({
        "model": "gpt3-175b", "parallelism": {"tp": 8, "pp": 8},
        "batch": {"micro_batch_size": 1, "global_batch_size": 1536, "seq_length": 2048},
        "cluster": {"gpus": 1024, "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"},
    })
    prog = build_program(sc, load_profile("a100-sxm-80gb"), build_schedule("1f1b", 8, sc.num_microbatches))
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    expected = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    assert prog.model_flops_per_step == pytest.approx(expected, rel=0.01)


def test_dp_only_without_overlap_is_compute_plus_ring_allreduce():
    topo_path = DATA / "topologies" / "one-gpu-per-node.yaml"
    sc = build_scenario(small(
        parallelism={"tp": 1, "pp": 1, "zero": 0, "overlap_grad_reduce": False, "grad_bucket_params": 10**12},
        model="llama3-8b", batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024},
        cluster={"gpus": 8, "gpu": "h100-sxm-80gb", "topology": str(topo_path)}, network="alpha-beta",
    ))
    res = simulate(sc)
    prog, prof = res.program, res.profile
    m = sc.num_microbatches
    compute = m * (prog.segments[(0, "F")].total_compute_s + prog.segments[(0, "B")].total_compute_s) + prog.optimizer_s
    grad_bytes = prog.segments[(0, "W")].grad_bytes.sum()
    # The all-reduce is timed by NCCL's cost model (simulator.network.nccl), one GPU per node.
    from simulator.network.nccl import collective_time_s

    ring = collective_time_s("all_reduce", grad_bytes, np.arange(8), load_topology(topo_path), prof)
    assert res.report.step_time_s == pytest.approx(compute + ring, rel=0.01)
    assert res.report.exposed_comm_s["dp"] == pytest.approx(ring, rel=0.01)


def test_reduced_and_full_modes_agree_on_symmetric_64_gpus():
    sc = build_scenario(small())
    reduced = simulate(sc, mode="reduced").report
    full = simulate(sc, mode="every-rank").report
    assert full.step_time_s == pytest.approx(reduced.step_time_s, rel=1e-3)
    for dim in ("tp", "pp", "dp"):
        assert full.exposed_comm_s[dim] == pytest.approx(reduced.exposed_comm_s[dim], rel=1e-3, abs=1e-6)
    assert full.bubble_fraction == pytest.approx(reduced.bubble_fraction, rel=1e-3, abs=1e-6)
    assert full.events > reduced.events  # full mode really simulated every rank


def test_default_scenario_is_llama3_70b_on_1024_h100():
    sc = load_scenario()
    p = sc.parallelism
    assert (sc.model.name, sc.cluster.gpus, p.tp, p.pp, sc.dp, sc.batch.seq_length) == ("llama3-70b", 1024, 8, 8, 16, 8192)


def test_default_simulation_is_believable():
    rep = simulate(load_scenario()).report
    # Published Llama-3 training ran at 38-43% MFU on H100; a simulator claiming more than the
    # GEMM efficiency of its own profile, or less than a few percent, is broken.
    assert 0.25 < rep.mfu < 0.72, rep.mfu
    assert rep.fits_in_memory
    assert 0 < rep.bubble_fraction < 0.3
    assert rep.exposed_comm_s["tp"] > 0 and rep.exposed_comm_s["cp"] == 0


def test_uneven_layer_split_gives_first_and_last_fewer():
    split = split_layers(126, 16)
    counts = [len(x) for x in split]
    assert counts[0] == 7 and counts[-1] == 7 and set(counts[1:-1]) == {8}
    assert sum(counts) == 126 and split[0][0] == 0 and split[-1][-1] == 125
    assert [len(x) for x in split_layers(80, 8)] == [10] * 8
    assert [len(x) for x in split_layers(10, 4, [2, 3, 3, 2])] == [2, 3, 3, 2]


def test_recompute_adds_forward_inside_backward():
    base = build_scenario(small())
    full = build_scenario(small(recompute="full"))
    prof = load_profile("h100-sxm-80gb")
    s0 = build_program(base, prof, build_schedule("1f1b", 4, base.num_microbatches))
    s1 = build_program(full, prof, build_schedule("1f1b", 4, full.num_microbatches))
    for pos in (1, 2):  # positions without embedding or head
        f, b0, b1 = (s0.segments[(pos, "F")].total_compute_s, s0.segments[(pos, "B")].total_compute_s,
                     s1.segments[(pos, "B")].total_compute_s)
        assert b1 == pytest.approx(b0 + f, rel=1e-9)
    assert s1.model_flops_per_step == s0.model_flops_per_step  # model FLOPs exclude recomputation


def test_sequence_parallel_swaps_allreduce_for_gather_scatter():
    prof = load_profile("h100-sxm-80gb")
    for sp, expected in ((True, {"all_gather", "reduce_scatter"}), (False, {"all_reduce"})):
        sc = build_scenario(small(parallelism={"tp": 2, "pp": 4, "sequence_parallel": sp}))
        prog = build_program(sc, prof, build_schedule("1f1b", 4, sc.num_microbatches))
        ops = {c.op for c in prog.segments[(1, "F")].comm if c is not None}
        assert ops == expected, f"{sp=}, {ops=}"


# ------------------------------------------------------------------ models and bad input


@pytest.mark.parametrize("name,layers,experts", [("gpt2", 12, 0), ("llama", 32, 0), ("mistral", 32, 0),
                                                 ("mixtral", 32, 8), ("qwen2", 28, 0)])
def test_huggingface_configs_resolve(name, layers, experts):
    m = resolve_model(str(DATA / "hf" / f"{name}.json"))
    assert (m.num_layers, m.num_experts) == (layers, experts)
    if name == "gpt2":
        assert (m.mlp, m.ffn_hidden_size, m.tied_embeddings) == ("gelu", 3072, True)
    if name == "llama":
        assert (m.kv_heads, m.ffn_hidden_size, m.mlp) == (8, 14336, "swiglu")


@pytest.mark.parametrize("over,match", [
    ({"parallelism": {"tp": 3, "pp": 4}, "cluster": {"gpus": 48}}, r"tp=3 does not divide num_attention_heads=32: choose tp among"),
    ({"parallelism": {"tp": 2, "pp": 4, "dp": 4}}, r"gpus=64 != tp\*cp\*pp\*dp=2\*1\*4\*4=32: set --gpus 32 or omit --dp"),
    ({"batch": {"micro_batch_size": 2, "global_batch_size": 60, "seq_length": 2048}},
     r"global_batch_size=60 is not divisible by micro_batch_size\*dp=2\*8: use a multiple of 16"),
    ({"parallelism": {"tp": 1, "pp": 64}}, r"pp\*vpp=64 exceeds num_layers=32: every pipeline stage needs at least one layer"),
    ({"model": "llama9-1t"}, r"unknown model 'llama9-1t': use a preset \(gpt3-175b, .*\) or a path to a HuggingFace config.json"),
    ({"cluster": {"gpus": 60}}, r"gpus=60 is not divisible by tp\*cp\*pp=2\*1\*4=8: use a multiple of 8 GPUs, or a tp, cp and pp"),
    ({"model": str(DATA / "hf" / "bert.json")}, r"model_type 'bert' in .* is not supported: supported are gpt2, llama"),
    ({"model": str(DATA / "hf" / "truncated.json")}, r"is not valid JSON \(.*\): fix the file"),
    ({"model": str(DATA / "hf" / "llama_missing_key.json")}, r"lacks 'intermediate_size': add it or use a preset"),
    ({"cluster": {"gpus": 64, "gpu": "b300"}}, r"unknown GPU profile 'b300' \(did you mean 'b200'\?\): use one of a100-.*h100-sxm-80gb.* or a path to a profile JSON"),
    # a name typed short or in capitals: the shipped names it begins
    ({"cluster": {"gpus": 64, "gpu": "H100"}}, r"unknown GPU profile 'H100' \(did you mean 'h100-hbm2e-96gb' or 'h100-sxm-80gb' or 'h100-sxm-80gb-p5-efa'\?\)"),
    ({"cluster": {"gpus": 64, "gpu": "h200"}}, r"unknown GPU profile 'h200' \(did you mean 'h200-sxm-141gb'\?\)"),
    ({"model": "llama-70b"}, r"unknown model 'llama-70b' \(did you mean 'llama3-70b'\?\)"),
])
def test_bad_scenarios_name_the_value_and_the_fix(over, match):
    with pytest.raises(UserError, match=match):
        sc = build_scenario(small(**over))
        simulate(sc)


def test_unknown_yaml_key_and_missing_file():
    with pytest.raises(UserError, match=r"unknown key 'parallelism.tensor_parallel': remove it or check its spelling"):
        load_scenario(DATA / "scenarios" / "unknown-key.yaml")
    with pytest.raises(UserError, match=r"scenario file '.*nope.yaml' does not exist: check the path"):
        load_scenario(DATA / "scenarios" / "nope.yaml")


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simulator.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_bad_input_is_one_line_exit_2_no_traceback():
    r = _cli("simulate", "--tp", "3", "--no-dashboard")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: tp=3 does not divide num_attention_heads=64: choose tp among 1, 2, 4, 8, 16, 32, 64"]
    assert "Traceback" not in r.stderr and r.stdout == ""
    r = _cli("simulate", str(DATA / "scenarios" / "unknown-key.yaml"), "--no-dashboard")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "tensor_parallel" in r.stderr


def test_cli_json_prints_exactly_one_object_with_report_keys(tmp_path):
    r = _cli("simulate", str(DATA / "scenarios" / "small-llama.yaml"), "--json", "--dashboard", str(tmp_path / "d.html"),
             "--perfetto", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)  # the whole stdout is one JSON document
    for key in Report.SUMMARY_KEYS:
        assert key in obj, key
    assert set(obj["exposed_comm_s"]) == {"tp", "cp", "ep", "pp", "dp"}
    assert obj["gpus"] == 64 and obj["step_time_s"] > 0
    assert (tmp_path / "d.html").stat().st_size > 0
    trace = json.loads((tmp_path / "p.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"])


def test_cli_flags_override_the_scenario_file():
    r = _cli("simulate", str(DATA / "scenarios" / "small-llama.yaml"), "--json", "--no-dashboard", "--tp", "4", "--pp", "2",
             "--set", "parallelism.zero=0")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["num_microbatches"] == 64 // 8  # dp = 64 / (4 * 2) = 8
