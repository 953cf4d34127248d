"""Kernels by shape: the time of one GPU kernel from what it computes, not from one efficiency
curve over FLOPs.

GEMM (C[b, M, N] = A @ B, inner K): the library tiles C into threadblock tiles (tm x tn) and runs
them in waves of one tile per SM (CUTLASS/cuBLAS: one persistent CTA per SM for large tiles):

    tiles  = b * ceil(M / tm) * ceil(N / tn) * split_k
    waves  = ceil(tiles / sm_count)
    t_tile = 2 * tm * tn * (ceil(K / split_k) + k_overhead) / (peak_per_SM * eff[dtype] * tile_eff(tm, tn))
    t      = waves * t_tile (+ split-K partials through HBM) , the fastest tile / split choice

``k_overhead`` is the prologue (pipeline fill) and epilogue (writing the tile) of each tile in
units of K, so short-K GEMMs (attention's q.k with K = head dim) run below peak.
``tile_eff`` = min(1, I(tm, tn) / I(128, 128)) with I = tm*tn / (tm + tn) the tile's arithmetic
intensity (operand bytes re-read per FLOP grow as tiles shrink). A GEMM is never faster than
moving its operands: t >= bytes / (HBM x efficiency).

Memory-bound kernels: bytes / (HBM x mem_efficiency[op class]).
FlashAttention-2/3 (fused): by FlashAttention-2's tiles (forward a CTA per 128 query rows,
backward a CTA per 128 keys), 4 bm bn d FLOPs a tile forward, 2.5x that backward (five matmuls
against two, Dao 2023 Sec. 4.1); causal masks skip the tiles above the diagonal and compute the
diagonal ones whole; the tile's matmuls run at the attention efficiency, its scores' softmax at a
score rate and each CTA pays a fixed cost where the profile measures them (else the efficiency,
the published throughput at the benchmark's shape, covers the whole tile).
Every kernel pays ``launch_floor_us``.

The free constants (GEMM efficiency per dtype, k_overhead, memory efficiency per class, launch
floor) are fitted by ``fit_kernel_model`` from measured per-op tables; the shipped spec profiles
carry sourced defaults.
"""

from __future__ import annotations

import math

import numpy as np

from simulator.profile import KernelModel, Profile
from simulator.errors import UserError
from simulator.workload.kernels import Kernel

# CUTLASS's default large tile (128x128) is the reference intensity; the tile menu follows
# CUTLASS 2.x/3.x defaults for Ampere/Hopper (128x128, 128x256, 256x128, 128x64, 64x64).
_REF_INTENSITY = 128 * 128 / 256
DTYPES = ("fp32", "bf16", "fp16", "fp8")
# Streaming kernels (BabelStream copy/triad) reach 0.85-0.92 of the datasheet HBM bandwidth on
# A100 and H100 (Deakin et al., BabelStream results; NVIDIA's STREAM figures): the fit's bound.
MAX_MEM_EFFICIENCY = 0.92
# HBM efficiency of a memory-bound kernel whose class a kernel model lacks and that has no
# 'default' entry either. No measured source: every shipped GPU profile carries 'default' and
# 'gemm' (spec_sources.py measures them), so only hand-written profiles reach this.
FALLBACK_MEM_EFFICIENCY = 0.8
# The least efficiency (GEMM or HBM) a fit may return: a search bound, no source; a fitted value
# there is flagged low confidence.
MIN_FIT_EFFICIENCY = 0.05


def normalize_dtype(dtype: str) -> str:
    d = str(dtype).replace("torch.", "").lower()
    return {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
            "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}.get(d, d)


def peak_flops(profile: Profile, dtype: str) -> float:
    """Dense peak FLOP/s of the device in dtype."""
    c = profile.compute
    d = normalize_dtype(dtype)
    if d == "fp32":
        if c.peak_tflops_fp32 is None:
            raise UserError(f"profile {profile.name!r} has no peak_tflops_fp32: use dtype bf16 (or fp16), or add the device's "
                            f"FP32 peak (datasheet) to a copy of the profile to simulate fp32")
        return c.peak_tflops_fp32 * 1e12
    if d == "mxfp8":
        return (c.peak_tflops_mxfp8 or c.peak_tflops_fp8 or c.peak_tflops) * 1e12
    if d == "fp8":
        return (c.peak_tflops_fp8 or c.peak_tflops) * 1e12
    return c.peak_tflops * 1e12


def kernel_model_of(profile: Profile) -> KernelModel:
    """The profile's kernel model, or one derived from its class curves (old profiles)."""
    if profile.compute.kernels is not None:
        return profile.compute.kernels
    cls = profile.compute.classes
    g = cls["gemm"]
    eff = g.peak_efficiency
    mem = {name: m.bandwidth_efficiency for name, m in cls.items()}
    mem["default"] = cls.get("elementwise", g).bandwidth_efficiency
    return KernelModel(gemm_efficiency={"bf16": eff, "fp16": eff, "fp8": eff, "fp32": eff}, mem_efficiency=mem,
                       attention_efficiency=cls.get("attention", g).peak_efficiency,
                       # Old profiles (no compute.kernels) only; neither the 0.8 backward/forward
                       # ratio nor the 1 µs least floor has a measured source.
                       attention_bwd_efficiency=0.8 * cls.get("attention", g).peak_efficiency,
                       launch_floor_us=max(g.overhead_us, 1.0))


def fa2_kernel_model(km: KernelModel) -> KernelModel:
    """The kernel model with FlashAttention-2's attention figures (PyTorch SDPA's flash backend)
    in place of the device's native fused attention, each where the profile gives one."""
    def pick(fa2, native):
        return native if fa2 is None else fa2
    return km.model_copy(update={
        "attention_efficiency": pick(km.fa2_attention_efficiency, km.attention_efficiency),
        "attention_bwd_efficiency": pick(km.fa2_attention_bwd_efficiency, km.attention_bwd_efficiency),
        "attention_score_Tps": pick(km.fa2_attention_score_Tps, km.attention_score_Tps),
        "attention_bwd_score_Tps": pick(km.fa2_attention_bwd_score_Tps, km.attention_bwd_score_Tps),
        "attention_cta_us": pick(km.fa2_attention_cta_us, km.attention_cta_us),
        "attention_bwd_cta_us": pick(km.fa2_attention_bwd_cta_us, km.attention_bwd_cta_us)})


def _sm_count(profile: Profile) -> int:
    # Without an SM count, assume 108 (A100) so waves still quantize; spec profiles carry theirs.
    return profile.compute.sm_count or 108


def gemm_time_s(profile: Profile, batch, m, n, k, dtype: str, km: KernelModel | None = None,
                with_floor: bool = True) -> np.ndarray:
    """Seconds of GEMMs C[batch, m, n] (inner k) in dtype; arrays broadcast."""
    km = km or kernel_model_of(profile)
    B, M, N, K = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(batch, m, n, k))
    d = normalize_dtype(dtype)
    eff = km.gemm_efficiency.get(d) or km.gemm_efficiency.get("bf16") or next(iter(km.gemm_efficiency.values()))
    sms = _sm_count(profile)
    per_sm = peak_flops(profile, d) / sms
    hbm = profile.compute.hbm_GBps * 1e9 * km.mem_efficiency.get("gemm", km.mem_efficiency.get("default", FALLBACK_MEM_EFFICIENCY))
    elem = 4 if d == "fp32" else (1 if d in ("fp8", "mxfp8") else 2)  # bytes an element of the dtype
    best = np.full(M.shape, np.inf)
    for tm, tn in km.gemm_tiles:
        tile_eff = min(1.0, (tm * tn / (tm + tn)) / _REF_INTENSITY)
        for sk in km.gemm_split_k:
            tiles = B * np.ceil(M / tm) * np.ceil(N / tn) * sk
            waves = np.ceil(tiles / sms)
            kk = np.ceil(K / sk)
            t = waves * 2.0 * tm * tn * (kk + km.gemm_k_overhead) / (per_sm * eff * tile_eff)
            if sk > 1:
                t = t + 2.0 * sk * B * M * N * 4 / hbm  # fp32 partials written and reduced
            best = np.minimum(best, t)
    io = (B * M * K + K * N + B * M * N) * elem / hbm
    t = np.maximum(best, io)
    t = np.where(M * N * K * B > 0, t, 0.0)
    return t + (km.launch_floor_us * 1e-6 if with_floor else 0.0)


def _variant_key(k: Kernel) -> str:
    return f"{k.op_class}:{k.variant}" if k.variant else k.op_class


def mem_key(k: Kernel, km: KernelModel) -> str:
    """The mem_efficiency key of a memory-bound kernel: its variant's where the model has one."""
    key = _variant_key(k)
    return key if key in km.mem_efficiency else k.op_class


def mem_time_s(profile: Profile, op_class, bytes_, km: KernelModel | None = None, with_floor: bool = True) -> np.ndarray:
    km = km or kernel_model_of(profile)
    b = np.asarray(bytes_, dtype=float)
    cls = np.broadcast_to(np.asarray(op_class), b.shape)
    eff = np.array([km.mem_efficiency.get(str(c), km.mem_efficiency.get("default", FALLBACK_MEM_EFFICIENCY)) for c in cls.ravel()]).reshape(b.shape)
    return b / (profile.compute.hbm_GBps * 1e9 * eff) + (km.launch_floor_us * 1e-6 if with_floor else 0.0)


# FlashAttention-2's tiles, read from flash-attn 2.6.3 (PyPI sdist; the kernels PyTorch's SDPA
# flash backend vendors) csrc/flash_attn/src/flash_fwd_launch_template.h run_mha_fwd_hdim64/128
# and flash_bwd_launch_template.h run_mha_bwd_hdim64/128, no dropout, >= 144 KB shared memory per
# block (A100, H100): forward, a CTA per kBlockM = 128 query rows looping over key blocks of
# kBlockN = 128 (head dim <= 64) or 64 (<= 128); backward (run_flash_bwd_seqk_parallel), a CTA per
# kBlockN = 128 keys looping over query blocks of kBlockM = 128 (<= 64) or 64 (<= 128). Causal
# masks skip the key blocks wholly above the diagonal and compute the diagonal blocks in full
# (masked).
def _fa2_tiles(head_dim: int, backward: bool) -> tuple[int, int]:
    """(kBlockM, kBlockN): query rows x keys of one tile (head dims above 128, e.g. MLA's 192, take
    the 128 ones: FA2's smaller tiles there only change the diagonal's share)."""
    if backward:
        return (128, 128) if head_dim <= 64 else (64, 128)
    return (128, 128) if head_dim <= 64 else (128, 64)


def _flash_cta_tiles(s_q: int, s_k: int, head_dim: int, causal: bool, backward: bool) -> np.ndarray:
    """Tiles each CTA of one (sequence, head) computes."""
    bm, bn = _fa2_tiles(head_dim, backward)
    nq, nk = math.ceil(s_q / bm), math.ceil(s_k / bn)
    if not causal:
        return np.full(nk if backward else nq, nq if backward else nk, dtype=float)
    # s_q == s_k: FA2's diagonal. s_k > s_q only stands for one CP rank's load-balanced share of a
    # causal sequence (Llama-3-style K/V all-gather): the rank's own s_q x s_q causal square, and
    # the other s_k - s_q keys half visible on average, unmasked.
    extra = max(s_k - s_q, 0)
    if not backward:
        own = np.ceil(np.minimum((np.arange(nq) + 1) * bm, s_q) / bn)  # keys a query block sees
        return np.minimum(own + extra / (2 * bn), nk)
    own = nq - np.floor(np.arange(math.ceil(min(s_q, s_k) / bn)) * bn / bm)  # query tiles a key block sees
    return np.concatenate([own, np.full(round(extra / bn), nq / 2)])


def flash_attention_time_s(profile: Profile, batch: int, heads: int, s_q: int, s_k: int, head_dim: int, causal: bool,
                           backward: bool, dtype: str = "bf16", km: KernelModel | None = None) -> float:
    """One fused attention kernel by shape (FlashAttention-2's tiling; FA3/cuDNN kernels tile
    alike at this granularity): its tiles, the diagonal tiles of a causal mask computed whole.

    A tile costs its matmuls at the profile's attention efficiency, plus, where the profile
    measures them, the non-matmul work on its scores (softmax) at ``attention_score_Tps``; each
    CTA adds ``attention_cta_us`` (prologue and epilogue). Without the score and CTA terms the
    efficiency is the whole tile's: FlashAttention-2's published H100 figure ("up to 335
    TFLOPs/s" forward + backward, Dao 2023, arXiv 2307.08691, Sec. 4.1, Fig. 7; batch x sequence
    = 16k tokens, head dim 64 or 128, sequence 512..16k) read at its longest sequence without a
    causal mask, where this model has no tile loss. Causal kernels lose the masked halves of their
    diagonal tiles (causal throughput below non-causal, the more so the shorter the sequence)."""
    km = km or kernel_model_of(profile)
    eff = km.attention_bwd_efficiency if backward else km.attention_efficiency
    score_Tps = km.attention_bwd_score_Tps if backward else km.attention_score_Tps
    cta_us = km.attention_bwd_cta_us if backward else km.attention_cta_us
    bm, bn = _fa2_tiles(head_dim, backward)
    sms = _sm_count(profile)
    # A tile: QK^T and PV forward (4 bm bn d FLOPs); backward five matmuls, 2.5x (Dao 2023 Sec. 4.1).
    t_tile = 4.0 * bm * bn * head_dim * (2.5 if backward else 1.0) / (peak_flops(profile, dtype) / sms) / eff
    if score_Tps:
        t_tile += bm * bn / (score_Tps * 1e12 / sms)
    tiles = _flash_cta_tiles(s_q, s_k, head_dim, causal, backward)
    batch_heads = batch * heads
    # CTAs per SM depend on register allocation, which the source does not fix, so no wave
    # quantization: the block scheduler backfills an SM as a CTA ends (causal CTAs differ in
    # length), and the kernel takes its tiles spread over the SMs, or its longest CTA where there
    # are too few to share out.
    t = max(batch_heads * float(tiles.sum()) / sms, float(tiles.max())) * t_tile
    t += batch_heads * len(tiles) * cta_us * 1e-6 / sms
    return t + km.launch_floor_us * 1e-6


def kernels_time_s(profile: Profile, kernels: list[Kernel], dtype: str, km: KernelModel | None = None) -> np.ndarray:
    """Seconds of each kernel."""
    km = km or kernel_model_of(profile)
    out = np.zeros(len(kernels))
    if not kernels:
        return out
    is_flash = np.array([k.kind == "flash" for k in kernels])
    for i in np.flatnonzero(is_flash):
        k = kernels[i]
        out[i] = flash_attention_time_s(profile, k.batch, 1, k.m, k.n, k.k, k.causal, k.backward, dtype, km)
    is_gemm = np.array([k.kind == "gemm" for k in kernels])
    if is_gemm.any():
        g = [k for k in kernels if k.kind == "gemm"]
        out[is_gemm] = gemm_time_s(profile, [k.batch for k in g], [k.m for k in g], [k.n for k in g], [k.k for k in g],
                                   dtype, km)
    is_mem = ~is_gemm & ~is_flash
    if is_mem.any():
        mk = [k for k in kernels if k.kind == "mem"]
        out[is_mem] = mem_time_s(profile, [mem_key(k, km) for k in mk], [k.bytes for k in mk], km)
    return out


# ---------------------------------------------------------------------------------------------
# Fitting from measured per-op tables
# ---------------------------------------------------------------------------------------------

def _row_predictions(profile: Profile, table, km: KernelModel) -> tuple[np.ndarray, np.ndarray]:
    """(predicted forward µs, predicted backward µs) per row of a MeasuredOpTable."""
    n = len(table.ops)
    fw = np.zeros(n)
    bw = np.zeros(n)
    if table.kernels:
        t = kernels_time_s(profile, [k for _, _, k in table.kernels], table.dtype, km) * 1e6
        for (row, phase, _), dt in zip(table.kernels, t):
            (fw if phase == "fw" else bw)[row] += dt
    return fw, bw


def predict_table(profile: Profile, table, km: KernelModel | None = None) -> "pd.DataFrame":  # noqa: F821
    """The table's ops with predicted fw/bw µs beside the measured ones (measured without the
    per-op timer's floor; the raw values stay in raw_fw_us / raw_bw_us)."""
    km = km or kernel_model_of(profile)
    fw, bw = _row_predictions(profile, table, km)
    d = table.ops.copy()
    d["raw_fw_us"], d["raw_bw_us"] = d["fw_us"], d["bw_us"]
    d["fw_us"], d["bw_us"] = table.net_times_us()
    d["pred_fw_us"] = fw
    d["pred_bw_us"] = bw
    return d


def class_errors(pred) -> dict[str, dict[str, float]]:
    """Per class: measured and predicted seconds per step, error of the total, and the median
    |relative error| of the individual ops (forward and backward each)."""
    out = {}
    d = pred[pred["op_class"] != "host"]
    for cls, g in d.groupby("op_class"):
        meas = float(((g["fw_us"] + g["bw_us"]) * g["count"]).sum() * 1e-6)
        prd = float(((g["pred_fw_us"] + g["pred_bw_us"]) * g["count"]).sum() * 1e-6)
        rel = []
        for a, b in (("fw_us", "pred_fw_us"), ("bw_us", "pred_bw_us")):
            sel = (g[a] > 0) & (g[b] > 0)
            rel += list(np.abs(g.loc[sel, b] / g.loc[sel, a] - 1.0))
        out[str(cls)] = {"measured_s": meas, "predicted_s": prd, "error": (prd - meas) / meas if meas else float("nan"),
                         "median_abs_op_error": float(np.median(rel)) if rel else float("nan"), "ops": int(len(g))}
    return out


def fit_kernel_model(profile: Profile, tables: list, base: KernelModel | None = None) -> KernelModel:
    """Fit the free constants of the kernel model to measured per-op tables (all of one device
    and dtype): GEMM efficiency for the dtype, k_overhead, memory efficiency per class present,
    launch floor. Least squares on log(predicted / measured), each op weighted by its share of
    the step's time, so class totals are matched first. Fitted values are checked against
    physics (efficiencies in (0, 1], floor >= 0)."""
    from scipy.optimize import least_squares

    if not tables:
        raise UserError("no measured op tables to fit the kernel model on")
    base = base or kernel_model_of(profile)
    dtype = normalize_dtype(tables[0].dtype)
    # Variants are fitted apart (their own key) only where the tables hold them.
    mem_classes = sorted({_variant_key(k) for t in tables for _, _, k in t.kernels if k.kind == "mem"})
    names = ["gemm_eff", "k_overhead", "floor_us"] + [f"mem:{c}" for c in mem_classes]
    x0 = np.array([base.gemm_efficiency.get(dtype, 0.7), base.gemm_k_overhead, base.launch_floor_us]
                  + [base.mem_efficiency.get(c, base.mem_efficiency.get(c.split(":")[0], base.mem_efficiency.get("default", FALLBACK_MEM_EFFICIENCY)))
                     for c in mem_classes])
    # MIN_FIT_EFFICIENCY and the upper k_overhead 512 / floor 50 µs are search limits, not
    # physics (no source); a fit at one of them (k_overhead's upper aside) is flagged low confidence.
    lo = np.array([MIN_FIT_EFFICIENCY, 0.0, 0.0] + [MIN_FIT_EFFICIENCY] * len(mem_classes))
    # Physics: no kernel beats the datasheet; streaming kernels reach ~90% of HBM bandwidth at
    # best (BabelStream on A100/H100: 0.85-0.92 of the datasheet figure).
    hi = np.array([1.0, 512.0, 50.0] + [MAX_MEM_EFFICIENCY] * len(mem_classes))
    x0 = np.clip(x0, lo + 1e-6, hi - 1e-6)

    meas, weights = [], []
    for t in tables:
        d = t.ops
        has_fw = (d["fw_kernels"] > 0) & (d["fw_us"] > 0)
        has_bw = (d["bw_kernels"] > 0) & (d["bw_us"] > 0)
        total = float(((d["fw_us"] + d["bw_us"]) * d["count"]).sum())
        # The per-op timer adds its own floor to every measurement (NeuSight times each op in
        # isolation); a training step runs the kernels back to back without it.
        fw_m, bw_m = t.net_times_us()
        meas.append((np.where(has_fw, fw_m, np.nan), np.where(has_bw, bw_m, np.nan)))
        weights.append((d["fw_us"] * d["count"] / total, d["bw_us"] * d["count"] / total))

    def model(x) -> KernelModel:
        mem = dict(base.mem_efficiency)
        mem.update({c: float(v) for c, v in zip(mem_classes, x[3:])})
        eff = dict(base.gemm_efficiency)
        eff[dtype] = float(x[0])
        return base.model_copy(update={"gemm_efficiency": eff, "gemm_k_overhead": float(x[1]), "launch_floor_us": float(x[2]),
                                       "mem_efficiency": mem})

    def residuals(x):
        km = model(x)
        res = []
        for t, (mf, mb), (wf, wb) in zip(tables, meas, weights):
            pf, pb = _row_predictions(profile, t, km)
            for m, p, w in ((mf, pf, wf), (mb, pb, wb)):
                ok = np.isfinite(m) & (p > 0)
                # sqrt(weight) x log error, plus a small unweighted term so small ops still count.
                res.append(np.sqrt(w[ok]) * np.log(p[ok] / m[ok]))
                res.append(0.02 * np.log(p[ok] / m[ok]))
        return np.concatenate(res)

    sol = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac", max_nfev=200)
    km = _match_class_totals(profile, tables, model(sol.x), mem_classes)
    # A constant pinned at its physical bound is a low-confidence fit: say so, in one line each.
    at_bound = [f"{n} = {v:.3g} sits at its bound {b:.3g}" for n, v, b in zip(names, sol.x, hi)
                if v >= b * 0.999 and n != "k_overhead"]
    at_bound += [f"{n} = {v:.3g} sits at its bound {b:.3g}" for n, v, b in zip(names, sol.x, lo) if v <= b + 1e-9 and b > 0]
    errs = {}
    for t in tables:
        for cls, e in class_errors(predict_table(profile, t, km)).items():
            errs.setdefault(cls, []).append(e["median_abs_op_error"])
    src = ", ".join(f"{t.path.parent.name}/{t.path.name}" for t in tables)
    notes = f"; low confidence: {'; '.join(at_bound)}" if at_bound else ""
    return km.model_copy(update={"fit_error": {c: float(np.nanmedian(v)) for c, v in errs.items()}, "fit_source": src + notes})


def _match_class_totals(profile: Profile, tables: list, km: KernelModel, mem_keys: list[str]) -> KernelModel:
    """Rescale each memory-bound efficiency key so that the ops holding its kernels take, summed
    over the step, what the tables measured for them (net of the per-op timer's floor).

    The least-squares fit matches ops on a log scale, a geometric mean: where the ops of one key
    scatter, their summed time can be off by several percent (the H100 GPT-2 Large embedding:
    +19% of its 0.3 ms). A step is a sum of kernel times, so the sum is what an efficiency must
    reproduce. Memory-bound time is linear in 1/efficiency, so one ratio per key does it; the
    efficiency stays within the physical bound (MAX_MEM_EFFICIENCY)."""
    mem = dict(km.mem_efficiency)
    floor = km.launch_floor_us
    for key in mem_keys:
        meas = pred = pred_mem = 0.0
        for t in tables:
            fw_m, bw_m = t.net_times_us()
            count = t.ops["count"].to_numpy(float)
            ks = list(t.kernels)
            times = kernels_time_s(profile, [k for _, _, k in ks], t.dtype, km) * 1e6
            rows = {"fw": set(), "bw": set()}
            for row, phase, k in ks:
                if k.kind == "mem" and _variant_key(k) == key:
                    rows[phase].add(row)
            for (row, phase, k), dt in zip(ks, times):
                if row in rows[phase]:
                    pred += dt * count[row]
                    if k.kind == "mem" and _variant_key(k) == key:
                        pred_mem += (dt - floor) * count[row]
            meas += sum(fw_m[r] * count[r] for r in rows["fw"]) + sum(bw_m[r] * count[r] for r in rows["bw"])
        target_mem = pred_mem + (meas - pred)
        if pred_mem > 0 and target_mem > 0 and key in mem:
            mem[key] = float(min(MAX_MEM_EFFICIENCY, max(MIN_FIT_EFFICIENCY, mem[key] * pred_mem / target_mem)))
    return km.model_copy(update={"mem_efficiency": mem})


# Device names as NeuSight's folders and the driver report them -> shipped spec profiles.
_SPEC_FOR_DEVICE = {"NVIDIA H100 80GB HBM3": "h100-sxm-80gb", "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
                    "NVIDIA A100-SXM4-80GB": "a100-sxm-80gb"}


def spec_profile_for(device: str) -> Profile:
    from simulator.profile import load_profile

    name = _SPEC_FOR_DEVICE.get(device)
    if name is None:
        raise UserError(f"no spec profile for device {device!r} (an op table's device is its folder's name, as NeuSight "
                        "lays them out): give the GPU's profile, --base PROFILE to calibrate or --profile PROFILE to "
                        "validate (a shipped name or a profile JSON)")
    return load_profile(name)


def calibrate_from_tables(tables: list, base: Profile | None = None) -> Profile:
    """A profile whose kernel model is fitted on measured op tables of one device."""
    devices = sorted({t.device for t in tables})
    if len(devices) > 1:
        raise UserError(f"op tables from different devices ({', '.join(devices)}): calibrate each device on its own")
    base = base or spec_profile_for(devices[0])
    km = fit_kernel_model(base, tables)
    from datetime import date

    from simulator.profile import ProvenanceItem

    # One item per fitted number, replacing the base's item for it (the base's "gemm_efficiency.fp32
    # 0.82" stood beside the fitted fp32 0.40, the profile contradicting itself); the dtypes and
    # classes the tables do not hold keep the base's numbers and items.
    dtypes = sorted({normalize_dtype(t.dtype) for t in tables})
    mem_keys = sorted({_variant_key(k) for t in tables for _, _, k in t.kernels if k.kind == "mem"})
    fitted = [(f"gemm_efficiency.{d}", round(km.gemm_efficiency[d], 4)) for d in dtypes if d in km.gemm_efficiency]
    fitted += [("gemm_k_overhead", round(km.gemm_k_overhead, 2)), ("launch_floor_us", round(km.launch_floor_us, 2))]
    fitted += [(f"mem_efficiency.{c}", round(km.mem_efficiency[c], 4)) for c in mem_keys if c in km.mem_efficiency]
    names = {f"compute.kernels.{k}" for k, _ in fitted}
    items = [i for i in base.provenance.items if i.field not in names] + [
        ProvenanceItem(field=f"compute.kernels.{k}", value=v, source=f"fitted on {km.fit_source}") for k, v in fitted]
    prov = base.provenance.model_copy(update={"method": "mixed", "created": date.today().isoformat(), "items": items})
    return base.model_copy(update={"name": f"{base.name}-fitted", "compute": base.compute.model_copy(update={"kernels": km}),
                                   "provenance": prov})
