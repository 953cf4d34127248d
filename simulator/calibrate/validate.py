"""``clustersim validate BUNDLE --profile P``: simulate what a bundle captured and compare.

The bundle's manifest records the scenario its `train` workload ran (model, parallelism, batch,
schedule, dtype). It becomes a Scenario on ``world_size`` devices of profile P, on the bundle's
kind of host (``cpu-loopback`` for gloo/CPU captures), is simulated, and is compared with what
the bundle measured:

- step time: the median over the measured steps (manifest step_times) against the prediction;
- per op class: time per step of each class on a rank (mean over ranks), measured from the
  trace's ops, predicted from the workload's ops under P;
- per collective: time per step a rank spends in each collective (mean over ranks), measured
  from the trace's collective spans, predicted from the simulated timeline. Both include waiting
  for peers, so they compare like with like.

Errors are signed fractions: (predicted - measured) / measured.
"""

from __future__ import annotations

import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import pandas as pd
import typer

from simulator.contention import measured_excess_scale
from simulator.profile import OP_CLASSES, OpClassModel, Profile, load_profile
from simulator.errors import UserError, path_exists
from simulator.textsafe import for_rich
from simulator.vocabulary import COMM_STREAMS, Stream

# Capture schedule names (simulator.capture.spec.SCHEDULES) -> simulator schedule names.
_SCHEDULE_ALIASES = {"interleaved-zb": "zb-h1"}
# Streams whose rows are communication (dp-ag excluded: parameter gathers are not compared; under
# FSDP2's one communicator they share the dp stream, so they are also told apart by name).
_COMM_STREAMS = tuple(s.value for s in COMM_STREAMS if s is not Stream.DP_AG)
_PARAM_GATHER_PREFIX = "all_gather params"  # the plan's ZeRO/FSDP parameter gathers (plan._plan_rank)


def _topology_for(manifest, profile: Profile) -> str:
    from simulator.calibrate.fit import default_topology_name

    device = manifest.devices[0] if manifest.devices else profile.device
    return default_topology_name(device, manifest.backend)


def scenario_from_manifest(manifest, profile_path: str, topology: str | None, name: str, profile: Profile) -> "Scenario":  # noqa: F821
    from simulator.scenario import build_scenario

    sc = manifest.scenario
    if not sc:
        raise UserError(
            f"bundle {name!r} records no scenario (workload {manifest.workload!r}): validate needs a bundle of the train workload"
        )
    data: dict[str, Any] = json.loads(json.dumps(sc))
    model = dict(data.get("model", {}))
    model.setdefault("name", name)
    if model.get("num_experts", 0) <= 1:
        # The capture writes a dense model as 0 or 1 experts; the simulator's dense model has 0.
        model["num_experts"], model["top_k"] = 0, 0
    data["model"] = model
    sched = data.get("schedule", "1f1b")
    data["schedule"] = _SCHEDULE_ALIASES.get(sched, sched)
    data.setdefault("name", name)
    data["cluster"] = {"gpus": manifest.world_size, "gpu": profile_path, "topology": topology or _topology_for(manifest, profile)}
    # torch's scaled_dot_product_attention runs a fused (flash) kernel on CPU and GPU alike.
    data.setdefault("flash_attention", True)
    if manifest.trace_files and len(manifest.trace_files) != manifest.world_size:
        raise UserError(f"bundle {name!r}: its manifest.json says world_size {manifest.world_size} but lists "
                        f"{len(manifest.trace_files)} rank traces: fix manifest.json or re-capture the bundle")
    try:
        return build_scenario(data)
    except UserError as exc:
        # (its own fix names flags; what is wrong here is the file)
        raise UserError(f"bundle {name!r}: the scenario its manifest.json records is refused ({exc}): fix manifest.json "
                        "or re-capture the bundle") from None


def _free_class() -> OpClassModel:
    """A class model whose ops cost (next to) nothing: isolates the other classes' time."""
    return OpClassModel(peak_efficiency=1.0, half_efficiency_flops=0.0, bandwidth_efficiency=1.0, overhead_us=0.0,
                        table_flops=[1.0], table_tflops=[1e12], table_bytes=[1.0], table_GBps=[1e15])


def _rank_compute_s(prog, rank_pp: int) -> float:
    sched = prog.schedule
    total = 0.0
    for a in sched.actions[rank_pp]:
        for sub in a.leaves:
            total += prog.segments[(sched.stage_position[sub.stage], sub.kind)].total_compute_s
    return total + prog.optimizer_s


def predicted_class_times(sc, profile: Profile, schedule) -> dict[str, float]:
    """Seconds per step per rank (mean over pipeline ranks) of each op class."""
    from simulator.workload.program import build_program

    if profile.compute.kernels is not None or sc.implementation == "hf-eager":
        # Shape-timed ops do not go through the class curves: sum the ops' own times per class.
        out = predicted_op_classes(sc, profile, schedule)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = build_program(sc, profile, schedule)
        out["optimizer"] = out.get("optimizer", 0.0) + prog.optimizer_s
        return {c: v for c, v in out.items() if c in OP_CLASSES}
    out = {}
    for cls in OP_CLASSES:
        # Kernel time only: the measured per-class times are op durations, which do not hold
        # the host overhead between ops (reported on its own).
        classes = {c: (m if c == cls else _free_class()) for c, m in profile.compute.classes.items()}
        if cls not in classes:
            continue
        p = profile.model_copy(update={"compute": profile.compute.model_copy(update={"classes": classes, "host_overhead_us": 0.0})})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog = build_program(sc, p, schedule)
        out[cls] = float(np.mean([_rank_compute_s(prog, r) for r in range(schedule.num_ranks)]))
    return out


def simulate_bundle_scenario(sc, profile: Profile):
    """simulate() with the profile's fitted collective curves in front of the network."""
    from simulator.calibrate.network import FittedNetwork
    from simulator.engine.core import Engine
    from simulator.simulate import make_network, resolve_schedule
    from simulator.topology import load_topology
    from simulator.workload.program import build_program

    topo = load_topology(sc.cluster.topology)
    sched = resolve_schedule(sc)
    prog = build_program(sc, profile, sched)
    net = FittedNetwork(make_network(sc, topo, profile), profile.comm, topo.node.gpus_per_node)
    tl = Engine(prog, net, mode="reduced", sm_count=profile.compute.sm_count,
                contention_scale=measured_excess_scale(profile.compute.overlap_fits, profile.compute.sm_count)).run()
    return prog, sched, tl


def measured_times(ops: pd.DataFrame, n_steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """(op class -> s per step per rank, collective -> s per step per rank), means over ranks."""
    if "step" in ops and (ops["step"] >= 0).any():
        ops = ops[ops["step"] >= 0]
        n_steps = max(1, ops["step"].nunique())
    ranks = max(1, ops["rank"].nunique())
    comp = ops[ops["op_class"].isin(OP_CLASSES)]
    cls = (comp.groupby(comp["op_class"].astype(str))["dur_us"].sum() * 1e-6 / n_steps / ranks).to_dict()
    comm = ops[(ops["op_class"] == "communication") & ops["collective"].notna()]
    comm = comm[~comm["collective"].astype(str).isin(("barrier", "wait"))]
    coll = (comm.groupby(comm["collective"].astype(str))["dur_us"].sum() * 1e-6 / n_steps / ranks).to_dict()
    return {k: float(v) for k, v in cls.items()}, {k: float(v) for k, v in coll.items()}


def predicted_collective_times(tl) -> dict[str, float]:
    ev = tl.events
    ev = ev[ev["stream"].isin(_COMM_STREAMS) & ~ev["name"].astype(str).str.startswith(_PARAM_GATHER_PREFIX)]
    if ev.empty:
        return {}
    op = ev["name"].astype(str).str.split(" ", n=1).str[0]
    dur = ev["end_s"] - ev["start_s"]
    n = max(1, len(tl.ranks))
    return {str(k): float(v) / n for k, v in dur.groupby(op).sum().items()}


def predicted_step_s(tl, world_size: int, profile: Profile) -> tuple[float, float | None]:
    """(step time, host-bound time or None). The engine gives every rank a device of its own;
    ranks that share a host's cores (profile host_cores) cannot finish a step faster than their
    total compute over those cores, however the pipeline idles them."""
    cores = profile.compute.host_cores
    if not cores:
        return float(tl.step_time_s), None
    # In reduced mode one rank per pipeline rank is simulated; the others run the same program.
    work = sum(tl.busy_compute_s.values()) * world_size / max(1, len(tl.ranks))
    bound = work / min(cores, world_size)
    return max(float(tl.step_time_s), bound), bound


def _err(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or not meas:
        return None
    return (pred - meas) / meas


def validate_bundle(bundle: str | Path, profile: str | Path, topology: str | None = None) -> dict[str, Any]:
    """Compare a bundle's measurements with the simulation of its scenario; returns one dict."""
    from simulator.trace.bundle import MANIFEST_NAME, load_manifest
    from simulator.trace.loader import load_trace

    bundle = Path(bundle)
    if not bundle.exists():
        raise UserError(f"bundle {str(bundle)!r} does not exist: give a trace bundle folder written by 'clustersim capture'")
    if not bundle.is_dir() or not (bundle / MANIFEST_NAME).exists():
        raise UserError(f"{str(bundle)!r} is not a trace bundle (no {MANIFEST_NAME}): give a folder written by 'clustersim capture "
                        f"train', or add --scenario S.yaml (the model, layout and batch it measured) for Kineto traces")
    manifest = load_manifest(bundle)
    prof = load_profile(profile)
    prof_path = str(Path(profile).resolve()) if Path(profile).suffix == ".json" else str(profile)
    sc = scenario_from_manifest(manifest, prof_path, topology, bundle.name, prof)
    if not manifest.step_times:
        raise UserError(f"bundle {str(bundle)!r} records no step times: re-capture it with --steps 1 or more")
    measured_step = float(np.median([s.wall_s for s in manifest.step_times]))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog, sched, tl = simulate_bundle_scenario(sc, prof)
        pred_cls = predicted_class_times(sc, prof, sched)
    extrapolated = sorted({str(w.message) for w in caught if "outside the fitted range" in str(w.message)})
    for msg in extrapolated:
        warnings.warn(msg, stacklevel=2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = load_trace(bundle)
    if ts.ops.empty:
        raise UserError(f"bundle {str(bundle)!r} holds no ops with timings: re-capture it")
    meas_cls, meas_coll = measured_times(ts.ops, len(manifest.step_times))
    pred_coll = predicted_collective_times(tl)

    def block(meas: dict, pred: dict, keys) -> dict:
        return {k: {"measured_time_s": meas.get(k), "predicted_time_s": pred.get(k), "error": _err(pred.get(k), meas.get(k))}
                for k in keys}

    cls_keys = [c for c in OP_CLASSES if c in meas_cls or c in pred_cls]
    coll_keys = sorted(set(meas_coll) | set(pred_coll))
    pred_step, host_bound = predicted_step_s(tl, sc.cluster.gpus, prof)
    out = {
        "bundle": str(bundle),
        "profile": prof.name,
        "scenario": sc.model_dump(mode="json"),
        "steps": len(manifest.step_times),
        "measured_step_time_s": measured_step,
        "measured_step_times_s": [s.wall_s for s in manifest.step_times],
        "predicted_step_time_s": pred_step,
        "step_time_error": (pred_step - measured_step) / measured_step,
        "predicted_critical_path_s": float(tl.step_time_s),
        "predicted_host_bound_s": host_bound,
        "op_classes": block(meas_cls, pred_cls, cls_keys),
        # Host time per step on a rank between the modelled kernels (profile host_overhead_us).
        "predicted_host_overhead_s": max(0.0, float(np.mean([_rank_compute_s(prog, r) for r in range(sched.num_ranks)]))
                                         - sum(pred_cls.values())),
        "collectives": block(meas_coll, pred_coll, coll_keys),
        "warnings": extrapolated,
    }
    out["notes"] = harness_notes(manifest, sc)
    out["warnings"] = out["warnings"] + step_hides_parts(out, ("op_classes", "collectives"))
    # A profile fitted from this very bundle (its provenance records the manifest's sha256): the
    # comparison checks the fit, it does not predict anything the profile has not seen.
    out["fitted_from_this_bundle"] = _fitted_from(prof, bundle)
    if out["fitted_from_this_bundle"]:
        out["warnings"].insert(0, f"profile {prof.name!r} was fitted from this bundle: a self-consistency check, not a "
                                  "prediction; validate on a bundle the profile has not seen")
    return out


def harness_notes(manifest, sc) -> list[str]:
    """What the capture's own train workload runs that its scenario does not price alike (so a
    reader of the optimizer and elementwise rows knows they compare different kernels)."""
    if manifest.workload != "train" or sc.framework != "generic":
        return []
    # Captures before the optimizer argument ran torch's default AdamW, the multi-tensor one on a GPU.
    implementation = (getattr(manifest, "workload_args", None) or {}).get("optimizer", "foreach")
    how = "foreach: 8 passes over 20 tensors a parameter" if implementation == "foreach" else "fused: one pass"
    return [f"the train workload steps torch.optim.AdamW ({how}) over its "
            f"{sc.dtype} parameters and runs torch's F.cross_entropy over fp32 logits; its scenario (framework generic) "
            f"prices megatron-core's fused Adam over fp32 master weights and megatron-core's loss, so the optimizer and "
            f"elementwise rows compare different kernels (docs/design-notes.md, Round 28; SwiGLU captures made since "
            f"round 30 run and declare torchtitan's recipe instead)"]


def _fitted_from(prof: Profile, bundle: Path) -> bool:
    """Whether ``prof``'s provenance lists ``bundle`` among its sources (by its manifest's sha256)."""
    import hashlib

    manifest = bundle / "manifest.json"
    sources = getattr(prof.provenance, "bundles", None) or []
    if not sources or not manifest.is_file():
        return False
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    return any(isinstance(b, dict) and (b.get("files") or {}).get("manifest.json") == digest for b in sources)


# A part that disagrees this much while the step agrees is a compensating error, not a fit.
PART_ERROR_LIMIT = 0.5
PART_SHARE_MIN = 0.05  # of the measured step: smaller parts can miss without moving the step
STEP_AGREES = 0.10


def step_hides_parts(res: dict[str, Any], sections: tuple[str, ...]) -> list[str]:
    """One line where the step agrees (within STEP_AGREES) but parts worth PART_SHARE_MIN of the
    measured step miss by more than PART_ERROR_LIMIT: the step is right for the wrong reasons
    (a CPU gloo bundle: step -2.6% while elementwise -97%, optimizer -99%, all_reduce -86%)."""
    step, err = res.get("measured_step_time_s"), res.get("step_time_error")
    if not step or err is None or abs(err) > STEP_AGREES:
        return []
    bad = [f"{name} {row['error']:+.0%}" for key in sections for name, row in (res.get(key) or {}).items()
           if row.get("error") is not None and row.get("measured_time_s") and not math.isnan(row["error"])
           and abs(row["error"]) > PART_ERROR_LIMIT and row["measured_time_s"] >= PART_SHARE_MIN * step]
    if not bad:
        return []
    return [f"the step agrees ({err:+.1%}) but its parts do not ({', '.join(bad)}): other terms compensate; "
            f"trust the step only as far as its parts"]


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else (f"{v * 1e3:.2f} ms" if v < 10 else f"{v:.2f} s")


def _fmt_e(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.1%}"


def _step_table(title: str, res: dict[str, Any]):
    """A measured / predicted / error table opened with the step-time row (both validations)."""
    from rich.table import Table

    t = Table(title=title)
    for col, j in (("", "left"), ("measured", "right"), ("predicted", "right"), ("error", "right")):
        t.add_column(col, justify=j)
    t.add_row("[bold]step time[/bold]", _fmt_s(res["measured_step_time_s"]), _fmt_s(res["predicted_step_time_s"]),
              _fmt_e(res["step_time_error"]))
    return t


def print_validation(res: dict[str, Any]) -> None:
    from rich.console import Console

    con = Console()
    t = _step_table(f"validate {for_rich(Path(res['bundle']).name)} with profile {for_rich(res['profile'])} "
                    f"(median of {res['steps']} steps"
                    + ("; self-consistency: the profile was fitted from this bundle)" if res.get("fitted_from_this_bundle") else ")"),
                    res)
    for title, key in (("op class", "op_classes"), ("collective", "collectives")):
        t.add_section()
        for name, row in res[key].items():
            t.add_row(f"{title} {for_rich(name)}", _fmt_s(row["measured_time_s"]), _fmt_s(row["predicted_time_s"]), _fmt_e(row["error"]))
    con.print(t)
    if res.get("predicted_host_bound_s"):
        con.print(f"engine critical path {_fmt_s(res['predicted_critical_path_s'])}; ranks' compute over the host's cores "
                  f"{_fmt_s(res['predicted_host_bound_s'])} (the step is the larger)")
    if res.get("predicted_host_overhead_s"):
        con.print(f"predicted host overhead between kernels: {_fmt_s(res['predicted_host_overhead_s'])} per step and rank")
    con.print("per op class and collective: time per step on one rank, mean over ranks")
    for n in res.get("notes", []):
        con.print(f"note: {for_rich(n)}")
    for w in res.get("warnings", []):
        con.print(f"warning: {for_rich(w)}")


def validate_command(
    bundle: Annotated[Optional[Path], typer.Argument(help="What was measured: a trace bundle of the train workload (traces/<name>), or with --scenario a Kineto trace, a per-operator latency table (.csv, e.g. NeuSight's) or a step JSON.")] = None,
    profile: Annotated[Optional[str], typer.Option("--profile", help="Profile: a shipped name or a path to a profile JSON. A bundle needs one; a trace or op table without it is fitted from itself (a self-consistency check).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object.")] = False,
    published: Annotated[Optional[str], typer.Option("--published", help="Validate against a published table instead: megatron-2021, torchtitan-2024 or vtrain-single-node.")] = None,
    topology: Annotated[Optional[str], typer.Option("--topology", help="Topology to simulate on; default from the bundle's host kind.")] = None,
    scenario: Annotated[Optional[Path], typer.Option("--scenario", help="Scenario the measurement ran (needed for op tables and step files).")] = None,
    rows: Annotated[Optional[int], typer.Option("--rows", min=0, help="--published: rows of the per-row table to print (0: all; default 60); the summary covers every row, --json lists them all.")] = None,
) -> None:
    """Simulate what a measurement ran and compare: a captured bundle, a per-operator latency
    table (.csv, e.g. NeuSight's) or a step JSON with --scenario, or a published table."""
    if published is not None:
        if bundle is not None:
            raise UserError(f"give either a bundle ({str(bundle)!r}) or --published {published!r}, not both")
        # Each published row is simulated as its source describes the run: its own GPU, topology
        # and layout. An option that would change that was silently ignored.
        given = [flag for flag, v in (("--profile", profile), ("--topology", topology), ("--scenario", scenario)) if v is not None]
        if given:
            raise UserError(f"--published {published!r} simulates each row on the hardware and layout its source states: "
                            f"drop {', '.join(given)}")
        from simulator.calibrate.published import print_published, published_set_name, validate_published

        published = published_set_name(published)

        from simulator.progress import progress_wanted

        # Per-row lines on a terminal only (they scroll above the spinner); silent under --json or a pipe.
        result = validate_published(published, progress=(lambda line: print(line, file=sys.stderr)) if progress_wanted(as_json) else None)
        if as_json:
            print(json.dumps(result.to_json()))
        else:
            print_published(result, max_rows=60 if rows is None else (rows or None))
        return
    if bundle is None:
        raise UserError("validate needs a BUNDLE (a traces/<name> folder) or --published NAME")
    if rows is not None:
        raise UserError(f"--rows {rows} sizes the per-row table of --published NAME only: drop it here")
    if bundle.suffix.lower() in (".yaml", ".yml"):
        raise UserError(f"{str(bundle)!r} is YAML (a scenario?), not a measurement: validate a trace bundle, or a Kineto "
                        "trace, op table or step file with --scenario S.yaml (the run it measured)")
    if scenario is not None or bundle.suffix in (".csv", ".json") or bundle.name.endswith(".json.gz"):
        if scenario is None:
            raise UserError(f"validate {str(bundle)!r} needs --scenario S.yaml: the model, layout and batch it measured")
        res = validate_trace(bundle, scenario, profile, topology)
        if as_json:
            print(json.dumps(res))
        else:
            print_trace_validation(res)
        return
    if not path_exists(bundle):
        raise UserError(f"bundle {str(bundle)!r} does not exist: give a trace bundle folder written by 'clustersim capture'")
    if profile is None:
        raise UserError(f"validate {str(bundle)!r} needs --profile: a shipped profile name or a profile JSON fitted with 'clustersim calibrate'")
    with warnings.catch_warnings():
        # Extrapolation warnings are part of the result (printed below / in the JSON).
        warnings.simplefilter("ignore")
        res = validate_bundle(bundle, profile, topology)
    if as_json:
        print(json.dumps(res))
    else:
        print_validation(res)


validate_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
validate_app.command("validate")(validate_command)


# ---------------------------------------------------------------------------------------------
# validate TRACE --scenario S.yaml: any imported measurement (a per-operator latency table, a
# NeuSight step JSON) against the simulation of the scenario the user says it ran.
# ---------------------------------------------------------------------------------------------

# The names both sides use: compute per op class, exposed communication per dimension, bubble.
COMM_DIMS = ("tp", "cp", "ep", "pp", "dp")
_NEUSIGHT_STEP_RE = __import__("re").compile(
    r"^(?P<model>.+)-(?P<mode>train|inf)-(?P<seq>\d+)-(?P<batch>\d+)(?:-(?P<par>dp|tp|pp)(?P<n>\d+)(?:_(?P<mb>\d+))?)?$")


class Measured:
    """What one measurement holds, in the names validate compares."""

    def __init__(self, source: str, step_s: float | None, world_size: int, layout: dict[str, int],
                 classes: dict[str, float] | None, includes_optimizer: bool, table=None, seq: int | None = None,
                 batch: int | None = None, device: str | None = None, notes: list[str] | None = None):
        self.source, self.step_s, self.world_size, self.layout = source, step_s, world_size, layout
        self.classes, self.includes_optimizer, self.table = classes, includes_optimizer, table
        self.seq, self.batch, self.device, self.notes = seq, batch, device, notes or []


def measured_from_path(path: Path) -> Measured:
    from simulator.trace.optable_csv import load_op_table

    if path.suffix == ".csv":
        t = load_op_table(path)
        cls = t.class_times_s()
        net = t.class_times_s(net=True)
        kernel_classes = {k: v for k, v in net.items() if k not in ("host", "grad_accumulate")}
        notes = []
        if t.timer_floor_us > 0:
            raw = sum(v for k, v in cls.items() if k not in ("host", "grad_accumulate"))
            notes.append(f"the table's per-op timer adds {t.timer_floor_us:.1f} us to every op (its median for ops that "
                         f"launch no kernel); class times are measured less that floor ({sum(kernel_classes.values()) * 1e3:.1f} "
                         f"of {raw * 1e3:.1f} ms per step)")
        if "host" in cls:
            notes.append(f"ops that launch no kernel (views, shape arithmetic) measured {cls['host'] * 1e3:.1f} ms per step "
                         f"(the per-op timer's floor); not GPU work, left out of the classes")
        if "grad_accumulate" in cls:
            notes.append(f"gradient accumulation into .grad measured {cls['grad_accumulate'] * 1e3:.1f} ms per step apart from the classes")
        step = t.measured_step_s
        if step is None:
            step = sum(kernel_classes.values())
            notes.append("no step time beside the table: the measured step is the sum of its ops")
        # NeuSight's step is forward + backward (e2e = fw + bwall): no optimizer.
        return Measured(str(path), step, 1, {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1}, kernel_classes, False, t,
                        t.seq, t.batch, t.device, notes)
    if path.suffix == ".json":
        from simulator.errors import read_json

        j = read_json(path, "step file", fix="give a NeuSight step JSON")
        if not isinstance(j, dict) or "e2e_latency" not in j:
            raise UserError(f"{str(path)!r} holds no e2e_latency: give a NeuSight step JSON, an op table CSV or a trace folder")
        e2e = j["e2e_latency"]
        if isinstance(e2e, bool) or not isinstance(e2e, (int, float)) or not math.isfinite(e2e) or e2e <= 0:
            raise UserError(f"{str(path)!r}: e2e_latency {e2e!r} is not a positive number of milliseconds: fix the step file")
        m = _NEUSIGHT_STEP_RE.match(path.stem)
        layout = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1}
        world = 1
        seq = batch = None
        if m:
            seq, batch = int(m["seq"]), int(m["batch"])
            if m["par"]:
                layout[m["par"]] = world = int(m["n"])
        return Measured(str(path), float(j["e2e_latency"]) * 1e-3, world, layout, None, False, None, seq, batch,
                        path.parent.name.replace("_", " "), [])
    raise UserError(f"{str(path)!r} is not a measurement validate reads: give an op table (.csv), a NeuSight step JSON "
                    f"or a bundle folder written by 'clustersim capture'")


def check_scenario_against(sc, meas: Measured) -> None:
    """One line naming the first thing the scenario says differently from the measurement."""
    p = sc.parallelism
    name = Path(meas.source).name
    if sc.cluster.gpus != meas.world_size:
        raise UserError(f"scenario runs on {sc.cluster.gpus} GPUs but {name!r} measured {meas.world_size}: "
                        f"set cluster.gpus: {meas.world_size}")
    said = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "dp": sc.dp}
    for dim, n in meas.layout.items():
        if said[dim] != n:
            raise UserError(f"scenario has {dim}={said[dim]} but {name!r} measured {dim}={n}: set parallelism.{dim}: {n}")
    if meas.seq is not None and sc.batch.seq_length != meas.seq:
        raise UserError(f"scenario has seq_length={sc.batch.seq_length} but {name!r} measured {meas.seq}: set batch.seq_length: {meas.seq}")
    if meas.batch is not None and sc.batch.global_batch_size != meas.batch:
        raise UserError(f"scenario has global_batch_size={sc.batch.global_batch_size} but {name!r} measured a batch of "
                        f"{meas.batch}: set batch.global_batch_size: {meas.batch}")
    t = meas.table
    if t is None:
        return
    if t.num_layers is not None and sc.model.num_layers != t.num_layers:
        raise UserError(f"scenario's model has {sc.model.num_layers} layers but {name!r} measured {t.num_layers}: "
                        f"use the model the table measured")
    d = t.ops
    norms = d[d["op_class"] == "norm"]
    if len(norms) and norms.iloc[0]["out_shape"] and norms.iloc[0]["out_shape"][-1] != sc.model.hidden_size:
        raise UserError(f"scenario's model has hidden_size={sc.model.hidden_size} but {name!r} measured "
                        f"{norms.iloc[0]['out_shape'][-1]}: use the model the table measured")
    from simulator.workload.kernel_model import normalize_dtype

    if normalize_dtype(t.dtype) != sc.dtype:
        raise UserError(f"scenario has dtype {sc.dtype} but {name!r} measured {normalize_dtype(t.dtype)}: set dtype: {normalize_dtype(t.dtype)}")
    from simulator.workload.kernel_model import _SPEC_FOR_DEVICE

    if t.device in _SPEC_FOR_DEVICE or re.match(r"(NVIDIA|Tesla|Quadro|AMD) ", t.device or ""):
        # A table that names its GPU (NeuSight's folder, as the driver names the device) must be
        # simulated on that GPU; a folder of any other name says nothing and the scenario's holds.
        gpu = load_profile(sc.cluster.gpu)
        if gpu.device != t.device:
            fix = _SPEC_FOR_DEVICE.get(t.device) or "a profile JSON of that GPU (no shipped profile names it)"
            raise UserError(f"scenario runs on {sc.cluster.gpu_name} ({gpu.device}) but {name!r} was measured on {t.device}: "
                            f"set cluster.gpu: {fix}")


def predicted_op_classes(sc, profile: Profile, schedule) -> dict[str, float]:
    """Kernel seconds per step per rank of each op class (mean over pipeline ranks), from the
    same ops the program times (forward, recomputation, backward)."""
    from simulator.workload.ops import build_layer_ops, op_durations_s
    from simulator.workload.program import split_layers

    m = sc.model
    kinds = build_layer_ops(sc)
    per_kind: dict[str, dict[str, float]] = {}
    for kind, lo in kinds.items():
        i_ops, w_ops = lo.backward()
        ops = [o for o in lo.forward + i_ops + w_ops if o.comm is None]
        dur = op_durations_s(profile, ops, sc)
        acc: dict[str, float] = {}
        for o, t in zip(ops, dur):
            acc[o.op_class] = acc.get(o.op_class, 0.0) + float(t)
        per_kind[kind] = acc
    positions = split_layers(m.num_layers, schedule.num_positions, sc.parallelism.pp_layer_split)
    total: dict[str, float] = {}
    for pos, layers in enumerate(positions):
        chain = (["embedding"] if pos == 0 else []) + [("moe" if m.is_moe and L >= m.num_dense_layers else "dense") for L in layers]
        chain += ["head"] if pos == len(positions) - 1 else []
        for kind in chain:
            for c, v in per_kind[kind].items():
                total[c] = total.get(c, 0.0) + v * sc.num_microbatches
    ranks = schedule.num_ranks
    return {c: v / ranks for c, v in total.items()}


def validate_trace(trace: str | Path, scenario: str | Path, profile: str | Path | None = None,
                   topology: str | None = None) -> dict[str, Any]:
    """Measured vs predicted step, op classes, exposed communication per dimension and bubble."""
    from simulator.workload.kernel_model import calibrate_from_tables
    from simulator.engine.core import Engine
    from simulator.report.metrics import rank_bubble_fraction
    from simulator.scenario import load_scenario
    from simulator.simulate import make_network, resolve_schedule
    from simulator.topology import load_topology
    from simulator.workload.program import build_program

    path = Path(trace)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist: give an op table (.csv), a NeuSight step JSON or a trace folder")
    sc = load_scenario(scenario)
    load_profile(sc.cluster.gpu)  # an unknown GPU name is one line, even where --profile or the table sets the rates
    if topology:
        sc = sc.model_copy(update={"cluster": sc.cluster.model_copy(update={"topology": topology})})
    is_trace = path.is_dir() or path.name.endswith(".json.gz") or (
        path.suffix == ".json" and b'"traceEvents"' in path.open("rb").read(1 << 16))
    if is_trace:
        meas = measured_from_trace_set(path, sc)
    else:
        meas = measured_from_path(path)
        check_scenario_against(sc, meas)
    if profile is not None:
        prof = load_profile(profile)
        mode = "predict"
    elif is_trace:
        from simulator.calibrate.fit import calibrate

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof = calibrate([path], f"{path.stem}-self")
        mode = "self-consistency"
    else:
        if meas.table is None:
            raise UserError(f"{path.name!r} holds a step time but no ops to calibrate on: give --profile (e.g. one fitted "
                            f"with 'clustersim calibrate' on an op table of the same GPU)")
        from simulator.workload.kernel_model import _SPEC_FOR_DEVICE

        # A table that does not name its GPU calibrates on the scenario's GPU profile.
        base = None if meas.table.device in _SPEC_FOR_DEVICE else load_profile(sc.cluster.gpu)
        prof = calibrate_from_tables([meas.table], base)
        mode = "self-consistency"
    topo = load_topology(sc.cluster.topology)
    sched = resolve_schedule(sc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = build_program(sc, prof, sched)
        tl = Engine(prog, make_network(sc, topo, prof), mode="reduced").run()
        pred_cls = predicted_op_classes(sc, prof, sched)
    pred_step = float(tl.step_time_s) - (0.0 if meas.includes_optimizer else prog.optimizer_s)
    if meas.includes_optimizer and prog.optimizer_s > 0:
        pred_cls["optimizer"] = pred_cls.get("optimizer", 0.0) + prog.optimizer_s
    ranks = list(tl.ranks)
    exposed = {d: float(np.mean([tl.exposed_s[r].get(d, 0.0) for r in ranks])) for d in COMM_DIMS}
    bubble = float(np.mean([rank_bubble_fraction(tl, r) for r in ranks])) * float(tl.step_time_s)

    def row(meas_v, pred_v):
        return {"measured_time_s": meas_v, "predicted_time_s": pred_v, "error": _err(pred_v, meas_v)}

    cls_keys = sorted(set(meas.classes or {}) | set(pred_cls), key=lambda c: (c not in OP_CLASSES, c))
    single = meas.world_size == 1
    res = {
        "trace": str(path),
        "mode": mode,
        "profile": prof.name,
        "kernel_model": prof.compute.kernels.model_dump(mode="json") if prof.compute.kernels else None,
        "scenario": sc.model_dump(mode="json"),
        "measured_step_time_s": meas.step_s,
        "predicted_step_time_s": pred_step,
        "step_time_error": _err(pred_step, meas.step_s),
        "predicted_optimizer_s": prog.optimizer_s,
        "step_includes_optimizer": meas.includes_optimizer,
        "op_classes": {c: row((meas.classes or {}).get(c), pred_cls.get(c)) for c in cls_keys},
        # A one-GPU measurement has no communication: measured 0 in every dimension.
        "exposed_comm": {d: row(getattr(meas, "exposed", {}).get(d, 0.0 if single else None), exposed[d]) for d in COMM_DIMS},
        "bubble": row(getattr(meas, "bubble", 0.0 if single else None), bubble),
        "measured_per_rank": getattr(meas, "per_rank", None),
        "per_rank": [{"rank": int(r), "pp_rank": int(tl.pp_rank_of.get(r, 0)), "compute_s": float(tl.busy_compute_s[r]),
                      "exposed_comm_s": {d: float(tl.exposed_s[r].get(d, 0.0)) for d in COMM_DIMS},
                      "bubble_s": rank_bubble_fraction(tl, r) * float(tl.step_time_s)} for r in ranks],
        "notes": meas.notes + ([] if meas.includes_optimizer else
                               [f"the measured step holds forward and backward only; the predicted optimizer step "
                                f"({prog.optimizer_s * 1e3:.1f} ms) is left out of the predicted step"]),
        "warnings": [],
    }
    res["warnings"] = step_hides_parts(res, ("op_classes",))
    return res


def print_trace_validation(res: dict[str, Any]) -> None:
    from rich.console import Console

    con = Console()
    t = _step_table(f"validate {for_rich(Path(res['trace']).name)} ({res['mode']}, profile {for_rich(res['profile'])})", res)
    t.add_section()
    for name, r in res["op_classes"].items():
        t.add_row(f"compute {for_rich(name)}", _fmt_s(r["measured_time_s"]), _fmt_s(r["predicted_time_s"]), _fmt_e(r["error"]))
    rows = [(f"exposed comm {name}", r) for name, r in res["exposed_comm"].items()] + [("bubble", res["bubble"])]
    # A dimension the run does not use (cp on one GPU) has nothing measured or predicted: a row of zeros says nothing.
    shown = [(label, r) for label, r in rows if r["measured_time_s"] or r["predicted_time_s"]]
    if shown:
        t.add_section()
    for label, r in shown:
        t.add_row(for_rich(label), _fmt_s(r["measured_time_s"]), _fmt_s(r["predicted_time_s"]), _fmt_e(r["error"]))
    con.print(t)
    hidden = [label.removeprefix("exposed comm ") for label, r in rows if (label, r) not in shown]
    con.print("per class, dimension and bubble: time per step on one rank, mean over ranks"
              + (f"; nothing measured or predicted, not shown: {', '.join(hidden)}" if hidden else ""))
    for n in res["notes"]:
        con.print(f"note: {for_rich(n)}")
    for w in res.get("warnings", []):
        con.print(f"warning: {for_rich(w)}")


def _union_length(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merged intervals (sorted, disjoint) of [starts, ends)."""
    if len(starts) == 0:
        return np.zeros(0), np.zeros(0)
    o = np.argsort(starts)
    s, e = starts[o], ends[o]
    ms, me = [s[0]], [e[0]]
    for a, b in zip(s[1:], e[1:]):
        if a <= me[-1]:
            me[-1] = max(me[-1], b)
        else:
            ms.append(a)
            me.append(b)
    return np.array(ms), np.array(me)


def _exposed_us(cs: np.ndarray, ce: np.ndarray, us: np.ndarray, ue: np.ndarray) -> float:
    """Length of the comm intervals [cs, ce) not covered by the merged compute intervals [us, ue)."""
    ms, me = _union_length(cs, ce)
    total = float((me - ms).sum())
    covered = 0.0
    for a, b in zip(ms, me):
        lo = np.maximum(us, a)
        hi = np.minimum(ue, b)
        covered += float(np.clip(hi - lo, 0, None).sum())
    return max(0.0, total - covered)


def _dim_of(coll: str, group: int | None, sc) -> str:
    """Which mesh dimension a measured collective belongs to (by group size, then by kind)."""
    p = sc.parallelism
    sizes = {"tp": p.tp, "cp": p.cp, "ep": p.ep, "dp": sc.dp, "pp": p.pp}
    if coll in ("send_recv", "send", "recv"):
        return "pp" if p.pp > 1 else "ep"
    if coll == "all_to_all":
        return "ep" if p.ep > 1 else "cp"
    if group:
        for d in ("tp", "cp", "ep", "dp"):
            if sizes[d] == group and group > 1:
                return d
        if group == sc.dp * p.cp and group > 1:
            return "dp"  # the gradient reduction spans dp x cp (Mesh.groups("dp-cp"))
    return "dp" if coll == "all_reduce" and sc.dp > 1 else ("tp" if p.tp > 1 else "dp")


def measured_from_trace_set(path: Path, sc) -> Measured:
    """Step, compute per class, exposed communication per dimension and bubble per rank, from
    Kineto traces (ProfilerStep boundaries; kernels on the GPU timeline)."""
    from simulator.trace.loader import load_trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = load_trace(path)
    ops = ts.ops
    if ops.empty:
        raise UserError(f"{str(path)!r} holds no timed GPU ops: give Kineto traces with CUDA activities")
    if ts.world_size is None and sc.cluster.gpus != len(ts.ranks):
        # (not "a job of 1": a trace that records no world size says nothing of the job's)
        raise UserError(f"the traces in {str(path)!r} record no world size (no distributedInfo, no rank<k>of<N> in their "
                        f"names), so which of the scenario's {sc.cluster.gpus} GPUs they are is unknown: name each file "
                        f"rank<k>of{sc.cluster.gpus}.json(.gz), or profile with torch.distributed initialised")
    world = ts.world_size or len(ts.ranks)
    if sc.cluster.gpus != world:
        raise UserError(f"scenario runs on {sc.cluster.gpus} GPUs but the traces in {str(path)!r} come from a job of "
                        f"{world}: set cluster.gpus: {world}")
    groups = sorted({int(g) for g in ops["group_size"].dropna().unique()} - {1})
    p = sc.parallelism
    allowed = {p.tp, p.cp, p.ep, sc.dp, p.pp, sc.dp * p.cp, sc.dp // max(p.ep, 1), world}
    odd = [g for g in groups if g not in allowed]
    if odd:
        raise UserError(f"the traces hold collectives over groups of {odd[0]} ranks, which the scenario's layout "
                        f"(tp={p.tp} cp={p.cp} ep={p.ep} dp={sc.dp} pp={p.pp}) has none of: set the layout the job ran")
    stepped = ops[ops["step"] >= 0]
    if stepped.empty:
        raise UserError(f"{str(path)!r} has no ProfilerStep boundaries: profile with torch.profiler's schedule (step())")
    per_rank, classes = [], {}
    gpu = stepped[stepped["device"] >= 0]
    for r, g in gpu.groupby("rank"):
        starts = g.groupby("step")["start_us"].min().sort_values()
        steps = sorted(g["step"].unique())
        if len(starts) >= 2:
            step_us = float(np.median(np.diff(starts.to_numpy())))
        else:
            step_us = float((g["start_us"] + g["dur_us"]).max() - g["start_us"].min())
        n = len(steps)
        comp = g[~g["op_class"].isin(["communication"])]
        for c, v in comp.groupby(comp["op_class"].astype(str))["dur_us"].sum().items():
            classes.setdefault(c, []).append(float(v) * 1e-6 / n)
        cs, ce = _union_length(comp["start_us"].to_numpy(float), (comp["start_us"] + comp["dur_us"]).to_numpy(float))
        comm = g[g["op_class"] == "communication"]
        exposed = dict.fromkeys(COMM_DIMS, 0.0)
        if not comm.empty:
            dims = [_dim_of(str(c), None if pd.isna(s) else int(s), sc) for c, s in zip(comm["collective"], comm["group_size"])]
            comm = comm.assign(dim=dims)
            for d, cg in comm.groupby("dim"):
                exposed[d] = _exposed_us(cg["start_us"].to_numpy(float), (cg["start_us"] + cg["dur_us"]).to_numpy(float),
                                         cs, ce) * 1e-6 / n
        busy = float((ce - cs).sum()) * 1e-6 / n
        per_rank.append({"rank": int(r), "step_s": step_us * 1e-6, "compute_s": busy, "exposed_comm_s": exposed,
                         "bubble_s": max(0.0, step_us * 1e-6 - busy - sum(exposed.values()))})
    meas = Measured(str(path), float(np.median([x["step_s"] for x in per_rank])), world,
                    {"tp": p.tp, "pp": p.pp, "dp": sc.dp, "cp": p.cp, "ep": p.ep},
                    {c: float(np.mean(v)) for c, v in classes.items()}, True, None, None, None,
                    ts.devices[0] if ts.devices else None,
                    [f"{len(ts.ranks)} of {world} ranks traced; step from ProfilerStep starts on the GPU timeline"])
    meas.per_rank = per_rank
    meas.exposed = {d: float(np.mean([x["exposed_comm_s"][d] for x in per_rank])) for d in COMM_DIMS}
    meas.bubble = float(np.mean([x["bubble_s"] for x in per_rank]))
    return meas
