"""ZeRO / FSDP, context parallelism, MoE expert parallelism and the memory model (issue 7)."""

from __future__ import annotations

import pytest

from simulator.profile import load_profile
from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.schedules import build_schedule
from simulator.simulate import simulate
from simulator.workload.memory import activation_bytes_per_layer
from simulator.workload.ops import build_layer_ops, moe_dropped_fraction, moe_load_factor
from simulator.workload.program import GRAD_REDUCE_BYTES, build_program


def scenario(**over) -> dict:
    d = {
        "name": "t",
        "model": "llama3-8b",
        "parallelism": {"tp": 1, "pp": 1, "zero": 0},
        "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 2048},
        "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
        "network": "alpha-beta",
    }
    d.update(over)
    return d


def dp_bytes(res) -> float:
    r = res.timeline.ranks[0]
    return res.timeline.comm_bytes[r]["dp"]


def rank_params(res) -> float:
    sched = res.program.schedule
    return sum(res.program.stage_params[sched.stage_position[s]] for s in sched.stages_of_rank(0))


def test_ddp_allreduce_volume_is_2P_dp_minus_1_over_dp():
    res = simulate(build_scenario(scenario()))
    dp = 16
    grad_bytes = rank_params(res) * GRAD_REDUCE_BYTES
    assert dp_bytes(res) == pytest.approx(2 * grad_bytes * (dp - 1) / dp, rel=1e-6)


@pytest.mark.parametrize("cp", [2, 8])
def test_context_parallel_ranks_join_the_gradient_reduction_and_the_zero_shards(cp):
    # CP ranks hold the same parameters and see other tokens: their gradients are reduced with
    # the dp ranks' and ZeRO shards over dp x cp (megatron-core dp_cp_group; torchtitan's "fsdp"
    # mesh is dp_shard x cp). The same 16 GPUs as dp 16 therefore move the same DDP gradient
    # volume and hold the same optimizer shard, whatever the split between dp and cp.
    dp = 16 // cp
    ddp = simulate(build_scenario(scenario()))
    mixed = simulate(build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "cp": cp, "zero": 0},
                                             batch={"micro_batch_size": 1, "global_batch_size": dp, "seq_length": 2048 * cp})))
    assert dp_bytes(mixed) == pytest.approx(dp_bytes(ddp), rel=1e-9)
    assert mixed.plan.groups["dp"].shape == (1, 16)
    for zero in (1, 3):
        par = {"tp": 1, "pp": 1, "zero": zero}
        flat = simulate(build_scenario(scenario(parallelism=par)))
        with_cp = simulate(build_scenario(scenario(parallelism=dict(par, cp=cp),
                                                   batch={"micro_batch_size": 1, "global_batch_size": dp, "seq_length": 2048 * cp})))
        a, b = flat.memory.per_rank_gib[0], with_cp.memory.per_rank_gib[0]
        assert b["optimizer_gib"] == pytest.approx(a["optimizer_gib"], rel=1e-9), f"{zero=}"
        assert b["parameters_gib"] == pytest.approx(a["parameters_gib"], rel=1e-9), f"{zero=}"
        assert dp_bytes(with_cp) == pytest.approx(dp_bytes(flat), rel=1e-9), f"{zero=}"


@pytest.mark.parametrize("microbatches", [1, 2])
def test_zero3_volume_is_about_1_5x_ddp(microbatches):
    # fp32 everywhere so parameters and gradients have the same size, as the 1.5x rule assumes.
    common = dict(dtype="fp32", batch={"micro_batch_size": 1, "global_batch_size": 16 * microbatches, "seq_length": 1024})
    ddp = simulate(build_scenario(scenario(**common)))
    fsdp = simulate(build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": 3}, **common)))
    # ZeRO-3 with resharding: every microbatch all-gathers each unit for forward and again for
    # backward; gradients are reduce-scattered once: (2m + 1) x P(dp-1)/dp against DDP's 2 x.
    ratio = dp_bytes(fsdp) / dp_bytes(ddp)
    assert ratio == pytest.approx((2 * microbatches + 1) / 2, rel=1e-3), f"{microbatches=}, {ratio=}"


def test_zero1_reduce_scatters_grads_and_gathers_params():
    res = simulate(build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": 1}, dtype="fp32")))
    dp = 16
    P = rank_params(res)
    # reduce-scatter of fp32 gradients + all-gather of fp32 parameters, each (dp-1)/dp.
    assert dp_bytes(res) == pytest.approx(2 * P * 4 * (dp - 1) / dp, rel=1e-6)


def test_ep_all_to_all_volume():
    sc = build_scenario(scenario(model="mixtral-8x7b", parallelism={"tp": 1, "pp": 1, "ep": 8, "zero": 1},
                                 batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}))
    res = simulate(sc)
    m = sc.model
    ep = 8
    tokens = 1024 * 1  # per microbatch per rank
    per_layer = tokens * m.top_k * m.hidden_size * 2 * (ep - 1) / ep
    # dispatch + combine, forward and backward, per MoE layer and microbatch
    expected = 4 * per_layer * m.num_layers * sc.num_microbatches
    r = res.timeline.ranks[0]
    assert res.timeline.comm_bytes[r]["ep"] == pytest.approx(expected, rel=1e-6)


def _fsdp_exposed_share(seq_length: int, mbs: int, hidden: int) -> float:
    model = {"name": "m", "num_layers": 8, "hidden_size": hidden, "ffn_hidden_size": 4 * hidden,
             "num_attention_heads": 16, "vocab_size": 32000, "mlp": "gelu"}
    sc = build_scenario(scenario(model=model, parallelism={"tp": 1, "pp": 1, "zero": 3, "fsdp_prefetch": 1},
                                 batch={"micro_batch_size": mbs, "global_batch_size": 16 * mbs, "seq_length": seq_length}))
    rep = simulate(sc).report
    return rep.exposed_comm_s["dp"] / rep.step_time_s


def test_fsdp_prefetch_hides_allgathers_only_with_enough_compute():
    ample = _fsdp_exposed_share(seq_length=8192, mbs=4, hidden=4096)
    tiny = _fsdp_exposed_share(seq_length=128, mbs=1, hidden=4096)
    assert ample < 0.05, ample
    assert tiny > 0.30, tiny


def test_fsdp_prefetch_depth_matters_when_gathers_are_slow():
    base = dict(model="llama3-8b", batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 512})
    exposed = []
    for depth in (0, 2):
        sc = build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": 3, "fsdp_prefetch": depth}, **base))
        exposed.append(simulate(sc).report.exposed_comm_s["dp"])
    assert exposed[1] < exposed[0]


def test_hsdp_shards_inside_groups_and_replicates_across():
    sc = build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": 3, "fsdp_shard_size": 8}, dtype="fp32"))
    res = simulate(sc)
    ev = res.timeline.events
    assert ev["name"].str.startswith("reduce_scatter").any()
    # Parameters are sharded over 8, not 16: the optimizer works on P/8.
    full = simulate(build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": 3}, dtype="fp32")))
    assert res.program.optimizer_s == pytest.approx(2 * full.program.optimizer_s, rel=0.05)
    with pytest.raises(UserError, match=r"fsdp_shard_size=5 needs zero=3 and must divide dp=16"):
        build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": 3, "fsdp_shard_size": 5}))


@pytest.mark.parametrize("recompute,formula", [
    ("none", lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h) / t),
    ("selective", lambda s, b, h, a, t: s * b * h * 34 / t),
])
def test_gpt3_175b_activation_memory_matches_korthikanti(recompute, formula):
    sc = build_scenario({
        "model": "gpt3-175b", "parallelism": {"tp": 8, "pp": 8, "sequence_parallel": True},
        "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 2048}, "recompute": recompute,
        "flash_attention": False, "cluster": {"gpus": 64, "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"},
    })
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    per_layer = activation_bytes_per_layer(sc)
    assert per_layer == pytest.approx(formula(s, b, h, a, t), rel=0.05)
    # The first stage holds p microbatches of its 12 layers under 1F1B.
    res = simulate(sc)
    first = res.memory.per_rank_gib[0]["activations_gib"] * 1024**3
    assert first == pytest.approx(8 * 12 * formula(s, b, h, a, t), rel=0.05)


def test_tp_without_sp_keeps_the_replicated_10sbh():
    sc = build_scenario({
        "model": "gpt3-175b", "parallelism": {"tp": 8, "pp": 8, "sequence_parallel": False},
        "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 2048}, "flash_attention": False,
        "cluster": {"gpus": 64, "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"},
    })
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    assert activation_bytes_per_layer(sc) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=0.05)


def _mixtral_pp4_ep8():
    return build_scenario({
        "model": "mixtral-8x7b", "parallelism": {"tp": 1, "pp": 4, "ep": 8}, "network": "alpha-beta",
        "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 2048},
        "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
    })


def test_moe_activations_are_kept_once_per_routed_expert():
    # Was one dense-width MLP per token whatever top_k (Mixtral top-1, top-2 and top-8 all 9.06 GiB
    # on its first stage); each routed copy keeps its permuted input and its expert's fc1 /
    # activation outputs (Megatron's MoE layer: permute, grouped fc1, SwiGLU, grouped fc2).
    from simulator.workload.memory import layer_activation_sbh

    base = _mixtral_pp4_ep8()
    assert base.model.top_k == 2
    m = base.model
    h, f = m.hidden_size, m.expert_ffn / m.hidden_size
    dense_c, _ = layer_activation_sbh(base)
    for k in (1, 2, 8):
        sc = base.model_copy(update={"model": m.model_copy(update={"top_k": k})})
        c, _ = layer_activation_sbh(sc, moe=True)
        assert c - dense_c == pytest.approx((k - 1) * (2 + 6 * f) + 2 * 4 * m.num_experts / h)
    narrow = base.model_copy(update={"model": m.model_copy(update={"num_experts": 32, "moe_ffn_hidden_size": m.expert_ffn // 4})})
    assert layer_activation_sbh(narrow, moe=True)[0] < layer_activation_sbh(base, moe=True)[0]
    # The whole stage: top-2 keeps ~1.6x the activations of a dense-width count, not the same.
    res = simulate(base)
    first = res.memory.per_rank_gib[0]["activations_gib"] * 1024**3
    assert first == pytest.approx(4 * 8 * activation_bytes_per_layer(base, moe=True) + 2 * 2048 * h, rel=0.02)
    assert activation_bytes_per_layer(base, moe=True) / activation_bytes_per_layer(base) == pytest.approx(59.0 / 36.0, rel=0.01)


def test_torchtitan_tp_keeps_the_gathered_linear_inputs_megatron_regathers():
    # DTensor TP hands F.linear the all-gathered input, which autograd saves whole; Megatron saves
    # its 1/tp slice and gathers it again in backward (ops.sp_regathers_input). Two such inputs a
    # layer (attention's and the MLP's), 2 bytes an element in bf16.
    data = {"model": "llama3-70b", "parallelism": {"tp": 8, "pp": 1, "sequence_parallel": True},
            "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 4096},
            "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    megatron = build_scenario(data)
    titan = build_scenario({**data, "framework": "torchtitan"})
    sbh = 4096 * 1 * 8192
    assert activation_bytes_per_layer(titan) - activation_bytes_per_layer(megatron) == pytest.approx(sbh * 2 * 2 * 7 / 8)
    # Full recomputation keeps only the layer input either way; the layer it re-materialises differs.
    full_t = build_scenario({**data, "framework": "torchtitan", "recompute": "full"})
    assert activation_bytes_per_layer(full_t) == activation_bytes_per_layer(build_scenario({**data, "recompute": "full"}))


def test_zero_stages_shard_model_state_memory():
    gib = []
    for z in (0, 1, 2, 3):
        res = simulate(build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": z})))
        row = res.memory.per_rank_gib[0]
        gib.append(row["parameters_gib"] + row["gradients_gib"] + row["optimizer_gib"])
    assert gib[0] > gib[1] > gib[2] > gib[3]
    P = rank_params(res) / 1024**3
    assert gib[0] == pytest.approx(18 * P, rel=1e-6)  # 2 + 4 + 12 bytes per parameter
    assert gib[3] == pytest.approx(18 * P / 16, rel=1e-6)


def test_fsdp_under_a_pipeline_holds_gathered_units_and_unsharded_gradients():
    # 16 GPUs: pp 2 x dp 8, four microbatches per pipeline. The plan reduces FSDP gradients at a
    # stage's last microbatch only (torch pipelining turns gradient sync off until then), so the
    # gradients accumulate unsharded (fp32); without resharding after forward every unit stays
    # gathered from its forward to its backward.
    def row(reshard: bool) -> tuple[dict, object]:
        res = simulate(build_scenario(scenario(
            parallelism={"tp": 1, "pp": 2, "zero": 3, "fsdp_reshard_after_forward": reshard},
            batch={"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 2048})))
        return res.memory.per_rank_gib[0], res
    resharded, res = row(True)
    kept, _ = row(False)
    P = rank_params(res)
    assert resharded["gradients_gib"] * 1024**3 == pytest.approx(4 * P, rel=1e-9)  # not 4 P / 8
    assert resharded["parameters_gib"] * 1024**3 == pytest.approx(2 * P / 8, rel=1e-9)
    # Resharded: only the unit computing and the one prefetched (fsdp_prefetch 1) are whole at
    # once, at worst the two largest of the rank's units (pp rank 0: the embedding and its
    # layers), each whole beside the rank's own 1/8: FSDP2 gathers into a new full-size tensor
    # and keeps the shard (torch _fsdp_param.py init_all_gather_outputs), so not 7/8 of a unit.
    units = sorted((res.program.unit_gather_bytes.get(L, res.program.unit_params[L] * 2)
                    for L in [-1] + list(res.program.position_layers[0])), reverse=True)
    assert resharded["gathered_parameters_gib"] * 1024**3 == pytest.approx(sum(units[:2]), rel=1e-9)
    assert kept["gathered_parameters_gib"] * 1024**3 == pytest.approx(2 * P, rel=0.02)
    assert kept["total_gib"] > resharded["total_gib"]
    # ZeRO-2 defers the reduction the same way in the plan: unsharded until the last microbatch.
    z2 = simulate(build_scenario(scenario(parallelism={"tp": 1, "pp": 2, "zero": 2},
                                          batch={"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 2048})))
    assert z2.memory.per_rank_gib[0]["gradients_gib"] * 1024**3 == pytest.approx(4 * P, rel=1e-9)
    # One microbatch: gradients are reduce-scattered as they are produced, sharded.
    one = simulate(build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "zero": 3})))
    assert one.memory.per_rank_gib[0]["gradients_gib"] * 1024**3 == pytest.approx(4 * rank_params(one) / 16, rel=1e-9)


def test_moe_skewed_routing_slows_the_step_and_capacity_drops_tokens():
    base = dict(model="mixtral-8x7b", parallelism={"tp": 1, "pp": 1, "ep": 8, "zero": 1},
                batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024})
    uniform = build_scenario(scenario(**base))
    skewed = build_scenario(scenario(moe={"routing": "skewed", "skew": 1.2, "seed": 3}, **base))
    capped = build_scenario(scenario(moe={"routing": "skewed", "skew": 1.2, "seed": 3, "capacity_factor": 1.25}, **base))
    assert moe_load_factor(uniform) == 1.0
    assert moe_load_factor(skewed) > 1.5
    assert moe_load_factor(capped) == pytest.approx(1.25)
    assert moe_dropped_fraction(capped) > 0
    t = [simulate(sc).report.step_time_s for sc in (uniform, capped, skewed)]
    assert t[0] < t[1] < t[2]
    # The same seed gives the same draw; another seed another one.
    again = build_scenario(scenario(moe={"routing": "skewed", "skew": 1.2, "seed": 3}, **base))
    assert moe_load_factor(again) == moe_load_factor(skewed)


def test_context_parallel_allgather_and_ring_attention():
    base = dict(model="llama3-8b", batch={"micro_batch_size": 1, "global_batch_size": 4, "seq_length": 32768},
                cluster={"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
    reports = {}
    for mode in ("allgather", "ring"):
        sc = build_scenario(scenario(parallelism={"tp": 1, "pp": 1, "cp": 8, "zero": 1, "cp_attention": mode}, **base))
        res = simulate(sc)
        ops = {c.op for seg in res.program.segments.values() for c in seg.comm
               if c is not None and c.dim == "cp" and c.op != "join"}
        reports[mode] = (res.report, ops)
    assert reports["allgather"][1] == {"all_gather", "reduce_scatter"}
    assert reports["ring"][1] == {"ring_step"}
    # Ring attention overlaps K/V passing with attention blocks: little cp is exposed.
    ring = reports["ring"][0]
    assert ring.exposed_comm_s["cp"] < 0.02 * ring.step_time_s


def test_deepseek_v3_like_scenario_simulates_end_to_end():
    sc = build_scenario({
        "name": "deepseek-v3-like", "model": "deepseek-v3",
        "parallelism": {"tp": 1, "pp": 16, "ep": 64, "zero": 1, "sequence_parallel": False},
        "batch": {"micro_batch_size": 1, "global_batch_size": 4096, "seq_length": 4096}, "schedule": "dualpipe",
        "cluster": {"gpus": 2048, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta",
    })
    res = simulate(sc)
    rep = res.report
    assert rep.gpus == 2048 and rep.step_time_s > 0 and 0 < rep.mfu < 1
    assert rep.exposed_comm_s["ep"] > 0
    # DualPipe keeps two model copies: every rank holds two stages.
    assert all(len(res.program.schedule.stages_of_rank(r)) == 2 for r in range(16))


def test_llama3_405b_like_with_cp16_and_fsdp_simulates_end_to_end():
    sc = build_scenario({
        "name": "llama3-405b-cp16-fsdp", "model": "llama3-405b",
        # Llama 3 all-gathers K/V (Dubey et al. 2024, Sec. 3.3.2); the generic default is TE's ring.
        "parallelism": {"tp": 8, "pp": 16, "cp": 16, "zero": 3, "fsdp_reshard_after_forward": False,
                        "cp_attention": "allgather"},
        "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 131072},
        "cluster": {"gpus": 16384, "gpu": "h100-sxm-80gb", "topology": "llama3-24k"}, "network": "alpha-beta",
    })
    rep = simulate(sc).report
    assert rep.gpus == 16384 and rep.exposed_comm_s["cp"] > 0 and rep.fits_in_memory


@pytest.mark.parametrize("preset,billions", [("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9),
                                             ("mixtral-8x7b", 46.7), ("mixtral-8x22b", 140.6), ("deepseek-v3", 671.0),
                                             ("qwen3-235b-a22b", 235.1), ("gpt3-175b", 174.6)])
def test_presets_have_their_published_parameter_counts(preset, billions):
    from simulator.workload.ops import total_parameters

    sc = build_scenario({"model": preset, "batch": {"global_batch_size": 8, "seq_length": 2048}, "cluster": {"gpus": 8}})
    assert total_parameters(sc) / 1e9 == pytest.approx(billions, rel=0.01), preset


def test_routing_imbalance_changes_time_not_model_flops():
    base = dict(model="mixtral-8x7b", parallelism={"tp": 1, "pp": 1, "ep": 8, "zero": 1},
                batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024})
    uniform = simulate(build_scenario(scenario(**base)))
    skewed = simulate(build_scenario(scenario(moe={"routing": "skewed", "skew": 1.2}, **base)))
    assert skewed.program.model_flops_per_step == pytest.approx(uniform.program.model_flops_per_step)
    assert skewed.report.mfu < uniform.report.mfu


@pytest.mark.parametrize("over", [
    {"parallelism": {"tp": 2, "cp": 2, "pp": 2, "zero": 3}},
    {"parallelism": {"tp": 2, "cp": 4, "pp": 1, "zero": 1, "cp_attention": "ring"}},
    {"parallelism": {"tp": 2, "pp": 2, "zero": 3, "fsdp_shard_size": 4}},
    {"model": "mixtral-8x7b", "parallelism": {"tp": 1, "pp": 4, "ep": 4, "zero": 1}, "schedule": "dualpipe",
     "batch": {"micro_batch_size": 1, "global_batch_size": 128, "seq_length": 2048}},
    # experts reduced over dp x tp / ep under SP, sharded inside HSDP shard groups (test_expert_groups)
    {"model": "mixtral-8x7b", "parallelism": {"tp": 2, "pp": 1, "ep": 4, "zero": 3, "fsdp_shard_size": 8}},
], ids=["fsdp-tp-cp-pp", "ring-attention", "hsdp", "moe-ep-dualpipe", "moe-tp-sp-hsdp"])
def test_reduced_and_full_modes_agree_with_every_parallelism(over):
    # Symmetry is exploited (one rank per pipeline rank) and checked: simulating all 64 ranks,
    # each rendezvousing with its real groups on the flow fabric, gives the same step.
    d = {"model": "llama3-8b", "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 4096},
         "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, **over}
    sc = build_scenario(d)
    reduced, full = simulate(sc, "reduced").report, simulate(sc, "every-rank").report
    assert full.step_time_s == pytest.approx(reduced.step_time_s, rel=1e-3)
    for dim in ("tp", "cp", "ep", "pp", "dp"):
        assert full.exposed_comm_s[dim] == pytest.approx(reduced.exposed_comm_s[dim], rel=1e-3, abs=1e-6), dim


def test_expert_state_is_sharded_over_expert_data_parallel_only():
    # Mixtral with ep=8 on dp=16: dense optimizer state is split 16 ways, an expert's only over
    # edp = dp / ep = 2 (each expert lives on 1/8 of the DP ranks).
    sc = build_scenario(scenario(model="mixtral-8x7b", parallelism={"tp": 1, "pp": 1, "ep": 8, "zero": 1},
                                 batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}))
    res = simulate(sc)
    prog = res.program
    expert = prog.stage_expert_params[0]
    dense = prog.stage_params[0] - expert
    assert expert > dense  # Mixtral is mostly experts
    assert res.memory.per_rank_gib[0]["optimizer_gib"] * 1024**3 == pytest.approx(12 * (dense / 16 + expert / 2), rel=1e-9)


def test_tp_beyond_the_kv_heads_gathers_the_qkv_output_as_megatron_core_does():
    # Llama 3 70B (64 query heads, 8 KV heads of 128) at TP16: megatron-core 0.16.1 splits the
    # interleaved QKV weight evenly, all-gathers the QKV output over tp and keeps its group's slice.
    def sc(tp, framework="generic"):
        return build_scenario({
            "model": "llama3-70b", "framework": framework, "parallelism": {"tp": tp, "pp": 1, "sequence_parallel": True},
            "batch": {"micro_batch_size": 1, "global_batch_size": 4, "seq_length": 4096},
            "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
        })
    ops16 = {o.name: o for o in build_layer_ops(sc(16))["dense"].forward}
    assert ops16["qkv_proj"].kernel.n == (64 + 2 * 8) * 128 // 16
    gather = ops16["qkv_group_gather"].comm
    assert (gather.dim, gather.op, gather.size_bytes) == ("tp", "all_gather", 4096 * (64 + 2 * 8) * 128 * 2)
    assert "qkv_group_gather" not in {o.name for o in build_layer_ops(sc(8))["dense"].forward}
    # Its backward is the conjugate reduce-scatter, and the step pays for it.
    i_ops, _ = build_layer_ops(sc(16))["dense"].backward()
    assert any(o.comm is not None and o.comm.op == "reduce_scatter" and o.comm.size_bytes == gather.size_bytes
               for o in i_ops)
    # torchtitan views each rank's K/V shard as whole heads: more ranks than KV heads is refused.
    with pytest.raises(UserError, match=r"tp=16 exceeds num_kv_heads=8: .*choose tp among 1, 2, 4, 8"):
        sc(16, framework="torchtitan")


def test_selective_layer_recompute_counts_each_stages_checkpointed_layers():
    # recompute selective-layer checkpoints every second block a rank wraps (torchtitan's
    # per-process counter, program.checkpointed_layers): a stage of 11 layers checkpoints its
    # 2nd, 4th... (5) and keeps 6 whole, wherever it starts -- not 5.5 each (nor 6 and 5 by
    # global even layers, the rule before). The layer being recomputed in backward is a
    # checkpointed one: it re-materialises all a kept layer holds beyond its input.
    from simulator.workload.memory import stage_activation_bytes

    sc = build_scenario(scenario(framework="torchtitan", recompute="selective-layer", flash_attention=True,
                                 parallelism={"tp": 1, "pp": 3, "zero": 1, "pp_layer_split": [11, 11, 10]},
                                 batch={"micro_batch_size": 1, "global_batch_size": 48, "seq_length": 2048},
                                 cluster={"gpus": 48, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}))
    res = simulate(sc)
    full = activation_bytes_per_layer(sc.model_copy(update={"recompute": "full"}))
    none = activation_bytes_per_layer(sc.model_copy(update={"recompute": "none"}))
    assert none > 10 * full
    embedding_out = 2 * 2048 * 4096
    by_stage = stage_activation_bytes(sc, res.program)
    assert by_stage[0] == pytest.approx(5 * full + 6 * none + embedding_out, rel=1e-12)
    assert by_stage[1] == pytest.approx(5 * full + 6 * none, rel=1e-12)
    for row in res.memory.per_rank_gib:
        assert row["recompute_working_set_gib"] * 1024**3 == pytest.approx(none - full, rel=1e-12)


def _recomputed_layers(prog) -> set[int]:
    """Layers whose input-gradient pass reruns forward work: their I FLOPs exceed the least."""
    by_layer: dict[int, float] = {}
    for (pos, kind), seg in prog.segments.items():
        if kind == "I":
            for L, f in zip(seg.layer.tolist(), seg.flops.tolist()):
                if 0 <= L < prog.scenario.model.num_layers:
                    by_layer[L] = by_layer.get(L, 0.0) + f
    least = min(by_layer.values())
    return {L for L, f in by_layer.items() if f > least * (1 + 1e-9)}


@pytest.mark.parametrize("schedule,pp,vpp,ckpt,per_position", [
    # 1F1B, 3 layers a stage: each rank wraps its own blocks 0, 1, 2 and checkpoints the 2nd.
    # By global even layers it was {0, 2, 4, 6, 8, 10}: 2, 1, 2, 1 a stage.
    ("1f1b", 4, 1, {1, 4, 7, 10}, [1, 1, 1, 1]),
    # V: rank 0 wraps stage 0 (layers 0-2), then stage 3 (9-11), one count across both chunks
    # (stage_ids_this_rank order); rank 1 stages 1 and 2.
    ("zbv", 2, 1, {1, 9, 11, 4, 6, 8}, [1, 1, 2, 2]),
    # Interleaved (loop placement): rank 0 wraps stages 0 and 2 (layers 0-2, 6-8), rank 1 stages 1 and 3.
    ("interleaved-1f1b", 2, 2, {1, 6, 8, 4, 9, 11}, [1, 1, 2, 2]),
])
def test_selective_layer_checkpoints_every_second_block_a_rank_wraps(schedule, pp, vpp, ckpt, per_position):
    # torchtitan 0.1.0 _apply_ac_to_transformer_block counts blocks on a per-process counter and
    # wraps the 2nd, 4th...: which layers are checkpointed depends on each rank's own blocks, in
    # the order parallelize meets them. The work (which layers rerun their forward) and the
    # memory (which keep only their input) follow the same rule.
    from simulator.sweep.estimate import Estimator
    from simulator.workload.memory import loss_bytes_per_logit, stage_activation_bytes
    from simulator.workload.program import checkpointed_layers

    model = {"name": "small", "num_layers": 12, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 16,
             "vocab_size": 32000}
    sc = build_scenario(scenario(model=model, framework="torchtitan", recompute="selective-layer", flash_attention=True,
                                 schedule=schedule, parallelism={"tp": 1, "pp": pp, "vpp": vpp, "zero": 1},
                                 batch={"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 2048}))
    res = simulate(sc)
    prog = res.program
    assert [len(ls) for ls in prog.position_layers] == [3] * (12 // 3)
    assert checkpointed_layers(sc, prog.schedule, prog.position_layers) == ckpt
    assert _recomputed_layers(prog) == ckpt
    full = activation_bytes_per_layer(sc.model_copy(update={"recompute": "full"}))
    none = activation_bytes_per_layer(sc.model_copy(update={"recompute": "none"}))
    embedding_out = 2 * 2048 * 2048
    loss = loss_bytes_per_logit(sc)[0] * 2048 * 32000  # what the loss keeps a logit
    by_position = {prog.schedule.stage_position[st]: b for st, b in enumerate(stage_activation_bytes(sc, prog))}
    for q, n in enumerate(per_position):
        extra = (embedding_out if q == 0 else 0) + (loss if q == len(per_position) - 1 else 0)
        assert by_position[q] == pytest.approx(n * full + (3 - n) * none + extra, rel=1e-12), q
    # The sweep estimate's per-layer reference Program checkpoints the point's layers.
    assert Estimator().estimate(sc).peak_memory_gib == pytest.approx(res.memory.peak_gib, rel=1e-9)


def test_selective_layer_one_block_a_rank_checkpoints_none():
    # A rank that wraps a single block never reaches the counter's second: nothing recomputed,
    # no recompute working set (the model had the even layers recomputed on ranks 0 and 2).
    from simulator.workload.program import checkpointed_layers

    model = {"name": "small", "num_layers": 4, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 16,
             "vocab_size": 32000}
    sc = build_scenario(scenario(model=model, framework="torchtitan", recompute="selective-layer", flash_attention=True,
                                 parallelism={"tp": 1, "pp": 4, "zero": 1},
                                 batch={"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 2048}))
    res = simulate(sc)
    assert checkpointed_layers(sc, res.program.schedule, res.program.position_layers) == frozenset()
    assert not any("recompute_working_set_gib" in row for row in res.memory.per_rank_gib)
    none = simulate(sc.model_copy(update={"recompute": "none"}))
    assert res.report.step_time_s == pytest.approx(none.report.step_time_s, rel=1e-12)


def test_fp8_tensor_parallel_without_sequence_parallel_saves_the_replicated_inputs_in_fp8():
    # Without sequence parallelism the QKV and fc1 inputs are replicated on every tp rank
    # (Korthikanti Sec. 4.2.1: 10 sbh of them with the norms' inputs and dropout masks); FP8
    # linears keep them as 1-byte copies, so their saving is 2 sbh whole and only the
    # out-projection's and fc2's inputs (1 + f sbh) shrink by t. llama3-8b: f = 3.5, c = 36.
    def act(dtype):
        d = scenario(parallelism={"tp": 4, "pp": 1, "zero": 0, "sequence_parallel": False}, dtype=dtype, flash_attention=True)
        if dtype == "fp8":
            d["fp8"] = {"recipe": "te-delayed"}
        return activation_bytes_per_layer(build_scenario(d))
    sbh = 2048 * 4096
    assert act("bf16") == pytest.approx(sbh * (10 + (36 - 10) / 4), rel=1e-12)
    assert act("fp8") == pytest.approx(sbh * (8 + (36 - 10 - 4.5) / 4), rel=1e-12)  # 107 MiB, was 119


@pytest.mark.parametrize("sp", [True, False])
def test_mla_runs_its_down_projections_on_this_ranks_tokens_and_gathers_the_latents(sp):
    """megatron-core MLA (0.16.1 multi_latent_attention.py): the down-projections are duplicated
    TELinears that read the rank's hidden states (the sequence shard under SP); the up-projections
    gather the latents (and the rotary key part apart), not the hidden state; without SP their
    input gradients are all-reduced at the latents' width. Under SP the duplicated weights'
    gradients are summed over tp once a step."""
    from simulator.workload.ops import build_layer_ops
    from simulator.workload.program import build_program
    from simulator.profile import load_profile
    from simulator.simulate import resolve_schedule

    from simulator.scenario import resolve_model

    # megatron-core refuses MoE under tp without SP (MoELayer.forward): without SP, DeepSeek-V3's
    # attention in a dense model of the same shape.
    model = "deepseek-v3" if sp else {**resolve_model("deepseek-v3").model_dump(), "num_experts": 0,
                                      "num_shared_experts": 0, "num_dense_layers": 0}
    sc = build_scenario({"model": model, "parallelism": {"tp": 2, "pp": 1, "ep": 8 if sp else 1, "sequence_parallel": sp},
                         "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 4096},
                         "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
    T, t, h, q_lora, kv_lora, rope = 4096, 2, 7168, 1536, 512, 64
    lo = build_layer_ops(sc)["moe" if sp else "dense"]
    ops = {o.name: o for o in lo.forward}
    tokens = T // t if sp else T
    assert ops["q_down_proj"].kernel.m == ops["kv_down_proj"].kernel.m == tokens
    assert ops["q_up_proj"].kernel.m == ops["kv_up_proj"].kernel.m == T
    comms = {o.name: (o.comm.op, o.comm.size_bytes) for o in lo.forward if o.comm is not None and o.comm.dim == "tp"}
    gather = "all_gather" if sp else "identity_ar"
    out = "reduce_scatter" if sp else "all_reduce"
    # The shared expert is tensor-parallel as the dense MLP is (megatron-core SharedExpertMLP).
    expected = {"q_latent_in": (gather, T * q_lora * 2), "kv_latent_in": (gather, T * kv_lora * 2),
                "attn_out": (out, T * h * 2)}
    if sp:
        expected |= {"k_rope_gather": ("all_gather", T * rope * 2), "shared_in": (gather, T * h * 2),
                     "shared_out": (out, T * h * 2)}
    else:
        expected |= {"mlp_in": ("identity_ar", T * h * 2), "mlp_out": ("all_reduce", T * h * 2)}
    assert comms == expected
    i_ops, _ = lo.backward()
    regathers = {o.name for o in i_ops if o.name.endswith(".input_regather")}
    assert regathers == ({"q_up_proj.input_regather", "kv_up_proj.input_regather", "shared_fc1_gate_up.input_regather"}
                         if sp else set())
    prog = build_program(sc, load_profile("h100-sxm-80gb"), resolve_schedule(sc))
    dup = {s.label: s for s in prog.step_collectives}.get("sp duplicated weight grads")
    per_layer = h * (q_lora + kv_lora + rope) + q_lora + kv_lora
    router = h * sc.model.num_experts * (sc.model.num_layers - sc.model.num_dense_layers)
    if sp:
        assert dup.dim == "tp" and dup.size_bytes == pytest.approx((sc.model.num_layers * per_layer + router) * 4)
    else:
        assert dup is None


def test_the_final_norms_gradient_is_summed_over_tp_under_sequence_parallelism():
    from simulator.workload.ops import build_layer_ops

    def head(sp):
        return build_layer_ops(build_scenario({"model": "llama3-8b", "parallelism": {"tp": 2, "sequence_parallel": sp},
                                               "batch": {"global_batch_size": 8, "seq_length": 2048},
                                               "cluster": {"gpus": 8}}))["head"]
    _, w_ops = head(True).backward()
    norm_ar = [o for o in w_ops if o.comm is not None and o.comm.dim == "tp"]
    assert [(o.comm.op, o.comm.size_bytes) for o in norm_ar] == [("all_reduce", 4096 * 4.0)]
    assert not [o for o in head(False).backward()[1] if o.comm is not None]
