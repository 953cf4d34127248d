"""``clustersim collective``: the simulated counterpart of nccl-tests.

Prints a table in nccl-tests' own layout and definitions (FORMATS.md §5): size (max of send
and receive bytes of one rank), count (the per-call element count), time in µs, algbw =
size / time and busbw = algbw x the collective's bus factor. Out-of-place and in-place columns
are the same simulation (the fabric does not tell them apart). Every simulated rank issues the
collective together, as nccl-tests does; for sendrecv each rank sends to the next and receives
from the previous one.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

import numpy as np
import typer

from simulator.errors import UserError
from simulator.network.base import CollectiveRequest, bus_factor
from simulator.network.fabric import FlowNetwork, comm_kwargs
from simulator.topology.graph import build_graph
from simulator.topology.spec import load_topology

# nccl-tests program names -> CollectiveRequest ops
OPS = {
    "all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all", "all_to_all": "all_to_all", "sendrecv": "send_recv", "send_recv": "send_recv",
    "broadcast": "broadcast",
}
_TYPE_BYTES = 4  # nccl-tests' default -d float
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?\s*$")


def parse_size(text: str) -> int:
    """nccl-tests' size syntax: 8, 128K, 8M, 8G (powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"size {text!r} is not a byte count: write e.g. 8, 128K, 8M or 8G")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes:
        raise UserError(f"size range {min_bytes}..{max_bytes} is empty: give 1 <= --min-bytes <= --max-bytes")
    if factor <= 1:
        raise UserError(f"--factor {factor} must be > 1")
    out, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-12):
        out.append(int(s))
        s *= factor
    return out


def network_kwargs_for_profile(gpu: str | None) -> tuple[dict[str, Any], str]:
    """FlowNetwork keyword arguments from a GPU profile name or path, and a note saying where
    they came from. Without a loadable profile: efficiency 1.0, topology latencies."""
    if not gpu:
        return {}, "no GPU profile: link efficiency 1.0, step latencies from the topology"
    try:
        from simulator.profile import load_profile
    except ImportError:
        return {}, f"profile loading is not available yet: {gpu!r} ignored, link efficiency 1.0, step latencies from the topology"
    profile = load_profile(gpu)
    return comm_kwargs(profile), f"profile {profile.name}: link efficiencies and step latencies from its comm model"


def simulate_sweep(op: str, gpus: int, topology: str, gpu: str | None = None, min_bytes: int = 8,
                   max_bytes: int = 8 << 30, factor: float = 2.0, network: FlowNetwork | None = None,
                   **network_kwargs: Any) -> tuple[list[dict], FlowNetwork, str]:
    """Rows of a simulated nccl-tests sweep: size_bytes, count, time_us, algbw_GBps, busbw_GBps
    (and the algorithm the fabric chose)."""
    if op not in OPS:
        raise UserError(f"unknown collective {op!r}: use one of all_reduce, all_gather, reduce_scatter, alltoall, sendrecv, broadcast")
    cop = OPS[op]
    if gpus < 2:
        raise UserError(f"--gpus {gpus}: a collective needs at least 2 GPUs")
    note = ""
    if network is None:
        kw, note = network_kwargs_for_profile(gpu)
        kw.update(network_kwargs)
        network = FlowNetwork(build_graph(load_topology(topology), gpus), **kw)
    ranks = np.arange(gpus)
    groups = np.stack([ranks, np.roll(ranks, -1)], axis=1) if cop == "send_recv" else ranks[None, :]
    rows = []
    for size in sizes(min_bytes, max_bytes, factor):
        if cop in ("all_gather", "reduce_scatter", "all_to_all"):
            count = size // (_TYPE_BYTES * gpus)
            size = count * _TYPE_BYTES * gpus
        else:
            count = size // _TYPE_BYTES
            size = count * _TYPE_BYTES
        if count == 0:
            continue
        req = CollectiveRequest(cop, "dp", groups, float(size))
        t = network.collective_time_s(req)
        algbw = size / t / 1e9
        rows.append({
            "size_bytes": size, "count": count, "time_us": t * 1e6, "algbw_GBps": algbw,
            "busbw_GBps": algbw * bus_factor(cop, gpus), "algorithm": network.algorithm(req),
        })
    return rows, network, note


def _time_str(us: float) -> str:
    # nccl-tests: fewer decimals as the number grows, width 7
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def format_table(op: str, gpus: int, rows: list[dict], header: str) -> str:
    cop = OPS[op]
    redop = "sum" if cop in ("all_reduce", "reduce_scatter") else "none"
    root = 0 if cop == "broadcast" else -1
    lines = [
        f"# {header}",
        f"# nThread 1 nGpus 1 minBytes {rows[0]['size_bytes'] if rows else 0} maxBytes {rows[-1]['size_bytes'] if rows else 0} "
        f"(simulated: {gpus} ranks, one GPU each)",
        "#",
        "#                                                              out-of-place                       in-place          ",
        "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       ",
    ]
    for r in rows:
        half = f"  {_time_str(r['time_us'])}  {r['algbw_GBps']:6.2f}  {r['busbw_GBps']:6.2f}  {'N/A':>5}"
        lines.append(f"{r['size_bytes']:12d}  {r['count']:12d}  {'float':>8}  {redop:>6}  {root:6d}{half}{half}")
    avg = float(np.mean([r["busbw_GBps"] for r in rows])) if rows else 0.0
    lines += ["# Out of bounds values : 0 OK", f"# Avg bus bandwidth    : {avg:.4g} ", "#"]
    return "\n".join(lines)


def collective_command(
    op: str = typer.Argument(..., help="all_reduce, all_gather, reduce_scatter, alltoall, sendrecv or broadcast."),
    gpus: int = typer.Option(..., "--gpus", help="Number of GPUs (ranks), all issuing the collective together."),
    topology: str = typer.Option("dgx-h100-fattree", "--topology", help="Topology: a shipped name or a path to a topology YAML."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU profile: a shipped name or a path to a profile JSON."),
    min_bytes: str = typer.Option("8", "--min-bytes", "-b", help="Smallest size, nccl-tests syntax (8, 1K, 1M, 1G)."),
    max_bytes: str = typer.Option("8G", "--max-bytes", "-e", help="Largest size."),
    factor: float = typer.Option(2.0, "--factor", "-f", help="Size multiplier between rows."),
    algorithm: Optional[str] = typer.Option(None, "--algorithm", help="Force ring, tree, hierarchical, torus (default: fastest, as NCCL)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of rows instead of the table."),
) -> None:
    """Simulated nccl-tests: time, algbw and busbw of one collective over a range of sizes."""
    try:
        extra = {"algorithms": {OPS.get(op, op): algorithm}} if algorithm else {}
        rows, net, note = simulate_sweep(op, gpus, topology, gpu, parse_size(min_bytes), parse_size(max_bytes), factor, **extra)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if as_json:
        keys = ("size_bytes", "time_us", "algbw_GBps", "busbw_GBps")
        typer.echo(json.dumps([{k: r[k] for k in keys} for r in rows]))
        return
    typer.echo(f"# note: {note}", err=True)
    algos = sorted({r["algorithm"] for r in rows})
    header = f"ClusterSim simulated {op}: {gpus} GPUs on {net.graph.spec.name}; algorithm {', '.join(algos)}"
    typer.echo(format_table(op, gpus, rows, header))


collective_app = typer.Typer(add_completion=False, help="Simulated nccl-tests.")
collective_app.command("collective")(collective_command)
