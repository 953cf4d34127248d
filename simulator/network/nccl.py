"""NCCL's own cost model for collectives (its tuner), re-implemented.

Every constant below is read from NCCL's sources as summarised, with citations, in
``reference/NCCL-MODEL.md`` (the section is given next to each table; "tuning.cc" etc. name the
NCCL source file). The model follows the NCCL 2.28.3 tuner: the 2.23-2.30 latency tables, the
2.27 bandwidth caps, and the 2.28 NVLS bandwidth rewrite (nvlsEfficiency, perChMaxNVLSTreeBws).

What it does, per collective (op, size, group):
1. graphs (§4, §6): from the node facts (GPUs per node, NVLink links, NICs and their speed,
   PCIe) a simplified NCCL graph search gives, per algorithm, the search channels and the
   per-channel bandwidths bwIntra / bwInter (speed ladders §1.8, channel duplication §4.1);
2. tuning (§3.2, §3.3): per enabled algorithm x protocol a bus bandwidth (protocol factors, caps)
   turned into an algorithm bandwidth, and a latency (base + per-hop x hops); LL128 is enabled
   by NCCL's own rule (§3.6, ``ll128_enabled``: NVLink inside the node and, across nodes, a
   GPU-NIC path <= PXB, <= PXN on Hopper+);
3. time (§3.4): time_us = latency + nBytes / (1000 x bw), with the Tree size correction and the
   Ring/Simple plateau factor; NCCL picks the minimum over enabled pairs in its scan order
   (§3.5), and so does ``NcclModel.choose``;
4. channels and threads for the launch (§3.7);
5. the pipeline fill NCCL's tuner leaves out (§4.4, §4.5; ``pipeline_fill_us``): Simple moves
   slices store-and-forward through an 8-slot FIFO, so each stage a slice crosses outside the
   lockstep ring (the hops of a tree or a broadcast chain, NVLS's
   switch) adds one slice time, with NCCL's own chunk and slice sizes per channel launched;
6. the runtime's chunking (§4.4; ``chunking``): calcCollChunking's chunk per channel and the
   proxy's network steps; across nodes every step beyond a channel's first loop (which NCCL's
   latency covers) costs a calibrated net_step_us, and with runtime_chunking Tree/LL128 across
   nodes takes its size dependence from that chunk count, not the tuner's treeCorrectionFactor.

NCCL's absolute times are optimistic (its tuner only ranks choices, §8.4). A per-system
calibration (``simulator.calibrate.nccl_fit``, stored in ``Profile.comm.nccl``) scales a few
things and nothing else: the latency tables (latency_scale across nodes, intra_latency_scale
inside one, per protocol LL128 / Simple relative to LL, and Ring/Simple across nodes apart
from inside one), a network latency per network hop
that NCCL itself takes from the net plugin (``latencyInter``, 0 for InfiniBand, large for EFA),
the graph bandwidths inside and across nodes (intra/inter_bw_scale), the LL and LL128 bandwidth
factors, and a host launch cost per GPU driven by one thread (launch_us); and it adds four
measured terms NCCL's tuner does not have: a cost per channel launched (channel_us), an exposed
memory pass per byte (mem_GBps), a 1-rank copy's start-up (copy_latency_us) and a cost per
network step beyond a channel's first loop (net_step_us, item 6), each with its
evidence in NcclTuning and docs/design-notes.md. The choice of algorithm and protocol is the
fastest on the calibrated time, with NCCL's scan order for ties (NcclTuning.rank_on_tuner_time
and pick_on_own_table give NCCL's own ranking rules instead).

Point-to-point (send/recv, all-to-all) has no NCCL cost model (§6.6); it is timed here with the
Simple per-hop latency of the link it crosses and the per-GPU link bandwidth (documented below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable

import numpy as np

# --- enumerations (scan order of enqueue.cc topoGetAlgoInfo, §3.5) -------------------------------

ALGOS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOS = ("LL", "LL128", "Simple")
GENS = ("volta", "ampere", "hopper", "blackwell")
_VOLTA, _AMPERE, _HOPPER, _BLACKWELL = range(4)

# --- §1.4 baseLat (µs), tuning.cc v2.23.4..v2.30.7 (PAT row from v2.28) --------------------------
BASE_LAT_US = {
    "tree": (6.8, 14.0, 8.4),
    "ring": (6.6, 14.0, 8.4),
    "collnet_direct": (0.0, 0.0, 0.0),
    "collnet_chain": (0.0, 0.0, 0.0),
    "nvls": (0.0, 0.0, 0.0),
    "nvls_tree": (0.0, 0.0, 0.0),
    "pat": (8.0, 8.0, 8.0),
}
# --- §1.5 hwLat (µs per hop) by link class, tuning.cc v2.23.4..v2.28.7 ---------------------------
HW_LAT_US = {
    "nvlink": {
        "tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0.0, 0.0, 3.7),
        "collnet_chain": (0.0, 0.0, 2.8), "nvls": (0.0, 0.0, 25.0), "nvls_tree": (0.0, 0.0, 25.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "pci": {
        "tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "collnet_direct": (0.0, 0.0, 3.7),
        "collnet_chain": (0.0, 0.0, 2.8), "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0),
        "pat": (0.0, 0.0, 4.0),
    },
    "net": {
        "tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0.0, 0.0, 31.0),
        "collnet_chain": (0.0, 0.0, 30.0), "nvls": (0.0, 0.0, 18.0), "nvls_tree": (0.0, 0.0, 14.0),
        "pat": (0.0, 0.0, 14.0),
    },
}
# --- §1.7 bandwidth caps, tuning.cc v2.27.7 (Blackwell and NVLS rows as of v2.28.3) ----------------
# Columns: 1 node, 2 nodes, 3+ nodes (index2 = nNodes <= 2 ? nNodes-1 : 2).
LL_MAX_BW_GPU = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))  # single node, by GPU
LL_MAX_BW_CPU = {"intel": (39.0, 39.0, 20.4), "amd": (87.7, 22.5, 19.0)}  # multi-node: row 0 Intel, row 1 AMD/other
PER_CH_MAX_RING_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7,) * 3, (73.4,) * 3)
PER_CH_MAX_TREE_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CH_MAX_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
PER_CH_MAX_NVLS_TREE = (None, None, (0.0, 57.7, 45.5), (0.0, 96.0, 43.1))
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)  # §1.7 nvlsEfficiency (v2.28.3)
# --- §1.9 treeCorrectionFactor, index floor(log2(nBytes/64)) 0..22 ---------------------------------
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}
# --- §1.8 topology constants and search speed ladders (topo.h, search.cc) --------------------------
NVLINK_PER_LINK_GBPS = (20.0, 20.0, 20.6, 40.1)  # SM70, SM80, SM90, SM100 per NVLink link
# Spec bandwidth of one NVLink link, one direction (NVLink 2/3/4: 25 GB/s, NVLink 5: 50 GB/s;
# NVIDIA V100/A100/H100/B200 datasheets): turns a topology's nvlink_GBps into NCCL's link count.
NVLINK_SPEC_PER_LINK_GBPS = (25.0, 25.0, 25.0, 50.0)
PCIE_X16_GBPS = (12.0, 24.0, 48.0, 48.0)  # topo.cc width x rate / 80: gen3 (V100), gen4 (A100), gen5 (H100, B200)
SPEED_INTRA = (
    (40, 30, 20, 18, 15, 12, 10, 9, 7, 6, 5, 4, 3),  # pre-Hopper
    (40, 30, 20, 18, 15, 12, 10, 9, 7, 6, 5, 4, 3),
    (60, 50, 40, 30, 24, 20, 15, 12, 11, 6, 3),  # Hopper
    (90, 80, 70, 60, 50, 40, 30, 24, 20, 19, 18),  # Blackwell (2.27)
)
SPEED_INTER = (
    (48, 30, 28, 24, 20, 18, 15, 12, 10, 9, 7, 6, 5, 4, 3, 2.4, 1.2, 0.24, 0.12),
    (48, 30, 28, 24, 20, 18, 15, 12, 10, 9, 7, 6, 5, 4, 3, 2.4, 1.2, 0.24, 0.12),
    (48, 45, 42, 40, 30, 24, 22, 20, 17.5, 15, 12, 6, 3, 2.4, 1.2, 0.24, 0.12),
    (96, 48, 45.1, 42, 40, 30, 24, 22, 20, 17.5, 15, 12, 6, 3, 2.4, 1.2, 0.24, 0.12),
)
MAX_SEARCH_CHANNELS = 32  # search.cc: the ring search runs with at most 32 channels (§4.1)
NVLS_CHANNELS = (16, 16, 16, 24)  # §1.10 NCCL_NVLS_NCHANNELS: 16 Hopper, 24 Blackwell (one NVLink domain)
# --- §1.3 protocol thread limits and thresholds (device.h, comm.h) --------------------------------
MAX_THREADS = {"LL": 512, "LL128": 640, "Simple": 512}
THREAD_THRESHOLD = {"LL": 8, "LL128": 8, "Simple": 64}
# §1.10 NCCL_NET_OVERHEAD: 1 µs per network step on Intel (and other) hosts, 2 µs on AMD x86.
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0, "arm": 1.0}
# --- §3.6 path types, best to worst (topo.h), and LL128's default enablement (tuning.cc) ----------
PATH_TYPES = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET")
# A single-node graph has no NIC: its typeInter stays at the search's starting PIX (a real
# single-node A100 log prints "type NVL/PIX", NCCL-MODEL.md §4.2), which passes the rule below.
SINGLE_NODE_TYPE_INTER = "PIX"


def ll128_enabled(gen: int, type_intra: str, type_inter: str) -> bool:
    """NCCL's default LL128 enablement (tuning.cc ncclTopoTuneModel, NCCL-MODEL.md §3.6): on only
    if the graph's intra-node path is at most NVB (NVLink, possibly through one GPU), its GPU-NIC
    path at most PXB (NIC and GPU under PCIe switches, not through the CPU) or, on Hopper and
    newer with NCCL_LL128_C2C=1 (default), at most PXN (the NIC reached through another GPU over
    NVLink), and every GPU has the same compute capability, sm70 or newer (a system here has one
    GPU model, Volta or newer, so that part holds). Anything else risks LL128's 128-byte stores
    arriving torn, so NCCL turns it off rather than slowing it down."""
    rank = PATH_TYPES.index
    inter_ok = rank(type_inter) <= rank("PXB") or (gen >= _HOPPER and rank(type_inter) <= rank("PXN"))
    return rank(type_intra) <= rank("NVB") and inter_ok


def gpu_generation(device: str) -> int | None:
    """NCCL's GPU generation index (§3.1) from a device name; None for a CPU or an unknown device."""
    d = device.upper()
    if any(k in d for k in ("B200", "B100", "GB200", "GB300", "B300")):
        return _BLACKWELL
    if any(k in d for k in ("H100", "H200", "H800", "GH200", "H20")):
        return _HOPPER
    if any(k in d for k in ("A100", "A800", "A30", "A10")):
        return _AMPERE
    if "V100" in d:
        return _VOLTA
    return None


@dataclass(frozen=True)
class NcclTuning:
    """The calibrated constants (defaults: NCCL's own model unchanged). See module docstring."""

    latency_scale: float = 1.0  # collectives that cross nodes
    intra_latency_scale: float = 1.0  # collectives inside one node (NVLink hops only)
    ll128_latency_scale: float = 1.0  # relative to LL's, on top of the two above
    simple_latency_scale: float = 1.0
    net_latency_us: float = 0.0
    intra_bw_scale: float = 1.0
    inter_bw_scale: float = 1.0
    launch_us: float = 0.0
    copy_GBps: float | None = None  # a 1-rank "collective" is a device copy at this rate
    ll_bw_scale: float = 1.0  # achieved / NCCL's LL bandwidth factor
    ll128_bw_scale: float = 1.0  # achieved / NCCL's LL128 bandwidth factor
    # A cost per channel (CTA) launched, µs, on top of NCCL's latency (which has none): measured,
    # see NcclCalibration.channel_us and docs/design-notes.md.
    channel_us: float = 0.0
    # The most channels the fitted logs ran: channel_us is charged up to it (None: every channel).
    channel_us_max_channels: int | None = None
    copy_latency_us: float | None = None  # a 1-rank copy's own start-up (None: added to the launch)
    # A per-byte cost that does not depend on the rank count, as GB/s (None: none). Measured on
    # one A100 node: Ring/Simple at 1 GiB takes 4.83, 6.68 and 7.58 ns/B at 2, 4 and 8 GPUs,
    # = 2(n-1)/n / 270 GB/s + 1 / 887 GB/s within 0.3 % (Azure NDv4 logs), where NCCL's model
    # has the first term only. 887 GB/s is about one read and one write of the buffer at the
    # HBM rate (A100 40 GB: 1555 GB/s): a memory pass that the transfers do not hide.
    mem_GBps: float | None = None
    # LL's bandwidth factor inside one node when it differs from across nodes (None: ll_bw_scale).
    intra_ll_bw_scale: float | None = None
    # Single-node bandwidth of only the CTAs launched (see _choose); off: NCCL's tuner.
    cta_bound_intra: bool = False
    # How the pair is picked. Default: the fastest on the model's full time (NCCL's calibrated
    # table + pipeline fill + the measured per-channel and memory terms). NCCL itself ranks on
    # its tuner time (the table alone: rank_on_tuner_time) with its own constants
    # (pick_on_own_table); both rank the same except near ties (8 x 200 Gb/s A100, 32 nodes,
    # 512 MiB: Tree/Simple for NCCL, Ring/LL128 with the fill) and both fit the development logs
    # worse (p4de 44 % / 27 % at >= 64 KiB against 7 %), their runs' NCCL versions and tuner
    # plugins not being the 2.28 tables: docs/design-notes.md.
    rank_on_tuner_time: bool = False
    pick_on_own_table: bool = False
    # A cost per network (proxy) step a channel runs beyond its first loop, µs: NCCL's tuner counts
    # one loop's steps in its latency and none after (see chunking, NcclCalibration.net_step_us).
    net_step_us: float = 0.0
    # Ring/Simple's latency scale across nodes where it differs from inside one node (None:
    # simple_latency_scale; NCCL's ring charges netOverhead x 3 per NVLink step across nodes, §3.3).
    inter_simple_latency_scale: float | None = None
    # Tree/LL128 across nodes takes its size dependence from the runtime's chunk count
    # (calcCollChunking, §4.4, with net_step_us per step) instead of the tuner's
    # treeCorrectionFactor (§1.9), which stands in for it keyed on the total size. Off: NCCL's tuner.
    runtime_chunking: bool = False

    @classmethod
    def from_comm(cls, comm: Any) -> "NcclTuning":
        cal = getattr(comm, "nccl", None)
        if cal is None:
            return cls()
        return cls(latency_scale=cal.latency_scale, intra_latency_scale=cal.intra_latency_scale,
                   ll128_latency_scale=cal.ll128_latency_scale, simple_latency_scale=cal.simple_latency_scale,
                   net_latency_us=cal.net_latency_us,
                   intra_bw_scale=cal.intra_bw_scale, inter_bw_scale=cal.inter_bw_scale,
                   launch_us=cal.launch_us, copy_GBps=cal.copy_GBps,
                   ll_bw_scale=cal.ll_bw_scale, ll128_bw_scale=cal.ll128_bw_scale,
                   channel_us=getattr(cal, "channel_us", 0.0),
                   channel_us_max_channels=getattr(cal, "channel_us_max_channels", None),
                   copy_latency_us=getattr(cal, "copy_latency_us", None),
                   mem_GBps=getattr(cal, "mem_GBps", None), intra_ll_bw_scale=getattr(cal, "intra_ll_bw_scale", None),
                   cta_bound_intra=bool(getattr(cal, "cta_bound_intra", False)),
                   net_step_us=float(getattr(cal, "net_step_us", 0.0) or 0.0),
                   inter_simple_latency_scale=getattr(cal, "inter_simple_latency_scale", None),
                   runtime_chunking=bool(getattr(cal, "runtime_chunking", False)))


@dataclass(frozen=True)
class NcclSystem:
    """The node facts NCCL's model reads, in NCCL's own units (GB/s = 1e9 B/s)."""

    gen: int
    cpu: str  # intel, amd, arm
    gpus_per_node: int
    nvl_GBps: float  # NCCL's NVLink bandwidth of one GPU: links x per-link constant
    nvlink: bool  # intra-node path type is NVLink (else PCI)
    nics_per_node: int
    nic_GBps: float  # one NIC as NCCL sees it: speed / 8000
    pcie_GBps: float
    nvls: bool
    collnet: bool
    ll128: bool  # LL128 allowed by the system's settings (False: NCCL_PROTO without it)
    protocols: tuple = PROTOS  # NCCL_PROTO: the protocols the system enables
    # NCCL's path type from a GPU to its NIC (§3.6, topo.h): PIX/PXB when they share PCIe
    # switches (DGX/HGX, p4de, p5, NDv4), PHB/SYS through the CPU. Sets LL128 across nodes.
    nic_path: str = "PXB"

    @property
    def type_intra(self) -> str:
        """The graph's intra-node path type: NVLink through the NVSwitch, else PCIe (§3.1)."""
        return "NVL" if self.nvlink else "PXB"

    def type_inter(self, n_nodes: int) -> str:
        """The graph's typeInter for a communicator over n_nodes: the GPU-NIC path across nodes,
        PIX on one node (§4.2)."""
        return self.nic_path if n_nodes > 1 else SINGLE_NODE_TYPE_INTER

    def ll128_on(self, n_nodes: int) -> bool:
        """LL128 for a communicator over n_nodes: the system's setting and NCCL's rule."""
        return self.ll128 and ll128_enabled(self.gen, self.type_intra, self.type_inter(n_nodes))

    def protocols_note(self, n_nodes: int) -> str:
        """One line: the protocols NCCL enables for a communicator over n_nodes, and why LL128 is
        on or off (NCCL's rule, §3.6)."""
        inter = self.type_inter(n_nodes)
        on = [p for p in self.protocols if p != "LL128" or self.ll128_on(n_nodes)]
        where = f"GPU-NIC path {inter}" if n_nodes > 1 else f"one node, graph typeInter {inter}"
        limit = "PXN (Hopper+)" if self.gen >= _HOPPER else "PXB"
        if "LL128" not in self.protocols or not self.ll128:
            why = "LL128 off: the system's NCCL_PROTO excludes it"
        elif self.ll128_on(n_nodes):
            why = f"LL128 on: intra {self.type_intra} <= NVB, {where} <= {limit}"
        elif PATH_TYPES.index(self.type_intra) > PATH_TYPES.index("NVB"):
            why = f"LL128 off: intra-node path {self.type_intra} (no NVLink) > NVB"
        else:
            why = f"LL128 off: {where} > {limit}"
        return f"protocols {', '.join(on)} ({why}; tuning.cc, NCCL-MODEL.md §3.6)"

    @classmethod
    def from_specs(cls, node: Any, device: str) -> "NcclSystem | None":
        gen = gpu_generation(device)
        if gen is None:
            return None
        links = getattr(node, "nvlink_links", None)
        if links is None:
            links = max(1, round(node.nvlink_GBps / NVLINK_SPEC_PER_LINK_GBPS[gen]))
        nvlink = getattr(node, "nvlink", True)
        nvl = links * NVLINK_PER_LINK_GBPS[gen] if nvlink else PCIE_X16_GBPS[gen]
        pcie = getattr(node, "pcie_GBps", None) or PCIE_X16_GBPS[gen]
        return cls(gen=gen, cpu=getattr(node, "cpu_vendor", "intel"), gpus_per_node=node.gpus_per_node,
                   nvl_GBps=float(nvl), nvlink=bool(nvlink), nics_per_node=node.nics_per_node,
                   nic_GBps=node.nic_gbps / 8.0, pcie_GBps=float(pcie),
                   nvls=bool(getattr(node, "nvls", False)) and gen >= _HOPPER and nvlink,
                   collnet=bool(getattr(node, "sharp", False)), ll128=bool(getattr(node, "ll128", True)),
                   nic_path=str(getattr(node, "gpu_nic_path", None) or "PXB"),
                   protocols=tuple(p for p in PROTOS if p in (getattr(node, "nccl_protocols", None) or PROTOS)))


@dataclass(frozen=True)
class Graph:
    n_ch: int  # search channels (the model's nChannels)
    bw_intra: float  # GB/s per channel
    bw_inter: float
    runtime_ch: int  # CTAs at run time


def _ladder_at_most(ladder, x: float) -> list[float]:
    return [float(s) for s in ladder if s <= x + 1e-9]


def _dup(g: Graph, gen: int) -> Graph:
    """search.cc ncclTopoDupChannels (§4.1): double channels, halve bandwidth, unless bwIntra < 25
    or (compute capability > 8.0 and bwIntra < 50 and more than 4 channels)."""
    if g.bw_intra < 25 or (gen >= _HOPPER and g.bw_intra < 50 and g.n_ch > 4):
        return g
    return Graph(min(2 * g.n_ch, MAX_SEARCH_CHANNELS), g.bw_intra / 2, g.bw_inter / 2, g.runtime_ch)


def graphs(sys: NcclSystem, n_nodes: int, ppn: int, tuning: NcclTuning | None = None) -> dict[str, Graph]:
    return _graphs(sys, n_nodes, ppn)


def _group_nics(sys: NcclSystem, ppn: int) -> int:
    """The NICs of each node a group with ``ppn`` GPUs a node gets: those local to its GPUs (see _graphs)."""
    return max(1, round(sys.nics_per_node * min(ppn, sys.gpus_per_node) / sys.gpus_per_node))


@lru_cache(maxsize=1024)
def _graphs(sys: NcclSystem, n_nodes: int, ppn: int) -> dict[str, Graph]:
    """Per-algorithm graph (§4.2, §6.1-6.4, §8.1), simplified from search.cc: the best speed of the
    ladder that the NICs (one channel per NIC per speed step that fits) and each GPU's NVLink carry."""
    gen = sys.gen
    nvl = sys.nvl_GBps
    out: dict[str, Graph] = {}
    if n_nodes <= 1:
        ladder = _ladder_at_most(SPEED_INTRA[gen], nvl)
        best = None
        for s in ladder:
            c = min(MAX_SEARCH_CHANNELS, int(nvl // s))
            if c >= 1 and (best is None or c * s > best[0] * best[1] + 1e-9):
                best = (c, s)
            if best is not None and s < 0.49 * best[1]:  # search.cc's 0.49 stop (NCCL-MODEL.md §6.2)
                break
        c, s = best or (1, ladder[-1] if ladder else nvl)
        ring = _dup(Graph(c, s, s, 0), gen)
        # Runtime channels = 2 x search channels, at most 64 (connect.cc ncclTopoPostset; NCCL-MODEL.md §4.1 item 3).
        ring = Graph(ring.n_ch, ring.bw_intra, ring.bw_inter, min(64, 2 * ring.n_ch))
        out["ring"] = out["tree"] = ring
    else:
        nic = sys.nic_GBps
        path = min(sys.pcie_GBps, nic)
        ladder = _ladder_at_most(SPEED_INTER[gen], path)
        # The NICs a ring or tree gets: those local to its GPUs in each node. NCCL picks the nets
        # closest to the ring's GPUs (search.cc ncclTopoSelectNets, rail-aligned with CROSS_NIC=2);
        # a group with fewer GPUs per node than the node has (Megatron's DP group under TP: one
        # GPU per node at tp8) shares the node's NICs with the sibling groups that run at the same
        # time (every TP rank reduces its gradients together), each on its own rails.
        nics = _group_nics(sys, ppn)
        best = None
        for s in ladder:
            c = min(MAX_SEARCH_CHANNELS, nics * int(nic // s + 1e-9), int(nvl // s))
            if c >= 1 and (best is None or c * s > best[0] * best[1] + 1e-9):
                best = (c, s)
            if best is not None and s < 0.49 * best[1]:
                break
        c, s = best or (1, ladder[-1] if ladder else path)
        # Tree pass 2 (§6.2): raise bwIntra one inter-ladder step at a time while below 2 x bwInter
        # and the node's NVLink carries it.
        t_intra = s
        for up in sorted(float(x) for x in SPEED_INTER[gen] if x > s):
            if t_intra >= 2 * s or c * up > nvl + 1e-9:
                break
            t_intra = up
        ring = _dup(Graph(c, s, s, 0), gen)
        rt = min(64, 2 * ring.n_ch)
        if gen >= _HOPPER and ring.bw_intra > 45 and ring.n_ch < 16:  # §4.1 item 4
            rt = min(64, 2 * rt)
        out["ring"] = Graph(ring.n_ch, ring.bw_intra, ring.bw_inter, rt)
        # Duplicated channels halve each channel's bandwidth, the tree's as the ring's (the
        # ratio was inverted; latent while no multi-node graph was duplicated).
        tree = Graph(ring.n_ch, t_intra * c / ring.n_ch, s * c / ring.n_ch, rt)
        out["tree"] = tree
        out["pat"] = tree
    if sys.nvls and ppn > 2:
        # §4.2 NVLS graph: one head per local GPU; each GPU carries (ppn + 1) x bw on its NVLink;
        # bwInter raised in pass 2 up to below 2 x bwIntra (one NIC's worth per head across nodes).
        bi = max(_ladder_at_most(SPEED_INTRA[gen], nvl / (ppn + 1)) or [nvl / (ppn + 1)])
        if n_nodes <= 1:
            be = max(_ladder_at_most(SPEED_INTRA[gen], 2 * bi - 1e-6) or [bi])
        else:
            nic_per_gpu = sys.nic_GBps * max(1.0, sys.nics_per_node / sys.gpus_per_node)
            be = max(_ladder_at_most(SPEED_INTER[gen], min(nic_per_gpu, 2 * bi - 1e-6)) or [nic_per_gpu])
        out["nvls"] = Graph(ppn, bi, be, NVLS_CHANNELS[gen])
    return out


@dataclass
class Choice:
    """What NCCL runs for one collective, and the time the (calibrated) model predicts."""

    op: str
    size_bytes: float
    n_ranks: int
    n_nodes: int
    algorithm: str
    protocol: str
    time_us: float
    latency_us: float  # latency x latCount (after the plateau factor) + pipeline fill + channel cost + launch floor
    bandwidth_GBps: float  # algorithm bandwidth of the size term (after corrections and the memory pass)
    channels: int  # CTAs NCCL launches (§3.7)
    threads: int
    table: dict = field(default_factory=dict)  # (algo, proto) -> time_us of every enabled pair
    pipeline_us: float = 0.0  # the pipeline fill (part of latency_us): see pipeline_fill_us
    pipeline_unit_bytes: float = 0.0  # the store-and-forward unit (slice or chunk) per channel
    pipeline_stages: float = 0.0  # store-and-forward stages a unit crosses beyond the lockstep ring
    channel_cost_us: float = 0.0  # the measured per-channel cost (part of latency_us): channels x channel_us
    chunk_bytes: float = 0.0  # NCCL's chunk per channel (calcCollChunking, §4.4)
    net_steps: int = 0  # network (proxy) steps per channel beyond the first loop, multi-node only
    step_cost_us: float = 0.0  # net_steps x net_step_us (part of latency_us)

    @property
    def bw_time_us(self) -> float:
        return self.time_us - self.latency_us


def _idx2(n_nodes: int) -> int:
    return n_nodes - 1 if n_nodes <= 2 else 2


def tune(sys: NcclSystem, op: str, n: int, n_nodes: int, ppn: int, tuning: NcclTuning) -> dict[tuple[str, str], tuple[float, float]]:
    """ncclTopoTuneModel (§3.2, §3.3): (algo, proto) -> (algorithm bandwidth GB/s, latency µs)
    for every enabled pair; op in all_reduce, all_gather, reduce_scatter, broadcast."""
    return _tune(sys, op, n, n_nodes, ppn, tuning)


@lru_cache(maxsize=4096)
def _tune(sys: NcclSystem, op: str, n: int, n_nodes: int, ppn: int, tuning: NcclTuning):
    gen, i2 = sys.gen, _idx2(n_nodes)
    gs = graphs(sys, n_nodes, ppn, tuning)
    intra_hw = "nvlink" if sys.nvlink else "pci"
    hw = intra_hw if n_nodes == 1 else "net"
    ll_max = LL_MAX_BW_GPU[gen][i2] if n_nodes == 1 else LL_MAX_BW_CPU.get(sys.cpu, LL_MAX_BW_CPU["amd"])[i2]
    out: dict[tuple[str, str], tuple[float, float]] = {}
    ll128 = sys.ll128_on(n_nodes)  # §3.6: NCCL's default enablement for this communicator
    if op == "all_reduce":
        nsteps = 2 * (n - 1)
    elif op in ("all_gather", "reduce_scatter"):
        nsteps = n - 1
    else:
        nsteps = n
    algos = ["ring"]
    if op == "all_reduce":
        algos.insert(0, "tree")
    if "nvls" in gs and op in ("all_reduce", "all_gather", "reduce_scatter"):
        # §1.1: NVLS on one node (multi-node NVLS needs CollNet/SHARP); NVLS Tree multi-node AllReduce.
        if n_nodes == 1 or (sys.collnet and op == "all_reduce"):
            algos.append("nvls")
        if n_nodes > 1 and op == "all_reduce":
            algos.append("nvls_tree")
    if sys.collnet and n_nodes >= 2 and op == "all_reduce":
        algos += ["collnet_direct", "collnet_chain"]
    if op in ("all_gather", "reduce_scatter") and ppn == 1 and n_nodes > 1:
        algos.append("pat")  # §1.1: PAT by default only with one rank per node
    for algo in algos:
        g = gs["nvls"] if algo.startswith("nvls") else gs["tree" if algo in ("tree", "pat") else "ring"]
        for pi, proto in enumerate(PROTOS):
            if (proto == "LL128" and not ll128) or proto not in sys.protocols:
                continue
            if algo in ("collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat") and proto != "Simple":
                continue
            bw = g.bw_intra if (n_nodes <= 2 or algo.startswith("collnet")) else g.bw_inter
            # Calibrated: what the links deliver of NCCL's graph bandwidth (NICs once the
            # collective crosses nodes, NVLink inside one); NCCL's protocol caps stay as they are.
            bus = g.n_ch * bw * (tuning.inter_bw_scale if n_nodes > 1 else tuning.intra_bw_scale)
            # NCCL's protocol factors, tuning.cc (NCCL-MODEL.md §3.2 item 3, §1.3).
            if algo == "ring" and proto == "LL":
                bus = min(ll_max, 0.5 * bus)
            elif algo == "ring" and proto == "LL128":
                bus = min(0.92 * bus, g.n_ch * PER_CH_MAX_RING_LL128[gen][i2])
            if algo == "tree":
                bus = min(0.92 * bus, g.n_ch * PER_CH_MAX_TREE[gen][i2])
                if proto == "LL":
                    bus = min(bus / 3.8, ll_max)
                elif proto == "LL128":
                    bus = min(bus * (7 / 9 if n_nodes == 1 else 120 / 128), g.n_ch * PER_CH_MAX_TREE_LL128[gen][i2])
            if algo == "pat":
                bus *= 0.75
            # Calibrated per-protocol efficiency on top of NCCL's own protocol factors.
            llsc = tuning.ll_bw_scale if (n_nodes > 1 or tuning.intra_ll_bw_scale is None) else tuning.intra_ll_bw_scale
            bus *= llsc if proto == "LL" else (tuning.ll128_bw_scale if proto == "LL128" else 1.0)
            if algo in ("nvls", "nvls_tree"):
                # §5.1 (v2.28+)
                intra = g.bw_intra * NVLS_EFFICIENCY[gen] * (g.n_ch - 1) / g.n_ch * tuning.intra_bw_scale
                intra *= 2.0 if op == "all_reduce" else (ppn - 1) / ppn
                inter = g.bw_inter * (2.0 if (algo == "nvls_tree" and n_nodes <= 2) else 1.0) * tuning.inter_bw_scale
                per = min(intra, inter)
                cap = PER_CH_MAX_NVLS_TREE[gen]
                if algo == "nvls_tree" and cap is not None:
                    per = min(per, cap[i2])
                if g.n_ch < 2:
                    continue
                bus = g.n_ch * per
            if algo == "collnet_direct":
                if op == "all_reduce":
                    f = ppn / max(1, g.n_ch)
                    f -= (f - 1) / 2
                    bus /= max(f, 1.0)
                    if gen >= _HOPPER:
                        bus *= 0.85  # CollNet Direct AllReduce, Hopper+ (NCCL-MODEL.md §3.2 item 3)
            # algorithm bandwidth (§3.2 item 4)
            if algo == "ring":
                algbw = bus * n / nsteps
            elif algo in ("nvls", "nvls_tree"):
                algbw = bus * n / nsteps if op == "all_reduce" else bus
            elif algo in ("tree", "collnet_direct", "collnet_chain"):
                algbw = bus * 0.5
            else:
                algbw = bus
            if n_nodes > 1 and op == "all_reduce":
                # Physics over NCCL's rules (nvls_tree doubles bwInter at <= 2 nodes, §5.1): each
                # node's reduced data leaves through its NICs, at least 2(m-1)/m of the buffer
                # over m nodes (S once where the switch reduces: CollNet/SHARP), so algbw <= the
                # node's NIC egress x m / (2(m-1)). B200 on 2 nodes: 408 GB/s over 8 x 50.
                nics = _group_nics(sys, ppn)
                egress = nics * min(sys.nic_GBps, sys.pcie_GBps)
                crossings = 1.0 if algo.startswith("collnet") or algo == "nvls" else 2 * (n_nodes - 1) / n_nodes
                algbw = min(algbw, egress / crossings)
            if algbw <= 0:
                continue
            # latency (§3.3): NCCL's tables (scaled by latency_scale) plus the plugin's network
            # latency (latencyInter) on every network hop, which NCCL adds unscaled.
            lat_nccl = _latency(sys, op, algo, proto, pi, n, n_nodes, ppn, nsteps, intra_hw, hw, 0.0)
            lat_net = _latency(sys, op, algo, proto, pi, n, n_nodes, ppn, nsteps, intra_hw, hw, 1.0) - lat_nccl
            lat_scale = tuning.latency_scale if n_nodes > 1 else tuning.intra_latency_scale
            simple_scale = tuning.simple_latency_scale
            if algo == "ring" and n_nodes > 1 and tuning.inter_simple_latency_scale is not None:
                simple_scale = tuning.inter_simple_latency_scale
            lat_scale *= tuning.ll128_latency_scale if proto == "LL128" else (simple_scale if proto == "Simple" else 1.0)
            out[(algo, proto)] = (algbw, lat_nccl * lat_scale + lat_net * tuning.net_latency_us)
    return out


def _latency(sys: NcclSystem, op: str, algo: str, proto: str, pi: int, n: int, n_nodes: int, ppn: int,
             nsteps: int, intra_hw: str, hw: str, net_us: float) -> float:
    """ncclTopoTuneModel's latency (§3.3) with latencyInter = net_us."""
    intra_lat = HW_LAT_US[intra_hw][algo][pi]
    inter_lat = HW_LAT_US["net"]["tree" if ppn == 1 else algo][pi] + net_us
    if proto == "Simple":
        inter_lat += net_us  # the plugin's latency again for the flush
    lat = BASE_LAT_US[algo][pi]
    if algo == "ring" and op == "broadcast":
        per_hop = HW_LAT_US[hw]["tree" if proto == "Simple" else "ring"][pi]
        if hw == "net":
            per_hop += net_us
        lat += n * per_hop
    elif algo == "ring":
        net_oh = 0.0 if n_nodes == 1 else NET_OVERHEAD_US.get(sys.cpu, 1.0) * (3 if proto == "Simple" else 1)
        il = max(intra_lat, net_oh)
        inter_steps = 0 if n_nodes == 1 else (2 * (n_nodes - 1) if op == "all_reduce" else n_nodes - 1)
        lat += (nsteps - inter_steps) * il + inter_steps * inter_lat
    elif algo == "tree":
        lat += 2 * ((ppn - 1) * intra_lat + int(math.log2(n_nodes)) * inter_lat)
    elif algo == "collnet_direct":
        lat += 2 * (min(1, ppn - 1) * intra_lat + (ppn - 1) * 0.4) + inter_lat  # 0.4 µs arity serialization (§3.3)
    elif algo == "collnet_chain":
        lat += 2 * (ppn - 1) * intra_lat + inter_lat
    elif algo == "nvls":
        lat = intra_lat + (inter_lat if n_nodes > 1 else 0.0)
    elif algo == "nvls_tree":
        lat += intra_lat + 2 * int(math.log2(n_nodes)) * inter_lat
    elif algo == "pat":
        lat += int(math.log2(n_nodes)) * inter_lat / 3.5 + 2.8 * n  # tuning.cc PAT latency (§3.3, §5.3)
    return lat


def algo_time_us(sys: NcclSystem, op: str, size: float, n: int, n_nodes: int, algo: str, proto: str,
                 algbw: float, lat: float, runtime_ch: int) -> tuple[float, float, float]:
    """ncclTopoGetAlgoTime (§3.4) for one collective in its group: (time, latency, bandwidth)."""
    bw = algbw
    if algo == "tree" and op == "all_reduce" and size >= 64:
        i = int(math.log2(size / 64))
        if i <= 22:
            bw *= TREE_CORRECTION[proto][i]
    if algo == "ring" and proto == "Simple" and n_nodes > 1 and op == "all_reduce" and size / (runtime_ch * n) >= 64:
        lat *= 1.4 if sys.gen >= _AMPERE else 1.9  # the "plateau effect of ring" (tuning.cc; §3.4)
    return lat + size / (1000.0 * bw), lat, bw


# --- §4.4 chunking (enqueue.cc calcCollChunking, collectives.h, init.cc computeBuffSizes) ---------
NCCL_STEPS = 8  # device.h: FIFO slots per connection
SIMPLE_STEP_BYTES = (4 << 20) // NCCL_STEPS  # NCCL_BUFFSIZE 4 MiB / 8 steps = 512 KiB per step
# Ring AllReduce/AllGather/ReduceScatter: chunk = NCCL_STEPS/2 steps (2 MiB), slice = NCCL_STEPS/4 (1 MiB)
RING_CHUNK_BYTES = SIMPLE_STEP_BYTES * (NCCL_STEPS // 2)
RING_SLICES_PER_CHUNK = (NCCL_STEPS // 2) // (NCCL_STEPS // 4)
TREE_CHUNK_BYTES = SIMPLE_STEP_BYTES  # Tree/Simple and Broadcast/Reduce: one step per chunk
NVLS_CHUNK_BYTES = 128 << 10  # NCCL_NVLS_CHUNKSIZE
NVLS_TREE_CHUNK_4NODES_BYTES = 64 << 10  # NCCL_NVLSTREE_MAX_CHUNKSIZE auto at >= 4 nodes


# §1.3: per-connection buffers (init.cc computeBuffSizes) and the grain a chunk is rounded down to
# (device.h ncclProtoGrainSize): LL 512 KiB, LL128 4,915,200 B, Simple 4 MiB, each in NCCL_STEPS slots.
LL_STEP_BYTES = (512 << 10) // NCCL_STEPS  # 64 KiB on the wire; a chunk is half of it in data (§4.4)
LL128_STEP_BYTES = 4915200 // NCCL_STEPS  # 614,400 B on the wire; 15 of 16 words are data (§4.4)
GRAIN_BYTES = {"LL": 16, "LL128": 1920, "Simple": 512}
RING_CHUNK_STEPS = NCCL_STEPS // 2  # collectives.h ALLREDUCE/ALLGATHER/REDUCESCATTER_CHUNKSTEPS (Simple ring)


@dataclass(frozen=True)
class Chunking:
    """What NCCL's calcCollChunking (enqueue.cc, NCCL-MODEL.md §4.4) gives one channel's share."""

    chunk_bytes: int  # data bytes per chunk, rounded down to the protocol's grain
    loops: int  # passes of the device loop over the channel's data (tree: chunks; ring: n chunks each)
    proxy_steps: int  # network steps the proxy runs per channel (§4.4: ring 2(n-1) x loops x chunkSteps)
    steps_per_loop: int  # of those, the ones one loop takes (what NCCL's latency term covers)


# memoised: a pure function of its arguments, called per (algorithm, protocol) at every choice, and
# a fit re-chooses every log row with new constants (the arguments here do not depend on them)
@lru_cache(maxsize=1 << 16)
def chunking(algo: str, proto: str, op: str, bytes_per_channel: float, n: int, n_nodes: int, ppn: int) -> Chunking:
    """calcCollChunking for one channel's bytes (NCCL 2.19+ chunks each channel's piece on its
    own, §4.3), NCCL-MODEL.md §4.4:
    - the chunk starts at one step (Ring/Simple AllReduce/AllGather/ReduceScatter: 4 steps = 2 MiB):
      Simple 512 KiB; LL half a 64 KiB step (32 KiB of data); LL128 15/16 of a 614,400 B step
      (576,000 B);
    - Tree/LL128 halves it (not below 128 KiB) while bytes/chunk < (1 + log2 nNodes + 0.1 ppn) x
      64/ppn, then (not below 32 KiB) while < the same x 16/ppn: on 4 nodes x 8 GPUs (3.8 x 8 =
      30.4, 3.8 x 2 = 7.6) a channel's share below 273,600 B gets 18,000 B chunks, below
      547,200 B 36,000 B, below 4,377,600 B 72,000 B, then 144,000 B and up;
    - NVLS / NVLS Tree: the pipeline_fill_us units (128 KiB, 64 KiB from 4 nodes);
    - rounded down to the grain (§1.3: 16 B LL, 1,920 B LL128, 512 B Simple).
    Loops: a ring moves n chunks per loop (runRing), a tree or a chain one. Proxy steps per channel
    (§4.4): ring AllReduce 2(n-1) x loops x chunkSteps, AllGather/ReduceScatter (n-1) x loops x
    chunkSteps, tree and chains 1 x loops."""
    ring_coll = algo == "ring" and op in ("all_reduce", "all_gather", "reduce_scatter")
    chunk_steps = RING_CHUNK_STEPS if (proto == "Simple" and ring_coll) else 1
    if proto == "LL":
        chunk = LL_STEP_BYTES // 2
    elif proto == "LL128":
        chunk = LL128_STEP_BYTES // 16 * 15  # NCCL_LL128_LINEELEMS 16, NCCL_LL128_DATAELEMS 15
    else:
        chunk = SIMPLE_STEP_BYTES * chunk_steps
    if algo == "tree" and proto == "LL128":
        # calcCollChunking's Tree/LL128 halving, floors 128 KiB then 32 KiB (NCCL-MODEL.md §4.4 table)
        nsteps_ll128 = 1 + int(math.log2(max(1, n_nodes))) + 0.1 * ppn  # log2i: floor
        while bytes_per_channel / chunk < nsteps_ll128 * 64 / ppn and chunk > 131072:
            chunk //= 2
        while bytes_per_channel / chunk < nsteps_ll128 * 16 / ppn and chunk > 32768:
            chunk //= 2
    elif algo in ("nvls", "nvls_tree"):
        chunk = NVLS_TREE_CHUNK_4NODES_BYTES if (algo == "nvls_tree" and n_nodes >= 4) else NVLS_CHUNK_BYTES
    grain = GRAIN_BYTES[proto]
    chunk = max(grain, chunk // grain * grain)
    per_loop = n * chunk if ring_coll else chunk
    loops = max(1, math.ceil(bytes_per_channel / per_loop))
    if ring_coll:
        steps = (2 * (n - 1) if op == "all_reduce" else n - 1) * chunk_steps
    else:
        steps = 1
    return Chunking(int(chunk), int(loops), int(steps * loops), int(steps))


def _units(bytes_per_channel: float, unit_max: float) -> float:
    """The unit a channel's data is cut into: as large as unit_max, the remainder spread evenly
    (the device loop shrinks its last chunk, runRing / runTree)."""
    k = max(1, math.ceil(bytes_per_channel / unit_max))
    return bytes_per_channel / k


def pipeline_fill_us(g: Graph, algo: str, proto: str, op: str, size: float, n: int, n_nodes: int, ppn: int,
                     channels: int, tuning: NcclTuning) -> tuple[float, float, float]:
    """Pipeline fill of one collective NCCL's tuner leaves out (§4.5): (fill µs, unit bytes, stages).

    Simple moves data in steps through an 8-slot FIFO and a receiver starts on a slice only once
    the sender has posted all of it (prims_simple: wait on the tail counter per slice), so every
    store-and-forward stage a slice crosses in sequence adds one slice time. LL and LL128 carry a
    flag in every 16-byte / 128-byte line and forward each line as it lands: no fill beyond NCCL's
    per-hop latencies (0 here). Stages per algorithm (Simple):
    - ring AllReduce/AllGather/ReduceScatter: every rank runs its steps in lockstep (all start
      together, each step needs only the neighbour's previous step), and a network crossing's
      extra stage hides behind the second slice of the chunk (see below): no fill;
    - ring Broadcast/Reduce: a chain from/to the root, n - 1 stages;
    - tree: a chain up and down, 2 x ((ppn - 1) NVLink hops + log2(nodes) network hops);
    - NVLS: scatter into the switch and multicast out (2 NVLink stages), NVLS Tree adds the
      tree's network hops; CollNet and PAT: not modelled (0).
    The unit is the slice (ring: a 2 MiB chunk in 2 slices, shrunk to the channel's share of one
    loop, n x chunk, for smaller messages), the 512 KiB step (tree, broadcast) or the 128/64 KiB
    NVLS chunk, per channel actually launched. One stage's unit is inside the bandwidth term
    already, so the fill is the sum of the stage times less the slowest one. Rates per runtime
    channel from the graph (calibrated scales applied)."""
    if proto != "Simple" or size <= 0 or algo in ("pat", "collnet_direct", "collnet_chain"):
        return 0.0, 0.0, 0.0
    rt = max(1, g.runtime_ch)
    per_ch = size / max(1, channels)
    r_intra = g.bw_intra * g.n_ch * tuning.intra_bw_scale / rt * 1e3  # bytes per µs per channel
    r_net = g.bw_inter * g.n_ch * (tuning.inter_bw_scale if n_nodes > 1 else tuning.intra_bw_scale) / rt * 1e3
    log_nodes = int(math.log2(n_nodes)) if n_nodes > 1 else 0
    if algo == "ring" and op in ("all_reduce", "all_gather", "reduce_scatter"):
        chunk = _units(per_ch / n, RING_CHUNK_BYTES)
        unit = chunk / RING_SLICES_PER_CHUNK
        # Lockstep: every rank starts at once and step k needs only the neighbour's step k-1, so
        # the longest dependency path is a rank's own sequence of slices (the bandwidth term). A
        # network crossing puts the NIC between two ranks as one more store-and-forward stage,
        # but with 2 slices per chunk the rank works on its next slice while the previous one
        # crosses, and the NIC moves a slice no slower than the ring's pace (the ring runs at its
        # slowest link's per-channel rate, the NIC's): the stage hides, and what remains is the
        # network latency NCCL already counts (nInterSteps x interLat). Hence no fill.
        return 0.0, unit, 0.0
    if algo == "ring":  # broadcast / reduce chain
        unit = _units(per_ch, TREE_CHUNK_BYTES)
        hops = [unit / r_intra] * (n - n_nodes) + [unit / r_net] * (n_nodes - 1)
    elif algo == "tree":
        unit = _units(per_ch, TREE_CHUNK_BYTES)
        hops = ([unit / r_intra] * (ppn - 1) + [unit / r_net] * log_nodes) * 2
    else:  # nvls, nvls_tree
        cmax = NVLS_TREE_CHUNK_4NODES_BYTES if (algo == "nvls_tree" and n_nodes >= 4) else NVLS_CHUNK_BYTES
        unit = _units(per_ch, cmax)
        hops = [unit / r_intra] * 2 + ([unit / r_net] * (2 * log_nodes) if algo == "nvls_tree" else [])
    if len(hops) <= 1:
        return 0.0, unit, float(len(hops))
    return sum(hops) - max(hops), unit, float(len(hops) - 1)


_NO_FILL = (0.0, 0.0, 0.0)


@lru_cache(maxsize=1 << 16)  # pure, and of the graph only its runtime channels (see chunking)
def _launch_shape(runtime_ch: int, algo: str, proto: str, op: str, size: float, n: int, gen: int) -> tuple[int, int]:
    """§3.7: channels (CTAs) and threads per CTA NCCL launches for this size, with the graph's
    runtime channels."""
    if algo.startswith("nvls"):  # 640 threads: NCCL-MODEL.md §3.7, §5.1
        return NVLS_CHANNELS[gen], 640
    nt = 640 if algo in ("tree", "pat") else MAX_THREADS[proto]
    nc = max(1, runtime_ch)
    thr = THREAD_THRESHOLD[proto] * (n if (algo == "ring" and proto == "LL") else 1)
    if algo in ("ring", "tree"):
        while nc > 1 and size < nc * nt * thr:
            nc -= 1
        while algo == "ring" and nt % 128 == 0 and nt > 128 and size < nc * nt * thr:
            nt //= 2
    if proto == "Simple":  # Ring Simple 512 + 32, Tree 640 (NCCL-MODEL.md §3.7 and its summary table)
        nt += 32 if algo == "ring" else (128 if algo == "tree" else 0)
    return nc, min(nt, 640)


class NcclModel:
    """NCCL's tuner for one system (topology node + GPU profile), with calibrated constants."""

    def __init__(self, system: NcclSystem, tuning: NcclTuning | None = None, gpus_per_thread: int = 1):
        self.system = system
        self.tuning = tuning or NcclTuning()
        # GPUs one host thread drives (nccl-tests -g G); training runs one process per GPU.
        self.gpus_per_thread = max(1, int(gpus_per_thread))
        self._cache: dict[tuple, Choice] = {}
        # (op, n, nodes, ppn) -> the (algorithm, protocol) pairs NCCL scans for that group shape,
        # with their table entries and graph: the same for every size (_candidates).
        self._shape_cache: dict[tuple, list[tuple]] = {}

    @classmethod
    def from_specs(cls, node: Any, profile: Any) -> "NcclModel | None":
        """None when the profile's device is not a GPU NCCL models (a CPU/gloo profile)."""
        sys = NcclSystem.from_specs(node, getattr(profile, "device", ""))
        if sys is None:
            return None
        return cls(sys, NcclTuning.from_comm(getattr(profile, "comm", None)))

    def shape(self, group: np.ndarray) -> tuple[int, int, int]:
        """(ranks, nodes, GPUs per node) of one group (global GPU ids, node = id // gpus_per_node)."""
        g = np.asarray(group).ravel()
        n = int(g.size)
        n_nodes = int(np.unique(g // self.system.gpus_per_node).size) if n else 1
        return n, n_nodes, max(1, math.ceil(n / max(n_nodes, 1)))

    def choose(self, op: str, size_bytes: float, n: int, n_nodes: int, ppn: int | None = None,
               gpus_per_thread: int | None = None, algorithm: str | None = None) -> Choice:
        """NCCL's (algorithm, protocol) and time for one collective; ``algorithm`` restricts the
        pick to it, as NCCL_ALGO does (None: where the group runs no such algorithm)."""
        ppn = ppn or max(1, math.ceil(n / n_nodes))
        gpus_per_thread = gpus_per_thread or self.gpus_per_thread
        key = (op, float(size_bytes), n, n_nodes, ppn, gpus_per_thread, algorithm)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        c = self._choose(op, float(size_bytes), n, n_nodes, ppn, gpus_per_thread, algorithm)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[key] = c
        return c

    def _choose(self, op: str, size: float, n: int, n_nodes: int, ppn: int, gpt: int,
                algorithm: str | None = None) -> Choice | None:
        tn = self.tuning
        # The host launches one kernel per GPU it drives (launch_us each); the next iteration's
        # launches overlap this one's kernels, so a run takes max(G x launch, the collective)
        # (nccl-tests -g G: one thread, G GPUs; G = 1 for a process per GPU). Staggering the
        # collective by the (G-1) launches before the last GPU joins fitted the Azure logs worse.
        floor = tn.launch_us * max(1, gpt)
        stagger = 0.0
        if n <= 1 or size <= 0:
            # One rank: nccl-tests' out-of-place "collective" is a device-to-device copy. The copy
            # has its own start-up (copy_latency_us) and overlaps the next launch like a kernel:
            # max(launch floor, start-up + bytes / rate) (Azure 1-GPU log: flat 4.4-4.6 µs to
            # 512 KiB, then 5.3 µs at 1 MiB = 3.7 µs + 1 MiB / 660 GB/s).
            bw = tn.copy_GBps or 0.0
            t = (size / (1000.0 * bw) if bw > 0 and size > 0 else 0.0)
            if tn.copy_latency_us is None:
                return Choice(op, size, n, n_nodes, "copy", "-", floor + t, floor, bw, 1, 0)
            lat = max(floor - t, tn.copy_latency_us)
            return Choice(op, size, n, n_nodes, "copy", "-", lat + t, lat, bw, 1, 0)
        if op in ("all_to_all", "send_recv"):
            return self._floor(self._p2p(op, size, n, n_nodes, ppn, stagger), floor)
        top = "broadcast" if op not in ("all_reduce", "all_gather", "reduce_scatter") else op
        on_tuner_time = tn.pick_on_own_table or tn.rank_on_tuner_time
        best = None
        times = {}
        system = self.system
        for algo, proto, e, o, g in self._candidates(top, n, n_nodes, ppn):
            if algorithm is not None and algo != algorithm:
                continue
            t, lat, bw = algo_time_us(system, top, size, n, n_nodes, algo, proto, e[0], e[1], g.runtime_ch)
            rank = t if o is e else algo_time_us(system, top, size, n, n_nodes, algo, proto, o[0], o[1], g.runtime_ch)[0]
            nc, nt = _launch_shape(g.runtime_ch, algo, proto, top, size, n, system.gen)
            if tn.cta_bound_intra and n_nodes == 1 and algo in ("ring", "tree") and nc < g.runtime_ch:
                # Inside one node the SMs copy over NVLink, each CTA its channel's share: with
                # nc of the runtime channels launched (§3.7) the bandwidth is nc/runtime of
                # NCCL's, which its tuner assumes for every size. Across nodes the network
                # path sets the rate (measured: the same rule there puts Azure 16-GPU 8 KiB
                # 32 % slow), so it stays NCCL's.
                bw = bw * nc / max(1, g.runtime_ch)
                t = lat + size / (1000.0 * bw)
            # (only Simple has a fill: pipeline_fill_us gives LL and LL128 none)
            fill, unit, stages = pipeline_fill_us(g, algo, proto, top, size, n, n_nodes, ppn, nc, tn) if proto == "Simple" else _NO_FILL
            # the measured cost per channel launched (NcclCalibration.channel_us): NCCL's
            # tuner has no such term, so more channels never cost it anything. Measured only up to
            # the channels the fitted logs ran: a faster fabric's extra channels (e.g. the Azure
            # A100 fit's 1.41 µs x 64 channels on 1,200 GB/s NVLink: 90 µs, which made all_gather
            # slower than at 300 GB/s) are not charged a cost nobody timed.
            cap = tn.channel_us_max_channels
            ch_us = tn.channel_us * (nc if cap is None else min(nc, cap))
            # NCCL's chunking of each channel's share (§4.4): the proxy runs every network step
            # in turn; NCCL's latency covers one loop's steps, each further step costs
            # net_step_us (fitted; no network, no proxy: 0 inside one node)
            ck = chunking(algo, proto, top, size / nc, n, n_nodes, ppn)  # nc >= 1 (_launch_shape)
            extra_steps = ck.proxy_steps - ck.steps_per_loop if n_nodes > 1 else 0
            st_us = tn.net_step_us * extra_steps
            if tn.runtime_chunking and algo == "tree" and proto == "LL128" and n_nodes > 1 and size >= 64:
                # the chunk count above replaces the tuner's size correction (§1.9) that
                # algo_time_us applied: the measured rate steps where calcCollChunking doubles
                # the chunk (Azure 32 GPUs: 8 MiB), not where the table steps (4 MiB)
                i = int(math.log2(size / 64))
                if i <= 22:
                    t = lat + (t - lat) * TREE_CORRECTION[proto][i]
                    bw = bw / TREE_CORRECTION[proto][i]
            t, lat = t + fill + ch_us + st_us, lat + fill + ch_us + st_us
            if tn.mem_GBps:
                # one pass over the buffer that does not overlap the transfers (see
                # NcclTuning.mem_GBps): the size term runs at the harmonic sum of the rates
                t += size / (1000.0 * tn.mem_GBps)
                bw = 1.0 / (1.0 / bw + 1.0 / tn.mem_GBps)
            if not on_tuner_time:
                rank = t
            t_floored = t + stagger
            times[(algo, proto)] = floor if floor > t_floored else t_floored  # max(), without the call
            if best is None or rank < best[0]:
                best = (rank, t, lat, bw, algo, proto, nc, nt, (fill, unit, stages), ch_us, ck, extra_steps, st_us)
        if best is None:
            return None  # (a forced algorithm this group does not run)
        _, t, lat, bw, algo, proto, nc, nt, pipe, ch_us, ck, extra_steps, st_us = best
        c = Choice(op, size, n, n_nodes, algo, proto, t + stagger, lat + stagger, bw, nc, nt, times, *pipe,
                   channel_cost_us=ch_us, chunk_bytes=float(ck.chunk_bytes), net_steps=extra_steps, step_cost_us=st_us)
        return self._floor(c, floor)

    def _candidates(self, top: str, n: int, n_nodes: int, ppn: int) -> list[tuple]:
        """The (algorithm, protocol) pairs NCCL's tuner scans for this group shape, in its scan
        order (topoGetAlgoInfo; strict < keeps the earlier on ties): (algo, proto, calibrated
        table entry, the entry ranked on, graph). Only the size varies between choices of one
        shape (a fit re-chooses every row of a log with new constants: one table per shape)."""
        key = (top, n, n_nodes, ppn)
        hit = self._shape_cache.get(key)
        if hit is None:
            tn = self.tuning
            table = tune(self.system, top, n, n_nodes, ppn, tn)
            # The table the pairs are ranked on: the calibrated one (default), or NCCL's own
            # constants (pick_on_own_table: NCCL's rule, the pick from its table, the time from
            # the calibrated).
            own = tune(self.system, top, n, n_nodes, ppn, NcclTuning()) if tn.pick_on_own_table else table
            gs = graphs(self.system, n_nodes, ppn, tn)
            hit = []
            for algo in ALGOS:
                for proto in PROTOS:
                    e = table.get((algo, proto))
                    o = own.get((algo, proto))
                    if e is None or o is None:
                        continue
                    g = gs["nvls"] if algo.startswith("nvls") else gs["tree" if algo in ("tree", "pat") else "ring"]
                    hit.append((algo, proto, e, o, g))
            self._shape_cache[key] = hit
        return hit

    @staticmethod
    def _floor(c: Choice, floor_us: float) -> Choice:
        if c.time_us < floor_us:
            c.latency_us += floor_us - c.time_us
            c.time_us = floor_us
        return c

    def _p2p(self, op: str, size: float, n: int, n_nodes: int, ppn: int, launch: float) -> Choice:
        """No NCCL tuner model exists for p2p (§6.6). Simple protocol: ring Simple base latency, one
        Simple hop of the link crossed (NVLink 3.4 µs, network 14 µs + the plugin latency), and the
        GPU's NVLink or its share of the node's NICs (calibrated scales applied)."""
        s, tn = self.system, self.tuning
        nvl = s.nvl_GBps * tn.intra_bw_scale
        nic = min(s.nic_GBps * s.nics_per_node / s.gpus_per_node, s.pcie_GBps) * tn.inter_bw_scale
        hop_intra = HW_LAT_US["nvlink" if s.nvlink else "pci"]["ring"][2]
        hop_net = HW_LAT_US["net"]["ring"][2]
        if op == "send_recv":
            inter = n_nodes > 1
            bw = nic if inter else nvl
            lat = (BASE_LAT_US["ring"][2] + (hop_net if inter else hop_intra)) * (tn.latency_scale if inter else tn.intra_latency_scale) + inter * tn.net_latency_us
            t = lat + size / (1000.0 * bw)
            return Choice(op, size, n, n_nodes, "p2p", "Simple", t + launch, lat + launch, bw, 2, 640)
        k = min(ppn, n)
        t_intra = (k - 1) / n * size / (1000.0 * nvl)
        t_inter = (n - k) / n * size / (1000.0 * nic) if n_nodes > 1 else 0.0
        lat = (BASE_LAT_US["ring"][2] + (hop_net if n_nodes > 1 else hop_intra)) * (tn.latency_scale if n_nodes > 1 else tn.intra_latency_scale) + (n_nodes > 1) * tn.net_latency_us
        bwt = max(t_intra, t_inter)
        t = lat + bwt
        bw = size / (1000.0 * bwt) if bwt > 0 else float("inf")
        return Choice(op, size, n, n_nodes, "p2p", "Simple", t + launch, lat + launch, bw, 1, 640)

    def time_s(self, op: str, size_bytes: float, group: np.ndarray) -> float:
        n, m, ppn = self.shape(group)
        return self.choose(op, size_bytes, n, m, ppn).time_us * 1e-6


def collective_time_s(op: str, size_bytes: float, group: Any, topology: Any, profile: Any) -> float:
    """Time of one uncontended collective as NCCL runs it: the function every network and the
    sweep estimate call. topology: a TopologySpec (or its node); profile: a Profile (its device
    picks the GPU generation, its comm.nccl the calibrated constants). Raises ValueError for a
    profile whose device NCCL does not model (CPU ranks)."""
    node = getattr(topology, "node", topology)
    model = NcclModel.from_specs(node, profile)
    if model is None:
        raise ValueError(f"device {getattr(profile, 'device', '?')!r} is not a GPU the NCCL model knows")
    return model.time_s(op, float(size_bytes), np.asarray(group))


# Inputs that NCCL's cost model does not read: on a GPU it describes, every collective and
# point-to-point transfer takes NCCL's own latencies and bandwidths (base, per hop, per protocol,
# per channel), scaled by the profile's comm.nccl calibration, so these change nothing there (they
# serve CPU/gloo profiles and tori). Found by a metamorphic test: a 1 ms NIC latency left every
# step bit-identical without a word.
NCCL_UNUSED_KEYS = (
    "cluster.topology.node.nic_latency_us", "cluster.topology.node.nvlink_latency_us",
    "cluster.topology.fabric.switch_latency_us", "cluster.gpu.comm.intra_node_latency_us",
    "cluster.gpu.comm.inter_node_latency_us", "cluster.gpu.comm.launch_overhead_us",
    "cluster.gpu.comm.nic_efficiency", "cluster.gpu.comm.nvlink_efficiency",
)


def unused_comm_note(keys: "Iterable[str]", node: Any, profile: Any) -> str | None:
    """One line naming the overridden ``keys`` that NCCL's model ignores on this node and GPU,
    and the knobs it does read; None when there are none or NCCL's model does not apply."""
    unused = [k for k in keys if k in NCCL_UNUSED_KEYS]
    if not unused or NcclSystem.from_specs(node, getattr(profile, "device", "")) is None:
        return None
    return (f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used on {profile.device}: collectives and "
            "transfers take NCCL's own latencies and bandwidths (its tuner's terms); set "
            "cluster.gpu.comm.nccl.net_latency_us (added per network hop), latency_scale, inter_bw_scale or "
            "intra_bw_scale instead, or calibrate them from nccl-tests logs (clustersim calibrate)")

