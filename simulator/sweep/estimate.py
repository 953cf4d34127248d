"""The closed-form pass: a step-time and memory estimate per scenario, with no event loop.

Durations come from the same workload model and profile the simulation uses: a Program is
built (``build_program``) and its segments are summed. Building a Program for every point of a
100,000-point space would dominate the search, so the estimator builds one *reference*
Program per layer configuration (model, tp, cp, ep, micro-batch, sequence, recompute, zero,
GPU profile...) with one pipeline position per layer, and composes any pipeline split of the
same configuration from those per-layer costs. Points that differ only in pp, vpp, schedule,
global batch or GPU count share one reference Program.

Step time of a point:

    all-gather of the first stage's parameters (ZeRO >= 1; nothing hides it at step start)
  + pipeline makespan: the heaviest rank's busy time plus the idle above it in a replay of the
    schedule with each position's own costs (quantised, cached per schedule and costs: the
    first position holds the embedding, the last the LM head and loss, and a V placement puts
    both on one rank)
    (per-position costs include the blocking tp / cp / ep collectives, priced by the network's
    ``collective_time_s``)
  + pipeline p2p on the fill/drain critical path: 2 x (cross-rank stage boundaries) x send time
  + exposed DP gradient reduction: what the last backward of each stage cannot hide
  + the step-level work after it (the program's step_collectives, as the plan runs them: the
    tied-embedding all-reduce between the first and last stage's ranks, the fp16 unscale, the
    gradient norm and its all-reduces)
  + the optimizer step

ZeRO-3 gathers are the plan's units (every layer id of a segment: the embedding and the head
are units of their own) at the plan's bytes, each behind the unit before it in the rank's order
of actions (``Estimator._action_gathers`` for an action's first unit).

Memory is ``memory_report`` of the same layout, so pruning by memory agrees with the simulation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulator.profile import Profile, load_profile
from simulator.errors import UserError
from simulator.network.alpha_beta import TierNetwork
from simulator.network.base import CollectiveRequest
from simulator.scenario import Scenario, spec_key
from simulator.schedules import build_schedule, replay_action_costs
from simulator.schedules.base import PipelineSchedule
from simulator.topology import load_topology
from simulator.topology.placement import Mesh
from simulator.workload.memory import memory_report
from simulator.contention import collective_ctas, compute_slowdown, measured_excess_scale, scaled_slowdown
from simulator.schedules.base import Action
from simulator.vocabulary import DIM_NAMES, CollectiveOp, Dim, Stream
from simulator.workload.plan import (
    Collective, GradBuckets, Wait, bucketed_stages, grad_reduction_steps, communication_groups, emit_action, hsdp_expert_shard_of,
    hsdp_shard_of, linear_replay, mesh_of, ADAM_BYTES_PER_PARAM, adam_bytes_per_param, adam_tensor_count,
    optimizer_state_bytes, param_buckets, pp_message_bytes, scenario_edp_tp, scenario_grad_bytes, scenario_optimizer_shards,
    zero12_bucket_bytes,
)
from simulator.workload.ops import optimizer_time_s, tied_head_shares_embedding
from simulator.workload.program import Program, build_program, checkpointed_layers, split_layers, step_terms

KINDS = ("F", "B", "I", "W")
# Cost ratios are quantised so that one replay serves many points (error well under 1%).
RATIO_STEP = 0.1


def _contention_scale(prof) -> float:
    """The engine's contention scale (simulator.contention.measured_excess_scale), so the
    estimate and the engine slow overlapped compute alike."""
    return measured_excess_scale(prof.compute.overlap_fits, prof.compute.sm_count)


@dataclass
class Estimate:
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    peak_memory_gib: float
    memory_capacity_gib: float
    fits_in_memory: bool
    gpus: int
    num_microbatches: int
    pipeline_s: float
    exposed_comm_s: dict[str, float]
    optimizer_s: float
    # What the step-level work between the last backward and the optimizer adds to the step
    # (the plan's Program.step_collectives: tied-embedding all-reduce, fp16 unscale, grad norm):
    # its kernels and its blocking collectives, after the slowest rank's gradient reduction.
    step_terms_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Table:
    """Costs per reference position (one layer each on the fast path)."""

    comp: dict[str, np.ndarray]  # kind -> compute seconds per position
    grad_bytes: np.ndarray  # dense gradient bytes per position (from its weight-grad pass)
    expert_grad_bytes: np.ndarray  # expert gradient bytes per position (reduced over edp)
    params: np.ndarray  # parameters per position on one rank
    expert_params: np.ndarray  # the expert share of params (sharded over edp)
    model_flops_unit: float  # model FLOPs of one microbatch on one data-parallel replica
    program: Program
    per_layer: bool  # True: one position per layer (compose any split); False: the point's own
    tp_duplicated_params: np.ndarray  # SP-duplicated parameters per position (summed over tp once a step)


def _ops_inputs(sc: Scenario) -> tuple:
    """What ``ops.build_layer_ops`` reads of dp and the microbatch count, which ``_layer_key``
    leaves out: the per-microbatch loss all-reduce exists only with dp x cp > 1; FSDP2's copy-out
    and the rowwise Float8 weight cast on the shard depend on the ZeRO-3 shard
    (``fsdp2_copy_out_ops``, ``fp8_cast_bytes_per_elem``); Float8 weight casts are amortised
    over the microbatches and DeepSpeed ZeRO-0 adds nmb - 1 gradients a step; FSDP2 under a
    pipeline accumulates its gradients in fp32 over the microbatches and copies a kept unit out
    once a step (``fsdp2_grad_bytes_per_param``, ``fsdp2_copy_out_ops``). A reference
    Program built for one of these served the others (ZeRO-3's W segment, without
    main_grad adds, priced a ZeRO-1 point's backward)."""
    p = sc.parallelism
    edp_tp = scenario_edp_tp(sc)
    shard = scenario_optimizer_shards(sc)[0] if p.zero >= 3 else None
    fsdp2 = sc.framework == "torchtitan" and p.zero >= 3
    nmb = sc.num_microbatches if (sc.dtype == "fp8" or (sc.framework == "megatron-deepspeed" and p.zero == 0)
                                  or (fsdp2 and (p.pp > 1 or not p.fsdp_reshard_after_forward))) else None
    return (sc.dp * p.cp > 1, shard, nmb, fsdp2 and p.pp > 1)


def _layer_key(sc: Scenario, layout: tuple) -> str:
    """Everything that shapes a layer's ops; pipeline, batch count and cluster size are left out,
    but for what of the layout the reference Program takes (``Estimator._layout``)."""
    d = sc.model_dump(mode="json")
    d.pop("name", None)
    par = d["parallelism"]
    # ZeRO's collectives live on the engine's dp stream (the estimate adds the ZeRO-3 gathers
    # itself), but the layer's ops read ZeRO, dp and the microbatch count (_ops_inputs): those
    # stay in the key as the ops read them, so layouts that differ only in GPU count or global
    # batch still share one reference Program.
    for k in ("pp", "vpp", "dp", "pp_layer_split", "mesh_order", "overlap_grad_reduce", "grad_bucket_params"):
        par.pop(k, None)
    d["batch"].pop("global_batch_size", None)
    d["_ops_inputs"] = _ops_inputs(sc)
    for k in ("schedule", "schedule_file", "network"):
        d.pop(k, None)
    d["cluster"] = {"gpu": d["cluster"]["gpu"]}
    # A tied head shares the embedding's matrix where one rank holds both ends (pp = 1, V
    # placements); selective-layer checkpoints the layers its blocks' rank order picks.
    d["_layout"] = [layout[0], list(layout[1])]
    return json.dumps(d, sort_keys=True)


class Estimator:
    """Estimates points; caches profiles, topologies, schedules, reference Programs and replays.

    Collectives are priced on the alpha-beta tier model (``TierNetwork``) whatever the point's
    ``network``: a point set to ``flow`` is estimated as on ``alpha-beta``, and its simulation
    runs the flow fabric.

    One Estimator per process: its caches assume the files it loaded do not change.
    """

    def __init__(self) -> None:
        self._profiles: dict[str, Profile] = {}
        self._nets: dict[tuple[str, str], tuple[TierNetwork, int]] = {}
        self._scheds: dict[tuple, PipelineSchedule | UserError] = {}
        self._sched_info: dict[tuple, tuple[np.ndarray, int]] = {}
        self._tables: dict[str, _Table] = {}
        self._replays: dict[tuple, tuple[float, tuple[float, ...]]] = {}
        self._splits: dict[tuple, np.ndarray] = {}
        self._costs: dict[tuple, tuple[dict[str, np.ndarray], np.ndarray]] = {}
        self._coll: dict[tuple, float] = {}
        self._groups: dict[tuple, dict[Dim, np.ndarray]] = {}
        self._tails: dict[tuple, float] = {}
        self._tails_of: dict[tuple, list] = {}
        self._memory: dict[tuple, Any] = {}
        self._step_terms: dict[tuple, list[tuple]] = {}
        self._gather_preds: dict[tuple, tuple] = {}
        self._replayed_orders: dict[tuple, tuple] = {}  # (schedule key, microbatches) -> the actions replayed
        self.stats = {"reference_programs": 0, "schedules": 0, "replays": 0, "slow_path": 0}

    # ------------------------------------------------------------------ cached loads

    def profile(self, name: str | Profile) -> Profile:
        if isinstance(name, Profile):  # an inline profile (a what-if on a shipped one)
            return name
        p = self._profiles.get(name)
        if p is None:
            p = self._profiles[name] = load_profile(name)
        return p

    def network(self, sc: Scenario) -> tuple[TierNetwork, int]:
        key = (spec_key(sc.cluster.topology), spec_key(sc.cluster.gpu))
        hit = self._nets.get(key)
        if hit is None:
            topo = load_topology(sc.cluster.topology)
            hit = self._nets[key] = (TierNetwork.for_topology(topo, self.profile(sc.cluster.gpu)), topo.node.gpus_per_node)
        return hit

    def schedule(self, name: str, pp: int, nmb: int, vpp: int) -> PipelineSchedule:
        key = (name, pp, nmb, vpp)
        s = self._scheds.get(key)
        if s is None:
            try:
                # Named generators are validated by their own tests and by every simulation;
                # validating each here would cost more than the estimate itself.
                s = build_schedule(name, pp, nmb, vpp)
            except UserError as exc:
                s = exc
            self._scheds[key] = s
            self.stats["schedules"] += 1
        if isinstance(s, UserError):
            raise s
        return s

    def _schedule_info(self, key: tuple, sched: PipelineSchedule) -> tuple:
        """(actions per rank x position x kind outside overlapped pairs, the same inside F&B pairs,
        cross-rank boundaries along a chain, stages per rank, the pipeline ranks of the chain's
        first and last stage: the tied embedding's two ends, one rank under V schedules)."""
        hit = self._sched_info.get(key)
        if hit is None:
            P = sched.num_positions
            counts = np.zeros((sched.num_ranks, P, len(KINDS)))
            counts_fb = np.zeros((sched.num_ranks, P, len(KINDS)))
            pos_of = sched.stage_position
            for r, ops in enumerate(sched.actions):
                for a in ops:
                    if a.kind == "FB" and a.sub is not None:
                        for leaf in a.sub:
                            counts_fb[r, pos_of[leaf.stage], KINDS.index(leaf.kind)] += 1
                    else:
                        counts[r, pos_of[a.stage], KINDS.index(a.kind)] += 1
            chain = sched.chains[0]
            hops = sum(sched.stage_rank[a] != sched.stage_rank[b] for a, b in zip(chain, chain[1:]))
            stages = [sched.stages_of_rank(r) for r in range(sched.num_ranks)]
            tie = tuple(sorted({int(sched.stage_rank[chain[0]]), int(sched.stage_rank[chain[-1]])}))
            hit = self._sched_info[key] = (counts, counts_fb, int(hops), stages, tie)
        return hit

    def _tail_actions(self, key: tuple, sched: PipelineSchedule, r: int,
                      every: bool = False) -> list[tuple[str, int, bool, bool, int]]:
        """(kind, position, reduces gradients, blocking, stage) of rank r's actions from its first
        last-backward to the end: the plan's gradient buckets fill there (the planner's rule).
        ``every`` (Program.grad_reduce_every_microbatch): every backward reduces, so the actions
        from the rank's first backward on."""
        tkey = (key, r, every)
        hit = self._tails_of.get(tkey)
        if hit is None:
            actions = sched.actions[r]
            last_grad: dict[int, int] = {}
            first_grad: dict[int, int] = {}
            for idx, a in enumerate(actions):
                for leaf in a.leaves:
                    if leaf.kind in ("B", "W"):
                        last_grad[leaf.stage] = idx
                        first_grad.setdefault(leaf.stage, idx)
            hit = []
            for idx in range(min((first_grad if every else last_grad).values(), default=len(actions)), len(actions)):
                a = actions[idx]
                for leaf in a.leaves:
                    g = (every or last_grad.get(leaf.stage) == idx) and leaf.kind in ("B", "W")  # (the plan's rule)
                    hit.append((leaf.kind, sched.stage_position[leaf.stage], g, a.kind != "FB", leaf.stage))
            self._tails_of[tkey] = hit
        return hit

    def _replay(self, key: tuple, sched: PipelineSchedule, steps: np.ndarray,
                pair_steps: int | None, wait_steps: np.ndarray | None = None) -> tuple:
        """The schedule replayed with each position's own (F, B, I, W) costs, ``steps[position]``
        in RATIO_STEPs of the unit, an overlapped F&B pair ``pair_steps`` RATIO_STEPs of its two
        halves. Returns, in units: the replay's idle above its heaviest rank (makespan minus that
        rank's busy time), each rank's slack (how long before the makespan its last action ends)
        and the ranks' summed busy time, and per rank the gather wait its idle hid. ``wait_steps``
        (positions x kinds, RATIO_STEPs): the part of an action's cost spent waiting for its first
        unit's ZeRO-3 gather, which idle before the action hides (replay_action_costs' ``wait``;
        an F&B pair's is its first half's). Cached by the schedule and the quantised costs: the
        middle positions of a split mostly cost the same, so the points of one schedule and split
        shape share a few replays."""
        rkey = (key, steps.tobytes(), pair_steps, None if wait_steps is None else wait_steps.tobytes())
        hit = self._replays.get(rkey)
        if hit is None:
            rows = (steps * RATIO_STEP).tolist()
            leaf = {(st, k): rows[pos][i] for st, pos in enumerate(sched.stage_position) for i, k in enumerate(KINDS)}
            pair = None if pair_steps is None else pair_steps * RATIO_STEP

            def cost(a: Action) -> float:
                if a.kind == "FB":
                    return pair * sum(leaf[(x.stage, x.kind)] for x in a.leaves)
                return leaf[(a.stage, a.kind)]

            wait = None
            if wait_steps is not None:
                wrows = (wait_steps * RATIO_STEP).tolist()
                wleaf = {(st, k): wrows[pos][i] for st, pos in enumerate(sched.stage_position) for i, k in enumerate(KINDS)}

                def wait(a: Action) -> float:
                    x = a.leaves[0]
                    return wleaf[(x.stage, x.kind)]

            rep = replay_action_costs(sched, cost, wait)
            slack = tuple(rep.makespan - (e[-1] if e else 0.0) for e in rep.end)
            hit = self._replays[rkey] = (rep.makespan - max(rep.busy), slack, sum(rep.busy), rep.hidden)
            self.stats["replays"] += 1
        return hit

    # ------------------------------------------------------------------ reference programs

    def _point_schedule(self, sc: Scenario) -> tuple[PipelineSchedule, tuple]:
        """The point's schedule and its cache key."""
        p = sc.parallelism
        if sc.schedule_file:
            from simulator.simulate import resolve_schedule

            return resolve_schedule(sc), ("file", sc.schedule_file, p.pp, sc.num_microbatches)
        return self.schedule(sc.schedule, p.pp, sc.num_microbatches, p.vpp), (sc.schedule, p.pp, sc.num_microbatches, p.vpp)

    @staticmethod
    def _layout(sc: Scenario, sched: PipelineSchedule) -> tuple[bool, tuple[int, ...]]:
        """What of the point's layout its layers' ops read, which a reference Program of one
        layer a 1F1B position would not see: whether a tied head shares the embedding's matrix
        (ops.tied_head_shares_embedding: pp = 1 or a V placement) and the layers recompute
        selective-layer checkpoints (program.checkpointed_layers: counted per rank)."""
        p = sc.parallelism
        layers = split_layers(sc.model.num_layers, sched.num_positions, p.pp_layer_split,
                              p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
        return tied_head_shares_embedding(sc, sched), tuple(sorted(checkpointed_layers(sc, sched, layers)))

    def _table(self, sc: Scenario, sched: PipelineSchedule | None = None) -> _Table:
        if sc.parallelism.account_for_embedding_in_pipeline_split or sc.parallelism.account_for_loss_in_pipeline_split:
            # The per-layer reference program ties the embedding and head to the first and last
            # layer; a split that gives them positions of their own takes the exact path.
            return self._exact_table(sc)
        if sched is None:
            sched = self._point_schedule(sc)[0]
        layout = self._layout(sc, sched)
        key = _layer_key(sc, layout)
        tab = self._tables.get(key)
        if tab is not None:
            return tab
        prof = self.profile(sc.cluster.gpu)
        L = sc.model.num_layers
        try:
            ref_sc = sc.model_copy(update={"parallelism": sc.parallelism.model_copy(update={"pp_layer_split": None})})
            prog = build_program(ref_sc, prof, build_schedule("1f1b", L, 1), tied_head_shared=layout[0],
                                 recompute_layers=frozenset(layout[1]))
            if prog.schedule.num_positions != L or len(prog.stage_params) != L:
                raise ValueError("reference program does not have one position per layer")
            per_layer = True
        except Exception:
            # If the workload ever refuses a pipeline of one layer per stage, fall back to the
            # point's own Program (exact, slower); keyed by the whole scenario then.
            return self._exact_table(sc)
        tab = self._tables[key] = self._make_table(prog, sc, per_layer)
        self.stats["reference_programs"] += 1
        return tab

    def _exact_table(self, sc: Scenario) -> _Table:
        key = "exact:" + sc.model_dump_json()
        tab = self._tables.get(key)
        if tab is None:
            sched = self.schedule(sc.schedule, sc.parallelism.pp, sc.num_microbatches, sc.parallelism.vpp)
            prog = build_program(sc, self.profile(sc.cluster.gpu), sched)
            tab = self._tables[key] = self._make_table(prog, sc, False)
            self.stats["slow_path"] += 1
        return tab

    @staticmethod
    def _make_table(prog: Program, sc: Scenario, per_layer: bool) -> _Table:
        P = len(prog.position_layers)
        comp = {k: np.array([prog.segments[(pos, k)].total_compute_s for pos in range(P)]) for k in KINDS}
        grad = np.array([float(np.sum(prog.segments[(pos, "W")].grad_bytes)) for pos in range(P)])
        egrad = np.zeros(P)
        for pos in range(P):
            eg = prog.segments[(pos, "W")].expert_grad_bytes
            egrad[pos] = float(np.sum(eg)) if eg is not None else 0.0
        eparams = np.asarray(prog.stage_expert_params or [0.0] * P, dtype=float)
        tp_dup = np.asarray(prog.stage_tp_duplicated_params or [0.0] * P, dtype=float)
        unit = prog.model_flops_per_step / max(1, sc.num_microbatches * sc.dp)
        return _Table(comp, grad, egrad, np.asarray(prog.stage_params, dtype=float), eparams, unit, prog, per_layer,
                      tp_dup)

    # ------------------------------------------------------------------ network

    def _first_groups(self, mesh: Mesh, shard: int | None, edp_tp: int) -> dict[Dim, np.ndarray]:
        """The first group of every dimension the plan may name (the network prices one)."""
        key = (mesh.tp, mesh.cp, mesh.ep, mesh.dp, mesh.pp, mesh.order, shard, edp_tp)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = {d: v[:1].copy() for d, v in communication_groups(mesh, shard).items()}
        return g

    def _coll_time(self, net: TierNetwork, netkey: tuple, mesh: Mesh, shard: int | None, edp_tp: int, dim: str,
                   op: str, size: float) -> float:
        key = (netkey, mesh.tp, mesh.cp, mesh.ep, mesh.dp, mesh.pp, mesh.order, shard, edp_tp, dim, op, size)
        t = self._coll.get(key)
        if t is None:
            groups = self._first_groups(mesh, shard, edp_tp)
            if dim == Dim.PP:
                g = groups[Dim.PP][:, :2] if mesh.pp > 1 else np.zeros((1, 1), dtype=np.int64)
            else:
                g = groups[Dim(dim)]
            if op == CollectiveOp.RING_STEP:
                # Every member sends a block to the next one, at once (as the engine issues it).
                g = np.stack([g, np.roll(g, -1, axis=1)], axis=-1).reshape(-1, 2)
                op = CollectiveOp.SEND_RECV
            t = self._coll[key] = float(net.collective_time_s(CollectiveRequest(op, dim, g, size)))
        return t

    @staticmethod
    def _action_instrs(prog: Program, pos: int, kind: str, blocking: bool = True, on_grads=None, out=None) -> list:
        """The plan's instructions for one action of a reference position (the same emitter)."""
        out = [] if out is None else out
        counter = [len(out)]

        def new_handle() -> int:
            counter[0] += 1
            return 10**9 + counter[0]  # never clashes with the caller's handles

        emit_action(out, prog.segments[(pos, kind)], Action(pos, kind, 0), blocking, new_handle, on_grads=on_grads)
        return out

    @staticmethod
    def _one_communicator_replay(prog: Program, sched: PipelineSchedule, microbatches: int, bounds: list, stage_pos,
                                 layer_cost: dict, layer_cost_nb: dict, by_dim: dict, by_dim_nb: dict, coll, sm_count,
                                 scale: float, zero: int, bucket_bytes: float, prefetch: int,
                                 ag_dim: Dim) -> tuple[float, float, float, float]:
        """(replayed seconds, the same actions' priced costs, the replay's compute seconds, the
        priced rows' compute seconds) of a pp 1 rank's first ``microbatches`` microbatches, with
        FSDP's gathers and gradient reduce-scatters queued on one stream as the plan queues them
        under one communicator (Program.fsdp_one_communicator): a unit's gather waits behind the
        reduce-scatters issued before it. The per-row costs price each gather alone; the
        difference is what the shared queue adds, in compute (the reduce-scatters' kernels slow
        the backward they overlap) and in waiting. Compute is a row's cost less its exposed
        communication (``by_dim``: seconds a row and kind, by dimension)."""
        out: list = []
        handles = [0]

        def new_handle() -> int:
            handles[0] += 1
            return handles[0]

        unit_of, keep = prog.fsdp_unit_of, prog.fsdp_keep_gathered
        members: dict[int, list[int]] = {}
        for L, u in unit_of.items():
            members.setdefault(u, []).append(L)

        def unit_bytes(u: int) -> float:
            return sum(prog.unit_gather_bytes.get(L, prog.unit_params.get(L, 0.0) * prog.param_bytes) for L in members.get(u, [u]))

        # The rows in execution order, each with the unit it gathers first in its action (the plan's rule).
        rows: list[tuple] = []  # (leaf, blocking, row, bytes of each unit it gathers first)
        for a in sched.actions[0]:
            if a.microbatch >= microbatches:
                continue
            for leaf in a.leaves:
                lo, hi = bounds[stage_pos[leaf.stage]]
                seen: set[int] = set()
                for q in (range(lo, hi) if leaf.kind == "F" else range(hi - 1, lo - 1, -1)):
                    units: list[float] = []
                    if leaf.kind != "W":
                        for L in dict.fromkeys(int(x) for x in prog.segments[(q, leaf.kind)].layer):
                            u = unit_of.get(L, L)
                            if u in seen or (leaf.kind != "F" and u in keep):
                                continue
                            seen.add(u)
                            if unit_bytes(u) > 0:
                                units.append(unit_bytes(u))
                    rows.append((leaf, a.kind != "FB", q, units))
        gathers = [b for r in rows for b in r[3]]
        gh = [new_handle() for _ in gathers]
        issued = [0]

        def issue(upto: int) -> None:
            while issued[0] < min(upto, len(gathers)):
                i = issued[0]
                out.append(Collective(Stream.DP, ((ag_dim, CollectiveOp.ALL_GATHER, gathers[i]),), gh[i], "dp",
                                      "all_gather params"))
                issued[0] += 1

        issue(1 + prefetch)
        # The root unit's gradients (the embedding's and the head's) are reduced last, at the
        # action's end (GradBuckets.unit_of), not where their rows end.
        gb = GradBuckets(out, new_handle, zero, bucket_bytes, True, False, None, wait_previous=True, unit_of=unit_of)
        nxt = 0
        priced = priced_exposed = 0.0
        for i, (leaf, blocking, q, units) in enumerate(rows):
            for _ in units:
                issue(nxt + 1 + prefetch)
                out.append(Wait(gh[nxt], Dim.DP, "dp all_gather"))
                nxt += 1
            action_end = i + 1 == len(rows) or rows[i + 1][0] is not leaf
            emit_action(out, prog.segments[(q, leaf.kind)], leaf, blocking, new_handle,
                        on_grads=(lambda a, j, seg, last, _end=action_end: gb.add(a, j, seg, last, last and _end))
                        if leaf.kind in ("B", "W") else None)
            priced += (layer_cost if blocking else layer_cost_nb)[leaf.kind][q]
            ki = KINDS.index(leaf.kind)
            priced_exposed += sum(float(v[q, ki]) for v in (by_dim if blocking else by_dim_nb).values())
        gb.join()
        lc = linear_replay(out, coll, sm_count, scale)
        return lc.end_s, priced, lc.busy_s, priced - priced_exposed

    @staticmethod
    def _zero12_first_forward(prog: Program, rows: range, coll, sm_count, scale: float, bucket_params: float,
                              issue_at_start: bool, use_dp: bool, use_edp: bool,
                              layer_cost: dict) -> tuple[float, float]:
        """(exposed dp seconds, extra compute seconds) of a stage's first forward under ZeRO-1/2
        with overlap_param_gather, replayed with the plan's bucketed parameter gathers
        (plan.zero12_param_buckets): one bucket ahead from the first (issued where it is waited
        for), or all issued at step start (``issue_at_start``: an interleaved schedule's aligned
        gathers). Extra compute is what the gathers' kernels take from the rows they overlap."""
        out: list = []
        handles = [0]

        def new_handle() -> int:
            handles[0] += 1
            return handles[0]

        layers = list(dict.fromkeys(int(x) for q in rows for x in prog.segments[(q, "F")].layer))
        gathers = []
        for members in param_buckets(layers, prog.unit_params, bucket_params):
            dense, ebytes = zero12_bucket_bytes(prog, members, use_dp, use_edp)
            if dense > 0 or ebytes > 0:
                steps = (((Dim.DP, CollectiveOp.ALL_GATHER, dense),) if dense > 0 else ()) + \
                    (((Dim.EDP, CollectiveOp.ALL_GATHER, ebytes),) if ebytes > 0 else ())
                gathers.append((members[0], steps, new_handle()))
        prefetch = len(gathers) if issue_at_start else 1
        state = [0, 0]  # next to wait for, next to issue

        def issue(upto: int) -> None:
            while state[1] < min(upto, len(gathers)):
                _, steps, h = gathers[state[1]]
                out.append(Collective(Stream.DP_AG, steps, h, "dp", "all_gather params"))
                state[1] += 1

        def on_layer(_idx: int, layer: int) -> None:
            i = state[0]
            if i < len(gathers) and gathers[i][0] == layer:
                state[0] += 1
                issue(i + 1 + prefetch)
                out.append(Wait(gathers[i][2], Dim.DP, "dp all_gather"))

        if issue_at_start:
            issue(1 + prefetch)
        priced = 0.0
        for q in rows:
            emit_action(out, prog.segments[(q, "F")], Action(q, "F", 0), True, new_handle, on_layer=on_layer)
            priced += float(layer_cost["F"][q])
        lc = linear_replay(out, coll, sm_count, scale)
        waited = lc.exposed_s.get(Dim.DP, 0.0)
        return waited, max(0.0, lc.end_s - priced - waited)

    def _action_gathers(self, skey: tuple, sched: PipelineSchedule, firsts: np.ndarray, f_c: float, starts: np.ndarray,
                        counts_: np.ndarray, prefetch: int, pos_cost: dict, pos_cost_nb: dict, pos_dim: dict,
                        pos_dim_nb: dict) -> np.ndarray:
        """Resharded ZeRO-3 under a pipeline: what hides the gather of an action's first unit.

        The plan issues a unit's gather ``fsdp_prefetch`` units ahead in the rank's own order of
        actions (plan._plan_rank's one gather list per rank), so an action's first unit is gathered
        behind the previous gathering action's last unit on that rank, and behind any weight-
        gradient (W) actions between them, which gather nothing. The reference rows priced it
        behind the row before in the model, a unit of another stage and often of a kind the rank
        does not run next: the last stage's LM head, gathered before every backward, was put
        behind the first layer's (or the embedding's) backward and exposed, where the plan hides
        it behind the head's own forward (1f1b) or a W. This replaces, per position and kind,
        the first unit's extra and wait by their mean over the schedule's actual predecessors
        (B and I gather the same unit: one mean). A rank's first action waits for its input at
        step start while its first gather runs (rank 0's is the step's start gather): nothing to add.
        Returns that first unit's wait per F, B, I row and position (3 x positions): the part of
        the action's cost that idle before it hides (the replay's ``wait``)."""
        P = len(counts_)
        gkey = (skey, counts_.tobytes())
        preds = self._gather_preds.get(gkey)
        if preds is None:
            pos_of = sched.stage_position
            seen: dict[tuple, int] = {}
            for ops in sched.actions:
                prev = (-1, -1)
                ws: list[int] = []
                for a in ops:
                    for leaf in a.leaves:
                        q = pos_of[leaf.stage]
                        if leaf.kind == "W":
                            ws.append(q)
                            continue
                        key = (KINDS.index(leaf.kind), q, prev[0], prev[1], tuple(ws))
                        seen[key] = seen.get(key, 0) + 1
                        prev, ws = (KINDS.index(leaf.kind), q), []
            pats = list(seen)
            pk, pq, ppk, ppq = np.array([pt[:4] for pt in pats], dtype=np.int64).reshape(-1, 4).T
            cnt = np.array([seen[pt] for pt in pats], dtype=float)
            first, last = starts, starts + counts_ - 1
            # A position's first and last row in execution order: forward runs its rows up,
            # backward down. The gathered unit is the action's first; what hides it, the
            # predecessor's last.
            ag_rows = np.where(pk == 0, first[pq], last[pq])
            behind_rows = np.where(ppk == 0, last[np.maximum(ppq, 0)], first[np.maximum(ppq, 0)])
            idx = np.where(pk == 0, 0, 1) * P + pq  # F, or backward (B and I gather the same unit)
            den = np.bincount(idx, weights=cnt, minlength=2 * P).reshape(2, P)[[0, 1, 1]]  # F, B, I
            preds = self._gather_preds[gkey] = (
                pk, ag_rows, np.maximum(ppk, 0), behind_rows, (ppq >= 0).astype(float), idx, cnt, den > 0,
                np.where(den > 0, den, 1.0), np.stack([first, last, last]),
                np.array([i for i, pt in enumerate(pats) for _ in pt[4]], dtype=np.int64),
                np.array([q for pt in pats for q in pt[4]], dtype=np.int64))
        pk, ag_rows, ppk, behind_rows, has_prev, idx, cnt, ok, den, own_rows, w_pat, w_q = preds
        ag = firsts[0, pk, ag_rows]
        f_b = np.full(len(pk), f_c)
        if prefetch > 0:
            behind = firsts[3, ppk, behind_rows]
            f_b = np.where(firsts[4, ppk, behind_rows] > 0, firsts[4, ppk, behind_rows], f_c)
            if len(w_q):
                behind = behind + np.bincount(w_pat, weights=pos_cost["W"][w_q], minlength=len(pk))
        else:
            behind = np.zeros(len(pk))
        extra = has_prev * np.maximum(np.where(behind * f_b >= ag, ag * (1 - 1 / f_b), ag - behind), 0.0)
        wait = has_prev * np.maximum(0.0, ag - behind * f_b)
        mean_extra = np.bincount(idx, weights=extra * cnt, minlength=2 * P).reshape(2, P)[[0, 1, 1]] / den
        kidx = np.array([[0], [1], [2]])  # KINDS' F, B, I
        d_extra = np.where(ok, mean_extra - firsts[1, kidx, own_rows], 0.0)
        for i, k in enumerate(("F", "B", "I")):
            pos_cost[k] = pos_cost[k] + d_extra[i]
            pos_cost_nb[k] = pos_cost_nb[k] + d_extra[i]
        mean_wait = np.bincount(idx, weights=wait * cnt, minlength=2 * P).reshape(2, P)[[0, 1, 1]] / den
        first_wait = np.where(ok, mean_wait, firsts[2, kidx, own_rows])
        if "dp" in pos_dim:
            d_wait = (first_wait - firsts[2, kidx, own_rows]).T
            for dims in (pos_dim, pos_dim_nb):
                m = dims["dp"] = dims["dp"].copy()
                m[:, :3] += d_wait
        return first_wait

    def _step_terms_end(self, sc: Scenario, prof: Profile, net_key: tuple, opt_params: float, dp_cp: int,
                        ends: dict[int, float], tie_ranks: tuple[int, ...], coll, exposed: dict[str, float],
                        tp_duplicated_params: float = 0.0) -> float:
        """When the step-level work ends, from the pipeline's end: the plan's Program.step_collectives
        run on every rank after its gradient reduction (``ends``), in order, blocking its compute
        stream. The tied-embedding all-reduce runs on the chain's first and last stage's ranks only
        (none under V schedules, whose two ends are one rank) and starts when both have arrived;
        an all-reduce over pp waits for every rank; tp and dp all-reduces join ranks of the same
        pipeline rank, which run the same work. The terms are the program's own
        (``program.step_terms``) for this point's optimizer shard, priced once per layout and
        network (``net_key``: the network, GPU and mesh the collectives run on)."""
        p, m = sc.parallelism, sc.model
        # (the framework: torchtitan's clip multiplies every gradient, program.step_terms)
        key = (net_key, m.tied_embeddings, m.vocab_size, m.hidden_size, p.zero, p.fsdp_shard_size, sc.dtype, p.grad_clip,
               opt_params, tp_duplicated_params, sc.framework)
        priced = self._step_terms.get(key)
        if priced is None:
            shard, _ = scenario_optimizer_shards(sc)
            # The plan's group sizes (plan._group_size): a one-rank group runs no collective.
            size = {Dim.TP: p.tp, Dim.PP: p.pp, Dim.DP: dp_cp, Dim.EMB: 2 if p.pp > 1 else 1}
            priced = []  # (who waits for whom, kernel + collective seconds, collective seconds, report dim)
            for term in step_terms(sc, prof, [], opt_params, shard, tp_duplicated_params=tp_duplicated_params):
                dim = Dim(term.dim)
                c = coll(dim, term.op, term.size_bytes) if term.size_bytes > 0 and size[dim] > 1 else 0.0
                how = "emb" if dim == Dim.EMB else "every" if dim == Dim.PP and c > 0 else "own"
                priced.append((how, term.compute_s + c, c, dim.base.value))
            self._step_terms[key] = priced
        if not priced:
            return max(0.0, *ends.values())
        t = dict(ends)
        for how, cost, c, dim in priced:
            if how == "emb":
                if len(tie_ranks) < 2:
                    continue
                both = max(t[r] for r in tie_ranks) + cost
                for r in tie_ranks:
                    t[r] = both
            elif how == "every":
                # The rank that ends the pipeline (slack 0) may not be sampled: it arrives at 0 or later.
                t = dict.fromkeys(t, max(0.0, *t.values()) + cost)
            else:
                t = {r: v + cost for r, v in t.items()}
            exposed[dim] = exposed.get(dim, 0.0) + c
        return max(0.0, *t.values())

    # ------------------------------------------------------------------ the estimate

    def estimate(self, sc: Scenario) -> Estimate:
        p = sc.parallelism
        prof = self.profile(sc.cluster.gpu)
        net, _ = self.network(sc)
        netkey = (spec_key(sc.cluster.topology), spec_key(sc.cluster.gpu))
        nmb = sc.num_microbatches
        dp = sc.dp
        sched, skey = self._point_schedule(sc)
        P = sched.num_positions
        if P > sc.model.num_layers + int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split):
            # Scenario.check only sees pp*vpp; V-shaped schedules hold 2 stages per rank.
            raise UserError(
                f"schedule {sched.name!r} splits the model into {P} positions but num_layers={sc.model.num_layers}: "
                "lower pp or pick another schedule"
            )
        tab = self._table(sc, sched)
        prog = tab.program
        mesh = mesh_of(sc)
        hsdp = hsdp_shard_of(p.zero, p.fsdp_shard_size, dp, cp=p.cp)
        # The gradient reduction's ranks: dp with the CP ranks (Mesh.groups("dp-cp")); the
        # experts' the ranks holding the same experts, tp ranks included under sequence
        # parallelism (plan.edp_tp_of), as the plan has them.
        dp_cp = dp * p.cp
        edp_tp = mesh.edp_tp
        use_edp = mesh.edp > 1
        hsdp_expert = hsdp_expert_shard_of(hsdp, p.ep, edp_tp)

        local: dict[tuple, float] = {}

        def coll(dim: str, op: str, size: float) -> float:
            k = (dim, op, size)
            t = local.get(k)
            if t is None:
                t = local[k] = self._coll_time(net, netkey, mesh, hsdp, edp_tp, dim, op, size)
            return t

        # Per-position costs: the plan's own instructions for each action, replayed alone (compute,
        # blocking collectives, overlapped ones joined where the plan joins them).
        fsdp = p.zero >= 3 and (dp_cp > 1 or use_edp)
        ckey = (id(tab), netkey, p.tp, p.cp, p.ep, dp, p.pp, p.mesh_order, fsdp, hsdp, edp_tp, p.fsdp_prefetch,
                p.fsdp_reshard_after_forward)
        hit = self._costs.get(ckey)
        if hit is None:
            n = len(tab.params)
            layer_cost = {k: np.zeros(n) for k in KINDS}
            layer_cost_nb = {k: np.zeros(n) for k in KINDS}  # as half of an overlapped F&B pair
            by_dim: dict[str, np.ndarray] = {}
            by_dim_nb: dict[str, np.ndarray] = {}
            replayed: dict[tuple, object] = {}
            for pos in range(n):
                for ki, k in enumerate(KINDS):
                    for blocking, costs, dims in ((True, layer_cost, by_dim), (False, layer_cost_nb, by_dim_nb)):
                        if not blocking and k == "W":
                            continue
                        seg = prog.segments[(pos, k)]
                        # Layers of one kind have identical segments: replay each shape once.
                        rkey = (k, blocking, seg.compute_s.tobytes(), tuple(seg.comm),
                                None if seg.sm_share is None else seg.sm_share.tobytes())
                        lc = replayed.get(rkey)
                        if lc is None:
                            lc = replayed[rkey] = linear_replay(self._action_instrs(prog, pos, k, blocking=blocking), coll,
                                                            prof.compute.sm_count, _contention_scale(prof))
                        costs[k][pos] = lc.end_s
                        for d, v in lc.exposed_s.items():
                            if v:
                                dims.setdefault(d.value, np.zeros((n, len(KINDS))))[pos, ki] += v
            start_gather = 0.0
            once = None  # (extra compute, exposed wait) per layer of gathers paid once a step
            # Resharded ZeRO-3: per kind and row, the row's first unit's gather, the extra and wait
            # priced for it behind the row before, and the row's last unit's time (see _action_gathers).
            firsts = None
            f_c = 1.0
            # Each layer's actions alone, before FSDP gathers: what a tail replay without
            # buckets adds up to (every action joins its own collectives at its end).
            bare_cost = {k: v.copy() for k, v in layer_cost.items()}
            bare_cost_nb = {k: v.copy() for k, v in layer_cost_nb.items()}
            if fsdp:
                # ZeRO-3: each unit's parameters are all-gathered before its forward (and again
                # before its backward when resharded); with prefetch a unit's gather runs behind
                # the previous unit's compute (the unit before in forward, after in backward).
                # The units are the plan's (plan._plan_rank): every layer id of an action's
                # segment, so the embedding and the LM head are units of their own beside the
                # first and last layer, gathered behind the unit next to them (the head's gather
                # behind the last layer's forward, the last layer's behind the head's backward).
                # Pricing a row's units as one gather behind the row before put the head's whole
                # gather behind one layer's compute. A unit's gather moves unit_gather_bytes where
                # the program has them (the FP8 all-gather: 1-byte Float8 linears, bf16 embedding,
                # norms, head), else its parameters at the gathered dtype's bytes (the dtype's
                # 2 bytes were charged for the Float8 linears: +5.7% on torchtitan tensorwise).
                units = prog.unit_params or {}
                # A MoE unit's experts are gathered over the expert group, after the rest (the plan's rule).
                ag_dim, eag_dim = (Dim.DP_SHARD, Dim.EDP_SHARD) if hsdp else (Dim.DP, Dim.EDP)
                ag_of: dict[int, float] = {}

                def unit_ag(L: int) -> float:
                    t = ag_of.get(L)
                    if t is None:
                        nbytes = prog.unit_gather_bytes.get(L, units.get(L, 0.0) * prog.param_bytes)
                        ebytes = prog.unit_expert_gather_bytes.get(L, 0.0)
                        dense, ebytes = (nbytes - ebytes if dp_cp > 1 else 0.0), (ebytes if use_edp else 0.0)
                        t = ag_of[L] = ((coll(ag_dim, CollectiveOp.ALL_GATHER, float(dense)) if dense > 0 else 0.0)
                                        + (coll(eag_dim, CollectiveOp.ALL_GATHER, float(ebytes)) if ebytes > 0 else 0.0))
                    return t

                # While the gather runs, the compute behind it runs slowed by the SMs the
                # gather's kernel holds (simulator.contention): in time ag it does ag / f of
                # work; the unit then waits for whatever of the gather is left.
                # Only the compute's SM-bound share (GEMMs, attention) slows (Segments.sm_share):
                # each unit's behind a gather at its own share, as the engine times each segment.
                f_c = scaled_slowdown(compute_slowdown(prof.compute.sm_count, collective_ctas(CollectiveOp.ALL_GATHER)),
                                      _contention_scale(prof))  # all SM-bound; each unit below at its share
                excess = f_c - 1.0
                kinds = ("F", "B", "I") if p.fsdp_reshard_after_forward else ("F",)
                if p.fsdp_reshard_after_forward:
                    firsts = np.zeros((5, len(KINDS), n))
                for k in kinds:
                    # The units of every row in execution order (rows backwards for B and I),
                    # each with its share of its row's cost (by compute) and its gather.
                    row_of, unit_s, ag_l, first_u, last_u, f_l = [], [], [], [], [], []
                    for pos in (range(n) if k == "F" else range(n - 1, -1, -1)):
                        seg = prog.segments[(pos, k)]
                        ids = list(dict.fromkeys(int(x) for x in seg.layer))
                        tot = float(seg.compute_s.sum())
                        first_u.append(len(row_of))
                        for u in ids:
                            in_u = seg.layer == u
                            t_u = float(seg.compute_s[in_u].sum())
                            share = t_u / tot if tot > 0 else 1.0 / len(ids)
                            row_of.append(pos)
                            unit_s.append(layer_cost[k][pos] * share)
                            ag_l.append(unit_ag(u))
                            sm_u = (float((seg.compute_s[in_u] * seg.sm_share[in_u]).sum()) / t_u
                                    if seg.sm_share is not None and t_u > 0 else 1.0)
                            f_l.append(1.0 + excess * sm_u)
                        last_u.append(len(row_of) - 1)
                    ag = np.array(ag_l)
                    if k == "F":
                        # Nothing runs behind the step's first gather (the stage's first unit).
                        start_gather = float(ag[0])
                    behind = np.roll(np.array(unit_s), 1) if p.fsdp_prefetch > 0 else np.zeros(len(ag))
                    f_u = np.roll(np.array(f_l), 1)  # the slowdown of the unit a gather runs behind
                    extra_u = np.maximum(np.where(behind >= ag / f_u, ag * (1 - 1 / f_u), ag - behind), 0.0)
                    wait_u = np.maximum(0.0, ag - behind * f_u)
                    extra, wait = np.zeros(n), np.zeros(n)
                    np.add.at(extra, row_of, extra_u)
                    np.add.at(wait, row_of, wait_u)
                    if firsts is not None:
                        rows = np.array([row_of[i] for i in first_u])
                        ki = KINDS.index(k)
                        firsts[0, ki, rows] = ag[first_u]
                        firsts[1, ki, rows] = extra_u[first_u]
                        firsts[2, ki, rows] = wait_u[first_u]
                        firsts[3, ki, rows] = np.array(unit_s)[last_u]
                        firsts[4, ki, rows] = np.array(f_l)[last_u]
                    if not p.fsdp_reshard_after_forward:
                        # Kept gathered: a unit is gathered before its stage's first forward only,
                        # once a step (the plan's rule), not before every microbatch's; spread over
                        # the step's microbatches below, as nmb is not in this cache's key.
                        once = (extra, wait)
                        continue
                    layer_cost[k] = layer_cost[k] + extra
                    layer_cost_nb[k] = layer_cost_nb[k] + extra
                    by_dim.setdefault("dp", np.zeros((n, len(KINDS))))[:, KINDS.index(k)] += wait
                    by_dim_nb.setdefault("dp", np.zeros((n, len(KINDS))))[:, KINDS.index(k)] += wait
            hit = self._costs[ckey] = (layer_cost, by_dim, layer_cost_nb, by_dim_nb, start_gather, bare_cost, bare_cost_nb,
                                       once, firsts, f_c)
        layer_cost, by_dim, layer_cost_nb, by_dim_nb, start_gather, bare_cost, bare_cost_nb, once, firsts, f_c = hit
        if once is not None:
            extra, wait = once[0] / max(1, nmb), once[1] / max(1, nmb)
            layer_cost = {**layer_cost, "F": layer_cost["F"] + extra}
            layer_cost_nb = {**layer_cost_nb, "F": layer_cost_nb["F"] + extra}
            fi = KINDS.index("F")
            by_dim, by_dim_nb = dict(by_dim), dict(by_dim_nb)
            for dims in (by_dim, by_dim_nb):
                m_ = dims.get("dp", np.zeros((len(extra), len(KINDS)))).copy()
                m_[:, fi] += wait
                dims["dp"] = m_
        first_wait = None  # resharded ZeRO-3: each F, B, I action's first-unit gather wait, per position
        split_key = None  # (the per-layer table's split of layers over positions: below)
        if tab.per_layer:
            L = len(tab.params)
            split_key = (L, P, tuple(p.pp_layer_split) if p.pp_layer_split else None,
                         p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
            counts_ = self._splits.get(split_key)
            if counts_ is None:
                layers = split_layers(L, P, p.pp_layer_split, p.account_for_embedding_in_pipeline_split,
                                      p.account_for_loss_in_pipeline_split)
                counts_ = self._splits[split_key] = np.array([len(ls) for ls in layers])
            # A position may hold no layer (only the embedding or the LM head): counted sums, not reduceat.
            pos_cost = {k: _segment_sum(layer_cost[k], counts_) for k in KINDS}
            pos_cost_nb = {k: _segment_sum(layer_cost_nb[k], counts_) for k in KINDS}
            pos_dim = {d: _segment_sum(v, counts_) for d, v in by_dim.items()}
            pos_dim_nb = {d: _segment_sum(v, counts_) for d, v in by_dim_nb.items()}
            pos_params = _segment_sum(tab.params, counts_)
            pos_eparams = _segment_sum(tab.expert_params, counts_)
            pos_tp_dup = _segment_sum(tab.tp_duplicated_params, counts_)
            starts = np.cumsum(counts_) - counts_
            bounds = list(zip(starts.tolist(), (starts + counts_).tolist()))
            if firsts is not None and counts_.min() > 0:
                first_wait = self._action_gathers(skey, sched, firsts, f_c, starts, counts_, p.fsdp_prefetch, pos_cost, pos_cost_nb,
                                     pos_dim, pos_dim_nb)
        else:
            # The point's own program (positions holding only the embedding or the head): one row
            # a position, its gathers priced as the per-layer rows' are.
            pos_cost = {k: v.copy() for k, v in layer_cost.items()}
            pos_cost_nb = {k: v.copy() for k, v in layer_cost_nb.items()}
            pos_dim = {d: v.copy() for d, v in by_dim.items()}
            pos_dim_nb = {d: v.copy() for d, v in by_dim_nb.items()}
            pos_params, pos_eparams, pos_tp_dup = tab.params, tab.expert_params, tab.tp_duplicated_params
            bounds = [(q, q + 1) for q in range(len(tab.params))]
            if firsts is not None:
                ones = np.ones(len(tab.params), dtype=int)
                first_wait = self._action_gathers(skey, sched, firsts, f_c, np.arange(len(tab.params)), ones, p.fsdp_prefetch,
                                     pos_cost, pos_cost_nb, pos_dim, pos_dim_nb)

        # Pipeline: the heaviest rank's busy time plus the idle above it (below).
        counts, counts_fb, hops, rank_stages, tie_ranks = self._schedule_info(skey, sched)
        cost_mat = np.stack([pos_cost[k] for k in KINDS], axis=1)  # positions x kinds
        cost_mat_nb = np.stack([pos_cost_nb[k] for k in KINDS], axis=1)
        busy = np.einsum("rpk,pk->r", counts, cost_mat) + np.einsum("rpk,pk->r", counts_fb, cost_mat_nb)
        # The pipeline: the heaviest rank's busy time, plus the idle above it in a replay of the
        # schedule with each position's own costs. A replay of the mean stage plus the heaviest
        # rank's excess (until round 23) assumed that rank idles as long as a rank of the mean
        # stage does. The first position holds the embedding and the last the LM head and loss,
        # so they cost more than the middle ones (the small model's 2-layer stages: LM head +60%
        # F). Under 1F1B the heavy last rank idles in the fill and drain that the other stages
        # set, and the assumption held; V placements (zbv, dualpipev) put both ends on rank 0,
        # whose idle is the round trip of its own microbatches through the lighter ranks, which
        # its extra work fills: the mean replay's bubble plus its excess counted that time twice
        # (small model pp 4: DualPipeV +5.8%, zbv +2.7%).
        u = float(pos_cost["F"][sched.num_positions // 2])  # the unit: a middle position's F
        if u > 0:
            # Costs in RATIO_STEPs of the unit, so that points whose positions cost alike share a
            # replay. I is its own, not B - W: a ZeRO-3 I waits for its gathers as B does, so
            # I + W exceeds B where the gathers bind.
            steps = np.rint(cost_mat / (u * RATIO_STEP)).astype(np.int64)
            pair_steps = None
            if counts_fb.any():
                # An overlapped F&B pair costs its two halves, each joining its own collectives at
                # its end: in the replay, its blocking halves times their ratio over the pairs.
                rfb = float((counts_fb * cost_mat_nb).sum()) / float((counts_fb * cost_mat).sum())
                pair_steps = max(1, round(rfb / RATIO_STEP))
            wait_steps = None
            if first_wait is not None and first_wait.any():
                # The first unit's gather is issued on the rank's own order, so the rank's idle
                # before the action (its input not yet there) hides its wait: priced as if nothing
                # overlapped it, DualPipeV pp 4 (64 GPUs, seq 512, 8 microbatches) read +2.9%.
                wait_steps = np.zeros_like(steps)
                wait_steps[:, :3] = np.minimum(np.rint(first_wait.T / (u * RATIO_STEP)).astype(np.int64), steps[:, :3])
            idle_u, slack_u, busy_u, hidden_u = self._replay(skey, sched, steps, pair_steps, wait_steps)
            # The quantised costs rescaled to the point's own on the whole: the idle is the other
            # positions' work, mostly the middle ones'.
            unit_s = float(busy.sum()) / busy_u if busy_u > 0 else u
            pipeline = float(busy.max()) + idle_u * unit_s
            slack = [unit_s * x for x in slack_u]
        else:
            pipeline = float(busy.max())
            slack = [0.0] * p.pp
            hidden_u, unit_s = (0.0,) * p.pp, 0.0

        exposed = dict.fromkeys(DIM_NAMES, 0.0)
        # Blocking collectives of the busiest rank are exposed by construction.
        rmax = int(np.argmax(busy))
        for d, m in pos_dim.items():
            exposed[d] = exposed.get(d, 0.0) + float((counts[rmax] * m).sum())
        for d, m in pos_dim_nb.items():
            exposed[d] = exposed.get(d, 0.0) + float((counts_fb[rmax] * m).sum())
        # Less the gather waits its idle hid (the replay's): they ran while it waited for input.
        exposed["dp"] = max(0.0, exposed["dp"] - hidden_u[rmax] * unit_s)

        # Pipeline p2p on the fill / drain path (the plan's message size and scatter/gather).
        if p.pp > 1 and hops:
            pp_bytes, gather_bytes = pp_message_bytes(sc.batch.micro_batch_size, sc.batch.seq_length, p.cp,
                                                      sc.model.hidden_size, sc.dtype_bytes, p.tp, p.sequence_parallel,
                                                      p.pp_scatter_gather)
            send = coll(Dim.PP, CollectiveOp.SEND_RECV, pp_bytes)
            if gather_bytes > 0:
                send += coll(Dim.TP, CollectiveOp.ALL_GATHER, gather_bytes)
            exposed["pp"] += 2 * hops * send
        p2p_s = exposed["pp"]

        # Data parallel: parameter all-gather before the first forward, gradient tail at the end.
        start_s = 0.0
        # When each sampled rank's backward work ends (its last action, then its gradient
        # reduction), from the pipeline's end: a rank whose last action ends before the makespan
        # starts that much early. The tied embedding's two ends are sampled for the step terms.
        ends = {r: -slack[r] for r in sorted({0, p.pp // 2, p.pp - 1, *tie_ranks})}
        queue_compute_s = 0.0  # FSDP2's one-communicator queue: the tail's slowed compute (below)
        start_compute_s = 0.0  # ZeRO-1/2's bucketed gathers: the first forwards' slowed compute (below)
        stage_pos = sched.stage_position
        param_bytes = prog.param_bytes  # the plan's ZeRO-1/2 gather (the dtype's bytes below ZeRO-3)
        if p.zero >= 3:
            start_s = start_gather
        elif p.zero >= 1 and not sc.overlap_param_gather:
            # Gathered after the optimizer step, blocking: rank 0 waits for all its stages' (the
            # other ranks' gathers run while they wait for their first input).
            for st in rank_stages[0]:
                q = stage_pos[st]
                if dp_cp > 1:
                    start_s += coll(Dim.DP, CollectiveOp.ALL_GATHER, float(pos_params[q] - pos_eparams[q]) * param_bytes)
                if pos_eparams[q] > 0 and use_edp:
                    start_s += coll(Dim.EDP, CollectiveOp.ALL_GATHER, float(pos_eparams[q]) * param_bytes)
        elif p.zero >= 1 and (dp_cp > 1 or use_edp):
            # megatron-core's bucketed gathers in each stage's first forward (the plan's
            # zero12_param_buckets). Without interleaving each rank issues its first bucket where
            # its first forward waits for it, so every rank's first-bucket wait lies on the fill
            # path; an interleaved schedule issues them all at step start (aligned), where the
            # first rank's first forward waits.
            interleaved = sched.num_stages > sched.num_ranks
            # (once a schedule, split and bucket: a warm point looks it up, not its ranks)
            tkey = ("zero12 total", id(tab), ckey, skey, split_key, sc.grad_bucket_params, interleaved)
            total = self._tails.get(tkey)
            if total is None:
                waited_s = extra_s = 0.0
                for r in ((0,) if interleaved else range(p.pp)):
                    st = next(leaf.stage for a in sched.actions[r] for leaf in a.leaves if leaf.kind == "F")
                    lo, hi = bounds[stage_pos[st]]
                    # Replayed once for what the rows are, not where: the middle ranks' first
                    # stages are alike.
                    zkey = ("zero12", id(tab), ckey, tuple((float(tab.params[q]), float(layer_cost["F"][q]))
                                                           for q in range(lo, hi)), sc.grad_bucket_params, interleaved)
                    got = self._tails.get(zkey)
                    if got is None:
                        got = self._tails[zkey] = self._zero12_first_forward(
                            prog, range(lo, hi), coll, prof.compute.sm_count, _contention_scale(prof),
                            float(sc.grad_bucket_params), interleaved, dp_cp > 1, use_edp, layer_cost)
                    waited_s += got[0]
                    extra_s += got[1]
                total = self._tails[tkey] = (waited_s, extra_s)
            start_s += total[0] + total[1]
            start_compute_s += total[1]
        if dp_cp > 1 or use_edp:
            bucket_bytes = sc.grad_bucket_params * scenario_grad_bytes(sc)
            # The tail differs by the stages a rank holds: the first and last ranks hold the
            # embedding and the head, every middle rank the same layers (up to uneven splits).
            # FSDP2's rules (the plan's Program.grad_reduce_waits_previous and
            # grad_reduce_every_microbatch), read off the point's scenario as build_program sets them.
            fsdp2 = sc.framework == "torchtitan" and p.zero >= 3
            # FSDP2 without a pipeline: its gathers and reduce-scatters share one communicator
            # (Program.fsdp_one_communicator), so the whole step's queue is replayed below (the
            # rank's one chain of actions; periodic in the microbatch from the second on).
            one_comm = (fsdp and prog.fsdp_one_communicator and p.pp == 1 and hsdp is None and p.overlap_grad_reduce
                        and p.fsdp_reshard_after_forward and not (use_edp and float(tab.expert_params.sum()) > 0))
            for r in ends:
                if one_comm:
                    ks = (nmb,) if nmb <= 3 else (2, 3)
                    # Keyed by the replayed actions themselves: points that differ only in their
                    # microbatch count (beyond three) share the two replays.
                    okey_s = (skey, ks)
                    order = self._replayed_orders.get(okey_s)
                    if order is None:  # (once a schedule: a scan of every action per point was the hot path's)
                        order = self._replayed_orders[okey_s] = tuple(
                            (a.kind, a.microbatch, a.stage) for a in sched.actions[0] if a.microbatch < ks[-1])
                    okey = (id(tab), ckey, tuple(bounds), ks, order, bucket_bytes)
                    got = self._tails.get(okey)
                    if got is None:
                        got = self._tails[okey] = tuple(
                            self._one_communicator_replay(prog, sched, k, bounds, stage_pos, layer_cost, layer_cost_nb,
                                                          by_dim, by_dim_nb, coll, prof.compute.sm_count,
                                                          _contention_scale(prof), p.zero, bucket_bytes, p.fsdp_prefetch,
                                                          Dim.DP)
                            for k in ks)
                    if len(got) == 1:
                        replayed, priced, busy_replayed, busy_priced = got[0]
                    else:
                        two, three = got
                        replayed, priced, busy_replayed, busy_priced = (a + (nmb - 2) * (b - a) for a, b in zip(two, three))
                    ends[r] = max(0.0, replayed - priced - start_s) - slack[r]
                    # The part of that tail that is compute slowed by the queue's kernels is the
                    # pipeline's, as the simulation counts it (compute, not exposed dp).
                    queue_compute_s = min(max(0.0, busy_replayed - busy_priced), max(0.0, ends[r]))
                    continue
                stages = rank_stages[r]
                tail_actions = self._tail_actions(skey, sched, r, every=fsdp2 and p.pp == 1)
                bucketed = bucketed_stages(sched, r, sc.grad_buckets_first_chunk_only)
                tkey = (id(tab), ckey, tuple((k, bounds[q], g, blk) for k, q, g, blk, _ in tail_actions),
                        tuple(bounds[stage_pos[st]] for st in stages), p.zero, bucket_bytes, p.overlap_grad_reduce, use_edp,
                        None if bucketed is None else tuple(sorted(bucketed)), sc.grad_reduce_in_one_piece, fsdp2,
                        p.pp > 1)
                tail = self._tails.get(tkey)
                if tail is None:
                    # The plan's own buckets over the last backward of each stage, replayed alone:
                    # what that backward cannot hide is the tail.
                    out: list = []
                    handles = [0]

                    def new_handle() -> int:
                        handles[0] += 1
                        return handles[0]

                    # (The root unit's reduction at the backward's end, fsdp_unit_of, is not replayed:
                    # the replay emits one layer a position, so a unit's end is every position's.)
                    gb = GradBuckets(out, new_handle, p.zero, bucket_bytes, dp_cp > 1, use_edp, hsdp, bucketed, hsdp_expert,
                                     wait_previous=fsdp2)
                    bare_s = 0.0  # the same actions without buckets: the tail is the difference
                    # torchtitan under PP: a stage's units reduced after its last backward, each
                    # blocking (the plan's reduce_stage_grads; one layer a position, one unit each).
                    reduce_after = fsdp2 and p.pp > 1
                    if p.overlap_grad_reduce:
                        # From the first of the rank's last backwards to the end, as the plan runs it.
                        for kind, q0, g, blocking, stage in tail_actions:
                            lo, hi = bounds[q0]
                            leaf = Action(stage, kind, 0)
                            order = range(lo, hi) if kind == "F" else range(hi - 1, lo - 1, -1)
                            for q in order:
                                emit_action(out, prog.segments[(q, kind)], leaf, blocking, new_handle,
                                            on_grads=gb.add if g and not reduce_after else None)
                                bare_s += (bare_cost if blocking else bare_cost_nb)[kind][q]
                            if g and reduce_after:
                                for q in range(lo, hi):
                                    for nbytes, expert, on in ((float(tab.grad_bytes[q]), False, dp_cp > 1),
                                                               (float(tab.expert_grad_bytes[q]), True, use_edp)):
                                        if nbytes > 0 and on:
                                            out.append(Collective(Stream.DP, grad_reduction_steps(
                                                p.zero, nbytes, expert, hsdp, hsdp_expert), -1, "dp", "grads"))
                            elif g:
                                gb.flush("grads")
                    else:
                        for st in stages:
                            lo, hi = bounds[stage_pos[st]]
                            gb.split(float(tab.grad_bytes[lo:hi].sum()), float(tab.expert_grad_bytes[lo:hi].sum()), "grads",
                                     sc.grad_reduce_in_one_piece)
                    gb.join()
                    # What the buckets add: their exposed wait and the compute their kernels slow.
                    lc = linear_replay(out, coll, prof.compute.sm_count, _contention_scale(prof))
                    tail = self._tails[tkey] = max(0.0, lc.end_s - bare_s)
                # A rank whose backward ends before the pipeline drains reduces in that slack
                # (megatron-core's later stages reduce in one piece after their last backward).
                ends[r] = tail - slack[r]
        # The rank that ends the pipeline last (slack 0) may not be sampled: nothing ends before 0.
        end_dp = max(0.0, *ends.values())
        exposed["dp"] = exposed.get("dp", 0.0) + start_s + end_dp
        opt_bytes = 0.0
        for stages in rank_stages:
            eparams = float(sum(pos_eparams[stage_pos[st]] for st in stages))
            dense = float(sum(pos_params[stage_pos[st]] for st in stages)) - eparams
            opt_bytes = max(opt_bytes, optimizer_state_bytes(dense, eparams, p.zero, dp, p.ep, p.fsdp_shard_size, cp=p.cp,
                                                             edp_tp=edp_tp))
        opt_params = opt_bytes / ADAM_BYTES_PER_PARAM
        # The program's own optimizer model (multi-tensor Adam launches by shape, or the class curve).
        opt_s = optimizer_time_s(prof, opt_params, adam_tensor_count(sc.model.num_layers, p.pp),
                                 adam_bytes_per_param(sc), sc)
        tp_dup = max(float(sum(pos_tp_dup[stage_pos[st]] for st in stages)) for stages in rank_stages)
        terms_end = self._step_terms_end(sc, prof, (netkey, p.tp, p.cp, p.ep, dp, p.pp, p.mesh_order, hsdp), opt_params,
                                         dp_cp, ends, tie_ranks, coll, exposed, tp_dup)

        step = start_s + pipeline + p2p_s + terms_end + opt_s
        if queue_compute_s or start_compute_s:
            # Reported with the compute, as the simulation counts it; the step is the same sum.
            # (the queue: pp 1 only, where the one rank's tail is end_dp, which holds it)
            pipeline += queue_compute_s + start_compute_s
            exposed["dp"] -= queue_compute_s + start_compute_s
        gpus = sc.cluster.gpus
        tokens = sc.batch.global_batch_size * sc.batch.seq_length
        flops = tab.model_flops_unit * nmb * dp
        tps = tokens / step
        mfu = flops / (step * gpus * prof.compute.peak_tflops * 1e12)

        # Memory: the simulation's own model, on this layout (shared by points that differ only
        # in what memory does not see: topology, network, GPU count at equal dp...).
        # the field as written, not the resolved bucket: memory_report sizes its bucket reserve by
        # the field (40M where unset), so an unset field and its resolved value differ in memory
        mkey = (id(tab), skey, dp, p.zero, p.grad_bucket_params, p.pp_layer_split and tuple(p.pp_layer_split))
        mem = self._memory.get(mkey)
        if mem is None:
            if tab.per_layer:
                layers = split_layers(len(tab.params), P, p.pp_layer_split, p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split)
                view = dataclasses.replace(
                    tab.program, scenario=sc, mesh=mesh, schedule=sched, position_layers=layers,
                    stage_params=[float(x) for x in pos_params], zero=p.zero, overlap_grad_reduce=p.overlap_grad_reduce,
                    # the expert share of this layout's positions (the reference's is per layer): memory_report
                    # shards it over edp, the rest over dp; without it an expert model's optimizer state read as dense
                    stage_expert_params=[float(x) for x in pos_eparams],
                    grad_bucket_bytes=sc.grad_bucket_params * scenario_grad_bytes(sc), param_bytes=param_bytes,
                )
            else:
                view = tab.program
            mem = self._memory[mkey] = memory_report(sc, view, prof.hbm_gib, prof.usable_memory_fraction)
        return Estimate(
            step_time_s=step, tokens_per_s=tps, tokens_per_s_per_gpu=tps / gpus, mfu=mfu,
            peak_memory_gib=mem.peak_gib, memory_capacity_gib=mem.capacity_gib, fits_in_memory=mem.fits,
            gpus=gpus, num_microbatches=nmb, pipeline_s=pipeline, exposed_comm_s=exposed, optimizer_s=opt_s,
            step_terms_s=terms_end - end_dp,
        )


# ---------------------------------------------------------------------------------------------
# Rank agreement between the estimate and the simulation
# ---------------------------------------------------------------------------------------------

def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank), 0-based."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    sa, sb = ra.std(), rb.std()
    if sa == 0 or sb == 0:
        return float("nan")
    return float(((ra - ra.mean()) * (rb - rb.mean())).mean() / (sa * sb))


def kendall_tau_b(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, float), np.asarray(b, float)
    n = len(a)
    if n < 2:
        return float("nan")
    conc = disc = ties_a = ties_b = 0
    # Row blocks keep the pairwise matrices small for a few thousand points.
    for i0 in range(0, n, 512):
        da = np.sign(a[i0:i0 + 512, None] - a[None, :])
        db = np.sign(b[i0:i0 + 512, None] - b[None, :])
        iu = np.arange(i0, min(n, i0 + 512))[:, None] < np.arange(n)[None, :]
        prod = (da * db)[iu]
        conc += int((prod > 0).sum())
        disc += int((prod < 0).sum())
        ties_a += int(((da == 0) & (db != 0))[iu].sum())
        ties_b += int(((db == 0) & (da != 0))[iu].sum())
    denom = math.sqrt((conc + disc + ties_a) * (conc + disc + ties_b))
    return float((conc - disc) / denom) if denom else float("nan")


def rank_agreement(estimated: list[float], simulated: list[float], maximize: bool) -> dict[str, Any]:
    """How well the estimate orders the simulated points: Spearman, Kendall tau-b, top-1."""
    e, s = np.asarray(estimated, float), np.asarray(simulated, float)
    out: dict[str, Any] = {"n": int(len(e)), "spearman": spearman(e, s), "kendall": kendall_tau_b(e, s)}
    if len(e):
        pick = np.argmax if maximize else np.argmin
        out["top1_agree"] = bool(pick(e) == pick(s) or s[pick(e)] == s[pick(s)])
        best = s[pick(s)]
        out["estimate_top1_sim_regret"] = float(abs(best - s[pick(e)]) / abs(best)) if best else 0.0
        out["median_abs_rel_error"] = float(np.median(np.abs(e - s) / np.abs(s))) if np.all(s != 0) else float("nan")
    return out


def _segment_sum(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``counts`` rows (a run may be empty: a pipeline position that
    holds only the embedding or the LM head)."""
    v = np.asarray(values, dtype=float)
    cs = np.concatenate([np.zeros((1,) + v.shape[1:]), np.cumsum(v, axis=0)])
    ends = np.cumsum(counts)
    return cs[ends] - cs[ends - counts]
