"""Link selectors -> link ids of a topology graph, and degraded capacities on a flow fabric.

Names follow ``TopologyGraph.link_name``: ``<kind><index>-><kind><index>`` with kinds gpu,
nvswitch, nic, leaf, spine, core (torus: gpu->gpu). A trunk (``leaf3->spine0``) stands for all
parallel uplinks of leaf 3 (graph.py), so halving it halves the leaf's uplink bandwidth.
"""

from __future__ import annotations

import fnmatch
import re

import numpy as np

from simulator.errors import UserError
from simulator.topology.graph import LINK_KINDS, TopologyGraph

TIERS = {
    "nvlink": ("gpu->nvswitch", "nvswitch->gpu"),
    "nic": ("nic->leaf", "leaf->nic"),
    "leaf-spine": ("leaf->spine", "spine->leaf"),
    "spine-core": ("spine->core", "core->spine"),
    "torus": ("torus",),
}


def link_names(graph: TopologyGraph) -> np.ndarray:
    names = np.array([f"{k}{i}" for k, i in zip(graph.vertex_kind, graph.vertex_index)], dtype=object)
    return names[graph.link_src] + "->" + names[graph.link_dst]


def _vertex(graph: TopologyGraph, kind: str, index: int) -> int | None:
    kinds = np.asarray(graph.vertex_kind, dtype=object)
    hit = np.nonzero((kinds == kind) & (graph.vertex_index == index))[0]
    return int(hit[0]) if hit.size else None


def _between(graph: TopologyGraph, va: np.ndarray, vb: np.ndarray) -> np.ndarray:
    """Both directions of the cables between vertex sets va and vb."""
    s, d = graph.link_src, graph.link_dst
    return np.nonzero((np.isin(s, va) & np.isin(d, vb)) | (np.isin(s, vb) & np.isin(d, va)))[0]


def _nic_vertices(graph: TopologyGraph, nics: np.ndarray) -> np.ndarray:
    kinds = np.asarray(graph.vertex_kind, dtype=object)
    v = np.nonzero(kinds == "nic")[0]
    return v[np.isin(graph.vertex_index[v], nics)]


def select_links(graph: TopologyGraph, selector: str) -> np.ndarray:
    """Link ids a selector names; UserError naming the selector when it names none."""
    sel = selector.strip()
    kinds = np.asarray(graph.vertex_kind, dtype=object)
    ids: np.ndarray
    m = re.fullmatch(r"(tier|rail|nic|node|uplink):(\S+)", sel)
    if m:
        what, arg = m.groups()
        if what == "tier":
            if arg not in TIERS:
                raise UserError(f"link selector {selector!r}: unknown tier {arg!r}; use one of {', '.join(TIERS)}")
            codes = [LINK_KINDS.index(k) for k in TIERS[arg]]
            ids = np.nonzero(np.isin(graph.link_kind, codes))[0]
        else:
            if not arg.isdigit():
                raise UserError(f"link selector {selector!r}: {arg!r} is not a whole number; write e.g. {what}:0")
            n = int(arg)
            if graph.nics_per_node == 0 and what != "uplink":
                raise UserError(f"link selector {selector!r}: topology {graph.spec.name!r} has no NICs; name links or tiers")
            leaves = np.nonzero(kinds == "leaf")[0]
            if what == "nic":
                nics = np.array([n])
            elif what == "node":
                nics = np.arange(n * graph.nics_per_node, (n + 1) * graph.nics_per_node)
            elif what == "rail":
                if n >= graph.nics_per_node:
                    raise UserError(f"link selector {selector!r}: rails are 0..{graph.nics_per_node - 1}")
                total = int((kinds == "nic").sum())
                nics = np.arange(n, total, graph.nics_per_node)
            else:  # uplink: leaf n <-> its spine
                v = _vertex(graph, "leaf", n)
                spines = np.nonzero(kinds == "spine")[0]
                ids = _between(graph, np.array([v] if v is not None else [], dtype=np.int64), spines)
                nics = None
            if what != "uplink":
                ids = _between(graph, _nic_vertices(graph, nics), leaves)
    elif "<->" in sel:
        a, b = sel.split("<->", 1)
        names = link_names(graph)
        ids = np.nonzero((names == f"{a}->{b}") | (names == f"{b}->{a}"))[0]
    else:
        names = link_names(graph)
        if any(c in sel for c in "*?["):
            ids = np.nonzero([fnmatch.fnmatchcase(x, sel) for x in names])[0]
        else:
            ids = np.nonzero(names == sel)[0]
    ids = ids[graph.link_capacity_GBps[ids] > 0] if ids.size else ids
    if ids.size == 0:
        sample = ", ".join(link_names(graph)[graph.link_class == 1][:3]) or "gpu0->nvswitch0"
        raise UserError(
            f"link selector {selector!r} names no link of topology {graph.spec.name!r} with {graph.n_gpus} GPUs: "
            f"use a link name (e.g. {sample}), 'uplink:LEAF', 'nic:N', 'node:N', 'rail:R' or 'tier:NAME'"
        )
    return ids


def link_factors(graph: TopologyGraph, selectors: list[tuple[str, float]]) -> np.ndarray:
    """Capacity multiplier per link (factors of overlapping selectors multiply)."""
    out = np.ones(graph.n_links)
    for sel, factor in selectors:
        out[select_links(graph, sel)] *= factor
    return out
