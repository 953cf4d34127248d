"""Compute-communication contention (issue 15, item 2): NCCL kernels hold SMs, so compute that
overlaps an in-flight collective slows down, and only then."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.contention import COLLECTIVE_CTAS, compute_slowdown
from simulator.engine.core import Engine
from simulator.network.alpha_beta import TierNetwork
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.schedules import build_schedule
from simulator.simulate import simulate
from simulator.topology import load_topology
from simulator.topology.placement import Mesh
from simulator.workload.ops import Comm
from simulator.workload.program import Program, Segments


def _program(overlap: bool) -> Program:
    """One TP8 rank: a forward whose tp all-reduce either overlaps the next compute segment or
    blocks before it."""
    sched = build_schedule("1f1b", 1, 1)
    comm = Comm("tp", "all_reduce", 256e6, overlap=overlap)
    f = Segments(np.array([1e-3, 5e-3]), [comm, None], np.array([0, 0]), ["a", "b"], np.zeros(2), np.zeros(2), np.zeros(2))
    seg = {(0, "F"): f, (0, "B"): Segments.constant(1e-3), (0, "I"): Segments.constant(1e-3), (0, "W"): Segments.constant(0.0)}
    mesh = Mesh(tp=8, cp=1, ep=1, dp=1, pp=1)
    return Program(scenario=None, mesh=mesh, schedule=sched, segments=seg, position_layers=[[0]], pp_bytes=0.0,
                   optimizer_s=0.0, stage_params=[0.0], model_flops_per_step=0.0, tokens_per_step=0, zero=0)


def _run(overlap: bool, sm_count: int | None):
    prof = load_profile("h100-sxm-80gb")
    net = TierNetwork(load_topology("dgx-h100-fattree").node, prof.comm)
    return Engine(_program(overlap), net, sm_count=sm_count).run()


def test_overlapped_collective_slows_the_compute_it_overlaps():
    sm = 132
    tl = _run(overlap=True, sm_count=sm)
    ev = tl.events
    seg_b = ev[(ev.stream == "compute") & (ev.name == "b")].iloc[0]
    comm = ev[ev.stream == "tp"].iloc[0]
    dur = seg_b.end_s - seg_b.start_s
    # Segment b starts with the all-reduce holding its SMs: while it runs, b goes at
    # (132 - 24) / 132 of full speed; once it is done, at full speed again.
    assert comm.start_s == pytest.approx(seg_b.start_s)
    comm_s = comm.end_s - comm.start_s
    f = sm / (sm - COLLECTIVE_CTAS)
    assert comm_s / f < 5e-3  # the all-reduce ends before b's work does
    assert dur == pytest.approx(5e-3 + comm_s * (1 - 1 / f), rel=1e-9)
    assert dur < 5e-3 * f  # not the whole segment slowed
    assert tl.contention_s[tl.ranks[0]] == pytest.approx(dur - 5e-3, rel=1e-9)


def test_contended_segment_longer_than_its_collective_is_slowed_throughout():
    # A segment shorter than the collective's share of it runs slowed from start to end.
    sm = 132
    prog = _program(overlap=True)
    seg = prog.segments[(0, "F")]
    seg.compute_s[1] = 1e-5
    prof = load_profile("h100-sxm-80gb")
    tl = Engine(prog, TierNetwork(load_topology("dgx-h100-fattree").node, prof.comm), sm_count=sm).run()
    ev = tl.events
    seg_b = ev[(ev.stream == "compute") & (ev.name == "b")].iloc[0]
    assert seg_b.end_s - seg_b.start_s == pytest.approx(1e-5 * sm / (sm - COLLECTIVE_CTAS), rel=1e-9)


def test_slowdown_vanishes_without_overlap():
    for overlap, sm in ((False, 132), (True, None)):
        tl = _run(overlap=overlap, sm_count=sm)
        ev = tl.events
        seg_b = ev[(ev.stream == "compute") & (ev.name == "b")].iloc[0]
        assert seg_b.end_s - seg_b.start_s == pytest.approx(5e-3, rel=1e-12)
        assert sum(tl.contention_s.values()) == 0.0
    assert compute_slowdown(132, 0) == 1.0 and compute_slowdown(None, 24) == 1.0


def test_dualpipe_on_dense_tp8_pays_for_its_overlapped_tp():
    # DualPipe's F&B pairs hide TP collectives behind the other half's compute; with contention
    # that compute runs on fewer SMs, so the pair no longer hides TP time for free.
    sc = build_scenario({
        "name": "dp-tp8", "model": {"name": "dense", "num_layers": 16, "hidden_size": 4096, "ffn_hidden_size": 14336,
                                     "num_attention_heads": 32, "num_kv_heads": 8, "vocab_size": 32000},
        "parallelism": {"tp": 8, "pp": 4, "zero": 1}, "schedule": "dualpipe",
        "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 4096},
        "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta",
    })
    res = simulate(sc)
    tl = res.timeline
    free = Engine(res.program, TierNetwork(load_topology("dgx-h100-fattree").node, res.profile.comm)).run()
    assert free.step_time_s < tl.step_time_s  # the old, free overlap was optimistic
    assert sum(tl.contention_s.values()) > 0.0
    # The relief the pairs give (blocking TP minus what stays exposed) is now partly paid back as
    # slower compute: busy compute grows by the contention.
    r = tl.ranks[0]
    assert tl.busy_compute_s[r] == pytest.approx(free.busy_compute_s[r] + tl.contention_s[r], rel=1e-9)


def test_a_collective_that_starts_during_a_segment_slows_it():
    """A gather queued behind another on its stream starts when the first ends, the very instant
    the compute waiting on the first starts: the segment began with no SMs taken, and the queued
    gather's kernel took them while it ran. It used to run at full speed throughout (the
    engine re-timed only segments that had started contended)."""
    from simulator.vocabulary import Dim, Stream
    from simulator.workload.plan import Collective, Compute, RankPlan, Wait, build_plan

    sm = 132
    prog = _program(overlap=True)
    plan = build_plan(prog)
    gather = (Dim.TP, "all_gather", 64e6)
    plan.ranks[0] = RankPlan(0, [
        Collective(Stream.DP_AG, (gather,), 1, "dp", "gather 1"),
        Collective(Stream.DP_AG, (gather,), 2, "dp", "gather 2"),  # queued behind gather 1
        Wait(1, Dim.DP, "gather 1"),
        Compute(20e-3, "F", "c"),  # starts as gather 1 ends and gather 2 starts
        Wait(2, Dim.DP, "gather 2"),
    ], num_handles=3)
    prof = load_profile("h100-sxm-80gb")
    tl = Engine(prog, TierNetwork(load_topology("dgx-h100-fattree").node, prof.comm), sm_count=sm, plan=plan).run()
    ev = tl.events
    seg = ev[(ev.stream == "compute") & (ev.name == "c")].iloc[0]
    g2 = ev[ev.name == "gather 2"].iloc[0]
    assert g2.start_s == pytest.approx(seg.start_s)
    g2_s = g2.end_s - g2.start_s
    f = sm / (sm - COLLECTIVE_CTAS)
    assert g2_s / f < 20e-3  # the gather ends before c's work does
    assert seg.end_s - seg.start_s == pytest.approx(20e-3 + g2_s * (1 - 1 / f), rel=1e-9)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_only_the_sm_bound_share_of_a_segment_is_slowed(share):
    """Memory-bound kernels lose nothing to SMs taken alone (measured on an H200, round 28:
    0.997-0.999 with 8-64 of 132 SMs held): an overlapped segment is slowed on its SM-bound
    share (GEMMs, attention) only, 1 + share x (f - 1) while the collective runs."""
    sm = 132
    prog = _program(overlap=True)
    prog.segments[(0, "F")].sm_share = np.array([1.0, share])
    prof = load_profile("h100-sxm-80gb")
    tl = Engine(prog, TierNetwork(load_topology("dgx-h100-fattree").node, prof.comm), sm_count=sm).run()
    ev = tl.events
    seg_b = ev[(ev.stream == "compute") & (ev.name == "b")].iloc[0]
    comm = ev[ev.stream == "tp"].iloc[0]
    comm_s = comm.end_s - comm.start_s
    f = 1 + share * (sm / (sm - COLLECTIVE_CTAS) - 1)
    assert seg_b.end_s - seg_b.start_s == pytest.approx(5e-3 + comm_s * (1 - 1 / f), rel=1e-9)
    assert (sum(tl.contention_s.values()) == 0.0) == (share == 0.0)


def test_segments_carry_their_sm_bound_share():
    """A transformer layer's segments are mostly GEMM and attention time, not all of it (norms,
    residuals, RoPE, SwiGLU are memory-bound); the optimizer step is memory-bound throughout."""
    from simulator.workload.plan import Compute, build_plan
    from simulator.workload.program import build_program

    sc = build_scenario({"name": "s", "model": "llama3-8b", "parallelism": {"tp": 2},
                         "batch": {"micro_batch_size": 1, "global_batch_size": 4, "seq_length": 4096},
                         "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
    prof = load_profile("h100-sxm-80gb")
    prog = build_program(sc, prof, build_schedule("1f1b", 1, 4))
    seg = prog.segments[(0, "F")]
    share = float((seg.compute_s * seg.sm_share).sum() / seg.compute_s.sum())
    assert 0.6 < share < 0.98, share
    assert ((seg.sm_share >= 0) & (seg.sm_share <= 1)).all()
    opt = [i for i in build_plan(prog).ranks[0].instrs if type(i) is Compute and i.label == "optimizer step"]
    assert opt and all(i.sm_share == 0.0 for i in opt)
