"""`clustersim trace ...`: look at traces without simulating anything."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import typer
from rich.console import Console
from rich.table import Table

from simulator.textsafe import for_rich

from simulator.errors import UserError
from simulator.trace import kineto_fields as K
from simulator.trace.loader import TraceSet, load_trace
from simulator.trace.nccl_tests import NcclTestsResult, check_collective_name, import_nccl_tests

trace_app = typer.Typer(help="Inspect Kineto traces, trace bundles and nccl-tests logs.", no_args_is_help=True)

_NCCL_TESTS_SUFFIXES = (".txt", ".log", ".out")


@trace_app.callback()
def _group() -> None:
    """Inspect Kineto traces, trace bundles and nccl-tests logs."""
    # A callback keeps `info` a subcommand even while it is the only one.


def summarise_traces(ts: TraceSet) -> dict[str, Any]:
    """The facts `trace info --json` prints, as plain JSON types."""
    ops = ts.ops
    by_class = ops.groupby("op_class", observed=True)["dur_us"].sum()
    op_classes = {c: round(float(by_class[c]), 3) for c in K.OP_CLASSES if c in by_class.index}
    comm = ops[ops["op_class"] == "communication"]
    colls = []
    if len(comm):
        g = comm.groupby(["collective", "msg_bytes", "group_size"], observed=True, dropna=False)
        agg = g.agg(count=("dur_us", "size"), total_us=("dur_us", "sum"), transfer_us=("transfer_us", "sum"),
                    wait_us=("wait_us", "sum")).reset_index()
        for r in agg.itertuples(index=False):
            colls.append({
                "name": str(r.collective),
                "count": int(r.count),
                "bytes": None if pd.isna(r.msg_bytes) else int(r.msg_bytes),
                "group_size": None if pd.isna(r.group_size) else int(r.group_size),
                "total_us": round(float(r.total_us), 3),
                # the calls' transfer part and the time they waited for peers (simulator.trace.collectives)
                "transfer_us": round(float(r.transfer_us), 3),
                "wait_us": round(float(r.wait_us), 3),
            })
        colls.sort(key=lambda c: (c["name"], c["bytes"] if c["bytes"] is not None else -1, c["group_size"] or 0))
    return {
        "kind": "bundle" if ts.manifest is not None else "kineto",
        "files": [str(f) for f in ts.files],
        "ranks": list(ts.ranks),
        "world_size": ts.world_size,
        "backend": ts.backend,
        "devices": list(ts.devices),
        "n_ops": int(len(ops)),
        "op_classes": op_classes,
        "collectives": colls,
        "span_us": round(ts.span_us, 3),
        "warnings": list(ts.warnings) + _world_size_mismatch(ts),
    }


def _world_size_mismatch(ts: TraceSet) -> list[str]:
    """A bundle whose manifest's world_size is not the ranks its traces hold (an edited or
    partly copied bundle): said, as validate refuses it."""
    m = ts.manifest
    if m is None or not ts.ranks or m.world_size == len(ts.ranks):
        return []
    return [f"manifest.json says world_size {m.world_size} but the bundle holds traces of {len(ts.ranks)} ranks: "
            "fix manifest.json or re-capture the bundle"]


def summarise_nccl_tests(res: NcclTestsResult, path: Path) -> dict[str, Any]:
    t = res.table
    colls = []
    for (name, size), grp in t.groupby(["collective", "size_bytes"], sort=True):
        colls.append({
            "name": str(name), "count": int(len(grp)), "bytes": int(size),
            "group_size": res.nranks, "busbw_GBps": float(grp["busbw_GBps"].max()),
            # the fastest of the size's rows (out-of-place, in-place), as busbw is the best of them
            "time_us": float(grp["time_us"].min()), "total_us": round(float(grp["time_us"].sum()), 3),
        })
    return {
        "kind": "nccl-tests",
        "files": [str(path)],
        "ranks": list(range(res.nranks)) if res.nranks else [],
        "world_size": res.nranks,
        "devices": list(res.devices),
        "hosts": list(res.hosts),
        "n_rows": int(len(t)),
        "op_classes": {"communication": round(float(t["time_us"].sum()), 3)},
        "collectives": colls,
        "span_us": round(float(t["time_us"].sum()), 3),
        "warnings": list(res.warnings),
    }


def _fmt_bytes(b: int | None) -> str:
    if b is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.4g} {unit}"
    return f"{b} B"


def _print_rich(info: dict[str, Any]) -> None:
    con = Console()
    con.print(f"[bold]{for_rich(info['kind'])}[/bold]: {for_rich(', '.join(info['files'][:4]))}{' ...' if len(info['files']) > 4 else ''}")
    ranks = info["ranks"]
    # An nccl-tests log has no timeline: its "span" is the sum of the rows' times.
    span = "sum of row times" if info["kind"] == "nccl-tests" else "span"
    con.print(f"ranks: {len(ranks)} {ranks if len(ranks) <= 16 else str(ranks[:16])[:-1] + ', ...]'}"
              f"   world size: {info.get('world_size') or '?'}   {span}: {info['span_us'] / 1e3:.3f} ms")
    devs = sorted(set(info["devices"]))
    con.print(f"devices: {for_rich(', '.join(devs)) if devs else '? (not named in the input)'}")
    if info["op_classes"] and info["kind"] != "nccl-tests":  # one class, all of it communication
        t = Table(title="op classes" + (f" (summed over the {len(ranks)} ranks)" if len(ranks) > 1 else ""))
        t.add_column("class")
        t.add_column("total ms", justify="right")
        total = sum(info["op_classes"].values()) or 1.0
        t.add_column("share", justify="right")
        for c, us in info["op_classes"].items():
            t.add_row(for_rich(c), f"{us / 1e3:.3f}", f"{100 * us / total:.1f}%")
        con.print(t)
    if info["collectives"] and info["kind"] == "nccl-tests":
        # One row per message size, as nccl-tests prints them (no waiting: nccl-tests times whole calls).
        t = Table(title="collectives")
        for col in ("name", "size", "ranks", "rows", "time us", "busbw GB/s"):
            t.add_column(col, justify="left" if col == "name" else "right")
        for c in info["collectives"]:
            t.add_row(for_rich(c["name"]), _fmt_bytes(c["bytes"]), str(c["group_size"] or "?"), str(c["count"]),
                      f"{c['time_us']:.1f}", f"{c['busbw_GBps']:.2f}")
        con.print(t)
    elif info["collectives"]:
        t = Table(title="collectives")
        for col, just in (("name", "left"), ("message", "right"), ("group", "right"), ("count", "right"),
                          ("total ms", "right"), ("waiting ms", "right")):
            t.add_column(col, justify=just)
        for c in info["collectives"]:
            t.add_row(for_rich(c["name"]), _fmt_bytes(c["bytes"]), str(c["group_size"] or "?"), str(c["count"]),
                      f"{c['total_us'] / 1e3:.3f}", "-" if c.get("wait_us") is None else f"{c['wait_us'] / 1e3:.3f}")
        con.print(t)
    for w in info.get("warnings", []):
        con.print(f"[yellow]warning:[/yellow] {for_rich(w)}")


@trace_app.command("info")
def info(
    path: Path = typer.Argument(..., help="A trace bundle, a Kineto trace (.json/.json.gz), a folder of per-rank traces, or an nccl-tests log."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    collective: str = typer.Option(None, "--collective", help="nccl-tests logs that do not name their collective: which one (all_reduce, all_gather, ...)."),
) -> None:
    """Print what PATH holds: ranks, devices, op classes with total time, collectives, time span."""
    try:
        check_collective_name(collective)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # they are part of the summary
            if path.is_file() and path.suffix == ".csv":
                # Per-operator latency tables are read by calibrate and validate, not summarised here.
                raise UserError(f"{str(path)!r} is a per-operator latency table, not a trace: give it to 'clustersim "
                                f"calibrate' or 'clustersim validate {path.name} --scenario S.yaml'")
            if path.is_file() and path.suffix.lower() in (".yaml", ".yml"):
                raise UserError(f"{str(path)!r} is YAML (a scenario?), not a trace: trace info reads Kineto traces, trace "
                                "bundles and nccl-tests logs; simulate a scenario with 'clustersim simulate'")
            if path.is_file() and path.name.endswith(_NCCL_TESTS_SUFFIXES):
                data = summarise_nccl_tests(import_nccl_tests(path, collective=collective), path)
            else:
                data = summarise_traces(load_trace(path))
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(data, allow_nan=False, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)))
    else:
        _print_rich(data)
