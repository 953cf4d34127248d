"""One self-contained HTML dashboard per simulation.

Sections: summary cards; the timeline of the representative ranks (one lane per (rank, stream));
an op-level detail window; a utilization heatmap over time x ranks that stays a fixed size at any
GPU count; per-stage time and memory breakdowns; the busiest network links.

Size is kept bounded by merging, on each lane, the consecutive segments of one action
(a microbatch's forward or backward on one stage) into one bar whose opacity shows how busy the
lane was inside it. Only the detail window shows every op.

Every string that comes from a scenario or a trace is HTML-escaped before it reaches Plotly or
the page: Plotly renders a subset of HTML tags in titles and hover labels, and turns entities back
into literal characters in text nodes, so escaped names show as written and run nothing.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from simulator.report.analysis import BREAKDOWN_LABELS, PATH_CAUSE_NAMES
from simulator.vocabulary import DIM_NAMES, STREAM_NAMES
from simulator.workload.ops import model_size_text

if TYPE_CHECKING:  # the report layer only reads results; importing simulate here would be circular
    from simulator.engine.core import Timeline
    from simulator.report.metrics import Report
    from simulator.simulate import SimulationResult

KIND_COLORS = {
    "F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#72B7B2", "FB": "#B279A2", "opt": "#9D755D",
    "tp": "#54A24B", "cp": "#D4A80B", "ep": "#D81B60", "pp": "#8E6BBF", "dp": "#2F4B7C",
}
# Why the compute stream was idle: waiting on another stage's compute (bubble) or on a dimension's
# communication; each its own colour, the dimension's hue drawn hatched.
CAUSE_COLORS = {"bubble": "#B8B8B8", "tp": KIND_COLORS["tp"], "cp": KIND_COLORS["cp"], "ep": KIND_COLORS["ep"],
                "pp": KIND_COLORS["pp"], "dp": KIND_COLORS["dp"]}
CAUSE_LABELS = {"bubble": "bubble (waiting on another stage)", "tp": "waiting on tp", "cp": "waiting on cp",
                "ep": "waiting on ep", "pp": "waiting on pp transfer", "dp": "waiting on dp"}
BREAKDOWN_COLORS = {"compute": "#4C78A8", "host_launch": "#9ECAE9", "exposed_tp": CAUSE_COLORS["tp"], "exposed_cp": CAUSE_COLORS["cp"],
                    "exposed_ep": CAUSE_COLORS["ep"], "exposed_pp": CAUSE_COLORS["pp"], "exposed_dp": CAUSE_COLORS["dp"],
                    "bubble": CAUSE_COLORS["bubble"], "imbalance": "#6E6E6E", "optimizer": KIND_COLORS["opt"]}
CRITICAL_COLOR = "#111111"
KIND_LABELS = {
    "F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad", "FB": "overlapped F&B",
    "opt": "optimizer", "tp": "tp comm", "cp": "cp comm", "ep": "ep comm", "pp": "pp send/recv", "dp": "dp comm",
}
KIND_ORDER = list(KIND_COLORS)
STREAM_ORDER = list(STREAM_NAMES)
IDLE_COLOR = "#F4C7C3"
DIMS = DIM_NAMES

# Budgets that keep the default scenario's page small and quick to build, and any scenario's
# page bounded (the heatmap and the lane count do not grow with the GPU count).
MAX_TIMELINE_BARS = 6_000
MAX_DETAIL_EVENTS = 4_000  # ops drawn at once in the op-level view (zoom in for more)
MAX_TIMELINE_RANKS = 32
MAX_HEATMAP_ROWS = 256
HEATMAP_BINS = 400
MERGE_PIXELS = 3000  # gaps shorter than one pixel of a 3000-px-wide step are merged

CDN_FALLBACK = "https://cdn.plot.ly/plotly-latest.min.js"


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


# ---------------------------------------------------------------------------------------------
# data shaping


def lane_order(ev: pd.DataFrame, ranks: Sequence[int]) -> list[tuple[int, str]]:
    """(rank, stream) lanes in display order: ranks as given, streams in pipeline-reading order."""
    present = set(zip(ev["rank"].to_numpy().tolist(), ev["stream"].to_numpy().tolist()))
    extra = sorted({s for _, s in present} - set(STREAM_ORDER))
    lanes = []
    for r in ranks:
        for s in STREAM_ORDER + extra:
            if (r, s) in present:
                lanes.append((r, s))
    return lanes


def representative_ranks(tl: "Timeline", limit: int = MAX_TIMELINE_RANKS) -> list[int]:
    """The lowest rank of each pipeline rank (the one reduced mode simulates), at most ``limit``
    spread evenly over the pipeline so first and last stages are always shown."""
    first: dict[int, int] = {}
    for r in sorted(tl.ranks):
        first.setdefault(tl.pp_rank_of[r], r)
    reps = [first[p] for p in sorted(first)]
    if len(reps) > limit:
        idx = np.unique(np.linspace(0, len(reps) - 1, limit).round().astype(int))
        reps = [reps[i] for i in idx]
    return reps


def merge_segments(ev: pd.DataFrame, gap_s: float, by_action: bool = True) -> pd.DataFrame:
    """Merge consecutive rows of one lane into bars.

    Rows merge when they are on the same lane and kind, belong to the same action (microbatch and
    stage) when ``by_action``, and the gap between them is below ``gap_s``. Rows outside any
    microbatch (dp buckets, the optimizer) never merge: they are few and each one matters.
    """
    if ev.empty:
        return pd.DataFrame(columns=["rank", "stream", "kind", "start_s", "end_s", "busy_s", "n", "first", "last",
                                     "layer_min", "layer_max", "microbatch", "stage", "bytes"])
    ev = ev.sort_values(["rank", "stream", "start_s"], kind="stable")
    rank = ev["rank"].to_numpy()
    # Compared and carried as codes where the columns are categoricals (the engine's timelines):
    # materialising millions of Python strings was most of a long step's dashboard time.
    stream = _codes(ev["stream"])
    kind = _codes(ev["kind"])
    mb = ev["microbatch"].to_numpy()
    stage = ev["stage"].to_numpy()
    start = ev["start_s"].to_numpy()
    end = ev["end_s"].to_numpy()
    new = np.ones(len(ev), dtype=bool)
    same_lane = (rank[1:] == rank[:-1]) & (stream[1:] == stream[:-1])
    lane_id = np.concatenate([[0], np.cumsum(~same_lane)])
    # gaps are measured from the latest end so far on the lane (overlapping rows stay one bar)
    run_end = pd.Series(end).groupby(lane_id).cummax().to_numpy()
    prev_end = np.concatenate([[-np.inf], run_end[:-1]])
    same = same_lane & (kind[1:] == kind[:-1]) & (start[1:] - prev_end[1:] <= gap_s) & (mb[1:] >= 0) & (mb[:-1] >= 0)
    if by_action:
        same &= (mb[1:] == mb[:-1]) & (stage[1:] == stage[:-1])
    new[1:] = ~same
    gid = np.cumsum(new) - 1
    layer = ev["layer"].to_numpy()
    name = _codes(ev["name"])
    g = pd.DataFrame({
        "gid": gid, "rank": rank, "stream": stream, "kind": kind, "start_s": start, "end_s": end,
        "busy_s": end - start, "name": name, "microbatch": mb, "stage": stage,
        "layer_min": np.where(layer >= 0, layer, np.iinfo(np.int64).max),
        "layer_max": layer, "bytes": ev["bytes"].to_numpy(),
    })
    out = g.groupby("gid", sort=False).agg(
        rank=("rank", "first"), stream=("stream", "first"), kind=("kind", "first"),
        start_s=("start_s", "min"), end_s=("end_s", "max"), busy_s=("busy_s", "sum"), n=("name", "size"),
        first=("name", "first"), last=("name", "last"), layer_min=("layer_min", "min"),
        layer_max=("layer_max", "max"), microbatch=("microbatch", "first"), stage=("stage", "first"),
        bytes=("bytes", "sum"),
    )
    out.loc[out["layer_max"] < 0, "layer_min"] = -1
    out = out.reset_index(drop=True)
    # back to strings, once per bar rather than once per row
    for col, src in (("stream", "stream"), ("kind", "kind"), ("first", "name"), ("last", "name")):
        out[col] = _decode(out[col].to_numpy(), ev[src])
    return out


def _lane_of_rows(ev: pd.DataFrame, lane_idx: dict[tuple[int, str], int]) -> np.ndarray:
    """Each row's lane index (``lane_idx`` by (rank, stream)), -1 for rows on no lane: looked up
    once per distinct (rank, stream code), not once per row."""
    ranks = ev["rank"].to_numpy()
    if not isinstance(ev["stream"].dtype, pd.CategoricalDtype):
        return np.fromiter((lane_idx.get(k, -1) for k in zip(ranks.tolist(), ev["stream"].tolist())),
                           dtype=np.int64, count=len(ev))
    streams = ev["stream"].cat.categories
    n = max(1, len(streams))
    keys, row_key = np.unique(ranks.astype(np.int64) * n + ev["stream"].cat.codes.to_numpy(), return_inverse=True)
    lane = np.array([lane_idx.get((k // n, streams[k % n]), -1) for k in keys.tolist()] or [-1], dtype=np.int64)
    return lane[row_key]


def _codes(col: pd.Series) -> np.ndarray:
    """A column's values as comparable numbers: a categorical's codes (equal codes, equal strings),
    else the values themselves."""
    return col.cat.codes.to_numpy() if isinstance(col.dtype, pd.CategoricalDtype) else col.to_numpy()


def _decode(values: np.ndarray, like: pd.Series) -> np.ndarray:
    """``_codes``'s inverse: the strings of ``like``'s categories at these codes."""
    if isinstance(like.dtype, pd.CategoricalDtype):
        return like.cat.categories.to_numpy(dtype=object)[values]
    return values


COMM_MERGE_PIXELS = 600  # communication lanes: rows closer than ~2 px of a 1200-px plot become one bar


def timeline_bars(ev: pd.DataFrame, step_s: float, max_bars: int = MAX_TIMELINE_BARS) -> tuple[pd.DataFrame, float]:
    """Merged bars within the bar budget, and the merge gap that achieved it. Compute lanes get one
    bar per action; communication lanes are merged at about two pixels (each bar's opacity still
    says how busy the link was inside it; the op-level view has every transfer)."""
    gap = max(step_s, 1e-9) / MERGE_PIXELS
    comm = ev["stream"] != "compute"
    if comm.any():
        cbars = merge_segments(ev[comm], max(step_s, 1e-9) / COMM_MERGE_PIXELS, by_action=False)
        ev = ev[~comm]
        bars = pd.concat([merge_segments(ev, gap, by_action=True), cbars], ignore_index=True)
        max_bars = max_bars - len(cbars)
        if len(bars) - len(cbars) <= max_bars:
            return bars, gap
        ev_compute = ev
        while len(bars) - len(cbars) > max_bars and gap <= step_s:
            gap *= 2
            bars = pd.concat([merge_segments(ev_compute, gap, by_action=False), cbars], ignore_index=True)
        return bars, gap
    bars = merge_segments(ev, gap, by_action=True)
    while len(bars) > max_bars:
        # Too many actions to draw one bar each: merge across actions at pixel resolution.
        gap *= 2
        bars = merge_segments(ev, gap, by_action=False)
        if gap > step_s:
            break
    return bars, gap


def idle_gaps(bars: pd.DataFrame, lanes: list[tuple[int, str]], step_s: float, min_gap_s: float) -> pd.DataFrame:
    """Idle intervals of each compute lane inside the step (the bubble, or waits on communication)."""
    rows = []
    for r, s in lanes:
        if s != "compute":
            continue
        b = bars[(bars["rank"] == r) & (bars["stream"] == s)].sort_values("start_s")
        starts = np.concatenate([b["start_s"].to_numpy(), [step_s]])
        ends = np.concatenate([[0.0], np.maximum.accumulate(b["end_s"].to_numpy())])
        mask = starts - ends > min_gap_s
        for a, e in zip(ends[mask], starts[mask]):
            rows.append((r, s, a, e))
    return pd.DataFrame(rows, columns=["rank", "stream", "start_s", "end_s"])


def utilization_matrix(ev: pd.DataFrame, row_of_rank: dict[int, int], n_rows: int, rows_weight: np.ndarray,
                       step_s: float, bins: int) -> np.ndarray:
    """Fraction of each time bin a row's events cover, averaged over the ranks a row stands for.

    Busy time up to t on one rank is  sum_i (t - s_i)+ - (t - e_i)+ ; evaluated at the bin edges
    with sorted starts / ends and cumulative sums it needs no loop over events or bins. Ranks are
    laid end to end on one axis (an offset of 2 x step per row) so one sort serves all rows.
    """
    edges = np.linspace(0.0, step_s, bins + 1)
    if ev.empty or step_s <= 0:
        return np.zeros((n_rows, bins))
    rows = ev["rank"].map(row_of_rank).to_numpy()
    keep = ~pd.isna(rows)
    rows = rows[keep].astype(np.int64)
    span = 2.0 * step_s
    s = ev["start_s"].to_numpy()[keep] + rows * span
    e = ev["end_s"].to_numpy()[keep] + rows * span
    t = (edges[None, :] + (np.arange(n_rows) * span)[:, None]).ravel()

    def ramp(x: np.ndarray) -> np.ndarray:
        x = np.sort(x)
        c = np.concatenate([[0.0], np.cumsum(x)])
        k = np.searchsorted(x, t, side="right")
        # only the events of the same row may count: subtract everything left of the row start
        row_start = np.repeat(np.arange(n_rows) * span, bins + 1)
        k0 = np.searchsorted(x, row_start, side="left")
        return (k - k0) * t - (c[k] - c[k0])

    busy = (ramp(s) - ramp(e)).reshape(n_rows, bins + 1)
    frac = np.diff(busy, axis=1) / np.diff(edges)[None, :]
    return np.clip(frac / rows_weight[:, None], 0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# figures


def _hover_bars(b: pd.DataFrame, pp_of: dict[int, int]) -> np.ndarray:
    n = b["n"].to_numpy()
    first = b["first"].astype(str).map(esc).to_numpy()
    last = b["last"].astype(str).map(esc).to_numpy()
    op = np.where(n > 1, np.char.add(np.char.add(np.char.add(n.astype(str), " ops: "), first.astype(str)),
                                     np.char.add(" … ", last.astype(str))), first.astype(str))
    lmin, lmax = b["layer_min"].to_numpy(), b["layer_max"].to_numpy()
    layer = np.where(lmax < 0, "–", np.where(lmin == lmax, lmax.astype(str),
                                              np.char.add(np.char.add(lmin.astype(str), "–"), lmax.astype(str))))
    mb = b["microbatch"].to_numpy()
    st = b["stage"].to_numpy()
    span = (b["end_s"] - b["start_s"]).to_numpy()
    busy = b["busy_s"].to_numpy()
    fill = np.where(span > 0, busy / np.where(span > 0, span, 1), 1.0)
    cd = np.empty((len(b), 9), dtype=object)
    cd[:, 0] = op
    cd[:, 1] = layer
    cd[:, 2] = np.where(mb >= 0, mb.astype(str), "–")
    cd[:, 3] = np.where(st >= 0, st.astype(str), "–")
    cd[:, 4] = np.round(span * 1e3, 3)
    cd[:, 5] = np.round(busy * 1e3, 3)
    cd[:, 6] = np.round(fill * 100, 0)
    cd[:, 7] = [_fmt_bytes(x) for x in b["bytes"].to_numpy()]
    cd[:, 8] = [f"rank {r} (pp {pp_of.get(r, '?')})" for r in b["rank"].to_numpy().tolist()]
    return cd


HOVER_TEMPLATE = (
    "<b>%{customdata[0]}</b><br>%{customdata[8]}<br>layer %{customdata[1]} · microbatch %{customdata[2]} · "
    "stage %{customdata[3]}<br>%{base:.3f}–%{customdata[9]:.3f} ms: %{customdata[4]} ms "
    "(busy %{customdata[5]} ms, %{customdata[6]}%)<br>bytes %{customdata[7]}<extra>%{fullData.name}</extra>"
)


def _fmt_bytes(x: float) -> str:
    if not x or x <= 0:
        return "–"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= f:
            return f"{x / f:.2f} {unit}"
    return f"{x:.0f} B"


def _kind_label(kind: str) -> str:
    return esc(f"{KIND_LABELS.get(kind, kind)} ({kind})")


def _lane_axis(lanes: list[tuple[int, str]], pp_of: dict[int, int]) -> dict[str, Any]:
    text = [esc(f"r{r} pp{pp_of.get(r, '?')} {s}") for r, s in lanes]
    return dict(tickmode="array", tickvals=list(range(len(lanes))), ticktext=text, autorange="reversed",
                range=None, showgrid=False, zeroline=False, tickfont=dict(size=10, family="monospace"))


def _rank_separators(lanes: list[tuple[int, str]]) -> list[dict]:
    shapes = []
    for i in range(1, len(lanes)):
        if lanes[i][0] != lanes[i - 1][0]:
            shapes.append(dict(type="line", xref="paper", x0=0, x1=1, yref="y", y0=i - 0.5, y1=i - 0.5,
                               line=dict(color="#999", width=1)))
    return shapes


# On a compute lane the work (actions) fills the upper part and the waits, by cause, the lower part.
COMPUTE_BAR = (-0.16, 0.52)  # (offset from the lane centre, height) of work bars on a compute lane
WAIT_BAR = (0.28, 0.34)
OTHER_BAR = (0.0, 0.8)


def _lane_y(lane_idx: dict[tuple[int, str], int], rank: np.ndarray, stream: np.ndarray, wait: bool = False
            ) -> tuple[np.ndarray, np.ndarray]:
    base = np.fromiter((lane_idx[(r, s)] for r, s in zip(rank.tolist(), stream.tolist())), dtype=np.float64,
                       count=len(rank))
    compute = stream == "compute"
    off, width = (WAIT_BAR if wait else COMPUTE_BAR)
    y = np.where(compute, base + off, base)
    w = np.where(compute, width, OTHER_BAR[1])
    return np.round(y, 3), w


def _bar_traces(bars: pd.DataFrame, lane_idx: dict[tuple[int, str], int], pp_of: dict[int, int],
                opacity_by_fill: bool, legendgroup_prefix: str = "", showlegend: bool = True) -> list[go.Bar]:
    traces = []
    kinds = [k for k in KIND_ORDER if k in set(bars["kind"])] + sorted(set(bars["kind"]) - set(KIND_ORDER))
    for kind in kinds:
        b = bars[bars["kind"] == kind]
        y, width = _lane_y(lane_idx, b["rank"].to_numpy(), b["stream"].to_numpy())
        cd = _hover_bars(b, pp_of)
        end_ms = np.round(b["end_s"].to_numpy() * 1e3, 3)
        cd = np.concatenate([cd, end_ms[:, None].astype(object)], axis=1)
        span = (b["end_s"] - b["start_s"]).to_numpy()
        marker: dict[str, Any] = dict(color=KIND_COLORS.get(kind, "#888888"), line=dict(width=0))
        if opacity_by_fill:
            fill = np.clip(b["busy_s"].to_numpy() / np.where(span > 0, span, 1), 0, 1)
            marker["opacity"] = np.round(0.3 + 0.7 * fill, 2)
        traces.append(go.Bar(
            x=np.round(span * 1e3, 4), base=np.round(b["start_s"].to_numpy() * 1e3, 4), y=y, orientation="h",
            name=_kind_label(kind), legendgroup=legendgroup_prefix + esc(kind), showlegend=showlegend,
            marker=marker, customdata=cd, hovertemplate=HOVER_TEMPLATE, width=width,
        ))
    return traces


def wait_intervals(tl: "Timeline", ranks: Sequence[int]) -> pd.DataFrame:
    """The compute stream's idle intervals of ``ranks`` with their cause: the engine's recorded
    waits, plus the tail after a rank finished (bubble: the slowest rank still runs)."""
    cols = ["rank", "start_s", "end_s", "cause", "issued_s", "src_rank", "what"]
    waits = getattr(tl, "waits", None)
    ends = getattr(tl, "end_time_s", None) or {}
    step = tl.step_time_s
    if waits is None:
        # An engine that records no causes: every idle gap of the compute lane, cause unknown (bubble).
        ev = tl.events[(tl.events["rank"].isin(ranks)) & (tl.events["stream"] == "compute")]
        rows = []
        for r, g in ev.groupby("rank"):
            g = g.sort_values("start_s")
            starts = np.concatenate([g["start_s"].to_numpy(), [step]])
            prev = np.concatenate([[0.0], np.maximum.accumulate(g["end_s"].to_numpy())])
            for a, e in zip(prev[starts > prev], starts[starts > prev]):
                rows.append((r, a, e, "bubble", np.nan, -1, "idle (this engine records no causes)"))
        return pd.DataFrame(rows, columns=cols)
    w = waits[waits["rank"].isin(ranks)]
    tail = [(r, float(ends[r]), step, "bubble", np.nan, -1, "finished: waiting for the slowest rank to end the step")
            for r in ranks if r in ends and step - ends[r] > 0]
    if tail:
        w = pd.concat([w, pd.DataFrame(tail, columns=cols)], ignore_index=True)
    return w.reset_index(drop=True)


def merge_waits(w: pd.DataFrame, gap_s: float) -> pd.DataFrame:
    """Consecutive waits of one rank and cause closer than ``gap_s`` become one bar (drawn with the
    share of its span that was waited as opacity); the first wait's description is kept."""
    if w.empty:
        return w.assign(busy_s=[], n=[])
    w = w.sort_values(["rank", "cause", "start_s"], kind="stable")
    rank, cause = w["rank"].to_numpy(), w["cause"].to_numpy()
    start, end = w["start_s"].to_numpy(), w["end_s"].to_numpy()
    same = (rank[1:] == rank[:-1]) & (cause[1:] == cause[:-1])
    lane_id = np.concatenate([[0], np.cumsum(~same)])
    run_end = pd.Series(end).groupby(lane_id).cummax().to_numpy()
    new = np.ones(len(w), dtype=bool)
    new[1:] = ~(same & (start[1:] - run_end[:-1] <= gap_s))
    gid = np.cumsum(new) - 1
    g = pd.DataFrame({"gid": gid, "rank": rank, "cause": cause, "start_s": start, "end_s": end,
                      "busy_s": end - start, "issued_s": w["issued_s"].to_numpy(), "src_rank": w["src_rank"].to_numpy(),
                      "what": w["what"].astype(str).to_numpy()})
    return g.groupby("gid", sort=False).agg(
        rank=("rank", "first"), cause=("cause", "first"), start_s=("start_s", "min"), end_s=("end_s", "max"),
        busy_s=("busy_s", "sum"), n=("what", "size"), issued_s=("issued_s", "first"), src_rank=("src_rank", "first"),
        what=("what", "first"),
    ).reset_index(drop=True)


WAIT_HOVER = ("<b>%{customdata[0]}</b><br>%{customdata[1]}<br>%{customdata[2]}<br>%{base:.3f}–%{customdata[3]:.3f} ms: "
              "%{customdata[4]}<br>%{customdata[5]}<extra></extra>")


def _wait_traces(w: pd.DataFrame, lane_idx: dict[tuple[int, str], int], pp_of: dict[int, int],
                 showlegend: bool = True, legendgroup_prefix: str = "") -> list[go.Bar]:
    traces = []
    for cause in CAUSE_COLORS:
        b = w[w["cause"] == cause]
        if b.empty:
            continue
        start, end = b["start_s"].to_numpy(), b["end_s"].to_numpy()
        y, width = _lane_y(lane_idx, b["rank"].to_numpy(), np.full(len(b), "compute", dtype=object), wait=True)
        span = end - start
        busy = b["busy_s"].to_numpy()
        n = b["n"].to_numpy()
        issued = b["issued_s"].to_numpy(dtype=float)
        src = b["src_rank"].to_numpy()
        whats = [esc(x) for x in b["what"].tolist()]
        since = []
        for i in range(len(b)):
            if n[i] > 1:
                since.append(f"{n[i]} waits merged; the first began at {start[i] * 1e3:.3f} ms")
            elif not np.isnan(issued[i]):
                since.append(f"waiting since {start[i] * 1e3:.3f} ms; on the wire since {issued[i] * 1e3:.3f} ms")
            elif cause == "bubble" and src[i] >= 0:
                since.append(f"waiting since {start[i] * 1e3:.3f} ms for rank {src[i]} (pp {pp_of.get(int(src[i]), '?')}) to compute it")
            else:
                since.append(f"waiting since {start[i] * 1e3:.3f} ms")
        cd = np.empty((len(b), 6), dtype=object)
        cd[:, 0] = esc(CAUSE_LABELS[cause])
        cd[:, 1] = [f"rank {r} (pp {pp_of.get(r, '?')})" for r in b["rank"].tolist()]
        cd[:, 2] = whats
        cd[:, 3] = np.round(end * 1e3, 3)
        cd[:, 4] = [f"waited {bz * 1e3:.3f} ms" + (f" of {sp * 1e3:.3f} ms ({bz / sp:.0%})" if k > 1 and sp > 0 else "")
                    for bz, sp, k in zip(busy, span, n)]
        cd[:, 5] = since
        fill = np.clip(busy / np.where(span > 0, span, 1), 0, 1)
        marker: dict[str, Any] = dict(color=CAUSE_COLORS[cause], line=dict(width=0), opacity=np.round(0.35 + 0.65 * fill, 2))
        if cause != "bubble":
            marker["pattern"] = dict(shape="/", fgcolor="#ffffff", fgopacity=0.55, size=6, solidity=0.25)
        traces.append(go.Bar(
            x=np.round(span * 1e3, 4), base=np.round(start * 1e3, 4), y=y, width=width, orientation="h",
            name=esc(CAUSE_LABELS[cause]), legendgroup=legendgroup_prefix + "wait-" + cause, showlegend=showlegend,
            marker=marker, customdata=cd, hovertemplate=WAIT_HOVER, meta=dict(cause=cause),
        ))
    return traces


def critical_path_trace(rep: "Report | None", lane_idx: dict[tuple[int, str], int], pp_of: dict[int, int],
                        showlegend: bool = True) -> go.Scatter | None:
    """The critical path as one polyline along the top edge of the compute lanes: across a lane for
    work and waits on that rank, down or up to another rank where a transfer hands the path over."""
    if rep is None or not rep.critical_path:
        return None
    xs: list[float | None] = []
    ys: list[float | None] = []
    text: list[str] = []
    prev_end = None
    for seg in rep.critical_path:
        lane = lane_idx.get((seg["rank"], "compute"))
        if lane is None:
            prev_end = None
            xs.append(None), ys.append(None), text.append("")
            continue
        y = lane - 0.44
        if prev_end is not None and abs(seg["start_s"] - prev_end) > 1e-9:
            xs.append(None), ys.append(None), text.append("")
        parts = ", ".join(f"{PATH_CAUSE_NAMES.get(k, k)} {v * 1e3:.2f} ms" for k, v in seg.get("by_cause_s", {}).items())
        label = esc(f"critical path: {seg['what']} on rank {seg['rank']} (pp {seg['pp_rank']}): {parts}")
        xs += [round(seg["start_s"] * 1e3, 4), round(seg["end_s"] * 1e3, 4)]
        ys += [y, y]
        text += [label, label]
        prev_end = seg["end_s"]
    return go.Scatter(x=xs, y=ys, mode="lines", name="critical path", line=dict(color=CRITICAL_COLOR, width=2.5),
                      hovertext=text, hoverinfo="text", showlegend=showlegend, legendgroup="critical-path",
                      connectgaps=False)


OPACITY_LEVELS = (0.45, 0.75, 1.0)


def bars_as_lines(bar: go.Bar, px_per_unit: float, min_len: float = 0.0) -> list[go.Scatter]:
    """The same bars drawn as thick horizontal line segments: one SVG path per trace instead of one
    element per bar, which is what keeps a timeline of many thousand bars quick to draw. Each bar
    becomes start, middle and end points (hover works along it) and a break. Per-bar opacity is
    kept in three levels (one trace each); the bar's height becomes the line width in pixels. Bars
    shorter than ``min_len`` (about a pixel) are drawn that long, so a short transfer stays visible."""
    x = np.maximum(np.asarray(bar.x, dtype=float), min_len)
    base = np.asarray(bar.base, dtype=float)
    y = np.asarray(bar.y, dtype=float)
    width = np.broadcast_to(np.asarray(bar.width if bar.width is not None else 0.8, dtype=float), x.shape)
    cd = np.asarray(bar.customdata, dtype=object) if bar.customdata is not None else np.empty((len(x), 0), dtype=object)
    if cd.ndim == 1:
        cd = cd[:, None]
    op = bar.marker.opacity
    op = np.broadcast_to(np.asarray(op if op is not None else 1.0, dtype=float), x.shape)
    level = np.searchsorted(np.array([(a + b) / 2 for a, b in zip(OPACITY_LEVELS, OPACITY_LEVELS[1:])]), op)
    tmpl = (bar.hovertemplate or "").replace("%{base", f"%{{customdata[{cd.shape[1]}]")
    out = []
    first = True
    for lv in range(len(OPACITY_LEVELS)):
        for w in np.unique(width):
            sel = (level == lv) & (width == w)
            if not sel.any():
                continue
            n = int(sel.sum())
            xs = np.empty((n, 4))
            xs[:, 0], xs[:, 1], xs[:, 2] = base[sel], base[sel] + x[sel] / 2, base[sel] + x[sel]
            xs[:, 3] = np.nan
            ys = np.repeat(y[sel][:, None], 4, axis=1)
            ys[:, 3] = np.nan
            c = np.concatenate([cd[sel], np.round(base[sel], 4)[:, None].astype(object)], axis=1)
            cdl = np.repeat(c[:, None, :], 4, axis=1).reshape(n * 4, c.shape[1])
            cdl[3::4] = None
            line: dict[str, Any] = dict(color=bar.marker.color, width=max(1.0, round(float(w) * px_per_unit, 1)))
            meta = dict(bar.meta) if bar.meta else {}
            if meta.get("cause") and meta["cause"] != "bubble":
                line["dash"] = "4px,2px"  # waiting on communication: dashed, like a hatch
            out.append(go.Scatter(
                x=np.round(xs.ravel(), 4), y=ys.ravel(), mode="lines", line=line, opacity=OPACITY_LEVELS[lv],
                name=bar.name, legendgroup=bar.legendgroup or bar.name, showlegend=bool(bar.showlegend is not False) and first,
                customdata=cdl, hovertemplate=tmpl, connectgaps=False, meta=meta or None, hoveron="points",
            ))
            first = False
    return out


def timeline_figure(tl: "Timeline", ranks: Sequence[int] | None = None, title: str = "",
                    x_range_ms: tuple[float, float] | None = None, height_per_lane: int = 15,
                    report: "Report | None" = None) -> tuple[go.Figure, dict]:
    """Merged-bar timeline of ``ranks`` (the representative ranks by default), with the compute
    lanes' waits coloured by cause and the critical path drawn over them; returns the figure and
    facts for the caption (bars drawn, rows merged, merge gap, lanes)."""
    ranks = list(ranks) if ranks is not None else representative_ranks(tl)
    ev = tl.events[tl.events["rank"].isin(ranks)]
    # a receive is its sender's transfer seen from the other end: the overview shows sends only
    # (the op-level view has both)
    ev = ev[~ev["stream"].isin(["pp-recv-f", "pp-recv-b"])]
    lanes = lane_order(ev, ranks)
    lane_idx = {ln: i for i, ln in enumerate(lanes)}
    step = tl.step_time_s
    bars, gap = timeline_bars(ev, step)
    waits = merge_waits(wait_intervals(tl, [r for r in ranks if (r, "compute") in lane_idx]), gap)
    fig = go.Figure()
    height = max(300, 110 + height_per_lane * len(lanes))
    top = 80 if title else 60
    px_per_unit = (height - top - 45) / max(1, len(lanes))
    pixel_ms = step * 1e3 / 1200  # the plot is ~1200 px wide at full step
    for t in _bar_traces(bars, lane_idx, tl.pp_rank_of, opacity_by_fill=True):
        fig.add_traces(bars_as_lines(t, px_per_unit, pixel_ms))
    for t in _wait_traces(waits, lane_idx, tl.pp_rank_of):
        fig.add_traces(bars_as_lines(t, px_per_unit, pixel_ms))
    cp = critical_path_trace(report, lane_idx, tl.pp_rank_of)
    if cp is not None:
        fig.add_trace(cp)
    fig.update_layout(
        title=dict(text=title, x=0.01, font=dict(size=13)) if title else None, barmode="overlay", bargap=0.15,
        height=height,
        xaxis=dict(title="time (ms)", range=list(x_range_ms) if x_range_ms else [0, step * 1e3], showgrid=True,
                   gridcolor="#eee", zeroline=False),
        # lanes are drawn as lines of a fixed pixel width: zoom in time only
        yaxis=dict(_lane_axis(lanes, tl.pp_rank_of), fixedrange=True, range=[len(lanes) - 0.5, -0.5], autorange=False),
        shapes=_rank_separators(lanes), hovermode="closest",
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0, font=dict(size=11)),
        margin=dict(l=150, r=20, t=top, b=45), plot_bgcolor="white", hoverlabel=dict(align="left"),
    )
    return fig, {"bars": len(bars) + len(waits), "rows": len(ev), "gap_s": gap, "lanes": lanes, "ranks": ranks}


def detail_window(ev: pd.DataFrame, step_s: float, max_events: int = MAX_DETAIL_EVENTS) -> tuple[float, float]:
    """A window at mid-step (steady state) as wide as fits ``max_events`` unmerged rows."""
    s, e = ev["start_s"].to_numpy(), ev["end_s"].to_numpy()
    centre = step_s / 2
    lo_w, hi_w = 0.0, step_s
    for _ in range(30):
        w = (lo_w + hi_w) / 2
        n = int(np.count_nonzero((e > centre - w / 2) & (s < centre + w / 2)))
        if n > max_events:
            hi_w = w
        else:
            lo_w = w
    w = max(lo_w, step_s * 1e-4)
    return max(0.0, centre - w / 2), min(step_s, centre + w / 2)


def ops_payload(tl: "Timeline", lanes: list[tuple[int, str]], pp_of: dict[int, int]) -> dict[str, Any]:
    """Every op, collective and wait of ``lanes``, packed once for the page's op-level view.

    Columns are typed arrays, gzip-compressed and base64-encoded (a simulated step repeats itself,
    so the default scenario's 190 K rows pack into ~50 KB). Times are quantised to ``unit_s`` (10 ns,
    coarser only for steps over 20 s) on absolute times before differencing, so decoding
    accumulates no error: start = previous end on the lane + gap, end = start + dur.
    """
    import base64
    import gzip

    lane_idx = {ln: i for i, ln in enumerate(lanes)}
    ranks = sorted({r for r, _ in lanes})
    ev = tl.events[tl.events["rank"].isin(ranks)]
    lane = _lane_of_rows(ev, lane_idx)
    # strings by the categories' codes, kept as Python objects (pandas' inference of a string
    # column from millions of them cost seconds on a long step)
    ops = pd.DataFrame({
        "lane": lane, "start_s": ev["start_s"].to_numpy(), "end_s": ev["end_s"].to_numpy(),
        "kind": pd.Series(_decode(_codes(ev["kind"]), ev["kind"]), dtype=object),
        "name": pd.Series(_decode(_codes(ev["name"]), ev["name"]), dtype=object),
        "layer": ev["layer"].to_numpy(), "mb": ev["microbatch"].to_numpy(), "stage": ev["stage"].to_numpy(),
        "aux": ev["bytes"].to_numpy(dtype=float),
    })
    w = wait_intervals(tl, [r for r in ranks if (r, "compute") in lane_idx])
    if len(w):
        wl = np.fromiter((lane_idx[(r, "compute")] for r in w["rank"].tolist()), dtype=np.int64, count=len(w))
        ops = pd.concat([ops, pd.DataFrame({
            "lane": wl, "start_s": w["start_s"].to_numpy(), "end_s": w["end_s"].to_numpy(),
            "kind": ("wait:" + w["cause"].astype(str)).to_numpy(), "name": w["what"].astype(str).to_numpy(),
            # when the awaited work went on the wire, as an offset from the wait's start (mostly 0:
            # a blocking collective starts when the wait does), which compresses to almost nothing
            "layer": -1, "mb": -1, "stage": -1,
            "aux": (w["issued_s"].to_numpy(dtype=float) - w["start_s"].to_numpy(dtype=float)) * 1e3,
        })], ignore_index=True)
    ops = ops[ops["lane"] >= 0].sort_values(["lane", "start_s", "end_s"], kind="stable")
    step = max(tl.step_time_s, 1e-9)
    unit = max(1e-8, step / 2e9)
    qs = np.rint(ops["start_s"].to_numpy() / unit).astype(np.int64)
    qe = np.maximum(np.rint(ops["end_s"].to_numpy() / unit).astype(np.int64), qs)
    ln = ops["lane"].to_numpy()
    prev = np.concatenate([[0], qe[:-1]])
    prev[np.concatenate([[True], ln[1:] != ln[:-1]])] = 0
    kinds = sorted(set(ops["kind"]), key=lambda k: (k.startswith("wait:"), KIND_ORDER.index(k) if k in KIND_ORDER else 99, k))
    kcode = {k: i for i, k in enumerate(kinds)}
    ncode, names = pd.factorize(ops["name"].to_numpy())
    cols = [
        ("gap", (qs - prev).astype(np.int32)), ("dur", (qe - qs).astype(np.int32)),
        ("name", ncode.astype(np.int32)), ("aux", ops["aux"].to_numpy().astype(np.float32)),
        ("layer", ops["layer"].to_numpy().astype(np.int32)), ("mb", ops["mb"].to_numpy().astype(np.int32)),
        ("stage", ops["stage"].to_numpy().astype(np.int32)), ("kind", pd.Categorical(ops["kind"], categories=kinds).codes.astype(np.int32)),
    ]
    raw = b"".join(a.tobytes() for _, a in cols)  # all 4-byte columns: aligned views in the browser
    # the op names (waits describe themselves one by one) go into the same compressed blob, as JSON
    names_json = json.dumps([esc(x) for x in names.tolist()], separators=(",", ":")).encode()
    counts = np.bincount(ln, minlength=len(lanes)).astype(int).tolist()
    colors, labels = [], []
    for k in kinds:
        if k.startswith("wait:"):
            colors.append(CAUSE_COLORS.get(k[5:], "#888"))
            labels.append(esc(CAUSE_LABELS.get(k[5:], k)))
        else:
            colors.append(KIND_COLORS.get(k, "#888888"))
            labels.append(_kind_label(k))
    # waits included (they are drawn too), 5% below the page's limit: the page counts quantised times
    t0, t1 = detail_window(ops, tl.step_time_s, int(MAX_DETAIL_EVENTS * 0.95))
    return {
        "n": int(len(ops)), "unit_s": unit, "columns": [c for c, _ in cols], "counts": counts,
        "lane_label": [esc(f"rank {r} (pp {pp_of.get(r, '?')}) {s}") for r, s in lanes],
        "lane_compute": [s == "compute" for _, s in lanes],
        "kinds": kinds, "kind_color": colors, "kind_label": labels, "names_bytes": len(names_json),
        "max_ops": MAX_DETAIL_EVENTS, "window_ms": [t0 * 1e3, t1 * 1e3], "step_ms": tl.step_time_s * 1e3,
        "bar": {"compute": list(COMPUTE_BAR), "wait": list(WAIT_BAR), "other": list(OTHER_BAR)},
        "gz": base64.b64encode(gzip.compress(raw + names_json, 6)).decode("ascii"),
    }


def detail_figure(tl: "Timeline", lanes: list[tuple[int, str]], window_ms: tuple[float, float]) -> go.Figure:
    """The op-level view's frame: the lanes of the overview; the page draws the ops of whatever
    window is in view from the data embedded once (``ops_payload``)."""
    fig = go.Figure()
    fig.update_layout(
        barmode="overlay", height=max(300, 110 + 15 * len(lanes)),
        xaxis=dict(title="time (ms)", range=list(window_ms), showgrid=True, gridcolor="#eee", zeroline=False),
        yaxis=dict(_lane_axis(lanes, tl.pp_rank_of), range=[len(lanes) - 0.5, -0.5], autorange=False),
        shapes=_rank_separators(lanes),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0, font=dict(size=11)),
        margin=dict(l=150, r=20, t=60, b=45), plot_bgcolor="white", hoverlabel=dict(align="left"),
    )
    return fig


@dataclass
class HeatmapRows:
    row_of_rank: dict[int, int]
    labels: list[str]
    weight: np.ndarray  # simulated ranks each row averages over
    gpus_per_row: list[int]


def heatmap_rows(tl: "Timeline", gpus: int, max_rows: int = MAX_HEATMAP_ROWS) -> HeatmapRows:
    ranks = sorted(tl.ranks)
    if tl.mode == "reduced":
        # Each simulated rank stands for every replica of its pipeline rank.
        pps = sorted({tl.pp_rank_of[r] for r in ranks})
        per = max(1, gpus // max(1, len(pps)))
        row_of_pp = {p: i for i, p in enumerate(pps)}
        n_sim = np.zeros(len(pps))
        row_of = {}
        for r in ranks:
            row_of[r] = row_of_pp[tl.pp_rank_of[r]]
            n_sim[row_of[r]] += 1
        return HeatmapRows(row_of, [f"pp {p} (×{per:,} GPUs)" for p in pps], n_sim, [per] * len(pps))
    n = len(ranks)
    group = max(1, int(np.ceil(n / max_rows)))
    row_of = {r: i // group for i, r in enumerate(ranks)}
    n_rows = (n + group - 1) // group
    weight = np.bincount(list(row_of.values()), minlength=n_rows).astype(float)
    labels = []
    for i in range(n_rows):
        members = ranks[i * group:(i + 1) * group]
        labels.append(f"rank {members[0]}" if len(members) == 1 else f"ranks {members[0]}–{members[-1]}")
    return HeatmapRows(row_of, labels, weight, weight.astype(int).tolist())


def heatmap_figure(tl: "Timeline", gpus: int, bins: int = HEATMAP_BINS) -> go.Figure:
    rows = heatmap_rows(tl, gpus)
    step = tl.step_time_s
    ev = tl.events
    n_rows = len(rows.labels)
    layers = [("compute", ev[ev["stream"] == "compute"])]
    for d in DIMS:
        sub = ev[ev["kind"] == d]
        if len(sub):
            layers.append((f"{d} comm", sub))
    centers = (np.arange(bins) + 0.5) * step / bins * 1e3
    # One label per cell, shaped like z (a row's label repeated along time): Plotly looks up
    # customdata[row][column], so a (rows, 1) array leaves every column but the first without one.
    labels = np.array([esc(lb) for lb in rows.labels], dtype=object)
    cd = np.repeat(labels[:, None], bins, axis=1)
    fig = go.Figure()
    for i, (label, sub) in enumerate(layers):
        z = utilization_matrix(sub, rows.row_of_rank, n_rows, rows.weight, step, bins)
        fig.add_trace(go.Heatmap(
            z=np.round(z * 100).astype(np.uint8), x=np.round(centers, 3), y=list(range(n_rows)),
            zmin=0, zmax=100, colorscale="Viridis", visible=i == 0, name=esc(label),
            # each cell is the exact busy share of its bin (no sampling), and smoothing draws it
            # without the nearest-neighbour resampling that turns periodic patterns into moire
            zsmooth="best",
            colorbar=dict(title=dict(text="% busy"), thickness=12),
            customdata=cd,
            hovertemplate="%{customdata}<br>t ≈ %{x:.1f} ms<br>busy %{z}%<extra>" + esc(label) + "</extra>",
        ))
    buttons = [dict(label=esc(lb), method="update",
                    args=[{"visible": [j == i for j in range(len(layers))]},
                          {"title.text": f"Utilization over time × ranks: {esc(lb)}"}])
               for i, (lb, _) in enumerate(layers)]
    many = n_rows > 40
    fig.update_layout(
        title=dict(text=f"Utilization over time × ranks: {esc(layers[0][0])}", x=0.01, font=dict(size=13)),
        updatemenus=[dict(type="buttons", direction="right", buttons=buttons, x=1, xanchor="right", y=1.02,
                          yanchor="bottom", showactive=True, font=dict(size=11))],
        height=max(300, min(900, 110 + (4 if many else 22) * n_rows)),
        xaxis=dict(title="time (ms)"),
        yaxis=dict(autorange="reversed", tickmode="array",
                   tickvals=list(range(0, n_rows, max(1, n_rows // 16))) if many else list(range(n_rows)),
                   ticktext=[esc(rows.labels[i]) for i in range(0, n_rows, max(1, n_rows // 16))] if many
                   else [esc(lb) for lb in rows.labels], tickfont=dict(size=10)),
        margin=dict(l=150, r=20, t=60, b=45),
    )
    return fig


# The step breakdown's terms and their names, as the terminal summary prints them.
BREAKDOWN_NAMES = BREAKDOWN_LABELS


def step_breakdown_figure(reports: Sequence[tuple[str, "Report"]]) -> go.Figure:
    """One stacked bar per run: where the step's time goes (sums to the step), and the critical
    path by cause under it."""
    fig = go.Figure()
    multi = len(reports) > 1
    ys = []
    for label, rep in reports:
        ys += [f"{esc(label)} step" if multi else "step", f"{esc(label)} critical path" if multi else "critical path"]
    for key, name in BREAKDOWN_NAMES.items():
        xs, yy, cd = [], [], []
        for label, rep in reports:
            v = rep.step_breakdown_s.get(key, 0.0)
            xs.append(v * 1e3)
            yy.append(f"{esc(label)} step" if multi else "step")
            cd.append(f"{v / rep.step_time_s:.1%}" if rep.step_time_s else "")
            cause = key.removeprefix("exposed_")  # the path's causes: compute, host_launch, tp..dp, bubble
            if key in ("compute", "host_launch", "bubble") or key.startswith("exposed_"):
                cv = rep.critical_path_s.get(cause, 0.0)
                xs.append(cv * 1e3)
                yy.append(f"{esc(label)} critical path" if multi else "critical path")
                cd.append(f"{cv / rep.step_time_s:.1%}" if rep.step_time_s else "")
        if not any(x > 0 for x in xs):
            continue
        fig.add_trace(go.Bar(x=xs, y=yy, orientation="h", name=esc(name), marker_color=BREAKDOWN_COLORS[key],
                             customdata=cd, hovertemplate="%{y}: " + esc(name) + " %{x:.2f} ms (%{customdata})<extra></extra>",
                             meta=dict(key=key)))
    fig.update_layout(barmode="stack", height=140 + 40 * len(ys), xaxis_title="ms",
                      yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=ys),
                      margin=dict(l=170 if multi else 110, r=20, t=10, b=45),
                      legend=dict(orientation="h", yanchor="top", y=-0.35, xanchor="left", x=0, traceorder="normal"))
    return fig


def stage_breakdown_figure(reports: Sequence[tuple[str, "Report"]]) -> go.Figure:
    """Per pipeline rank: compute, exposed communication per dimension, bubble, imbalance and
    optimizer, in seconds (each row sums to the step)."""
    fig = go.Figure()
    multi = len(reports) > 1
    for si, (label, rep) in enumerate(reports):
        rows = rep.per_pp_rank
        y = [f"{esc(label)} pp {r['pp_rank']}" if multi else f"pp {r['pp_rank']}" for r in rows]
        for key, name in BREAKDOWN_NAMES.items():
            if rows and "breakdown_s" in rows[0]:
                v = [r["breakdown_s"].get(key, 0.0) for r in rows]
            elif key == "compute":
                v = [r["compute_s"] for r in rows]
            elif key.startswith("exposed_"):
                v = [r["exposed_comm_s"].get(key.removeprefix("exposed_"), 0.0) for r in rows]
            elif key == "bubble":
                v = [r["bubble_fraction"] * rep.step_time_s for r in rows]
            else:
                continue
            if not any(x > 0 for x in v):
                continue
            fig.add_trace(go.Bar(
                y=y, x=v, orientation="h", name=esc(name), marker_color=BREAKDOWN_COLORS[key], legendgroup=key,
                showlegend=si == 0, hovertemplate="%{y}: " + esc(name) + " %{x:.3f} s<extra></extra>",
            ))
    n = sum(len(r.per_pp_rank) for _, r in reports)
    fig.update_layout(barmode="stack", height=max(300, 140 + 22 * n), xaxis_title="seconds",
                      yaxis=dict(autorange="reversed"), margin=dict(l=150 if multi else 60, r=20, t=30, b=45),
                      legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0, traceorder="normal"))
    return fig


def memory_figure(reports: Sequence[tuple[str, "Report"]]) -> go.Figure:
    fig = go.Figure()
    colors = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D"]
    multi = len(reports) > 1
    cap = 0.0
    for si, (label, rep) in enumerate(reports):
        rows = rep.per_pp_rank
        x = [f"{esc(label)} pp {r['pp_rank']}" if multi else f"pp {r['pp_rank']}" for r in rows]
        keys = [k for k in (rows[0].get("memory_gib", {}) if rows else {}) if k != "total_gib"]
        for ki, k in enumerate(keys):
            name = esc(k.removesuffix("_gib"))
            fig.add_trace(go.Bar(x=x, y=[r["memory_gib"].get(k, 0.0) for r in rows], name=name,
                                 marker_color=colors[ki % len(colors)], legendgroup=name, showlegend=si == 0,
                                 hovertemplate="%{x}: " + name + " %{y:.2f} GiB<extra></extra>"))
        cap = max(cap, rep.memory_capacity_gib)
    fig.add_hline(y=cap, line=dict(color="#C00", dash="dash", width=2),
                  annotation_text=f"usable HBM {cap:.1f} GiB", annotation_position="top left")
    peak = max((r.peak_memory_gib for _, r in reports), default=0.0)
    fig.update_layout(barmode="stack", yaxis=dict(title="GiB per GPU", range=[0, max(cap, peak) * 1.12]),
                      height=380,
                      margin=dict(l=60, r=20, t=30, b=45),
                      legend=dict(orientation="h", yanchor="top", y=-0.14, xanchor="left", x=0))
    return fig


def stage_activation_bytes(result: "SimulationResult") -> list[float]:
    """Activation bytes one microbatch leaves on each stage, as the memory model counts them
    (``workload.memory.stage_activation_bytes``), indexed by stage."""
    from simulator.workload import memory

    return memory.stage_activation_bytes(result.scenario, result.program)


def memory_over_time(result: "SimulationResult") -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per pipeline rank: (times s, GiB) of its memory over the step. Model state, buffers and the
    reserve are constant; a microbatch's activations are taken when its forward starts and freed
    when its input-gradient pass (B or I) ends, as the memory model counts them; the loss's
    working set (torchtitan) is held through the first segment of each backward of the last stage."""
    from simulator.workload.memory import GIB

    from simulator.engine.lockstep import drawn_from

    rep, tl = result.report, drawn_from(result.timeline)
    stage_bytes = stage_activation_bytes(result)
    ev = tl.events[tl.events["stream"] == "compute"]
    reps = {}
    for r in sorted(tl.ranks):
        reps.setdefault(tl.pp_rank_of[r], r)
    out = {}
    for pp, r in reps.items():
        row = rep.per_pp_rank[pp]["memory_gib"] if pp < len(rep.per_pp_rank) else {}
        loss_gib = row.get("loss_working_set_gib", 0.0)
        static = row.get("total_gib", 0.0) - row.get("activations_gib", 0.0) - loss_gib
        e = ev[(ev["rank"] == r) & (ev["kind"].isin(["F", "B", "I"]))]
        g = e.groupby(["stage", "microbatch", "kind"]).agg(start=("start_s", "min"), end=("end_s", "max"),
                                                           first_end=("end_s", "min")).reset_index()
        f = g[g["kind"] == "F"]
        bk = g[g["kind"] != "F"]
        t = np.concatenate([f["start"].to_numpy(), bk["end"].to_numpy()])
        d = np.concatenate([[stage_bytes[int(st)] for st in f["stage"]], [-stage_bytes[int(st)] for st in bk["stage"]]])
        if loss_gib > 0:
            # The loss's backward working set: held from the last stage's backward start to the
            # end of its first segment (the head's backward, loss first), once per microbatch.
            head = bk[bk["stage"] == len(stage_bytes) - 1]
            t = np.concatenate([t, head["start"].to_numpy(), head["first_end"].to_numpy()])
            w = loss_gib * GIB
            d = np.concatenate([d, np.full(len(head), w), np.full(len(head), -w)])
        # At equal times free first: a backward that ends as the next forward starts hands its
        # activations over (the memory model counts the schedule's in-flight microbatches, not one
        # more; allocating first drew pp 0 of the default scenario at 33.95 GiB against 31.16).
        order = np.lexsort((d, t))
        t, d = t[order], d[order]
        held = np.cumsum(d) / GIB
        out[pp] = (np.concatenate([[0.0], t, [tl.step_time_s]]),
                   static + np.concatenate([[0.0], held, [held[-1] if len(held) else 0.0]]))
    return out


def memory_time_figure(result: "SimulationResult") -> go.Figure | None:
    try:
        series = memory_over_time(result)
    except (KeyError, IndexError, AttributeError, TypeError):
        return None
    rep = result.report
    fig = go.Figure()
    palette = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D", "#2F4B7C"]
    for i, (pp, (t, gib)) in enumerate(series.items()):
        if len(t) > 4000:  # keep the page small: the step function at ~4000 points
            idx = np.unique(np.linspace(0, len(t) - 1, 4000).astype(int))
            t, gib = t[idx], gib[idx]
        fig.add_trace(go.Scatter(x=np.round(t * 1e3, 3), y=np.round(gib, 3), mode="lines", line=dict(shape="hv", width=1.5,
                                 color=palette[i % len(palette)]), name=f"pp {pp}",
                                 hovertemplate=f"pp {pp}: " + "%{y:.1f} GiB at %{x:.1f} ms<extra></extra>"))
    cap = rep.memory_capacity_gib
    fig.add_hline(y=cap, line=dict(color="#C00", dash="dash", width=2),
                  annotation_text=f"usable HBM {cap:.1f} GiB", annotation_position="top left")
    peak = max((float(g.max()) for _, g in series.values()), default=0.0)
    fig.update_layout(height=380, xaxis_title="time (ms)", yaxis=dict(title="GiB per GPU", range=[0, max(cap, peak) * 1.12]),
                      margin=dict(l=60, r=20, t=30, b=45),
                      legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0))
    return fig


def comm_rate_series(result: "SimulationResult", bins: int = 300) -> dict[str, tuple[np.ndarray, np.ndarray, str]]:
    """Per dimension: (bin centres s, GB/s one GPU puts on the wire, tier). Bus bytes of each
    communication row (nccl-tests convention) spread evenly over its span; the tier is NVLink when a
    group of that dimension sits inside one node, else scale-out. From the timeline, not the fabric."""
    from simulator.engine.lockstep import drawn_from
    from simulator.network.base import bus_factor

    tl = drawn_from(result.timeline)
    ev = tl.events[tl.events["stream"] != "compute"]
    out: dict[str, tuple[np.ndarray, np.ndarray, str]] = {}
    if ev.empty:
        return out
    mesh = result.program.mesh
    gpn = result.topology.node.gpus_per_node
    step = tl.step_time_s
    edges = np.linspace(0, step, bins + 1)
    n_ranks = max(1, len(tl.ranks))
    for d in DIMS:
        sub = ev[(ev["kind"] == d) & ~ev["stream"].isin(["pp-recv-f", "pp-recv-b"])]
        if sub.empty:
            continue
        size = {"tp": mesh.tp, "cp": mesh.cp, "ep": mesh.ep, "pp": 2, "dp": mesh.dp}[d]
        if d == "pp":
            tier = "NVLink" if mesh.tp * mesh.cp * mesh.dp < gpn else "scale-out"
        else:
            g = np.asarray(mesh.groups(d)[0])
            tier = "NVLink" if len(set((g // gpn).tolist())) == 1 else "scale-out"
        s0, e0 = sub["start_s"].to_numpy(), sub["end_s"].to_numpy()
        codes, uniq = pd.factorize(sub["name"].astype(str).to_numpy())
        per_name = np.array([bus_factor(o, size) if d != "pp" and o in ("all_reduce", "all_gather", "reduce_scatter",
                                                                          "all_to_all") else 1.0
                             for o in (u.split(" ", 1)[0] for u in uniq)])
        factor = per_name[codes]
        rate = sub["bytes"].to_numpy(dtype=float) * factor / np.maximum(e0 - s0, 1e-12)
        per_bin = _binned(s0, e0, rate, edges)  # bytes per bin: rate x overlap of each row with the bin
        out[d] = ((edges[:-1] + edges[1:]) / 2, per_bin / np.diff(edges) / n_ranks / 1e9, tier)
    return out


def _binned(s0: np.ndarray, e0: np.ndarray, rate: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Sum over rows of rate x |[s, e] ∩ bin|: the total rate is a step function (+rate at s, -rate
    at e), integrated exactly up to each bin edge from cumulative sums at the breakpoints."""
    t = np.concatenate([s0, e0])
    w = np.concatenate([rate, -rate])
    order = np.argsort(t)
    t, w = t[order], w[order]
    level = np.cumsum(w)
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(t))])  # integral up to each breakpoint

    def integral(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(t, x, side="right") - 1
        base = np.where(k >= 0, area[np.clip(k, 0, None)], 0.0)
        lev = np.where(k >= 0, level[np.clip(k, 0, None)], 0.0)
        return base + lev * (x - np.where(k >= 0, t[np.clip(k, 0, None)], x))

    return np.diff(integral(edges))


def comm_time_figure(result: "SimulationResult", bins: int = 300) -> go.Figure | None:
    """Bytes per second one GPU puts on the wire over the step, per dimension and tier."""
    series = comm_rate_series(result, bins)
    if not series:
        return None
    fig = go.Figure()
    for d, (t, gbps, tier) in series.items():
        fig.add_trace(go.Scatter(x=np.round(t * 1e3, 3), y=np.round(gbps, 3), mode="lines",
                                 name=esc(f"{d} ({tier})"), line=dict(color=KIND_COLORS[d], width=1.5),
                                 hovertemplate=esc(f"{d} over {tier}") + ": %{y:.1f} GB/s at %{x:.1f} ms<extra></extra>"))
    fig.update_layout(height=340, xaxis_title="time (ms)", yaxis_title="GB/s per GPU on the wire",
                      margin=dict(l=60, r=20, t=30, b=45), legend=dict(orientation="h", yanchor="top", y=-0.2, x=0))
    return fig


# ---------------------------------------------------------------------------------------------
# HTML


CSS = """
body{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;
 background:#f6f7f9;color:#222}
header{background:#1f2a44;color:#fff;padding:14px 22px}
header h1{font-size:20px;margin:0 0 4px 0;font-weight:600}
header .sub{font-size:13px;color:#c9d1e3}
main{padding:14px 22px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin-bottom:14px}
.card{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.12);padding:10px 14px;flex:1 1 140px;min-width:140px}
.card .k{font-size:12px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.card .v{font-size:22px;font-weight:600;margin-top:2px}
.card .s{font-size:12px;color:#555;margin-top:2px}
.card.bad .v{color:#C00}
.card table{font-size:13px;border-collapse:collapse}
.card td{padding:1px 8px 1px 0}
.panel{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.12);padding:8px 10px;margin-bottom:14px}
.panel h2{font-size:15px;margin:4px 4px 6px 4px}
.caption{font-size:12px;color:#555;margin:0 6px 6px 6px}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:14px}
table.links,table.diff{border-collapse:collapse;font-size:13px;margin:4px}
table.links th,table.links td,table.diff th,table.diff td{border-bottom:1px solid #e3e3e3;padding:3px 10px;text-align:left}
.better{color:#137333;font-weight:600}.worse{color:#C5221F;font-weight:600}.changed{background:#FFF4CE}
.notes li,.findings li{font-size:13px;margin:4px 0}
.findings .tag{display:inline-block;font-size:11px;font-weight:600;text-transform:uppercase;border-radius:4px;padding:1px 6px;
 margin-right:6px;background:#FCE8E6;color:#A50E0E}
.findings .tag.bubble,.findings .tag.imbalance{background:#EEE;color:#333}
.findings .tag.exposed-dp,.findings .tag.slow-link{background:#E8EAF6;color:#1A237E}
#cs-noplotly{display:none;background:#FFF4CE;border:1px solid #E0B000;border-radius:6px;padding:10px 14px;margin:0 0 14px 0;
 font-size:14px}
.cs-fig{min-height:40px}
"""

# Installed before plotly.js so a failing script is recorded in the DOM (the browser test reads it).
ERROR_HOOK = ("<script>window.addEventListener('error',function(e){var d=document.documentElement;"
              "d.setAttribute('data-js-errors',(parseInt(d.getAttribute('data-js-errors')||'0')+1)+'');"
              "d.setAttribute('data-js-error-last',String(e.message));});</script>")


def plotly_script_tag(cdn: bool) -> str:
    """plotly.js from its CDN, or inline: gzip-compressed and base64-encoded (2 MB instead of 4.8 MB),
    unpacked by the page with the browser's DecompressionStream before the figures are drawn."""
    if cdn:
        tag = pio.to_html(go.Figure(), include_plotlyjs="cdn", full_html=False)
        m = re.search(r'src="([^"]+)"', tag)
        src = m.group(1) if m else CDN_FALLBACK
        return f'<script charset="utf-8" src="{esc(src)}" onerror="window.csPlotlyFailed=true"></script>'
    return (f'<script type="application/octet-stream" id="cs-plotly-gz">{_plotly_gz()}</script>'
            # start unpacking at once, while the rest of the page is still being parsed
            "<script>(function(){try{var t=document.getElementById('cs-plotly-gz').textContent,s=atob(t),n=s.length,"
            "u=new Uint8Array(n);for(var i=0;i<n;i++)u[i]=s.charCodeAt(i);window.csPlotlyText=new Response(new Blob([u])"
            ".stream().pipeThrough(new DecompressionStream('gzip'))).text();}catch(e){}})();</script>")


_PLOTLY_GZ: dict[str, str] = {}


def _plotly_gz() -> str:
    import base64
    import gzip

    from plotly.offline import get_plotlyjs

    # cached per process: compressing 4.8 MB takes ~0.3 s and the bundle never changes
    key = plotly_version()
    if key not in _PLOTLY_GZ:
        _PLOTLY_GZ[key] = base64.b64encode(gzip.compress(get_plotlyjs().encode(), 9)).decode("ascii")
    return _PLOTLY_GZ[key]


def plotly_version() -> str:
    import plotly

    return str(plotly.__version__)


PLOT_CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False,
               "toImageButtonOptions": {"format": "png", "scale": 2}}


def _json_for_script(obj: Any) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    # inside <script> only "</" and "<!--" can end or bend the element; JSON allows "\/"
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


GZIP_FIGURE_BYTES = 50_000  # figures bigger than this travel gzip-compressed (hover text repeats a lot)


def figure_div(fig: go.Figure, div_id: str) -> str:
    """A placeholder div and the figure as JSON (gzip + base64 when large); the page's runtime draws
    it once plotly.js is there."""
    import base64
    import gzip

    body = pio.to_json(fig, validate=False, remove_uids=True)
    div = f'<div id="{esc(div_id)}" class="cs-fig"></div>'
    if len(body) > GZIP_FIGURE_BYTES:
        gz = base64.b64encode(gzip.compress(body.encode(), 6)).decode("ascii")
        return div + f'<script type="application/octet-stream" class="cs-fig-data" data-gz="1" data-for="{esc(div_id)}">{gz}</script>'
    return div + f'<script type="application/json" class="cs-fig-data" data-for="{esc(div_id)}">{_json_for_script(body)}</script>'


def figure_json(page_html: str, div_id: str) -> dict:
    """The figure of ``div_id`` as embedded in a page (plain or compressed): for tests and tools."""
    import base64
    import gzip

    m = re.search(r'<script type="[^"]+" class="cs-fig-data"( data-gz="1")? data-for="' + re.escape(div_id) + r'">(.*?)</script>',
                  page_html, re.S)
    if m is None:
        raise KeyError(div_id)
    text = gzip.decompress(base64.b64decode(m.group(2))).decode() if m.group(1) else m.group(2).replace("<\\/", "</")
    return json.loads(text)


# The page runtime: unpack plotly.js (or find it from the CDN), draw every figure, wire the op-level
# view and linked axes, then mark the page ready (data-ready, data-tti-ms, a cs-ready event).
RUNTIME_JS = r"""
(function(){
var CONFIG=__CONFIG__;
function bytes(b64){var s=atob(b64),n=s.length,u=new Uint8Array(n);for(var i=0;i<n;i++)u[i]=s.charCodeAt(i);return u;}
async function gunzip(b64){var ds=new DecompressionStream('gzip');
  return await new Response(new Blob([bytes(b64)]).stream().pipeThrough(ds)).arrayBuffer();}
async function loadPlotly(){
  if(window.Plotly)return true;
  var el=document.getElementById('cs-plotly-gz'); if(!el)return false;
  var txt=window.csPlotlyText?await window.csPlotlyText:new TextDecoder().decode(await gunzip(el.textContent));
  var sc=document.createElement('script'); sc.textContent=txt; document.head.appendChild(sc);
  return !!window.Plotly;}
function ready(){var d=document.documentElement;d.setAttribute('data-ready','1');
  d.setAttribute('data-tti-ms',String(Math.round(performance.now())));window.dispatchEvent(new Event('cs-ready'));}
function noPlotly(){var m=document.getElementById('cs-noplotly');
  m.textContent=document.getElementById('cs-plotly-gz')?'The charts could not be drawn: this browser cannot unpack the embedded plotly.js (it needs DecompressionStream). The numbers and findings on this page are complete.'
   :'The charts are missing: plotly.js could not be loaded from its CDN (offline, or blocked). The numbers and findings on this page are complete; rebuild the dashboard without --cdn to embed plotly.js in the page.';
  m.style.display='block';document.documentElement.setAttribute('data-plotly','missing');}
var OPS=null;
async function setupOps(){
  var el=document.getElementById('cs-ops'); if(!el)return;
  var P=JSON.parse(el.textContent); var buf=await gunzip(P.gz); var n=P.n, col={};
  P.names=JSON.parse(new TextDecoder().decode(new Uint8Array(buf,4*n*P.columns.length,P.names_bytes)));
  P.columns.forEach(function(c,i){col[c]=(c==='aux'?new Float32Array(buf,4*n*i,n):new Int32Array(buf,4*n*i,n));});
  var start=new Float64Array(n),end=new Float64Array(n),lane=new Int32Array(n),u=P.unit_s*1e3,k=0;
  for(var l=0;l<P.counts.length;l++){var prev=0;for(var j=0;j<P.counts[l];j++,k++){
    var s0=prev+col.gap[k],e0=s0+col.dur[k];start[k]=s0*u;end[k]=e0*u;lane[k]=l;prev=e0;}}
  OPS={P:P,col:col,start:start,end:end,lane:lane,div:document.getElementById(el.dataset.for),
       overview:document.getElementById(el.dataset.overview),busy:false};
  await draw(P.window_ms[0],P.window_ms[1]);
  OPS.overview.on('plotly_relayout',function(e){
    if(e['xaxis.range[0]']!==undefined)draw(e['xaxis.range[0]'],e['xaxis.range[1]']);
    else if(e['xaxis.range'])draw(e['xaxis.range'][0],e['xaxis.range'][1]);
    else if(e['xaxis.autorange'])draw(P.window_ms[0],P.window_ms[1]);});
  OPS.div.on('plotly_relayout',function(e){if(OPS.busy)return;
    if(e['xaxis.range[0]']!==undefined)draw(e['xaxis.range[0]'],e['xaxis.range[1]'],true);});
}
function draw(t0,t1,fromDetail){
  var O=OPS,P=O.P,c=O.col,idx=[];
  for(var i=0;i<P.n;i++){if(O.end[i]>t0&&O.start[i]<t1){idx.push(i);if(idx.length>P.max_ops)break;}}
  var traces=[],note='';
  if(idx.length>P.max_ops){note='More than '+P.max_ops.toLocaleString()+' ops in '+(t1-t0).toFixed(2)+' ms: zoom in (here or on the timeline above) to see every op.';idx=[];}
  var by={};
  idx.forEach(function(i){var kk=c.kind[i];(by[kk]=by[kk]||[]).push(i);});
  Object.keys(by).sort(function(a,b){return a-b;}).forEach(function(kk){
    var ii=by[kk],kind=P.kinds[kk],wait=kind.indexOf('wait:')===0,x=[],base=[],y=[],w=[],cd=[];
    ii.forEach(function(i){var l=O.lane[i],comp=P.lane_compute[l],bb=comp?(wait?P.bar.wait:P.bar.compute):P.bar.other;
      x.push(O.end[i]-O.start[i]);base.push(O.start[i]);y.push(l+bb[0]);w.push(bb[1]);
      var aux=c.aux[i],extra='';
      if(wait){extra=isNaN(aux)?'waiting since '+O.start[i].toFixed(3)+' ms':'waiting since '+O.start[i].toFixed(3)+' ms; on the wire since '+(O.start[i]+aux).toFixed(3)+' ms';}
      else if(aux>0){extra=(aux>=1e9?(aux/1e9).toFixed(2)+' GB':aux>=1e6?(aux/1e6).toFixed(2)+' MB':(aux/1e3).toFixed(1)+' KB');}
      cd.push([P.names[c.name[i]],P.lane_label[l],c.layer[i]>=0?c.layer[i]:'–',c.mb[i]>=0?c.mb[i]:'–',
               c.stage[i]>=0?c.stage[i]:'–',(O.end[i]-O.start[i]).toFixed(4),extra,O.end[i].toFixed(3)]);});
    var marker={color:P.kind_color[kk],line:{width:0}};
    if(wait&&kind!=='wait:bubble')marker.pattern={shape:'/',fgcolor:'#ffffff',fgopacity:0.55,size:6,solidity:0.25};
    traces.push({type:'bar',orientation:'h',x:x,base:base,y:y,width:w,name:P.kind_label[kk],marker:marker,customdata:cd,
      meta:{kind:kind},hovertemplate:'<b>%{customdata[0]}</b><br>%{customdata[1]}<br>layer %{customdata[2]} · microbatch %{customdata[3]} · stage %{customdata[4]}<br>%{base:.4f}–%{customdata[7]} ms: %{customdata[5]} ms<br>%{customdata[6]}<extra>%{fullData.name}</extra>'});});
  var lay=O.div.layout;lay.xaxis.range=[t0,t1];lay.xaxis.autorange=false;
  lay.annotations=note?[{text:note,xref:'paper',yref:'paper',x:0.5,y:0.5,showarrow:false,font:{size:14,color:'#A50E0E'},bgcolor:'#FFF4CE'}]:[];
  O.busy=true;
  return Plotly.react(O.div,traces,lay).then(function(){O.busy=false;O.div.setAttribute('data-ops',String(idx.length));
    O.div.setAttribute('data-window',t0.toFixed(6)+','+t1.toFixed(6));});
}
window.csDrawOps=function(t0,t1){return draw(t0,t1);};
function linkAxes(){
  document.querySelectorAll('[data-link-x]').forEach(function(a){
    var ids=a.getAttribute('data-link-x').split(','),divs=ids.map(function(i){return document.getElementById(i);}),lock=false;
    divs.forEach(function(d){d.on('plotly_relayout',function(e){if(lock)return;var upd=null;
      if(e['xaxis.range[0]']!==undefined)upd={'xaxis.range':[e['xaxis.range[0]'],e['xaxis.range[1]']]};
      else if(e['xaxis.autorange'])upd={'xaxis.autorange':true};
      if(!upd)return;lock=true;Promise.all(divs.filter(function(o){return o!==d;}).map(function(o){return Plotly.relayout(o,upd);}))
        .then(function(){lock=false;});});});});}
async function main(){
  var ok=false;try{ok=await loadPlotly();}catch(e){ok=false;}
  performance.mark('cs-plotly');
  if(!ok){noPlotly();ready();return;}
  // Reserve each figure's height first, then draw the figures on the first screen, mark the page
  // interactive, and draw the rest, yielding between figures so the page keeps responding.
  var els=document.querySelectorAll('script.cs-fig-data'),figs=[];
  for(var k=0;k<els.length;k++){var el=els[k],f=JSON.parse(el.dataset.gz?new TextDecoder().decode(await gunzip(el.textContent)):el.textContent),
    div=document.getElementById(el.dataset.for);
    if(f.layout&&f.layout.height)div.style.minHeight=f.layout.height+'px';figs.push({f:f,div:div});}
  var H=window.innerHeight||1000;
  var first=figs.filter(function(x){return x.div.getBoundingClientRect().top<H;}),
      rest=figs.filter(function(x){return first.indexOf(x)<0;});
  async function drawFig(x){await Plotly.newPlot(x.div,x.f.data,x.f.layout,CONFIG);x.div.style.minHeight='';
    performance.mark('cs-fig-'+x.div.id);}
  for(var i=0;i<first.length;i++)await drawFig(first[i]);
  document.documentElement.setAttribute('data-interactive-ms',String(Math.round(performance.now())));
  for(var j=0;j<rest.length;j++){await new Promise(function(r){setTimeout(r,0);});await drawFig(rest[j]);}
  try{await setupOps();}catch(e){console.error('op-level view: '+e);}
  performance.mark('cs-ops');
  linkAxes();ready();}
if(document.readyState==='loading')document.addEventListener('DOMContentLoaded',main);else main();
})();
"""


def runtime_script() -> str:
    return "<script>" + RUNTIME_JS.replace("__CONFIG__", json.dumps(PLOT_CONFIG)) + "</script>"


def panel(title: str, body: str, caption: str = "", anchor: str = "") -> str:
    cap = f'<p class="caption">{caption}</p>' if caption else ""
    ident = f' id="{esc(anchor)}"' if anchor else ""
    return f'<section class="panel"{ident}><h2>{title}</h2>{cap}{body}</section>'


def page(title: str, subtitle: str, body: str, cdn: bool) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{title}</title>"
        f"<style>{CSS}</style>{ERROR_HOOK}{plotly_script_tag(cdn)}</head><body>"
        f"<header><h1>{title}</h1><div class=\"sub\">{subtitle}</div></header><main>"
        f'<div id="cs-noplotly" role="alert"></div>{body}</main>{runtime_script()}</body></html>\n'
    )


def card(key: str, value: str, sub: str = "", bad: bool = False) -> str:
    cls = "card bad" if bad else "card"
    s = f'<div class="s">{sub}</div>' if sub else ""
    return f'<div class="{cls}"><div class="k">{key}</div><div class="v">{value}</div>{s}</div>'


def summary_cards(rep: "Report") -> str:
    step = rep.step_time_s
    exposed_rows = "".join(
        f"<tr><td>{esc(d)}</td><td>{v * 1e3:,.1f} ms</td><td>{(v / step if step else 0):.1%}</td></tr>"
        for d, v in rep.exposed_comm_s.items() if v > 0
    ) or "<tr><td>none</td></tr>"
    total_exposed = sum(rep.exposed_comm_s.values())
    mem_rows = "".join(
        f"<tr><td>pp {esc(r.get('pp_rank'))}</td><td>{r.get('memory_gib', {}).get('total_gib', 0.0):.1f} GiB</td></tr>"
        for r in rep.per_pp_rank[:4]
    )
    more = f"<tr><td colspan=2>… {len(rep.per_pp_rank) - 4} more in the chart</td></tr>" if len(rep.per_pp_rank) > 4 else ""
    bd = rep.step_breakdown_s
    bubble_sub = f"worst stage {rep.bubble_fraction_worst:.1%}"
    if bd:
        bubble_sub = (f"bubble {bd.get('bubble', 0.0) / step:.1%} + imbalance {bd.get('imbalance', 0.0) / step:.1%}"
                      f" · worst stage {rep.bubble_fraction_worst:.1%}")
    cards = [
        card("step time", f"{step:.3f} s", f"{rep.num_microbatches} microbatches"),
        card("MFU", f"{rep.mfu:.1%}", f"{rep.model_tflops_per_gpu:.0f} model TFLOP/s per GPU"),
        card("tokens / s", f"{rep.tokens_per_s:,.0f}", f"{rep.tokens_per_s_per_gpu:,.0f} per GPU"),
        card("pipeline idle", f"{rep.bubble_fraction:.1%}", bubble_sub),
        f'<div class="card"><div class="k">exposed communication</div><div class="v">{total_exposed:.3f} s</div>'
        f"<table>{exposed_rows}</table></div>",
        f'<div class="card{"" if rep.fits_in_memory else " bad"}"><div class="k">peak memory</div>'
        f'<div class="v">{rep.peak_memory_gib:.1f} GiB</div><div class="s">of {rep.memory_capacity_gib:.1f} GiB usable'
        f' · {"fits" if rep.fits_in_memory else "DOES NOT FIT"}</div><table>{mem_rows}{more}</table></div>',
        card("simulated", f"{rep.wall_s if rep.wall_s is not None else rep.sim_wall_s:.2f} s",
             f"{rep.events:,} events · {esc(rep.mode)} mode · {rep.gpus:,} GPUs"
             + (f" · event loop {rep.sim_wall_s:.2f} s" if rep.wall_s is not None else "")),
    ]
    return '<div class="cards">' + "".join(cards) + "</div>"


def breakdown_table(rep: "Report") -> str:
    bd = rep.step_breakdown_s
    step = rep.step_time_s
    if not bd or step <= 0:
        return ""
    rows = "".join(
        f'<tr data-key="{esc(k)}" data-seconds="{bd.get(k, 0.0):.9g}"><td><span style="color:{BREAKDOWN_COLORS[k]}">■</span> '
        f"{esc(name)}</td><td>{bd.get(k, 0.0) * 1e3:,.2f} ms</td><td>{bd.get(k, 0.0) / step:.1%}</td></tr>"
        for k, name in BREAKDOWN_NAMES.items() if bd.get(k, 0.0) > 0)
    total = sum(bd.get(k, 0.0) for k in BREAKDOWN_NAMES)
    return (f'<table class="diff" id="breakdown">{rows}<tr><td><b>sum</b></td><td><b>{total * 1e3:,.2f} ms</b></td>'
            f"<td>step {step * 1e3:,.2f} ms</td></tr></table>")


def critical_path_html(rep: "Report", limit: int = 40) -> str:
    """The critical path's entries in time order (the ``limit`` longest kept), foldable."""
    path = rep.critical_path
    if not path:
        return ""
    keep = sorted(sorted(range(len(path)), key=lambda i: path[i]["start_s"] - path[i]["end_s"])[:limit])
    rows = "".join(
        f'<tr><td>{path[i]["start_s"] * 1e3:,.2f}</td><td>{(path[i]["end_s"] - path[i]["start_s"]) * 1e3:,.2f}</td>'
        f'<td>rank {esc(path[i]["rank"])} (pp {esc(path[i]["pp_rank"])})</td><td>{esc(path[i]["what"])}</td>'
        f'<td>{esc(", ".join(f"{PATH_CAUSE_NAMES.get(k, k)} {v * 1e3:.2f} ms" for k, v in path[i].get("by_cause_s", {}).items()))}</td></tr>'
        for i in keep)
    by = ", ".join(f"{esc(PATH_CAUSE_NAMES.get(k, k))} {v / rep.step_time_s:.1%}"
                   for k, v in sorted(rep.critical_path_s.items(), key=lambda x: -x[1]))
    return (f'<details id="critical-path"><summary>Critical path: {len(path):,} entries ({by}); the {len(keep)} longest '
            f'in time order</summary><table class="diff"><tr><th>start ms</th><th>ms</th><th>where</th><th>what</th>'
            f"<th>by cause</th></tr>{rows}</table></details>")


def findings_html(rep: "Report") -> str:
    if not rep.findings:
        return '<p class="caption" id="findings-none">No finding: memory fits, and no bubble, imbalance or exposed communication crosses its threshold.</p>'
    items = []
    for f in rep.findings:
        items.append(f'<li class="finding" data-kind="{esc(f.get("kind", ""))}" data-value="{float(f.get("value", 0.0)):.6g}">'
                     f'<span class="tag {esc(f.get("kind", ""))}">{esc(f.get("kind", ""))}</span>{esc(f.get("message", ""))}</li>')
    return '<ul class="findings" id="findings">' + "".join(items) + "</ul>"


def links_html(rep: "Report", limit: int = 10) -> str:
    """Links grouped by tier (kind): how many, the busiest and the mean utilisation, bytes; then the
    busiest distinct links. (A tier of identical links is one row, not ten.)"""
    links = rep.busiest_links
    if not links:
        return '<p class="caption">alpha-beta network: no per-link data</p>'
    tiers: dict[str, list[dict]] = {}
    for ln in links:
        tiers.setdefault(str(ln.get("kind", "link")), []).append(ln)
    rows = []
    for kind, ls in sorted(tiers.items(), key=lambda kv: -max(float(x.get("utilization", 0) or 0) for x in kv[1])):
        u = [float(x.get("utilization", 0) or 0) for x in ls]
        b = [float(x.get("bytes", 0) or 0) for x in ls]
        top = max(ls, key=lambda x: float(x.get("utilization", 0) or 0))
        rows.append(f"<tr><td>{esc(kind)}</td><td>{len(ls)}</td><td>{max(u):.1%} ({esc(top.get('name', top.get('link', '')))})</td>"
                    f"<td>{sum(u) / len(u):.1%}</td><td>{_fmt_bytes(sum(b))}</td></tr>")
    table = ('<table class="links"><tr><th>tier</th><th>links in the top list</th><th>busiest</th><th>mean busy</th>'
             f"<th>bytes</th></tr>{''.join(rows)}</table>")
    # busiest distinct links: collapse links with the same kind and utilisation
    seen, distinct = set(), []
    for ln in links:
        key = (ln.get("kind"), round(float(ln.get("utilization", 0) or 0), 4))
        if key in seen:
            continue
        seen.add(key)
        distinct.append((ln, sum(1 for x in links if (x.get("kind"), round(float(x.get("utilization", 0) or 0), 4)) == key)))
    distinct = distinct[:limit]
    if not all(isinstance(ln.get("utilization"), (int, float)) for ln, _ in distinct):
        return table
    names = [esc(f"{ln.get('name', ln.get('link', i))}" + (f" (+{n - 1} alike)" if n > 1 else "")) for i, (ln, n) in enumerate(distinct)]
    fig = go.Figure(go.Bar(
        y=names, x=[100 * float(ln["utilization"]) for ln, _ in distinct], orientation="h", marker_color="#2F4B7C",
        customdata=[[_fmt_bytes(float(ln.get("bytes", 0) or 0)), esc(ln.get("kind", ""))] for ln, _ in distinct],
        hovertemplate="%{y} (%{customdata[1]})<br>%{x:.1f}% busy over the step<br>%{customdata[0]}<extra></extra>",
    ))
    fig.update_layout(height=max(220, 60 + 22 * len(distinct)), margin=dict(l=200, r=20, t=20, b=40),
                      xaxis=dict(title="% of the step the link is busy", rangemode="tozero"),
                      yaxis=dict(autorange="reversed", type="category"))
    return f'<div class="grid2"><div>{figure_div(fig, "links")}</div><div>{table}</div></div>'


def scenario_line(result: "SimulationResult") -> str:
    sc = result.scenario
    p = sc.parallelism
    setup = result.report.setup or {}
    size = (f" ({model_size_text(setup['parameters'], setup.get('active_parameters', setup['parameters']))})"
            if setup.get("parameters") else "")
    parts = [
        f"{sc.model.name}{size}", f"{sc.cluster.gpus:,} × {sc.cluster.gpu_name}", f"topology {sc.cluster.topology_name}",
        f"TP{p.tp} PP{p.pp}" + (f" VPP{p.vpp}" if p.vpp > 1 else "") + f" DP{sc.dp}" + (f" CP{p.cp}" if p.cp > 1 else "")
        + (f" EP{p.ep}" if p.ep > 1 else "") + f" ZeRO-{p.zero}",
        f"schedule {sc.schedule_file or sc.schedule}",
        f"micro-batch {sc.batch.micro_batch_size}, global batch {sc.batch.global_batch_size}, seq {sc.batch.seq_length}",
        f"recompute {sc.recompute}",
    ]
    return " · ".join(esc(x) for x in parts)


def timeline_sections(result: "SimulationResult", ranks: Sequence[int] | None = None,
                      x_range_ms: tuple[float, float] | None = None, prefix: str = "", detail: bool = True,
                      title: str = "", heading: str = "Timeline") -> list[str]:
    tl = result.timeline
    out = []
    fig, facts = timeline_figure(tl, ranks, title=esc(title) if title else "", x_range_ms=x_range_ms,
                                 report=result.report)
    n_ranks = len(facts["ranks"])
    who = (f"the {n_ranks} representative ranks (one per pipeline rank; every replica runs the same program)"
           if tl.mode == "reduced" else f"{n_ranks} of {len(tl.ranks)} simulated ranks (the first of each pipeline rank)")
    cap = (f"One lane per (rank, stream) of {who}. On a compute lane the upper bars are work, one per action (a "
           f"microbatch's forward or backward on a stage), fainter where it was busy for less of its span; the lower "
           f"bars are why it waited: grey = pipeline bubble (another stage still computing), hatched colours = waiting "
           f"on tp, cp, ep, pp or dp communication (hover: what, and since when). The black line is the critical path. "
           f"{facts['rows']:,} simulated segments drawn as {facts['bars']:,} bars (gaps under "
           f"{facts['gap_s'] * 1e3:.2f} ms merged). Drag to zoom: the op-level view below follows.")
    out.append(panel(heading, figure_div(fig, f"{prefix}timeline"), cap, anchor=f"sec-{prefix}timeline"))
    if detail:
        payload = ops_payload(tl, facts["lanes"], tl.pp_rank_of)
        t0, t1 = payload["window_ms"]
        dfig = detail_figure(tl, facts["lanes"], (t0, t1))
        out.append(panel("Op-level detail", figure_div(dfig, f"{prefix}detail")
                         + f'<script type="application/json" id="cs-ops" data-for="{esc(prefix)}detail" '
                           f'data-overview="{esc(prefix)}timeline">{_json_for_script(payload)}</script>',
                         f"Every op, collective and wait of the same lanes ({payload['n']:,} in all, embedded once), "
                         f"drawn for the window in view: zoom the timeline above, or this view, anywhere in the step "
                         f"(up to {MAX_DETAIL_EVENTS:,} ops at once). It opens at mid-step (steady state).",
                         anchor=f"sec-{prefix}detail"))
    return out


# Full mode in lockstep draws every rank's rows up to this many (~100 MB of frames); beyond, it
# draws the representatives, whose rows every rank of their pipeline rank has.
LOCKSTEP_ROWS_DRAWN = 2_000_000


def build_dashboard_html(result: "SimulationResult", cdn: bool = False, ranks: Sequence[int] | None = None) -> str:
    """The whole dashboard of one simulation as one HTML string (plotly.js inline unless ``cdn``).

    ``ranks`` picks the timeline's ranks (default: one representative per pipeline rank)."""
    from simulator.engine.lockstep import LockstepTimeline

    tl = result.timeline
    if (ranks is None and isinstance(tl, LockstepTimeline)
            and len(tl.representatives.events) * len(tl.ranks) / len(tl.representatives.ranks) > LOCKSTEP_ROWS_DRAWN):
        # Full mode from ranks in lockstep, at scale: every rank of a pipeline rank has its
        # representative's rows, so the views drawn from the representatives are those of every
        # rank, without making tens of millions of rows first (1,024 GPUs, 128 microbatches:
        # 49 M rows, 7 GB). Below the bound every rank is drawn, as full mode always was.
        from dataclasses import replace

        result = replace(result, timeline=tl.representatives)
    rep = result.report
    tl = result.timeline
    sections = [f'<div id="sec-cards">{summary_cards(rep)}</div>']
    sections.append(panel("Findings: what to change", findings_html(rep),
                          "Each finding is measured on this simulation; suggested changes carry predicted numbers, "
                          "simulated where it was cheap (it says so).", anchor="sec-findings"))
    if rep.step_breakdown_s:
        sections.append(panel("Where the step goes", '<div class="grid2"><div>'
                              + figure_div(step_breakdown_figure([("", rep)]), "breakdown-fig") + "</div><div>"
                              + breakdown_table(rep) + "</div></div>" + critical_path_html(rep),
                              "The step split into compute, the device waiting for the host to launch kernels, exposed "
                              "communication per dimension, pipeline bubble, "
                              "stage imbalance and the optimizer (mean over pipeline ranks; the parts sum to the step), "
                              "and the critical path by cause.", anchor="sec-breakdown"))
    sections += timeline_sections(result, ranks)
    sim_ranks = len(tl.ranks)
    lock = rep.lockstep if tl.mode == "reduced" and rep.mode == "full" else None
    hm_cap = ("Share of each time bin that a rank's stream is busy. "
              + (f"Full mode, ranks in lockstep: each row is one pipeline rank, whose "
                 f"{lock['ranks'] // max(1, lock['simulated_ranks']):,} ranks all have these rows (drawn from one "
                 f"rank each beyond {LOCKSTEP_ROWS_DRAWN:,} rows)." if lock else
                 "Reduced mode: each row is one pipeline rank and stands for all its replicas."
                 if tl.mode == "reduced" else
                 f"Full mode: {sim_ranks:,} ranks" + (", consecutive ranks averaged per row" if sim_ranks > MAX_HEATMAP_ROWS else "")
                 + ".") + " The buttons switch between compute and each communication dimension.")
    sections.append(panel("Utilization heatmap", figure_div(heatmap_figure(tl, rep.gpus), "heatmap"), hm_cap,
                          anchor="sec-heatmap"))
    sections.append('<div class="grid2" id="sec-stages">'
                    + panel("Per-stage breakdown", figure_div(stage_breakdown_figure([("", rep)]), "stages"),
                            "Per pipeline rank: compute, communication the compute stream waited on, bubble, "
                            "imbalance and optimizer (each row sums to the step).")
                    + panel("Memory", figure_div(memory_figure([("", rep)]), "memory"),
                            "Peak memory per GPU of each pipeline rank against the usable HBM line.")
                    + "</div>")
    mem_t = memory_time_figure(result)
    comm_t = comm_time_figure(result)
    if mem_t is not None or comm_t is not None:
        sections.append('<div class="grid2" id="sec-over-time">'
                        + (panel("Memory over the step", figure_div(mem_t, "memory-time"),
                                 "Per pipeline rank: model state and buffers, plus the activations of the microbatches "
                                 "in flight (taken at a forward's start, freed at its backward's end), against usable HBM.")
                           if mem_t is not None else "")
                        + (panel("Communication over the step", figure_div(comm_t, "comm-time"),
                                 "Bytes per second one GPU puts on the wire, per dimension, with the tier its groups "
                                 "use; from the timeline's communication rows (bus bytes spread over each row).")
                           if comm_t is not None else "")
                        + "</div>")
    sections.append(panel("Busiest network links", links_html(rep), anchor="sec-links"))
    other_notes = [n for n in rep.notes if n not in {f.get("message") for f in rep.findings}]
    if other_notes:
        sections.append(panel("Notes", '<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in other_notes) + "</ul>"))
    if getattr(rep, "whatif", None):
        from simulator.whatif.summary import whatif_lines

        sections.append(panel("What-if: against the clean step, who waits on whom, distribution, goodput",
                              "<pre>" + esc("\n".join(whatif_lines(rep.whatif))) + "</pre>", anchor="sec-whatif"))
    title = f"ClusterSim · {esc(rep.name)}"
    return page(title, scenario_line(result), "".join(sections), cdn)


__all__ = ["build_dashboard_html", "timeline_figure", "heatmap_figure", "merge_segments", "utilization_matrix",
           "summary_cards", "page", "panel", "figure_div", "esc", "ops_payload", "memory_over_time"]
