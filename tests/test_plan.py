"""The workload's communication plan (issue 13): policy in the plan, a generic replay in the engine."""

from __future__ import annotations

import inspect

import pytest

from simulator.profile import load_profile
from simulator.engine import core
from simulator.scenario import build_scenario
from simulator.simulate import resolve_schedule, simulate
from simulator.vocabulary import CollectiveOp, Dim, Stream
from simulator.workload.plan import Collective, Compute, Wait, build_plan
from simulator.workload.program import build_program


def scenario(**over) -> dict:
    d = {
        "name": "t", "model": "llama3-8b", "parallelism": {"tp": 1, "pp": 1, "zero": 0},
        "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024},
        "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta",
    }
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def plan_of(**over):
    sc = build_scenario(scenario(**over))
    prog = build_program(sc, load_profile(sc.cluster.gpu), resolve_schedule(sc))
    return prog, build_plan(prog)


def test_engine_holds_no_parallelism_policy():
    import re

    src = inspect.getsource(core).lower()
    for word in (r"\bzero\b", "fsdp", "hsdp", "bucket", "grad_", "optimizer", "prefetch", "stage_params"):
        assert not re.search(word, src), f"engine mentions {word!r}: policy belongs in the workload plan"


@pytest.mark.parametrize("over", [
    {}, {"parallelism": {"zero": 1}}, {"parallelism": {"zero": 3}}, {"parallelism": {"zero": 3, "fsdp_shard_size": 4}},
    {"parallelism": {"tp": 2, "pp": 4, "zero": 1}, "schedule": "dualpipev", "batch": {"global_batch_size": 32}},
    {"model": "mixtral-8x7b", "parallelism": {"ep": 4, "zero": 1}, "moe": {"overlap_dispatch": True}},
])
def test_every_async_collective_is_issued_before_its_single_wait(over):
    _, plan = plan_of(**over)
    for rp in plan.ranks:
        issued, waited = set(), set()
        for ins in rp.instrs:
            if isinstance(ins, Collective) and not ins.blocking:
                assert ins.handle not in issued
                issued.add(ins.handle)
            elif isinstance(ins, Wait):
                assert ins.handle in issued, "a wait before its collective is issued would deadlock"
                assert ins.handle not in waited
                waited.add(ins.handle)
        assert issued == waited == set(range(rp.num_handles))


def test_hsdp_reduces_in_the_shard_group_then_across_replicas():
    prog, plan = plan_of(parallelism={"zero": 3, "fsdp_shard_size": 4})
    grads = [c for c in plan.ranks[0].collectives() if c.stream == Stream.DP and "grads" in c.name]
    assert grads and all(len(c.steps) == 2 for c in grads)
    for c in grads:
        (d1, op1, s1), (d2, op2, s2) = c.steps
        assert (d1, op1, d2, op2) == (Dim.DP_SHARD, CollectiveOp.REDUCE_SCATTER, Dim.DP_REP, CollectiveOp.ALL_REDUCE)
        assert s2 == pytest.approx(s1 / 4)
    gathers = [c for c in plan.ranks[0].collectives() if c.stream == Stream.DP_AG]
    assert {c.steps[0][0] for c in gathers} == {Dim.DP_SHARD}
    assert plan.groups[Dim.DP_SHARD].shape == (4, 4) and plan.groups[Dim.DP_REP].shape == (4, 4)


def test_fsdp_gathers_every_unit_for_forward_and_backward_with_prefetch():
    prog, plan = plan_of(parallelism={"zero": 3, "fsdp_prefetch": 2})
    instrs = plan.ranks[0].instrs
    units = len(prog.unit_params)  # layers + embedding + head
    gathers = [i for i in instrs if isinstance(i, Collective) and i.stream == Stream.DP_AG]
    assert len(gathers) == 2 * units * prog.schedule.num_microbatches
    # Prefetch 2: three gathers are in flight before the first unit's compute starts.
    first_compute = next(k for k, i in enumerate(instrs) if isinstance(i, Compute))
    assert sum(isinstance(i, Collective) for i in instrs[:first_compute]) == 3


def test_replay_of_the_plan_is_the_simulation():
    # The engine adds nothing but contention: busy compute is the plan's compute, slowed where
    # communication kernels held SMs.
    res = simulate(build_scenario(scenario(parallelism={"tp": 2, "pp": 2, "zero": 1}, batch={"global_batch_size": 32})))
    plan = build_plan(res.program)
    tl = res.timeline
    for r in tl.ranks:
        rp = plan.ranks[tl.pp_rank_of[r]]
        planned = sum(i.seconds for i in rp.instrs if isinstance(i, Compute))
        assert tl.busy_compute_s[r] == pytest.approx(planned + tl.contention_s[r], rel=1e-12)


@pytest.mark.parametrize("gpus,net", [(64, "flow"), (256, "flow"), (256, "alpha-beta")])
def test_reduced_and_full_modes_agree_on_symmetric_scenarios_up_to_256_gpus(gpus, net):
    from agreement_scenarios import SMALL_DENSE

    d = scenario(model=dict(SMALL_DENSE, num_layers=4), network=net,
                 parallelism={"tp": 2, "pp": 2, "zero": 1}, batch={"global_batch_size": gpus // 4 * 2, "seq_length": 512},
                 cluster={"gpus": gpus})
    sc = build_scenario(d)
    red, full = simulate(sc, "reduced"), simulate(sc, "every-rank")
    assert full.timeline.step_time_s == pytest.approx(red.timeline.step_time_s, rel=1e-3)
    for dim in ("tp", "pp", "dp"):
        assert full.report.exposed_comm_s[dim] == pytest.approx(red.report.exposed_comm_s[dim], rel=1e-3, abs=1e-7)
    assert full.report.bubble_fraction == pytest.approx(red.report.bubble_fraction, rel=1e-3, abs=1e-6)
    assert len(full.timeline.ranks) == gpus


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev", "zbv", "zb-h1", "1f1b"])
def test_every_stage_of_a_rank_reduces_all_its_gradients(schedule):
    # DualPipe's first (and, for dualpipe, last) rank ends one of its stages with a full B while it
    # splits others into I and W; the planner took only W as a stage's last gradient action on such
    # a rank, so that stage's gradients were never reduced (dualpipev rank 0: 357.6 of 715.2 MB).
    prog, plan = plan_of(model={"name": "s", "num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 7168,
                                "num_attention_heads": 16, "num_kv_heads": 8, "vocab_size": 32000, "mlp": "swiglu"},
                         parallelism={"tp": 2, "pp": 4, "zero": 1}, batch={"global_batch_size": 64}, schedule=schedule,
                         cluster={"gpus": 32})
    sched = plan.schedule
    for rp in plan.ranks:
        reduced = sum(sum(s[2] for s in i.steps) for i in rp.instrs
                      if type(i) is Collective and i.stream == Stream.DP and "grads" in i.name)
        expected = sum(float(prog.segments[(sched.stage_position[st], "W")].grad_bytes.sum())
                       for st in sched.stages_of_rank(rp.pp_rank))
        assert reduced == pytest.approx(expected, rel=1e-9), (schedule, rp.pp_rank, reduced, expected)


def test_megatron_reduces_in_one_piece_without_overlap_whatever_the_bucket():
    # megatron-core sets bucket_size to None without overlap_grad_reduce, even when one is given;
    # FSDP (zero 3) still reduces per unit; DeepSpeed keeps its 500M-element buffers.
    from simulator.scenario import build_scenario

    def sc(**par):
        return build_scenario({"model": "llama3-8b", "parallelism": {"tp": 2, "pp": 2, **par},
                               "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024},
                               "cluster": {"gpus": 16}})

    assert sc(overlap_grad_reduce=False).grad_reduce_in_one_piece
    assert sc(overlap_grad_reduce=False, grad_bucket_params=5_000_000).grad_reduce_in_one_piece
    assert not sc(overlap_grad_reduce=False, zero=3).grad_reduce_in_one_piece
    assert not sc(overlap_grad_reduce=True).grad_reduce_in_one_piece
    ds = build_scenario({"model": "llama3-8b", "framework": "megatron-deepspeed",
                         "parallelism": {"tp": 2, "pp": 2, "zero": 0, "overlap_grad_reduce": False},
                         "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024},
                         "cluster": {"gpus": 16}})
    assert not ds.grad_reduce_in_one_piece and ds.grad_bucket_params == 500_000_000
    # megatron-core's bucket grows with dp: max(40M, 1M x dp)
    big = build_scenario({"model": "llama3-8b", "parallelism": {"tp": 1, "pp": 1},
                          "batch": {"micro_batch_size": 1, "global_batch_size": 128, "seq_length": 1024},
                          "cluster": {"gpus": 128}})
    assert big.grad_bucket_params == 128_000_000 and sc().grad_bucket_params == 40_000_000


@pytest.mark.parametrize("schedule,vpp,tied_ranks", [("1f1b", 1, {0, 3}), ("interleaved-1f1b", 2, {0, 3}),
                                                     ("zbv", 1, set()), ("dualpipev", 1, set())])
def test_tied_embedding_grads_are_all_reduced_between_the_ranks_holding_the_two_ends(schedule, vpp, tied_ranks):
    # V-shaped schedules put the first and the last stage on pp rank 0: nothing to all-reduce. The
    # plan all-reduced the matrix's gradient (50,304 x 1,024 fp32: 206 MB) between pp ranks 0 and 3,
    # the last of which holds neither; zbv on this layout 19.10 -> 14.76 ms a step.
    model = {"name": "tied", "num_layers": 8, "hidden_size": 1024, "ffn_hidden_size": 4096, "num_attention_heads": 16,
             "vocab_size": 50304, "tied_embeddings": True}
    prog, plan = plan_of(model=model, schedule=schedule, parallelism={"pp": 4, "vpp": vpp},
                         batch={"global_batch_size": 32})
    sizes = {rp.pp_rank: [c.steps[0][2] for c in rp.collectives() if c.steps[0][0] == Dim.EMB] for rp in plan.ranks}
    assert {r for r, s in sizes.items() if s} == tied_ranks
    assert all(s == [50304 * 1024 * 4] for r, s in sizes.items() if r in tied_ranks)


def _fsdp2_pp(framework: str, schedule: str = "1f1b", vpp: int = 1):
    return plan_of(framework=framework, schedule=schedule,
                   parallelism={"pp": 4, "vpp": vpp, "zero": 3, "fsdp_reshard_after_forward": False},
                   batch={"global_batch_size": 32})


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_torchtitan_pipeline_reduces_a_stages_gradients_after_its_last_backward_blocking(schedule, vpp):
    # torch.distributed.pipelining (torch 2.13 stage.py backward_maybe_with_nosync, perform_reduce_grad;
    # schedules.py _add_reduce_grad) runs FSDP2's post_backward for every unit of a stage after its
    # last backward; each waits on the compute stream for the previous reduce-scatter
    # (post_backward_rs_wait) and the final callback for the last: nothing overlaps a backward.
    prog, plan = _fsdp2_pp("torchtitan", schedule, vpp)
    sched = plan.schedule
    for rp in plan.ranks:
        grads = [i for i in rp.instrs if type(i) is Collective and i.stream == Stream.DP and "grads" in i.name]
        assert grads and all(c.blocking for c in grads)
        reduced = sum(c.steps[0][2] for c in grads)
        expected = sum(float(prog.segments[(sched.stage_position[st], "W")].grad_bytes.sum())
                       for st in sched.stages_of_rank(rp.pp_rank))
        assert reduced == pytest.approx(expected, rel=1e-9)
        # Every reduction comes after its stage's last backward compute, before any later compute
        # of that stage.
        for st in sched.stages_of_rank(rp.pp_rank):
            last_b = max(k for k, i in enumerate(rp.instrs) if type(i) is Compute and i.stage == st and i.kind in "BW")
            first = min(k for k, i in enumerate(rp.instrs) if i in grads and i.stage == st)
            assert first > last_b
    # Other frameworks' ZeRO-3 keeps reducing each unit beside the last backward.
    _, generic = _fsdp2_pp("generic")
    assert all(not c.blocking for c in generic.ranks[0].collectives() if c.stream == Stream.DP and "grads" in c.name)


def test_torchtitan_pipeline_gradient_reduction_is_exposed():
    # Replayed alone (plan.linear_replay, 1 GB/s for every collective), pp rank 0's reductions are
    # exposed whole; reduced unit by unit beside the last backward they were mostly hidden.
    from dataclasses import replace as dc_replace

    from simulator.workload.plan import linear_replay

    prog, plan = _fsdp2_pp("torchtitan")
    coll = lambda dim, op, size: size / 1e9  # noqa: E731
    after = linear_replay(plan.ranks[0].instrs, coll)
    before = linear_replay(build_plan(dc_replace(prog, grad_reduce_after_stage_backward=False)).ranks[0].instrs, coll)
    reductions = sum(c.steps[0][2] for c in plan.ranks[0].collectives() if c.stream == Stream.DP and "grads" in c.name) / 1e9
    assert after.exposed_s[Dim.DP] >= reductions
    assert before.exposed_s[Dim.DP] < after.exposed_s[Dim.DP]


def test_fsdp2_waits_for_the_previous_units_reduce_scatter_before_issuing_the_next():
    # torch 2.13 _fsdp_param_group.py post_backward (post_backward_rs_wait): with one reduce-scatter
    # input buffer in flight (reduce_scatter_max_input_buffers = 1) the compute stream waits on the
    # previous unit's reduce-scatter event before it copies in and issues the next, so the next
    # unit's backward cannot start until then. Other ZeRO-3 keeps them all in flight to the end.
    for framework, waits in (("torchtitan", True), ("generic", False)):
        _, plan = plan_of(framework=framework, parallelism={"zero": 3})
        instrs = plan.ranks[0].instrs
        grads = [k for k, i in enumerate(instrs) if type(i) is Collective and i.stream == Stream.DP and "grads" in i.name]
        assert len(grads) > 3
        for a, b in zip(grads, grads[1:]):
            between = instrs[a + 1:b]
            waited = [i for i in between if type(i) is Wait and i.handle == instrs[a].handle]
            assert bool(waited) == waits, framework
            if waits:
                # after the next unit's backward compute, right before its own reduction
                assert between[-1] is waited[0]
                assert any(type(i) is Compute for i in between[:-1])


def test_torchtitan_fsdp_units_a_root_and_a_last_block_kept_whole():
    # torchtitan 0.1.0 apply_fsdp: fully_shard per transformer block, the last one with
    # reshard_after_forward False without PP; fully_shard(model) makes the embedding, the final
    # norm and the head one root unit, resharded after forward under torch 2.13 (the True given is
    # kept) and reduced in the final callback, after every block's reduction.
    prog, plan = plan_of(framework="torchtitan", parallelism={"zero": 3})
    n = prog.scenario.model.num_layers
    instrs = plan.ranks[0].instrs
    gathers = [i for i in instrs if type(i) is Collective and i.name.startswith("all_gather params")]
    root_bytes = prog.unit_params[-1] * prog.param_bytes + prog.unit_params[n] * prog.param_bytes
    names = [g.name for g in gathers]
    # forward: the root, then every block; backward: the root again, every block but the last
    assert names == ([f"all_gather params layer {L}" for L in [-1, *range(n)]]
                     + [f"all_gather params layer {L}" for L in [n, *range(n - 2, -1, -1)]])
    assert gathers[0].row_bytes == pytest.approx(root_bytes) and gathers[n + 1].row_bytes == pytest.approx(root_bytes)
    grads = [i for i in instrs if type(i) is Collective and i.stream == Stream.DP and "grads" in i.name]
    assert len(grads) == n + 1 and grads[-1].name.endswith("root")
    root_grads = sum(float(w.grad_bytes[k]) for w in [prog.segments[(0, "W")]] for k in range(len(w.layer))
                     if int(w.layer[k]) in (-1, n))
    assert grads[-1].row_bytes == pytest.approx(root_grads)
    # Other frameworks keep a unit a layer id, all resharded.
    gprog, gplan = plan_of(parallelism={"zero": 3})
    assert len([i for i in gplan.ranks[0].instrs if type(i) is Collective and i.stream == Stream.DP_AG]) == 2 * (n + 2)


def test_torchtitan_last_block_is_not_copied_out_again_in_backward():
    prog, _ = plan_of(framework="torchtitan", parallelism={"zero": 3})
    n = prog.scenario.model.num_layers
    b = prog.segments[(0, "B")]
    per_layer = {}
    for t, L in zip(b.compute_s, b.layer):
        per_layer[int(L)] = per_layer.get(int(L), 0.0) + float(t)
    # Same ops but the copy-out: the last block's backward is the shorter.
    assert per_layer[n - 1] < per_layer[n - 2]


def test_torchtitan_gradient_accumulation_reduces_every_microbatch():
    # torchtitan 0.1.0 train.py train_step: loss.backward() per microbatch with FSDP2's gradient
    # sync left on (no set_requires_gradient_sync(False)), so every backward reduce-scatters and
    # the fp32 shards accumulate into .grad; the gradients never sit unsharded across microbatches.
    from simulator.workload.memory import memory_report

    over = dict(parallelism={"zero": 3}, batch={"global_batch_size": 64})
    prog, plan = plan_of(framework="torchtitan", **over)
    nmb = prog.schedule.num_microbatches
    assert nmb == 4
    per_step = float(prog.segments[(0, "W")].grad_bytes.sum())
    reduced = sum(c.steps[0][2] for c in plan.ranks[0].collectives() if c.stream == Stream.DP and "grads" in c.name)
    assert reduced == pytest.approx(nmb * per_step)
    # Other ZeRO-3 (and the capture harness's FSDP2 loop) reduces on the last microbatch only.
    gprog, gplan = plan_of(**over)
    greduced = sum(c.steps[0][2] for c in gplan.ranks[0].collectives() if c.stream == Stream.DP and "grads" in c.name)
    assert greduced == pytest.approx(float(gprog.segments[(0, "W")].grad_bytes.sum()))
    mem = memory_report(prog.scenario, prog, 80.0, 1.0).per_rank_gib[0]["gradients_gib"]
    gmem = memory_report(gprog.scenario, gprog, 80.0, 1.0).per_rank_gib[0]["gradients_gib"]
    assert mem == pytest.approx(gmem / 16)  # sharded over the 16 ranks, not whole


def test_fsdp2_under_hsdp_does_not_wait_for_the_replica_all_reduce():
    # FSDP2 waits on the previous unit's reduce-scatter event only; HSDP's all-reduce runs on its
    # own all_reduce_stream (torch 2.13 _fsdp_collectives.foreach_reduce) and is joined at the
    # backward's end. The plan's HSDP reduction is one reduce-scatter + all-reduce chain under one
    # handle: waiting on it would hold the backward for the replicas' all-reduce.
    _, plan = plan_of(framework="torchtitan", parallelism={"zero": 3, "fsdp_shard_size": 4})
    waits = [i for i in plan.ranks[0].instrs if type(i) is Wait and "previous FSDP unit" in i.reason]
    assert not waits


def test_fsdp2_gradient_buffers_replace_the_bucket_reserve():
    # FSDP2 keeps no gradient buckets: beside the sharded .grad it holds the unit in backward's
    # bf16 gradients (2 B a parameter), the previous unit's fp32 reduce-scatter input (4 B) until
    # its post_backward_rs_wait, and the root's head gradient (bf16) from the head's backward to
    # the root's post_backward at the end (torch 2.13 _fsdp_param_group.py post_backward).
    from simulator.workload.memory import GIB, RUNTIME_RESERVE_BYTES, memory_report

    # They come after the loss's backward, whose working set is gone by then: the larger of the two
    # counts (the loss's is counted already).
    prog, _ = plan_of(framework="torchtitan", parallelism={"zero": 3})
    n = prog.scenario.model.num_layers
    row = memory_report(prog.scenario, prog, 80.0, 1.0).per_rank_gib[0]
    assert row["buffers_gib"] == pytest.approx(RUNTIME_RESERVE_BYTES / GIB)
    held = (6 * prog.unit_params[0] + 2 * prog.unit_params[n]) / GIB
    assert 0 < row["loss_working_set_gib"] < held
    assert row["fsdp_grad_buffers_gib"] + row["loss_working_set_gib"] == pytest.approx(held)
    # An eager loss's working set at 8K tokens outgrows them: nothing more.
    eager, _ = plan_of(framework="torchtitan", compile_loss=False, parallelism={"zero": 3}, batch={"seq_length": 8192})
    erow = memory_report(eager.scenario, eager, 80.0, 1.0).per_rank_gib[0]
    assert erow["loss_working_set_gib"] > held and erow["fsdp_grad_buffers_gib"] == 0.0
    # A pipeline stage without the loss holds the unit's bf16 gradients only (reduced at the end).
    pp, _ = plan_of(framework="torchtitan", parallelism={"zero": 3, "pp": 4, "fsdp_reshard_after_forward": False},
                    batch={"global_batch_size": 32})
    prow = memory_report(pp.scenario, pp, 80.0, 1.0).per_rank_gib[1]
    assert prow["fsdp_grad_buffers_gib"] == pytest.approx(2 * pp.unit_params[0] / GIB)
    # Megatron-style ZeRO-3 keeps its bucket reserve and no such row.
    gprog, _ = plan_of(parallelism={"zero": 3})
    grow = memory_report(gprog.scenario, gprog, 80.0, 1.0).per_rank_gib[0]
    assert "fsdp_grad_buffers_gib" not in grow and grow["buffers_gib"] > RUNTIME_RESERVE_BYTES / GIB


@pytest.mark.parametrize("over,shared", [
    ({"framework": "torchtitan", "parallelism": {"zero": 3}}, True),
    # HSDP: the all-reduce after each reduce-scatter runs on the replicate group's communicator,
    # chained to the reduce-scatter in the plan; sharing would queue gathers behind it too.
    ({"framework": "torchtitan", "parallelism": {"zero": 3, "fsdp_shard_size": 8}}, False),
    ({"framework": "generic", "parallelism": {"zero": 3}}, False),
    # torch's set_separate_reduce_scatter_group(): the reductions get their own communicator
    ({"framework": "torchtitan", "parallelism": {"zero": 3, "fsdp_separate_reduce_scatter_group": True}}, False),
])
def test_fsdp2_gathers_queue_with_the_reduce_scatters_on_one_communicator(over, shared):
    # torch 2.13 FSDPModule.set_separate_reduce_scatter_group: by default FSDP's all-gather and
    # reduce-scatter go through one process group, "one NCCL communicator, which processes one
    # collective at a time and so serializes them"; the plan queues them on one stream, in issue
    # order (a backward's gather behind the reduce-scatter of the unit before).
    prog, plan = plan_of(**over)
    assert prog.fsdp_one_communicator == (over["framework"] == "torchtitan"
                                          and not over["parallelism"].get("fsdp_separate_reduce_scatter_group"))
    colls = [i for i in plan.ranks[0].instrs if type(i) is Collective]
    gathers = [c for c in colls if c.name.startswith("all_gather params")]
    reductions = [c for c in colls if "grads" in c.name]
    assert gathers and reductions
    assert {c.stream for c in reductions} == {Stream.DP}
    assert {c.stream for c in gathers} == ({Stream.DP} if shared else {Stream.DP_AG})
    if shared:
        # issue order on the shared stream: some gather is queued after a reduce-scatter
        names = [c.name for c in colls if c.stream == Stream.DP]
        first_rs = next(i for i, n in enumerate(names) if "grads" in n)
        assert any(n.startswith("all_gather params") for n in names[first_rs:])


def test_one_communicator_runs_gathers_and_reduce_scatters_one_at_a_time():
    # The engine runs a stream's work in order: under torchtitan no gather overlaps a
    # reduce-scatter on a rank; with its own stream (framework generic) they overlap, and the
    # overlapped backward pays both collectives' SMs (simulator.contention).
    def dp_rows(framework):
        sc = build_scenario(scenario(framework=framework, parallelism={"zero": 3}))
        rows = simulate(sc, with_critical_path=False).timeline.events
        rows = rows[(rows["rank"] == 0) & rows["stream"].isin(["dp", "dp-ag"])]
        ag = rows[rows["name"].str.startswith("all_gather params")][["start_s", "end_s"]].to_numpy()
        rs = rows[rows["name"].str.contains("grads")][["start_s", "end_s"]].to_numpy()
        return sum(max(0.0, min(a1, r1) - max(a0, r0)) for a0, a1 in ag for r0, r1 in rs)

    assert dp_rows("torchtitan") == 0.0
    assert dp_rows("generic") > 0.0


def test_param_buckets_are_filled_from_the_end_so_the_first_in_forward_is_the_remainder():
    from simulator.workload.plan import param_buckets

    params = {-1: 30.0, 0: 20.0, 1: 20.0, 2: 20.0, 3: 20.0}
    assert param_buckets([-1, 0, 1, 2, 3], params, 40) == [[-1], [0, 1], [2, 3]]
    assert param_buckets([-1, 0, 1, 2, 3], params, 1e9) == [[-1, 0, 1, 2, 3]]
    assert param_buckets([0, 1], params, 1) == [[0], [1]]  # whole layers: a bucket is at least one


def test_zero1_gathers_parameters_by_bucket_one_ahead_in_the_first_forward():
    # megatron-core with overlap_param_gather: a module's forward pre-hook waits for its bucket,
    # issuing it there if it is not yet (the first), then issues the next (one ahead).
    prog, plan = plan_of(parallelism={"zero": 1, "grad_bucket_params": 400_000_000})
    instrs = plan.ranks[0].instrs
    gathers = [k for k, i in enumerate(instrs) if isinstance(i, Collective) and "all_gather params" in i.name]
    waits = [k for k, i in enumerate(instrs) if isinstance(i, Wait) and "parameters" in i.reason]
    # llama3-8b: 32 layers of 218M parameters, the embedding and the head 525M each: buckets of
    # at least 400M parameters from the end: the head, 16 pairs of layers, the embedding
    assert len(gathers) == len(waits) == 18
    assert sum(instrs[g].steps[0][2] for g in gathers) == pytest.approx(sum(prog.stage_params) * 2)
    first_compute = next(k for k, i in enumerate(instrs) if isinstance(i, Compute))
    # the first two are issued where the first is waited for, not at step start; every later one
    # where the one before it is waited for, and all in the first microbatch's forward
    assert gathers[:2] == [first_compute - 1 - 2, first_compute - 1 - 1] and waits[0] == first_compute - 1
    assert all(w > g for g, w in zip(gathers, waits))
    first_backward = next(k for k, i in enumerate(instrs) if isinstance(i, Compute) and i.kind != "F")
    assert max(gathers + waits) < first_backward


def test_zero1_without_overlap_param_gather_waits_for_the_whole_gather_first():
    over = dict(parallelism={"zero": 1}, batch={"global_batch_size": 64})
    blocking_over = dict(over, parallelism={"zero": 1, "overlap_param_gather": False})
    prog, plan = plan_of(**blocking_over)
    instrs = plan.ranks[0].instrs
    first_compute = next(k for k, i in enumerate(instrs) if isinstance(i, Compute))
    (gather,) = [i for i in instrs if isinstance(i, Collective) and "all_gather params" in i.name]
    assert gather.blocking and instrs.index(gather) < first_compute
    assert gather.steps[0][2] == pytest.approx(prog.stage_params[0] * 2)
    # the whole gather is exposed; by buckets, most of it hides behind the first forward
    overlapped = simulate(build_scenario(scenario(**over)), with_critical_path=False).report
    blocking = simulate(build_scenario(scenario(**blocking_over)), with_critical_path=False).report
    gather_s = blocking.step_time_s - overlapped.step_time_s
    assert gather_s > 0.5 * (blocking.exposed_comm_s["dp"] - overlapped.exposed_comm_s["dp"]) > 0
    # DeepSpeed's ZeRO-1/2 optimizer step ends in a blocking all-gather (all_gather_dp_groups)
    assert not build_scenario(scenario(framework="megatron-deepspeed", **blocking_over)).overlap_param_gather
    assert not build_scenario(scenario(framework="megatron-deepspeed", **over)).overlap_param_gather
    assert build_scenario(scenario(**over)).overlap_param_gather
