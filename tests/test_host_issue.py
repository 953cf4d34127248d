"""Host issue floor: eager PyTorch launches every kernel from Python, so a run of small kernels
takes at least the host's launch time (profile host_launch_*_us), while large kernels hide it."""

import pytest

from simulator.calibrate.published import vtrain_scenario
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.simulate import resolve_schedule
from simulator.workload.program import build_program


def _row(h: int, tp: int, mb: int) -> dict:
    return {"hidden size": str(h), "# layers": "4", "attention heads": "16", "sequence length": "1024",
            "tensor parallelism": str(tp), "pipeline parallelism": "1", "data parallelism": "1",
            "micro batch": str(mb), "global batch": str(mb * 2), "# GPUs": str(tp)}


def _backward_s(sc, profile) -> float:
    prog = build_program(sc, profile, resolve_schedule(sc))
    return prog.segments[(0, "B")].total_compute_s


def test_a100_profile_carries_the_measured_launch_costs():
    c = load_profile("a100-sxm-80gb").compute
    assert c.host_launch_forward_us == 20.0 and c.host_launch_backward_us == 43.0


def test_small_kernels_wait_on_the_host_large_ones_hide_it():
    prof = load_profile("a100-sxm-80gb")
    free = prof.model_copy(update={"compute": prof.compute.model_copy(
        update={"host_launch_forward_us": 0.0, "host_launch_backward_us": 0.0})})
    small = build_scenario(vtrain_scenario(_row(1024, 8, 1)))
    big = build_scenario(vtrain_scenario(_row(8192, 1, 8)))
    # h1024 at tp8: each kernel is a few µs, shorter than its launch: the host sets the pace.
    assert _backward_s(small, prof) > 1.5 * _backward_s(small, free)
    # h8192, 8 sequences per microbatch: kernels of milliseconds; the floor changes nothing.
    assert abs(_backward_s(big, prof) / _backward_s(big, free) - 1) < 0.01


def test_floor_is_the_issue_time_of_the_segment():
    prof = load_profile("a100-sxm-80gb")
    slow = prof.model_copy(update={"compute": prof.compute.model_copy(
        update={"host_launch_forward_us": 1000.0, "host_launch_backward_us": 1000.0})})
    sc = build_scenario(vtrain_scenario(_row(1024, 1, 1)))
    prog = build_program(sc, slow, resolve_schedule(sc))
    seg = prog.segments[(0, "F")]
    # 1 ms per launch dwarfs every kernel: each segment takes exactly its launches x 1 ms.
    assert all(abs(t * 1e3 - round(t * 1e3)) < 1e-6 and t >= 1e-3 for t in seg.compute_s)


def test_a_collective_call_costs_the_host_its_measured_c10d_time():
    from simulator.workload.ops import Comm, Op
    from simulator.workload.program import host_issue_s

    prof = load_profile("a100-sxm-80gb")
    ar = Op("mlp_out", "other", "F", comm=Comm("tp", "all_reduce", 4e6))
    assert host_issue_s(prof, ar) == pytest.approx(80e-6)
    # Without the measured figure a collective counts as one launch of its phase.
    bare = prof.model_copy(update={"compute": prof.compute.model_copy(update={"host_collective_us": 0.0})})
    assert host_issue_s(bare, ar) == pytest.approx(20e-6)
    assert host_issue_s(bare, Op("x.bwd", "other", "I", comm=Comm("tp", "all_reduce", 4e6))) == pytest.approx(43e-6)


def test_megatron_framework_counts_its_data_and_loss_kernels():
    # Megatron (2021 and DeepSpeed's fork) runs get_batch, a vocab-parallel cross-entropy of 18
    # kernels and loss_func every microbatch; the generic framework one kernel each.
    from simulator.workload.ops import build_layer_ops

    data = vtrain_scenario({**_row(1024, 1, 1), "pipeline parallelism": "2", "# GPUs": "2"})
    launches = {}
    for fw in ("generic", "megatron-deepspeed"):
        data["framework"] = fw
        layers = build_layer_ops(build_scenario(data))
        fwd = {k: sum(o.launches for o in layers[k].forward if o.comm is None) for k in ("embedding", "head")}
        bwd = {k: sum(o.launches for o in layers[k].backward()[0] if o.comm is None) for k in ("embedding", "head")}
        launches[fw] = (fwd, bwd)
    (gf, gb), (mf, mb) = launches["generic"], launches["megatron-deepspeed"]
    assert mf["embedding"] == gf["embedding"] + 10 + 3  # get_batch; position lookup, add, dropout
    # pp > 1: the last stage loads the microbatch too; cross-entropy 18 not 1; loss_func 8.
    assert mf["head"] == gf["head"] + 10 + 17 + 8
    assert mb["head"] == gb["head"] + (8 - 2) + 4
    # The lookup's backward is the dropout's; the two tables' embedding_dense_backward (6 kernels
    # and AccumulateGrad's add each) are the embedding's weight gradient (ops.embedding_wgrad_op).
    assert mb["embedding"] == 1


def _report(sc):
    from simulator.simulate import simulate

    return simulate(sc, with_critical_path=False)


def test_the_step_breakdown_shows_the_host_wait_apart_from_compute(tmp_path):
    from simulator.workload.program import host_launch_wait_s

    prof = load_profile("a100-sxm-80gb")
    free = prof.model_copy(update={"compute": prof.compute.model_copy(
        update={"host_launch_forward_us": 0.0, "host_launch_backward_us": 0.0, "host_collective_us": 0.0})})
    (tmp_path / "free.json").write_text(free.model_dump_json())
    data = vtrain_scenario(_row(1024, 8, 1))
    sc = build_scenario(data)
    res = _report(sc)
    bd = res.report.step_breakdown_s
    waited = host_launch_wait_s(res.program)
    # One pipeline rank: its host wait is the plan's, and the terms still sum to the step.
    assert bd["host_launch"] == pytest.approx(waited[0], rel=1e-9) and bd["host_launch"] > 0.3 * res.report.step_time_s
    assert sum(v for k, v in bd.items()) == pytest.approx(res.report.step_time_s, rel=1e-9)
    # Without launch costs the kernels alone are what "compute" kept: the same seconds.
    data["cluster"]["gpu"] = str(tmp_path / "free.json")
    res_free = _report(build_scenario(data))
    assert res_free.report.step_breakdown_s["host_launch"] == 0.0
    assert bd["compute"] == pytest.approx(res_free.report.step_breakdown_s["compute"], rel=1e-6)


def test_the_critical_path_splits_the_host_wait_off_its_compute():
    from simulator.report.analysis import critical_path, split_host_launch
    from simulator.simulate import simulate
    from simulator.workload.program import host_wait_shares

    res = simulate(build_scenario(vtrain_scenario(_row(1024, 8, 1))))
    rep = res.report
    # One pipeline rank: the path crosses every action of it whole, so its host share is the
    # breakdown's host term, and the causes still sum to the step.
    assert rep.critical_path_s["host_launch"] == pytest.approx(rep.step_breakdown_s["host_launch"], rel=1e-9)
    assert sum(rep.critical_path_s.values()) == pytest.approx(rep.step_time_s, rel=1e-9)
    # The split moves time from compute to host_launch and nothing else: per action on the path too.
    raw = critical_path(res.timeline)
    split = split_host_launch(raw, host_wait_shares(res.program), res.program.schedule.stage_position)
    before = sum(s["end_s"] - s["start_s"] for s in raw if s["cause"] == "compute")
    after = {c: sum(s["end_s"] - s["start_s"] for s in split if s["cause"] == c) for c in ("compute", "host_launch")}
    assert after["compute"] + after["host_launch"] == pytest.approx(before, rel=1e-12) and after["host_launch"] > 0
    assert all(set(e["by_cause_s"]) >= {"compute", "host_launch"} for e in rep.critical_path if e["what"].startswith("B "))
    # Large kernels: next to nothing on the path waits on the host (a few small segments).
    big = simulate(build_scenario(vtrain_scenario(_row(8192, 1, 8)))).report
    assert big.critical_path_s.get("host_launch", 0.0) < 1e-3 * big.step_time_s


def test_a_host_bound_step_gets_a_finding_with_simulated_fixes():
    from simulator.report.findings import attach

    sc = build_scenario(vtrain_scenario(_row(1024, 8, 1)))
    rep = attach(_report(sc)).report
    host = [f for f in rep.findings if f["kind"] == "host-bound"]
    assert host, [f["kind"] for f in rep.findings]
    labels = {s["label"]: s for s in host[0]["suggestions"]}
    # Twice the tokens per launch: the step shortens (the global batch is the same).
    assert labels["micro_batch_size=2"]["simulated"]
    assert labels["micro_batch_size=2"]["predicted_step_s"] < rep.step_time_s
    # Large kernels: no finding.
    big = attach(_report(build_scenario(vtrain_scenario(_row(8192, 1, 8))))).report
    assert not [f for f in big.findings if f["kind"] == "host-bound"]


def test_the_host_finding_halves_tp_when_dp_is_left_to_be_derived():
    # Was TypeError "p.dp * 2" (None * 2) whenever dp was not given: the CLI's default.
    from simulator.report.findings import attach
    from simulator.simulate import simulate

    data = vtrain_scenario(_row(1024, 8, 1))
    data["parallelism"] = {k: v for k, v in data["parallelism"].items() if k != "dp"}
    sc = build_scenario(data)
    assert sc.parallelism.dp is None and sc.dp == 1
    host = [f for f in attach(simulate(sc)).report.findings if f["kind"] == "host-bound"]
    halved = {s["label"]: s for s in host[0]["suggestions"]}["tp=4, dp=2"]
    assert halved["overrides"] == {"parallelism.tp": 4, "parallelism.dp": 2} and halved["simulated"]
