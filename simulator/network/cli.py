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
import math
import re
from typing import Any, Optional

import numpy as np
import typer

from simulator.errors import UserError
from simulator.network.base import CollectiveRequest, bus_factor
from simulator.network.fabric import FlowNetwork, comm_kwargs, nccl_model_for
from simulator.topology.graph import build_graph
from simulator.topology.spec import load_topology

# nccl-tests program names -> CollectiveRequest ops
OPS = {
    "all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all", "all_to_all": "all_to_all", "sendrecv": "send_recv", "send_recv": "send_recv",
    "broadcast": "broadcast",
}
_TYPE_BYTES = 4  # nccl-tests' default -d float
# nccl-tests' -d names and their element sizes (common.cu's test_typenames).
DATATYPES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "half": 2, "float": 4,
             "double": 8, "bfloat16": 2, "f8e4m3": 1, "f8e5m2": 1}
# nccl-tests' -o names; the reduction does not change the simulated time (the fabric moves bytes).
REDOPS = ("sum", "prod", "max", "min", "avg", "all")
# GPU profile to assume when --gpu is not given, by the topology's node kind.
# Node kind -> the shipped profile of its GPU (each topology file's description names the part).
# p5 (EFA) and ndv4 take the profiles whose NCCL constants were fitted on their own nccl-tests
# logs: the DGX H100 profile's NCCL defaults miss the p5 log by up to 52% (128 KiB-32 MiB), where
# ideal links miss it by up to 155%; a100-sxm-40gb carries the Azure NDv4 fit (those logs ran on
# A100-SXM4-40GB parts), which meets the 8-32 GPU logs within 9% where NCCL's defaults are 17-55% off.
NODE_KIND_PROFILES = {"dgx-h100": "h100-sxm-80gb", "dgx-a100": "a100-sxm-80gb", "p4de": "a100-sxm-80gb",
                      "p5": "h100-sxm-80gb-p5-efa", "ndv4": "a100-sxm-40gb",
                      "dgx-h200": "h200-sxm-141gb", "dgx-b200": "b200", "gb200-nvl72": "gb200",
                      "cpu-host": "cpu-gloo-host"}


def normalise_op(name: str) -> str:
    """nccl-tests' program names and their spellings: all_reduce_perf, allreduce, all-reduce -> all_reduce."""
    key = name.strip().lower().removesuffix("_perf").replace("-", "").replace("_", "")
    table = {k.replace("_", ""): k for k in OPS}
    if key not in table:
        raise UserError(
            f"unknown collective {name!r}: use one of all_reduce, all_gather, reduce_scatter, alltoall, sendrecv, broadcast "
            "(nccl-tests' names such as all_reduce_perf or allreduce work too)"
        )
    return table[key]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)[bB]?\s*$")
# Bounds far above any real nccl-tests run (issue 16): nccl-tests' default -f 2 from 8 B to 8 GiB makes
# 31 sizes, and the largest GPU memory today is under 200 GB; a typo (-f 1.0000001) would otherwise ask
# for millions of sizes.
MAX_SIZES = 1_000
MAX_MESSAGE_BYTES = 1 << 40  # 1 TiB
# Ranks of one simulated collective: above the largest published jobs (~100K GPUs). Measured on this
# machine: 131,072 ranks build their fat-tree in ~20 s and 1.4 GB; 1,000,000 took 7-10 GB.
MAX_COLLECTIVE_RANKS = 131_072


def parse_size(text: str) -> int:
    """nccl-tests' size syntax: 8, 128K, 8M, 8G (powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"size {text!r} is not a byte count: write e.g. 8, 128K, 8M or 8G")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    value = float(m.group(1)) * mult
    if not value <= MAX_MESSAGE_BYTES:  # also catches inf from a very long digit string
        raise UserError(f"size {text[:40]!r} is more than 1T (at most {MAX_MESSAGE_BYTES:,} bytes): give a smaller size")
    return int(value)


def sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes:
        raise UserError(f"size range {min_bytes}..{max_bytes} is empty: give 1 <= --min-bytes <= --max-bytes")
    if not math.isfinite(factor) or factor <= 1:
        raise UserError(f"--factor {factor} must be a finite number > 1, e.g. 2")
    if max_bytes > MAX_MESSAGE_BYTES:
        raise UserError(f"--max-bytes {max_bytes:,} is more than 1T (at most {MAX_MESSAGE_BYTES:,} bytes): give a smaller size")
    # Count the rows before making them: log(max/min)/log(f) + 1 (the loop below adds at most one more).
    n = math.floor(math.log(max_bytes / min_bytes) / math.log(factor) * (1 + 1e-12)) + 1
    if n > MAX_SIZES:
        need = math.ceil((max_bytes / min_bytes) ** (1 / (MAX_SIZES - 2)) * 1e4) / 1e4  # rounded up: fits the limit
        raise UserError(f"--factor {factor:g} from {min_bytes:,} to {max_bytes:,} bytes makes {n:,} sizes, at most {MAX_SIZES:,} "
                        f"per run: use --factor {need:g} or more, or a narrower -b/-e range")
    out, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-12):
        out.append(int(s))
        s *= factor
    return out


def network_kwargs_for_profile(gpu: str | None, topology: str | None = None, gpus_per_thread: int = 1) -> tuple[dict[str, Any], str]:
    """FlowNetwork keyword arguments from a GPU profile name or path (with the topology: NCCL's
    cost model for the profile's GPU), and a note saying where they came from. Without a
    loadable profile: efficiency 1.0, topology latencies, no NCCL model."""
    if not gpu:
        return {}, "no GPU profile: link efficiency 1.0, step latencies from the topology (give --gpu for NCCL's model)"
    try:
        from simulator.profile import load_profile
    except ImportError:
        return {}, f"profile loading is not available yet: {gpu!r} ignored, link efficiency 1.0, step latencies from the topology"
    profile = load_profile(gpu)
    kw = comm_kwargs(profile)
    if topology is not None:
        model = nccl_model_for(load_topology(topology), profile)
        if model is not None:
            model.gpus_per_thread = max(1, gpus_per_thread)
            kw["nccl"] = model
            cal = "calibrated constants " + (profile.comm.nccl.system or "from its comm.nccl") if profile.comm.nccl else "NCCL's own constants"
            return kw, f"profile {profile.name}: NCCL cost model (2.28 tuner) with {cal}"
    return kw, f"profile {profile.name}: link efficiencies and step latencies from its comm model"


def simulate_sweep(op: str, gpus: int, topology: str, gpu: str | None = None, min_bytes: int = 8,
                   max_bytes: int = 8 << 30, factor: float = 2.0, network: FlowNetwork | None = None,
                   type_bytes: int = _TYPE_BYTES, gpus_per_thread: int = 1,
                   **network_kwargs: Any) -> tuple[list[dict], FlowNetwork, str]:
    """Rows of a simulated nccl-tests sweep: size_bytes, count, time_us, algbw_GBps, busbw_GBps
    (and the algorithm the fabric chose). ``type_bytes`` is the element size of -d."""
    op = normalise_op(op)
    cop = OPS[op]
    if gpus < 2:
        raise UserError(f"--gpus {gpus}: a collective needs at least 2 GPUs")
    if gpus > MAX_COLLECTIVE_RANKS:
        raise UserError(f"--gpus {gpus:,} is more than the {MAX_COLLECTIVE_RANKS:,} ranks one simulated collective may have "
                        f"(at most {MAX_COLLECTIVE_RANKS:,}): give fewer ranks")
    note = ""
    if network is None:
        kw, note = network_kwargs_for_profile(gpu, topology, gpus_per_thread)
        kw.update(network_kwargs)
        network = FlowNetwork(build_graph(load_topology(topology), gpus), **kw)
    ranks = np.arange(gpus)
    groups = np.stack([ranks, np.roll(ranks, -1)], axis=1) if cop == "send_recv" else ranks[None, :]
    rows = []
    for size in sizes(min_bytes, max_bytes, factor):
        if cop in ("all_gather", "reduce_scatter", "all_to_all"):
            count = size // (type_bytes * gpus)
            size = count * type_bytes * gpus
        else:
            count = size // type_bytes
            size = count * type_bytes
        if count == 0:
            continue
        req = CollectiveRequest(cop, "dp", groups, float(size))
        t = network.collective_time_s(req)
        algbw = size / t / 1e9
        rows.append({
            "size_bytes": size, "count": count, "time_us": t * 1e6, "algbw_GBps": algbw,
            "busbw_GBps": algbw * bus_factor(cop, gpus), "algorithm": network.algorithm(req),
            "nccl": network.nccl_choice(req),
        })
    return rows, network, note


def _time_str(us: float) -> str:
    # nccl-tests: fewer decimals as the number grows, width 7
    if us >= 10000.0:
        return f"{us:7.0f}"
    if us >= 100.0:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def format_table(op: str, gpus: int, rows: list[dict], header: str, datatype: str = "float", redop_name: str = "sum") -> str:
    cop = OPS[normalise_op(op)]
    redop = redop_name if cop in ("all_reduce", "reduce_scatter") else "none"
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
        lines.append(f"{r['size_bytes']:12d}  {r['count']:12d}  {datatype:>8}  {redop:>6}  {root:6d}{half}{half}")
    avg = float(np.mean([r["busbw_GBps"] for r in rows])) if rows else 0.0
    lines += ["# Out of bounds values : 0 OK", f"# Avg bus bandwidth    : {avg:.4g} ", "#"]
    return "\n".join(lines)


def default_profile_for(topology: str) -> str | None:
    """The shipped GPU profile that matches a topology's node kind (None when none does)."""
    return NODE_KIND_PROFILES.get(load_topology(topology).node.kind)


def format_explain(op: str, gpus: int, rows: list[dict], model: Any = None) -> str:
    """NCCL's choice per size and the terms of its predicted time (simulator.network.nccl);
    with the NcclModel, a first line says which protocols NCCL enables for this group and why."""
    lines = []
    if model is not None and gpus > 1:
        _, n_nodes, _ = model.shape(np.arange(gpus))
        lines.append(f"# {n_nodes} node(s): {model.system.protocols_note(n_nodes)}")
    lines += [f"# {op} on {gpus} GPUs: NCCL's choice per size; time us = lat us + fill us + bw-term us + chan us + step us",
              "#   lat us: NCCL's latency terms (calibrated) and the launch floor; chan us: measured cost per channel x ch",
              "#   chunk B: NCCL's chunk per channel (calcCollChunking); step us: network steps beyond the first loop x the fitted cost per step",
              "#   fill us: Simple's store-and-forward stages x slice time (unit B: slice bytes per channel); bw-term us: size / model GB/s",
              "#   ch: channels; thr: threads per channel; busbw GB/s = algbw x bus factor (as nccl-tests); runner-up: the next-fastest choice",
              f"#{'size (B)':>13} {'algorithm':>15} {'proto':>6} {'ch':>3} {'thr':>4} {'lat us':>9} {'fill us':>8} {'stages':>6} "
              f"{'unit B':>8} {'bw-term us':>11} "
              f"{'model GB/s':>10} {'time us':>10} {'busbw':>8} {'chan us':>8} {'chunk B':>8} {'step us':>8}   runner-up"]
    for r in rows:
        c = r.get("nccl")
        if c is None:
            lines.append(f"{r['size_bytes']:14d} {r['algorithm']:>15} {'-':>6} {'-':>3} {'-':>4} {'-':>9} {'-':>8} {'-':>6} {'-':>8} {'-':>11} {'-':>10} "
                         f"{r['time_us']:10.1f} {r['busbw_GBps']:8.2f} {'-':>8} {'-':>8} {'-':>8}   "
                         f"{'(the flow model: NCCL has no such algorithm here)' if model is not None else '(no NCCL model: give --gpu)'}")
            continue
        others = sorted((t, f"{a}/{p}") for (a, p), t in c.table.items() if (a, p) != (c.algorithm, c.protocol))
        runner = f"{others[0][1]} {others[0][0]:.1f} us" if others else "-"
        lines.append(f"{r['size_bytes']:14d} {c.algorithm:>15} {c.protocol:>6} {c.channels:3d} {c.threads:4d} "
                     f"{c.latency_us - c.pipeline_us - c.channel_cost_us - c.step_cost_us:9.1f} {c.pipeline_us:8.1f} {c.pipeline_stages:6.0f} "
                     f"{c.pipeline_unit_bytes:8.0f} {c.bw_time_us:11.1f} {c.bandwidth_GBps:10.2f} {r['time_us']:10.1f} {r['busbw_GBps']:8.2f} "
                     f"{c.channel_cost_us:8.1f} {c.chunk_bytes:8.0f} {c.step_cost_us:8.1f}   {runner}")
    return "\n".join(lines)


def collective_command(
    op: str = typer.Argument(..., help="all_reduce, all_gather, reduce_scatter, alltoall, sendrecv or broadcast; nccl-tests' names (all_reduce_perf) and allreduce work too."),
    gpus: Optional[int] = typer.Option(None, "--gpus", "--ngpus", "-g", help="Ranks (one GPU each), all issuing the collective together. nccl-tests' -g counts GPUs per process; here it is the total."),
    topology: str = typer.Option("dgx-h100-fattree", "--topology", help="Topology: a shipped name or a path to a topology YAML."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU profile (link efficiencies, step latencies): a shipped name or a path. Default: the shipped profile matching the topology's node kind, or ideal links if none does (said on stderr)."),
    min_bytes: str = typer.Option("8", "--minbytes", "--min-bytes", "-b", help="Smallest message, bytes, nccl-tests syntax (8, 1K, 1M, 1G; powers of 1024)."),
    max_bytes: str = typer.Option("8G", "--maxbytes", "--max-bytes", "-e", help="Largest message, bytes, same syntax."),
    factor: float = typer.Option(2.0, "--stepfactor", "--factor", "-f", help="Size multiplier between rows."),
    datatype: str = typer.Option("float", "--datatype", "-d", help=f"Element type, sets the element count per size: {', '.join(DATATYPES)}."),
    redop: str = typer.Option("sum", "--op", "-o", help=f"Reduction ({', '.join(REDOPS)}): shown in the table; it does not change the simulated time."),
    iters: int = typer.Option(20, "--iters", "-n", help="Accepted for nccl-tests compatibility: the simulation is deterministic, one iteration is exact."),
    warmup_iters: int = typer.Option(5, "--warmup_iters", "--warmup-iters", "-w", help="Accepted for nccl-tests compatibility (no warm-up in a simulation)."),
    algorithm: Optional[str] = typer.Option(None, "--algorithm", help="Force ring, tree, hierarchical or torus (all_reduce and the like), pairwise (alltoall); default: the fastest, as NCCL picks."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: the collective, the assumptions and the rows."),
    explain: bool = typer.Option(False, "--explain", help="Per size: NCCL's algorithm, protocol, channels, and the latency and bandwidth terms of the time."),
) -> None:
    """Simulated nccl-tests: time, algbw and busbw of one collective over a range of sizes."""
    try:
        if gpus is None:
            raise UserError("give the number of ranks: --gpus N (or nccl-tests' -g N), at least 2")
        if datatype not in DATATYPES:
            raise UserError(f"--datatype {datatype!r} is unknown: use one of {', '.join(DATATYPES)}")
        if redop not in REDOPS:
            raise UserError(f"--op {redop!r} is unknown: use one of {', '.join(REDOPS)}")
        if iters < 1 or warmup_iters < 0:
            raise UserError(f"--iters {iters} must be >= 1 and --warmup_iters {warmup_iters} >= 0")
        if not 2 <= gpus <= MAX_COLLECTIVE_RANKS:
            raise UserError(f"--gpus {gpus:,}: a simulated collective has at least 2 and at most {MAX_COLLECTIVE_RANKS:,} ranks: "
                            "give a count in that range")
        # The sizes are checked (range, factor, count) before the topology is built.
        sizes(parse_size(min_bytes), parse_size(max_bytes), factor)
        if parse_size(max_bytes) < DATATYPES[datatype]:
            raise UserError(f"--maxbytes {max_bytes} is less than one {datatype} element ({DATATYPES[datatype]} bytes): "
                            "no message to time; raise --maxbytes")
        name = normalise_op(op)
        profile = gpu
        assumed = ""
        if profile is None:
            profile = default_profile_for(topology)
            assumed = (f"no --gpu: assuming profile {profile} (it matches the topology's node kind); give --gpu to choose"
                       if profile else "no --gpu and no shipped profile for this topology's node kind: ideal links "
                       "(efficiency 1.0, step latencies from the topology) without NCCL's algorithm and protocol "
                       "model, so not an upper bound; give --gpu, best a profile calibrated from this system's "
                       "nccl-tests log (clustersim calibrate LOG --base GPU --topology T)")
        extra = {"algorithms": {OPS[name]: algorithm}} if algorithm else {}
        rows, net, note = simulate_sweep(name, gpus, topology, profile, parse_size(min_bytes), parse_size(max_bytes), factor,
                                         type_bytes=DATATYPES[datatype], **extra)
        # (NCCL's choices read "ring/Simple": the algorithm is the part before the protocol)
        ran = sorted({r["algorithm"].split("/")[0] for r in rows} - {algorithm}) if algorithm else []
        if ran:
            # The fabric falls back to its default where a forced algorithm does not apply (torus off a
            # torus, tree inside one node, any but pairwise for alltoall): a table under the asked name would mislead.
            raise UserError(f"--algorithm {algorithm} does not apply to {name} on {gpus:,} GPUs of {net.graph.spec.name} "
                            f"(it would run {', '.join(ran)}): choose {' or '.join(ran)}, or omit --algorithm")
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if assumed:
        typer.echo(f"# note: {assumed}", err=True)
    if as_json:
        keys = ("size_bytes", "count", "time_us", "algbw_GBps", "busbw_GBps", "algorithm")
        typer.echo(json.dumps({
            "collective": name, "gpus": gpus, "topology": net.graph.spec.name, "gpu_profile": profile,
            "assumptions": assumed or note, "datatype": datatype, "type_bytes": DATATYPES[datatype], "op": redop,
            "avg_busbw_GBps": float(np.mean([r["busbw_GBps"] for r in rows])) if rows else 0.0,
            "rows": [{k: r[k] for k in keys} for r in rows],
        }))
        return
    if not assumed:
        typer.echo(f"# note: {note}", err=True)
    if explain:
        typer.echo(format_explain(name, gpus, rows, getattr(net, "nccl", None)))
        return
    algos = sorted({r["algorithm"] for r in rows})
    header = f"ClusterSim simulated {name}: {gpus} GPUs on {net.graph.spec.name}; algorithm {', '.join(algos)}"
    typer.echo(format_table(name, gpus, rows, header, datatype=datatype, redop_name=redop))


collective_app = typer.Typer(add_completion=False, help="Simulated nccl-tests.")
collective_app.command("collective")(collective_command)
