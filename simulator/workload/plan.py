"""The communication plan: what each pipeline rank does, in order, computed before the event loop.

``build_plan(program)`` turns a Program (durations per segment) and its schedule into one
``RankPlan`` per pipeline rank — a *rank class*: every rank with the same pipeline rank runs the
same plan, which is what reduced mode relies on. A plan is a flat list of typed instructions:

  Recv        wait for an input (activation or gradient) of an action; names its source rank
  Compute     a stretch of kernels on the compute stream
  Collective  a collective (or a chain of them) on a named stream, over a named group; either
              blocking (the compute stream waits for it) or asynchronous with a handle, which a
              later Wait joins; the compute between the two is what it may overlap
  Wait        join an asynchronous collective; the wait is exposed communication of a dimension
  Complete    an action's output is ready: wakes local consumers and sends it to other ranks
  Post        blocking exchange (Megatron-LM 2021): the receives a rank posts; a peer's send of
              each starts only once it is posted
  SendDone    blocking exchange: wait until a send of this rank has been delivered

All parallelism policy lives here: ZeRO-1/2 parameter gathers, the FSDP/ZeRO-3 gather plan with
prefetch and resharding, gradient bucketing, the HSDP reduce-scatter + all-reduce split, expert
data parallelism, overlapped F&B pairs, the optimizer step. The engine replays instructions.
The shared formulas (pipeline bytes, bucket size, optimizer sharding) are functions here so the
closed-form estimate uses the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simulator.contention import collective_ctas, compute_slowdown, scaled_slowdown
from simulator.schedules.base import Action, PipelineSchedule, required_inputs
from simulator.topology.placement import Mesh
from simulator.vocabulary import CollectiveOp, Dim, Stream

# ----------------------------------------------------------------------------- instructions
# Slotted, not frozen: a frozen dataclass's __init__ pays an object.__setattr__ per field, and a
# plan holds up to millions of instructions. Nothing mutates them after planning.

Step = tuple[Dim, CollectiveOp, float]  # (group dimension, op, nccl-tests size in bytes)

# Not a collective: a Comm with this op closes a segment where the compute stream waits for the
# overlapped collectives in flight (async TP: the last GEMM chunk needs the last shard, the
# reduction every partial).
JOIN = "join"


@dataclass(slots=True)
class Recv:
    stage: int
    kind: str  # "F" (activation) or "BI" (input gradient)
    microbatch: int
    src_pp: int  # pipeline rank producing it
    local: bool  # produced on this rank (no transfer)
    before: Action  # the action that needs it

    def describe(self) -> str:
        if self.local:
            return f"{self.stage}{self.kind}{self.microbatch} (same rank) before {self.before}"
        what = "activation" if self.kind == "F" else "gradient"
        return f"{what} of {self.stage}{self.kind}{self.microbatch} from pp rank {self.src_pp} before {self.before}"


@dataclass(slots=True)
class Compute:
    seconds: float
    kind: str  # F, B, I, W or opt
    label: str
    microbatch: int = -1
    stage: int = -1
    layer: int = -1
    counted: bool = True  # counts as a simulation event (segments do; the optimizer step never did)
    # Fraction of ``seconds`` in SM-bound kernels (Segments.sm_share): the part the SM-share
    # contention law slows while NCCL kernels hold SMs.
    sm_share: float = 1.0


@dataclass(slots=True)
class Collective:
    stream: Stream
    steps: tuple[Step, ...]  # run back to back on the stream (HSDP: reduce-scatter then all-reduce)
    handle: int  # -1: blocking (the compute stream waits); else joined by Wait(handle)
    # timeline row: kind column, name, microbatch, stage, layer, bytes
    row_kind: str
    name: str
    microbatch: int = -1
    stage: int = -1
    layer: int = -1
    row_bytes: float = 0.0
    action: Action | None = None  # the action a blocking collective belongs to
    # SMs its kernel holds while it runs: -1 = NCCL's for its first op (collective_ctas); 0 for
    # copies on the copy engines (async TP's P2P copies through symmetric memory)
    ctas: int = -1
    # the report dimension its exposed time counts under; None: its first step's base dimension
    # (Megatron's pipeline scatter/gather: a tp all-gather that finishes a pp receipt counts as pp)
    exposed_dim: Dim | None = None

    @property
    def sms(self) -> int:
        """SMs the first step's kernel holds while in flight."""
        return self.ctas if self.ctas >= 0 else collective_ctas(self.steps[0][1])

    @property
    def blocking(self) -> bool:
        return self.handle < 0

    def describe(self) -> str:
        dim, op, _ = self.steps[0]
        if self.exposed_dim is not None:
            return f"{dim} {op} ({self.name}, pipeline scatter/gather)"
        return f"{dim} {op} in {self.action}" if self.action is not None else f"{dim} {op} {self.name}"


@dataclass(slots=True)
class Wait:
    handle: int
    dim: Dim  # exposed time goes to this (base) dimension
    reason: str

    def describe(self) -> str:
        return self.reason


@dataclass(slots=True)
class Send:
    stream: Stream
    dst_pp: int
    size_bytes: float
    # Blocking exchange: the transfer starts when the receiver has posted its receive (Post).
    rendezvous: bool = False


@dataclass(slots=True)
class Complete:
    stage: int
    kind: str  # "F" or "BI"
    microbatch: int
    sends: tuple[Send, ...]
    wake: bool = True  # wakes this rank's own consumers (a blocking exchange's deferred sends do not)


@dataclass(slots=True)
class Post:
    """Megatron-LM 2021's exchange: the inputs (stage, "F"/"BI", microbatch) whose receives this
    rank posts now. A peer's rendezvous send of one starts when it is posted and the peer has
    posted the send."""
    keys: tuple[tuple[int, str, int], ...]


@dataclass(slots=True)
class SendDone:
    """Megatron-LM 2021's exchange: the rank waits until its send of an output has arrived
    (batch_isend_irecv, wait, torch.cuda.synchronize)."""
    stage: int
    kind: str  # "F" or "BI"
    microbatch: int
    dst_pp: int

    def describe(self) -> str:
        what = "activation" if self.kind == "F" else "gradient"
        return f"send of {what} {self.stage}{self.kind}{self.microbatch} to pp rank {self.dst_pp} (blocking exchange)"


Instr = Recv | Compute | Collective | Wait | Complete | Post | SendDone


@dataclass
class RankPlan:
    pp_rank: int
    instrs: list[Instr]
    num_handles: int

    @property
    def streams(self) -> set[Stream]:
        out = set()
        add, update = out.add, out.update
        for i in self.instrs:
            # Collective and Complete are slotted dataclasses: their type, not isinstance chains.
            t = type(i)
            if t is Collective:
                add(i.stream)
            elif t is Complete:
                update(s.stream for s in i.sends)
        return out

    def collectives(self) -> list[Collective]:
        return [i for i in self.instrs if isinstance(i, Collective)]


@dataclass
class Plan:
    mesh: Mesh
    schedule: PipelineSchedule
    ranks: list[RankPlan]  # one per pipeline rank
    groups: dict[Dim, np.ndarray] = field(default_factory=dict)  # dim -> (n_groups, group_size) GPU ids


# ----------------------------------------------------------------------------- shared formulas

# Megatron keeps fp32 main gradients and reduces them in fp32 when training in bf16.
GRAD_REDUCE_BYTES = 4


def grad_reduce_bytes(dtype: str, zero: int, in_fp32: bool | None = None) -> int:
    """Bytes per parameter of the data-parallel gradient reduction (and of the gradient buffer
    it reduces). Megatron reduces in the parameter dtype unless asked for fp32 (megatron-core
    DistributedDataParallelConfig grad_reduce_in_fp32=False: grad_dtype = float if
    grad_reduce_in_fp32 else param.dtype; Megatron-LM's arguments force fp32 only for bf16): fp16
    runs reduce fp16 gradients. FSDP (torchtitan, zero 3) reduces in fp32 (mixed_precision_reduce
    = float32). ``in_fp32`` (parallelism.grad_reduce_in_fp32) overrides: True fp32, False the
    parameter dtype (bf16 under FP8 training)."""
    if in_fp32 is None:
        return 2 if dtype == "fp16" and zero < 3 else GRAD_REDUCE_BYTES
    return GRAD_REDUCE_BYTES if in_fp32 or dtype == "fp32" else 2
# Adam step per parameter: read fp32 master, grad, m, v; write master, m, v; write bf16 copy.
ADAM_BYTES_PER_PARAM = 30
# torchtitan's AdamW (0.1.0 config_manager.py Optimizer.implementation = "fused": torch's
# _fused_adamw_) over FSDP2's fp32 sharded parameters: read param, grad, m, v; write param, m, v.
# No bf16 copy: FSDP2 casts to param_dtype in its all-gather copy-in.
TORCHTITAN_ADAM_BYTES_PER_PARAM = 28
# torchtitan with optimizer.implementation foreach: torch's _multi_tensor_adam (decoupled weight
# decay) in eight passes: param.mul_ (r/w p), exp_avg.lerp_ (r m, g; w m), exp_avg_sq.mul_ (r/w v),
# addcmul_ (r v, g; w v), sqrt (r v; w d), div_ (r/w d), add_ eps (r/w d), param.addcdiv_
# (r p, m, d; w p): 20 fp32 tensors, 80 bytes a parameter (device check on an H200, round 28,
# tests/data/reference/h200/optimizer.csv: 6,025 us for 2^28 parameters, 0.74 of HBM at 80 B).
TORCHTITAN_FOREACH_ADAM_BYTES_PER_PARAM = 80
TORCHTITAN_FOREACH_ADAM_PASSES = 8
# torchtitan with training.dtype bfloat16 (full bf16 training, 0.3.0 config/configs.py: parameters,
# gradients and AdamW's moments in bf16, no fp32 copy): the same tensors in 2 bytes each. fused:
# read param, grad, m, v, write param, m, v = 14; foreach: the 20 tensor passes above = 40
# (tests/data/reference/h200/optimizer.csv, 2^28 bf16 parameters on an H200: fused 1,452 us,
# multi-tensor 3,640 us, 0.54 and 0.61 of HBM at these counts).
TORCHTITAN_BF16_ADAM_BYTES_PER_PARAM = 14
TORCHTITAN_BF16_FOREACH_ADAM_BYTES_PER_PARAM = 40


def torchtitan_state_bytes(sc) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes a sharded parameter holds under framework
    torchtitan: FSDP2's sharded parameters are the training dtype's (fp32 masters under mixed
    precision, MixedPrecisionPolicy(param_dtype=bf16) casting them at each all-gather; bf16 with
    training_dtype bfloat16), their gradients are cast back to that dtype after the fp32
    reduce-scatter, and AdamW's m and v are created like the parameter (torch.optim zeros_like)."""
    return (2, 2, 4) if sc.training_dtype == "bfloat16" else (4, 4, 8)


def adam_passes(sc) -> int:
    """Passes over the parameters the optimizer step makes, each its own launches: torch's foreach
    AdamW's eight under torchtitan's optimizer.implementation foreach; one fused kernel otherwise."""
    foreach = sc.framework == "torchtitan" and sc.optimizer.implementation == "foreach"
    return TORCHTITAN_FOREACH_ADAM_PASSES if foreach else 1


def adam_bytes_per_param(sc) -> int:
    """HBM bytes per parameter of the optimizer step's kernels (the state's size stays
    ``optimizer_state_bytes``'s, in ADAM_BYTES_PER_PARAM units).

    megatron-core 0.16.1 distrib_optimizer.py _copy_model_grads_to_main_grads: a precision-aware
    optimizer (Transformer Engine's FusedAdam) reads the gradient buffer's shard as it is
    (``decoupled_grad``, the buffer's dtype: grad_reduce_in_fp32), the moments in their dtypes
    and, with parameter remainders, reads and writes the bf16 parameter and its 16-bit remainder
    for the master weight: 2 x (2 + 2) + grad + 2 x (m + v), 18 bytes all in bf16. Otherwise the
    shard becomes an fp32 ``.grad`` (``shard_model_grad.float()``: a copy, 2 read + 4 written,
    where the buffer is bf16; none where it is fp32) that Adam reads: 30 bytes, 36 with a bf16
    buffer asked for (grad_reduce_in_fp32 false; the default fp16 buffers of fp16 runs are left
    as they were modelled)."""
    if sc.framework == "torchtitan":
        if sc.training_dtype == "bfloat16":
            return TORCHTITAN_BF16_FOREACH_ADAM_BYTES_PER_PARAM if adam_passes(sc) > 1 else TORCHTITAN_BF16_ADAM_BYTES_PER_PARAM
        return TORCHTITAN_FOREACH_ADAM_BYTES_PER_PARAM if adam_passes(sc) > 1 else TORCHTITAN_ADAM_BYTES_PER_PARAM
    o, p = sc.optimizer, sc.parallelism
    buffer = scenario_grad_bytes(sc)
    if not o.precision_aware:
        return ADAM_BYTES_PER_PARAM + (2 + 4 if p.grad_reduce_in_fp32 is False and buffer == 2 else 0)
    m, v = (_OPT_DTYPE_BYTES[d] for d in (o.exp_avg_dtype, o.exp_avg_sq_dtype))
    master = 2 * (2 + 2) if remainders_kept(sc) else 2 * 4 + 2  # read + write (master, bf16 copy written)
    return master + buffer + 2 * (m + v)


_OPT_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def remainders_kept(sc) -> bool:
    """The fp32 master weights kept as 16-bit remainders of bf16 parameters (megatron-core 0.16.1
    distrib_optimizer.py: master_param int16 where store_param_remainders and bf16)."""
    o = sc.optimizer
    return o.precision_aware and o.store_param_remainders and sc.dtype in ("bf16", "fp8")


def optimizer_state_bytes_per_param(sc) -> int:
    """Bytes of optimizer state a (sharded) parameter holds: the fp32 master weight (2 as a
    remainder beside a bf16 parameter), Adam's two moments in their dtypes; 12 by default."""
    o = sc.optimizer
    master = 2 if remainders_kept(sc) else 4
    return master + _OPT_DTYPE_BYTES[o.exp_avg_dtype] + _OPT_DTYPE_BYTES[o.exp_avg_sq_dtype]
# Parameter tensors the multi-tensor Adam walks (its launches: kernels.adam_kernels), a GPT layer's
# 12 (QKV, out, fc1, fc2 weights and biases, two LayerNorms' weight and bias) and 4 outside the
# layers (word and position embeddings, final norm weight and bias). Counted for GPT; a Llama
# layer has 9 (no biases, RMSNorm weights only): the count sets only how many launches pay the floor.
ADAM_TENSORS_PER_LAYER = 12
ADAM_TENSORS_OUTSIDE_LAYERS = 4


def adam_tensor_count(num_layers: int, pp: int) -> int:
    """Parameter tensors of one pipeline rank's Adam step (ADAM_TENSORS_PER_LAYER)."""
    return ADAM_TENSORS_PER_LAYER * max(1, num_layers // max(1, pp)) + ADAM_TENSORS_OUTSIDE_LAYERS


def pp_message_bytes(micro_batch_size: int, seq_length: int, cp: int, hidden_size: int, dtype_bytes: int, tp: int,
                     sequence_parallel: bool, scatter_gather: bool) -> tuple[float, float]:
    """(bytes each pipeline send carries, bytes of the receiver's tp all-gather afterwards).

    One activation (or its gradient) of a microbatch: b x s/cp x h; sequence parallelism leaves
    each TP rank 1/tp of it; Megatron's scatter/gather sends 1/tp and rebuilds it over NVLink."""
    sp = sequence_parallel and tp > 1
    nbytes = micro_batch_size * (seq_length // cp) * hidden_size * dtype_bytes / (tp if sp else 1)
    if scatter_gather and tp > 1 and not sp:
        return nbytes / tp, nbytes
    return nbytes, 0.0


def edp_tp_of(tp: int, sequence_parallel: bool, moe: bool, etp: int = 1) -> int:
    """Tensor-parallel ranks in the expert folding (``Mesh.edp_tp``, ``Mesh.groups("edp")``).

    The experts are not split by tp (expert tensor parallelism 1: megatron-core
    ``--expert-tensor-parallel-size 1``, torchtitan's ETP 1), so every tp rank holds all the
    experts of its ep index. Under sequence parallelism each tp rank routes its own T/tp tokens
    through them (ops._moe_layer), so the tp ranks' expert gradients differ and are reduced, and
    the expert state sharded, over them too: megatron-core 0.16.1 parallel_state's expert data
    parallel size is world / (etp x ep x pp) = dp x cp x tp / ep. Without sequence parallelism
    every tp rank routes the same T tokens, its expert gradients equal its tp peers', and tp
    stays out (as it does for the norm weights then). 1 for a dense model, and 1 where tp splits
    each expert (``etp`` = tp: a tp rank holds its slice of the experts, its tp peers others)."""
    return tp if moe and sequence_parallel and tp > 1 and etp == 1 else 1


def scenario_edp_tp(sc) -> int:
    """``edp_tp_of`` a scenario's layout."""
    p = sc.parallelism
    return edp_tp_of(p.tp, p.sequence_parallel, sc.model.is_moe, p.expert_tp)


def scenario_optimizer_shards(sc) -> tuple[int, int]:
    """``optimizer_shards`` of a scenario's layout: (dense, expert) ranks its state is sharded over."""
    p = sc.parallelism
    return optimizer_shards(p.zero, sc.dp, p.ep, p.fsdp_shard_size, cp=p.cp, edp_tp=scenario_edp_tp(sc))


def scenario_grad_bytes(sc) -> int:
    """``grad_reduce_bytes`` of a scenario: its gradient buffer's and reduction's bytes a parameter."""
    p = sc.parallelism
    return grad_reduce_bytes(sc.dtype, p.zero, p.grad_reduce_in_fp32)


def mesh_of(sc) -> Mesh:
    """The rank mesh of a scenario, its expert folding included (``edp_tp_of``)."""
    p = sc.parallelism
    return Mesh(tp=p.tp, cp=p.cp, ep=p.ep, dp=sc.dp, pp=p.pp, order=p.mesh_order, edp_tp=scenario_edp_tp(sc))


def optimizer_shards(zero: int, dp: int, ep: int, fsdp_shard_size: int | None, *, cp: int,
                     edp_tp: int) -> tuple[int, int]:
    """(ranks the dense optimizer state is sharded over, ranks the expert state is sharded over).

    ZeRO >= 1 shards over the data-parallel group with its context-parallel ranks (they hold the
    same parameters: ``Mesh.groups("dp-cp")``), or over the HSDP shard group (its dp ranks times
    cp); expert parameters over the ranks that hold the same experts: dp x cp x ``edp_tp`` / ep
    (``edp_tp_of``; ``Mesh.edp``), or under HSDP the shard group's share of them, fsdp_shard_size
    x cp x edp_tp / ep (torchtitan 0.3.0 fully_shards the experts over efsdp = dp_shard x cp x tp
    / ep and replicates them over dp_replicate; Scenario.check keeps ep a divisor of that)."""
    if zero < 1:
        return 1, 1
    group = fsdp_shard_size or dp
    return group * cp, max(1, group * cp * edp_tp // ep)


def grad_reduction_steps(zero: int, size_bytes: float, expert: bool, hsdp_shard: int | None,
                         hsdp_expert_shard: int | None = None) -> tuple[Step, ...]:
    """The collectives that reduce one gradient bucket.

    DDP all-reduces; ZeRO >= 1 reduce-scatters; HSDP reduce-scatters inside the shard group and
    all-reduces the shard across replicas; expert gradients go over the expert-data-parallel group,
    under HSDP over its shard group (``hsdp_expert_shard`` ranks) and then across its replicas."""
    if expert:
        if hsdp_expert_shard is not None:
            return ((Dim.EDP_SHARD, CollectiveOp.REDUCE_SCATTER, size_bytes),
                    (Dim.EDP_REP, CollectiveOp.ALL_REDUCE, size_bytes / hsdp_expert_shard))
        return ((Dim.EDP, CollectiveOp.ALL_REDUCE if zero == 0 else CollectiveOp.REDUCE_SCATTER, size_bytes),)
    if zero == 0:
        return ((Dim.DP, CollectiveOp.ALL_REDUCE, size_bytes),)
    if hsdp_shard is not None:
        return ((Dim.DP_SHARD, CollectiveOp.REDUCE_SCATTER, size_bytes), (Dim.DP_REP, CollectiveOp.ALL_REDUCE, size_bytes / hsdp_shard))
    return ((Dim.DP, CollectiveOp.REDUCE_SCATTER, size_bytes),)


def optimizer_state_bytes(dense_params: float, expert_params: float, zero: int, dp: int, ep: int,
                          fsdp_shard_size: int | None, *, cp: int, edp_tp: int) -> float:
    """Bytes the optimizer step of one rank streams through HBM (Adam, ZeRO-sharded)."""
    shard, expert_shard = optimizer_shards(zero, dp, ep, fsdp_shard_size, cp=cp, edp_tp=edp_tp)
    return (dense_params / shard + expert_params / expert_shard) * ADAM_BYTES_PER_PARAM


def hsdp_shard_of(zero: int, fsdp_shard_size: int | None, dp: int, *, cp: int) -> int | None:
    """Ranks in one HSDP shard group (its dp ranks times cp: torchtitan's "fsdp" mesh is
    dp_shard x cp), or None when parameters shard over the whole data-parallel group."""
    if zero >= 3 and fsdp_shard_size is not None and fsdp_shard_size < dp:
        return fsdp_shard_size * cp
    return None


def hsdp_expert_shard_of(hsdp_shard: int | None, ep: int, edp_tp: int) -> int | None:
    """Ranks in one HSDP shard group of the experts: of the ``hsdp_shard`` ranks (fsdp_shard_size x
    cp) and their ``edp_tp`` tp ranks, those that hold the same experts, one in ep
    (torchtitan 0.3.0: the experts' FSDP mesh is (dp_replicate, efsdp), efsdp = dp_shard x cp x
    tp / ep). None without HSDP."""
    if hsdp_shard is None:
        return None
    return max(1, hsdp_shard * edp_tp // ep)


def _shard_and_replica_groups(groups: np.ndarray, shard: int | None) -> tuple[np.ndarray, np.ndarray]:
    """HSDP over ``groups`` (one row a data-parallel group): the shard groups, consecutive blocks
    of ``shard`` ranks of a row (the whole row without HSDP), and the replica groups, the ranks
    at the same place in each block."""
    size = groups.shape[1]
    shard = shard or size
    return (groups.reshape(-1, shard),
            groups.reshape(len(groups), -1, shard).transpose(0, 2, 1).reshape(-1, size // shard))


def communication_groups(mesh: Mesh, hsdp_shard: int | None) -> dict[Dim, np.ndarray]:
    """Every group a plan may name. The data-parallel groups (dp, edp) take in the context-
    parallel ranks: every collective on them reduces or gathers parameters and gradients, which
    CP ranks share (``Mesh.groups("dp-cp")``); the expert one is the mesh's expert folding
    (``Mesh.groups("edp")``: the tp ranks too when ``Mesh.edp_tp`` > 1). HSDP (``hsdp_shard``
    ranks, ``hsdp_shard_of``): shard inside consecutive blocks of the DP group, replicate across
    blocks; the experts alike inside their group (``hsdp_expert_shard_of``): the folding runs dp
    outermost, so a replica's fsdp_shard_size dp indices hold fsdp_shard_size x cp x edp_tp / ep
    consecutive edp indices (Scenario.check keeps that whole)."""
    groups = {Dim(d): mesh.groups(d) for d in (Dim.TP, Dim.CP, Dim.EP, Dim.PP)}
    groups[Dim.DP] = dp_groups = mesh.groups("dp-cp")
    groups[Dim.EDP] = edp_groups = mesh.groups("edp")
    groups[Dim.DP_SHARD], groups[Dim.DP_REP] = _shard_and_replica_groups(dp_groups, hsdp_shard)
    groups[Dim.EDP_SHARD], groups[Dim.EDP_REP] = _shard_and_replica_groups(
        edp_groups, hsdp_expert_shard_of(hsdp_shard, mesh.ep, mesh.edp_tp))
    # First and last pipeline stage of each replica: Megatron's tied-embedding gradient all-reduce.
    groups[Dim.EMB] = groups[Dim.PP][:, [0, -1]] if mesh.pp > 1 else groups[Dim.PP]
    return groups


def bucketed_stages(sched, pp_rank: int, first_chunk_only: bool) -> set[int] | None:
    """The stages of ``pp_rank`` whose gradients are reduced in buckets as backward produces them
    (None: all). megatron-core's DDP buckets only the first model chunk of the first pipeline rank:
    "Turn off bucketing if we are on a pipeline stage that is not the first (since data-parallel
    communication on these stages is not on the critical path)", and Megatron-LM's get_model passes
    disable_bucketing for model chunks after the first (megatron-core 0.16.1
    distributed/distributed_data_parallel.py). Their gradients are reduced in one piece when the
    stage's last backward ends."""
    if not first_chunk_only:
        return None
    if pp_rank != 0:
        return set()
    stages = sched.stages_of_rank(0)
    first = min(stages, key=lambda st: sched.stage_position[st])
    return {first}


class GradBuckets:
    """Gradient buckets: filled as backward produces gradients, reduced when full (DDP/Megatron)
    or when an FSDP unit's gradients are complete; dense over dp (or HSDP), expert over edp."""

    def __init__(self, out: list, new_handle, zero: int, bucket_bytes: float, use_dp: bool, use_edp: bool,
                 hsdp_shard: int | None, bucketed: set[int] | None = None, hsdp_expert_shard: int | None = None,
                 wait_previous: bool = False, unit_of: dict[int, int] | None = None):
        self.out, self.new_handle = out, new_handle
        # FSDP units of several layer ids (Program.fsdp_unit_of). The root unit (-1 among them)
        # wraps the whole model: its post-backward runs after every other unit's, where the
        # backward ends (torch 2.13 FSDPState._root_post_backward_final_callback: the root's
        # inputs, the token ids, need no gradient, so no RegisterPostBackwardFunction fires for
        # it earlier); its gradients wait in ``root_fill`` until the action's last segment.
        self.unit_of = unit_of or {}
        self.root_fill = [0.0, 0.0]
        # FSDP2: the compute stream waits for the reductions in flight before it issues the next
        # (Program.grad_reduce_waits_previous). It waits on the reduce-scatter's event only; under
        # HSDP the all-reduce runs after it on FSDP2's all_reduce_stream and is waited for at the
        # backward's end (finalize_backward), but the plan chains the two on one stream under one
        # handle, so waiting on it would wait for the all-reduce too: HSDP keeps them in flight.
        self.wait_previous = wait_previous and hsdp_shard is None and hsdp_expert_shard is None
        self.zero, self.bucket_bytes, self.hsdp_shard = zero, bucket_bytes, hsdp_shard
        self.hsdp_expert_shard = hsdp_expert_shard
        # Stages whose gradients go in buckets (None: all); the others reduce theirs in one piece
        # when their last backward ends (``bucketed_stages``).
        self.bucketed = bucketed
        self.on = (use_dp, use_edp)
        self.fill = [0.0, 0.0]  # dense, expert bytes waiting
        self.pending: list[int] = []

    def flush(self, label: str) -> None:
        if self.wait_previous and any(self.fill[i] > 0 and self.on[i] for i in (0, 1)):
            for h in self.pending:
                self.out.append(Wait(h, Dim.DP, "dp reduce-scatter of the previous FSDP unit"))
            self.pending.clear()
        for i, expert in ((0, False), (1, True)):
            if self.fill[i] > 0 and self.on[i]:
                h = self.new_handle()
                self.pending.append(h)
                steps = grad_reduction_steps(self.zero, self.fill[i], expert, self.hsdp_shard, self.hsdp_expert_shard)
                self.out.append(Collective(Stream.DP, steps, h, "dp", f"{steps[0][1]} {label}", row_bytes=steps[0][2]))
            self.fill[i] = 0.0

    def add(self, a: Action, j: int, seg, last: bool, action_last: bool | None = None) -> None:
        """Gradients of op ``j`` of ``seg``; ``last``: the segment's last op. ``action_last``: whether
        the action's gradients end there (default ``last``; a caller emitting one action as several
        segments, the sweep estimate's one-layer rows, says where the action ends)."""
        unit_of = self.unit_of
        L = int(seg.layer[j])
        fill = self.root_fill if unit_of and unit_of.get(L, L) == -1 else self.fill
        fill[0] += seg.grad_bytes[j]
        if seg.expert_grad_bytes is not None:
            fill[1] += seg.expert_grad_bytes[j]
        # FSDP reduces per unit; DDP/ZeRO-1/2 per bucket.
        unit_done = self.zero >= 3 and (last or unit_of.get(int(seg.layer[j + 1]), int(seg.layer[j + 1])) != unit_of.get(L, L))
        total = self.fill[0] + self.fill[1]
        full = total >= self.bucket_bytes and (self.bucketed is None or a.stage in self.bucketed)
        if full or (unit_done and total > 0):
            self.flush(f"grads stage {a.stage}")
        if (last if action_last is None else action_last) and self.root_fill[0] + self.root_fill[1] > 0:
            # (the unit before it was flushed just above: fill is empty)
            self.fill, self.root_fill = self.root_fill, [0.0, 0.0]
            self.flush(f"grads stage {a.stage} root")

    def split(self, dense: float, expert: float, label: str, one_piece: bool = False) -> None:
        """Reduce ``dense`` + ``expert`` bytes in equal buckets (no overlap with backward), or in one
        collective each (``Scenario.grad_reduce_in_one_piece``)."""
        n_buckets = 1 if one_piece else max(1, int(np.ceil((dense + expert) / self.bucket_bytes)))
        for _ in range(n_buckets):
            self.fill[0], self.fill[1] = dense / n_buckets, expert / n_buckets
            self.flush(label)

    def join(self) -> None:
        for h in self.pending:
            self.out.append(Wait(h, Dim.DP, "dp gradient reduction"))
        self.pending.clear()


@dataclass
class LinearCost:
    end_s: float
    busy_s: float
    exposed_s: dict[Dim, float]  # by base dimension


def linear_replay(instrs, coll_time, sm_count: int | None = None, contention_scale: float = 1.0) -> LinearCost:
    """Replay one rank's instructions alone: what the engine does with inputs always ready.

    ``coll_time(dim, op, size_bytes)`` prices a collective (the network's isolated time). Streams
    are FIFO queues as in the engine; cross-rank dependencies (Recv) are ignored, so this is the
    engine's answer exactly for a rank that never waits on a peer, and the per-action cost the
    closed-form estimate composes into a pipeline. With ``sm_count``, compute that overlaps
    asynchronous collectives is slowed by the SMs they hold while they run, as in the engine."""
    now = busy = 0.0
    running: list[tuple[float, float, int]] = []  # (start, end, CTAs) of asynchronous collectives
    exposed: dict[Dim, float] = {}
    stream_free: dict[Stream, float] = {}
    done: dict[int, float] = {}
    for ins in instrs:
        t = type(ins)
        if t is Compute:
            sec = ins.seconds
            if sm_count and running:
                # Slowed while collectives hold SMs, at full speed between and after them (the
                # engine's Engine._contended_compute).
                t, left = now, sec
                while left > 0.0:
                    running = [r for r in running if r[1] > t]
                    taken = sum(c for st, _, c in running if st <= t)
                    f = scaled_slowdown(compute_slowdown(sm_count, taken), contention_scale * ins.sm_share)
                    nxt = min([en for st, en, _ in running if st <= t] + [st for st, _, _ in running if st > t],
                              default=float("inf"))
                    if t + left * f <= nxt:
                        t, left = t + left * f, 0.0
                    else:
                        left -= (nxt - t) / f
                        t = nxt
                sec = t - now
            now += sec
            busy += sec
        elif t is Collective:
            dur = 0.0
            for d, op, size in ins.steps:
                dur += coll_time(d, op, size)
            begin = max(now, stream_free.get(ins.stream, 0.0))
            end = begin + dur
            if sm_count and ins.handle >= 0:
                running.append((begin, end, ins.sms))
            stream_free[ins.stream] = end
            if ins.handle < 0:
                b = ins.steps[0][0].base
                exposed[b] = exposed.get(b, 0.0) + end - now
                now = end
            else:
                done[ins.handle] = end
        elif t is Wait:
            end = done[ins.handle]
            if end > now:
                exposed[ins.dim] = exposed.get(ins.dim, 0.0) + end - now
                now = end
    return LinearCost(now, busy, exposed)


# ----------------------------------------------------------------------------- the planner

def _group_size(prog, dim: str) -> int:
    mesh = prog.mesh
    if dim == Dim.EMB:
        return 2 if mesh.pp > 1 else 1
    return int(communication_groups(mesh, _hsdp_shard(prog))[Dim(dim)].shape[1])


def _hsdp_shard(prog) -> int | None:
    """``hsdp_shard_of`` for a program."""
    return hsdp_shard_of(prog.zero, prog.fsdp_shard_size, prog.mesh.dp, cp=prog.mesh.cp)


def build_plan(prog) -> Plan:
    """The plan of every pipeline rank of ``prog`` (a ``simulator.workload.program.Program``)."""
    sched = prog.schedule
    ranks = [_plan_rank(prog, r) for r in range(sched.num_ranks)]
    return Plan(mesh=prog.mesh, schedule=sched, ranks=ranks,
                groups=communication_groups(prog.mesh, _hsdp_shard(prog)))




def _template(seg) -> list[tuple]:
    """Per segment, what every action of this (position, kind) emits: parsed once per Segments."""
    tpl = getattr(seg, "_plan_template", None)
    if tpl is None and getattr(seg, "_template_of", None) is not None:
        # A one-layer position's copy of another layer's segments (program.build_program): its
        # instructions but for the layer id, every segment of which is this layer.
        L = int(seg.layer[0]) if len(seg.layer) else 0
        tpl = seg._plan_template = [(c, label, L, info, share) for c, label, _, info, share in _template(seg._template_of)]
    if tpl is None:
        tpl = []
        shares = seg.sm_share
        for j in range(len(seg.compute_s)):
            comm = seg.comm[j]
            c_info = None
            if comm is not None and comm.op == JOIN:
                c_info = JOIN
            elif comm is not None:
                dim = Dim(comm.dim)
                c_info = (dim.value, Stream(dim), ((dim, CollectiveOp(comm.op), comm.size_bytes),), f"{comm.op} {seg.label[j]}",
                          comm.overlap, comm.size_bytes, Wait(-1, dim.base, f"overlapped {dim} communication"),
                          -1 if comm.ctas is None else comm.ctas)
            tpl.append((float(seg.compute_s[j]), seg.label[j], int(seg.layer[j]), c_info, 1.0 if shares is None else float(shares[j])))
        seg._plan_template = tpl
    return tpl


def emit_action(out: list, seg, a: Action, blocking: bool, new_handle, idx: int = 0, on_layer=None, on_grads=None) -> None:
    """The instructions of one action: its segments' compute and collectives.

    A blocking collective stops the compute stream; an ``overlap`` one runs beside the next
    segment and is joined before the next collective, at a JOIN or at the action's end; in an overlapped
    F&B pair (``blocking=False``) every collective is joined at the end of its half. ``on_layer``
    runs where a new layer starts (FSDP gathers), ``on_grads`` after each segment's compute
    (gradient buckets)."""
    pending: list[tuple[Wait, int]] = []  # overlapped collectives in flight
    deferred: list[tuple[Wait, int]] = []  # collectives of an overlapped F&B pair, joined at its end
    append = out.append
    kind, mb, stage = a.kind, a.microbatch, a.stage
    layer = None
    tpl = _template(seg)
    n = len(tpl)
    for j in range(n):
        c, label, lj, c_info, share = tpl[j]
        if on_layer is not None and lj != layer:
            layer = lj
            on_layer(idx, layer)
        if c > 0:
            append(Compute(c, kind, label, mb, stage, lj, True, share))
        if on_grads is not None:
            on_grads(a, j, seg, j + 1 == n)
        if c_info is None:
            continue
        if pending:
            for w, h in pending:
                append(Wait(h, w.dim, w.reason))
            pending.clear()
        if c_info is JOIN:
            continue
        row_kind, stream, step, name, overlap, size, w, ctas = c_info
        if blocking and not overlap:
            append(Collective(stream, step, -1, row_kind, name, mb, stage, lj, size, a, ctas))
            continue
        h = new_handle()
        append(Collective(stream, step, h, row_kind, name, mb, stage, lj, size, None, ctas))
        (pending if blocking else deferred).append((w, h))
    for w, h in pending:
        append(Wait(h, w.dim, w.reason))
    # Overlapped F&B: what the pair's compute could not hide is exposed at its end.
    for w, h in deferred:
        append(Wait(h, w.dim, w.reason))


def param_buckets(layers: list[int], params_of: dict[int, float], bucket_params: float) -> list[list[int]]:
    """megatron-core's parameter (and gradient) buckets of one model chunk whose layers run in
    this forward order, as lists of layers in forward order: ParamAndGradBuffer fills one buffer
    in reverse parameter order and closes a bucket once it holds bucket_size parameters, so the
    first bucket in forward order is the remainder. Whole layers here (the embedding and the
    head are layers of their own)."""
    buckets: list[list[int]] = []
    held = 0.0
    for L in reversed(layers):
        if not buckets or held >= bucket_params:
            buckets.append([])
            held = 0.0
        buckets[-1].insert(0, L)
        held += params_of.get(L, 0.0)
    return buckets[::-1]


def zero12_param_buckets(prog, pp_rank: int, use_dp: bool, use_edp: bool) -> list[tuple[int, int, float, float]]:
    """ZeRO-1/2 with overlap_param_gather: megatron-core's parameter all-gathers of one rank, as
    (action index, layer whose forward waits for it, dense bytes, expert bytes) in the order the
    rank's first forward of each stage runs them (param_buckets)."""
    sched = prog.schedule
    out: list[tuple[int, int, float, float]] = []
    seen: set[int] = set()
    for idx, a in enumerate(sched.actions[pp_rank]):
        for sub in a.leaves:
            if sub.kind != "F" or sub.stage in seen:
                continue
            seen.add(sub.stage)
            seg = prog.segments[(sched.stage_position[sub.stage], "F")]
            layers = list(dict.fromkeys(int(x) for x in seg.layer))
            for members in param_buckets(layers, prog.unit_params, prog.bucket_params):
                dense, ebytes = zero12_bucket_bytes(prog, members, use_dp, use_edp)
                if dense > 0 or ebytes > 0:
                    out.append((idx, members[0], dense, ebytes))
    return out


def zero12_bucket_bytes(prog, members: list[int], use_dp: bool, use_edp: bool) -> tuple[float, float]:
    """(dense bytes over dp, expert bytes over edp) one ZeRO-1/2 parameter bucket gathers."""
    total = sum(prog.unit_params.get(L, 0.0) for L in members)
    expert = sum(prog.unit_expert_params.get(L, 0.0) for L in members)
    return ((total - expert) * prog.param_bytes if use_dp else 0.0), (expert * prog.param_bytes if use_edp else 0.0)


def _plan_rank(prog, pp_rank: int) -> RankPlan:
    sched = prog.schedule
    mesh = prog.mesh
    actions = sched.actions[pp_rank]
    out: list[Instr] = []
    n_handles = [0]

    def new_handle() -> int:
        n_handles[0] += 1
        return n_handles[0] - 1

    # Which action is the last backward (B or W) of each stage: gradient buckets fill there.
    last_grad_action: dict[int, int] = {}
    for idx, a in enumerate(actions):
        for sub in a.leaves:
            if sub.kind in ("B", "W"):
                last_grad_action[sub.stage] = idx
    use_dp = mesh.dp * mesh.cp > 1  # CP ranks reduce their gradients with the dp ones
    zero3 = prog.zero >= 3
    hsdp_shard = _hsdp_shard(prog)
    # The ranks holding the same experts (dp x cp / ep, x tp under sequence parallelism: edp_tp_of).
    use_edp = mesh.edp > 1
    hsdp_expert_shard = hsdp_expert_shard_of(hsdp_shard, mesh.ep, prog.edp_tp)
    buckets = GradBuckets(out, new_handle, prog.zero, prog.grad_bucket_bytes, use_dp, use_edp, hsdp_shard,
                          bucketed_stages(sched, pp_rank, prog.grad_buckets_first_chunk_only), hsdp_expert_shard,
                          wait_previous=prog.grad_reduce_waits_previous, unit_of=prog.fsdp_unit_of)

    # ZeRO-1/2: the updated parameters are all-gathered. Without overlap_param_gather (megatron-
    # core's default; DeepSpeed's ZeRO-1/2 step ends in all_gather_dp_groups) the gather ends the
    # optimizer step and each rank waits for all of it (its stages' gathers one after another)
    # before anything runs: here, at step start. With it, megatron-core gathers by buckets in the
    # first forward (below, with the FSDP gathers).
    if 1 <= prog.zero <= 2 and (use_dp or use_edp) and not prog.overlap_param_gather:
        for st in sched.stages_of_rank(pp_rank):
            pos = sched.stage_position[st]
            expert = prog.stage_expert_params[pos] if prog.stage_expert_params else 0.0
            # Dense parameters are sharded over dp, expert parameters over edp (which, with tp
            # ranks in it, may shard experts where dp x cp is 1).
            steps: tuple[Step, ...] = ()
            if use_dp:
                steps += ((Dim.DP, CollectiveOp.ALL_GATHER, (prog.stage_params[pos] - expert) * prog.param_bytes),)
            if expert > 0 and use_edp:
                steps += ((Dim.EDP, CollectiveOp.ALL_GATHER, expert * prog.param_bytes),)
            if steps:
                out.append(Collective(Stream.DP_AG, steps, -1, "dp", f"all_gather params stage {st}",
                                      row_bytes=steps[0][2]))

    # ZeRO-3 / FSDP: every unit (layer) is all-gathered before it runs, forward and (when
    # resharded after forward) backward, `fsdp_prefetch` units ahead on its own stream. A MoE
    # layer's experts are sharded over the expert-data-parallel group, not the dense one, and
    # are gathered there, right after the rest of the unit (torchtitan 0.3.0 llama4 parallelize
    # apply_fsdp: the routed experts are fully_shard-ed on their own mesh, the block around them
    # on the dense one); with no expert replica (use_edp False) they are whole on the rank.
    gathers: list[tuple[int, int, float, float]] = []  # (action index, layer, bytes, expert bytes) in execution order
    ag_dim = Dim.DP_SHARD if hsdp_shard is not None else Dim.DP
    eag_dim = Dim.EDP_SHARD if hsdp_shard is not None else Dim.EDP
    unit_of = prog.fsdp_unit_of
    prefetch, issue_at_start = prog.fsdp_prefetch, True
    if 1 <= prog.zero <= 2 and (use_dp or use_edp) and prog.overlap_param_gather:
        gathers = zero12_param_buckets(prog, pp_rank, use_dp, use_edp)
        # megatron-core (DistributedDataParallel._make_forward_pre_hook, _ParamAndGradBucketGroup
        # finish_param_sync): a module's forward pre-hook waits for its bucket's gather, issuing it
        # there if it is not yet (the first), and then issues the next bucket's: one bucket ahead,
        # the first exposed. An interleaved schedule aligns them instead (align_param_gather, as
        # NeMo 2.5 sets it for vpp > 1: megatron_comm_overlap.py): the schedule issues each
        # chunk's gathers ahead of it (schedules.py param_sync_func), here all at step start.
        interleaved = sched.num_stages > sched.num_ranks
        prefetch, issue_at_start = (len(gathers), True) if interleaved else (1, False)
    if zero3 and (use_dp or use_edp):
        gathered: set[tuple[int, int]] = set()
        for idx, a in enumerate(actions):
            for sub in a.leaves:
                if sub.kind == "W" or (sub.kind != "F" and not prog.fsdp_reshard_after_forward):
                    continue
                seg = prog.segments[(sched.stage_position[sub.stage], sub.kind)]
                layers = list(dict.fromkeys(int(x) for x in seg.layer))
                # A unit of several layer ids (torchtitan's root: the embedding, the final norm
                # and the head) is gathered whole where the first of them runs, once an action.
                members: dict[int, list[int]] = {}
                for L in layers:
                    members.setdefault(unit_of.get(L, L), []).append(L)
                for u, ls in members.items():
                    if sub.kind != "F" and u in prog.fsdp_keep_gathered:
                        continue  # not resharded after its forward: still whole for its backward
                    if prog.fsdp_reshard_after_forward or (sub.stage, u) not in gathered:
                        gathered.add((sub.stage, u))
                        nbytes = sum(prog.unit_gather_bytes.get(L, prog.unit_params.get(L, 0.0) * prog.param_bytes)
                                     for L in ls)
                        ebytes = sum(prog.unit_expert_gather_bytes.get(L, 0.0) for L in ls)
                        dense, ebytes = (nbytes - ebytes if use_dp else 0.0), (ebytes if use_edp else 0.0)
                        if dense > 0 or ebytes > 0:
                            gathers.append((idx, ls[0], dense, ebytes))
    gather_handles = [new_handle() for _ in gathers]
    next_gather = [0, 0]  # [next to wait for, next to issue]
    # FSDP2 (Program.fsdp_one_communicator): a unit's gather queues behind the reduce-scatters
    # issued before it, and they behind it, on the one communicator's stream. Not under HSDP
    # (the all-reduce that follows each reduce-scatter is on the replicate group's communicator,
    # FSDP2's all_reduce_stream, but the plan chains it to the reduce-scatter) nor with sharded
    # experts (their gathers and reductions run on the expert mesh's own communicator, the plan
    # chains their gathers to the dense ones): there the gathers keep their own stream.
    experts_sharded = use_edp and any(x > 0 for x in (prog.stage_expert_params or ()))
    gather_stream = (Stream.DP if prog.fsdp_one_communicator and hsdp_shard is None and not experts_sharded
                     else Stream.DP_AG)

    def issue_gathers(upto: int) -> None:
        while next_gather[1] < min(upto, len(gathers)):
            i = next_gather[1]
            _, L, nbytes, ebytes = gathers[i]
            steps: tuple[Step, ...] = ((ag_dim, CollectiveOp.ALL_GATHER, nbytes),) if nbytes > 0 else ()
            if ebytes > 0:
                steps += ((eag_dim, CollectiveOp.ALL_GATHER, ebytes),)
            out.append(Collective(gather_stream, steps, gather_handles[i], "dp", f"all_gather params layer {L}",
                                  row_bytes=nbytes + ebytes))
            next_gather[1] += 1

    if issue_at_start:
        issue_gathers(1 + prefetch)

    def wait_gather(idx: int, layer: int) -> None:
        i = next_gather[0]
        if i >= len(gathers) or gathers[i][0] != idx or gathers[i][1] != layer:
            return
        next_gather[0] += 1
        issue_gathers(i + 1 + prefetch)
        out.append(Wait(gather_handles[i], Dim.DP, f"dp all_gather of layer {layer} parameters"))

    def on_layer(idx: int, layer: int) -> None:
        if gathers:
            wait_gather(idx, layer)

    reduce_after = prog.grad_reduce_after_stage_backward and prog.overlap_grad_reduce

    def run_segments(a: Action, idx: int, grads_here: bool, blocking: bool) -> None:
        seg = prog.segments[(sched.stage_position[a.stage], a.kind)]
        emit_action(out, seg, a, blocking, new_handle, idx=idx, on_layer=on_layer if gathers else None,
                    on_grads=buckets.add if grads_here and prog.overlap_grad_reduce and not reduce_after else None)

    def reduce_stage_grads(a: Action) -> None:
        """torch.distributed.pipelining's REDUCE_GRAD after a stage's last backward (torch 2.13
        stage.py perform_reduce_grad; schedules.py _add_reduce_grad puts it right after the
        stage's n-th backward; Schedule1F1B after the schedule): FSDP2's post_backward for every
        unit of the stage in turn, each waiting on the compute stream for the previous unit's
        reduce-scatter before it copies in and issues its own (_fsdp_param_group.py
        post_backward, post_backward_rs_wait), and _root_post_backward_final_callback waiting for
        the last: the compute stream waits for every one, none overlaps a backward."""
        w = prog.segments[(sched.stage_position[a.stage], "W")]
        units: dict[int, list[float]] = {}
        for j in range(len(w.compute_s)):
            u = units.setdefault(prog.fsdp_unit_of.get(int(w.layer[j]), int(w.layer[j])), [0.0, 0.0])
            u[0] += float(w.grad_bytes[j])
            if w.expert_grad_bytes is not None:
                u[1] += float(w.expert_grad_bytes[j])
        for L in sorted(units):
            for nbytes, expert, on in ((units[L][0], False, use_dp), (units[L][1], True, use_edp)):
                if nbytes <= 0 or not on:
                    continue
                steps = grad_reduction_steps(prog.zero, nbytes, expert, hsdp_shard, hsdp_expert_shard)
                out.append(Collective(Stream.DP, steps, -1, "dp", f"{steps[0][1]} grads stage {a.stage} layer {L}",
                                      stage=a.stage, layer=L, row_bytes=steps[0][2], action=a))

    blocking_exchange = prog.pp_blocking_exchange

    def sends_of(a: Action, kind: str) -> tuple[Send, ...]:
        consumer = sched.stage_next[a.stage] if kind == "F" else sched.stage_prev[a.stage]
        if consumer < 0:
            return ()
        dst_pp = sched.stage_rank[consumer]
        if dst_pp == pp_rank:
            return ()
        stream = Stream.PP_SEND_F if kind == "F" else Stream.PP_SEND_B
        return (Send(stream, dst_pp, prog.pp_bytes, blocking_exchange),)

    def output_kind(a: Action) -> str | None:
        return "F" if a.kind == "F" else "BI" if a.kind in ("B", "I") else None

    def complete(a: Action) -> None:
        kind = output_kind(a)
        if kind is not None:
            # A blocking exchange sends at the next exchange (send_outputs); consumers on this
            # rank are woken now.
            out.append(Complete(a.stage, kind, a.microbatch, () if blocking_exchange else sends_of(a, kind)))

    def inputs(sub: Action, remote: bool | None = None) -> None:
        """Waits for the action's inputs: all, or (``remote``) only those from other ranks or
        only the rest (this rank's own outputs; parameter gathers are waited for by layer)."""
        for (st, kind, mb) in required_inputs(sched, sub):
            src_pp = sched.stage_rank[st]
            if remote is not None and remote != (src_pp != pp_rank):
                continue
            out.append(Recv(st, kind, mb, src_pp, src_pp == pp_rank, sub))
            if src_pp != pp_rank and prog.pp_gather_bytes > 0:
                # Megatron's scatter/gather: each TP rank received 1/tp of the tensor; the
                # receiver rebuilds it with a blocking tp all-gather after the exchange
                # (p2p_communication._communicate: gather_split_1d_tensor on what it received).
                out.append(Collective(
                    Stream.TP, ((Dim.TP, CollectiveOp.ALL_GATHER, prog.pp_gather_bytes),), -1, "pp",
                    f"gather {'activation' if kind == 'F' else 'gradient'} {st}{kind}{mb}", microbatch=mb, stage=st,
                    row_bytes=prog.pp_gather_bytes, action=sub, exposed_dim=Dim.PP))

    def run_action(idx: int, a: Action) -> None:
        for sub in a.leaves:
            # The stage's last weight-gradient action: a W, or a full B (DualPipe's first and last
            # ranks end one of their stages with a B though they split others into I and W).
            g = (last_grad_action.get(sub.stage) == idx or prog.grad_reduce_every_microbatch) and sub.kind in ("B", "W")
            run_segments(sub, idx, g, blocking=a.kind != "FB")
            complete(sub)
            if g and reduce_after:
                reduce_stage_grads(sub)
            elif g and prog.overlap_grad_reduce:
                buckets.flush(f"grads stage {sub.stage}")

    def send_outputs(done: list[Action]) -> list[SendDone]:
        """A blocking exchange's sends of the actions run since the last one, and their waits."""
        waits = []
        for a in done:
            kind = output_kind(a)
            sends = sends_of(a, kind) if kind is not None else ()
            if sends:
                out.append(Complete(a.stage, kind, a.microbatch, sends, wake=False))
                waits += [SendDone(a.stage, kind, a.microbatch, s.dst_pp) for s in sends]
        return waits

    if not blocking_exchange:
        for idx, a in enumerate(actions):
            for sub in a.leaves:
                inputs(sub)
            run_action(idx, a)
    else:
        # Megatron-LM 2021 (schedules.py, p2p_communication._communicate): between two groups of
        # actions a rank exchanges the first group's outputs for the second's inputs. The
        # interleaved schedule runs every exchange as one call (send_forward_recv_forward,
        # send_forward_backward_recv_forward_backward after each steady F+B pair, ...); plain 1F1B
        # combines them where the kind changes (send_forward_recv_backward,
        # send_backward_recv_forward) and sends, then receives, in its warm-up and cool-down
        # (send_forward; recv_forward).
        interleaved = sched.num_stages > sched.num_ranks
        # Steady F+B pairs exist only where a forward follows the first backward. When every
        # forward is warm-up (num_microbatches == pp: all_warmup_microbatches), the last warm-up
        # forward's exchange is send_forward_recv_forward and the backward's gradient comes by
        # its own recv_backward; pairing that forward with the first backward waited for a
        # gradient that needs the forward's output (a dependency cycle).
        kinds = [a.kind for a in actions]
        steady = "B" in kinds and "F" in kinds[kinds.index("B"):]
        groups: list[list[int]] = []
        i = 0
        while i < len(actions):
            pair = (interleaved and steady and i + 1 < len(actions) and actions[i].kind == "F"
                    and actions[i + 1].kind == "B")
            groups.append([i, i + 1] if pair else [i])
            i += len(groups[-1])
        done: list[Action] = []
        for g in groups:
            first = actions[g[0]]
            combined = interleaved or not done or done[-1].kind != first.kind
            waits = send_outputs(done)
            posts = tuple((st, kind, mb) for j in g for sub in actions[j].leaves
                          for (st, kind, mb) in required_inputs(sched, sub) if sched.stage_rank[st] != pp_rank)
            if not combined:
                out.extend(waits)
            if posts:
                out.append(Post(posts))
            if combined:
                out.extend(waits)
            # The exchange returns when everything has arrived (and been all-gathered, with
            # scatter/gather): the group's inputs are waited for before any of its compute.
            for j in g:
                for sub in actions[j].leaves:
                    inputs(sub, remote=True)
            done = []
            for j in g:
                for sub in actions[j].leaves:
                    inputs(sub, remote=False)
                run_action(j, actions[j])
                done += actions[j].leaves
        out.extend(send_outputs(done))

    # Gradient reduction not overlapped with backward: all buckets after the last backward.
    if not prog.overlap_grad_reduce:
        for st in sched.stages_of_rank(pp_rank):
            w = prog.segments[(sched.stage_position[st], "W")]
            dense = float(w.grad_bytes.sum())
            expert = float(w.expert_grad_bytes.sum()) if w.expert_grad_bytes is not None else 0.0
            buckets.split(dense, expert, f"grads stage {st}", prog.grad_reduce_in_one_piece)
    buckets.join()
    # Step-level work between the backward and the optimizer (simulator.workload.program
    # StepCollective): the tied-embedding all-reduce (first and last stage only), the
    # gradient-norm kernel and its all-reduces, blocking the compute stream.
    # The tie's two ends: the ranks of the first and the last stage (communication_groups' emb
    # group, pp ranks 0 and pp - 1). V-shaped schedules (zbv, dualpipev) put both stages on pp
    # rank 0, which holds the matrix once (ops.tied_head_shares_embedding, the same rule):
    # there is no peer to all-reduce with (Megatron's embedding group would hold one rank),
    # where the plan had pp ranks 0 and pp - 1 all-reduce the matrix's gradient and the last
    # rank holds neither. (step_terms emits no such term then; the filter keeps the other ranks out.)
    tie_ranks = set(sched.chain_end_ranks)
    for term in getattr(prog, "step_collectives", ()):
        if term.dim == Dim.EMB and (pp_rank not in tie_ranks or sched.chain_ends_share_rank):
            continue
        if term.compute_s > 0:
            out.append(Compute(term.compute_s, "opt", term.label, counted=False, sm_share=0.0))
        if term.size_bytes > 0 and _group_size(prog, term.dim) > 1:
            dim = Dim(term.dim)
            out.append(Collective(Stream.DP, ((dim, CollectiveOp(term.op), term.size_bytes),), -1, dim.base.value,
                                  f"{term.op} {term.label}", row_bytes=term.size_bytes))
    # Optimizer step on this rank's (ZeRO-sharded) parameters.
    if prog.optimizer_s > 0:
        out.append(Compute(prog.optimizer_s, "opt", "optimizer step", counted=False, sm_share=0.0))
    return RankPlan(pp_rank, out, n_handles[0])
