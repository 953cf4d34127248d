"""Program: everything the engine replays, with every duration computed up front (DESIGN rule 2).

For each pipeline *position* (a slice of layers) and each action kind (F, B, I, W) the program
holds a short array of *segments*: a stretch of compute followed, optionally, by a blocking
collective (tp, cp or ep). Consecutive kernels are merged into one segment, so the event loop
sees one event per collective, not one per kernel. Ranks that hold the same positions run the
same program, which is what lets the engine simulate one representative per class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from simulator.profile import Profile
from simulator.errors import UserError
from simulator.scenario import Scenario
from simulator.schedules.base import PipelineSchedule
from simulator.topology.placement import Mesh
from simulator.workload.ops import Comm, Op, build_layer_ops, moe_dropped_fraction, moe_load_factor

from simulator.workload.plan import (  # noqa: F401  (re-exported: one home for the shared formulas)
    ADAM_BYTES_PER_PARAM, GRAD_REDUCE_BYTES, optimizer_state_bytes, pp_message_bytes,
)


@dataclass
class Segments:
    """One (position, kind): compute_s[i] runs, then comm[i] (if any) blocks the compute stream."""

    compute_s: np.ndarray
    comm: list[Comm | None]
    layer: np.ndarray  # layer id per segment (-1 embedding, num_layers = head)
    label: list[str]
    grad_bytes: np.ndarray  # dense gradient bytes ready at the end of the segment's compute (reduced over dp)
    flops: np.ndarray  # executed FLOPs per segment (for utilisation views)
    expert_grad_bytes: np.ndarray | None = None  # expert gradients (reduced over the expert-data-parallel group)

    @property
    def total_compute_s(self) -> float:
        return float(self.compute_s.sum())

    @staticmethod
    def constant(compute_s: float, grad_bytes: float = 0.0) -> "Segments":
        """One segment of pure compute (used by tests and synthetic programs)."""
        return Segments(np.array([compute_s]), [None], np.array([0]), ["compute"], np.array([grad_bytes]), np.array([0.0]),
                        np.array([0.0]))


@dataclass
class Program:
    scenario: Scenario | None
    mesh: Mesh
    schedule: PipelineSchedule
    # segments[(position, kind)] for kind in F, B, I, W
    segments: dict[tuple[int, str], Segments]
    position_layers: list[list[int]]
    pp_bytes: float  # bytes of one activation (or its gradient) sent between stages
    optimizer_s: float  # optimizer step of one rank (per stage it holds: scaled by params)
    stage_params: list[float]  # parameters of each stage on one rank (after TP/EP sharding)
    model_flops_per_step: float
    tokens_per_step: int
    zero: int = 1
    pp_gather_bytes: float = 0.0  # > 0: after a p2p receive, a tp all-gather of this size (scatter/gather)
    unit_params: dict[int, float] = field(default_factory=dict)  # FSDP units: layer id -> parameters on one rank
    fsdp_reshard_after_forward: bool = True
    fsdp_prefetch: int = 1
    fsdp_shard_size: int | None = None  # HSDP shard group size (None: the whole dp group)
    stage_expert_params: list[float] = field(default_factory=list)  # the expert share of stage_params (sharded over edp)
    overlap_grad_reduce: bool = True
    grad_bucket_bytes: float = 40e6 * GRAD_REDUCE_BYTES
    param_bytes: int = 2
    notes: list[str] = field(default_factory=list)

    @property
    def num_ranks_pp(self) -> int:
        return self.schedule.num_ranks


def split_layers(num_layers: int, positions: int, override: list[int] | None = None) -> list[list[int]]:
    """Layers per pipeline position. Uneven splits give the first and last positions fewer
    layers (they also hold the embedding and the LM head), as Llama 3 and the zero-bubble
    paper do."""
    if positions > num_layers:
        raise UserError(f"{positions} pipeline positions exceed num_layers={num_layers}: use fewer pipeline stages")
    if override is not None:
        counts = list(override)
    else:
        q = math.ceil(num_layers / positions)
        counts = [q] * positions
        deficit = q * positions - num_layers
        # Take one layer at a time from the ends inwards: first, last, second, second-to-last...
        order = []
        for i in range(positions // 2 + 1):
            for j in (i, positions - 1 - i):
                if j not in order and 0 <= j < positions:
                    order.append(j)
        k = 0
        while deficit > 0:
            j = order[k % len(order)]
            if counts[j] > 1:
                counts[j] -= 1
                deficit -= 1
            k += 1
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def _segments(ops: list[tuple[Op, int]], times: dict[int, float]) -> Segments:
    """Merge consecutive kernels into segments; a collective closes a segment."""
    compute, comms, layers, labels, grads, flops, egrads = [], [], [], [], [], [], []
    acc_t = acc_g = acc_f = acc_e = 0.0
    first = None
    last_layer = ops[0][1] if ops else 0
    for op, layer in ops:
        if layer != last_layer and (acc_t > 0 or acc_g > 0 or acc_e > 0) and first is not None:
            # A layer boundary closes a segment: FSDP units, gradient buckets and the timeline
            # all work per layer.
            compute.append(acc_t); comms.append(None); layers.append(last_layer)
            labels.append(first); grads.append(acc_g); flops.append(acc_f); egrads.append(acc_e)
            acc_t = acc_g = acc_f = acc_e = 0.0
            first = None
        last_layer = layer
        if op.comm is not None:
            if op.comm.op == "identity_ar":
                continue
            compute.append(acc_t); comms.append(op.comm); layers.append(layer)
            labels.append(first or op.name); grads.append(acc_g); flops.append(acc_f); egrads.append(acc_e)
            acc_t = acc_g = acc_f = acc_e = 0.0
            first = None
            continue
        acc_t += times[id(op)]
        acc_f += op.exec_flops
        if op.phase == "W":
            if op.name.startswith("experts_"):
                acc_e += op.params * GRAD_REDUCE_BYTES
            else:
                acc_g += op.params * GRAD_REDUCE_BYTES
        first = first or op.name
    if acc_t > 0 or not compute:
        compute.append(acc_t); comms.append(None); layers.append(last_layer)
        labels.append(first or "compute"); grads.append(acc_g); flops.append(acc_f); egrads.append(acc_e)
    return Segments(np.array(compute), comms, np.array(layers), labels, np.array(grads), np.array(flops), np.array(egrads))


def build_program(sc: Scenario, profile: Profile, schedule: PipelineSchedule) -> Program:
    p = sc.parallelism
    mesh = Mesh(tp=p.tp, cp=p.cp, ep=p.ep, dp=sc.dp, pp=p.pp, order=p.mesh_order)
    layer_kinds = build_layer_ops(sc)
    m = sc.model
    P = schedule.num_positions
    positions = split_layers(m.num_layers, P, p.pp_layer_split)

    # Backward op lists per layer kind, and the weight-grad-carrying embedding.
    bwd: dict[str, tuple[list[Op], list[Op]]] = {k: lo.backward() for k, lo in layer_kinds.items()}
    emb = layer_kinds["embedding"]
    emb_w = [Op("embedding_wgrad", "elementwise", "W", 0.0, 0.0, emb.forward[0].bytes, params=emb.params)]
    bwd["embedding"] = (bwd["embedding"][0], emb_w)

    # Every op's duration in one vectorised call (DESIGN rule 2).
    all_ops: list[Op] = []
    for kind, lo in layer_kinds.items():
        all_ops += lo.forward + bwd[kind][0] + bwd[kind][1]
    kernels = [o for o in all_ops if o.comm is None]
    dur = profile.compute_time_s(np.array([o.op_class for o in kernels]), np.array([o.exec_flops for o in kernels]),
                                 np.array([o.bytes for o in kernels]))
    times = {id(o): float(t) for o, t in zip(kernels, dur)}

    def kind_of(layer: int) -> str:
        if m.is_moe and layer >= m.num_dense_layers:
            return "moe"
        return "dense"

    def recompute_ops(kind: str) -> list[Op]:
        if sc.recompute == "full":
            return list(layer_kinds[kind].forward)
        if sc.recompute == "selective":
            return [o for o in layer_kinds[kind].forward if o.op_class == "attention" or o.name == "softmax_dropout"]
        return []

    segments: dict[tuple[int, str], Segments] = {}
    stage_params: list[float] = []
    stage_expert_params: list[float] = []
    for pos, layers in enumerate(positions):
        chain: list[tuple[str, int]] = []
        if pos == 0:
            chain.append(("embedding", -1))
        chain += [(kind_of(L), L) for L in layers]
        if pos == P - 1:
            chain.append(("head", m.num_layers))
        f_ops = [(o, L) for k, L in chain for o in layer_kinds[k].forward]
        i_ops, w_ops, b_ops = [], [], []
        for k, L in reversed(chain):
            rec = [(o, L) for o in recompute_ops(k)] if k not in ("embedding", "head") else []
            li = [(o, L) for o in bwd[k][0]]
            lw = [(o, L) for o in bwd[k][1]]
            i_ops += rec + li
            w_ops += lw
            b_ops += rec + li + lw
        segments[(pos, "F")] = _segments(f_ops, times)
        segments[(pos, "I")] = _segments(i_ops, times)
        segments[(pos, "W")] = _segments(w_ops, times)
        segments[(pos, "B")] = _segments(b_ops, times)
        stage_params.append(sum(layer_kinds[k].params for k, _ in chain))
        stage_expert_params.append(sum(o.params for k, _ in chain for o in layer_kinds[k].forward if o.name.startswith("experts_")))

    # Model FLOPs per step: forward + backward of every op on every rank, no recomputation.
    per_pos_model = []
    for pos, layers in enumerate(positions):
        tot = 0.0
        for L in layers:
            k = kind_of(L)
            tot += sum(o.model_flops for o in layer_kinds[k].forward + bwd[k][0] + bwd[k][1])
        if pos == P - 1:
            tot += sum(o.model_flops for o in layer_kinds["head"].forward + bwd["head"][0] + bwd["head"][1])
        per_pos_model.append(tot)
    # Each position's FLOPs are per TP/CP/EP rank per microbatch; scale to the whole job.
    ranks_per_replica = p.tp * p.cp
    model_flops = sum(per_pos_model) * ranks_per_replica * sc.num_microbatches * sc.dp

    pp_bytes, pp_gather_bytes = pp_message_bytes(sc.batch.micro_batch_size, sc.batch.seq_length, p.cp, m.hidden_size,
                                                 sc.dtype_bytes, p.tp, p.sequence_parallel, p.pp_scatter_gather)

    unit_params = {L: layer_kinds[kind_of(L)].params for L in range(m.num_layers)}
    unit_params[-1] = layer_kinds["embedding"].params
    unit_params[m.num_layers] = layer_kinds["head"].params
    notes: list[str] = []
    dropped = moe_dropped_fraction(sc)
    if dropped > 0:
        notes.append(f"MoE capacity factor {sc.moe.capacity_factor} drops {dropped:.1%} of routed tokens")
    if m.is_moe and moe_load_factor(sc) > 1.0:
        notes.append(f"MoE routing: the busiest EP rank processes {moe_load_factor(sc):.2f}x the mean tokens and sets the pace")

    # The optimizer updates this rank's parameters; ZeRO>=1 shards the update over dp (or the
    # HSDP shard group), expert parameters over the expert-data-parallel group.
    opt_bytes = 0.0
    for r in range(schedule.num_ranks):
        positions_r = [schedule.stage_position[st] for st in schedule.stages_of_rank(r)]
        expert = sum(stage_expert_params[q] for q in positions_r)
        dense = sum(stage_params[q] for q in positions_r) - expert
        opt_bytes = max(opt_bytes, optimizer_state_bytes(dense, expert, p.zero, sc.dp, p.ep, p.fsdp_shard_size))
    optimizer_s = float(profile.compute_time_s(np.array(["optimizer"]), np.array([0.0]), np.array([opt_bytes]))[0])

    return Program(
        scenario=sc, mesh=mesh, schedule=schedule, segments=segments, position_layers=positions,
        pp_bytes=pp_bytes, pp_gather_bytes=pp_gather_bytes, optimizer_s=optimizer_s, stage_params=stage_params,
        model_flops_per_step=model_flops, tokens_per_step=sc.batch.global_batch_size * sc.batch.seq_length,
        zero=p.zero, overlap_grad_reduce=p.overlap_grad_reduce,
        grad_bucket_bytes=p.grad_bucket_params * GRAD_REDUCE_BYTES,
        param_bytes=sc.dtype_bytes,
        unit_params=unit_params,
        stage_expert_params=stage_expert_params,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        fsdp_prefetch=p.fsdp_prefetch,
        fsdp_shard_size=p.fsdp_shard_size,
        notes=notes,
    )


def synthetic_program(schedule: PipelineSchedule, F_s: float, B_s: float, W_s: float = 0.0, FB_s: float | None = None,
                      optimizer_s: float = 0.0) -> Program:
    """A program with uniform per-position costs and no communication inside actions.

    B_s is the full backward; I costs B_s - W_s. For checking schedules against closed-form
    bubble formulas and for benchmarks of the engine itself.
    """
    P = schedule.num_positions
    seg: dict[tuple[int, str], Segments] = {}
    for pos in range(P):
        seg[(pos, "F")] = Segments.constant(F_s)
        seg[(pos, "B")] = Segments.constant(B_s)
        seg[(pos, "I")] = Segments.constant(B_s - W_s)
        seg[(pos, "W")] = Segments.constant(W_s)
    mesh = Mesh(tp=1, cp=1, ep=1, dp=1, pp=schedule.num_ranks)
    return Program(
        scenario=None, mesh=mesh, schedule=schedule, segments=seg, position_layers=[[pos] for pos in range(P)],
        pp_bytes=0.0, optimizer_s=optimizer_s, stage_params=[0.0] * P, model_flops_per_step=0.0, tokens_per_step=0,
        zero=0,
    )
