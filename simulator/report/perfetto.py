"""Chrome trace JSON that ui.perfetto.dev (and chrome://tracing) opens.

X (complete) events in µs, a pid per rank, a tid per stream. The JSON importer nests events of one
track by time, so two events on one tid must be disjoint or strictly nested; a stream whose events
ever overlap (concurrent transfers, say) is split into extra tids ("dp #2") by greedy interval
partitioning, which uses the fewest tracks possible.

Times are rounded to whole nanoseconds first, so float noise in the simulation cannot turn two
back-to-back events into an overlap.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import pandas as pd

from simulator.vocabulary import STREAM_NAMES

if TYPE_CHECKING:
    from simulator.engine.core import Timeline

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


def assign_tracks(start_ns: np.ndarray, end_ns: np.ndarray) -> np.ndarray:
    """Track index (0, 1, ...) per interval so that no two intervals on a track overlap.

    Intervals are visited by start; each goes to the lowest-numbered free track. Touching
    intervals (end == next start) share a track."""
    n = len(start_ns)
    track = np.zeros(n, dtype=np.int64)
    if n == 0:
        return track
    order = np.argsort(start_ns, kind="stable")
    s, e = start_ns[order], end_ns[order]
    if np.all(s[1:] >= np.maximum.accumulate(e)[:-1]):
        return track  # the usual case: a stream runs one thing at a time
    free_at: list[int] = []  # end time of the last interval on each track
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        for k, t in enumerate(free_at):
            if t <= s[i]:
                free_at[k] = e[i]
                out[i] = k
                break
        else:
            free_at.append(e[i])
            out[i] = len(free_at) - 1
    track[order] = out
    return track


def perfetto_events(tl: "Timeline", ranks: Sequence[int] | None = None) -> list[dict[str, Any]]:
    ranks = sorted(default_ranks(tl) if ranks is None else {int(r) for r in ranks})
    unknown = sorted(set(ranks) - set(tl.ranks))
    if unknown:
        from simulator.errors import UserError

        raise UserError(f"ranks {unknown[:5]} were not simulated (simulated: {len(tl.ranks)} ranks, e.g. "
                        f"{sorted(tl.ranks)[:4]}): pick simulated ranks, or simulate with --mode full")
    ev = tl.events[tl.events["rank"].isin(ranks)]
    streams = [s for s in STREAM_ORDER if s in set(ev["stream"])] + sorted(set(ev["stream"]) - set(STREAM_ORDER))
    stream_index = {s: i + 1 for i, s in enumerate(streams)}

    start_ns = np.rint(ev["start_s"].to_numpy() * 1e9).astype(np.int64)
    end_ns = np.maximum(np.rint(ev["end_s"].to_numpy() * 1e9).astype(np.int64), start_ns)
    tid = np.zeros(len(ev), dtype=np.int64)
    used: dict[tuple[int, str], int] = {}
    for (rank, stream), idx in pd.Series(np.arange(len(ev))).groupby([ev["rank"].to_numpy(), ev["stream"].to_numpy()]):
        ii = idx.to_numpy()
        tracks = assign_tracks(start_ns[ii], end_ns[ii])
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
    return out


def perfetto_trace(tl: "Timeline", ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """The trace as a dict (json.dumps it). ``ranks``: which simulated ranks to include; by default
    all of them up to 64, else one representative per pipeline rank."""
    return {"traceEvents": perfetto_events(tl, ranks), "displayTimeUnit": "ms",
            "otherData": {"generator": "clustersim", "step_time_s": tl.step_time_s, "mode": tl.mode}}


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
