"""Full mode at the cost of the work: ranks that provably move in lockstep, simulated once.

In a scenario without per-rank differences every rank of a pipeline rank runs the same plan on
the same GPU model, and its collectives meet groups whose members are in the same position. If,
besides, the network treats those groups alike, every one of them runs each collective in the
same time, and a rank's whole timeline is its pipeline rank's: the event loop has nothing to
learn from simulating the others. That is reduced mode's premise; here it is *checked*, and full
mode's output (every rank's rows, waits and accumulators) is then the reduced run's, given to
each rank of the pipeline rank, with its own peers named.

The checks. Statically (``lockstep_blocker``), the fabric's shape: not a torus (dimension-ordered
routes are not the same from every position), no oversubscription (where trunks bind, contention
decides which flow ends first, and the per-rank loop itself parts ranks of one pipeline rank),
whole nodes, leaves and pods of equal size, every node's NICs on the leaves in the same way. At
run time (``LockstepCheck``): reduced mode issues one request for all the groups of a pipeline
rank (they start together); the first time each request is issued, every group's collective time
alone on the network (``collective_time_s``) must be the same. A group that spans another level
of the fabric, a PCIe-only hop or a different NIC count makes it differ, and the run falls back
to one process per rank (``Engine(mode="full")``, the reference, ``--mode every-rank``).

``tests/test_lockstep.py`` compares the rows, waits and accumulators with the reference loop's
(to float summation order) on symmetric scenarios of several parallelisms, and checks the
fall-backs. The guards are conservative; the equality is shown on the cases tested, not proven.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.engine.core import Timeline
from simulator.network.base import CollectiveRequest
from simulator.vocabulary import CollectiveOp

# Relative difference between two groups' isolated collective times that still counts as equal
# (the same arithmetic in another order differs by a few ulps).
SAME_TIME_REL = 1e-9


class NotLockstep(Exception):
    """The groups a reduced-mode request stands for are not alike on this network."""


def lockstep_blocker(net) -> str | None:
    """Why this network cannot be trusted to treat same-position groups alike (None: it can).
    Static: the fabric's shape. The per-request check is ``LockstepCheck``."""
    base = getattr(net, "base", net)  # PlacedNetwork: the placement maps ranks onto the fabric
    graph = getattr(base, "graph", None)
    if graph is None:
        return None  # alpha-beta tiers: a time per (size, group shape), the same everywhere
    if graph.is_torus:
        return "a torus: dimension-ordered routes differ by position"
    fab = graph.spec.fabric
    over = max(getattr(fab, "leaf_oversubscription", 1.0), getattr(fab, "spine_oversubscription", 1.0))
    if over > 1.0:
        # Trunks that bind make contention decide who finishes first; the per-rank loop then parts
        # ranks of one pipeline rank (measured: 96 GPUs on 3:1 leaves, 6.7 us apart on a 10 ms step).
        return f"an oversubscribed fabric ({over:g}:1): contended flows can part a pipeline rank's ranks"
    if graph.n_gpus % graph.gpus_per_node:
        return f"a partial node ({graph.n_gpus} GPUs, {graph.gpus_per_node} a node)"
    if graph.nic_leaf is not None and graph.nic_leaf.size:
        per_leaf = np.bincount(graph.nic_leaf)
        if per_leaf.min() != per_leaf.max():
            return f"leaves of unequal size ({per_leaf.min()} to {per_leaf.max()} NICs)"
        per_pod = np.bincount(graph.leaf_pod)
        if per_pod.min() != per_pod.max():
            return f"pods of unequal size ({per_pod.min()} to {per_pod.max()} leaves)"
        npn = graph.nics_per_node
        if npn and graph.nic_leaf.size % npn == 0:
            by_node = graph.nic_leaf.reshape(-1, npn)
            if not (by_node - by_node[:, :1] == by_node[0] - by_node[0, 0]).all():
                return "nodes whose NICs sit on the leaves in different ways"
    return None


class LockstepCheck:
    """The network, with each multi-group request checked once: every group alone takes the same
    time, or ``NotLockstep`` is raised (before the request runs)."""

    def __init__(self, net):
        self.net = net
        self._checked: dict[int, CollectiveRequest] = {}  # id -> request (held, so the id stays its own)
        # One group's time by its shape: groups of a request that sit in the same place relative
        # to their nodes are the same problem to the network (most TP groups of a large world).
        self._time_by_shape: dict[tuple, float] = {}
        # The distinct group shapes of a group set (and a group of each), by the set's content:
        # a request's op and size do not change them, and the requests of one step share a few
        # group sets (TP all-reduces forward and backward, DP gathers and reductions of every
        # bucket), each O(world) to analyse: once per set, not once per request (at 16,384 GPUs
        # 74 requests over a handful of sets, 0.37 s of a 2.3 s run).
        self._shapes_by_groups: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._gpn = _gpus_per_node(net)

    def __getattr__(self, name: str):
        return getattr(self.net, name)

    def collective_time_s(self, req: CollectiveRequest) -> float:
        return self.net.collective_time_s(req)

    def _check_once(self, req: CollectiveRequest) -> None:
        if id(req) not in self._checked:
            self._check(req)
            self._checked[id(req)] = req

    def start(self, env, req: CollectiveRequest):
        self._check_once(req)
        return self.net.start(env, req)

    # Defined here, not forwarded by __getattr__: a collective run in closed form is checked too.
    # The engine asks for the links of every request its plans will issue before the loop
    # (Engine._closed_form_requests): checking them there fails a run that is not lockstep before
    # it simulates anything, and keeps the O(world) checks out of the event loop.
    def links_of(self, req: CollectiveRequest):
        self._check_once(req)
        return self.net.links_of(req)

    def run_closed_form(self, env, req: CollectiveRequest, t0_s: float):
        self._check_once(req)
        return self.net.run_closed_form(env, req, t0_s)

    def _shapes(self, groups: np.ndarray) -> np.ndarray:
        """Per group, what its time on the network depends on: each member's GPU index in its node
        and which members share a node, a leaf and a pod (each member labelled by the first member
        it shares one with: groups in the same place relative to nodes, leaves and pods get the
        same row, on a fabric whose nodes, leaves and pods are alike)."""
        gpu = _gpu_ids(self.net, groups)
        node = gpu // self._gpn
        cols = [gpu % self._gpn, _first_alike(node)]
        graph = getattr(getattr(self.net, "base", self.net), "graph", None)
        if graph is not None and graph.nic_leaf is not None and graph.nic_leaf.size:
            leaf = graph.nic_leaf[node * graph.nics_per_node]  # the leaf of the node's first NIC
            cols += [_first_alike(leaf), _first_alike(graph.leaf_pod[leaf])]
        return np.concatenate(cols, axis=1)

    def _check(self, req: CollectiveRequest) -> None:
        groups = np.asarray(req.groups)
        if groups.shape[0] < 2:
            return
        gkey = (groups.shape, groups.dtype.str, groups.tobytes())
        hit = self._shapes_by_groups.get(gkey)
        if hit is None:
            hit = self._shapes_by_groups[gkey] = tuple(np.unique(self._shapes(groups), axis=0, return_index=True)[:2])
        shapes, first_of = hit
        first = None
        for shape, gi in zip(shapes, first_of):
            key = (req.op, req.dim, float(req.size_bytes), shape.tobytes())
            t = self._time_by_shape.get(key)
            if t is None:
                t = self._time_by_shape[key] = self.net.collective_time_s(
                    CollectiveRequest(req.op, req.dim, groups[gi:gi + 1], req.size_bytes))
            if first is None:
                first = t
            elif abs(t - first) > SAME_TIME_REL * max(abs(first), 1e-30):
                op = req.op.value if isinstance(req.op, CollectiveOp) else req.op
                raise NotLockstep(f"{req.dim} {op} of {req.size_bytes:.0f} B takes {first * 1e6:.3f} us on one group "
                                  f"and {t * 1e6:.3f} us on group {groups[gi].tolist()[:8]}")


def _first_alike(x: np.ndarray) -> np.ndarray:
    """Per row, each element replaced by the position of the first element equal to it."""
    return (x[:, :, None] == x[:, None, :]).argmax(axis=2)


def _gpus_per_node(net) -> int:
    base = getattr(net, "base", net)
    graph = getattr(base, "graph", None)
    if graph is not None:
        return int(graph.gpus_per_node)
    node = getattr(base, "node", None)
    return int(getattr(node, "gpus_per_node", 1) or 1)


def _gpu_ids(net, ranks: np.ndarray) -> np.ndarray:
    gpu_of_rank = getattr(net, "gpu_of_rank", None)
    ranks = np.asarray(ranks, dtype=np.int64)
    return ranks if gpu_of_rank is None else np.asarray(gpu_of_rank)[ranks]


class _Widen:
    """Every rank's rows from its pipeline rank's representative's, for all ranks or a few."""

    def __init__(self, reps_tl: Timeline, mesh):
        self.coords = coords = mesh.coords  # rank -> (pp, dp, cp, tp, ep)
        self.world = mesh.world_size
        self.pp_of = pp_of = coords[:, 0].astype(np.int64)
        rep_of_pp = {int(pp_of[r]): int(r) for r in reps_tl.ranks}
        self.reps = np.array([rep_of_pp[int(p)] for p in range(int(pp_of.max()) + 1)], dtype=np.int64)
        self.members = [np.nonzero(pp_of == p)[0] for p in range(len(self.reps))]

    def frame(self, frame: pd.DataFrame, ranks: np.ndarray | None = None) -> pd.DataFrame:
        """The rows of each pipeline rank's representative, once per member (members in rank
        order; ``ranks``: only those), column by column: a tile of a contiguous block is a copy,
        where a frame-wide take over tens of millions of row indices was most of the time at
        16,384 GPUs."""
        rank = frame["rank"].to_numpy()
        members = self.members if ranks is None else [np.intersect1d(m, ranks) for m in self.members]
        blocks = [(np.flatnonzero(rank == rep), members[p]) for p, rep in enumerate(self.reps)]
        n_out = sum(rows.size * m.size for rows, m in blocks)
        cols = {}

        def tiled(v: np.ndarray) -> np.ndarray:
            # written in place, block by block (no tile + concatenate: fresh pages twice)
            out = np.empty(n_out, dtype=v.dtype)
            at = 0
            for rows, m in blocks:
                n = rows.size * m.size
                out[at:at + n].reshape(m.size, rows.size)[:] = v[rows]
                at += n
            return out

        for name in frame.columns:
            col = frame[name]
            if name == "rank":
                out = np.empty(n_out, dtype=rank.dtype)
                at = 0
                for rows, m in blocks:
                    n = rows.size * m.size
                    out[at:at + n].reshape(m.size, rows.size)[:] = m[:, None]
                    at += n
                cols[name] = out
            elif isinstance(col.dtype, pd.CategoricalDtype):
                cols[name] = pd.Categorical.from_codes(tiled(col.cat.codes.to_numpy()), dtype=col.dtype)
            else:
                cols[name] = tiled(col.to_numpy())
        return pd.DataFrame(cols, columns=frame.columns, copy=False)

    def waits(self, frame: pd.DataFrame, ranks: np.ndarray | None = None) -> pd.DataFrame:
        waits = self.frame(frame, ranks)
        # A wait's source: -1 stays, the waiting rank's own representative becomes the rank
        # itself, another pipeline rank's representative becomes this rank's peer there.
        pp_of = self.pp_of
        src = waits["src_rank"].to_numpy().astype(np.int64)
        me = waits["rank"].to_numpy().astype(np.int64)
        out = src.copy()
        is_rep = src >= 0
        q = np.where(is_rep, pp_of[np.maximum(src, 0)], 0)
        own = is_rep & (q == pp_of[me])
        out[own] = me[own]
        other = is_rep & ~own
        if other.any():
            # (pp, dp, cp, tp) names a rank (the engine's peer rule, Engine._peer in full mode)
            c = self.coords[:, :4].astype(np.int64)
            rank_at = np.full(tuple(c.max(axis=0) + 1), -1, dtype=np.int64)
            rank_at[c[:, 0], c[:, 1], c[:, 2], c[:, 3]] = np.arange(self.world)
            cm = c[me[other]]
            out[other] = rank_at[q[other], cm[:, 1], cm[:, 2], cm[:, 3]]
        waits["src_rank"] = out.astype(frame["src_rank"].dtype, copy=False)
        return waits


class LockstepTimeline(Timeline):
    """Every rank's timeline, its rows made from the representatives' when first read
    (``events`` / ``waits``: tens of millions of rows at thousands of GPUs), or for a few ranks
    only (``events_of`` / ``waits_of``). ``representatives`` is the reduced run itself (a
    dashboard draws from it what it would draw from every rank: their rows are the same)."""

    representatives: Timeline
    _widen: _Widen

    def _get_events(self) -> pd.DataFrame:
        if self.__dict__.get("_events_all") is None:
            self.__dict__["_events_all"] = self._widen.frame(self.representatives.events)
        return self.__dict__["_events_all"]

    def _set_events(self, value) -> None:  # (the dataclass __init__ hands the representatives' frame)
        self.__dict__["_events_all"] = None

    def _get_waits(self) -> pd.DataFrame | None:
        if self.representatives.waits is None:
            return None
        if self.__dict__.get("_waits_all") is None:
            self.__dict__["_waits_all"] = self._widen.waits(self.representatives.waits)
        return self.__dict__["_waits_all"]

    def _set_waits(self, value) -> None:
        self.__dict__["_waits_all"] = None

    events = property(_get_events, _set_events)  # type: ignore[assignment]
    waits = property(_get_waits, _set_waits)  # type: ignore[assignment]

    def events_of(self, ranks) -> pd.DataFrame:
        """The rows of these ranks only (what ``events[events.rank.isin(ranks)]`` gives)."""
        return self._widen.frame(self.representatives.events, np.asarray(sorted(ranks), dtype=np.int64))

    def waits_of(self, ranks) -> pd.DataFrame | None:
        if self.representatives.waits is None:
            return None
        return self._widen.waits(self.representatives.waits, np.asarray(sorted(ranks), dtype=np.int64))


def drawn_from(tl: Timeline) -> Timeline:
    """The timeline a view over every rank can be drawn from: a lockstep timeline's
    representatives (every rank of their pipeline rank has their rows, and every pipeline rank
    as many ranks, so per-stage series and means over ranks are theirs), else the timeline."""
    return tl.representatives if isinstance(tl, LockstepTimeline) else tl


def events_of(tl: Timeline, ranks) -> pd.DataFrame:
    """The timeline rows of ``ranks`` (a lockstep timeline makes only those)."""
    if isinstance(tl, LockstepTimeline):
        return tl.events_of(ranks)
    return tl.events[tl.events["rank"].isin(list(ranks))]


def waits_of(tl: Timeline, ranks) -> pd.DataFrame | None:
    if isinstance(tl, LockstepTimeline):
        return tl.waits_of(ranks)
    w = getattr(tl, "waits", None)
    return None if w is None else w[w["rank"].isin(list(ranks))]


def expand_timeline(tl: Timeline, mesh) -> LockstepTimeline:
    """Every rank's timeline from a reduced run (one simulated rank per pipeline rank): each
    rank gets its pipeline rank's rows, waits and accumulators, its waits naming its own peers
    (rows made when first read)."""
    w = _Widen(tl, mesh)
    reps, pp_of, world = w.reps, w.pp_of, w.world

    def per_rank(d: dict) -> dict:
        return {r: d[int(reps[pp_of[r]])] for r in range(world)}

    def per_rank_copy(d: dict) -> dict:
        return {r: dict(d[int(reps[pp_of[r]])]) for r in range(world)}

    out = LockstepTimeline(
        events=tl.events, step_time_s=tl.step_time_s, ranks=list(range(world)),
        pp_rank_of={r: int(pp_of[r]) for r in range(world)},
        busy_compute_s=per_rank(tl.busy_compute_s), exposed_s=per_rank_copy(tl.exposed_s),
        comm_bytes=per_rank_copy(tl.comm_bytes), sim_wall_s=tl.sim_wall_s, num_events=tl.num_events, mode="full",
        network_report=tl.network_report, contention_s=per_rank(tl.contention_s), waits=tl.waits,
        end_time_s=per_rank(tl.end_time_s), fast_forward=tl.fast_forward,
        lockstep={"simulated_ranks": len(reps), "ranks": world}, loop_wall_s=tl.loop_wall_s,
    )
    out.representatives = tl
    out._widen = w
    return out
