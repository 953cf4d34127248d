"""NCCL's default LL128 enablement (tuning.cc ncclTopoTuneModel, NCCL-MODEL.md §3.6): LL128 only
with NVLink inside the node (intra path <= NVB) and a GPU-NIC path <= PXB (<= PXN on Hopper+)
across nodes; a single-node graph's typeInter is PIX, so one node keeps LL128 whatever the NICs."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from simulator.calibrate.nccl_fit import errors, fit_system, read_log
from simulator.network.nccl import NcclModel, NcclSystem, NcclTuning, ll128_enabled, tune
from simulator.topology.spec import load_topology

DATA = Path(__file__).parent / "data" / "reference" / "nccl-tests"
AMPERE, HOPPER, VOLTA = 1, 2, 0


@pytest.mark.parametrize("gen, intra, inter, on", [
    (AMPERE, "NVL", "PIX", True),
    (AMPERE, "NVL", "PXB", True),   # DGX A100 / p4de / NDv4: NIC and GPU under PCIe switches
    (AMPERE, "NVL", "PXN", False),  # PXN counts for Hopper+ only
    (AMPERE, "NVL", "PHB", False),  # NIC reached through the CPU: LL128 off across nodes
    (AMPERE, "NVL", "SYS", False),
    (HOPPER, "NVL", "PXN", True),   # NCCL_LL128_C2C=1 (default) on sm90+
    (HOPPER, "NVL", "PHB", False),
    (VOLTA, "NVB", "PXB", True),    # NVLink through one GPU (DGX-1) is still <= NVB
    (AMPERE, "PXB", "PIX", False),  # no NVLink inside: PCIe intra path > NVB
])
def test_ll128_rule_on_path_types(gen, intra, inter, on):
    assert ll128_enabled(gen, intra, inter) is on


def _azure(path: str) -> NcclSystem:
    spec = load_topology("azure-ndv4")
    return NcclSystem.from_specs(spec.node.model_copy(update={"gpu_nic_path": path}), "A100-SXM4-40GB")


def test_a100_nic_through_cpu_loses_ll128_across_nodes_only():
    """An A100 node whose NICs hang off the CPU (PHB): no LL128 pair in NCCL's table at 2 or 4
    nodes, LL128 still there on one node; under PCIe switches (PXB) LL128 is in every table."""
    phb, pxb = _azure("PHB"), _azure("PXB")
    assert phb.nic_path == "PHB" and pxb.nic_path == "PXB"
    for n_nodes in (2, 4):
        n = 8 * n_nodes
        assert not [k for k in tune(phb, "all_reduce", n, n_nodes, 8, NcclTuning()) if k[1] == "LL128"]
        assert {("ring", "LL128"), ("tree", "LL128")} <= set(tune(pxb, "all_reduce", n, n_nodes, 8, NcclTuning()))
    assert ("ring", "LL128") in tune(phb, "all_reduce", 8, 1, 8, NcclTuning())
    # What NCCL runs: 16 ranks on 2 nodes at 1 MiB is Tree/LL128 with NCCL's own constants
    # (NCCL-MODEL.md §6.5, 8 x 200 Gb/s A100), and something else once LL128 is off.
    assert NcclModel(pxb).choose("all_reduce", 1 << 20, 16, 2).protocol == "LL128"
    picks = {NcclModel(phb).choose("all_reduce", float(1 << k), 16, 2).protocol for k in range(10, 31)}
    assert "LL128" not in picks and picks == {"LL", "Simple"}


def test_topology_default_and_bad_path():
    """Shipped topologies keep LL128 across nodes (default PXB); a path type NCCL does not have is
    refused when the topology is read."""
    for name, device in (("azure-ndv4", "A100-SXM4-40GB"), ("p4de-efa", "A100-SXM4-80GB"), ("p5-efa", "H100")):
        s = NcclSystem.from_specs(load_topology(name).node, device)
        assert s.ll128_on(1) and s.ll128_on(4), name
    with pytest.raises(ValidationError):
        load_topology("azure-ndv4").node.model_validate({**load_topology("azure-ndv4").node.model_dump(), "gpu_nic_path": "PCI"})


def test_azure_multinode_logs_show_ll128_in_use():
    """The Azure 16- and 32-GPU logs (2 and 4 nodes) fitted with LL128 on across nodes (NDv4:
    GPU and NIC under PCIe switches) against the same fit with it off (a NIC through the CPU):
    the logs' mid sizes need LL128, so the rule must not turn it off on this system."""
    logs = [read_log(DATA / f"azure-ndv4-a100-40gb-{g}gpu_all_reduce_perf.txt", 8) for g in (16, 32)]
    worst = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in ("PXB", "SYS"):
            s = _azure(path)
            cal = fit_system(s, logs, 1555.0, "azure-ndv4", n_random_starts=0)
            m = NcclModel(s, NcclTuning.from_comm(NS(nccl=cal)))
            worst[path] = max(float(np.max(np.abs(errors(m, l)))) for l in logs)
    # measured on this data: PXB 13 %, SYS 24 %
    assert worst["PXB"] < 0.16
    assert worst["SYS"] > 1.3 * worst["PXB"]


def test_explain_says_why_ll128_is_off(tmp_path):
    from simulator.cli import app

    text = (Path(__file__).parents[1] / "simulator" / "data" / "topologies" / "azure-ndv4.yaml").read_text()
    topo = tmp_path / "ndv4-phb.yaml"
    topo.write_text(text.replace("name: azure-ndv4", "name: ndv4-phb").replace("  cpu_vendor: amd", "  gpu_nic_path: PHB\n  cpu_vendor: amd"))
    r = CliRunner().invoke(app, ["collective", "all_reduce", "-g", "16", "--topology", str(topo), "--gpu", "a100-sxm-40gb",
                                 "-b", "64K", "-e", "64M", "-f", "4", "--explain"])
    assert r.exit_code == 0, r.output
    assert "protocols LL, Simple (LL128 off: GPU-NIC path PHB > PXB" in r.output
    rows = [l.split() for l in r.output.splitlines() if l.strip() and l.strip()[0].isdigit()]
    assert len(rows) == 6 and all(row[2] in ("LL", "Simple") for row in rows)
    r1 = CliRunner().invoke(app, ["collective", "all_reduce", "-g", "8", "--topology", str(topo), "--gpu", "a100-sxm-40gb",
                                  "-b", "1M", "-e", "1M", "--explain"])
    assert r1.exit_code == 0 and "LL128 on: intra NVL <= NVB, one node" in r1.output
