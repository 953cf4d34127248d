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
from simulator.network.base import CollectiveRequest
from simulator.topology.spec import TopologySpec, load_topology

# compute.parquet 'op' -> op class (the names simulator.workload.ops gives the same work).
COMPUTE_OP_CLASS = {
    "gemm": "gemm", "sdpa": "attention", "attention": "attention", "layernorm": "norm", "rmsnorm": "norm",
    "gelu": "elementwise", "swiglu": "elementwise", "cross_entropy": "elementwise", "softmax": "elementwise",
    "adamw": "optimizer", "adam": "optimizer",
}
_NCCL_TESTS_SUFFIXES = (".txt", ".log", ".out")
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

def read_sources(paths: list[Path], topology: TopologySpec | None) -> Sources:
    src = Sources()
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise UserError(f"calibration input {str(p)!r} does not exist: give trace bundles, Kineto traces or nccl-tests logs")
        if p.is_dir():
            _read_dir(p, src, topology)
        elif p.name.endswith((".json", ".json.gz")):
            _read_traces(p, src, topology, record=_files_record(p, [p]))
        elif p.suffix in _NCCL_TESTS_SUFFIXES or p.suffix == "":
            _read_nccl_tests(p, src, topology)
        else:
            raise UserError(
                f"calibration input {str(p)!r} is neither a bundle folder, a Kineto .json/.json.gz trace nor an nccl-tests log (.txt/.log)"
            )
    return src


def _read_dir(p: Path, src: Sources, topology: TopologySpec | None) -> None:
    from simulator.trace.bundle import MANIFEST_NAME, load_manifest

    if not (p / MANIFEST_NAME).exists():
        # A folder of per-rank Kineto files from one job (load_trace says what is wrong otherwise).
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz")))
        _read_traces(p, src, topology, record=_files_record(p, files))
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
        t = pd.read_parquet(p / "compute.parquet")
        cls = t["op"].map(COMPUTE_OP_CLASS)
        unknown = sorted(set(t.loc[cls.isna(), "op"]))
        if unknown:
            src.notes.append(f"{p.name}/compute.parquet: ops {', '.join(unknown)} have no op class and were skipped")
        t = t[cls.notna()]
        src.compute.append(pd.DataFrame({"op_class": cls[cls.notna()], "flops": t["flops"], "bytes": t["bytes"],
                                         "time_us": t["time_us"]}))
        used_table = True
    if (p / "collectives.parquet").exists():
        t = pd.read_parquet(p / "collectives.parquet")
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
        _read_traces(p, src, topology, record=None, ranks_per_host=ranks_per_host, default_group=default_group)


def _read_traces(p: Path, src: Sources, topology: TopologySpec | None, record: dict | None,
                 ranks_per_host: int | None = None, default_group: int | None = None) -> None:
    from simulator.trace.loader import load_trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = load_trace(p)
    ops = ts.ops
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
    cls = comp["op_class"].astype(str).to_numpy()
    # The importer counts the whole score matrix of an attention op; the workload's exec FLOPs
    # (and the compute sweep) count the causal half that fused kernels compute. Training traces
    # are causal decoders.
    scale = np.where(cls == "attention", CAUSAL_FRACTION, 1.0)
    src.compute.append(pd.DataFrame({"op_class": cls, "flops": comp["flops"].to_numpy(float) * scale,
                                     "bytes": comp["bytes"].to_numpy(float),
                                     "time_us": comp["dur_us"].to_numpy(float)}))
    coll = collectives_from_ops(ops, default_group)
    if len(coll):
        if ranks_per_host is None:
            gpn = topology.node.gpus_per_node if topology else 8
            ranks_per_host = gpn
        coll["tier"] = np.where(coll["group_size"] <= ranks_per_host, "intra", "inter")
        src.comm.append(coll[["collective", "group_size", "tier", "size_bytes", "time_us"]])
        if ops["rank"].nunique() == 1:
            src.notes.append(f"{p.name}: one rank only, so collective times include waiting for peers (upper bounds)")


def _read_nccl_tests(p: Path, src: Sources, topology: TopologySpec | None) -> None:
    from simulator.trace.nccl_tests import import_nccl_tests

    res = import_nccl_tests(p)
    t = res.table
    if t.empty:
        raise UserError(f"nccl-tests log {str(p)!r} has no result rows: give the complete output of an nccl-tests run")
    n = int(res.nranks or t["nranks"].dropna().max())
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
        return np.arange(n)[None, :], max(n, 1)
    # Inter-node: spread over as few full nodes as hold it, as the sweeps place ranks.
    nodes = max(2, math.ceil(n / gpn))
    per = math.ceil(n / nodes)
    ids = np.concatenate([np.arange(per) + i * gpn for i in range(nodes)])[:n]
    return ids[None, :], int(ids.max()) + 1


def derive_link_model(fits: list[CollectiveFit], topo: TopologySpec) -> dict:
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
            warnings.warn(f"cannot map {op} x {f.group_size} ({f.tier}) onto topology {topo.name!r}: {exc}", stacklevel=2)
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
    if "h100" in d or "h200" in d:
        return "dgx-h100-fattree"
    return "dgx-a100-fattree"


def _default_base(device: str) -> Profile | None:
    d = device.lower()
    if "h100" in d or "h200" in d:
        return load_profile("h100-sxm-80gb")
    if "a100" in d:
        return load_profile("a100-sxm-80gb")
    return None


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
) -> Profile:
    if not paths:
        raise UserError("calibrate needs at least one input: a trace bundle, a Kineto trace or an nccl-tests log")
    topo_pre = load_topology(topology) if topology else None
    src = read_sources([Path(p) for p in paths], topo_pre)
    device = next((d for d in src.devices if d and d != "unknown"), None)
    backend = src.backends[0] if src.backends else None
    base_profile = load_profile(base) if base else (_default_base(device) if device else None)
    device = device or (base_profile.device if base_profile else "unknown")
    topo = topo_pre or load_topology(default_topology_name(device, backend))
    items: list[ProvenanceItem] = []
    src_names = ", ".join(Path(r["path"]).name for r in src.records)

    # --- compute ---
    samples = pd.concat(src.compute, ignore_index=True) if src.compute else pd.DataFrame(
        columns=["op_class", "flops", "bytes", "time_us"])
    samples = samples[np.isfinite(samples["time_us"].to_numpy(float))]
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
            items.append(ProvenanceItem(field=f"compute.classes.{cls}", value="from base", source=f"base profile {base_profile.name}"))
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
    compute = ComputeModel(peak_tflops=peak, hbm_GBps=hbm, classes=classes, overlap_slowdown=overlap, host_cores=cores)

    # --- communication ---
    comm_samples = pd.concat(src.comm, ignore_index=True) if src.comm else pd.DataFrame(columns=["collective", "group_size", "tier", "size_bytes", "time_us"])
    cfits = fit_collectives(comm_samples, source=src_names) if len(comm_samples) else []
    base_comm = base_profile.comm if base_profile is not None else CommModel(
        nvlink_efficiency=1.0, nic_efficiency=1.0, intra_node_latency_us=topo.node.nvlink_latency_us,
        inter_node_latency_us=topo.node.nic_latency_us, launch_overhead_us=0.0)
    comm_kw = base_comm.model_dump(exclude={"collectives"})
    if cfits:
        link = derive_link_model(cfits, topo)
        for tier, key, link_name in (("intra", "nvlink_efficiency", "nvlink_GBps"), ("inter", "nic_efficiency", "nic")):
            raw = link["raw_efficiency"][tier]
            if raw is None:
                continue
            if raw > 1.0:
                warnings.warn(
                    f"measured {tier}-node bandwidth is {raw:.2f}x what topology {topo.name!r} allows; efficiency capped at 1 "
                    f"(raise the topology's {link_name} or use the fitted per-collective curves)", stacklevel=2)
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

    prof_kw = dict(
        name=name,
        device=device,
        hbm_gib=base_profile.hbm_gib if base_profile is not None else _host_memory_gib(device),
        usable_memory_fraction=base_profile.usable_memory_fraction if base_profile is not None else 0.95,
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
    notes = [f"fitted by clustersim calibrate from {len(src.records)} source(s); topology for link efficiencies: {topo.name}"]
    notes += src.notes
    if base_profile is not None:
        notes.append(f"unfitted numbers from base profile {base_profile.name!r}")
    return Profile(
        **{**prof_kw, "compute": compute},
        provenance=Provenance(method=method, created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                              items=items, bundles=src.records, notes="; ".join(notes)),
    )


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
