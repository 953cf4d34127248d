"""A node whose GPUs talk over PCIe (NeuSight's 4 x A100 80GB PCIe box, tests/data/topologies/
pcie-a100x4.yaml): NCCL's model must see PCI paths there, not NVLink."""

from __future__ import annotations

from pathlib import Path

from simulator.network.nccl import NcclModel, graphs
from simulator.profile import load_profile
from simulator.topology.spec import load_topology

ROOT = Path(__file__).resolve().parent.parent
PCIE = ROOT / "tests" / "data" / "topologies" / "pcie-a100x4.yaml"
TP_ALLREDUCE_BYTES = 4 * 1024 * 1280 * 4  # GPT-2 Large b4 s1024 fp32 activations: one Megatron TP all-reduce
PCIE_GEN4_X16_GBPS = 31.5  # PCI-SIG: 16 GT/s x 16 lanes x 128/130 / 8, one direction


def test_pcie_node_is_a_pci_path_for_nccl():
    node = load_topology(str(PCIE)).node
    assert node.nvlink is False
    model = NcclModel.from_specs(node, load_profile("a100-pcie-80gb"))
    s = model.system
    # NCCL's PCIe gen4 x16 figure (topo.cc width x rate / 80 = 24 GB/s), not one NVLink link's 20.
    assert not s.nvlink and s.nvl_GBps == 24.0
    assert not s.ll128_on(1) and not s.ll128_on(2)  # LL128 stays off on any intra path worse than NVB (tuning.cc)
    g = graphs(s, 1, 4)["ring"]
    assert g.n_ch * g.bw_intra <= 24.0 + 1e-9
    c = model.choose("all_reduce", TP_ALLREDUCE_BYTES, 4, 1)
    assert c.protocol != "LL128" and "LL128" not in {p for _, p in c.table}
    # Bus bandwidth below the link's spec rate: each rank sends 2(n-1)/n of the buffer out of its link.
    busbw = 2 * 3 / 4 * TP_ALLREDUCE_BYTES / (c.time_us * 1e-6) / 1e9
    assert 15.0 < busbw <= PCIE_GEN4_X16_GBPS, busbw


def test_nvlink_is_still_the_default():
    node = load_topology("dgx-a100-fattree").node
    assert node.nvlink is True
    model = NcclModel.from_specs(node, load_profile("a100-sxm-80gb"))
    assert model.system.nvlink and model.system.ll128_on(1)
    c = model.choose("all_reduce", TP_ALLREDUCE_BYTES, 4, 1)
    pcie = NcclModel.from_specs(load_topology(str(PCIE)).node, load_profile("a100-pcie-80gb"))
    assert c.time_us * 4 < pcie.choose("all_reduce", TP_ALLREDUCE_BYTES, 4, 1).time_us
