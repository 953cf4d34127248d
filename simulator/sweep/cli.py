"""`clustersim sweep`: search a space of parallel layouts (estimate all, simulate the best).

Results go to stdout (a rich table, or one JSON object with --json); the progress bar goes to
stderr; the store, dashboards and nothing else are written.
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from simulator.errors import UserError


class Executor(str, Enum):
    local = "local"
    dask = "dask"


def _flag_axes(**flags: Optional[str]) -> dict[str, list]:
    from simulator.sweep.space import parse_list

    kinds = {"schedule": str, "recompute": str, "gpu": str, "topology": str, "network": str, "sequence_parallel": bool}
    axes = {}
    for name, raw in flags.items():
        vals = parse_list(name.replace("_", "-"), raw, kinds.get(name, int))
        if vals is not None and kinds.get(name, int) is int:
            # A size below 1 (a ZeRO stage below 0) is a typo, not a layout to prune.
            least = 0 if name == "zero" else 1
            for v in vals:
                if v < least:
                    raise UserError(f"--{name.replace('_', '-')} value {v} must be at least {least}: "
                                    f"write e.g. --{name.replace('_', '-')} {'0,1,3' if name == 'zero' else '2,4,8'}")
        if vals is not None:
            axes[name] = vals
    return axes


def sweep_command(
    space: Optional[Path] = typer.Argument(None, help="Space YAML (axes, objective, constraints); flags add or replace axes."),
    model: Optional[str] = typer.Option(None, "--model", help="Model preset or HuggingFace config.json."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU count(s): 1024 or 512,1024."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU profile(s), comma-separated."),
    topology: Optional[str] = typer.Option(None, "--topology", help="Topology name(s) or path(s), comma-separated."),
    network: Optional[str] = typer.Option(None, "--network", help="flow and/or alpha-beta: the network the simulated points run on. The estimate that ranks the space prices collectives on the alpha-beta tier model either way."),
    seq_length: Optional[str] = typer.Option(None, "--seq-length", help="Sequence length(s), tokens per sequence."),
    global_batch_size: Optional[str] = typer.Option(None, "--global-batch-size", help="Global batch size(s), sequences."),
    tp: Optional[str] = typer.Option(None, "--tp", help="Tensor-parallel sizes, e.g. 2,4,8."),
    pp: Optional[str] = typer.Option(None, "--pp", help="Pipeline-parallel sizes."),
    vpp: Optional[str] = typer.Option(None, "--vpp", help="Model chunks per pipeline rank."),
    cp: Optional[str] = typer.Option(None, "--cp", help="Context-parallel sizes."),
    ep: Optional[str] = typer.Option(None, "--ep", help="Expert-parallel sizes."),
    etp: Optional[str] = typer.Option(None, "--etp", help="Expert tensor-parallel sizes: 1 (whole experts) and/or the tp (points where it is neither are infeasible)."),
    dp: Optional[str] = typer.Option(None, "--dp", help="Data-parallel sizes (derived from --gpus when omitted)."),
    zero: Optional[str] = typer.Option(None, "--zero", help="ZeRO stages, e.g. 0,1,3 (default 1, as simulate)."),
    micro_batch_size: Optional[str] = typer.Option(None, "--micro-batch-size", help="Micro-batch sizes, sequences per microbatch per data-parallel rank."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="Schedules, e.g. 1f1b,interleaved-1f1b,zbv."),
    recompute: Optional[str] = typer.Option(None, "--recompute", help="none,selective,full."),
    objective: Optional[str] = typer.Option(None, "--objective", help="tokens_per_s (default), tokens_per_s_per_gpu, mfu, step_time_s."),
    memory_headroom: Optional[float] = typer.Option(None, "--memory-headroom", help="Fraction of usable memory to keep free (0-1)."),
    max_gpus: Optional[int] = typer.Option(None, "--max-gpus", help="Prune points with more GPUs."),
    min_gpus: Optional[int] = typer.Option(None, "--min-gpus", help="Prune points with fewer GPUs."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Simulate the k best estimates (default 20, or the space file's)."),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Simulate every feasible point."),
    estimate_only: bool = typer.Option(False, "--estimate-only", help="Rank by the estimate only; simulate nothing."),
    mode: Optional[str] = typer.Option(None, "--mode", help="reduced (default) or full simulation."),
    executor: Executor = typer.Option(Executor.local, "--executor", help="local process pool, or an existing dask cluster."),
    scheduler: Optional[str] = typer.Option(None, "--scheduler", help="Dask scheduler address, tcp://HOST:8786."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Local worker processes (default: all cores)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Scenarios per task (default: a few tasks per worker)."),
    store: Optional[str] = typer.Option(None, "--store", metavar="PATH", help="SQLite results store (default sweeps/<name>.sqlite); re-runs skip what it holds."),
    name: Optional[str] = typer.Option(None, "--name", help="Sweep name (default: the space file's name, or 'sweep')."),
    as_json: bool = typer.Option(False, "--json", help="Print exactly one JSON object."),
    dashboard: Optional[str] = typer.Option(None, "--dashboard", metavar="PATH", help="Dashboard HTML path (default dashboards/sweep-<name>.html)."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard", help="Write no dashboard."),
    cdn: bool = typer.Option(False, "--cdn", help="Load plotly.js from its CDN (small HTML)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar on stderr."),
) -> None:
    """Search parallel layouts: prune, estimate every point, simulate the best, store and rank them.

    Without a space file the base is the built-in default scenario (Llama-3-70B, 1,024 H100, TP8 PP8,
    global batch 2,048 x 8,192 tokens); the flags' axes vary it.
    """
    from simulator.scenario import default_scenario_dict
    from simulator.sweep.runner import run_sweep
    from simulator.sweep.space import Constraints, apply_fixed, load_space, make_spec

    axes = _flag_axes(gpus=gpus, gpu=gpu, topology=topology, network=network, seq_length=seq_length,
                      global_batch_size=global_batch_size, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp, dp=dp, zero=zero,
                      micro_batch_size=micro_batch_size, schedule=schedule, recompute=recompute)
    if space is not None:
        spec = load_space(space)
        base, file_axes = spec.base, dict(spec.axes)
        from simulator.sweep.space import AXES

        for k, v in axes.items():
            file_axes[AXES[k]] = v
        cons = spec.constraints
        spec = make_spec(apply_fixed(base, {"model": model}), {k: v for k, v in file_axes.items()},
                         name=name or spec.name, objective=objective or spec.objective, constraints=cons,
                         top_k=top_k or spec.top_k, mode=mode or spec.mode, where="sweep")
    else:
        if not axes:
            raise UserError("nothing to sweep: give a space file or axes such as --tp 2,4,8 --pp 1,2,4")
        base = apply_fixed(default_scenario_dict(), {"model": model})
        spec = make_spec(base, axes, name=name or "sweep", objective=objective or "tokens_per_s",
                         constraints=Constraints(), top_k=top_k or 20, mode=mode or "reduced", where="sweep")
    if memory_headroom is not None:
        if not 0 <= memory_headroom < 1:
            raise UserError(f"--memory-headroom {memory_headroom} must be a fraction in [0, 1), e.g. 0.1")
        spec.constraints.memory_headroom = memory_headroom
    for flag, value in (("--max-gpus", max_gpus), ("--min-gpus", min_gpus)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} must be at least 1: it prunes points by their GPU count")
    if max_gpus is not None:
        spec.constraints.max_gpus = max_gpus
    if min_gpus is not None:
        spec.constraints.min_gpus = min_gpus
    lo, hi = spec.constraints.min_gpus, spec.constraints.max_gpus
    if lo is not None and hi is not None and lo > hi:
        raise UserError(f"min_gpus={lo} is above max_gpus={hi}: every point would be pruned; lower --min-gpus or raise --max-gpus")
    if executor == Executor.dask and not scheduler:
        raise UserError("--executor dask needs --scheduler tcp://HOST:8786 (the address of a running dask scheduler)")
    if scheduler and executor != Executor.dask:
        raise UserError(f"--scheduler {scheduler!r} is used only with --executor dask: add it, or drop --scheduler")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k {top_k} must be at least 1 (points to simulate); --estimate-only simulates none")
    if workers is not None and workers < 1:
        raise UserError(f"--workers {workers} must be at least 1")
    max_workers = 4 * (os.cpu_count() or 1)
    if workers is not None and workers > max_workers:
        # one process each: beyond a few per core they only queue (and 100,000 never start)
        raise UserError(f"--workers {workers:,} is more than {max_workers} (4 per core on this machine): lower it, "
                        "or run a dask cluster (--executor dask)")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1 (scenarios per task)")
    store_path = Path(store) if store else Path("sweeps") / f"{spec.name}.sqlite"
    dash_path = best_path = None
    if not no_dashboard:
        from simulator.report.files import output_path

        dash_path = Path(dashboard) if dashboard else output_path(Path("dashboards"), spec.name, ".html", prefix="sweep-")
        best_path = dash_path.with_name(dash_path.stem + "-best.html")
    from simulator.files import HTML_SUFFIXES, check_outputs, write_atomic

    # Before the sweep: a bad path never costs the results, and no input is written over.
    inputs = [("space file", space), ("--model config", model)]
    for flag, values in (("--gpu", gpu), ("--topology", topology)):
        inputs += [(f"{flag} file", value.strip() or None) for value in (values or "").split(",")]
    # (as typed: a trailing slash names a folder, and Path() would drop it)
    check_outputs({"--store": store or store_path,
                   "--dashboard": dashboard if dashboard and not no_dashboard else dash_path,
                   "the best point's dashboard": best_path}, inputs,
                  replaces_only={"--dashboard": HTML_SUFFIXES, "the best point's dashboard": HTML_SUFFIXES})

    out = run_sweep(spec, store=store_path, executor=executor.value, workers=workers, scheduler=scheduler,
                    exhaustive=exhaustive, estimate_only=estimate_only, batch_size=batch_size,
                    show_progress=not no_progress)

    if dash_path is not None:
        from simulator.sweep.dashboard import build_sweep_dashboard_html

        href = None
        if out.best is not None:
            from simulator.report.dashboard import build_dashboard_html
            from simulator.scenario import build_scenario
            from simulator.simulate import simulate

            res = simulate(build_scenario(out.best["scenario"]), mode=spec.mode)
            write_atomic(best_path, build_dashboard_html(res, cdn=cdn))
            href = os.path.relpath(best_path, dash_path.parent)
            print(f"timeline of the best point: {best_path}", file=sys.stderr)
        write_atomic(dash_path, build_sweep_dashboard_html(out, cdn=cdn, timeline_href=href))
    if as_json:
        obj = out.to_json()
        obj["dashboard"] = str(dash_path) if dash_path else None
        obj["store"] = str(store_path)
        print(json.dumps(_finite(obj)))
    else:
        print_sweep(out)
        # (the store is written whether or not asked for: say where, and what it is for)
        print(f"results store: {store_path} (a re-run reuses its points; --store PATH to put it elsewhere)")
        if dash_path:
            print(f"dashboard: {dash_path}")
    if out.crashes:
        raise UserError(
            f"{len(out.crashes)} simulations failed with an internal error (first: {out.crashes[0]['error'][:200]}): "
            "please report it; the other results are stored"
        )


def _finite(o):
    """NaN and infinities as null: --json must print valid JSON."""
    if isinstance(o, float):
        return o if o == o and o not in (float("inf"), float("-inf")) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def print_sweep(out) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from simulator.words import plural

    # Wide enough for a table of axes when stdout is a file or a pipe.
    con = Console(width=None if sys.stdout.isatty() else 160)
    ev = out.evaluation
    # The default name is "sweep": say "sweep:", not "sweep sweep:".
    title = "sweep" if out.spec.name == "sweep" else f"sweep {out.spec.name}"
    con.print(f"[bold]{escape(title)}[/bold]: {plural(ev.total, 'point')}, {sum(ev.pruned.values()):,} pruned, "
              f"{len(ev.candidates):,} feasible estimated in {ev.estimate_s:.2f} s ({ev.rate:,.0f}/s); "
              f"{len(out.simulated):,} simulated ({out.newly_simulated:,} now, {out.reused:,} from the store)",
              markup=True, highlight=False)
    from simulator.sweep.runner import reuse_line

    if reuse_line(out.reuse):
        con.print(reuse_line(out.reuse), markup=False, highlight=False)
    if ev.pruned:
        from simulator.sweep.runner import pruned_summary

        t = Table(title="pruned before simulation (one example per reason)", show_header=True)
        t.add_column("reason")
        t.add_column("points", justify="right")
        for reason, n in pruned_summary(ev):
            t.add_row(escape(reason), f"{n:,}")
        con.print(t)
    rows = out.simulated[: out.spec.top_k]
    if rows:
        t = Table(title=f"top {len(rows)} by simulated {out.spec.objective}")
        t.add_column("#", justify="right")
        axes = list(rows[0]["point"])
        for a in axes:
            t.add_column(a)
        for col in ("tokens/s", "step s", "MFU", "mem GiB", "est. rank"):
            t.add_column(col, justify="right")
        est_rank = {c.hash: i + 1 for i, c in enumerate(ev.candidates)}
        for i, r in enumerate(rows):
            rep = r["report"]
            t.add_row(str(i + 1), *[str(r["point"][a]) for a in axes], f"{rep['tokens_per_s']:,.0f}",
                      f"{rep['step_time_s']:.4g}", f"{rep['mfu']:.1%}", f"{rep['peak_memory_gib']:.1f}",
                      str(est_rank.get(r["hash"], "-")))
        con.print(t)
        a = out.agreement
        if a.get("n", 0) >= 2:
            con.print(f"estimate vs simulation ({a['n']} points): Spearman {a['spearman']:.3f}, Kendall {a['kendall']:.3f}, "
                      f"top-1 {'agrees' if a.get('top1_agree') else 'differs'}, median |error| "
                      f"{a.get('median_abs_rel_error', float('nan')):.1%}", highlight=False)
    elif ev.candidates:
        t = Table(title=f"top {min(out.spec.top_k, len(ev.candidates))} by estimated {out.spec.objective}")
        axes = list(ev.candidates[0].point)
        for a in axes:
            t.add_column(a)
        t.add_column(f"estimate {out.spec.objective}", justify="right")
        t.add_column("mem GiB", justify="right")
        for c in ev.candidates[: out.spec.top_k]:
            t.add_row(*[str(c.point[a]) for a in axes], f"{c.score:.4g}", f"{c.estimate.peak_memory_gib:.1f}")
        con.print(t)
    for e in out.errors[:5]:
        con.print(f"simulation error for {e['point']}: {e['error']}", highlight=False, markup=False)


sweep_app = typer.Typer(name="sweep", add_completion=False, pretty_exceptions_enable=False)
sweep_app.command(name="sweep")(sweep_command)
