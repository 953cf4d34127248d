"""Flow-level fabric: collective times against closed forms, max-min sharing, contention."""

from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.sparse as sp
import simpy

from simulator.profile import load_profile
from simulator.network.base import CollectiveRequest, bus_factor
from simulator.network.fabric import FlowNetwork
from simulator.network.maxmin import maxmin_rates
from simulator.topology import load_topology
from simulator.topology.graph import build_graph
from simulator.topology.spec import TopologySpec

GiB = float(1 << 30)


def spec(fabric: dict, gpus_per_node=8, nvlink_GBps=100.0, nvlink_latency_us=2.0, nics_per_node=1,
         nic_gbps=400.0, nic_latency_us=3.0) -> TopologySpec:
    return TopologySpec.model_validate({
        "name": "test",
        "node": {"kind": "test", "gpus_per_node": gpus_per_node, "nvlink_GBps": nvlink_GBps,
                 "nvlink_latency_us": nvlink_latency_us, "nics_per_node": nics_per_node,
                 "nic_gbps": nic_gbps, "nic_latency_us": nic_latency_us},
        "fabric": fabric,
    })


def req(op, groups, size):
    return CollectiveRequest(op, "dp", np.atleast_2d(np.asarray(groups)), float(size))


def run_together(net: FlowNetwork, reqs, starts=None) -> list[float]:
    env = simpy.Environment()
    ends = [None] * len(reqs)

    def launch(i, r, t):
        yield env.timeout(t)
        ev = net.start(env, r)
        yield ev
        ends[i] = env.now

    for i, r in enumerate(reqs):
        env.process(launch(i, r, 0.0 if starts is None else starts[i]))
    env.run()
    return ends


# --- max-min fairness -----------------------------------------------------------------------


def test_maxmin_three_flows_two_links():
    # f0 on L0, f1 on L0 and L1, f2 on L1; L0 = 1, L1 = 2
    inc = sp.csc_matrix(np.array([[1, 1, 0], [0, 1, 1]], dtype=float))
    r = maxmin_rates(inc, np.array([1.0, 2.0]))
    assert r == pytest.approx([0.5, 0.5, 1.5])


def test_maxmin_bottleneck_elsewhere_frees_capacity():
    # f0 alone on a slow link L1 (0.2) also crosses L0 (1.0) with f1 and f2: f0 = 0.2, f1 = f2 = 0.4
    inc = sp.csc_matrix(np.array([[1, 1, 1], [1, 0, 0]], dtype=float))
    assert maxmin_rates(inc, np.array([1.0, 0.2])) == pytest.approx([0.2, 0.4, 0.4])
    # inactive flows take nothing
    assert maxmin_rates(inc, np.array([1.0, 0.2]), np.array([False, True, True])) == pytest.approx([0, 0.5, 0.5])


def test_maxmin_parking_lot():
    # a long flow over 3 unit links, each also carrying one short flow: all get 1/2
    inc = sp.csc_matrix(np.array([[1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=float))
    assert maxmin_rates(inc, np.ones(3)) == pytest.approx([0.5] * 4)


# --- closed forms ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("size", [1 << 20, 1 << 28])
def test_uncontended_ring_matches_alpha_beta(n, size):
    B, a = 100e9, 2e-6
    net = FlowNetwork(build_graph(spec({"kind": "single-node"}), n))
    g = np.arange(n)
    t_ar = net.collective_time_s(req("all_reduce", g, size))
    assert t_ar == pytest.approx(2 * (n - 1) / n * size / B + 2 * (n - 1) * a, rel=0.01)
    for op in ("all_gather", "reduce_scatter"):
        assert net.collective_time_s(req(op, g, size)) == pytest.approx((n - 1) / n * size / B + (n - 1) * a, rel=0.01)
    assert net.algorithm(req("all_reduce", g, size)) == "ring"


def test_uncontended_ring_across_nodes_matches_alpha_beta():
    # one GPU per node, all on one leaf: every ring edge is NIC -> leaf -> NIC
    n, B, a, size = 6, 50e9, 3e-6, 1 << 26
    net = FlowNetwork(build_graph(spec({"kind": "fat-tree", "radix": 16}, gpus_per_node=1), n), algorithms={"all_reduce": "ring"})
    g = np.arange(n)
    assert net.collective_time_s(req("all_reduce", g, size)) == pytest.approx(2 * (n - 1) / n * size / B + 2 * (n - 1) * a, rel=0.01)
    assert net.collective_time_s(req("all_gather", g, size)) == pytest.approx((n - 1) / n * size / B + (n - 1) * a, rel=0.01)


def test_simpy_run_of_one_collective_equals_isolated_time():
    net = FlowNetwork.from_topology("dgx-h100-fattree", 32)
    r = req("all_reduce", np.arange(32), 1 << 28)
    t = net.collective_time_s(r)
    for fast in (True, False):
        net.fast_path = fast
        assert run_together(net, [r])[0] == pytest.approx(t, rel=1e-9)


# --- contention -------------------------------------------------------------------------------


def _two_leaf_net(oversubscription: float, fast_path=True) -> FlowNetwork:
    # radix 4, one NIC per node: two nodes per leaf; uplink = 2 NICs / oversubscription
    s = spec({"kind": "fat-tree", "radix": 4, "leaf_oversubscription": oversubscription}, gpus_per_node=1,
             nic_latency_us=0.0)
    return FlowNetwork(build_graph(s, 4), fast_path=fast_path)


def test_shared_oversubscribed_uplink_halves_each_all_reduce():
    size = 1 << 28
    a, b = req("all_reduce", [0, 2], size), req("all_reduce", [1, 3], size)
    net = _two_leaf_net(2.0)
    alone = net.collective_time_s(a)
    assert net.collective_time_s(b) == pytest.approx(alone)
    ends = run_together(net, [a, b])
    assert min(ends) >= 1.9 * alone
    # the engine's reduced mode issues both groups as one request: same contention
    assert net.collective_time_s(req("all_reduce", [[0, 2], [1, 3]], size)) >= 1.9 * alone
    top = net.link_report(top=2)
    assert top[0]["kind"] in ("leaf->spine", "spine->leaf") and top[0]["utilization"] == pytest.approx(1.0, rel=0.02)


def test_full_bisection_all_reduces_do_not_slow_each_other():
    size = 1 << 28
    a, b = req("all_reduce", [0, 2], size), req("all_reduce", [1, 3], size)
    for fast in (True, False):
        net = _two_leaf_net(1.0, fast_path=fast)
        alone = net.collective_time_s(a)
        ends = run_together(net, [a, b])
        assert max(ends) <= 1.01 * alone


def test_late_arrival_shares_then_speeds_up_and_fast_path_agrees():
    size = 1 << 28
    a, b = req("all_reduce", [0, 2], size), req("all_reduce", [1, 3], size)
    results = []
    for fast in (True, False):
        net = _two_leaf_net(2.0, fast_path=fast)
        T = net.collective_time_s(a)
        ends = run_together(net, [a, b], starts=[0.0, T / 2])
        results.append(ends)
        # a: T/2 alone, then its other half at half rate; b: half rate, then alone
        assert ends[0] == pytest.approx(1.5 * T, rel=1e-3)
        assert ends[1] == pytest.approx(2.0 * T, rel=1e-3)
    assert results[0] == pytest.approx(results[1], rel=1e-9)
    assert net.stats.solves > 0


def _equal_injection_pair():
    # torus 4x4x4, 6 links x 10 GB/s per chip; fat-tree: one 60 GB/s NIC per GPU, full bisection
    torus = FlowNetwork(build_graph(spec({"kind": "torus", "dims": [4, 4, 4], "link_GBps": 10, "hop_latency_us": 0.0},
                                         gpus_per_node=4, nvlink_latency_us=0.0), 64))
    tree = FlowNetwork(build_graph(spec({"kind": "fat-tree", "radix": 16}, gpus_per_node=1, nic_gbps=480,
                                        nic_latency_us=0.0, nvlink_latency_us=0.0), 64))
    return torus, tree


def test_torus_all_to_all_is_slower_but_rings_are_not():
    torus, tree = _equal_injection_pair()
    g = np.arange(64)
    size = 1 << 26
    t_a2a = torus.collective_time_s(req("all_to_all", g, size))
    f_a2a = tree.collective_time_s(req("all_to_all", g, size))
    assert t_a2a >= 1.3 * f_a2a
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        t_ring = torus.collective_time_s(req(op, g, size))
        f_ring = tree.collective_time_s(req(op, g, size))
        assert t_ring <= 1.02 * f_ring, op
    assert torus.algorithm(req("all_reduce", g, size)) == "torus"
    # a ring of nearest neighbours along x (one torus line) runs at link speed, no slower
    line = np.arange(4)
    assert torus.collective_time_s(req("all_gather", line, size)) == pytest.approx(3 / 4 * size / 20e9, rel=0.01)


# --- calibrated nodes -------------------------------------------------------------------------


def test_dgx_h100_8gpu_all_reduce_busbw_is_the_intra_node_value():
    prof = load_profile("h100-sxm-80gb")
    net = FlowNetwork.from_profile("dgx-h100-fattree", 8, prof)
    t = net.collective_time_s(req("all_reduce", np.arange(8), GiB))
    busbw = GiB / t / 1e9 * bus_factor("all_reduce", 8)
    intra = load_topology("dgx-h100-fattree").node.nvlink_GBps * prof.comm.nvlink_efficiency
    assert busbw == pytest.approx(intra, rel=0.10)


def test_two_node_all_reduce_is_bounded_by_the_nics():
    topo = load_topology("dgx-h100-fattree")
    node_nic_GBps = topo.node.nics_per_node * topo.node.nic_gbps / 8  # 400 GB/s
    r = req("all_reduce", np.arange(16), GiB)
    auto = FlowNetwork.from_topology(topo, 16)
    # every byte of a node's half must leave it once and come back once: >= S per node
    assert auto.collective_time_s(r) >= GiB / (node_nic_GBps * 1e9)
    # NCCL's ring: each node sends 2(n-1)/n x S through its NICs, so busbw = the node's NIC
    # bandwidth (400 GB/s), below the 450 GB/s of NVLink
    ring = FlowNetwork.from_topology(topo, 16, algorithms={"all_reduce": "ring"})
    busbw = GiB / ring.collective_time_s(r) / 1e9 * bus_factor("all_reduce", 16)
    assert busbw == pytest.approx(node_nic_GBps, rel=0.01)
    # with 800 Gb/s NICs the same ring is NVLink-bound instead (the GPU that sends over a NIC
    # reads its memory over PCIe, so each GPU's NVLink carries 7/8 of the ring's traffic)
    fast = topo.model_copy(update={"node": topo.node.model_copy(update={"nic_gbps": 800})})
    ring2 = FlowNetwork.from_topology(fast, 16, algorithms={"all_reduce": "ring"})
    busbw2 = GiB / ring2.collective_time_s(r) / 1e9 * bus_factor("all_reduce", 16)
    assert busbw2 == pytest.approx(topo.node.nvlink_GBps * 8 / 7, rel=0.01)


def test_p4de_algorithms_and_nic_bound():
    r = req("all_reduce", np.arange(16), GiB)
    eff = 0.9
    for algo in ("ring", "tree", "hierarchical"):
        net = FlowNetwork.from_topology("p4de-efa", 16, nic_efficiency=eff, algorithms={"all_reduce": algo})
        assert net.algorithm(r) == algo
        algbw = GiB / net.collective_time_s(r) / 1e9
        # 4 x 100 Gb/s per node: the tree sends S per node, the ring 2(n-1)/n x S; the
        # hierarchical one adds its unpipelined intra-node reduce-scatter and all-gather
        nic = 50 * eff
        expected = {"ring": nic / (2 * 15 / 16), "tree": nic, "hierarchical": 1 / (1 / nic + 2 * 7 / 8 / 300)}[algo]
        assert algbw == pytest.approx(expected, rel=0.02), algo
    auto = FlowNetwork.from_topology("p4de-efa", 16)
    assert auto.algorithm(r) == "tree"  # NCCL's choice at 2 nodes, large sizes


def test_pipeline_send_recv_and_broadcast():
    net = FlowNetwork.from_topology("dgx-h100-fattree", 16)
    t = net.collective_time_s(req("send_recv", [[0, 8]], GiB))
    assert GiB / t / 1e9 == pytest.approx(50, rel=0.01)  # one NIC
    t = net.collective_time_s(req("broadcast", np.arange(8), GiB))
    assert GiB / t / 1e9 == pytest.approx(450, rel=0.01)
    assert net.collective_time_s(req("all_reduce", [[3]], GiB)) == 0.0


# --- scale ------------------------------------------------------------------------------------


def test_tens_of_thousands_of_flows():
    graph = build_graph(load_topology("dgx-h100-fattree"), 4096)
    rng = np.random.default_rng(0)
    pairs = rng.integers(0, 4096, size=(30000, 2))
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    routes = graph.route(pairs[:, 0], pairs[:, 1])
    inc = routes.incidence(graph.n_links)
    t0 = time.perf_counter()
    rate = maxmin_rates(inc, graph.link_capacity_GBps)
    assert time.perf_counter() - t0 < 5.0
    assert (rate > 0).all()
    load = inc @ rate
    assert (load <= graph.link_capacity_GBps * (1 + 1e-6)).all()
    # max-min: every flow crosses a saturated link on which it has the largest rate
    sat = load >= graph.link_capacity_GBps * (1 - 1e-6)
    A = inc.tocsr()
    ok = np.zeros(rate.size, bool)
    for l in np.nonzero(sat)[0]:
        flows = A.indices[A.indptr[l]:A.indptr[l + 1]]
        ok[flows[rate[flows] >= rate[flows].max() * (1 - 1e-6)]] = True
    assert ok.all()


def test_many_concurrent_collectives_in_simpy():
    net = FlowNetwork.from_topology("dgx-h100-fattree", 256)
    groups = np.arange(256).reshape(32, 8).T  # 8 DP groups of 32 ranks, one GPU per node
    reqs = [req("all_reduce", groups[i], 1 << 26) for i in range(8)]
    reqs += [req("all_reduce", np.arange(256).reshape(32, 8)[i], 1 << 26) for i in range(32)]  # TP, NVLink only
    alone = [net.collective_time_s(r) for r in reqs]
    ends = run_together(net, reqs)
    assert ends[8:] == pytest.approx(alone[8:])  # TP groups took the fast path, untouched
    assert max(ends[:8]) == pytest.approx(max(alone[:8]), rel=0.02)  # rails do not collide
    assert net.stats.fast_path >= 32
    assert net.link_report(top=1)[0]["utilization"] <= 1.0 + 1e-9


def test_heap_tail_equals_vectorised_rounds(monkeypatch):
    import simulator.network.maxmin as mm

    graph = build_graph(load_topology("dgx-h100-fattree"), 512)
    rng = np.random.default_rng(1)
    pairs = rng.integers(0, 512, size=(3000, 2))
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    inc = graph.route(pairs[:, 0], pairs[:, 1]).incidence(graph.n_links)
    act = rng.random(pairs.shape[0]) < 0.8
    monkeypatch.setattr(mm, "_VECTOR_ROUNDS", 10**9)
    vec = mm.maxmin_rates(inc, graph.link_capacity_GBps, act)
    monkeypatch.setattr(mm, "_VECTOR_ROUNDS", 0)
    heap = mm.maxmin_rates(inc, graph.link_capacity_GBps, act)
    assert heap == pytest.approx(vec, rel=1e-9)
    assert (heap[~act] == 0).all()


# --- coflow model against per-flow max-min ------------------------------------------------------


def _both(make_net, reqs, starts=None):
    """End times and link bytes with the coflow model and with per-flow max-min."""
    out = []
    for coflow in (True, False):
        net = make_net(coflow)
        out.append((np.array(run_together(net, reqs, starts)), net.link_bytes.copy()))
    return out


def test_coflow_agrees_with_per_flow_on_the_contention_cases():
    size = 1 << 28
    a, b = req("all_reduce", [0, 2], size), req("all_reduce", [1, 3], size)
    for over in (1.0, 2.0):
        for fast in (True, False):
            for starts in (None, [0.0, 0.5e-3], [0.0, 3e-3]):
                (tc, bc), (tf, bf) = _both(
                    lambda co: FlowNetwork(_two_leaf_net(over).graph, fast_path=fast, coflow=co), [a, b], starts)
                assert tc == pytest.approx(tf, rel=0.01), (over, fast, starts)
                assert bc == pytest.approx(bf, rel=1e-9)
    graph = build_graph(load_topology("dgx-h100-fattree"), 256)
    groups = np.arange(256).reshape(32, 8)
    reqs = [req("all_reduce", groups.T[i], 1 << 26) for i in range(8)]
    reqs += [req("all_reduce", groups[i], 1 << 26) for i in range(32)]
    # test_many_concurrent_collectives_in_simpy, with every collective run as flows
    (tc, bc), (tf, bf) = _both(lambda co: FlowNetwork(graph, fast_path=False, coflow=co), reqs)
    assert tc == pytest.approx(tf, rel=0.01)
    assert bc == pytest.approx(bf, rel=1e-9)
    # staggered, with an all-to-all and a multi-node all-gather crossing the DP rings: these
    # rings then lose different shares per flow and per coflow (seen: 1.5%)
    reqs += [req("all_to_all", groups.T[:2].ravel(), 1 << 26), req("all_gather", groups[:4].ravel(), 1 << 26)]
    (tc, bc), (tf, bf) = _both(lambda co: FlowNetwork(graph, coflow=co), reqs, starts=np.linspace(0, 1e-3, len(reqs)))
    assert tc == pytest.approx(tf, rel=0.03)
    assert bc == pytest.approx(bf, rel=1e-9)


def _random_case(seed: int):
    """Six random collectives on random GPU sets of a 16-GPU, 2:1 oversubscribed fat-tree."""
    rng = np.random.default_rng(seed)
    s = spec({"kind": "fat-tree", "radix": 4, "leaf_oversubscription": 2.0}, gpus_per_node=2, nic_latency_us=1.0)
    graph = build_graph(s, 16)
    reqs, starts = [], []
    for _ in range(6):
        op = str(rng.choice(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]))
        k = 2 if op == "send_recv" else int(rng.integers(2, 9))
        reqs.append(req(op, rng.choice(16, size=k, replace=False), float(rng.integers(1, 64)) * (1 << 20)))
        starts.append(float(rng.uniform(0, 2e-3)))
    return graph, reqs, np.array(starts)


def test_coflow_against_per_flow_on_random_irregular_collectives():
    """Random groups make irregular phases whose flows are bottlenecked on different links.

    Per flow, a collective's flows on uncontended paths run ahead while the contended ones
    lag; as coflows (flows grouped by when they end alone) they advance together, so the
    bandwidth they leave to others differs. Stated tolerance (seen on these 30 seeds): every
    link carries the same bytes; 90% of the 180 collectives end within 1% of the per-flow
    time, the mean difference is under 2% (0.9%), a case's makespan within 10% (6%), and one
    collective may differ by up to 60% (41%: a two-GPU collective beside an irregular ring;
    over 200 seeds the worst is 2x, the mean 1.5%, the worst makespan 19%).
    """
    errs, spans = [], []
    for seed in range(30):
        graph, reqs, starts = _random_case(seed)
        (tc, bc), (tf, bf) = _both(lambda co: FlowNetwork(graph, coflow=co), reqs, starts)
        assert bc == pytest.approx(bf, rel=1e-9, abs=1.0)
        dc, df = tc - starts, tf - starts
        errs.append(np.abs(dc / df - 1))
        spans.append(abs(tc.max() / tf.max() - 1))
    errs = np.concatenate(errs)
    assert np.mean(errs < 0.01) >= 0.85
    assert errs.mean() < 0.02
    assert max(spans) < 0.10
    assert errs.max() < 0.6
