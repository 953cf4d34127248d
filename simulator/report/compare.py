"""`clustersim compare A B`: two scenarios (or two saved reports) on one page, side by side.

A and B are scenario YAMLs (simulated here) or report JSONs written by
``clustersim simulate --report``. The page leads with a metric table whose change column is
coloured by whether B is better or worse than A, then the scenario fields that differ, then the
two summaries, per-stage breakdowns and memory side by side, and, when both sides were simulated,
the two timelines on one time scale.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from simulator.errors import UserError
from simulator.vocabulary import DIM_NAMES
from simulator.report.dashboard import (
    esc, figure_div, memory_figure, page, panel, scenario_line, stage_breakdown_figure, summary_cards,
    timeline_sections,
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
    ("pipeline bubble", lambda r: r.bubble_fraction, "{:.1%}", -1),
    ("bubble, worst stage", lambda r: r.bubble_fraction_worst, "{:.1%}", -1),
    *[(f"exposed {d} comm", (lambda r, d=d: r.exposed_comm_s.get(d, 0.0)), "{:.3f} s", -1)
      for d in DIM_NAMES],
    ("peak memory", lambda r: r.peak_memory_gib, "{:.1f} GiB", -1),
    ("usable HBM", lambda r: r.memory_capacity_gib, "{:.1f} GiB", 0),
    ("fits in memory", lambda r: r.fits_in_memory, "{}", +1),
    ("GPUs", lambda r: r.gpus, "{:,}", 0),
    ("microbatches", lambda r: r.num_microbatches, "{:,}", 0),
]
REL_TOL = 0.005  # changes under half a percent are shown, but not called better or worse


def load_side(label: str, path: Path, mode: str) -> Side:
    if not path.exists():
        raise UserError(f"{label} = {str(path)!r} does not exist: give a scenario YAML or a report JSON "
                        "(clustersim simulate --report out.json)")
    if path.is_dir():
        raise UserError(f"{label} = {str(path)!r} is a folder: give a scenario YAML or a report JSON file")
    text_head = path.read_text(errors="replace")[:1].lstrip()
    if path.suffix.lower() == ".json" or (path.suffix.lower() not in (".yaml", ".yml") and text_head.startswith("{")):
        from pydantic import ValidationError

        from simulator.report.metrics import Report

        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{label} = {str(path)!r} is not valid JSON ({exc.__class__.__name__}: "
                            f"{' '.join(str(exc).split())}): give a report JSON or a scenario YAML") from None
        try:
            report = Report.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ())) or "top level"
            raise UserError(f"{label} = {str(path)!r} is not a report JSON written by clustersim simulate --report "
                            f"({where}: {first.get('msg', 'invalid')}): write one with --report, or pass the scenario YAML") from None
        return Side(label, path, report)
    from simulator.scenario import load_scenario
    from simulator.simulate import simulate

    sc = load_scenario(path, {})
    print(f"simulating {label}: {sc.name} ({mode} mode)", file=sys.stderr)
    result = simulate(sc, mode=mode)
    return Side(label, path, result.report, result)


def _fmt(fmt: str, v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    return fmt.format(v)


def metric_table(a: "Report", b: "Report") -> str:
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
            cls = ""
            if direction and abs(rel) >= REL_TOL:
                cls = "better" if (rel > 0) == (direction > 0) else "worse"
        row_cls = ' class="changed"' if cls else ""
        rows.append(f"<tr{row_cls}><td>{esc(label)}</td><td>{_fmt(fmt, va)}</td><td>{_fmt(fmt, vb)}</td>"
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


def build_compare_html(a: Side, b: Side, cdn: bool = False) -> str:
    ra, rb = a.report, b.report
    sections = [panel("What changed, B against A", metric_table(ra, rb),
                      "Green: B is better; red: B is worse (changes under 0.5% are not coloured).")]
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
        side_cards.append(panel(esc(s.title), f'<p class="caption">{sub}</p>' + summary_cards(s.report)))
    sections.append('<div class="grid2">' + "".join(side_cards) + "</div>")
    both = [(a.label, ra), (b.label, rb)]
    sections.append('<div class="grid2">'
                    + panel("Per-stage breakdown", figure_div(stage_breakdown_figure(both), "cmp-stages"),
                            "Compute, exposed communication and bubble per pipeline rank, A above B.")
                    + panel("Memory", figure_div(memory_figure(both), "cmp-memory"),
                            "Peak memory per GPU of each pipeline rank, against the usable HBM line.")
                    + "</div>")
    if a.result is not None and b.result is not None:
        # one time scale for both, so a longer step looks longer
        span = (0.0, max(a.result.timeline.step_time_s, b.result.timeline.step_time_s) * 1e3)
        cols = []
        for s in (a, b):
            assert s.result is not None
            cols.append("".join(timeline_sections(s.result, x_range_ms=span, prefix=f"cmp-{s.label}-", detail=False,
                                                  heading=f"Timeline {esc(s.title)}")))
        sections.append('<div class="grid2">' + "".join(cols) + "</div>")
    else:
        missing = ", ".join(s.label for s in (a, b) if s.result is None)
        sections.append(panel("Timelines", f'<p class="caption">No timeline for {esc(missing)}: a report JSON holds '
                                           "metrics only; pass scenario YAMLs to compare timelines.</p>"))
    title = f"ClusterSim compare · {esc(ra.name)} vs {esc(rb.name)}"
    sub = f"A = {esc(a.path)} · B = {esc(b.path)}"
    return page(title, sub, "".join(sections), cdn)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:60] or "x"


def compare_command(
    a: Path = typer.Argument(..., help="Scenario YAML or report JSON (clustersim simulate --report) for A."),
    b: Optional[Path] = typer.Argument(
        None, help="Scenario YAML or report JSON for B, compared against A. Omitted: A's perturbations (what-if) against A clean."),
    output: Optional[Path] = typer.Option(None, "--output", "-o",
                                          help="Dashboard HTML path (default dashboards/compare-<A>-vs-<B>.html)."),
    mode: CompareMode = typer.Option(CompareMode.reduced, "--mode", help="Simulation mode for scenario YAMLs."),
    cdn: bool = typer.Option(False, "--cdn", help="Load plotly.js from its CDN (small HTML)."),
) -> None:
    """Compare two scenarios or two reports side by side in one dashboard."""
    from simulator.cli import write_atomic

    if b is None:
        # What-if: the scenario without its perturbations (A) against with them (B).
        side_b = load_side("B", a, mode.value)
        if side_b.result is None or side_b.result.clean is None:
            raise UserError(f"A = {str(a)!r} has no perturbations: give B, or add a perturbations: section to A")
        clean = side_b.result.clean
        side_a = Side("A", a, clean.report, clean)
        side_a.report = side_a.report.model_copy(update={"name": f"{clean.report.name} (clean)"})
        path = output or Path("dashboards") / f"compare-{_slug(a.stem)}-whatif.html"
    else:
        side_a = load_side("A", a, mode.value)
        side_b = load_side("B", b, mode.value)
        path = output or Path("dashboards") / f"compare-{_slug(a.stem)}-vs-{_slug(b.stem)}.html"
    if path.exists() and path.is_dir():
        raise UserError(f"--output {str(path)!r} is a folder: give a file path ending in .html")
    write_atomic(path, build_compare_html(side_a, side_b, cdn=cdn))
    typer.echo(str(path))


compare_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
compare_app.command("compare")(compare_command)
