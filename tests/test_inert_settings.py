"""A setting the run does not read gets a note, and each rule's claim holds in the engine: on a
layout the rule covers, changing the field leaves the predicted step and memory as they were."""

from __future__ import annotations

import json

import pytest

from agreement_scenarios import SMALL_DENSE, SMALL_MOE, scenario
from simulator.inert_settings import RULES, given_paths, inert_settings
from simulator.scenario import build_scenario
from simulator.simulate import simulate

# Per rule: a small layout where the rule says the field is not read, and another value for it.
CASES: dict[str, tuple[dict, object]] = {
    "parallelism.fsdp_prefetch": (scenario("z1", parallelism={"zero": 1}), 3),
    "parallelism.fsdp_reshard_after_forward": (scenario("z1", parallelism={"zero": 1}), False),
    "parallelism.fsdp_separate_reduce_scatter_group": (
        scenario("tt-hsdp", framework="torchtitan", parallelism={"zero": 3, "fsdp_shard_size": 4}), True),
    "parallelism.cp_attention": (scenario("cp1"), "allgather"),
    "parallelism.cp_load_balance": (scenario("cp2-generic", seq=4096, parallelism={"cp": 2}), False),
    "parallelism.sequence_parallel": (scenario("tp1"), False),
    "parallelism.async_tp": (scenario("tp1"), True),
    "parallelism.tp_comm_overlap": (scenario("tp1"), True),
    "parallelism.pp_scatter_gather": (scenario("pp2-tp2-sp", parallelism={"pp": 2, "tp": 2}), True),
    "parallelism.pp_exchange": (scenario("pp1"), "blocking"),
    "parallelism.grad_bucket_params": (scenario("tt-z3", framework="torchtitan", parallelism={"zero": 3}), 2_000_000),
    "parallelism.overlap_grad_reduce": (scenario("dp1", gpus=8, gbs=4, parallelism={"tp": 8}), False),
    "parallelism.overlap_param_gather": (scenario("z3", parallelism={"zero": 3}), False),
    "parallelism.loss_all_reduce_per_microbatch": (scenario("dp1", gpus=8, gbs=4, parallelism={"tp": 8}), True),
    "parallelism.etp": (scenario("dense-tp2", parallelism={"tp": 2}), 2),
    "optimizer.store_param_remainders": (scenario("adam", parallelism={"zero": 1}), False),
    "optimizer.main_grads_dtype": (scenario("adam-pa", parallelism={"zero": 1}, optimizer={"precision_aware": True}), "bf16"),
    "optimizer.implementation": (scenario("adam", parallelism={"zero": 1}), "foreach"),
    "moe.routing": (scenario("dense"), "skewed"),
    "moe.skew": (scenario("moe-uniform", model=SMALL_MOE, parallelism={"ep": 4}), 2.0),
    "moe.seed": (scenario("moe-uniform", model=SMALL_MOE, parallelism={"ep": 4}), 7),
    "moe.capacity_factor": (scenario("dense"), 0.5),
    "moe.overlap_dispatch": (scenario("dense"), True),
    "fp8.recipe": (scenario("bf16"), "te-current"),
    "fp8.attention": (scenario("bf16"), True),
    "fp8.param_all_gather": (scenario("fp8-z1", dtype="fp8", parallelism={"zero": 1}), True),
    "torch_compile": (scenario("generic"), False),
    "compile_loss": (scenario("generic"), True),
    "training_dtype": (scenario("generic"), "bfloat16"),
    "torch_version": (scenario("tt-compiled", framework="torchtitan", parallelism={"zero": 3}), "2.6"),
    "attention_kernel": (scenario("no-flash", flash_attention=False), "fa2"),
    "model.hf_model_type": (scenario("megatron-impl"), "opt"),
    "model.attention_dropout": (scenario("megatron-impl"), 0.0),
    "model.max_position_embeddings": (scenario("rope"), 8192),
}


def test_every_rule_has_a_case():
    assert sorted(CASES) == sorted(r.path for r in RULES)


def _set(data: dict, path: str, value) -> dict:
    out = build_scenario(data).model_dump(mode="json")
    node = out
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    return out


@pytest.mark.parametrize("path", sorted(CASES))
def test_a_rule_holds_in_the_engine(path):
    data, other = CASES[path]
    base = build_scenario(data)
    changed = build_scenario(_set(data, path, other))
    notes = inert_settings(changed, [path])
    assert len(notes) == 1 and notes[0].startswith(f"{path}="), notes
    a, b = simulate(base).report, simulate(changed).report
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-9), (path, a.step_time_s, b.step_time_s)
    assert b.peak_memory_gib == pytest.approx(a.peak_memory_gib, rel=1e-9), (path, a.peak_memory_gib, b.peak_memory_gib)


@pytest.mark.parametrize("path, data, other", [
    # The same fields where they are read: each changes the prediction and gets no note.
    ("parallelism.fsdp_prefetch", scenario("z3", parallelism={"zero": 3}), 0),
    ("parallelism.fsdp_separate_reduce_scatter_group",
     scenario("tt-z3", gbs=64, framework="torchtitan", parallelism={"zero": 3}), True),
    ("fp8.recipe", scenario("fp8", dtype="fp8"), "te-current"),
    ("parallelism.grad_bucket_params", scenario("z1", parallelism={"zero": 1}), 2_000_000),
    ("parallelism.overlap_param_gather", scenario("z1", parallelism={"zero": 1}), False),
    ("parallelism.grad_bucket_params", scenario("z3", parallelism={"zero": 3}), 2_000_000),
    ("moe.skew", scenario("moe-skewed", model=SMALL_MOE, parallelism={"ep": 4}, moe={"routing": "skewed"}), 2.0),
    ("parallelism.etp", scenario("moe-tp2", model=SMALL_MOE, parallelism={"tp": 2, "ep": 4}), 2),
    ("optimizer.store_param_remainders", scenario("adam-pa", parallelism={"zero": 1}, optimizer={"precision_aware": True}), False),
    ("training_dtype", scenario("tt-z3", framework="torchtitan", parallelism={"zero": 3}), "bfloat16"),
    ("torch_version", scenario("tt-eager", framework="torchtitan", torch_compile=False, parallelism={"zero": 3}), "2.6"),
])
def test_a_field_that_is_read_gets_no_note(path, data, other):
    base = build_scenario(data)
    changed = build_scenario(_set(data, path, other))
    assert inert_settings(changed, [path]) == []
    a, b = simulate(base).report, simulate(changed).report
    assert (a.step_time_s, a.peak_memory_gib) != (b.step_time_s, b.peak_memory_gib)


def test_given_paths_reads_the_file_and_the_command_line():
    data = {"model": "llama3-8b", "parallelism": {"zero": 1, "fsdp_prefetch": 2}, "fp8": {"recipe": "mxfp8"}}
    overrides = {"parallelism.tp": 2, "torch_compile": False, "attention_kernel": None}
    # (a preset name writes none of the model's fields; an override without a value was not given)
    assert sorted(given_paths(data, overrides)) == ["fp8.recipe", "parallelism.fsdp_prefetch", "torch_compile"]
    assert given_paths(None, None) == []


def test_the_note_names_the_value_and_the_reason():
    sc = build_scenario(scenario("z1", parallelism={"zero": 1, "fsdp_prefetch": 2}))
    assert inert_settings(sc, ["parallelism.fsdp_prefetch"]) == [
        "parallelism.fsdp_prefetch=2 has no effect on this run: it applies to ZeRO-3 (FSDP) parameter gathers and "
        "this layout is ZeRO-1"]
    sc = build_scenario(scenario("tt", framework="torchtitan", parallelism={"zero": 3},
                                 model=dict(SMALL_DENSE)))
    assert inert_settings(sc, ["parallelism.fsdp_prefetch", "torch_compile"]) == []


def test_simulate_notes_what_the_file_and_the_command_line_set_to_no_effect(tmp_path):
    import yaml

    from cli_helpers import TINY_SCENARIO, clustersim

    data = dict(TINY_SCENARIO, parallelism={**TINY_SCENARIO["parallelism"], "fsdp_prefetch": 2},
                fp8={"recipe": "mxfp8"})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    p = clustersim(["simulate", "s.yaml", "--json", "--set", "torch_compile=false", "--set", "parallelism.tp=2"], tmp_path)
    assert p.returncode == 0, p.stderr
    notes = sorted(line for line in p.stderr.splitlines() if "has no effect on this run" in line)
    assert notes == [
        "note: fp8.recipe=mxfp8 has no effect on this run: dtype is bf16; fp8 settings apply with dtype fp8 (--dtype fp8)",
        "note: parallelism.fsdp_prefetch=2 has no effect on this run: it applies to ZeRO-3 (FSDP) parameter gathers "
        "and this layout is ZeRO-1",
        "note: torch_compile=false has no effect on this run: torch_compile is read under framework torchtitan only "
        "and this run's framework is generic",
    ]
    assert json.loads(p.stdout)["step_time_s"] > 0
