"""The `train` workload: a small decoder trained with torch's own parallel stack, torchtitan's.

- model: ``--mlp swiglu`` is torchtitan's Llama 3 (RMSNorm, RoPE through complex pairs, repeat_kv
  before SDPA, SwiGLU), so its bundle declares framework torchtitan (spec.scenario_of); ``--mlp
  gelu`` is GPT-style (LayerNorm, GELU, no position encoding) and declares framework generic.
  Parameters are in the run's dtype with no fp32 copy (torchtitan's training.dtype); AdamW is
  torch's fused or foreach implementation (``--optimizer``, torchtitan's optimizer.implementation).

- mesh: ``init_device_mesh`` over (pp, edp, ep, cp, tp), outermost first, which is exactly
  simulator.topology.placement.Mesh's default ``tp-cp-ep-dp-pp`` layout (checked at start-up);
  dense data parallelism is the flattened (edp, ep) sub-mesh.
- tp: DTensor ``parallelize_module``: ColwiseParallel for wq/wk/wv and the MLP up (and gate)
  projections, RowwiseParallel for wo and the MLP down projection, a vocab-parallel embedding
  and a column-parallel LM head whose logits stay vocabulary-sharded for loss_parallel(); with
  sequence parallelism, SequenceParallel norms and PrepareModuleInput all-gathers in front of
  attention and MLP.
- pp: ``torch.distributed.pipelining.PipelineStage`` and torch's schedule classes.
- dp: FSDP2 ``fully_shard`` per block and per model chunk, reducing gradients in fp32
  (torchtitan's mixed_precision_reduce). zero 3 -> reshard_after_forward=True;
  zero 2 and zero 1 -> reshard_after_forward=False (FSDP2 always reduce-scatters gradients and
  shards optimizer state, so both run as ZeRO-2); zero 0 -> FSDP2's ``replicate`` (DDP:
  all-reduced gradients). Gradients are synchronised on the last microbatch only.
- ep: a MoE layer whose dispatch and combine are ``dist.all_to_all_single`` over the ep group;
  experts are sharded by FSDP2 over the expert-data-parallel (edp) ranks, or left alone when
  edp is 1 (no replica to synchronise with).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from simulator.capture.harness import RankContext, WorkloadResult, timed_steps
from simulator.capture.spec import SCHEDULES, scenario_of
from simulator.topology.placement import Mesh


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with the transposed exchange as its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def _norm(kind: str, h: int) -> nn.Module:
    return nn.RMSNorm(h) if kind == "swiglu" else nn.LayerNorm(h)


# Llama 3's RoPE base (Meta's params.json rope_theta; torchtitan's llama3 configs).
LLAMA3_ROPE_THETA = 500000.0


def rope_freqs_cis(head_dim: int, seq_length: int, theta: float = LLAMA3_ROPE_THETA) -> torch.Tensor:
    """torchtitan's precompute_freqs_cis (Llama 3, no frequency scaling): [seq, head_dim / 2] complex64."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan's apply_rotary_emb (models/llama3/model.py): q and k to fp32 complex pairs, times
    the rotations, back to their dtype; [batch, seq, heads, head_dim] in and out."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torchtitan's repeat_kv: each key/value head copied out to its n_rep query heads."""
    bs, slen, n_kv, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv, n_rep, head_dim).reshape(bs, slen, n_kv * n_rep, head_dim)


class Attention(nn.Module):
    """``llama``: torchtitan's Llama 3 attention (RoPE on q and k, repeat_kv, then SDPA), which a
    scenario of framework torchtitan prices op by op; otherwise GPT-style attention with no
    position encoding and SDPA's own grouped-query path."""

    def __init__(self, h: int, n_heads: int, n_kv: int, llama: bool = False):
        super().__init__()
        self.head_dim = h // n_heads
        self.llama = llama
        self.wq = nn.Linear(h, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(h, n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(h, n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, h, bias=False)
        self.freqs_cis: torch.Tensor | None = None  # set by GPT.init_rope, after any dtype cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        # -1: the heads on this TP rank (the projections' outputs are local shards)
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.llama:
            q, k = apply_rotary_emb(q, k, self.freqs_cis[:t])
            n_rep = q.shape[2] // k.shape[2]
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, h: int, ffn: int, kind: str):
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(h, ffn, bias=False)  # up (and SwiGLU's activated half)
        self.w2 = nn.Linear(ffn, h, bias=False)  # down
        self.w3 = nn.Linear(h, ffn, bias=False) if kind == "swiglu" else None  # SwiGLU gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


# Process groups cannot be deep-copied (pipeline chunks are deep copies): modules hold a key.
_GROUPS: dict[str, Any] = {}


class MoE(nn.Module):
    """Top-k routed experts; the experts of this ep rank live in ``experts``."""

    def __init__(self, h: int, ffn: int, kind: str, num_experts: int, top_k: int, ep: int, ep_group: Any):
        super().__init__()
        self.num_experts, self.top_k, self.ep = num_experts, top_k, ep
        if ep_group is not None:
            _GROUPS["ep"] = ep_group
        self.router = nn.Linear(h, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(h, ffn, kind) for _ in range(num_experts // ep))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(xf).float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        routed = xf[token]  # grouped by global expert id
        counts = torch.bincount(flat, minlength=self.num_experts)
        n_local = len(self.experts)
        if self.ep > 1:
            group = _GROUPS["ep"]
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=group)  # [src rank][local expert]
            in_splits = counts.view(self.ep, n_local).sum(1).tolist()
            out_splits = recv_counts.view(self.ep, n_local).sum(1).tolist()
            recv = _AllToAll.apply(routed, out_splits, in_splits, group)
            local_expert = torch.repeat_interleave(
                torch.arange(n_local, device=x.device).repeat(self.ep), recv_counts
            )
            regroup = torch.argsort(local_expert, stable=True)
            per_expert = recv_counts.view(self.ep, n_local).sum(0).tolist()
            y_sorted = self._run_experts(recv[regroup], per_expert)
            y = torch.empty_like(y_sorted)
            y[regroup] = y_sorted
            back = _AllToAll.apply(y, in_splits, out_splits, group)
        else:
            back = self._run_experts(routed, counts.tolist())
        w = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(xf).index_add(0, token, back * w)
        return out.view(shape)

    def _run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = [expert(chunk) for expert, chunk in zip(self.experts, torch.split(x, counts))]
        return torch.cat(outs) if outs else x


class Block(nn.Module):
    def __init__(self, a: dict[str, Any], ep_group: Any):
        super().__init__()
        h = a["hidden_size"]
        self.attention_norm = _norm(a["mlp"], h)
        self.attention = Attention(h, a["num_heads"], a["num_kv_heads"], llama=a["mlp"] == "swiglu")
        self.ffn_norm = _norm(a["mlp"], h)
        if a["num_experts"] > 1:
            self.feed_forward: nn.Module = MoE(h, a["ffn_hidden_size"], a["mlp"], a["num_experts"], a["top_k"],
                                               a["ep"], ep_group)
        else:
            self.feed_forward = MLP(h, a["ffn_hidden_size"], a["mlp"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only LM; a pipeline chunk keeps a slice of ``layers`` and sets the rest to None."""

    def __init__(self, a: dict[str, Any], ep_group: Any):
        super().__init__()
        h, v = a["hidden_size"], a["vocab_size"]
        self.tok_embeddings: nn.Module | None = nn.Embedding(v, h)
        self.layers = nn.ModuleDict({str(i): Block(a, ep_group) for i in range(a["num_layers"])})
        self.norm: nn.Module | None = _norm(a["mlp"], h)
        self.output: nn.Module | None = nn.Linear(h, v, bias=False)

    def init_rope(self, seq_length: int, device: torch.device) -> None:
        """Give each Llama attention its RoPE rotations (complex64): after the model's dtype cast,
        which would drop their imaginary part."""
        for layer in self.layers.values():
            if layer.attention.llama:
                layer.attention.freqs_cis = rope_freqs_cis(layer.attention.head_dim, seq_length).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _stage_ids(layout: str, pp_rank: int, pp: int, vpp: int) -> list[int]:
    if layout == "single":
        return [pp_rank]
    if layout == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(vpp)]


def _chunk(full: GPT, stage: int, n_stages: int) -> GPT:
    part = copy.deepcopy(full)
    per = len(full.layers) // n_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def _apply_tp(model: GPT, tp_mesh: Any, sp: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    act = Shard(1) if sp else Replicate()
    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        # Loss parallelism, as torchtitan (and Megatron's vocab-parallel cross-entropy): the logits
        # stay sharded over the vocabulary and the loss runs under loss_parallel().
        top["output"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            plan.update(
                {
                    "attention_norm": SequenceParallel(),
                    "ffn_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                }
            )
        parallelize_module(block, tp_mesh, plan)


def _apply_dp(model: GPT, a: dict[str, Any], dp_mesh: Any, edp_mesh: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # torchtitan's policy (mixed_precision_reduce float32): gradients reduced in fp32 whatever the
    # parameters' dtype, and cast back to it in the shard.
    mp = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if a["zero"] == 0:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        def wrap(m: Any, mesh: Any, ignored: set | None = None) -> None:
            # replicate takes one module: a list of experts is replicated expert by expert
            for mod in m if isinstance(m, list) else [m]:
                replicate(mod, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    else:
        reshard = a["zero"] == 3

        def wrap(m: Any, mesh: Any, ignored: set | None = None) -> None:
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, ignored_params=ignored)

    expert_params: set = set()
    for block in model.layers.values():
        ignored = None
        if isinstance(block.feed_forward, MoE):
            experts = block.feed_forward.experts
            if edp_mesh is not None and edp_mesh.size() > 1:
                # one FSDP group for all local experts (ModuleList has no forward to hook)
                wrap(list(experts), edp_mesh)
            else:
                ignored = set(experts.parameters())
                expert_params |= ignored
        wrap(block, dp_mesh, ignored)
    wrap(model, dp_mesh, expert_params or None)


def _sdpa_kernel(a: dict[str, Any], device: torch.device, dtype: torch.dtype) -> str:
    """The scenario's attention_kernel for what torch's SDPA picks at this run's shapes on a GPU
    (torch._fused_sdp_choice, the dispatcher's own choice): fa2 for its flash backend
    (FlashAttention-2), default otherwise (cuDNN or memory-efficient attention, the profile's
    attention figures). A CPU run keeps default: no GPU kernel to name."""
    if device.type != "cuda":
        return "default"
    from torch.nn.attention import SDPBackend

    heads = a["num_heads"] // a["tp"]
    q = torch.empty(a["micro_batch_size"], heads, a["seq_length"], a["hidden_size"] // a["num_heads"],
                    device=device, dtype=dtype)
    llama = a["mlp"] == "swiglu"
    kv = q if llama else q[:, : a["num_kv_heads"] // a["tp"]]
    choice = torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=not llama and kv.shape[1] != heads)
    return "fa2" if choice == SDPBackend.FLASH_ATTENTION.value else "default"


def run(ctx: RankContext) -> WorkloadResult:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    a = dict(ctx.cfg.args)
    tp, pp, cp, ep, dp = a["tp"], a["pp"], a["cp"], a["ep"], a["dp"]
    placement = Mesh(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp)
    mesh = init_device_mesh(
        ctx.device.type, (pp, dp // ep, ep, cp, tp), mesh_dim_names=("pp", "edp", "ep", "cp", "tp")
    )
    if mesh.mesh.flatten().tolist() != placement.grid.flatten().tolist():
        raise RuntimeError("torch's device mesh and simulator.topology.placement.Mesh disagree on rank layout")
    pp_rank, dp_rank, _, _, _ = (int(c) for c in placement.coords[ctx.rank])
    tp_mesh, ep_mesh, edp_mesh = mesh["tp"], mesh["ep"], mesh["edp"]
    dp_mesh = mesh["edp", "ep"]._flatten("dp")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a["dtype"]]
    notes = []

    torch.manual_seed(1234)  # identical initial weights everywhere: DTensor shards a full local copy
    full = GPT(a, ep_mesh.get_group() if ep > 1 else None).to(dtype)
    if ep > 1:
        # Each ep rank owns a different slice of the experts.
        torch.manual_seed(1234 + int(ep_mesh.get_local_rank()))
        for block in full.layers.values():
            for p in block.feed_forward.experts.parameters():
                nn.init.normal_(p, std=0.02)

    cls_name, layout = SCHEDULES[a["schedule"]]
    vpp = a["vpp"] if pp > 1 else 1
    n_stages = pp * vpp
    stage_ids = _stage_ids(layout, pp_rank, pp, vpp) if pp > 1 else [0]
    parts = [_chunk(full, s, n_stages) for s in stage_ids] if pp > 1 else [full]
    del full
    for part in parts:
        part.to(ctx.device)
        part.init_rope(a["seq_length"], ctx.device)
        if tp > 1:
            _apply_tp(part, tp_mesh, bool(a["sequence_parallel"]))
        if dp > 1:
            _apply_dp(part, a, dp_mesh, edp_mesh if ep > 1 else None)
    from torch.distributed.tensor import DTensor

    params = [p for part in parts for p in part.parameters()]
    # torchtitan's optimizer.implementation: fused (its default, torch's _fused_adamw_) or foreach.
    # A multi-tensor kernel takes DTensors or plain tensors, not both (TP without sequence
    # parallelism leaves the norms plain): one parameter group of each.
    groups = [{"params": g} for g in ([p for p in params if isinstance(p, DTensor)],
                                      [p for p in params if not isinstance(p, DTensor)]) if g]
    opt = torch.optim.AdamW(groups, lr=1e-4, **{a["optimizer"]: True})
    a["attention_kernel"] = _sdpa_kernel(a, ctx.device, dtype)
    a["torch_version"] = torch.__version__

    n_mb, mbs, seq = a["num_microbatches"], a["micro_batch_size"], a["seq_length"]
    local_batch = n_mb * mbs
    schedule = None
    if pp > 1:
        import torch.distributed.pipelining as pipelining

        pp_group = mesh["pp"].get_group()
        stages = [
            pipelining.PipelineStage(part, s, n_stages, ctx.device, group=pp_group)
            for part, s in zip(parts, stage_ids)
        ]
        cls = getattr(pipelining, cls_name)
        schedule = cls(stages[0] if layout == "single" else stages, n_mb, loss_fn=_loss)
        notes.append(f"pipeline: {cls_name}, stages {stage_ids} of {n_stages} on pipeline rank {pp_rank} (rank 0's view)")
    has_first = 0 in stage_ids
    has_last = (n_stages - 1) in stage_ids

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Same data across a TP group and a pipeline, different across data-parallel replicas.
        g = torch.Generator().manual_seed(step * 100003 + dp_rank)
        tokens = torch.randint(0, a["vocab_size"], (local_batch, seq + 1), generator=g)
        return tokens[:, :-1].to(ctx.device), tokens[:, 1:].to(ctx.device)

    losses: list[float] = []

    def train_step(step: int) -> None:
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        with torch.profiler.record_function(f"train_step#{step}"), (loss_parallel() if tp > 1 else nullcontext()):
            if schedule is not None:
                kwargs: dict[str, Any] = {}
                mb_losses: list[torch.Tensor] = []
                if has_last:
                    kwargs.update(target=y, losses=mb_losses)
                if has_first:
                    schedule.step(x, **kwargs)
                else:
                    schedule.step(**kwargs)
                if mb_losses:
                    losses.append(float(torch.stack([l.detach().float() for l in mb_losses]).mean()))
            else:
                model = parts[0]
                total = 0.0
                for i in range(n_mb):
                    if dp > 1:
                        model.set_requires_gradient_sync(i == n_mb - 1)
                    sl = slice(i * mbs, (i + 1) * mbs)
                    loss = _loss(model(x[sl]), y[sl]) / n_mb
                    loss.backward()
                    total += float(loss.detach())
                losses.append(total)
            opt.step()

    warm, steps = ctx.cfg.warmup_steps, ctx.cfg.steps
    # Warm-up steps run under the profiler's warm-up phase, so the trace holds only measured steps.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*warmup.*")  # warm == 0 is a deliberate choice
        sched = torch.profiler.schedule(wait=0, warmup=warm, active=steps, repeat=1)
    with ctx.profiler(schedule=sched) as prof:
        times = timed_steps(ctx, warm + steps, train_step, prof)
    if a["zero"] in (1, 2) and dp > 1:
        notes.append(f"zero {a['zero']} ran as FSDP2 reshard_after_forward=False (ZeRO-2: sharded grads and optimizer state)")
    if a["zero"] == 0 and dp > 1:
        notes.append("zero 0 ran as FSDP2 replicate (DDP: all-reduced gradients)")
    if losses:
        notes.append(f"rank {ctx.rank} losses: " + ", ".join(f"{v:.4f}" for v in losses))
    return WorkloadResult(step_times_s=times[warm:], scenario=scenario_of(a), notes=notes)
