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

from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from simulator.scenario import Scenario

Phase = Literal["F", "I", "W"]


@dataclass(frozen=True)
class Comm:
    """A collective on the compute path (tp, cp or ep).

    Blocking by default. An ``overlap`` collective runs while the next compute segment does;
    the compute stream waits for it before it issues its next collective or ends the action
    (ring attention's K/V passing, overlapped MoE dispatch).
    """

    dim: str
    op: str
    size_bytes: float
    overlap: bool = False


@dataclass(frozen=True)
class Op:
    name: str
    op_class: str  # gemm | attention | elementwise | norm | optimizer | other
    phase: Phase
    exec_flops: float = 0.0
    model_flops: float = 0.0
    bytes: float = 0.0
    comm: Comm | None = None  # a collective instead of a kernel
    params: float = 0.0  # parameters whose gradient this op produces (W phase) or owns (F)
    fp8: bool = False  # a GEMM (or attention) on FP8 tensor cores: timed at the profile's FP8 peak
    bwd_bytes: float | None = None  # memory-bound op whose backward moves these bytes (not 2x forward)


@dataclass
class LayerOps:
    """Forward ops of one layer kind, and the rules to derive its backward."""

    kind: str  # "dense", "moe", "embedding", "head"
    forward: list[Op] = field(default_factory=list)
    params: float = 0.0  # parameters of this layer on one rank (after TP/EP sharding)

    def backward(self) -> tuple[list[Op], list[Op]]:
        """(input-grad ops, weight-grad ops) in execution order (reverse of forward)."""
        i_ops: list[Op] = []
        w_ops: list[Op] = []
        for op in reversed(self.forward):
            if op.comm is not None:
                conj = CONJUGATE.get(op.comm.op)
                if conj is not None:
                    i_ops.append(replace(op, name=op.name + ".bwd", phase="I", comm=replace(op.comm, op=conj)))
                continue
            if op.op_class == "gemm":
                i_ops.append(replace(op, name=op.name + ".dgrad", phase="I"))
                if op.params > 0:
                    w_ops.append(replace(op, name=op.name + ".wgrad", phase="W"))
            elif op.op_class == "attention":
                # dQ, dK, dV: twice the forward matmul work.
                i_ops.append(replace(op, name=op.name + ".bwd", phase="I", exec_flops=2 * op.exec_flops,
                                     model_flops=2 * op.model_flops, bytes=2 * op.bytes))
            elif op.bwd_bytes is not None:
                # FP8 casts: the backward quantizes the output gradient, with its own size.
                if op.bwd_bytes > 0:
                    i_ops.append(replace(op, name=op.name + ".bwd", phase="I", bytes=op.bwd_bytes, exec_flops=0.0,
                                         model_flops=0.0, params=0.0))
            else:
                i_ops.append(replace(op, name=op.name + ".bwd", phase="I", bytes=2 * op.bytes,
                                     exec_flops=2 * op.exec_flops, model_flops=0.0, params=0.0))
                if op.params > 0:
                    # Norm weights: their gradient is a by-product of the input-grad kernel;
                    # a zero-cost W entry carries it to the gradient reduction.
                    w_ops.append(replace(op, name=op.name + ".wgrad", phase="W", exec_flops=0.0, model_flops=0.0,
                                         bytes=0.0))
        return i_ops, w_ops


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


def build_layer_ops(sc: Scenario) -> dict[str, LayerOps]:
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
    qkv_out = (a + 2 * g) * d // t if g >= t else (a // t + 2) * d  # GQA: kv heads replicated when tp > kv heads
    attn_width = a * d // t
    act_bytes = T * h * dt  # one hidden-state tensor of the whole microbatch

    fp8 = sc.dtype == "fp8"
    recipe = sc.fp8.recipe
    nmb = max(1, sc.num_microbatches)

    def gemm(name: str, tokens: int, k: int, n: int) -> Op:
        flops = 2.0 * tokens * k * n
        return Op(name, "gemm", "F", flops, flops, (tokens * k + k * n + tokens * n) * dt, params=k * n)

    def linear(name: str, tokens: int, k: int, n: int) -> list[Op]:
        """A linear layer: one GEMM, and under FP8 its quantization kernels first."""
        op = gemm(name, tokens, k, n)
        if not fp8:
            return [op]
        # FP8 operands are 1 byte, the output bf16.
        op = replace(op, fp8=True, bytes=float(tokens * k + k * n) + tokens * n * dt)
        act_f, act_b, w_f, w_b = fp8_cast_bytes_per_elem(recipe, nmb, sc)
        cast = Op(f"{name}.fp8_cast", "elementwise", "F", 0.0, 0.0, tokens * k * act_f + k * n * w_f,
                  bwd_bytes=tokens * n * act_b + k * n * w_b)
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
        return Op(name, "norm", "F", 5.0 * Tn * h, 0.0, 2 * Tn * h * dt, params=norm_params)

    def residual(name: str) -> Op:
        return Op(name, "elementwise", "F", Tn * h, 0.0, 3 * Tn * h * dt)

    # --- attention block ---
    attn: list[Op] = [norm("attn_norm"), *tp_in("attn_in")]
    if m.is_mla:
        # Multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value paths. The
        # down-projections are small and replicated across TP; the up-projections are
        # column-parallel by heads. Queries and keys carry a rotary part of qk_rope_head_dim.
        dqk, dv = d + m.qk_rope_head_dim, m.v_dim
        if m.q_lora_rank:
            attn += linear("q_down_proj", T, h, m.q_lora_rank)
            attn += linear("q_up_proj", T, m.q_lora_rank, a * dqk // t)
        else:
            attn += linear("q_proj", T, h, a * dqk // t)
        attn += linear("kv_down_proj", T, h, m.kv_lora_rank + m.qk_rope_head_dim)
        attn += linear("kv_up_proj", T, m.kv_lora_rank, a * (d + dv) // t)
        attn_width = a * dv // t
        core_model = 2.0 * b * s * s_full * a * (dqk + dv) / t
    else:
        attn += linear("qkv_proj", T, h, qkv_out)
        core_model = 4.0 * b * s * s_full * a * d / t  # QK^T and AV over the full key length
    # Causal load balancing (2*cp chunks, each rank a mirrored pair) gives every CP rank the
    # same attention work: 1/cp of the full causal attention.
    causal = 0.5 if sc.flash_attention else 1.0
    io_bytes = 4.0 * T * attn_width * dt
    if cp > 1 and p.cp_attention == "ring":
        # Ring attention: cp steps; K/V blocks travel around the ring while a block computes.
        kv_block_bytes = 2 * b * s * max(g // t, 1) * d * dt
        for i in range(cp):
            if i < cp - 1:
                attn.append(Op(f"cp_kv_ring_step{i}", "other", "F", comm=Comm("cp", "ring_step", kv_block_bytes, overlap=True)))
            attn.append(Op(f"attention_block{i}", "attention", "F", core_model * causal / cp, core_model / cp, io_bytes / cp))
    else:
        if cp > 1:
            # Llama-3-style CP: all-gather K and V of the whole sequence before attention.
            kv_bytes = 2 * b * s_full * max(g // t, 1) * d * dt
            attn.append(Op("cp_kv_all_gather", "other", "F", comm=Comm("cp", "all_gather", kv_bytes)))
        attn.append(Op("attention", "attention", "F", core_model * causal, core_model, io_bytes,
                       fp8=fp8 and sc.fp8.attention))
    if not sc.flash_attention:
        # Materialised scores: baddbmm write, fused scale-mask-softmax read+write, dropout, bmm read.
        score_elems = b * (a / t) * s * s_full
        attn.append(Op("softmax_dropout", "elementwise", "F", 5.0 * score_elems, 0.0, 11.0 * score_elems))
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

    layers: dict[str, LayerOps] = {}
    dense = LayerOps("dense", attn + mlp)
    dense.params = sum(o.params for o in dense.forward)
    layers["dense"] = dense

    if m.is_moe:
        layers["moe"] = _moe_layer(sc, attn, norm, residual, dense_mlp, gemm, Tn, h, dt)

    # --- embedding (first position) and LM head + loss (last position) ---
    V = m.vocab_size
    emb_bytes = Tn * h * dt * (2 if m.learned_position_embeddings else 1)
    emb = [Op("embedding_lookup", "elementwise", "F", 0.0, 0.0, emb_bytes + T * 8)]
    if t > 1:
        # Vocab-parallel embedding: partial lookups are summed (reduce-scattered with SP).
        emb.append(Op("embedding_reduce", "other", "F", comm=Comm("tp", "reduce_scatter" if sp else "all_reduce", act_bytes)))
    emb_params = V * h / t + (m.max_position_embeddings * h if m.learned_position_embeddings else 0)
    layers["embedding"] = LayerOps("embedding", emb, emb_params)
    # The embedding table's gradient is a scatter-add; give the lookup's backward the table's
    # parameters so the DP gradient bucket sees them.
    head_ops = [norm("final_norm"), *tp_in("head_in"), gemm("lm_head", T, h, V // t)]
    # Vocab-parallel cross-entropy over fp32 logits: max, exp-sum, loss, softmax grad.
    head_ops.append(Op("cross_entropy", "elementwise", "F", 6.0 * T * V / t, 0.0, 3 * T * (V / t) * 4))
    if t > 1:
        head_ops.append(Op("cross_entropy_allreduce", "other", "F", comm=Comm("tp", "all_reduce", 3 * T * 4)))
    if p.loss_all_reduce_per_microbatch and sc.dp > 1:
        # Megatron's loss_func averages each microbatch's loss over dp for logging (one fp32).
        head_ops.append(Op("loss_dp_allreduce", "other", "F", comm=Comm("dp", "all_reduce", 4.0)))
    head_params = 0.0 if m.tied_embeddings and sc.parallelism.pp == 1 else V * h / t
    head = LayerOps("head", head_ops, head_params + norm_params)
    if head_params == 0.0:
        head.forward = [replace(o, params=0.0) if o.name == "lm_head" else o for o in head.forward]
    layers["head"] = head
    return layers


def _moe_layer(sc, attn, norm, residual, dense_mlp, gemm, Tn, h, dt) -> LayerOps:
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
    # Executed FLOPs follow the busiest rank's load; model FLOPs (MFU) count the nominal k tokens.
    expert_tokens = routed_tokens * load  # tokens this (busiest) rank's experts process
    ffn = m.expert_ffn
    overlap = sc.moe.overlap_dispatch
    ops = [norm("mlp_norm")]
    ops.append(gemm("router", Tn, h, m.num_experts))
    ops.append(Op("moe_dispatch", "other", "F", comm=Comm("ep", "all_to_all", a2a_bytes, overlap=overlap)))
    if m.mlp == "swiglu":
        ops.append(Op("experts_fc1", "gemm", "F", 2.0 * expert_tokens * h * 2 * ffn, 2.0 * routed_tokens * h * 2 * ffn,
                      (expert_tokens * (h + 2 * ffn) + experts_local * h * 2 * ffn) * dt, params=experts_local * h * 2 * ffn))
        ops.append(Op("experts_swiglu", "elementwise", "F", 3.0 * expert_tokens * ffn, 0.0, 3 * expert_tokens * ffn * dt))
    else:
        ops.append(Op("experts_fc1", "gemm", "F", 2.0 * expert_tokens * h * ffn, 2.0 * routed_tokens * h * ffn,
                      (expert_tokens * (h + ffn) + experts_local * h * ffn) * dt, params=experts_local * h * ffn))
        ops.append(Op("experts_gelu", "elementwise", "F", 8.0 * expert_tokens * ffn, 0.0, 2 * expert_tokens * ffn * dt))
    ops.append(Op("experts_fc2", "gemm", "F", 2.0 * expert_tokens * ffn * h, 2.0 * routed_tokens * ffn * h,
                  (expert_tokens * (ffn + h) + experts_local * ffn * h) * dt, params=experts_local * ffn * h))
    ops.append(Op("moe_combine", "other", "F", comm=Comm("ep", "all_to_all", a2a_bytes, overlap=overlap)))
    if sc.dtype == "fp8":
        # FP8 grouped expert GEMMs (Transformer Engine's grouped linear; DeepSeek-V3 trains its
        # experts in FP8): 1-byte operands, bf16 output, a cast of the routed tokens and weights.
        act_f, act_b, w_f, w_b = fp8_cast_bytes_per_elem(sc.fp8.recipe, max(1, sc.num_microbatches), sc)
        quantized = []
        for op in ops:
            if op.name in ("experts_fc1", "experts_fc2"):
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
        # Shared experts: a dense MLP num_shared_experts x the expert width, on this rank's tokens.
        # (dense_mlp divides the width by tp; the shared experts here are not tensor-parallel.)
        ops += dense_mlp("shared_", m.num_shared_experts * ffn * p.tp, Tn)
    ops.append(residual("mlp_residual"))
    layer = LayerOps("moe", attn + ops)
    layer.params = sum(o.params for o in layer.forward)
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
    # With pp=1 a tied LM head shares the embedding's matrix, so the head counts its norm only.
    return kinds["embedding"].params + sum(per_layer) + kinds["head"].params


def fp8_cast_bytes_per_elem(recipe: str, num_microbatches: int, sc: Scenario) -> tuple[float, float, float, float]:
    """HBM bytes per element of FP8 quantization around one linear layer, per microbatch:
    (activation forward, output-gradient backward, weight forward, weight backward).

    A quantized activation is needed row-wise for the forward GEMM and column-wise (transposed)
    for the weight-gradient GEMM, since Hopper's FP8 GEMMs take only the TN layout: one fused
    cast-transpose reads bf16 (2 bytes) and writes two FP8 copies (1 + 1), 4 bytes an element
    (Transformer Engine's cast_transpose). Current (dynamic) scaling first needs the tensor's
    amax: one more bf16 read, 2 bytes (TE Float8CurrentScaling, torchao tensorwise). Delayed
    scaling takes the scale from the amax history and fuses the new amax into the cast.
    MXFP8 computes a scale per 32-element block inside the cast (one E8M0 byte per block and
    layout: +2/32). torchao rowwise scales each row: an amax and a cast per layout (2+2+1 twice).
    Weights: TE casts them once per step and caches the FP8 copy across microbatches; torchao
    casts them in every forward (and their transpose in backward), or once on the FSDP shard
    before an FP8 all-gather.
    """
    if recipe == "te-delayed":
        act = 4.0
        w_f, w_b = 4.0 / num_microbatches, 0.0
    elif recipe == "te-current":
        act = 6.0
        w_f, w_b = 6.0 / num_microbatches, 0.0
    elif recipe == "mxfp8":
        act = 4.0 + 2.0 / 32
        w_f, w_b = act / num_microbatches, 0.0
    elif recipe == "tensorwise":
        act = 6.0
        w_f, w_b = 5.0, 2.0  # amax + cast in forward; the FP8 weight transposed in backward (1 + 1)
    else:  # rowwise
        act = 10.0
        w_f, w_b = 5.0, 5.0
    p = sc.parallelism
    if sc.fp8.param_all_gather and p.zero >= 3 and recipe in ("tensorwise", "rowwise"):
        # Cast on the shard before the all-gather (torchtitan precompute_float8_dynamic_scale_for_fsdp).
        w_f = w_f / (p.fsdp_shard_size or sc.dp)
    return act, act, w_f, w_b
