"""Plotly dashboard of one simulation (a first, plain timeline; see the dashboards work)."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from simulator.simulate import SimulationResult

COLORS = {"F": "#4C78A8", "B": "#F58518", "I": "#E45756", "W": "#72B7B2", "FB": "#B279A2", "opt": "#9D755D",
          "tp": "#54A24B", "cp": "#EECA3B", "ep": "#FF9DA6", "pp": "#BAB0AC", "dp": "#79706E"}


def build_dashboard_html(result: SimulationResult, cdn: bool = False) -> str:
    ev = result.timeline.events
    fig = go.Figure()
    lanes = []
    for (rank, stream), _ in ev.groupby(["rank", "stream"], sort=True):
        lanes.append(f"rank {rank} {stream}")
    for kind, g in ev.groupby("kind", sort=True):
        lane = "rank " + g["rank"].astype(str) + " " + g["stream"]
        fig.add_trace(go.Bar(
            y=lane, x=(g["end_s"] - g["start_s"]) * 1e3, base=g["start_s"] * 1e3, orientation="h",
            name=str(kind), marker_color=COLORS.get(str(kind), "#888"),
            hovertext=g["name"].map(html.escape), hoverinfo="text+x",
        ))
    fig.update_layout(barmode="overlay", title=html.escape(result.report.name), xaxis_title="time (ms)",
                      yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes))},
                      height=max(400, 18 * len(lanes)))
    return fig.to_html(include_plotlyjs="cdn" if cdn else True, full_html=True)
