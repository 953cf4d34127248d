"""Megatron-LM 2021's blocking pipeline exchange (parallelism.pp_exchange: blocking): a rank
exchanges the previous action group's outputs for the next one's inputs (batch_isend_irecv, wait,
torch.cuda.synchronize), a transfer starts once both ends have posted it, and neither end
computes until its exchange is over."""

from __future__ import annotations

import pytest

from agreement_scenarios import scenario
from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import resolve_schedule, simulate
from simulator.profile import load_profile
from simulator.workload.plan import Complete, Compute, Post, Recv, SendDone, build_plan
from simulator.workload.program import build_program

CASES = {
    "1f1b-pp4": scenario("bx-1f1b", gbs=32, parallelism={"pp": 4, "tp": 2, "zero": 0}),
    "interleaved-pp4": scenario("bx-int", gbs=32, parallelism={"pp": 4, "vpp": 2, "tp": 2, "zero": 0},
                                schedule="interleaved-1f1b"),
    # Megatron 2021's scatter/gather on the flow fabric: the receiver's tp all-gather after the exchange
    "scatter-gather-flow": scenario("bx-sg", gbs=32, network="flow",
                                    parallelism={"pp": 4, "vpp": 2, "tp": 2, "zero": 0, "sequence_parallel": False,
                                                 "pp_scatter_gather": True}, schedule="interleaved-1f1b"),
}


def _with(d: dict, exchange: str) -> dict:
    return {**d, "parallelism": {**d["parallelism"], "pp_exchange": exchange}}


def _busy(ev, rank: int, stream_prefix: str) -> list[tuple[float, float]]:
    rows = ev[(ev["rank"] == rank) & ev["stream"].astype(str).str.startswith(stream_prefix)]
    return list(zip(rows["start_s"].to_numpy(), rows["end_s"].to_numpy()))


def _overlaps(spans: list[tuple[float, float]], t0: float, t1: float) -> bool:
    return any(a < t1 - 1e-12 and b > t0 + 1e-12 for a, b in spans)


@pytest.mark.parametrize("case", list(CASES))
def test_neither_end_computes_while_its_transfer_runs(case):
    res = simulate(build_scenario(_with(CASES[case], "blocking")), mode="full")
    ev = res.timeline.events
    sends = ev[ev["stream"].astype(str).str.startswith("pp-send")]
    recvs = ev[ev["stream"].astype(str).str.startswith("pp-recv")]
    assert len(sends) > 0 and len(sends) == len(recvs)
    compute = {r: _busy(ev, r, "compute") for r in res.timeline.ranks}
    # a send row and its receive row span the same transfer
    assert sorted(zip(sends["start_s"], sends["end_s"])) == sorted(zip(recvs["start_s"], recvs["end_s"]))
    for _, s in sends.iterrows():
        assert not _overlaps(compute[int(s["rank"])], s["start_s"], s["end_s"]), s.to_dict()
    for _, r in recvs.iterrows():
        assert not _overlaps(compute[int(r["rank"])], r["start_s"], r["end_s"]), r.to_dict()
    # Eager sends overlap the sender's next compute: the property above is the exchange's.
    eager = simulate(build_scenario(_with(CASES[case], "eager")), mode="full").timeline.events
    e_sends = eager[eager["stream"].astype(str).str.startswith("pp-send")]
    e_compute = {r: _busy(eager, r, "compute") for r in res.timeline.ranks}
    assert any(_overlaps(e_compute[int(s["rank"])], s["start_s"], s["end_s"]) for _, s in e_sends.iterrows())
    assert res.report.step_time_s > simulate(build_scenario(_with(CASES[case], "eager"))).report.step_time_s


@pytest.mark.parametrize("case", list(CASES))
def test_reduced_full_and_the_fast_path_agree(case):
    sc = build_scenario(_with(CASES[case], "blocking"))
    reduced = simulate(sc).report.step_time_s
    assert simulate(sc, mode="full").report.step_time_s == pytest.approx(reduced, rel=1e-12)
    assert simulate(sc, mode="every-rank").report.step_time_s == pytest.approx(reduced, rel=1e-12)
    ff = simulate(sc, fast_forward=True)
    assert ff.report.step_time_s == pytest.approx(reduced, rel=1e-11)


def test_the_plan_posts_exchanges_as_megatron_2021_calls_them():
    """1F1B: warm-up sends, then receives (send_forward; recv_forward); the steady state combines
    (send_forward_recv_backward: post the gradient's receive, then wait for the send)."""
    sc = build_scenario(_with(CASES["1f1b-pp4"], "blocking"))
    prog = build_program(sc, load_profile(sc.cluster.gpu), resolve_schedule(sc))
    rank0 = build_plan(prog).ranks[0].instrs
    kinds = [type(i).__name__ for i in rank0 if type(i) in (Complete, Post, SendDone, Recv)]
    # rank 0 of 4 warms up with 3 forwards: after F0, send it and wait, then post F1's input
    # (none on the first stage) ...
    first_send = next(i for i, ins in enumerate(rank0) if type(ins) is SendDone)
    assert type(rank0[first_send - 1]) is Complete and not rank0[first_send - 1].wake
    assert rank0[first_send - 1].sends[0].rendezvous
    # ... and after the last warm-up forward, F3: the steady F3 -> B0 boundary posts B0's gradient
    # receive before waiting for F3's send (one combined call).
    post_b0 = next(i for i, ins in enumerate(rank0) if type(ins) is Post and ins.keys == ((1, "BI", 0),))
    assert type(rank0[post_b0 + 1]) is SendDone and rank0[post_b0 + 1].microbatch == 3
    assert type(rank0[post_b0 - 1]) is Complete and rank0[post_b0 - 1].microbatch == 3
    # every send is waited for, every remote input posted once
    assert kinds.count("SendDone") == sum(len(i.sends) for i in rank0 if type(i) is Complete)
    posted = [k for i in rank0 if type(i) is Post for k in i.keys]
    assert len(posted) == len(set(posted)) == sum(1 for i in rank0 if type(i) is Recv and not i.local)
    assert any(type(i) is Compute for i in rank0)


def test_blocking_exchange_needs_a_megatron_schedule():
    d = _with(scenario("bx-zb", gbs=32, parallelism={"pp": 4, "zero": 0}, schedule="zb-h1"), "blocking")
    with pytest.raises(UserError, match=r"pp_exchange blocking is Megatron-LM 2021's exchange, which runs 1f1b and "
                                        r"interleaved-1f1b, not schedule 'zb-h1': set schedule"):
        build_scenario(d)
    # without a pipeline there is nothing to exchange: accepted, and the step is the eager one's
    flat = scenario("bx-flat", parallelism={"tp": 2})
    assert simulate(build_scenario(_with(flat, "blocking"))).report.step_time_s == \
        simulate(build_scenario(flat)).report.step_time_s


@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_with_every_microbatch_in_warm_up_runs(pp):
    """num_microbatches == pp: Megatron-LM 2021's interleaved schedule runs every forward as
    warm-up (all_warmup_microbatches), exchanging send_forward_recv_forward after the last one and
    receiving the first gradient by recv_backward. Pairing the last forward with the first
    backward in one exchange had stalled the run on a dependency cycle."""
    d = scenario("bx-allwarm", gbs=8, gpus=16,
                 parallelism={"pp": pp, "vpp": 2, "tp": 2, "zero": 0, "pp_exchange": "blocking"},
                 schedule="interleaved-1f1b")
    sc = build_scenario(d)
    assert sc.num_microbatches == pp
    blocking = simulate(sc).report.step_time_s
    eager = simulate(build_scenario(_with(d, "eager"))).report.step_time_s
    # Blocking exchanges only add waits to the eager schedule's.
    assert blocking >= eager > 0
