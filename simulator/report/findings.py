"""Findings: what to change, with numbers.

``find(result)`` looks at one simulation and returns findings, each with the measured problem and
concrete changes (scenario overrides) with their predicted effect:

- memory overflow: a compiled loss (torchtitan), recompute, more pipeline stages, a higher ZeRO
  stage; peak GiB predicted by the memory model (``workload.memory``, no simulation needed);
- a large pipeline bubble: interleaving, zero-bubble schedules, more microbatches;
- stage imbalance: the ``pp_layer_split`` that minimises the slowest stage, from the program's
  per-layer compute times;
- TP, CP or EP groups that cross the node's NVLink domain onto NICs: the largest size inside a
  node with its memory-model peak (and simulated step where it fits), or, for EP that does not
  fit, overlapped dispatch / combine;
- exposed DP communication: bucket size, overlap, FSDP prefetch;
- exposed TP communication inside a node: async TP (torch) or Megatron's TP comm overlap (TE).

Time predictions come from re-simulating the suggestion with the library's ``simulate`` when that
is cheap (the original simulation's wall time times the number of suggestions fits
``budget_s``); a finding says which numbers were simulated and which were not. ``attach`` writes
the findings into the report (``findings`` and, as one line each, ``notes``).
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from simulator.errors import UserError
from simulator.workload.memory import loss_bytes_per_logit

if TYPE_CHECKING:
    from simulator.report.metrics import Report
    from simulator.simulate import SimulationResult

# Thresholds that make a finding worth a line; shares of the step unless named otherwise.
BUBBLE_SHARE = 0.10  # pipeline bubble (imbalance excluded)
IMBALANCE_SHARE = 0.03  # slowest stage's compute over the mean, beyond which a re-split is proposed
NO_GAIN_SHARE = 0.002  # a simulated step shorter by less than this is no gain: the suggestion is not advised
DP_SHARE = 0.03  # exposed dp communication
TP_SHARE = 0.03  # exposed tp communication inside the NVLink domain (async TP)
HOST_SHARE = 0.05  # the device waiting for the host to issue kernels
SLOW_LINK_SHARE = 0.01  # exposed comm of a dimension whose groups cross nodes
RESIM_BUDGET_S = 20.0  # wall time the re-simulations of one report may take in all


@dataclass
class Suggestion:
    label: str
    overrides: dict[str, Any]
    predicted_step_s: float | None = None
    predicted_tokens_per_s: float | None = None
    predicted_peak_gib: float | None = None
    fits: bool | None = None
    simulated: bool = False
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != ""}


@dataclass
class Finding:
    kind: str
    message: str
    value: float
    suggestions: list[Suggestion] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "value": self.value,
                "suggestions": [s.as_dict() for s in self.suggestions]}


class _Budget:
    """Re-simulates a changed scenario while the time budget lasts."""

    def __init__(self, result: "SimulationResult", budget_s: float):
        self.result = result
        self.budget_s = budget_s
        self.left_s = budget_s
        self.one_s = max(0.05, self.worst_case_s(result.report))
        self.why_not = ""  # why the last simulate() returned None, as a suggestion's note

    @staticmethod
    def worst_case_s(rep: "Report") -> float:
        """What one re-simulation may cost: the whole original run (workload, event loop,
        analysis), not its event loop alone; where the original replayed a steady period, a
        suggestion whose short run does not verify (a stage re-split, another schedule) runs
        plain, every microbatch through the loop (measured: llama3-8b tp2 pp8, 2,048
        microbatches: the run 4.3 s, its re-split re-simulated plain 28 s)."""
        total = rep.wall_s if rep.wall_s is not None else rep.sim_wall_s
        ff = rep.fast_forward
        if not ff or not ff.get("microbatches_simulated"):
            return total
        loop_plain_s = rep.sim_wall_s * rep.num_microbatches / ff["microbatches_simulated"]
        return max(total, total - rep.sim_wall_s + loop_plain_s)

    def scenario(self, overrides: dict[str, Any]):
        from simulator.scenario import build_scenario, set_dotted

        data = self.result.scenario.model_dump(mode="json")
        # build_scenario skips None overrides; here None means "back to the default"
        for dotted, value in overrides.items():
            if value is None:
                *parents, leaf = dotted.split(".")
                node = data
                for k in parents:
                    node = node.get(k, {})
                node.pop(leaf, None)
            else:
                set_dotted(data, dotted, value)
        try:
            return build_scenario(data)
        except UserError:
            return None

    def valid(self, overrides: dict[str, Any]) -> bool:
        return self.scenario(overrides) is not None

    def simulate(self, overrides: dict[str, Any]) -> "Report | None":
        if self.one_s * 1.5 > self.left_s:
            self.why_not = ("not simulated (--findings-budget-s 0)" if self.budget_s <= 0 else
                            f"not simulated: a re-simulation may take ~{self.one_s:.1f} s and {max(self.left_s, 0.0):.1f} s "
                            f"of the {self.budget_s:g} s findings budget is left (--findings-budget-s)")
            return None
        sc = self.scenario(overrides)
        if sc is None:
            self.why_not = "not simulated (the change does not make a valid scenario)"
            return None
        from simulator.simulate import simulate

        t = time.perf_counter()
        try:
            # the original run's path (fast path or not); the figures only, no critical path
            # (a what-if's timeline is its perturbed run's, 'split' or 'full': re-simulate in the
            # mode the user asked for, kept in the report's what-if section)
            mode = (self.result.report.whatif or {}).get("mode") or self.result.timeline.mode
            mode = mode if mode in ("reduced", "full", "every-rank") else "reduced"
            # Reduced mode takes the steady fast path, which gives the same step (to ~1e-12, and
            # the plain run where its period does not verify) several times faster: a
            # suggestion needs only the figures, not the busiest-link table it leaves out.
            rep = simulate(sc, mode=mode, fast_forward=self.result.fast_forward or mode == "reduced",
                           with_critical_path=False).report
        except (UserError, ValueError) as exc:
            rep = None
            self.why_not = f"not simulated (the changed scenario does not run: {exc})"
        dt = time.perf_counter() - t
        self.left_s -= dt
        self.one_s = max(self.one_s, dt)
        return rep

    def memory(self, overrides: dict[str, Any]):
        """The memory model's report for a changed scenario (no simulation)."""
        sc = self.scenario(overrides)
        if sc is None:
            return None
        from simulator.simulate import resolve_schedule
        from simulator.workload.memory import memory_report
        from simulator.workload.program import build_program

        try:
            sched = resolve_schedule(sc)
            prog = build_program(sc, self.result.profile, sched)
        except (UserError, ValueError):
            return None
        prof = self.result.profile
        return memory_report(sc, prog, prof.hbm_gib, prof.usable_memory_fraction)


def _fill(s: Suggestion, rep: "Report | None", why_not: str = "") -> Suggestion:
    """``s`` with the re-simulated figures of ``rep``; where there is none, ``why_not`` (the
    budget's reason) as its note unless it has one."""
    if rep is None and why_not and not s.note:  # (a Suggestion's note is "" until set)
        s.note = why_not
    if rep is not None:
        s.predicted_step_s = rep.step_time_s
        s.predicted_tokens_per_s = rep.tokens_per_s
        s.predicted_peak_gib = rep.peak_memory_gib
        s.fits = rep.fits_in_memory
        s.simulated = True
    return s


def _tried(budget: "_Budget", cands: list[tuple[str, dict[str, Any]]], note) -> list[Suggestion]:
    """Each valid candidate (label, overrides) re-simulated while the budget lasts; ``note(report)``
    says what the simulated run shows of the problem."""
    out = []
    for label, over in cands:
        if not budget.valid(over):
            continue
        rep2 = budget.simulate(over)
        s = _fill(Suggestion(label, over), rep2, budget.why_not)
        if rep2 is not None:
            s.note = note(rep2)
        out.append(s)
    return out


def _sim_text(s: Suggestion, step_s: float, tokens_per_s: float | None = None) -> str:
    if s.simulated and s.predicted_step_s is not None:
        if "batch.global_batch_size" in s.overrides and tokens_per_s and s.predicted_tokens_per_s:
            # a larger batch lengthens the step by design: its throughput is the comparison
            return (f"{s.label}: step {s.predicted_step_s:.3f} s, tokens/s "
                    f"{s.predicted_tokens_per_s / tokens_per_s - 1:+.1%} (simulated)")
        return f"{s.label}: step {s.predicted_step_s:.3f} s ({(s.predicted_step_s - step_s) / step_s:+.1%}, simulated)"
    return f"{s.label}: {s.note or 'not simulated'}"


def _verdict(sugg: list[Suggestion], step_s: float) -> str:
    """The best simulated suggestion that shortens the step, or that none does (keep what runs)."""
    sim = [s for s in sugg if s.simulated and s.predicted_step_s is not None and "batch.global_batch_size" not in s.overrides]
    if not sim:
        return ""
    best = min(sim, key=lambda s: s.predicted_step_s)
    if best.predicted_step_s < step_s * (1 - NO_GAIN_SHARE):
        return f" Best: {best.label} ({best.predicted_step_s / step_s - 1:+.1%} step)."
    return " None of these shortens the step: keep the current settings."


# ---------------------------------------------------------------------------------------------
# the checks


def memory_finding(result: "SimulationResult", budget: _Budget) -> Finding | None:
    rep = result.report
    if rep.fits_in_memory:
        return None
    sc = result.scenario
    p = sc.parallelism
    worst = max(range(len(rep.per_pp_rank)), key=lambda i: rep.per_pp_rank[i]["memory_gib"]["total_gib"])
    row = rep.per_pp_rank[worst]["memory_gib"]
    biggest = max((k for k in row if k != "total_gib"), key=lambda k: row[k])
    cands: list[tuple[str, dict[str, Any]]] = []
    if row.get("loss_working_set_gib", 0.0) > 0 and loss_bytes_per_logit(sc)[1] > 2.0:
        # torchtitan's eager loss keeps the fp32 log-softmax and its backward holds two more fp32
        # copies of the logits; compiled it keeps the bf16 logits (memory.loss_bytes_per_logit)
        cands.append(("compile_loss=true", {"compile_loss": True}))
    if p.zero >= 3 and not p.fsdp_reshard_after_forward:
        # the gathered units held from forward to backward (gathered_parameters) go
        cands.append(("fsdp_reshard_after_forward=true", {"parallelism.fsdp_reshard_after_forward": True}))
    if sc.recompute != "selective" and sc.recompute != "full":
        cands.append(("recompute=selective", {"recompute": "selective"}))
    if sc.recompute != "full":
        cands.append(("recompute=full", {"recompute": "full"}))
    for z in range(p.zero + 1, 4):
        cands.append((f"zero={z}", {"parallelism.zero": z}))
    for mult in (2, 4):
        cands.append((f"pp={p.pp * mult}", {"parallelism.pp": p.pp * mult, "parallelism.pp_layer_split": None}))
    # What holds the same layout in fewer bytes: experts split over tp (their weights, gradients
    # and state 1/tp), Adam's moments in bf16 (megatron-core's precision-aware optimizer, as NeMo's
    # DeepSeek-V3 recipe runs it), gradients reduced and held in bf16.
    if sc.model.is_moe and p.tp > 1 and p.sequence_parallel and p.expert_tp == 1:
        cands.append((f"etp={p.tp}", {"parallelism.etp": p.tp}))
    if p.zero >= 1 and sc.framework == "generic" and not sc.optimizer.precision_aware:
        cands.append(("optimizer.precision_aware=true with bf16 moments",
                      {"optimizer.precision_aware": True, "optimizer.exp_avg_dtype": "bf16", "optimizer.exp_avg_sq_dtype": "bf16"}))
    if p.grad_reduce_in_fp32 is not False and sc.dtype in ("bf16", "fp8"):
        cands.append(("grad_reduce_in_fp32=false", {"parallelism.grad_reduce_in_fp32": False}))
    sugg = []
    for label, over in cands:
        mem = budget.memory(over)
        if mem is None or abs(mem.peak_gib - rep.peak_memory_gib) < 0.05:
            continue  # not a valid layout here, or no change (recompute with FlashAttention already on)
        sugg.append(Suggestion(label, over, predicted_peak_gib=mem.peak_gib, fits=mem.fits,
                               note=f"{mem.peak_gib:.1f} GiB predicted by the memory model"))
    # the best fitting suggestion that changes least gets a simulated step time, when cheap
    fitting = [s for s in sugg if s.fits]
    # and the first fitting one that only stores the same numbers in fewer bytes, which costs
    # little time where recomputation or a deeper pipeline costs much
    precision = next((s for s in fitting if all(k.startswith("optimizer.") or k == "parallelism.grad_reduce_in_fp32"
                                               for k in s.overrides)), None)
    simulated = fitting[:1] + ([precision] if precision is not None and precision is not fitting[0] else [])
    for s in simulated:
        _fill(s, budget.simulate(s.overrides), budget.why_not)
    parts = [f"{s.label} → {s.predicted_peak_gib:.1f} GiB ({'fits' if s.fits else 'still over'})" for s in sugg]
    step_part = "".join(f"; {_sim_text(s, rep.step_time_s)}" for s in simulated if s.simulated)
    biggest_name = biggest.removesuffix("_gib").replace("_", " ")
    msg = (f"memory: pp rank {rep.per_pp_rank[worst]['pp_rank']} needs {rep.peak_memory_gib:.1f} GiB of the usable "
           f"{rep.memory_capacity_gib:.1f} GiB ({biggest_name} {row[biggest]:.1f} GiB is the largest part). "
           f"Memory model: {'; '.join(parts) if parts else 'no single change tried fits'}{step_part}.")
    return Finding("memory", msg, rep.peak_memory_gib - rep.memory_capacity_gib, sugg)


# Without interleaving megatron-core issues a stage's parameter gathers in its first forward only
# (no align_param_gather), so the stages gather one after another along the fill (exposed dp on
# each, bubble on the ranks after it); gathered after the optimizer step, they all gather at once.
SERIALIZED_GATHER_SUGGESTION = (
    "overlap_param_gather=false (the parameter all-gather after the optimizer step, every stage at once, instead "
    "of each stage's in its first forward, one stage after another along the fill)",
    {"parallelism.overlap_param_gather": False})


def serialized_param_gathers(result: "SimulationResult") -> bool:
    """ZeRO-1/2 gathering by buckets in each stage's first forward on a plain (non-interleaved)
    pipeline with data parallelism: the layouts SERIALIZED_GATHER_SUGGESTION is for."""
    sc = result.scenario
    p = sc.parallelism
    sched = result.program.schedule
    return (1 <= p.zero <= 2 and sc.overlap_param_gather and p.pp > 1 and sc.dp * p.cp > 1
            and sched.num_stages == sched.num_ranks)


def bubble_finding(result: "SimulationResult", budget: _Budget) -> Finding | None:
    rep = result.report
    sc = result.scenario
    p = sc.parallelism
    bubble = rep.step_breakdown_s.get("bubble", 0.0)
    if p.pp < 2 or bubble < BUBBLE_SHARE * rep.step_time_s:
        return None
    m = sc.num_microbatches
    cands: list[tuple[str, dict[str, Any]]] = []
    if sc.schedule in ("1f1b", "gpipe") and not sc.schedule_file:
        cands.append(("interleaved-1f1b vpp=2", {"schedule": "interleaved-1f1b", "parallelism.vpp": 2,
                                                 "parallelism.pp_layer_split": None}))
        cands.append(("zb-h1", {"schedule": "zb-h1"}))
    if sc.schedule not in ("zbv", "dualpipev") and not sc.schedule_file:
        cands.append(("zbv", {"schedule": "zbv", "parallelism.vpp": 1, "parallelism.pp_layer_split": None}))
    if serialized_param_gathers(result):
        cands.append(SERIALIZED_GATHER_SUGGESTION)
    if sc.schedule_file:
        pass  # the file fixes the order and the microbatch count: a batch change would not run it
    elif sc.batch.micro_batch_size > 1:
        cands.append((f"micro_batch_size={sc.batch.micro_batch_size // 2} ({2 * m} microbatches)",
                      {"batch.micro_batch_size": sc.batch.micro_batch_size // 2}))
    else:
        cands.append((f"global_batch_size={2 * sc.batch.global_batch_size} ({2 * m} microbatches, a larger batch)",
                      {"batch.global_batch_size": 2 * sc.batch.global_batch_size}))
    cands = [(label, over) for label, over in cands if budget.valid(over)]
    sugg = []
    for label, over in cands:
        rep2 = budget.simulate(over)
        sugg.append(_fill(Suggestion(label, over), rep2, budget.why_not if rep2 is None else ""))
    for s in sugg:
        if not s.simulated:
            # first-order estimates from the measured step (Narayanan et al. 2021, Sec. 2.2: a
            # pipeline's bubble is (p - 1) microbatch times, whatever m; interleaving divides it by vpp).
            # Of the measured step, not of 1F1B's (p-1)/(m+p-1): that formula put a dualpipev or
            # imbalanced step's share *above* the measured one (deepseek-v3 15.6% -> "~19.0%").
            work = max(rep.step_time_s - bubble, 0.0)
            if "vpp=2" in s.label:
                s.note = f"bubble ~{bubble / 2:.3f} s (halved by interleaving, first-order; not simulated)"
            elif "batch.global_batch_size" in s.overrides:  # twice the work, the same bubble
                s.note = f"bubble share ~{bubble / (2 * work + bubble):.1%} of the step (first-order; not simulated)"
            elif "batch.micro_batch_size" in s.overrides:  # the same work, microbatches half as long
                s.note = f"bubble share ~{bubble / 2 / (work + bubble / 2):.1%} of the step (first-order; not simulated)"
            # (otherwise the budget's reason, set by _fill)
    # a larger global batch changes the optimisation, so it is shown but never called best
    better = [s for s in sugg if s.simulated and s.predicted_tokens_per_s and s.predicted_tokens_per_s > rep.tokens_per_s
              and "batch.global_batch_size" not in s.overrides]
    best = max(better, key=lambda s: s.predicted_tokens_per_s or 0.0) if better else None
    schedule = f"schedule file {Path(sc.schedule_file).name}" if sc.schedule_file else sc.schedule
    tail = ("; ".join(_sim_text(s, rep.step_time_s, rep.tokens_per_s) for s in sugg) if sugg else
            "The schedule file fixes the order and the microbatches: a file with more microbatches, or with "
            "interleaved or zero-bubble order, would shrink it")
    msg = (f"bubble: {bubble:.3f} s ({bubble / rep.step_time_s:.1%} of the step) with {schedule} on pp={p.pp} and "
           f"{m} microbatches. " + tail
           + (f". Best: {best.label} ({best.predicted_tokens_per_s / rep.tokens_per_s - 1:+.1%} tokens/s)" if best else "")
           + ".")
    return Finding("bubble", msg, bubble / rep.step_time_s, sugg)


def layer_costs(result: "SimulationResult") -> np.ndarray | None:
    """Compute seconds per microbatch of each layer (index 0..L-1), the embedding added to the first
    layer and the head to the last, from the program's segments and the kinds the schedule runs."""
    prog = result.program
    sched = prog.schedule
    nl = len([L for pos in prog.position_layers for L in pos])
    kinds = set()
    for acts in sched.actions:
        for a in acts:
            for sub in a.leaves:
                kinds.add(sub.kind)
    cost = np.zeros(nl + 2)  # slot 0 = embedding (-1), slot nl + 1 = head (nl)
    for (pos, kind), seg in prog.segments.items():
        if kind not in kinds:
            continue
        np.add.at(cost, np.clip(seg.layer.astype(np.int64) + 1, 0, nl + 1), seg.compute_s)
    out = cost[1:nl + 1].copy()
    out[0] += cost[0]
    out[-1] += cost[nl + 1]
    return out


def best_split(costs: np.ndarray, parts: int, factors: Sequence[float] | None = None) -> list[int]:
    """Contiguous split of ``costs`` into ``parts`` non-empty groups minimising the largest group
    sum (dynamic programming, O(parts · n²)); ``factors``: group k's sum counts factors[k] times
    (a stage on a slower GPU)."""
    n = len(costs)
    pre = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    best = np.full((parts + 1, n + 1), inf)
    cut = np.zeros((parts + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            j = np.arange(k - 1, i)
            vals = np.maximum(best[k - 1, j], pre[i] - pre[j] if factors is None else (pre[i] - pre[j]) * factors[k - 1])
            a = int(np.argmin(vals))
            best[k, i], cut[k, i] = vals[a], j[a]
    counts, i = [], n
    for k in range(parts, 0, -1):
        j = int(cut[k, i])
        counts.append(i - j)
        i = j
    return counts[::-1]


def rank_loads(costs: np.ndarray, counts: Sequence[int], rank_of_position: Sequence[int], ranks: int,
               factors: Sequence[float] | None = None) -> np.ndarray:
    """Per pipeline rank, the compute of the layers its positions hold: position i takes the next
    ``counts[i]`` layers in order and runs on rank ``rank_of_position[i]``; ``factors``: per
    rank, how many times slower its slowest GPU computes them."""
    edges = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pre = np.concatenate([[0.0], np.cumsum(costs)])
    loads = np.zeros(ranks)
    np.add.at(loads, np.asarray(rank_of_position), pre[edges[1:]] - pre[edges[:-1]])
    return loads if factors is None else loads * np.asarray(factors)


def balance_positions(costs: np.ndarray, counts: Sequence[int], rank_of_position: Sequence[int], ranks: int,
                      microbatches: int, factors: Sequence[float] | None = None) -> list[int]:
    """Layers per position (contiguous, in order, each >= 1) for a pipeline where a rank holds
    several positions (interleaved chunks, V shapes), lowering m x (slowest rank's compute per
    microbatch) + (ranks - 1) x (slowest position's): 1F1B's (m + p - 1) x stage time with the
    fill and drain paid per position, so evening out ranks does not pay for a lopsided chunk
    (with one position per rank it is best_split's objective). From ``counts``, repeatedly move
    one layer from one position to another (those between shift by one layer) where that lowers
    (objective, sum of squared rank loads); stops when no move does. A local search.
    ``factors``: per rank, as in :func:`rank_loads`."""
    cur = list(counts)
    pre = np.concatenate([[0.0], np.cumsum(costs)])
    slower = None if factors is None else np.asarray(factors)[np.asarray(rank_of_position)]

    def score(c: list[int]) -> tuple[float, float]:
        loads = rank_loads(costs, c, rank_of_position, ranks, factors)
        edges = np.concatenate([[0], np.cumsum(c)]).astype(np.int64)
        held = pre[edges[1:]] - pre[edges[:-1]]
        longest = float((held if slower is None else held * slower).max())
        return microbatches * float(loads.max()) + (ranks - 1) * longest, float((loads ** 2).sum())

    best = score(cur)
    for _ in range(4 * len(costs)):
        found = None
        for i in range(len(cur)):
            if cur[i] <= 1:
                continue
            for j in range(len(cur)):
                if j == i:
                    continue
                cand = cur.copy()
                cand[i] -= 1
                cand[j] += 1
                sc = score(cand)
                tol = 1e-12 * max(abs(best[0]), 1.0)
                if sc[0] < best[0] - tol or (sc[0] <= best[0] + tol and sc[1] < best[1] * (1 - 1e-9)):
                    if found is None or sc < found[0]:
                        found = (sc, cand)
        if found is None:
            break
        best, cur = found
    return cur


def imbalance_finding(result: "SimulationResult", budget: _Budget) -> Finding | None:
    rep = result.report
    sc = result.scenario
    prog = result.program
    sched = prog.schedule
    p = sc.parallelism
    if p.pp < 2:
        return None
    rank_of: dict[int, int] = {}
    for st in range(sched.num_stages):
        if rank_of.setdefault(sched.stage_position[st], sched.stage_rank[st]) != sched.stage_rank[st]:
            return None  # a position run by two ranks (DualPipe's two directions): no split to propose
    positions = len(prog.position_layers)
    if sorted(rank_of) != list(range(positions)) or len(set(rank_of.values())) != sched.num_ranks:
        return None
    rank_of_position = [rank_of[i] for i in range(positions)]
    # A what-if row's mean dilutes a slow GPU among its pp rank's replicas; the step waits for the
    # slowest replica of each stage, and max over stages of max over replicas is the slowest stage
    # of any pipeline, so the stages compare by their slowest ranks.
    loaded = [r.get("slowest", r) for r in rep.per_pp_rank]
    comp = [r["breakdown_s"]["compute"] for r in loaded]
    mean = sum(comp) / len(comp)
    slow = int(np.argmax(comp))
    if comp[slow] < (1 + IMBALANCE_SHARE) * mean:
        return None
    costs = layer_costs(result)
    factors = _stage_slowdowns(result)
    current = [len(x) for x in prog.position_layers]
    if positions == sched.num_ranks and rank_of_position == list(range(positions)):
        split = best_split(costs, p.pp, factors)
    else:
        split = balance_positions(costs, current, rank_of_position, sched.num_ranks, sc.num_microbatches, factors)
    now_max = float(rank_loads(costs, current, rank_of_position, sched.num_ranks, factors).max())
    new_max = float(rank_loads(costs, split, rank_of_position, sched.num_ranks, factors).max())
    excess = comp[slow] / mean - 1
    row = rep.per_pp_rank[slow]
    who = (f"; each pp rank's slowest GPU, here rank {loaded[slow]['rank']}, where pp rank {slow}'s mean is "
           f"{row['breakdown_s']['compute']:.3f} s" if "slowest" in row and comp[slow] > row["breakdown_s"]["compute"] * (1 + 1e-6) else "")
    head = f"imbalance: pp rank {slow} computes {excess:.1%} more than the mean ({comp[slow]:.3f} s vs {mean:.3f} s{who})"
    if split == current or new_max >= now_max * 0.99:
        return Finding("imbalance", f"{head}; no layer split lowers the slowest stage "
                                    f"(split {current} is already the best for these layer costs).", excess, [])
    over = {"parallelism.pp_layer_split": split}
    s = _fill(Suggestion(f"pp_layer_split={split}", over,
                         note=f"slowest stage {new_max * 1e3:.1f} ms instead of {now_max * 1e3:.1f} ms per microbatch "
                              f"(program's per-layer compute{'' if factors is None else ', each stage at its slowest GPU'}; "
                              "not simulated)"), budget.simulate(over))
    unit = "layers" if positions == sched.num_ranks else "layers; positions are virtual stages, chunk by chunk"
    moved = ", ".join(f"{'pp' if positions == sched.num_ranks else 'position'} {i} {c:+d}"
                      for i, c in enumerate(np.array(split) - np.array(current)) if c)
    head += f"; imbalance costs {rep.step_breakdown_s.get('imbalance', 0.0):.3f} s of the step"
    # (factors exist only for a what-if, so result.clean is its clean step)
    slowed = [] if factors is None else [i for i, f in enumerate(factors) if f > 1 + 1e-6]
    pert = sc.perturbations
    noise_only = pert is not None and pert.jitter is not None and not (pert.gpus or pert.gpu_draw)
    if slow in slowed and noise_only:
        # Seeded jitter on every GPU: no faulty GPU to replace; the slowest replica draws longer kernels.
        beyond = rep.step_breakdown_s.get("imbalance", 0.0) - result.clean.report.step_breakdown_s.get("imbalance", 0.0)
        head += (f", {beyond:.3f} s of it beyond the clean step: under the what-if's jitter pp rank {slow}'s slowest "
                 f"replica runs its layers {factors[slow]:.2f}x as long (noise on every GPU, not one slow GPU; a layer "
                 "split only works around it)")
    elif slowed and noise_only:
        head += (f" (the what-if's jitter lengthens pp rank{'s' if len(slowed) > 1 else ''} {', '.join(map(str, slowed))}: "
                 "a split below also works around that noise)")
    elif slow in slowed:
        # A what-if's slow GPU: the first remedy is the GPU (replace or drain it); moving layers
        # off its stage only works around it, and would be wrong once the GPU is healthy again.
        beyond = rep.step_breakdown_s.get("imbalance", 0.0) - result.clean.report.step_breakdown_s.get("imbalance", 0.0)
        head += (f", {beyond:.3f} s of it beyond the clean step: pp rank {slow}'s slowest GPU runs its layers "
                 f"{factors[slow]:.2f}x as long (replacing or draining that GPU removes this part; a layer split "
                 "only works around it)")
    elif slowed:
        # The split is computed with every stage at its slowest GPU, so it also moves layers
        # around a slowed GPU elsewhere: say so, since it would be wrong once that GPU is replaced.
        head += (f" (the what-if slows a GPU of pp rank{'s' if len(slowed) > 1 else ''} {', '.join(map(str, slowed))}: "
                 "a split below also works around it, and would not once that GPU is replaced)")
    head += ". "
    stages = (f"{'' if positions == sched.num_ranks else '(pp rank) '}{now_max * 1e3:.1f} → {new_max * 1e3:.1f} ms "
              "per microbatch")
    if s.simulated and s.predicted_step_s is not None and s.predicted_step_s > rep.step_time_s * (1 - NO_GAIN_SHARE):
        # The per-layer compute says the split helps, the simulation says the step does not: do not advise it.
        msg = (f"{head}Moving layers ({moved} {unit}) lowers the slowest stage {stages} but not the step: "
               f"{_sim_text(s, rep.step_time_s)}; keep pp_layer_split {current}.")
    else:
        msg = (f"{head}Move layers ({moved} {unit}): pp_layer_split {current} → {split}, slowest stage {stages}; "
               f"{_sim_text(s, rep.step_time_s)}.")
    return Finding("imbalance", msg, excess, [s])


def _stage_slowdowns(result: "SimulationResult") -> list[float] | None:
    """Per pipeline rank, its slowest rank's compute over the clean step's (what-if runs: a slow
    GPU's stage runs its layers that many times slower); None where the ranks are alike."""
    pert = result.scenario.perturbations
    if pert is None or not (pert.gpus or pert.gpu_draw or pert.jitter):
        # Slower links lengthen compute only through the SMs their collectives hold longer: no
        # GPU of a stage runs its layers slower.
        return None
    rows = result.report.per_pp_rank
    clean = result.clean.report.per_pp_rank if result.clean is not None else []
    if not rows or len(clean) != len(rows) or any("slowest" not in r for r in rows):
        return None
    out = []
    for r, c in zip(rows, clean):
        nominal = c["breakdown_s"]["compute"]
        out.append(r["slowest"]["breakdown_s"]["compute"] / nominal if nominal > 0 else 1.0)
    return out


def _nodes_spanned(result: "SimulationResult", dim: str) -> int:
    """Nodes one group of ``dim`` spans (groups of a dimension are alike)."""
    g = result.program.mesh.groups(dim)[0]
    return len(set((np.asarray(g) // result.topology.node.gpus_per_node).tolist()))


def _inside_node(result: "SimulationResult", budget: _Budget, dim: str, size: int) -> tuple[Suggestion | None, str]:
    """The largest size of ``dim`` within one node that makes a valid scenario, its memory from the
    memory model and, where it fits, its simulated step; with the sentence that says so. Shrinking
    a group into a node multiplies what each GPU holds of that dimension's shard (experts under ep,
    layers' widths under tp), so the advice is checked against memory before it is given
    (DeepSeek-V3 with ep 64 across nodes was told "use ep ≤ 8", which needs several times the HBM)."""
    node = result.topology.node.gpus_per_node
    rep = result.report
    for v in range(min(node, size - 1), 0, -1):
        if size % v:
            continue  # (the placement packs whole groups into a domain: 64 of an NVL72's 72 GPUs hold ep=64)
        over = {f"parallelism.{dim}": v}
        mem = budget.memory(over)
        if mem is None:
            continue
        s = Suggestion(f"{dim}={v}", over, predicted_peak_gib=mem.peak_gib, fits=mem.fits)
        if not mem.fits:
            return s, (f"{dim}={v} would need {mem.peak_gib:.1f} GiB of the usable {mem.capacity_gib:.1f} GiB "
                       f"(memory model): it does not fit, so the {dim} groups cannot move inside a node here")
        _fill(s, budget.simulate(over), budget.why_not)
        return s, f"{dim}={v} fits ({mem.peak_gib:.1f} GiB, memory model); {_sim_text(s, rep.step_time_s)}"
    return None, ""


def etp_alternative(sc) -> tuple[str, dict[str, Any]] | None:
    """The other expert tensor parallelism of a MoE layout with tp > 1 under sequence parallelism,
    as (label, overrides): etp = tp splits each expert over the tp group (an EP group keeps one tp
    index, the expert gradients reduce over dp x cp / ep ranks); etp = 1 keeps the experts whole
    and folds the tp ranks into ep (an EP group on consecutive GPUs, the expert gradients over
    dp x cp x tp / ep ranks). None where there is no choice."""
    p = sc.parallelism
    if not sc.model.is_moe or p.tp < 2 or not p.sequence_parallel:
        return None
    if p.expert_tp > 1:
        return ("etp=1 (experts whole on each rank, the tp ranks folded into ep: an EP group on consecutive GPUs)",
                {"parallelism.etp": 1})
    return (f"etp={p.tp} (each expert split over the tp group, megatron-core's default: the expert gradients "
            f"reduce over dp x cp / ep ranks)", {"parallelism.etp": p.tp})


def slow_link_findings(result: "SimulationResult", budget: _Budget) -> list[Finding]:
    rep = result.report
    mesh = result.program.mesh
    node = result.topology.node
    sc = result.scenario
    out = []
    for dim in ("tp", "cp", "ep"):
        size = getattr(mesh, dim)
        exposed = rep.exposed_comm_s.get(dim, 0.0)
        if size < 2 or exposed < SLOW_LINK_SHARE * rep.step_time_s:
            continue
        nodes = _nodes_spanned(result, dim)
        if nodes < 2:
            continue
        msg = (f"slow links: each {dim.upper()} group of {size} GPUs spans {nodes} nodes, so its collectives cross "
               f"NICs at {node.nic_GBps_per_gpu:.0f} GB/s per GPU instead of NVLink at {node.nvlink_GBps:.0f} GB/s; "
               f"exposed {dim} is {exposed:.3f} s ({exposed / rep.step_time_s:.1%} of the step). ")
        sugg: list[Suggestion] = []
        alt = etp_alternative(sc) if dim == "ep" and sc.parallelism.expert_tp > 1 else None
        if alt is not None and budget.valid(alt[1]):
            # Split experts keep an EP group on one tp index, ep x tp GPUs apart; folding the tp
            # ranks in puts it on ep consecutive ones.
            s = _fill(Suggestion(alt[0], alt[1]), budget.simulate(alt[1]), budget.why_not)
            sugg.append(s)
            msg += (f"Experts split over tp (etp={sc.parallelism.expert_tp}) keep an EP group on one tp index, "
                    f"{sc.parallelism.tp} GPUs apart; {_sim_text(s, rep.step_time_s)}.")
        elif size <= node.gpus_per_node and dim == "ep":
            msg += ("An EP group is ep consecutive ranks of the tp-cp-dp order where the tp ranks fold into it "
                    f"(megatron-core's MoE parallel folding): keep tp, cp and dp innermost in mesh_order (now {mesh.order})"
                    + (", and run sequence parallelism so the tp ranks fold in" if sc.parallelism.tp > 1
                       and not sc.parallelism.sequence_parallel else "") + ".")
        elif size <= node.gpus_per_node:
            msg += f"Keep the {dim} groups inside a node: put {dim} innermost in mesh_order (now {mesh.order})."
        else:
            s, said = _inside_node(result, budget, dim, size)
            if s is None:
                msg += (f"Keep the {dim} groups inside a node: {dim}={size} exceeds the {node.gpus_per_node} GPUs of "
                        f"a node, use {dim} ≤ {node.gpus_per_node}.")
            else:
                sugg.append(s)
                msg += f"{dim}={size} exceeds the {node.gpus_per_node} GPUs of a node: {said}."
                if not s.fits and dim == "ep" and not sc.moe.overlap_dispatch and not sc.schedule.startswith("dualpipe"):
                    # Hiding the all-to-all is what is left: overlapped dispatch / combine (DualPipe's pairing
                    # does it by its schedule), as DeepSeek-V3 runs ep 64 over 8 nodes (V3 report, Sec. 3.2).
                    over = {"moe.overlap_dispatch": True}
                    h = _fill(Suggestion("moe.overlap_dispatch=true", over), budget.simulate(over), budget.why_not)
                    sugg.append(h)
                    msg += (f" Overlapping the dispatch / combine all-to-all with compute hides it instead: "
                            f"{_sim_text(h, rep.step_time_s)}.")
        out.append(Finding("slow-link", msg, exposed / rep.step_time_s, sugg))
    return out


def tp_finding(result: "SimulationResult", budget: _Budget) -> Finding | None:
    """Exposed TP communication the GEMMs could hide: async TP (or, under Megatron, TE's TP comm
    overlap) overlaps each sequence-parallel all-gather / reduce-scatter with chunks of its GEMM
    (TP groups across nodes are slow_link_findings' case: the fix there is the placement)."""
    rep = result.report
    p = result.scenario.parallelism
    exposed = rep.exposed_comm_s.get("tp", 0.0)
    if p.tp < 2 or p.async_tp or p.tp_comm_overlap or exposed < TP_SHARE * rep.step_time_s:
        return None
    if _nodes_spanned(result, "tp") > 1:
        return None
    # Megatron overlaps through Transformer Engine's userbuffers, everything else through torch.
    megatron = result.scenario.framework.startswith("megatron")
    field_name = "tp_comm_overlap" if megatron else "async_tp"
    how = ("Megatron's --tp-comm-overlap (Transformer Engine userbuffers)" if megatron else
           "Async TP (torchtitan enable_async_tensor_parallel with torch.compile)")
    over: dict[str, Any] = {f"parallelism.{field_name}": True}
    label = f"{field_name}=true"
    if not p.sequence_parallel:
        over["parallelism.sequence_parallel"] = True
        label = f"sequence_parallel=true, {field_name}=true"
    if not budget.valid(over):
        return None
    rep2 = budget.simulate(over)
    s = _fill(Suggestion(label, over), rep2, budget.why_not)
    exposed2 = getattr(rep2, "exposed_comm_s", None)
    if exposed2 is not None:
        s.note = f"exposed tp {exposed2.get('tp', 0.0):.3f} s"
    head = (f"exposed TP communication: {exposed:.3f} s ({exposed / rep.step_time_s:.1%} of the step) inside the NVLink "
            f"domain, the compute stream waiting on tp={p.tp} collectives. ")
    if s.simulated and s.predicted_step_s is not None and s.predicted_step_s > rep.step_time_s * (1 - NO_GAIN_SHARE):
        msg = head + f"{how} does not shorten the step: {_sim_text(s, rep.step_time_s)}."
    else:
        msg = (head + f"{how} overlaps each all-gather / reduce-scatter with chunks of its GEMM: "
               f"{_sim_text(s, rep.step_time_s)}.")
    return Finding("tp", msg, exposed / rep.step_time_s, [s])


def dp_finding(result: "SimulationResult", budget: _Budget) -> Finding | None:
    rep = result.report
    sc = result.scenario
    p = sc.parallelism
    exposed = rep.exposed_comm_s.get("dp", 0.0)
    if sc.dp < 2 or exposed < DP_SHARE * rep.step_time_s:
        return None
    clean = (rep.whatif or {}).get("clean_exposed_comm_s", {}).get("dp")
    if clean is not None and exposed - clean > 0.5 * exposed:
        # A what-if whose perturbation made most of it: the replicas wait at the gradient
        # reduction for the perturbed one; bucket sizes would not change that.
        extra = exposed - clean
        return Finding("exposed-dp", f"exposed dp: {exposed:.3f} s ({exposed / rep.step_time_s:.1%} of the step), "
                       f"{extra:.3f} s of it beyond the clean step: the other replicas waiting at the gradient "
                       "reduction for the perturbed one (who waits on whom, below); no bucket size shortens that.",
                       exposed / rep.step_time_s, [])
    cands: list[tuple[str, dict[str, Any]]] = []
    if not p.overlap_grad_reduce:
        cands.append(("overlap_grad_reduce=true", {"parallelism.overlap_grad_reduce": True}))
    if 1 <= p.zero <= 2 and not sc.overlap_param_gather:
        cands.append(("overlap_param_gather=true (megatron-core --overlap-param-gather: the parameter all-gather by "
                      "buckets in the first forward)", {"parallelism.overlap_param_gather": True}))
    elif serialized_param_gathers(result):
        cands.append(SERIALIZED_GATHER_SUGGESTION)
    if p.zero >= 3:
        cands.append((f"fsdp_prefetch={p.fsdp_prefetch + 1}", {"parallelism.fsdp_prefetch": p.fsdp_prefetch + 1}))
        cands.append((f"fsdp_prefetch={p.fsdp_prefetch + 2}", {"parallelism.fsdp_prefetch": p.fsdp_prefetch + 2}))
        if sc.framework == "torchtitan" and not p.fsdp_separate_reduce_scatter_group:
            # FSDP2's gathers queue behind its reduce-scatters on one communicator (torch's
            # default); torch's experimental set_separate_reduce_scatter_group() lifts that.
            cands.append(("fsdp_separate_reduce_scatter_group=true (torch's experimental "
                          "FSDPModule.set_separate_reduce_scatter_group(): the reductions on a communicator of their own)",
                          {"parallelism.fsdp_separate_reduce_scatter_group": True}))
    alt = etp_alternative(sc)
    if alt is not None:
        cands.append(alt)
    # (the framework reduces in one piece whatever the bucket; ZeRO-3 reduces a unit at a time)
    if not sc.grad_reduce_in_one_piece and p.zero < 3:
        bucket = sc.grad_bucket_params
        cands.append((f"grad_bucket_params={bucket // 2:,}", {"parallelism.grad_bucket_params": bucket // 2}))
        cands.append((f"grad_bucket_params={bucket * 2:,}", {"parallelism.grad_bucket_params": bucket * 2}))
    sugg = _tried(budget, cands, lambda r: f"exposed dp {r.exposed_comm_s.get('dp', 0.0):.3f} s")
    waits = result.timeline.waits
    where = ""
    if waits is not None and len(waits):
        w = waits[waits["cause"] == "dp"]
        if len(w):
            # ("parameters": a wait for a gather; "params": a blocking ZeRO-1/2 gather itself)
            share = (w["end_s"] - w["start_s"]).groupby(w["what"].str.contains("param")).sum()
            params = float(share.get(True, 0.0)) / max(1, len(result.timeline.ranks))
            where = (f" ({params:.3f} s of it waiting for parameter all-gathers, the rest for gradient reduction)"
                     if params > 0 else " (all of it waiting for gradient reduction)")
    msg = (f"exposed dp: {exposed:.3f} s ({exposed / rep.step_time_s:.1%} of the step){where}. "
           + "; ".join(_sim_text(s, rep.step_time_s) + (f", {s.note}" if s.simulated and s.note else "") for s in sugg) + "."
           + _verdict(sugg, rep.step_time_s))
    return Finding("exposed-dp", msg, exposed / rep.step_time_s, sugg)


def host_finding(result: "SimulationResult", budget: _Budget) -> Finding | None:
    """Kernels shorter than their launch: the GPU waits while eager PyTorch issues them (profile
    host_launch_*_us). Larger microbatches (more work a launch) or fewer TP ranks (larger shards)
    raise the kernel time a launch buys; CUDA graphs or torch.compile issue fewer kernels."""
    rep = result.report
    waited = rep.step_breakdown_s.get("host_launch", 0.0)
    if waited < HOST_SHARE * rep.step_time_s:
        return None
    sc = result.scenario
    p = sc.parallelism
    cands = [(f"micro_batch_size={sc.batch.micro_batch_size * 2}", {"batch.micro_batch_size": sc.batch.micro_batch_size * 2})]
    if p.tp >= 2:
        # (sc.dp: the scenario may leave dp to be derived from the GPU count, p.dp None)
        cands.append((f"tp={p.tp // 2}, dp={sc.dp * 2}", {"parallelism.tp": p.tp // 2, "parallelism.dp": sc.dp * 2}))
    sugg = _tried(budget, cands, lambda r: f"host {r.step_breakdown_s.get('host_launch', 0.0):.3f} s")
    tried = "; ".join(_sim_text(s, rep.step_time_s) + (f", {s.note}" if s.simulated and s.note else "") for s in sugg)
    msg = (f"host-bound: the GPU waits {waited:.3f} s ({waited / rep.step_time_s:.1%} of the step) for the host to issue "
           "kernels that run shorter than their launch (eager PyTorch, profile host_launch_forward_us / "
           "host_launch_backward_us); CUDA graphs or torch.compile issue fewer of them"
           + (f"; {tried}." if tried else ".") + _verdict(sugg, rep.step_time_s))
    return Finding("host-bound", msg, waited / rep.step_time_s, sugg)


def find(result: "SimulationResult", budget_s: float = RESIM_BUDGET_S) -> list[Finding]:
    """Every finding for one simulation, most expensive problem first."""
    if not result.report.step_breakdown_s:
        return []
    budget = _Budget(result, budget_s)
    out: list[Finding] = []
    for check in (memory_finding, imbalance_finding, bubble_finding, host_finding, tp_finding, dp_finding):
        f = check(result, budget)
        if f is not None:
            out.append(f)
    out += slow_link_findings(result, budget)
    return out


def attach(result: "SimulationResult", budget_s: float = RESIM_BUDGET_S) -> "SimulationResult":
    """Compute the findings and put them into ``result.report`` (findings and notes)."""
    if result.report.findings:
        return result
    found = find(result, budget_s)
    rep = result.report
    result.report = rep.model_copy(update={
        "findings": [f.as_dict() for f in found],
        "notes": list(rep.notes) + [f.message for f in found],
    })
    return result
