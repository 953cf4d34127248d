"""The `compute` workload: the per-op costs a transformer layer is made of, timed on the device.

GEMMs come from a grid over hidden size x tokens x TP degree for the four projections of a
layer (QKV, attention out-projection, MLP up, MLP down), each in its three passes (fwd, dgrad,
wgrad: [m,k]x[k,n], [m,n]x[n,k], [k,m]x[m,n]). The rest: causal scaled-dot-product attention
(fwd, fwd+bwd), LayerNorm, RMSNorm, GELU, SwiGLU, softmax cross-entropy (fwd+bwd) and an AdamW
step. GPU ops are timed with CUDA events, CPU ops with perf_counter; each row is the median of
repeats run until ``min_time_s`` has passed (at least 3, at most ``max_repeats``).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from simulator.capture.harness import RankContext, WorkloadResult

HEAD_DIM = 64


# torch.cuda._sleep spins for a number of GPU clock cycles; 2 GHz is above the boost clock of every
# NVIDIA datacenter part (H100/H200 SXM 1,980 MHz, nvidia-smi clocks.max.sm), so the sleep lasts
# at least as long as asked.
_SLEEP_CYCLES_PER_S = 2.0e9


def device_time_us(fn: Callable[[], Any], calls: int, host_call_s: float) -> float:
    """Device time of one call, from ``calls`` back-to-back calls queued behind a sleep kernel.

    Events around a single call time the host too: on an H200 an RMSNorm over 8 MB measured 73 us
    that way, where its kernel takes ~5 us, because the GPU idled while Python and the profiler
    launched it (device check, docs/design-notes.md, Round 28). Here the GPU sleeps until the host
    has queued every call, so the span between the events holds only device work."""
    torch.cuda._sleep(int((1.5 * calls * host_call_s + 1e-3) * _SLEEP_CYCLES_PER_S))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e3 / calls


def _bench(ctx: RankContext, fn: Callable[[], Any], min_time_s: float, max_repeats: int) -> tuple[float, int]:
    for _ in range(2):  # first calls pay allocation and kernel selection
        fn()
    ctx.synchronize()
    if ctx.is_cuda:
        # host time to queue one call (no sync), then one call's device time, then groups sized
        # to min_time_s: the median of three groups' per-call device time
        t0 = time.perf_counter()
        fn()
        host_call_s = time.perf_counter() - t0
        ctx.synchronize()
        one_us = device_time_us(fn, 1, host_call_s)
        calls = int(min(max_repeats, max(3, min_time_s / 3 / max(one_us * 1e-6, 1e-7))))
        groups = [device_time_us(fn, calls, host_call_s) for _ in range(3)]
        return statistics.median(groups), 3 * calls
    times_us: list[float] = []
    total_s = 0.0
    while (len(times_us) < 3 or total_s < min_time_s) and len(times_us) < max_repeats:
        t0 = time.perf_counter()
        fn()
        dt_us = (time.perf_counter() - t0) * 1e6
        times_us.append(dt_us)
        total_s += dt_us * 1e-6
    return statistics.median(times_us), len(times_us)


def _gemm_cases(hidden: int, tokens: int, tp: int, ffn: int) -> list[tuple[str, int, int, int]]:
    """(role, m, k, n) of a layer's forward GEMMs on one TP rank."""
    return [
        ("qkv", tokens, hidden, 3 * hidden // tp),
        ("out_proj", tokens, hidden // tp, hidden),
        ("mlp_up", tokens, hidden, ffn // tp),
        ("mlp_down", tokens, ffn // tp, hidden),
    ]


def run(ctx: RankContext) -> WorkloadResult:
    a = ctx.cfg.args
    dev = ctx.device
    dtype = getattr(torch, a["dtype"])
    es = torch.tensor([], dtype=dtype).element_size()
    min_t, max_r = a["min_time_s"], a["max_repeats"]
    rows: list[dict[str, Any]] = []

    def record(op: str, role: str, pass_: str, shape: str, params: dict[str, Any], flops: float, nbytes: float,
               fn: Callable[[], Any]) -> None:
        with torch.profiler.record_function(f"compute:{op}:{role}:{pass_}:{shape}"):
            t_us, reps = _bench(ctx, fn, min_t, max_r)
        rows.append(
            {
                "op": op, "role": role, "pass": pass_, "shape": shape, "params": json.dumps(params, sort_keys=True),
                "hidden_size": params.get("hidden_size"), "tokens": params.get("tokens"), "tp": params.get("tp"),
                "m": params.get("m"), "n": params.get("n"), "k": params.get("k"),
                "flops": float(flops), "bytes": float(nbytes), "dtype": a["dtype"],
                "time_us": t_us, "repeats": reps, "rank": ctx.rank, "device": dev.type,
            }
        )

    with ctx.profiler():
        for h in a["hidden_sizes"]:
            ffn = a["ffn_multiplier"] * h
            heads = max(1, h // HEAD_DIM)
            for t in a["tokens"]:
                for tp in a["tp_sizes"]:
                    if h % tp or ffn % tp or heads % tp:
                        continue
                    base = {"hidden_size": h, "tokens": t, "tp": tp}
                    for role, m, k, n in _gemm_cases(h, t, tp, ffn):
                        for pass_, (mm, kk, nn_) in (("fwd", (m, k, n)), ("dgrad", (m, n, k)), ("wgrad", (k, m, n))):
                            x = torch.randn(mm, kk, device=dev, dtype=dtype)
                            w = torch.randn(kk, nn_, device=dev, dtype=dtype)
                            p = {**base, "m": mm, "n": nn_, "k": kk}
                            record("gemm", role, pass_, f"{mm}x{kk}x{nn_}", p, 2.0 * mm * nn_ * kk,
                                   es * (mm * kk + kk * nn_ + mm * nn_), lambda x=x, w=w: x @ w)
                    # attention over one sequence of t tokens, this TP rank's heads
                    hl = heads // tp
                    q, k_, v = (torch.randn(1, hl, t, HEAD_DIM, device=dev, dtype=dtype, requires_grad=True)
                                for _ in range(3))
                    fl = 4.0 * hl * t * t * HEAD_DIM * 0.5  # causal: half the score matrix
                    p = {**base, "heads": hl, "head_dim": HEAD_DIM, "seq": t, "causal": True}
                    shape = f"1x{hl}x{t}x{HEAD_DIM}"
                    nb = es * 4 * hl * t * HEAD_DIM
                    record("sdpa", "attention", "fwd", shape, p, fl, nb,
                           lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))

                    def sdpa_fb() -> None:  # autograd.grad: no .grad accumulation between repeats
                        out = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
                        torch.autograd.grad(out.sum(), (q, k_, v))

                    # backward is 2.5x the forward matmul work (5 GEMMs against 2)
                    record("sdpa", "attention", "fwd_bwd", shape, p, 3.5 * fl, 3 * nb, sdpa_fb)
                # tp-independent elementwise ops on a [tokens, hidden] activation
                x = torch.randn(t, h, device=dev, dtype=dtype)
                ln = torch.nn.LayerNorm(h, device=dev, dtype=dtype)
                rms = torch.nn.RMSNorm(h, device=dev, dtype=dtype)
                p = {"hidden_size": h, "tokens": t, "tp": 1}
                with torch.no_grad():
                    record("layernorm", "norm", "fwd", f"{t}x{h}", p, 8.0 * t * h, es * 2 * t * h, lambda: ln(x))
                    record("rmsnorm", "norm", "fwd", f"{t}x{h}", p, 4.0 * t * h, es * 2 * t * h, lambda: rms(x))
                    u = torch.randn(t, ffn, device=dev, dtype=dtype)
                    g = torch.randn(t, ffn, device=dev, dtype=dtype)
                    pf = {"hidden_size": h, "tokens": t, "tp": 1, "ffn_hidden_size": ffn}
                    record("gelu", "mlp_act", "fwd", f"{t}x{ffn}", pf, 8.0 * t * ffn, es * 2 * t * ffn,
                           lambda: F.gelu(u))
                    record("swiglu", "mlp_act", "fwd", f"{t}x{ffn}", pf, 6.0 * t * ffn, es * 3 * t * ffn,
                           lambda: F.silu(u) * g)
            for t in a["tokens"]:
                for vocab in a["vocab_sizes"]:
                    logits = torch.randn(t, vocab, device=dev, dtype=dtype, requires_grad=True)
                    target = torch.randint(0, vocab, (t,), device=dev)

                    def ce() -> None:
                        torch.autograd.grad(F.cross_entropy(logits, target), (logits,))

                    p = {"tokens": t, "vocab_size": vocab}
                    # each tensor once: log-softmax reads the logits and writes its output, nll
                    # gathers; backward fills the gradient, log-softmax backward reads the
                    # gradient and output and writes its own (rows of tens of thousands of logits
                    # are read more than once: the fitted rate carries that)
                    record("cross_entropy", "loss", "fwd_bwd", f"{t}x{vocab}", p, 10.0 * t * vocab,
                           es * 6 * t * vocab, ce)
        for numel in a["adamw_numels"]:
            param = torch.nn.Parameter(torch.randn(numel, device=dev, dtype=dtype))
            param.grad = torch.randn_like(param)
            opt = torch.optim.AdamW([param], lr=1e-4)
            # torch's default AdamW on a GPU is the multi-tensor one (torch/optim/adam.py
            # _multi_tensor_adam, decoupled weight decay, steps on the host): eight in-place passes,
            # mul_ p (2 tensors moved), lerp_ m g (3), mul_ v (2), addcmul_ v g g (3: g once),
            # sqrt v (2), div_ (2), add_ eps (2), addcdiv_ p m d (4) = 20 tensors a parameter
            record("adamw", "optimizer", "step", str(numel), {"numel": numel}, 12.0 * numel, es * 20 * numel, opt.step)

    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    table = pd.DataFrame([r for part in gathered for r in part])
    return WorkloadResult(tables={"compute": table}, notes=[f"compute timed on {dev.type}; one row per rank and op"])
