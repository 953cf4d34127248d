"""Step-time breakdown and critical path: measured parts that sum to the step on every schedule."""

from __future__ import annotations

import pytest

from simulator.report.analysis import BREAKDOWN_KEYS, critical_path, rank_breakdown
from simulator.scenario import build_scenario
from simulator.simulate import simulate

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 1), ("dualpipe", 1),
             ("dualpipev", 1)]


def moe_all_dims(schedule: str = "dualpipe", vpp: int = 1, **over) -> dict:
    """A small MoE scenario with every dimension > 1, so every cause of waiting occurs."""
    d = {"name": f"moe-{schedule}", "model": "mixtral-8x7b",
         "parallelism": {"tp": 2, "cp": 2, "pp": 4, "vpp": vpp, "ep": 2, "zero": 1},
         "schedule": schedule, "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 2048},
         "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    d.update(over)
    return d


@pytest.mark.parametrize("schedule,vpp", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_breakdown_sums_to_step_on_every_schedule(schedule, vpp):
    res = simulate(build_scenario(moe_all_dims(schedule, vpp)))
    rep, tl = res.report, res.timeline
    bd = rep.step_breakdown_s
    total = sum(bd[k] for k in BREAKDOWN_KEYS)
    # every part is measured on its own (compute rows, recorded waits, the tail), not a remainder
    assert total == pytest.approx(rep.step_time_s, rel=1e-3)
    assert abs(bd["unattributed"]) <= 1e-3 * rep.step_time_s
    for r, row in rank_breakdown(tl).items():
        assert sum(row[k] for k in BREAKDOWN_KEYS) == pytest.approx(tl.step_time_s, rel=1e-3), r
        assert all(row[k] >= -1e-12 for k in BREAKDOWN_KEYS)
    # the recorded waits are exactly the exposed communication the engine accounts
    w = tl.waits
    for r in tl.ranks:
        for d in ("tp", "cp", "ep", "pp", "dp"):
            mine = w[(w["rank"] == r) & (w["cause"] == d)]
            assert (mine["end_s"] - mine["start_s"]).sum() == pytest.approx(tl.exposed_s[r][d], abs=1e-12)
    # the old bubble fraction is bubble + imbalance
    assert (bd["bubble"] + bd["imbalance"]) / rep.step_time_s == pytest.approx(rep.bubble_fraction, abs=1e-6)
    # the critical path runs from 0 to the end of the step without gaps or overlaps
    path = critical_path(tl)
    assert path[0]["start_s"] == pytest.approx(0.0, abs=1e-12)
    assert path[-1]["end_s"] == pytest.approx(rep.step_time_s, rel=1e-12)
    for a, b in zip(path, path[1:]):
        assert b["start_s"] == pytest.approx(a["end_s"], abs=1e-9)
    assert sum(rep.critical_path_s.values()) == pytest.approx(rep.step_time_s, rel=1e-6)
    assert set(rep.critical_path_s) <= {"compute", "host_launch", "bubble", "tp", "cp", "ep", "pp", "dp"}
    assert rep.critical_path_s.get("compute", 0) > 0
    if schedule != "dualpipe":  # a pipeline with pp > 1: the path crosses stages through pp transfers
        assert len({s["pp_rank"] for s in path}) == 4 and rep.critical_path_s.get("pp", 0) > 0


DENSE = {"name": "dense", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 4, "zero": 1},
         "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 4096},
         "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}


def test_breakdown_sees_imbalance_when_layers_are_uneven():
    # 32 layers on 4 stages as 5/9/9/9: every stage but the slowest idles for its missing layers
    even = simulate(build_scenario(DENSE)).report
    skew = simulate(build_scenario(dict(DENSE, parallelism={"tp": 2, "pp": 4, "zero": 1,
                                                             "pp_layer_split": [5, 9, 9, 9]}))).report
    assert skew.step_breakdown_s["imbalance"] > 1.3 * even.step_breakdown_s["imbalance"]
    assert skew.step_breakdown_s["imbalance"] > 0.05 * skew.step_time_s


def test_step_delta_parts_sum_to_the_step_change():
    from simulator.report.analysis import step_delta

    a = simulate(build_scenario(DENSE)).report
    b = simulate(build_scenario(dict(DENSE, schedule="zb-h1"))).report
    rows = step_delta(a, b)
    step = rows[-1]
    assert step["component"] == "step" and step["delta_s"] == pytest.approx(b.step_time_s - a.step_time_s)
    assert sum(r["delta_s"] for r in rows[:-1]) == pytest.approx(step["delta_s"], abs=1e-3 * a.step_time_s)
    bubble = next(r for r in rows if r["component"] == "bubble")
    assert bubble["delta_s"] < 0  # the zero-bubble schedule fills the bubble
    # a report without a breakdown (an older JSON) still compares on the step
    old = a.model_copy(update={"step_breakdown_s": {}})
    assert [r["component"] for r in step_delta(old, b)] == ["step"]


def test_timeline_string_columns_are_categoricals_in_string_order():
    """The timeline's string columns are stored as codes (memory at scale), with categories in
    string order, so sorting or grouping by them orders rows exactly as the strings would."""
    import pandas as pd

    tl = simulate(build_scenario(moe_all_dims("1f1b"))).timeline
    for frame, cols in ((tl.events, ("stream", "kind", "name")), (tl.waits, ("cause", "what"))):
        for c in cols:
            assert isinstance(frame[c].dtype, pd.CategoricalDtype), c
            cats = list(frame[c].cat.categories)
            assert cats == sorted(cats), c
        as_strings = frame.astype({c: pd.Series(["x"]).dtype for c in cols})
        keys = ["rank", cols[0], "start_s"]
        by_code = frame.sort_values(keys, kind="stable").index
        by_string = as_strings.sort_values(keys, kind="stable").index
        assert (by_code == by_string).all()
    # what the reports compare against reads the same either way
    ev = tl.events
    assert (ev["stream"] == "compute").sum() == (ev["stream"].astype(str) == "compute").sum() > 0


def test_memory_parts_line_names_the_peak_ranks_largest_terms():
    from simulator.report.analysis import memory_parts_line

    rep = simulate(build_scenario({"model": "llama3-8b", "parallelism": {"tp": 2, "pp": 2, "zero": 1},
                                   "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
                                   "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})).report
    worst = max((r["memory_gib"] for r in rep.per_pp_rank), key=lambda m: m["total_gib"])
    top = sorted(((k, v) for k, v in worst.items() if k != "total_gib"), key=lambda kv: -kv[1])[:3]
    line = memory_parts_line(rep)
    assert line == ", ".join(f"{k.removesuffix('_gib').replace('_', ' ')} {v:.1f}" for k, v in top) + " GiB"
    rep.per_pp_rank = []
    assert memory_parts_line(rep) == ""


def test_waiting_for_a_later_stage_at_a_pp_collective_is_bubble_not_communication():
    # A pipeline's drain ends in collectives over pp (the gradient norm, the tied embedding): the
    # stages that finished first waited there for the last one's cool-down, and that wait was
    # counted as exposed pp (dense PP8: 0.003 ... 0.105 s by stage for ~0.2 GB a GPU, against
    # 0.005 s of pp on the critical path). Now: bubble up to the last member's arrival.
    sc = build_scenario({**DENSE, "network": "alpha-beta", "parallelism": {"tp": 1, "pp": 8, "zero": 1},
                         "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 2048},
                         "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
    rep = simulate(sc).report
    pp = [row["exposed_comm_s"]["pp"] for row in rep.per_pp_rank]
    assert max(pp) < 3 * min(pp), pp  # the same transfers on every stage, not a ramp with the drain
    assert rep.exposed_comm_s["pp"] < 2 * rep.critical_path_s.get("pp", 0.0) + 1e-3
    for row in rep.per_pp_rank:
        b = row["breakdown_s"]
        assert abs(sum(v for k, v in b.items() if k != "unattributed") - rep.step_time_s) < 1e-6 * rep.step_time_s


def test_the_critical_path_follows_collectives_queued_on_one_stream():
    # FSDP2's gathers and reduce-scatters share one queue: a collective queued behind others
    # started when the one before it ended. The walk went back to the compute lane at that
    # instant, found nothing ending there, and called 37 ms of a 113 ms step without a pipeline
    # "bubble: idle (a send queued behind another, or the end of the step)".
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from agreement_scenarios import scenario
    from simulator.scenario import build_scenario
    from simulator.simulate import simulate

    rep = simulate(build_scenario(scenario("tt-accum", framework="torchtitan", gbs=64, parallelism={"zero": 3}))).report
    assert "bubble" not in rep.critical_path_s, rep.critical_path_s
    assert sum(rep.critical_path_s.values()) == pytest.approx(rep.step_time_s, rel=1e-9)
    assert rep.critical_path_s["dp"] > rep.step_breakdown_s["exposed_dp"]
