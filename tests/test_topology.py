"""Topology specs, graphs and placement."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.errors import UserError
from simulator.topology import load_topology
from simulator.topology.graph import build_graph, torus_dims_for
from simulator.topology.placement import Mesh, Placement
from simulator.topology.spec import TopologySpec, available_topologies

PRESETS = ["dgx-a100-fattree", "dgx-h100-fattree", "dgx-h100-rail", "llama3-24k", "torus-3d", "p4de-efa", "cpu-loopback"]


def test_presets_load_and_keep_node_fields():
    assert set(PRESETS) <= set(available_topologies())
    for name in PRESETS:
        t = load_topology(name)
        assert t.node.gpus_per_node >= 1 and t.node.nic_GBps_per_gpu > 0
    h = load_topology("dgx-h100-fattree")
    assert h.node.nvlink_GBps == 450 and h.node.nic_GBps_per_gpu == 50
    p4 = load_topology("p4de-efa")
    assert p4.node.nics_per_node == 4 and p4.node.nic_gbps == 100


def test_spec_without_fabric_defaults_to_fat_tree():
    t = TopologySpec(name="x", node=load_topology("dgx-h100-fattree").node)
    assert t.fabric.kind == "fat-tree"


def _write(tmp_path, text):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    return p


NODE = """
node: {kind: n, gpus_per_node: 8, nvlink_GBps: 300, nvlink_latency_us: 1, nics_per_node: 8, nic_gbps: 200, nic_latency_us: 2}
"""


def test_unknown_key_is_one_line_user_error(tmp_path):
    p = _write(tmp_path, "name: x\n" + NODE + "fabric: {kind: fat-tree, radixx: 64}\n")
    with pytest.raises(UserError, match=r"unknown key 'fabric\.radixx' \(did you mean 'radix'\?\): remove it or check its spelling"):
        load_topology(p)


def test_unknown_kind_is_one_line_user_error(tmp_path):
    p = _write(tmp_path, "name: x\n" + NODE + "fabric: {kind: dragonfly}\n")
    with pytest.raises(UserError, match=r"unknown fabric\.kind 'dragonfly': use one of single-node, fat-tree"):
        load_topology(p)
    p = _write(tmp_path, "name: x\n" + NODE + "fabric: {radix: 4}\n")
    with pytest.raises(UserError, match=r"missing key 'fabric\.kind'"):
        load_topology(p)


def test_unknown_node_key_and_bad_value(tmp_path):
    p = _write(tmp_path, "name: x\n" + NODE.replace("nic_latency_us: 2", "nic_latency_us: 2, nic_gbs: 1") + "fabric: {kind: fat-tree}\n")
    with pytest.raises(UserError, match=r"unknown key 'node\.nic_gbs'"):
        load_topology(p)
    p = _write(tmp_path, "name: x\n" + NODE + "fabric: {kind: torus, link_GBps: [1, 2]}\n")
    with pytest.raises(UserError, match=r"link_GBps has 2 values for 3 dimensions"):
        load_topology(p)


def test_graph_is_parametric_in_gpu_count():
    spec = load_topology("dgx-h100-fattree")
    for n in (8, 64, 1024, 4096):
        g = build_graph(spec, n)
        assert g.n_gpus == n and g.n_nodes == n // 8
        assert (g.link_capacity_GBps > 0).all()
    big = build_graph(load_topology("llama3-24k"), 24576)
    assert int(big.leaf_pod.max()) + 1 == 8  # 3,072-GPU pods
    pod_up = big.link_capacity_GBps[big._ids["pod_up"]]
    assert pod_up == pytest.approx(3072 * 50 / 7)


def test_rail_optimized_same_rail_is_one_switch_hop():
    g = build_graph(load_topology("dgx-h100-rail"), 256)
    r = g.route(np.array([3, 3]), np.array([8 * 5 + 3, 8 * 5 + 4]))  # same rail, other rail
    kinds = [[g.link_kind[l] for l in r.link[r.flow == f]] for f in range(2)]
    assert len(kinds[0]) == 2 and len(kinds[1]) == 4  # nic->leaf->nic vs up to the spine


def test_single_node_and_torus_errors():
    with pytest.raises(UserError, match=r"65 GPUs do not fit topology 'cpu-loopback' \(single-node, 64 per node\)"):
        build_graph(load_topology("cpu-loopback"), 65)
    spec = TopologySpec.model_validate({"name": "t", "node": load_topology("torus-3d").node.model_dump(),
                                        "fabric": {"kind": "torus", "dims": [4, 4, 4], "link_GBps": 10}})
    with pytest.raises(UserError, match=r"torus dims \[4, 4, 4\] hold 64 GPUs, not 32"):
        build_graph(spec, 32)
    assert torus_dims_for(64, 3) == (4, 4, 4) and torus_dims_for(32, 3) == (4, 4, 2) and torus_dims_for(64, 2) == (8, 8)


def test_torus_routing_is_dimension_ordered_and_wraps():
    g = build_graph(load_topology("torus-3d"), 64)
    r = g.route(np.array([0]), np.array([3 + 4 * 2]))  # x: 0->3 wraps (1 hop), y: 0->2 (2 hops)
    assert r.link.size == 3


def test_placement_keeps_tp_in_a_node():
    mesh = Mesh(tp=8, cp=2, ep=2, dp=8, pp=4)
    pl = Placement(mesh)
    tp = pl.groups("tp")
    assert (tp // 8 == tp[:, :1] // 8).all()
    pl.check_fits(mesh.world_size, 8, ("tp",))
    # another order moves TP out of the node, and the check says so
    bad = Placement(mesh, order="dp-tp-cp-ep-pp")
    assert sorted(bad.gpu_of_rank.tolist()) == list(range(mesh.world_size))
    with pytest.raises(UserError, match=r"tp groups of size 8 leave the 8-GPU node"):
        bad.check_fits(mesh.world_size, 8, ("tp",))
    with pytest.raises(UserError, match=r"the mesh needs 512 GPUs"):
        pl.check_fits(256)


def test_placed_network_maps_a_request_to_the_same_object():
    # The fabric caches its plan per request object; a placed network must hand it the same
    # mapped request each time the engine issues the same request, and map the ranks right.
    from simulator.network.base import CollectiveRequest
    from simulator.topology.placement import PlacedNetwork

    mesh = Mesh(tp=2, cp=1, ep=1, dp=2, pp=2)
    pl = Placement(mesh, order="dp-tp-cp-ep-pp")
    assert not pl.is_identity
    net = PlacedNetwork(object(), pl)
    req = CollectiveRequest("all_reduce", "tp", np.array([[0, 1]]), 1024.0)
    a, b = net._map(req), net._map(req)
    assert a is b
    assert a.groups.tolist() == [[int(pl.gpu_of_rank[0]), int(pl.gpu_of_rank[1])]]
    other = CollectiveRequest("all_reduce", "tp", np.array([[0, 1]]), 2048.0)
    assert net._map(other) is not a and net._map(other).size_bytes == 2048.0


def test_alpha_beta_on_a_torus_prices_the_torus_links_not_the_host_nic():
    """torus-3d's host NIC (200 Gb/s for 4 chips) is not part of the torus graph; the alpha-beta
    tier model had priced every cross-node collective on it (6.25 GB/s a GPU) while the flow
    fabric used the 45 GB/s torus links, 5x apart on a ZeRO-3 step. A cross-node all-gather on the
    tier model now moves at the torus link's rate, within the flow fabric's time on the graph."""
    from simulator.network.alpha_beta import TierNetwork
    from simulator.network.base import CollectiveRequest
    from simulator.network.fabric import FlowNetwork
    from simulator.vocabulary import CollectiveOp, Dim
    from simulator.profile import load_profile

    topo, prof = load_topology("torus-3d"), load_profile("a100-pcie-40gb")
    tier = TierNetwork.for_topology(topo, prof)
    assert tier.nccl is None
    assert tier.inter_GBps == pytest.approx(45.0 * prof.comm.nic_efficiency)
    groups = np.array([[0, 4]])  # two chips on two hosts, torus neighbours
    size = 256 * 2**20
    req = CollectiveRequest(CollectiveOp.ALL_GATHER, Dim.DP, groups, size)
    t_tier = tier.collective_time_s(req)
    t_flow = FlowNetwork.from_profile(topo, 64, prof).collective_time_s(req)
    assert t_tier == pytest.approx(t_flow, rel=0.25)
    # The NIC's rate (the old pricing) is 7x slower.
    nic = TierNetwork(topo.node, prof.comm, None).collective_time_s(req)
    assert nic > 5 * t_tier
