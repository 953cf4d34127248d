"""Findings: each names the problem with numbers and a change whose effect was predicted."""

from __future__ import annotations

import re

import pytest

from simulator.report.findings import attach, balance_positions, best_split, rank_loads
from simulator.scenario import build_scenario
from simulator.simulate import simulate

BASE = {"name": "t", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 4, "zero": 1},
        "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 4096},
        "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
# 70B with DDP on 64 GPUs: optimizer state is not sharded and does not fit in 80 GB
OVERFLOW = dict(BASE, model="llama3-70b", parallelism={"tp": 2, "pp": 4, "zero": 0},
                batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 4096})
# 5/9/9/9 layers: the last stage (9 layers and the LM head) is much slower than the first
IMBALANCED = dict(BASE, parallelism={"tp": 2, "pp": 4, "zero": 1, "pp_layer_split": [5, 9, 9, 9]})
NUMBER = re.compile(r"\d+\.\d+ (s|GiB|ms)")


def _kinds(rep):
    return {f["kind"]: f for f in rep.findings}


def test_overflow_finding_names_what_fits():
    res = attach(simulate(build_scenario(OVERFLOW)), budget_s=10)
    rep = res.report
    assert not rep.fits_in_memory
    f = _kinds(rep)["memory"]
    assert f["value"] == pytest.approx(rep.peak_memory_gib - rep.memory_capacity_gib)
    fits = [s for s in f["suggestions"] if s["fits"]]
    assert fits and all(s["predicted_peak_gib"] <= rep.memory_capacity_gib for s in fits)
    assert any(s["overrides"].get("parallelism.zero", 0) >= 2 for s in fits)
    # ZeRO-3 shards parameters too, so it predicts less memory than ZeRO-2
    by = {s["label"]: s["predicted_peak_gib"] for s in f["suggestions"]}
    assert by["zero=3"] < by["zero=2"] < rep.peak_memory_gib
    assert f["message"] in rep.notes and NUMBER.search(f["message"]) and "GiB" in f["message"]


def test_overflow_with_fsdp_units_kept_gathered_tries_resharding_first():
    # FSDP without resharding after forward holds every gathered unit from forward to backward
    # (memory row gathered_parameters): the first change the finding tries frees them.
    sc = dict(BASE, model="llama3-70b", parallelism={"tp": 1, "pp": 2, "zero": 3, "fsdp_reshard_after_forward": False},
              batch={"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 4096},
              cluster={"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
    rep = attach(simulate(build_scenario(sc)), budget_s=10).report
    assert rep.per_pp_rank[0]["memory_gib"]["gathered_parameters_gib"] > 0
    f = _kinds(rep)["memory"]
    first = f["suggestions"][0]
    assert first["label"] == "fsdp_reshard_after_forward=true"
    gathered = rep.per_pp_rank[0]["memory_gib"]["gathered_parameters_gib"]
    # (resharded, the unit computing and the one prefetched stay whole: far less than every unit)
    assert rep.peak_memory_gib - gathered < first["predicted_peak_gib"] < rep.peak_memory_gib - gathered / 4


def test_bubble_finding_simulates_lower_bubble_schedules():
    rep = attach(simulate(build_scenario(BASE)), budget_s=10).report
    f = _kinds(rep)["bubble"]
    assert f["value"] >= 0.10
    sim = {s["label"]: s for s in f["suggestions"] if s.get("simulated")}
    assert "zb-h1" in sim and "zbv" in sim
    # zero-bubble schedules fill the bubble with weight-gradient work: the step gets shorter
    assert sim["zb-h1"]["predicted_step_s"] < rep.step_time_s
    assert "simulated" in f["message"] and "Best:" in f["message"]


def test_imbalance_finding_moves_layers_and_the_move_helps():
    rep = attach(simulate(build_scenario(IMBALANCED)), budget_s=10).report
    f = _kinds(rep)["imbalance"]
    (s,) = f["suggestions"]
    split = s["overrides"]["parallelism.pp_layer_split"]
    assert sum(split) == 32 and split != [5, 9, 9, 9] and split[0] > 5
    assert s["simulated"] and s["predicted_step_s"] < rep.step_time_s
    assert "pp_layer_split" in f["message"] and NUMBER.search(f["message"])


def test_no_findings_budget_means_no_simulation_but_still_numbers():
    rep = attach(simulate(build_scenario(OVERFLOW)), budget_s=0).report
    f = _kinds(rep)["memory"]
    assert all(not s.get("simulated") for s in f["suggestions"])
    assert all(s["predicted_peak_gib"] > 0 for s in f["suggestions"])  # the memory model needs no simulation


def test_best_split_is_optimal_on_a_small_case():
    import itertools

    costs = [3.0, 1.0, 1.0, 1.0, 2.0, 5.0, 1.0]
    got = best_split(__import__("numpy").array(costs), 3)
    best = min((max(sum(costs[:a]), sum(costs[a:b]), sum(costs[b:])), (a, b - a, len(costs) - b))
               for a, b in itertools.combinations(range(1, len(costs)), 2))
    edges = [0, got[0], got[0] + got[1], len(costs)]
    assert max(sum(costs[edges[i]:edges[i + 1]]) for i in range(3)) == best[0]


def test_tp_group_crossing_nodes_is_named():
    sc = build_scenario(dict(BASE, parallelism={"tp": 16, "pp": 1, "zero": 1}))
    rep = attach(simulate(sc), budget_s=0).report
    f = _kinds(rep)["slow-link"]
    assert "TP group of 16 GPUs spans 2 nodes" in f["message"] and f["value"] > 0.01
    # within a node there is no such finding
    rep8 = attach(simulate(build_scenario(dict(BASE, parallelism={"tp": 8, "pp": 1, "zero": 1}))), budget_s=0).report
    assert "slow-link" not in _kinds(rep8)


def test_ep_group_across_nodes_is_checked_against_memory_before_it_is_advised():
    # Was "use ep ≤ 8" whatever the experts a GPU would then hold: Qwen3-235B with ep 16 over two
    # nodes needs 97 GiB a GPU at ep 8. The finding says so and offers hiding the all-to-all instead.
    sc = build_scenario(dict(BASE, model="qwen3-235b-a22b", parallelism={"tp": 1, "pp": 4, "ep": 16, "zero": 1},
                             recompute="full", batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 4096}))
    rep = attach(simulate(sc), budget_s=0).report
    f = _kinds(rep)["slow-link"]
    assert "EP group of 16 GPUs spans 2 nodes" in f["message"]
    assert re.search(r"ep=8 would need \d+\.\d GiB of the usable 75\.6 GiB \(memory model\): it does not fit",
                     f["message"]), f["message"]
    assert "use ep ≤ 8" not in f["message"]
    by = {s["label"]: s for s in f["suggestions"]}
    assert by["ep=8"]["fits"] is False and by["ep=8"]["predicted_peak_gib"] > rep.memory_capacity_gib
    assert by["moe.overlap_dispatch=true"]["overrides"] == {"moe.overlap_dispatch": True}


def test_memory_finding_offers_storing_the_same_state_in_fewer_bytes_and_simulates_it():
    # 70B TP2 PP4 ZeRO-1 on 64 GPUs: fp32 gradients are the largest part. Reduced and held in
    # bf16 (megatron-core grad_reduce_in_fp32=False) they fit; that costs no recomputation, so
    # its step is simulated beside the first fitting change's.
    sc = build_scenario(dict(OVERFLOW, parallelism={"tp": 2, "pp": 4, "zero": 1}))
    rep = attach(simulate(sc), budget_s=30).report
    assert not rep.fits_in_memory
    f = _kinds(rep)["memory"]
    by = {s["label"]: s for s in f["suggestions"]}
    bf16_grads = by["grad_reduce_in_fp32=false"]
    assert bf16_grads["overrides"] == {"parallelism.grad_reduce_in_fp32": False}
    assert bf16_grads["fits"] and bf16_grads["predicted_peak_gib"] < rep.peak_memory_gib and bf16_grads["simulated"]
    assert by["optimizer.precision_aware=true with bf16 moments"]["predicted_peak_gib"] < rep.peak_memory_gib
    assert re.search(r"grad_reduce_in_fp32=false: step \d\.\d+ s \([+-]\d+\.\d%, simulated\)", f["message"]), f["message"]


MIXTRAL = dict(BASE, model="mixtral-8x7b", batch={"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 4096})


def test_split_experts_whose_ep_group_crosses_nodes_are_offered_the_folding():
    # etp=2 with ep 8 on TP pairs: an EP group takes one rank of each of 8 pairs, 16 GPUs, two
    # nodes. Folding the tp ranks in (etp=1) puts it on 8 consecutive GPUs: the finding simulates it.
    sc = build_scenario(dict(MIXTRAL, parallelism={"tp": 2, "pp": 2, "ep": 8, "etp": 2, "zero": 1}))
    rep = attach(simulate(sc), budget_s=30).report
    f = _kinds(rep)["slow-link"]
    assert "EP group of 8 GPUs spans 2 nodes" in f["message"]
    assert "mesh_order" not in f["message"], "the mesh order places nothing of ep"
    (s,) = f["suggestions"]
    assert s["overrides"] == {"parallelism.etp": 1} and s["simulated"]
    # Here the folded all-to-all stays in the node but the expert gradients then cross it (the
    # exposed-dp finding's side): the step is what the simulation says, either way.
    change = s["predicted_step_s"] / rep.step_time_s - 1
    assert f"etp=1 (experts whole on each rank" in f["message"]
    assert f"step {s['predicted_step_s']:.3f} s ({change:+.1%}, simulated)" in f["message"], f["message"]


def test_exposed_expert_gradient_reduction_is_offered_the_other_expert_tensor_parallelism():
    # Folded (etp=1), the ranks holding the same experts are one in each EP group: one a node, so
    # the expert gradients cross NICs. Splitting the experts over tp (etp=2) halves what each
    # rank reduces; the exposed-dp finding simulates it.
    sc = build_scenario(dict(MIXTRAL, parallelism={"tp": 2, "pp": 2, "ep": 8, "zero": 1}))
    rep = attach(simulate(sc), budget_s=60).report
    f = _kinds(rep)["exposed-dp"]
    by = {s["overrides"].get("parallelism.etp"): s for s in f["suggestions"] if "parallelism.etp" in s["overrides"]}
    assert set(by) == {2} and by[2]["simulated"]
    assert "etp=2 (each expert split over the tp group" in f["message"]


def test_tp_group_across_nodes_names_the_fitting_size_and_its_step():
    rep = attach(simulate(build_scenario(dict(BASE, parallelism={"tp": 16, "pp": 1, "zero": 1}))), budget_s=10).report
    f = _kinds(rep)["slow-link"]
    (s,) = f["suggestions"]
    assert s["label"] == "tp=8" and s["fits"] and s["simulated"] and s["predicted_step_s"] < rep.step_time_s
    assert re.search(r"tp=8 fits \(\d+\.\d GiB, memory model\); tp=8: step \d\.\d+ s \(-\d+\.\d%, simulated\)",
                     f["message"]), f["message"]


def test_exposed_tp_inside_a_node_suggests_async_tp_and_simulates_it():
    sc = build_scenario(dict(BASE, parallelism={"tp": 8, "pp": 1, "zero": 1}))
    res = simulate(sc)
    rep = attach(res, budget_s=30).report
    f = _kinds(rep)["tp"]
    assert f["value"] == pytest.approx(res.report.exposed_comm_s["tp"] / res.report.step_time_s)
    (s,) = f["suggestions"]
    assert s["overrides"] == {"parallelism.async_tp": True} and s["simulated"]
    assert s["predicted_step_s"] < rep.step_time_s
    assert "Async TP" in f["message"] and NUMBER.search(f["message"])
    # asked for already, or with nothing exposed: no such finding
    on = attach(simulate(build_scenario(dict(BASE, parallelism={"tp": 8, "pp": 1, "zero": 1, "async_tp": True}))), budget_s=0)
    assert "tp" not in _kinds(on.report)
    tp1 = dict(BASE, parallelism={"tp": 1, "pp": 1, "zero": 1}, batch=dict(BASE["batch"], global_batch_size=64))
    assert "tp" not in _kinds(attach(simulate(build_scenario(tp1)), budget_s=0).report)


def test_a_suggestion_re_simulated_on_the_steady_fast_path_predicts_the_plain_runs_step():
    # Suggestions of a reduced run are re-simulated on the steady fast path (the default
    # llama3-70b scenario's findings: 4.9 -> 0.9 s); their figures are the plain run's.
    data = dict(BASE, parallelism={"tp": 8, "pp": 2, "zero": 1}, batch=dict(BASE["batch"], global_batch_size=64))
    res = simulate(build_scenario(data))
    assert res.report.num_microbatches == 16 and not res.fast_forward
    (s,) = _kinds(attach(res, budget_s=60).report)["tp"]["suggestions"]
    assert s["simulated"] and s["overrides"] == {"parallelism.async_tp": True}
    changed = build_scenario(dict(data, parallelism={**data["parallelism"], "async_tp": True}))
    plain = simulate(changed, with_critical_path=False).report
    assert s["predicted_step_s"] == pytest.approx(plain.step_time_s, rel=1e-9)
    # (and the fast path does replay this one: half its microbatches in closed form)
    assert simulate(changed, fast_forward=True, with_critical_path=False).report.fast_forward["periods_skipped"] == 8


def test_budget_counts_a_fast_path_run_as_the_plain_run_a_suggestion_may_need():
    """The budget prices a re-simulation at what the original run cost end to end, and, where it
    replayed a steady period, at the plain loop over every microbatch (a suggestion whose short run
    does not verify runs plain: a re-split llama3-8b pp8 took 28 s after a 4.3 s fast-path run)."""
    from simulator.report.findings import _Budget

    res = simulate(build_scenario(IMBALANCED))
    rep = res.report
    assert rep.wall_s is not None and rep.wall_s >= rep.sim_wall_s > 0
    assert _Budget.worst_case_s(rep) == rep.wall_s  # no fast path: what it took
    ff = rep.model_copy(update={"wall_s": 5.0, "sim_wall_s": 0.25, "num_microbatches": 2048,
                                "fast_forward": {"microbatches_simulated": 32, "periods_skipped": 2016}})
    assert _Budget.worst_case_s(ff) == pytest.approx(5.0 - 0.25 + 0.25 * 2048 / 32)
    # a budget below that worst case simulates nothing, however cheap the original's loop was
    res.report = ff
    f = _kinds(attach(res, budget_s=15).report)["imbalance"]
    assert not f["suggestions"][0].get("simulated") and "not simulated" in f["message"]


def test_unsimulated_batch_suggestions_estimate_a_lower_bubble_share_than_measured():
    # Were 1F1B's (p-1)/(2m+p-1), which put a dualpipev or imbalanced step's share above the
    # measured one (deepseek-v3 15.6% -> "~19.0%"): a suggestion that looked worse than no change.
    rep = attach(simulate(build_scenario(IMBALANCED)), budget_s=0).report
    f = _kinds(rep)["bubble"]
    share_now = f["value"]
    (s,) = [s for s in f["suggestions"] if "batch.global_batch_size" in s["overrides"]]
    est = float(re.search(r"bubble share ~([\d.]+)%", s["note"]).group(1)) / 100
    bubble = share_now * rep.step_time_s
    assert est == pytest.approx(bubble / (2 * (rep.step_time_s - bubble) + bubble), abs=5e-4)
    assert est < share_now


def test_overflow_from_torchtitans_eager_loss_tries_compiling_it_first():
    # 65,536 tokens of a 128K vocabulary: torchtitan's eager loss holds 12 bytes a logit at its
    # backward (memory.loss_bytes_per_logit), compiled 4; the finding tries compiling it first.
    sc = dict(BASE, model="llama3-8b", framework="torchtitan", compile_loss=False, recompute="full",
              parallelism={"tp": 1, "pp": 1, "zero": 3},
              batch={"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 65536},
              cluster={"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
    rep = attach(simulate(build_scenario(sc)), budget_s=10).report
    mem = rep.per_pp_rank[0]["memory_gib"]
    logits_gib = 65536 * 128256 / 2**30
    assert mem["loss_working_set_gib"] == pytest.approx(8 * logits_gib)
    first = _kinds(rep)["memory"]["suggestions"][0]
    assert first["label"] == "compile_loss=true"
    # 6 bytes a logit kept less in the backward working set, 2 less kept.
    assert first["predicted_peak_gib"] == pytest.approx(rep.peak_memory_gib - 8 * logits_gib, abs=0.05)
    assert first["fits"]


def test_bubble_under_a_schedule_file_names_the_file_and_suggests_no_batch_change():
    # Was "with 1f1b on pp=2" and a larger global batch (simulated) for a step whose order and
    # microbatches a schedule file fixes.
    from pathlib import Path

    from simulator.scenario import load_scenario

    data = Path(__file__).parent / "data"
    sc = load_scenario(data / "scenarios" / "small-llama.yaml",
                       {"parallelism.pp": 2, "schedule_file": str(data / "schedules" / "custom_interleaved_2ranks.csv")})
    rep = attach(simulate(sc), budget_s=10).report
    f = _kinds(rep)["bubble"]
    assert "with schedule file custom_interleaved_2ranks.csv on pp=2" in f["message"]
    assert "1f1b" not in f["message"] and "global_batch_size" not in f["message"]
    assert f["suggestions"] == []


def test_interleaved_imbalance_is_found_and_re_split_by_virtual_stage():
    """An interleaved pipeline whose last rank holds the LM head gets the imbalance finding (it
    had none: a rank holding several positions was skipped), with a split over pp*vpp positions."""
    sc = dict(BASE, parallelism={"tp": 2, "pp": 4, "vpp": 2, "zero": 1, "pp_layer_split": [4] * 8},
              schedule="interleaved-1f1b")
    rep = attach(simulate(build_scenario(sc)), budget_s=10).report
    f = _kinds(rep)["imbalance"]
    (s,) = f["suggestions"]
    split = s["overrides"]["parallelism.pp_layer_split"]
    assert len(split) == 8 and sum(split) == 32 and min(split) >= 1 and split[-1] < 4
    assert s["simulated"] and s["predicted_step_s"] < rep.step_time_s
    assert "virtual stages" in f["message"]


def test_balance_positions_matches_brute_force_on_a_small_interleaved_case():
    import itertools

    import numpy as np

    costs = np.array([1.0] * 9 + [2.5])  # the last layer carries the head
    rank_of = [0, 1, 0, 1]  # two ranks, two chunks each
    m = 8

    def objective(c):  # m x slowest rank + (ranks - 1) x slowest position, per microbatch
        pos = [costs[a:b].sum() for a, b in zip(np.cumsum([0, *c[:-1]]), np.cumsum(c))]
        return m * rank_loads(costs, c, rank_of, 2).max() + max(pos)

    start = [4, 1, 4, 1]  # rank 0 holds 8 of 10 layers
    got = balance_positions(costs, start, rank_of, 2, m)
    best = min(objective(c) for c in itertools.product(range(1, 8), repeat=4) if sum(c) == 10)
    assert sum(got) == 10 and min(got) >= 1
    assert objective(got) == pytest.approx(best) and objective(got) < objective(start)


def test_a_suggestion_not_simulated_says_why():
    """The note names the budget and what one re-simulation costs (it said "over the time budget"
    whether the budget was spent or zero)."""
    from simulator.report.findings import _Budget

    res = simulate(build_scenario(BASE))
    b = _Budget(res, 0.0)
    assert b.simulate({"parallelism.zero": 2}) is None and b.why_not == "not simulated (--findings-budget-s 0)"
    b = _Budget(res, 1e-3)
    assert b.simulate({"parallelism.zero": 2}) is None
    assert "findings budget is left (--findings-budget-s)" in b.why_not and f"~{b.one_s:.1f} s" in b.why_not
    rep = attach(res, budget_s=0).report
    notes = [s.get("note") for f in rep.findings for s in f["suggestions"]]
    assert notes and not any("over the time budget" in (n or "") for n in notes)
    # and the reason reaches the suggestion and its line (it was dropped: "async_tp=true: not simulated.")
    unsimulated = [s for f in rep.findings for s in f["suggestions"] if not s.get("simulated")]
    assert unsimulated and all(s.get("note") for s in unsimulated)
    assert any(s.get("note") == "not simulated (--findings-budget-s 0)" for s in unsimulated)
    assert any("not simulated (--findings-budget-s 0)" in n for n in rep.notes), rep.notes


def test_exposed_dp_under_fsdp2_tries_a_separate_reduce_scatter_group():
    # FSDP2's gathers queue behind its reduce-scatters on one communicator (torch's default);
    # torch's set_separate_reduce_scatter_group() gives the reductions their own. The finding
    # re-simulates it; bucket sizes, which a ZeRO-3 unit's reduction does not use, are not offered.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("tt-accum", framework="torchtitan", gbs=64, parallelism={"zero": 3}))
    rep = attach(simulate(sc), budget_s=30).report
    f = _kinds(rep)["exposed-dp"]
    by = {s["label"]: s for s in f["suggestions"]}
    sep = next(v for k, v in by.items() if k.startswith("fsdp_separate_reduce_scatter_group=true (torch's experimental"))
    assert sep["simulated"] and sep["predicted_step_s"] < rep.step_time_s
    assert not any(label.startswith("grad_bucket_params") for label in by)


def test_zero1_gathers_serialized_along_a_plain_pipelines_fill_suggest_gathering_after_the_step():
    # megatron-core without interleaving issues a stage's parameter gathers in its first forward
    # (no align_param_gather): pp 8 stages gather one after another along the fill. Gathered
    # after the optimizer step (overlap_param_gather false) every stage gathers at once.
    data = {"name": "t", "model": "llama3-70b", "parallelism": {"tp": 8, "pp": 8, "cp": 4, "zero": 1},
            "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 8192},
            "cluster": {"gpus": 1024, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta"}
    rep = attach(simulate(build_scenario(data)), budget_s=60).report
    (s,) = [s for s in _kinds(rep)["exposed-dp"]["suggestions"] if "overlap_param_gather" in s["label"]]
    assert s["overrides"] == {"parallelism.overlap_param_gather": False} and s["simulated"]
    assert s["predicted_step_s"] < 0.9 * rep.step_time_s
    # most of it is the ranks after each gathering stage waiting: the bubble finding offers it too
    (b,) = [b for b in _kinds(rep)["bubble"]["suggestions"] if "overlap_param_gather" in b["label"]]
    assert b["predicted_step_s"] == pytest.approx(s["predicted_step_s"])
    # interleaved, the schedule issues the gathers ahead (aligned): no such suggestion
    inter = dict(data, schedule="interleaved-1f1b", parallelism={**data["parallelism"], "vpp": 2})
    kinds = _kinds(attach(simulate(build_scenario(inter)), budget_s=0).report)
    for found in (kinds.get("exposed-dp"), kinds.get("bubble")):
        assert found is None or not any("overlap_param_gather" in s["label"] for s in found["suggestions"])
