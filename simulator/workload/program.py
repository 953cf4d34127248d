"""Program: everything the engine replays, with every duration computed up front (DESIGN rule 2).

For each pipeline *position* (a slice of layers) and each action kind (F, B, I, W) the program
holds a short array of *segments*: a stretch of compute followed, optionally, by a blocking
collective (tp, cp or ep). Consecutive kernels are merged into one segment, so the event loop
sees one event per collective, not one per kernel. Ranks that hold the same positions run the
same program, which is what lets the engine simulate one representative per class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from simulator.profile import Profile
from simulator.errors import UserError
from simulator.scenario import MEGATRON_GRAD_BUCKET_PARAMS, Scenario
from simulator.schedules.base import PipelineSchedule
from simulator.topology.placement import Mesh
from simulator.workload.ops import (ROUTED_EXPERT_GEMMS, Comm, LayerOps, Op, build_layer_ops, embedding_wgrad_op, fp8_recompute_cast_op,
                                   fsdp_gather_bytes, moe_dropped_fraction, moe_load_factor, op_durations_s,
                                   optimizer_time_s, tied_head_shares_embedding)

from simulator.workload.plan import (  # noqa: F401  (re-exported: one home for the shared formulas)
    ADAM_BYTES_PER_PARAM, GRAD_REDUCE_BYTES, JOIN, adam_bytes_per_param, adam_tensor_count, edp_tp_of, grad_reduce_bytes,
    torchtitan_state_bytes,
    mesh_of, optimizer_shards, optimizer_state_bytes, pp_message_bytes, scenario_grad_bytes, scenario_optimizer_shards,
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
    # Of compute_s, the time the device waits for the host to issue the segment's kernels: a
    # segment lasts max(kernel time, host issue time) (_segments); this is the excess, or None.
    host_wait_s: np.ndarray | None = None
    # Of compute_s, the fraction in kernels that fill the SMs (GEMMs, fused attention): what the
    # SM-share contention law slows while NCCL kernels hold SMs. Memory-bound kernels lose nothing
    # to SMs taken alone (measured on an H200: 0.997-0.999 with 8-64 of 132 SMs held, round 28,
    # tests/data/reference/h200/kernels.csv), nor does the host wait. None: all of it.
    sm_share: np.ndarray | None = None

    @property
    def total_compute_s(self) -> float:
        return float(self.compute_s.sum())

    @staticmethod
    def constant(compute_s: float, grad_bytes: float = 0.0) -> "Segments":
        """One segment of pure compute (used by tests and synthetic programs)."""
        return Segments(np.array([compute_s]), [None], np.array([0]), ["compute"], np.array([grad_bytes]), np.array([0.0]),
                        np.array([0.0]))


@dataclass(frozen=True)
class StepCollective:
    """Step-level work after the backward, before the optimizer: an optional kernel of
    ``compute_s``, then a collective over ``dim`` (tp, pp, dp, or emb: first and last stage)."""

    label: str
    dim: str
    op: str
    size_bytes: float
    compute_s: float = 0.0


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
    pp_blocking_exchange: bool = False  # Megatron-LM 2021's blocking exchange (scenario parallelism.pp_exchange)
    unit_params: dict[int, float] = field(default_factory=dict)  # FSDP units: layer id -> parameters on one rank
    unit_expert_params: dict[int, float] = field(default_factory=dict)  # layer id -> the routed experts' share of unit_params
    # FSDP units: layer id -> bytes one all-gather of it moves, where they are not unit_params x param_bytes.
    unit_gather_bytes: dict[int, float] = field(default_factory=dict)
    # FSDP units: layer id -> the routed experts' share of those bytes (MoE layers only), gathered
    # over the expert-data-parallel group rather than the dense one.
    unit_expert_gather_bytes: dict[int, float] = field(default_factory=dict)
    fsdp_reshard_after_forward: bool = True
    fsdp_prefetch: int = 1
    fsdp_shard_size: int | None = None  # HSDP shard group size (None: the whole dp group)
    # FSDP units: layer id -> the unit it belongs to, where not its own (torchtitan's root module:
    # the embedding, the final norm and the output head, fully_shard(model) in apply_fsdp).
    fsdp_unit_of: dict[int, int] = field(default_factory=dict)
    # FSDP units kept whole from their forward to their backward though the others reshard
    # (torchtitan's last transformer block: apply_fsdp's "default" policy).
    fsdp_keep_gathered: frozenset[int] = frozenset()
    # A stage's gradients reduced after its last backward, unit by unit, the compute stream
    # waiting for each (torch.distributed.pipelining's REDUCE_GRAD over FSDP2: plan.reduce_stage_grads).
    grad_reduce_after_stage_backward: bool = False
    # Before it issues a unit's gradient reduction the compute stream waits for the one in flight
    # (FSDP2's post_backward_rs_wait: torch 2.13 _fsdp_param_group.py post_backward keeps
    # reduce_scatter_max_input_buffers = 1 input buffer, waiting on the previous unit's
    # reduce-scatter event before it copies in the next), so a backward whose reductions outlast
    # its compute is held back by them rather than running ahead of them.
    grad_reduce_waits_previous: bool = False
    # Every microbatch's backward reduces its gradients (not only a stage's last): torchtitan's
    # gradient accumulation without PP (0.1.0 train.py train_step runs loss.backward() per
    # microbatch with FSDP2's gradient sync left on; the reduced shards add into .grad).
    grad_reduce_every_microbatch: bool = False
    # FSDP's parameter all-gathers and gradient reduce-scatters go through one NCCL communicator,
    # which runs one collective at a time in issue order (torch 2.13 FSDPModule
    # set_separate_reduce_scatter_group: "By default FSDP runs all-gather and reduce-scatter on
    # separate CUDA streams but through the **same** process group -- one NCCL communicator, which
    # processes one collective at a time and so serializes them on the wire"; the opt-out is
    # experimental and torchtitan does not call it: parallelism.fsdp_separate_reduce_scatter_group
    # asks for it). The plan queues both on one stream.
    fsdp_one_communicator: bool = False
    stage_expert_params: list[float] = field(default_factory=list)  # the expert share of stage_params (sharded over edp)
    # Per position: SP-duplicated parameters (LayerOps.tp_duplicated_params), summed over tp once a step.
    stage_tp_duplicated_params: list[float] = field(default_factory=list)
    edp_tp: int = 1  # tp ranks in the expert-data-parallel group (plan.edp_tp_of)
    overlap_grad_reduce: bool = True
    # ZeRO-1/2: the updated parameters' all-gather overlaps the first forwards (scenario
    # overlap_param_gather); else every rank waits for it before its first action.
    overlap_param_gather: bool = True
    bucket_params: float = float(MEGATRON_GRAD_BUCKET_PARAMS)  # Scenario.grad_bucket_params (a parameter and gradient bucket)
    grad_bucket_bytes: float = float(MEGATRON_GRAD_BUCKET_PARAMS) * GRAD_REDUCE_BYTES
    grad_buckets_first_chunk_only: bool = False  # Scenario.grad_buckets_first_chunk_only
    grad_reduce_in_one_piece: bool = False  # Scenario.grad_reduce_in_one_piece
    param_bytes: int = 2
    notes: list[str] = field(default_factory=list)
    step_collectives: list[StepCollective] = field(default_factory=list)

    @property
    def num_ranks_pp(self) -> int:
        return self.schedule.num_ranks


def fp8_speedup(sc: Scenario, profile: Profile) -> float:
    """FP8 over BF16 tensor-core peak of the profile's GPU (1 when the scenario is not FP8);
    UserError when the GPU has no FP8 (or, for mxfp8, no MXFP8) tensor cores, or for bf16 on a GPU
    without BF16 ones (V100)."""
    c = profile.compute
    if sc.dtype == "bf16" and not c.bf16:
        raise UserError(
            f"dtype bf16 needs BF16 tensor cores but GPU profile {profile.name!r} has none (compute.bf16 is false; "
            "Volta has FP16 only): use dtype fp16, or an A100 or newer profile"
        )
    if sc.dtype != "fp8":
        return 1.0
    if sc.fp8.recipe == "mxfp8":
        if c.peak_tflops_mxfp8 is None:
            other = ("use fp8.recipe te-delayed, te-current, tensorwise or rowwise (per-tensor or row-wise FP8), or a "
                     "b200/gb200 profile") if c.peak_tflops_fp8 else "use dtype bf16, or a b200/gb200 profile"
            raise UserError(
                f"fp8 recipe mxfp8 needs MXFP8 tensor cores (Blackwell) but GPU profile {profile.name!r} has none: {other}"
            )
        return c.peak_tflops_mxfp8 / c.peak_tflops
    if c.peak_tflops_fp8 is None:
        raise UserError(
            f"dtype fp8 needs FP8 tensor cores but GPU profile {profile.name!r} has none (no compute.peak_tflops_fp8): "
            f"use dtype {'bf16' if c.bf16 else 'fp16'}, or an H100/H200/B200/GB200 profile"
        )
    return c.peak_tflops_fp8 / c.peak_tflops


def split_layers(num_layers: int, positions: int, override: list[int] | None = None,
                 embedding_counts: bool = False, loss_counts: bool = False) -> list[list[int]]:
    """Layers per pipeline position. Uneven splits give the first and last positions fewer
    layers (they also hold the embedding and the LM head), as Llama 3 and the zero-bubble
    paper do. ``embedding_counts`` / ``loss_counts``: the embedding / the LM head and loss
    take the place of one layer on the first / last position (Megatron's
    --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split), which
    may leave that position with the embedding or the head alone."""
    extra = int(embedding_counts) + int(loss_counts)
    if positions > num_layers + extra:
        raise UserError(f"{positions} pipeline positions exceed num_layers={num_layers}: use fewer pipeline stages")
    if override is None and extra:
        counts = [len(x) for x in split_layers(num_layers + extra, positions)]
        if embedding_counts:
            counts[0] -= 1
        if loss_counts:
            counts[-1] -= 1
        # A position left with the embedding or head only is allowed; a negative count is not.
        if min(counts) < 0:
            counts = [len(x) for x in split_layers(num_layers, positions)]
        override = counts
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


def host_issue_s(profile: Profile, op: Op) -> float:
    """Host time to issue ``op``'s kernels (or its collective's launch) in eager PyTorch: forward
    ops on the Python thread, backward (I/W) ops on the autograd thread."""
    c = profile.compute
    if op.comm is not None and op.comm.op == JOIN:
        return 0.0  # a stream wait, no call
    if op.comm is not None and op.comm.op != "identity_ar" and c.host_collective_us > 0:
        return c.host_collective_us * 1e-6
    per_us = c.host_launch_forward_us if op.phase == "F" else c.host_launch_backward_us
    return op.launches * per_us * 1e-6


def _segments(ops: list[tuple[Op, int]], times: dict[int, float], host: dict[int, float] | None = None,
              grad_bytes_per_param: float = GRAD_REDUCE_BYTES) -> Segments:
    """Merge consecutive kernels into segments; a collective closes a segment.

    ``host``: host issue time per op. A segment takes at least the time its host needs to issue
    its kernels and the collective that closes it: when kernels are shorter than their launch
    cost the device waits on the host (small layers, high TP). Taken per segment, the bound
    ignores the host running ahead across a collective (an upper bound of the pipelined issue)."""
    compute, comms, layers, labels, grads, flops, egrads, waits, shares = [], [], [], [], [], [], [], [], []
    host = host or {}
    acc_t = acc_g = acc_f = acc_e = acc_h = acc_s = 0.0
    first = last = None

    def named(fallback: str) -> str:
        # A segment is named after the ops it merged: the first, or first…last (Perfetto and the
        # op view showed "qkv_proj" for qkv, attention and the output projection together).
        if first is None:
            return fallback
        return first if last in (None, first) else f"{first}…{last}"

    last_layer = ops[0][1] if ops else 0
    for op, layer in ops:
        if layer != last_layer and (acc_t > 0 or acc_g > 0 or acc_e > 0) and first is not None:
            # A layer boundary closes a segment: FSDP units, gradient buckets and the timeline
            # all work per layer.
            compute.append(max(acc_t, acc_h)); waits.append(max(0.0, acc_h - acc_t)); comms.append(None)
            layers.append(last_layer); shares.append(_sm_share(acc_s, acc_t, acc_h))
            labels.append(named(first)); grads.append(acc_g); flops.append(acc_f); egrads.append(acc_e)
            acc_t = acc_g = acc_f = acc_e = acc_h = acc_s = 0.0
            first = last = None
        last_layer = layer
        if op.comm is not None:
            if op.comm.op == "identity_ar":
                continue
            acc_h += host.get(id(op), 0.0)
            compute.append(max(acc_t, acc_h)); waits.append(max(0.0, acc_h - acc_t)); comms.append(op.comm)
            layers.append(layer); shares.append(_sm_share(acc_s, acc_t, acc_h))
            labels.append(named(op.name)); grads.append(acc_g); flops.append(acc_f); egrads.append(acc_e)
            acc_t = acc_g = acc_f = acc_e = acc_h = acc_s = 0.0
            first = last = None
            continue
        acc_t += times[id(op)]
        if op.op_class in SM_BOUND_CLASSES:
            acc_s += times[id(op)]
        acc_h += host.get(id(op), 0.0)
        acc_f += op.exec_flops
        if op.phase == "W":
            if op.name.startswith("experts_"):
                acc_e += op.params * grad_bytes_per_param
            else:
                acc_g += op.params * grad_bytes_per_param
        first = first or op.name
        last = op.name
    if acc_t > 0 or not compute:
        compute.append(max(acc_t, acc_h)); waits.append(max(0.0, acc_h - acc_t)); comms.append(None)
        layers.append(last_layer); shares.append(_sm_share(acc_s, acc_t, acc_h))
        labels.append(named("compute")); grads.append(acc_g); flops.append(acc_f); egrads.append(acc_e)
    return Segments(np.array(compute), comms, np.array(layers), labels, np.array(grads), np.array(flops), np.array(egrads),
                    np.array(waits) if any(w > 0 for w in waits) else None, np.array(shares))


# Op classes whose kernels fill the SMs and so slow down when NCCL kernels hold some (the
# SM-share law, simulator.contention); the rest (elementwise, norm, optimizer, embedding) are
# memory-bound, and keep their speed while HBM has bandwidth to spare.
SM_BOUND_CLASSES = frozenset({"gemm", "attention"})


def _sm_share(sm_bound_s: float, kernels_s: float, host_s: float) -> float:
    """Fraction of a segment's time (max of kernels and host issue) in SM-bound kernels."""
    total = max(kernels_s, host_s)
    return sm_bound_s / total if total > 0 else 1.0


def host_launch_wait_s(prog: "Program") -> list[float]:
    """Per pipeline rank, the seconds of one step its compute stream waits for the host to issue
    kernels (eager PyTorch's launch cost, profile host_launch_*_us): the sum of Segments.host_wait_s
    over the rank's actions in the step's schedule. A plan quantity: the engine runs each segment
    for its compute_s, which includes it."""
    sched = prog.schedule
    per_kind: dict[tuple[int, str], float] = {}
    out = []
    for actions in sched.actions:
        total = 0.0
        for a in actions:
            for leaf in a.leaves:
                key = (sched.stage_position[leaf.stage], leaf.kind)
                v = per_kind.get(key)
                if v is None:
                    seg = prog.segments.get(key)
                    v = per_kind[key] = float(seg.host_wait_s.sum()) if seg is not None and seg.host_wait_s is not None else 0.0
                total += v
        out.append(total)
    return out


def host_wait_shares(prog: "Program") -> dict[tuple[int, str], float]:
    """Per (position, kind) that waits on the host: the fraction of its compute time that is
    host wait (Segments.host_wait_s over compute_s), for splitting a stretch of an action's
    compute (the critical path's) into kernels and waiting for their launches."""
    out = {}
    for key, seg in prog.segments.items():
        if seg.host_wait_s is not None:
            total = float(seg.compute_s.sum())
            if total > 0:
                out[key] = float(seg.host_wait_s.sum()) / total
    return out


def _torchtitan_mm_parts(sc: Scenario, op: Op) -> list[float]:
    """The aten.mm calls torchtitan's Llama runs for one of our (fused) projection ops, as
    fractions of its output width: wq, wk, wv for qkv_proj (models/llama3/model/model.py
    Attention.forward calls self.wq(x), self.wk(x), self.wv(x)); w1 then w3 for fc1_gate_up
    (FeedForward.forward: self.w2(F.silu(self.w1(x)) * self.w3(x)) evaluates w1 before w3)."""
    m, t = sc.model, sc.parallelism.tp
    if op.name == "qkv_proj":
        q, kv = max(m.num_attention_heads // t, 1), max(m.kv_heads // t, 1)
        return [q / (q + 2 * kv), kv / (q + 2 * kv), kv / (q + 2 * kv)]
    if op.name == "fc1_gate_up":
        return [0.5, 0.5]
    return [1.0]


def _gemm_part(op: Op, frac: float, tag: str) -> Op:
    """``frac`` of a GEMM's output columns as its own GEMM (same tokens and inner dimension)."""
    if frac == 1.0:
        return op
    k = op.kernel
    kern = replace(k, n=max(1, round(k.n * frac)), flops=k.flops * frac, bytes=k.bytes * frac) if k is not None else None
    return replace(op, name=f"{op.name}.{tag}", exec_flops=op.exec_flops * frac, model_flops=op.model_flops * frac,
                   bytes=op.bytes * frac, params=op.params * frac, kernel=kern)


def _splittable(op: Op, tp: int) -> bool:
    """A GEMM timed by shape whose M rows (tokens) split into tp chunks. Not the routed experts'
    grouped GEMMs: the collectives beside them are the MoE dispatcher's (ops.EXPERT_TP_COMM), which
    neither TE's userbuffers nor torch's micro-pipelined TP overlap."""
    k = op.kernel
    return (op.comm is None and op.op_class == "gemm" and k is not None and k.kind == "gemm" and k.m >= tp
            and not op.name.startswith(ROUTED_EXPERT_GEMMS))


def _gemm_rows(op: Op, rows: int, tag: str) -> Op:
    """The GEMM on ``rows`` of its M rows (tokens) as its own GEMM: same weight, fewer tokens
    (``op`` is ``_splittable``)."""
    k = op.kernel
    m = k.m
    frac = rows / m
    # element size from the kernel's own byte count (A m x k, B k x n, C m x n)
    dt = k.bytes / max(1, k.batch * (m * k.k + k.k * k.n + m * k.n))
    kern = replace(k, m=rows, flops=k.flops * frac, bytes=dt * k.batch * (rows * k.k + k.k * k.n + rows * k.n))
    return replace(op, name=f"{op.name}.{tag}", exec_flops=op.exec_flops * frac, model_flops=op.model_flops * frac,
                   bytes=op.bytes * frac, params=op.params * frac, kernel=kern)


# Transformer Engine userbuffers (Megatron --tp-comm-overlap), TE 1.11
# pytorch/module/base.py initialize_ub defaults: ring exchange for the all-gather -> GEMM pairs
# (qkv/fc1 fprop, proj/fc2 dgrad: tp splits, copy-engine P2P, num_sm 1), pipelined reduce-scatter
# for proj/fc2 fprop (num_splits 4, num_sm 16), bulk overlap for qkv/fc1 dgrad (the input-gradient
# reduce-scatter runs beside the weight-gradient GEMM, the input re-gather beside the dgrad GEMM;
# num_sm 16).
TE_RING_EXCHANGE_SMS = 1
TE_PIPELINE_SPLITS = 4
TE_UB_SMS = 16


def _next_gemm_or_comm(ops: list[Op], i: int) -> int:
    """Index of the first op after ``i`` that is a GEMM or a collective (len(ops) if none): what
    lies between is elementwise work on the same tensor (a Float8 cast)."""
    j = i + 1
    while j < len(ops) and ops[j].comm is None and ops[j].op_class != "gemm":
        j += 1
    return j


def micro_pipeline_tp(ops: list[Op], tp: int, style: str = "torch") -> list[Op]:
    """TP communication overlapped with the TP GEMMs, as the frameworks run it. ``style``:

    ``torch`` (``parallelism.async_tp``): torch's micro-pipelined TP (torch
    ``distributed/_symmetric_memory``: ``_pipelined_all_gather_and_consume`` for
    ``fused_all_gather_matmul``, ``_pipelined_produce_and_all2all`` for
    ``fused_matmul_reduce_scatter``; torchtitan turns it on with torch.compile's
    ``_micro_pipeline_tp`` pass). The GEMM is cut into tp chunks of M / tp rows (tokens), each
    shard or partial moved by a P2P copy on the copy engines (no SMs):

    - all-gather -> GEMM: the local shard is copied into the symmetric buffer (read + write of
      S / tp bytes), then the local chunk's GEMM runs while the first remote shard is copied,
      and so on; the last chunk's GEMM waits for the last shard. As ops: the copy, the gather
      overlapped with tp - 1 chunks' GEMM, a JOIN, the last chunk. Elementwise ops between the
      gather and the GEMM (a Float8 cast: torchao casts the shard before the gather) go first.
    - GEMM -> reduce-scatter: the first chunk (a partial for a peer) runs alone, then the
      transfers overlap the other tp - 1 chunks; after a JOIN the tp partials of this rank's
      slice are summed (``reduce_fn``: reads S, writes S / tp). Ops between the GEMM and the
      reduce-scatter run after it.

    ``te`` (``parallelism.tp_comm_overlap``): Transformer Engine's userbuffers with its defaults
    (see TE_*): all-gather -> GEMM as above (ring exchange in tp splits on the copy engines, one
    SM; the forward's LayerNorm writes its output into the userbuffer, so no shard copy there);
    a forward GEMM -> reduce-scatter in 4 splits, the reduce-scatter on 16 SMs reducing as it
    goes (no partial sum); an input-gradient GEMM -> reduce-scatter in bulk: the whole GEMM,
    then the reduce-scatter beside what follows (the weight-gradient GEMMs); the weight
    gradient's input re-gather likewise on 16 SMs.

    The transfers are priced as the collective they replace (the same (tp - 1) / tp of S into
    every rank over NVLink); the overlapped chunks run as one GEMM of their rows (torch issues
    them on two streams so chunk GEMMs overlap each other, which its comments say removes most
    of the quantization loss). Nothing else changes."""
    te = style == "te"
    ag_sms = TE_RING_EXCHANGE_SMS if te else 0
    rs_splits = TE_PIPELINE_SPLITS if te else tp
    out: list[Op] = []
    i, n = 0, len(ops)
    while i < n:
        op = ops[i]
        c = op.comm
        if te and c is not None and c.dim == "tp" and c.overlap and c.op == "all_gather" and op.phase != "F":
            out.append(replace(op, comm=replace(c, ctas=TE_UB_SMS)))  # bulk: the weight gradient's re-gather
            i += 1
            continue
        if c is not None and c.dim == "tp" and not c.overlap and c.op == "all_gather":
            j = _next_gemm_or_comm(ops, i)
            g = ops[j] if j < n else None
            if g is not None and _splittable(g, tp):
                m = g.kernel.m
                last = m // tp
                out += ops[i + 1 : j]
                if not (te and op.phase == "F"):
                    out.append(Op(f"{op.name}.shard_copy", "elementwise", op.phase, bytes=2.0 * c.size_bytes / tp))
                out.append(replace(op, comm=replace(c, overlap=True, ctas=ag_sms)))
                out.append(_gemm_rows(g, m - last, "chunks"))
                out.append(Op(f"{op.name}.join", "other", op.phase, comm=Comm(c.dim, JOIN, 0.0)))
                out.append(_gemm_rows(g, last, "last_chunk"))
                i = j + 1
                continue
        if _splittable(op, tp):
            j = _next_gemm_or_comm(ops, i)
            rs = ops[j].comm if j < n else None
            if rs is not None and rs.dim == "tp" and not rs.overlap and rs.op == "reduce_scatter":
                if te and op.phase != "F":
                    # bulk: the input gradient is reduce-scattered beside the weight-gradient GEMMs
                    out += ops[i:j]
                    out.append(replace(ops[j], comm=replace(rs, overlap=True, ctas=TE_UB_SMS)))
                    i = j + 1
                    continue
                m = op.kernel.m
                first = m // rs_splits
                out.append(_gemm_rows(op, first, "first_chunk"))
                out.append(replace(ops[j], comm=replace(rs, overlap=True, ctas=TE_UB_SMS if te else 0)))
                out.append(_gemm_rows(op, m - first, "chunks"))
                out.append(Op(f"{ops[j].name}.join", "other", op.phase, comm=Comm(rs.dim, JOIN, 0.0)))
                if not te:
                    out.append(Op(f"{ops[j].name}.partials_sum", "elementwise", op.phase,
                                  bytes=rs.size_bytes + rs.size_bytes / tp))
                out += ops[i + 1 : j]
                i = j + 1
                continue
        out.append(op)
        i += 1
    return out


def is_grouped_expert_gemm(o: Op) -> bool:
    """A MoE layer's routed-expert GEMM: torchtitan runs it as torch._grouped_mm, which neither
    counts as aten.mm nor is in per-op SAC's save list (0.2.0 models/llama4/infra/parallelize.py
    _op_sac_save_list), so it is recomputed and its output not kept."""
    return o.name in ROUTED_EXPERT_GEMMS


def _sac_mm_parts(sc: Scenario, lo: LayerOps):
    """torchtitan's per-op SAC verdict on each mm a layer's forward runs, in order: (GEMM op, part
    index, fraction of its output columns, recomputed). The policy counts aten.mm per layer and
    recomputes every second one (mm_count % 2 == 0); with framework torchtitan the count runs over
    its separate projections (``_torchtitan_mm_parts``), otherwise over our fused GEMMs."""
    n_mm = 0
    for o in lo.forward:
        if o.comm is not None or o.op_class != "gemm" or not o.recompute or is_grouped_expert_gemm(o):
            continue
        for j, frac in enumerate(_torchtitan_mm_parts(sc, o) if sc.framework == "torchtitan" else [1.0]):
            n_mm += 1
            yield o, j, frac, n_mm % 2 == 0


# recompute selective-layer: torchtitan's layer AC checkpoints every ac_freq-th block, ac_freq
# being activation_checkpoint.selective_ac_option (torchtitan 0.1.0 config_manager.py: default
# "2", "every nth layer"; the published rows say "selective (layer)" and name no other).
TORCHTITAN_LAYER_AC_FREQ = 2


def selective_layer_checkpointed(local_index: int, ac_freq: int = TORCHTITAN_LAYER_AC_FREQ) -> bool:
    """Whether torchtitan's layer AC checkpoints the block its process wraps ``local_index``-th
    (0-based, ``rank_block_index``). torchtitan 0.1.0 models/llama3/infra/parallelize.py
    _apply_ac_to_transformer_block counts blocks on ptd_checkpoint_wrapper._count, a function
    attribute: one counter a process, never reset, incremented before each block, which is
    wrapped when count % ac_freq == 0. So the 2nd, 4th... block a rank wraps (local indices 1, 3,
    ...), whatever their global layer ids: at pp = 1 layers 1, 3, 5..., not 0, 2, 4..."""
    return (local_index + 1) % ac_freq == 0


def rank_block_index(schedule: PipelineSchedule, position_layers: list[list[int]]) -> dict[int, int]:
    """Each layer's index among the transformer blocks of the pipeline rank that holds it, in the
    order torchtitan wraps them: pipeline_llama (0.1.0 models/llama3/infra/pipeline.py) calls
    parallelize_fn on each model part in stage_ids_this_rank order (loop: r, r + pp, ...; v: r,
    2 pp - 1 - r; both ascending stage index, our position) and apply_ac walks each part's
    model.layers in order. The first chain's positions: DualPipe's second chain holds a mirrored
    copy of the same layers, which take the index they have in the first (DualPipe is not
    torchtitan's; its blocks' order on a rank is not read)."""
    out: dict[int, int] = {}
    chain = schedule.chains[0]
    for r in range(schedule.num_ranks):
        mine = sorted(schedule.stage_position[st] for st in chain if schedule.stage_rank[st] == r)
        out.update((L, i) for i, L in enumerate(L for q in mine for L in position_layers[q]))
    return out


def checkpointed_layers(sc: Scenario, schedule: PipelineSchedule, position_layers: list[list[int]]) -> frozenset[int]:
    """The layers recompute selective-layer checkpoints whole (none under any other policy): one
    rule for the work (build_program's layer_recompute_ops) and the memory model
    (stage_activation_bytes, the recompute working set)."""
    if sc.recompute != "selective-layer":
        return frozenset()
    return frozenset(L for L, i in rank_block_index(schedule, position_layers).items() if selective_layer_checkpointed(i))


# Ops that run inside one SDPA call (torch's context parallel: its merges, casts and K/V copies
# happen in the DTensor dispatch of aten._scaled_dot_product_flash_attention, _attention.py
# _sdpa_handler), so per-op SAC, which saves that op's outputs, never reruns them.
SDPA_INTERNAL_OPS = frozenset({"cp_sdpa_merge"})


def layer_recompute_ops(sc: Scenario, lo: LayerOps, checkpointed: bool = False) -> list[Op]:
    """Forward ops activation checkpointing reruns in a layer's backward. ``checkpointed``: under
    recompute selective-layer, whether this layer is one the rule checkpoints (checkpointed_layers)."""
    if sc.recompute == "full" or (sc.recompute == "selective-layer" and checkpointed):
        # torchtitan's layer AC checkpoints every second block a rank wraps whole.
        return [o for o in lo.forward if o.recompute]
    if sc.recompute == "selective-op":
        # torchtitan's per-op SAC policy (0.1.0 models/llama3/infra/parallelize.py _save_list,
        # _custom_policy): saves every aten.mm output except every second one (mm_count % 2 == 0,
        # counted per layer), the SDPA outputs and reduce-scatters; everything else is recomputed.
        # With framework torchtitan the count runs over its seven separate projections (wq, wk,
        # wv, wo, w1, w3, w2: wk, wo and w3 recomputed); otherwise over our fused GEMMs.
        # Float8 (torchao) linears dispatch aten.mm on Float8Tensor operands: SAC's
        # TorchDispatchMode sees that call before the subclass unwraps it into _scaled_mm (modes
        # run before a subclass's __torch_dispatch__; under torch.compile the AOT trace keeps that
        # order, functionalization below the subclass), so they count like bf16 mms.
        out = []
        tensorwise = sc.dtype == "fp8" and sc.fp8.recipe == "tensorwise"
        by_name = {o.name: o for o in lo.forward}
        verdicts: dict[int, list[tuple[int, float, bool]]] = {}
        for o, j, frac, recomputed in _sac_mm_parts(sc, lo):
            verdicts.setdefault(id(o), []).append((j, frac, recomputed))
        rerun: dict[str, bool] = {}  # GEMM name -> any of its mm parts recomputed
        for o in lo.forward:
            if o.comm is not None or o.op_class == "attention" or not o.recompute or o.name in SDPA_INTERNAL_OPS:
                continue
            if o.op_class == "gemm" and id(o) in verdicts:
                parts = verdicts[id(o)]
                rerun[o.name] = any(rec for _, _, rec in parts)
                out += [_gemm_part(o, frac, f"mm{j}") for j, frac, rec in parts if rec]
                continue
            out.append(o)
        if tensorwise:
            # A cast precedes its GEMM in the forward list, so its GEMM's verdict is known only now.
            recast = []
            for o in out:
                gemm = by_name.get(o.name[: -len(".fp8_cast")]) if o.name.endswith(".fp8_cast") else None
                if gemm is None:
                    recast.append(o)
                    continue
                # A grouped expert GEMM has no mm verdict: it is recomputed whole.
                r = fp8_recompute_cast_op(o, gemm, sc, rerun.get(gemm.name, is_grouped_expert_gemm(gemm)))
                if r is not None:
                    recast.append(r)
            out = recast
        return out
    if sc.recompute == "selective":
        # Megatron's selective recompute reruns core_attention whole (megatron-core 0.16.1
        # transformer/attention.py _checkpointed_attention_forward): classic attention's context
        # permute copy (DotProductAttention.forward, attn_layout_copies' forward bytes), and under
        # context parallelism the K/V exchange, which TEDotProductAttention runs inside TE's attention
        # (extensions/transformer_engine.py passes it cp_group and cp_comm_type), with the ring's
        # own elementwise passes (ops.te_cp_merge_op). Picked by class and name, both used to be
        # left out.
        return [o for o in lo.forward if o.op_class == "attention"
                or o.name in ("softmax_dropout", "attn_layout_copies", "cp_ring_merge", "cp_sdpa_merge")
                or (o.comm is not None and o.comm.dim == "cp")]
    return []


def selective_op_saved_bytes(sc: Scenario, lo: LayerOps) -> float:
    """Bytes torchtitan's per-op SAC keeps for one layer and one microbatch on one GPU; everything
    else is recomputed in backward (``layer_recompute_ops`` reruns exactly the rest).

    Under ``torch.utils.checkpoint`` with a policy only the checkpoint's input and the outputs of
    MUST_SAVE ops are stored (torchtitan Dec 2024 ``_save_list``: aten.mm except every second
    one per layer, the SDPA flash/efficient outputs, ``reduce_scatter_tensor``, ``aten.max``;
    0.3.0 ``_get_default_save_ops`` the same kinds): the block's input (bf16, sharded under
    sequence parallelism), each saved mm part's bf16 output (FP8 GEMMs write bf16 too), the
    attention output with its fp32 logsumexp, and each forward tensor-parallel reduce-scatter's
    output. ``aten.max`` (FP8 amax) is a scalar. In a MoE layer the routed experts' grouped
    GEMMs are not saved (``is_grouped_expert_gemm``) and the all-to-alls' outputs are."""
    p = sc.parallelism
    t = p.tp
    sp = p.sequence_parallel and t > 1
    tokens = sc.batch.micro_batch_size * sc.batch.seq_length / p.cp
    saved = 2.0 * tokens * sc.model.hidden_size / (t if sp else 1)
    attention_seen = False
    for o in lo.forward:
        if o.comm is not None:
            if o.comm.dim == "tp" and o.comm.op == "reduce_scatter":
                saved += o.comm.size_bytes / t
            elif o.comm.dim == "ep" and o.comm.op == "all_to_all" and p.ep > 1:
                # MoE dispatch and combine (all_to_all_single, in the MoE models' save list,
                # torchtitan 0.2.0): the tokens this rank receives, as many as it sends. At ep 1
                # no all-to-all runs (the tokens are permuted in place) and nothing is kept.
                saved += o.comm.size_bytes
        elif o.op_class == "attention" and not attention_seen:
            # One SDPA output per layer: context parallelism's per-step kernels (ops.torch_cp_sdpa_ops)
            # are one aten SDPA call, whose merged output and logsumexp are the rank's queries',
            # step 0's shape (the later steps' half-size blocks were each counted again).
            attention_seen = True
            k = o.kernel
            if k is not None and k.kind == "flash":
                saved += k.batch * k.m * (2.0 * k.k + 4.0)  # output bf16, logsumexp fp32 per row
            else:
                saved += 2.0 * tokens * sc.model.num_attention_heads * sc.model.dim_head / t
    # Every GEMM op carries its kernel (ops.build_layer_ops gemm): M x N outputs, bf16.
    saved += sum(2.0 * frac * o.kernel.batch * o.kernel.m * o.kernel.n
                 for o, _, frac, recomputed in _sac_mm_parts(sc, lo) if not recomputed)
    return saved


def build_program(sc: Scenario, profile: Profile, schedule: PipelineSchedule, tied_head_shared: bool | None = None,
                  recompute_layers: frozenset[int] | None = None) -> Program:
    """The program of ``sc`` under ``schedule``. ``tied_head_shared`` (ops.tied_head_shares_embedding)
    and ``recompute_layers`` (checkpointed_layers) default to the schedule's own; the sweep
    estimate's per-layer reference Program, one layer a position on a 1F1B pipeline, takes the
    point's layout's."""
    p = sc.parallelism
    mesh = mesh_of(sc)
    if tied_head_shared is None:
        tied_head_shared = tied_head_shares_embedding(sc, schedule)
    layer_kinds = build_layer_ops(sc, tied_head_shared)
    m = sc.model
    P = schedule.num_positions
    positions = split_layers(m.num_layers, P, p.pp_layer_split, p.account_for_embedding_in_pipeline_split,
                             p.account_for_loss_in_pipeline_split)
    if recompute_layers is None:
        recompute_layers = checkpointed_layers(sc, schedule, positions)

    # Backward op lists per layer kind, and the weight-grad-carrying embedding.
    bwd: dict[str, tuple[list[Op], list[Op]]] = {k: lo.backward() for k, lo in layer_kinds.items()}
    emb = layer_kinds["embedding"]
    if emb.explicit_backward is None:
        # hf-eager layers give each table's backward kernel by kernel already (the zeroed table
        # among the input-grad ops, the scatter as the weight gradient): replacing their weight
        # gradient with this op zeroed every table twice.
        emb_w = [embedding_wgrad_op(sc, emb.params)]
        emb_w += emb.grad_accumulate_ops(emb_w[0])
        bwd["embedding"] = (bwd["embedding"][0], emb_w)

    # Keyed by the rule's verdict: a layer's recomputed ops depend on its kind and on whether
    # selective-layer checkpoints it, not on its global layer id (the key was layer % 2).
    rec_cache: dict[tuple[str, bool], list[Op]] = {}

    def recompute_ops(kind: str, checkpointed: bool = False) -> list[Op]:
        key = (kind, checkpointed)
        if key not in rec_cache:
            rec_cache[key] = layer_recompute_ops(sc, layer_kinds[kind], checkpointed)
        return rec_cache[key]

    # TP overlap (async TP, TE userbuffers) rewrites the op sequences the compute stream runs
    # (forward, recomputation, input gradients); the layer kinds keep the model's ops (FLOPs,
    # parameters, FSDP units).
    overlap_style = None
    if p.tp > 1 and p.sequence_parallel:
        overlap_style = "torch" if p.async_tp else ("te" if p.tp_comm_overlap else None)
    piped: dict[int, tuple[list[Op], list[Op]]] = {}

    def run_ops(ops: list[Op]) -> list[Op]:
        if overlap_style is None:
            return ops
        hit = piped.get(id(ops))
        if hit is None or hit[0] is not ops:
            hit = piped[id(ops)] = (ops, micro_pipeline_tp(ops, p.tp, overlap_style))
        return hit[1]

    # Every op's duration in one vectorised call (DESIGN rule 2).
    all_ops: list[Op] = []
    for kind, lo in layer_kinds.items():
        all_ops += run_ops(lo.forward) + run_ops(bwd[kind][0]) + bwd[kind][1]
    seen = {id(o) for o in all_ops}
    for kind in layer_kinds:
        if kind in ("embedding", "head"):
            continue
        for checkpointed in (False, True):
            # Recomputed parts of a forward op (torchtitan's SAC splits fused projections).
            all_ops += [o for o in run_ops(recompute_ops(kind, checkpointed)) if id(o) not in seen]
    kernels = [o for o in all_ops if o.comm is None]
    # FP8 GEMMs run on the FP8 tensor cores (op_durations_s); fp8_speedup also refuses a GPU
    # that has none, with one line.
    speedup = fp8_speedup(sc, profile)
    dur = op_durations_s(profile, kernels, sc, fp8_speedup=speedup)
    times = {id(o): float(t) for o, t in zip(kernels, dur)}
    host = {id(o): host_issue_s(profile, o) for o in all_ops}
    gbytes = scenario_grad_bytes(sc)

    def kind_of(layer: int) -> str:
        if m.is_moe and layer >= m.num_dense_layers:
            return "moe"
        return "dense"

    # torchtitan's FSDP units (0.1.0 models/llama3/infra/parallelize.py apply_fsdp): one per
    # transformer block, and the root, fully_shard(model), holding the embedding, the final norm
    # and the output head together (a pipeline stage's model part holds those of them it has).
    # The root is resharded after forward (torch 2.13 fully_shard: reshard_after_forward given
    # as True is kept; FSDPState._lazy_init keeps a root whole only when it is left None) and
    # gathered again where the backward starts. Without PP the "default" policy keeps the last
    # block whole ("FSDP would prefetch it immediately"): reshard_after_forward =
    # int(layer_id) < len(model.layers) - 1; under PP none reshards (fsdp_reshard_after_forward).
    fsdp_unit_of: dict[int, int] = {}
    fsdp_keep: frozenset[int] = frozenset()
    if sc.framework == "torchtitan" and p.zero >= 3:
        fsdp_unit_of = {-1: -1, m.num_layers: -1}
        if p.pp == 1 and p.fsdp_reshard_after_forward:
            fsdp_keep = frozenset({m.num_layers - 1})

    segments: dict[tuple[int, str], Segments] = {}
    stage_params: list[float] = []
    stage_expert_params: list[float] = []
    stage_tp_duplicated: list[float] = []
    # A position of one layer (the sweep estimate's reference programs have one a position) has
    # the segments of any other layer of its kind, recompute and FSDP keep but for the layer id:
    # built once a kind (a 126-layer reference Program merged 504 op lists into alike segments).
    one_layer: dict[tuple, tuple[Segments, ...]] = {}
    expert_params_of = {k: sum(o.params for o in lo.forward if o.name.startswith("experts_")) for k, lo in layer_kinds.items()}
    for pos, layers in enumerate(positions):
        chain: list[tuple[str, int]] = []
        if pos == 0:
            chain.append(("embedding", -1))
        chain += [(kind_of(L), L) for L in layers]
        if pos == P - 1:
            chain.append(("head", m.num_layers))
        stage_params.append(sum(layer_kinds[k].params for k, _ in chain))
        stage_expert_params.append(sum(expert_params_of[k] for k, _ in chain))
        stage_tp_duplicated.append(sum(layer_kinds[k].tp_duplicated_params for k, _ in chain))
        okey = (chain[0][0], chain[0][1] in recompute_layers, chain[0][1] in fsdp_keep) if len(chain) == 1 else None
        hit = one_layer.get(okey) if okey is not None else None
        if hit is not None:
            L = chain[0][1]
            for kind, tpl in zip("FIWB", hit):
                seg = segments[(pos, kind)] = replace(tpl, layer=np.full(len(tpl.layer), L, dtype=tpl.layer.dtype))
                seg._template_of = tpl  # (plan._template: the same instructions but for the layer id)
            continue
        f_ops = [(o, L) for k, L in chain for o in run_ops(layer_kinds[k].forward)]
        i_ops, w_ops, b_ops = [], [], []
        for k, L in reversed(chain):
            rec = [(o, L) for o in run_ops(recompute_ops(k, L in recompute_layers))] if k not in ("embedding", "head") else []
            # A unit kept whole since its forward is not gathered, nor copied out, again.
            li = [(o, L) for o in run_ops(bwd[k][0]) if not (L in fsdp_keep and o.name == "fsdp_copy_out.bwd")]
            lw = [(o, L) for o in bwd[k][1]]
            i_ops += rec + li
            w_ops += lw
            b_ops += rec + li + lw
        segments[(pos, "F")] = _segments(f_ops, times, host, gbytes)
        segments[(pos, "I")] = _segments(i_ops, times, host, gbytes)
        segments[(pos, "W")] = _segments(w_ops, times, host, gbytes)
        segments[(pos, "B")] = _segments(b_ops, times, host, gbytes)
        if okey is not None:
            one_layer[okey] = tuple(segments[(pos, kind)] for kind in "FIWB")

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
    # FSDP all-gather bytes per unit: with the FP8 all-gather only Float8 linears move 1 byte a
    # parameter; the embedding, the norms and the (unconverted) LM head move bf16.
    unit_gather_bytes: dict[int, float] = {}
    if sc.dtype == "fp8" and sc.fp8.param_all_gather and p.zero >= 3:
        for L in range(m.num_layers):
            unit_gather_bytes[L] = fsdp_gather_bytes(sc, layer_kinds[kind_of(L)].forward)
        unit_gather_bytes[-1] = layer_kinds["embedding"].params * sc.dtype_bytes
        unit_gather_bytes[m.num_layers] = layer_kinds["head"].params * sc.dtype_bytes
    # The routed experts' share of each MoE unit's gather (by the same byte rule), which the plan
    # gathers over the expert-data-parallel group.
    unit_expert_gather_bytes: dict[int, float] = {}
    if p.zero >= 3:
        fp8_gather = sc.dtype == "fp8" and sc.fp8.param_all_gather
        for L in range(m.num_layers):
            if kind_of(L) == "moe":
                experts = [o for o in layer_kinds["moe"].forward if o.name.startswith("experts_")]
                unit_expert_gather_bytes[L] = (fsdp_gather_bytes(sc, experts) if fp8_gather
                                               else sum(o.params for o in experts) * sc.dtype_bytes)
    notes: list[str] = []
    for name in ("async_tp", "tp_comm_overlap"):
        if getattr(p, name) and p.tp == 1:
            notes.append(f"{name} has nothing to overlap at tp=1: no tensor-parallel collectives")
    dropped = moe_dropped_fraction(sc)
    if dropped > 0:
        notes.append(f"MoE capacity factor {sc.moe.capacity_factor} drops {dropped:.1%} of routed tokens")
    if m.is_moe and moe_load_factor(sc) > 1.0:
        notes.append(f"MoE routing: the busiest EP rank processes {moe_load_factor(sc):.2f}x the mean tokens and sets the pace")

    # The optimizer updates this rank's parameters; ZeRO>=1 shards the update over dp x cp (or
    # the HSDP shard group), expert parameters over the expert-data-parallel group.
    edp_tp = mesh.edp_tp
    opt_bytes = 0.0
    for r in range(schedule.num_ranks):
        positions_r = [schedule.stage_position[st] for st in schedule.stages_of_rank(r)]
        expert = sum(stage_expert_params[q] for q in positions_r)
        dense = sum(stage_params[q] for q in positions_r) - expert
        opt_bytes = max(opt_bytes, optimizer_state_bytes(dense, expert, p.zero, sc.dp, p.ep, p.fsdp_shard_size, cp=p.cp,
                                                         edp_tp=edp_tp))
    opt_params_max = opt_bytes / ADAM_BYTES_PER_PARAM
    shard, _ = scenario_optimizer_shards(sc)
    optimizer_s = optimizer_time_s(profile, opt_params_max, adam_tensor_count(m.num_layers, p.pp),
                                   adam_bytes_per_param(sc), sc)

    # Under SP: the duplicated weights' gradients of the rank's layers, all-reduced over tp.
    tp_duplicated_max = rank_max(schedule, stage_tp_duplicated)
    step = step_terms(sc, profile, stage_params, opt_params_max, shard, tied_head_shared, tp_duplicated_max)
    return Program(
        step_collectives=step,
        scenario=sc, mesh=mesh, schedule=schedule, segments=segments, position_layers=positions,
        pp_bytes=pp_bytes, pp_gather_bytes=pp_gather_bytes, optimizer_s=optimizer_s, stage_params=stage_params,
        pp_blocking_exchange=p.pp_exchange == "blocking" and p.pp > 1,
        model_flops_per_step=model_flops, tokens_per_step=sc.batch.global_batch_size * sc.batch.seq_length,
        zero=p.zero, overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=sc.overlap_param_gather,
        grad_bucket_bytes=sc.grad_bucket_params * gbytes, bucket_params=float(sc.grad_bucket_params),
        grad_buckets_first_chunk_only=sc.grad_buckets_first_chunk_only,
        grad_reduce_in_one_piece=sc.grad_reduce_in_one_piece,
        # FSDP with FP8 all-gather moves 1-byte weights (torchtitan enable_fsdp_float8_all_gather).
        param_bytes=1 if sc.dtype == "fp8" and sc.fp8.param_all_gather and p.zero >= 3 else sc.dtype_bytes,
        unit_params=unit_params,
        unit_expert_params={L: float(expert_params_of[kind_of(L)]) for L in range(m.num_layers)
                            if expert_params_of[kind_of(L)] > 0},
        unit_gather_bytes=unit_gather_bytes,
        unit_expert_gather_bytes=unit_expert_gather_bytes,
        stage_expert_params=stage_expert_params,
        stage_tp_duplicated_params=stage_tp_duplicated,
        edp_tp=edp_tp,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        fsdp_prefetch=p.fsdp_prefetch,
        fsdp_shard_size=p.fsdp_shard_size,
        fsdp_unit_of=fsdp_unit_of,
        fsdp_keep_gathered=fsdp_keep,
        # torchtitan runs PP through torch.distributed.pipelining, which reduces FSDP2's
        # gradients after a stage's last backward (plan.reduce_stage_grads).
        grad_reduce_after_stage_backward=sc.framework == "torchtitan" and p.zero >= 3 and p.pp > 1,
        grad_reduce_waits_previous=sc.framework == "torchtitan" and p.zero >= 3,
        grad_reduce_every_microbatch=sc.framework == "torchtitan" and p.zero >= 3 and p.pp == 1,
        fsdp_one_communicator=sc.framework == "torchtitan" and p.zero >= 3 and not p.fsdp_separate_reduce_scatter_group,
        notes=notes,
    )


def rank_max(schedule: PipelineSchedule, per_position) -> float:
    """The largest sum of a per-position quantity over the positions one pipeline rank holds."""
    return max(float(sum(per_position[schedule.stage_position[st]] for st in schedule.stages_of_rank(r)))
               for r in range(schedule.num_ranks))


def step_terms(sc: Scenario, profile: Profile, stage_params: list[float], opt_params_max: float,
               shard: int, tied_head_shared: bool | None = None,
               tp_duplicated_params: float = 0.0) -> list[StepCollective]:
    """What a training step pays between the last backward and the optimizer, besides the DP
    gradient reduction (Megatron-LM's finalize_model_grads and clip_grad_norm_):

    - Tied embeddings split over a pipeline: the first stage's input embedding and the last
      stage's LM head are one matrix, so their gradients (fp32 main grads, V*h/tp) are
      all-reduced between the two stages (Megatron _allreduce_word_embedding_grads); not where
      one rank holds both ends and the matrix once (``tied_head_shared``; None: pp = 1).
    - Sequence parallelism: gradients of weights each tp rank holds whole but feeds its sequence
      shard only (MLA's duplicated down-projections and latent norms, ``tp_duplicated_params``
      on the busiest rank) summed over tp: flattened into one buffer, all-reduced, copied back
      (megatron-core 0.16.1 _allreduce_non_tensor_model_parallel_grads: _flatten_dense_tensors,
      all_reduce, buf.copy_; 4 bytes read and written a parameter each way). The norms' own
      share rides LayerOps.tp_norm_grad_bytes.
    - fp16 loss scaling: grads unscaled and checked for inf/nan, a flag all-reduced.
    - Gradient clipping: a fused L2-norm over the rank's gradients (multi_tensor_l2norm reads
      4 bytes a parameter of the fp32 main grads it owns), then the squared norm all-reduced
      over the model-parallel ranks (tp, pp) and, with a sharded optimizer, over dp.
    """
    m, p = sc.model, sc.parallelism
    out: list[StepCollective] = []
    if tied_head_shared is None:
        tied_head_shared = tied_head_shares_embedding(sc)
    if m.tied_embeddings and not tied_head_shared:
        emb_params = m.vocab_size * m.hidden_size / p.tp
        # In the gradient buffer's dtype (Megatron all-reduces the embedding's main_grad).
        out.append(StepCollective("tied embedding grads", "emb", "all_reduce", emb_params * scenario_grad_bytes(sc)))
    if tp_duplicated_params > 0 and p.tp > 1:
        grad_b = scenario_grad_bytes(sc)
        copy_s = float(profile.compute_time_s(np.array(["optimizer"]), np.array([0.0]),
                                              np.array([tp_duplicated_params * 4 * grad_b]))[0])
        out.append(StepCollective("sp duplicated weight grads", "tp", "all_reduce", tp_duplicated_params * grad_b, copy_s))
    if sc.dtype == "fp16":
        # fp16 with dynamic loss scaling: main grads unscaled in place (multi_tensor_scale reads
        # and writes 4 bytes a parameter) and an inf/nan flag all-reduced over the model-parallel
        # ranks (Megatron _unscale_main_grads_and_check_for_nan).
        unscale_s = float(profile.compute_time_s(np.array(["optimizer"]), np.array([0.0]),
                                                 np.array([opt_params_max * 2 * GRAD_REDUCE_BYTES]))[0])
        mp = [d for d, n in (("tp", p.tp), ("pp", p.pp)) if n > 1]
        out.append(StepCollective("fp16 unscale + inf check", mp[0] if mp else "tp", "all_reduce", 4.0 if mp else 0.0, unscale_s))
        for d in mp[1:]:
            out.append(StepCollective("fp16 unscale + inf check", d, "all_reduce", 4.0))
    if p.grad_clip:
        # torchtitan's gradients are its sharded parameters' dtype (bf16 with training_dtype bfloat16).
        clip_grad_bytes = torchtitan_state_bytes(sc)[1] if sc.framework == "torchtitan" else GRAD_REDUCE_BYTES
        norm_s = float(profile.compute_time_s(np.array(["optimizer"]), np.array([0.0]),
                                              np.array([opt_params_max * clip_grad_bytes]))[0])
        # One fp32 squared norm per rank; the all-reduces are latency only.
        dims = [d for d, n in (("tp", p.tp), ("pp", p.pp)) if n > 1]
        if p.zero >= 1 and shard > 1:
            dims.append("dp")
        out.append(StepCollective("grad norm", dims[0] if dims else "tp", "all_reduce", 4.0 if dims else 0.0, norm_s))
        for d in dims[1:]:
            out.append(StepCollective("grad norm", d, "all_reduce", 4.0))
        if sc.framework == "torchtitan":
            # torchtitan 0.1.0 distributed/utils.py clip_grad_norm_ ends in
            # torch.nn.utils.clip_grads_with_norm_, which multiplies every gradient by the clamped
            # coefficient whether or not it clips (torch 2.13 clip_grad.py _clip_grads_with_norm_:
            # _foreach_mul_, "avoids a `if clip_coef < 1:` conditional"): reads and writes the
            # rank's gradient shard. (Megatron scales only when the coefficient is below 1.)
            clip_s = float(profile.compute_time_s(np.array(["optimizer"]), np.array([0.0]),
                                                  np.array([opt_params_max * 2 * clip_grad_bytes]))[0])
            out.append(StepCollective("grad clip", "tp", "all_reduce", 0.0, clip_s))
    return out


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
