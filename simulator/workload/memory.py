"""Memory per GPU and per pipeline rank: parameters, gradients, optimizer state, activations,
communication buffers.

Activations per layer follow Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), Sec. 4: for one microbatch of s tokens, b sequences, width h,

    no parallelism          s·b·h·(34 + 5·a·s/h)
    tensor parallel t       s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel     s·b·h·(34 + 5·a·s/h) / t
    + selective recompute   s·b·h·34 / t
    full recompute          2·s·b·h (the layer input only; / t with sequence parallelism)

The constant 34 is 11 (attention) + 19 (GELU MLP with 4h) + 4 (two LayerNorms); it is rebuilt
here from the model's own widths so GQA and SwiGLU models get their own value (for GPT-3 it is
exactly 34). FlashAttention stores no s x s scores, which removes the 5·a·s/h term, as
selective recomputation does. Each stage holds as many microbatches as its schedule keeps in
flight (1F1B: p on the first rank). An expert layer keeps each routed copy's MLP activations at
the expert's width (``layer_activation_sbh(moe=True)``). Beside them: the layer recomputation
re-materialises in backward, and under FSDP resharding after forward the gathered working set.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.scenario import MEGATRON_GRAD_BUCKET_PARAMS, Scenario
from simulator.schedules.analysis import peak_activations
from simulator.workload.plan import (optimizer_state_bytes_per_param, scenario_grad_bytes, scenario_optimizer_shards,
                                    torchtitan_state_bytes)
from simulator.workload.ops import build_layer_ops, sp_regathers_input
from simulator.workload.program import Program, checkpointed_layers, selective_op_saved_bytes

GIB = 1024**3
# cuBLAS / NCCL workspaces, CUDA context and allocator fragmentation held aside on every GPU.
# A round figure with no measured source (docs/design-notes.md "Memory" states it, no more).
RUNTIME_RESERVE_BYTES = 1.0 * GIB


def layer_activation_sbh(sc: Scenario, moe: bool = False) -> tuple[float, float]:
    """(per-layer constant c, scores coefficient k): activations = s·b·h·(c + k·a·s/h)
    before any tensor-parallel division; returns the parts as Korthikanti splits them.

    ``moe``: an expert layer. Every token's MLP activations are kept once per expert it is routed
    to (its permuted copy as fc1 input and the expert's fc1 / activation outputs, at the expert's
    own width), plus the shared experts' and the router's fp32 logits and probabilities; a
    dense-width MLP once per token under-counted Mixtral's top-2 by ~37% and ignored top_k."""
    m = sc.model
    h = m.hidden_size
    r = m.kv_heads / m.num_attention_heads * (m.dim_head * m.num_attention_heads / h)
    attn = 7 + 4 * r  # QKV input 2, Q 2, K 2r, V 2r, out-proj input 2, dropout mask 1
    per_f = 4 if m.mlp == "gelu" else 6  # fc1 / activation outputs per unit of inner width
    fp8 = sc.dtype == "fp8"
    if moe and m.is_moe:
        f = m.expert_ffn / h
        # Under expert tensor parallelism the grouped GEMMs keep the tp group's pooled tokens as
        # their input: etp x this rank's routed copies, at 1/etp of the inner width (so the width
        # terms, tokens x width, do not change).
        etp = sc.parallelism.expert_tp  # 1 or tp (Scenario.check)
        copies = m.top_k * etp + (1 if m.num_shared_experts else 0)  # routed copies, and the shared experts' input
        width = m.top_k * f + m.num_shared_experts * f  # inner width kept per token, over its experts
        mlp = 1 + 2 * copies + per_f * width + 2 * 4 * m.num_experts / h  # dropout mask; router fp32
        if fp8:
            # FP8 linears save their inputs as FP8 copies: each fc1 input and each fc2 input.
            mlp -= copies + width
    else:
        f = m.ffn_hidden_size / h
        mlp = 3 + per_f * f  # fc1 input 2, dropout mask 1, fc1 / act outputs
        if fp8:
            mlp -= 1 + f
    norms = 4  # the two norms' inputs, 2 each (Korthikanti et al. 2022, Sec. 4.1: 34 = 11 + 19 + 4)
    if fp8:
        # FP8 linears save their inputs for the weight gradient as FP8 copies (1 byte, not 2):
        # the QKV and out-projection inputs (1 each); the MLP's above.
        attn -= 2
    # Scores: QK^T softmax output 2, dropout mask 1, dropout output 2 (Korthikanti Sec. 4.1: 5as/h).
    return attn + mlp + norms, 5.0


def activation_bytes_per_layer(sc: Scenario, moe: bool = False) -> float:
    """Bytes one layer keeps for one microbatch on one GPU (``moe``: an expert layer)."""
    m, p = sc.model, sc.parallelism
    t = p.tp
    sp = p.sequence_parallel and t > 1
    s = sc.batch.seq_length / p.cp
    b = sc.batch.micro_batch_size
    h, a = m.hidden_size, m.num_attention_heads
    sbh = s * b * h
    if sc.recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if sc.recompute == "selective-layer":
        # Which layers keep only their input depends on where they sit (program.checkpointed_layers:
        # counted per pipeline rank); no one layer stands for them all.
        raise ValueError("recompute selective-layer: count per layer with stage_activation_bytes "
                         "(a checkpointed layer is recompute 'full', the others 'none')")
    if sc.recompute == "selective-op":
        # torchtitan's per-op SAC keeps only its save list's outputs and the block input.
        layer_ops = build_layer_ops(sc)
        ops = layer_ops.get("moe") if moe else None
        return selective_op_saved_bytes(sc, ops or layer_ops.get("dense") or layer_ops["moe"])
    c, k = layer_activation_sbh(sc, moe)
    scores = 0.0 if (sc.flash_attention or sc.recompute == "selective") else k * a * s / h
    if t == 1:
        return sbh * (c + scores)
    if sp:
        kept = sbh * (c + scores) / t
        if not sp_regathers_input(sc):
            # torchtitan's DTensor TP saves the column-parallel linears' gathered inputs whole
            # (autograd keeps F.linear's input; Megatron keeps its 1/tp slice and re-gathers it):
            # attention's and the MLP's, 1 byte each for FP8 linears as c counts them.
            kept += sbh * 2 * (1 if sc.dtype == "fp8" else 2) * (1 - 1 / t)
        return kept
    replicated = 10.0  # norm inputs, dropout masks, QKV and fc1 inputs (Korthikanti Sec. 4.2.1)
    if sc.dtype == "fp8":
        # The QKV and fc1 inputs are the replicated ones c counts at 1 byte each for FP8 linears:
        # their saving stays whole here, only the out-projection's and fc2's are divided by t.
        replicated -= 2
    return sbh * (replicated + (c - replicated) / t + scores / t)


def loss_bytes_per_logit(sc: Scenario) -> tuple[float, float]:
    """(bytes a logit the loss keeps from its forward to its backward, bytes a logit more it holds at
    its peak), on the rank that holds the head; logits per rank, vocab-sharded under tp.

    Megatron's vocab-parallel cross-entropy keeps its fp32 softmax and computes the gradient in
    place in it: (4, 0). torchtitan's loss is F.cross_entropy(pred.flatten(0, 1).float(), labels),
    under loss_parallel when tp > 1 (its default); measured with torch 2.13 (bench/loss_memory.py:
    live bytes over the bf16 logits, the peaks over forward and backward, the logits freed before
    backward unless the loss keeps them, as torchtitan's train step does):
      eager        keeps the fp32 log-softmax (4); backward peaks at 12 (incoming and input
                   gradients, fp32): (4, 8)
      compiled     keeps the bf16 logits themselves (2), writes their bf16 gradient (2): (2, 2)
      tp eager     keeps 4; backward peaks at 16: (4, 12)
      tp compiled  keeps an fp32 [tokens, vocab/tp] tensor (4; saved_tensors_hooks lists it, the
                   resident set shows it in some runs only); its forward holds 4 more beside it and
                   the logits (2): (4, 6)"""
    if sc.framework != "torchtitan":
        return 4.0, 0.0
    compiled = sc.loss_compiled
    if sc.parallelism.tp > 1:
        return (4.0, 6.0) if compiled else (4.0, 12.0)
    return (2.0, 2.0) if compiled else (4.0, 8.0)


def cp_attention_working_set_bytes(sc: Scenario) -> float:
    """Bytes torch's context-parallel SDPA holds while it runs a layer's attention backward, beside
    the layer's activations (framework torchtitan; 0 otherwise). Read from torch 2.13 / 2.6.0
    _attention.py _templated_ring_attention_backward, live together during step i >= 1's SDPA
    backward, in E = local tokens x heads x head_dim elements (K and V repeated to every head):
    the rotated K/V (bf16): the all-gather rotater's whole-sequence buffer, cp x 2 E, kept until the
    call returns, plus the step's cat(K, V) of 2 E; the all-to-all rotater the received block, the
    cat being sent and the one being received, 3 x 2 E; the fp32 dq accumulator (E); three fp32
    cat(dK, dV) buffers of 2 E: the received one the step adds into, the cat being sent and the
    permute's receive in flight; the step's bf16 dq, dk, dv (3 E). The forward's (the gathered K/V,
    the fp32 running output and block cast) is smaller. Transformer Engine's rings hold K/V blocks of
    this rank's size at KV heads only (not modelled: a few per cent of this at GQA)."""
    p, m = sc.parallelism, sc.model
    if sc.framework != "torchtitan" or p.cp <= 1 or not sc.flash_attention:
        return 0.0
    s = sc.batch.seq_length / p.cp
    E = sc.batch.micro_batch_size * s * max(m.num_attention_heads // p.tp, 1) * m.dim_head
    kv = 2.0 * E * sc.dtype_bytes
    rotating = (p.cp + 1) * kv if sc.cp_attention == "allgather" else 3 * kv
    return rotating + 4.0 * E + 3 * 2.0 * E * 4.0 + 3 * E * sc.dtype_bytes


@dataclass
class MemoryReport:
    per_rank_gib: list[dict[str, float]]  # per pipeline rank: breakdown and total
    peak_gib: float
    capacity_gib: float
    fits: bool
    in_flight: list[float]  # peak microbatches in flight per pipeline rank (per-stage weighted)


def stage_activation_bytes(sc: Scenario, prog: Program) -> list[float]:
    """Activation bytes one microbatch leaves on each stage until its input-gradient pass: its
    layers' share, the embedding output on the first position, what the loss keeps on the last."""
    p, m = sc.parallelism, sc.model
    t = p.tp
    sp = p.sequence_parallel and t > 1
    s = sc.batch.seq_length / p.cp
    b = sc.batch.micro_batch_size
    ckpt = checkpointed_layers(sc, prog.schedule, prog.position_layers)

    def layer_bytes(layer: int) -> float:
        moe = m.is_moe and layer >= m.num_dense_layers
        if sc.recompute == "selective-layer":
            # The layers the work recomputes (program.checkpointed_layers) keep their input only,
            # the others everything: counted per layer, since a stage's share is not half and
            # half (an odd count; blocks counted per rank, not by global layer id).
            kept = "full" if layer in ckpt else "none"
            return activation_bytes_per_layer(sc.model_copy(update={"recompute": kept}), moe)
        return activation_bytes_per_layer(sc, moe)

    position_bytes = []
    for pos, layers in enumerate(prog.position_layers):
        act = sum(layer_bytes(L) for L in layers)
        if pos == 0:
            act += 2 * s * b * m.hidden_size / (t if sp else 1)  # embedding output
        if pos == len(prog.position_layers) - 1:
            act += loss_bytes_per_logit(sc)[0] * s * b * m.vocab_size / t  # what the loss keeps for its backward
        position_bytes.append(act)
    sched = prog.schedule
    return [position_bytes[sched.stage_position[st]] for st in range(sched.num_stages)]


def memory_report(sc: Scenario, prog: Program, hbm_gib: float, usable_fraction: float) -> MemoryReport:
    p, m = sc.parallelism, sc.model
    sched = prog.schedule
    dp = sc.dp
    t = p.tp
    sp = p.sequence_parallel and t > 1
    s = sc.batch.seq_length / p.cp
    b = sc.batch.micro_batch_size
    by_stage = stage_activation_bytes(sc, prog)
    recomputed_layers = checkpointed_layers(sc, sched, prog.position_layers)
    act_peaks = peak_activations(sched, by_stage)
    # In-flight microbatches in units of the rank's whole model share.
    in_flight = peak_activations(sched, [1.0 / len(sched.stages_of_rank(sched.stage_rank[st])) for st in range(sched.num_stages)])

    # Mixed-precision Adam (bytes/param): bf16 weights 2, fp32 gradients 4, fp32 master 4 + m 4 + v 4,
    # each sharded from its ZeRO stage on: dense parameters over the DP group with its CP ranks
    # (or the HSDP shard group), expert parameters over the expert-data-parallel group (with its
    # tp ranks under sequence parallelism: edp_tp_of).
    # torchtitan (FSDP2, MixedPrecisionPolicy(param_dtype=bf16)) keeps no bf16 copy: its sharded
    # parameters are the fp32 masters (4) and its AdamW holds m and v (8); the bf16 weights exist
    # only gathered (gathered_parameters_gib, and one unit at a time otherwise).
    # With training_dtype bfloat16 all three are bf16 (plan.torchtitan_state_bytes).
    if sc.framework == "torchtitan":
        param_bytes, held_grad_bytes, optim_bytes = torchtitan_state_bytes(sc)
    else:
        param_bytes, held_grad_bytes, optim_bytes = 2, scenario_grad_bytes(sc), optimizer_state_bytes_per_param(sc)
    z = p.zero
    shard, expert_shard = scenario_optimizer_shards(sc)
    # The factor 2: no source found. Sized by the scenario's bucket where one is given, else by
    # the 40M-parameter bucket it was set with: megatron-core's dp-grown buckets are views of its
    # contiguous gradient buffer (counted under gradients), not allocations of their own.
    bucket_params = p.grad_bucket_params if p.grad_bucket_params is not None else MEGATRON_GRAD_BUCKET_PARAMS
    grad_buffer_bytes = scenario_grad_bytes(sc)
    buffers = 2 * bucket_params * grad_buffer_bytes
    # Recomputation re-materialises one layer at a time in backward: beside the checkpoints, the
    # layer being recomputed holds what it would have kept without recomputation (Chen et al.
    # 2016, "Training Deep Nets with Sublinear Memory Cost": memory = checkpoints + one segment).
    recompute_extra = {}
    if sc.recompute != "none":
        kept = sc.model_copy(update={"recompute": "none"})
        # selective-layer: the layer being recomputed is a checkpointed one, holding only its input.
        ckpt = sc.model_copy(update={"recompute": "full"}) if sc.recompute == "selective-layer" else sc
        for moe in ((False, True) if m.is_moe else (False,)):
            recompute_extra[moe] = max(0.0, activation_bytes_per_layer(kept, moe) - activation_bytes_per_layer(ckpt, moe))
    rows = []
    last_position = len(prog.position_layers) - 1
    for r in range(sched.num_ranks):
        positions = [sched.stage_position[st] for st in sched.stages_of_rank(r)]
        expert = sum(prog.stage_expert_params[q] for q in positions) if prog.stage_expert_params else 0.0
        dense = sum(prog.stage_params[q] for q in positions) - expert

        def state_bytes(per_param: float, from_stage: int) -> float:
            if z < from_stage:
                return per_param * (dense + expert)
            return per_param * (dense / shard + expert / expert_shard)

        # The gradient buffer holds the reduction's dtype (megatron-core: fp32 with
        # grad_reduce_in_fp32, else the parameter dtype); torchtitan's sharded .grad is its
        # parameter's dtype (FSDP2 casts the reduced shard back; its unsharded fp32 accumulation
        # across a pipeline's microbatches is the case below).
        grads = state_bytes(held_grad_bytes, 2)
        if z >= 2 and sched.num_microbatches > 1 and not prog.grad_reduce_every_microbatch:
            # The plan reduces gradients at a stage's last microbatch only, at every ZeRO stage
            # (Megatron's full main-grad buffer; torch.distributed.pipelining stage.py and the
            # capture harness turn FSDP2's set_requires_gradient_sync off until the last
            # backward), so until then each rank accumulates its whole stages' gradients
            # unsharded, in fp32 (FSDP2 _fsdp_param.py to_accumulated_grad_if_needed: the reduce
            # dtype). ZeRO-2/3 shard them only when each microbatch is reduced as it is produced,
            # which a one-microbatch step is, and torchtitan's gradient accumulation without PP
            # (Program.grad_reduce_every_microbatch: sync stays on, the fp32 shards accumulate).
            grads = grad_buffer_bytes * (dense + expert)
        row = {
            "parameters_gib": state_bytes(param_bytes, 3) / GIB,
            "gradients_gib": grads / GIB,
            "optimizer_gib": state_bytes(optim_bytes, 1) / GIB,
            "activations_gib": act_peaks[r] / GIB,
            # A bucket never holds more than the rank's own gradients (at the buffer's bytes each).
            "buffers_gib": (min(buffers, 2 * grad_buffer_bytes * (dense + expert)) + RUNTIME_RESERVE_BYTES) / GIB,
        }
        if recompute_extra:
            layers = [L for q in positions for L in prog.position_layers[q]]
            if sc.recompute == "selective-layer":
                # Only a checkpointed layer is recomputed: a rank that wraps one block wraps none
                # (torchtitan counts blocks per rank) and re-materialises nothing.
                layers = [L for L in layers if L in recomputed_layers]
            kinds = {m.is_moe and L >= m.num_dense_layers for L in layers}
            if kinds:
                row["recompute_working_set_gib"] = max(recompute_extra[k] for k in kinds) / GIB
        if z >= 3 and max(shard, expert_shard) > 1:
            # The FSDP units the rank holds (-1: the embedding, num_layers: the head), each gathered
            # whole (bf16; 1 byte for FP8 linears under the FP8 all-gather) beside its shard.
            last = len(prog.position_layers) - 1
            units = [L for q in positions for L in ([-1] if q == 0 else []) + list(prog.position_layers[q])
                     + ([m.num_layers] if q == last else [])]
            unit_bytes = {L: prog.unit_gather_bytes.get(L, prog.unit_params.get(L, 0.0) * prog.param_bytes) for L in units}
            if p.fsdp_reshard_after_forward:
                # Resharded after forward: the unit computing and the fsdp_prefetch units gathered
                # ahead of it are whole at once, the largest of them at the worst moment. torchtitan
                # also wraps the embedding, final norm and output head in the root module
                # (parallelize_llama apply_fsdp: fully_shard(model)), whose forward and backward
                # span the whole step, so those stay gathered throughout.
                root = [L for L in units if L in (-1, m.num_layers)] if sc.framework == "torchtitan" else []
                rest = sorted((b for L, b in unit_bytes.items() if L not in root), reverse=True)
                gathered = sum(unit_bytes[L] for L in root) + sum(rest[:1 + p.fsdp_prefetch])
            else:
                # Not resharded after forward: every unit the rank ran forward stays gathered until
                # its backward, so at the turn from forward to backward the rank holds all of them.
                gathered = sum(unit_bytes.values())
            # Whole, not (1 - 1/shard): FSDP2 all-gathers into a new full-size tensor that becomes
            # the unsharded parameter (torch 2.13 _fsdp_param.py init_all_gather_outputs: numel x
            # world_size; init_unsharded_param views it), while the sharded parameter stays
            # allocated beside it (fp32 under torchtitan's mixed precision), counted above.
            row["gathered_parameters_gib"] = gathered / GIB
        cp_attn = cp_attention_working_set_bytes(sc)
        if cp_attn > 0 and any(prog.position_layers[q] for q in positions):
            # torch's CP attention backward's buffers, while one layer's attention runs.
            row["cp_attention_working_set_gib"] = cp_attn / GIB
        if sc.framework == "torchtitan" and last_position in positions:
            # The loss's backward working set beside what it keeps (loss_bytes_per_logit),
            # vocab-sharded under loss parallelism.
            row["loss_working_set_gib"] = loss_bytes_per_logit(sc)[1] * s * b * m.vocab_size / t / GIB
        if sc.framework == "torchtitan" and z >= 3 and shard > 1:
            # FSDP2 has no gradient buckets (the reserve above is Megatron's). What it holds beside
            # the sharded .grad during a backward (torch 2.13 _fsdp_param_group.py post_backward,
            # _fsdp_collectives.py foreach_reduce): the unit in backward's bf16 gradients (2 B a
            # parameter, AccumulateGrad's .grad until its post_backward copies them in), where each
            # backward reduces (no pipeline) the previous unit's fp32 reduce-scatter input (4 B a
            # parameter, kept in reduce_scatter_states until this unit's post_backward_rs_wait),
            # and on the rank holding the head the root unit's head weight gradient in bf16, from
            # the head's backward (the first) to the root's post_backward (the last). Under a
            # pipeline the reduce-scatter inputs come after the last backward, the activations gone.
            # They come after the loss's backward: where the rank runs the loss its working set
            # (freed by then) and they are not held at once, and the larger of the two counts.
            blocks = [prog.unit_params.get(L, 0.0) for q in positions for L in prog.position_layers[q]]
            per_param = 2.0 + (4.0 if prog.grad_reduce_every_microbatch else 0.0)
            head = prog.unit_params.get(m.num_layers, 0.0) if last_position in positions else 0.0
            held = (per_param * max(blocks, default=0.0) + 2.0 * head) / GIB
            row["buffers_gib"] = RUNTIME_RESERVE_BYTES / GIB
            row["fsdp_grad_buffers_gib"] = max(0.0, held - row.get("loss_working_set_gib", 0.0))
        if sc.framework == "torchtitan" and p.pp > 1:
            # torch.distributed.pipelining allocates its receive buffers for every microbatch up
            # front (stage.py _setup_forward_recv_info, _setup_backward_recv_info, torch 2.13): a
            # stage other than the first holds one activation buffer per microbatch, one other
            # than the last one gradient buffer per microbatch, each a stage boundary's tensor.
            boundary = sc.dtype_bytes * s * b * m.hidden_size / (t if sp else 1)
            ends = sum((st != 0) + (st != sched.num_stages - 1) for st in sched.stages_of_rank(r))
            row["pp_recv_buffers_gib"] = ends * sched.num_microbatches * boundary / GIB
        if sc.dtype == "fp8" and sc.fp8.recipe in ("te-delayed", "te-current", "mxfp8"):
            # Transformer Engine caches each linear weight's FP8 copy and its transpose across
            # microbatches (2 bytes a parameter of the transformer layers), on the rank's shard
            # of them under ZeRO-3: the experts' over the expert group, the rest over dp. On
            # compute capability 10.x per-tensor scaling keeps no transpose (1 byte); MXFP8 keeps
            # its row-wise and column-wise copies everywhere.
            layer_params = sum(prog.unit_params.get(L, 0.0) for q in positions for L in prog.position_layers[q])
            layer_dense = layer_params - expert  # the experts are all in the transformer layers
            cached = layer_dense / shard + expert / expert_shard if z >= 3 else layer_params
            copies = 2 if sc.fp8.recipe == "mxfp8" or sc.te_fp8_transposes else 1
            row["fp8_weights_gib"] = copies * cached / GIB
        row["total_gib"] = sum(row.values())
        rows.append(row)
    peak = max(r["total_gib"] for r in rows)
    capacity = hbm_gib * usable_fraction
    return MemoryReport(rows, peak, capacity, peak <= capacity, in_flight)
