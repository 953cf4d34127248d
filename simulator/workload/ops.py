"""The transformer as ops: per layer the forward ops, and the backward split into input-grad (I)
and weight-grad (W), each with FLOPs and bytes, sharded as Megatron shards them.

Tensor parallelism (Megatron-LM): QKV and MLP-in are column-parallel, attention-out and
MLP-out are row-parallel. Without sequence parallelism the row-parallel outputs are all-reduced
in forward and the column-parallel inputs all-reduced in backward; with sequence parallelism
norms, dropout and residuals run on s/tp tokens and the collectives become all-gather before a
column-parallel block and reduce-scatter after a row-parallel one (their conjugates in backward).

FLOPs: ``model_flops`` counts matmuls and attention as model FLOPs do (no recomputation, full
s x s attention scores); ``exec_flops`` is what the kernels execute (FlashAttention skips the
masked half of causal attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from simulator.scenario import Scenario
from simulator.workload.kernels import Kernel, adam_kernel, adam_launches, flash_kernel, gemm_kernel, mem_kernel, op_kernels
from simulator.workload.plan import JOIN, adam_passes, scenario_grad_bytes, scenario_optimizer_shards

Phase = Literal["F", "I", "W"]


@dataclass(frozen=True)
class Comm:
    """A collective on the compute path (tp, cp or ep).

    Blocking by default. An ``overlap`` collective runs while the next compute segment does;
    the compute stream waits for it before it issues its next collective, at a ``JOIN`` or at
    the end of the action (ring attention's K/V passing, overlapped MoE dispatch, async TP).
    ``ctas``: SMs its kernels hold while in flight where they are not NCCL's (None): 0 for P2P
    copies on the copy engines (torch's micro-pipelined TP, TE's ring exchange), 16 for TE
    userbuffers' pipelined and bulk overlaps.
    """

    dim: str
    op: str
    size_bytes: float
    overlap: bool = False
    ctas: int | None = None
    # Bytes of its conjugate in backward where they differ (torchao Float8 TP: the forward
    # all-gather moves FP8 activations, its backward reduce-scatter bf16 gradients).
    bwd_size_bytes: float | None = None


@dataclass(frozen=True)
class Op:
    name: str
    op_class: str  # gemm | attention | elementwise | norm | optimizer | other
    phase: Phase
    # Memory-bound ops' FLOP counts (5 a norm element, 8 a GELU, 6 a logit...) are nominal, without
    # a source: those ops are timed by their bytes (kernel model), or by max(FLOPs, bytes) on the
    # class curves, where the bytes bind by ~100x.
    exec_flops: float = 0.0
    model_flops: float = 0.0
    bytes: float = 0.0
    comm: Comm | None = None  # a collective instead of a kernel
    params: float = 0.0  # parameters whose gradient this op produces (W phase) or owns (F)
    fp8: bool = False  # a GEMM (or attention) on FP8 tensor cores: timed at the profile's FP8 peak
    bwd_bytes: float | None = None  # memory-bound op whose backward moves these bytes (not 2x forward)
    # One kernel timed by shape (simulator.workload.kernel_model); None: by class, FLOPs and bytes.
    kernel: Kernel | None = None
    # Kernels the framework launches for this op (host issue cost, ``host_launch_*_us``).
    launches: int = 1
    bias: bool = False  # a linear with a bias (GPT): its backward reduces and accumulates the bias gradient
    bwd_launches: int | None = None  # kernels of its backward where they are not 2 per forward kernel
    # False: activation checkpointing never reruns it (FSDP2's copy-out: backward's own all-gather
    # copies the parameters out once, before the recomputation runs).
    recompute: bool = True
    # The ops its backward runs, in order, in place of the ones derived from it (() for none):
    # context-parallel attention, whose backward interleaves its K/V exchange and dK/dV
    # rotation with the per-step kernels in an order the reversed forward cannot give
    # (torch_cp_attention_ops, te_cp_p2p_ops).
    bwd_ops: tuple["Op", ...] | None = None


@dataclass
class LayerOps:
    """Forward ops of one layer kind, and the rules to derive its backward."""

    kind: str  # "dense", "moe", "embedding", "head"
    forward: list[Op] = field(default_factory=list)
    params: float = 0.0  # parameters of this layer on one rank (after TP/EP sharding)
    # Backward given kernel by kernel (hf-eager layers): (input-grad ops, weight-grad ops).
    explicit_backward: tuple[list[Op], list[Op]] | None = None
    # Megatron sequence parallelism: all-gather a column-parallel GEMM's input again in backward.
    sp_regather: bool = False
    # Megatron SP: norm weights see 1/tp of the tokens, so their gradients are all-reduced over tp
    # (finalize_model_grads._allreduce_layernorm_grads; 0.16.1
    # _allreduce_non_tensor_model_parallel_grads); bytes of this layer's share, fp32
    # (sp_norm_grad_bytes).
    tp_norm_grad_bytes: float = 0.0
    # > 0: every microbatch adds each weight's fresh gradient into its main gradient in a separate
    # elementwise pass of this many HBM bytes per parameter (no gradient-accumulation fusion).
    grad_accum_bytes_per_param: float = 0.0
    # Under SP, parameters every tp rank holds whole but feeds only its sequence shard, other than
    # the norms above: MLA's "duplicated" down-projections and latent norms, a MoE router. Their fp32 main
    # gradients are all-reduced over tp once a step (megatron-core 0.16.1
    # finalize_model_grads._allreduce_non_tensor_model_parallel_grads, params with
    # .sequence_parallel; program.step_terms).
    tp_duplicated_params: float = 0.0

    def backward(self) -> tuple[list[Op], list[Op]]:
        """(input-grad ops, weight-grad ops) in execution order (reverse of forward)."""
        if self.explicit_backward is not None:
            return list(self.explicit_backward[0]), list(self.explicit_backward[1])
        i_ops, w_ops = self._backward()
        if self.tp_norm_grad_bytes > 0:
            # Megatron coalesces these into one call after backward; one small asynchronous call
            # per layer, overlapped with the next layer's backward, costs about the same.
            w_ops.append(Op("norm_grads_allreduce", "other", "W",
                            comm=Comm("tp", "all_reduce", self.tp_norm_grad_bytes, overlap=True)))
        return i_ops, w_ops

    def _backward(self) -> tuple[list[Op], list[Op]]:
        i_ops: list[Op] = []
        w_ops: list[Op] = []
        sp_regather = self.sp_regather
        for i in range(len(self.forward) - 1, -1, -1):
            op = self.forward[i]
            if op.bwd_ops is not None:
                i_ops += op.bwd_ops
                continue
            if op.comm is not None:
                conj = CONJUGATE.get(op.comm.op)
                if conj is not None:
                    c = op.comm
                    size = c.size_bytes if c.bwd_size_bytes is None else c.bwd_size_bytes
                    i_ops.append(replace(op, name=op.name + ".bwd", phase="I",
                                         comm=replace(c, op=conj, size_bytes=size, bwd_size_bytes=None)))
                continue
            if op.op_class == "gemm":
                k = op.kernel
                # dgrad: G[M, N] @ W^T -> [M, K]; wgrad: X^T[K, M] @ G[M, N] -> [K, N].
                dk = replace(k, n=k.k, k=k.n) if k is not None and k.kind == "gemm" else None
                wk = replace(k, m=k.k, k=k.m) if k is not None and k.kind == "gemm" else None
                gather = self._input_gather(i) if sp_regather and op.params > 0 else None
                if gather is not None:
                    # Megatron SP keeps only its 1/tp slice of the input: gather it again for the
                    # weight gradient, overlapped with the input-grad GEMM (Megatron
                    # LinearWithGradAccumulationAndAsyncCommunication.backward; Transformer
                    # Engine's layernorm_linear.py backward, in FP8 where the forward gathered FP8).
                    i_ops.append(Op(op.name + ".input_regather", "other", "I",
                                    comm=replace(gather, overlap=True, bwd_size_bytes=None)))
                i_ops.append(replace(op, name=op.name + ".dgrad", phase="I", kernel=dk, launches=1))
                if op.params > 0:
                    # Launches: the wgrad GEMM and AccumulateGrad's add into .grad (gradient
                    # accumulation over microbatches); with a bias, its reduction and its add.
                    w_ops.append(replace(op, name=op.name + ".wgrad", phase="W", kernel=wk,
                                         launches=2 + (2 if op.bias else 0)))
                    w_ops += self.grad_accumulate_ops(op)
            elif op.op_class == "attention":
                i_ops.append(attention_backward_op(op))
            elif op.bwd_bytes is not None and op.op_class != "norm":
                # FP8 casts: the backward quantizes the output gradient, with its own size.
                if op.bwd_bytes > 0:
                    i_ops.append(replace(op, name=op.name + ".bwd", phase="I", bytes=op.bwd_bytes, exec_flops=0.0,
                                         model_flops=0.0, params=0.0,
                                         launches=op.launches if op.bwd_launches is None else op.bwd_launches))
            else:
                # Launches: apex's fused LayerNorm backward runs three kernels (input grad, partial
                # and final gamma/beta grads); an elementwise op's backward two per forward kernel
                # (the gradient, and the bias-gradient reduction or the residual's gradient sum).
                launches = 3 if op.op_class == "norm" else 2 * op.launches
                # (A norm whose forward writes FP8 carries its bf16 backward bytes in bwd_bytes.)
                i_ops.append(replace(op, name=op.name + ".bwd", phase="I",
                                     bytes=op.bwd_bytes if op.bwd_bytes is not None else 2 * op.bytes,
                                     exec_flops=2 * op.exec_flops, model_flops=0.0, params=0.0,
                                     launches=launches if op.bwd_launches is None else op.bwd_launches))
                if op.params > 0:
                    # Norm weights: their gradient is a by-product of the input-grad kernel;
                    # a zero-cost W entry carries it to the gradient reduction (AccumulateGrad:
                    # one add per weight tensor, two with a bias).
                    w_ops.append(replace(op, name=op.name + ".wgrad", phase="W", exec_flops=0.0, model_flops=0.0,
                                         bytes=0.0, launches=2 if op.bias else 1))
                    w_ops += self.grad_accumulate_ops(op)
        return i_ops, w_ops

    def _input_gather(self, i: int) -> Comm | None:
        """The tp all-gather that feeds forward op ``i`` (a column-parallel GEMM), looking past the
        GEMM's own FP8 cast between them; None where its input was not gathered."""
        j = i - 1
        while j >= 0 and self.forward[j].name == self.forward[i].name + ".fp8_cast":
            j -= 1
        if j < 0 or self.forward[j].name in EXPERT_TP_COMM:
            return None  # the dispatcher's gathered tokens are the grouped GEMM's saved input
        c = self.forward[j].comm
        return c if c is not None and c.op == "all_gather" and c.dim == "tp" else None

    def grad_accumulate_ops(self, op: Op) -> list[Op]:
        """The pass that adds ``op``'s weight (and bias) gradient into the main gradient: an
        elementwise kernel timed by its bytes. Its launch is already counted by the wgrad op's
        ``launches`` (AccumulateGrad's add); its parameters are carried by the wgrad op."""
        if self.grad_accum_bytes_per_param <= 0 or op.params <= 0:
            return []
        return [Op(op.name + ".grad_accumulate", "elementwise", "W", 0.0, 0.0, op.params * self.grad_accum_bytes_per_param,
                   launches=0)]


def attention_backward_op(op: Op) -> Op:
    """An attention op's backward: dQ, dK, dV, twice the forward matmul work (a fused kernel's
    backward kernel; classic attention's batched GEMMs twice over)."""
    k = op.kernel
    bk = replace(k, backward=True, flops=2 * k.flops) if k is not None and k.kind == "flash" else (
        replace(k, batch=2 * k.batch) if k is not None else None)
    return replace(op, name=op.name + ".bwd", phase="I", exec_flops=2 * op.exec_flops,
                   model_flops=2 * op.model_flops, bytes=2 * op.bytes, kernel=bk,
                   launches=2 * op.launches if k is None or k.kind != "flash" else op.launches, bwd_ops=None)


# The expert tensor-parallel group's gather of the dispatched tokens and reduce-scatter of the
# experts' output (megatron-core's MoEAlltoAllTokenDispatcher, etp > 1): plain bf16 collectives of
# the dispatcher, not a column- or row-parallel linear's sequence-parallel ones; and the routed
# experts' grouped GEMMs between them.
EXPERT_TP_COMM = ("experts_etp_gather", "experts_etp_reduce_scatter")
ROUTED_EXPERT_GEMMS = ("experts_fc1", "experts_fc2")

# Forward collective -> its backward counterpart (None: no backward communication).
# "identity_ar" marks a column-parallel input without SP: nothing forward, all-reduce backward.
CONJUGATE: dict[str, str | None] = {
    "all_gather": "reduce_scatter",
    "reduce_scatter": "all_gather",
    "all_reduce": None,
    "identity_ar": "all_reduce",
    "all_to_all": "all_to_all",
    "ring_step": "ring_step",
}


# Kernels Megatron runs per microbatch outside the transformer layers, counted from its code (the
# host issue floor charges each a launch, profile host_launch_*_us). The 2021 Megatron-LM and
# Megatron-DeepSpeed functions are the same as megatron-core 0.16's where named.
# Vocab-parallel cross-entropy (tensor_parallel/cross_entropy.py _VocabParallelCrossEntropy;
# 2021: mpu/cross_entropy.py): forward float cast, max, sub_, lt, ge, or, clone, sub, masked_fill,
# arange, gather, clone, masked_fill, exp, sum, log, sub, div_ = 18 (its three all-reduces are
# collectives); backward arange, float, rsub, gather, sub, index_put, mul_, and the fp16 cast of
# the logits' gradient = 8.
MEGATRON_CROSS_ENTROPY_LAUNCHES = {"launches": 18, "bwd_launches": 8}
# Its bytes a logit (the [tokens, vocab/tp] passes; the per-token ones are negligible), from the same code.
MEGATRON_CROSS_ENTROPY_BYTES_PER_LOGIT = 38
MEGATRON_CROSS_ENTROPY_BWD_BYTES_PER_LOGIT = 14
# torch's eager F.cross_entropy over fp32-cast logits, bytes a logit forward and backward as
# measured kernel by kernel on an H200 (the op's comment in build_layer_ops).
TORCH_CROSS_ENTROPY_BYTES_PER_LOGIT = 22
TORCH_CROSS_ENTROPY_BWD_BYTES_PER_LOGIT = 26
# pretrain_gpt.py loss_func: loss_mask * losses, two sums, div; average_losses_across_data_parallel
# _group: clone, cat, div (its all-reduce is loss_dp_allreduce); fp16 loss scaling: mul = 8.
# Backward: the div's, the mul's, and the scaling's = 4 (the sums' backward is an expand).
MEGATRON_LOSS_FUNC_LAUNCHES = {"launches": 8, "bwd_launches": 4}


def megatron_embedding_launches(learned_positions: bool) -> dict[str, int]:
    """Megatron's Embedding.forward: word lookup, position lookup, add, dropout (4; 2 without
    learned positions). Backward of the lookup op: the dropout's; the tables' own backward is the
    weight gradient (``embedding_wgrad_op``)."""
    tables = 2 if learned_positions else 1
    return {"launches": 2 * tables, "bwd_launches": 1}


# PyTorch's dense embedding backward (aten/src/ATen/native/cuda/Embedding.cu
# embedding_dense_backward_cuda and EmbeddingBackwardKernel.cu embedding_backward_cuda_kernel, as
# recalled; the CPU wheel carries no CUDA source). Up to EMBEDDING_BACKWARD_FEATURE_KERNEL_MAX_INDICES
# indices (and no scale_grad_by_freq): zero a gradient the size of the table, then one
# embedding_backward_feature_kernel adds each token's row into it (2 kernels). Beyond: zero the
# table, sort the indices, count, segment offsets, fp32 partial sums of up to
# EMBEDDING_BACKWARD_ROWS_PER_PARTIAL rows of one index, sum and scatter into the table (6).
EMBEDDING_BACKWARD_FEATURE_KERNEL_MAX_INDICES = 3072
EMBEDDING_BACKWARD_ROWS_PER_PARTIAL = 10  # NROWS_PER_THREAD
EMBEDDING_BACKWARD_LAUNCHES_SMALL = 2
EMBEDDING_BACKWARD_LAUNCHES_SORTED = 6
# A partial sum is an fp32 row written and read back.
EMBEDDING_BACKWARD_PARTIAL_BYTES_PER_ELEM = 8


def embedding_backward(table_rows: float, hidden: int, tokens: int, distinct_rows: float,
                       dtype_bytes: int) -> tuple[float, int]:
    """(HBM bytes, kernels) of one table's dense embedding backward for ``tokens`` indices of
    which ``distinct_rows`` differ: the zeroed table (rows x h), each token's gradient row read,
    and on the sorted path fp32 partial sums (one per distinct row and EMBEDDING_BACKWARD_ROWS_PER_
    PARTIAL repeats) written, read and scattered into the table; the feature kernel instead
    reads and writes the table row of each token."""
    zero = table_rows * hidden * dtype_bytes
    if tokens <= EMBEDDING_BACKWARD_FEATURE_KERNEL_MAX_INDICES:
        return zero + tokens * hidden * 3 * dtype_bytes, EMBEDDING_BACKWARD_LAUNCHES_SMALL
    repeats = max(1.0, tokens / max(1.0, distinct_rows))
    partials = distinct_rows * math.ceil(repeats / EMBEDDING_BACKWARD_ROWS_PER_PARTIAL)
    nbytes = zero + tokens * hidden * dtype_bytes + partials * hidden * EMBEDDING_BACKWARD_PARTIAL_BYTES_PER_ELEM \
        + distinct_rows * hidden * dtype_bytes
    return nbytes, EMBEDDING_BACKWARD_LAUNCHES_SORTED


# Frameworks whose per-microbatch kernels outside the layers are counted from Megatron's code.
MEGATRON_FRAMEWORKS = ("megatron-2021", "megatron-deepspeed")


def embedding_wgrad_op(sc: Scenario, params: float) -> Op:
    """The embedding's weight gradient, a microbatch: PyTorch's dense backward of the word table
    (the rank's vocab/tp rows; every token is scattered, masked ones as zeros into row 0; the
    tokens taken as distinct) and of a learned position table (s rows, each position once a
    sequence). Every microbatch allocates and zeroes a gradient the size of the table, which
    AccumulateGrad then adds into .grad: at tp 1 the word table dominates."""
    m, p = sc.model, sc.parallelism
    s = sc.batch.seq_length // p.cp
    tokens = sc.batch.micro_batch_size * s
    dt = sc.dtype_bytes
    nbytes, launches = embedding_backward(m.vocab_size / p.tp, m.hidden_size, tokens, tokens, dt)
    tables = 1
    if m.learned_position_embeddings:
        pos_bytes, pos_launches = embedding_backward(m.max_position_embeddings, m.hidden_size, tokens, s, dt)
        nbytes, launches, tables = nbytes + pos_bytes, launches + pos_launches, 2
    # Launches: Megatron's are counted kernel by kernel (each table's backward and its
    # AccumulateGrad add); other frameworks one a microbatch (the add), as before.
    return Op("embedding_wgrad", "elementwise", "W", 0.0, 0.0, nbytes, params=params,
              launches=launches + tables if sc.framework in MEGATRON_FRAMEWORKS else 1)


def megatron_get_batch(micro_batch_size: int, seq_length: int) -> Op:
    """Megatron's get_batch, every microbatch: broadcast_data's size tensor to the GPU and back
    and its data to the GPU (3 copies), labels and tokens made contiguous (2), and
    get_ltor_masks_and_position_ids: ones, tril, loss-mask ones, arange, < 0.5 (5) = 10 launches.
    Bytes: the b x s x s fp32 mask written, read and written by tril, read and written as bool.
    No backward. Its two broadcasts over tp are left out (host only, size-1 groups at tp 1)."""
    mask = micro_batch_size * seq_length * seq_length
    return Op("get_batch", "elementwise", "F", 0.0, 0.0, mask * (4 + 8 + 5), launches=10, bwd_bytes=0.0)


def grad_accumulate_bytes_per_param(sc: Scenario, gemm_weight: bool = True) -> float:
    """HBM bytes per parameter of adding one microbatch's weight gradient into the main gradient
    when the framework does it in a separate pass (``parallelism.grad_accumulation_fusion``
    false): read the main gradient, read the fresh gradient (parameter dtype), write the
    main gradient. The main gradient is kept in the gradient-reduction dtype (fp16 for fp16 runs,
    fp32 otherwise: ``plan.grad_reduce_bytes``). Megatron-LM 2021 and megatron-core without the
    fusion: ``param.main_grad.add_(param.grad.data)`` in the DDP backward hook, every microbatch
    (megatron/core/distributed/distributed_data_parallel.py); PyTorch's AccumulateGrad does the
    same add into ``.grad``. 0 with the fusion (the wgrad GEMM accumulates in its epilogue) and
    under ZeRO-3 (gradients are reduce-scattered, not accumulated by this pass), except FSDP2's
    own passes under torchtitan (``fsdp2_grad_bytes_per_param``).
    ``gemm_weight`` False: a weight no GEMM produces the gradient of (an embedding table): the
    fusion cannot reach it, so megatron-core's backward hook still adds its fresh ``.grad`` into
    ``main_grad`` every microbatch (distributed_data_parallel.py _make_backward_post_hook)."""
    p = sc.parallelism
    if sc.framework == "torchtitan" and p.zero >= 3:
        return fsdp2_grad_bytes_per_param(sc)
    if (p.grad_accumulation_fusion and gemm_weight) or p.zero >= 3:
        return 0.0
    main = scenario_grad_bytes(sc)
    fresh = 4.0 if sc.dtype == "fp32" else 2.0  # fp8 runs keep bf16 parameters and gradients
    return 2.0 * main + fresh


# FSDP2's gradient passes on the compute stream, bytes per parameter of the unsharded gradient
# (torch 2.13 torch/distributed/fsdp/_fully_shard, torchtitan's MixedPrecisionPolicy(param_dtype=
# bf16, reduce_dtype=fp32)):
# - the reduce-scatter copy-in: foreach_reduce calls foreach_reduce_scatter_copy_in (torch.ops.fsdp
#   .chunk_cat into the reduce_dtype input buffer) on the current stream, before
#   reduce_scatter_stream.wait_stream(current_stream): reads the bf16 gradient (2), writes fp32 (4);
FSDP2_RS_COPY_IN_BYTES_PER_PARAM = 2.0 + 4.0
# - with gradient sync off (torch.distributed.pipelining stage.py backward_maybe_with_nosync sets
#   set_requires_gradient_sync(False) for every microbatch, perform_reduce_grad reduces after the
#   last), post_backward keeps the unsharded gradient in the reduce dtype: the first microbatch's
#   to_accumulated_grad_if_needed casts it (grad.to(fp32): read 2, write 4), every later one's
#   accumulate_unsharded_grad_if_needed adds into it (+=: read 4 and 2, write 4), and the copy-in
#   then reads the fp32 accumulation (4) and writes fp32 (4).
FSDP2_ACCUMULATE_CAST_BYTES_PER_PARAM = 2.0 + 4.0
FSDP2_ACCUMULATE_ADD_BYTES_PER_PARAM = 4.0 + 2.0 + 4.0
FSDP2_RS_COPY_IN_ACCUMULATED_BYTES_PER_PARAM = 4.0 + 4.0


def fsdp2_grad_bytes_per_param(sc: Scenario) -> float:
    """HBM bytes per parameter, per microbatch, FSDP2 (framework torchtitan, zero 3) spends on the
    compute stream between autograd's gradient and the reduce-scatter: the copy-in every backward
    where each backward reduces (no pipeline: torchtitan 0.1.0's gradient accumulation leaves
    sync on, train.py train_step), else the cast, the adds and one
    copy-in spread over the step's microbatches (the pipeline reduces once, after the stage's last
    backward). Spreading puts the last copy-in inside the backwards rather than before each
    reduce-scatter at the step's end (the plan's gradient reduction there): same bytes, an earlier place."""
    p = sc.parallelism
    shard, _ = scenario_optimizer_shards(sc)
    if shard <= 1:
        return 0.0  # torchtitan applies no FSDP to a one-rank data-parallel group (fsdp_enabled)
    nmb = max(1, sc.num_microbatches)
    if p.pp == 1:
        return FSDP2_RS_COPY_IN_BYTES_PER_PARAM
    return (FSDP2_ACCUMULATE_CAST_BYTES_PER_PARAM + (nmb - 1) * FSDP2_ACCUMULATE_ADD_BYTES_PER_PARAM
            + FSDP2_RS_COPY_IN_ACCUMULATED_BYTES_PER_PARAM) / nmb


def megatron_fused_softmax_available(micro_batch: int, heads_per_rank: int, s_q: int, s_k: int, dtype_bytes: int) -> bool:
    """Whether Megatron's fused scale-mask-softmax kernel takes classic (non-flash) attention's
    scores, as ``FusedScaleMaskSoftmax.is_kernel_available`` decides (megatron-core 0.5.0,
    PyPI wheel, core/fusions/fused_softmax.py; Megatron-LM and Megatron-DeepSpeed of 2021-22
    check the same with sk <= 2048): fp16/bf16 input, 16 < sk <= 4096, sq and sk multiples of 4,
    and attn_batches = b x heads a multiple of 4 (and of the kernel's batch_per_block, 4 for
    sk in (128, 4096]: 128 threads a block over 32-thread warps, one row a warp). Otherwise the
    scores go through ``forward_torch_softmax``."""
    attn_batches = micro_batch * heads_per_rank
    return (dtype_bytes == 2 and 16 < s_k <= 4096 and s_q % 4 == 0 and s_k % 4 == 0
            and attn_batches % 4 == 0)


# Megatron's unfused softmax (FusedScaleMaskSoftmax.forward_torch_softmax, megatron-core 0.5.0)
# with attention_softmax_in_fp32 (megatron-core's default; Megatron-LM and Megatron-DeepSpeed set
# it whenever apply_query_key_layer_scaling is on, their default). HBM bytes a score element:
#   forward  input.float() 2+4, * scale 4+4, masked_fill_ 4+4, softmax 4+4, .half() 4+2 = 36 B, 5 kernels
#   backward the same chain's gradients: to fp32 2+4, softmax_backward 4+4+4, masked_fill 4+4,
#            * scale 4+4, to half 4+2 = 40 B, 5 kernels
# (the boolean mask is broadcast over heads and left out). The fused kernel moves 2+2 forward
# and 2+2+2 backward.
UNFUSED_SOFTMAX_BYTES_PER_SCORE = (36.0, 40.0, 5, 5)
# Classic attention's softmax + dropout, HBM bytes a score element forward (backward: twice it),
# of which FUSED_SOFTMAX_BYTES_PER_SCORE (read 2, write 2) are the fused softmax's. The kernels'
# code moves less (docs/design-notes.md "vTrain, third pass": 8 B forward, the baddbmm's score
# write counted again here; Round 17: 22 B backward where the kernels move 11). Corrected,
# Megatron SC'21 goes from 2.3 to 5.7 % MAPE (round 21, with the layout copies and Megatron's
# cross-entropy bytes: 2.1 to 5.9 %, the 1.7B row -1.5 to -12.6 %): the over-count stands in for
# a cost the model lacks, most likely the fused kernel streaming below the elementwise rate at
# s = 2048 (64 elements a thread in registers; no fp16 measurement of it here). Kept as is; the
# excess has no source.
SOFTMAX_DROPOUT_BYTES_PER_SCORE = 11.0
FUSED_SOFTMAX_BYTES_PER_SCORE = 4.0


def sp_norm_grad_bytes(norm_params: float) -> float:
    """Bytes of a layer's norm-weight gradients all-reduced over tp under sequence parallelism:
    its two norms (attention's and the MLP's), fp32 main gradients (LayerOps.tp_norm_grad_bytes)."""
    return 2 * norm_params * 4.0


def tied_head_shares_embedding(sc: Scenario, schedule=None) -> bool:
    """Whether a tied LM head multiplies by the embedding's own matrix, so that its rank holds the
    matrix once (parameters, gradients, optimizer state, its DP gradient reduction), rather than a
    copy of it on another rank.

    The matrix is one tensor where one rank holds both the first and the last stage of the
    pipeline (``schedule.chain_ends_share_rank``): pp = 1, and V-shaped schedules (zbv,
    dualpipev), whose rank 0 holds stages 0 and 2 pp - 1. Megatron's LanguageModule shares the
    Parameter at pp = 1 (megatron-core 0.16.1 models/common/language_module/language_module.py
    setup_embeddings_and_output_layer: one module is both pre- and post-process) and otherwise
    keeps a copy on the last stage whose gradient finalize_model_grads all-reduces with the
    first stage's. For V placements no readable source settles it: megatron-core has no V
    placement, torchtitan 0.1.0 ties no model and deep-copies the model per stage
    (models/llama3/infra/pipeline.py _build_stage, which would leave rank 0 two Parameters nothing
    keeps equal), and DeepSeek's DualPipe is not on PyPI (not read). The plan all-reduces
    nothing there (no peer, plan._plan_rank), which keeps the two ends equal only if
    rank 0's two chunks share one Parameter, autograd summing both ends' gradients into it: the
    model counts it once, as at pp = 1. Without a schedule (the layer ops alone): pp = 1."""
    if not sc.model.tied_embeddings:
        return False
    if schedule is None:
        return sc.parallelism.pp == 1
    return schedule.chain_ends_share_rank


def build_layer_ops(sc: Scenario, tied_head_shared: bool | None = None) -> dict[str, LayerOps]:
    """Per layer kind (dense, moe, embedding, head) its ops on one rank. ``tied_head_shared``:
    whether a tied head uses the embedding's matrix on its rank (``tied_head_shares_embedding``;
    None: decided from pp alone, as without a schedule)."""
    if tied_head_shared is None:
        tied_head_shared = tied_head_shares_embedding(sc)
    tied_head_shared = tied_head_shared and sc.model.tied_embeddings
    if sc.implementation == "hf-eager":
        return build_hf_eager_layer_ops(sc, tied_head_shared)
    m, p = sc.model, sc.parallelism
    t, cp = p.tp, p.cp
    sp = p.sequence_parallel and t > 1
    b = sc.batch.micro_batch_size
    s_full = sc.batch.seq_length
    s = s_full // cp  # tokens of one sequence on this rank
    T = b * s  # tokens per microbatch on this rank (before the SP split)
    Tn = T // t if sp else T  # tokens seen by norms / residuals / dropout
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.kv_heads, m.dim_head
    dt = sc.dtype_bytes
    # Per-rank QKV columns: the interleaved [q.. k v] weight split over tp. With fewer KV heads
    # than tp ranks megatron-core (0.16.1 transformer/attention.py SelfAttention.get_query_key_value_tensors)
    # splits the same weight evenly, then all-gathers the QKV output over tp and slices out its
    # group's queries and the one K/V head (qkv_group_gather below).
    qkv_out = (a + 2 * g) * d // t
    attn_width = a * d // t
    act_bytes = T * h * dt  # one hidden-state tensor of the whole microbatch

    fp8 = sc.dtype == "fp8"
    recipe = sc.fp8.recipe
    nmb = max(1, sc.num_microbatches)

    gpt_bias = m.mlp == "gelu"  # GPT linears and LayerNorms carry biases; Llama's none
    acc_bpp = grad_accumulate_bytes_per_param(sc)
    if sc.framework == "megatron-deepspeed" and p.zero == 0:
        # DeepSpeed's FP16_Optimizer.step sets every p.grad = None (runtime/fp16/fused_optimizer.py),
        # so the step's first microbatch's AccumulateGrad takes the fresh gradient without an add:
        # nmb - 1 adds a step, spread evenly over the nmb microbatches.
        acc_bpp *= (nmb - 1) / nmb

    def gemm(name: str, tokens: int, k: int, n: int) -> Op:
        flops = 2.0 * tokens * k * n
        return Op(name, "gemm", "F", flops, flops, (tokens * k + k * n + tokens * n) * dt, params=k * n,
                  kernel=gemm_kernel("gemm", 1, tokens, n, k, dt, b_batched=False), bias=gpt_bias and name != "lm_head")

    def linear(name: str, tokens: int, k: int, n: int) -> list[Op]:
        """A linear layer: one GEMM, and under FP8 its quantization kernels first."""
        op = gemm(name, tokens, k, n)
        if not fp8:
            return [op]
        # FP8 operands are 1 byte, the output bf16.
        op = replace(op, fp8=True, bytes=float(tokens * k + k * n) + tokens * n * dt)
        act_f, act_b, w_f, w_b = fp8_cast_bytes_per_elem(recipe, nmb, sc)
        # torchao recasts the saved bf16 input for the weight-gradient GEMM in backward (T x k).
        in_b = fp8_input_recast_bytes_per_elem(recipe)
        cast = Op(f"{name}.fp8_cast", "elementwise", "F", 0.0, 0.0, tokens * k * act_f + k * n * w_f,
                  bwd_bytes=tokens * n * act_b + tokens * k * in_b + k * n * w_b)
        return [cast, op]

    def tp_in(name: str) -> list[Op]:
        """Entering a column-parallel block."""
        if t == 1:
            return []
        if sp:
            return [Op(name, "other", "F", comm=Comm("tp", "all_gather", act_bytes))]
        return [Op(name, "other", "F", comm=Comm("tp", "identity_ar", act_bytes))]

    def tp_out(name: str) -> list[Op]:
        """Leaving a row-parallel block."""
        if t == 1:
            return []
        return [Op(name, "other", "F", comm=Comm("tp", "reduce_scatter" if sp else "all_reduce", act_bytes))]

    norm_params = 2 * h if m.mlp == "gelu" else h  # LayerNorm (GPT) has a bias, RMSNorm (Llama) not

    def norm(name: str) -> Op:
        return Op(name, "norm", "F", 5.0 * Tn * h, 0.0, 2 * Tn * h * dt, params=norm_params, bias=gpt_bias)

    def residual(name: str) -> Op:
        return Op(name, "elementwise", "F", Tn * h, 0.0, 3 * Tn * h * dt)

    # --- attention block ---
    attn: list[Op] = [norm("attn_norm")]
    mla_duplicated_params = 0.0
    if m.is_mla:
        # Multi-head latent attention (DeepSeek-V2/V3), as megatron-core runs it (0.16.1
        # transformer/multi_latent_attention.py, models/gpt/gpt_layer_specs.py): the
        # down-projections are TELinear "duplicated" (replicated over tp) and read this rank's
        # hidden states, the sequence shard under SP; each latent passes its RMSNorm (DeepSeek's
        # q_a_layernorm, kv_a_layernorm: fused into the up-projection's LayerNormLinear with
        # qk_layernorm) and the column-parallel up-projection gathers the latent over the
        # sequence (or, without SP, all-reduces its gradient). The rotary key part is gathered
        # apart (gather_from_sequence_parallel_region(k_pos_emb)). Queries and keys carry a
        # rotary part of qk_rope_head_dim.
        dqk, dv = d + m.qk_rope_head_dim, m.v_dim
        latent_tokens = Tn if sp else T

        def latent_norm(name: str, width: int) -> Op:
            return Op(name, "norm", "F", 5.0 * latent_tokens * width, 0.0, 2 * latent_tokens * width * dt, params=width)

        def latent_in(name: str, width: int) -> list[Op]:
            """A latent entering its column-parallel up-projection (tp_in at the latent's width)."""
            if t == 1:
                return []
            return [Op(name, "other", "F", comm=Comm("tp", "all_gather" if sp else "identity_ar", T * width * dt))]

        if m.q_lora_rank:
            attn += linear("q_down_proj", latent_tokens, h, m.q_lora_rank)
            attn += [latent_norm("q_latent_norm", m.q_lora_rank), *latent_in("q_latent_in", m.q_lora_rank)]
            attn += linear("q_up_proj", T, m.q_lora_rank, a * dqk // t)
            mla_duplicated_params += h * m.q_lora_rank + m.q_lora_rank
        else:
            attn += [*tp_in("attn_in"), *linear("q_proj", T, h, a * dqk // t)]
        attn += linear("kv_down_proj", latent_tokens, h, m.kv_lora_rank + m.qk_rope_head_dim)
        if sp:
            attn.append(Op("k_rope_gather", "other", "F", comm=Comm("tp", "all_gather", T * m.qk_rope_head_dim * dt)))
        attn += [latent_norm("kv_latent_norm", m.kv_lora_rank), *latent_in("kv_latent_in", m.kv_lora_rank)]
        attn += linear("kv_up_proj", T, m.kv_lora_rank, a * (d + dv) // t)
        mla_duplicated_params += h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        attn_width = a * dv // t
        core_model = 2.0 * b * s * s_full * a * (dqk + dv) / t
    else:
        attn += [*tp_in("attn_in"), *linear("qkv_proj", T, h, qkv_out)]
        if g < t:
            attn.append(Op("qkv_group_gather", "other", "F", comm=Comm("tp", "all_gather", T * (a + 2 * g) * d * dt)))
        core_model = 4.0 * b * s * s_full * a * d / t  # QK^T and AV over the full key length
        if sc.framework == "torchtitan":
            attn += torchtitan_rope_repeat_kv_ops(T, max(a // t, 1), max(g // t, 1), d, dt, sc.torch_compile)
    # Causal load balancing (2*cp chunks, each rank a mirrored pair) gives every CP rank the
    # same attention work: 1/cp of the full causal attention.
    causal = 0.5 if sc.flash_attention else 1.0
    io_bytes = 4.0 * T * attn_width * dt
    heads = max(a // t, 1)
    qk_dim = d if not m.is_mla else dqk
    # K and V of this rank's tokens as the attention kernel takes them: KV heads (GQA) of head_dim,
    # MLA's per-head K (dqk) and V (dv).
    kv_local_bytes = (b * s * heads * (dqk + dv) if m.is_mla else 2 * b * s * max(g // t, 1) * d) * dt
    if cp > 1 and sc.framework == "torchtitan" and sc.flash_attention:
        attn += torch_cp_attention_ops(b, s, cp, heads, qk_dim, core_model, io_bytes, dt, fp8 and sc.fp8.attention,
                                       p.cp_load_balance, "alltoall" if sc.cp_attention == "ring" else "allgather")
    elif cp > 1 and sc.cp_attention == "ring":
        attn += te_cp_p2p_ops(b, s, cp, heads, qk_dim, core_model, io_bytes, kv_local_bytes, T * attn_width, dt,
                              sc.flash_attention, fp8 and sc.fp8.attention)
    else:
        if sc.flash_attention:
            kern = flash_kernel(b * heads, s, s_full, qk_dim, True, core_model * causal, io_bytes)
        else:
            # Materialised scores: QK^T and PV as batched GEMMs of equal work (b x heads each).
            kern = gemm_kernel("attention", 2 * b * heads, s, s_full, d, dt)
        # Classic attention launches two batched GEMMs (baddbmm QK^T, bmm PV); FlashAttention one.
        core = Op("attention", "attention", "F", core_model * causal, core_model, io_bytes, kernel=kern,
                  fp8=fp8 and sc.fp8.attention, launches=1 if sc.flash_attention else 2)
        if cp > 1:
            # Llama-3-style CP (Transformer Engine cp_comm_type "all_gather",
            # AttnFuncWithCPAndKVAllGather, TE 2.20.2 context_parallel.py): K and V of the whole
            # sequence gathered before attention, blocking (gather_along_first_dim, synchronous:
            # "KV all-gather between CP ranks is exposed"). torchtitan calls repeat_kv before SDPA,
            # so a torchtitan run without flash attention would gather K/V with every query head.
            cp_kv_heads = heads if sc.framework == "torchtitan" else max(g // t, 1)
            kv_bytes = cp * kv_local_bytes if sc.framework != "torchtitan" else 2 * b * s_full * cp_kv_heads * d * dt
            attn.append(Op("cp_kv_all_gather", "other", "F",
                           comm=Comm("cp", "all_gather", kv_bytes, overlap=sc.framework == "torchtitan")))
            if sc.framework != "torchtitan":
                # Backward gathers K and V again (AttnFuncWithCPAndKVAllGather.backward:
                # gather_along_first_dim of the saved local k, v, blocking) before the attention
                # gradients, then reduce-scatters dK and dV (reduce_scatter_along_first_dim: the
                # gather op's conjugate).
                core = replace(core, bwd_ops=(Op("cp_kv_all_gather.regather", "other", "I",
                                                 comm=Comm("cp", "all_gather", kv_bytes)),
                                              attention_backward_op(core)))
        attn.append(core)
    if not sc.flash_attention:
        # Materialised scores: baddbmm write, fused scale-mask-softmax read+write, dropout, bmm read.
        score_elems = b * (a / t) * s * s_full
        if megatron_fused_softmax_available(b, max(a // t, 1), s, s_full, dt):
            # Two launches: Megatron's fused scale-mask-softmax kernel, then the dropout kernel.
            attn.append(Op("softmax_dropout", "elementwise", "F", 5.0 * score_elems, 0.0,
                           SOFTMAX_DROPOUT_BYTES_PER_SCORE * score_elems, launches=2))
        else:
            # Megatron's torch fallback in fp32 instead of the fused kernel's 4 B an element.
            fwd_b, bwd_b, fwd_k, bwd_k = UNFUSED_SOFTMAX_BYTES_PER_SCORE
            attn.append(Op("softmax_dropout", "elementwise", "F", 5.0 * score_elems, 0.0,
                           (SOFTMAX_DROPOUT_BYTES_PER_SCORE - FUSED_SOFTMAX_BYTES_PER_SCORE + fwd_b) * score_elems,
                           launches=1 + fwd_k,
                           bwd_bytes=(2 * SOFTMAX_DROPOUT_BYTES_PER_SCORE - 2 * FUSED_SOFTMAX_BYTES_PER_SCORE + bwd_b)
                           * score_elems, bwd_launches=2 + bwd_k))
        if not m.is_mla:
            # Megatron's classic attention moves its tensors between layouts (megatron-core 0.16.1
            # transformer/dot_product_attention.py; Megatron-LM 2021 ParallelAttention the same):
            # the bmm leaves the context as [b, np, sq, hn] and `permute(2, 0, 1, 3).contiguous()`
            # copies it to [sq, b, np, hn] (read + write); in backward, the torch.split of the fused
            # QKV output into q, k, v (attention.py get_query_key_value_tensors; 2021
            # split_tensor_along_last_dim) cats their gradients into one tensor (read + write).
            attn.append(Op("attn_layout_copies", "elementwise", "F", 0.0, 0.0, 2 * T * attn_width * dt,
                           bwd_bytes=2 * T * qkv_out * dt, launches=1, bwd_launches=1))
    attn += linear("attn_out_proj", T, attn_width, h)
    attn += tp_out("attn_out")
    attn.append(residual("attn_residual"))

    # --- MLP block ---
    def dense_mlp(prefix: str, ffn: int, tokens: int) -> list[Op]:
        f = ffn // t
        if m.mlp == "swiglu":
            return [*linear(f"{prefix}fc1_gate_up", tokens, h, 2 * f),
                    Op(f"{prefix}swiglu", "elementwise", "F", 3.0 * tokens * f, 0.0, 3 * tokens * f * dt),
                    *linear(f"{prefix}fc2", tokens, f, h)]
        return [*linear(f"{prefix}fc1", tokens, h, f),
                Op(f"{prefix}gelu", "elementwise", "F", 8.0 * tokens * f, 0.0, 2 * tokens * f * dt),
                *linear(f"{prefix}fc2", tokens, f, h)]

    mlp = [norm("mlp_norm"), *tp_in("mlp_in"), *dense_mlp("", m.ffn_hidden_size, T), *tp_out("mlp_out"),
           residual("mlp_residual")]

    if sc.framework == "torchtitan" and not sc.torch_compile:
        attn = torchtitan_eager_extras(attn, Tn, h, dt, sc.torch_fuses_rms_norm)
        mlp = torchtitan_eager_extras(mlp, Tn, h, dt, sc.torch_fuses_rms_norm)
    if sp and fp8 and recipe == "tensorwise" and sc.framework == "torchtitan":
        act_f = fp8_cast_bytes_per_elem(recipe, nmb, sc)[0]
        attn, mlp = float8_tensorwise_tp(attn, T, Tn, h, act_f), float8_tensorwise_tp(mlp, T, Tn, h, act_f)
    elif sp and fp8 and recipe in TE_FP8_RECIPES:
        ub = p.tp_comm_overlap
        act_f = fp8_cast_bytes_per_elem(recipe, nmb, sc)[0]
        tr = sc.te_fp8_transposes
        attn, mlp = (te_fp8_sequence_parallel_comm(attn, T, Tn, h, recipe, act_f, ub, tr),
                     te_fp8_sequence_parallel_comm(mlp, T, Tn, h, recipe, act_f, ub, tr))
    elif fp8 and recipe in TE_FP8_RECIPES:
        act_f = fp8_cast_bytes_per_elem(recipe, nmb, sc)[0]
        tr = sc.te_fp8_transposes
        attn, mlp = te_fp8_norm_fused_casts(attn, recipe, act_f, tr), te_fp8_norm_fused_casts(mlp, recipe, act_f, tr)
    layers: dict[str, LayerOps] = {}
    dense = LayerOps("dense", attn + mlp, sp_regather=sp and sp_regathers_input(sc),
                     tp_norm_grad_bytes=sp_norm_grad_bytes(norm_params) if sp else 0.0, grad_accum_bytes_per_param=acc_bpp,
                     tp_duplicated_params=mla_duplicated_params if sp else 0.0)
    dense.params = sum(o.params for o in dense.forward)
    layers["dense"] = dense

    if m.is_moe:
        layers["moe"] = _moe_layer(sc, attn, norm, residual, dense_mlp, gemm, Tn, h, dt, tp_in, tp_out, T)
        layers["moe"].grad_accum_bytes_per_param = acc_bpp
        layers["moe"].tp_duplicated_params += dense.tp_duplicated_params  # its attention's (MLA)

    # --- embedding (first position) and LM head + loss (last position) ---
    V = m.vocab_size
    emb_bytes = Tn * h * dt * (2 if m.learned_position_embeddings else 1)
    megatron_path = sc.framework in MEGATRON_FRAMEWORKS
    emb = [Op("embedding_lookup", "elementwise", "F", 0.0, 0.0, emb_bytes + T * 8,
              **(megatron_embedding_launches(m.learned_position_embeddings) if megatron_path else {}))]
    if megatron_path:
        emb.insert(0, megatron_get_batch(b, s_full))
    if t > 1:
        # Vocab-parallel embedding: partial lookups are summed (reduce-scattered with SP).
        emb.append(Op("embedding_reduce", "other", "F", comm=Comm("tp", "reduce_scatter" if sp else "all_reduce", act_bytes)))
    emb_params = V * h / t + (m.max_position_embeddings * h if m.learned_position_embeddings else 0)
    emb_acc_bpp = acc_bpp if not p.grad_accumulation_fusion else grad_accumulate_bytes_per_param(sc, gemm_weight=False)
    layers["embedding"] = LayerOps("embedding", emb, emb_params, grad_accum_bytes_per_param=emb_acc_bpp)
    # The tables' gradient (and their parameters, for the DP gradient bucket) is the program's
    # embedding_wgrad_op, or hf-eager's own kernels.
    head_ops = [norm("final_norm"), *tp_in("head_in"), gemm("lm_head", T, h, V // t)]
    # Vocab-parallel cross-entropy over fp32 logits: max, exp-sum, loss, softmax grad.
    if megatron_path:
        # Megatron's own, byte for byte (megatron-core 0.16.1 tensor_parallel/cross_entropy.py;
        # 2021 mpu/cross_entropy.py runs the same in-place passes on `output.float()`):
        # forward float cast 2+4, max 4, sub_ 4+4, exp 4+4, sum 4, div_ 4+4 = 38 B a logit;
        # backward mul_ 4+4 and the cast of the gradient back to fp16 4+2 = 14.
        head_ops.append(Op("cross_entropy", "elementwise", "F", 6.0 * T * V / t, 0.0,
                           MEGATRON_CROSS_ENTROPY_BYTES_PER_LOGIT * T * (V / t),
                           bwd_bytes=MEGATRON_CROSS_ENTROPY_BWD_BYTES_PER_LOGIT * T * (V / t),
                           **MEGATRON_CROSS_ENTROPY_LAUNCHES))
    elif sc.framework == "torchtitan" and not sc.loss_compiled:
        # torchtitan's eager loss: torch F.cross_entropy over .float() logits (its
        # cross_entropy_loss), kernel by kernel as torch 2.11 ran it on an H200 (round 28,
        # tests/data/reference/h200/train-8b-layers, [16384, 128256] logits): forward the fp32
        # cast 2+4, cunn_SoftMaxForward 16 (three reads of each row: max, sum, output; one
        # write; its 7.9 ms are 0.89 of HBM at that count), nll_loss a gather; backward the
        # gradient's zero fill 4, nll_loss_backward a scatter, cunn_SoftMaxBackward 16 (the
        # gradient read for its sum, then with the output; one write), the cast back 4+2.
        # 22 + 26 B a logit, 3 + 4 kernels (the old estimate, 12 + 24, had no source).
        head_ops.append(Op("cross_entropy", "elementwise", "F", 6.0 * T * V / t, 0.0,
                           TORCH_CROSS_ENTROPY_BYTES_PER_LOGIT * T * (V / t),
                           bwd_bytes=TORCH_CROSS_ENTROPY_BWD_BYTES_PER_LOGIT * T * (V / t), launches=3, bwd_launches=4))
    else:
        # torchtitan's compiled loss (Inductor fuses the cast into the softmax's passes) and
        # megatron-core's (framework generic; its vocab-parallel cross-entropy or a fused one):
        # 3 fp32 passes forward, 2x backward, an estimate with no source (neither measured).
        head_ops.append(Op("cross_entropy", "elementwise", "F", 6.0 * T * V / t, 0.0, 3 * T * (V / t) * 4))
    if megatron_path:
        head_ops.append(Op("loss_func", "elementwise", "F", 0.0, 0.0, 3 * T * 4, **MEGATRON_LOSS_FUNC_LAUNCHES))
        if sc.parallelism.pp > 1:
            # The last stage loads the microbatch too (labels, loss mask): DeepSpeed's
            # _exec_load_micro_batch / Megatron's get_batch on first and last stage.
            head_ops.insert(0, megatron_get_batch(b, s_full))
    if t > 1:
        head_ops.append(Op("cross_entropy_allreduce", "other", "F", comm=Comm("tp", "all_reduce", 3 * T * 4)))
    if p.loss_all_reduce_per_microbatch and sc.dp * p.cp > 1:
        # Megatron's loss_func averages each microbatch's loss over dp x cp for logging (one fp32).
        head_ops.append(Op("loss_dp_allreduce", "other", "F", comm=Comm("dp", "all_reduce", 4.0)))
    head = LayerOps("head", head_ops, V * h / t + norm_params, grad_accum_bytes_per_param=acc_bpp)
    if sp:
        # The final norm's weight too sees only the shard, and is summed over tp as the layers'
        # norms are (megatron-core _allreduce_non_tensor_model_parallel_grads; torchtitan's
        # SequenceParallel norm, a replicated DTensor): one norm, fp32 main gradient.
        head.tp_norm_grad_bytes = norm_params * 4.0
    # torchtitan's output ColwiseParallel gathers the input as a DTensor op and autograd keeps the
    # gathered tensor; activation checkpointing never wraps the head (sp_regathers_input).
    head.sp_regather = sp and sc.framework != "torchtitan"
    tied_head = tied_head_shared
    if tied_head:
        # A tied LM head shares the embedding's matrix, but autograd still runs its weight
        # gradient: dW = G^T X, 2*T*h*V/tp FLOPs a microbatch, added into the shared matrix's
        # .grad (Megatron/DeepSpeed GPT: logits = F.linear(x, word_embeddings.weight)). Keep that
        # GEMM and count the matrix once, on the embedding (as the hf-eager path below does).
        lm_head = next(o for o in head.forward if o.name == "lm_head")
        head.forward = [replace(o, params=0.0) if o is lm_head else o for o in head.forward]
        head.params = norm_params
    if sc.framework == "torchtitan" and not sc.torch_compile:
        head.forward = torchtitan_eager_extras(head.forward, Tn, h, dt, sc.torch_fuses_rms_norm)
    layers["head"] = head
    if sc.framework == "torchtitan":
        for lk in layers.values():
            lk.forward = fsdp2_copy_out_ops(sc, lk) + lk.forward
    if tied_head:
        # Derived from the forward as the transforms above left it: taken before them, it lost
        # the backward of the eager RMSNorm's extra passes and of FSDP2's copy-out.
        untied = replace(head, forward=[lm_head if o.name == "lm_head" else o for o in head.forward])
        i_ops, w_ops = untied.backward()
        w_ops = [replace(o, params=0.0) if o.name.startswith("lm_head") else o for o in w_ops
                 # FSDP2 copies the shared matrix's gradient in once, on the embedding's unit.
                 if not (o.name == "lm_head.grad_accumulate" and sc.framework == "torchtitan")]
        head.explicit_backward = (i_ops, w_ops)
    return layers


# ---------------------------------------------------------------------------------------------
# torchtitan (framework: torchtitan). Read from torchtitan 0.1.0 (PyPI wheel),
# models/llama3/model/model.py, and PyTorch's eager kernels of the Dec 2024 / 2025 era.
# ---------------------------------------------------------------------------------------------

# RoPE, torchtitan apply_rotary_emb: xq.float() (read bf16, write fp32: 2 + 4 bytes an element),
# view_as_complex (a view), xq_ * freqs_cis (complex mul: read 4, write 4; freqs are s x d/2,
# negligible), view_as_real().flatten(3) (views), .type_as(xq) (read 4, write 2) = 20 bytes an
# element of q and of k, 3 kernels each. Autograd runs the conjugates: cast of the bf16 gradient
# to fp32, mul by conj(freqs), cast back = 20 bytes, 3 kernels each. torch.compile fuses the
# chain into one kernel over q and k: read bf16, write bf16 = 4 bytes an element, forward and
# backward alike.
TORCHTITAN_ROPE_EAGER_BYTES_PER_ELEM = 20.0
TORCHTITAN_ROPE_COMPILED_BYTES_PER_ELEM = 4.0


def torchtitan_rope_repeat_kv_ops(tokens: int, heads: int, kv_heads: int, head_dim: int, dt: int,
                                  compiled: bool) -> list[Op]:
    """torchtitan's Attention.forward between the projections and SDPA: RoPE on q and k, then
    repeat_kv (GQA) on k and v. Per rank: ``heads`` / ``kv_heads`` after TP sharding."""
    q_k_elems = float(tokens) * (heads + kv_heads) * head_dim
    if compiled:
        rope = Op("rope", "elementwise", "F", 3.0 * q_k_elems, 0.0, q_k_elems * TORCHTITAN_ROPE_COMPILED_BYTES_PER_ELEM,
                  bwd_bytes=q_k_elems * TORCHTITAN_ROPE_COMPILED_BYTES_PER_ELEM, launches=1, bwd_launches=1)
    else:
        rope = Op("rope", "elementwise", "F", 3.0 * q_k_elems, 0.0, q_k_elems * TORCHTITAN_ROPE_EAGER_BYTES_PER_ELEM,
                  bwd_bytes=q_k_elems * TORCHTITAN_ROPE_EAGER_BYTES_PER_ELEM, launches=6, bwd_launches=6)
    ops = [rope]
    n_rep = heads // kv_heads
    if n_rep > 1:
        # repeat_kv: unsqueeze.expand.reshape copies k and v out to every query head (read the
        # kv-head tensor, write n_rep x it). Backward: the reshape's gradient summed over n_rep
        # (read n_rep x, write 1 x). A copy either way, eager or compiled (SDPA needs the tensors).
        kv_elems = float(tokens) * kv_heads * head_dim
        per = 2 * kv_elems * (1 + n_rep) * dt
        ops.append(Op("repeat_kv", "elementwise", "F", 0.0, 0.0, per, bwd_bytes=per, launches=2, bwd_launches=2))
    return ops


# Eager nn.RMSNorm before torch 2.9 (2.5/2.6 at::rms_norm, composite; from 2.9 one fused kernel each
# way on CUDA, Scenario.torch_fuses_rms_norm): pow(x, 2) (read + write), mean over
# the last dim (read), add_(eps) and rsqrt (on the [T, 1] statistics), x.mul(rsqrt) (read +
# write), .mul(weight) (read + write) = 7 passes over the [T, h] activation in 6 kernels, where
# the fused norm op moves 2 passes in 1. Backward, from the autograd formulas of those ops
# (tools/autograd/derivatives.yaml: mul, rsqrt, mean, pow; recalled, not re-read here): weight
# mul -> input grad (2 passes) and weight grad mul + row sum (4); x.mul(rsqrt) -> input grad (2)
# and rsqrt grad mul + row sum (4); mean -> expand / h (1); pow -> x.pow(1), * 2, * grad (2 + 2
# + 3); the two input grads added (3) = 23 passes in 12 kernels, against the fused op's 4 in 3.
RMSNORM_EAGER_EXTRA = {"fwd_passes": 7 - 2, "bwd_passes": 23 - 4, "launches": 6 - 1, "bwd_launches": 12 - 3}
# Eager SwiGLU, torchtitan FeedForward: w2(F.silu(w1(x)) * w3(x)): silu (read + write the gate),
# then mul (read 2, write 1) = 5 passes over [T, ffn] in 2 kernels against the fused op's 3 in 1.
# Backward: mul -> grad * up (3), grad * silu (3); silu_backward (3) = 9 passes in 3 kernels
# against the fused op's 6 in 2.
SWIGLU_EAGER_EXTRA = {"fwd_passes": 5 - 3, "bwd_passes": 9 - 6, "launches": 1, "bwd_launches": 1}


def torchtitan_eager_extras(ops: list[Op], tokens: int, h: int, dt: int, fused_rms_norm: bool) -> list[Op]:
    """Without torch.compile: after each RMSNorm and SwiGLU op, the HBM passes and kernels eager
    PyTorch adds over the fused op (the fused op stays, with its parameters). ``fused_rms_norm``
    (torch >= 2.9, Scenario.torch_fuses_rms_norm): eager RMSNorm is torch's fused kernel, the
    norm op as it stands."""
    out: list[Op] = []
    for op in ops:
        out.append(op)
        if op.op_class == "norm":
            if fused_rms_norm:
                continue
            e, elem = RMSNORM_EAGER_EXTRA, float(tokens) * h
        elif op.name.endswith("swiglu"):
            e, elem = SWIGLU_EAGER_EXTRA, op.bytes / (3 * dt)  # the fused op moves 3 passes
        else:
            continue
        out.append(Op(op.name + ".eager", "elementwise", "F", 0.0, 0.0, e["fwd_passes"] * elem * dt,
                      bwd_bytes=e["bwd_passes"] * elem * dt, launches=e["launches"], bwd_launches=e["bwd_launches"]))
    return out


# torch's context-parallel SDPA (torch.distributed.tensor.experimental _attention.py,
# _templated_ring_attention / _SDPAMerger / _templated_ring_attention_backward; read from the
# torch 2.13 source installed here and the torch 2.6.0 wheel, which match; 2.5.1 wheel for the
# older form): one SDPA call per CP step, each block's output merged into an fp32 running output,
# in bytes per element of the local output E = tokens x heads x head_dim (K and V, repeated to
# every head, have as many). Forward: K and V made contiguous (torchtitan hands SDPA
# repeat_kv(...).transpose(1, 2) views: `key = key.contiguous()`, read and write each, 8); step 0
# casts the block to fp32 (6); each later step casts (6), then out - block_out (12),
# sigmoid(dlse) * that (8), out - that (12) = 38 over a full block; with load balancing, on the
# ranks whose step takes half the queries (i > rank, half of all later steps) 19 over the half plus
# _partial_update's cat over the whole (8) = 27; mean 32.5; the result cast to bf16 (6).
# Backward: K and V made contiguous again (8, the saved views); zeros_like for dq, dk, dv in fp32
# (12); step 0 adds the bf16 block gradients into them (3 x 10) and cats dk, dv for the rotation
# (16); later steps with load balancing 52 (i <= rank: half-chunk adds + cats for dk, dv 26, cat 16,
# dq add 10) or 49 (i > rank: dk, dv adds 20, cat 16, dq half add + cat 13), mean 50.5; without
# (torch 2.5: every block full) 46 like step 0; dq, dk, dv cast to bf16 (18). Every step but the
# last cats K and V (bf16, read and write: 8) for the rotation, forward and backward (torch.cat
# runs even where the all-gather rotater then ignores it). Eager bytes: under torch.compile the
# traced ring (functional collectives, _maybe_wait) would let inductor fuse these passes; not
# modelled.
TORCH_CP_KV_CONTIGUOUS_BYTES_PER_ELEM = 8.0


def torch_cp_sdpa_ops(batch_heads: int, s: int, cp: int, head_dim: int, core_model: float, io_bytes: float,
                      fp8: bool = False, load_balance: bool = True, name: str = "attention_step") -> list[Op]:
    """The SDPA kernels torch's context parallel launches on one rank. ``core_model``: QK^T and
    PV FLOPs of the rank's queries against the whole sequence, not masked.

    Load-balanced (torch 2.6.0 ``_cp_options.enable_load_balance = True``: each rank holds sequence
    chunks r and 2 cp - 1 - r of 2 cp): step 0, the local queries against the local keys, causal
    (s x s); step i >= 1 against rank (r - i)'s keys, not causal: i <= r, all local queries
    against the first half of the keys (s x s/2); i > r, the second half of the queries against
    all the keys (s/2 x s). Every step is half a full s x s block, so all ranks match; the shapes
    are rank cp // 2's. Transformer Engine's p2p ring runs the same sections (te_cp_p2p_ops).

    Not balanced (torch 2.5.1: contiguous shards, _is_causal_behavior SKIPs a block from a later
    rank): rank r runs step 0 causal and r full s x s blocks; the last rank runs cp - 1 of them
    and sets the pace (its peers wait at the next collective), so its kernels are modelled."""
    r = cp // 2
    ops = []
    for i in range(cp):
        if load_balance:
            s_q, s_k, causal = (s, s, True) if i == 0 else ((s, s // 2, False) if i <= r else (s // 2, s, False))
            flops = core_model / cp * 0.5
        else:
            s_q, s_k, causal = s, s, i == 0
            flops = core_model / cp * (0.5 if causal else 1.0)
        ops.append(Op(f"{name}{i}", "attention", "F", flops, core_model / cp, io_bytes / cp,
                      kernel=flash_kernel(batch_heads, s_q, s_k, head_dim, causal, flops, io_bytes / cp), fp8=fp8,
                      launches=1))
    return ops


def torch_cp_merge_op(out_elems: float, cp: int, load_balance: bool = True) -> Op:
    # Bytes an output element, read from torch's _attention.py (the comment above torch_cp_sdpa_ops):
    # forward 12 (step 0's fp32 cast 6, the final bf16 cast 6) + 8 (K, V contiguous); backward 12
    # (fp32 zeros for dq, dk, dv) + 46 (step 0's adds and cats) + 18 (the bf16 casts) + 8 (K, V
    # contiguous); a later step 32.5 forward / 50.5 backward load-balanced, 38 / 46 not; K/V cats 8
    # a later step.
    later_fwd, later_bwd = (32.5, 50.5) if load_balance else (38.0, 46.0)
    kv_cat = 8.0 * (cp - 1)
    contiguous = TORCH_CP_KV_CONTIGUOUS_BYTES_PER_ELEM
    fwd = float(out_elems) * (12.0 + contiguous + later_fwd * (cp - 1) + kv_cat)
    bwd = float(out_elems) * (12.0 + 46.0 + later_bwd * (cp - 1) + 18.0 + contiguous + kv_cat)
    # Launches: forward ~5 a later step (cast, sub, sigmoid, mul, sub; lse updates aside), the
    # K/V cat and the two contiguous copies; backward ~6 a step (adds, cats), the K/V cat and the
    # two copies; host cost only.
    return Op("cp_sdpa_merge", "elementwise", "F", 0.0, 0.0, fwd, bwd_bytes=bwd, launches=4 + 6 * (cp - 1),
              bwd_launches=6 * cp + 8 + (cp - 1))


def torch_cp_attention_ops(b: int, s: int, cp: int, heads: int, head_dim: int, core_model: float, io_bytes: float,
                           dt: int, fp8: bool, load_balance: bool, rotate: str) -> list[Op]:
    """torch's context-parallel SDPA on one rank (torchtitan: ``context_parallel`` patches
    F.scaled_dot_product_attention; torch 2.13 / 2.6.0 _templated_ring_attention and its
    backward), forward ops whose first carries the whole backward (Op.bwd_ops).

    K/V move with every query head (torchtitan's repeat_kv precedes SDPA): this rank's K and V
    are 2 E elements, E = b s heads head_dim, bf16.

    ``rotate`` "allgather" (torchtitan 0.1.0 config_manager.py context_parallel_rotate_method
    default; _AllGatherRotater): forward, one all_gather_single of cat(K, V), issued before step
    0's SDPA and waited by next_buffer at step 1 (a JOIN after step 0). Backward
    (_templated_ring_attention_backward): the kv_rotater (the same method) gathers K/V again,
    issued before step 0's backward and waited at step 1; the dK/dV rotater is _AllToAllRotater
    whatever the method (``dkv_rotater = _create_rotater(group, 2, method=ALL_TO_ALL)``):
    after every step's backward cat(dK, dV) in fp32 (convert_to_f32, 8 bytes an element pair) is
    permuted to the next rank (ft_c.permute_tensor, an all_to_all_single with one peer: a ring
    step), waited after the next step's backward; the last is waited at once (a JOIN).

    ``rotate`` "alltoall" (scenario cp_attention "ring"): K/V permuted to the next rank before
    every step but the last, waited at the next step (a JOIN before the last step); backward the
    K/V permute before step i + 1 and the dK/dV permute after step i leave together and are
    waited at step i + 2's start / after step i + 1: one ring step of their summed bytes after
    each step's backward."""
    E = b * s * heads * head_dim
    kv_bytes = 2.0 * E * dt  # cat(K, V) of this rank
    dkv_bytes = 2.0 * E * 4  # cat(dK, dV), fp32
    steps = torch_cp_sdpa_ops(b * heads, s, cp, head_dim, core_model, io_bytes, fp8, load_balance)
    bwd: list[Op] = []
    fwd: list[Op] = []
    if rotate == "allgather":
        bwd.append(Op("cp_kv_all_gather.regather", "other", "I", comm=Comm("cp", "all_gather", cp * kv_bytes, overlap=True)))
        for i, st in enumerate(steps):
            bwd += [attention_backward_op(st),
                    Op(f"cp_dkv_rotate{i}", "other", "I", comm=Comm("cp", "ring_step", dkv_bytes, overlap=True))]
        bwd.append(Op("cp_dkv_rotate.wait", "other", "I", comm=Comm("cp", JOIN, 0.0)))
        fwd = [Op("cp_kv_all_gather", "other", "F", comm=Comm("cp", "all_gather", cp * kv_bytes, overlap=True),
                  bwd_ops=tuple(bwd)),
               replace(steps[0], bwd_ops=()),
               Op("cp_kv_all_gather.wait", "other", "F", comm=Comm("cp", JOIN, 0.0))]
        fwd += [replace(st, bwd_ops=()) for st in steps[1:]]
    else:
        bwd.append(Op("cp_kv_rotate0.bwd", "other", "I", comm=Comm("cp", "ring_step", kv_bytes, overlap=True)))
        for i, st in enumerate(steps):
            size = dkv_bytes + (kv_bytes if i + 2 <= cp - 1 else 0.0)
            bwd += [attention_backward_op(st),
                    Op(f"cp_dkv_rotate{i}", "other", "I", comm=Comm("cp", "ring_step", size, overlap=True))]
        bwd.append(Op("cp_dkv_rotate.wait", "other", "I", comm=Comm("cp", JOIN, 0.0)))
        fwd += _kv_ring_forward(steps, kv_bytes, bwd, "cp_kv_rotate", "cp_kv_rotate.wait")
    return fwd + [torch_cp_merge_op(E, cp, load_balance)]


def _kv_ring_forward(steps: list[Op], kv_bytes: float, bwd: list[Op], name: str, wait_name: str) -> list[Op]:
    """A K/V ring's forward: before each attention step but the last, the next K/V block is sent
    on (``name``{i}, overlapped with the step), the last one waited (``wait_name``) before the last
    step; the first send carries the whole backward (Op.bwd_ops)."""
    cp = len(steps)
    fwd: list[Op] = []
    for i, st in enumerate(steps):
        if i < cp - 1:
            fwd.append(Op(f"{name}{i}", "other", "F", comm=Comm("cp", "ring_step", kv_bytes, overlap=True),
                          bwd_ops=tuple(bwd) if i == 0 else ()))
        fwd.append(replace(st, bwd_ops=()))
        if i == cp - 2:
            fwd.append(Op(wait_name, "other", "F", comm=Comm("cp", JOIN, 0.0)))
    return fwd


def te_cp_p2p_ops(b: int, s: int, cp: int, heads: int, head_dim: int, core_model: float, io_bytes: float,
                  kv_bytes: float, out_elems: float, dt: int, flash: bool, fp8: bool) -> list[Op]:
    """Transformer Engine's ring attention (cp_comm_type "p2p", megatron-core's default:
    extensions/transformer_engine.py TEDotProductAttention passes "p2p" when the config names
    none; TE 2.20.2 context_parallel.py AttnFuncWithCPAndKVP2P), forward ops whose first carries
    the whole backward (Op.bwd_ops). ``kv_bytes``: cat(K, V) of this rank (KV heads only: TE's
    kernels take GQA as is); ``out_elems``: the attention output's elements on this rank.

    Forward: step i sends its K/V buffer to the next rank and receives the next one
    (flash_attn_p2p_communicate: isend/irecv, or batch_isend_irecv at cp 2 before Blackwell) for
    i < cp - 1, waited at step i + 1's start; the sections are torch's load-balanced ones (step 0
    diagonal causal s x s, i <= rank lower-triangle s x s/2, i > rank upper-triangle s/2 x s).
    Backward (bf16, no FP8): step 0 sends K/V, steps 1 .. cp - 2 K/V and the dK/dV accumulated so
    far in one (2, K/V) buffer, step cp - 1 dK/dV alone, each issued before the step's
    attention backward and waited after it ("wait until dKV is received"): 2 (cp - 1) K/V
    sizes in all, each step's under its own kernel (a JOIN after the last). Without flash
    attention the blocks are timed by class, as before. The two streams TE alternates the forward
    steps on (to soften FlashAttention's wave quantization) are not modelled."""
    if flash:
        steps = torch_cp_sdpa_ops(b * heads, s, cp, head_dim, core_model, io_bytes, fp8, True, name="attention_block")
    else:
        steps = [Op(f"attention_block{i}", "attention", "F", core_model / cp, core_model / cp, io_bytes / cp)
                 for i in range(cp)]
    bwd: list[Op] = []
    for i, st in enumerate(steps):
        size = kv_bytes if i in (0, cp - 1) else 2 * kv_bytes
        bwd += [Op(f"cp_kv_ring_step{i}.bwd", "other", "I", comm=Comm("cp", "ring_step", size, overlap=True)),
                attention_backward_op(st)]
    bwd.append(Op("cp_kv_ring.wait.bwd", "other", "I", comm=Comm("cp", JOIN, 0.0)))
    return (_kv_ring_forward(steps, kv_bytes, bwd, "cp_kv_ring_step", "cp_kv_ring.wait")
            + [te_cp_merge_op(out_elems, kv_bytes / dt, cp, dt)])


def te_cp_merge_op(out_elems: float, kv_elems: float, cp: int, dt: int) -> Op:
    """The elementwise passes of Transformer Engine's p2p ring around its attention kernels
    (AttnFuncWithCPAndKVP2P, TE 2.20.2, bf16/fp16, causal, bshd/sbhd), in the input dtype
    (``dt`` bytes: read + write a copy 2 dt, read 2 + write 1 an add 3 dt; half of that over a
    half chunk). Forward: cat(K, V) into the first ring buffer (``kv_elems``, the K and V elements
    of this rank); step 0's output cloned as the accumulator; each later step's output folded in
    by flash_attn_fwd_incremental_out_correction (torch.compile'd by jit_fuser: read out and the
    step's output, write out), over the whole output for a lower-triangle step, over its second
    half (..._second_half_...) for an upper one. Backward: K/V copied into the ring buffer, then
    per step dq (copy or add, whole or half: the section branches after cp_p2p_bwd_flash_attn)
    and dK/dV folded into the received buffer alike. Per rank the sections differ; the bytes are
    the mean over the ranks (the logsumexp rows, b x heads x s fp32, are left out: 1/head_dim of
    these). ``out_elems``: local tokens x query heads x head dim."""
    def half_or_full(lower: bool) -> float:
        return 3.0 * dt if lower else 1.5 * dt

    fwd = bwd = 0.0
    for r in range(cp):
        fwd += out_elems * (2.0 * dt + sum(half_or_full(j <= r) for j in range(1, cp)))
        c = cp - r - 1  # steps i >= c are the rank's lower-triangle (and its last, diagonal) ones
        for i in range(cp):
            if i < c:
                dq = 1.0 * dt if i == 0 else 1.5 * dt  # second half: copy at step 0, add after
                dkv = 2.0 * dt if i == 0 else 3.0 * dt  # whole: copy at step 0, add after
            elif i == c:
                dq = 2.0 * dt if r == cp - 1 else 1.0 * dt + 1.5 * dt  # copy, or first half copied + second added
                dkv = 1.0 * dt if (i == 0 and r == cp - 1) else 1.5 * dt  # first half: copy or add
            else:
                dq = 3.0 * dt
                dkv = 1.5 * dt
            if i == cp - 1:
                dkv = 1.5 * dt + 1.0 * dt if r == 0 else 3.0 * dt  # diagonal: rank 0 adds one half, copies one
            bwd += out_elems * dq + kv_elems * dkv
    fwd = fwd / cp + 2.0 * dt * kv_elems
    bwd = bwd / cp + 2.0 * dt * kv_elems
    return Op("cp_ring_merge", "elementwise", "F", 0.0, 0.0, fwd, bwd_bytes=bwd, launches=2 + 2 * (cp - 1),
              bwd_launches=1 + 4 * cp)


def fsdp2_copy_out_ops(sc: Scenario, lo: LayerOps) -> list[Op]:
    """FSDP2's copy-out (torch.distributed.fsdp _fsdp_collectives.foreach_all_gather_copy_out:
    split_with_sizes_copy of the all-gather output into the unsharded parameters), which runs on
    the compute stream when the all-gather is waited for: read the gathered buffer, write the
    parameters, in the gather dtype (bf16; 1 byte for Float8 linears with FP8 all-gather). Once
    in forward and once more in backward where units reshard after forward (torchtitan without
    PP); where they do not (``fsdp_reshard_after_forward`` false: torchtitan under PP) a unit is
    gathered, and copied out, once a step, at its first forward (the plan's gathers): its bytes
    spread over the step's forwards, none in backward. The copy-in runs on the all-gather's
    copy-in stream and is not charged here; the reduce-scatter's copy-in (chunk_cat) runs on the
    compute stream and is charged per parameter (``fsdp2_grad_bytes_per_param``)."""
    p = sc.parallelism
    shard, _ = scenario_optimizer_shards(sc)
    if p.zero < 3 or shard <= 1:
        return []
    # The embedding's tables are the layer's parameters, not an op's (its lookup carries none):
    # gathered in bf16 like the other non-Float8 parameters.
    unowned = lo.params - sum(o.params for o in lo.forward)
    nbytes = fsdp_gather_bytes(sc, lo.forward) + max(0.0, unowned) * sc.dtype_bytes
    if nbytes <= 0:
        return []
    if not p.fsdp_reshard_after_forward:
        # Kept unsharded from the first microbatch's forward to the step's reduction (FSDP2
        # unshard() returns at once while the group is_unsharded; the pipeline turns
        # reshard_after_backward off until perform_reduce_grad).
        fwd = 2 * nbytes / max(1, sc.num_microbatches)
        return [Op("fsdp_copy_out", "elementwise", "F", 0.0, 0.0, fwd, bwd_bytes=0.0, launches=1, recompute=False)]
    return [Op("fsdp_copy_out", "elementwise", "F", 0.0, 0.0, 2 * nbytes, bwd_bytes=2 * nbytes, launches=1,
               bwd_launches=1, recompute=False)]


def fsdp_gather_bytes(sc: Scenario, ops: list[Op]) -> float:
    """Bytes FSDP2 all-gathers for the parameters these ops own: the gather dtype (bf16 param_dtype),
    and 1 byte for FP8 linears under the FP8 all-gather (torchao float8/fsdp_utils.py
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather hands FSDP only ``float8_tensor._data``;
    the scale travels as metadata, and with precompute_float8_dynamic_scale_for_fsdp it is the same
    on every rank). Embedding, norms and the LM head (not Float8Linear) stay bf16."""
    dt = sc.dtype_bytes
    fp8_gather = sc.dtype == "fp8" and sc.fp8.param_all_gather
    return float(sum(op.params * (1 if (fp8_gather and op.fp8) else dt) for op in ops if op.params > 0))


def _moe_layer(sc, attn, norm, residual, dense_mlp, gemm, Tn, h, dt, tp_in, tp_out, T) -> LayerOps:
    """Attention, then a router, all-to-all dispatch over ep, grouped expert GEMMs, combine."""
    m, p = sc.model, sc.parallelism
    ep = p.ep
    # Tokens routed from this rank: each token goes to top_k experts. Dispatch and combine move
    # tokens * top_k * hidden * dtype bytes; the share (ep-1)/ep leaves the rank.
    routed_tokens = Tn * m.top_k
    load = moe_load_factor(sc)
    # The busiest EP rank sets the pace: it receives `load` times the mean share of tokens.
    a2a_bytes = routed_tokens * h * dt * load
    experts_local = m.num_experts // ep
    # Expert tensor parallelism (etp = tp): each expert's ffn is split over the tp group, which
    # pools the tokens its ranks received (megatron-core 0.16.1 MoEAlltoAllTokenDispatcher:
    # all_to_all over ep, then gather_from_sequence_parallel_region over the expert tp group;
    # after the experts reduce_scatter_to_sequence_parallel_region, then the combine all_to_all).
    # The FLOPs a rank runs are the same as with whole experts; the GEMMs are etp x taller and
    # 1/etp as wide, and the weights 1/etp.
    etp = p.expert_tp  # 1 or tp (Scenario.check)
    # Executed FLOPs follow the busiest rank's load; model FLOPs (MFU) count the nominal k tokens.
    expert_tokens = routed_tokens * load * etp  # tokens this (busiest) rank's experts process
    model_tokens = routed_tokens * etp
    ffn = m.expert_ffn // etp  # each rank's share of an expert's inner width
    overlap = sc.moe.overlap_dispatch
    ops = [norm("mlp_norm")]
    ops.append(gemm("router", Tn, h, m.num_experts))
    ops.append(Op("moe_dispatch", "other", "F", comm=Comm("ep", "all_to_all", a2a_bytes, overlap=overlap)))
    if etp > 1:
        ops.append(Op("experts_etp_gather", "other", "F", comm=Comm("tp", "all_gather", expert_tokens * h * dt)))
    # The grouped GEMM by shape: one (tokens an expert) x n x k GEMM per local expert, the tokens
    # spread evenly over the rank's experts (TE GroupedLinear / torch._grouped_mm run a problem
    # per expert; kernel_model quantizes each one's tiles).
    per_expert = max(1, round(expert_tokens / experts_local))

    def grouped(n: int, k: int):
        return gemm_kernel("gemm", experts_local, per_expert, n, k, dt)
    fc1_n = (2 if m.mlp == "swiglu" else 1) * ffn
    ops.append(Op("experts_fc1", "gemm", "F", 2.0 * expert_tokens * h * fc1_n, 2.0 * model_tokens * h * fc1_n,
                  (expert_tokens * (h + fc1_n) + experts_local * h * fc1_n) * dt, params=experts_local * h * fc1_n,
                  kernel=grouped(fc1_n, h)))
    if m.mlp == "swiglu":
        ops.append(Op("experts_swiglu", "elementwise", "F", 3.0 * expert_tokens * ffn, 0.0, 3 * expert_tokens * ffn * dt))
    else:
        ops.append(Op("experts_gelu", "elementwise", "F", 8.0 * expert_tokens * ffn, 0.0, 2 * expert_tokens * ffn * dt))
    ops.append(Op("experts_fc2", "gemm", "F", 2.0 * expert_tokens * ffn * h, 2.0 * model_tokens * ffn * h,
                  (expert_tokens * (ffn + h) + experts_local * ffn * h) * dt, params=experts_local * ffn * h,
                  kernel=grouped(h, ffn)))
    if etp > 1:
        ops.append(Op("experts_etp_reduce_scatter", "other", "F", comm=Comm("tp", "reduce_scatter", expert_tokens * h * dt)))
    ops.append(Op("moe_combine", "other", "F", comm=Comm("ep", "all_to_all", a2a_bytes, overlap=overlap)))
    if sc.dtype == "fp8":
        # FP8 grouped expert GEMMs (Transformer Engine's grouped linear; DeepSeek-V3 trains its
        # experts in FP8): 1-byte operands, bf16 output, a cast of the routed tokens and weights.
        act_f, act_b, w_f, w_b = fp8_cast_bytes_per_elem(sc.fp8.recipe, max(1, sc.num_microbatches), sc)
        if sc.fp8.param_all_gather and p.zero >= 3 and sc.fp8.recipe == "rowwise":
            # The weights are cast on their shard before the all-gather: an expert's shard is the
            # expert group's, not the dense one fp8_cast_bytes_per_elem divided by.
            shard, expert_shard = scenario_optimizer_shards(sc)
            w_f *= shard / expert_shard
        quantized = []
        for op in ops:
            if op.name in ROUTED_EXPERT_GEMMS:
                n_out = (2 if m.mlp == "swiglu" else 1) * ffn if op.name == "experts_fc1" else h
                k_in = h if op.name == "experts_fc1" else ffn
                weights = experts_local * k_in * n_out
                quantized.append(Op(f"{op.name}.fp8_cast", "elementwise", "F", 0.0, 0.0,
                                    expert_tokens * k_in * act_f + weights * w_f,
                                    bwd_bytes=expert_tokens * n_out * act_b + weights * w_b))
                op = replace(op, fp8=True, bytes=float(expert_tokens * k_in + weights) + expert_tokens * n_out * dt)
            quantized.append(op)
        ops = quantized
    if m.num_shared_experts:
        # Shared experts: a dense MLP num_shared_experts x the expert width, tensor-parallel as the
        # dense MLP is (megatron-core 0.16.1 moe/shared_experts.py SharedExpertMLP(MLP) on the tp
        # group: under SP it gathers the layer's input and reduce-scatters its output; run after
        # the routed experts, without --moe-shared-expert-overlap).
        ops += [*tp_in("shared_in"), *dense_mlp("shared_", m.num_shared_experts * m.expert_ffn, T), *tp_out("shared_out")]
    ops.append(residual("mlp_residual"))
    if sc.framework == "torchtitan" and not sc.torch_compile:
        # The attention block came with its eager extras; the MoE block's ffn_norm is nn.RMSNorm and
        # its experts run F.silu(x @ w1) * (x @ w3) eagerly too (torchtitan 0.1.0
        # experiments/llama4/model/model.py TransformerBlock, moe.py GroupedExperts).
        ops = torchtitan_eager_extras(ops, Tn, h, dt, sc.torch_fuses_rms_norm)
    sp = p.sequence_parallel and p.tp > 1
    if sp and m.num_shared_experts and sc.dtype == "fp8" and sc.fp8.recipe in TE_FP8_RECIPES:
        # The shared experts' TE linears gather FP8 as the dense MLP's do.
        act_f = fp8_cast_bytes_per_elem(sc.fp8.recipe, max(1, sc.num_microbatches), sc)[0]
        ops = te_fp8_sequence_parallel_comm(ops, T, Tn, h, sc.fp8.recipe, act_f, p.tp_comm_overlap, sc.te_fp8_transposes)
    # Its attention block re-gathers as the dense layer's does (not under torchtitan's DTensor TP).
    layer = LayerOps("moe", attn + ops, sp_regather=sp and sp_regathers_input(sc),
                     tp_norm_grad_bytes=sp_norm_grad_bytes(2 * h if m.mlp == "gelu" else h) if sp else 0.0)
    layer.params = sum(o.params for o in layer.forward)
    if sp:
        # The router's weight is replicated over tp and, under SP, sees this rank's T/tp tokens:
        # megatron-core 0.16.1 moe/router.py marks it sequence_parallel, and finalize_model_grads
        # sums its fp32 gradient over tp once a step (LayerOps.tp_duplicated_params).
        layer.tp_duplicated_params = float(h * m.num_experts)
    return layer


def expert_shares(sc: Scenario) -> np.ndarray:
    """Fraction of routed tokens each expert receives (sums to 1)."""
    m, moe = sc.model, sc.moe
    E = m.num_experts
    if moe.routing == "uniform" or moe.skew == 0:
        return np.full(E, 1.0 / E)
    rng = np.random.default_rng(moe.seed)
    popularity = 1.0 / np.arange(1, E + 1) ** moe.skew
    shares = popularity[rng.permutation(E)]  # which expert is popular is random, seeded
    return shares / shares.sum()


def moe_load_factor(sc: Scenario) -> float:
    """Tokens the busiest EP rank processes, relative to the uniform share; with a capacity
    factor, experts drop what exceeds capacity x their uniform share."""
    m, ep = sc.model, sc.parallelism.ep
    shares = expert_shares(sc)
    cap = sc.moe.capacity_factor
    kept = shares if cap is None else np.minimum(shares, cap / m.num_experts)
    per_rank = kept.reshape(ep, -1).sum(axis=1)
    return float(per_rank.max() * ep)


def moe_dropped_fraction(sc: Scenario) -> float:
    cap = sc.moe.capacity_factor
    if cap is None or not sc.model.is_moe:
        return 0.0
    shares = expert_shares(sc)
    return float(np.maximum(shares - cap / sc.model.num_experts, 0.0).sum())


def total_parameters(sc: Scenario) -> float:
    """Parameters of the whole model (no sharding): embedding, every layer, LM head."""
    flat = sc.model_copy(update={"parallelism": sc.parallelism.model_copy(update={"tp": 1, "cp": 1, "ep": 1, "pp": 1})})
    kinds = build_layer_ops(flat)
    m = sc.model
    per_layer = [kinds["moe" if m.is_moe and L >= m.num_dense_layers else "dense"].params for L in range(m.num_layers)]
    # With pp=1 a tied LM head shares the embedding's matrix, so the head counts its norm only
    # (the model's parameters, whatever copy of the matrix a pipeline keeps).
    return kinds["embedding"].params + sum(per_layer) + kinds["head"].params


def active_parameters(sc: Scenario) -> float:
    """Parameters one token passes through: every dense parameter, and of each MoE layer's routed
    experts the top_k it is sent to (the usual "active" count: Mixtral 8x7B 12.9B of 46.7B)."""
    total = total_parameters(sc)
    m = sc.model
    if not m.is_moe:
        return total
    flat = sc.model_copy(update={"parallelism": sc.parallelism.model_copy(update={"tp": 1, "cp": 1, "ep": 1, "pp": 1})})
    routed = sum(o.params for o in build_layer_ops(flat)["moe"].forward if o.name in ROUTED_EXPERT_GEMMS)
    return total - (m.num_layers - m.num_dense_layers) * routed * (1 - m.top_k / m.num_experts)


def model_size_text(total: float, active: float) -> str:
    """'70.6B parameters', or '46.7B parameters, 12.9B active' for a mixture of experts."""
    return f"{total / 1e9:.1f}B parameters" + (f", {active / 1e9:.1f}B active" if active < total else "")


def sp_regathers_input(sc: Scenario) -> bool:
    """Whether a column-parallel GEMM's weight gradient gathers its sequence-parallel input again
    in backward. Megatron keeps only its 1/tp slice and re-gathers it
    (LinearWithGradAccumulationAndAsyncCommunication.backward). torchtitan's DTensor TP feeds the
    gathered tensor to F.linear, whose autograd saves it: nothing to gather again, unless
    activation checkpointing dropped it. Full AC reruns the forward's gather with the layer (in
    the recomputed ops already); torchtitan's per-op SAC saves mm, SDPA and reduce-scatter
    outputs, not the all-gather's (0.1.0 parallelize.py _save_list), so it is gathered again."""
    if sc.framework != "torchtitan":
        return True
    return sc.recompute == "selective-op"


def float8_tensorwise_tp(ops: list[Op], T: int, Tn: int, h: int, act_f: float) -> list[Op]:
    """torchao Float8 tensor parallelism, as torchtitan applies it with tensorwise float8
    (0.1.0 models/llama3/infra/parallelize.py apply_tp, enable_float8_tensorwise_tp; torchao
    0.12 float8/float8_tensor_parallel.py):
    - PrepareFloat8ModuleInput casts the attention / feed-forward input to e4m3 on its sequence
      shard (Tn tokens), then redistributes it: the sequence-parallel all-gather moves 1 byte an
      element, and the one cast serves every column-parallel linear of the block (fused here);
    - Float8RowwiseParallel reduce-scatters the bf16 output, and NoopFwToFloat8BwDynamic casts
      its gradient to e5m2 before the redistribute's backward: the backward all-gather of
      gradients moves 1 byte an element, the backward reduce-scatter of input gradients bf16.
    The cast moves before the gather (on the shard, ``act_f`` bytes an element less for the T - Tn
    tokens it no longer sees); everything else is the ops as built."""
    out: list[Op] = []
    i = 0
    while i < len(ops):
        op = ops[i]
        c = op.comm
        if c is not None and c.dim == "tp" and c.op == "all_gather" and i + 2 < len(ops) \
                and ops[i + 1].name.endswith(".fp8_cast") and ops[i + 2].op_class == "gemm":
            cast, g = ops[i + 1], ops[i + 2]
            k = g.kernel.k if g.kernel is not None else h
            out.append(replace(cast, bytes=cast.bytes - (T - Tn) * k * act_f))
            out.append(replace(op, comm=replace(c, size_bytes=float(T * h), bwd_size_bytes=c.size_bytes)))
            out.append(g)
            i += 3
            continue
        if c is not None and c.dim == "tp" and c.op == "reduce_scatter":
            out.append(replace(op, comm=replace(c, bwd_size_bytes=float(T * h))))
            i += 1
            continue
        out.append(op)
        i += 1
    return out


# Transformer Engine's FP8 recipes (the others are torchao's).
TE_FP8_RECIPES = ("te-delayed", "te-current", "mxfp8")
# Float8Tensor.update_usage(columnwise_usage=True): a transpose kernel reads the FP8 data (1 B)
# and writes its transpose (1 B) an element (TE 2.20.2 tensor/storage/float8_tensor_storage.py
# _create_transpose, tex.fp8_transpose). Hopper only: on compute capability 10.x
# (is_non_tn_fp8_gemm_supported, Scenario.te_fp8_transposes false) update_usage makes none and
# the GEMM reads the row-wise copy.
TE_FP8_TRANSPOSE_BYTES_PER_ELEM = 2.0


def te_fp8_norm_fed_cast_bytes_per_elem(recipe: str, transposes: bool = True) -> float:
    """HBM bytes an element Transformer Engine spends quantizing a norm-fed linear's input without
    sequence parallelism (TE 2.20.2 module/layernorm_linear.py: the norm kernel takes the input
    quantizer, row-wise and column-wise usage; csrc/extensions/normalization.cpp picks the kernel).
    - delayed scaling (Impl::FULLY_FUSED): the norm writes the row-wise FP8 data itself, and the
      column-wise copy is a transpose of it, read 1 and write 1 (TE's norm_fwd after the kernel,
      as recalled: the common library's normalization source is not in the wheel or the sdist): 2.
    - current scaling (FUSED_NORM_AMAX_FP8): the norm writes bf16 and the amax; the quantize reads 2
      and writes both 1-byte copies (cast-transpose): 4, where a separate amax pass would add 2.
    - MXFP8 (UNFUSED): the norm writes bf16, the quantize reads it and writes both copies with
      their block scales: as a separate cast (fp8_cast_bytes_per_elem).
    Without transposes (``transposes`` false: compute capability 10.x) per-tensor scaling writes
    the row-wise copy only: delayed 0, current 3."""
    if recipe == "te-delayed":
        return 2.0 if transposes else 0.0
    if recipe == "te-current":
        return 4.0 if transposes else 3.0
    if recipe == "mxfp8":
        return 4.0 + 2 * MXFP8_SCALE_BYTES_PER_ELEM
    raise ValueError(f"not a Transformer Engine FP8 recipe: {recipe!r}")


def te_fp8_norm_writes_fp8(norm: Op, out_elems: float) -> Op:
    """Delayed scaling's fused norm (Impl::FULLY_FUSED, te_fp8_norm_fed_cast_bytes_per_elem) writes
    its output as FP8, 1 byte an element where the norm op counts its dtype's 2; its backward
    (bf16 gradients and the bf16 input it saved) keeps the bytes derived from the bf16 norm."""
    return replace(norm, bytes=norm.bytes - out_elems, bwd_bytes=2 * norm.bytes)


def te_fp8_norm_fused_casts(ops: list[Op], recipe: str, act_f: float, transposes: bool = True) -> list[Op]:
    """Without SP, the casts of linears a norm feeds (through tp's forward identity) take
    ``te_fp8_norm_fed_cast_bytes_per_elem`` instead of a separate cast's ``act_f`` bytes an input
    element; the others (fc2, the attention output projection) are TE Linear's own cast."""
    out = list(ops)
    for i, cast in enumerate(ops):
        if not cast.name.endswith(".fp8_cast") or i + 1 >= len(ops) or ops[i + 1].kernel is None:
            continue
        j = i - 1
        while j >= 0 and ops[j].comm is not None and ops[j].comm.op == "identity_ar":
            j -= 1
        if j < 0 or ops[j].op_class != "norm":
            continue
        g = ops[i + 1].kernel
        tokens_k = g.m * g.k  # the GEMM's input, all the tokens the cast quantized
        out[i] = replace(cast, bytes=cast.bytes - tokens_k * (act_f - te_fp8_norm_fed_cast_bytes_per_elem(recipe, transposes)))
        if recipe == "te-delayed":
            out[j] = te_fp8_norm_writes_fp8(ops[j], tokens_k)
    return out


def te_fp8_sp_input_cast_bytes_per_elem(recipe: str, norm_fed: bool) -> float:
    """HBM bytes an element of the sequence shard that Transformer Engine spends quantizing a
    column-parallel input before its FP8 all-gather (TE 2.20.2, transformer_engine_torch sdist
    csrc/extensions/normalization.cpp ``layernorm_fwd`` / ``rmsnorm_fwd`` and
    module/layernorm_linear.py, linear.py forward). The all-gather takes only the row-wise copy
    for per-tensor scaling (``supports_only_rowwise_all_gather``), so the cast writes one 1-byte
    copy; MXFP8 writes both copies with their block scales (the column-wise one is saved and
    re-gathered for the weight gradient).
    - delayed scaling, after a norm: the norm kernel writes FP8 itself (Impl::FULLY_FUSED): 0.
      (The norm's own output write is 1 byte, not 2: ``te_fp8_norm_writes_fp8``.)
    - current scaling, after a norm: the norm writes bf16 and its amax (FUSED_NORM_AMAX_FP8), then
      quantize_with_amax reads 2 and writes 1: 3.
    - MXFP8 (UNFUSED, without NVTE_NORM_FWD_USE_CUDNN): bf16 read 2, two 1-byte copies, a scale
      byte per 32 elements each: 4 + 2/32.
    - without a norm before it (linear.py): delayed reads 2 and writes 1 with the amax fused (3);
      current reads 2 for the amax first (5); MXFP8 as above."""
    if recipe == "mxfp8":
        return 4.0 + 2 * MXFP8_SCALE_BYTES_PER_ELEM
    if recipe == "te-delayed":
        return 0.0 if norm_fed else 3.0
    if recipe == "te-current":
        return 3.0 if norm_fed else 5.0
    raise ValueError(f"not a Transformer Engine FP8 recipe: {recipe!r}")
# MXFP8 carries an E8M0 scale byte for every 32 elements (OCP MX spec v1.0) beside the FP8 data.
MXFP8_SCALE_BYTES_PER_ELEM = 1.0 / 32


def te_fp8_sequence_parallel_comm(ops: list[Op], T: int, Tn: int, h: int, recipe: str, act_f: float,
                                  userbuffers: bool = False, transposes: bool = True) -> list[Op]:
    """Transformer Engine under FP8 with sequence parallelism (2.20.2 PyPI wheel,
    module/layernorm_linear.py and linear.py forward and backward, module/base.py
    grad_output_preprocess): a linear quantizes its input on the sequence shard and all-gathers
    the FP8 data, so the column-parallel input's all-gather moves 1 byte an element forward (and
    so does its backward re-gather, LayerOps._input_gather), and the row-parallel output's
    gradient is quantized before its backward all-gather (1 byte). Reduce-scatters (the
    row-parallel output forward, the column-parallel input gradient backward) stay bf16. MXFP8
    adds its scales. Only gathers that feed an FP8 linear, and reduce-scatters after one, change
    (not MLA's or GQA's QKV-output gather). The gathered input's quantization runs on the
    sequence shard (``te_fp8_sp_input_cast_bytes_per_elem``), and per-tensor scaling transposes
    the gathered copy for the weight gradient in backward (layernorm_linear.py backward
    ``ln_out_total.update_usage(columnwise_usage=True)``: read 1, write 1 of all T tokens) where
    MXFP8 re-gathers its column-wise copy instead.
    The output gradient feeds both the dgrad GEMM (row-wise) and the wgrad GEMM (column-wise):
    per-tensor FP8 gathers the row-wise data and transposes it after (distributed.py
    _all_gather_fp8), but MXFP8's column-wise data has its own block scales and is gathered too
    (_all_gather_mxfp8, linear.py backward set_usage(rowwise=True, columnwise=True)): two copies,
    except under userbuffers (``userbuffers``: tp_comm_overlap), which gather the row-wise one only.
    ``transposes`` false (compute capability 10.x): per-tensor scaling transposes nothing."""
    per_elem = 1.0 + (MXFP8_SCALE_BYTES_PER_ELEM if recipe == "mxfp8" else 0.0)
    grad_gather_bytes = T * h * per_elem * (2 if recipe == "mxfp8" and not userbuffers else 1)
    transpose_b = 0.0 if recipe == "mxfp8" or not transposes else TE_FP8_TRANSPOSE_BYTES_PER_ELEM
    out: list[Op] = []
    recast: dict[int, Op] = {}  # index of a gathered input's cast -> the cast on the shard
    for i, op in enumerate(ops):
        c = op.comm
        if i in recast:
            out.append(recast[i])
            continue
        if op.name in EXPERT_TP_COMM:
            out.append(op)  # the MoE dispatcher's bf16 tokens, not a TE linear's input
        elif c is not None and c.dim == "tp" and c.op == "all_gather" and i + 2 < len(ops) \
                and ops[i + 1].name.endswith(".fp8_cast") and ops[i + 2].kernel is not None:
            cast, k = ops[i + 1], ops[i + 2].kernel.k
            norm_fed = i > 0 and ops[i - 1].op_class == "norm"
            if norm_fed and recipe == "te-delayed" and out and out[-1] is ops[i - 1]:
                out[-1] = te_fp8_norm_writes_fp8(ops[i - 1], Tn * k)  # the norm on the shard writes FP8
            # The gathered input is the GEMM's: T x k (the hidden state, or an MLA latent).
            out.append(replace(op, comm=replace(c, size_bytes=T * k * per_elem, bwd_size_bytes=c.size_bytes)))
            # linear() built the cast over all T tokens the GEMM sees (act_f bytes an element,
            # beside its weight's): TE quantizes the Tn-token shard before the gather instead.
            shard_bytes = Tn * k * te_fp8_sp_input_cast_bytes_per_elem(recipe, norm_fed)
            recast[i + 1] = replace(cast, bytes=cast.bytes - T * k * act_f + shard_bytes,
                                    bwd_bytes=(cast.bwd_bytes or 0.0) + T * k * transpose_b)
        elif c is not None and c.dim == "tp" and c.op == "reduce_scatter" and i > 0 and ops[i - 1].fp8:
            out.append(replace(op, comm=replace(c, bwd_size_bytes=grad_gather_bytes)))
        else:
            out.append(op)
    return out


def fp8_cast_bytes_per_elem(recipe: str, num_microbatches: int, sc: Scenario) -> tuple[float, float, float, float]:
    """HBM bytes per element of FP8 quantization around one linear layer, per microbatch:
    (activation forward, output-gradient backward, weight forward, weight backward).

    A quantized activation is needed row-wise for the forward GEMM and column-wise (transposed)
    for the weight-gradient GEMM, since Hopper's FP8 GEMMs take only the TN layout: one fused
    cast-transpose reads bf16 (2 bytes) and writes two FP8 copies (1 + 1), 4 bytes an element
    (Transformer Engine's cast_transpose). Current (dynamic) scaling first needs the tensor's
    amax: one more bf16 read, 2 bytes (TE Float8CurrentScaling, torchao tensorwise). Delayed
    scaling takes the scale from the amax history and fuses the new amax into the cast. On
    compute capability 10.x (B200, GB200) TE's per-tensor recipes write the row-wise copy only,
    one byte less (Scenario.te_fp8_transposes); torchao's recipes lay out their own copies and
    are priced as on Hopper.
    MXFP8 computes a scale per 32-element block inside the cast (one E8M0 byte per block and
    layout: +2/32). torchao rowwise scales each row: an amax and a cast per layout (2+2+1 twice).
    Weights: TE casts them once per step and caches the FP8 copy across microbatches; torchao
    casts them in every forward (and their transpose in backward), or, with the FP8 all-gather, in
    FSDP2's copy-in (not charged here). torchao tensorwise is read from its source below.
    """
    if recipe in ("te-delayed", "te-current"):
        # Compute capability 10.x takes FP8 GEMMs in any layout: the cast writes one 1-byte copy.
        act = (4.0 if recipe == "te-delayed" else 6.0) - (0.0 if sc.te_fp8_transposes else 1.0)
        w_f, w_b = act / num_microbatches, 0.0
    elif recipe == "mxfp8":
        act = 4.0 + 2.0 / 32
        w_f, w_b = act / num_microbatches, 0.0
    elif recipe == "tensorwise":
        # torchao 0.11/0.12 float8/float8_linear.py matmul_with_hp_or_float8_args: forward casts
        # the input once, row-major, for the output GEMM (tensor_to_amax: torch.max(torch.abs(x)),
        # 2 B read; then x * scale, clamp, to e4m3: 2 B read, 1 B write) and saves the bf16 input;
        # the transposed copy for grad_weight is made in backward (fp8_input_recast_bytes_per_elem).
        # Backward casts grad_output twice with one config (grad_input and grad_weight), which
        # torch.compile's CSE makes one amax (2) and one cast (2 -> 1) plus the transposed layout
        # float8_ops.preprocess_addmm needs for go.t() (a second 1 B write): 6.
        act_f, act_b = 5.0, 6.0
        w_f, w_b = 5.0, 2.0  # amax + cast in forward; the FP8 weight transposed in backward (1 + 1)
        p = sc.parallelism
        if sc.fp8.param_all_gather and p.zero >= 3:
            # enable_fsdp_float8_all_gather: the weight arrives as Float8Tensor, so
            # Float8Linear.forward casts nothing (_cast_weight_to_float8_t returns weight.t()). The
            # cast runs in WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather (fp32 shard -> e4m3,
            # float8/fsdp_utils.py) inside FSDP2's all-gather copy-in, on the copy-in stream, which
            # is not charged to compute (fsdp2_copy_out_ops); with
            # precompute_float8_dynamic_scale_for_fsdp its scale comes from one _foreach_norm
            # after the optimizer step. The backward transpose (preprocess_addmm: weight row-major
            # -> b.t().contiguous().t()) stays.
            w_f = 0.0
        return act_f, act_b, w_f, w_b
    else:  # rowwise
        act = 10.0
        w_f, w_b = 5.0, 5.0
    p = sc.parallelism
    if sc.fp8.param_all_gather and p.zero >= 3 and recipe == "rowwise":
        # Cast on the shard before the all-gather (torchtitan precompute_float8_dynamic_scale_for_fsdp).
        w_f = w_f / scenario_optimizer_shards(sc)[0]
    return act, act, w_f, w_b


def fp8_input_recast_bytes_per_elem(recipe: str) -> float:
    """HBM bytes per input element a linear's backward spends re-quantizing its input for the
    weight-gradient GEMM. torchao (0.11/0.12 float8_linear.py matmul_with_hp_or_float8_args.backward)
    saves the bf16 input and calls hp_tensor_to_float8_dynamic on it again
    (cast_config_input_for_grad_weight): amax 2 B, cast 2 B read + 1 B write in the column-major
    layout float8_ops.preprocess_addmm asks of b (compiled: the transpose fuses into the cast; eager
    adds a 1 + 1 copy): 5. Transformer Engine keeps the forward's transposed FP8 copy instead (0);
    the rowwise figure (10) already counts both layouts in forward."""
    return 5.0 if recipe == "tensorwise" else 0.0


def fp8_recompute_cast_op(cast: Op, gemm: Op, sc: Scenario, gemm_recomputed: bool) -> Op | None:
    """What torchtitan's per-op SAC reruns in backward of a torchao tensorwise ``.fp8_cast`` op
    (None: nothing). The input's FP8 copy feeds only its forward GEMM, so under torch.compile
    (the partitioner recomputes only what backward reads) it is re-quantized only when that GEMM
    is recomputed; the amax is not re-read, since torchtitan's _save_list holds aten.max.default
    (tensor_to_amax's torch.max) and SAC saves it: 2 B read + 1 B write an element. Without the
    FP8 all-gather the FP8 weight (cast in Float8Linear.forward, inside the checkpointed block)
    is saved for the grad_input GEMM but tagged PREFER_RECOMPUTE: re-cast, 3 B a parameter,
    whether or not the GEMM reruns."""
    kern = gemm.kernel
    if kern is None:
        return cast
    p = sc.parallelism
    weight_cast = 0.0 if (sc.fp8.param_all_gather and p.zero >= 3) else 3.0 * kern.k * kern.n
    # The tokens the forward cast quantized, from its own bytes: float8_tensorwise_tp casts a
    # column-parallel input on its sequence shard (T / tp tokens) before the all-gather, where
    # the GEMM's M is all T (taking M re-cast tp x the shard).
    act_f, _, w_f, _ = fp8_cast_bytes_per_elem(sc.fp8.recipe, max(1, sc.num_microbatches), sc)
    cast_tokens = (cast.bytes - kern.k * kern.n * w_f) / (kern.k * act_f)
    input_cast = 3.0 * cast_tokens * kern.k if gemm_recomputed else 0.0
    if weight_cast + input_cast <= 0:
        return None
    return replace(cast, name=f"{cast.name}.rec", bytes=float(input_cast + weight_cast), bwd_bytes=0.0)


# ---------------------------------------------------------------------------------------------
# HuggingFace eager PyTorch: every op of the model's forward is its own kernel (or several), and
# autograd runs each op's backward kernels (simulator.workload.kernels). This is what NeuSight's
# per-operator tables measure, row for row.
# ---------------------------------------------------------------------------------------------

def _hf_ops(records: list[tuple], dt: int) -> tuple[list[Op], list[Op], list[Op], float]:
    """records: (name, op_type, op_class, in_shapes, out_shape, has_bias) or ("comm", Comm).
    Returns forward ops, input-grad ops, weight-grad ops (both in backward order) and params."""
    fwd: list[Op] = []
    bwd_i: list[Op] = []
    bwd_w: list[Op] = []
    params = 0.0
    for rec in records:
        if rec[0] == "comm":
            fwd.append(Op(rec[1].dim + "_" + rec[1].op, "other", "F", comm=rec[1]))
            continue
        name, op_type, cls, ins, out, bias = rec[:6]
        fk, bk = op_kernels(op_type, cls, ins, out, dt, has_bias=bias,
                            table_rows=rec[6] if len(rec) > 6 else 0)
        for j, k in enumerate(fk):
            fwd.append(Op(f"{name}" + (f".{j}" if j else ""), cls, "F", k.flops, k.flops if k.kind == "gemm" else 0.0,
                          k.bytes, kernel=k))
        ib, wb = [], []
        for j, k in enumerate(bk):
            if k.param_numel > 0:
                params += k.param_numel
                wb.append(Op(f"{name}.wgrad{j}", cls, "W", k.flops, k.flops if k.kind == "gemm" else 0.0, k.bytes,
                             params=k.param_numel, kernel=k))
            else:
                ib.append(Op(f"{name}.bwd{j}", cls, "I", k.flops, k.flops if k.kind == "gemm" else 0.0, k.bytes, kernel=k))
        bwd_i.append(ib)
        bwd_w.append(wb)
    # Backward runs in reverse op order; collectives turn into their conjugates.
    i_ops: list[Op] = []
    w_ops: list[Op] = []
    k = len(bwd_i)
    for rec in reversed(records):
        if rec[0] == "comm":
            conj = CONJUGATE.get(rec[1].op)
            if conj is not None:
                i_ops.append(Op(rec[1].dim + "_" + conj + ".bwd", "other", "I", comm=replace(rec[1], op=conj)))
            continue
        k -= 1
        i_ops += bwd_i[k]
        w_ops += bwd_w[k]
    return fwd, i_ops, w_ops, params


def build_hf_eager_layer_ops(sc: Scenario, tied_head_shared: bool = False) -> dict[str, LayerOps]:
    """Layers of an HF GPT-2 (GPT-2/GPT-3 shapes) or OPT model as eager PyTorch runs them.

    Tensor parallelism splits heads and MLP columns as Megatron does (all-reduce after the
    row-parallel projections, and of the input gradient before the column-parallel ones); norms,
    dropout and residuals run on every token of every TP rank.
    """
    from simulator.errors import UserError

    m, p = sc.model, sc.parallelism
    arch = m.hf_model_type or "gpt2"
    if arch not in ("gpt2", "opt"):
        raise UserError(f"implementation hf-eager models HF gpt2 and opt layers, not {arch!r}: use implementation megatron")
    if p.cp > 1 or m.is_moe or m.is_mla:
        raise UserError("implementation hf-eager has no context parallelism, MoE or MLA: use implementation megatron")
    t = p.tp
    b, s = sc.batch.micro_batch_size, sc.batch.seq_length
    h, a, d = m.hidden_size, m.num_attention_heads // t, m.dim_head
    f = m.ffn_hidden_size // t
    V = m.vocab_size
    T = b * s
    dt = sc.dtype_bytes
    act = T * h * dt
    x = [b, s, h]
    scores = [b, a, s, s]
    drop = m.attention_dropout > 0
    tp_in = [("comm", Comm("tp", "identity_ar", act))] if t > 1 else []
    tp_out = [("comm", Comm("tp", "all_reduce", act))] if t > 1 else []
    if arch == "gpt2":
        attn = [("ln_1", "LayerNorm", "norm", [x], x, True), *tp_in,
                ("c_attn", "addmm", "gemm", [[3 * a * d], [T, h], [h, 3 * a * d]], [T, 3 * a * d], True),
                ("q_k", "matmul", "attention", [[b, a, s, d], [b, a, d, s]], scores, False),
                ("scale", "truediv", "attention", [scores, [1]], scores, False),
                ("causal_mask", "where", "attention", [[1, 1, s, s], scores, [1]], scores, False),
                ("softmax", "softmax", "attention", [scores], scores, False)]
        attn += [("attn_dropout", "Dropout", "attention", [scores], scores, False)] if drop else []
        attn += [("p_v", "matmul", "attention", [scores, [b, a, s, d]], [b, a, s, d], False),
                 ("merge_heads", "contiguous", "elementwise", [[b, s, a, d]], [b, s, a, d], False),
                 ("attn_c_proj", "addmm", "gemm", [[h], [T, a * d], [a * d, h]], [T, h], True), *tp_out,
                 ("resid_dropout", "Dropout", "elementwise", [x], x, False),
                 ("attn_residual", "add", "elementwise", [x, x], x, False)]
        y = [b, s, f]
        # gelu_new, as HF writes it: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))), op by op.
        mlp = [("ln_2", "LayerNorm", "norm", [x], x, True), *tp_in,
               ("c_fc", "addmm", "gemm", [[f], [T, h], [h, f]], [T, f], True),
               ("gelu_half", "mul", "elementwise", [y, [1]], y, False), ("gelu_pow", "pow", "elementwise", [y, [1]], y, False),
               ("gelu_cube_scale", "mul", "elementwise", [y, [1]], y, False), ("gelu_add", "add", "elementwise", [y, y], y, False),
               ("gelu_scale", "mul", "elementwise", [y, [1]], y, False), ("gelu_tanh", "tanh", "elementwise", [y], y, False),
               ("gelu_one", "add", "elementwise", [y, [1]], y, False), ("gelu_mul", "mul", "elementwise", [y, y], y, False),
               ("mlp_c_proj", "addmm", "gemm", [[h], [T, f], [f, h]], [T, h], True), *tp_out,
               ("mlp_dropout", "Dropout", "elementwise", [x], x, False), ("mlp_residual", "add", "elementwise", [x, x], x, False)]
        emb = [("wte", "Embedding", "embedding", [[b, s]], x, False, V),
               ("wpe", "Embedding", "embedding", [[1, s]], [1, s, h], False, s),
               ("pos_add", "add", "elementwise", [x, [1, s, h]], x, False),
               ("emb_dropout", "Dropout", "elementwise", [x], x, False)]
        head = [("ln_f", "LayerNorm", "norm", [x], x, True), *tp_in,
                ("lm_head", "Linear", "gemm", [x], [b, s, V // t], False)]
    else:
        flat = [b * a, s, s]
        attn = [("self_attn_layer_norm", "LayerNorm", "norm", [x], x, True), *tp_in,
                ("q_proj", "Linear", "gemm", [x], [b, s, a * d], True),
                ("q_scale", "mul", "elementwise", [[b, s, a * d], [1]], [b, s, a * d], False),
                ("k_proj", "Linear", "gemm", [x], [b, s, a * d], True),
                ("k_heads", "contiguous", "elementwise", [[b, a, s, d]], [b, a, s, d], False),
                ("v_proj", "Linear", "gemm", [x], [b, s, a * d], True),
                ("v_heads", "contiguous", "elementwise", [[b, a, s, d]], [b, a, s, d], False),
                ("q_heads", "contiguous", "elementwise", [[b, a, s, d]], [b, a, s, d], False),
                ("q_k", "bmm", "attention", [[b * a, s, d], [b * a, d, s]], flat, False),
                ("mask_add", "add", "attention", [scores, [b, 1, s, s]], scores, False),
                ("mask_max", "max", "attention", [scores, [1]], scores, False),
                ("softmax", "softmax", "attention", [flat], flat, False)]
        attn += [("attn_dropout", "dropout", "attention", [flat], flat, False)] if drop else []
        attn += [("p_v", "bmm", "attention", [flat, [b * a, s, d]], [b * a, s, d], False),
                 ("out_proj", "Linear", "gemm", [[b, s, a * d]], x, True), *tp_out,
                 ("resid_dropout", "dropout", "elementwise", [x], x, False),
                 ("attn_residual", "add", "elementwise", [x, x], x, False)]
        mlp = [("final_layer_norm", "LayerNorm", "norm", [[T, h]], [T, h], True), *tp_in,
               ("fc1", "Linear", "gemm", [[T, h]], [T, f], True),
               ("relu", "ReLU", "elementwise", [[T, f]], [T, f], False),
               ("fc2", "Linear", "gemm", [[T, f]], [T, h], True), *tp_out,
               ("mlp_dropout", "dropout", "elementwise", [[T, h]], [T, h], False),
               ("mlp_residual", "add", "elementwise", [[T, h], [T, h]], [T, h], False)]
        emb = [("embed_tokens", "Embedding", "embedding", [[b, s]], x, False, V),
               ("embed_positions", "embedding", "embedding", [[b, s], [m.max_position_embeddings + 2, h]], x, False),
               ("pos_add", "add", "elementwise", [x, x], x, False)]
        head = [("final_layer_norm", "LayerNorm", "norm", [x], x, True), *tp_in,
                ("lm_head", "Linear", "gemm", [x], [b, s, V // t], False)]

    layers: dict[str, LayerOps] = {}
    fwd, i_ops, w_ops, params = _hf_ops(attn + mlp, dt)
    layers["dense"] = LayerOps("dense", fwd, params, explicit_backward=(i_ops, w_ops))
    fwd, i_ops, w_ops, params = _hf_ops(emb, dt)
    # The token table is split over tp (vocab-parallel) as the LM head is.
    params = V * h / t + (params - V * h)
    layers["embedding"] = LayerOps("embedding", fwd, params, explicit_backward=(i_ops, w_ops))
    fwd, i_ops, w_ops, params = _hf_ops(head, dt)
    if tied_head_shared:
        # The tied LM head's weight gradient lands in the embedding's; count the matrix once.
        w_ops = [replace(o, params=0.0) if o.name.startswith("lm_head") else o for o in w_ops]
        params = sum(o.params for o in w_ops)
    layers["head"] = LayerOps("head", fwd, params, explicit_backward=(i_ops, w_ops))
    return layers


def op_durations_s(profile, ops: list[Op], sc: Scenario, fp8_speedup: float = 1.0) -> np.ndarray:
    """Kernel time of each op. hf-eager ops are always timed by shape; Megatron ops by shape when
    the profile carries a kernel model (fitted or sourced), else by the class curves.

    FP8 runs only the ops marked ``fp8`` (the linears; attention unless asked) on FP8 tensor cores;
    everything else keeps bf16. By shape, an FP8 GEMM is timed at the FP8 (or MXFP8) peak; by
    class curve, its FLOPs are divided by ``fp8_speedup`` so the curve's fixed per-kernel cost stays.
    """
    from simulator.workload.kernel_model import fa2_kernel_model, kernels_time_s

    shape_aware = sc.implementation == "hf-eager" or profile.compute.kernels is not None
    km = None
    if sc.attention_kernel == "fa2" and profile.compute.kernels is not None:
        base = profile.compute.kernels
        km = fa2_kernel_model(base)
    kern: list[Kernel | None] = []
    for o in ops:
        k = o.kernel if shape_aware else None
        if shape_aware and k is None and o.op_class in ("elementwise", "norm", "other", "optimizer") and o.bytes > 0:
            k = mem_kernel(o.op_class, o.bytes, o.exec_flops)
        kern.append(k)
    out = np.zeros(len(ops))
    with_k = np.array([k is not None for k in kern], dtype=bool)
    base_dtype = "bf16" if sc.dtype == "fp8" else sc.dtype
    fp8_dtype = "mxfp8" if sc.dtype == "fp8" and sc.fp8.recipe == "mxfp8" else "fp8"
    is_fp8 = np.array([bool(o.fp8) and sc.dtype == "fp8" for o in ops], dtype=bool)
    for sel, dtype in ((with_k & ~is_fp8, base_dtype), (with_k & is_fp8, fp8_dtype)):
        if sel.any():
            out[sel] = kernels_time_s(profile, [kern[i] for i in np.flatnonzero(sel)], dtype, km)
    if (~with_k).any():
        rest = [o for o, k in zip(ops, kern) if k is None]
        # FlashAttention-2 on a class-curve profile: its own attention curve where it has one.
        fa2_cls = sc.attention_kernel == "fa2" and "attention_fa2" in profile.compute.classes
        out[~with_k] = profile.compute_time_s(
            np.array([("attention_fa2" if fa2_cls and o.op_class == "attention" else o.op_class) for o in rest]),
            np.array([o.exec_flops / (fp8_speedup if (o.fp8 and sc.dtype == "fp8") else 1.0) for o in rest]),
            np.array([o.bytes for o in rest]))
    return out


def optimizer_time_s(profile, params: float, tensors: int, bytes_per_param: float, sc: Scenario) -> float:
    """One Adam step over this rank's params: multi-tensor launches by shape when the profile has
    a kernel model (each pays the launch floor), else the optimizer class curve over the bytes."""
    from simulator.workload.kernel_model import kernels_time_s

    if profile.compute.kernels is None and sc.implementation != "hf-eager":
        return float(profile.compute_time_s(np.array(["optimizer"]), np.array([0.0]), np.array([params * bytes_per_param]))[0])
    # The launches are equal (adam_kernel): one timed, times their count (a 405B rank's step has
    # hundreds; the sweep estimate prices one per point). torch's foreach AdamW runs each of its
    # passes as its own launches, each moving its share of the bytes.
    n = adam_launches(params, tensors)
    if n == 0:
        return 0.0
    passes = adam_passes(sc)
    one = adam_kernel(params, tensors, bytes_per_param / passes)
    return n * passes * float(kernels_time_s(profile, [one], sc.dtype)[0])
