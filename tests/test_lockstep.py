"""Full mode from ranks that move in lockstep (simulator.engine.lockstep), against the reference
loop that runs one process per rank (mode "every-rank")."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from agreement_scenarios import SMALL_DENSE, SMALL_MOE, scenario
from simulator.engine.lockstep import LockstepCheck, NotLockstep, lockstep_blocker
from simulator.network.base import CollectiveRequest
from simulator.scenario import build_scenario
from simulator.simulate import make_network, simulate
from simulator.topology import load_topology
from simulator.profile import load_profile
from simulator.vocabulary import CollectiveOp, Dim


def _sorted(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    out = frame.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.CategoricalDtype):
            out[c] = out[c].astype(str)
    return out.sort_values(keys, kind="mergesort").reset_index(drop=True)


def _same_frame(a: pd.DataFrame, b: pd.DataFrame, keys: list[str]) -> None:
    assert list(a.columns) == list(b.columns)
    assert (a.dtypes == b.dtypes).all()
    a, b = _sorted(a, keys), _sorted(b, keys)
    assert len(a) == len(b)
    for c in a.columns:
        x, y = a[c].to_numpy(), b[c].to_numpy()
        if x.dtype.kind == "f":
            # the same rows; the two loops add the same floats in another order (a few ulps)
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-15, err_msg=c)
        else:
            assert (x == y).all(), c


CASES = {
    # flow fabric: FSDP gathers and reduce-scatters across nodes, TP and CP inside, PP between stages
    "fsdp-tp-cp-pp": scenario("fsdp-tp-cp-pp", gpus=32, network="flow",
                              parallelism={"tp": 2, "cp": 2, "pp": 2, "zero": 3}, seq=2048),
    # experts (all-to-all), DualPipe's bidirectional pipeline
    "moe-dualpipe": scenario("moe-dualpipe", model=SMALL_MOE, gpus=16, network="flow", schedule="dualpipe",
                             parallelism={"pp": 4, "ep": 4, "zero": 1}, gbs=64),
    # interleaved pipeline on the alpha-beta network, with HSDP
    "interleaved-hsdp": scenario("interleaved-hsdp", gpus=32, schedule="interleaved-1f1b",
                                 parallelism={"tp": 2, "pp": 2, "vpp": 2, "zero": 3, "fsdp_shard_size": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_full_mode_gives_every_rank_what_the_per_rank_loop_gives(case):
    sc = build_scenario(CASES[case])
    full, ref = simulate(sc, "full"), simulate(sc, "every-rank")
    a, b = full.timeline, ref.timeline
    pp = sc.parallelism.pp
    assert a.lockstep == {"simulated_ranks": pp, "ranks": sc.cluster.gpus} and b.lockstep is None
    assert (a.mode, full.report.mode, b.mode, ref.report.mode) == ("full", "full", "every-rank", "every-rank")
    assert full.report.lockstep == a.lockstep
    # the work, not the world: a pipeline rank's events once, not once per rank of it
    assert a.num_events <= 1.01 * b.num_events * pp / sc.cluster.gpus
    assert sorted(a.ranks) == sorted(b.ranks) == list(range(sc.cluster.gpus))
    _same_frame(a.events, b.events, ["rank", "start_s", "end_s", "stream", "name"])
    # waits name each rank's own peers (src_rank), as the per-rank loop does
    _same_frame(a.waits, b.waits, ["rank", "start_s", "end_s", "cause", "what"])
    for field in ("busy_compute_s", "contention_s", "end_time_s"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.keys() == y.keys()
        assert [x[r] for r in sorted(x)] == pytest.approx([y[r] for r in sorted(y)], rel=1e-12, abs=1e-15)
    for r in b.ranks:
        assert a.exposed_s[r] == pytest.approx(b.exposed_s[r], rel=1e-12, abs=1e-15)
        assert a.comm_bytes[r] == pytest.approx(b.comm_bytes[r], rel=1e-12)
    assert a.pp_rank_of == b.pp_rank_of
    ra, rb = full.report, ref.report
    assert ra.step_time_s == pytest.approx(rb.step_time_s, rel=1e-12)
    assert ra.mfu == pytest.approx(rb.mfu, rel=1e-12)
    assert ra.bubble_fraction == pytest.approx(rb.bubble_fraction, rel=1e-9)
    assert ra.exposed_comm_s == pytest.approx(rb.exposed_comm_s, rel=1e-9, abs=1e-12)
    assert ra.critical_path_s == pytest.approx(rb.critical_path_s, rel=1e-9, abs=1e-12)
    assert [(e["rank"], e["what"]) for e in ra.critical_path] == [(e["rank"], e["what"]) for e in rb.critical_path]


def test_a_torus_runs_full_mode_on_every_rank():
    # Dimension-ordered routes are not the same from every chip: no shortcut, the reference loop.
    d = scenario("torus", gpus=16, network="flow", parallelism={"tp": 2, "pp": 2, "zero": 1},
                 cluster={"topology": "torus-3d"})
    sc = build_scenario(d)
    net = make_network(sc, load_topology(sc.cluster.topology), load_profile(sc.cluster.gpu))
    assert "torus" in lockstep_blocker(net)
    res = simulate(sc, "full")
    full = res.timeline
    assert full.lockstep is None and full.num_events == simulate(sc, "every-rank").timeline.num_events
    # and the report says why it took the long way
    assert res.report.notes[-1] == ("full mode ran one process per rank, ranks in lockstep not simulated once: "
                                    "a torus: dimension-ordered routes differ by position")


def test_a_partial_node_runs_full_mode_on_every_rank():
    d = scenario("partial", gpus=12, gbs=24, network="flow", parallelism={"tp": 2, "pp": 2, "zero": 1})
    sc = build_scenario(d)
    net = make_network(sc, load_topology(sc.cluster.topology), load_profile(sc.cluster.gpu))
    assert lockstep_blocker(net) == "a partial node (12 GPUs, 8 a node)"
    assert simulate(sc, "full").timeline.lockstep is None


def test_an_oversubscribed_fabric_runs_full_mode_on_every_rank():
    # 3:1 leaves: binding trunks make contention decide which flow finishes first, and the
    # per-rank loop parts ranks of one pipeline rank; no shortcut there.
    topo = load_topology("dgx-h100-fattree").model_dump(mode="json")
    topo["fabric"].update(radix=48, leaf_oversubscription=3.0)
    d = scenario("over", gpus=96, gbs=96, network="flow", parallelism={"tp": 8, "pp": 4, "zero": 1},
                 cluster={"topology": topo})
    sc = build_scenario(d)
    net = make_network(sc, load_topology(sc.cluster.topology), load_profile(sc.cluster.gpu))
    assert lockstep_blocker(net) == "an oversubscribed fabric (3:1): contended flows can part a pipeline rank's ranks"
    assert simulate(sc, "full").timeline.lockstep is None


class _Net:
    """A network of 8-GPU nodes on which a group inside one node is fast, one across nodes slow."""

    def __init__(self):
        from types import SimpleNamespace

        self.node = SimpleNamespace(gpus_per_node=8)
        self.started = []

    def collective_time_s(self, req):
        self.timed = getattr(self, "timed", 0) + 1
        nodes = np.asarray(req.groups) // 8
        return 1e-3 if (nodes == nodes[:, :1]).all() else 2e-3

    def start(self, env, req):
        self.started.append(req)
        return "event"


def test_groups_the_network_treats_differently_stop_the_shortcut_before_they_run():
    net = _Net()
    check = LockstepCheck(net)
    # two groups in the same place relative to their nodes: one is timed, it stands for both
    alike = CollectiveRequest(CollectiveOp.ALL_REDUCE, Dim.TP, np.array([[0, 1], [8, 9]]), 1e6)
    assert check.start(None, alike) == "event" and net.started == [alike] and net.timed == 1
    unlike = CollectiveRequest(CollectiveOp.ALL_REDUCE, Dim.DP, np.array([[0, 4], [6, 12]]), 2e6)
    with pytest.raises(NotLockstep, match=r"dp all_reduce of 2000000 B takes 1000.000 us on one group "
                                          r"and 2000.000 us on group \[6, 12\]"):
        check.start(None, unlike)
    assert net.started == [alike]  # refused before it ran


def test_a_group_set_is_analysed_once_and_checked_when_its_links_are_asked_for(monkeypatch):
    """The engine asks for the links of every request before its loop: the check runs there, and
    requests over one group set (other ops, sizes) reuse its analysis (O(world) each)."""
    net = _Net()
    net.links_of = lambda req: None
    check = LockstepCheck(net)
    calls = []
    shapes = LockstepCheck._shapes
    monkeypatch.setattr(LockstepCheck, "_shapes", lambda self, g: calls.append(1) or shapes(self, g))
    groups = np.array([[0, 1], [8, 9]])
    for op, size in ((CollectiveOp.ALL_REDUCE, 1e6), (CollectiveOp.ALL_GATHER, 2e6), (CollectiveOp.ALL_REDUCE, 3e6)):
        check.links_of(CollectiveRequest(op, Dim.TP, groups.copy(), size))
    assert len(calls) == 1 and net.timed == 3  # one analysis; each (op, size) timed once per shape
    unlike = CollectiveRequest(CollectiveOp.ALL_REDUCE, Dim.DP, np.array([[0, 4], [6, 12]]), 2e6)
    with pytest.raises(NotLockstep, match=r"on group \[6, 12\]"):
        check.links_of(unlike)
    assert len(calls) == 2 and net.started == []


def test_what_if_full_mode_is_still_the_per_rank_loop():
    # A perturbed run keeps its own reference (split mode is checked against it): one process per rank.
    d = scenario("slow", gpus=16, parallelism={"tp": 2, "pp": 2, "zero": 1},
                 perturbations={"gpus": [{"rank": 5, "speed": 0.8}]})
    res = simulate(build_scenario(d), "full")
    assert res.timeline.lockstep is None and res.report.whatif["simulated_ranks"] == 16


def test_a_few_ranks_rows_are_made_without_every_ranks():
    # The dashboard and Perfetto draw a few ranks: those rows are made alone, and are the ones every
    # rank's rows hold (rows are made when first read: tens of millions at thousands of GPUs).
    from simulator.engine.lockstep import LockstepTimeline, events_of, waits_of

    tl = simulate(build_scenario(CASES["fsdp-tp-cp-pp"]), "full").timeline
    assert isinstance(tl, LockstepTimeline) and tl.__dict__.get("_events_all") is None
    ranks = [3, 17, 30]
    few, few_waits = events_of(tl, ranks), waits_of(tl, ranks)
    assert tl.__dict__.get("_events_all") is None and tl.__dict__.get("_waits_all") is None
    _same_frame(few, tl.events[tl.events["rank"].isin(ranks)], ["rank", "start_s", "end_s", "stream", "name"])
    _same_frame(few_waits, tl.waits[tl.waits["rank"].isin(ranks)], ["rank", "start_s", "end_s", "cause", "what"])
    assert set(few["rank"]) == set(ranks)
