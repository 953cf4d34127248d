"""The expert-data-parallel group: the ranks that hold the same experts and reduce their gradients.

The experts are not split by tp (expert tensor parallelism 1), so under sequence parallelism every
tp rank routes its own tokens through the same experts: the group is dp / ep x cp x tp
(megatron-core 0.16.1 parallel_state: world / (etp x ep x pp); torchtitan 0.3.0 efsdp).
"""

from __future__ import annotations

import numpy as np
import pytest

from agreement_scenarios import SMALL_MOE, scenario
from simulator.errors import UserError
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.simulate import resolve_schedule, simulate
from simulator.sweep.estimate import Estimator
from simulator.topology.placement import Mesh
from simulator.vocabulary import CollectiveOp, Dim, Stream
from simulator.workload.memory import memory_report
from simulator.workload.ops import build_layer_ops
from simulator.workload.plan import build_plan
from simulator.workload.program import build_program

GIB = 1024**3


def plan_of(d: dict):
    sc = build_scenario(d)
    prog = build_program(sc, load_profile(sc.cluster.gpu), resolve_schedule(sc))
    return sc, prog, build_plan(prog)


def expert_grad_reductions(plan):
    """The gradient reductions of rank class 0 whose first step runs on an expert group."""
    return [c for c in plan.ranks[0].collectives()
            if c.stream == Stream.DP and c.steps[0][0] in (Dim.EDP, Dim.EDP_SHARD)]


def split_params(prog) -> tuple[float, float]:
    expert = prog.stage_expert_params[0]
    return prog.stage_params[0] - expert, expert


def test_the_expert_folding_cuts_a_stages_tp_cp_dp_ranks_into_consecutive_ep_groups():
    # megatron-core 0.16.1's expert rank generator (etp 1, the default order): a stage's ranks in
    # tp-cp-dp order, ep consecutive ranks an EP group, the ranks at the same place in each group
    # the expert-data-parallel group.
    mesh = Mesh(tp=2, cp=2, ep=2, dp=4, pp=2, edp_tp=2)
    ep, edp = mesh.groups("ep"), mesh.groups("edp")
    assert ep.shape == (16, 2) and edp.shape == (mesh.pp * mesh.ep, mesh.edp) == (4, 8)
    assert mesh.edp == mesh.dp * mesh.cp * mesh.tp // mesh.ep == 8
    for groups in (ep, edp):
        assert sorted(groups.ravel().tolist()) == list(range(mesh.world_size))
    # An EP group of 2 is a TP pair (consecutive ranks); the expert data-parallel group takes one
    # rank of each pair, across cp and dp.
    assert ep[:2].tolist() == [[0, 1], [2, 3]]
    assert edp[0].tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    c = mesh.coords  # pp, dp, cp, tp, ep
    for g in edp:
        assert len({(int(c[r, 0]), int(c[r, 4])) for r in g}) == 1, "one (pp, ep) index per group"
    # An EP group larger than dp: 16 ranks a stage (tp 2 x dp 8), ep 16 spans every one of them.
    wide = Mesh(tp=2, cp=1, ep=16, dp=8, pp=2, edp_tp=2)
    assert wide.groups("ep").tolist() == [list(range(16)), list(range(16, 32))]
    assert wide.edp == 1 and wide.ep_dp_span == 8
    # Where tp ranks route the same tokens (no sequence parallelism), the folding runs over each
    # tp index's cp x dp ranks: an EP group keeps one tp index.
    same_tokens = Mesh(tp=2, cp=1, ep=2, dp=4, pp=1)
    assert same_tokens.groups("ep").tolist() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert same_tokens.groups("edp").tolist() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(UserError, match=r"^ep=3 must divide the 8 ranks of a pipeline stage that route tokens to "
                                        r"experts \(dp x cp x tp = 4 x 1 x 2\): choose an ep that divides 8$"):
        Mesh(tp=2, cp=1, ep=3, dp=4, pp=1, edp_tp=2)


def test_expert_gradients_are_reduced_over_dp_tp_cp_over_ep_ranks_under_sequence_parallelism():
    # 16 GPUs, tp 2 with SP, ep 2: dp 8, and the experts of one ep index live on dp x tp / ep = 8 ranks.
    # The folding makes each TP pair an EP group, so a group of ranks holding the same experts
    # holds one tp index: the experts of the pair's two halves differ.
    sc, prog, plan = plan_of(scenario("moe-tp2", model=SMALL_MOE, parallelism={"tp": 2, "ep": 2, "zero": 1}))
    mesh = prog.mesh
    assert (mesh.dp, mesh.tp, mesh.cp, mesh.ep) == (8, 2, 1, 2)
    groups = plan.groups[Dim.EDP]
    assert groups.shape == (2, 8)
    c = mesh.coords
    for g in groups:
        assert len(set(c[g, 4].tolist())) == 1 and len(set(c[g, 1].tolist())) == 8  # one ep index, every dp rank
    assert np.array_equal(plan.groups[Dim.EP], plan.groups[Dim.TP])
    assert sorted(groups[0].tolist()) == [r for r in range(mesh.world_size) if c[r, 4] == c[groups[0][0], 4]]
    reductions = expert_grad_reductions(plan)
    assert reductions and {(d, op) for c_ in reductions for d, op, _ in c_.steps} == {(Dim.EDP, CollectiveOp.REDUCE_SCATTER)}
    # ZeRO-1: the expert parameters are all-gathered back over the same group (by buckets in the
    # first forward: a MoE layer's bucket gathers its dense part over dp, its experts over edp).
    gathers = [c_ for c_ in plan.ranks[0].collectives() if c_.stream == Stream.DP_AG]
    assert any([d for d, _, _ in g.steps] == [Dim.DP, Dim.EDP] for g in gathers)
    edp_bytes = sum(b for g in gathers for d, _, b in g.steps if d == Dim.EDP)
    assert edp_bytes == pytest.approx(prog.stage_expert_params[0] * prog.param_bytes)


def test_expert_optimizer_state_divides_by_the_expert_data_parallel_group():
    d = scenario("moe-tp2", model=SMALL_MOE, parallelism={"tp": 2, "ep": 2, "zero": 1})
    res = simulate(build_scenario(d))
    dense, expert = split_params(res.program)
    assert expert > 0
    # Megatron's 12 bytes of fp32 state a parameter: dense over dp x cp = 8, experts over dp x tp x cp / ep = 8
    # (it was dp / ep = 4: the tp ranks left out).
    assert res.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * (dense / 8 + expert / 8), rel=1e-9)


def test_experts_without_sequence_parallelism_keep_tp_out_of_the_expert_group():
    # Without SP every tp rank routes the same tokens: its expert gradients equal its tp peer's.
    # megatron-core refuses MoE under tp without SP (MoELayer.forward); Megatron-DeepSpeed runs it.
    d = scenario("moe-tp2-nosp", model=SMALL_MOE, framework="megatron-deepspeed",
                 parallelism={"tp": 2, "ep": 2, "zero": 1, "sequence_parallel": False})
    sc, prog, plan = plan_of(d)
    assert np.array_equal(plan.groups[Dim.EDP], prog.mesh.groups("edp"))
    res = simulate(sc)
    dense, expert = split_params(res.program)
    assert res.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * (dense / 8 + expert / 4), rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_at_tp_1_the_expert_group_is_dp_over_ep_times_cp_as_before(zero):
    sc, prog, plan = plan_of(scenario("moe-tp1", model=SMALL_MOE, parallelism={"ep": 4, "zero": zero}))
    assert prog.edp_tp == 1
    assert np.array_equal(plan.groups[Dim.EDP], prog.mesh.groups("edp"))
    assert plan.groups[Dim.EDP].shape == (4, 4)


def test_tp_ranks_shard_and_reduce_the_experts_when_dp_times_cp_is_one():
    # tp 2 with SP on 2 GPUs: no data parallelism, yet the two tp ranks hold the same experts and
    # route different tokens: ZeRO-1 shards the expert state over them, and gathers it back.
    d = scenario("moe-tp2-dp1", model=SMALL_MOE, gpus=2, gbs=4, parallelism={"tp": 2, "zero": 1})
    sc, prog, plan = plan_of(d)
    assert plan.groups[Dim.EDP].tolist() == [[0, 1]]
    assert {d_ for c_ in expert_grad_reductions(plan) for d_, _, _ in c_.steps} == {Dim.EDP}
    gathers = [c_ for c_ in plan.ranks[0].collectives() if c_.stream == Stream.DP_AG]
    assert gathers and all([d_ for d_, _, _ in c_.steps] == [Dim.EDP] for c_ in gathers)
    res = simulate(sc)
    dense, expert = split_params(res.program)
    assert res.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * (dense + expert / 2), rel=1e-9)
    # ZeRO-3 alike: only the experts are sharded, so only they are gathered, and the memory
    # model holds the gathered units beside the shards.
    sc3, _, plan3 = plan_of({**d, "parallelism": {"tp": 2, "zero": 3}})
    gathers = [c_ for c_ in plan3.ranks[0].collectives() if c_.stream == Stream.DP_AG]
    assert gathers and all([d_ for d_, _, _ in c_.steps] == [Dim.EDP] for c_ in gathers)
    assert simulate(sc3).memory.per_rank_gib[0]["gathered_parameters_gib"] > 0


def test_zero3_gathers_a_moe_units_experts_over_the_expert_group():
    # FSDP (torchtitan) shards the routed experts on their own mesh: a MoE unit's gather moves the
    # block's dense parameters over dp and its experts over the expert group, back to back.
    sc, prog, plan = plan_of(scenario("moe-z3", model=SMALL_MOE, parallelism={"tp": 2, "ep": 2, "zero": 3}))
    gathers = [c_ for c_ in plan.ranks[0].collectives() if c_.stream == Stream.DP_AG]
    by_layer = {c_.name: c_ for c_ in gathers}
    moe = by_layer["all_gather params layer 0"]
    (d1, op1, dense_bytes), (d2, op2, expert_bytes) = moe.steps
    assert (d1, op1, d2, op2) == (Dim.DP, CollectiveOp.ALL_GATHER, Dim.EDP, CollectiveOp.ALL_GATHER)
    assert expert_bytes == pytest.approx(prog.unit_expert_gather_bytes[0]) and expert_bytes > dense_bytes
    assert dense_bytes + expert_bytes == pytest.approx(prog.unit_params[0] * prog.param_bytes, rel=1e-12)
    # the embedding and the head have no experts: one step
    assert [d_ for d_, _, _ in by_layer["all_gather params layer -1"].steps] == [Dim.DP]


def test_hsdp_shard_group_that_splits_an_ep_group_is_refused():
    d = scenario("hsdp-ep", model=SMALL_MOE, gpus=16, parallelism={"ep": 4, "zero": 3, "fsdp_shard_size": 2})
    with pytest.raises(UserError, match=r"^fsdp_shard_size=2 splits ep=4 groups across HSDP replicas: fsdp_shard_size x cp = 2 "
                                        r"must be a multiple of ep .*use fsdp_shard_size among 4, 8, 16, or an ep that divides 2$"):
        build_scenario(d)


def test_hsdp_shards_the_experts_inside_the_shard_group_and_all_reduces_across_replicas():
    # 32 GPUs, tp 2 (SP), ep 4, shard groups of 8 dp ranks: dp 16 in 2 replicas. The experts of one
    # ep index: dp / ep x tp = 8 ranks, 8 / ep x tp = 4 of them in each shard group (torchtitan's
    # efsdp = dp_shard x cp x tp / ep), 2 replicas.
    d = scenario("hsdp-ep-tp2", model=SMALL_MOE, gpus=32,
                 parallelism={"tp": 2, "ep": 4, "zero": 3, "fsdp_shard_size": 8})
    sc, prog, plan = plan_of(d)
    assert plan.groups[Dim.EDP].shape == (4, 8)
    assert plan.groups[Dim.EDP_SHARD].shape == (8, 4) and plan.groups[Dim.EDP_REP].shape == (16, 2)
    # A shard group of the experts lies inside one dense shard group's ranks (with their tp peers).
    dense_block = {int(r) for r in plan.groups[Dim.DP_SHARD][0]}
    tp_peers = {int(r) for g in plan.groups[Dim.TP] if dense_block & set(g.tolist()) for r in g}
    assert set(plan.groups[Dim.EDP_SHARD][0].tolist()) <= tp_peers
    reductions = expert_grad_reductions(plan)
    assert reductions
    for c_ in reductions:
        (d1, op1, s1), (d2, op2, s2) = c_.steps
        assert (d1, op1, d2, op2) == (Dim.EDP_SHARD, CollectiveOp.REDUCE_SCATTER, Dim.EDP_REP, CollectiveOp.ALL_REDUCE)
        assert s2 == pytest.approx(s1 / 4)
    moe_gather = next(c_ for c_ in plan.ranks[0].collectives() if c_.name == "all_gather params layer 0")
    assert [d_ for d_, _, _ in moe_gather.steps] == [Dim.DP_SHARD, Dim.EDP_SHARD]
    res = simulate(sc)
    dense, expert = split_params(res.program)
    # fp32 master + m + v (torchtitan would keep 4 + 8; this scenario is generic: 12) over the
    # shard groups: dense 8 ranks, experts 4.
    assert res.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * (dense / 8 + expert / 4), rel=1e-9)


@pytest.mark.parametrize("d", [
    scenario("ep2-tp2-moe-zero3", model=SMALL_MOE, parallelism={"tp": 2, "ep": 2, "zero": 3}),
    scenario("hsdp-ep-tp2-moe", model=SMALL_MOE, gpus=32, parallelism={"tp": 2, "ep": 4, "zero": 3, "fsdp_shard_size": 8}),
    scenario("moe-tp2-dp1", model=SMALL_MOE, gpus=2, gbs=4, parallelism={"tp": 2, "zero": 1}),
    scenario("ep8-over-tp2-dp4", model=SMALL_MOE, gpus=8, parallelism={"tp": 2, "ep": 8, "zero": 1}),
    scenario("ep8-over-tp2-dp4-zero3", model=SMALL_MOE, gpus=8, parallelism={"tp": 2, "ep": 8, "zero": 3}),
    scenario("etp2-ep4", model=SMALL_MOE, parallelism={"tp": 2, "ep": 4, "etp": 2, "zero": 1}),
    scenario("etp2-ep4-zero3", model=SMALL_MOE, parallelism={"tp": 2, "ep": 4, "etp": 2, "zero": 3}),
], ids=lambda d: d["name"])
def test_the_estimate_uses_the_same_expert_groups_as_the_simulation(d):
    sc = build_scenario(d)
    res = simulate(sc)
    est = Estimator().estimate(sc)
    assert est.step_time_s == pytest.approx(res.timeline.step_time_s, rel=0.10)
    assert est.optimizer_s == pytest.approx(res.program.optimizer_s, rel=1e-9)
    prof = load_profile(sc.cluster.gpu_name)
    mem = memory_report(sc, build_program(sc, prof, resolve_schedule(sc)), prof.hbm_gib, prof.usable_memory_fraction)
    assert est.peak_memory_gib == pytest.approx(mem.peak_gib, rel=1e-9)


def test_the_router_gradient_is_all_reduced_over_tp_under_sequence_parallelism():
    # The router is replicated over tp and sees this rank's T/tp tokens: its fp32 gradient is summed
    # over tp once a step with the other SP-duplicated weights (megatron-core moe/router.py:
    # weight.sequence_parallel; finalize_model_grads._allreduce_non_tensor_model_parallel_grads).
    sc = build_scenario(scenario("moe-tp2", model=SMALL_MOE, parallelism={"tp": 2, "ep": 2, "zero": 1}))
    h, E = sc.model.hidden_size, sc.model.num_experts
    layers = build_layer_ops(sc)
    assert layers["dense"].tp_norm_grad_bytes == layers["moe"].tp_norm_grad_bytes == 2 * h * 4
    assert layers["moe"].tp_duplicated_params == h * E and layers["dense"].tp_duplicated_params == 0
    prog = build_program(sc, load_profile(sc.cluster.gpu), resolve_schedule(sc))
    moe_layers = sc.model.num_layers - sc.model.num_dense_layers
    per_rank = max(sum(1 for L in prog.position_layers[q] if L >= sc.model.num_dense_layers)
                   for q in range(prog.schedule.num_positions))
    step = {t.label: t for t in prog.step_collectives}["sp duplicated weight grads"]
    assert step.dim == "tp" and step.size_bytes == 4 * h * E * per_rank and per_rank <= moe_layers
    nosp = build_scenario(scenario("moe-tp2", model=SMALL_MOE, framework="megatron-deepspeed",
                                   parallelism={"tp": 2, "ep": 2, "zero": 1, "sequence_parallel": False}))
    assert build_layer_ops(nosp)["moe"].tp_duplicated_params == 0


def test_te_fp8_weight_cache_under_zero3_holds_the_experts_shard_of_the_expert_group():
    # Transformer Engine caches an FP8 copy and its transpose of each linear weight (2 bytes a
    # parameter) on the rank's shard: the experts' over the expert group (dp / ep here), the rest
    # over dp. Dividing the experts by the dense shard counted ep times too few of their bytes.
    sc = build_scenario(scenario("moe-fp8-z3", model=SMALL_MOE, dtype="fp8", fp8={"recipe": "te-delayed"},
                                 parallelism={"ep": 4, "zero": 3}))
    res = simulate(sc, with_critical_path=False)
    prog = res.program
    row = res.memory.per_rank_gib[0]
    expert = sum(prog.stage_expert_params)
    layer_params = sum(prog.unit_params[L] for L in range(sc.model.num_layers))
    dp = sc.dp
    expected = 2 * ((layer_params - expert) / dp + expert / (dp // 4)) / 1024**3
    assert row["fp8_weights_gib"] == pytest.approx(expected, rel=1e-9)


def test_rowwise_fp8_casts_an_experts_weight_on_the_expert_groups_shard():
    # torchao rowwise under ZeRO-3 with the FP8 all-gather casts each weight on its shard before the
    # gather (5 B a parameter of the shard); an expert's shard is the expert group's (dp / ep = 4
    # ranks here), not the dense one (dp = 16), which left the experts' cast 4x too small.
    def cast_bytes(all_gather: bool) -> tuple[float, float]:
        sc = build_scenario(scenario("moe-rowwise", model=SMALL_MOE, dtype="fp8",
                                     fp8={"recipe": "rowwise", "param_all_gather": all_gather},
                                     parallelism={"ep": 4, "zero": 3}))
        op = {o.name: o for o in build_layer_ops(sc)["moe"].forward}["experts_fc1.fp8_cast"]
        fc1 = {o.name: o for o in build_layer_ops(sc)["moe"].forward}["experts_fc1"]
        return op.bytes, fc1.params

    whole, weights = cast_bytes(False)
    sharded, _ = cast_bytes(True)
    assert whole - sharded == pytest.approx(5.0 * weights * (1 - 1 / 4), rel=1e-9)


def test_megatron_core_moe_under_tp_without_sequence_parallelism_is_refused():
    # megatron-core 0.16.1 MoELayer.forward raises in training when attention's tp group is larger
    # than one and sequence_parallel is off; Megatron-DeepSpeed's MoE runs that layout.
    par = {"tp": 2, "ep": 2, "zero": 1, "sequence_parallel": False}
    with pytest.raises(UserError, match=r"mixture-of-experts model with tp=2 needs sequence_parallel.*set parallelism.sequence_parallel true"):
        build_scenario(scenario("moe-tp2-nosp", model=SMALL_MOE, parallelism=par))
    assert build_scenario(scenario("moe-tp2-nosp", model=SMALL_MOE, framework="megatron-deepspeed", parallelism=par)).parallelism.tp == 2
    assert build_scenario(scenario("moe-tp2-sp", model=SMALL_MOE, parallelism={**par, "sequence_parallel": True})).parallelism.tp == 2


def test_ep_larger_than_dp_folds_over_the_tp_ranks_as_megatron_core_does():
    # NeMo 2.5's DeepSeek-V3 recipe runs TP2, PP16, EP64 with expert_tensor_parallel_size 1 on 32 dp
    # ranks: megatron-core's MoE parallel folding cuts each stage's 64 tp x dp ranks into one EP
    # group. The small model here: tp 2 with SP on 8 GPUs (dp 4), ep 8 > dp.
    sc, prog, plan = plan_of(scenario("fold", model=SMALL_MOE, gpus=8, parallelism={"tp": 2, "ep": 8, "zero": 1}))
    assert (sc.dp, prog.mesh.edp) == (4, 1)
    assert plan.groups[Dim.EP].tolist() == [list(range(8))]
    # Every rank holds one expert of its own: no expert gradient to reduce, no expert state sharded.
    assert not expert_grad_reductions(plan)
    res = simulate(sc)
    dense, expert = split_params(res.program)
    assert res.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * (dense / 4 + expert), rel=1e-9)
    # Without sequence parallelism the tp ranks route the same tokens and cannot fold in.
    with pytest.raises(UserError, match=r"^ep=8 does not divide the 4 ranks of a pipeline stage that route tokens to the "
                                        r"experts \(dp x cp = 4 x 1\): choose ep among 1, 2, 4 \(with sequence_parallel "
                                        r"the tp ranks join them\)$"):
        build_scenario(scenario("fold-nosp", model=SMALL_MOE, gpus=8, framework="megatron-deepspeed",
                                parallelism={"tp": 2, "ep": 8, "zero": 1, "sequence_parallel": False}))
    with pytest.raises(UserError, match=r"^ep=16 does not divide the 8 ranks .* \(dp x cp x tp = 4 x 1 x 2\): "
                                        r"choose ep among 1, 2, 4, 8$"):
        build_scenario(scenario("fold16", model=dict(SMALL_MOE, num_experts=16), gpus=8,
                                parallelism={"tp": 2, "ep": 16, "zero": 1}))


def test_an_ep_group_of_tp_pairs_stays_in_the_node_where_carving_it_out_of_dp_left_it():
    # tp 2 with SP and ep 8 on 16 GPUs (dp 8): folded, an EP group is 8 consecutive ranks, one
    # 8-GPU node, and its all-to-all runs on NVLink. Carved out of dp alone (the model before
    # megatron-core's folding), it took one rank of each TP pair: 16 GPUs, two nodes.
    sc, prog, plan = plan_of(scenario("fold-node", model=SMALL_MOE, gpus=16, parallelism={"tp": 2, "ep": 8, "zero": 1}))
    ep = plan.groups[Dim.EP]
    assert ep.shape == (2, 8) and (ep // 8 == ep[:, :1] // 8).all()
    # The ranks holding the same experts: one rank in each EP group, one a node.
    edp = plan.groups[Dim.EDP]
    assert edp.shape == (8, 2) and (edp[:, 1] - edp[:, 0] == 8).all()
    a2a = [i for i in plan.ranks[0].collectives() if i.steps[0][0] == Dim.EP]
    assert a2a, "the MoE layers dispatch and combine over ep"


def test_expert_tensor_parallelism_splits_each_expert_over_the_tp_group():
    # etp = tp (megatron-core's default, --expert-tensor-parallel-size): each tp rank holds 1/tp of
    # every local expert's ffn; the dispatcher gathers the tp group's dispatched tokens after the
    # all-to-all and reduce-scatters the experts' output before the combine (0.16.1
    # MoEAlltoAllTokenDispatcher). The EP groups keep one tp index, and a rank's expert state is
    # shared with dp x cp / ep ranks, not dp x cp x tp / ep.
    base = scenario("etp", model=SMALL_MOE, parallelism={"tp": 2, "ep": 4, "zero": 1})
    whole = {o.name: o for o in build_layer_ops(build_scenario(base))["moe"].forward}
    split_sc = build_scenario({**base, "parallelism": {**base["parallelism"], "etp": 2}})
    split = {o.name: o for o in build_layer_ops(split_sc)["moe"].forward}
    for name in ("experts_fc1", "experts_fc2"):
        assert split[name].params == pytest.approx(whole[name].params / 2)
        assert split[name].exec_flops == pytest.approx(whole[name].exec_flops)
        assert split[name].model_flops == pytest.approx(whole[name].model_flops)
    assert "experts_etp_gather" not in whole
    gather, rs = split["experts_etp_gather"].comm, split["experts_etp_reduce_scatter"].comm
    assert (gather.dim, gather.op, rs.dim, rs.op) == ("tp", "all_gather", "tp", "reduce_scatter")
    assert gather.size_bytes == rs.size_bytes == pytest.approx(split["moe_dispatch"].comm.size_bytes * 2)
    # Backward: the conjugates, and no re-gather of the grouped GEMM's input (the dispatcher's
    # gathered tokens are what the GEMM saved).
    lo = build_layer_ops(split_sc)["moe"]
    i_ops, _ = lo.backward()
    names = [o.name for o in i_ops]
    assert "experts_etp_gather.bwd" in names and "experts_etp_reduce_scatter.bwd" in names
    assert not any(n.startswith("experts_fc1") and n.endswith("input_regather") for n in names)
    sc, prog, plan = plan_of({**base, "parallelism": {**base["parallelism"], "etp": 2}})
    assert prog.mesh.edp == sc.dp // 4 == 2
    c = prog.mesh.coords
    for g in plan.groups[Dim.EP]:
        assert len(set(c[g, 3].tolist())) == 1, "an EP group keeps one tp index"
    res = simulate(sc)
    dense, expert = split_params(res.program)
    assert res.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * (dense / 8 + expert / 2), rel=1e-9)
    # Whole experts (etp 1): twice the expert parameters a rank, over dp x tp / ep = 4 ranks.
    whole_res = simulate(build_scenario(base))
    dense1, expert1 = split_params(whole_res.program)
    assert (dense1, expert1) == pytest.approx((dense, 2 * expert))
    assert whole_res.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * (dense / 8 + expert1 / 4), rel=1e-9)


@pytest.mark.parametrize("par, framework, message", [
    ({"tp": 2, "ep": 2, "etp": 3}, "generic", r"^etp=3 must be 1 or tp=2: experts are either whole on a rank or split"),
    ({"tp": 2, "ep": 2, "etp": 2, "sequence_parallel": False}, "megatron-deepspeed",
     r"^etp=2 gathers the dispatched tokens over the sequence-parallel tp group: set parallelism.sequence_parallel true"),
    ({"tp": 2, "ep": 16, "etp": 2}, "generic",
     r"^ep=16 does not divide the 8 ranks .* \(dp x cp = 8 x 1\): choose ep among 1, 2, 4, 8 \(with etp=1 the tp ranks join them\)$"),
])
def test_bad_expert_tensor_parallelism_is_refused(par, framework, message):
    with pytest.raises(UserError, match=message):
        build_scenario(scenario("etp-bad", model=dict(SMALL_MOE, num_experts=16), framework=framework,
                                parallelism={"zero": 1, **par}))


def test_routed_expert_gemms_are_timed_by_shape_one_problem_per_local_expert():
    # Kernels by shape cover the grouped GEMM: a (tokens an expert) x n x k problem per local
    # expert, the same FLOPs as the op, so the kernel model quantizes each expert's tiles.
    sc = build_scenario(scenario("grouped", model=SMALL_MOE, parallelism={"tp": 2, "ep": 4, "etp": 2, "zero": 1}))
    m = sc.model
    ops = {o.name: o for o in build_layer_ops(sc)["moe"].forward}
    for name, n, k in (("experts_fc1", 2 * m.expert_ffn // 2, m.hidden_size), ("experts_fc2", m.hidden_size, m.expert_ffn // 2)):
        kern = ops[name].kernel
        assert (kern.batch, kern.n, kern.k) == (m.num_experts // 4, n, k)
        assert kern.flops == pytest.approx(ops[name].exec_flops, rel=1e-3)


@pytest.mark.parametrize("style", ["torch", "te"])
def test_tp_comm_overlap_leaves_the_dispatchers_collectives_and_grouped_gemms_alone(style):
    # Async TP and TE's userbuffers pipeline a linear's sequence-parallel gather into its GEMM;
    # the MoE dispatcher's gather over the expert tp group and the grouped GEMM after it are
    # neither (their kernels are timed by shape now, which made them look splittable).
    from simulator.workload.program import micro_pipeline_tp

    sc = build_scenario(scenario("etp-overlap", model=SMALL_MOE, parallelism={"tp": 2, "ep": 4, "etp": 2, "zero": 1}))
    lo = build_layer_ops(sc)["moe"]
    expert_ops = [o for o in lo.forward if o.name.startswith(("experts_", "moe_"))]
    piped = micro_pipeline_tp(lo.forward, 2, style)
    assert [o for o in piped if o.name.startswith(("experts_", "moe_"))] == expert_ops
    i_ops, _ = lo.backward()
    expert_bwd = [o for o in i_ops if o.name.startswith(("experts_", "moe_"))]
    assert [o for o in micro_pipeline_tp(i_ops, 2, style) if o.name.startswith(("experts_", "moe_"))] == expert_bwd
    # The attention block's own gathers are still pipelined.
    assert any(o.name.endswith(".join") for o in piped)
