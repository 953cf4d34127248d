"""``calibrate``: read bundles / Kineto traces / nccl-tests logs, fit a Profile (nothing written).

What is fitted from what:
- compute: a bundle's compute.parquet (the `compute` sweep) and the ops of Kineto traces (GPU
  kernels, or on CPU traces the outermost aten ops) -> simulator.calibrate.compute_fit.
- communication: collectives.parquet, nccl-tests logs, and the collectives inside multi-rank
  traces (latest-starting rank) -> simulator.calibrate.comm_fit; then the link efficiencies and
  per-step latencies by inverting the simulator's own network model on the chosen topology.
- overlap: compute ops of one shape timed while a collective ran on the same rank vs. not.
- provenance: every source file's sha256, devices, versions, date.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from simulator.calibrate.comm_fit import collectives_from_ops, fit_collectives, large_message_busbw
from simulator.calibrate.compute_fit import ClassFit, fit_compute
from simulator.calibrate.overlap import measure_overlap, overlap_lines
from simulator.calibrate.physics import FEW_SAMPLES, Notes, check_collective, check_compute, identify_gpu
from simulator.profile import (
    OP_CLASSES,
    CollectiveFit,
    CommModel,
    ComputeModel,
    OpClassModel,
    Profile,
    Provenance,
    ProvenanceItem,
    load_profile,
)
from simulator.errors import UserError
from simulator.trace.nccl_tests import NCCL_TESTS_SUFFIXES
from simulator.network.base import CollectiveRequest
from simulator.topology.spec import TopologySpec, load_topology
from simulator.trace.collectives import AMBIGUOUS, MEMBERS_MISSING, NO_GROUP, NOT_IN_LAYOUT, UNMATCHED

# compute.parquet 'op' -> op class (the names simulator.workload.ops gives the same work).
COMPUTE_OP_CLASS = {
    "gemm": "gemm", "sdpa": "attention", "attention": "attention", "layernorm": "norm", "rmsnorm": "norm",
    "gelu": "elementwise", "swiglu": "elementwise", "cross_entropy": "elementwise", "softmax": "elementwise",
    "adamw": "optimizer", "adam": "optimizer",
}
CAUSAL_FRACTION = 0.5


@dataclass
class Sources:
    compute: list[pd.DataFrame] = field(default_factory=list)  # op_class, flops, bytes, time_us
    comm: list[pd.DataFrame] = field(default_factory=list)  # collective, group_size, tier, size_bytes, time_us
    traces: list[pd.DataFrame] = field(default_factory=list)  # OpTables (for overlap)
    records: list[dict] = field(default_factory=list)  # provenance per source
    devices: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    hosts_per_source: list[int] = field(default_factory=list)
    train_bundles: list[tuple[Path, object]] = field(default_factory=list)  # (path, manifest) with scenario + step times
    notes: list[str] = field(default_factory=list)
    nccl_logs: list[Path] = field(default_factory=list)  # nccl-tests logs, for the NCCL model fit
    nccl_collective: str | None = None  # --collective: what logs that do not name theirs measured
    device_props: list[dict] = field(default_factory=list)  # deviceProperties of the traced GPUs
    # measured time (µs) and kernels per op class whose ops carry no FLOPs or bytes
    unsized: dict[str, list[float]] = field(default_factory=dict)
    nccl_tests: list[dict] = field(default_factory=list)  # per log: path, hosts, nranks, gpus per host


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files_record(path: Path, files: list[Path]) -> dict:
    return {"path": str(path), "files": {str(f.relative_to(path) if f != path else f.name): sha256_file(f) for f in files}}


# ---------------------------------------------------------------------------------------------
# reading sources
# ---------------------------------------------------------------------------------------------

def _read_table(path: Path) -> pd.DataFrame:
    """A bundle's parquet table; a corrupt or truncated one is one line, not a pyarrow traceback."""
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError and others for damaged files
        reason = " ".join(str(exc).split())[:160]
        raise UserError(f"{str(path)!r} is not a readable parquet table ({reason}): re-capture the bundle") from None


def read_sources(paths: list[Path], topology: TopologySpec | None, mesh=None, collective: str | None = None) -> Sources:
    src = Sources()
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise UserError(f"calibration input {str(p)!r} does not exist: give trace bundles, Kineto traces or nccl-tests logs")
        if p.is_dir():
            _read_dir(p, src, topology, mesh, collective)
        elif p.name.endswith((".json", ".json.gz")):
            _read_traces(p, src, topology, record=_files_record(p, [p]), mesh=mesh)
        elif p.suffix in NCCL_TESTS_SUFFIXES or p.suffix == "":
            _read_nccl_tests(p, src, topology, collective)
        else:
            raise UserError(
                f"calibration input {str(p)!r} is neither a bundle folder, a Kineto .json/.json.gz trace nor an nccl-tests log (.txt/.log)"
            )
    return src


def _read_dir(p: Path, src: Sources, topology: TopologySpec | None, mesh=None, collective: str | None = None) -> None:
    from simulator.trace.bundle import MANIFEST_NAME, load_manifest
    from simulator.trace.loader import _BUNDLE_TRACE_RE, find_trace_files, nccl_tests_logs

    if not (p / MANIFEST_NAME).exists() and not any(_BUNDLE_TRACE_RE.match(f.name) for f in p.iterdir() if f.is_file()):
        # A folder of per-rank Kineto files from one job, at any depth (load_trace says what is
        # wrong otherwise), and nccl-tests logs beside them or on their own (a folder of a
        # cluster's logs, as ../shared/reference/nccl-tests keeps them): each log is read as if
        # given by itself.
        files, _ = find_trace_files(p)
        logs = nccl_tests_logs(p)
        for log in logs:
            _read_nccl_tests(log, src, topology, collective)
        if files or not logs:
            _read_traces(p, src, topology, record=_files_record(p, files), mesh=mesh)
        return
    m = load_manifest(p)
    files = sorted(f for f in p.iterdir() if f.is_file())
    rec = _files_record(p, files)
    rec.update({
        "devices": sorted(set(m.devices)), "world_size": m.world_size, "hosts": m.hosts, "backend": m.backend,
        "torch_version": m.torch_version, "nccl_version": m.nccl_version, "workload": m.workload,
        "created": m.created, "tool_version": m.tool_version,
    })
    src.records.append(rec)
    src.devices += m.devices
    src.backends.append(m.backend)
    hosts = max(1, len(m.hosts))
    src.hosts_per_source.append(hosts)
    ranks_per_host = max(1, m.world_size // hosts)
    used_table = False
    if m.scenario and m.step_times:
        src.train_bundles.append((p, m))
    if (p / "compute.parquet").exists():
        t = _read_table(p / "compute.parquet")
        cls = t["op"].map(COMPUTE_OP_CLASS)
        unknown = sorted(set(t.loc[cls.isna(), "op"]))
        if unknown:
            src.notes.append(f"{p.name}/compute.parquet: ops {', '.join(unknown)} have no op class and were skipped")
        t = t[cls.notna()]
        src.compute.append(pd.DataFrame({"op_class": cls[cls.notna()], "flops": t["flops"], "bytes": t["bytes"],
                                         "time_us": t["time_us"]}))
        used_table = True
    if (p / "collectives.parquet").exists():
        t = _read_table(p / "collectives.parquet")
        g = t["group_size"] if "group_size" in t else t["nranks"]
        g = g.astype(int)
        src.comm.append(pd.DataFrame({
            "collective": t["collective"].astype(str), "group_size": g,
            "tier": np.where(g <= ranks_per_host, "intra", "inter"),
            "size_bytes": t["size_bytes"].astype(float), "time_us": t["time_us"].astype(float),
        }))
        used_table = True
    if not used_table and m.trace_files:
        default_group = None
        if m.scenario:
            # Collectives in CPU traces carry no group size; the largest group in the layout is a
            # safe upper bound only for a single parallel dimension.
            par = m.scenario.get("parallelism", {})
            dims = [d for d in (par.get("tp", 1), par.get("dp", 1) or 1) if d > 1]
            default_group = dims[0] if len(dims) == 1 else None
        # (the --scenario layout, if given, else load_trace takes the bundle's own)
        _read_traces(p, src, topology, record=None, ranks_per_host=ranks_per_host, default_group=default_group, mesh=mesh)


def _read_traces(p: Path, src: Sources, topology: TopologySpec | None, record: dict | None,
                 ranks_per_host: int | None = None, default_group: int | None = None, mesh=None) -> None:
    from simulator.trace.loader import load_trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = load_trace(p, mesh=mesh)
    ops = ts.ops
    src.notes.extend(ts.warnings[:1] if ts.warnings and ts.warnings[0].startswith("skipped") else [])
    for t in ts.traces:
        for dp in t.device_properties or []:
            if isinstance(dp, dict) and dp.get("name"):
                src.device_props.append(dp)
                break
    if record is not None:
        record.update({"devices": sorted(set(ts.devices)), "world_size": ts.world_size, "backend": ts.backend})
        src.records.append(record)
        src.devices += ts.devices
        if ts.backend:
            src.backends.append(ts.backend)
    if ops.empty:
        raise UserError(f"{str(p)!r} holds no ops with timings: capture with torch.profiler around the work")
    src.traces.append(ops)
    comp = ops[ops["op_class"].isin(OP_CLASSES) & (ops["dur_us"] > 0)]
    gpu = (ops["device"] >= 0).any()
    if gpu and len(comp) and not comp["shapes_known"].any():
        raise UserError(
            f"{str(p)!r} recorded no op shapes, so no FLOPs or bytes can be fitted: re-profile with "
            "torch.profiler(record_shapes=True), or calibrate from a trace that has them")
    cls = comp["op_class"].astype(str).to_numpy()
    # The importer counts the whole score matrix of an attention op; the workload's exec FLOPs
    # (and the compute sweep) count the causal half that fused kernels compute. Training traces
    # are causal decoders.
    scale = np.where(cls == "attention", CAUSAL_FRACTION, 1.0)
    flops = comp["flops"].to_numpy(float)
    nbytes = comp["bytes"].to_numpy(float)
    # Time of ops with neither FLOPs nor bytes is kept per class: it is measured, and reported.
    unsized = ~(np.isfinite(flops) & (flops > 0)) & ~(np.isfinite(nbytes) & (nbytes > 0))
    for c, grp in pd.DataFrame({"c": cls[unsized], "t": comp["dur_us"].to_numpy(float)[unsized]}).groupby("c"):
        acc = src.unsized.setdefault(str(c), [0.0, 0])
        acc[0] += float(grp["t"].sum())
        acc[1] += int(len(grp))
    src.compute.append(pd.DataFrame({"op_class": cls, "flops": flops * scale, "bytes": nbytes,
                                     "time_us": comp["dur_us"].to_numpy(float),
                                     "op": comp["cpu_op"].astype(object).fillna(comp["name"].astype(object)).astype(str).to_numpy(),
                                     "dtype": comp["dtype"].astype(object).to_numpy()}))
    coll = collectives_from_ops(ops, default_group)
    if len(coll):
        if ranks_per_host is None:
            gpn = topology.node.gpus_per_node if topology else 8
            ranks_per_host = gpn
        coll["tier"] = np.where(coll["group_size"] <= ranks_per_host, "intra", "inter")
        src.comm.append(coll[["collective", "group_size", "tier", "size_bytes", "time_us"]])
        note = _envelope_note(p.name, ops, coll)
        if note:
            src.notes.append(note)


# Why calls were timed by their lower envelope (simulator.trace.collectives.WHY) -> what to do.
_ENVELOPE_WHY = {
    NO_GROUP: "their calls record no process group (gloo records none): pass --scenario with the layout the job ran",
    AMBIGUOUS: "the layout cannot tell their groups (or peers) apart, as several of its dimensions could hold them: "
               "capture with dimensions of different sizes, or on NCCL, which records each call's group",
    NOT_IN_LAYOUT: "the layout has no group of their kind and size among the ranks' process groups: "
                   "give the --scenario the job ran",
    MEMBERS_MISSING: "their groups' other ranks are not in the set: pass every rank's trace of the job",
    UNMATCHED: "their calls do not pair up across the group's members (some cut off by the profiling window, or "
               "a layout that is not the job's): profile whole steps on every rank, and give the --scenario the job ran",
}


def _envelope_note(name: str, ops: pd.DataFrame, coll: pd.DataFrame) -> str | None:
    """One line when some fitted collective sizes could not be timed from matched instances: how
    many, why, and what would match them; None when every fitted size came from instances."""
    env = coll[coll["source"] == "envelope"]
    c = ops[(ops["op_class"] == "communication") & ops["msg_bytes"].notna() & ops["collective"].notna()
            & (ops["transfer_source"] == "envelope")]
    # (calls of one-rank groups wait for nobody: their envelope misses nothing, and no reason is set)
    whys = [w for w in _ENVELOPE_WHY if w in set(c["transfer_why"].dropna().astype(str))]
    if env.empty or not whys:
        return None
    sizes = len(env[["collective", "size_bytes", "group_size"]].drop_duplicates())
    return (f"{name}: {sizes} collective size(s) timed by the lower envelope of their calls, so waiting no single rank "
            f"sees may remain: " + "; ".join(dict.fromkeys(_ENVELOPE_WHY[w] for w in whys)))


def _read_nccl_tests(p: Path, src: Sources, topology: TopologySpec | None, collective: str | None = None) -> None:
    from simulator.trace.nccl_tests import import_nccl_tests

    res = import_nccl_tests(p, collective=collective)
    t = res.table
    if t.empty:
        raise UserError(f"nccl-tests log {str(p)!r} has no result rows: give the complete output of an nccl-tests run")
    if not res.nranks:
        raise UserError(f"nccl-tests log {str(p)!r}: cannot tell how many ranks ran it (no '# Rank' lines or nThread/nGpus "
                        "header, and busbw/algbw does not fix it): give the whole log, header included")
    n = int(res.nranks)
    hosts = len(res.hosts)
    gpn = topology.node.gpus_per_node if topology else 8
    tier = "inter" if (hosts > 1 or (hosts == 0 and n > gpn)) else "intra"
    src.comm.append(pd.DataFrame({"collective": t["collective"].astype(str), "group_size": n, "tier": tier,
                                  "size_bytes": t["size_bytes"].astype(float), "time_us": t["time_us"].astype(float)}))
    rec = _files_record(p, [p])
    rec.update({"devices": sorted(set(res.devices)), "world_size": n, "hosts": res.hosts, "nccl_tests_version": res.version,
                "kind": "nccl-tests"})
    src.records.append(rec)
    src.devices += res.devices
    src.backends.append("nccl")
    src.nccl_logs.append(p)
    src.nccl_collective = collective
    src.nccl_tests.append({"path": p, "hosts": hosts, "nranks": n})


# ---------------------------------------------------------------------------------------------
# overlap
# ---------------------------------------------------------------------------------------------

def fit_overlap(tables: list[pd.DataFrame], min_pairs: int = 3) -> tuple[float, int]:
    """Median ratio of a compute op's time while a collective runs on its rank (another stream
    or thread) to the same op's time alone, over op shapes seen both ways. (1.0, 0) if none."""
    ratios, weights = [], []
    for ops in tables:
        for _, r in ops.groupby("rank", sort=True):
            comm = r[r["op_class"] == "communication"]
            comp = r[r["op_class"].isin(OP_CLASSES) & (r["dur_us"] > 0)]
            if comm.empty or comp.empty:
                continue
            cs = np.sort(comm["start_us"].to_numpy())
            ce = comm["start_us"].to_numpy() + comm["dur_us"].to_numpy()
            ce_sorted = np.maximum.accumulate(ce[np.argsort(comm["start_us"].to_numpy())])
            mid = comp["start_us"].to_numpy() + comp["dur_us"].to_numpy() / 2
            k = np.searchsorted(cs, mid, side="right") - 1
            over = (k >= 0) & (ce_sorted[np.maximum(k, 0)] > mid)
            # A collective on the op's own thread is the op waiting, not overlap.
            key = comp["name"].astype(str) + "|" + comp["flops"].astype(str) + "|" + comp["bytes"].astype(str)
            df = pd.DataFrame({"key": key.to_numpy(), "over": over, "t": comp["dur_us"].to_numpy()})
            for _, g in df.groupby("key"):
                a, b = g.loc[g["over"], "t"], g.loc[~g["over"], "t"]
                if len(a) >= min_pairs and len(b) >= min_pairs:
                    ratios.append(float(a.median() / b.median()))
                    weights.append(len(a))
    if not ratios:
        return 1.0, 0
    order = np.argsort(ratios)
    cw = np.cumsum(np.asarray(weights)[order])
    med = float(np.asarray(ratios)[order][np.searchsorted(cw, cw[-1] / 2)])
    return max(1.0, med), len(ratios)


# ---------------------------------------------------------------------------------------------
# link efficiencies and latencies from the network model
# ---------------------------------------------------------------------------------------------

def _network(topo: TopologySpec, n_gpus: int, lat_intra: float, lat_inter: float):
    """The simulator's network with ideal links, the given per-step latencies and no launch cost."""
    comm = CommModel(nvlink_efficiency=1.0, nic_efficiency=1.0, intra_node_latency_us=lat_intra,
                     inter_node_latency_us=lat_inter, launch_overhead_us=0.0)
    try:
        from simulator.network.fabric import FlowNetwork

        return FlowNetwork.from_topology(topo, n_gpus, nvlink_efficiency=1.0, nic_efficiency=1.0,
                                         intra_node_latency_us=lat_intra, inter_node_latency_us=lat_inter,
                                         launch_overhead_us=0.0)
    except (ImportError, UserError, TypeError):
        from simulator.network.alpha_beta import TierNetwork

        return TierNetwork(topo.node, comm)


def _group(fit: CollectiveFit, gpn: int) -> tuple[np.ndarray, int]:
    n = fit.group_size
    if fit.tier == "intra" or n <= 1:
        ids = np.arange(n)
    else:
        # Inter-node: spread over as few full nodes as hold it, as the sweeps place ranks.
        nodes = max(2, math.ceil(n / gpn))
        per = math.ceil(n / nodes)
        ids = np.concatenate([np.arange(per) + i * gpn for i in range(nodes)])[:n]
    if fit.collective == "send_recv" and n > 2:
        # nccl-tests' sendrecv (and the capture's, simulator.capture.collectives): every rank
        # sends to the next in the ring and receives from the previous, all at once: n pairs.
        return np.stack([ids, np.roll(ids, -1)], axis=1), int(ids.max()) + 1
    return ids[None, :], max(int(ids.max()) + 1 if n else 1, 1)


def derive_link_model(fits: list[CollectiveFit], topo: TopologySpec, notes: Notes | None = None) -> dict:
    """nvlink/nic efficiency and per-step latencies that make the simulator's network reproduce
    the fitted curves: efficiency from the largest messages (bandwidth part), latencies by
    non-negative least squares over every fit's alpha = launch + steps_intra x a_i + steps_inter x a_e."""
    from scipy.optimize import nnls

    gpn = topo.node.gpus_per_node
    eff: dict[str, list[float]] = {"intra": [], "inter": []}
    rows, rhs = [], []
    for f in fits:
        op = f.collective
        groups, n_gpus = _group(f, gpn)
        if f.tier == "intra" and f.group_size > gpn:
            continue
        try:
            s_big = float(max(f.table_bytes))
            req = CollectiveRequest(op, "dp", groups, s_big)
            ideal = _network(topo, n_gpus, 0.0, 0.0).collective_time_s(req)
            req0 = CollectiveRequest(op, "dp", groups, 1e-9)
            units_i = _network(topo, n_gpus, 1.0, 0.0).collective_time_s(req0) * 1e6
            units_e = _network(topo, n_gpus, 0.0, 1.0).collective_time_s(req0) * 1e6
        except (UserError, ValueError) as exc:
            if notes is not None:
                notes.add(f"cannot map {op} x {f.group_size} ({f.tier}) onto topology {topo.name!r}: {exc}")
            continue
        measured_bw_s = (float(f.time_us(s_big)) - f.alpha_us) * 1e-6
        if ideal > 0 and measured_bw_s > 0:
            eff[f.tier].append(ideal / measured_bw_s)
        rows.append([1.0, units_i, units_e])
        rhs.append(f.alpha_us)
    out: dict = {"raw_efficiency": {k: (float(np.median(v)) if v else None) for k, v in eff.items()}}
    if rows:
        A, b = np.asarray(rows), np.asarray(rhs)
        used = A.any(axis=0)
        sol = np.zeros(3)
        sol[used], _ = nnls(A[:, used], b)
        out["launch_overhead_us"] = float(sol[0])
        out["intra_node_latency_us"] = float(sol[1]) if used[1] else None
        out["inter_node_latency_us"] = float(sol[2]) if used[2] else None
    return out


# ---------------------------------------------------------------------------------------------
# assembling the profile
# ---------------------------------------------------------------------------------------------

def default_topology_name(device: str, backend: str | None) -> str:
    d = device.lower()
    if backend == "gloo" or d.startswith("cpu"):
        return "cpu-loopback"
    if "h100" in d or "h200" in d or "h800" in d:
        return "dgx-h100-fattree"
    return "dgx-a100-fattree"


def fit_host_overhead(profile: Profile, bundles: list[tuple[Path, object]]) -> tuple[float, str]:
    """The host time per modelled kernel that makes the simulated step times of train bundles
    match their measured medians (least squares over bundles; the step time is piecewise
    linear in it, so a few secant steps converge). 0 when the kernels alone already take longer."""
    from simulator.calibrate.validate import scenario_from_manifest, simulate_bundle_scenario

    cases = []
    for path, m in bundles:
        sc = scenario_from_manifest(m, "fitted-profile", None, path.name, profile)
        cases.append((sc, float(np.median([s.wall_s for s in m.step_times]))))

    from simulator.calibrate.validate import predicted_step_s

    def residual(x: float) -> float:
        p = profile.model_copy(update={"compute": profile.compute.model_copy(update={"host_overhead_us": x})})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = [predicted_step_s(simulate_bundle_scenario(sc, p)[2], sc.cluster.gpus, p)[0] / meas - 1.0 for sc, meas in cases]
        return float(np.mean(r))

    x0, r0 = 0.0, residual(0.0)
    if r0 >= 0:
        x = 0.0
    else:
        x1 = 100.0
        r1 = residual(x1)
        for _ in range(8):
            if r1 == r0:
                break
            x2 = max(0.0, x1 - r1 * (x1 - x0) / (r1 - r0))
            x0, r0, x1 = x1, r1, x2
            r1 = residual(x1)
            if abs(r1) < 1e-4:
                break
        x = x1
    detail = ", ".join(f"{p.name} ({np.median([s.wall_s for s in m.step_times]):.4g} s)" for p, m in bundles)
    return float(x), detail


def calibrate(
    paths: list[Path],
    name: str,
    base: str | Path | None = None,
    topology: str | Path | None = None,
    fit_host: bool = True,
    host_cores: int | None = None,
    notes: Notes | None = None,
    mesh=None,
    collective: str | None = None,
) -> Profile:
    """Fit a profile from the inputs. ``notes`` collects readable lines about low-confidence
    fits and substitutions (the CLI prints them); ``mesh`` (a placement.Mesh) tells collective
    groups that the traces do not record; ``collective`` names the collective of nccl-tests logs
    that do not say."""
    notes = notes if notes is not None else Notes()
    if not paths:
        raise UserError("calibrate needs at least one input: a trace bundle, a Kineto trace or an nccl-tests log")
    topo_pre = load_topology(topology) if topology else None
    src = read_sources([Path(p) for p in paths], topo_pre, mesh=mesh, collective=collective)
    _refuse_mixed_gpus(src)
    device = next((d for d in src.devices if d and d != "unknown"), None)
    backend = src.backends[0] if src.backends else None
    mem_gib = None
    if base:
        base_profile = load_profile(base)
        _refuse_base_of_another_gpu(base, base_profile, device)
    elif src.device_props:
        dp = src.device_props[0]
        match = identify_gpu(str(dp.get("name")), dp.get("totalGlobalMem"), dp.get("numSms"))
        base_profile, mem_gib = match.profile, match.memory_gib
        if match.note:
            notes.add(match.note)
        notes.add(f"GPU {dp.get('name')!r} identified as profile {base_profile.name!r} (its spec numbers are the base)")
    elif device and _is_gpu_name(device):
        base_profile = identify_gpu(device).profile
    elif device and device.startswith("GPU ") and "unnamed" in device:
        raise UserError(
            f"the traces do not name their GPU (no deviceProperties): pass --base PROFILE "
            f"(e.g. a100-sxm-80gb) so that fitted numbers can be checked against its spec")
    else:
        base_profile = None
    if src.device_props and mem_gib is None:
        mems = [d.get("totalGlobalMem") for d in src.device_props
                if isinstance(d.get("totalGlobalMem"), (int, float)) and not isinstance(d.get("totalGlobalMem"), bool)
                and math.isfinite(d.get("totalGlobalMem")) and d.get("totalGlobalMem") > 0]  # (corrupt entries: unknown)
        mem_gib = min(mems) / (1 << 30) if mems else None
    if device and device.startswith("GPU ") and "unnamed" in device and base_profile is not None:
        device = base_profile.device  # the trace does not name it; --base does
    device = device or (base_profile.device if base_profile else "unknown")
    topo = topo_pre or load_topology(default_topology_name(device, backend))
    items: list[ProvenanceItem] = []
    src_names = ", ".join(Path(r["path"]).name for r in src.records)

    # --- compute ---
    samples = pd.concat(src.compute, ignore_index=True) if src.compute else pd.DataFrame(
        columns=["op_class", "flops", "bytes", "time_us"])
    samples = samples[np.isfinite(samples["time_us"].to_numpy(float))]
    samples = _compute_dtype_samples(samples, base_profile, notes)
    fits: dict[str, ClassFit] = fit_compute(samples) if len(samples) else {}
    if not fits and base_profile is None:
        if src.compute and not len(samples):
            raise UserError(f"no compute ops with timings in {src_names}: the op table is empty; capture the compute or train workload")
        raise UserError(
            f"no compute ops with FLOPs or bytes in {src_names} and no --base profile for device {device!r}: "
            "add a compute/train bundle or pass --base"
        )
    if base_profile is not None:
        peak, hbm = base_profile.compute.peak_tflops, base_profile.compute.hbm_GBps
    else:
        flop_rates = [f.rates.max() * 1e6 / 1e12 for f in fits.values() if f.basis == "flops"]
        byte_rates = [f.rates.max() * 1e6 / 1e9 for f in fits.values() if f.basis == "bytes"]
        peak = float(max(flop_rates)) if flop_rates else 1.0
        hbm = float(max(byte_rates)) if byte_rates else 1.0
        items.append(ProvenanceItem(field="compute.peak_tflops", value=peak, source=f"best achieved FLOP rate of the captured ops ({src_names})"))
        items.append(ProvenanceItem(field="compute.hbm_GBps", value=hbm, source=f"best achieved byte rate of the captured ops ({src_names})"))
    classes: dict[str, OpClassModel] = {}
    for cls, f in fits.items():
        if base_profile is not None and _is_gpu_name(base_profile.device):
            sub = samples[samples["op_class"] == cls]
            limit = peak
            fp8 = base_profile.compute.peak_tflops_fp8
            if fp8 and "dtype" in sub and sub["dtype"].astype(str).str.startswith("float8").any():
                limit = fp8  # FP8 matrix work runs up to the FP8 tensor-core peak
            check_compute(cls, f, sub, limit, hbm, base_profile.device)
        if f.n_samples < FEW_SAMPLES:
            notes.add(f"{cls}: fitted on only {f.n_samples} ops: low confidence")
        if f.size_range[1] < 2.0 * f.size_range[0]:
            # (the classes `clustersim capture compute` times over a range of shapes: capture/compute.py)
            more = (": a compute bundle (clustersim capture compute --out traces/NAME) times a range of them"
                    if cls in ("gemm", "attention", "norm", "elementwise", "optimizer") else "")
            notes.add(f"{cls}: every fitted op has about {f.size_range[0]:.3g} {f.basis}: other sizes extrapolate flat "
                      f"from it{more}")
        classes[cls] = f.to_model(peak, hbm)
        items.append(ProvenanceItem(
            field=f"compute.classes.{cls}", value=f"{f.n_samples} ops, {f.basis} {f.size_range[0]:.3g}..{f.size_range[1]:.3g}",
            source=f"fitted on {src_names}; held-out median |error| {f.fit_error if f.fit_error is not None else 'n/a'}",
        ))
    for cls in OP_CLASSES:
        if cls in classes:
            continue
        if base_profile is not None and cls in base_profile.compute.classes:
            classes[cls] = base_profile.compute.classes[cls]
            measured = src.unsized.get(cls)
            why = (f"the trace measured {measured[0] / 1e3:.4g} ms in {measured[1]} kernels of it, without FLOPs or bytes"
                   if measured else "no ops of this class with FLOPs or bytes were captured")
            items.append(ProvenanceItem(field=f"compute.classes.{cls}", value="from base",
                                        source=f"base profile {base_profile.name}: {why}"))
            if measured:
                notes.add(f"{cls}: {measured[0] / 1e3:.4g} ms measured in {measured[1]} kernels whose ops carry no FLOPs or bytes "
                          f"(no shapes, or shapes that do not tell): kept {base_profile.name}'s spec model for it")
            continue
        km = base_profile.compute.kernels if base_profile is not None else None
        if km is not None and cls in km.mem_efficiency and cls not in fits:
            # Spec profiles time memory-bound classes by shape (compute.kernels), not by a class
            # curve: the same bytes-only cost as a curve, from the base's kernel model.
            classes[cls] = OpClassModel(bandwidth_efficiency=km.mem_efficiency[cls], overhead_us=km.launch_floor_us, basis="bytes")
            items.append(ProvenanceItem(field=f"compute.classes.{cls}", value="from base kernel model",
                                        source=f"base profile {base_profile.name}: compute.kernels.mem_efficiency.{cls} and launch_floor_us "
                                               "(no ops of this class were captured)"))
            continue
        # Nothing captured: borrow the closest fitted class (memory-bound ones from each other).
        order = ("elementwise", "norm", "optimizer", "other", "gemm", "attention") if cls not in ("gemm", "attention") else (
            "gemm", "attention", "elementwise", "norm", "optimizer", "other")
        donor = next(c for c in order if c in fits)
        classes[cls] = fits[donor].to_model(peak, hbm).model_copy(update={"fit_error": None})
        items.append(ProvenanceItem(field=f"compute.classes.{cls}", value=f"copy of {donor}", source="no ops of this class were captured"))
    overlap, n_shapes = fit_overlap(src.traces)
    if n_shapes == 0 and base_profile is not None:
        overlap = base_profile.compute.overlap_slowdown
    items.append(ProvenanceItem(field="compute.overlap_slowdown", value=overlap,
                                source=f"{n_shapes} op shapes timed with and without a concurrent collective" if n_shapes else "unknown (no overlapped ops): 1.0 or the base's value"))
    cores = host_cores if host_cores else _capture_host_cores(device, src)
    if cores:
        items.append(ProvenanceItem(field="compute.host_cores", value=cores,
                                    source="--host-cores" if host_cores else "cores of this machine, where the bundles were captured (os.cpu_count)"))
    # Per-class slowdown of compute kernels under NCCL kernels, like-for-like signatures only.
    trace_sms = next((int(d["numSms"]) for d in src.device_props if isinstance(d.get("numSms"), int) and d["numSms"] > 0),
                     None)
    sms = trace_sms or (base_profile.compute.sm_count if base_profile is not None else None)
    overlap_fits = measure_overlap(src.traces, sms)
    for line in overlap_lines(overlap_fits):
        notes.add(line)
    for cls, f in overlap_fits.items():
        items.append(ProvenanceItem(field=f"compute.overlap_fits.{cls}", value=round(f.slowdown, 4),
                                    source=f"{f.overlapped_kernels} kernels of {f.signatures} signatures timed under NCCL kernels "
                                           f"and alone ({'confident' if f.confident else 'low confidence: reported, not used'})"))
    # The device's own numbers (SMs, tensor-core dtypes and their peaks) are facts about the chip,
    # not fits: a calibrated profile keeps them, or FP8 scenarios, wave quantization and the
    # contention law (all of which need them) would fall back to guesses on a fitted profile.
    device_facts = {}
    if base_profile is not None:
        device_facts = base_profile.compute.model_dump(include={"bf16", "peak_tflops_fp8", "peak_tflops_fp32",
                                                                "peak_tflops_mxfp8", "fp8_non_tn_gemm"})
        for k, v in device_facts.items():
            if v is not None:
                items.append(ProvenanceItem(field=f"compute.{k}", value=v, source=f"base profile {base_profile.name!r}"))
    if sms:
        items.append(ProvenanceItem(field="compute.sm_count", value=sms, source="the traces' deviceProperties numSms"
                                    if trace_sms else f"base profile {base_profile.name!r}"))
    compute = ComputeModel(peak_tflops=peak, hbm_GBps=hbm, classes=classes, overlap_slowdown=overlap, host_cores=cores,
                           overlap_fits=overlap_fits, sm_count=sms, **device_facts)

    # --- communication ---
    comm_samples = pd.concat(src.comm, ignore_index=True) if src.comm else pd.DataFrame(columns=["collective", "group_size", "tier", "size_bytes", "time_us"])
    # Physics bounds apply to GPUs with a spec; a CPU "device" has nominal links only.
    physics = base_profile is not None and _is_gpu_name(base_profile.device)
    link_bw = {"intra": topo.node.nvlink_GBps} if physics else None
    cfits = fit_collectives(comm_samples, source=src_names, max_busbw_GBps=link_bw) if len(comm_samples) else []
    base_comm = base_profile.comm if base_profile is not None else CommModel(
        nvlink_efficiency=1.0, nic_efficiency=1.0, intra_node_latency_us=topo.node.nvlink_latency_us,
        inter_node_latency_us=topo.node.nic_latency_us, launch_overhead_us=0.0)
    comm_kw = base_comm.model_dump(exclude={"collectives"})
    if cfits:
        for f in cfits:
            lim = topo.node.nvlink_GBps if f.tier == "intra" else topo.node.nic_GBps_per_gpu
            if physics:
                check_collective(f, lim, f.tier, topo.name, notes)
            # Only kernel times from GPU traces hide waits for peers: nccl-tests times do not (a
            # 2-node EFA all-reduce really takes ~150 us at small sizes), nor is gloo's latency NCCL's.
            if f.alpha_us > ALPHA_SUSPECT_US and physics and src.traces and not src.nccl_tests:
                notes.add(f"{f.collective} x{f.group_size} ({f.tier}): fitted latency {f.alpha_us:.4g} us is far above NCCL's "
                          f"launch and hop latencies (~10-50 us): the calls likely still include waiting for peers")
        link = derive_link_model(cfits, topo, notes)
        for tier, key, link_name in (("intra", "nvlink_efficiency", "nvlink_GBps"), ("inter", "nic_efficiency", "nic")):
            raw = link["raw_efficiency"][tier]
            if raw is None:
                if base_profile is None:
                    items.append(ProvenanceItem(field=f"comm.{key}", value=comm_kw[key],
                                                source=f"not fitted: no {tier}-node collective was measured; 1.0 leaves the "
                                                       f"topology's {link_name} as given"))
                continue
            offered_GBps = topo.node.nic_GBps_per_gpu if tier == "inter" else topo.node.nvlink_GBps
            if raw > 1.0:
                notes.add(
                    f"measured {tier}-node bandwidth is {raw:.2f}x what topology {topo.name!r} allows; efficiency capped at 1 "
                    f"(pass --topology with the real {link_name}, or rely on the fitted per-collective curves)")
            elif raw < LOW_EFFICIENCY and topo.node.kind == "cpu-host":
                # The CPU topology's bandwidths are placeholders (cpu-loopback.yaml): the fitted
                # efficiency is how the host's own rate gets into the profile, nothing to fix.
                notes.add(f"{key} {raw:.2f}: this host's {tier}-node transfers reach {raw:.0%} of the placeholder "
                          f"{offered_GBps:.4g} GB/s a rank of "
                          f"topology {topo.name!r}; the profile carries the measured rate")
            elif raw < LOW_EFFICIENCY:
                logs = [r for r in src.nccl_tests]
                what = f" ({', '.join(Path(r['path']).name for r in logs)})" if logs else ""
                notes.add(
                    f"{'nic' if tier == 'inter' else 'nvlink'}_efficiency {raw:.2f}: the measured {tier}-node bandwidth{what} is "
                    f"{raw:.0%} of what topology {topo.name!r} offers "
                    f"({offered_GBps:.4g} GB/s per GPU): the inputs "
                    "likely ran on another fabric (or the topology models it poorly); pass --topology matching it")
            comm_kw[key] = float(min(1.0, max(raw, 1e-6)))
            items.append(ProvenanceItem(field=f"comm.{key}", value=comm_kw[key],
                                        source=f"large-message bus bandwidth of {src_names} through topology {topo.name!r} (raw {raw:.3f})"))
        for key in ("launch_overhead_us", "intra_node_latency_us", "inter_node_latency_us"):
            if link.get(key) is not None:
                comm_kw[key] = link[key]
                items.append(ProvenanceItem(field=f"comm.{key}", value=link[key], source=f"least squares over fitted alphas of {src_names}"))
        for f in cfits:
            items.append(ProvenanceItem(
                field=f"comm.collectives[{f.collective},{f.group_size},{f.tier}]",
                value=f"alpha {f.alpha_us:.1f} us, large-message busbw {large_message_busbw(f):.3g} GB/s",
                source=f"fitted on {src_names}; held-out median |error| {f.fit_error if f.fit_error is not None else 'n/a'}"))
    elif base_profile is None:
        items.append(ProvenanceItem(field="comm", value="topology defaults", source=f"no collectives captured; latencies from topology {topo.name!r}"))
    comm = CommModel(**comm_kw, collectives=cfits)
    if src.nccl_logs:
        from simulator.calibrate.nccl_fit import calibrate_nccl

        ncal, nitems = calibrate_nccl(src.nccl_logs, topo, device, hbm, note=notes.add, collective=src.nccl_collective)
        if ncal is not None:
            comm = comm.model_copy(update={"nccl": ncal})
            items += nitems

    if mem_gib is not None:
        items.append(ProvenanceItem(field="hbm_gib", value=round(mem_gib, 2),
                                    source="deviceProperties.totalGlobalMem of the traced GPU"))
    elif base_profile is None:
        items.append(ProvenanceItem(field="hbm_gib", value=_host_memory_gib(device),
                                    source="nominal, not measured: the bundles do not record the device's memory"))
    if base_profile is None:
        items.append(ProvenanceItem(field="usable_memory_fraction", value=DEFAULT_USABLE_MEMORY_FRACTION,
                                    source="calibrate's default for a profile without a base, as the GPU spec profiles "
                                           "(judgement: 5% kept for allocator fragmentation)"))
    prof_kw = dict(
        name=name,
        device=device,
        hbm_gib=round(mem_gib, 2) if mem_gib is not None else (base_profile.hbm_gib if base_profile is not None else _host_memory_gib(device)),
        usable_memory_fraction=base_profile.usable_memory_fraction if base_profile is not None else DEFAULT_USABLE_MEMORY_FRACTION,
        compute=compute,
        comm=comm,
    )
    if src.train_bundles and fit_host:
        host, detail = fit_host_overhead(Profile(**prof_kw, provenance=Provenance(method="fitted", created="", items=[])),
                                         src.train_bundles)
        compute = compute.model_copy(update={"host_overhead_us": host})
        items.append(ProvenanceItem(field="compute.host_overhead_us", value=host,
                                    source=f"makes the simulated step time match the measured median step time of {detail}"))

    method = "fitted" if base_profile is None else "mixed"
    for line in src.notes:
        notes.add(line)
    prov_notes = [f"fitted by clustersim calibrate from {len(src.records)} source(s); topology for link efficiencies: {topo.name}"]
    prov_notes += notes.lines
    if base_profile is not None:
        prov_notes.append(f"unfitted numbers from base profile {base_profile.name!r}")
    return Profile(
        **{**prof_kw, "compute": compute},
        provenance=Provenance(method=method, created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                              items=items, bundles=src.records, notes="; ".join(prov_notes)),
    )


# A collective latency above this is not launch + hops; it is waiting left in the samples.
ALPHA_SUSPECT_US = 100.0
# usable_memory_fraction of a profile fitted without a base: judgement (5% kept for allocator
# fragmentation), the figure the GPU spec profiles carry; no measured source.
DEFAULT_USABLE_MEMORY_FRACTION = 0.95
# A link efficiency below this says the inputs and the topology describe different fabrics.
LOW_EFFICIENCY = 0.5
# Only 16-bit (and 8-bit) matrix work sets the tensor-core curves the simulator uses; FP32 GEMMs
# run on the FP32/TF32 pipes at a fraction of peak_tflops.
_TENSOR_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def _refuse_mixed_gpus(src: "Sources") -> None:
    """One profile describes one GPU: inputs that name different GPU models (an H100 trace with an
    A100 nccl-tests log) would fit one system's compute with another's collectives."""
    from simulator.calibrate.physics import gpu_model

    by_model: dict[str, list[str]] = {}
    for rec in src.records:
        for d in rec.get("devices") or []:
            m = gpu_model(str(d))
            if m is not None:
                by_model.setdefault(m, []).append(Path(str(rec["path"])).name)
    if len(by_model) > 1:
        listed = "; ".join(f"{m.upper()} ({', '.join(sorted(set(files))[:3])})" for m, files in sorted(by_model.items()))
        raise UserError(f"the inputs measured different GPUs: {listed}: calibrate one system at a time")


def _refuse_base_of_another_gpu(base, base_profile: Profile, device: str | None) -> None:
    """--base supplies what the inputs do not measure (peaks, HBM, SMs): of the measured GPU only."""
    from simulator.calibrate.physics import gpu_model

    measured, based = (gpu_model(device) if device else None), gpu_model(base_profile.device)
    if measured is not None and based is not None and measured != based:
        raise UserError(f"--base {str(base)!r} describes {base_profile.device!r} but the inputs measured {device!r}: "
                        f"give a base profile of the {measured.upper()} (or leave --base out to pick it from the inputs)")


def _is_gpu_name(name: str) -> bool:
    from simulator.calibrate.physics import _model_and_form

    return _model_and_form(name)[0] is not None


def _compute_dtype_samples(samples: pd.DataFrame, base: Profile | None, notes: Notes) -> pd.DataFrame:
    """Keep the FLOP-class samples in the dtypes the simulator's peak_tflops refers to (16-bit
    tensor-core math). A class traced only in float32 is not fitted (its spec model stays) and
    said so: an FP32 curve at ~5% of the BF16 peak would set every BF16 GEMM."""
    if "dtype" not in samples or base is None:
        return samples
    keep = np.ones(len(samples), dtype=bool)
    cls = samples["op_class"].astype(str).to_numpy()
    dt = samples["dtype"].astype(object).to_numpy()
    fl = samples["flops"].to_numpy(float)
    for c in ("gemm", "attention"):
        sel = (cls == c) & np.isfinite(fl) & (fl > 0)
        if not sel.any():
            continue
        tensor = sel & np.isin(dt, _TENSOR_DTYPES)
        if tensor.any():
            keep &= ~(sel & ~tensor)
            continue
        found = sorted({str(x) for x in dt[sel] if x is not None}) or ["unknown dtype"]
        keep &= ~(cls == c)
        notes.add(f"{c}: the {int(sel.sum())} {c} ops with FLOPs are {', '.join(found)}, not 16-bit tensor-core math: "
                  f"a curve from them would not hold for bf16 work; kept {base.name}'s spec model")
    return samples[keep]


def _capture_host_cores(device: str, src: Sources) -> int | None:
    """CPU ranks share their host's cores. Bundles do not record the core count, so it is known
    only when they were captured on this machine (or given with --host-cores)."""
    import os
    import socket

    if not device.lower().startswith("cpu"):
        return None
    hosts = {h for r in src.records for h in (r.get("hosts") or [])}
    if hosts == {socket.gethostname()}:
        return os.cpu_count()
    warnings.warn(
        f"CPU bundles from host(s) {sorted(hosts) or '?'} (not this machine): their core count is unknown; "
        "pass --host-cores to model ranks sharing cores", stacklevel=3)
    return None


def _host_memory_gib(device: str) -> float:
    # A CPU "device" has the host's memory; a bundle does not record it, so a nominal value.
    return 64.0 if device.lower().startswith("cpu") else 80.0
