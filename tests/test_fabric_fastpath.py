"""The fabric's per-collective bookkeeping: which links are held (bitsets), the per-request
caches and the small-component split, against independent computations.

A collective takes the fast path exactly when none of its links carries another running
collective; the bitsets must make the same decision as a per-link check done from scratch. The
cached per-request link bytes and the bitset split of small components must give the same
numbers, bit for bit, as the paths they shortcut.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

import simulator.network.fabric as F
from simulator.network.base import CollectiveRequest
from simulator.network.fabric import FlowNetwork
from simulator.topology import load_topology
from simulator.topology.graph import build_graph
from simulator.topology.spec import TopologySpec

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]


def _spec() -> TopologySpec:
    return TopologySpec.model_validate({
        "name": "test",
        "node": {"kind": "test", "gpus_per_node": 2, "nvlink_GBps": 100.0, "nvlink_latency_us": 2.0,
                 "nics_per_node": 1, "nic_gbps": 400.0, "nic_latency_us": 1.0},
        "fabric": {"kind": "fat-tree", "radix": 4, "leaf_oversubscription": 2.0},
    })


def _random_reqs(rng, n_gpus: int, n: int) -> list[CollectiveRequest]:
    reqs = []
    for _ in range(n):
        op = str(rng.choice(OPS))
        k = 2 if op == "send_recv" else int(rng.integers(2, min(n_gpus, 9) + 1))
        groups = np.atleast_2d(rng.choice(n_gpus, size=k, replace=False))
        reqs.append(CollectiveRequest(op, "dp", groups, float(rng.integers(1, 64)) * (1 << 20)))
    return reqs


def _run(net: FlowNetwork, reqs, starts, check=None):
    """Start reqs[i] at starts[i] (a request may repeat: the engine reuses its objects); end times
    and link bytes. ``check(net, req, running)`` runs before each start."""
    env = simpy.Environment()
    ends = [None] * len(reqs)
    running: list[tuple[CollectiveRequest, simpy.Event]] = []

    def launch(i, r, t):
        yield env.timeout(t)
        if check is not None:
            check(net, r, [q for q, ev in running if not ev.triggered])
        ev = net.start(env, r)
        running.append((r, ev))
        yield ev
        ends[i] = env.now

    for i, r in enumerate(reqs):
        env.process(launch(i, r, starts[i]))
    env.run()
    return np.array(ends), net.link_bytes.copy()


def _links(net: FlowNetwork, req) -> set[int]:
    return set(net.plan_for(req).links.tolist())


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("scan", [True, False])
def test_fast_path_is_taken_exactly_when_every_link_is_idle(seed, scan, monkeypatch):
    if not scan:  # virtual collectives found through the link -> owner array
        monkeypatch.setattr(F, "_SCAN_VIRTUALS_MAX", 0)
    rng = np.random.default_rng(500 + seed)
    graph = build_graph(_spec(), 16)
    pool = _random_reqs(rng, 16, 6)
    reqs = [pool[int(i)] for i in rng.integers(0, len(pool), 30)]  # repeated request objects
    starts = np.round(rng.uniform(0, 3e-3, len(reqs)), 4)
    decisions = []

    def check(net, req, running):
        held = set().union(*(_links(net, q) for q in running)) if running else set()
        before = net.stats.fast_path
        decisions.append((not (_links(net, req) & held), before))

    net = FlowNetwork(graph)
    seen = []
    orig = net.start

    def start(env, req):
        ev = orig(env, req)
        seen.append(net.stats.fast_path)
        return ev

    net.start = start
    _run(net, reqs, starts, check)
    taken = [after > before for (_, before), after in zip(decisions, seen)]
    assert taken == [idle for idle, _ in decisions]
    assert any(taken) and not all(taken)  # both paths were exercised
    # everything ended: no link is held any more
    assert net._virt_bits == 0 and net._real_bits == 0 and not net._virtuals and not net._real_plans


@pytest.mark.parametrize("seed", range(8))
def test_shortcuts_change_no_number(seed, monkeypatch):
    rng = np.random.default_rng(700 + seed)
    graph = build_graph(_spec(), 16)
    pool = _random_reqs(rng, 16, 6)
    reqs = [pool[int(i)] for i in rng.integers(0, len(pool), 24)]
    starts = np.round(rng.uniform(0, 3e-3, len(reqs)), 4)
    t_new, b_new = _run(FlowNetwork(graph), reqs, starts)
    monkeypatch.setattr(F, "_BYTES_LOG_MAX", 1)  # link bytes added at once
    monkeypatch.setattr(F, "_SCAN_VIRTUALS_MAX", 0)  # virtual collectives found through the owner array
    t_ref, b_ref = _run(FlowNetwork(graph), reqs, starts)
    np.testing.assert_array_equal(t_new, t_ref)
    np.testing.assert_array_equal(b_new, b_ref)


def test_cached_link_bytes_on_a_dgx_fabric(monkeypatch):
    """Many TP rings in nodes and DP rings across them, staggered so some overlap."""
    graph = build_graph(load_topology("dgx-h100-fattree"), 64)
    groups = np.arange(64).reshape(8, 8)
    reqs = [CollectiveRequest("all_reduce", "tp", groups[i:i + 1], float(1 << 24)) for i in range(8)]
    reqs += [CollectiveRequest("all_reduce", "dp", groups.T[i:i + 1], float(1 << 24)) for i in range(8)]
    reqs = reqs * 3
    starts = np.linspace(0, 2e-3, len(reqs))
    t_new, b_new = _run(FlowNetwork(graph), reqs, starts)
    monkeypatch.setattr(F, "_BYTES_LOG_MAX", 1)
    t_ref, b_ref = _run(FlowNetwork(graph), reqs, starts)
    np.testing.assert_array_equal(t_new, t_ref)
    np.testing.assert_array_equal(b_new, b_ref)
    assert b_new.sum() > 0


@pytest.mark.parametrize("seed", range(4))
def test_link_bytes_summed_per_phase_equal_bytes_added_per_collective(seed, monkeypatch):
    """A collective run alone adds only its size to its phases' sums (FlowNetwork._log_isolated_bytes);
    its links get sum x link_coef when read. Against each collective's bytes added to each of its
    links as it ends (the fabric before round 15): the same bytes to float rounding, the same times."""
    rng = np.random.default_rng(740 + seed)
    graph = build_graph(load_topology("dgx-h100-fattree"), 64)
    groups = np.arange(64).reshape(8, 8)
    pool = [CollectiveRequest("all_reduce", "tp", groups[i:i + 1], float(1 << int(rng.integers(12, 26)))) for i in range(8)]
    pool += [CollectiveRequest("all_gather", "dp", groups.T, float(1 << int(rng.integers(12, 26))))]
    pool += [CollectiveRequest("reduce_scatter", "dp", groups.T[i:i + 1], float(1 << 22)) for i in range(8)]
    reqs = [pool[int(i)] for i in rng.integers(0, len(pool), 60)]
    starts = np.sort(np.round(rng.uniform(0, 4e-3, len(reqs)), 5))
    t_new, b_new = _run(FlowNetwork(graph), reqs, starts)

    def per_link(self, plan, size):
        for ph in plan.phases:
            self._add_bytes(ph.link_ids, size * ph.link_coef)

    monkeypatch.setattr(FlowNetwork, "_log_isolated_bytes", per_link)
    t_ref, b_ref = _run(FlowNetwork(graph), reqs, starts)
    np.testing.assert_array_equal(t_new, t_ref)
    assert b_ref.sum() > 0 and np.count_nonzero(b_ref) == np.count_nonzero(b_new)
    np.testing.assert_allclose(b_new, b_ref, rtol=1e-12, atol=0)


def test_a_run_does_not_depend_on_where_objects_sit_in_memory():
    """Contended components are solved with their coflows in creation order: solved in id()
    order (before), this case's end times moved by an ulp from one run to the next."""
    rng = np.random.default_rng(704)
    graph = build_graph(_spec(), 16)
    pool = _random_reqs(rng, 16, 6)
    reqs = [pool[int(i)] for i in rng.integers(0, len(pool), 24)]
    starts = np.round(rng.uniform(0, 3e-3, len(reqs)), 4)
    ref_t, ref_b = _run(FlowNetwork(graph), reqs, starts)
    for k in range(6):
        junk = [object() for _ in range(37 * k)]  # shifts where the next run's objects go
        t, b = _run(FlowNetwork(graph), reqs, starts)
        np.testing.assert_array_equal(t, ref_t)
        np.testing.assert_array_equal(b, ref_b)
        del junk
