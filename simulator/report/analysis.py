"""Where the step's time goes: the exact step-time breakdown and the critical path.

Step-time breakdown (per simulated rank, then the mean over ranks). Each rank's compute stream
is, at every instant of the step, in exactly one of these states, so the parts sum to the step:

    compute     running kernels (forward, backward, weight-gradient), optimizer excluded
    optimizer   the optimizer step at the end
    exposed_d   waiting on a collective or transfer of dimension d (tp, cp, ep, pp, dp)
    bubble      waiting on another stage's compute (pipeline fill/drain), or idle after the
                rank finished while slower ranks still run
    imbalance   the part of that idle time a perfectly balanced pipeline would not have: the
                slowest stage's compute minus this rank's stage's (capped at its idle time); in
                a what-if run (``stages``), the slowest stage of this rank's own model replica

Every part is measured on its own (compute rows, recorded waits, the tail after the rank's end);
``unattributed`` is the step minus their sum and stays ~0 when the engine accounts for every wait.

Critical path: walked backwards from the rank that ends the step. On a rank's compute lane the
tile ending at time t is either compute (take it, go to its start), a wait on a collective of the
same rank (take the collective from its issue), or a wait on a pipeline transfer (take the
transfer, then continue on the sending rank where the transfer started). In reduced mode every
collective's members are symmetric, so staying on the rank is exact; in full mode a collective's
last arriving member is not looked up (the path stays on the waiting rank).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np
import pandas as pd

from simulator.engine.steady import row_totals

if TYPE_CHECKING:
    from simulator.engine.core import Timeline
    from simulator.whatif.split import Stages

DIMS = ("tp", "cp", "ep", "pp", "dp")
CAUSES = ("bubble",) + DIMS
# host_launch: of the compute stream's busy time, the device waiting for the host to issue
# kernels (simulator.workload.program.host_launch_wait_s); compute is the rest.
BREAKDOWN_KEYS = ("compute", "host_launch") + tuple(f"exposed_{d}" for d in DIMS) + ("bubble", "imbalance", "optimizer")
EPS_S = 1e-12


def rank_breakdown(tl: "Timeline", host_wait_s: dict[int, float] | None = None,
                   stages: Stages | None = None) -> dict[int, dict[str, float]]:
    """Per simulated rank: the parts of BREAKDOWN_KEYS (seconds) and ``unattributed``.
    ``host_wait_s``: per pipeline rank, the part of its compute time spent waiting for the host
    to issue kernels (the plan's, simulator.workload.program.host_launch_wait_s); 0 if None.
    ``stages``: where ranks of one pipeline rank differ (what-if runs), each rank's stage and
    replica (``simulator.whatif.split.stage_groups``); None: every replica alike, each rank its own stage."""
    step = tl.step_time_s
    waits = getattr(tl, "waits", None)
    ends = getattr(tl, "end_time_s", None) or {}
    # What the rows sum to: from the rows, or, where the fast path made none for the periods
    # it replayed, as it summed them (the same sums, simulator.engine.steady.row_totals).
    totals = getattr(tl, "row_totals", None)
    if totals is None:
        totals = row_totals(tl.events, waits)
    opt, busy, bubble_w = totals["opt_s"], totals["compute_s"], totals["bubble_wait_s"]
    out: dict[int, dict[str, float]] = {}
    for r in tl.ranks:
        compute = busy.get(r, 0.0) - opt
        exposed = {d: float(tl.exposed_s[r].get(d, 0.0)) for d in DIMS}
        if waits is not None and r in ends:
            idle = float(bubble_w.get(r, 0.0)) + max(0.0, step - float(ends[r]))
        else:  # an engine that records no waits: idle is what is left
            idle = max(0.0, step - compute - opt - sum(exposed.values()))
        row = {"compute": compute, **{f"exposed_{d}": v for d, v in exposed.items()}, "idle": idle, "optimizer": opt}
        out[r] = row
    max_c = max((row["compute"] for row in out.values()), default=0.0)
    stage_c: dict[int, float] = {}
    if stages is not None:
        # A slow GPU makes its stage peers wait inside every layer (exposed tp/cp/ep, already
        # counted), so a stage computes as long as its slowest member; and only the stages of
        # its own replica wait for it through the pipeline (other replicas wait at the DP
        # reduction, exposed dp). Against the slowest rank of the world every replica's idle
        # time turned into imbalance, and the tp peers' too.
        stage_c = {r: max(out[q]["compute"] for q in stages.stage[r] if q in out) for r in out}
    replica_max: dict[tuple[int, ...], float] = {}  # (full mode: every rank of a replica shares it)
    for r, row in out.items():
        idle = row.pop("idle")
        # (a rank issuing kernels is as busy as one running them: imbalance compares the two together)
        if stages is None:
            imb = min(idle, max(0.0, max_c - row["compute"]))
        else:
            peers = stages.replica[r]
            slowest = replica_max.get(peers)
            if slowest is None:
                slowest = replica_max[peers] = max(stage_c[q] for q in peers if q in out)
            imb = min(idle, max(0.0, slowest - stage_c[r]))
        row["imbalance"] = imb
        row["bubble"] = idle - imb
        waited = host_wait_s.get(tl.pp_rank_of.get(r, 0), 0.0) if host_wait_s else 0.0
        row["host_launch"] = min(max(0.0, waited), max(0.0, row["compute"]))
        row["compute"] -= row["host_launch"]
        row["unattributed"] = step - sum(row[k] for k in BREAKDOWN_KEYS)
    return {r: {k: row[k] for k in (*BREAKDOWN_KEYS, "unattributed")} for r, row in out.items()}


def step_breakdown(tl: "Timeline") -> dict[str, float]:
    """The mean over simulated ranks of :func:`rank_breakdown` (each rank sums to the step, so the
    mean does too)."""
    per = rank_breakdown(tl)
    n = max(1, len(per))
    return {k: sum(row[k] for row in per.values()) / n for k in (*BREAKDOWN_KEYS, "unattributed")}


# ---------------------------------------------------------------------------------------------
# critical path


class _Tiles:
    """Per rank, the compute lane as tiles (compute rows and waits) sorted by end: the sorted ends
    (the walk's binary search) and, per tile, where it came from; a tile's other columns are read
    from the events' and the waits' own columns when the walk visits it. The walk visits a few
    thousand of millions of tiles, so no column but the sort keys is gathered or copied (full mode
    at 1,024 GPUs: the copied columns were ~0.25 GiB and ~0.4 s)."""

    def __init__(self, tl: "Timeline"):
        ev = tl.events
        self.ci = ci = np.flatnonzero((ev["stream"] == "compute").to_numpy())
        waits = getattr(tl, "waits", None)
        self.waits = waits if waits is not None and len(waits) else None
        nw = 0 if self.waits is None else len(self.waits)
        self.nc = nc = len(ci)

        def both(name: str) -> np.ndarray:
            comp = ev[name].to_numpy()[ci]
            return comp if self.waits is None else np.concatenate([comp, self.waits[name].to_numpy()])

        rank, start, end = both("rank"), both("start_s"), both("end_s")
        # One stable sort by (rank, end, start) and a slice per rank: the order a per-rank stable
        # sort by (end, start) gives, without a groupby and a sort per rank. Empty tiles are
        # dropped after the sort (a stable sort keeps the rest in the order it gives them alone),
        # so no filtered copy of the keys is made. Each key array is freed once used: at 1,024
        # GPUs in full mode (categorical string columns) the walk's set-up was the run's peak of memory.
        order = np.lexsort((start, end, rank))
        order = order[(end > start)[order]]
        del start
        self.pos = order  # position in (compute rows, then waits)
        self.end_s = end[order]
        del end
        rank = rank[order]  # sorted: each rank's first tile is where the value changes
        first = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]]) if len(rank) else np.zeros(0, dtype=np.int64)
        ranks = rank[first]
        del rank
        bounds = list(first) + [len(order)]
        self.span = {int(r): (bounds[i], bounds[i + 1]) for i, r in enumerate(ranks)}
        self.ev_cols = {c: ev[c].to_numpy() for c in ("rank", "start_s", "end_s", "microbatch", "stage")}
        self.ev_str = {c: ev[c].array for c in ("name", "kind")}
        if self.waits is not None:
            w = self.waits
            self.w_cols = {c: w[c].to_numpy() for c in ("rank", "start_s", "end_s", "issued_s", "src_rank")}
            self.w_what = w["what"].array
            # the walk branches on a wait's cause: codes of a categorical, read once (a scalar
            # read of an Arrow string column costs ~5-15 us, thousands of times a walk)
            cause = w["cause"].astype("category")
            self.w_cause_code = cause.cat.codes.to_numpy()
            self.w_cause_name = [str(c) for c in cause.cat.categories]

    def lane_ends(self, rank: int) -> np.ndarray | None:
        sp = self.span.get(rank)
        return None if sp is None else self.end_s[sp[0]:sp[1]]

    def row(self, rank: int, i: int) -> dict[str, Any]:
        """Tile ``i`` of ``rank``'s lane (in end order). Its "what" and "kind" are references
        (``_Ref``) into the string columns, read in one take per column when the walk ends
        (`resolve`)."""
        k = int(self.pos[self.span[rank][0] + i])
        if k < self.nc:
            j = int(self.ci[k])
            c = self.ev_cols
            return {"rank": c["rank"][j], "start_s": c["start_s"][j], "end_s": c["end_s"][j], "issued_s": np.nan,
                    "src_rank": -1, "microbatch": c["microbatch"][j], "stage": c["stage"][j], "cause": "compute",
                    "what": _Ref("name", j), "kind": _Ref("kind", j)}
        j = k - self.nc
        c = self.w_cols
        code = int(self.w_cause_code[j])
        cause = self.w_cause_name[code] if code >= 0 else str(pd.NA)
        return {"rank": c["rank"][j], "start_s": c["start_s"][j], "end_s": c["end_s"][j], "issued_s": c["issued_s"][j],
                "src_rank": c["src_rank"][j], "microbatch": -1, "stage": -1, "cause": cause,
                "what": _Ref("what", j), "kind": cause}

    def resolve(self, path: list[dict[str, Any]]) -> None:
        """Replace the path's references by their strings, one take per column."""
        for field in ("what", "kind"):
            refs = [(n, seg[field]) for n, seg in enumerate(path) if isinstance(seg[field], _Ref)]
            for column in ("name", "kind", "what"):
                mine = [(n, r.row) for n, r in refs if r.column == column]
                if not mine:
                    continue
                source = self.w_what if column == "what" else self.ev_str[column]
                values = source.take(np.array([j for _, j in mine], dtype=np.int64)).to_numpy(dtype=object)
                for (n, _), v in zip(mine, values):
                    path[n][field] = str(v)


class _Ref(NamedTuple):
    """A string cell of the timeline, read later in bulk: column "name"/"kind" of the events,
    "what" of the waits."""
    column: str
    row: int


class _CommRows:
    """Per rank, its communication rows (end, kind, start) as arrays, in row order, built for a
    rank when the walk first asks (it looks up the row ending at t once per dp wait on the path:
    hundreds under FSDP, where a pandas mask per look-up cost ~2 ms; and a sub-frame of every
    communication row copied millions of rows in full mode)."""

    def __init__(self, ev: pd.DataFrame):
        self.ev = ev
        rows = np.flatnonzero((ev["stream"] != "compute").to_numpy(dtype=bool))
        rank = ev["rank"].to_numpy()[rows]
        order = np.argsort(rank, kind="stable")
        self.rows, r_sorted = rows[order], rank[order]
        starts = np.flatnonzero(np.r_[True, r_sorted[1:] != r_sorted[:-1]]) if len(r_sorted) else np.zeros(0, int)
        bounds = list(starts) + [len(r_sorted)]
        self.span = {int(r_sorted[b]): (bounds[i], bounds[i + 1]) for i, b in enumerate(starts)}
        self.cache: dict[int, dict] = {}

    def _by_kind(self, rank: int) -> dict:
        hit = self.cache.get(rank)
        if hit is None:
            hit = {}
            if rank in self.span:
                a, b = self.span[rank]
                idx = self.rows[a:b]
                ev = self.ev
                end, start = ev["end_s"].to_numpy()[idx], ev["start_s"].to_numpy()[idx]
                kind = ev["kind"].array[idx].to_numpy(dtype=object)
                for k in dict.fromkeys(kind.tolist()):
                    sel = np.flatnonzero(kind == k)
                    order = np.argsort(end[sel], kind="stable")
                    hit[k] = (end[sel][order], start[sel][order])
            self.cache[rank] = hit
        return hit

    def earliest_start(self, rank: int, kind: str, t: float, tol: float) -> float | None:
        """The earliest start of this rank's rows of this kind that end within tol of t (None if
        none). A window found by bisection over the kind's ends (sorted), then the exact test on
        it: a scan of every row per look-up made FSDP steps' critical path O(rows x waits)."""
        hit = self._by_kind(rank).get(kind)
        if hit is None:
            return None
        end, start = hit
        # widened by one ulp-scale margin so the exact test below decides at the edges
        pad = tol * 1e-3 + abs(t) * 1e-15
        a = int(end.searchsorted(t - tol - pad, side="left"))
        b = int(end.searchsorted(t + tol + pad, side="right"))
        if a >= b:
            return None
        m = np.abs(end[a:b] - t) <= tol
        if not m.any():
            return None
        return float(start[a:b][m].min())


def critical_path(tl: "Timeline") -> list[dict[str, Any]]:
    """Segments of the critical path in time order: dicts with rank, pp_rank, cause (compute or a
    dimension or bubble), kind, what, start_s, end_s, microbatch, stage. Contiguous from 0 to the step."""
    ends = getattr(tl, "end_time_s", None) or {}
    if not ends or getattr(tl, "waits", None) is None:
        return []
    tiles = _Tiles(tl)
    comm_by_rank = _CommRows(tl.events)
    tol = max(1e-12, tl.step_time_s * 1e-12)
    # The lowest rank of those ending the step: ranks that end together (after a step-wide
    # collective) differ by float rounding, which must not pick the rank the walk starts from.
    t_end = max(ends.values())
    rank = min(r for r in ends if ends[r] >= t_end - tol)
    t = float(ends[rank])
    path: list[dict[str, Any]] = []

    def add(r: int, cause: str, kind: str, what: str, s: float, e: float, mb: int = -1, st: int = -1):
        if e - s > 0:
            path.append({"rank": int(r), "pp_rank": int(tl.pp_rank_of.get(r, -1)), "cause": cause, "kind": kind,
                         "what": what, "start_s": float(s), "end_s": float(e), "microbatch": int(mb), "stage": int(st)})

    guard = 0
    limit = 4 * len(tiles.end_s) + 100
    while t > tol and guard < limit:
        guard += 1
        lane_ends = tiles.lane_ends(rank)
        if lane_ends is None or not len(lane_ends):
            break
        i = int(lane_ends.searchsorted(t + tol, side="right")) - 1
        if i < 0:
            add(rank, "bubble", "bubble", "idle before the first work", 0.0, t)
            break
        row = tiles.row(rank, i)
        if row["end_s"] < t - tol:
            # Nothing ends at t on this lane: the rank was idle from its last tile until t
            # (a transfer queued behind another on the send stream, or a rank's end of step).
            add(rank, "bubble", "bubble", "idle (a send queued behind another, or the end of the step)",
                float(row["end_s"]), t)
            t = float(row["end_s"])
            continue
        s0 = float(row["start_s"])
        cause = row["cause"]
        if cause == "compute":
            add(rank, "compute", row["kind"], row["what"], s0, t, row["microbatch"], row["stage"])
            t = s0
        elif cause == "pp" or (cause == "bubble" and int(row["src_rank"]) >= 0 and int(row["src_rank"]) != rank):
            src = int(row["src_rank"])
            issued = row["issued_s"]
            if cause == "pp" and not math.isnan(issued):
                add(rank, "pp", "pp", row["what"], float(issued), t)
                t = float(issued)
            if src in tiles.span:
                rank = src
            else:
                add(rank, "bubble", "bubble", row["what"], s0, t)
                t = s0
        elif cause in DIMS:
            issued = row["issued_s"]
            if math.isnan(issued):
                # find the communication row that ended at t (dp buckets, parameter gathers)
                found = comm_by_rank.earliest_start(rank, cause, t, max(tol, 1e-9))
                issued = s0 if found is None else found
            issued = min(float(issued), s0)
            # A collective queued behind others on its stream (FSDP2's reduce-scatters one after
            # another, a gather behind them) started when the one before it ended: follow the
            # queue back to where it was first reached, or the walk lands on the compute lane at
            # a time nothing ends and calls the queue idle.
            while True:
                before = comm_by_rank.earliest_start(rank, cause, issued, max(tol, 1e-9))
                if before is None or before >= issued - max(tol, 1e-9):
                    break
                issued = before
            add(rank, cause, cause, row["what"], issued, t)
            t = issued
        else:
            add(rank, "bubble", "bubble", row["what"], s0, t)
            t = s0
    path.reverse()
    tiles.resolve(path)
    return path


def split_host_launch(path: list[dict[str, Any]], shares: dict[tuple[int, str], float],
                      stage_position: Sequence[int]) -> list[dict[str, Any]]:
    """The path with each compute stretch of an action that waits on the host split in two:
    its kernels (cause compute) and, after them, its share of waiting for their launches (cause
    host_launch), ``shares`` per (position, kind) (program.host_wait_shares). The share is the
    action's: a stretch that covers part of an action gets that part's proportional share (the
    waits are spread over the action's segments; the path does not resolve which of them it
    crossed). The step breakdown's host_launch term is the exact per-rank sum."""
    if not shares:
        return path
    out = []
    for seg in path:
        share = 0.0
        if seg["cause"] == "compute" and 0 <= seg["stage"] < len(stage_position):
            share = shares.get((stage_position[seg["stage"]], seg["kind"]), 0.0)
        if share <= 0:
            out.append(seg)
            continue
        cut = seg["end_s"] - share * (seg["end_s"] - seg["start_s"])
        out.append({**seg, "end_s": cut})
        out.append({**seg, "cause": "host_launch", "start_s": cut})
    return out


def summarize_path(path: list[dict[str, Any]], limit: int = 400) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Seconds on the path per cause, and the path merged into at most ~``limit`` entries: runs of
    one rank and one action (compute with the collectives inside it), transfers and waits apart."""
    by_cause: dict[str, float] = {}
    for seg in path:
        by_cause[seg["cause"]] = by_cause.get(seg["cause"], 0.0) + seg["end_s"] - seg["start_s"]
    merged: list[dict[str, Any]] = []
    for seg in path:
        inside = seg["cause"] in ("compute", "host_launch", "tp", "cp", "ep")
        on_action = seg["cause"] in ("compute", "host_launch")
        key = (seg["rank"], seg["microbatch"], seg["stage"], seg["kind"]) if on_action else None
        last = merged[-1] if merged else None
        if last is not None and inside and last["_inside"] and last["rank"] == seg["rank"] and (
                key is None or last["_key"] is None or last["_key"] == key):
            last["end_s"] = seg["end_s"]
            last["by_cause_s"][seg["cause"]] = last["by_cause_s"].get(seg["cause"], 0.0) + seg["end_s"] - seg["start_s"]
            if key is not None and last["_key"] is None:
                last["_key"] = key
                last["what"] = _action_label(seg)
            continue
        merged.append({"rank": seg["rank"], "pp_rank": seg["pp_rank"], "start_s": seg["start_s"], "end_s": seg["end_s"],
                       "what": _action_label(seg) if on_action else f"{seg['cause']}: {seg['what']}",
                       "by_cause_s": {seg["cause"]: seg["end_s"] - seg["start_s"]}, "_inside": inside, "_key": key})
    for m in merged:
        m.pop("_inside")
        m.pop("_key")
    if len(merged) > limit:
        # keep the longest entries, in time order, so the list stays readable
        keep = sorted(sorted(range(len(merged)), key=lambda i: merged[i]["start_s"] - merged[i]["end_s"])[:limit])
        merged = [merged[i] for i in keep]
    return by_cause, merged


def _action_label(seg: dict[str, Any]) -> str:
    if seg["microbatch"] >= 0:
        return f"{seg['kind']} stage {seg['stage']} mb {seg['microbatch']}"
    return str(seg["what"])


BREAKDOWN_LABELS = {"compute": "compute", "host_launch": "host (kernel launches)", "exposed_tp": "exposed tp", "exposed_cp": "exposed cp",
                    "exposed_ep": "exposed ep", "exposed_pp": "exposed pp", "exposed_dp": "exposed dp",
                    "bubble": "bubble", "imbalance": "stage imbalance", "optimizer": "optimizer"}


# The critical path's causes as printed where the raw key reads badly (host_launch: the
# breakdown's "host (kernel launches)"); the others print as they are (compute, tp, ..., bubble).
PATH_CAUSE_NAMES = {"host_launch": "host"}


def breakdown_lines(report: Any) -> list[tuple[str, str]]:
    """(label, value) rows of the step breakdown and the critical path, for the terminal summary."""
    bd = report.step_breakdown_s
    step = report.step_time_s
    if not bd or step <= 0:
        return []
    rows = [(f"  {BREAKDOWN_LABELS[k]}", f"{bd[k]:.3f} s ({bd[k] / step:.1%})") for k in BREAKDOWN_KEYS
            if bd.get(k, 0.0) > 0.0005 * step]
    if rows:
        rows[0] = ("step = " + rows[0][0].strip(), rows[0][1])
        rows[1:] = [("  + " + label.strip(), v) for label, v in rows[1:]]
    cp = report.critical_path_s
    if cp:
        rows.append(("critical path", ", ".join(f"{PATH_CAUSE_NAMES.get(k, k)} {v / step:.0%}" for k, v in sorted(cp.items(), key=lambda x: -x[1])
                                                if v > 0.005 * step)))
    return rows


def memory_parts_line(report: Any, parts: int = 3) -> str:
    """The largest terms of the peak pipeline rank's memory, for the terminal summary
    ("gradients 23.3, gathered parameters 10.2, optimizer 5.8 GiB"); "" without a breakdown."""
    ranks = [r.get("memory_gib") for r in report.per_pp_rank or [] if r.get("memory_gib")]
    if not ranks:
        return ""
    worst = max(ranks, key=lambda m: m.get("total_gib", 0.0))
    terms = sorted(((k.removesuffix("_gib").replace("_", " "), v) for k, v in worst.items()
                    if k != "total_gib" and v >= 0.05), key=lambda kv: -kv[1])[:parts]
    return ", ".join(f"{k} {v:.1f}" for k, v in terms) + " GiB" if terms else ""


def step_delta(report_a: Any, report_b: Any) -> list[dict[str, Any]]:
    """Per component of the step breakdown: A, B and B - A in seconds, and the change as a share of
    A's step. The component deltas sum to the step delta (each side sums to its step); the last row
    is the step itself. Reports without a breakdown (older JSON) give the step row only."""
    rows = []
    ba, bb = report_a.step_breakdown_s or {}, report_b.step_breakdown_s or {}
    step_a = report_a.step_time_s
    if ba and bb:
        for k in (*BREAKDOWN_KEYS, "unattributed"):
            a, b = float(ba.get(k, 0.0)), float(bb.get(k, 0.0))
            if k == "unattributed" and abs(a) < 1e-9 and abs(b) < 1e-9:
                continue
            if a == 0.0 and b == 0.0:
                continue
            rows.append({"component": k, "label": BREAKDOWN_LABELS.get(k, k), "a_s": a, "b_s": b, "delta_s": b - a,
                         "delta_of_step": (b - a) / step_a if step_a else 0.0})
    rows.append({"component": "step", "label": "step", "a_s": step_a, "b_s": report_b.step_time_s,
                 "delta_s": report_b.step_time_s - step_a,
                 "delta_of_step": (report_b.step_time_s - step_a) / step_a if step_a else 0.0})
    return rows
