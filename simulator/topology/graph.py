"""A topology as a graph of GPUs, NVSwitches, NICs and switches (or torus links), for a given
GPU count, with vectorised routing.

Links are directed (each direction of a cable is its own link) and live in flat numpy arrays:
``link_src``/``link_dst`` (vertex ids), ``link_capacity_GBps``, ``link_latency_us`` and
``link_class`` (0: inside a node, NVLink; 1: the scale-out network), so the flow solver never
touches Python objects per link.

Routing (stated once, used everywhere):

- Inside a node: GPU -> NVSwitch -> GPU (two links).
- Across nodes on a Clos (fat-tree, leaf-spine(-core), rail-optimized): NIC -> leaf ->
  [spine layer of the pod -> [core -> spine layer of the other pod] ->] leaf -> NIC, going only
  as high as needed. The parallel uplinks of a switch are one *trunk* link per direction whose
  capacity is their sum: a flow is spread evenly over all equal-cost uplinks (per-flow
  spreading, i.e. ideal adaptive routing / packet spraying), so there are no ECMP hash
  collisions. The NIC a GPU uses is its PCIe-affine one (GPU i of a node with K NICs: NIC
  i*K//gpus_per_node) unless a collective algorithm pins a channel to a rail (NCCL's rings and
  trees do). The GPU->NIC PCIe hop is not a link: it is never the bottleneck on these systems.
- Torus: dimension-ordered routing (x, then y, then z), the shorter way round each ring
  (ties go the + way); without wrap-around, the only way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

# scipy.sparse is imported where a matrix is built, not at the top: it takes ~0.3 s (with the
# numpy.f2py its array-API shim loads), and only the flow model needs it.
if TYPE_CHECKING:
    import scipy.sparse as sp

from simulator.errors import UserError
from simulator.topology.spec import (
    FatTreeFabric,
    RailOptimizedFabric,
    SingleNodeFabric,
    TopologySpec,
    TorusFabric,
)

LINK_INTRA = 0  # NVLink / NVSwitch (or loopback): scaled by nvlink_efficiency
LINK_NETWORK = 1  # NICs, switch trunks, torus links: scaled by nic_efficiency

# link kinds, for reports
LINK_KINDS = ("gpu->nvswitch", "nvswitch->gpu", "nic->leaf", "leaf->nic", "leaf->spine", "spine->leaf",
              "spine->core", "core->spine", "torus")


@dataclass
class Routes:
    """Paths of many flows, as COO pairs (flow index, link id)."""

    n_flows: int
    flow: np.ndarray
    link: np.ndarray

    def incidence(self, n_links: int) -> sp.csc_matrix:
        """links x flows, 1 where the flow crosses the link."""
        import scipy.sparse as sp  # (see the note at the imports)

        data = np.ones(self.flow.size, dtype=np.float64)
        m = sp.csc_matrix((data, (self.link, self.flow)), shape=(n_links, self.n_flows))
        m.sum_duplicates()
        m.data[:] = 1.0
        return m


@dataclass
class TopologyGraph:
    spec: TopologySpec
    n_gpus: int
    gpus_per_node: int
    vertex_kind: list[str]
    vertex_index: np.ndarray  # index of the vertex within its kind
    link_src: np.ndarray
    link_dst: np.ndarray
    link_capacity_GBps: np.ndarray
    link_latency_us: np.ndarray
    link_class: np.ndarray
    link_kind: np.ndarray  # index into LINK_KINDS
    gpu_node: np.ndarray
    # Clos only
    nics_per_node: int = 0
    nic_leaf: np.ndarray | None = None
    leaf_pod: np.ndarray | None = None
    _ids: dict = field(default_factory=dict)  # first link id of each link block
    # Torus only
    torus_dims: tuple[int, ...] = ()

    @property
    def n_links(self) -> int:
        return int(self.link_src.size)

    @property
    def n_nodes(self) -> int:
        return int(self.gpu_node[-1]) + 1 if self.n_gpus else 0

    @property
    def is_torus(self) -> bool:
        return bool(self.torus_dims)

    @cached_property
    def gpu_coords(self) -> np.ndarray:
        """Torus coordinates of each GPU, shape (n_gpus, ndim); x varies fastest."""
        dims = self.torus_dims
        return np.stack(np.unravel_index(np.arange(self.n_gpus), dims[::-1])[::-1], axis=1)

    def affinity_nic(self, gpu: np.ndarray) -> np.ndarray:
        """Local index of the NIC on the GPU's PCIe switch."""
        local = np.asarray(gpu) % self.gpus_per_node
        return local * self.nics_per_node // self.gpus_per_node

    def vertex_name(self, v: int) -> str:
        return f"{self.vertex_kind[v]}{int(self.vertex_index[v])}"

    def link_name(self, link: int) -> str:
        return f"{self.vertex_name(int(self.link_src[link]))}->{self.vertex_name(int(self.link_dst[link]))}"

    # --- routing -------------------------------------------------------------------------

    def route(self, src: np.ndarray, dst: np.ndarray, src_nic: np.ndarray | None = None,
              dst_nic: np.ndarray | None = None) -> Routes:
        """Paths of flows src[i] -> dst[i] (GPU ids, src != dst), vectorised.

        src_nic / dst_nic: local NIC index to use at each end of a flow that leaves the node,
        -1 (or None) for the GPU's affine NIC. Ignored on a torus.
        """
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        if self.is_torus:
            return self._route_torus(src, dst)
        return self._route_clos(src, dst, src_nic, dst_nic)

    def _route_clos(self, src, dst, src_nic, dst_nic) -> Routes:
        n = src.size
        ids = self._ids
        fidx = np.arange(n, dtype=np.int64)
        intra = self.gpu_node[src] == self.gpu_node[dst]
        flows = [fidx[intra], fidx[intra]]
        links = [ids["gpu_up"] + src[intra], ids["gpu_down"] + dst[intra]]
        inter = ~intra
        if inter.any():
            if "nic_up" not in ids:
                raise UserError(
                    f"topology {self.spec.name!r} is one node of {self.gpus_per_node} GPUs but a flow "
                    "crosses nodes: use a multi-node fabric kind or fewer GPUs"
                )
            f = fidx[inter]
            s, d = src[inter], dst[inter]
            ns = self._nic_choice(s, None if src_nic is None else np.asarray(src_nic)[inter])
            nd = self._nic_choice(d, None if dst_nic is None else np.asarray(dst_nic)[inter])
            flows += [f, f]
            links += [ids["nic_up"] + ns, ids["nic_down"] + nd]
            ls, ld = self.nic_leaf[ns], self.nic_leaf[nd]
            xl = ls != ld
            flows += [f[xl], f[xl]]
            links += [ids["leaf_up"] + ls[xl], ids["leaf_down"] + ld[xl]]
            ps, pd = self.leaf_pod[ls], self.leaf_pod[ld]
            xp = ps != pd
            if xp.any():
                flows += [f[xp], f[xp]]
                links += [ids["pod_up"] + ps[xp], ids["pod_down"] + pd[xp]]
        return Routes(n, np.concatenate(flows), np.concatenate(links))

    def _nic_choice(self, gpu: np.ndarray, local_nic: np.ndarray | None) -> np.ndarray:
        """Global NIC id used by each GPU."""
        aff = self.affinity_nic(gpu)
        if local_nic is not None:
            local_nic = np.asarray(local_nic, dtype=np.int64)
            aff = np.where(local_nic >= 0, local_nic % self.nics_per_node, aff)
        return self.gpu_node[gpu] * self.nics_per_node + aff

    def _route_torus(self, src, dst) -> Routes:
        dims = self.torus_dims
        nd = len(dims)
        wrap = self.spec.fabric.wraparound
        coords = self.gpu_coords
        cur = coords[src].copy()
        tgt = coords[dst]
        strides = np.cumprod((1,) + tuple(dims[:-1]))
        fidx = np.arange(src.size, dtype=np.int64)
        flows, links = [], []
        for d in range(nd):
            e = dims[d]
            if e == 1:
                continue
            delta = (tgt[:, d] - cur[:, d]) % e
            if wrap:
                plus = delta <= e // 2
                hops = np.where(plus, delta, e - delta)
            else:
                plus = tgt[:, d] >= cur[:, d]
                hops = np.abs(tgt[:, d] - cur[:, d])
            step = np.where(plus, 1, -1)
            for h in range(int(hops.max(initial=0))):
                m = hops > h
                gpu = cur[m] @ strides
                # link id = (gpu * ndim + d) * 2 + (0 for +, 1 for -)
                links.append((gpu * nd + d) * 2 + (~plus[m]).astype(np.int64))
                flows.append(fidx[m])
                cur[m, d] = (cur[m, d] + step[m]) % e
        if not flows:
            return Routes(src.size, np.zeros(0, np.int64), np.zeros(0, np.int64))
        return Routes(src.size, np.concatenate(flows), np.concatenate(links))

    def path_latency_us(self, routes: Routes) -> np.ndarray:
        return np.bincount(routes.flow, weights=self.link_latency_us[routes.link], minlength=routes.n_flows)

    def crosses_network(self, routes: Routes) -> np.ndarray:
        """Per flow: does its path use a scale-out (network-class) link."""
        return np.bincount(routes.flow, weights=self.link_class[routes.link], minlength=routes.n_flows) > 0


# --- building ------------------------------------------------------------------------------


def build_graph(spec: TopologySpec, n_gpus: int) -> TopologyGraph:
    """The graph of ``spec`` with ``n_gpus`` GPUs (the last node may be partly filled)."""
    if n_gpus < 1:
        raise UserError(f"GPU count {n_gpus} must be at least 1")
    fab = spec.fabric
    if isinstance(fab, TorusFabric):
        return _build_torus(spec, fab, n_gpus)
    if isinstance(fab, SingleNodeFabric) and n_gpus > spec.node.gpus_per_node:
        raise UserError(
            f"{n_gpus} GPUs do not fit topology {spec.name!r} (single-node, {spec.node.gpus_per_node} per node): "
            f"use at most {spec.node.gpus_per_node} or a multi-node fabric"
        )
    return _build_clos(spec, fab, n_gpus)


class _Builder:
    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.index: list[np.ndarray] = []
        self.n_vertices = 0
        self.blocks: list[tuple] = []
        self.n_links = 0
        self.ids: dict[str, int] = {}

    def vertices(self, kind: str, n: int) -> int:
        first = self.n_vertices
        self.kinds += [kind] * n
        self.index.append(np.arange(n))
        self.n_vertices += n
        return first

    def links(self, name: str, src, dst, cap, lat, cls: int, kind: str) -> None:
        src, dst, cap, lat = np.broadcast_arrays(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
                                                 np.asarray(cap, dtype=np.float64), np.asarray(lat, dtype=np.float64))
        n = src.size
        self.ids[name] = self.n_links
        self.blocks.append((src.ravel(), dst.ravel(), cap.ravel(), lat.ravel(),
                            np.full(n, cls, np.int8), np.full(n, LINK_KINDS.index(kind), np.int8)))
        self.n_links += n

    def arrays(self):
        cols = list(zip(*self.blocks))
        return [np.concatenate(c) for c in cols]


def _build_clos(spec: TopologySpec, fab, n_gpus: int) -> TopologyGraph:
    node = spec.node
    gpn = node.gpus_per_node
    n_nodes = -(-n_gpus // gpn)
    gpu_node = np.arange(n_gpus) // gpn
    b = _Builder()
    v_gpu = b.vertices("gpu", n_gpus)
    v_nvs = b.vertices("nvswitch", n_nodes)
    gpus = np.arange(n_gpus)
    half_nvl = node.nvlink_latency_us / 2.0
    b.links("gpu_up", v_gpu + gpus, v_nvs + gpu_node, node.nvlink_GBps, half_nvl, LINK_INTRA, "gpu->nvswitch")
    b.links("gpu_down", v_nvs + gpu_node, v_gpu + gpus, node.nvlink_GBps, half_nvl, LINK_INTRA, "nvswitch->gpu")
    kw: dict = {}
    if not isinstance(fab, SingleNodeFabric):
        kw = _add_clos_network(b, spec, fab, n_nodes, v_nvs)
    src, dst, cap, lat, cls, kind = b.arrays()
    return TopologyGraph(
        spec=spec, n_gpus=n_gpus, gpus_per_node=gpn, vertex_kind=b.kinds,
        vertex_index=np.concatenate(b.index), link_src=src, link_dst=dst, link_capacity_GBps=cap,
        link_latency_us=lat, link_class=cls, link_kind=kind, gpu_node=gpu_node, _ids=b.ids, **kw,
    )


def _add_clos_network(b: _Builder, spec: TopologySpec, fab: FatTreeFabric | RailOptimizedFabric,
                      n_nodes: int, v_nvs: int) -> dict:
    node = spec.node
    gpn, npn = node.gpus_per_node, node.nics_per_node
    o = fab.leaf_oversubscription
    down_ports = max(1, int(fab.radix * o / (1.0 + o)))
    n_nics = n_nodes * npn
    nic = np.arange(n_nics)
    nic_node, nic_local = nic // npn, nic % npn
    rail = isinstance(fab, RailOptimizedFabric)
    if rail:
        # One rail switch per (rail group, NIC index); a rail switch takes one NIC from each
        # of down_ports nodes.
        nodes_per_group = down_ports
        nic_leaf = (nic_node // nodes_per_group) * npn + nic_local
        nodes_per_leaf_unit = nodes_per_group  # leaves come in groups of npn covering these nodes
        leaves_per_unit = npn
    elif npn <= down_ports:
        nodes_per_leaf_unit = down_ports // npn
        nic_leaf = nic_node // nodes_per_leaf_unit
        leaves_per_unit = 1
    else:
        # A node's NICs span several leaves.
        nic_leaf = nic // down_ports
        leaves_per_unit = 1
        nodes_per_leaf_unit = 1
    n_leaves = int(nic_leaf.max()) + 1
    # A pod is what one spine layer reaches: by default radix leaves (two-level leaf-spine).
    if fab.pod_gpus is not None:
        nodes_per_pod = max(1, fab.pod_gpus // gpn)
    else:
        nodes_per_pod = max(1, fab.radix // leaves_per_unit) * nodes_per_leaf_unit
    # Pods hold whole leaves.
    nodes_per_pod = max(nodes_per_leaf_unit, nodes_per_pod // nodes_per_leaf_unit * nodes_per_leaf_unit)
    leaf_first_node = np.full(n_leaves, np.iinfo(np.int64).max)
    np.minimum.at(leaf_first_node, nic_leaf, nic_node)
    leaf_pod = leaf_first_node // nodes_per_pod
    n_pods = int(leaf_pod.max()) + 1

    nic_GBps = node.nic_gbps / 8.0
    half_nic = node.nic_latency_us / 2.0
    sw = fab.switch_latency_us
    v_nic = b.vertices("nic", n_nics)
    v_leaf = b.vertices("leaf", n_leaves)
    v_spine = b.vertices("spine", n_pods)
    # The NIC sits on the node's PCIe: the NVSwitch vertex stands for the node's inside.
    b.links("nic_up", v_nic + nic, v_leaf + nic_leaf, nic_GBps, half_nic, LINK_NETWORK, "nic->leaf")
    b.links("nic_down", v_leaf + nic_leaf, v_nic + nic, nic_GBps, half_nic, LINK_NETWORK, "leaf->nic")
    leaf_down_GBps = np.bincount(nic_leaf, minlength=n_leaves) * nic_GBps
    leaf_up_GBps = leaf_down_GBps / o
    leaves = np.arange(n_leaves)
    b.links("leaf_up", v_leaf + leaves, v_spine + leaf_pod, leaf_up_GBps, sw, LINK_NETWORK, "leaf->spine")
    b.links("leaf_down", v_spine + leaf_pod, v_leaf + leaves, leaf_up_GBps, sw, LINK_NETWORK, "spine->leaf")
    if n_pods > 1:
        v_core = b.vertices("core", 1)
        pods = np.arange(n_pods)
        pod_GBps = np.bincount(leaf_pod, weights=leaf_up_GBps, minlength=n_pods) / fab.spine_oversubscription
        b.links("pod_up", v_spine + pods, v_core, pod_GBps, sw, LINK_NETWORK, "spine->core")
        b.links("pod_down", v_core, v_spine + pods, pod_GBps, sw, LINK_NETWORK, "core->spine")
    return {"nics_per_node": npn, "nic_leaf": nic_leaf, "leaf_pod": leaf_pod}


def torus_dims_for(n_gpus: int, ndim: int) -> tuple[int, ...]:
    """Near-equal sides whose product is n_gpus, largest first (64 -> 4x4x4, 32 -> 4x4x2)."""
    dims = []
    rest = n_gpus
    for k in range(ndim, 0, -1):
        target = round(rest ** (1.0 / k))
        # the divisor of rest closest to the k-th root
        best = min((d for d in range(1, rest + 1) if rest % d == 0), key=lambda d: (abs(d - target), -d))
        dims.append(best)
        rest //= best
    return tuple(sorted(dims, reverse=True))


def _build_torus(spec: TopologySpec, fab: TorusFabric, n_gpus: int) -> TopologyGraph:
    if fab.dims is not None:
        dims = tuple(fab.dims)
        if int(np.prod(dims)) != n_gpus:
            raise UserError(
                f"torus dims {list(dims)} hold {int(np.prod(dims))} GPUs, not {n_gpus}: "
                "change fabric.dims or drop it to derive the sides from the GPU count"
            )
    else:
        dims = torus_dims_for(n_gpus, fab.ndim)
    nd = len(dims)
    bw = fab.link_GBps if isinstance(fab.link_GBps, list) else [fab.link_GBps] * nd
    b = _Builder()
    v_gpu = b.vertices("gpu", n_gpus)
    gpus = np.arange(n_gpus)
    coords = np.stack(np.unravel_index(gpus, dims[::-1])[::-1], axis=1)
    strides = np.cumprod((1,) + dims[:-1])
    # link id (g * nd + d) * 2 + dir, built in that order
    src = np.repeat(gpus, 2 * nd)
    d_of = np.tile(np.repeat(np.arange(nd), 2), n_gpus)
    sign = np.tile(np.array([1, -1] * nd), n_gpus)
    c = coords[src, d_of]
    e = np.asarray(dims)[d_of]
    nbr_c = (c + sign) % e
    dst = src + (nbr_c - c) * strides[d_of]
    cap = np.asarray(bw, dtype=np.float64)[d_of]
    # Links that do not exist (extent-1 dimensions; the wrap link of a mesh) keep an id so the
    # arithmetic stays simple; routing never uses them, and they are dropped from reports.
    exists = e > 1
    if not fab.wraparound:
        exists &= ~(((sign == 1) & (c == e - 1)) | ((sign == -1) & (c == 0)))
    cap = np.where(exists, cap, 0.0)
    b.links("torus", v_gpu + src, v_gpu + dst, cap, fab.hop_latency_us, LINK_NETWORK, "torus")
    s, d_, cap_, lat, cls, kind = b.arrays()
    return TopologyGraph(
        spec=spec, n_gpus=n_gpus, gpus_per_node=spec.node.gpus_per_node, vertex_kind=b.kinds,
        vertex_index=np.concatenate(b.index), link_src=s, link_dst=d_, link_capacity_GBps=cap_,
        link_latency_us=lat, link_class=cls, link_kind=kind,
        gpu_node=gpus // spec.node.gpus_per_node, _ids=b.ids, torus_dims=dims,
    )
