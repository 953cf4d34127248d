"""Kernel measurements on one GPU that the capture workloads do not take: FP8 against BF16 GEMMs
by shape, FlashAttention by backend and shape, the HBM copy ceiling, and how much a GEMM (and a
memory-bound kernel) slows down while a resident kernel holds N SMs the way NCCL's CTAs do.

Run on the device machine by bench/device/capture_h200.sh; writes ``kernels.csv`` and
``kernels-meta.json`` to the folder given. Every section is guarded: one that fails is logged and
the rest still run. The comparison with the simulator's kernel model runs afterwards, on any
machine, with bench/device/compare_kernels.py.

Timing: CUDA events around ``reps`` back-to-back calls (sized to ~20 ms) queued behind a sleep
kernel so that the events hold device time only, median of 3 such groups, after 3 warm-up calls. Operands stay in L2 between calls when they fit (60 MB on an H200), as the
capture workloads' timings do.

The contention interferer (CUDA C compiled by CuPy's NVRTC) launches N blocks of 512 threads
(NCCL's NCCL_SIMPLE_MAX_NTHREADS, NCCL-MODEL.md), each resident on its own SM until a stop flag
is set: ``spin`` holds the SM and moves no bytes; ``copy`` also streams a 512 MiB buffer through
HBM as fast as N blocks can. NCCL's CTAs are between the two: they hold their SMs and move bytes
at link rate. The simulator's law (simulator/contention.py) predicts sm_count / (sm_count - N)
for a compute-bound kernel.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from rows_csv import write_rows_csv  # beside this script (python3 bench/device/kernels_h200.py)

from simulator.capture.compute import device_time_us  # the repository root is on PYTHONPATH (capture_h200.sh)

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
OUT.mkdir(parents=True, exist_ok=True)
DEV = torch.device("cuda")
ROWS: list[dict] = []
META: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "errors": []}
TARGET_GROUP_S = 0.020


def bench_s(fn, target_s: float = TARGET_GROUP_S) -> float:
    """Device seconds per call: median of 3 groups of back-to-back calls timed with CUDA events,
    each group queued behind a sleep kernel (capture compute's device_time_us). Round 28 timed the
    groups without it: a call whose kernel is shorter than its host issue (torch._scaled_mm's
    ~27 us on the H200) then measured the host, e.g. every FP8 GEMM of 27 us or less."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_call_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    one_s = max(device_time_us(fn, 1, host_call_s) * 1e-6, 1e-6)
    reps = int(min(1000, max(3, target_s / one_s)))
    return statistics.median(device_time_us(fn, reps, host_call_s) * 1e-6 for _ in range(3))


def row(section: str, name: str, time_s: float, **kw) -> None:
    r = {"section": section, "name": name, "time_us": round(time_s * 1e6, 3)}
    r.update(kw)
    ROWS.append(r)
    print(section, name, {k: v for k, v in r.items() if k not in ("section", "name")}, flush=True)


def guarded(fn):
    def wrapper():
        t0 = time.time()
        try:
            fn()
        except Exception as exc:  # a failed section is logged; the others still run
            META["errors"].append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        print(f"== {fn.__name__}: {time.time() - t0:.1f} s", flush=True)
    return wrapper


# (label, m, n, k): C[m, n] = A[m, k] @ B[k, n]
GEMM_SHAPES = [
    *[(f"square{s}", s, s, s) for s in (1024, 2048, 4096, 8192, 16384)],
    # Llama-3-8B at 2 x 8192 tokens (torchtitan's 8B rows): fwd of each projection, and the
    # MLP up's dgrad and wgrad
    ("l8b_qkv", 16384, 6144, 4096), ("l8b_out", 16384, 4096, 4096),
    ("l8b_up_gate", 16384, 28672, 4096), ("l8b_down", 16384, 4096, 14336),
    ("l8b_up_dgrad", 16384, 4096, 28672), ("l8b_up_wgrad", 4096, 28672, 16384),
    ("l8b_lm_head", 16384, 128256, 4096),
    # Llama-3-70B per TP8 rank at 8192 tokens
    ("l70b_tp8_qkv", 8192, 1280, 8192), ("l70b_tp8_out", 8192, 8192, 1024),
    ("l70b_tp8_up_gate", 8192, 7168, 8192), ("l70b_tp8_down", 8192, 8192, 3584),
    # skinny: memory-bound at small m, where FP8 should gain little
    *[(f"skinny_m{m}", m, 8192, 8192) for m in (16, 64, 256, 1024)],
]


@guarded
def gemms() -> None:
    fp8 = getattr(torch, "float8_e4m3fn", None)
    for label, m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=DEV, dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        t = bench_s(lambda: torch.matmul(a, b))
        row("gemm", label, t, m=m, n=n, k=k, dtype="bf16", variant="matmul", tflops=round(flops / t / 1e12, 1))
        if fp8 is None:
            continue
        a8 = a.to(fp8)
        b8 = b.t().contiguous().to(fp8).t()  # _scaled_mm wants B column-major
        one = torch.ones((), device=DEV, dtype=torch.float32)
        ra = torch.ones(m, 1, device=DEV, dtype=torch.float32)
        rb = torch.ones(1, n, device=DEV, dtype=torch.float32)
        for variant, sa, sb, fast in (("tensorwise", one, one, False), ("tensorwise_fastacc", one, one, True),
                                      ("rowwise", ra, rb, False)):
            try:
                fn = lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                              use_fast_accum=fast)
                t = bench_s(fn)
                row("gemm", label, t, m=m, n=n, k=k, dtype="fp8", variant=variant,
                    tflops=round(flops / t / 1e12, 1))
            except Exception as exc:
                META["errors"].append(f"gemm {label} fp8 {variant}: {type(exc).__name__}: {exc}")
        del a, b, a8, b8
    torch.cuda.empty_cache()


@guarded
def fp8_casts() -> None:
    """Per-tensor current scaling in eager torch: amax, scale, cast (TE fuses these into one)."""
    fp8 = torch.float8_e4m3fn
    for m, k in ((16384, 4096), (16384, 14336), (8192, 8192)):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)

        def quant():
            amax = x.abs().amax().float()
            scale = 448.0 / torch.clamp(amax, min=1e-12)
            return (x.float() * scale).to(fp8)

        t = bench_s(quant)
        row("fp8_cast", "amax_scale_cast_eager", t, m=m, k=k, bytes=m * k * 3,
            gbps=round(m * k * 3 / t / 1e9, 1))
        t = bench_s(lambda: x.to(fp8))
        row("fp8_cast", "cast_only", t, m=m, k=k, bytes=m * k * 3, gbps=round(m * k * 3 / t / 1e9, 1))
        del x


# (batch, sequence, causal): 16,384 tokens at four lengths (round 28's shapes), plus 2,048 and
# 4,096 tokens at one sequence each and one unmasked kernel. With the token count fixed the CTA
# count was too (fit_attention.py could not tell a per-CTA cost from a per-token one); the
# unmasked kernel has no diagonal tiles.
ATTENTION_SHAPES = [(16384 // s, s, True) for s in (2048, 4096, 8192, 16384)] + [(1, 2048, True), (1, 4096, True),
                                                                                   (2, 8192, False)]


@guarded
def attention() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads = 32
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        for head_dim in (64, 128):
            for batch, seq, causal in ATTENTION_SHAPES:
                shape = (batch, heads, seq, head_dim)
                q, k, v = (torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
                g = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
                try:
                    with sdpa_kernel(backend):
                        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        t_f = bench_s(fwd)

                        def fwd_bwd():  # autograd.grad: no .grad accumulation kernels between calls
                            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            torch.autograd.grad(out, (q, k, v), g)

                        t_fb = bench_s(fwd_bwd)
                    flops = 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
                    common = dict(batch=batch, heads=heads, seq=seq, head_dim=head_dim, causal=causal,
                                  variant=backend.name.lower())
                    row("attention", "sdpa_fwd", t_f, tflops=round(flops / t_f / 1e12, 1), **common)
                    row("attention", "sdpa_fwd_bwd", t_fb, tflops=round(3.5 * flops / t_fb / 1e12, 1), **common)
                except Exception as exc:
                    META["errors"].append(f"attention {backend.name} d{head_dim} b{batch} s{seq} causal {causal}: "
                                          f"{type(exc).__name__}: {exc}")
                del q, k, v, g


@guarded
def hbm() -> None:
    x = torch.empty(1 << 30, device=DEV, dtype=torch.uint8)  # 1 GiB, far past the 60 MB L2
    y = torch.empty_like(x)
    t = bench_s(lambda: y.copy_(x))
    row("memory", "copy_1GiB", t, bytes=2 << 30, gbps=round((2 << 30) / t / 1e9, 1))
    z = torch.empty(1 << 29, device=DEV, dtype=torch.bfloat16)
    t = bench_s(lambda: z.mul_(1.0))
    row("memory", "scale_inplace_1GiB", t, bytes=2 << 30, gbps=round((2 << 30) / t / 1e9, 1))
    del x, y, z


INTERFERER = r"""
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void interfere(const float4* __restrict__ src, float4* __restrict__ dst,
                                     long long n4, int mode, const volatile int* stop,
                                     unsigned long long max_ns, unsigned long long* moved_bytes) {
    __shared__ int done;
    long long per_block = n4 / gridDim.x;
    const float4* s = src + blockIdx.x * per_block;
    float4* d = dst + blockIdx.x * per_block;
    unsigned long long t0 = now_ns();
    unsigned long long moved = 0;
    while (true) {
        if (mode == 1) {
            for (long long i = threadIdx.x; i < per_block; i += blockDim.x) d[i] = s[i];
            moved += (unsigned long long)per_block * 32ull;  // 16 B read + 16 B written
        } else {
            unsigned long long t = now_ns();
            while (now_ns() - t < 2000ull) { }
        }
        if (threadIdx.x == 0) done = (*stop != 0) || (now_ns() - t0 > max_ns);
        __syncthreads();
        if (done) break;
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(moved_bytes, moved);
}
"""


@guarded
def contention() -> None:
    import cupy as cp
    import numpy as np

    kernel = cp.RawKernel(INTERFERER, "interfere")
    sm_count = torch.cuda.get_device_properties(DEV).multi_processor_count
    META["sm_count"] = sm_count
    buf_bytes = 512 << 20
    src = torch.randn(buf_bytes // 4, device=DEV, dtype=torch.float32)
    dst = torch.empty_like(src)
    stop = torch.zeros(1, device=DEV, dtype=torch.int32)
    moved = torch.zeros(1, device=DEV, dtype=torch.int64)
    n4 = buf_bytes // 16
    side = torch.cuda.Stream()

    def launch(blocks: int, mode: int, max_ns: int) -> None:
        with cp.cuda.ExternalStream(side.cuda_stream):
            kernel((blocks,), (512,), (cp.from_dlpack(src), cp.from_dlpack(dst), np.int64(n4), np.int32(mode),
                                       cp.from_dlpack(stop), np.uint64(max_ns), cp.from_dlpack(moved)))

    # The interferer alone: what N copying blocks move through HBM.
    for blocks in (8, 16, 24, 32, 48, 64):
        stop.zero_(); moved.zero_(); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            e0.record()
        launch(blocks, 1, 20_000_000)
        with torch.cuda.stream(side):
            e1.record()
        torch.cuda.synchronize()
        t = e0.elapsed_time(e1) * 1e-3
        row("contention", "interferer_alone", t, sms_taken=blocks, mode="copy",
            gbps=round(int(moved.item()) / t / 1e9, 1))

    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(1 << 29, device=DEV, dtype=torch.bfloat16)
    q, k, v = (torch.randn(2, 32, 8192, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    a_l, b_l = (torch.randn(16384, 4096, device=DEV, dtype=torch.bfloat16),
                torch.randn(4096, 14336, device=DEV, dtype=torch.bfloat16))
    targets = {
        "gemm_bf16_8192cube": lambda: torch.matmul(a, b),
        "gemm_bf16_l8b_up": lambda: torch.matmul(a_l, b_l),
        "scale_inplace_1GiB": lambda: x.mul_(1.0),
        "sdpa_fwd_s8192_d128": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    for name, fn in targets.items():
        alone_s = bench_s(fn)
        reps = max(3, int(0.02 / alone_s))
        row("contention", name, alone_s, sms_taken=0, mode="alone", reps=reps)
        for mode_name, mode in (("spin", 0), ("copy", 1)):
            for blocks in (8, 16, 24, 32, 48, 64):
                groups, rates, timed_out = [], [], 0
                # The interferer stops on the flag; its own limit (5x the loop alone, plus 5 ms)
                # only guards against a flag never seen.
                max_ns = int((reps * alone_s * 5 + 0.005) * 1e9)
                for _ in range(3):
                    stop.zero_(); moved.zero_(); torch.cuda.synchronize()
                    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(side):
                        s0.record()
                    launch(blocks, mode, max_ns)
                    with torch.cuda.stream(side):
                        s1.record()
                    torch.cuda._sleep(2_000_000)  # ~1 ms: the interferer's blocks are resident first
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    for _ in range(reps):
                        fn()
                    e1.record()
                    stop.fill_(1)
                    torch.cuda.synchronize()
                    groups.append(e0.elapsed_time(e1) * 1e-3 / reps)
                    side_s = s0.elapsed_time(s1) * 1e-3
                    rates.append(int(moved.item()) / side_s)
                    timed_out += side_s * 1e9 >= max_ns  # stopped by its limit, not the flag
                t = statistics.median(groups)
                row("contention", name, t, sms_taken=blocks, mode=mode_name, reps=reps,
                    slowdown=round(t / alone_s, 4), sm_share_law=round(sm_count / (sm_count - blocks), 4),
                    interferer_gbps=round(statistics.median(rates) / 1e9, 1), interferer_timed_out=timed_out)


def _smi_sample() -> tuple[float, float] | None:
    """(SM clock MHz, board power W) now, read with nvidia-smi (reading changes no setting)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                              f"--id={torch.cuda.current_device()}"], capture_output=True, text=True, timeout=5).stdout
        mhz, watts = (float(x) for x in out.strip().split(","))
        return mhz, watts
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


@guarded
def clocks() -> None:
    """The SM clock and board power the GPU settles at under sustained work (~3 s each): what a
    power limit would have to take the clock down from (the torchtitan H100 rows ran at 500 W;
    nothing here changes the limit). Idle first, then a BF16 and an FP8 GEMM loop and FlashAttention."""
    import threading

    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    fp8 = torch.float8_e4m3fn
    a8, b8 = a.to(fp8), b.t().contiguous().to(fp8).t()
    one = torch.ones((), device=DEV)
    q = torch.randn(2, 32, 8192, 128, device=DEV, dtype=torch.bfloat16)
    loads = {"idle": None, "gemm_bf16_8192cube": lambda: a @ b,
             "gemm_fp8_8192cube": lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
             "flash_fwd_s8192_d128": lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)}
    for name, fn in loads.items():
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                got = _smi_sample()
                if got:
                    samples.append(got)
                time.sleep(0.2)

        t_end = time.time() + 3.0
        if fn is not None:
            for _ in range(20):
                fn()  # ramp before sampling
        th = threading.Thread(target=sample)
        th.start()
        while time.time() < t_end:
            if fn is None:
                time.sleep(0.05)
                continue
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        stop.set()
        th.join()
        if samples:
            tail = samples[len(samples) // 3:]  # after the clock has settled
            row("clocks", name, 0.0, sm_mhz=statistics.median(s[0] for s in tail),
                power_w=statistics.median(s[1] for s in tail), samples=len(tail))


def main() -> None:
    props = torch.cuda.get_device_properties(DEV)
    META.update(name=props.name, sm_count=props.multi_processor_count, total_memory=props.total_memory,
                l2_bytes=getattr(props, "L2_cache_size", None))
    print(META, flush=True)
    t0 = time.time()
    for section in (hbm, gemms, fp8_casts, attention, contention, clocks):
        section()
    META["seconds"] = round(time.time() - t0, 1)
    write_rows_csv(ROWS, OUT / "kernels.csv")
    (OUT / "kernels-meta.json").write_text(json.dumps(META, indent=1))
    print(f"{len(ROWS)} rows, {len(META['errors'])} errors, {META['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
