"""Collective algorithms -> flows.

A collective is a list of sequential *phases*. A phase is a set of concurrent flows
(src GPU, dst GPU, bytes) plus a latency term (algorithm steps x per-step latency). Flow bytes
are stored per byte of the collective's nccl-tests ``size`` (``coef``), so one plan serves every
message size. Phases are pipelined the way NCCL pipelines them: a ring all-reduce is one phase
whose flows carry 2(n-1)/n x S between ring neighbours, with 2(n-1) latency steps.

Algorithms (names are what ``FlowNetwork(algorithms=...)`` accepts):

- ``ring``: all_reduce, all_gather, reduce_scatter; broadcast as a pipelined chain along the
  ring. A group spanning nodes is ordered node by node and split into ``c`` channels (c = GPUs
  of the group per node, at most the node's NIC count), each its own ring carrying S/c, whose
  node-crossing edge uses NIC r on both ends (rail-aligned, as NCCL's ring search does), and
  whose order inside the node is rotated so each channel leaves a node from a different GPU.
- ``tree``: NCCL's double binary tree all-reduce: two complementary binary trees over the nodes
  (the second is the first mirrored), each carrying half of the data, reduce and broadcast
  pipelined (one phase); inside a node a chain. ``c`` channels as for rings.
- ``hierarchical``: intra-node reduce-scatter (ring), inter-node all-reduce (ring) between the
  GPUs of equal local rank on S/k, intra-node all-gather (ring); three phases.
- ``torus``: on a torus, for a group that is a full sub-torus (a line, plane or the whole
  torus), rings per dimension: the data is cut into one chunk per dimension; chunk j
  reduce-scatters along dimensions j, j+1, ... (then all-gathers back), each ring
  bidirectional, so every link of the torus works in every phase.
- ``pairwise``: all_to_all: every member sends S/n to every other member, all at once (NCCL
  posts all sends and receives of an all-to-all together).
- ``p2p``: send_recv: one flow of S from groups[:, 0] to groups[:, 1].

Default choice, close to NCCL's tuner: inside a node a ring; across nodes the faster of ring
and tree *for that size* by the model's own isolated time (NCCL picks the algorithm with the
lowest predicted time the same way); on a torus the per-dimension rings where they apply;
all_gather / reduce_scatter use rings (NCCL has no tree for them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simulator.errors import UserError
from simulator.topology.graph import TopologyGraph

ALGORITHMS = ("ring", "tree", "hierarchical", "torus", "pairwise", "p2p")


@dataclass
class Phase:
    src: np.ndarray
    dst: np.ndarray
    coef: np.ndarray  # bytes of the flow per byte of the collective's size
    src_nic: np.ndarray | None = None  # local NIC index, -1: the GPU's affine NIC
    dst_nic: np.ndarray | None = None
    steps_intra: int = 0  # latency steps on intra-node paths
    steps_inter: int = 0  # latency steps on network paths

    @property
    def n_flows(self) -> int:
        return int(self.src.size)


@dataclass
class Plan:
    op: str
    algorithm: str
    phases: list[Phase] = field(default_factory=list)


def _phase(src_list, dst_list, coef_list, snic_list=None, dnic_list=None, steps_intra=0, steps_inter=0) -> Phase:
    src = np.concatenate([np.asarray(a, np.int64).ravel() for a in src_list]) if src_list else np.zeros(0, np.int64)
    dst = np.concatenate([np.asarray(a, np.int64).ravel() for a in dst_list]) if dst_list else np.zeros(0, np.int64)
    coef = np.concatenate([np.broadcast_to(np.asarray(c, np.float64), np.shape(s)).ravel()
                           for c, s in zip(coef_list, src_list)]) if src_list else np.zeros(0)
    snic = dnic = None
    if snic_list is not None:
        snic = np.concatenate([np.broadcast_to(np.asarray(c, np.int64), np.shape(s)).ravel()
                               for c, s in zip(snic_list, src_list)])
        dnic = np.concatenate([np.broadcast_to(np.asarray(c, np.int64), np.shape(s)).ravel()
                               for c, s in zip(dnic_list, src_list)])
    keep = src != dst
    if not keep.all():
        src, dst, coef = src[keep], dst[keep], coef[keep]
        if snic is not None:
            snic, dnic = snic[keep], dnic[keep]
    return Phase(src, dst, coef, snic, dnic, steps_intra, steps_inter)


# --- group structure -------------------------------------------------------------------------


@dataclass
class _Layout:
    """Groups sorted node by node: members[g, i, j] = j-th GPU of group g on its i-th node.
    None when groups do not all have the same number of GPUs on each of their nodes."""

    members: np.ndarray | None
    n_nodes: int  # nodes per group (m)
    per_node: int  # GPUs per node per group (k)


def _node_ids(graph: TopologyGraph, gpus: np.ndarray) -> np.ndarray:
    # On a torus every chip is its own router: there is no NVSwitch domain to stay inside.
    return gpus if graph.is_torus else graph.gpu_node[gpus]


def layout(graph: TopologyGraph, groups: np.ndarray) -> _Layout:
    g = np.asarray(groups, dtype=np.int64)
    n_groups, n = g.shape
    nodes = _node_ids(graph, g)
    order = np.lexsort((g, nodes), axis=-1) if n_groups else np.zeros_like(g)
    gs = np.take_along_axis(g, order, axis=1)
    ns = np.take_along_axis(nodes, order, axis=1)
    new_node = np.ones_like(ns, dtype=bool)
    new_node[:, 1:] = ns[:, 1:] != ns[:, :-1]
    m_per_group = new_node.sum(axis=1)
    m = int(m_per_group[0]) if n_groups else 1
    if (m_per_group == m).all() and n % m == 0:
        k = n // m
        # every node block must be exactly k long
        if (new_node.reshape(n_groups, m, k)[:, :, 0]).all():
            return _Layout(gs.reshape(n_groups, m, k), m, k)
    return _Layout(None, m, 0)


def _channels(graph: TopologyGraph, lay: _Layout) -> int:
    if lay.members is None or lay.n_nodes == 1 or graph.is_torus:
        return 1
    return max(1, min(lay.per_node, graph.nics_per_node))


def _ring_orders(graph: TopologyGraph, groups: np.ndarray, lay: _Layout):
    """[(sequence (n_groups, n), nic_of_position (n_groups, n) or None, weight)] per channel."""
    if lay.members is None:
        g = np.asarray(groups, dtype=np.int64)
        nodes = _node_ids(graph, g)
        order = np.lexsort((g, nodes), axis=-1)
        return [(np.take_along_axis(g, order, axis=1), None, 1.0)]
    M = lay.members
    G, m, k = M.shape
    c = _channels(graph, lay)
    if c == 1 and m == 1:
        return [(M.reshape(G, m * k), None, 1.0)]
    stride = max(1, k // c)
    out = []
    for r in range(c):
        exit_pos = r * stride
        rot = np.roll(M, -((exit_pos + 1) % k), axis=2)  # last member of each node = exit GPU
        seq = rot.reshape(G, m * k)
        if graph.is_torus or graph.nics_per_node == 0:
            nic = None
        else:
            # the channel's rail: the exit GPU's NIC, used on both ends of the crossing edge
            rail = graph.affinity_nic(M[:, 0, exit_pos])[:, None]
            nic = np.broadcast_to(rail, seq.shape)
        out.append((seq, nic, 1.0 / c))
    return out


def _steps(total: int, inter: int) -> tuple[int, int]:
    return total - inter, inter


# --- algorithms ----------------------------------------------------------------------------


def ring_plan(graph: TopologyGraph, op: str, groups: np.ndarray, lay: _Layout | None = None) -> Plan:
    lay = lay or layout(graph, groups)
    n = groups.shape[1]
    m = lay.n_nodes
    if op == "all_reduce":
        per_edge, steps, inter = 2.0 * (n - 1) / n, 2 * (n - 1), 2 * (m - 1)
    elif op in ("all_gather", "reduce_scatter"):
        per_edge, steps, inter = (n - 1) / n, n - 1, m - 1
    elif op == "broadcast":
        per_edge, steps, inter = 1.0, n - 1, m - 1
    else:
        raise ValueError(op)
    src_l, dst_l, coef_l, sn_l, dn_l = [], [], [], [], []
    for seq, nic, w in _ring_orders(graph, groups, lay):
        nxt = np.roll(seq, -1, axis=1)
        s, d = seq, nxt
        if op == "broadcast":  # a chain from the first member: no closing edge
            s, d = seq[:, :-1], nxt[:, :-1]
        src_l.append(s)
        dst_l.append(d)
        coef_l.append(per_edge * w)
        if nic is not None:
            nn = nic[:, : s.shape[1]]
            sn_l.append(nn)
            dn_l.append(nn)
        else:
            sn_l.append(-1)
            dn_l.append(-1)
    si, se = _steps(steps, inter)
    return Plan(op, "ring", [_phase(src_l, dst_l, coef_l, sn_l, dn_l, si, se)])


def _binary_tree_parents(m: int) -> np.ndarray:
    """parent[i] of node position i in a heap-ordered binary tree, -1 for the root."""
    i = np.arange(m)
    return np.where(i == 0, -1, (i - 1) // 2)


def tree_plan(graph: TopologyGraph, groups: np.ndarray, lay: _Layout | None = None) -> Plan | None:
    lay = lay or layout(graph, groups)
    if lay.members is None or lay.n_nodes == 1:
        return None
    M = lay.members
    G, m, k = M.shape
    c = _channels(graph, lay)
    stride = max(1, k // c)
    parent = _binary_tree_parents(m)
    child_pos = np.nonzero(parent >= 0)[0]
    depth = int(np.floor(np.log2(m))) if m > 1 else 0
    data = 1.0 / (2 * c)  # each of 2 trees x c channels carries this share of S
    src_l, dst_l, coef_l, sn_l, dn_l = [], [], [], [], []
    for r in range(c):
        head_pos = r * stride
        chain = np.roll(M, -head_pos, axis=2)  # chain[g, i, 0] = head of node i
        heads = chain[:, :, 0]
        rail = graph.affinity_nic(heads[:, 0])[:, None] if not graph.is_torus else None
        for mirror in (False, True):
            # the second tree is the first over the nodes in reverse order: leaves of one are
            # the inner nodes of the other
            pos = (m - 1 - np.arange(m)) if mirror else np.arange(m)
            ch = heads[:, pos[child_pos]]
            pa = heads[:, pos[parent[child_pos]]]
            for s, d in ((ch, pa), (pa, ch)):  # reduce up, broadcast down (pipelined)
                src_l.append(s)
                dst_l.append(d)
                coef_l.append(data)
                sn_l.append(-1 if rail is None else np.broadcast_to(rail, s.shape))
                dn_l.append(-1 if rail is None else np.broadcast_to(rail, s.shape))
            if k > 1:
                a, b = chain[:, :, :-1], chain[:, :, 1:]
                for s, d in ((b, a), (a, b)):
                    src_l.append(s)
                    dst_l.append(d)
                    coef_l.append(data)
                    sn_l.append(-1)
                    dn_l.append(-1)
    return Plan("all_reduce", "tree", [_phase(src_l, dst_l, coef_l, sn_l, dn_l, 2 * (k - 1), 2 * depth)])


def hierarchical_plan(graph: TopologyGraph, groups: np.ndarray, lay: _Layout | None = None) -> Plan | None:
    lay = lay or layout(graph, groups)
    if lay.members is None or lay.n_nodes == 1:
        return None
    M = lay.members
    G, m, k = M.shape
    phases = []
    if k > 1:
        nxt = np.roll(M, -1, axis=2)
        rs = _phase([M], [nxt], [(k - 1) / k], steps_intra=k - 1)
        phases.append(rs)
    # inter-node ring between GPUs of the same local position, on S/k each
    nxt = np.roll(M, -1, axis=1)
    phases.append(_phase([M], [nxt], [2.0 * (m - 1) / m / k], steps_inter=2 * (m - 1)))
    if k > 1:
        phases.append(_phase([M], [np.roll(M, -1, axis=2)], [(k - 1) / k], steps_intra=k - 1))
    return Plan("all_reduce", "hierarchical", phases)


def _torus_box_dims(graph: TopologyGraph, groups: np.ndarray) -> list[int] | None:
    """Active dimensions if every group is a full sub-torus spanning the same dimensions."""
    if not graph.is_torus:
        return None
    dims = graph.torus_dims
    co = graph.gpu_coords[np.asarray(groups, dtype=np.int64)]  # (G, n, D)
    n = groups.shape[1]
    active = []
    for d, e in enumerate(dims):
        lo, hi = co[:, :, d].min(axis=1), co[:, :, d].max(axis=1)
        if (lo == hi).all():
            continue
        if e > 1 and (lo == 0).all() and (hi == e - 1).all():
            active.append(d)
        else:
            return None
    if not active or int(np.prod([dims[d] for d in active])) != n:
        return None
    # a full box has n distinct members; groups are sets of distinct GPUs, so size suffices
    return active


def torus_plan(graph: TopologyGraph, op: str, groups: np.ndarray) -> Plan | None:
    active = _torus_box_dims(graph, groups)
    if active is None:
        return None
    dims = graph.torus_dims
    g = np.asarray(groups, dtype=np.int64).ravel()
    co = graph.gpu_coords[g]
    strides = np.cumprod((1,) + tuple(dims[:-1]))
    D = len(active)
    rs_phases = []
    for p in range(D):
        src_l, dst_l, coef_l = [], [], []
        steps = 0
        for j in range(D):
            d = active[(j + p) % D]
            e = dims[d]
            done = [dims[active[(j + q) % D]] for q in range(p)]
            data = 1.0 / D / float(np.prod(done))
            per_dir = data * (e - 1) / e / 2.0  # bidirectional ring: half each way
            for sign in (1, -1):
                nb = g + (((co[:, d] + sign) % e) - co[:, d]) * strides[d]
                src_l.append(g)
                dst_l.append(nb)
                coef_l.append(per_dir)
            steps = max(steps, e - 1)
        rs_phases.append(_phase(src_l, dst_l, coef_l, steps_inter=steps))
    if op == "reduce_scatter":
        phases = rs_phases
    elif op == "all_gather":
        phases = rs_phases[::-1]
    elif op == "all_reduce":
        phases = rs_phases + rs_phases[::-1]
    else:
        return None
    return Plan(op, "torus", phases)


def pairwise_plan(graph: TopologyGraph, groups: np.ndarray) -> Plan:
    g = np.asarray(groups, dtype=np.int64)
    G, n = g.shape
    src = np.repeat(g, n, axis=1)  # (G, n*n): i repeated
    dst = np.tile(g, (1, n))
    inter = 0 if (_node_ids(graph, g) == _node_ids(graph, g[:, :1])).all() else 1
    return Plan("all_to_all", "pairwise", [_phase([src], [dst], [1.0 / n], steps_intra=1 - inter, steps_inter=inter)])


def p2p_plan(graph: TopologyGraph, groups: np.ndarray) -> Plan:
    g = np.asarray(groups, dtype=np.int64)
    if g.shape[1] != 2:
        raise UserError(f"send_recv groups have {g.shape[1]} members: give [src, dst] pairs")
    inter = int((_node_ids(graph, g[:, 0]) != _node_ids(graph, g[:, 1])).any())
    return Plan("send_recv", "p2p", [_phase([g[:, 0]], [g[:, 1]], [1.0], steps_intra=1 - inter, steps_inter=inter)])


# --- choice --------------------------------------------------------------------------------


def candidates(graph: TopologyGraph, op: str, groups: np.ndarray, override: str | None = None) -> list[Plan]:
    """Plans the fabric may run for this collective; the fabric keeps the fastest per size.

    override: an algorithm name forced by the profile or scenario; where it does not apply
    (tree inside one node, torus on a non-box group) the default is used.
    """
    groups = np.asarray(groups, dtype=np.int64)
    if groups.ndim != 2 or groups.shape[1] < 1:
        raise UserError(f"collective groups have shape {groups.shape}: give (n_groups, group_size)")
    if override is not None and override not in ALGORITHMS:
        raise UserError(f"unknown collective algorithm {override!r}: use one of {', '.join(ALGORITHMS)}")
    if op == "send_recv":
        return [p2p_plan(graph, groups)]
    if op == "all_to_all":
        return [pairwise_plan(graph, groups)]
    if groups.shape[1] == 1:
        return [Plan(op, "ring", [])]
    lay = layout(graph, groups)
    if op == "broadcast":
        return [ring_plan(graph, op, groups, lay)]
    if op not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise UserError(f"unknown collective {op!r}: use one of all_reduce, all_gather, reduce_scatter, all_to_all, send_recv, broadcast")
    if override == "ring":
        return [ring_plan(graph, op, groups, lay)]
    if override in ("torus", None) and graph.is_torus:
        plan = torus_plan(graph, op, groups)
        if plan is not None:
            return [plan]
    if op == "all_reduce" and lay.n_nodes > 1:
        if override == "tree":
            plan = tree_plan(graph, groups, lay)
            if plan is not None:
                return [plan]
        if override == "hierarchical":
            plan = hierarchical_plan(graph, groups, lay)
            if plan is not None:
                return [plan]
        if override is None and not graph.is_torus:
            tree = tree_plan(graph, groups, lay)
            return [ring_plan(graph, op, groups, lay)] + ([tree] if tree is not None else [])
    return [ring_plan(graph, op, groups, lay)]
