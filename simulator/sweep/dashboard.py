"""The sweep dashboard: one HTML page (Plotly).

Sections: summary and a link to the winner's timeline dashboard; the top-k table; Pareto fronts
of throughput against GPUs and against peak memory (simulated points, with the estimates of the
whole feasible space behind them); the whole space as a heatmap of the best estimate over two
axes and as parallel coordinates; the estimate against the simulation; why points were pruned.

Every string that comes from a space file or a scenario (names, axis values, prune reasons,
the link) is HTML-escaped before it reaches Plotly or the page.
"""

from __future__ import annotations

import html
import math
from typing import Any

import plotly.graph_objects as go

from simulator.sweep.runner import SweepOutcome

_E = html.escape
LABEL = {"tokens_per_s": "tokens/s", "tokens_per_s_per_gpu": "tokens/s per GPU", "mfu": "MFU", "step_time_s": "step time (s)"}


def _fmt(v: Any) -> str:
    """Numbers as people write them: thousands separators, no scientific notation."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == int(v) and abs(v) >= 1:
            return f"{int(v):,}"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.4g}" if abs(v) >= 1e-3 else f"{v:.6f}".rstrip("0")
    return str(v)


def _reason(text: str) -> str:
    """A prune reason for display (one real example of its group): wrapped so the labels stay readable."""
    words, lines, line = _E(text).split(" "), [], ""
    for w in words:
        if len(line) + len(w) > 60 and line:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    lines.append(line)
    return "<br>".join(lines)


def _desc(point: dict[str, Any]) -> str:
    return _E(" ".join(f"{k}={_fmt(v)}" for k, v in point.items()))


def pareto(points: list[tuple[float, float]], maximize_y: bool = True) -> list[int]:
    """Indices of the points no other point beats: lower x and better y (ties kept once)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1] if maximize_y else points[i][1]))
    front, best = [], None
    for i in order:
        y = points[i][1]
        if best is None or (y > best if maximize_y else y < best):
            front.append(i)
            best = y
    return front


def _pareto_fig(out: SweepOutcome, xkey: str, xlabel: str, max_bg: int) -> go.Figure:
    obj, maxi = out.spec.objective, out.spec.maximize
    fig = go.Figure()
    bg = out.evaluation.candidates[:max_bg]
    if bg:
        fig.add_trace(go.Scattergl(
            x=[getattr(c.estimate, xkey) for c in bg], y=[c.score for c in bg], mode="markers",
            name="estimate (feasible space)", marker={"color": "#BBBBBB", "size": 5, "opacity": 0.5},
            hovertext=[_desc(c.point) for c in bg], hoverinfo="text+x+y",
        ))
    sim = out.simulated
    if sim:
        xs = [r["report"][xkey] for r in sim]
        ys = [r["score"] for r in sim]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="markers", name="simulated", marker={"color": "#4C78A8", "size": 8},
            hovertext=[_desc(r["point"]) for r in sim], hoverinfo="text+x+y",
        ))
        front = pareto(list(zip(xs, ys)), maximize_y=maxi)
        fig.add_trace(go.Scatter(
            x=[xs[i] for i in front], y=[ys[i] for i in front], mode="lines+markers", name="Pareto front",
            line={"color": "#E45756", "shape": "hv"}, marker={"size": 10, "symbol": "diamond"},
            hovertext=[_desc(sim[i]["point"]) for i in front], hoverinfo="text+x+y",
        ))
    xs_all = {getattr(c.estimate, xkey) for c in bg} | {r["report"][xkey] for r in sim}
    fig.update_layout(title=_E(f"{LABEL.get(obj, obj)} against {xlabel}"), xaxis_title=_E(xlabel),
                      yaxis_title=_E(LABEL.get(obj, obj)), height=450,
                      yaxis=dict(tickformat=",.4~r" if obj == "mfu" else ",.0f" if obj.startswith("tokens") else ",.4~r"),
                      xaxis=dict(tickformat=",.0f" if xkey == "gpus" else ",.1f"))
    if xkey == "gpus" and len(xs_all) <= 12:
        # a handful of GPU counts: one tick per count, not a continuous scale around one value
        fig.update_xaxes(tickmode="array", tickvals=sorted(xs_all), ticktext=[f"{int(v):,}" for v in sorted(xs_all)])
    return fig


def _axis_values(out: SweepOutcome) -> dict[str, list[Any]]:
    from simulator.sweep.space import SHORT

    return {SHORT.get(k, k): v for k, v in out.spec.axes.items() if len(v) > 1}


def _heatmap_fig(out: SweepOutcome) -> go.Figure | None:
    axes = _axis_values(out)
    if not axes or not out.evaluation.candidates:
        return None
    names = sorted(axes, key=lambda a: -len(axes[a]))[:2]
    maxi = out.spec.maximize
    if len(names) == 1:
        names = names + [names[0]]
    xa, ya = names[1], names[0]
    xv, yv = axes[xa], axes[ya]
    best: dict[tuple[str, str], float] = {}
    for c in out.evaluation.candidates:
        key = (repr(c.point.get(xa)), repr(c.point.get(ya)))
        v = c.score
        if key not in best or (v > best[key] if maxi else v < best[key]):
            best[key] = v
    z = [[best.get((repr(x), repr(y)), math.nan) for x in xv] for y in yv]
    fig = go.Figure(go.Heatmap(
        z=z, x=[_E(_fmt(x)) for x in xv], y=[_E(_fmt(y)) for y in yv], colorscale="Viridis",
        colorbar={"title": _E(LABEL.get(out.spec.objective, out.spec.objective))},
        hovertemplate=f"{_E(xa)}=%{{x}}<br>{_E(ya)}=%{{y}}<br>best estimate %{{z:.4g}}<extra></extra>",
    ))
    fig.update_xaxes(type="category", title=_E(xa))
    fig.update_yaxes(type="category", title=_E(ya))
    fig.update_layout(title=_E(f"Best estimated {LABEL.get(out.spec.objective, out.spec.objective)} over {ya} x {xa} "
                               "(blank: every point pruned)"), height=450)
    return fig


def _parcoords_fig(out: SweepOutcome, max_points: int) -> go.Figure | None:
    axes = _axis_values(out)
    cands = out.evaluation.candidates[:max_points]
    if not axes or not cands:
        return None
    dims = []
    for name, vals in axes.items():
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
        if numeric:
            # parallel degrees and sizes are discrete choices: ticks at the values, not a continuum
            dims.append({"label": _E(name), "values": [c.point.get(name) for c in cands],
                         "tickvals": sorted(vals), "ticktext": [_E(_fmt(v)) for v in sorted(vals)]})
        else:
            idx = {repr(v): i for i, v in enumerate(vals)}
            dims.append({"label": _E(name), "values": [idx.get(repr(c.point.get(name)), 0) for c in cands],
                         "tickvals": list(range(len(vals))), "ticktext": [_E(_fmt(v)) for v in vals]})
    obj = out.spec.objective
    dims.append({"label": _E(f"estimate {LABEL.get(obj, obj)}"), "values": [c.score for c in cands]})
    dims.append({"label": "memory GiB", "values": [c.estimate.peak_memory_gib for c in cands]})
    fig = go.Figure(go.Parcoords(line={"color": [c.score for c in cands], "colorscale": "Viridis", "showscale": True},
                                 dimensions=dims, labelangle=-20, labelside="top",
                                 tickfont={"size": 10}, rangefont={"size": 9}))
    fig.update_layout(title=_E(f"Feasible space: the {len(cands):,} best estimates of {len(out.evaluation.candidates):,}"),
                      height=520, margin={"t": 120, "l": 60, "r": 60})
    return fig


def _agreement_fig(out: SweepOutcome) -> go.Figure | None:
    sim = out.simulated
    if len(sim) < 2:
        return None
    obj = LABEL.get(out.spec.objective, out.spec.objective)
    xs = [r["estimate_score"] for r in sim]
    ys = [r["score"] for r in sim]
    lo, hi = min(xs + ys), max(xs + ys)
    fig = go.Figure([
        go.Scatter(x=xs, y=ys, mode="markers", name="points", hovertext=[_desc(r["point"]) for r in sim], hoverinfo="text+x+y"),
        go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x", line={"dash": "dot", "color": "#888"}),
    ])
    a = out.agreement
    fig.update_layout(title=_E(f"Estimate vs simulation ({obj}): Spearman {a.get('spearman', math.nan):.3f}, "
                               f"Kendall {a.get('kendall', math.nan):.3f}"),
                      xaxis_title=_E(f"estimated {obj}"), yaxis_title=_E(f"simulated {obj}"), height=450)
    return fig


def _pruned_fig(out: SweepOutcome) -> go.Figure | None:
    from simulator.sweep.runner import pruned_summary

    pr = pruned_summary(out.evaluation, 15)
    if not pr:
        return None
    labels = [_reason(r) for r, _ in pr][::-1]
    lines = max(lb.count("<br>") + 1 for lb in labels)
    fig = go.Figure(go.Bar(x=[n for _, n in pr][::-1], y=labels, orientation="h", marker_color="#F58518",
                           hovertemplate="%{y}<br>%{x:,} points<extra></extra>"))
    fig.update_layout(title="Pruned before simulation, by reason (one example each; the numbers differ between points)",
                      height=120 + 20 * lines * len(pr), xaxis=dict(title="points", tickformat=",d"),
                      yaxis=dict(automargin=True, type="category", tickfont={"size": 11}), margin={"l": 20})
    return fig


def _table_html(out: SweepOutcome, k: int) -> str:
    rows = out.simulated[:k]
    if not rows:
        return "<p>No point was simulated.</p>"
    axes = list(rows[0]["point"])
    head = "".join(f"<th>{_E(a)}</th>" for a in axes)
    body = []
    for i, r in enumerate(rows):
        rep = r["report"]
        cells = "".join(f"<td>{_E(_fmt(r['point'][a]))}</td>" for a in axes)
        body.append(
            f"<tr><td>{i + 1}</td>{cells}<td>{rep['tokens_per_s']:,.0f}</td><td>{rep['step_time_s']:.3f}</td>"
            f"<td>{rep['mfu']:.1%}</td><td>{rep['peak_memory_gib']:.1f}</td><td>{_E(_fmt(r['estimate_score']))}</td></tr>"
        )
    return ("<table><thead><tr><th>#</th>" + head + "<th>tokens/s</th><th>step s</th><th>MFU</th><th>memory GiB</th>"
            f"<th>estimate ({_E(out.spec.objective)})</th></tr></thead><tbody>" + "".join(body) + "</tbody></table>")


def build_sweep_dashboard_html(out: SweepOutcome, cdn: bool = False, timeline_href: str | None = None,
                               max_points: int = 3000) -> str:
    ev = out.evaluation
    a = out.agreement
    gpu_counts = {c.estimate.gpus for c in ev.candidates[:max_points]} | {r["report"]["gpus"] for r in out.simulated}
    figs = [f for f in (
        # one GPU count for every point: a chart against GPUs would be a single column
        _pareto_fig(out, "gpus", "GPUs", max_points) if len(gpu_counts) > 1 else None,
        _pareto_fig(out, "peak_memory_gib", "peak memory per GPU (GiB)", max_points),
        _heatmap_fig(out),
        _parcoords_fig(out, max_points),
        _agreement_fig(out),
        _pruned_fig(out),
    ) if f is not None]
    from simulator.report.dashboard import figure_div, page

    parts = [figure_div(f, f"sweep-fig-{i}") for i, f in enumerate(figs)]
    if len(gpu_counts) == 1:
        parts.insert(0, f"<p>Every point uses {next(iter(gpu_counts)):,} GPUs: throughput is shown against peak memory only.</p>")
    best = out.best
    link = ""
    if best is not None:
        desc = _desc(best["point"])
        if timeline_href:
            link = f'<p>Winner: {desc} &mdash; <a href="{_E(timeline_href, quote=True)}">timeline dashboard</a></p>'
        else:
            link = f"<p>Winner: {desc}</p>"
    agree = ""
    if a.get("n", 0) >= 2:
        agree = (f"<p>Estimate vs simulation over {a['n']} simulated points: Spearman {a['spearman']:.3f}, "
                 f"Kendall &tau;<sub>b</sub> {a['kendall']:.3f}, top-1 {'agrees' if a.get('top1_agree') else 'differs'}, "
                 f"median |error| {a.get('median_abs_rel_error', math.nan):.1%}.</p>")
    summary = (f"<p>{ev.total:,} points; {sum(ev.pruned.values()):,} pruned; {len(ev.candidates):,} feasible, "
               f"estimated at {ev.rate:,.0f} points/s; {len(out.simulated):,} simulated "
               f"({out.newly_simulated:,} now, {out.reused:,} from the store); objective "
               f"{_E(out.spec.objective)} ({'max' if out.spec.maximize else 'min'}).</p>")
    style = ("<style>table.top{border-collapse:collapse;font-size:13px;background:#fff}"
             "table.top td,table.top th{border:1px solid #ccc;padding:3px 8px;text-align:right;} table.top th{background:#f4f4f4;}"
             "</style>")
    body = (style + '<section class="panel">' + summary + agree + link + "<h2>Top configurations (simulated)</h2>"
            + _table_html(out, out.spec.top_k).replace("<table>", '<table class="top">', 1) + "</section>"
            + "".join(f'<section class="panel">{p}</section>' for p in parts))
    return page(_E(f"Sweep {out.spec.name}"), _E(f"objective {out.spec.objective}"), body, cdn)
