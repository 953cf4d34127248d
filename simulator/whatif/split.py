"""Symmetry that splits only where something differs.

Reduced mode simulates one representative per pipeline rank: every (tp, cp, dp) peer runs the
same plan on the same hardware. A perturbation breaks that for some ranks only. Here ranks are
partitioned into *classes* that provably behave alike, by refinement (as in bisimulation):

  1. the initial key of a rank: its pipeline rank, its compute factor, which of its groups touch
     a degraded link, and (under jitter) its TP x CP group;
  2. repeat: two ranks stay in one class only if, for every group dimension, their groups hold
     the same *set* of classes; until the number of classes stops changing.

A collective's start time depends only on when each class in the group arrives, and the classes
in a group are the same for every member of a class, so one representative per class is exact.
Groups whose class sets are equal ("signatures") issue their collective together, as all
replicas do in reduced mode, so the fabric still sees every flow. One slow GPU among 16,384
splits its TP/PP/DP neighbourhood into a few dozen classes, not the world. With no perturbation
the classes are the pipeline ranks: reduced mode exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from simulator.engine.core import Engine, _Rendezvous
from simulator.network.base import CollectiveRequest
from simulator.vocabulary import GROUP_DIMS, CollectiveOp, Dim
from simulator.workload.plan import Plan
from simulator.workload.program import Program


def _unique_rows(cols: list[np.ndarray]) -> np.ndarray:
    """Inverse index of the unique rows of the stacked columns (labels 0..n-1, in row order)."""
    arr = np.stack(cols, axis=1)
    _, inv = np.unique(arr, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64)


def group_signatures(groups: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per group, an id of the *set* of classes its members belong to."""
    lab = np.sort(labels[groups], axis=1)
    if lab.shape[1] > 1:
        dup = np.zeros_like(lab, dtype=bool)
        dup[:, 1:] = lab[:, 1:] == lab[:, :-1]
        lab = np.where(dup, -1, lab)
        lab = np.sort(lab, axis=1)
    _, inv = np.unique(lab, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64)


def group_index(groups: np.ndarray, world: int) -> np.ndarray:
    idx = np.full(world, -1, dtype=np.int64)  # -1: the rank is in no group of this dimension (emb)
    idx[groups.ravel()] = np.repeat(np.arange(len(groups)), groups.shape[1])
    return idx


def refine_classes(plan: Plan, initial: list[np.ndarray], max_rounds: int = 64) -> np.ndarray:
    """Class label of every rank: the coarsest stable refinement of the initial keys."""
    world = plan.mesh.world_size
    gidx = {d: group_index(plan.groups[d], world) for d in GROUP_DIMS}
    labels = _unique_rows(initial)
    n = int(labels.max()) + 1
    for _ in range(max_rounds):
        cols = [labels]
        for d in GROUP_DIMS:
            g = plan.groups[d]
            if g.shape[1] > 1:
                sig = group_signatures(g, labels)
                if g.size == world:
                    cols.append(sig[gidx[d]])
                else:
                    # Groups that cover some ranks only (emb: first and last pipeline stage).
                    col = np.full(world, -1, dtype=np.int64)
                    covered = g.ravel()
                    col[covered] = sig[gidx[d][covered]]
                    cols.append(col)
        new = _unique_rows(cols)
        m = int(new.max()) + 1
        labels = new
        if m == n:
            break
        n = m
    return labels


@dataclass
class Classes:
    labels: np.ndarray  # class of every rank
    reps: np.ndarray  # representative (smallest rank) of every class
    sizes: np.ndarray  # ranks per class

    @classmethod
    def of(cls, labels: np.ndarray) -> "Classes":
        n = int(labels.max()) + 1
        reps = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(reps, labels, np.arange(labels.size))
        return cls(labels, reps, np.bincount(labels, minlength=n))


class Stages(NamedTuple):
    """Per simulated rank, the simulated ranks (representatives) standing for its *stage* (its
    TP x CP x EP group: ranks that meet every layer, so the slowest sets the stage's pace) and
    for its *replica* (every stage of its pipelines: the ranks between which idle time is a
    pipeline's, short of the DP reduction that ends the step)."""
    stage: dict[int, tuple[int, ...]]
    replica: dict[int, tuple[int, ...]]


def stage_groups(mesh: Any, rep_of: np.ndarray, simulated: Sequence[int]) -> Stages:
    """:class:`Stages` of the ``simulated`` ranks; ``rep_of[rank]``: the simulated rank that stands
    for each rank of the world (what-if split mode: its class's representative). A replica is
    one data-parallel index of the dense model, or the ``Mesh.ep_dp_span`` of them an EP group
    reaches (EP groups tie their ranks together every MoE layer)."""
    c = mesh.coords  # pp, dp, cp, tp, ep
    rep = np.asarray(rep_of, dtype=np.int64)
    replica = c[:, 1] // mesh.ep_dp_span
    stage = c[:, 0] * (int(replica.max()) + 1) + replica

    def members(key: np.ndarray) -> dict[int, tuple[int, ...]]:
        out: dict[int, list[int]] = {}
        for k, r in np.unique(np.stack([key, rep], axis=1), axis=0).tolist():
            out.setdefault(k, []).append(r)
        return {k: tuple(v) for k, v in out.items()}

    by_stage, by_replica = members(stage), members(replica)
    return Stages({int(r): by_stage[int(stage[r])] for r in simulated},
                  {int(r): by_replica[int(replica[r])] for r in simulated})


class SplitEngine(Engine):
    """Reduced mode generalised to arbitrary classes: one simulated representative per class.

    ``collective_jitter`` (optional): a callable ``(n_groups) -> multiplier`` giving the largest
    of n_groups draws for the next collective; when above 1 the collective ends (multiplier - 1)
    x its isolated time later.
    """

    # Kept on the event loop step by step: split mode is checked against the per-rank loop as it
    # stood (tests/test_whatif.py), and its rendezvous and jitter sit in ``_collective``.
    run_ahead = False

    def __init__(self, program: Program, network, plan: Plan, classes: Classes, collective_jitter=None,
                 sm_count: int | None = None):
        super().__init__(program, network, mode="reduced", plan=plan, sm_count=sm_count)
        self.mode = "split"
        self.classes = classes
        self.ranks = sorted(int(r) for r in classes.reps)
        self.simulated[:] = False
        self.simulated[self.ranks] = True
        lab = classes.labels
        self._sig: dict[str, np.ndarray] = {}
        self._sig_classes: dict[tuple, int] = {}
        for d in GROUP_DIMS:
            g = self._groups[d]
            sig = group_signatures(g, lab)
            self._sig[d] = sig
            first = np.unique(sig, return_index=True)[1]
            for s, gi in zip(range(len(first)), first):
                self._sig_classes[(d, s)] = int(np.unique(lab[g[gi]]).size)
        self.collective_jitter = collective_jitter

    # ------------------------------------------------------------------ groups and peers

    def _sig_groups(self, dim: str, sid: int) -> np.ndarray:
        key = ("sig_groups", dim, sid)
        hit = self._request_cache.get(key)
        if hit is None:
            hit = self._request_cache[key] = self._groups[dim][self._sig[dim] == sid]
        return hit

    def _request(self, dim: str, op: str, size_bytes: float, rank: int):
        gi = int(self._group_index[dim][rank])
        sid = int(self._sig[dim][gi])
        ckey = ("split", dim, op, size_bytes, sid)
        req = self._request_cache.get(ckey)
        if req is None:
            groups = self._sig_groups(dim, sid)
            if op == CollectiveOp.RING_STEP:
                pairs = np.stack([groups, np.roll(groups, -1, axis=1)], axis=-1).reshape(-1, 2)
                req = CollectiveRequest(CollectiveOp.SEND_RECV, dim, pairs, size_bytes)
            else:
                req = CollectiveRequest(op, dim, groups, size_bytes)
            self._request_cache[ckey] = req
        return req, (dim, sid)

    def _actual_peer(self, rank: int, pp_rank: int) -> int:
        _, dp, cp, tp, _ = self.coords[rank]
        return self.mesh.rank(pp=pp_rank, dp=int(dp), cp=int(cp), tp=int(tp))

    def _peer(self, rank: int, pp_rank: int) -> int:
        return int(self.classes.reps[self.classes.labels[self._actual_peer(rank, pp_rank)]])

    def _p2p_request(self, src: int, dst: int, size_bytes: float) -> CollectiveRequest:
        key = ("split-pp", src, dst, size_bytes)
        req = self._request_cache.get(key)
        if req is None:
            # Every member of the sender's class sends to its own peer on the receiver's stage.
            members = np.nonzero(self.classes.labels == self.classes.labels[src])[0]
            g = self._groups[Dim.PP]
            pgi = self._group_index[Dim.PP][members]
            pairs = np.stack([members, g[pgi, int(self._pp_of[dst])]], axis=1)
            req = CollectiveRequest(CollectiveOp.SEND_RECV, Dim.PP, pairs, size_bytes)
            self._request_cache[key] = req
        return req

    # ------------------------------------------------------------------ rendezvous

    def _collective(self, rank: int, dim: str, op: str, size_bytes: float):
        req, gkey = self._request_counted(rank, dim, op, size_bytes)
        sk = (rank, dim)
        seq = self.seq[sk]
        self.seq[sk] = seq + 1
        key = (gkey, seq)
        env = self.env
        rv = self.rdv.get(key)
        if rv is None:
            rv = _Rendezvous(self._sig_classes[gkey], env.event())
            self.rdv[key] = rv
        if rv.arrive(rank, env.now, self.wait_log):
            del self.rdv[key]
            start = env.now
            rv.log_waits(self.wait_log, start, rank, dim)
            net_ev = self.net.start(env, req)
            extra = 0.0
            if self.collective_jitter is not None:
                # The groups issuing together stand for that many independent collectives; the
                # slowest of them is what their classes wait for next.
                m = self.collective_jitter(int(req.groups.shape[0]))
                if m > 1.0:
                    extra = (m - 1.0) * self.net.collective_time_s(req)
            # (as Engine._collective: when the transfer started and who arrived last)
            if extra > 0:
                def _late(_e, done=rv.done, s=(start, rank), x=extra):
                    env.timeout(x).callbacks.append(lambda _t: done.succeed(s))
                net_ev.callbacks.append(_late)
            else:
                net_ev.callbacks.append(lambda _e, done=rv.done, s=(start, rank): done.succeed(s))
        return rv.done
