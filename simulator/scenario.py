"""What is simulated: model, parallel layout, batch, schedule and cluster (pydantic v2).

A Scenario loads from YAML, and every field can be overridden from the CLI. Consistency checks
(tp divides heads, gpus = tp*cp*pp*dp, ...) raise ``UserError`` with one line naming the value
and the fix. Presets and HuggingFace ``config.json`` files resolve to a ``ModelConfig``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from simulator.profile import Profile, load_profile
from simulator.errors import UserError, Whole, check_document_kind, did_you_mean, did_you_mean_name, path_exists, read_json, read_yaml, validation_error_line
from simulator.topology.spec import TopologySpec, first_validation_error, load_topology
from simulator.whatif.perturbations import Perturbations

# Bounds far above any real run (the largest published jobs use ~100K GPUs, ~200 layers, a few
# thousand microbatches per step) that keep a typo from asking for terabytes or hours.
MAX_GPUS = 1_048_576
MAX_LAYERS = 10_000
MAX_WIDTH = 1_048_576
MAX_VOCAB = 16_777_216
MAX_SEQ_LENGTH = 16_777_216
MAX_EXPERTS = 65_536
MAX_MICROBATCHES = 100_000
# Per pipeline rank, layers x microbatches bounds the events of one step (real runs: ~1,000-4,000).
MAX_LAYER_MICROBATCHES_PER_RANK = 10_000_000

_STRICT = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


# The first torch release whose nn.RMSNorm has a fused CUDA kernel (aten::_fused_rms_norm and
# _fused_rms_norm_backward: ATen/ops/_fused_rms_norm_cuda_dispatch.h ships from the 2.9.0 wheel;
# 2.8.0 has only the MPS one). An H200 capture under torch 2.11 runs it (tests/data/reference/h200).
TORCH_FUSED_RMS_NORM = (2, 9)

class ModelConfig(BaseModel):
    """A decoder-only transformer, dense or mixture-of-experts."""

    model_config = _STRICT

    name: str = Field("custom", description="Preset or model name, shown in reports.")
    num_layers: Whole = Field(ge=1, le=MAX_LAYERS, description="Transformer layers.")
    hidden_size: Whole = Field(ge=1, le=MAX_WIDTH, description="Model width h.")
    ffn_hidden_size: Whole = Field(ge=1, le=4 * MAX_WIDTH, description="Dense MLP inner width (4h for GPT, ~3.5h for Llama).")
    num_attention_heads: Whole = Field(ge=1, le=MAX_WIDTH, description="Query heads a.")
    num_kv_heads: Whole | None = Field(None, ge=1, le=MAX_WIDTH, description="Key/value heads (GQA); defaults to num_attention_heads.")
    head_dim: Whole | None = Field(None, ge=1, le=MAX_WIDTH, description="Per-head width; defaults to hidden_size / num_attention_heads.")
    vocab_size: Whole = Field(ge=1, le=MAX_VOCAB, description="Vocabulary size V (padded as the framework pads it).")
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank set means MLA.
    q_lora_rank: Whole | None = Field(None, ge=1, description="MLA: rank of the query down-projection (None: full-rank queries).")
    kv_lora_rank: Whole | None = Field(None, ge=1, description="MLA: rank of the compressed key/value latent.")
    qk_rope_head_dim: Whole = Field(0, ge=0, description="MLA: rotary part of each query/key head, added to head_dim.")
    v_head_dim: Whole | None = Field(None, ge=1, description="MLA: value head width; defaults to head_dim.")
    mlp: Literal["gelu", "swiglu"] = Field("swiglu", description="MLP kind: GELU (2 matrices) or SwiGLU (3 matrices).")
    tied_embeddings: bool = Field(False, description="Input embedding and LM head share one matrix.")
    learned_position_embeddings: bool = Field(False, description="GPT-style learned positions (adds seq x h parameters).")
    max_position_embeddings: Whole = Field(2048, ge=1, le=MAX_SEQ_LENGTH, description="Rows of the learned position table.")
    # Mixture of experts (simulated by the MoE work; carried here so scenarios can name them).
    num_experts: Whole = Field(0, ge=0, le=MAX_EXPERTS, description="Routed experts per MoE layer; 0 = dense model.")
    top_k: Whole = Field(0, ge=0, le=MAX_EXPERTS, description="Experts each token is routed to.")
    moe_ffn_hidden_size: Whole | None = Field(None, ge=1, le=4 * MAX_WIDTH, description="Inner width of one expert; defaults to ffn_hidden_size.")
    num_shared_experts: Whole = Field(0, ge=0, le=MAX_EXPERTS, description="Always-active shared experts per MoE layer.")
    num_dense_layers: Whole = Field(0, ge=0, le=MAX_LAYERS, description="First layers that use a dense MLP instead of experts.")
    # HuggingFace architecture whose eager kernels `implementation: hf-eager` replays (gpt2, opt).
    hf_model_type: str | None = Field(None, description="HuggingFace model_type (gpt2, opt) for hf-eager kernels; None: generic.")
    attention_dropout: float = Field(0.1, ge=0, lt=1, description="Dropout on attention probabilities (hf-eager; 0 launches no kernel).")
    # Read from a HuggingFace config so that `simulate` can say it is not modelled; excluded from
    # the dump (the sweep store's keys, reports) because nothing simulated depends on it.
    sliding_window: Whole | None = Field(
        None, ge=1, exclude=True,
        description="Sliding-window attention span in tokens, from a HuggingFace config (not modelled: attention is "
                    "simulated full-causal over seq_length; simulate notes it when seq_length exceeds it).")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.dim_head

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}: set head_dim"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads={self.kv_heads} must divide num_attention_heads={self.num_attention_heads}")
        if self.is_moe and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}")
        if self.num_dense_layers > self.num_layers:
            raise ValueError(f"num_dense_layers={self.num_dense_layers} exceeds num_layers={self.num_layers}")
        return self


# megatron-core 0.16.1 distributed/distributed_data_parallel.py: bucket_size defaults to
# max(40000000, 1000000 * dp) parameters ("if using very large dp_sizes, make buckets larger to
# ensure that chunks used in NCCL ring-reduce implementations are large enough to remain
# bandwidth-bound"; dp is its dp_group, without context parallelism).
MEGATRON_GRAD_BUCKET_PARAMS = 40_000_000
MEGATRON_GRAD_BUCKET_PARAMS_PER_DP_RANK = 1_000_000
# DeepSpeed 0.9.5 runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE: the pipeline engine's ReduceGrads
# all-reduces ZeRO-0 gradients after the backward in buffers of 500M elements.
DEEPSPEED_ALLREDUCE_BUCKET_PARAMS = 500_000_000


class ParallelConfig(BaseModel):
    model_config = _STRICT

    tp: Whole = Field(1, ge=1, le=MAX_GPUS, description="Tensor-parallel size (Megatron column/row parallel linears).")
    pp: Whole = Field(1, ge=1, le=MAX_GPUS, description="Pipeline-parallel ranks.")
    vpp: Whole = Field(1, ge=1, le=MAX_LAYERS, description="Model chunks per pipeline rank (interleaved schedules).")
    cp: Whole = Field(1, ge=1, le=MAX_GPUS, description="Context-parallel size: the sequence split across ranks.")
    ep: Whole = Field(1, ge=1, le=MAX_GPUS, description="Expert-parallel size, folded over a stage's dp x cp ranks (x tp under sequence parallelism with etp 1): megatron-core's MoE parallel folding.")
    etp: Whole | None = Field(
        None, ge=1, le=MAX_GPUS,
        description="Expert tensor parallelism (megatron-core --expert-tensor-parallel-size, torchtitan "
        "expert_tensor_parallel_degree): 1 or tp. 1 keeps each expert whole on a rank and folds the tp ranks into ep; "
        "tp splits each expert's ffn over the tp group, which gathers the dispatched tokens and reduce-scatters the "
        "experts' output (needs sequence_parallel). None: 1, as torchtitan's default and NeMo 2.5's DeepSeek-V3 and "
        "Qwen3 recipes set it (megatron-core's own default is tp).",
    )
    dp: Whole | None = Field(None, ge=1, le=MAX_GPUS, description="Data-parallel size; derived as gpus / (tp*cp*pp) when omitted.")
    zero: Whole = Field(1, ge=0, le=3, description="ZeRO stage: 0 DDP, 1 sharded optimizer, 2 + gradients, 3 + parameters (FSDP); sharded over dp x cp, whose ranks hold the same parameters.")
    sequence_parallel: bool = Field(True, description="Megatron sequence parallelism: all-gather / reduce-scatter instead of all-reduce.")
    async_tp: bool = Field(
        False,
        description="Async (micro-pipelined) TP, torchtitan's enable_async_tensor_parallel (torch symmetric memory, "
        "needs sequence_parallel): each all-gather -> GEMM and GEMM -> reduce-scatter runs as tp chunks whose P2P "
        "copies on the copy engines overlap the other chunks' GEMMs.",
    )
    tp_comm_overlap: bool = Field(
        False,
        description="Megatron --tp-comm-overlap (Transformer Engine userbuffers, needs sequence_parallel): ring-exchange "
        "all-gathers in tp splits on the copy engines, pipelined reduce-scatters in 4 splits on 16 SMs, bulk overlap of "
        "the backward reduce-scatter with the weight-gradient GEMMs (TE's defaults).",
    )
    mesh_order: str = Field("tp-cp-ep-dp-pp", description="Placement order of the mesh on GPU ids, innermost first (Megatron's "
                            "order string: ep's place in it lays out nothing, as the experts fold over a stage's tp, cp and dp ranks).")
    pp_layer_split: list[int] | None = Field(
        None, description="Layers per pipeline position (pp*vpp entries); default spreads them, first/last fewer."
    )
    pp_scatter_gather: bool = Field(
        False, description="Megatron's scatter/gather for pipeline sends without SP: each TP rank sends 1/tp, then the receiver all-gathers it over tp (blocking, counted as pp)."
    )
    pp_exchange: Literal["eager", "blocking"] = Field(
        "eager", description="How pipeline ranks exchange activations and gradients. eager: a send leaves when its "
        "output is ready and the sender goes on (the receive is always posted). blocking: Megatron-LM 2021's "
        "p2p_communication (batch_isend_irecv, then torch.cuda.synchronize): at each exchange a rank posts the previous "
        "action's outputs and the next one's inputs, a transfer starts when both ends have posted it, and the rank "
        "waits for all of them (schedules 1f1b and interleaved-1f1b)."
    )
    fsdp_reshard_after_forward: bool = Field(
        True, description="ZeRO-3/FSDP: free gathered parameters after forward and gather again for backward."
    )
    fsdp_prefetch: Whole = Field(1, ge=0, le=MAX_LAYERS, description="ZeRO-3/FSDP: parameter all-gathers issued ahead of the unit that needs them. Under framework torchtitan (FSDP2) they queue with the gradient reduce-scatters on one NCCL communicator, one collective at a time (torch's default; HSDP and sharded experts excepted; see fsdp_separate_reduce_scatter_group).")
    fsdp_separate_reduce_scatter_group: bool = Field(
        False, description="framework torchtitan (FSDP2) only: torch's FSDPModule.set_separate_reduce_scatter_group() "
        "(experimental, torch 2.13): the gradient reduce-scatters get a communicator of their own, so they run beside "
        "the parameter all-gathers instead of queuing with them; the two then share the links and both take SMs from "
        "the compute they overlap. Ignored by other frameworks.")
    fsdp_shard_size: Whole | None = Field(
        None, ge=1, description="HSDP: shard parameters within groups of this many DP ranks (with their CP ranks) and replicate across groups; with ep, a multiple of ep (each EP group inside one shard group)."
    )
    cp_attention: Literal["allgather", "ring"] | None = Field(
        None, description="Context parallelism's K/V exchange: allgather gathers K/V of the whole sequence (Llama 3; "
        "Transformer Engine cp_comm_type all_gather; torch's default rotate method under framework torchtitan); ring "
        "passes K/V blocks around while each step computes (TE's p2p; torch's alltoall rotate method under framework "
        "torchtitan). None (default): the framework's own default, allgather under torchtitan (torch's "
        "context_parallel rotate method), ring otherwise (megatron-core's cp_comm_type None runs TE's p2p). The "
        "frameworks' names are taken too: p2p and alltoall mean ring, all_gather means allgather."
    )

    @property
    def expert_tp(self) -> int:
        """Ranks one expert's ffn is split over (``etp``; None is 1)."""
        return self.etp or 1

    @field_validator("cp_attention", mode="before")
    @classmethod
    def _cp_attention_alias(cls, v: Any) -> Any:
        # The frameworks' own names: megatron-core's cp_comm_type (p2p, all_gather) and
        # torchtitan's context_parallel_rotate_method (allgather, alltoall: torch's K/V ring).
        if isinstance(v, str) and v in ("a2a", "a2a+p2p"):
            raise ValueError(f"{v!r} (Ulysses-style all-to-all CP) is not modelled: use ring (megatron-core's p2p) "
                             f"or allgather")
        return {"p2p": "ring", "all_gather": "allgather", "alltoall": "ring"}.get(v, v) if isinstance(v, str) else v

    cp_load_balance: bool = Field(
        True, description="torch's context parallel (framework torchtitan): round-robin load balancing of causal attention "
        "(torch 2.6 default); false = torch 2.5's contiguous shards, where the last CP rank runs every block and sets the pace."
    )
    account_for_embedding_in_pipeline_split: bool = Field(
        False, description="The embedding counts as one layer when splitting layers over pipeline positions (Megatron flag of that name)."
    )
    account_for_loss_in_pipeline_split: bool = Field(
        False, description="The LM head and loss count as one layer when splitting layers over pipeline positions (Megatron flag of that name)."
    )
    loss_all_reduce_per_microbatch: bool = Field(
        False, description="The last stage all-reduces each microbatch's loss over dp for logging (Megatron's average_losses_across_data_parallel_group)."
    )
    grad_clip: bool = Field(True, description="Clip gradients by their global norm (a norm over all gradients and an all-reduce).")
    grad_accumulation_fusion: bool = Field(
        True,
        description="The weight-gradient GEMM accumulates into the main gradient (Megatron gradient_accumulation_fusion). "
        "False: every microbatch adds each parameter's gradient into it in a separate pass over HBM "
        "(Megatron-LM 2021 and megatron-core without the fusion: main_grad.add_(grad); PyTorch AccumulateGrad).",
    )
    overlap_grad_reduce: bool = Field(True, description="Overlap the DP gradient reduction with backward (DDP/Megatron buckets).")
    grad_reduce_in_fp32: bool | None = Field(
        None, description="Reduce (and accumulate) the data-parallel gradients in fp32 (megatron-core "
        "DistributedDataParallelConfig.grad_reduce_in_fp32, torchtitan mixed_precision_reduce float32); false: in "
        "the parameter dtype, half the bytes for bf16 (NeMo 2.5's DeepSeek-V3 recipe). None: the framework's own, "
        "fp32 except fp16 runs without FSDP (Megatron-LM forces fp32 for bf16 only).")
    overlap_param_gather: bool | None = Field(
        None, description="ZeRO-1/2 (distributed optimizer): the updated parameters' all-gather overlaps the next "
        "step's forward, each stage's first forward waiting for its own gather (megatron-core "
        "DistributedDataParallelConfig.overlap_param_gather, --overlap-param-gather); false: gathered after the "
        "optimizer step, every rank waiting for it (megatron-core without the flag; DeepSpeed ZeRO-1/2, whose "
        "optimizer step ends in all_gather_dp_groups). None (default): the framework's own, false under "
        "megatron-deepspeed, true otherwise (Megatron's performance flags, as overlap_grad_reduce).")
    grad_bucket_params: Whole | None = Field(
        None, ge=1, description="Parameters per DP gradient bucket. None: the framework's own rule. megatron-core "
        "(framework generic): max(40M, 1M x dp), buckets only on the first model chunk of the first pipeline rank "
        "(the other stages reduce their gradients in one piece after their last backward), one piece without "
        "overlap_grad_reduce (whatever is given here); megatron-2021: one piece (no overlap); megatron-deepspeed "
        "without overlap: 500M; otherwise 40M. A number here is the bucket on the stages the framework buckets.")


class MoEConfig(BaseModel):
    """How tokens are routed to experts (mixture-of-experts models only)."""

    model_config = _STRICT

    routing: Literal["uniform", "skewed"] = Field(
        "uniform", description="uniform: every expert gets the same tokens; skewed: a seeded Zipf-like skew over experts."
    )
    skew: float = Field(1.0, ge=0, description="Zipf exponent of expert popularity for skewed routing (0 = uniform).")
    seed: Whole = Field(0, ge=0, le=2**32 - 1, description="Seed of the skewed routing draw (determinism).")
    capacity_factor: float | None = Field(
        None, gt=0, description="Tokens an expert accepts, as a multiple of its uniform share; overflow is dropped. None: no dropping."
    )
    overlap_dispatch: bool = Field(
        False, description="Overlap dispatch/combine all-to-all with compute (DualPipe's F&B pairing does this regardless)."
    )


FP8_RECIPES = ("te-delayed", "te-current", "mxfp8", "tensorwise", "rowwise")


class FP8Config(BaseModel):
    """How FP8 training is done (used when dtype is fp8).

    Recipes: Transformer Engine per-tensor scaling with delayed (amax history) or current
    scaling on Hopper and Blackwell; MXFP8 (32-element blocks with E8M0 scales) on Blackwell;
    torchao float8 as torchtitan uses it, per-tensor ("tensorwise", dynamic scaling) or
    per-row ("rowwise").
    """

    model_config = _STRICT

    recipe: Literal["te-delayed", "te-current", "mxfp8", "tensorwise", "rowwise"] = Field(
        "te-delayed", description="te-delayed, te-current (TE per-tensor), mxfp8 (Blackwell), tensorwise or rowwise (torchao)."
    )
    attention: bool = Field(False, description="Run attention in FP8 too (FlashAttention-3 / cuDNN FP8); default bf16.")
    param_all_gather: bool = Field(
        False, description="ZeRO-3/FSDP all-gathers FP8 weights (torchtitan enable_fsdp_float8_all_gather, Megatron --fp8-param-gather)."
    )


class OptimizerConfig(BaseModel):
    """The optimizer: torchtitan's AdamW implementation, and Adam's state precision under
    megatron-core's precision-aware optimizer (0.16.1
    optimizer_config.py use_precision_aware_optimizer, with Transformer Engine's FusedAdam), which
    keeps the moments in bf16 and the fp32 master weights as 16-bit remainders beside the bf16
    parameters (distrib_optimizer.py: master_param int16 with store_param_remainders and bf16),
    and reads the gradient buffer as it is. NeMo 2.5's DeepSeek-V3 recipe runs it with bf16
    moments, bf16 main gradients and grad_reduce_in_fp32 false."""

    model_config = _STRICT

    precision_aware: bool = Field(
        False, description="megatron-core --use-precision-aware-optimizer (needs the distributed optimizer, zero >= 1): the "
        "dtypes below may be bf16.")
    exp_avg_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Adam's first moment (--exp-avg-dtype).")
    exp_avg_sq_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Adam's second moment (--exp-avg-sq-dtype).")
    main_grads_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="--main-grads-dtype: megatron-core 0.16.1 reads it only in its config check; the optimizer "
        "reads the gradient buffer, whose dtype parallelism.grad_reduce_in_fp32 sets (NeMo sets both).")
    store_param_remainders: bool = Field(
        True, description="With precision_aware and bf16 parameters, keep the fp32 master weights as 16-bit remainders of "
        "the bf16 ones (megatron-core's default, Transformer Engine >= 2.1).")
    implementation: Literal["fused", "foreach"] = Field(
        "fused", description="framework torchtitan only: its optimizer.implementation. fused (its default): torch's "
        "_fused_adamw_, one pass reading parameter, gradient and moments and writing them back, 28 B a parameter; "
        "foreach: torch's multi-tensor AdamW, eight passes over 20 tensors, 80 B (measured on an H200: 2.3 ms against "
        "6.0 ms for 2^28 fp32 parameters). megatron-core's and DeepSpeed's Adam are fused.")


class BatchConfig(BaseModel):
    model_config = _STRICT

    micro_batch_size: Whole = Field(1, ge=1, le=MAX_SEQ_LENGTH, description="Sequences per microbatch per data-parallel rank.")
    global_batch_size: Whole = Field(ge=1, le=MAX_SEQ_LENGTH, description="Sequences per optimizer step, all data-parallel ranks together.")
    seq_length: Whole = Field(ge=1, le=MAX_SEQ_LENGTH, description="Tokens per sequence.")


class ClusterConfig(BaseModel):
    model_config = _STRICT

    gpus: Whole = Field(ge=1, le=MAX_GPUS, description="GPUs in the job.")
    # Named (a shipped name or a file) or written inline as a mapping. A dotted override into a
    # named one (--set cluster.gpu.compute.peak_tflops=500) first turns it into its mapping.
    gpu: str | Profile = Field(
        "h100-sxm-80gb",
        description="GPU profile: a name shipped in simulator/data/profiles, a path to a profile JSON, or the profile as a mapping.",
    )
    topology: str | TopologySpec = Field(
        "dgx-h100-fattree",
        description="Topology: a name shipped in simulator/data/topologies, a path to a YAML file, or the topology as a mapping.",
    )

    @field_validator("gpu", mode="before")
    @classmethod
    def _inline_gpu(cls, v: Any) -> Any:
        if isinstance(v, dict):
            try:
                return Profile.model_validate(v)
            except ValidationError as exc:
                raise ValueError(validation_error_line(exc, model=Profile)) from None
        if not isinstance(v, (str, Profile)):
            raise ValueError(f"{v!r} is not a GPU profile: give a shipped name, a path to a profile JSON, or a mapping")
        return v

    @field_validator("topology", mode="before")
    @classmethod
    def _inline_topology(cls, v: Any) -> Any:
        if isinstance(v, dict):
            try:
                return TopologySpec.model_validate(v)
            except ValidationError as exc:
                raise ValueError(first_validation_error(exc)) from None
        if not isinstance(v, (str, TopologySpec)):
            raise ValueError(f"{v!r} is not a topology: give a shipped name, a path to a topology YAML, or a mapping")
        return v

    @property
    def gpu_name(self) -> str:
        """What reports call the GPU profile: its name or path, or the inline profile's name."""
        return self.gpu if isinstance(self.gpu, str) else self.gpu.name

    @property
    def topology_name(self) -> str:
        return self.topology if isinstance(self.topology, str) else self.topology.name


def spec_key(value: str | BaseModel) -> str:
    """A hashable cache key for a named-or-inline profile or topology: the name or path as
    given, or a digest of the inline mapping's content."""
    if isinstance(value, str):
        return value
    blob = json.dumps(value.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return "inline:" + hashlib.sha256(blob.encode()).hexdigest()[:24]


class Scenario(BaseModel):
    """One training step to simulate."""

    model_config = _STRICT

    name: str = Field("scenario", description="Shown in reports; names the dashboard file.")
    model: ModelConfig
    parallelism: ParallelConfig = Field(default_factory=ParallelConfig)
    batch: BatchConfig
    moe: MoEConfig = Field(default_factory=MoEConfig)
    recompute: Literal["none", "selective", "full", "selective-op", "selective-layer"] = Field(
        "none", description="Activation recomputation: none; selective (Megatron: attention core); full; selective-op "
        "(torchtitan per-op SAC: every second matmul and the non-matmul ops); selective-layer (torchtitan: every second block each pipeline rank holds, checkpointed whole)."
    )
    schedule: str = Field("1f1b", description="Pipeline schedule name (see simulator.schedules).")
    schedule_file: str | None = Field(None, description="A torchtitan-style schedule CSV; overrides `schedule`.")
    cluster: ClusterConfig
    network: Literal["flow", "alpha-beta"] = Field(
        "flow", description="flow: flows on the topology graph sharing links max-min fairly; alpha-beta: per-tier formulas."
    )
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = Field(
        "bf16", description="Compute precision; fp8 runs the linear layers' GEMMs in FP8 (activations and attention stay bf16)."
    )
    fp8: FP8Config = Field(default_factory=lambda: FP8Config(), description="FP8 training recipe (dtype: fp8 only).")
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(), description="The optimizer: Adam's state precision (megatron-core's precision-aware optimizer) and torchtitan's AdamW implementation.")
    flash_attention: bool = Field(
        True, description="Fused attention that skips masked causal blocks and stores no s x s scores."
    )
    framework: Literal["generic", "megatron-2021", "megatron-deepspeed", "torchtitan"] = Field(
        "generic",
        description="Training framework, for its per-microbatch host work outside the layers. megatron-2021 / "
        "megatron-deepspeed: Megatron's get_batch (attention mask, position ids), vocab-parallel cross-entropy "
        "and loss_func, kernel by kernel (simulator.workload.ops megatron_loss_path). generic, torchtitan: "
        "one kernel each.",
    )
    torch_compile: bool = Field(
        True, description="framework torchtitan only: false runs torchtitan's eager kernels (RMSNorm, SwiGLU and RoPE "
        "unfused, simulator.workload.ops torchtitan_*); true (default) times them fused, as torch.compile does. "
        "Ignored by other frameworks."
    )
    compile_loss: bool | None = Field(
        None, description="framework torchtitan only: whether the cross-entropy loss runs under torch.compile. None "
        "(default) follows torch_compile, as torchtitan does since 0.1.0 (components/loss.py build_cross_entropy_loss); "
        "torchtitan of 2024 left the loss eager. Eager it keeps the fp32 log-softmax (4 bytes a logit) and its "
        "backward holds 8 more; compiled it keeps the bf16 logits and its backward writes their bf16 gradient "
        "(docs/design-notes.md, Memory). Ignored by other frameworks."
    )
    training_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="framework torchtitan only: its training.dtype (torchtitan 0.3.0 config/configs.py). "
        "float32 (default): fp32 parameters, gradients and AdamW moments, bf16 compute through FSDP2's mixed "
        "precision; bfloat16: full bf16 training, parameters, gradients and moments in bf16 with no fp32 copy "
        "(8 bytes a parameter of state instead of 16; FSDP2 still reduce-scatters in fp32, mixed_precision_reduce). "
        "Ignored by other frameworks."
    )
    torch_version: str | None = Field(
        None, description="framework torchtitan only: the torch release the run uses ('2.6', "
        "'2.11.0+cu130'), for what eager mode fuses without torch.compile: from 2.9 nn.RMSNorm runs torch's fused "
        "kernel on CUDA, one forward and one backward (aten::_fused_rms_norm; the 2.9.0 wheel is the first with its "
        "CUDA dispatch), before it six and twelve composite ones (RMSNORM_EAGER_EXTRA). None (default): a current "
        "release (2.9 or later). Ignored under torch_compile, which fuses the norm either way."
    )
    attention_kernel: Literal["default", "fa2"] = Field(
        "default", description="Fused attention kernel (flash_attention only): default = the profile's attention figures; "
        "fa2 = FlashAttention-2, what PyTorch SDPA's flash backend runs (torchtitan), at the profile's fa2_* figures."
    )
    implementation: Literal["megatron", "hf-eager"] = Field(
        "megatron", description="Kernels the framework runs: Megatron's fused layers, or HuggingFace eager PyTorch (every op its own kernel)."
    )
    perturbations: Perturbations | None = Field(
        None, description="What-if: slow GPUs, degraded links, failed nodes, jitter (simulator.whatif)."
    )

    @field_validator("torch_version")
    @classmethod
    def _torch_release(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"\d+\.\d+", v):
            raise ValueError(f"{v!r} is not a torch release: write it as torch.__version__ prints it, e.g. 2.6 or "
                             "2.11.0+cu130")
        return v

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, v: Any) -> Any:
        if isinstance(v, str):
            return resolve_model(v)
        return v

    @property
    def torch_fuses_rms_norm(self) -> bool:
        """Whether eager nn.RMSNorm is one fused kernel each way (torch >= 2.9 on CUDA, the
        torch_version field; a current release where it is unset)."""
        if self.torch_version is None:
            return True
        major, minor = (int(x) for x in self.torch_version.split(".")[:2])
        return (major, minor) >= TORCH_FUSED_RMS_NORM

    @property
    def dp(self) -> int:
        p = self.parallelism
        return p.dp if p.dp is not None else self.cluster.gpus // (p.tp * p.cp * p.pp)

    @property
    def grad_bucket_params(self) -> int:
        """Parameters per DP gradient bucket: the field, or the framework's default (megatron-core's
        grows with dp; the 2021 Megatron-LM, DeepSpeed and torchtitan rows keep 40M, as before)."""
        p = self.parallelism
        if p.grad_bucket_params is not None:
            return p.grad_bucket_params
        if self.framework == "generic":
            return max(MEGATRON_GRAD_BUCKET_PARAMS, MEGATRON_GRAD_BUCKET_PARAMS_PER_DP_RANK * self.dp)
        if self.framework == "megatron-deepspeed" and not p.overlap_grad_reduce:
            return DEEPSPEED_ALLREDUCE_BUCKET_PARAMS
        return MEGATRON_GRAD_BUCKET_PARAMS

    @property
    def overlap_param_gather(self) -> bool:
        """parallelism.overlap_param_gather, or the framework's default where it is unset: DeepSpeed
        0.9.5's ZeRO-1/2 optimizer gathers the updated parameters at the end of its step, blocking
        (runtime/zero/stage_1_and_2.py step -> runtime/utils.py all_gather_dp_groups, a sequence
        of dist.all_gather calls); the generic framework is Megatron with its performance flags."""
        p = self.parallelism
        if p.overlap_param_gather is not None:
            return p.overlap_param_gather
        return self.framework != "megatron-deepspeed"

    @property
    def grad_buckets_first_chunk_only(self) -> bool:
        """Gradients reduced in buckets during the backward only on the first pipeline rank's first
        model chunk, the other stages in one piece when their last backward ends: megatron-core's
        DDP (framework generic; plan.bucketed_stages has the source)."""
        return self.framework == "generic"

    @property
    def grad_reduce_in_one_piece(self) -> bool:
        """Gradients reduced after the backward (no overlap) in one collective per stage, not in
        buckets: megatron-core sets bucket_size to None without overlap_grad_reduce, whatever
        bucket was asked for (distributed_data_parallel.py), and Megatron-LM 2021's DDP all-reduces
        its contiguous gradient buffer (or one flattened bucket per dtype) at once
        (megatron/model/distributed.py allreduce_gradients). FSDP (ZeRO 3) reduces per unit."""
        p = self.parallelism
        return not p.overlap_grad_reduce and p.zero < 3 and self.framework in ("generic", "megatron-2021")

    @property
    def loss_compiled(self) -> bool:
        """torchtitan's cross-entropy under torch.compile (compile_loss, else torch_compile); false
        for every other framework, whose loss the model prices as its own."""
        return self.framework == "torchtitan" and (self.torch_compile if self.compile_loss is None else self.compile_loss)

    @property
    def num_microbatches(self) -> int:
        return self.batch.global_batch_size // (self.batch.micro_batch_size * self.dp)

    @property
    def dtype_bytes(self) -> int:
        # FP8 training keeps activations, gradients between layers and weights in bf16; only the
        # GEMM operands are FP8 copies (see simulator.workload.ops).
        return 4 if self.dtype == "fp32" else 2

    @field_validator("name")
    @classmethod
    def _printable_name(cls, value: str) -> str:
        # The name titles reports and terminals and becomes a file name (slugged by the CLI).
        if not value.strip():
            raise ValueError("the name is empty: give the scenario a name")
        if len(value.encode()) > 200:
            raise ValueError(f"the name is {len(value.encode())} bytes long: use at most 200")
        if any(ord(ch) < 32 or 0x7F <= ord(ch) <= 0x9F for ch in value):
            raise ValueError(f"the name {value!r} holds control characters: use printable text")
        return value

    # (the GPU it was read for, compute.fp8_non_tn_gemm): the profile is read once per scenario
    # and GPU, not at every op the workload builds.
    _fp8_non_tn_memo: tuple[Any, bool] | None = PrivateAttr(None)

    @property
    def te_fp8_transposes(self) -> bool:
        """Transformer Engine's per-tensor FP8 (te-delayed, te-current) keeps a transposed copy of
        each quantized tensor for the GEMM that reads it the other way: Hopper's FP8 GEMMs take
        only TN. On compute capability 10.x (profile compute.fp8_non_tn_gemm) one row-wise buffer
        serves both and no transpose is made."""
        gpu = self.cluster.gpu
        key = gpu if isinstance(gpu, str) else id(gpu)
        if self._fp8_non_tn_memo is None or self._fp8_non_tn_memo[0] != key:
            self._fp8_non_tn_memo = (key, load_profile(gpu).compute.fp8_non_tn_gemm)
        return not self._fp8_non_tn_memo[1]

    @property
    def cp_attention(self) -> str:
        """parallelism.cp_attention, or the framework's default where it is unset: torch's
        context_parallel rotates K/V by all-gather unless told otherwise (torch 2.13
        _context_parallel/_attention.py, _cp_options.rotate_method ALL_GATHER), which torchtitan
        keeps by default; megatron-core passes cp_comm_type None to Transformer Engine as "p2p"
        (megatron-core 0.16.1 extensions/transformer_engine.py TEDotProductAttention), the ring."""
        if self.parallelism.cp_attention is not None:
            return self.parallelism.cp_attention
        return "allgather" if self.framework == "torchtitan" else "ring"

    def check(self) -> "Scenario":
        """Consistency across sections; raises UserError naming the value and the fix."""
        m, p, b, c = self.model, self.parallelism, self.batch, self.cluster
        if m.num_attention_heads % p.tp:
            raise UserError(
                f"tp={p.tp} does not divide num_attention_heads={m.num_attention_heads}: choose tp among {_divisors(m.num_attention_heads, 64)}"
            )
        if m.kv_heads % p.tp and p.tp % m.kv_heads:
            raise UserError(f"tp={p.tp} and num_kv_heads={m.kv_heads} must divide one another: choose another tp")
        if self.framework == "torchtitan" and m.kv_heads % p.tp:
            # torchtitan shards wk/wv column-wise and views each rank's K/V as whole heads
            # (Dec 2024 models/llama/model.py Attention.forward, 0.3.0 models/common/attention.py: view(..., -1, head_dim)
            # on the local shard, which fails when a rank holds part of a head).
            raise UserError(
                f"tp={p.tp} exceeds num_kv_heads={m.kv_heads}: torchtitan gives each tensor-parallel rank whole "
                f"key/value heads; choose tp among {_divisors(m.kv_heads, 64)} (megatron-core, framework generic, "
                "allows more)"
            )
        if self.framework == "torchtitan" and self.training_dtype == "bfloat16" and self.dtype == "fp32":
            raise UserError("training_dtype bfloat16 keeps the parameters in bf16, so the layers cannot compute in fp32: "
                            "set dtype bf16 (or fp8), or training_dtype float32")
        model_ranks = p.tp * p.cp * p.pp
        if c.gpus % model_ranks:
            raise UserError(
                f"gpus={c.gpus} is not divisible by tp*cp*pp={p.tp}*{p.cp}*{p.pp}={model_ranks}: use a multiple of "
                f"{model_ranks} GPUs, or a tp, cp and pp (--tp, --cp, --pp) whose product divides {c.gpus}"
            )
        if p.dp is not None and p.tp * p.cp * p.pp * p.dp != c.gpus:
            raise UserError(
                f"gpus={c.gpus} != tp*cp*pp*dp={p.tp}*{p.cp}*{p.pp}*{p.dp}={model_ranks * p.dp}: "
                f"set --gpus {model_ranks * p.dp} or omit --dp to derive it"
            )
        dp = self.dp
        if p.ep > 1 and not m.is_moe:
            raise UserError(f"ep={p.ep} needs a mixture-of-experts model, but {m.name!r} is dense: set ep=1")
        # Expert parallelism folds over the ranks of a pipeline stage that route their own tokens:
        # dp x cp, and the tp ranks under sequence parallelism (each routes its T/tp tokens through
        # unsplit experts; megatron-core's MoE parallel folding with expert tensor parallelism 1,
        # torchtitan's ep over dp_shard x cp x tp). topology.placement.Mesh lays the groups out;
        # sp_tp is plan.edp_tp_of, which this layer cannot import.
        if p.etp is not None and p.etp not in (1, p.tp):
            raise UserError(f"etp={p.etp} must be 1 or tp={p.tp}: experts are either whole on a rank or split over "
                            f"the tp group (megatron-core and torchtitan support these two)")
        if p.expert_tp > 1 and m.is_moe:
            if not p.sequence_parallel:
                raise UserError(f"etp={p.etp} gathers the dispatched tokens over the sequence-parallel tp group: set "
                                f"parallelism.sequence_parallel true (--sequence-parallel) or etp=1")
            if m.expert_ffn % p.etp:
                raise UserError(f"etp={p.etp} does not divide the experts' ffn size {m.expert_ffn}: use etp=1")
        sp_tp = p.tp if m.is_moe and p.sequence_parallel and p.tp > 1 and p.expert_tp == 1 else 1
        expert_ranks = dp * p.cp * sp_tp
        if expert_ranks % p.ep:
            formula = f"dp x cp{' x tp' if sp_tp > 1 else ''} = {dp} x {p.cp}{f' x {p.tp}' if sp_tp > 1 else ''}"
            fits = [str(e) for e in range(1, min(expert_ranks, m.num_experts) + 1)
                    if expert_ranks % e == 0 and m.num_experts % e == 0]
            hint = "" if sp_tp > 1 or p.tp == 1 else (
                " (with etp=1 the tp ranks join them)" if p.sequence_parallel else " (with sequence_parallel the tp ranks join them)")
            raise UserError(
                f"ep={p.ep} does not divide the {expert_ranks} ranks of a pipeline stage that route tokens to the "
                f"experts ({formula}): choose ep among {', '.join(fits)}{hint}")
        o = self.optimizer
        lowered = [f"{k}={getattr(o, k)}" for k in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype")
                   if getattr(o, k) != "fp32"]
        if lowered and not o.precision_aware:
            # megatron-core 0.16.1 optimizer_config.py: "exp_avg_dtype can only be fp32 when not
            # using precision-aware optimizer" (and alike for the others).
            raise UserError(f"optimizer.{lowered[0]} needs the precision-aware optimizer: set optimizer.precision_aware "
                            f"true (megatron-core --use-precision-aware-optimizer) or the dtype fp32")
        if o.precision_aware and (p.zero < 1 or self.framework != "generic"):
            # optimizer_config.py: "--use-precision-aware-optimizer only supported with distributed
            # optimizer", with Transformer Engine's FusedAdam: a megatron-core feature.
            raise UserError(
                "optimizer.precision_aware is megatron-core's distributed optimizer with Transformer Engine's FusedAdam: "
                + (f"it needs zero >= 1, not zero={p.zero}: set --zero 1" if p.zero < 1 else
                   f"framework {self.framework} does not run it: set framework generic or precision_aware false"))
        if self.framework == "torchtitan" and p.tp > 1 and not p.sequence_parallel:
            # torchtitan's TP plan shards the norms over the sequence unconditionally, with no
            # option to turn it off (0.1.0 models/llama3/infra/parallelize.py apply_tp:
            # "attention_norm" / "ffn_norm" / "norm": SequenceParallel()).
            raise UserError(
                f"framework torchtitan runs tensor parallelism (tp={p.tp}) with sequence parallelism always "
                f"(apply_tp's SequenceParallel norms): set parallelism.sequence_parallel true (--sequence-parallel) or tp=1"
            )
        if m.is_moe and p.tp > 1 and not p.sequence_parallel and self.framework == "generic":
            # megatron-core 0.16.1 transformer/moe/moe_layer.py MoELayer.forward raises in training
            # when attention's tp group is larger than one and sequence_parallel is off.
            raise UserError(
                f"a mixture-of-experts model with tp={p.tp} needs sequence_parallel: megatron-core refuses MoE with "
                f"tensor parallelism without it (MoELayer.forward): set parallelism.sequence_parallel true "
                f"(--sequence-parallel) or tp=1"
            )
        if m.is_moe and m.num_experts % p.ep:
            raise UserError(f"ep={p.ep} does not divide num_experts={m.num_experts}: choose ep among {_divisors(m.num_experts, 1024)}")
        if b.global_batch_size % (b.micro_batch_size * dp):
            raise UserError(
                f"global_batch_size={b.global_batch_size} is not divisible by micro_batch_size*dp={b.micro_batch_size}*{dp}: "
                f"use a multiple of {b.micro_batch_size * dp}"
            )
        microbatches = b.global_batch_size // (b.micro_batch_size * dp)
        if microbatches > MAX_MICROBATCHES:
            raise UserError(
                f"{microbatches:,} microbatches per step is more than the {MAX_MICROBATCHES:,} ClusterSim simulates: "
                f"raise micro_batch_size or lower global_batch_size"
            )
        layers_per_rank = -(-m.num_layers // p.pp)
        if microbatches * layers_per_rank > MAX_LAYER_MICROBATCHES_PER_RANK:
            raise UserError(
                f"{microbatches:,} microbatches x {layers_per_rank:,} layers per pipeline rank is more than the "
                f"{MAX_LAYER_MICROBATCHES_PER_RANK:,} layer-microbatches ClusterSim simulates per rank: use fewer layers, more pp or fewer microbatches"
            )
        # V-shaped schedules hold two stages per rank; interleaved ones vpp.
        v_shape = self.schedule in ("zbv", "dualpipev") and not self.schedule_file
        # Interleaving spreads a rank's model chunks over the other pipeline ranks; with one rank there
        # are none. Megatron-LM refuses it (megatron/training/arguments.py: "When interleaved schedule is
        # used, pipeline-model-parallel size should be greater than 1"); a V shape's two stages per
        # rank are the schedule's own, not vpp.
        if p.pp == 1 and not self.schedule_file and not v_shape and (self.schedule == "interleaved-1f1b" or p.vpp > 1):
            what = f"schedule {self.schedule!r}" if self.schedule == "interleaved-1f1b" else f"vpp={p.vpp}"
            raise UserError(
                f"{what} needs pp >= 2 (model chunks are interleaved over pipeline ranks), but pp=1: "
                f"set pp to 2 or more, or use schedule 1f1b with vpp=1"
            )
        positions = 2 * p.pp if v_shape else p.pp * p.vpp
        # With the embedding and/or the loss counted as layers, the first/last position may hold
        # only the embedding / only the LM head (Megatron --account-for-*-in-pipeline-split).
        extra = int(p.account_for_embedding_in_pipeline_split) + int(p.account_for_loss_in_pipeline_split)
        if positions > m.num_layers + extra:
            what = f"2*pp={positions} ({self.schedule} holds two stages per rank)" if v_shape else f"pp*vpp={positions}"
            fix = ("" if extra == 2 else
                   ": every pipeline stage needs at least one layer (or set parallelism.account_for_embedding_in_pipeline_split"
                   " / account_for_loss_in_pipeline_split to let the first/last position hold only the embedding / LM head)")
            raise UserError(f"{what} exceeds num_layers={m.num_layers}{' + ' + str(extra) if extra else ''}{fix or ': use fewer pipeline positions'}")
        if p.pp_layer_split is not None:
            lows = [0 if (i == 0 and p.account_for_embedding_in_pipeline_split)
                    or (i == positions - 1 and p.account_for_loss_in_pipeline_split) else 1 for i in range(positions)]
            if (len(p.pp_layer_split) != positions or sum(p.pp_layer_split) != m.num_layers
                    or any(c < lo for c, lo in zip(p.pp_layer_split, lows))):
                raise UserError(
                    f"pp_layer_split={p.pp_layer_split} must have pp*vpp={positions} positive entries summing to num_layers={m.num_layers}"
                    " (the first/last may be 0 with account_for_embedding/loss_in_pipeline_split)"
                )
        if p.pp_exchange == "blocking" and p.pp > 1 and (self.schedule_file or self.schedule not in ("1f1b", "interleaved-1f1b")):
            what = "a schedule file" if self.schedule_file else f"schedule {self.schedule!r}"
            raise UserError(
                f"parallelism.pp_exchange blocking is Megatron-LM 2021's exchange, which runs 1f1b and interleaved-1f1b, "
                f"not {what}: set schedule 1f1b or interleaved-1f1b, or pp_exchange eager"
            )
        if p.fsdp_shard_size is not None and (p.zero < 3 or dp % p.fsdp_shard_size):
            raise UserError(
                f"fsdp_shard_size={p.fsdp_shard_size} needs zero=3 and must divide dp={dp}: set --zero 3 and a divisor of {dp}"
            )
        if p.fsdp_shard_size is not None and (p.fsdp_shard_size * p.cp * sp_tp) % p.ep:
            # torchtitan carves ep out of the sharded dimension, never the replicated one (0.2.0
            # parallel_dims.py: dp_shard = dp_shard_mod_ep x dp_shard_in_ep, asserting (dp_shard x
            # cp [x tp]) % ep == 0; 0.3.0: efsdp = dp_shard x cp x tp / ep, inside dp_replicate):
            # an HSDP shard group's ranks (with their cp and routing tp ranks) hold whole EP groups.
            inner = p.cp * sp_tp
            fits = [str(s) for s in range(1, dp + 1) if dp % s == 0 and (s * inner) % p.ep == 0]
            what = f"fsdp_shard_size x cp{' x tp' if sp_tp > 1 else ''} = {p.fsdp_shard_size * inner}"
            raise UserError(
                f"fsdp_shard_size={p.fsdp_shard_size} splits ep={p.ep} groups across HSDP replicas: {what} must be a "
                f"multiple of ep (torchtitan carves ep out of the sharded data-parallel ranks, never the replicated "
                f"ones): use fsdp_shard_size among {', '.join(fits)}, or an ep that divides {p.fsdp_shard_size * inner}"
            )
        if self.cp_attention == "ring" and p.cp > 1 and (b.seq_length // p.cp) % 2:
            raise UserError(f"ring attention splits each rank's {b.seq_length // p.cp} tokens in two chunks: use an even seq_length/cp")
        if b.seq_length % p.cp:
            raise UserError(f"cp={p.cp} does not divide seq_length={b.seq_length}: use a seq_length multiple of {p.cp}")
        for name in ("async_tp", "tp_comm_overlap"):
            if getattr(p, name) and p.tp > 1 and not p.sequence_parallel:
                raise UserError(
                    f"{name} overlaps the sequence-parallel all-gathers and reduce-scatters, but sequence_parallel is off: "
                    f"set parallelism.sequence_parallel true (--sequence-parallel) or {name} false"
                )
        if p.async_tp and p.tp_comm_overlap:
            raise UserError(
                "async_tp (torch's micro-pipelined TP) and tp_comm_overlap (Transformer Engine userbuffers) are two ways "
                "to overlap the same collectives: set one of them false"
            )
        if p.sequence_parallel and p.tp > 1 and (b.seq_length // p.cp) % p.tp:
            raise UserError(
                f"sequence_parallel needs tp={p.tp} to divide seq_length/cp={b.seq_length // p.cp}: change seq_length or use --no-sequence-parallel"
            )
        return self


def _divisors(n: int, limit: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


# ---------------------------------------------------------------------------------------------
# Model presets. Numbers from the models' papers and released configs.
# ---------------------------------------------------------------------------------------------

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Brown et al. 2020, Table 2.1; Megatron pads the GPT-2 vocabulary to 51,200 for TP.
    "gpt3-175b": dict(num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96,
                      vocab_size=51200, mlp="gelu", tied_embeddings=True, learned_position_embeddings=True,
                      max_position_embeddings=2048),
    # Meta Llama 3 / 3.1 configs (config.json of the released checkpoints).
    "llama3-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_kv_heads=8, vocab_size=128256, mlp="swiglu"),
    "llama3-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                       num_kv_heads=8, vocab_size=128256, mlp="swiglu"),
    "llama3-405b": dict(num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128,
                        num_kv_heads=8, vocab_size=128256, mlp="swiglu"),
    # Mixtral configs (mistralai/Mixtral-8x7B-v0.1, 8x22B-v0.1).
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                         num_kv_heads=8, vocab_size=32000, mlp="swiglu", num_experts=8, top_k=2),
    "mixtral-8x22b": dict(num_layers=56, hidden_size=6144, ffn_hidden_size=16384, num_attention_heads=48,
                          num_kv_heads=8, vocab_size=32768, mlp="swiglu", num_experts=8, top_k=2),
    # DeepSeek-V3 (config.json): 3 dense layers then 58 MoE layers of 256 routed + 1 shared expert,
    # top-8; multi-head latent attention with 128 heads (nope 128 + rope 64, value 128, q rank
    # 1536, kv rank 512). Multi-token prediction is left out.
    "deepseek-v3": dict(num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
                        head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536, kv_lora_rank=512,
                        vocab_size=129280, mlp="swiglu", num_experts=256, top_k=8,
                        moe_ffn_hidden_size=2048, num_shared_experts=1, num_dense_layers=3),
    # Qwen3-235B-A22B (config.json): head_dim 128 with 64 query heads on a 4096-wide model.
    "qwen3-235b-a22b": dict(num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64,
                            num_kv_heads=4, head_dim=128, vocab_size=151936, mlp="swiglu", num_experts=128,
                            top_k=8, moe_ffn_hidden_size=1536),
}


def resolve_model(name_or_path: str) -> ModelConfig:
    """A preset name, or a path to a HuggingFace config.json."""
    if name_or_path in MODEL_PRESETS:
        return ModelConfig(name=name_or_path, **MODEL_PRESETS[name_or_path])
    path = Path(name_or_path)
    if path_exists(path / "config.json"):  # (only a folder holds one; a name the OS refuses: no)
        # a HuggingFace snapshot folder (huggingface-cli download, save_pretrained): its config.json
        path = path / "config.json"
    if path.suffix == ".json" or path_exists(path):
        return model_from_hf_config(path)
    raise UserError(
        f"unknown model {name_or_path!r}{did_you_mean_name(str(name_or_path), MODEL_PRESETS)}: use a preset "
        f"({', '.join(MODEL_PRESETS)}) or a path to a HuggingFace config.json"
    )


HF_MODEL_TYPES = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3", "opt")


def _qwen_moe_dense_layers(cfg: dict[str, Any], path: str, layers: int) -> int:
    """Qwen2-MoE / Qwen3-MoE: the dense layers as num_dense_layers. HF's Qwen2MoeDecoderLayer and
    Qwen3MoeDecoderLayer use experts where ``layer_idx not in mlp_only_layers and (layer_idx + 1) %
    decoder_sparse_step == 0``, a dense MLP of intermediate_size elsewhere. ModelConfig holds dense
    layers first only (num_dense_layers, as DeepSeek's first_k_dense_replace), so any other pattern is
    refused rather than simulated as all-expert layers (which miscounts parameters and FLOPs)."""
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise UserError(f"model config {path!r}: 'decoder_sparse_step' is {step!r}; write a whole number of at least 1")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in only):
        raise UserError(f"model config {path!r}: 'mlp_only_layers' is {only!r}; write a list of layer indices "
                        f"0..{layers - 1}")
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    if dense != list(range(len(dense))):
        raise UserError(
            f"model config {path!r}: decoder_sparse_step={step} and mlp_only_layers={only} put dense layers "
            f"{dense[:8]}{' ...' if len(dense) > 8 else ''} between the expert layers, which is not modelled (only "
            "the first layers can be dense): set decoder_sparse_step to 1 and list only first layers in mlp_only_layers")
    return len(dense)


def model_from_hf_config(path: Path) -> ModelConfig:
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        # (read as JSON it was "not valid JSON: fix the file", of a file that is fine)
        raise UserError(f"model config {str(path)!r} is YAML: a model is a preset name or a HuggingFace config.json; a "
                        f"scenario YAML goes first on the command line (clustersim simulate {str(path)})")
    cfg = read_json(path, "model config", fix="fix the file")
    check_document_kind(cfg, "model config", str(path), "a HuggingFace model config", fix="give a HuggingFace config.json")
    mt = cfg.get("model_type")
    if mt is None:
        raise UserError(f"model config {str(path)!r} has no model_type: add the architecture's (one of "
                        f"{', '.join(HF_MODEL_TYPES)}), as transformers writes it in config.json")
    if mt not in HF_MODEL_TYPES:
        raise UserError(
            f"model_type {mt!r} in {str(path)!r} is not supported: supported are {', '.join(HF_MODEL_TYPES)}"
        )
    # A hub download is <model>/config.json: the folder names the model; any other file names it itself
    # (tests/data/hf/mistral.json is "mistral", not "hf").
    name = cfg.get("_name_or_path") or (path.parent.name if path.name == "config.json" and path.parent.name else path.stem)

    def whole(key: str, value: Any) -> int:
        # HF configs hold JSON numbers; a quoted "768" would otherwise multiply as text (4 * "768").
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"model config {str(path)!r}: {key!r} is {value!r}; write a whole number of at least 1")
        return value

    def need(key: str) -> int:
        if key not in cfg:
            raise UserError(f"model config {str(path)!r} (model_type {mt}) lacks {key!r}: add it or use a preset")
        return whole(key, cfg[key])

    def opt(key: str, default: Any = None) -> Any:
        """An optional whole number; absent, null or 0 (HF's "not used") gives the default."""
        value = cfg.get(key)
        if value is None or (value == 0 and not isinstance(value, bool)):
            return default
        return whole(key, value)

    def flag(key: str, default: bool) -> bool:
        value = cfg.get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"model config {str(path)!r}: {key!r} is {value!r}; write true or false (no quotes)")
        return value

    try:
        if mt == "gpt2":
            h = need("n_embd")
            return ModelConfig(
                name=str(name), num_layers=need("n_layer"), hidden_size=h, ffn_hidden_size=opt("n_inner") or 4 * h,
                num_attention_heads=need("n_head"), vocab_size=need("vocab_size"), mlp="gelu", tied_embeddings=True,
                learned_position_embeddings=True, max_position_embeddings=opt("n_positions", 1024),
                hf_model_type="gpt2", attention_dropout=cfg.get("attn_pdrop", 0.1),
            )
        if mt == "opt":
            h = need("hidden_size")
            if cfg.get("word_embed_proj_dim", h) != h or not cfg.get("do_layer_norm_before", True):
                raise UserError(f"model config {str(path)!r}: OPT with word_embed_proj_dim != hidden_size or post-LN (OPT-350M) is not modelled")
            return ModelConfig(
                name=str(name), num_layers=need("num_hidden_layers"), hidden_size=h, ffn_hidden_size=need("ffn_dim"),
                num_attention_heads=need("num_attention_heads"), vocab_size=need("vocab_size"), mlp="gelu",
                tied_embeddings=flag("tie_word_embeddings", True), learned_position_embeddings=True,
                max_position_embeddings=need("max_position_embeddings"), hf_model_type="opt",
                attention_dropout=cfg.get("attention_dropout", 0.0),
            )
        common = dict(
            name=str(name), num_layers=need("num_hidden_layers"), hidden_size=need("hidden_size"),
            ffn_hidden_size=need("intermediate_size"), num_attention_heads=need("num_attention_heads"),
            num_kv_heads=opt("num_key_value_heads"), head_dim=opt("head_dim"), vocab_size=need("vocab_size"),
            mlp="swiglu", tied_embeddings=flag("tie_word_embeddings", False),
        )
        # Sliding-window attention: HF Mistral / Mixtral apply config.sliding_window whenever it is set,
        # Qwen2 / Qwen3 (and their MoE) only with use_sliding_window (on layers from max_window_layers).
        if mt in ("mistral", "mixtral") or (mt.startswith("qwen") and flag("use_sliding_window", False)):
            common["sliding_window"] = opt("sliding_window")
        if mt == "mixtral":
            common.update(num_experts=need("num_local_experts"), top_k=need("num_experts_per_tok"))
        elif mt in ("qwen2_moe", "qwen3_moe"):
            common.update(num_experts=need("num_experts"), top_k=need("num_experts_per_tok"),
                          moe_ffn_hidden_size=need("moe_intermediate_size"),
                          num_dense_layers=_qwen_moe_dense_layers(cfg, str(path), common["num_layers"]))
            shared = opt("shared_expert_intermediate_size")
            if shared:
                common["num_shared_experts"] = max(1, shared // common["moe_ffn_hidden_size"])
        elif mt == "deepseek_v3":
            freq = cfg.get("moe_layer_freq", 1)
            if freq != 1:
                # HF DeepseekV3DecoderLayer: a layer is MoE where layer_idx >= first_k_dense_replace and
                # layer_idx % moe_layer_freq == 0; only the first layers can be dense here.
                raise UserError(
                    f"model config {str(path)!r}: moe_layer_freq={freq!r} puts dense layers between the expert layers, "
                    "which is not modelled (only the first first_k_dense_replace layers can be dense): set "
                    "moe_layer_freq to 1")
            common.update(num_experts=need("n_routed_experts"), top_k=need("num_experts_per_tok"),
                          moe_ffn_hidden_size=need("moe_intermediate_size"),
                          num_shared_experts=opt("n_shared_experts", 0),
                          num_dense_layers=opt("first_k_dense_replace", 0),
                          head_dim=opt("qk_nope_head_dim") or opt("head_dim"),
                          qk_rope_head_dim=opt("qk_rope_head_dim", 0), v_head_dim=opt("v_head_dim"),
                          q_lora_rank=opt("q_lora_rank"), kv_lora_rank=opt("kv_lora_rank"))
        return ModelConfig(**common)
    except ValidationError as exc:
        raise UserError(f"model config {str(path)!r}: {validation_message(exc, ModelConfig)}") from None


# ---------------------------------------------------------------------------------------------
# Loading and overriding
# ---------------------------------------------------------------------------------------------

def validation_message(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    return validation_error_line(exc, model=model)


def default_scenario_dict() -> dict[str, Any]:
    """Llama-3-70B-class on 1,024 H100: TP8, PP8, DP16, sequence 8192, 16M tokens per step."""
    return {
        "name": "llama3-70b-1024xh100",
        "model": "llama3-70b",
        "parallelism": {"tp": 8, "pp": 8, "sequence_parallel": True, "zero": 1},
        "batch": {"micro_batch_size": 1, "global_batch_size": 2048, "seq_length": 8192},
        "recompute": "none",
        "schedule": "1f1b",
        "cluster": {"gpus": 1024, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
    }


def load_scenario_dict(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    data = read_yaml(path, "scenario file")
    check_document_kind(data, "scenario file", str(path), "a scenario",
                        fix="give a scenario YAML: a mapping of sections (model, parallelism, batch, cluster)")
    # Paths inside a scenario file are relative to that file.
    base = path.parent
    slots = [(data, "model"), (data, "schedule_file")]
    if isinstance(data.get("cluster"), dict):
        slots += [(data["cluster"], "topology"), (data["cluster"], "gpu")]
    for holder, key in slots:
        value = holder.get(key)
        if isinstance(value, str) and _looks_like_path(value) and not Path(value).is_absolute():
            holder[key] = str(base / value)
    return data


# Scenario slots that may name a file, and what the file is called in messages.
INPUT_FILE_SLOTS = {"model": "model config", "schedule_file": "schedule file", "cluster.gpu": "GPU profile",
                    "cluster.topology": "topology file"}


def scenario_input_files(path: str | Path | None, overrides: dict[str, Any] | None = None) -> dict[str, str]:
    """The files a scenario run reads, by what they are called: the scenario file and the model
    config, schedule CSV, profile and topology it or an override names (a name, not a path, is
    listed too; it matches no output file). For refusing an output path that would replace one."""
    files: dict[str, str] = {}
    data: dict[str, Any] = {}
    if path is not None:
        files["scenario file"] = str(path)
        data = load_scenario_dict(path)
    for dotted, what in INPUT_FILE_SLOTS.items():
        value = (overrides or {}).get(dotted)
        if value is None:
            value = _get_dotted(data, dotted)
        if isinstance(value, str):
            files[what] = value
    return files


def _looks_like_path(value: str) -> bool:
    return "/" in value or value.endswith((".json", ".yaml", ".yml", ".csv"))


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """data["parallelism"]["tp"] = value for dotted = "parallelism.tp", creating sections."""
    node = data
    *parents, leaf = dotted.split(".")
    walked = []
    for key in parents:
        walked.append(key)
        if node.get(key) is None:
            # An absent or unset optional section (a profile's comm.nccl: None = NCCL's own
            # constants) starts empty: its defaults, with this one key set.
            node[key] = {}
        node = node[key]
        if not isinstance(node, dict):
            where = ".".join(walked)
            raise UserError(
                f"cannot set {dotted!r}: {where!r} is {node!r}, not a section; set {where!r} itself or write the section out in a scenario file"
            )
    node[leaf] = value


# Sections a scenario may name (a preset, a shipped name or a file) instead of writing them out;
# a dotted override that reaches inside one turns the named form into its full mapping first.
_NAMED_SECTIONS: dict[str, tuple[Any, Any]] = {
    "model": (lambda v: resolve_model(v).model_dump(), None),
    "cluster.gpu": (lambda v: load_profile(v).model_dump(mode="json"), "h100-sxm-80gb"),
    "cluster.topology": (lambda v: load_topology(v).model_dump(mode="json"), "dgx-h100-fattree"),
}
_WHAT_IF_SOURCE = "what-if override from the command line or scenario (not measured)"


def _get_dotted(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _materialise(data: dict[str, Any], dotted: str) -> str | None:
    """Turn the named section ``dotted`` reaches into (if any) into its mapping; returns that
    section's path, or None when the override is not inside one."""
    for section, (expand, default) in _NAMED_SECTIONS.items():
        if dotted.startswith(section + "."):
            value = _get_dotted(data, section)
            if value is None:
                value = default
            if isinstance(value, str):
                set_dotted(data, section, expand(value))
            return section
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic model classes an annotation allows (through Optional, unions and Annotated)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _models_in(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for a in get_args(annotation) for m in _models_in(a)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _dict_values_in(annotation: Any) -> Any:
    """The value annotation of a dict[str, X] field (through Optional), else None."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _dict_values_in(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        for a in get_args(annotation):
            v = _dict_values_in(a)
            if v is not None:
                return v
        return None
    if origin is dict:
        return get_args(annotation)[1]
    return None


def _narrow_by_kind(models: list[type[BaseModel]], node: Any) -> list[type[BaseModel]]:
    """A discriminated union (the topology's fabric) narrowed to the member the data names."""
    kind = node.get("kind") if isinstance(node, dict) else None
    if len(models) < 2 or kind is None:
        return models
    hit = [m for m in models if "kind" in m.model_fields and kind in get_args(m.model_fields["kind"].annotation)]
    return hit or models


@functools.lru_cache(maxsize=1024)
def _valid_without_data(dotted: str) -> bool:
    """True when ``dotted`` names a scenario field through plain sections only (no union to
    narrow by the data, no dict of entries): such a path is valid whatever the data holds. A
    sweep builds a scenario per point; this keeps the check off its hot path."""
    models: list[type[BaseModel]] = [Scenario]
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if len(models) != 1 or part not in models[0].model_fields:
            return False
        ann = models[0].model_fields[part].annotation
        if i == len(parts) - 1:
            return True
        if _dict_values_in(ann) is not None:
            return False
        models = _models_in(ann)
    return False


def check_override_path(dotted: str, data: dict[str, Any]) -> None:
    """Raise UserError unless ``dotted`` names a field of the scenario (profiles and topologies
    included); the message lists the valid keys where the path went wrong."""
    if _valid_without_data(dotted):
        return
    parts = dotted.split(".")
    models: list[type[BaseModel]] = [Scenario]
    i = 0
    while True:
        here = ".".join(parts[:i])
        models = _narrow_by_kind(models, _get_dotted(data, here) if here else data)
        fields = {name: f for m in models for name, f in m.model_fields.items()}
        if parts[i] not in fields:
            where = f"under {here!r}" if here else "at the top level"
            raise UserError(f"unknown key {'.'.join(parts[: i + 1])!r}{did_you_mean(parts[i], fields)}: "
                            f"valid keys {where} are {', '.join(sorted(fields))}")
        if i == len(parts) - 1:
            return
        ann = fields[parts[i]].annotation
        values = _dict_values_in(ann)
        if values is not None:
            # A dict of sub-models (a profile's op classes): one of its entries, then its fields.
            node = _get_dotted(data, ".".join(parts[: i + 1]))
            if isinstance(node, dict) and parts[i + 1] not in node:
                raise UserError(
                    f"unknown key {'.'.join(parts[: i + 2])!r}{did_you_mean(parts[i + 1], node)}: valid keys under "
                    f"{'.'.join(parts[: i + 1])!r} are {', '.join(sorted(node))}"
                )
            if i + 1 == len(parts) - 1:
                return
            models, i = _models_in(values), i + 2
        else:
            models, i = _models_in(ann), i + 1
        if not models:
            raise UserError(f"{'.'.join(parts[:i])!r} is a value, not a section: cannot set {dotted!r}")


def apply_override(data: dict[str, Any], dotted: str, value: Any) -> None:
    """One dotted override (``cluster.topology.node.nic_gbps = 200``) applied to a scenario dict:
    a named model, profile or topology it reaches into becomes its mapping first, and the path
    must name an existing field."""
    section = _materialise(data, dotted)
    check_override_path(dotted, data)
    set_dotted(data, dotted, value)
    if section in ("cluster.gpu", "cluster.topology"):
        # Reports name the profile and topology; a changed one must not read as the stock one.
        spec = _get_dotted(data, section)
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            shown = f"{value:g}" if isinstance(value, float) else value  # (2000 from a flag or from --set alike)
            spec["name"] = f"{spec['name']} with {dotted[len(section) + 1:]}={shown}"
    if section == "cluster.gpu" and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        # A changed profile number is no longer the datasheet's or the fit's: say so where the
        # profile records where its numbers come from.
        prov = data["cluster"]["gpu"].setdefault("provenance", {})
        if isinstance(prov, dict):
            prov.setdefault("items", []).append(
                {"field": dotted[len(section) + 1:], "value": value, "source": _WHAT_IF_SOURCE}
            )


def build_scenario(data: dict[str, Any], overrides: dict[str, Any] | None = None) -> Scenario:
    """Validate a scenario dict after applying dotted overrides ({"parallelism.tp": 4})."""
    data = json.loads(json.dumps(data))  # deep copy
    for dotted, value in (overrides or {}).items():
        if value is not None:
            apply_override(data, dotted, value)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise UserError(f"scenario: {validation_message(exc, Scenario)}") from None
    return scenario.check()


def _check_inert_overrides(sc: Scenario, overrides: dict[str, Any] | None) -> None:
    """An override the simulation would not read is refused, not ignored: the class curves of a
    profile that times kernels by shape (``compute.kernels``) are one (only class-curve profiles,
    which have no ``kernels``, use them)."""
    prefix = "cluster.gpu.compute.classes."
    keys = [k for k in (overrides or {}) if k.startswith(prefix)]
    gpu = sc.cluster.gpu
    if keys and isinstance(gpu, Profile) and gpu.compute.kernels is not None:
        key = keys[0]
        cls, field = key[len(prefix):].split(".")[0], key.rsplit(".", 1)[-1]
        if field == "bandwidth_efficiency":
            hint = f"kernels.mem_efficiency.{'default' if cls == 'gemm' else cls}"
        elif cls == "attention":
            hint = "kernels.attention_efficiency"
        else:
            hint = "kernels.gemm_efficiency.bf16"
        raise UserError(f"--set {key}: profile {gpu.name.split(' with ')[0]!r} times kernels by shape (compute.kernels) and does not read "
                        f"its class curves: set cluster.gpu.compute.{hint} instead")


def load_scenario(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Scenario:
    data = default_scenario_dict() if path is None else load_scenario_dict(path)
    sc = build_scenario(data, overrides)
    _check_inert_overrides(sc, overrides)
    if path is None and "name" not in (overrides or {}):
        # The default's name describes the default; flags that change the job rename it.
        gpu = Path(sc.cluster.gpu_name).stem.split("-")[0]
        sc = sc.model_copy(update={"name": f"{Path(sc.model.name).stem}-{sc.cluster.gpus}x{gpu}"})
    return sc
