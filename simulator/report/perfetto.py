"""Chrome trace JSON that ui.perfetto.dev opens: X events in µs, a pid per rank, a tid per stream."""

from __future__ import annotations

from typing import Any

from simulator.engine.core import Timeline


def perfetto_trace(tl: Timeline) -> dict[str, Any]:
    ev = tl.events
    streams = sorted(ev["stream"].unique())
    tid = {s: i for i, s in enumerate(streams)}
    out: list[dict[str, Any]] = []
    for r in sorted(ev["rank"].unique()):
        out.append({"ph": "M", "name": "process_name", "pid": int(r), "tid": 0, "args": {"name": f"rank {r}"}})
        for s in streams:
            out.append({"ph": "M", "name": "thread_name", "pid": int(r), "tid": tid[s], "args": {"name": s}})
    for row in ev.itertuples(index=False):
        out.append({"ph": "X", "name": row.name, "cat": row.kind, "pid": int(row.rank), "tid": tid[row.stream],
                    "ts": row.start_s * 1e6, "dur": (row.end_s - row.start_s) * 1e6,
                    "args": {"microbatch": int(row.microbatch), "stage": int(row.stage), "layer": int(row.layer),
                             "bytes": float(row.bytes)}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}
