"""NVLink domains larger than a DGX: a GB200 NVL72 rack is one 72-GPU NVLink domain, and the
placement packs TP groups whole into it."""

import numpy as np
import pytest

from simulator.profile import load_profile
from simulator.network.base import CollectiveRequest
from simulator.scenario import build_scenario
from simulator.simulate import make_network
from simulator.topology import build_graph, load_topology
from simulator.topology.graph import LINK_INTRA
from simulator.topology.placement import Mesh, Placement


def test_new_topologies_load_with_their_nvlink_domains():
    assert load_topology("gb200-nvl72").node.nvlink_domain_gpus == 72
    assert load_topology("gb200-nvl72-800g").node.nic_GBps_per_gpu == pytest.approx(100.0)
    for name in ("dgx-h200", "dgx-b200", "dgx-h100-nvls"):
        t = load_topology(name)
        assert t.node.nvlink_domain_gpus == 8 and t.node.nvls
    assert load_topology("dgx-b200").node.nvlink_GBps == 2 * load_topology("dgx-h200").node.nvlink_GBps
    assert not load_topology("dgx-h100-fattree").node.nvls


def test_tp16_group_inside_nvl72_is_nvlink_only():
    topo = load_topology("gb200-nvl72")
    # 64 GPUs (4 TP16 groups) of one rack: every TP flow stays on NVLink.
    mesh = Mesh(tp=16, cp=1, ep=1, dp=4, pp=1)
    pl = Placement(mesh, domain_gpus=72)
    assert pl.is_identity
    g = build_graph(topo, 64)
    groups = pl.groups("tp")
    src = groups.ravel()
    dst = np.roll(groups, -1, axis=1).ravel()
    routes = g.route(src, dst)
    assert (g.link_class[routes.link] == LINK_INTRA).all()
    # On a DGX (8-GPU domains) the same TP16 group crosses the network.
    g8 = build_graph(load_topology("dgx-h100-fattree"), 64)
    assert g8.crosses_network(g8.route(src, dst)).any()


def test_tp16_on_two_racks_packs_whole_groups_per_rack():
    mesh = Mesh(tp=16, cp=1, ep=1, dp=8, pp=1)
    pl = Placement(mesh, domain_gpus=72)
    assert pl.ranks_per_domain == 64
    assert not pl.is_identity and pl.gpus_spanned == 72 + 64
    tp = pl.groups("tp")
    # No TP group straddles two racks (without packing, ranks 64..79 would).
    assert (tp // 72 == tp[:, :1] // 72).all()
    assert not (np.arange(128).reshape(-1, 16) // 72 == (np.arange(128).reshape(-1, 16)[:, :1] // 72)).all()
    # DGX-sized groups that divide the domain keep the identity placement.
    assert Placement(Mesh(tp=8, cp=1, ep=1, dp=18, pp=1), domain_gpus=72).is_identity


def test_an_nvl72_rack_holds_whole_ep_groups():
    # ep 8 folded over TP8 groups under sequence parallelism: an EP group is one TP group's 8
    # ranks, so 9 of them fill the rack. Where tp ranks route the same tokens an EP group takes
    # one rank of 8 TP groups: 64 ranks a rack, whole groups, 8 GPUs idle.
    assert Placement(Mesh(tp=8, cp=1, ep=8, dp=18, pp=1, edp_tp=8), domain_gpus=72).ranks_per_domain == 72
    pl = Placement(Mesh(tp=8, cp=1, ep=8, dp=16, pp=1), domain_gpus=72)
    assert pl.ranks_per_domain == 64
    ep = pl.groups("ep")
    assert (ep // 72 == ep[:, :1] // 72).all()
    # ep 64 over tp 2: 64 consecutive ranks a group, one a rack.
    wide = Placement(Mesh(tp=2, cp=1, ep=64, dp=64, pp=1, edp_tp=2), domain_gpus=72)
    assert wide.ranks_per_domain == 64
    g = wide.groups("ep")
    assert (g // 72 == g[:, :1] // 72).all()


def test_simulated_tp16_on_nvl72_uses_nvlink_speed():
    sc = build_scenario({
        "model": "llama3-70b", "parallelism": {"tp": 16, "pp": 1, "zero": 1},
        "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
        "cluster": {"gpus": 128, "gpu": "gb200", "topology": "gb200-nvl72"},
    })
    net = make_network(sc, load_topology("gb200-nvl72"), load_profile("gb200"))
    req = CollectiveRequest("all_gather", "tp", np.arange(64, 80)[None, :], 64e6)
    t_nvl72 = net.collective_time_s(req)
    # The same ranks without packing straddle racks 0 and 1 and go through 400 Gb/s NICs.
    sc_alpha = sc.model_copy(update={"network": "alpha-beta"})
    t_alpha = make_network(sc_alpha, load_topology("gb200-nvl72"), load_profile("gb200")).collective_time_s(req)
    busbw_GBps = 64e6 * 15 / 16 / t_nvl72 / 1e9
    assert busbw_GBps > 400  # NVLink 5 (900 GB/s x 0.82), far above a 50 GB/s NIC
    assert t_alpha == pytest.approx(t_nvl72, rel=0.5)
