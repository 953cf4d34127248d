"""Collective calls in a trace set: which calls are one instance, and how much of each call was
transfer rather than waiting for peers.

A rank's collective kernel starts when that rank reaches it and ends when the data has moved,
which needs every member: the earliest arrivals wait for the latest. The ends of one instance
align across its members; the starts do not. So:

- all members of an instance in the set: the transfer runs from the last member's start to its
  end (the last-starting member did not wait), and each member's wait is its duration minus that;
- otherwise (one rank, or membership unknown): the lower envelope, the shortest call of the
  same (collective, message size, group) seen, which is the call that waited least.

Membership comes from the process group the call records (``Process Group Ranks``, or its
``Process Group Name`` resolved through ``distributedInfo.pg_config``), else from the parallel
layout (a ``Mesh``: TP/CP/EP/DP/PP arithmetic; a bundle's own scenario, or the one the user
gives). gloo records no group per call (torch 2.13: no record_param_comms on CPU), so a gloo
capture's groups come from its layout: a call can run on the layout's groups of its kind
(point-to-point on pp or cp, the other collectives on tp, cp, ep or dp) and of its size when
known; one candidate is its group, and it must be one of the rank's groups in pg_config. Such
an inferred instance must also be one: every member's call still running when the last one
starts, else the key takes the envelope. Calls are never grouped by being concurrent and of the
same size: concurrent same-size calls of different groups are common (every TP group
all-reduces the same activation at the same time).

Point-to-point calls pair a send on one rank with the recv on its peer: the k-th send from a to
b with the k-th recv on b from a (c10d delivers one pair's messages in order). The peer is the
c10d op's dst/src, an index into the call's group (the other member of a 2-rank group).
"""

from __future__ import annotations

import ast
from collections import defaultdict

import numpy as np
import pandas as pd

INSTANCE = "instance"
ENVELOPE = "envelope"
_P2P = ("send", "recv", "send_recv")
# Why a call took the envelope (transfer_why): its group is unknown and no layout was given; the
# records and the layout leave several groups (or peers) for it; the layout has no group of its
# kind and size among the rank's process groups (not the job's layout); its group's other ranks
# are not in the set; or all are, but their calls do not pair up (cut off by the profiling window,
# or not the job's layout). <NA> on instances, and on calls of one-rank groups, which wait for nobody.
NO_GROUP, AMBIGUOUS, NOT_IN_LAYOUT, MEMBERS_MISSING, UNMATCHED = (
    "no_group", "ambiguous", "not_in_layout", "members_missing", "unmatched")
WHY = (NO_GROUP, AMBIGUOUS, NOT_IN_LAYOUT, MEMBERS_MISSING, UNMATCHED)
# Layout dimensions a call whose record names no group can run on, by kind: a pipeline group
# carries the stages' point-to-point transfers only (torch.distributed.pipelining, Megatron), and
# context parallelism's ring attention is point-to-point too (Megatron); collectives run on the
# others. A barrier (or an unknown kind) is no dimension's: a job usually barriers its world.
_LAYOUT_DIMS = {"p2p": ("pp", "cp"), "collective": ("tp", "cp", "ep", "dp")}
_NO_LAYOUT = ("barrier", "other")
# Kineto rounds timestamps to the microsecond: an inferred instance's calls must overlap beyond it.
_OVERLAP_TOLERANCE_US = 1.0


def _parse_ranks(s: object) -> tuple[int, ...] | None:
    """'[0, 1]' -> (0, 1); None when absent, empty or truncated by Kineto ('[0, 1, ...')."""
    if s is None or (isinstance(s, float) and np.isnan(s)):
        return None
    if isinstance(s, (list, tuple)):
        r = tuple(int(x) for x in s)
        return r or None
    txt = str(s).strip()
    if not txt or "..." in txt:
        return None
    try:
        v = ast.literal_eval(txt)
    except (ValueError, SyntaxError):
        return None
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v):
        return tuple(v)
    return None


def pg_ranks_from_config(distributed_infos: list[dict]) -> dict[str, tuple[int, ...]]:
    """Process group name -> its global ranks, from every rank's distributedInfo.pg_config.

    A group name is local to the ranks that created it; the same name on two ranks with
    different member lists is kept apart by resolving per rank (see group_of_rows)."""
    out: dict[str, tuple[int, ...]] = {}
    for di in distributed_infos:
        for pg in (di or {}).get("pg_config") or []:
            if not isinstance(pg, dict):
                continue
            r = _parse_ranks(pg.get("ranks"))
            name = pg.get("pg_name")
            if r and name is not None:
                out.setdefault(str(name), r)
    return out


def group_of_rows(comm: pd.DataFrame, pg_by_rank: dict[int, dict[str, tuple[int, ...]]] | None = None,
                  mesh=None) -> tuple[list[tuple[int, ...] | None], np.ndarray, list[str | None]]:
    """The member ranks of each collective row's group, or None where it cannot be known; whether
    each came from the layout (inferred) rather than the call's own record; and, where a layout
    was given but left the group open, why (AMBIGUOUS or NOT_IN_LAYOUT)."""
    out: list[tuple[int, ...] | None] = []
    inferred = np.zeros(len(comm), dtype=bool)
    open_why: list[str | None] = [None] * len(comm)
    dim_groups: dict[str, np.ndarray] = {}
    if mesh is not None:
        for dim in ("tp", "cp", "ep", "dp", "pp"):
            g = mesh.groups(dim)
            if g.shape[1] > 1:
                dim_groups[dim] = g
    rank_col = comm["rank"].to_numpy()
    granks = comm["group_ranks"].astype(object).to_numpy()
    pgn = comm["pg_name"].astype(object).to_numpy()
    gsize = comm["group_size"].to_numpy(dtype=float, na_value=np.nan)
    coll = comm["collective"].astype(str).to_numpy()
    for k, (r, gr, pg, gs, c) in enumerate(zip(rank_col.tolist(), granks, pgn, gsize, coll)):
        members = _parse_ranks(gr)
        if members is None and pg is not None and pg_by_rank:
            members = (pg_by_rank.get(int(r)) or {}).get(str(pg))
        if members is None and mesh is not None:
            open_why[k] = AMBIGUOUS  # (a barrier or an unknown kind: no dimension's)
        if members is None and dim_groups and c not in _NO_LAYOUT:
            # The layout's groups of the call's kind (and size, when recorded) that hold the rank;
            # unique only when one dimension qualifies (TP2 x DP2 cannot tell an all-reduce's group).
            cands = set()
            for dim in _LAYOUT_DIMS["p2p" if c in _P2P else "collective"]:
                g = dim_groups.get(dim)
                if g is None or (np.isfinite(gs) and g.shape[1] != int(gs)):
                    continue
                row = np.flatnonzero((g == int(r)).any(axis=1))
                if len(row):
                    cands.add(tuple(int(x) for x in g[row[0]]))
            # torch lists every group the rank is in: a layout group it lacks is not the job's
            mine = {tuple(sorted(m)) for m in ((pg_by_rank or {}).get(int(r)) or {}).values()}
            if mine:
                cands = {m for m in cands if tuple(sorted(m)) in mine}
            if len(cands) == 1:
                (members,) = cands
                inferred[k] = True
            elif not cands:
                open_why[k] = NOT_IN_LAYOUT
        if members is not None and int(r) not in members:
            members = None  # a group name resolved to a group this rank is not in: do not trust it
        out.append(members)
    return out, inferred, open_why


def _overlap(idx: list[int], start: np.ndarray, dur: np.ndarray) -> bool:
    """One instance: each call still running when the last one started (none can end before all arrived)."""
    return max(start[j] for j in idx) <= min(start[j] + dur[j] for j in idx) + _OVERLAP_TOLERANCE_US


def _causal(pair: list[int], start: np.ndarray, dur: np.ndarray) -> bool:
    """One transfer [send, recv]: the recv cannot end before its send started. (A send may end
    before its recv starts: gloo and NCCL buffer small messages, so no overlap is required.)"""
    s, r = pair
    return start[r] + dur[r] + _OVERLAP_TOLERANCE_US >= start[s]


def annotate_transfers(ops: pd.DataFrame, pg_by_rank: dict[int, dict[str, tuple[int, ...]]] | None = None,
                       mesh=None) -> pd.DataFrame:
    """Fill transfer_us, wait_us, coll_instance, transfer_source and transfer_why of the collective
    rows of an OpTable, and group_size where the call recorded none but its group is known (in
    place; returns it). start_us must share one time base across ranks."""
    for c, dt in (("transfer_us", "float64"), ("wait_us", "float64")):
        ops[c] = np.full(len(ops), np.nan)
    ops["coll_instance"] = pd.array([pd.NA] * len(ops), dtype="Int64")
    ops["transfer_source"] = pd.Categorical([None] * len(ops), categories=[INSTANCE, ENVELOPE])
    ops["transfer_why"] = pd.Categorical([None] * len(ops), categories=list(WHY))
    is_comm = (ops["op_class"] == "communication") & ops["collective"].notna()
    if not is_comm.any():
        return ops
    comm = ops.loc[is_comm]
    idx = comm.index.to_numpy()
    members, inferred, open_why = group_of_rows(comm, pg_by_rank, mesh)
    start = comm["start_us"].to_numpy(float)
    dur = comm["dur_us"].to_numpy(float)
    rank = comm["rank"].to_numpy()
    coll = comm["collective"].astype(str).to_numpy()
    size = comm["msg_bytes"].to_numpy(dtype=float, na_value=np.nan)
    peer_col = comm["peer"].to_numpy(dtype=float, na_value=np.nan) if "peer" in comm else np.full(len(comm), np.nan)
    ranks_present = set(int(r) for r in ops["rank"].unique())
    sz = [size[i] if np.isfinite(size[i]) else -1.0 for i in range(len(comm))]

    transfer = np.full(len(comm), np.nan)
    inst = np.full(len(comm), -1, dtype=np.int64)
    why = np.array([None] * len(comm), dtype=object)
    next_id = 0

    def last_member(calls: list[int]) -> float:
        return dur[max(calls, key=lambda j: start[j])]  # from the last member's start to its end

    def receiver(pair: list[int]) -> float:
        # [send, recv]: from the later start to the recv's end, when the receiver holds the data.
        # (A send's span can outlast the transfer: gloo closes it when the work is waited on.)
        s, r = pair
        return start[r] + dur[r] - max(start[s], start[r])

    def match(lists: list[list[int]], check, transfer_of) -> str | None:
        """Pair the k-th call of each list into one instance; the reason when they cannot be."""
        nonlocal next_id
        lists = [sorted(lst, key=lambda j: start[j]) for lst in lists]
        counts = {len(lst) for lst in lists}
        if len(counts) != 1 or 0 in counts:
            return UNMATCHED  # a member's calls were cut off by the profiling window
        groups = [list(calls) for calls in zip(*lists)]
        if check and not all(check(g, start, dur) for g in groups):
            return UNMATCHED  # calls that never ran together: the layout is not the job's
        for calls in groups:
            t = max(0.0, transfer_of(calls))
            for j in calls:
                transfer[j] = min(t, dur[j])
                inst[j] = next_id
            next_id += 1
        return None

    # --- instances: calls of one (group, collective, size), k-th call of each member together
    by_key: dict[tuple, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    key_inferred: dict[tuple, bool] = defaultdict(bool)
    # --- point-to-point: (sender, receiver, size) -> the sends on the sender, the recvs on the receiver
    p2p: dict[tuple, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for i, m in enumerate(members):
        if m is None:
            why[i] = open_why[i] or NO_GROUP
            continue
        if coll[i] in ("send", "recv"):
            p = peer_col[i]
            other = m[int(p)] if np.isfinite(p) and 0 <= int(p) < len(m) else (
                next(x for x in m if x != int(rank[i])) if len(m) == 2 else None)
            if other is None or other == int(rank[i]):
                why[i] = AMBIGUOUS  # the peer is not known (no dst/src recorded, a group of more than 2)
            elif other not in ranks_present:
                why[i] = MEMBERS_MISSING
            elif coll[i] == "send":
                p2p[(int(rank[i]), other, sz[i])][0].append(i)
            else:
                p2p[(other, int(rank[i]), sz[i])][1].append(i)
            continue
        if len(m) < 2:
            continue  # a group of one waits for nobody: its envelope misses nothing
        if coll[i] in _P2P:
            why[i] = AMBIGUOUS  # a fused send_recv names no single peer
            continue
        if not set(m) <= ranks_present:
            why[i] = MEMBERS_MISSING
            continue
        key = (m, coll[i], sz[i])
        by_key[key][int(rank[i])].append(i)
        key_inferred[key] |= bool(inferred[i])
    for key, per_rank in by_key.items():
        bad = match([per_rank.get(r, []) for r in key[0]], _overlap if key_inferred[key] else None, last_member)
        if bad:
            for lst in per_rank.values():
                why[lst] = bad
    for sends, recvs in p2p.values():
        bad = match([sends, recvs], _causal, receiver)
        if bad:
            why[sends + recvs] = bad
    src = np.where(inst >= 0, INSTANCE, None).astype(object)
    why[inst >= 0] = None
    # --- lower envelope for the rest, per (collective, size, group or group size)
    rest = np.flatnonzero(inst < 0)
    if len(rest):
        gs = comm["group_size"].to_numpy(dtype=float, na_value=np.nan)
        keys = [(coll[i], sz[i], members[i] if members[i] is not None else (gs[i] if np.isfinite(gs[i]) else -1.0))
                for i in rest]
        env: dict[tuple, float] = {}
        for i, k in zip(rest.tolist(), keys):
            env[k] = min(env.get(k, np.inf), dur[i])
        for i, k in zip(rest.tolist(), keys):
            transfer[i] = env[k]
            src[i] = ENVELOPE
    ops.loc[idx, "transfer_us"] = transfer
    ops.loc[idx, "wait_us"] = np.maximum(dur - transfer, 0.0)
    ops.loc[idx, "coll_instance"] = pd.array([int(x) if x >= 0 else pd.NA for x in inst.tolist()], dtype="Int64")
    ops.loc[idx, "transfer_source"] = pd.Categorical(src, categories=[INSTANCE, ENVELOPE])
    ops.loc[idx, "transfer_why"] = pd.Categorical(why, categories=list(WHY))
    # A group known from pg_config or the layout gives the size the call did not record; a
    # point-to-point transfer's group is its two ranks.
    gs_now = comm["group_size"].to_numpy(dtype=float, na_value=np.nan)
    fill = [(j, 2 if coll[j] in _P2P else len(m)) for j, m in enumerate(members)
            if m is not None and not np.isfinite(gs_now[j])]
    if fill:
        ops.loc[idx[[j for j, _ in fill]], "group_size"] = [g for _, g in fill]
    return ops
