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
layout the user gives (a ``Mesh``: TP/CP/EP/DP/PP arithmetic). Calls are never grouped by being
concurrent and of the same size: concurrent same-size calls of different groups are common
(every TP group all-reduces the same activation at the same time).
"""

from __future__ import annotations

import ast
from collections import defaultdict

import numpy as np
import pandas as pd

INSTANCE = "instance"
# Point-to-point calls pair a send on one rank with a recv on another, often inside the world
# group: the k-th call per member is no instance of them, so they take the lower envelope.
_P2P = ("send", "recv", "send_recv")
ENVELOPE = "envelope"


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
                  mesh=None) -> list[tuple[int, ...] | None]:
    """The member ranks of each collective row's group, or None where it cannot be known."""
    out: list[tuple[int, ...] | None] = []
    mesh_groups: dict[int, list[np.ndarray]] = {}
    if mesh is not None:
        for dim in ("tp", "cp", "ep", "dp", "pp"):
            g = mesh.groups(dim)
            if g.shape[1] > 1:
                mesh_groups.setdefault(int(g.shape[1]), []).append(g)
    rank_col = comm["rank"].to_numpy()
    granks = comm["group_ranks"].astype(object).to_numpy()
    pgn = comm["pg_name"].astype(object).to_numpy()
    gsize = comm["group_size"].to_numpy(dtype=float, na_value=np.nan)
    for r, gr, pg, gs in zip(rank_col.tolist(), granks, pgn, gsize):
        members = _parse_ranks(gr)
        if members is None and pg is not None and pg_by_rank:
            members = (pg_by_rank.get(int(r)) or {}).get(str(pg))
        if members is None and mesh is not None and np.isfinite(gs):
            # The layout's groups of this size that hold the rank; unique only when one
            # dimension has this size (TP2 x DP2 cannot tell a 2-rank call's group).
            cands = []
            for g in mesh_groups.get(int(gs), []):
                row = np.flatnonzero((g == int(r)).any(axis=1))
                if len(row):
                    cands.append(tuple(int(x) for x in g[row[0]]))
            if len(set(cands)) == 1:
                members = cands[0]
        if members is not None and int(r) not in members:
            members = None  # a group name resolved to a group this rank is not in: do not trust it
        out.append(members)
    return out


def annotate_transfers(ops: pd.DataFrame, pg_by_rank: dict[int, dict[str, tuple[int, ...]]] | None = None,
                       mesh=None) -> pd.DataFrame:
    """Fill transfer_us, wait_us, coll_instance and transfer_source of the collective rows of an
    OpTable (in place; returns it). start_us must share one time base across ranks."""
    for c, dt in (("transfer_us", "float64"), ("wait_us", "float64")):
        ops[c] = np.full(len(ops), np.nan)
    ops["coll_instance"] = pd.array([pd.NA] * len(ops), dtype="Int64")
    ops["transfer_source"] = pd.Categorical([None] * len(ops), categories=[INSTANCE, ENVELOPE])
    is_comm = (ops["op_class"] == "communication") & ops["collective"].notna()
    if not is_comm.any():
        return ops
    comm = ops.loc[is_comm]
    idx = comm.index.to_numpy()
    members = group_of_rows(comm, pg_by_rank, mesh)
    start = comm["start_us"].to_numpy(float)
    dur = comm["dur_us"].to_numpy(float)
    rank = comm["rank"].to_numpy()
    coll = comm["collective"].astype(str).to_numpy()
    size = comm["msg_bytes"].to_numpy(dtype=float, na_value=np.nan)
    ranks_present = set(int(r) for r in ops["rank"].unique())

    transfer = np.full(len(comm), np.nan)
    inst = np.full(len(comm), -1, dtype=np.int64)
    # --- instances: calls of one (group, collective, size), k-th call of each member together
    by_key: dict[tuple, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, m in enumerate(members):
        if m is None or len(m) < 2 or not set(m) <= ranks_present or coll[i] in _P2P:
            continue
        by_key[(m, coll[i], size[i] if np.isfinite(size[i]) else -1.0)][int(rank[i])].append(i)
    next_id = 0
    for (m, _, _), per_rank in by_key.items():
        lists = [sorted(per_rank.get(r, []), key=lambda j: start[j]) for r in m]
        counts = {len(lst) for lst in lists}
        if len(counts) != 1 or 0 in counts:
            continue  # a member's calls were cut off by the profiling window: use the envelope
        for calls in zip(*lists):
            calls = list(calls)
            last = max(calls, key=lambda j: start[j])
            t = max(0.0, dur[last])  # from the last member's start to its end
            for j in calls:
                transfer[j] = min(t, dur[j])
                inst[j] = next_id
            next_id += 1
    src = np.where(inst >= 0, INSTANCE, None).astype(object)
    # --- lower envelope for the rest, per (collective, size, group or group size)
    rest = np.flatnonzero(inst < 0)
    if len(rest):
        gs = comm["group_size"].to_numpy(dtype=float, na_value=np.nan)
        keys = [(coll[i], size[i] if np.isfinite(size[i]) else -1.0,
                 members[i] if members[i] is not None else (gs[i] if np.isfinite(gs[i]) else -1.0)) for i in rest]
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
    return ops
