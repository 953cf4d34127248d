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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from simulator.vocabulary import DIM_NAMES, STREAM_NAMES

if TYPE_CHECKING:  # the report layer only reads results; importing simulate here would be circular
    from simulator.engine.core import Timeline
    from simulator.report.metrics import Report
    from simulator.simulate import SimulationResult

KIND_COLORS = {
    "F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#72B7B2", "FB": "#B279A2", "opt": "#9D755D",
    "tp": "#54A24B", "cp": "#EECA3B", "ep": "#FF9DA6", "pp": "#8E6BBF", "dp": "#2F4B7C",
}
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
MAX_TIMELINE_BARS = 20_000
MAX_DETAIL_EVENTS = 4_000
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
    stream = ev["stream"].to_numpy()
    kind = ev["kind"].to_numpy()
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
    g = pd.DataFrame({
        "gid": gid, "rank": rank, "stream": stream, "kind": kind, "start_s": start, "end_s": end,
        "busy_s": end - start, "name": ev["name"].to_numpy(), "microbatch": mb, "stage": stage,
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
    return out.reset_index(drop=True)


def timeline_bars(ev: pd.DataFrame, step_s: float, max_bars: int = MAX_TIMELINE_BARS) -> tuple[pd.DataFrame, float]:
    """Merged bars within the bar budget, and the merge gap that achieved it."""
    gap = max(step_s, 1e-9) / MERGE_PIXELS
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


def _bar_traces(bars: pd.DataFrame, lane_idx: dict[tuple[int, str], int], pp_of: dict[int, int],
                opacity_by_fill: bool, legendgroup_prefix: str = "", showlegend: bool = True) -> list[go.Bar]:
    traces = []
    kinds = [k for k in KIND_ORDER if k in set(bars["kind"])] + sorted(set(bars["kind"]) - set(KIND_ORDER))
    for kind in kinds:
        b = bars[bars["kind"] == kind]
        y = np.fromiter((lane_idx[(r, s)] for r, s in zip(b["rank"].tolist(), b["stream"].tolist())), dtype=np.int32,
                        count=len(b))
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
            marker=marker, customdata=cd, hovertemplate=HOVER_TEMPLATE, width=0.8,
        ))
    return traces


def timeline_figure(tl: "Timeline", ranks: Sequence[int] | None = None, title: str = "",
                    x_range_ms: tuple[float, float] | None = None, height_per_lane: int = 15) -> tuple[go.Figure, dict]:
    """Merged-bar timeline of ``ranks`` (the representative ranks by default); returns the figure
    and facts for the caption (bars drawn, rows merged, merge gap)."""
    ranks = list(ranks) if ranks is not None else representative_ranks(tl)
    ev = tl.events[tl.events["rank"].isin(ranks)]
    lanes = lane_order(ev, ranks)
    lane_idx = {ln: i for i, ln in enumerate(lanes)}
    step = tl.step_time_s
    bars, gap = timeline_bars(ev, step)
    idle = idle_gaps(bars, lanes, step, gap)
    fig = go.Figure()
    if len(idle):
        y = [lane_idx[(r, s)] for r, s in zip(idle["rank"], idle["stream"])]
        dur = (idle["end_s"] - idle["start_s"]).to_numpy()
        fig.add_trace(go.Bar(
            x=np.round(dur * 1e3, 4), base=np.round(idle["start_s"].to_numpy() * 1e3, 4), y=y, orientation="h",
            name="idle (bubble / waiting)", marker=dict(color=IDLE_COLOR, line=dict(width=0)), width=0.8,
            customdata=np.round(dur * 1e3, 3),
            hovertemplate="<b>idle</b> %{customdata} ms<br>%{base:.3f} ms<extra>compute stream idle</extra>",
        ))
    for t in _bar_traces(bars, lane_idx, tl.pp_rank_of, opacity_by_fill=True):
        fig.add_trace(t)
    fig.update_layout(
        title=dict(text=title, x=0.01, font=dict(size=13)) if title else None, barmode="overlay", bargap=0.15,
        height=max(300, 90 + height_per_lane * len(lanes)),
        xaxis=dict(title="time (ms)", range=list(x_range_ms) if x_range_ms else [0, step * 1e3], showgrid=True,
                   gridcolor="#eee", zeroline=False),
        yaxis=_lane_axis(lanes, tl.pp_rank_of), shapes=_rank_separators(lanes),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0, font=dict(size=11)),
        margin=dict(l=150, r=20, t=60 if title else 40, b=45), plot_bgcolor="white", hoverlabel=dict(align="left"),
    )
    return fig, {"bars": len(bars) + len(idle), "rows": len(ev), "gap_s": gap, "lanes": len(lanes), "ranks": ranks}


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


def detail_figure(tl: "Timeline", ranks: Sequence[int]) -> tuple[go.Figure, tuple[float, float]]:
    ev = tl.events[tl.events["rank"].isin(ranks)]
    t0, t1 = detail_window(ev, tl.step_time_s)
    win = ev[(ev["end_s"] > t0) & (ev["start_s"] < t1)]
    lanes = lane_order(ev, ranks)
    lane_idx = {ln: i for i, ln in enumerate(lanes)}
    # every op on its own bar (merge_segments would join touching ops)
    one = pd.DataFrame({
        "rank": win["rank"].to_numpy(), "stream": win["stream"].to_numpy(), "kind": win["kind"].to_numpy(),
        "start_s": win["start_s"].to_numpy(), "end_s": win["end_s"].to_numpy(),
        "busy_s": (win["end_s"] - win["start_s"]).to_numpy(), "n": 1, "first": win["name"].to_numpy(),
        "last": win["name"].to_numpy(), "layer_min": win["layer"].to_numpy(), "layer_max": win["layer"].to_numpy(),
        "microbatch": win["microbatch"].to_numpy(), "stage": win["stage"].to_numpy(), "bytes": win["bytes"].to_numpy(),
    })
    fig = go.Figure(_bar_traces(one, lane_idx, tl.pp_rank_of, opacity_by_fill=False))
    fig.update_layout(
        barmode="overlay", height=max(300, 90 + 15 * len(lanes)),
        xaxis=dict(title="time (ms)", range=[t0 * 1e3, t1 * 1e3], showgrid=True, gridcolor="#eee", zeroline=False),
        yaxis=_lane_axis(lanes, tl.pp_rank_of), shapes=_rank_separators(lanes),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0, font=dict(size=11)),
        margin=dict(l=150, r=20, t=40, b=45), plot_bgcolor="white", hoverlabel=dict(align="left"),
    )
    return fig, (t0, t1)


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
    fig = go.Figure()
    for i, (label, sub) in enumerate(layers):
        z = utilization_matrix(sub, rows.row_of_rank, n_rows, rows.weight, step, bins)
        fig.add_trace(go.Heatmap(
            z=np.round(z * 100).astype(np.uint8), x=np.round(centers, 3), y=list(range(n_rows)),
            zmin=0, zmax=100, colorscale="Viridis", visible=i == 0, name=esc(label),
            colorbar=dict(title=dict(text="% busy"), thickness=12),
            customdata=np.array([esc(lb) for lb in rows.labels], dtype=object)[:, None].repeat(1, axis=1),
            hovertemplate="%{customdata[0]}<br>t ≈ %{x:.1f} ms<br>busy %{z}%<extra>" + esc(label) + "</extra>",
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


def stage_breakdown_figure(reports: Sequence[tuple[str, "Report"]]) -> go.Figure:
    """Per pipeline rank: compute, exposed communication per dimension and bubble, in seconds."""
    fig = go.Figure()
    parts = [("compute", "#4C78A8")] + [(f"exposed {d}", KIND_COLORS[d]) for d in DIMS] + [("bubble", IDLE_COLOR)]
    multi = len(reports) > 1
    for si, (label, rep) in enumerate(reports):
        rows = rep.per_pp_rank
        y = [f"{esc(label)} pp {r['pp_rank']}" if multi else f"pp {r['pp_rank']}" for r in rows]
        values = {"compute": [r["compute_s"] for r in rows], "bubble": [r["bubble_fraction"] * rep.step_time_s for r in rows]}
        for d in DIMS:
            values[f"exposed {d}"] = [r["exposed_comm_s"].get(d, 0.0) for r in rows]
        for name, color in parts:
            v = values[name]
            if not any(x > 0 for x in v):
                continue
            fig.add_trace(go.Bar(
                y=y, x=v, orientation="h", name=name, marker_color=color, legendgroup=name, showlegend=si == 0,
                hovertemplate="%{y}: " + name + " %{x:.3f} s<extra></extra>",
            ))
    n = sum(len(r.per_pp_rank) for _, r in reports)
    fig.update_layout(barmode="stack", height=max(300, 140 + 22 * n), xaxis_title="seconds",
                      yaxis=dict(autorange="reversed"), margin=dict(l=150 if multi else 60, r=20, t=30, b=45),
                      legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0))
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
.notes li{font-size:13px}
"""

# Installed before plotly.js so a failing script is recorded in the DOM (the browser test reads it).
ERROR_HOOK = ("<script>window.addEventListener('error',function(e){var d=document.documentElement;"
              "d.setAttribute('data-js-errors',(parseInt(d.getAttribute('data-js-errors')||'0')+1)+'');"
              "d.setAttribute('data-js-error-last',String(e.message));});</script>")


def plotly_script_tag(cdn: bool) -> str:
    if cdn:
        tag = pio.to_html(go.Figure(), include_plotlyjs="cdn", full_html=False)
        start = tag.find("<script charset")
        if start < 0:
            start = tag.find('<script src=')
        end = tag.find("</script>", start)
        if start >= 0 and end >= 0:
            return tag[start:end + len("</script>")]
        return f'<script charset="utf-8" src="{CDN_FALLBACK}"></script>'
    from plotly.offline import get_plotlyjs

    return f'<script type="text/javascript">{get_plotlyjs()}</script>'


PLOT_CONFIG = {"displaylogo": False, "responsive": True, "scrollZoom": False,
               "toImageButtonOptions": {"format": "png", "scale": 2}}


def figure_div(fig: go.Figure, div_id: str) -> str:
    return pio.to_html(fig, include_plotlyjs=False, full_html=False, config=PLOT_CONFIG, div_id=div_id,
                       validate=False)


def panel(title: str, body: str, caption: str = "", anchor: str = "") -> str:
    cap = f'<p class="caption">{caption}</p>' if caption else ""
    ident = f' id="{esc(anchor)}"' if anchor else ""
    return f'<section class="panel"{ident}><h2>{title}</h2>{cap}{body}</section>'


def page(title: str, subtitle: str, body: str, cdn: bool) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{title}</title>"
        f"<style>{CSS}</style>{ERROR_HOOK}{plotly_script_tag(cdn)}</head><body>"
        f"<header><h1>{title}</h1><div class=\"sub\">{subtitle}</div></header><main>{body}</main></body></html>\n"
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
    cards = [
        card("step time", f"{step:.3f} s", f"{rep.num_microbatches} microbatches"),
        card("MFU", f"{rep.mfu:.1%}", f"{rep.model_tflops_per_gpu:.0f} model TFLOP/s per GPU"),
        card("tokens / s", f"{rep.tokens_per_s:,.0f}", f"{rep.tokens_per_s_per_gpu:,.0f} per GPU"),
        card("pipeline bubble", f"{rep.bubble_fraction:.1%}", f"worst stage {rep.bubble_fraction_worst:.1%}"),
        f'<div class="card"><div class="k">exposed communication</div><div class="v">{total_exposed:.3f} s</div>'
        f"<table>{exposed_rows}</table></div>",
        f'<div class="card{"" if rep.fits_in_memory else " bad"}"><div class="k">peak memory</div>'
        f'<div class="v">{rep.peak_memory_gib:.1f} GiB</div><div class="s">of {rep.memory_capacity_gib:.1f} GiB usable'
        f' · {"fits" if rep.fits_in_memory else "DOES NOT FIT"}</div><table>{mem_rows}{more}</table></div>',
        card("simulated", f"{rep.sim_wall_s:.2f} s", f"{rep.events:,} events · {esc(rep.mode)} mode · {rep.gpus:,} GPUs"),
    ]
    return '<div class="cards">' + "".join(cards) + "</div>"


def links_html(rep: "Report", limit: int = 10) -> str:
    links = rep.busiest_links[:limit]
    if not links:
        return '<p class="caption">alpha-beta network: no per-link data</p>'
    keys: list[str] = []
    for ln in links:
        for k in ln:
            if k not in keys:
                keys.append(k)

    def cell(k: str, v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return esc(v)
        if k == "utilization":
            return f"{v:.1%}"
        if k == "bytes" or k.endswith("_bytes"):
            return _fmt_bytes(v)
        return f"{v:,.4g}" if isinstance(v, float) else f"{v:,}"

    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{cell(k, ln.get(k, ''))}</td>" for k in keys) + "</tr>" for ln in links)
    table = f'<table class="links"><tr>{head}</tr>{body}</table>'
    if not all(isinstance(ln.get("utilization"), (int, float)) for ln in links):
        return table
    names = [esc(ln.get("name", ln.get("link", i))) for i, ln in enumerate(links)]
    fig = go.Figure(go.Bar(
        y=names, x=[100 * float(ln["utilization"]) for ln in links], orientation="h", marker_color="#2F4B7C",
        customdata=[[_fmt_bytes(float(ln.get("bytes", 0) or 0)), esc(ln.get("kind", ""))] for ln in links],
        hovertemplate="%{y} (%{customdata[1]})<br>%{x:.1f}% busy over the step<br>%{customdata[0]}<extra></extra>",
    ))
    fig.update_layout(height=max(220, 60 + 22 * len(links)), margin=dict(l=160, r=20, t=20, b=40),
                      xaxis=dict(title="% of the step the link is busy", rangemode="tozero"),
                      yaxis=dict(autorange="reversed", type="category"))
    return f'<div class="grid2"><div>{figure_div(fig, "links")}</div><div>{table}</div></div>'


def scenario_line(result: "SimulationResult") -> str:
    sc = result.scenario
    p = sc.parallelism
    parts = [
        f"{sc.model.name}", f"{sc.cluster.gpus:,} × {sc.cluster.gpu}", f"topology {sc.cluster.topology}",
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
    fig, facts = timeline_figure(tl, ranks, title=esc(title) if title else "", x_range_ms=x_range_ms)
    n_ranks = len(facts["ranks"])
    who = (f"the {n_ranks} representative ranks (one per pipeline rank; every replica runs the same program)"
           if tl.mode == "reduced" else f"{n_ranks} of {len(tl.ranks)} simulated ranks (the first of each pipeline rank)")
    cap = (f"One lane per (rank, stream) of {who}. Each bar is one action (a microbatch's forward or backward on a "
           f"stage) on that lane: {facts['rows']:,} simulated segments drawn as {facts['bars']:,} bars, gaps under "
           f"{facts['gap_s'] * 1e3:.2f} ms merged; fainter bars were busy for less of their span. Pink = idle compute "
           f"(pipeline bubble or waiting on communication). Drag to zoom, double-click to reset.")
    out.append(panel(heading, figure_div(fig, f"{prefix}timeline"), cap, anchor=f"sec-{prefix}timeline"))
    if detail:
        dfig, (t0, t1) = detail_figure(tl, facts["ranks"])
        out.append(panel(f"Op-level detail, {t0 * 1e3:,.1f}–{t1 * 1e3:,.1f} ms", figure_div(dfig, f"{prefix}detail"),
                         "Every op and collective of the same lanes in a window at mid-step (steady state), "
                         "unmerged; hover for op, layer, microbatch, stage, duration and bytes.",
                         anchor=f"sec-{prefix}detail"))
    return out


def build_dashboard_html(result: "SimulationResult", cdn: bool = False, ranks: Sequence[int] | None = None) -> str:
    """The whole dashboard of one simulation as one HTML string (plotly.js inline unless ``cdn``).

    ``ranks`` picks the timeline's ranks (default: one representative per pipeline rank)."""
    rep = result.report
    tl = result.timeline
    sections = [f'<div id="sec-cards">{summary_cards(rep)}</div>']
    sections += timeline_sections(result, ranks)
    sim_ranks = len(tl.ranks)
    hm_cap = ("Share of each time bin that a rank's stream is busy. "
              + ("Reduced mode: each row is one pipeline rank and stands for all its replicas."
                 if tl.mode == "reduced" else
                 f"Full mode: {sim_ranks:,} ranks" + (", consecutive ranks averaged per row" if sim_ranks > MAX_HEATMAP_ROWS else "")
                 + ".") + " The buttons switch between compute and each communication dimension.")
    sections.append(panel("Utilization heatmap", figure_div(heatmap_figure(tl, rep.gpus), "heatmap"), hm_cap,
                          anchor="sec-heatmap"))
    sections.append('<div class="grid2" id="sec-stages">'
                    + panel("Per-stage breakdown", figure_div(stage_breakdown_figure([("", rep)]), "stages"),
                            "Compute, communication the compute stream waited on, and bubble, per pipeline rank.")
                    + panel("Memory", figure_div(memory_figure([("", rep)]), "memory"),
                            "Peak memory per GPU of each pipeline rank against the usable HBM line.")
                    + "</div>")
    sections.append(panel("Busiest network links", links_html(rep), anchor="sec-links"))
    if rep.notes:
        sections.append(panel("Notes", '<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in rep.notes) + "</ul>"))
    if getattr(rep, "whatif", None):
        from simulator.whatif.summary import whatif_lines

        sections.append(panel("What-if: against the clean step, who waits on whom, distribution, goodput",
                              "<pre>" + esc("\n".join(whatif_lines(rep.whatif))) + "</pre>", anchor="sec-whatif"))
    title = f"ClusterSim · {esc(rep.name)}"
    return page(title, scenario_line(result), "".join(sections), cdn)


__all__ = ["build_dashboard_html", "timeline_figure", "heatmap_figure", "merge_segments", "utilization_matrix",
           "summary_cards", "page", "panel", "figure_div", "esc"]

