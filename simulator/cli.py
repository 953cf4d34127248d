"""`clustersim`: capture, calibrate, simulate, validate, trace, collective.

Only this module writes files. Bad input prints one line (``error: ...``) and exits with 2.
Results go to stdout (a rich summary, or exactly one JSON object with --json); progress and
logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from simulator.errors import UserError

app = typer.Typer(
    name="clustersim",
    help="Trace-driven simulator of GPU clusters for LLM training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from simulator.version import package_version

        print(f"clustersim {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    """Capture traces, calibrate profiles, simulate training steps at scale, validate predictions."""


def _register_subcommands() -> None:
    # Each command module imports its heavy dependencies (torch for capture) inside the command.
    from simulator.calibrate.cli import calibrate_command
    from simulator.calibrate.validate import validate_command
    from simulator.capture.cli import capture_command
    from simulator.network.cli import collective_command
    from simulator.report.compare import compare_command
    from simulator.sweep.cli import sweep_command
    from simulator.trace.cli import trace_app

    app.command("capture", help="Capture a trace bundle from a real torch run (gloo on CPU, NCCL on GPUs).")(capture_command)
    app.command("calibrate", help="Fit a GPU profile (compute and communication cost models) from traces.")(calibrate_command)
    app.command("validate", help="Compare the simulator with a captured bundle, or with a published table (--published).")(validate_command)
    app.command("sweep", help="Search parallel layouts: estimate the whole space, simulate the best, Pareto dashboard.")(sweep_command)
    app.command("compare", help="Two scenarios or reports side by side: the what-if dashboard.")(compare_command)

    app.command("collective", help="Simulated nccl-tests: time, algbw and busbw of one collective over message sizes.")(
        collective_command
    )
    app.add_typer(trace_app, name="trace", help="Inspect traces: a bundle, a Kineto file, a folder of them, or an nccl-tests log.")


_register_subcommands()


class SimMode(str, Enum):
    reduced = "reduced"
    full = "full"


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def check_output_path(path: Path, what: str) -> Path:
    """Refuse, before any work is done, an output path that cannot be written as a regular file.

    Checked up front so that a long simulation is never lost to a bad --report or --perfetto path:
    a folder or device as target, a file where a folder should be, a read-only folder, a name too
    long or holding NUL. Returns the path.
    """
    import stat

    shown = str(path)
    if "\x00" in shown:
        raise UserError(f"{what} path {shown!r} holds a NUL character: choose another name")
    if any(len(part.encode()) > 255 for part in path.parts):
        raise UserError(f"{what} path {shown[:60]!r}... has a name longer than 255 bytes: choose a shorter name")
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None  # NotADirectoryError: a parent is a file; said below
    except OSError as exc:
        raise UserError(f"{what} path {shown!r} cannot be used ({exc.strerror}): choose another path") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UserError(f"{what} path {shown!r} is a folder: name a file inside it")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what} path {shown!r} is not a regular file (a device, pipe or socket): name a file")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{what} path {shown!r} goes through {str(parent)!r}, which is a file, not a folder: choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{what} folder {str(parent)!r} is not writable: choose another path")
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder, then rename: never a half-written file,
    and never a device or folder replaced by a file (``check_output_path``)."""
    check_output_path(path, "output")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a dashboard is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parse_set(values: list[str]) -> dict:
    """--set section.key=value, value parsed as YAML (numbers, booleans, lists)."""
    import yaml

    out = {}
    for item in values:
        if "=" not in item:
            raise UserError(f"--set {item!r} is not KEY=VALUE: write e.g. --set parallelism.zero=3")
        key, raw = item.split("=", 1)
        if not key.strip() or any(not part for part in key.strip().split(".")):
            raise UserError(f"--set {item!r} names no field: write e.g. --set parallelism.zero=3")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise UserError(f"--set {item!r}: the value is not valid YAML: quote it") from None
        if value is None:
            # Dropping it silently would simulate something the user did not ask for.
            raise UserError(f"--set {item!r} gives no value: write --set {key.strip()}=VALUE")
        out[key.strip()] = value
    return out


@app.command()
def simulate(
    scenario: Optional[Path] = typer.Argument(None, help="Scenario YAML; the built-in Llama-3-70B / 1,024 H100 default when omitted."),
    model: Optional[str] = typer.Option(None, "--model", help="Model preset or HuggingFace config.json."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU profile: a shipped name (clustersim profiles) or a path to a profile JSON."),
    topology: Optional[str] = typer.Option(None, "--topology", help="Topology: a shipped name or a path to a topology YAML."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Number of GPUs."),
    tp: Optional[int] = typer.Option(None, "--tp"),
    pp: Optional[int] = typer.Option(None, "--pp"),
    vpp: Optional[int] = typer.Option(None, "--vpp", help="Virtual pipeline stages (model chunks) per rank."),
    cp: Optional[int] = typer.Option(None, "--cp"),
    ep: Optional[int] = typer.Option(None, "--ep"),
    dp: Optional[int] = typer.Option(None, "--dp", help="Derived from --gpus when omitted."),
    zero: Optional[int] = typer.Option(None, "--zero", help="ZeRO stage 0-3."),
    sequence_parallel: Optional[bool] = typer.Option(None, "--sequence-parallel/--no-sequence-parallel"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size"),
    global_batch_size: Optional[int] = typer.Option(None, "--global-batch-size"),
    seq_length: Optional[int] = typer.Option(None, "--seq-length"),
    recompute: Optional[Recompute] = typer.Option(None, "--recompute"),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="1f1b, gpipe, interleaved-1f1b, zb-h1, zbv, dualpipe, dualpipev."),
    schedule_file: Optional[Path] = typer.Option(None, "--schedule-file", help="torchtitan-style schedule CSV."),
    network: Optional[str] = typer.Option(None, "--network", help="flow (default: flows sharing links max-min fairly) or alpha-beta."),
    mode: SimMode = typer.Option(SimMode.reduced, "--mode", help="reduced: one rank per symmetry class; full: every rank."),
    set_: list[str] = typer.Option([], "--set", help="Override any scenario field: --set parallelism.grad_bucket_params=1e8."),
    as_json: bool = typer.Option(False, "--json", help="Print exactly one JSON object with the report."),
    dashboard: Optional[Path] = typer.Option(None, "--dashboard", help="Dashboard HTML path (default dashboards/<name>.html)."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard", help="Write no dashboard."),
    cdn: bool = typer.Option(False, "--cdn", help="Load plotly.js from its CDN (small HTML)."),
    perfetto: Optional[Path] = typer.Option(None, "--perfetto", help="Write a Perfetto / Chrome trace JSON here."),
    report_json: Optional[Path] = typer.Option(None, "--report", help="Also write the full report JSON here."),
    # --- what-if (simulator.whatif; the scenario's perturbations: section) ---
    slow_gpu: list[str] = typer.Option([], "--slow-gpu", help="What-if: RANK=SPEED or node:N=SPEED (repeatable), e.g. 3=0.8."),
    slow_link: list[str] = typer.Option([], "--slow-link", help="What-if: LINK=BANDWIDTH (repeatable): a link name, uplink:LEAF, nic:N, node:N, rail:R, tier:NAME."),
    fail_node: list[int] = typer.Option([], "--fail-node", help="What-if: a node that fails (repeatable); goodput from --mtbf-hours etc."),
    failure_policy: Optional[str] = typer.Option(None, "--failure-policy", help="What-if: restart (from checkpoint) or spares."),
    mtbf_hours: Optional[float] = typer.Option(None, "--mtbf-hours", help="What-if: MTBF of one GPU, hours (default 50,000, Llama 3)."),
    checkpoint_interval_s: Optional[float] = typer.Option(None, "--checkpoint-interval-s", help="What-if: work between checkpoints, s."),
    checkpoint_cost_s: Optional[float] = typer.Option(None, "--checkpoint-cost-s", help="What-if: time to write a checkpoint, s."),
    restart_cost_s: Optional[float] = typer.Option(None, "--restart-cost-s", help="What-if: time to restart after a failure, s."),
    jitter: Optional[float] = typer.Option(None, "--jitter", help="What-if: CV of seeded noise per kernel (e.g. 0.05)."),
    jitter_target: Optional[str] = typer.Option(None, "--jitter-target", help="What-if: kernel, collective or both."),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="What-if: steps (one per seed) for the P50/P90/P99 step time."),
    seed: Optional[int] = typer.Option(None, "--seed", help="What-if: first jitter seed."),
    jitter_granularity: Optional[str] = typer.Option(None, "--jitter-granularity", help="What-if: group (every TP group) or stage (cheaper)."),
) -> None:
    """Simulate one training step and print the prediction."""
    from simulator.scenario import load_scenario
    from simulator.simulate import simulate as run_simulation

    overrides = {
        "model": model, "cluster.gpu": gpu, "cluster.topology": topology, "cluster.gpus": gpus,
        "parallelism.tp": tp, "parallelism.pp": pp, "parallelism.vpp": vpp, "parallelism.cp": cp,
        "parallelism.ep": ep, "parallelism.dp": dp, "parallelism.zero": zero,
        "parallelism.sequence_parallel": sequence_parallel, "batch.micro_batch_size": micro_batch_size,
        "batch.global_batch_size": global_batch_size, "batch.seq_length": seq_length,
        "recompute": recompute.value if recompute else None, "schedule": schedule,
        "schedule_file": str(schedule_file) if schedule_file else None, "network": network,
    }
    overrides.update(_parse_set(set_))
    if scenario is not None and not scenario.exists():
        raise UserError(f"scenario file {str(scenario)!r} does not exist: check the path, or omit it to run the default")
    sc = load_scenario(scenario, overrides)
    from simulator.whatif.cli_flags import merge_perturbations, perturbations_from_flags

    sc = merge_perturbations(sc, perturbations_from_flags(
        slow_gpu, slow_link, fail_node, failure_policy, mtbf_hours, checkpoint_interval_s, checkpoint_cost_s,
        restart_cost_s, jitter, jitter_target, seeds, seed, jitter_granularity))
    result = run_simulation(sc, mode=mode.value, progress=_stderr)
    report = result.report

    if not no_dashboard:
        from simulator.report.dashboard import build_dashboard_html

        path = dashboard or Path("dashboards") / f"{sc.name}.html"
        write_atomic(path, build_dashboard_html(result, cdn=cdn))
        _stderr(f"dashboard: {path}")
    if perfetto is not None:
        from simulator.report.perfetto import perfetto_trace

        write_atomic(perfetto, json.dumps(perfetto_trace(result.timeline)))
        _stderr(f"perfetto trace: {perfetto}")
    if report_json is not None:
        write_atomic(report_json, report.model_dump_json(indent=2))
    if as_json:
        print(json.dumps(report.model_dump(mode="json")))
    else:
        print_summary(report)


def print_summary(report) -> None:
    from rich.console import Console
    from rich.table import Table

    from simulator.textsafe import for_rich

    con = Console()
    t = Table(title=f"{for_rich(report.name)}: {report.gpus} GPUs, {report.num_microbatches} microbatches", show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("step time", f"{report.step_time_s:.3f} s")
    t.add_row("throughput", f"{report.tokens_per_s:,.0f} tokens/s ({report.tokens_per_s_per_gpu:,.0f} per GPU)")
    t.add_row("model TFLOP/s per GPU", f"{report.model_tflops_per_gpu:.1f}")
    t.add_row("MFU", f"{report.mfu:.1%}")
    t.add_row("pipeline bubble", f"{report.bubble_fraction:.1%} (worst stage {report.bubble_fraction_worst:.1%})")
    for dim, v in report.exposed_comm_s.items():
        if v > 0:
            t.add_row(f"exposed {dim} comm", f"{v:.3f} s ({v / report.step_time_s:.1%})")
    fit = "fits" if report.fits_in_memory else "[red]DOES NOT FIT[/red]"
    t.add_row("peak memory", f"{report.peak_memory_gib:.1f} GiB of {report.memory_capacity_gib:.1f} ({fit})")
    for link in report.busiest_links[:3]:
        t.add_row("busy link", f"{for_rich(link.get('name', link.get('link')))}: {link.get('utilization', 0):.0%}")
    t.add_row("simulated in", f"{report.sim_wall_s:.2f} s, {report.events:,} events ({report.mode})")
    con.print(t)
    for note in report.notes:
        con.print(f"note: {for_rich(note)}")
    if getattr(report, "whatif", None):
        from simulator.whatif.summary import whatif_lines

        for line in whatif_lines(report.whatif):
            con.print(for_rich(line))


def main() -> None:
    """Console entry point: one-line errors with exit status 2, never a traceback for bad input.

    Typer's standalone mode handles usage errors itself (exit 2); our UserError comes out of
    the command and is printed here as one line.
    """
    try:
        app()
    except UserError as exc:
        _stderr(f"error: {exc}")
        sys.exit(2)
    except KeyboardInterrupt:
        _stderr("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
