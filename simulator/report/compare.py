"""`clustersim compare A B`: two scenarios (or two saved reports) on one page, side by side.

A and B are scenario YAMLs (simulated here) or report JSONs written by
``clustersim simulate --report``. The page leads with a metric table whose change column is
coloured by whether B is better or worse than A, then the scenario fields that differ, then the
two summaries, per-stage breakdowns and memory side by side, and, when both sides were simulated,
both timelines in one figure on one shared time axis, and the step's change per component (also
printed in the terminal as a table).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from simulator.errors import UserError, check_document_kind, read_user_text
from simulator.vocabulary import DIM_NAMES
from simulator.report.analysis import step_delta
from simulator.report.dashboard import (
    esc, figure_div, findings_html, memory_figure, page, panel, scenario_line,
    stage_breakdown_figure, step_breakdown_figure, summary_cards, timeline_figure,
)

if TYPE_CHECKING:
    from simulator.report.metrics import Report
    from simulator.simulate import SimulationResult


class CompareMode(str, Enum):
    reduced = "reduced"
    full = "full"


@dataclass
class Side:
    label: str  # "A" or "B"
    path: Path
    report: "Report"
    result: "SimulationResult | None" = None  # None when loaded from a report JSON

    @property
    def title(self) -> str:
        return f"{self.label}: {self.report.name}"


# (label, getter, format, direction): direction +1 = higher is better, -1 = lower is better, 0 = neutral
METRICS: list[tuple[str, Any, str, int]] = [
    ("step time", lambda r: r.step_time_s, "{:.3f} s", -1),
    ("tokens / s", lambda r: r.tokens_per_s, "{:,.0f}", +1),
    ("tokens / s per GPU", lambda r: r.tokens_per_s_per_gpu, "{:,.0f}", +1),
    ("MFU", lambda r: r.mfu, "{:.1%}", +1),
    ("model TFLOP/s per GPU", lambda r: r.model_tflops_per_gpu, "{:.1f}", +1),
    # A share of the step can fall while the idle time itself grows (a longer step): both shown.
    ("pipeline idle, share of step", lambda r: r.bubble_fraction, "{:.1%}", -1),
    ("idle, worst stage", lambda r: r.bubble_fraction_worst, "{:.1%}", -1),
    ("bubble time", lambda r: r.step_breakdown_s.get("bubble", 0.0), "{:.3f} s", -1),
    *[(f"exposed {d} comm", (lambda r, d=d: r.exposed_comm_s.get(d, 0.0)), "{:.3f} s", -1)
      for d in DIM_NAMES],
    ("peak memory", lambda r: r.peak_memory_gib, "{:.1f} GiB", -1),
    ("usable HBM", lambda r: r.memory_capacity_gib, "{:.1f} GiB", 0),
    ("fits in memory", lambda r: r.fits_in_memory, "{}", +1),
    ("GPUs", lambda r: r.gpus, "{:,}", 0),
    ("microbatches", lambda r: r.num_microbatches, "{:,}", 0),
]
REL_TOL = 0.005  # changes under half a percent are shown, but not called better or worse


def load_side(label: str, path: Path, mode: str, progress: Any = None) -> Side:
    if not path.exists():
        raise UserError(f"{label} = {str(path)!r} does not exist: give a scenario YAML or a report JSON "
                        "(clustersim simulate --report out.json)")
    if path.is_dir():
        raise UserError(f"{label} = {str(path)!r} is a folder: give a scenario YAML or a report JSON file")
    text = read_user_text(path, label)  # (gunzipped where it is gzip: a --report x.json.gz)
    text_head = text[:1].lstrip()
    json_name = path.suffix.lower() == ".json" or path.name.lower().endswith(".json.gz")
    if json_name or (path.suffix.lower() not in (".yaml", ".yml") and text_head.startswith("{")):
        from pydantic import ValidationError

        from simulator.report.metrics import Report

        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{label} = {str(path)!r} is not valid JSON ({exc.__class__.__name__}: "
                            f"{' '.join(str(exc).split())}): give a report JSON or a scenario YAML") from None
        check_document_kind(data, f"{label} =", str(path), "a simulate report (clustersim simulate --report/--json)",
                            fix="write one with --report, or pass the scenario YAML")
        try:
            report = Report.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "top level"
            raise UserError(f"{label} = {str(path)!r} is not a report JSON written by clustersim simulate --report "
                            f"({where}: {first.get('msg', 'invalid')}): write one with --report, or pass the scenario YAML") from None
        for field in ("step_time_s", "tokens_per_s", "mfu"):
            v = getattr(report, field)
            if not math.isfinite(v) or v < 0 or (field == "step_time_s" and v == 0):
                raise UserError(f"{label} = {str(path)!r}: {field} {v!r} is not a figure a simulation writes "
                                "(negative, zero or not finite): re-write the report with clustersim simulate --report")
        return Side(label, path, report)
    from simulator.scenario import load_scenario
    from simulator.simulate import simulate

    sc = load_scenario(path, {})
    if progress is not None:
        progress(f"simulating {label}: {sc.name} ({mode} mode)")
    result = simulate(sc, mode=mode)
    return Side(label, path, result.report, result)


def _fmt(fmt: str, v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    return fmt.format(v)


def metric_rows(a: "Report", b: "Report") -> list[tuple[str, str, str, str, str]]:
    """(metric, A, B, change, "better" | "worse" | "") per metric either side uses."""
    rows = []
    for label, get, fmt, direction in METRICS:
        va, vb = get(a), get(b)
        if isinstance(va, bool) or isinstance(vb, bool):
            change = "" if va == vb else "changed"
            cls = "" if va == vb else ("better" if (vb if direction > 0 else not vb) else "worse")
        else:
            if va == vb == 0:
                continue  # a dimension neither side uses
            rel = (vb - va) / abs(va) if va else float("inf")
            change = f"{rel:+.1%}" if va else "new"
            if fmt.endswith("%}"):
                # A share's change in percentage points first: "-11.2%" of an MFU of 30.6% reads
                # as 11 points; it is 3.4.
                change = f"{100 * (vb - va):+.1f} points" + (f" ({rel:+.1%})" if va else "")
            cls = ""
            if direction and abs(rel) >= REL_TOL:
                cls = "better" if (rel > 0) == (direction > 0) else "worse"
        rows.append((label, _fmt(fmt, va), _fmt(fmt, vb), change, cls))
    return rows


def metric_table(a: "Report", b: "Report") -> str:
    rows = []
    for label, va, vb, change, cls in metric_rows(a, b):
        row_cls = ' class="changed"' if cls else ""
        rows.append(f"<tr{row_cls}><td>{esc(label)}</td><td>{va}</td><td>{vb}</td>"
                    f'<td class="{cls}">{esc(change)}</td></tr>')
    return ('<table class="diff"><tr><th>metric</th><th>A</th><th>B</th><th>B vs A</th></tr>'
            + "".join(rows) + "</table>")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix.rstrip(".")] = d
    return out


def scenario_diff(a: "SimulationResult", b: "SimulationResult") -> str:
    fa = _flatten(a.scenario.model_dump(mode="json"))
    fb = _flatten(b.scenario.model_dump(mode="json"))
    fa["parallelism.dp (derived)"], fb["parallelism.dp (derived)"] = a.scenario.dp, b.scenario.dp
    keys = [k for k in dict.fromkeys([*fa, *fb]) if k != "name"]
    diff = [k for k in keys if fa.get(k) != fb.get(k)]
    if not diff:
        return '<p class="caption">The two scenarios are identical apart from their names.</p>'
    rows = "".join(f'<tr class="changed"><td>{esc(k)}</td><td>{esc(fa.get(k, "–"))}</td><td>{esc(fb.get(k, "–"))}</td></tr>'
                   for k in diff)
    return (f'<p class="caption">{len(diff)} of {len(keys)} fields differ; the rest are equal.</p>'
            f'<table class="diff"><tr><th>field</th><th>A</th><th>B</th></tr>{rows}</table>')


def delta_table(a: "Report", b: "Report") -> str:
    rows = []
    for r in step_delta(a, b):
        cls = "" if abs(r["delta_of_step"]) < REL_TOL else ("worse" if r["delta_s"] > 0 else "better")
        bold = r["component"] == "step"
        name = f"<b>{esc(r['label'])}</b>" if bold else esc(r["label"])
        rows.append(f'<tr data-component="{esc(r["component"])}" data-delta-s="{r["delta_s"]:.9g}"><td>{name}</td>'
                    f"<td>{r['a_s'] * 1e3:,.2f} ms</td><td>{r['b_s'] * 1e3:,.2f} ms</td>"
                    f'<td class="{cls}">{r["delta_s"] * 1e3:+,.2f} ms</td><td class="{cls}">{r["delta_of_step"]:+.1%}</td></tr>')
    return ('<table class="diff" id="step-delta"><tr><th>component</th><th>A</th><th>B</th><th>B − A</th>'
            "<th>of A's step</th></tr>" + "".join(rows) + "</table>")


def delta_figure(a: "Report", b: "Report") -> "go.Figure | None":
    import plotly.graph_objects as go

    rows = [r for r in step_delta(a, b) if r["component"] != "step"]
    if not rows:
        return None
    total = sum(r["delta_s"] for r in rows)
    fig = go.Figure(go.Waterfall(
        orientation="h", y=[esc(r["label"]) for r in rows] + ["step"], x=[r["delta_s"] * 1e3 for r in rows] + [total * 1e3],
        measure=["relative"] * len(rows) + ["total"], connector=dict(line=dict(color="#bbb")),
        increasing=dict(marker=dict(color="#C5221F")), decreasing=dict(marker=dict(color="#137333")),
        totals=dict(marker=dict(color="#1f2a44")), hovertemplate="%{y}: %{x:+.2f} ms<extra></extra>",
    ))
    fig.update_layout(height=120 + 28 * len(rows), xaxis_title="B − A (ms): red is slower, green faster",
                      yaxis=dict(autorange="reversed"), margin=dict(l=130, r=20, t=10, b=45), showlegend=False)
    return fig


def aligned_timelines(a: Side, b: Side) -> "go.Figure":
    """Both runs' timelines in one figure, A's lanes above B's, on one shared time axis."""
    from plotly.subplots import make_subplots

    assert a.result is not None and b.result is not None
    figs = []
    for s in (a, b):
        fig, facts = timeline_figure(s.result.timeline, report=s.report)
        figs.append((fig, facts))
    n = [len(f[1]["lanes"]) for f in figs]
    out = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[max(1, n[0]), max(1, n[1])],
                        subplot_titles=[esc(a.title), esc(b.title)])
    for i, (fig, _) in enumerate(figs):
        for tr in fig.data:
            if i == 1:
                tr.showlegend = False
            out.add_trace(tr, row=i + 1, col=1)
        ya = fig.layout.yaxis
        out.update_yaxes(tickmode="array", tickvals=ya.tickvals, ticktext=ya.ticktext, autorange="reversed",
                         showgrid=False, zeroline=False, tickfont=dict(size=10, family="monospace"), row=i + 1, col=1)
        yref = "y" if i == 0 else "y2"
        for sh in fig.layout.shapes:
            out.add_shape(type="line", xref="x domain" if i == 0 else "x2 domain", x0=0, x1=1, yref=yref, y0=sh.y0,
                          y1=sh.y1, line=dict(color="#999", width=1))
    step = max(a.result.timeline.step_time_s, b.result.timeline.step_time_s) * 1e3
    out.update_xaxes(range=[0, step], showgrid=True, gridcolor="#eee", zeroline=False)
    out.update_xaxes(title="time (ms), one axis for A and B", row=2, col=1)
    out.update_layout(barmode="overlay", height=max(420, 160 + 15 * (n[0] + n[1])), plot_bgcolor="white",
                      legend=dict(orientation="h", yanchor="bottom", y=1.03, xanchor="left", x=0, font=dict(size=11)),
                      margin=dict(l=150, r=20, t=90, b=45), hoverlabel=dict(align="left"))
    return out


def build_compare_html(a: Side, b: Side, cdn: bool = False) -> str:
    ra, rb = a.report, b.report
    sections = [panel("What changed, B against A", metric_table(ra, rb),
                      "Green: B is better; red: B is worse (changes under 0.5% are not coloured).")]
    dfig = delta_figure(ra, rb)
    sections.append(panel("Where the step changed", '<div class="grid2"><div>' + delta_table(ra, rb) + "</div><div>"
                          + (figure_div(dfig, "cmp-delta") if dfig is not None else "") + "</div></div>",
                          "The step's breakdown for A and B, and the change of each part; the parts' changes sum to "
                          "the change of the step.", anchor="sec-cmp-delta"))
    if ra.step_breakdown_s and rb.step_breakdown_s:
        sections.append(panel("Where the step goes, A and B", figure_div(step_breakdown_figure([("A", ra), ("B", rb)]),
                                                                           "cmp-breakdown")))
    if a.result is not None and b.result is not None:
        sections.append(panel("Scenario differences", scenario_diff(a.result, b.result)))
    for s in (a, b):
        if getattr(s.report, "whatif", None):
            from simulator.whatif.summary import whatif_lines

            sections.append(panel(f"What-if ({esc(s.label)}): step change, who waits on whom, distribution, goodput",
                                  "<pre>" + esc("\n".join(whatif_lines(s.report.whatif))) + "</pre>"))
    side_cards = []
    for s in (a, b):
        sub = scenario_line(s.result) if s.result is not None else f"from report {esc(s.path.name)}"
        side_cards.append(panel(esc(s.title), f'<p class="caption">{sub}</p>' + summary_cards(s.report)
                                + findings_html(s.report).replace('id="findings"', f'id="findings-{s.label}"')))
    sections.append('<div class="grid2">' + "".join(side_cards) + "</div>")
    both = [(a.label, ra), (b.label, rb)]
    sections.append('<div class="grid2">'
                    + panel("Per-stage breakdown", figure_div(stage_breakdown_figure(both), "cmp-stages"),
                            "Compute, exposed communication and bubble per pipeline rank, A above B.")
                    + panel("Memory", figure_div(memory_figure(both), "cmp-memory"),
                            "Peak memory per GPU of each pipeline rank, against the usable HBM line.")
                    + "</div>")
    if a.result is not None and b.result is not None:
        sections.append(panel("Timelines of A and B on one time axis", figure_div(aligned_timelines(a, b), "cmp-timeline"),
                              "A's lanes above B's, one shared time axis: zooming either zooms both. Compute lanes show "
                              "work above and waits by cause below; the black line is each run's critical path.",
                              anchor="sec-cmp-timeline"))
    else:
        missing = ", ".join(s.label for s in (a, b) if s.result is None)
        sections.append(panel("Timelines", f'<p class="caption">No timeline for {esc(missing)}: a report JSON holds '
                                           "metrics only; pass scenario YAMLs to compare timelines.</p>"))
    title = f"ClusterSim compare · {esc(ra.name)} vs {esc(rb.name)}"
    sub = f"A = {esc(a.path)} · B = {esc(b.path)}"
    return page(title, sub, "".join(sections), cdn)


def _slug(text: str) -> str:
    from simulator.report.files import slug

    return slug(text, 60)


def compare_command(
    a: Path = typer.Argument(..., help="Scenario YAML or report JSON (clustersim simulate --report) for A."),
    b: Optional[Path] = typer.Argument(
        None, help="Scenario YAML or report JSON for B, compared against A. Omitted: A's perturbations (what-if) against A clean."),
    # --dashboard as simulate and sweep name the same path (a user going from one to the other typed it)
    output: Optional[str] = typer.Option(None, "--output", "-o", "--dashboard", metavar="PATH",
                                          help="Dashboard HTML path (default dashboards/compare-<A>-vs-<B>.html; with B omitted, compare-<A>-whatif.html)."),
    mode: CompareMode = typer.Option(CompareMode.reduced, "--mode", help="Simulation mode for scenario YAMLs."),
    cdn: bool = typer.Option(False, "--cdn", help="Load plotly.js from its CDN (small HTML)."),
) -> None:
    """Compare two scenarios or two reports: a per-metric table here, both side by side in a dashboard."""
    from simulator.files import HTML_SUFFIXES, check_outputs, write_atomic
    from simulator.progress import progress

    if b is None:
        path = Path(output) if output else Path("dashboards") / f"compare-{_slug(a.stem)}-whatif.html"
    else:
        path = Path(output) if output else Path("dashboards") / f"compare-{_slug(a.stem)}-vs-{_slug(b.stem)}.html"
    if path.exists() and path.is_dir():
        raise UserError(f"--output {str(path)!r} is a folder: give a file path ending in .html")
    # Before simulating: a bad path never costs the result, and A or B is never written over.
    inputs = [("file A", a), ("file B", b)]
    from simulator.scenario import scenario_input_files

    for label, side in (("A", a), ("B", b)):
        # a scenario also reads the files it names (model config, schedule CSV, profile, topology)
        if side is not None and side.suffix in (".yaml", ".yml") and side.is_file():
            inputs += [(f"{what} of {label}", f) for what, f in scenario_input_files(side).items() if what != "scenario file"]
    # (as typed: a trailing slash names a folder, and Path() would drop it)
    check_outputs({"--output": output or path}, inputs, replaces_only={"--output": HTML_SUFFIXES})
    from simulator.report.findings import attach

    with progress("compare") as phase:
        if b is None:
            # What-if: the scenario without its perturbations (A) against with them (B).
            # Errors name the file as the user gave it (A); the perturbed run is then shown as B.
            side_b = load_side("A", a, mode.value, phase)
            side_b.label = "B"
            if side_b.result is None or side_b.result.clean is None:
                raise UserError(f"A = {str(a)!r} has no perturbations: give B, or add a perturbations: section to A")
            clean = side_b.result.clean
            side_a = Side("A", a, clean.report, clean)
        else:
            side_a = load_side("A", a, mode.value, phase)
            side_b = load_side("B", b, mode.value, phase)
        for side in (side_a, side_b):
            if side.result is not None:
                attach(side.result, budget_s=0)  # findings without re-simulation: compare stays quick
                side.report = side.result.report
        if b is None:
            side_a.report = side_a.report.model_copy(update={"name": f"{side_a.report.name} (clean)"})
        phase("writing the dashboard")
        write_atomic(path, build_compare_html(side_a, side_b, cdn=cdn))
    print_metric_table(side_a, side_b)
    print_delta_table(side_a.report, side_b.report)
    typer.echo(f"dashboard: {path}")


def print_metric_table(a: Side, b: Side) -> None:
    """The dashboard's lead table in the terminal: each metric for A and B and B's change."""
    from rich.console import Console

    from simulator.textsafe import plain
    from rich.table import Table

    from simulator.textsafe import for_rich

    # (names and file names come from the user's files: no markup, no control characters)
    t = Table(title=f"B vs A: A = {for_rich(a.report.name)} ({for_rich(a.path.name)}), "
                    f"B = {for_rich(b.report.name)} ({for_rich(b.path.name)})")
    t.add_column("metric")
    t.add_column("A", justify="right")
    t.add_column("B", justify="right")
    t.add_column("B vs A", justify="right")
    style = {"better": "green", "worse": "red", "": ""}
    for label, va, vb, change, cls in metric_rows(a.report, b.report):
        mark = {"better": " (better)", "worse": " (worse)"}.get(cls, "")
        t.add_row(label, va, vb, f"[{style[cls]}]{change}{mark}[/]" if cls else change)
    con = Console(width=None if sys.stdout.isatty() else 120)
    con.print(t)
    differs = setup_differences(a.report.setup, b.report.setup)
    if differs:
        con.print("B differs from A in: " + plain(", ".join(differs)), highlight=False, markup=False, soft_wrap=True)


def setup_differences(a: dict, b: dict) -> list[str]:
    """'key A -> B' for every setup field (Report.setup) the two runs differ in; none where a report
    has no setup (written before it was recorded)."""
    if not a or not b:
        return []
    return [f"{k} {a.get(k)} -> {b.get(k)}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]


def print_delta_table(a: "Report", b: "Report") -> None:
    """The step's per-component change, B against A, as a terminal table."""
    from rich.console import Console
    from rich.table import Table

    from simulator.textsafe import for_rich

    t = Table(title=f"B vs A: {for_rich(a.name)} → {for_rich(b.name)}")
    for col, just in (("component", "left"), ("A", "right"), ("B", "right"), ("B − A", "right"), ("of A's step", "right")):
        t.add_column(col, justify=just)
    for r in step_delta(a, b):
        style = "bold" if r["component"] == "step" else ""
        colour = "" if abs(r["delta_of_step"]) < REL_TOL else ("red" if r["delta_s"] > 0 else "green")
        delta = f"[{colour}]{r['delta_s'] * 1e3:+,.2f} ms[/{colour}]" if colour else f"{r['delta_s'] * 1e3:+,.2f} ms"
        t.add_row(r["label"], f"{r['a_s'] * 1e3:,.2f} ms", f"{r['b_s'] * 1e3:,.2f} ms", delta,
                  f"{r['delta_of_step']:+.1%}", style=style)
    Console(width=100).print(t)


compare_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
compare_app.command("compare")(compare_command)
