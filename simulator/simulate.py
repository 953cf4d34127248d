"""The library entry point: scenario -> workload -> engine -> report (nothing written)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

from simulator.contention import measured_excess_scale
from simulator.profile import Profile, load_profile
from simulator.engine.core import Engine, Mode, Timeline
from simulator.errors import UserError
from simulator.gcpause import cyclic_gc_paused
from simulator.network.alpha_beta import TierNetwork
from simulator.report.metrics import Report, build_report
from simulator.scenario import Scenario
from simulator.words import plural
from simulator.schedules import build_schedule, load_schedule_csv, validate_schedule
from simulator.schedules.base import PipelineSchedule
from simulator.topology import TopologySpec, load_topology
from simulator.workload.memory import MemoryReport, memory_report
from simulator.workload.ops import active_parameters, total_parameters
from simulator.workload.plan import Plan, build_plan, mesh_of
from simulator.workload.program import Program, build_program


@dataclass
class SimulationResult:
    scenario: Scenario
    profile: Profile
    topology: TopologySpec
    program: Program
    timeline: Timeline
    memory: MemoryReport
    report: Report
    plan: Plan | None = None  # what every pipeline rank did, as the engine replayed it
    clean: "SimulationResult | None" = None  # what-if runs: the same step without perturbations
    fast_forward: bool = False  # the steady-state fast path was asked for (simulate's fast_forward)


def resolve_schedule(sc: Scenario) -> PipelineSchedule:
    p = sc.parallelism
    if sc.schedule_file:
        path = Path(sc.schedule_file)
        if not path.exists():
            raise UserError(f"schedule file {str(path)!r} does not exist: check the path")
        sched = load_schedule_csv(path)
        if sched.num_ranks != p.pp:
            raise UserError(f"schedule file {str(path)!r} has {sched.num_ranks} ranks but pp={p.pp}: set --pp {sched.num_ranks}")
        if sched.num_microbatches != sc.num_microbatches:
            raise UserError(
                f"schedule file {str(path)!r} has {sched.num_microbatches} microbatches but the batch gives "
                f"{sc.num_microbatches} (global_batch_size / (micro_batch_size * dp)): adjust --global-batch-size"
            )
    else:
        sched = build_schedule(sc.schedule, p.pp, sc.num_microbatches, p.vpp)
    validate_schedule(sched)
    return sched


def make_network(sc: Scenario, topo: TopologySpec, profile: Profile):
    from simulator.topology.placement import Placement, PlacedNetwork

    p = sc.parallelism
    # The placement knows the NVLink domain (72 GPUs on a GB200 NVL72): groups that do not
    # divide it are packed whole into each domain, leaving its remainder idle.
    placement = Placement(mesh_of(sc), domain_gpus=topo.node.nvlink_domain_gpus)
    n_gpus = sc.cluster.gpus if placement.is_identity else placement.gpus_spanned
    if sc.network == "alpha-beta":
        net = TierNetwork.for_topology(topo, profile)
    else:
        from simulator.network.fabric import FlowNetwork

        net = FlowNetwork.from_profile(topo, n_gpus, profile)
    return net if placement.is_identity else PlacedNetwork(net, placement)


def simulate(sc: Scenario, mode: Mode = "reduced", progress: Callable[[str], None] | None = None,
             fast_forward: bool = False, with_critical_path: bool = True, rows: bool = True) -> SimulationResult:
    """Simulate one step. ``progress`` hears about the work once all input has been checked.
    ``fast_forward``: replay a verified steady pipeline period in closed form (``simulate_step``).
    ``with_critical_path``: False skips the report's critical path (what-if runs always walk it).
    ``rows``: False where only the report's figures are wanted: the fast path then makes no rows
    for the periods it replays (``Timeline.rows``), and there is no critical path."""
    t_start = time.perf_counter()
    if sc.perturbations is not None and not sc.perturbations.empty:
        # What-if: the clean step and the perturbed one (simulator.whatif.run).
        from simulator.whatif.run import simulate_whatif

        result = simulate_whatif(sc, mode=mode, progress=progress)
    else:
        result = simulate_step(sc, mode, progress, fast_forward=fast_forward, with_critical_path=with_critical_path,
                               rows=rows)
    result.fast_forward = fast_forward
    result.report.setup = scenario_setup(sc)
    result.report.wall_s = time.perf_counter() - t_start
    return result


def scenario_setup(sc: Scenario) -> dict:
    """What a run simulated, flat, for the report (``Report.setup``) and for saying what two
    reports differ in."""
    p, b = sc.parallelism, sc.batch
    return {"model": sc.model.name, "gpus": sc.cluster.gpus, "gpu": sc.cluster.gpu_name, "topology": sc.cluster.topology_name,
            "network": sc.network, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": sc.dp, "cp": p.cp, "ep": p.ep, "zero": p.zero,
            "sequence_parallel": p.sequence_parallel, "async_tp": p.async_tp, "tp_comm_overlap": p.tp_comm_overlap,
            "schedule": Path(sc.schedule_file).name if sc.schedule_file else sc.schedule,
            "micro_batch_size": b.micro_batch_size, "global_batch_size": b.global_batch_size, "seq_length": b.seq_length,
            "dtype": sc.dtype, "fp8_recipe": sc.fp8.recipe if sc.dtype == "fp8" else None, "recompute": sc.recompute,
            "fp8_peak_tflops": _fp8_peak_tflops(sc),
            # the whole model's, unsharded; active: what one token passes through (MoE: top_k experts)
            "parameters": total_parameters(sc), "active_parameters": active_parameters(sc)}


def _fp8_peak_tflops(sc: Scenario) -> float | None:
    """The FP8 GEMMs' peak of an FP8 run (MXFP8's for that recipe), None otherwise: MFU is over the
    BF16 peak, so an FP8 run can pass 100% of it; its share of this peak says how close it runs."""
    if sc.dtype != "fp8":
        return None
    prof = load_profile(sc.cluster.gpu)
    c = prof.compute
    return c.peak_tflops_mxfp8 if sc.fp8.recipe == "mxfp8" and c.peak_tflops_mxfp8 else c.peak_tflops_fp8


def _steady_timeline(sc: Scenario, profile: Profile, topo: TopologySpec, sched: PipelineSchedule,
                     rows: bool = True) -> Timeline | None:
    """The step's timeline from a shorter pipeline whose steady period is verified and replayed
    in closed form (``simulator.engine.steady``); None where that does not apply. A short run
    that had not settled is retried once with at least 1.5x the microbatches, if the two short
    runs together simulate at most MAX_SHORT_FRACTION of the step's: a step whose short runs do
    not verify costs at most 1 + MAX_SHORT_FRACTION plain runs."""
    from simulator.engine.steady import MAX_SHORT_FRACTION, plan_cuts, run_short

    p = sc.parallelism
    budget = MAX_SHORT_FRACTION * sched.num_microbatches
    tried = 0
    for short, cut in plan_cuts(sched, lambda n: build_schedule(sc.schedule, p.pp, n, p.vpp)):
        if tried and (short.num_microbatches < 1.5 * tried or tried + short.num_microbatches > budget):
            if tried + short.num_microbatches > budget:
                return None
            continue
        validate_schedule(short)
        prog_s = build_program(sc, profile, short)
        engine = Engine(prog_s, make_network(sc, topo, profile), mode="reduced", plan=build_plan(prog_s),
                        sm_count=profile.compute.sm_count,
                        contention_scale=measured_excess_scale(profile.compute.overlap_fits, profile.compute.sm_count))
        engine.describe_waits = rows  # (rows=False: extend reads the waits' times and causes only)
        out = run_short(engine, short, cut, rows=rows)
        if out is not None or tried:
            return out
        tried = short.num_microbatches
    return None


def _lockstep_timeline(sc: Scenario, topo: TopologySpec, profile: Profile, prog, plan, net, contention: float):
    """Full mode from one simulated rank per pipeline rank, where the network is checked to treat
    every rank of a pipeline rank alike (``simulator.engine.lockstep``): (every rank's timeline,
    the representatives' timeline, the network, None); (None, None, a fresh network, why not)
    where it does not, for the reference loop over every rank."""
    from simulator.engine.lockstep import LockstepCheck, NotLockstep, expand_timeline, lockstep_blocker

    why = lockstep_blocker(net)
    if why is not None:
        return None, None, net, why
    engine = Engine(prog, LockstepCheck(net), mode="reduced", plan=plan, sm_count=profile.compute.sm_count,
                    contention_scale=contention)
    try:
        tl = engine.run()
    except NotLockstep as exc:
        return None, None, make_network(sc, topo, profile), str(exc)  # the partial run used the network
    return expand_timeline(tl, prog.mesh), tl, net, None


def simulate_step(sc: Scenario, mode: Mode = "reduced", progress: Callable[[str], None] | None = None,
                  what: str = "", wait_log: list | None = None, fast_forward: bool = False,
                  with_critical_path: bool = True, rows: bool = True) -> SimulationResult:
    """The one wiring of scenario -> workload plan -> engine -> report, for plain and what-if runs.
    ``what`` qualifies the progress line ("clean"); ``wait_log``, given, collects the engine's waits.
    ``fast_forward`` (reduced mode, a named schedule): simulate a shorter pipeline and replay its
    verified steady period in closed form; the plain run where it does not verify. ``rows``: see
    simulate."""
    # Plan, run, frames and report: all of it allocates objects that stay alive (cyclic_gc_paused).
    with cyclic_gc_paused():
        return _simulate_step(sc, mode, progress, what, wait_log, fast_forward, with_critical_path and rows, rows)


def _simulate_step(sc: Scenario, mode: Mode, progress: Callable[[str], None] | None, what: str,
                   wait_log: list | None, fast_forward: bool, with_critical_path: bool = True,
                   rows: bool = True) -> SimulationResult:
    profile = load_profile(sc.cluster.gpu)
    topo = load_topology(sc.cluster.topology)
    tl = tl_reps = not_lockstep = None
    plan = None
    sched = prog = None
    if fast_forward and mode == "reduced" and not sc.schedule_file and wait_log is None:
        p = sc.parallelism
        sched = build_schedule(sc.schedule, p.pp, sc.num_microbatches, p.vpp)
        validate_schedule(sched)
        prog = build_program(sc, profile, sched)
        tl = _steady_timeline(sc, profile, topo, sched, rows)
        if tl is not None:
            if progress is not None:
                progress(f"simulated {sc.name}: {sched.name}, {tl.fast_forward['microbatches_simulated']} of "
                         f"{sched.num_microbatches} microbatches, the steady period replayed")
    if tl is None:
        if sched is None or prog is None:  # (the fast path built and checked them already)
            sched = resolve_schedule(sc)
            prog = build_program(sc, profile, sched)
        plan = build_plan(prog)
        net = make_network(sc, topo, profile)
        if progress is not None:
            progress(f"simulating {sc.name}{' ' + what if what else ''}: {sc.model.name} on {sc.cluster.gpus} x "
                     f"{sc.cluster.gpu_name}, {Path(sc.schedule_file).name if sc.schedule_file else sched.name} with "
                     f"{plural(sched.num_microbatches, 'microbatch')} ({mode} mode)")
        contention = measured_excess_scale(profile.compute.overlap_fits, profile.compute.sm_count)
        if mode == "full" and wait_log is None:
            tl, tl_reps, net, not_lockstep = _lockstep_timeline(sc, topo, profile, prog, plan, net, contention)
        if tl is None:
            engine = Engine(prog, net, mode="full" if mode == "every-rank" else mode, plan=plan,
                            sm_count=profile.compute.sm_count, contention_scale=contention)
            if wait_log is not None:
                engine.wait_log = wait_log
            tl = engine.run()
            if mode == "every-rank":
                tl.mode = "every-rank"  # (the engine's full mode; said as asked, so outputs tell them apart)
    mem = memory_report(sc, prog, profile.hbm_gib, profile.usable_memory_fraction)
    # A lockstep run's report is its representatives' (every rank of a pipeline rank has their
    # rows, so each mean and the critical path are the same; the walk over every rank's rows
    # was most of a 16,384-GPU run's time).
    report = build_report(sc.name, prog, tl if tl_reps is None else tl_reps, mem, profile.compute.peak_tflops,
                          sc.cluster.gpus, with_critical_path=with_critical_path)
    report.mode, report.lockstep = tl.mode, tl.lockstep
    if not_lockstep:
        report.notes.append(f"full mode ran one process per rank, ranks in lockstep not simulated once: {not_lockstep}")
    return SimulationResult(sc, profile, topo, prog, tl, mem, report, plan)
