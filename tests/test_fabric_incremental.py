"""The fabric's incremental solver against the global one it replaced.

FlowNetwork(incremental=True) (the default) re-solves only the connected components of running
coflows that a start or an end touches; FlowNetwork(incremental=False) re-solves every running
coflow at every event, as the fabric did before. Max-min on disjoint link sets is independent,
so the two must give the same rates, the same completion times and the same link bytes, up to
floating-point rounding (1e-9 relative), and the incremental one's work per event must not grow
with the number of independent components running beside it.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components
import simpy

from simulator.network.base import CollectiveRequest
from simulator.network.fabric import (
    FlowNetwork,
    _CoBatch,
    _Coll,
    _incidence,
    _isolated_unshared,
    _link_load,
)
from simulator.network.maxmin import maxmin_dense, maxmin_rates
from simulator.topology import load_topology
from simulator.topology.graph import build_graph
from simulator.topology.spec import TopologySpec

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]


def _spec(radix=4, over=2.0, gpus_per_node=2) -> TopologySpec:
    return TopologySpec.model_validate({
        "name": "test",
        "node": {"kind": "test", "gpus_per_node": gpus_per_node, "nvlink_GBps": 100.0, "nvlink_latency_us": 2.0,
                 "nics_per_node": 1, "nic_gbps": 400.0, "nic_latency_us": 1.0},
        "fabric": {"kind": "fat-tree", "radix": radix, "leaf_oversubscription": over},
    })


def _req(op, groups, size):
    return CollectiveRequest(op, "dp", np.atleast_2d(np.asarray(groups)), float(size))


def _random_reqs(rng, n_gpus, n):
    reqs = []
    for _ in range(n):
        op = str(rng.choice(OPS))
        k = 2 if op == "send_recv" else int(rng.integers(2, min(n_gpus, 9) + 1))
        reqs.append(_req(op, rng.choice(n_gpus, size=k, replace=False), float(rng.integers(1, 64)) * (1 << 20)))
    return reqs


def _run(net, reqs, starts):
    env = simpy.Environment()
    ends = [None] * len(reqs)

    def launch(i, r, t):
        yield env.timeout(t)
        yield net.start(env, r)
        ends[i] = env.now

    for i, r in enumerate(reqs):
        env.process(launch(i, r, starts[i]))
    env.run()
    return np.array(ends), net.link_bytes.copy()


# --- rates: the incremental components against one global max-min -------------------------------


def _global_levels(net: FlowNetwork, batches) -> np.ndarray:
    """Weighted max-min over every running coflow at once, on every link (no components, no
    cache, no merged rows): the definition the incremental solver must reproduce."""
    K = np.zeros((net.graph.n_links, len(batches)))
    for c, b in enumerate(batches):
        K[b.cf.link_ids, c] = b.cf.link_flows
    used = K.sum(axis=1) > 0
    ceil = np.array([b.cf.ceil_Bps for b in batches])
    return maxmin_dense(K[used], net.capacity_Bps[used], ceil)


@pytest.mark.parametrize("seed", range(12))
def test_incremental_rates_equal_global_maxmin_on_random_coflow_sets(seed):
    """Random coflows (from random collectives on a 2:1 oversubscribed fat-tree) join and leave
    in random order; after every change each running coflow's rate equals the global solve's."""
    rng = np.random.default_rng(seed)
    graph = build_graph(_spec(), 16)
    net = FlowNetwork(graph)
    env = simpy.Environment()
    net._reset_dynamic(env)
    pool = []
    for r in _random_reqs(rng, 16, 10):
        plan = net.plan_for(r)
        for p, ph in enumerate(plan.phases):
            for cf in ph.coflows:
                pool.append((_Coll(plan, r.size_bytes, simpy.Event(env), 0.0), p, cf))
    rng.shuffle(pool)
    running: list[_CoBatch] = []
    checked = bound_somewhere = 0
    for step in range(3 * len(pool)):
        if pool and (not running or rng.random() < 0.6):
            coll, p, cf = pool.pop()
            b = _CoBatch(coll, p, cf, [1], 1.0)
            net._join(b)
            running.append(b)
        elif running:
            gone = [running.pop(int(rng.integers(len(running))))]
            if running and rng.random() < 0.3:  # two ending at one timer
                gone.append(running.pop(int(rng.integers(len(running)))))
            net._leave(gone)
        else:
            break
        net._settle_incremental()
        if not running:
            continue
        want = _global_levels(net, running)
        got = np.array([b.rate / b.cu_per for b in running])
        assert got == pytest.approx(want, rel=1e-9)
        # the earlier global path (all running coflows, its own components) agrees as well
        assert got == pytest.approx(net._coflow_levels(running), rel=1e-9)
        checked += 1
        # the component map: a link points at the component of its coflows where their demand
        # at their ceilings exceeds its capacity (it binds), nowhere else; and the components are
        # the parts those binding links connect, no coarser
        demand = np.zeros(net.graph.n_links)
        for b in running:
            np.add.at(demand, b.cf.link_ids, b.cf.link_flows * b.cf.ceil_Bps)
        binds = demand > net.capacity_Bps * (1 + 1e-9)
        for b in running:
            lc = net._link_comp[b.cf.link_ids]
            on = binds[b.cf.link_ids]
            assert (lc[on] == b.comp.cid).all() and (lc[~on] == -1).all()
        live = {b.comp.cid for b in running}
        assert set(net._comps) == live
        assert set(np.unique(net._link_comp[net._link_comp >= 0]).tolist()) <= live
        edges = [(i, j) for i, bi in enumerate(running) for j, bj in enumerate(running)
                 if i < j and binds[np.intersect1d(bi.cf.link_ids, bj.cf.link_ids)].any()]
        n_parts, _ = connected_components(sp.coo_matrix((np.ones(len(edges)), ([e[0] for e in edges], [e[1] for e in edges])),
                                                        shape=(len(running),) * 2), directed=False)
        assert len(live) == n_parts
        bound_somewhere += int(binds.any())
    assert checked > 10 and bound_somewhere > 0


# --- whole runs: completion times and link bytes --------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_incremental_run_equals_global_run_on_random_collectives(seed):
    rng = np.random.default_rng(1000 + seed)
    graph = build_graph(_spec(), 16)
    reqs = _random_reqs(rng, 16, 8)
    starts = rng.uniform(0, 2e-3, len(reqs))
    if seed % 4 == 0:
        starts = np.round(starts, 3)  # simultaneous starts
    for fast in (True, False):
        t_inc, b_inc = _run(FlowNetwork(graph, fast_path=fast), reqs, starts)
        t_glob, b_glob = _run(FlowNetwork(graph, fast_path=fast, incremental=False), reqs, starts)
        assert t_inc == pytest.approx(t_glob, rel=1e-9)
        assert b_inc == pytest.approx(b_glob, rel=1e-9, abs=1e-3)


def test_incremental_run_equals_global_run_at_256_gpus():
    """DP rings across leaves, TP rings in nodes, an all-to-all and an all-gather crossing them,
    staggered: large components that merge and split."""
    graph = build_graph(load_topology("dgx-h100-fattree"), 256)
    groups = np.arange(256).reshape(32, 8)
    reqs = [_req("all_reduce", groups.T[i], 1 << 26) for i in range(8)]
    reqs += [_req("all_reduce", groups[i], 1 << 26) for i in range(32)]
    reqs += [_req("all_to_all", groups.T[:2].ravel(), 1 << 26), _req("all_gather", groups[:4].ravel(), 1 << 26)]
    starts = np.linspace(0, 1e-3, len(reqs))
    for fast in (True, False):
        t_inc, b_inc = _run(FlowNetwork(graph, fast_path=fast), reqs, starts)
        t_glob, b_glob = _run(FlowNetwork(graph, fast_path=fast, incremental=False), reqs, starts)
        assert t_inc == pytest.approx(t_glob, rel=1e-9)
        assert b_inc == pytest.approx(b_glob, rel=1e-9, abs=1e-3)


def test_full_mode_step_is_unchanged_by_the_incremental_solver(monkeypatch):
    """A full-mode training step (TP, PP, DP across nodes, contention on) gives the same step,
    the same per-rank ends and the same events with either solver."""
    from simulator.scenario import build_scenario
    from simulator.simulate import simulate

    d = {"name": "inc", "model": "llama3-8b", "parallelism": {"tp": 4, "pp": 2, "zero": 1},
         "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 2048},
         "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    out = []
    for inc in (True, False):
        init = FlowNetwork.__init__

        def patched(self, *a, _inc=inc, _init=init, **k):
            k.setdefault("incremental", _inc)
            _init(self, *a, **k)

        monkeypatch.setattr(FlowNetwork, "__init__", patched)
        tl = simulate(build_scenario(d), mode="every-rank").timeline
        monkeypatch.setattr(FlowNetwork, "__init__", init)
        out.append((tl.step_time_s, tl.end_time_s, tl.num_events, tl.events.end_s.to_numpy()))
    (s1, e1, n1, r1), (s2, e2, n2, r2) = out
    assert s1 == pytest.approx(s2, rel=1e-9)
    assert n1 == n2
    assert [e1[r] for r in sorted(e1)] == pytest.approx([e2[r] for r in sorted(e2)], rel=1e-9)
    assert np.sort(r1) == pytest.approx(np.sort(r2), rel=1e-9)


def test_level_cache_bound_keeps_results_and_holds(monkeypatch):
    """The component-level cache is emptied when its keys would hold more coflows than its bound:
    the run is the same (the cache only saves solves), and the count never passes the bound."""
    import simulator.network.fabric as fabric

    # random collectives on a 2:1 oversubscribed fat-tree: links that bind, components to solve
    # (DGX rings of TP and DP groups leave every link room for all its coflows: nothing to solve)
    rng = np.random.default_rng(4)
    graph = build_graph(_spec(), 16)
    reqs = _random_reqs(rng, 16, 40)
    starts = rng.uniform(0, 4e-3, len(reqs))
    free = FlowNetwork(graph, fast_path=False)
    t_free, b_free = _run(free, reqs, starts)
    biggest = max((len(k) for k in free._level_cache), default=0)
    assert free._level_cache_members > 3 * biggest  # the unbounded run kept several components
    monkeypatch.setattr(fabric, "LEVEL_CACHE_MEMBERS", biggest + 1)
    seen = []
    cache_levels = FlowNetwork._cache_levels

    def watched(self, key, hit):
        cache_levels(self, key, hit)
        seen.append(self._level_cache_members)

    monkeypatch.setattr(FlowNetwork, "_cache_levels", watched)
    bounded = FlowNetwork(graph, fast_path=False)
    t_b, b_b = _run(bounded, reqs, starts)
    assert seen and max(seen) <= biggest + 1
    assert bounded.stats.solves >= free.stats.solves
    assert (t_b == t_free).all()
    assert b_b == pytest.approx(b_free, rel=1e-12, abs=1e-6)


# --- cost: work per event does not grow with what runs elsewhere --------------------------------


def _independent_rings(n_nodes: int) -> FlowNetwork:
    """Two overlapping ring all-reduces in each of n_nodes nodes (a component of two coflows per
    node, nodes independent), every collective as real flows, staggered in time."""
    graph = build_graph(load_topology("dgx-h100-fattree"), 8 * n_nodes)
    net = FlowNetwork(graph, fast_path=False)
    reqs, starts = [], []
    for node in range(n_nodes):
        g = np.arange(8 * node, 8 * node + 8)
        reqs += [_req("all_reduce", g, 1 << 24), _req("all_reduce", g[::-1].copy(), 1 << 23)]
        starts += [node * 1e-6, node * 1e-6 + 5e-5]
    _run(net, reqs, np.array(starts))
    return net


def test_work_per_event_is_flat_in_the_number_of_independent_components():
    small, large = _independent_rings(4), _independent_rings(32)
    per_solve = [n.stats.solved_coflows / n.stats.solves for n in (small, large)]
    # each re-solve covers one node's component (at most its two coflows), however many run
    assert max(per_solve) <= 2.0
    assert per_solve[1] == pytest.approx(per_solve[0], rel=0.25)
    # the global solver's work per solve grows with the number of nodes
    glob = FlowNetwork(build_graph(load_topology("dgx-h100-fattree"), 256), fast_path=False, incremental=False)
    reqs = [_req("all_reduce", np.arange(8 * k, 8 * k + 8), 1 << 24) for k in range(32)]
    _run(glob, reqs, np.arange(32) * 1e-6)
    assert glob.stats.solved_coflows / glob.stats.solves > 8


# --- plan building helpers against their plain definitions ----------------------------------------


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n_gpus", [16, 256])
def test_plan_helpers_equal_their_definitions(seed, n_gpus):
    """On 16 GPUs phases cover much of the fabric (the helpers' dense branches); on 256 GPUs
    small groups touch a few of its links (the sparse ones)."""
    rng = np.random.default_rng(seed)
    graph = build_graph(_spec(), 16) if n_gpus == 16 else build_graph(load_topology("dgx-h100-fattree"), n_gpus)
    for r in _random_reqs(rng, n_gpus, 6):
        from simulator.network.collectives import candidates

        for plan in candidates(graph, r.op, r.groups, None):
            for ph in plan.phases:
                routes = graph.route(ph.src, ph.dst, ph.src_nic, ph.dst_nic)
                ref = routes.incidence(graph.n_links)
                inc = _incidence(routes.flow, routes.link, routes.n_flows, graph.n_links)
                assert (ref != inc).nnz == 0 and inc.shape == ref.shape
                ids, load = _link_load(inc, ph.coef)
                full = inc @ ph.coef
                assert np.array_equal(ids, np.nonzero(full)[0])
                assert load == pytest.approx(full[ids], rel=1e-12)
                alive = ph.coef > 0
                fast = _isolated_unshared(inc, ph.coef, alive, FlowNetwork(graph).capacity_Bps)
                if fast is None:
                    continue
                rate = maxmin_rates(sp.csr_matrix(inc), FlowNetwork(graph).capacity_Bps, alive)
                fin = np.where(alive, ph.coef / np.where(alive, rate, 1.0), 0.0)
                assert fast[1] == pytest.approx(fin, rel=1e-12)
                assert fast[0] == pytest.approx(fin.max(), rel=1e-12)


