"""Async (micro-pipelined) TP: parallelism.async_tp, torch's fused all-gather/reduce-scatter GEMMs."""

from __future__ import annotations

import copy

import pytest

from simulator.errors import UserError
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.simulate import resolve_schedule, simulate
from simulator.workload.ops import build_layer_ops
from simulator.workload.plan import JOIN, Collective, Compute, Wait, build_plan
from simulator.workload.program import build_program, micro_pipeline_tp

BASE = {
    "name": "async-tp", "model": "llama3-8b",
    "parallelism": {"tp": 8, "pp": 1, "zero": 1, "sequence_parallel": True},
    "batch": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 4096},
    "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}


def scenario(**par) -> dict:
    d = copy.deepcopy(BASE)
    d["parallelism"].update(par)
    # the same batch per replica whatever tp: 4 sequences on every data-parallel rank
    d["batch"]["global_batch_size"] = 4 * d["cluster"]["gpus"] // d["parallelism"]["tp"]
    return d


def test_the_pipelined_pair_keeps_the_gemm_flops_and_moves_every_transfer_off_the_sms():
    sc = build_scenario(scenario())
    lo = build_layer_ops(sc)["dense"]
    tp = sc.parallelism.tp
    piped = micro_pipeline_tp(lo.forward, tp)
    assert sum(o.exec_flops for o in piped) == pytest.approx(sum(o.exec_flops for o in lo.forward), rel=1e-12)
    gathers = [o for o in lo.forward if o.comm is not None and o.comm.op == "all_gather"]
    scatters = [o for o in lo.forward if o.comm is not None and o.comm.op == "reduce_scatter"]
    assert gathers and scatters
    comms = [o.comm for o in piped if o.comm is not None and o.comm.op != JOIN]
    assert len(comms) == len(gathers) + len(scatters)
    assert all(c.overlap and c.ctas == 0 for c in comms)
    names = [o.name for o in piped]
    for g in gathers:
        # the last chunk waits for the last shard: a join right before it
        i = names.index(g.name + ".join")
        assert names[i + 1].endswith(".last_chunk"), names[i - 2 : i + 2]
    for r in scatters:
        # the partials are summed only once every one has arrived
        i = names.index(r.name + ".join")
        assert names[i + 1] == r.name + ".partials_sum"
    # each chunk of tokens is a GEMM of M / tp rows; the overlapped ones together the rest
    qkv = next(o for o in lo.forward if o.name == "qkv_proj")
    last = next(o for o in piped if o.name == "qkv_proj.last_chunk")
    rest = next(o for o in piped if o.name == "qkv_proj.chunks")
    assert last.kernel.m == qkv.kernel.m // tp and rest.kernel.m + last.kernel.m == qkv.kernel.m
    assert (last.kernel.n, last.kernel.k) == (qkv.kernel.n, qkv.kernel.k)


def test_the_plan_joins_each_transfer_before_the_compute_that_needs_it():
    sc = build_scenario(scenario(async_tp=True))
    plan = build_plan(build_program(sc, load_profile(sc.cluster.gpu), resolve_schedule(sc)))
    ins = plan.ranks[0].instrs
    ce = [i for i in ins if isinstance(i, Collective) and i.ctas == 0]
    assert ce and all(not c.blocking and c.sms == 0 for c in ce)
    nccl = [i for i in ins if isinstance(i, Collective) and i.ctas < 0]
    assert all(c.sms > 0 for c in nccl)
    for k, c in enumerate(ins):
        if isinstance(c, Collective) and c.ctas == 0:
            # issued, then exactly one stretch of compute (the overlapped chunks), then its wait
            assert isinstance(ins[k + 1], Compute) and isinstance(ins[k + 2], Wait) and ins[k + 2].handle == c.handle


def test_async_tp_hides_tp_communication_but_never_beats_having_none():
    vanilla = simulate(build_scenario(scenario())).report
    overlapped = simulate(build_scenario(scenario(async_tp=True))).report
    assert vanilla.exposed_comm_s["tp"] > 0
    assert overlapped.exposed_comm_s["tp"] < 0.7 * vanilla.exposed_comm_s["tp"]
    assert overlapped.step_time_s < vanilla.step_time_s
    # Lower bound: the step with every TP transfer free (vanilla less its exposed TP); async TP
    # adds the shard copies and the partial sums, so it cannot get below it.
    assert overlapped.step_time_s > vanilla.step_time_s - vanilla.exposed_comm_s["tp"], (
        overlapped.step_time_s, vanilla.step_time_s, vanilla.exposed_comm_s["tp"])


def test_async_tp_without_tensor_parallelism_changes_nothing_and_says_so():
    a = simulate(build_scenario(scenario(tp=1))).report
    b = simulate(build_scenario(scenario(tp=1, async_tp=True))).report
    assert b.step_time_s == a.step_time_s
    assert any("async_tp has nothing to overlap at tp=1" in n for n in b.notes)
    assert not any("nothing to overlap" in n for n in a.notes)


def test_async_tp_needs_sequence_parallelism():
    with pytest.raises(UserError, match=r"async_tp overlaps the sequence-parallel .* set parallelism.sequence_parallel true"):
        build_scenario(scenario(async_tp=True, sequence_parallel=False)).check()


def test_reduced_and_full_modes_agree_with_async_tp():
    sc = build_scenario(scenario(async_tp=True, zero=3))
    reduced, full = simulate(sc, "reduced").report, simulate(sc, "every-rank").report
    assert full.step_time_s == pytest.approx(reduced.step_time_s, rel=1e-3)
    assert full.exposed_comm_s["tp"] == pytest.approx(reduced.exposed_comm_s["tp"], rel=1e-3, abs=1e-6)


def test_te_userbuffers_overlap_as_megatron_configures_it():
    # TE 1.11 initialize_ub defaults: ring exchange (tp splits, copy engine, 1 SM) before the
    # column-parallel GEMMs; pipelined reduce-scatter in 4 splits on 16 SMs after the row-parallel
    # ones; in backward the input-gradient reduce-scatter runs whole beside the weight gradients.
    sc = build_scenario(scenario(tp_comm_overlap=True))
    lo = build_layer_ops(sc)["dense"]
    fwd = {o.name: o for o in micro_pipeline_tp(lo.forward, 8, "te")}
    assert fwd["attn_in"].comm.ctas == 1 and "attn_in.shard_copy" not in fwd  # the norm writes into the buffer
    assert fwd["attn_out"].comm.ctas == 16 and "attn_out.partials_sum" not in fwd
    qkv = next(o for o in lo.forward if o.name == "qkv_proj")
    out = next(o for o in lo.forward if o.name == "attn_out_proj")
    assert fwd["attn_out_proj.first_chunk"].kernel.m == out.kernel.m // 4
    assert fwd["qkv_proj.last_chunk"].kernel.m == qkv.kernel.m // 8
    i_ops, _ = lo.backward()
    bwd = micro_pipeline_tp(i_ops, 8, "te")
    rs = next(o for o in bwd if o.name == "attn_in.bwd")
    assert rs.comm.overlap and rs.comm.ctas == 16
    k = [o.name for o in bwd].index("attn_in.bwd")
    assert bwd[k - 1].name.startswith("qkv_proj.") and "chunk" not in bwd[k - 1].name  # the dgrad GEMM ran whole
    assert "attn_out.bwd.shard_copy" in [o.name for o in bwd]  # the gradient is copied into the buffer
    vanilla = simulate(build_scenario(scenario())).report
    te = simulate(build_scenario(scenario(tp_comm_overlap=True))).report
    assert te.exposed_comm_s["tp"] < vanilla.exposed_comm_s["tp"] and te.step_time_s < vanilla.step_time_s
    assert te.step_time_s > vanilla.step_time_s - vanilla.exposed_comm_s["tp"]


def test_one_tp_overlap_at_a_time():
    with pytest.raises(UserError, match=r"async_tp .* and tp_comm_overlap .* set one of them false"):
        build_scenario(scenario(async_tp=True, tp_comm_overlap=True)).check()
