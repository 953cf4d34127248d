"""Validation of capture arguments, done before any rank starts (no torch here).

Combinations torch cannot run are refused here with one line, so a bad request never spawns
ranks that then die in a collective.
"""

from __future__ import annotations

from typing import Any

from simulator.errors import UserError

# schedule name -> (torch.distributed.pipelining class, stage layout on a pipeline rank)
#   single: one stage per rank; looped: vpp stages r, r+pp, ...; v: stages r and 2pp-1-r
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "looped"),
    "looped-bfs": ("ScheduleLoopedBFS", "looped"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "looped"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}

BACKENDS = ("gloo", "nccl")
# torch.optim.AdamW's implementations, as torchtitan's optimizer.implementation names them.
OPTIMIZERS = ("fused", "foreach")
WORKLOADS = ("collectives", "compute", "train")


def _fail(msg: str) -> None:
    raise UserError(msg)


def validate_train(a: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Check and complete the train workload's arguments; return them with defaults filled in."""
    a = dict(a)
    for key in ("tp", "pp", "cp", "ep", "num_layers", "hidden_size", "num_heads", "vocab_size",
                "micro_batch_size", "seq_length"):
        if a[key] < 1:
            _fail(f"--{key.replace('_', '-')} {a[key]} must be at least 1")
    tp, pp, cp, ep = a["tp"], a["pp"], a["cp"], a["ep"]
    model_ranks = tp * pp * cp
    if a.get("dp") is None:
        if world_size % model_ranks:
            _fail(f"--nproc {world_size} is not a multiple of tp x pp x cp = {model_ranks}: change --nproc or the parallel sizes")
        a["dp"] = world_size // model_ranks
    dp = a["dp"]
    if tp * pp * cp * dp != world_size:
        _fail(f"tp x pp x cp x dp = {tp}x{pp}x{cp}x{dp} = {tp * pp * cp * dp} but --nproc is {world_size}: make them equal")
    if cp != 1:
        _fail(f"--cp {cp}: context parallelism is not captured (torch's context_parallel needs CUDA SDPA kernels): use --cp 1")
    if dp % ep:
        _fail(f"--ep {ep} must divide dp={dp}: experts are sharded over data-parallel ranks")
    if a["zero"] not in (0, 1, 2, 3):
        _fail(f"--zero {a['zero']} must be 0, 1, 2 or 3")
    if a["mlp"] not in ("gelu", "swiglu"):
        _fail(f"--mlp {a['mlp']!r} must be gelu or swiglu")
    if a["dtype"] not in ("fp32", "bf16"):
        _fail(f"--dtype {a['dtype']!r} must be fp32 or bf16")
    a["optimizer"] = a.get("optimizer") or "fused"
    if a["optimizer"] not in OPTIMIZERS:
        _fail(f"--optimizer {a['optimizer']!r} must be one of {', '.join(OPTIMIZERS)} (torch's AdamW implementations)")

    h, nh = a["hidden_size"], a["num_heads"]
    a["num_kv_heads"] = a.get("num_kv_heads") or nh
    a["ffn_hidden_size"] = a.get("ffn_hidden_size") or 4 * h
    nkv = a["num_kv_heads"]
    if h % nh:
        _fail(f"--hidden-size {h} is not a multiple of --num-heads {nh}")
    if nh % nkv:
        _fail(f"--num-heads {nh} is not a multiple of --num-kv-heads {nkv}")
    for key, val in (("num_heads", nh), ("num_kv_heads", nkv), ("ffn_hidden_size", a["ffn_hidden_size"]),
                     ("vocab_size", a["vocab_size"])):
        if val % tp:
            _fail(f"--{key.replace('_', '-')} {val} is not a multiple of --tp {tp}: tensor parallelism splits it evenly")
    if a["mlp"] == "swiglu" and tp > 1 and not a["sequence_parallel"]:
        _fail(f"--mlp swiglu with --tp {tp} runs torchtitan's Llama, whose tensor parallelism always shards the sequence "
              "(SequenceParallel norms): add --sequence-parallel, or use --mlp gelu")
    if a["sequence_parallel"] and tp > 1 and a["seq_length"] % tp:
        _fail(f"--seq-length {a['seq_length']} is not a multiple of --tp {tp}, which sequence parallelism needs")

    E = a["num_experts"]
    if E > 1:
        if tp > 1:
            _fail(f"--num-experts {E} with --tp {tp}: MoE capture has no expert tensor parallelism: use --tp 1 (ep carves experts out of dp)")
        if E % ep:
            _fail(f"--num-experts {E} is not a multiple of --ep {ep}")
        if not 1 <= a["top_k"] <= E:
            _fail(f"--top-k {a['top_k']} must be between 1 and --num-experts {E}")
    elif ep > 1:
        _fail(f"--ep {ep} needs a MoE model: pass --num-experts (a multiple of {ep})")

    sched = a["schedule"]
    if sched not in SCHEDULES:
        _fail(f"--schedule {sched!r} is not one torch.distributed.pipelining runs here: use one of {', '.join(SCHEDULES)}")
    layout = SCHEDULES[sched][1]
    vpp = a.get("vpp")
    if layout == "single":
        vpp = vpp or 1
        if vpp != 1:
            _fail(f"--vpp {vpp} with --schedule {sched}: one stage per rank; use --schedule interleaved-1f1b for vpp > 1")
    elif layout == "v":
        vpp = vpp or 2
        if vpp != 2:
            _fail(f"--vpp {vpp} with --schedule {sched}: V schedules hold exactly 2 stages per rank; use --vpp 2")
    else:
        vpp = vpp or 2
    a["vpp"] = vpp
    stages = pp * vpp
    if pp > 1 and a["num_layers"] % stages:
        _fail(f"--num-layers {a['num_layers']} is not a multiple of pp x vpp = {stages} pipeline stages")
    if pp == 1 and layout != "single" and vpp > 1:
        # Without a pipeline the chunks would all be local: run plain gradient accumulation.
        a["vpp"] = 1

    mbs = a["micro_batch_size"]
    if a.get("global_batch_size") is None:
        a["global_batch_size"] = mbs * dp * max(2, 2 * pp)
    gbs = a["global_batch_size"]
    if gbs % (mbs * dp):
        _fail(f"--global-batch-size {gbs} is not a multiple of micro-batch-size x dp = {mbs * dp}")
    n_mb = gbs // (mbs * dp)
    if pp > 1 and layout != "single" and n_mb % pp:
        _fail(f"{n_mb} microbatches (global batch / (micro batch x dp)) must be a multiple of pp={pp} for --schedule {sched}")
    if pp > 1 and n_mb < pp and sched != "gpipe":
        _fail(f"{n_mb} microbatches is fewer than pp={pp} for --schedule {sched}: raise --global-batch-size")
    a["num_microbatches"] = n_mb
    return a


def scenario_of(a: dict[str, Any]) -> dict[str, Any]:
    """The manifest's scenario: the train arguments in the shape the Scenario loader reads.

    A SwiGLU model runs torchtitan's Llama 3 on torchtitan's stack (FSDP2 with fp32 gradient
    reduction, DTensor TP with loss parallelism, torch.distributed.pipelining, RoPE and repeat_kv,
    torch's AdamW), eager, with no activation checkpointing and the parameters in the run's
    dtype: framework torchtitan, torch_compile false, training_dtype bfloat16 for bf16 runs. A
    GELU model is GPT-style (no position encoding) and stays framework generic, which prices
    megatron-core's fused kernels and Adam over fp32 masters; its comparisons carry that gap."""
    llama = a["mlp"] == "swiglu"
    framework: dict[str, Any] = {
        "framework": "torchtitan", "torch_compile": False, "recompute": "none",
        "training_dtype": "bfloat16" if a["dtype"] == "bf16" else "float32",
        "optimizer": {"implementation": a.get("optimizer", "fused")},
    } if llama else {}
    if llama and a.get("torch_version"):
        framework["torch_version"] = a["torch_version"]  # what its eager kernels fuse (RMSNorm from 2.9)
    if a.get("attention_kernel"):
        framework["attention_kernel"] = a["attention_kernel"]
    return framework | {
        "model": {
            "num_layers": a["num_layers"],
            "hidden_size": a["hidden_size"],
            "ffn_hidden_size": a["ffn_hidden_size"],
            "num_attention_heads": a["num_heads"],
            "num_kv_heads": a["num_kv_heads"],
            "vocab_size": a["vocab_size"],
            "mlp": a["mlp"],
            "num_experts": a["num_experts"],
            "top_k": a["top_k"] if a["num_experts"] > 1 else 1,
        },
        "parallelism": {
            "tp": a["tp"], "pp": a["pp"], "vpp": a["vpp"], "cp": a["cp"], "ep": a["ep"], "dp": a["dp"],
            "zero": a["zero"], "sequence_parallel": bool(a["sequence_parallel"] and a["tp"] > 1),
        },
        "batch": {
            "micro_batch_size": a["micro_batch_size"],
            "global_batch_size": a["global_batch_size"],
            "seq_length": a["seq_length"],
        },
        "schedule": a["schedule"],
        "dtype": a["dtype"],
    }
