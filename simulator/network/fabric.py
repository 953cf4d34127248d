"""The flow-level network (DESIGN.md rule 5): collectives become flows on the topology graph,
and concurrent flows share every link max-min fairly.

How a collective runs: its plan (simulator.network.collectives) is a list of phases; a phase
waits its latency term (algorithm steps x per-step latency; the launch overhead is added
before the first phase) and then its flows start; when the last flow of a phase ends, the next
phase begins; when the last phase ends, the collective's event fires.

Inside SimPy there is no process per flow or per collective: the fabric keeps one pending
"next completion" timeout (stale ones are ignored by a generation counter) and re-solves the
max-min rates whenever flows start or end: in the coflow model only the connected components
of running coflows that the start or end touches (the rest keep their rates and completion
times), so an event costs the same however much else runs (full mode at 16,384 GPUs).

Coflow model (the default; ``coflow=False`` solves flow by flow, kept for validation): a
phase's flows are grouped into coflows, the flows that end together when the phase runs
alone (one coflow for a symmetric phase; an all-to-all across nodes splits into its NVLink-only
and its network flows). All flows of a coflow advance by the same fraction, so the solve has
one variable per running coflow instead of one per flow (a DeepSeek-V3 EP all-to-all in
reduced mode is 8K flows): weighted max-min where a coflow puts (its bytes on a link / its
mean flow's bytes) "equivalent flows" on each link, so on a shared link it gets the share its
flows would get one by one, and never beyond the speed it has alone. A coflow alone finishes at
its isolated time, as flow by flow; symmetric collectives sharing links match the per-flow
model to rounding, irregular ones within the tolerance tests/test_network_fabric.py states.
Running coflows split into components that share links; a component's levels depend only on
which coflows form it, so they are memoised, and most events cost no solve at all.

Fast path: a collective whose links are all idle runs *virtually*: its isolated time (cached
per op, group structure and algorithm, linear in the size) decides when it ends, and only one
timeout is scheduled. If a later collective touches its links while it runs, it is converted
to real flows at the point its isolated schedule has reached, and from then on shares
bandwidth exactly. Collectives on disjoint links (TP inside nodes, DP across nodes) thus never
pay for a solve.

Per-link efficiency: link capacity x ``nvlink_efficiency`` on intra-node links and x
``nic_efficiency`` on network links (both from the GPU profile). Per-step latency: the profile's
``intra_node_latency_us`` / ``inter_node_latency_us`` if given, else the path latency from the
topology (sum of link latencies, worst flow of the phase).
"""

from __future__ import annotations

import hashlib
import heapq
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

# scipy.sparse is imported where a matrix is built, not at the top: it takes ~0.3 s (with the
# numpy.f2py its array-API shim loads), and only the flow model needs it.
if TYPE_CHECKING:
    import scipy.sparse as sp

from simulator.errors import UserError
from simulator.network.base import COLLECTIVE_OPS, CollectiveRequest
from simulator.network.collectives import Plan, candidates
from simulator.network.maxmin import maxmin_dense, maxmin_rates
from simulator.topology.graph import LINK_INTRA, LINK_KINDS, TopologyGraph, build_graph
from simulator.topology.spec import TopologySpec, load_topology

_DONE_REL = 1e-9


@dataclass
class _RPhase:
    inc: sp.csc_matrix  # links x flows
    coef: np.ndarray  # bytes per byte of size
    lat_s: float
    tau_s: float  # isolated bandwidth time per byte of size
    fin_s: np.ndarray  # isolated finish time of each flow per byte of size
    link_ids: np.ndarray
    link_coef: np.ndarray  # bytes per byte of size on link_ids
    coflows: list["_Coflow"] = field(default_factory=list)

    @property
    def n_flows(self) -> int:
        return int(self.coef.size)


@dataclass(eq=False)
class _Coflow:
    """Flows of a phase that end together when the phase runs alone: the coflow model's unit.

    All flows of a coflow advance by the same fraction of their bytes. A symmetric phase is
    one coflow; an all-to-all across nodes splits into its NVLink-only flows and its network
    flows, so the fast ones free their links early as they do flow by flow.
    """

    link_ids: np.ndarray
    link_coef: np.ndarray  # bytes per byte of size on link_ids
    flow_coef: float  # bytes of its mean flow per byte of size
    link_flows: np.ndarray  # link_coef / flow_coef: "equivalent flows" on each link
    fin_s: float  # isolated finish time per byte of size
    ceil_Bps: float  # per-flow bandwidth it averages alone: it never runs faster
    link_bits: int | None = None  # link_ids as a Python int bitset, for overlap tests
    link_demand: np.ndarray | None = None  # link_flows x ceil_Bps: what it puts on each link at most (B/s)
    # creation number in its fabric: components are solved with their coflows in this order, so a
    # run's rounding does not depend on where Python put the objects in memory (it did: id order)
    uid: int = -1


# Link-byte values logged before they are added (see FlowNetwork._flush_bytes); 1: at once.
# 16K values: each concatenated array (128 KiB) stays under glibc's mmap threshold; batches of
# 1 MiB measured 3x slower per value than 128 KiB ones (fresh pages at every flush).
_BYTES_LOG_MAX = 1 << 14
# The component-level cache's bounds: components, and coflows over all its keys (each costs
# ~100 B across key, group and levels: 2^22 of them ~0.4 GB; full mode at 4,096 GPUs keeps
# 1.6 M, at 16,384 GPUs it would keep ~25 M).
LEVEL_CACHE_ENTRIES = 65536
LEVEL_CACHE_MEMBERS = 1 << 22

# A link couples the coflows on it only where their demand at their ceilings exceeds its capacity
# by more than this (relative): below it, every coflow on it can run at its ceiling whatever the
# others do, so max-min never meets the link (see FlowNetwork._join). The margin absorbs the
# rounding of the running sums; a link loaded that little past capacity slows nobody measurably.
BIND_REL = 1e-9

# Most coflows per phase: flows of an irregular phase whose isolated finish times differ are
# bucketed (the bucket keeps its latest finish, so a phase alone still ends on time).
_MAX_COFLOWS = 8


def _split_coflows(inc: sp.csc_matrix, coef: np.ndarray, fin: np.ndarray, tau: float) -> list[_Coflow]:
    live = np.nonzero((coef > 0) & (fin > 0))[0]
    if live.size == 0 or tau <= 0:
        return []
    f = fin[live] / tau
    levels = np.unique(np.round(f, 9))
    if levels.size > _MAX_COFLOWS:
        edges = np.linspace(f.min(), f.max(), _MAX_COFLOWS + 1)[1:-1]
        bucket = np.searchsorted(edges, f, side="right")
    else:
        bucket = np.searchsorted(levels, np.round(f, 9))
    out = []
    for k in np.unique(bucket):
        sel = live[bucket == k]
        c = np.zeros_like(coef)
        c[sel] = coef[sel]
        ids, load = _link_load(inc, c)
        fc = float(coef[sel].mean())
        fin_k = float(fin[sel].max())
        out.append(_Coflow(ids, load, fc, load / fc, fin_k, fc / fin_k))
    return out


def _link_load(inc: sp.csc_matrix, coef: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(links, bytes per byte of size on each) that flows with these coefs put on the fabric:
    the nonzeros of ``inc @ coef`` without an array as long as the fabric (16,384 GPUs: 66K
    links, for every plan of every group in full mode)."""
    import scipy.sparse as sp  # (see the note at the imports)

    inc = inc if sp.isspmatrix_csc(inc) else sp.csc_matrix(inc)
    if 4 * inc.nnz > inc.shape[0]:
        # a phase over much of the fabric (reduced mode's all-replica requests): the mat-vec is cheaper
        per_link = inc @ np.asarray(coef, dtype=np.float64)
        ids = np.flatnonzero(per_link)
        return ids, per_link[ids]
    w = np.repeat(np.asarray(coef, dtype=np.float64), np.diff(inc.indptr)) * inc.data
    ids, inv = np.unique(inc.indices, return_inverse=True)
    load = np.bincount(inv, weights=w, minlength=ids.size)
    keep = load != 0
    return ids[keep].astype(np.int64), load[keep]


def _root(parent: list[int], x: int) -> int:
    """Union-find: the root of x, halving the path on the way."""
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _join_roots(parent: list[int], x: int, y: int) -> None:
    """Union-find: join x's and y's sets under the smaller root."""
    rx, ry = _root(parent, x), _root(parent, y)
    if rx != ry:
        parent[max(rx, ry)] = min(rx, ry)


def _labels(parent: list[int]) -> tuple[int, list[int]]:
    """(count, label per node) of a union-find, labels in order of each set's first node."""
    ids: dict[int, int] = {}
    label = [ids.setdefault(_root(parent, i), len(ids)) for i in range(len(parent))]
    return len(ids), label


# Up to this many virtual collectives running, a contended start finds the ones on its links by
# testing each one's link bitset; beyond, from a link -> owner array (see _virtual_owners).
_SCAN_VIRTUALS_MAX = 64

# Forced algorithms (FlowNetwork ``algorithms``, collective --algorithm) that are NCCL's own: they
# restrict NCCL's pick as NCCL_ALGO does, keeping its protocols, latencies and calibration; the
# rest (hierarchical, torus, pairwise) are the flow model's own plans on the topology's links.
NCCL_FORCEABLE = ("ring", "tree")


def _incidence(flow: np.ndarray, link: np.ndarray, n_flows: int, n_links: int) -> sp.csc_matrix:
    """links x flows, 1 where the flow crosses the link (``Routes.incidence``, built straight
    into CSC: plans are built per group in full mode, tens of thousands at 16,384 GPUs)."""
    import scipy.sparse as sp  # (see the note at the imports)

    flow = np.asarray(flow, dtype=np.int64)
    link = np.asarray(link, dtype=np.int64)
    order = np.lexsort((link, flow))
    f, l = flow[order], link[order]
    if f.size > 1:
        keep = np.empty(f.size, dtype=bool)
        keep[0] = True
        keep[1:] = (f[1:] != f[:-1]) | (l[1:] != l[:-1])
        f, l = f[keep], l[keep]
    indptr = np.zeros(n_flows + 1, dtype=np.int64)
    np.cumsum(np.bincount(f, minlength=n_flows), out=indptr[1:])
    return sp.csc_matrix((np.ones(l.size), l, indptr), shape=(n_links, n_flows))


def _isolated_unshared(inc: sp.csc_matrix, coef: np.ndarray, alive: np.ndarray,
                       capacity: np.ndarray) -> tuple[float, np.ndarray] | None:
    """A phase alone whose live flows share no link (rings, p2p, most tree edges): max-min
    gives each flow the smallest capacity on its path, for good, so its finish time is its
    bytes over that. None where flows share a link (the caller fills progressively)."""
    import scipy.sparse as sp  # (see the note at the imports)

    inc = inc if sp.isspmatrix_csc(inc) else sp.csc_matrix(inc)
    ptr = inc.indptr
    per_col = np.diff(ptr)
    if (per_col[alive] == 0).any():
        return None
    rows = inc.indices[np.repeat(alive, per_col)]
    if 4 * rows.size > inc.shape[0]:
        if np.bincount(rows, minlength=inc.shape[0]).max(initial=0) > 1:
            return None
    elif rows.size and np.unique(rows).size != rows.size:
        return None
    nz = per_col > 0
    rate = np.zeros(coef.size)
    rate[nz] = np.minimum.reduceat(capacity[inc.indices], ptr[:-1][nz])
    fin = np.zeros(coef.size)
    fin[alive] = coef[alive] / rate[alive]
    return float(fin.max(initial=0.0)), fin


@dataclass
class _RPlan:
    op: str
    algorithm: str
    phases: list[_RPhase]
    overhead_s: float
    links: np.ndarray  # every link the plan uses
    lat_s: float = 0.0
    tau_s: float = 0.0
    # links as a Python int bitset: whether a collective's links are idle is one AND with the
    # fabric's held-link bitsets, not a fancy index of per-link arrays (most starts take the fast path)
    bits: int = 0

    def time_s(self, size_bytes: float) -> float:
        return self.overhead_s + self.lat_s + size_bytes * self.tau_s


@dataclass(eq=False, slots=True)
class _Coll:
    plan: _RPlan
    size: float
    event: simpy.Event
    t0: float
    virtual: bool = False  # runs on idle links in closed form; holds them in _virt_bits
    real: bool = False  # holds its links (FlowNetwork._real_plans, _real_bits) until it finishes
    vid: int = -1  # while virtual, once written into FlowNetwork._virt_owner: its id there


@dataclass(eq=False)
class _Batch:
    coll: _Coll
    phase: int
    inc: sp.csc_matrix
    rem: np.ndarray
    bytes0: np.ndarray
    alive: np.ndarray


@dataclass(eq=False, slots=True)
class _CoBatch:
    """One running coflow."""

    coll: _Coll
    phase: int
    cf: _Coflow
    left: list[int]  # coflows of this phase run still running (shared by them)
    rem: float  # fraction of its bytes still to carry
    carried: float = 0.0  # fraction carried but not yet added to link_bytes
    due: bool = False  # the pending completion timer is this coflow's
    # Incremental solver (FlowNetwork(incremental=True)): each coflow advances lazily from
    # t_set at its own rate; its completion sits in the fabric's heap under version gen.
    seq: int = 0  # start order: coflows ending at one timer are processed in it
    cu_per: float = 0.0  # fraction of the coflow per second at a level of 1 B/s per flow
    rate: float = 0.0  # fraction per second
    t_set: float = 0.0
    gen: int = 0
    comp: "_Comp | None" = None
    done: bool = False

    def bring_to(self, now: float) -> None:
        moved = self.rate * (now - self.t_set)
        if moved:
            self.rem -= moved
            self.carried += moved
        self.t_set = now


@dataclass(eq=False, slots=True)
class _Comp:
    """Running coflows connected through shared links (a connected component)."""

    cid: int
    members: dict  # _CoBatch -> None, in joining order


def _bitset(ids: np.ndarray) -> int:
    if ids.size == 0:
        return 0
    bits = np.zeros(int(ids.max()) + 1, dtype=bool)
    bits[ids] = True
    return int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")


@dataclass
class FabricStats:
    collectives: int = 0
    fast_path: int = 0
    materialized: int = 0
    solves: int = 0
    solve_s: float = 0.0
    # running coflows whose levels were (re)computed, summed over solves: the fabric's work
    # per event, which the incremental solver keeps to the components an event touches
    solved_coflows: int = 0
    plans_built: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class FlowNetwork:
    """Flow-level fabric implementing simulator.network.base.Network."""

    def __init__(
        self,
        graph: TopologyGraph,
        *,
        nvlink_efficiency: float = 1.0,
        nic_efficiency: float = 1.0,
        intra_node_latency_us: float | None = None,
        inter_node_latency_us: float | None = None,
        launch_overhead_us: float = 0.0,
        algorithms: dict[str, str] | None = None,
        fast_path: bool = True,
        coflow: bool = True,
        incremental: bool = True,
        nccl: Any = None,
    ):
        for name, eff in (("nvlink_efficiency", nvlink_efficiency), ("nic_efficiency", nic_efficiency)):
            if not 0 < eff <= 1:
                raise UserError(f"{name}={eff} must be in (0, 1]: it scales link bandwidth")
        self.graph = graph
        self.nvlink_efficiency = float(nvlink_efficiency)
        self.nic_efficiency = float(nic_efficiency)
        self.intra_node_latency_us = intra_node_latency_us
        self.inter_node_latency_us = inter_node_latency_us
        self.launch_overhead_us = float(launch_overhead_us)
        self.algorithms = dict(algorithms or {})
        for op in self.algorithms:
            if op not in COLLECTIVE_OPS:
                raise UserError(f"algorithm override for unknown collective {op!r}: use one of {', '.join(COLLECTIVE_OPS)}")
        self.fast_path = fast_path
        self.coflow = bool(coflow)
        # Coflow model only: re-solve just the components a start or an end touches (False: the
        # earlier global re-solve of every running coflow at every event, kept to check against).
        self.incremental = bool(incremental) and self.coflow
        # NCCL's cost model (simulator.network.nccl.NcclModel): when given, the isolated time of a
        # collective is NCCL's (its algorithm, protocol, latencies and bandwidths), and its flows
        # carry bytes scaled so that alone they take NCCL's bandwidth time; contention between
        # collectives is still max-min sharing of the links.
        self.nccl = nccl
        self._nccl_plans: dict[tuple, _RPlan] = {}
        self._nccl_shapes: dict[bytes, list[tuple[int, int, int]]] = {}
        self._nccl_reqs: dict[int, tuple] = {}
        # id(request) -> (request, plan, bytes, isolated time): the engine reuses its request
        # objects, so what a start needs of one is looked up once (the entry keeps it alive)
        self._req_plans: dict[int, tuple] = {}
        self._req_adds_n = 0  # link-byte values the request cache holds
        eff = np.where(graph.link_class == LINK_INTRA, self.nvlink_efficiency, self.nic_efficiency)
        if nccl is not None:
            # NCCL's model sets every isolated time (its bandwidths, scaled by comm.nccl's
            # intra_bw_scale / inter_bw_scale); the links only share. Scaled by the profile's
            # efficiencies they shifted the byte scaling between a collective's NVLink and NIC
            # phases: a lower nic_efficiency made steps faster (0.3: 0.32557 s, 1.0: 0.32649 s).
            eff = np.ones_like(eff)
        link_GBps = graph.link_capacity_GBps
        if nccl is not None and graph.link_kind.size:
            # A NIC reaches its GPU over PCIe: no faster than the GPU-NIC path NCCL's graph counts
            # (node.pcie_GBps, else the generation's x16). Uncapped, a NIC beyond it (800 Gb/s on
            # PCIe gen5's 48 GB/s) shortened the flows' isolated time while NCCL's stayed at the
            # path's, so the byte scaling (_nccl_scaled_new: NCCL time / flow time) grew every phase of the
            # collective, its NVLink phases included: a faster NIC slowed TP (metamorphic test).
            nic_links = np.isin(graph.link_kind, [LINK_KINDS.index("nic->leaf"), LINK_KINDS.index("leaf->nic")])
            link_GBps = np.where(nic_links, np.minimum(link_GBps, nccl.system.pcie_GBps), link_GBps)
        self.capacity_Bps = link_GBps * 1e9 * eff
        # The healthy fabric's capacities: NCCL's model prices a collective on healthy links, so a
        # degraded link (what-if) must slow the flows, not be normalised away by the NCCL scaling.
        self.nominal_capacity_Bps = self.capacity_Bps.copy()
        # ... and on a non-blocking fabric: its tuner knows a node's NICs, not the switch trunks,
        # so oversubscribed trunks must slow the flows too. The NCCL scaling is taken on the
        # healthy fabric with every trunk at its downstream NICs' capacity (oversubscription 1);
        # normalised on the oversubscribed one, a 32:1 leaf left every collective and step as
        # at 1:1 (metamorphic test).
        self.reference_capacity_Bps = self.nominal_capacity_Bps.copy()
        fab = getattr(graph.spec, "fabric", None)
        if nccl is not None and graph.link_kind.size and fab is not None:
            leaf_o = float(getattr(fab, "leaf_oversubscription", 1.0) or 1.0)
            spine_o = float(getattr(fab, "spine_oversubscription", 1.0) or 1.0)
            kinds = graph.link_kind
            for names, factor in ((("leaf->spine", "spine->leaf"), leaf_o), (("spine->core", "core->spine"), leaf_o * spine_o)):
                trunk = np.isin(kinds, [LINK_KINDS.index(n) for n in names])
                self.reference_capacity_Bps[trunk] *= max(1.0, factor)
        self._plans: dict[tuple, list] = {}  # (op, groups) -> candidate Plans, routed as used (_RPlan)
        self._level_cache: dict[tuple, tuple[np.ndarray, tuple]] = {}
        self._level_cache_members = 0  # coflows over the cache's keys
        self._n_coflows = 0
        self._scratch_pos = np.zeros(graph.n_links, dtype=np.int64)
        self._hash_w = np.random.default_rng(12345).random(257) + 0.5
        self._gkeys: dict[int, tuple[np.ndarray, bytes]] = {}
        self.stats = FabricStats()
        self._env: simpy.Environment | None = None
        self._reset_dynamic(None)

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def from_topology(cls, topology: TopologySpec | str | Path, n_gpus: int, **kwargs: Any) -> "FlowNetwork":
        spec = topology if isinstance(topology, TopologySpec) else load_topology(topology)
        return cls(build_graph(spec, n_gpus), **kwargs)

    @classmethod
    def from_profile(cls, topology: TopologySpec | str | Path, n_gpus: int, profile: Any, **kwargs: Any) -> "FlowNetwork":
        """With the link efficiencies and step latencies of a GPU profile (its ``comm`` part), and
        NCCL's cost model for GPU profiles on switched (non-torus) fabrics."""
        spec = topology if isinstance(topology, TopologySpec) else load_topology(topology)
        if "nccl" not in kwargs:
            kwargs["nccl"] = nccl_model_for(spec, profile)
        return cls(build_graph(spec, n_gpus), **comm_kwargs(profile), **kwargs)

    # --- plans ----------------------------------------------------------------------------

    def _groups_key(self, groups: np.ndarray) -> bytes:
        hit = self._gkeys.get(id(groups))
        if hit is not None and hit[0] is groups:
            return hit[1]
        arr = np.ascontiguousarray(groups, dtype=np.int64)
        key = hashlib.blake2b(arr.tobytes(), digest_size=16).digest() + repr(arr.shape).encode()
        if len(self._gkeys) > 4096:
            self._gkeys.clear()
        self._gkeys[id(groups)] = (groups, key)
        return key

    def _unrouted(self, req: CollectiveRequest) -> list:
        """The request's candidate plans, each routed (_RPlan) once something asked for it: with
        NCCL's model only the algorithm NCCL picks is used, and routing one (its isolated time
        by progressive filling, for a tree) is most of a plan's cost."""
        groups = req.groups
        if not isinstance(groups, np.ndarray):
            groups = np.asarray(groups, dtype=np.int64)
        key = (req.op, self._groups_key(groups))
        plans = self._plans.get(key)
        if plans is None:
            if groups.size and (groups.min() < 0 or groups.max() >= self.graph.n_gpus):
                raise UserError(
                    f"collective {req.op} uses GPU ids {int(groups.min())}..{int(groups.max())} but the fabric has "
                    f"{self.graph.n_gpus} GPUs: build it with more GPUs"
                )
            plans = self._plans[key] = candidates(self.graph, req.op, groups, self.algorithms.get(req.op))
        return plans

    def _routed(self, plans: list, i: int) -> _RPlan:
        p = plans[i]
        if not isinstance(p, _RPlan):
            p = plans[i] = self._route_plan(p)
        return p

    def _candidates(self, req: CollectiveRequest) -> list[_RPlan]:
        plans = self._unrouted(req)
        return [self._routed(plans, i) for i in range(len(plans))]

    def plan_for(self, req: CollectiveRequest) -> _RPlan:
        if self.nccl is not None and req.op not in self.algorithms:
            choice = self.nccl_choice(req)
            if choice is not None:
                plans = self._unrouted(req)
                # The flows of the NCCL algorithm: a tree's for Tree / NVLS Tree / CollNet, else a ring's.
                want = "tree" if choice.algorithm in ("tree", "nvls_tree", "collnet_direct", "collnet_chain") else "ring"
                for i, p in enumerate(plans):
                    if p.algorithm == want:
                        return self._routed(plans, i)
                return self._routed(plans, 0)
        plans = self._candidates(req)
        if len(plans) == 1:
            return plans[0]
        return min(plans, key=lambda p: p.time_s(req.size_bytes))

    def nccl_choice(self, req: CollectiveRequest):
        """NCCL's choice (simulator.network.nccl.Choice) for this collective, or None without the model."""
        forced = self.algorithms.get(req.op)
        if forced is not None and (forced not in NCCL_FORCEABLE or req.op in ("all_to_all", "send_recv")):
            return None  # (NCCL picks no algorithm for its point-to-point collectives)
        if self.nccl is None or req.group_size <= 1:
            return None
        groups = req.groups if isinstance(req.groups, np.ndarray) else np.asarray(req.groups, dtype=np.int64)
        gk = self._groups_key(groups)
        shapes = self._nccl_shapes.get(gk)
        if shapes is None:
            shapes = self._nccl_shapes[gk] = self._group_shapes(groups)
        # Groups issued together end together (one coflow): the slowest shape sets the time. (A
        # ring of send/recv pairs on 16 GPUs has pairs inside a node and pairs across nodes; the
        # first pair alone priced it at NVLink speed.)
        choices = [self.nccl.choose(req.op, float(req.size_bytes), n, m, ppn, algorithm=forced) for n, m, ppn in shapes]
        if any(c is None for c in choices):
            return None  # NCCL runs no such algorithm on this group: the flow model's, as asked
        return choices[0] if len(choices) == 1 else max(choices, key=lambda c: c.time_us)

    def _group_shapes(self, groups: np.ndarray) -> list[tuple[int, int, int]]:
        """The distinct (ranks, nodes, GPUs per node) of the groups, in order of first appearance."""
        if groups.shape[0] == 1:
            return [self.nccl.shape(groups[0])]
        node = np.sort(groups // self.nccl.system.gpus_per_node, axis=1)
        n_nodes = 1 + (np.diff(node, axis=1) != 0).sum(axis=1)
        _, first = np.unique(n_nodes, return_index=True)
        return [self.nccl.shape(groups[i]) for i in sorted(first.tolist())]

    def algorithm(self, req: CollectiveRequest) -> str:
        """The algorithm the fabric runs this collective with (at this size)."""
        choice = self.nccl_choice(req)
        if choice is not None:
            return f"{choice.algorithm}/{choice.protocol}"
        return self.plan_for(req).algorithm

    def _nccl_scaled(self, req: CollectiveRequest) -> tuple[_RPlan, float]:
        """(plan, bytes) whose isolated run takes NCCL's time: NCCL's latency before the flows
        (none between phases), and the flows' bytes scaled so they take NCCL's bandwidth time."""
        hit = self._nccl_reqs.get(id(req))
        if hit is not None and hit[0] is req:  # the engine reuses its request objects
            return hit[1], hit[2]
        plan, eff = self._nccl_scaled_new(req)
        if len(self._nccl_reqs) > 65536:
            self._nccl_reqs.clear()
        self._nccl_reqs[id(req)] = (req, plan, eff)
        return plan, eff

    def _resolve(self, req: CollectiveRequest) -> tuple:
        """(req, plan, bytes, isolated time, per-phase link bytes or None) of a request: what
        ``start`` runs, cached by identity."""
        if self.nccl is not None:
            plan, size = self._nccl_scaled(req)
        else:
            plan, size = self.plan_for(req), float(req.size_bytes)
        hit = (req, plan, size, plan.time_s(size))
        # bounded in entries (a caller that makes a new request per start, as a placed network
        # does, only ever misses)
        if len(self._req_plans) > 65536:
            self._req_plans.clear()
        self._req_plans[id(req)] = hit
        return hit

    def _nccl_scaled_new(self, req: CollectiveRequest) -> tuple[_RPlan, float]:
        plan = self.plan_for(req)
        choice = self.nccl_choice(req)
        size = float(req.size_bytes)
        if choice is None:
            return plan, size
        bw_s = max(choice.bw_time_us, 0.0) * 1e-6
        tau_s = plan.tau_s
        # only this plan's links matter (comparing the whole fabric costs 66K compares per plan at 16K GPUs)
        if not np.array_equal(self.capacity_Bps[plan.links], self.reference_capacity_Bps[plan.links]):
            tau_s = sum(self._isolated(ph.inc, ph.coef, self.reference_capacity_Bps)[0] for ph in plan.phases)
        if tau_s <= 0 or size <= 0:
            lat_us, eff = choice.time_us, 0.0
        else:
            lat_us, eff = choice.latency_us, bw_s / tau_s
        key = (id(plan), round(lat_us, 9))
        rp = self._nccl_plans.get(key)
        if rp is None:
            phases = [replace(ph, lat_s=0.0) for ph in plan.phases]
            rp = replace(plan, phases=phases, overhead_s=lat_us * 1e-6, lat_s=0.0)
            if len(self._nccl_plans) > 65536:
                self._nccl_plans.clear()
            self._nccl_plans[key] = rp
        return rp, eff

    def _route_plan(self, plan: Plan) -> _RPlan:
        self.stats.plans_built += 1
        g = self.graph
        phases = []
        for i, ph in enumerate(plan.phases):
            routes = g.route(ph.src, ph.dst, ph.src_nic, ph.dst_nic)
            inc = _incidence(routes.flow, routes.link, routes.n_flows, g.n_links)
            lat_us = g.path_latency_us(routes)
            net = g.crosses_network(routes)
            a_intra = self.intra_node_latency_us
            if a_intra is None:
                a_intra = float(lat_us[~net].max(initial=0.0))
            a_inter = self.inter_node_latency_us
            if a_inter is None:
                a_inter = float(lat_us[net].max(initial=0.0))
            if not (~net).any() and self.intra_node_latency_us is None:
                a_intra = a_inter
            if not net.any() and self.inter_node_latency_us is None:
                a_inter = a_intra
            lat_s = (ph.steps_intra * a_intra + ph.steps_inter * a_inter) * 1e-6
            coef = ph.coef
            if coef.size == 1 and coef[0] > 0 and inc.nnz:
                # One flow (a p2p pair: most plans in full mode): what _isolated, _link_load and
                # _split_coflows give it, without their general set-up (~0.35 of ~0.6 ms a plan).
                ids = inc.indices.astype(np.int64)  # one column: its rows, sorted, distinct
                c0 = float(coef[0])
                fin = np.array([c0 / float(self.capacity_Bps[ids].min())])
                tau = float(fin[0])
                load = np.full(ids.size, c0)
                rph = _RPhase(inc, coef, lat_s, tau, fin, ids, load)
                rph.coflows = [_Coflow(ids.copy(), load.copy(), c0, load / c0, tau, c0 / tau)]
            else:
                tau, fin = self._isolated(inc, coef)
                ids, load = _link_load(inc, coef)
                rph = _RPhase(inc, coef, lat_s, tau, fin, ids, load)
                rph.coflows = _split_coflows(inc, coef, fin, tau)
            for cf in rph.coflows:
                self._n_coflows += 1
                cf.uid = self._n_coflows
            phases.append(rph)
        links = np.unique(np.concatenate([p.link_ids for p in phases])) if phases else np.zeros(0, np.int64)
        rp = _RPlan(plan.op, plan.algorithm, phases, self.launch_overhead_us * 1e-6, links)
        rp.lat_s = sum(p.lat_s for p in phases)
        rp.tau_s = sum(p.tau_s for p in phases)
        rp.bits = _bitset(links)
        return rp

    def _isolated(self, inc: sp.csc_matrix, coef: np.ndarray, capacity_Bps: np.ndarray | None = None) -> tuple[float, np.ndarray]:
        """Bandwidth time of a phase alone, per byte of size, and each flow's finish time
        (on ``capacity_Bps``, default the links' present capacities)."""
        capacity = self.capacity_Bps if capacity_Bps is None else capacity_Bps
        n = coef.size
        fin = np.zeros(n)
        if n == 0:
            return 0.0, fin
        alive = coef > 0
        fast = _isolated_unshared(inc, coef, alive, capacity)
        if fast is not None:
            return fast
        A = inc.tocsr()
        AT = inc.T.tocsr()
        rem = coef.astype(np.float64).copy()
        t = 0.0
        while alive.any():
            rate = maxmin_rates(A, capacity, alive, AT)
            self.stats.solves += 1
            dt = float(np.min(rem[alive] / rate[alive]))
            t += dt
            rem[alive] -= rate[alive] * dt
            done = alive & (rem <= _DONE_REL * coef)
            fin[done] = t
            alive &= ~done
        return t, fin

    # --- the Network protocol -------------------------------------------------------------

    def collective_time_s(self, req: CollectiveRequest) -> float:
        choice = self.nccl_choice(req)
        if choice is not None:
            # NCCL's time where the fabric is as its tuner assumes (non-blocking, healthy);
            # slower where the flows, at NCCL's rate, cross oversubscribed or degraded links.
            plan, size = self._nccl_scaled(req)
            return max(choice.time_us * 1e-6, plan.time_s(size))
        return self.plan_for(req).time_s(float(req.size_bytes))

    def links_of(self, req: CollectiveRequest) -> np.ndarray | None:
        """The link ids the collective puts bytes on (the engine's exclusivity analysis)."""
        hit = self._req_plans.get(id(req))
        if hit is None or hit[0] is not req:
            hit = self._resolve(req)
        return hit[1].links

    def run_closed_form(self, env: simpy.Environment, req: CollectiveRequest, t0_s: float) -> float | None:
        """Account the collective as run alone from ``t0_s`` (now or later) and return its time,
        with no event: what ``start``'s fast path does for a collective on idle links that no
        other starts on before it ends. The caller guarantees that: no other issuer ever puts
        bytes on these links (``links_of``). None where the fast path is off (``start`` then)."""
        if not self.fast_path:
            return None
        _, plan, size, time_s = self._resolved(env, req)
        if plan.bits & (self._virt_bits | self._real_bits):
            raise RuntimeError(f"{req.dim} {req.op} run in closed form on links another collective holds")
        stats = self.stats
        stats.collectives += 1
        stats.fast_path += 1
        if self._t_first is None or t0_s < self._t_first:
            self._t_first = t0_s
        self._log_isolated_bytes(plan, size)
        t1 = t0_s + time_s
        if t1 > self._t_end:
            self._t_end = t1
        return time_s

    def _resolved(self, env: simpy.Environment, req: CollectiveRequest) -> tuple:
        """The request's (req, plan, bytes, isolated time, link bytes) on this run's environment."""
        if env is not self._env:
            self._reset_dynamic(env)
        hit = self._req_plans.get(id(req))
        if hit is None or hit[0] is not req:
            hit = self._resolve(req)
        return hit

    def _log_isolated_bytes(self, plan: _RPlan, size: float) -> None:
        """The link bytes of a collective that ran alone (its isolated schedule): each phase puts
        ``size * link_coef`` on its links, so only its byte count is summed here, per plan (each
        phase belongs to one plan, so every phase sums the same sizes in the same order as a sum
        per phase did), and the links get ``sum * link_coef`` when link_bytes is read. Per
        collective that is one addition, not a value per link: in full mode one collective stands
        for every replica's flows, and logging per link made the loop's cost per event grow with
        the world (16,384 GPUs: ~0.2 s of a 0.36 s loop). The link totals equal the
        per-collective sums to float rounding (~1e-16)."""
        hit = self._phase_bytes.get(id(plan))
        if hit is None:
            self._phase_bytes[id(plan)] = [plan, size]  # (holds the plan: its id stays its own)
        else:
            hit[1] += size

    def start(self, env: simpy.Environment, req: CollectiveRequest) -> simpy.Event:
        _, plan, size, time_s = self._resolved(env, req)
        now = env.now
        stats = self.stats
        stats.collectives += 1
        if self._t_first is None or now < self._t_first:  # (a collective run in closed form may have set a later one)
            self._t_first = now
        bits = plan.bits
        if self.fast_path and not (bits & self._virt_bits or bits & self._real_bits):
            # every link idle: run in closed form (see the module's "Fast path")
            stats.fast_path += 1
            coll = _Coll(plan, size, env.event(), now, True, False)
            self._virt_bits |= bits
            self._virtuals[coll] = None
            self._unsynced.append(coll)
            if len(self._unsynced) > 2 * len(self._virtuals) + 4096:
                self._unsynced = [v for v in self._unsynced if v.virtual]
            env.timeout(time_s).callbacks.append(partial(self._virtual_done, coll))
            return coll.event
        coll = _Coll(plan, size, env.event(), now, False, False)
        if not self.incremental:
            self._advance()
        if self._virtuals and bits & self._virt_bits:
            # a virtual collective only starts on idle links, so each link has at most one
            # virtual holder; they are materialised in start order
            if len(self._virtuals) <= _SCAN_VIRTUALS_MAX:
                hit = [v for v in self._virtuals if v.plan.bits & bits]
            else:
                hit = self._virtual_owners(plan.links)
            for v in hit:
                self._materialize(v)
        coll.real = True
        self._hold(plan)
        self._enter_phase(coll, 0)
        self._settle()
        return coll.event

    def _virtual_owners(self, links: np.ndarray) -> list[_Coll]:
        """The virtual collectives on these links, in start order, from the link -> owner array
        (full mode at scale runs thousands at once: a scan would test each). The array is written
        here, for the virtual collectives started since the last call that still run: most end
        before any contended start looks."""
        owner = self._virt_owner
        for v in self._unsynced:
            if v.virtual:
                self._vid += 1
                v.vid = self._vid
                self._vid_coll[v.vid] = v
                owner[v.plan.links] = v.vid
        self._unsynced.clear()
        ids = owner[links]
        out = []
        # ids grow in start order; an entry of a virtual collective that has ended is stale
        for vid in np.unique(ids[ids >= 0]).tolist():
            v = self._vid_coll.get(vid)
            if v is not None:
                out.append(v)
        return out

    def _hold(self, plan: _RPlan) -> None:
        held = self._real_plans.get(id(plan))
        if held is None:
            self._real_plans[id(plan)] = [plan, 1]
            self._real_bits |= plan.bits
            self._link_plans[plan.links] += 1  # (a plan's links are unique)
        else:
            held[1] += 1

    def _release(self, plan: _RPlan) -> None:
        held = self._real_plans[id(plan)]
        held[1] -= 1
        if held[1] == 0:
            del self._real_plans[id(plan)]
            # Clear the links no other running plan holds. (An OR over every running plan's
            # bitset cost O(plans x links): full mode at 2,048 GPUs spent 63 us a release.)
            counts = self._link_plans
            counts[plan.links] -= 1
            freed = counts[plan.links] == 0
            if freed.all():
                self._real_bits &= ~plan.bits
            elif freed.any():
                key = (id(plan), np.packbits(freed).tobytes())
                hit = self._freed_bits.get(key)
                if hit is None or hit[0] is not plan:
                    if len(self._freed_bits) > 65536:
                        self._freed_bits.clear()
                    hit = self._freed_bits[key] = (plan, _bitset(plan.links[freed]))
                self._real_bits &= ~hit[1]

    # --- dynamic state --------------------------------------------------------------------

    def _reset_dynamic(self, env: simpy.Environment | None) -> None:
        self._env = env
        n = self.graph.n_links
        # Links held: by virtual collectives (each link by at most one, so a virtual one's end
        # clears its bits with an XOR), and by real ones (_real_bits: the links of the plans in
        # _real_plans, id(plan) -> [plan, real collectives running it]).
        self._virt_bits = 0
        self._real_bits = 0
        self._real_plans: dict[int, list] = {}
        self._link_plans = np.zeros(n, dtype=np.int64)  # link -> plans in _real_plans using it
        # (id(plan), which of its links a release frees) -> their bitset: the same few patterns
        # recur (a pipeline send released while its neighbour's still runs), each a ~20 us build
        self._freed_bits: dict[tuple[int, bytes], tuple[_RPlan, int]] = {}
        self._virtuals: dict[_Coll, None] = {}  # running virtual collectives, in start order
        # link -> id of the virtual collective last written there (stale once it ended), written
        # lazily: _unsynced are the virtual ones started since (see _virtual_owners)
        self._virt_owner = np.full(n, -1, dtype=np.int64)
        self._vid_coll: dict[int, _Coll] = {}
        self._unsynced: list[_Coll] = []
        self._vid = 0
        self._batches: list[Any] = []  # _Batch (per-flow) or _CoBatch (coflow, global solve)
        self._dirty = True
        self._A: sp.csr_matrix | None = None
        self._AT: sp.csr_matrix | None = None
        self._cu_per = np.zeros(0)  # coflow: phase fraction per second per B/s of level
        self._due: list[_CoBatch] = []
        self._rate = np.zeros(0)
        self._t_last = 0.0 if env is None else env.now
        self._gen = 0
        self._link_bytes = np.zeros(n)
        # (link ids, bytes) added to _link_bytes later, in this order (see _flush_bytes)
        self._bytes_log: list[tuple[np.ndarray, np.ndarray]] = []
        self._bytes_log_n = 0  # values in it
        # id(plan) -> [plan, bytes]: the sizes of the collectives run alone, per plan (see
        # _log_isolated_bytes); added to _link_bytes by _flush_bytes
        self._phase_bytes: dict[int, list] = {}
        self._t_first: float | None = None
        self._t_end = 0.0
        # incremental solver: running coflows, their components (link -> component id), the
        # components to re-solve at the end of this event, and a heap of completion times
        self._running: dict[_CoBatch, None] = {}
        # link -> component id where the link binds (see _join), else -1
        self._link_comp = np.full(n, -1, dtype=np.int64)
        # per link: what its running coflows would put on it at their ceilings (B/s), the load
        # past which it binds, and how many running coflows cross it
        # (1-D arrays: fancy indexing on them measured half the cost of rows of one 2-D array)
        self._demand = np.zeros(n)
        self._bind_at = self.capacity_Bps * (1.0 + BIND_REL)
        self._link_n = np.zeros(n, dtype=np.int64)
        # XOR of the seqs of the running coflows on each link: with two there, one's seq gives the other's
        self._link_xor = np.zeros(n, dtype=np.int64)
        self._link_mark = np.zeros(n, dtype=bool)  # scratch for _on_links
        # (link, coflow seq) of every running coflow's links, appended at each join; when full it is
        # rebuilt from the running coflows at twice their size (entries of ended coflows are stale
        # until then): a link that starts to bind finds its coflows here (_on_links).
        # Per-link dicts cost reduced mode, where a coflow crosses ~150 links, 14 % of its run.
        self._inc_link = np.empty(1024, dtype=np.int64)
        self._inc_seq = np.empty(1024, dtype=np.int64)
        self._inc_n = 0
        self._inc_live = 0
        self._by_seq: dict[int, _CoBatch] = {}
        self._comps: dict[int, _Comp] = {}
        self._cid = 0
        self._seq = 0
        self._changed: dict[_Comp, None] = {}
        self._heap: list[tuple] = []
        self._timer_at = float("inf")

    def reset(self) -> None:
        """Forget flows and link statistics (the plan cache is kept)."""
        self._reset_dynamic(None)

    def _virtual_done(self, coll: _Coll, _event: Any = None) -> None:
        if not coll.virtual:
            return  # it was turned into real flows
        coll.virtual = False
        del self._virtuals[coll]
        if coll.vid >= 0:
            del self._vid_coll[coll.vid]
        plan = coll.plan
        # nothing else touched its links while it ran (that would have materialised it)
        self._virt_bits ^= plan.bits
        self._log_isolated_bytes(plan, coll.size)
        # _finish of a collective that is not real
        now = self._env.now
        if now > self._t_end:
            self._t_end = now
        coll.event.succeed()

    def _materialize(self, coll: _Coll) -> None:
        """Turn a virtual collective into real flows where its isolated schedule is now."""
        self.stats.materialized += 1
        env = self._env
        coll.virtual = False
        del self._virtuals[coll]
        if coll.vid >= 0:
            del self._vid_coll[coll.vid]
        plan = coll.plan
        self._virt_bits ^= plan.bits  # it goes on holding its links, as a real one
        coll.real = True
        self._hold(plan)
        tau = env.now - coll.t0
        t = plan.overhead_s
        for p, ph in enumerate(plan.phases):
            lat = ph.lat_s
            if tau < t + lat:
                env.timeout(t + lat - tau).callbacks.append(partial(self._event, partial(self._add_phase_now, coll, p, None)))
                return
            t += lat
            bw = coll.size * ph.tau_s
            if tau < t + bw:
                u = tau - t
                if self.coflow:
                    # the coflow model's isolated schedule: each coflow at its average speed
                    rem = []
                    for cf in ph.coflows:
                        frac = min(max(u / (coll.size * cf.fin_s), 0.0), 1.0)
                        self._add_bytes(cf.link_ids, (coll.size * frac) * cf.link_coef)
                        rem.append(1.0 - frac)
                    self._add_phase_now(coll, p, rem)
                    return
                frac = np.clip(u / np.maximum(coll.size * ph.fin_s, 1e-300), 0.0, 1.0)
                full = coll.size * ph.coef
                carried = full * frac
                self.link_bytes += ph.inc @ carried
                self._add_phase_now(coll, p, full - carried)
                return
            t += bw
            self._add_bytes(ph.link_ids, coll.size * ph.link_coef)
        # its isolated end is exactly now; the completion timeout has not fired yet
        self._finish(coll)

    def _event(self, fn, _event: Any = None) -> None:
        if not self.incremental:
            self._advance()
        fn()
        self._settle()

    def _enter_phase(self, coll: _Coll, p: int) -> None:
        plan = coll.plan
        if p >= len(plan.phases):
            if p == 0 and plan.overhead_s > 0:
                self._env.timeout(plan.overhead_s).callbacks.append(partial(self._event, partial(self._finish, coll)))
            else:
                self._finish(coll)
            return
        delay = plan.phases[p].lat_s + (plan.overhead_s if p == 0 else 0.0)
        if delay > 0:
            self._env.timeout(delay).callbacks.append(partial(self._event, partial(self._add_phase_now, coll, p, None)))
        else:
            self._add_phase_now(coll, p, None)

    def _add_phase_now(self, coll: _Coll, p: int, rem: Any) -> None:
        ph = coll.plan.phases[p]
        if self.coflow:
            fracs = [1.0] * len(ph.coflows) if rem is None else rem
            left = [0]
            for cf, frac in zip(ph.coflows, fracs):
                if frac > _DONE_REL and coll.size > 0:
                    b = _CoBatch(coll, p, cf, left, frac)
                    if self.incremental:
                        self._join(b)
                    else:
                        self._batches.append(b)
                    left[0] += 1
            if left[0] == 0:
                self._phase_done(coll, p)
            self._dirty = True
            return
        bytes0 = coll.size * ph.coef
        rem = bytes0.copy() if rem is None else rem
        alive = rem > _DONE_REL * bytes0 + 1e-9
        if not alive.any():
            self._phase_done(coll, p)
            return
        self._batches.append(_Batch(coll, p, ph.inc, rem, bytes0, alive))
        self._dirty = True

    def _phase_done(self, coll: _Coll, p: int) -> None:
        self._enter_phase(coll, p + 1)

    def _finish(self, coll: _Coll) -> None:
        if coll.real:
            coll.real = False
            self._release(coll.plan)
        self._t_end = max(self._t_end, self._env.now)
        coll.event.succeed()

    def _advance(self) -> None:
        now = self._env.now if self._env is not None else 0.0
        dt = now - self._t_last
        if dt > 0 and self._rate.size:
            moved = self._rate * dt
            if self.coflow:
                for b, m in zip(self._batches, moved.tolist()):
                    b.rem -= m
                    b.carried += m
            else:
                off = 0
                for b in self._batches:
                    n = b.rem.size
                    b.rem -= moved[off:off + n]
                    off += n
                self.link_bytes += self._A @ moved
        self._t_last = now

    def _collect_done(self) -> bool:
        changed = False
        keep = []
        finished = []
        for b in self._batches:
            done = b.alive & (b.rem <= _DONE_REL * b.bytes0 + 1e-9)
            if done.any():
                changed = True
                b.alive &= ~done
                b.rem[done] = 0.0
            if b.alive.any():
                keep.append(b)
            else:
                finished.append(b)
        if finished:
            self._batches = keep
            self._dirty = True
            for b in finished:
                self._phase_done(b.coll, b.phase)
        return changed

    def _collect_done_coflow(self) -> bool:
        finished = [b for b in self._batches if b.due or b.rem <= _DONE_REL]
        if not finished:
            return False
        self._batches = [b for b in self._batches if not (b.due or b.rem <= _DONE_REL)]
        self._dirty = True
        for b in finished:
            b.carried += max(b.rem, 0.0)  # the sliver the clock's rounding left
            self._account(b)
            b.left[0] -= 1
            if b.left[0] == 0:
                self._phase_done(b.coll, b.phase)
        return True

    def _account(self, b: _CoBatch) -> None:
        # Link bytes of a running coflow are added when it ends or someone reads link_bytes,
        # not at every event: the event loop then touches no per-link array.
        if b.carried > 0:
            self._add_bytes(b.cf.link_ids, (b.coll.size * b.carried) * b.cf.link_coef)
            b.carried = 0.0

    @property
    def link_bytes(self) -> np.ndarray:
        """Bytes each link has carried so far (running phases up to the last event)."""
        if self.incremental:
            now = self._env.now if self._env is not None else 0.0
            for b in self._running:
                b.bring_to(now)
                self._account(b)
        elif self.coflow:
            for b in self._batches:
                self._account(b)
        self._flush_bytes()
        return self._link_bytes

    @link_bytes.setter
    def link_bytes(self, value: np.ndarray) -> None:
        self._bytes_log.clear()  # (the getter, which computed value, flushed it)
        self._bytes_log_n = 0
        self._link_bytes = value

    def _add_bytes(self, ids: np.ndarray, b: np.ndarray) -> None:
        self._bytes_log.append((ids, b))
        self._bytes_log_n += ids.size
        if self._bytes_log_n >= _BYTES_LOG_MAX:
            self._flush_bytes()

    def _flush_bytes(self) -> None:
        """Add the logged bytes to _link_bytes: the per-phase sums of collectives run alone
        (_log_isolated_bytes), then the log of contended ones. np.add.at adds the log element by
        element in its order, so every link sums those bytes in the order they came, as one
        ``+=`` per entry did (the same floats), for one numpy call per batch instead of four per entry."""
        acc = self._phase_bytes
        if acc:
            lb = self._link_bytes
            for plan, size in acc.values():
                for ph in plan.phases:
                    lb[ph.link_ids] += size * ph.link_coef  # (a phase's link ids are distinct)
            acc.clear()
        log = self._bytes_log
        if len(log) == 1:
            ids, b = log[0]
            self._link_bytes[ids] += b
        elif log:
            np.add.at(self._link_bytes, np.concatenate([e[0] for e in log]), np.concatenate([e[1] for e in log]))
        log.clear()
        self._bytes_log_n = 0

    def _settle(self) -> None:
        if self.incremental:
            self._settle_incremental()
            return
        if self.coflow:
            self._settle_coflow()
            return
        while self._collect_done():
            pass
        if not self._batches:
            self._rate = np.zeros(0)
            self._A = None
            self._gen += 1
            return
        if self._dirty:
            import scipy.sparse as sp  # (see the note at the imports)

            A = sp.hstack([b.inc for b in self._batches], format="csc")
            self._A = A.tocsr()
            self._AT = A.T.tocsr()
            self._dirty = False
        alive = np.concatenate([b.alive for b in self._batches])
        rem = np.concatenate([b.rem for b in self._batches])
        t0 = time.perf_counter()
        rate = maxmin_rates(self._A, self.capacity_Bps, alive, self._AT)
        self.stats.solves += 1
        self.stats.solve_s += time.perf_counter() - t0
        self._rate = rate
        dt = float(np.min(rem[alive] / rate[alive]))
        self._gen += 1
        self._env.timeout(max(dt, 0.0)).callbacks.append(partial(self._on_timer, self._gen))

    def _settle_coflow(self) -> None:
        while self._collect_done_coflow():
            pass
        batches = self._batches
        if not batches:
            self._rate = np.zeros(0)
            self._gen += 1
            return
        t0 = time.perf_counter()
        if self._dirty:
            # fraction of the coflow per second at a level of 1 B/s per flow
            self._cu_per = 1.0 / np.array([b.coll.size * b.cf.flow_coef for b in batches])
            self._dirty = False
        rate = self._coflow_levels(batches) * self._cu_per
        self.stats.solves += 1
        self.stats.solved_coflows += len(batches)
        self.stats.solve_s += time.perf_counter() - t0
        self._rate = rate
        rem = np.array([b.rem for b in batches])
        fin = rem / rate
        dt = float(fin.min())
        # the coflows that end at the timer are marked rather than re-tested against a
        # tolerance: the clock's rounding must not leave one a sliver short
        due = fin <= dt * (1 + 1e-9)
        self._due = [b for b, d in zip(batches, due.tolist()) if d]
        self._gen += 1
        self._env.timeout(max(dt, 0.0)).callbacks.append(partial(self._on_timer, self._gen))

    def _coflow_levels(self, batches: list[_CoBatch]) -> np.ndarray:
        """Max-min level (B/s per flow) of each running coflow.

        Coflows that share no link (through any chain of others) do not affect each other, so
        the running coflows split into connected components, each solved on its own. A
        component's levels depend only on which coflows form it, not on sizes or progress, and
        a training step repeats the same few overlaps every micro-batch (DeepSeek-V3 at 15,360
        samples: 138 distinct components over 18,000 events), so they are memoised by the
        coflows' identities; the plan cache keeps them alive, and each entry holds them.
        """
        cfs = [b.cf for b in batches]
        level = np.empty(len(cfs))
        comps: list[list] = []  # [link bitset, member indices]
        for i, cf in enumerate(cfs):
            bits = cf.link_bits
            if bits is None:
                bits = cf.link_bits = _bitset(cf.link_ids)
            hit = [c for c in comps if c[0] & bits]
            if not hit:
                comps.append([bits, [i]])
                continue
            first = hit[0]
            first[0] |= bits
            first[1].append(i)
            for c in hit[1:]:
                first[0] |= c[0]
                first[1] += c[1]
                comps.remove(c)
        for _, members in comps:
            level[members] = self._component_levels([cfs[i] for i in members])
        return level

    # --- incremental solver (coflow model) ------------------------------------------------
    #
    # Only the running coflows that share links with a starting or ending one can change rate
    # (max-min on disjoint link sets is independent), so the fabric keeps the running coflows
    # in connected components (link -> component id in _link_comp) and, at the end of an
    # event, re-solves only the components the event changed. Every coflow advances lazily
    # at its own constant rate between its component's re-solves; its completion time sits in
    # a heap, and one SimPy timer points at the earliest. The work of an event is that of the
    # components it touches, not of everything running (full mode at scale: thousands of
    # independent TP/PP components at once). Levels are the same as the global solve's
    # (tests/test_fabric_incremental.py compares the two).

    def _join(self, b: _CoBatch) -> None:
        now = self._env.now
        self._seq += 1
        b.seq = self._seq
        cf = b.cf
        b.cu_per = 1.0 / (b.coll.size * cf.flow_coef)
        b.t_set = now
        self._running[b] = None
        ids = cf.link_ids
        dem = cf.link_demand
        if dem is None:
            dem = cf.link_demand = cf.link_flows * cf.ceil_Bps
        # Coflows are coupled only through links that bind: where the running coflows' demand
        # at their ceilings exceeds the capacity. On any other link every coflow can run at its
        # ceiling whatever the others do, so the link never limits max-min and the solution is
        # that of the problem without it (exact). Components are therefore connected through
        # binding links only: in full mode most links a DP ring shares with a PP send have room
        # for both, and components over every shared link grew with the world (4.5x larger at
        # 1,024 GPUs, members weighted; 28 % of the run at 8,192 GPUs went to re-solving them).
        if not np.count_nonzero(self._link_n[ids]):
            # Alone on every link (half the joins in reduced mode): nothing to merge, and it binds
            # no link, its ceiling being its isolated rate on these links. A link without running
            # coflows holds demand 0.0 and XOR 0 exactly (see _leave), so these are the sums.
            self._demand[ids] = dem
            self._link_n[ids] = 1
            self._link_xor[ids] = b.seq
            self._register(b)
            self._cid += 1
            comp = _Comp(self._cid, {b: None})
            self._comps[comp.cid] = comp
            b.comp = comp
            self._changed[comp] = None
            return
        bind_at = self._bind_at[ids]
        load = self._demand[ids]
        was = load > bind_at
        load += dem
        self._demand[ids] = load
        binds = load > bind_at
        self._link_n[ids] += 1
        self._link_xor[ids] ^= b.seq
        lc = self._link_comp
        # the components on its binding links: one per link that bound already (all its coflows
        # are in one component), every coflow's on a link this join makes bind
        # (np.count_nonzero: a C call; ndarray.any() costs a ufunc reduction, 5 us a call here)
        hit = set(lc[ids[was]].tolist()) if np.count_nonzero(was) else set()
        fresh = binds & ~was
        if np.count_nonzero(fresh):
            for m in self._on_links(ids[fresh], b.seq):
                hit.add(m.comp.cid)
        hit.discard(-1)
        self._register(b)
        if not hit:
            self._cid += 1
            comp = _Comp(self._cid, {})
            self._comps[comp.cid] = comp
        else:
            comps = [self._comps[c] for c in sorted(hit)]
            comp = max(comps, key=lambda c: len(c.members))
            for other in comps:
                if other is comp:
                    continue
                # the merged component keeps the joining order of both; the other's binding
                # links point at it now
                o_ids = np.concatenate([m.cf.link_ids for m in other.members])
                lc[o_ids[lc[o_ids] == other.cid]] = comp.cid
                comp.members.update(other.members)
                for m in other.members:
                    m.comp = comp
                del self._comps[other.cid]
                self._changed.pop(other, None)
            if len(comps) > 1:
                comp.members = dict(sorted(comp.members.items(), key=lambda kv: kv[0].seq))
        if np.count_nonzero(binds):
            lc[ids[binds]] = comp.cid
        comp.members[b] = None
        b.comp = comp
        self._changed[comp] = None

    def _register(self, b: _CoBatch) -> None:
        """Add a joining coflow's links to the (link, seq) table."""
        ids = b.cf.link_ids
        k = ids.size
        self._by_seq[b.seq] = b
        if self._inc_n + k > self._inc_link.size:
            live = [m for m in self._running if m is not b]
            need = max(1024, 2 * (self._inc_live + k))
            if need > self._inc_link.size:
                self._inc_link = np.empty(need, dtype=np.int64)
                self._inc_seq = np.empty(need, dtype=np.int64)
            n = 0
            if live:
                links = np.concatenate([m.cf.link_ids for m in live])
                n = links.size
                self._inc_link[:n] = links
                self._inc_seq[:n] = np.repeat([m.seq for m in live], [m.cf.link_ids.size for m in live])
            self._inc_n = n
        n = self._inc_n
        self._inc_link[n:n + k] = ids
        self._inc_seq[n:n + k] = b.seq
        self._inc_n = n + k
        self._inc_live += k

    def _on_links(self, links: np.ndarray, seq: int) -> list[_CoBatch]:
        """The running coflows other than the joining one (seq, not yet registered) that cross
        any of these links, which it has joined."""
        by_seq = self._by_seq
        two = self._link_n[links] == 2
        # a link it shares with one other coflow names that one: its XOR less the joiner's seq
        out = dict.fromkeys((self._link_xor[links[two]] ^ seq).tolist())
        more = links[~two]
        if more.size:
            n = self._inc_n
            mark = self._link_mark
            mark[more] = True
            hit = mark[self._inc_link[:n]]
            mark[more] = False
            out.update(dict.fromkeys(np.unique(self._inc_seq[:n][hit]).tolist()))
        return [by_seq[q] for q in out if q in by_seq]

    def _leave(self, gone: list[_CoBatch]) -> None:
        """Take finished coflows out of their components; split what is left where it falls apart."""
        by_comp: dict[_Comp, list[_CoBatch]] = {}
        demand, count, xor = self._demand, self._link_n, self._link_xor
        for b in gone:
            by_comp.setdefault(b.comp, []).append(b)
            b.comp = None
            b.done = True
            del self._running[b]
            del self._by_seq[b.seq]
            ids = b.cf.link_ids
            self._inc_live -= ids.size
            n = count[ids] - 1
            count[ids] = n
            if not np.count_nonzero(n):  # it was alone on every link: they hold nothing now
                demand[ids] = 0.0
                xor[ids] = 0
                continue
            xor[ids] ^= b.seq
            load = demand[ids] - b.cf.link_demand
            load[n == 0] = 0.0  # no drift left from the running sums
            demand[ids] = load
        lc = self._link_comp
        for comp, left in by_comp.items():
            for b in left:
                del comp.members[b]
            if len(left) > 1 or comp.members:
                # (a component of one coflow has no binding link: a link binds only with two on it)
                for b in left:
                    lc[b.cf.link_ids] = -1  # links still binding are pointed at again below
            rest = list(comp.members)
            if not rest:
                del self._comps[comp.cid]
                self._changed.pop(comp, None)
                continue
            self._split(comp, rest)

    def _split(self, comp: _Comp, rest: list[_CoBatch]) -> None:
        """Re-point the binding links of ``rest`` (what is left of ``comp``) and split it into the
        parts its binding links still connect."""
        lc = self._link_comp
        self._changed[comp] = None
        if len(rest) == 1:
            ids = rest[0].cf.link_ids
            lc[ids] = np.where(self._demand[ids] > self._bind_at[ids], comp.cid, -1)
            return
        sizes = np.fromiter((m.cf.link_ids.size for m in rest), dtype=np.int64, count=len(rest))
        ids = np.concatenate([m.cf.link_ids for m in rest])
        owner = np.repeat(np.arange(len(rest)), sizes)
        binds = self._demand[ids] > self._bind_at[ids]
        lc[ids[~binds]] = -1
        b_ids, b_own = ids[binds], owner[binds]
        # union-find over the binding links (few: most links have room for all their coflows)
        parent = list(range(len(rest)))
        first: dict[int, int] = {}
        for l, i in zip(b_ids.tolist(), b_own.tolist()):
            j = first.setdefault(l, i)
            if j != i:
                _join_roots(parent, i, j)
        n_sub, labels = _labels(parent)
        if n_sub == 1:
            lc[b_ids] = comp.cid
            return
        # the largest part keeps the component's id; the others become new components
        counts = [0] * n_sub
        for k in labels:
            counts[k] += 1
        big = counts.index(max(counts))
        parts: dict[int, _Comp] = {}
        for m, k in zip(rest, labels):
            if k == big:
                continue
            part = parts.get(k)
            if part is None:
                self._cid += 1
                part = parts[k] = _Comp(self._cid, {})
                self._comps[part.cid] = part
                self._changed[part] = None
            del comp.members[m]
            part.members[m] = None
            m.comp = part
        cid_of = np.full(n_sub, comp.cid, dtype=np.int64)
        for k, part in parts.items():
            cid_of[k] = part.cid
        lc[b_ids] = cid_of[np.asarray(labels, dtype=np.int64)[b_own]]

    def _settle_incremental(self) -> None:
        now = self._env.now
        heap = self._heap
        for comp in self._changed:
            members = list(comp.members)
            level = self._component_level_list([m.cf for m in members])
            self.stats.solves += 1
            self.stats.solved_coflows += len(members)
            for m, lv in zip(members, level):
                rate = lv * m.cu_per
                if rate == m.rate and m.gen:
                    continue  # same rate: its completion entry stands
                m.bring_to(now)
                m.rate = rate
                m.gen += 1
                heapq.heappush(heap, (now + m.rem / rate, m.seq, m.gen, now, m))
        self._changed.clear()
        while heap and (heap[0][4].done or heap[0][2] != heap[0][4].gen):
            heapq.heappop(heap)
        if len(heap) > 4 * len(self._running) + 1024:
            self._heap = heap = [e for e in heap if not e[4].done and e[2] == e[4].gen]
            heapq.heapify(heap)
        self._gen += 1
        if not heap:
            self._timer_at = float("inf")
            return
        self._timer_at = t = heap[0][0]
        self._env.timeout(max(t - now, 0.0)).callbacks.append(partial(self._on_timer, self._gen))

    def _on_timer_incremental(self) -> None:
        t = self._timer_at
        heap = self._heap
        due = []
        # the coflows whose completion falls at this timer, up to the clock's rounding
        while heap:
            t_fin, _, gen, t0, b = heap[0]
            if b.done or gen != b.gen:
                heapq.heappop(heap)
                continue
            if t_fin > t + 1e-9 * (t_fin - t0):
                break
            heapq.heappop(heap)
            due.append(b)
        if due:
            now = self._env.now
            due.sort(key=lambda b: b.seq)
            for b in due:
                b.bring_to(now)
                b.carried += max(b.rem, 0.0)  # the sliver the clock's rounding left
                b.rem = 0.0
            self._leave(due)
            for b in due:
                self._account(b)
                b.left[0] -= 1
                if b.left[0] == 0:
                    self._phase_done(b.coll, b.phase)
        self._settle()

    def _cache_levels(self, key: tuple, hit: tuple) -> None:
        """Keep a component's levels; the cache is emptied when it holds LEVEL_CACHE_ENTRIES
        components or LEVEL_CACHE_MEMBERS coflows in all. (Components grow with the world in full
        mode: counted by entries alone, at 16,384 GPUs it held gigabytes of keys.)"""
        cache = self._level_cache
        if len(cache) >= LEVEL_CACHE_ENTRIES or self._level_cache_members + len(key) > LEVEL_CACHE_MEMBERS:
            cache.clear()
            self._level_cache_members = 0
        cache[key] = hit
        self._level_cache_members += len(key)

    def _component_levels(self, cfs: list[_Coflow]) -> np.ndarray:
        """Max-min levels (B/s per flow) of one connected component of running coflows,
        memoised by the coflows' identities (see _coflow_levels)."""
        if len(cfs) == 1:
            return np.array([cfs[0].ceil_Bps])  # alone: its isolated speed
        order = sorted(range(len(cfs)), key=lambda i: (cfs[i].uid, id(cfs[i])))
        group = tuple(cfs[i] for i in order)
        key = tuple(map(id, group))
        hit = self._level_cache.get(key)
        if hit is None:
            hit = (self._solve_component(group), group)
            self._cache_levels(key, hit)
        level = np.empty(len(cfs))
        level[order] = hit[0]
        return level

    def _component_level_list(self, cfs: list[_Coflow]) -> list[float]:
        """``_component_levels`` as Python floats (the same values), without numpy on a few numbers."""
        if len(cfs) == 1:
            return [cfs[0].ceil_Bps]
        # Sorted by (uid, id), ties in list order: the order a stable sort by (uid, id) gives,
        # from tuples compared in C rather than a key function called per coflow (components
        # grow with the world in full mode, and are re-keyed at every change).
        keyed = sorted(zip([cf.uid for cf in cfs], map(id, cfs), range(len(cfs))))
        order = [k[2] for k in keyed]
        key = tuple([k[1] for k in keyed])
        hit = self._level_cache.get(key)
        if hit is None:
            group = tuple(cfs[i] for i in order)
            hit = (self._solve_component(group), group)
            self._cache_levels(key, hit)
        if len(hit) == 2:  # first use as a list: keep the floats beside the array
            hit = self._level_cache[key] = hit + (hit[0].tolist(),)
        lv = hit[2]
        level = [0.0] * len(cfs)
        for j, i in enumerate(order):
            level[i] = lv[j]
        return level

    def _solve_component(self, cfs: tuple[_Coflow, ...]) -> np.ndarray:
        n = len(cfs)
        sizes = np.fromiter((cf.link_ids.size for cf in cfs), dtype=np.int64, count=n)
        ids = np.concatenate([cf.link_ids for cf in cfs])
        val = np.concatenate([cf.link_flows for cf in cfs])
        col = np.repeat(np.arange(n), sizes)
        # only the links the component uses: nothing here is as long as the fabric
        links, pos = np.unique(ids, return_inverse=True)
        cap = self.capacity_Bps[links]
        # Links with the same capacity and the same load from every phase (all GPU uplinks of
        # an all-to-all, say) fill together: one row stands for all, which turns thousands of
        # rows into tens. Rows whose hashes differ only by rounding merely stay separate.
        if self._hash_w.size <= n:
            self._hash_w = np.random.default_rng(12345).random(2 * n + 1) + 0.5
        h = np.bincount(pos, weights=val * self._hash_w[col], minlength=links.size) + (cap / cap.max()) * self._hash_w[-1]
        _, rows = np.unique(h, return_index=True)
        row_of = np.full(links.size, -1, dtype=np.int64)
        row_of[rows] = np.arange(rows.size)
        r = row_of[pos]
        keep = r >= 0
        K = np.zeros((rows.size, n))
        K[r[keep], col[keep]] = val[keep]
        ceil = np.array([cf.ceil_Bps for cf in cfs])
        return maxmin_dense(K, cap[rows], ceil)

    def _on_timer(self, gen: int, _event: Any = None) -> None:
        if gen != self._gen:
            return
        if self.incremental:
            self._on_timer_incremental()
            return
        self._advance()
        if self.coflow:
            for b in self._due:
                b.due = True
        self._settle()

    # --- reports ----------------------------------------------------------------------------

    @property
    def span_s(self) -> float:
        if self._t_first is None:
            return 0.0
        return max(self._t_end - self._t_first, 0.0)

    def link_utilization(self, duration_s: float | None = None) -> np.ndarray:
        """Bytes carried / (raw capacity x duration); the duration defaults to the time from
        the first collective's start to the last one's end."""
        span = self.span_s if duration_s is None else float(duration_s)
        cap = self.graph.link_capacity_GBps * 1e9
        with np.errstate(divide="ignore", invalid="ignore"):
            u = np.where((cap > 0) & (span > 0), self.link_bytes / (cap * max(span, 1e-300)), 0.0)
        return u

    def link_report(self, top: int = 10, duration_s: float | None = None) -> list[dict]:
        """The busiest links: name, kind, capacity, bytes carried and utilization over
        duration_s (the engine passes the step time)."""
        util = self.link_utilization(duration_s)
        used = np.nonzero(self.link_bytes > 0)[0]
        order = used[np.argsort(-util[used], kind="stable")][:top]
        g = self.graph
        return [
            {
                "link": int(l),
                "name": g.link_name(int(l)),
                "kind": LINK_KINDS[int(g.link_kind[l])],
                "capacity_GBps": float(g.link_capacity_GBps[l]),
                "bytes": float(self.link_bytes[l]),
                "utilization": float(util[l]),
            }
            for l in order
        ]

    def link_summary(self, duration_s: float | None = None) -> list[dict]:
        """Per link kind: links used, total bytes, mean and max utilization."""
        util = self.link_utilization(duration_s)
        g = self.graph
        out = []
        for k, name in enumerate(LINK_KINDS):
            sel = (g.link_kind == k) & (g.link_capacity_GBps > 0)
            if not sel.any():
                continue
            out.append({
                "kind": name,
                "links": int(sel.sum()),
                "bytes": float(self.link_bytes[sel].sum()),
                "mean_utilization": float(util[sel].mean()),
                "max_utilization": float(util[sel].max()),
            })
        return out


def nccl_model_for(spec: TopologySpec, profile: Any):
    """NCCL's cost model for a GPU profile on a switched fabric; None for CPU ranks and tori
    (NCCL's tuner describes NVLink/NVSwitch nodes and NICs)."""
    from simulator.network.nccl import NcclModel

    if getattr(spec.fabric, "kind", "") == "torus":
        return None
    return NcclModel.from_specs(spec.node, profile)


def comm_kwargs(profile: Any) -> dict[str, Any]:
    """FlowNetwork keyword arguments from a GPU profile (simulator.profile.Profile):
    its ``comm`` model has exactly these fields."""
    comm = getattr(profile, "comm", profile)
    return {
        "nvlink_efficiency": comm.nvlink_efficiency,
        "nic_efficiency": comm.nic_efficiency,
        "intra_node_latency_us": comm.intra_node_latency_us,
        "inter_node_latency_us": comm.inter_node_latency_us,
        "launch_overhead_us": comm.launch_overhead_us,
    }
