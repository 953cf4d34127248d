"""Report: the numbers a user asks for, computed from the Timeline (definitions in DESIGN.md).

- step time: wall time of one optimizer step, the latest rank's end.
- MFU = model FLOPs / (step time x GPUs x peak dense FLOP/s), model FLOPs without recomputation.
- bubble fraction: idle time of a pipeline rank's compute stream that is neither compute nor
  a wait on communication, over the step time; mean over pipeline ranks, and the worst rank.
- exposed communication: time a rank's compute stream waits on communication, per dimension
  (mean over pipeline ranks; the per-rank values are in ``per_pp_rank``).
- step breakdown: compute, host (the device waiting for eager PyTorch to issue kernels), exposed
  communication per dimension, bubble, imbalance and optimizer,
  summing to the step (``simulator.report.analysis``); the critical path through the step.
- findings: what to change, with numbers (``simulator.report.findings``), also written to ``notes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from simulator.engine.core import DIMS, Timeline
from simulator.workload.memory import MemoryReport
from simulator.workload.program import Program, host_launch_wait_s, host_wait_shares

if TYPE_CHECKING:
    from simulator.whatif.split import Stages


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float = Field(description="Model FLOP/s per GPU over the GPU's dense BF16 peak (profile compute.peak_tflops), "
                                   "whatever the dtype: FP8 runs are reported against the BF16 peak, as torchtitan and Megatron do.")
    bubble_fraction: float = Field(description="Pipeline idle share of the step, mean over pipeline ranks: the schedule's "
                                   "bubble plus stage imbalance (step_breakdown_s splits them into bubble and imbalance).")
    bubble_fraction_worst: float = Field(description="The same idle share on the idlest pipeline rank.")
    exposed_comm_s: dict[str, float]
    comm_bytes_per_gpu: dict[str, float] = Field(
        default_factory=dict, description="Bytes one GPU puts on the wire per step, per dimension (nccl-tests bus convention), mean over pipeline ranks.")
    peak_memory_gib: float
    fits_in_memory: bool
    memory_capacity_gib: float
    gpus: int
    num_microbatches: int
    sim_wall_s: float
    # The event loop's wall time is a small part of a run whose steady period is replayed or whose
    # critical path is long: this one is what the user waited for (set by simulate()).
    wall_s: float | None = Field(None, description="Wall time of the whole simulation, scenario to report (workload, plan, event loop, analysis), seconds; sim_wall_s is the event loop's part.")
    events: int
    mode: str
    setup: dict[str, Any] = Field(default_factory=dict, description="What was simulated (model, GPUs, GPU, topology, layout, schedule, batch, dtype, recompute, TP overlap), so a report read alone (compare a.json b.json) says what it is (set by simulate()).")
    per_pp_rank: list[dict[str, Any]] = Field(
        default_factory=list, description="Per pipeline rank: means over its ranks (compute_s, bubble_fraction, exposed_comm_s, "
        "breakdown_s), memory. What-if runs add slowest: the most loaded simulated rank of that pipeline rank (rank, "
        "ranks it stands for, compute_s, breakdown_s), since the mean dilutes one slow GPU among its replicas.")
    busiest_links: list[dict[str, Any]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    step_breakdown_s: dict[str, float] = Field(
        default_factory=dict, description="Step time split into compute, host_launch (the device waiting for the host to issue kernels), "
        "exposed_<dim>, bubble, imbalance, optimizer "
        "(mean over simulated ranks; sums to step_time_s) and unattributed (the remainder, ~0).")
    critical_path_s: dict[str, float] = Field(
        default_factory=dict, description="Seconds of the critical path per cause (compute, host_launch, tp, cp, ep, pp, dp, "
                                          "bubble); host_launch: the device waiting for eager kernel launches, the "
                                          "action's share of its compute stretches on the path.")
    critical_path: list[dict[str, Any]] = Field(
        default_factory=list, description="The critical path in time order: one entry per action, transfer or wait on it.")
    findings: list[dict[str, Any]] = Field(
        default_factory=list, description="What to change: kind, message, numbers, and whether a suggestion was simulated.")
    whatif: dict[str, Any] | None = Field(
        None, description="What-if answers (simulator.whatif): clean vs perturbed step, wait chain, seed distribution, goodput.")
    fast_forward: dict[str, Any] | None = Field(
        None, description="Set when the steady-state fast path made the step (--steady-fast-path): microbatches "
        "simulated, periods replayed in closed form, the period (s) and microbatches per period.")
    lockstep: dict[str, Any] | None = Field(
        None, description="Set when full mode simulated one rank per pipeline rank and gave its rows to every rank "
        "(the network was checked to treat them alike): simulated_ranks, ranks. None: every rank simulated.")

    # The keys `--json` promises; everything else is detail.
    SUMMARY_KEYS: ClassVar[tuple[str, ...]] = (
        "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu", "bubble_fraction",
        "exposed_comm_s", "peak_memory_gib", "fits_in_memory", "gpus", "sim_wall_s", "events",
    )


def rank_bubble_fraction(tl: Timeline, rank: int) -> float:
    """Idle share of a rank's compute stream that is neither compute nor a wait on communication."""
    step = tl.step_time_s
    if step <= 0:
        return 0.0
    waits = sum(float(v) for v in tl.exposed_s[rank].values())
    return max(0.0, step - float(tl.busy_compute_s[rank]) - waits) / step


def build_report(name: str, prog: Program, tl: Timeline, mem: MemoryReport, peak_tflops: float, gpus: int,
                 rank_weight: dict[int, int] | None = None, with_critical_path: bool = True,
                 stages: "Stages | None" = None) -> Report:
    """``rank_weight``: how many ranks each simulated rank stands for (what-if split mode), so
    means over a pipeline rank weigh each class by its size; default 1 each.
    ``stages``: where ranks of one pipeline rank differ (what-if), each simulated rank's stage and
    replica (``simulator.whatif.split.stage_groups``): imbalance is then measured inside each replica, and each
    ``per_pp_rank`` row gets ``slowest``, its most loaded simulated rank.
    ``with_critical_path``: False leaves ``critical_path`` empty (its walk can cost more than a
    fast-path run's event loop; a findings re-simulation needs only the step's figures)."""
    from simulator.report.analysis import critical_path, rank_breakdown, split_host_launch, summarize_path

    step = tl.step_time_s
    per_rank_bd = rank_breakdown(tl, dict(enumerate(host_launch_wait_s(prog))), stages=stages)
    per_pp: dict[int, dict[str, Any]] = {}
    wt = rank_weight or {}
    for r in tl.ranks:
        w = wt.get(r, 1)
        pp = tl.pp_rank_of[r]
        exposed = {d: float(tl.exposed_s[r][d]) for d in DIMS}
        busy = float(tl.busy_compute_s[r])
        bubble = rank_bubble_fraction(tl, r)
        row = per_pp.setdefault(pp, {"pp_rank": pp, "ranks": 0, "compute_s": 0.0, "bubble_fraction": 0.0,
                                     "exposed_comm_s": dict.fromkeys(DIMS, 0.0)})
        row["ranks"] += w
        acc = row.setdefault("breakdown_s", {})
        for k, v in per_rank_bd[r].items():
            acc[k] = acc.get(k, 0.0) + float(v) * w
        row["compute_s"] += busy * w
        # The row's figures stay means over the pp rank's ranks (split mode weighs its classes so
        # they equal full mode's means): one slow GPU moves them by 1 / (ranks of the pp rank),
        # so the most loaded rank is given beside them, not in their place.
        if stages is not None and busy > row.get("slowest", {}).get("compute_s", -1.0):
            row["slowest"] = {"rank": int(r), "ranks": int(w), "compute_s": busy, "breakdown_s": dict(per_rank_bd[r])}
        row["bubble_fraction"] += bubble * w
        for d in DIMS:
            row["exposed_comm_s"][d] += exposed[d] * w
    rows = []
    for pp in sorted(per_pp):
        row = per_pp[pp]
        n = row.pop("ranks")
        row["compute_s"] /= n
        row["bubble_fraction"] /= n
        row["exposed_comm_s"] = {d: v / n for d, v in row["exposed_comm_s"].items()}
        row["breakdown_s"] = {k: v / n for k, v in row["breakdown_s"].items()}
        row["memory_gib"] = mem.per_rank_gib[pp]
        row["activations_in_flight"] = mem.in_flight[pp]
        rows.append(row)
    bubbles = [r["bubble_fraction"] for r in rows]
    exposed_mean = {d: sum(r["exposed_comm_s"][d] for r in rows) / len(rows) for d in DIMS}
    n_w = sum(wt.get(r, 1) for r in tl.ranks)
    comm_bytes = {d: sum(float(tl.comm_bytes[r][d]) * wt.get(r, 1) for r in tl.ranks) / n_w for d in DIMS}
    tokens_per_s = prog.tokens_per_step / step
    # The mean over pipeline ranks (each row already averages its replicas), like exposed_comm_s.
    breakdown = {k: sum(r["breakdown_s"][k] for r in rows) / len(rows) for k in rows[0]["breakdown_s"]}
    path_by_cause, path = ({}, [])
    if with_critical_path:
        path_by_cause, path = summarize_path(split_host_launch(
            critical_path(tl), host_wait_shares(prog), prog.schedule.stage_position))
    model_tflops_per_gpu = prog.model_flops_per_step / step / gpus / 1e12
    return Report(
        name=name,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / gpus,
        model_tflops_per_gpu=model_tflops_per_gpu,
        mfu=model_tflops_per_gpu / peak_tflops,
        bubble_fraction=sum(bubbles) / len(bubbles),
        bubble_fraction_worst=max(bubbles),
        exposed_comm_s=exposed_mean,
        comm_bytes_per_gpu=comm_bytes,
        peak_memory_gib=mem.peak_gib,
        fits_in_memory=mem.fits,
        memory_capacity_gib=mem.capacity_gib,
        gpus=gpus,
        num_microbatches=prog.schedule.num_microbatches,
        sim_wall_s=tl.sim_wall_s,
        events=tl.num_events,
        mode=tl.mode,
        per_pp_rank=rows,
        busiest_links=tl.network_report[:10],
        notes=list(prog.notes),
        step_breakdown_s=breakdown,
        critical_path_s={k: float(v) for k, v in path_by_cause.items()},
        critical_path=path,
        fast_forward=tl.fast_forward,
        lockstep=tl.lockstep,
    )
