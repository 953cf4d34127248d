"""Perfetto / Chrome trace export: valid JSON, a pid per rank, tracks whose events nest."""

from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest

from simulator.errors import UserError
from simulator.report.perfetto import assign_tracks, check_nesting, dumps, perfetto_trace
from simulator.scenario import load_scenario
from simulator.simulate import simulate

SMALL = {"model": "llama3-8b", "cluster.gpus": 64, "parallelism.tp": 2, "parallelism.pp": 4,
         "batch.global_batch_size": 32, "batch.seq_length": 4096}


@pytest.fixture(scope="module")
def reduced():
    return simulate(load_scenario(None, SMALL))


@pytest.fixture(scope="module")
def full():
    return simulate(load_scenario(None, dict(SMALL, **{"cluster.gpus": 16})), mode="full")


def _x(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_trace_parses_and_nests(reduced):
    trace = json.loads(dumps(perfetto_trace(reduced.timeline)))
    xs = [e for e in _x(trace) if e["cat"] != "action" and not e["cat"].startswith("wait")]
    assert len(xs) == len(reduced.timeline.events)  # every op once, beside the action and wait slices
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    assert {e["pid"] for e in xs} == set(reduced.timeline.ranks)
    # µs: the last event ends at the step time
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(reduced.timeline.step_time_s * 1e6, rel=1e-6)
    assert check_nesting(trace["traceEvents"]) == []
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in xs} <= set(names)  # every track is named
    assert "compute" in names.values() and "tp" in names.values()
    procs = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert len(procs) == len(reduced.timeline.ranks)


def test_full_mode_every_rank_and_subset(full):
    trace = perfetto_trace(full.timeline)
    assert {e["pid"] for e in _x(trace)} == set(range(16))
    assert check_nesting(trace["traceEvents"]) == []
    sub = perfetto_trace(full.timeline, ranks=[0, 7, 15])
    assert {e["pid"] for e in _x(sub)} == {0, 7, 15}
    with pytest.raises(UserError, match="not simulated"):
        perfetto_trace(full.timeline, ranks=[16])


def test_overlapping_events_split_into_tracks(reduced):
    tl = copy.copy(reduced.timeline)
    r = tl.ranks[0]
    extra = pd.DataFrame([
        (r, "dp", "dp", "bucket a", 0.001, 0.004, -1, -1, -1, 1e6),
        (r, "dp", "dp", "bucket b", 0.002, 0.005, -1, -1, -1, 1e6),  # crosses a
        (r, "dp", "dp", "bucket c", 0.003, 0.0035, -1, -1, -1, 1e6),  # inside a and b: a third track
        (r, "dp", "dp", "bucket d", 0.005, 0.006, -1, -1, -1, 1e6),  # touches b's end
    ], columns=tl.events.columns)
    tl.events = pd.concat([tl.events, extra], ignore_index=True)
    trace = perfetto_trace(tl, ranks=[r])
    assert check_nesting(trace["traceEvents"]) == []
    tid = {e["name"]: e["tid"] for e in _x(trace) if e["name"].startswith("bucket")}
    assert len({tid["bucket a"], tid["bucket b"], tid["bucket c"]}) == 3
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == r}
    assert {"dp #2", "dp #3"} <= threads


def test_assign_tracks_is_minimal():
    rng = np.random.default_rng(1)
    s = rng.integers(0, 1000, 300)
    e = s + rng.integers(0, 100, 300)
    tr = assign_tracks(s, e)
    for k in np.unique(tr):
        idx = np.argsort(s[tr == k])
        ss, ee = s[tr == k][idx], e[tr == k][idx]
        assert np.all(ss[1:] >= ee[:-1])
    # greedy by start time uses exactly the maximum number of simultaneously open intervals
    points = sorted([(x, 1) for x, y in zip(s, e) if y > x] + [(y, -1) for x, y in zip(s, e) if y > x])
    depth = np.max(np.cumsum([d for _, d in points]))
    assert tr.max() + 1 == max(depth, 1)


def test_checker_catches_crossing_events():
    bad = [{"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0.0, "dur": 10.0},
           {"ph": "X", "name": "b", "pid": 0, "tid": 1, "ts": 5.0, "dur": 10.0}]
    assert check_nesting(bad)
    nested = [{"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0.0, "dur": 10.0},
              {"ph": "X", "name": "b", "pid": 0, "tid": 1, "ts": 2.0, "dur": 3.0}]
    assert check_nesting(nested) == []


def test_ops_nest_under_actions_flows_counters_and_metadata(reduced):
    trace = json.loads(dumps(perfetto_trace(reduced.timeline, result=reduced)))
    ev = trace["traceEvents"]
    assert check_nesting(ev) == []
    xs = _x(trace)
    actions = [e for e in xs if e["cat"] == "action"]
    ops = [e for e in xs if e["cat"] in ("F", "B", "W", "I") and "microbatch" in e["args"]]
    assert actions and ops
    # every forward/backward op lies inside an action slice of its own kind, stage and microbatch
    by = {}
    for a in actions:
        by.setdefault((a["pid"], a["tid"], a["args"]["stage"], a["args"]["microbatch"], a["name"].split()[0]), []).append(a)
    for o in ops:
        cands = by[(o["pid"], o["tid"], o["args"]["stage"], o["args"]["microbatch"], o["cat"])]
        assert any(a["ts"] - 1e-3 <= o["ts"] and o["ts"] + o["dur"] <= a["ts"] + a["dur"] + 1e-3 for a in cands), o
    # waits are slices on the compute track, with their cause
    assert any(e["cat"] == "wait bubble" for e in xs) and any(e["cat"] == "wait tp" for e in xs)
    # one flow per pipeline transfer, from the sender's process to the receiver's
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    sends = reduced.timeline.events["stream"].str.startswith("pp-send").sum()
    assert len(starts) == len(ends) == sends > 0
    assert all(starts[i]["pid"] != ends[i]["pid"] for i in starts)
    counters = {e["name"] for e in ev if e["ph"] == "C"}
    assert "memory GiB" in counters and any(n.startswith("wire GB/s tp") for n in counters)
    peak = max(e["args"]["GiB"] for e in ev if e["ph"] == "C" and e["name"] == "memory GiB")
    assert peak == pytest.approx(reduced.report.peak_memory_gib, rel=1e-3)  # the model's peak, reached in time
    meta = trace["otherData"]
    assert meta["scenario_name"] == reduced.scenario.name
    assert json.loads(meta["scenario"])["parallelism"]["pp"] == 4
