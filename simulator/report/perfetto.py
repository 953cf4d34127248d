"""Chrome trace JSON that ui.perfetto.dev (and chrome://tracing) opens.

X (complete) events in µs, a pid per rank, a tid per stream. The JSON importer nests events of one
track by time, so two events on one tid must be disjoint or strictly nested; a stream whose events
ever overlap (concurrent transfers, say) is split into extra tids ("dp #2") by greedy interval
partitioning, which uses the fewest tracks possible.

Times are rounded to whole nanoseconds first, so float noise in the simulation cannot turn two
back-to-back events into an overlap.

On each compute track the ops nest under their action's slice ("F stage 2 mb 5": the run of one
action's ops), and the compute stream's waits are slices of their own ("wait tp: ..."), so a gap
says why it is there. Flow arrows join each pipeline send to its receive on the other rank. With
the simulation result at hand the trace also has counter tracks (memory per rank against time,
bytes on the wire per dimension and tier) and the scenario in its metadata.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import pandas as pd

from simulator.vocabulary import STREAM_NAMES

if TYPE_CHECKING:
    from simulator.engine.core import Timeline
    from simulator.simulate import SimulationResult

STREAM_ORDER = list(STREAM_NAMES)
# Beyond this many simulated ranks the default is one representative per pipeline rank: a full-mode
# trace of thousands of ranks is too big for a browser tab to load.
MAX_DEFAULT_RANKS = 64
TIDS_PER_STREAM = 100  # room for overflow tracks: stream k uses tids k*100 + 1 ... k*100 + 99


def default_ranks(tl: "Timeline", limit: int = MAX_DEFAULT_RANKS) -> list[int]:
    ranks = sorted(tl.ranks)
    if len(ranks) <= limit:
        return ranks
    first: dict[int, int] = {}
    for r in ranks:
        first.setdefault(tl.pp_rank_of[r], r)
    return [first[p] for p in sorted(first)]


def assign_tracks(start_ns: np.ndarray, end_ns: np.ndarray, allow_nesting: bool = False) -> np.ndarray:
    """Track index (0, 1, ...) per interval so that two intervals on a track never cross.

    Intervals are visited by start (longest first at equal starts); each goes to the lowest-numbered
    track where it fits: after the track's last interval (touching allowed), or, with
    ``allow_nesting``, inside the innermost interval still open there (how ops sit under their
    action's slice). Without nesting this uses the fewest tracks possible."""
    n = len(start_ns)
    track = np.zeros(n, dtype=np.int64)
    if n == 0:
        return track
    order = np.lexsort((-end_ns, start_ns))
    s, e = start_ns[order], end_ns[order]
    if np.all(s[1:] >= np.maximum.accumulate(e)[:-1]):
        return track  # the usual case: a stream runs one thing at a time
    stacks: list[list[int]] = []  # per track, the ends of its open intervals (innermost last)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        si, ei = s[i], e[i]
        for k, st in enumerate(stacks):
            while st and st[-1] <= si:
                st.pop()
            if not st or (allow_nesting and ei <= st[-1]):
                st.append(ei)
                out[i] = k
                break
        else:
            stacks.append([ei])
            out[i] = len(stacks) - 1
    track[order] = out
    return track


def action_rows(ev: pd.DataFrame) -> pd.DataFrame:
    """Parent slices for the compute tracks: each run of consecutive compute rows of one rank that
    belong to one action (stage, microbatch, kind), spanning its first op's start to its last op's end."""
    c = ev[(ev["stream"] == "compute") & (ev["microbatch"] >= 0)].sort_values(["rank", "start_s"], kind="stable")
    if c.empty:
        return c
    r, st, mb, k = (c[x].to_numpy() for x in ("rank", "stage", "microbatch", "kind"))
    new = np.ones(len(c), dtype=bool)
    new[1:] = (r[1:] != r[:-1]) | (st[1:] != st[:-1]) | (mb[1:] != mb[:-1]) | (k[1:] != k[:-1])
    gid = np.cumsum(new)
    g = c.assign(gid=gid).groupby("gid", sort=False).agg(
        rank=("rank", "first"), kind=("kind", "first"), start_s=("start_s", "min"), end_s=("end_s", "max"),
        microbatch=("microbatch", "first"), stage=("stage", "first"), n=("name", "size"))
    out = pd.DataFrame({
        "rank": g["rank"].to_numpy(), "stream": "compute", "kind": "action",
        "name": [f"{k} stage {s} mb {m}" for k, s, m in zip(g["kind"], g["stage"], g["microbatch"])],
        "start_s": g["start_s"].to_numpy(), "end_s": g["end_s"].to_numpy(), "microbatch": g["microbatch"].to_numpy(),
        "stage": g["stage"].to_numpy(), "layer": -1, "bytes": 0.0,
    })
    return out[list(ev.columns)]


def wait_rows(tl: "Timeline", ranks: Sequence[int]) -> pd.DataFrame | None:
    from simulator.engine.lockstep import waits_of

    w = waits_of(tl, ranks)
    if w is None or not len(w):
        return None
    return pd.DataFrame({
        "rank": w["rank"].to_numpy(), "stream": "compute", "kind": ("wait " + w["cause"].astype(str)).to_numpy(),
        "name": ("wait " + w["cause"].astype(str) + ": " + w["what"].astype(str)).to_numpy(),
        "start_s": w["start_s"].to_numpy(), "end_s": w["end_s"].to_numpy(), "microbatch": -1, "stage": -1,
        "layer": -1, "bytes": 0.0,
    })


def perfetto_events(tl: "Timeline", ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    ranks = sorted(default_ranks(tl) if ranks is None else {int(r) for r in ranks})
    unknown = sorted(set(ranks) - set(tl.ranks))
    if unknown:
        from simulator.errors import UserError

        raise UserError(f"ranks {unknown[:5]} were not simulated (simulated: {len(tl.ranks)} ranks, e.g. "
                        f"{sorted(tl.ranks)[:4]}): pick simulated ranks, or simulate with --mode full")
    from simulator.engine.lockstep import events_of

    ev = events_of(tl, ranks)  # (a lockstep timeline makes these ranks' rows only)
    extra = [action_rows(ev)]
    waits = wait_rows(tl, ranks)
    if waits is not None:
        extra.append(waits)
    ev = pd.concat([ev, *[x for x in extra if len(x)]], ignore_index=True)
    streams = [s for s in STREAM_ORDER if s in set(ev["stream"])] + sorted(set(ev["stream"]) - set(STREAM_ORDER))
    stream_index = {s: i + 1 for i, s in enumerate(streams)}

    start_ns = np.rint(ev["start_s"].to_numpy() * 1e9).astype(np.int64)
    end_ns = np.maximum(np.rint(ev["end_s"].to_numpy() * 1e9).astype(np.int64), start_ns)
    tid = np.zeros(len(ev), dtype=np.int64)
    used: dict[tuple[int, str], int] = {}
    for (rank, stream), idx in pd.Series(np.arange(len(ev))).groupby([ev["rank"].to_numpy(), ev["stream"].to_numpy()]):
        ii = idx.to_numpy()
        tracks = assign_tracks(start_ns[ii], end_ns[ii], allow_nesting=stream == "compute")
        over = int(tracks.max()) + 1
        if over >= TIDS_PER_STREAM:
            raise ValueError(f"rank {rank} stream {stream} needs {over} concurrent tracks")
        tid[ii] = stream_index[stream] * TIDS_PER_STREAM + tracks
        used[(int(rank), str(stream))] = over

    out: list[dict[str, Any]] = []
    pp_of = tl.pp_rank_of
    for r in ranks:
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                    "args": {"name": f"rank {r} (pp {pp_of.get(r, '?')})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for s in streams:
            for k in range(used.get((r, s), 0)):
                t = stream_index[s] * TIDS_PER_STREAM + k
                out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": t,
                            "args": {"name": s if k == 0 else f"{s} #{k + 1}"}})
                out.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": t, "args": {"sort_index": t}})

    cols = zip(ev["rank"].tolist(), tid.tolist(), ev["kind"].astype(str).tolist(), ev["name"].astype(str).tolist(),
               start_ns.tolist(), (end_ns - start_ns).tolist(), ev["microbatch"].tolist(), ev["stage"].tolist(),
               ev["layer"].tolist(), ev["bytes"].tolist())
    for rank, t, kind, name, ts, dur, mb, stage, layer, nbytes in cols:
        args: dict[str, Any] = {}
        if mb >= 0:
            args["microbatch"] = int(mb)
        if stage >= 0:
            args["stage"] = int(stage)
        if layer >= 0:
            args["layer"] = int(layer)
        if nbytes:
            args["bytes"] = float(nbytes)
        out.append({"ph": "X", "name": name, "cat": kind, "pid": int(rank), "tid": t,
                    "ts": ts / 1000, "dur": dur / 1000, "args": args})
    out += _pp_flows(ev, tid, start_ns, end_ns)
    return out


def _pp_flows(ev: pd.DataFrame, tid: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray) -> list[dict[str, Any]]:
    """A flow arrow from each pipeline send slice to its receive slice (same transfer: same times,
    microbatch and stage, on the sending and the receiving rank)."""
    out: list[dict[str, Any]] = []
    stream = ev["stream"].to_numpy()
    idx = np.arange(len(ev))
    rows = {}
    for which in ("f", "b"):
        send = idx[stream == f"pp-send-{which}"]
        recv = idx[stream == f"pp-recv-{which}"]
        key = lambda i: (int(start_ns[i]), int(end_ns[i]), int(ev["microbatch"].iat[i]), int(ev["stage"].iat[i]))  # noqa: E731
        pending = {}
        for i in recv:
            pending.setdefault(key(i), []).append(i)
        for i in send:
            lst = pending.get(key(i))
            if lst:
                rows[i] = lst.pop(0)
    ranks = ev["rank"].to_numpy()
    for n, (i, j) in enumerate(sorted(rows.items())):
        name = str(ev["name"].iat[i])
        out.append({"ph": "s", "id": n + 1, "name": name, "cat": "pp", "pid": int(ranks[i]), "tid": int(tid[i]),
                    "ts": start_ns[i] / 1000})
        out.append({"ph": "f", "bp": "e", "id": n + 1, "name": name, "cat": "pp", "pid": int(ranks[j]),
                    "tid": int(tid[j]), "ts": start_ns[j] / 1000})
    return out


def counter_events(result: "SimulationResult", ranks: Sequence[int]) -> list[dict[str, Any]]:
    """Counter tracks: memory (GiB) of each shown rank's pipeline rank over the step, and bytes on
    the wire per dimension and tier (GB/s per GPU) on the first shown rank."""
    from simulator.report.dashboard import comm_rate_series, memory_over_time

    tl = result.timeline
    out: list[dict[str, Any]] = []
    try:
        mem = memory_over_time(result)
    except (KeyError, IndexError, AttributeError, TypeError):
        mem = {}
    for r in ranks:
        series = mem.get(tl.pp_rank_of.get(r, -1))
        if series is None:
            continue
        t, gib = series
        keep = np.concatenate([[True], np.diff(gib) != 0])  # one sample per change
        for ts, v in zip(t[keep].tolist(), gib[keep].tolist()):
            out.append({"ph": "C", "name": "memory GiB", "pid": int(r), "ts": round(ts * 1e6, 3), "args": {"GiB": round(v, 3)}})
    if ranks:
        for d, (t, gbps, tier) in comm_rate_series(result).items():
            name = f"wire GB/s {d} ({tier})"
            for ts, v in zip(t.tolist(), gbps.tolist()):
                out.append({"ph": "C", "name": name, "pid": int(ranks[0]), "ts": round(ts * 1e6, 3), "args": {"GB/s": round(v, 3)}})
    return out


def perfetto_trace(tl: "Timeline", ranks: Sequence[int] | None = None,
                   result: "SimulationResult | None" = None) -> dict[str, Any]:
    """The trace as a dict (json.dumps it). ``ranks``: which simulated ranks to include; by default
    all of them up to 64, else one representative per pipeline rank. ``result`` (the simulation)
    adds counter tracks and the scenario and headline numbers to the metadata."""
    events = perfetto_events(tl, ranks)
    other: dict[str, Any] = {"generator": "clustersim", "step_time_s": tl.step_time_s, "mode": tl.mode}
    if result is not None:
        shown = sorted({e["pid"] for e in events if e.get("ph") == "X"})
        events += counter_events(result, shown)
        rep = result.report
        other.update({
            "scenario_name": result.scenario.name,
            "scenario": json.dumps(result.scenario.model_dump(mode="json"), separators=(",", ":")),
            "mfu": rep.mfu, "tokens_per_s": rep.tokens_per_s, "peak_memory_gib": rep.peak_memory_gib,
            "step_breakdown_s": json.dumps(rep.step_breakdown_s, separators=(",", ":")),
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def check_nesting(events: Iterable[dict[str, Any]]) -> list[str]:
    """Problems that would make a trace viewer mis-nest X events: on each (pid, tid), every pair of
    events must be disjoint or one inside the other. Empty when the trace is sound."""
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for e in events:
        if e.get("ph") == "X":
            # compare in whole ns: ts + dur in float µs carries rounding noise at large ts
            s = round(e["ts"] * 1000)
            tracks.setdefault((e["pid"], e["tid"]), []).append((s, s + round(e["dur"] * 1000), e["name"]))
    problems = []
    for key, items in tracks.items():
        items.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[int, int, str]] = []
        for s, e, name in items:
            while stack and stack[-1][1] <= s:
                stack.pop()
            if stack and e > stack[-1][1]:
                problems.append(f"pid {key[0]} tid {key[1]}: {name!r} [{s}, {e}] ns crosses {stack[-1][2]!r} "
                                f"[{stack[-1][0]}, {stack[-1][1]}] ns")
                if len(problems) > 20:
                    return problems
            stack.append((s, e, name))
    return problems


def dumps(trace: dict[str, Any]) -> str:
    """Compact JSON (the trace of a big scenario is tens of MB with indentation)."""
    return json.dumps(trace, separators=(",", ":"))
