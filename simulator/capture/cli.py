"""``clustersim capture WORKLOAD --out traces/<name>``: run a real torch workload, write a bundle.

Importable without torch: the harness and workloads are imported inside ``capture_command``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from simulator.capture.spec import BACKENDS, SCHEDULES, WORKLOADS, validate_train
from simulator.errors import UserError

_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _ints(flag: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        vals = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r} must be comma-separated integers, e.g. 256,512") from None
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"{flag} {text!r} must list positive integers, e.g. 256,512")
    return vals


def _torchrun_world() -> int | None:
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return int(os.environ["WORLD_SIZE"])
    return None


def _check_capture_numbers(nproc, threads_per_rank, timeout_s, factor, min_time_s, max_repeats) -> None:
    """Counts and times that torch would take and then hang or crash on; one line each."""
    import math

    if nproc is not None and not 1 <= nproc <= 1024:
        raise UserError(f"--nproc {nproc} must be between 1 and 1024 local ranks")
    if threads_per_rank is not None and not 1 <= threads_per_rank <= 4096:
        raise UserError(f"--threads-per-rank {threads_per_rank} must be between 1 and 4096")
    if not math.isfinite(timeout_s) or timeout_s < 1:
        # (below a second, the ranks' rendezvous itself times out before any collective runs)
        raise UserError(f"--timeout-s {timeout_s} must be at least 1 second (torch's default is 600)")
    if not math.isfinite(factor):
        raise UserError(f"--factor {factor} must be a finite number above 1")
    if not math.isfinite(min_time_s) or min_time_s < 0:
        raise UserError(f"--min-time-s {min_time_s} must be a finite number of seconds, at least 0")
    if max_repeats < 1:
        raise UserError(f"--max-repeats {max_repeats} must be at least 1")


def capture_command(
    workload: Annotated[str, typer.Argument(help="collectives | compute | train")],
    out: Annotated[Path, typer.Option("--out", help="Bundle folder to create, e.g. traces/<name>.")],
    nproc: Annotated[Optional[int], typer.Option(help="Local ranks to start (ignored under torchrun). Default: train tp*pp*cp*dp, collectives 2 (GPUs: all), compute 1.")] = None,
    backend: Annotated[str, typer.Option(help="gloo (CPU) or nccl (GPUs).")] = "gloo",
    steps: Annotated[int, typer.Option(help="Measured (and profiled) train steps.")] = 3,
    warmup_steps: Annotated[int, typer.Option(help="Train steps run before measuring.")] = 1,
    force: Annotated[bool, typer.Option(help="Replace an existing --out.")] = False,
    dtype: Annotated[Optional[str], typer.Option(help="fp32 | bf16 | fp16. Default fp32 on gloo, bf16 on nccl.")] = None,
    threads_per_rank: Annotated[Optional[int], typer.Option(help="torch CPU threads per rank. Default: cores / nproc.")] = None,
    timeout_s: Annotated[float, typer.Option(help="Collective timeout, seconds.")] = 600.0,
    # collectives
    min_bytes: Annotated[int, typer.Option(help="collectives: smallest message, bytes.")] = 1024,
    max_bytes: Annotated[Optional[int], typer.Option(help="collectives: largest message, bytes. Default 4 MiB on gloo, 1 GiB on nccl.")] = None,
    factor: Annotated[float, typer.Option(help="collectives: size multiplier between rows.")] = 2.0,
    iters: Annotated[int, typer.Option(help="collectives: timed iterations per row.")] = 20,
    warmup_iters: Annotated[int, typer.Option(help="collectives: warm-up iterations per row.")] = 5,
    group_sizes: Annotated[Optional[str], typer.Option(help="collectives: comma list. Default powers of two below N, and N.")] = None,
    collectives: Annotated[Optional[str], typer.Option(help="collectives: comma list of all_reduce,all_gather,reduce_scatter,all_to_all,send_recv,broadcast.")] = None,
    # compute
    hidden_sizes: Annotated[Optional[str], typer.Option(help="compute: comma list. Default 256,512 on CPU; 1024..8192 on GPU.")] = None,
    tokens: Annotated[Optional[str], typer.Option(help="compute: comma list of tokens per GEMM / sequence length.")] = None,
    tp_sizes: Annotated[Optional[str], typer.Option(help="compute: comma list of TP splits.")] = None,
    vocab_sizes: Annotated[Optional[str], typer.Option(help="compute: comma list for cross-entropy.")] = None,
    adamw_numels: Annotated[Optional[str], typer.Option(help="compute: comma list of parameter counts for the AdamW step.")] = None,
    min_time_s: Annotated[float, typer.Option(help="compute: least time spent repeating one op.")] = 0.02,
    max_repeats: Annotated[int, typer.Option(help="compute: most repeats of one op.")] = 50,
    # train: the same parallelism / schedule / batch flags as `clustersim simulate`
    tp: Annotated[int, typer.Option(help="train: tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option(help="train: pipeline-parallel size.")] = 1,
    vpp: Annotated[Optional[int], typer.Option(help="train: virtual stages per pipeline rank (interleaved; 2 for V schedules).")] = None,
    dp: Annotated[Optional[int], typer.Option(help="train: data-parallel size (ep included). Default: world / (tp*pp*cp).")] = None,
    cp: Annotated[int, typer.Option(help="train: context-parallel size (only 1 is captured).")] = 1,
    ep: Annotated[int, typer.Option(help="train: expert-parallel size, carved out of dp.")] = 1,
    # The same default as `clustersim simulate` (ParallelConfig.zero): a capture and the scenario it
    # records agree unless the user asks otherwise.
    zero: Annotated[int, typer.Option(help="train: ZeRO stage; 0 DDP (FSDP2 replicate), 1/2 FSDP2 reshard_after_forward=False, 3 FSDP2 full sharding. Default 1, as in `clustersim simulate`.")] = 1,
    schedule: Annotated[str, typer.Option(help=f"train: {', '.join(SCHEDULES)}.")] = "1f1b",
    micro_batch_size: Annotated[int, typer.Option(help="train: sequences per microbatch.")] = 1,
    global_batch_size: Annotated[Optional[int], typer.Option(help="train: sequences per step. Default micro x dp x max(2, 2pp).")] = None,
    seq_length: Annotated[int, typer.Option(help="train: tokens per sequence.")] = 64,
    num_layers: Annotated[int, typer.Option(help="train: decoder layers.")] = 4,
    hidden_size: Annotated[int, typer.Option(help="train: model width.")] = 64,
    num_heads: Annotated[int, typer.Option(help="train: attention heads.")] = 4,
    num_kv_heads: Annotated[Optional[int], typer.Option(help="train: key/value heads (GQA). Default num-heads.")] = None,
    ffn_hidden_size: Annotated[Optional[int], typer.Option(help="train: MLP width. Default 4 x hidden.")] = None,
    vocab_size: Annotated[int, typer.Option(help="train: vocabulary.")] = 512,
    num_experts: Annotated[int, typer.Option(help="train: experts per MoE layer (0 or 1: dense).")] = 0,
    top_k: Annotated[int, typer.Option(help="train: experts per token.")] = 2,
    mlp: Annotated[str, typer.Option(help="train: gelu (GPT-style, LayerNorm; framework generic) or swiglu (torchtitan's Llama 3: RMSNorm, RoPE, repeat_kv; framework torchtitan).")] = "gelu",
    sequence_parallel: Annotated[bool, typer.Option(help="train: sequence parallelism with tp > 1 (always on in torchtitan: needed with --mlp swiglu).")] = False,
    optimizer: Annotated[str, typer.Option(help="train: torch AdamW implementation, fused (torchtitan's default) or foreach.")] = "fused",
) -> None:
    """Capture a real torch run (gloo on CPU, NCCL on GPUs) into a trace bundle."""
    if workload not in WORKLOADS:
        raise UserError(f"workload {workload!r} is unknown: use one of {', '.join(WORKLOADS)}")
    if backend not in BACKENDS:
        raise UserError(f"--backend {backend!r} must be gloo or nccl")
    _check_capture_numbers(nproc=nproc, threads_per_rank=threads_per_rank, timeout_s=timeout_s, factor=factor,
                           min_time_s=min_time_s, max_repeats=max_repeats)
    if steps < 1 or warmup_steps < 0:
        raise UserError(f"--steps {steps} must be >= 1 and --warmup-steps {warmup_steps} >= 0")
    gpu = backend == "nccl"
    dt = _DTYPES.get(dtype or ("bf16" if gpu else "fp32"))
    if dt is None:
        raise UserError(f"--dtype {dtype!r} must be fp32, bf16 or fp16")

    world = _torchrun_world()
    if world is not None and nproc is not None and nproc != world:
        raise UserError(f"--nproc {nproc} differs from torchrun's WORLD_SIZE {world}: drop --nproc under torchrun")

    args: dict[str, Any]
    if workload == "collectives":
        if min_bytes < 1 or factor <= 1 or iters < 1 or warmup_iters < 0:
            raise UserError(f"--min-bytes {min_bytes} must be >= 1, --factor {factor} > 1, --iters {iters} >= 1, --warmup-iters >= 0")
        mx = max_bytes if max_bytes is not None else (1 << 30 if gpu else 4 << 20)
        if mx < min_bytes:
            raise UserError(f"--max-bytes {mx} is below --min-bytes {min_bytes}")
        if collectives is not None and not collectives.strip(" ,"):
            raise UserError("--collectives is empty: name some of all_reduce, all_gather, reduce_scatter, all_to_all, "
                            "send_recv, broadcast, or leave it out for all of them")
        colls = [c.strip() for c in collectives.split(",")] if collectives else None
        known = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
        for c in colls or []:
            if c not in known:
                raise UserError(f"--collectives entry {c!r} is unknown: use {', '.join(known)}")
        if world is None:
            world = nproc or (_gpu_count() if gpu else 2)
        if world < 2:
            raise UserError(f"the collectives sweep needs at least 2 ranks, not {world}: pass --nproc 2 or more")
        if not gpu:
            # gloo's ranks share this host's memory; an all-gather's output is world x the message
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
            ranks = world
            if ram and 2 * ranks * ranks * mx > ram:
                raise UserError(f"--max-bytes {mx:,}: {ranks} gloo ranks' all-gather buffers (2 x ranks^2 x message) "
                                f"need more than this host's {ram / 2**30:.0f} GiB of memory: lower --max-bytes")
        gs = _ints("--group-sizes", group_sizes)
        for g in gs or []:
            if not 2 <= g <= world:
                raise UserError(f"--group-sizes entry {g} must be between 2 and the world size {world}")
        args = {"min_bytes": min_bytes, "max_bytes": mx, "factor": factor, "iters": iters, "warmup_iters": warmup_iters,
                "group_sizes": gs, "collectives": colls, "dtype": dt}
    elif workload == "compute":
        if world is None:
            world = nproc or 1
        args = {
            "hidden_sizes": _ints("--hidden-sizes", hidden_sizes) or ([1024, 2048, 4096, 8192] if gpu else [256, 512]),
            "tokens": _ints("--tokens", tokens) or ([1024, 4096, 16384] if gpu else [256, 1024]),
            "tp_sizes": _ints("--tp-sizes", tp_sizes) or ([1, 2, 4, 8] if gpu else [1, 2]),
            "vocab_sizes": _ints("--vocab-sizes", vocab_sizes) or ([32768, 131072] if gpu else [4096]),
            "adamw_numels": _ints("--adamw-numels", adamw_numels) or ([1 << 24, 1 << 27] if gpu else [1 << 20]),
            "ffn_multiplier": 4,
            "min_time_s": min_time_s,
            "max_repeats": max_repeats,
            "dtype": dt,
        }
    else:
        if dt == "float16":
            raise UserError("--dtype fp16 is not a train dtype: use fp32 or bf16")
        if world is None:
            world = nproc or tp * pp * cp * (dp or 1)
        args = validate_train(
            {
                "tp": tp, "pp": pp, "vpp": vpp, "dp": dp, "cp": cp, "ep": ep, "zero": zero, "schedule": schedule,
                "micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size,
                "seq_length": seq_length, "num_layers": num_layers, "hidden_size": hidden_size,
                "num_heads": num_heads, "num_kv_heads": num_kv_heads, "ffn_hidden_size": ffn_hidden_size,
                "vocab_size": vocab_size, "num_experts": num_experts, "top_k": top_k, "mlp": mlp,
                "sequence_parallel": sequence_parallel, "dtype": _SHORT[dt], "optimizer": optimizer,
            },
            world,
        )
    if world < 1:
        raise UserError(f"--nproc {world} must be at least 1")
    try:
        import torch  # noqa: F401  (capture runs real PyTorch: the harness needs it)
    except ImportError:
        raise UserError('capture runs real PyTorch, which is not installed here: pip install -e ".[capture]" '
                        '(or pip install torch)') from None
    if gpu and _torchrun_world() is None and world > _gpu_count():
        raise UserError(f"--nproc {world} exceeds the {_gpu_count()} visible GPUs: lower --nproc or use torchrun across nodes")
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world)

    from simulator.capture.harness import CaptureConfig, check_out_dir, in_torchrun, launch

    check_out_dir(out, force)
    cfg = CaptureConfig(
        workload=workload, out_dir=str(out), backend=backend, steps=steps, warmup_steps=warmup_steps,
        args=args, force=force, timeout_s=timeout_s, threads_per_rank=threads,
    )
    bundle = launch(cfg, world)
    if in_torchrun() and int(os.environ["RANK"]) != 0:
        return
    _print_summary(bundle, workload)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _print_summary(bundle: Path, workload: str) -> None:
    import pandas as pd

    from simulator.trace.bundle import load_manifest
    from simulator.words import plural

    m = load_manifest(bundle)
    size = sum(p.stat().st_size for p in bundle.iterdir() if p.is_file())
    logs = "; rank stderr (profiler messages) in rank*.stderr.log" if (bundle / "rank0.stderr.log").exists() else ""
    typer.echo(f"wrote {bundle} ({size / 1e6:.2f} MB): {plural(m.world_size, 'rank')}, {m.backend}, "
               f"{plural(len(m.trace_files), 'trace')}{logs}")
    if workload == "collectives":
        df = pd.read_parquet(bundle / "collectives.parquet")
        with pd.option_context("display.max_rows", None, "display.width", 200):
            typer.echo(df[["collective", "group_size", "size_bytes", "count", "dtype", "time_us", "algbw_GBps",
                           "busbw_GBps"]].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    elif workload == "compute":
        df = pd.read_parquet(bundle / "compute.parquet")
        typer.echo(f"{len(df)} op timings; median {df['time_us'].median():.1f} us")
    elif m.step_times:
        ts = sorted(s.wall_s for s in m.step_times)
        typer.echo(f"step time median {ts[len(ts) // 2] * 1e3:.1f} ms over {plural(len(ts), 'step')}")


capture_app = typer.Typer(add_completion=False)
capture_app.command("capture")(capture_command)
