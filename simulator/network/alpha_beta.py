"""Alpha-beta network per tier: NVLink inside a node, NICs between nodes.

The spine's first network, and the fast path when no contention needs modelling. A group that
spans m nodes with k of its GPUs in each runs hierarchically, its intra- and inter-node phases
pipelined as NCCL pipelines them, so the slower phase sets the time:

    time = max(intra-node phase, inter-node phase) + steps x latency + launch overhead

with the ring bus factors of nccl-tests applied to k ranks (intra) and m nodes (inter). A group
with one GPU per node (data parallel behind TP=8) is then a plain ring over the NICs:
2(n-1)/n * S / B + 2(n-1) * alpha for an all-reduce. Each GPU's inter-node bandwidth is its
share of its node's NICs: all replicas of a collective run at once, each on its own rail.
"""

from __future__ import annotations

import numpy as np
import simpy

from simulator.profile import CommModel
from simulator.network.base import CollectiveRequest
from simulator.topology.spec import NodeSpec


class TierNetwork:
    """nccl: NCCL's cost model (simulator.network.nccl.NcclModel); when given, it times every
    collective (TierNetwork.from_profile gives it for GPU profiles); the tier formula remains for
    CPU ranks and for callers that build the network from a comm model alone."""

    def __init__(self, node: NodeSpec, comm: CommModel, nccl=None):
        self.node = node
        self.nccl = nccl
        self.intra_GBps = node.nvlink_GBps * comm.nvlink_efficiency
        self.inter_GBps = node.nic_GBps_per_gpu * comm.nic_efficiency
        self.alpha_intra_s = comm.intra_node_latency_us * 1e-6
        self.alpha_inter_s = comm.inter_node_latency_us * 1e-6
        self.launch_s = comm.launch_overhead_us * 1e-6
        self._cache: dict[tuple, float] = {}
        self._by_request: dict[int, tuple[CollectiveRequest, float]] = {}

    @classmethod
    def from_profile(cls, node: NodeSpec, profile) -> "TierNetwork":
        from simulator.network.nccl import NcclModel

        return cls(node, profile.comm, NcclModel.from_specs(node, profile))

    @classmethod
    def for_topology(cls, topo, profile) -> "TierNetwork":
        """The tier model of a topology. On a torus the scale-out tier is the torus: each GPU
        reaches its neighbour on another node over its own link (fabric.link_GBps, the slowest
        dimension's), not over the host NIC the torus graph leaves unused, and NCCL's tuner
        (NVSwitch nodes and NICs) does not apply, as on the flow fabric (fabric.nccl_model_for)."""
        fab = topo.fabric
        if getattr(fab, "kind", "") != "torus":
            return cls.from_profile(topo.node, profile)
        link = fab.link_GBps if isinstance(fab.link_GBps, (int, float)) else min(fab.link_GBps)
        node = topo.node.model_copy(update={"nics_per_node": topo.node.gpus_per_node, "nic_gbps": 8.0 * float(link)})
        return cls(node, profile.comm, None)

    def _shape(self, group: np.ndarray) -> tuple[int, int]:
        """(nodes m, GPUs per node k) of one group."""
        nodes = np.unique(np.asarray(group) // self.node.gpus_per_node)
        m = len(nodes)
        return m, len(group) // m

    def collective_time_s(self, req: CollectiveRequest) -> float:
        # The engine reuses request objects, so most calls end here.
        hit = self._by_request.get(id(req))
        if hit is not None and hit[0] is req:
            return hit[1]
        t = self._collective_time_s(req)
        self._by_request[id(req)] = (req, t)
        return t

    def _collective_time_s(self, req: CollectiveRequest) -> float:
        n = req.group_size
        if n <= 1 or req.size_bytes <= 0:
            return 0.0
        m, k = self._shape(req.groups[0])
        if self.nccl is not None:
            return self.nccl.choose(req.op, float(req.size_bytes), n, m, k).time_us * 1e-6
        key = (req.op, n, m, req.size_bytes)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        t = self._time(req.op, n, m, k, float(req.size_bytes))
        self._cache[key] = t
        return t

    def _time(self, op: str, n: int, m: int, k: int, S: float) -> float:
        bi, be = self.intra_GBps * 1e9, self.inter_GBps * 1e9
        ai, ae = self.alpha_intra_s, self.alpha_inter_s
        if op == "all_reduce":
            t = max(2 * (k - 1) / k * S / bi, 2 * (m - 1) / m * (S / k) / be)
            lat = 2 * (k - 1) * ai + 2 * (m - 1) * ae
        elif op in ("all_gather", "reduce_scatter"):
            t = max((k - 1) / k * S / bi, (m - 1) / m * S / (k * be))
            lat = (k - 1) * ai + (m - 1) * ae
        elif op == "all_to_all":
            t = max((k - 1) / n * S / bi, (n - k) / n * S / be)
            lat = (k - 1) * ai + (n - k) * ae
        elif op == "send_recv":
            t = S / (bi if m == 1 else be)
            lat = ai if m == 1 else ae
        elif op == "broadcast":
            t = max(S / bi if k > 1 else 0.0, S / be if m > 1 else 0.0)
            lat = (k - 1) * ai + (m - 1) * ae
        else:
            raise ValueError(f"unknown collective {op!r}")
        return t + lat + self.launch_s

    def start(self, env: simpy.Environment, req: CollectiveRequest) -> simpy.Event:
        return env.timeout(self.collective_time_s(req))

    def links_of(self, req: CollectiveRequest) -> None:
        return None  # no shared links: every collective takes its isolated time

    def run_closed_form(self, env: simpy.Environment, req: CollectiveRequest, t0_s: float) -> float:
        return self.collective_time_s(req)


class IdealNetwork:
    """Communication that takes no time: for checking schedules against closed-form bubbles."""

    def collective_time_s(self, req: CollectiveRequest) -> float:
        return 0.0

    def start(self, env: simpy.Environment, req: CollectiveRequest) -> simpy.Event:
        return env.timeout(0.0)

    def links_of(self, req: CollectiveRequest) -> None:
        return None

    def run_closed_form(self, env: simpy.Environment, req: CollectiveRequest, t0_s: float) -> float:
        return 0.0
