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
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import pandas as pd
import typer

from simulator.profile import OP_CLASSES, OpClassModel, Profile, load_profile
from simulator.errors import UserError
from simulator.vocabulary import COMM_STREAMS, Stream

# Capture schedule names (simulator.capture.spec.SCHEDULES) -> simulator schedule names.
_SCHEDULE_ALIASES = {"interleaved-zb": "zb-h1"}
# Streams whose rows are communication (dp-ag excluded: parameter gathers are not compared).
_COMM_STREAMS = tuple(s.value for s in COMM_STREAMS if s is not Stream.DP_AG)


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
    return build_scenario(data)


def _free_class() -> OpClassModel:
    """A class model whose ops cost (next to) nothing: isolates the other classes' time."""
    return OpClassModel(peak_efficiency=1.0, half_efficiency_flops=0.0, bandwidth_efficiency=1.0, overhead_us=0.0,
                        table_flops=[1.0], table_tflops=[1e12], table_bytes=[1.0], table_GBps=[1e15])


def _rank_compute_s(prog, rank_pp: int) -> float:
    sched = prog.schedule
    total = 0.0
    for a in sched.actions[rank_pp]:
        for sub in (a.sub if a.kind == "FB" else (a,)):
            total += prog.segments[(sched.stage_position[sub.stage], sub.kind)].total_compute_s
    return total + prog.optimizer_s


def predicted_class_times(sc, profile: Profile, schedule) -> dict[str, float]:
    """Seconds per step per rank (mean over pipeline ranks) of each op class."""
    from simulator.workload.program import build_program

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
    tl = Engine(prog, net, mode="reduced", sm_count=profile.compute.sm_count).run()
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
    ev = ev[ev["stream"].isin(_COMM_STREAMS)]
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
        raise UserError(f"{str(bundle)!r} is not a trace bundle (no {MANIFEST_NAME}): give a folder written by 'clustersim capture train'")
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
    return {
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


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else (f"{v * 1e3:.2f} ms" if v < 10 else f"{v:.2f} s")


def _fmt_e(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.1%}"


def print_validation(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"validate {Path(res['bundle']).name} with profile {res['profile']} (median of {res['steps']} steps)")
    for col, j in (("", "left"), ("measured", "right"), ("predicted", "right"), ("error", "right")):
        t.add_column(col, justify=j)
    t.add_row("[bold]step time[/bold]", _fmt_s(res["measured_step_time_s"]), _fmt_s(res["predicted_step_time_s"]),
              _fmt_e(res["step_time_error"]))
    for title, key in (("op class", "op_classes"), ("collective", "collectives")):
        t.add_section()
        for name, row in res[key].items():
            t.add_row(f"{title} {name}", _fmt_s(row["measured_time_s"]), _fmt_s(row["predicted_time_s"]), _fmt_e(row["error"]))
    con.print(t)
    if res.get("predicted_host_bound_s"):
        con.print(f"engine critical path {_fmt_s(res['predicted_critical_path_s'])}; ranks' compute over the host's cores "
                  f"{_fmt_s(res['predicted_host_bound_s'])} (the step is the larger)")
    if res.get("predicted_host_overhead_s"):
        con.print(f"predicted host overhead between kernels: {_fmt_s(res['predicted_host_overhead_s'])} per step and rank")
    con.print("per op class and collective: seconds per step on one rank, mean over ranks")
    for w in res.get("warnings", []):
        con.print(f"warning: {w}")


def validate_command(
    bundle: Annotated[Optional[Path], typer.Argument(help="Trace bundle of the train workload (traces/<name>).")] = None,
    profile: Annotated[Optional[str], typer.Option("--profile", help="Profile: a shipped name or a path to a profile JSON.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON object.")] = False,
    published: Annotated[Optional[str], typer.Option("--published", help="Validate against a published table instead, e.g. megatron-2021.")] = None,
    topology: Annotated[Optional[str], typer.Option("--topology", help="Topology to simulate on; default from the bundle's host kind.")] = None,
) -> None:
    """Simulate the scenario a bundle recorded and compare with what it measured."""
    if published is not None:
        if bundle is not None:
            raise UserError(f"give either a bundle ({str(bundle)!r}) or --published {published!r}, not both")
        from simulator.calibrate.published import print_published, validate_published

        result = validate_published(published, progress=lambda line: print(line, file=sys.stderr))
        if as_json:
            print(json.dumps(result.to_json()))
        else:
            print_published(result)
        return
    if bundle is None:
        raise UserError("validate needs a BUNDLE (a traces/<name> folder) or --published NAME")
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
