"""Kernels by shape: GEMM tiles and waves, memory-bound kernels by bytes, fitted on NeuSight's
measured per-op latencies and checked per class."""

from pathlib import Path

import pytest

from simulator.workload.kernel_model import (MAX_MEM_EFFICIENCY, class_errors, fit_kernel_model, flash_attention_time_s,
                                              gemm_time_s, kernel_model_of, mem_time_s, predict_table)
from simulator.profile import load_profile
from simulator.trace.optable_csv import load_op_table

NEU = Path(__file__).parent / "data" / "reference" / "neusight"
GPUS = {"h100-sxm-80gb": "NVIDIA_H100_80GB_HBM3", "a100-pcie-80gb": "NVIDIA_A100_80GB_PCIe"}


def test_wave_quantization():
    p = load_profile("h100-sxm-80gb")  # 132 SMs
    km = kernel_model_of(p).model_copy(update={"gemm_tiles": [(128, 128)], "gemm_split_k": [1]})
    one_wave = gemm_time_s(p, 1, 128 * 12, 128 * 11, 4096, "bf16", km, with_floor=False)   # 132 tiles
    just_over = gemm_time_s(p, 1, 128 * 12, 128 * 11 + 1, 4096, "bf16", km, with_floor=False)  # 144 tiles
    assert just_over[()] == pytest.approx(2 * one_wave[()], rel=1e-9)
    # A full wave of large tiles runs at the fitted fraction of peak (less the K overhead).
    flops = 2.0 * 128 * 12 * 128 * 11 * 4096
    eff = km.gemm_efficiency["bf16"] * 4096 / (4096 + km.gemm_k_overhead)
    assert flops / one_wave[()] == pytest.approx(p.compute.peak_tflops * 1e12 * eff, rel=1e-9)
    # fp32 GEMMs (no TF32) run on the FP32 peak, 15x below BF16 tensor cores on H100.
    fp32 = gemm_time_s(p, 1, 4096, 4096, 4096, "fp32", km, with_floor=False)[()]
    assert fp32 > 10 * gemm_time_s(p, 1, 4096, 4096, 4096, "bf16", km, with_floor=False)[()]


def test_memory_bound_and_floor():
    p = load_profile("h100-sxm-80gb")
    km = kernel_model_of(p)
    t = mem_time_s(p, ["elementwise", "elementwise"], [0.0, 1e9], km)
    assert t[0] == pytest.approx(km.launch_floor_us * 1e-6)
    assert t[1] - t[0] == pytest.approx(1e9 / (p.compute.hbm_GBps * 1e9 * km.mem_efficiency["elementwise"]))
    # A skinny GEMM is bounded by moving its operands, not by its FLOPs.
    skinny = gemm_time_s(p, 1, 8, 8192, 8192, "bf16", km, with_floor=False)[()]
    assert skinny >= 8192 * 8192 * 2 / (p.compute.hbm_GBps * 1e9)


def test_flash_attention_causal_and_backward():
    p = load_profile("h100-sxm-80gb")
    full = flash_attention_time_s(p, 1, 32, 8192, 8192, 128, causal=False, backward=False)
    causal = flash_attention_time_s(p, 1, 32, 8192, 8192, 128, causal=True, backward=False)
    bwd = flash_attention_time_s(p, 1, 32, 8192, 8192, 128, causal=True, backward=True)
    assert causal < 0.6 * full and bwd > 2 * causal


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backward", [False, True])
def test_flash_attention_causal_diagonal_tiles(head_dim, backward):
    """FlashAttention-2 computes a causal mask's diagonal tiles whole: at s = n x 128 the causal
    kernel takes (n + 1) / (2 n) of the unmasked one (forward 128-row query tiles, backward
    128-key tiles), so causal throughput (at half the FLOPs) falls below non-causal, most at short
    sequences, and approaches it at long ones."""
    p = load_profile("h100-sxm-80gb")
    floor = kernel_model_of(p).launch_floor_us * 1e-6
    for n in (4, 64):
        s = 128 * n
        full = flash_attention_time_s(p, 4, 32, s, s, head_dim, causal=False, backward=backward) - floor
        causal = flash_attention_time_s(p, 4, 32, s, s, head_dim, causal=True, backward=backward) - floor
        assert causal / full == pytest.approx((n + 1) / (2 * n), rel=1e-9)


def test_flash_attention_score_and_cta_terms():
    """Where a profile measures them, a fused-attention tile adds its scores' softmax work
    (bm x bn scores at the score rate) to its matmuls, and each CTA its fixed cost, both spread
    over the SMs: the kernel grows by exactly that over the matmul-only time."""
    p = load_profile("h100-sxm-80gb")  # 132 SMs
    base = kernel_model_of(p)
    km = base.model_copy(update={"attention_score_Tps": 4.0, "attention_bwd_score_Tps": 2.0,
                                 "attention_cta_us": 2.0, "attention_bwd_cta_us": 20.0})
    b, h, s, d = 2, 32, 8192, 128
    for backward, (bm, bn), rate, cta_us in ((False, (128, 64), 4.0, 2.0), (True, (64, 128), 2.0, 20.0)):
        plain = flash_attention_time_s(p, b, h, s, s, d, causal=False, backward=backward, km=base)
        full = flash_attention_time_s(p, b, h, s, s, d, causal=False, backward=backward, km=km)
        tiles = b * h * (s // bm) * (s // bn)
        ctas = b * h * (s // (bn if backward else bm))
        extra = tiles * bm * bn / (rate * 1e12) + ctas * cta_us * 1e-6 / 132
        assert full - plain == pytest.approx(extra, rel=1e-9)


def test_flash_attention_full_tiles_at_profile_efficiency():
    """A long unmasked kernel over many CTAs runs at the profile's attention efficiency (the
    published figure is read as full-tile throughput); a kernel of fewer CTAs than SMs takes its
    longest CTA."""
    p = load_profile("h100-sxm-80gb")  # 132 SMs
    km = kernel_model_of(p)
    floor = km.launch_floor_us * 1e-6
    s, d = 16384, 128
    t = flash_attention_time_s(p, 1, 32, s, s, d, causal=False, backward=False) - floor
    flops = 4.0 * 32 * s * s * d
    assert flops / t == pytest.approx(p.compute.peak_tflops * 1e12 * km.attention_efficiency, rel=1e-9)
    tb = flash_attention_time_s(p, 1, 32, s, s, d, causal=False, backward=True) - floor
    assert 2.5 * flops / tb == pytest.approx(p.compute.peak_tflops * 1e12 * km.attention_bwd_efficiency, rel=1e-9)
    # One head, 128 query CTAs on 132 SMs: one CTA's 256 key tiles of 64 at one SM's rate.
    one = flash_attention_time_s(p, 1, 1, s, s, d, causal=False, backward=False) - floor
    per_sm = p.compute.peak_tflops * 1e12 * km.attention_efficiency / p.compute.sm_count
    assert one == pytest.approx(4.0 * 128 * s * d / per_sm, rel=1e-9)


@pytest.mark.parametrize("profile", list(GPUS))
def test_fit_on_gpt2_large_matches_classes_and_physics(profile):
    """Calibrated on GPT-2 Large (batch 4) of one GPU: each class's total within 15% on that run,
    GEMMs within 10% per op (median), and the fitted constants within physics."""
    p = load_profile(profile)
    gpt2 = load_op_table(NEU / GPUS[profile] / "gpt2_large-train-1024-4.csv")
    km = fit_kernel_model(p, [gpt2])
    assert 0 < km.gemm_efficiency["fp32"] <= 1.0
    assert all(0 < v <= MAX_MEM_EFFICIENCY for k, v in km.mem_efficiency.items())
    assert 0 <= km.launch_floor_us <= 50
    errs = class_errors(predict_table(p, gpt2, km))
    for cls, e in errs.items():
        assert abs(e["error"]) <= 0.15, (cls, e)
    assert errs["gemm"]["median_abs_op_error"] <= 0.10
    # Softmax and dropout backward fitted apart: attention's ops each within 10% (median; one
    # efficiency for all of them left 37-44%).
    assert errs["attention"]["median_abs_op_error"] <= 0.10
    assert "attention:dropout_bw" in km.mem_efficiency and "attention:softmax_bw" in km.mem_efficiency


# OPT's attention has ops GPT-2 Large (the calibration run) lacks: the clamp max's backward, five
# kernels by autograd's formula (simulator.workload.kernels; it was -16.7% on A100 with two), and the
# mask add broadcast over heads (A100: measured 1,006 us, predicted 707; H100: 573 vs 400), which
# streams at 0.56-0.57 of HBM on both GPUs against GPT-2's broadcast where/div at 0.75-0.79. The
# A100 attention class is -8.7% with it; nothing is xfailed.
_CLASS_MISSES: dict = {}


@pytest.mark.parametrize("profile", list(GPUS))
@pytest.mark.parametrize("other", ["gpt3_xl-train-2048-1", "opt_13-train-2048-1"])
def test_fit_predicts_other_models_per_class(profile, other, request):
    """The constants fitted on GPT-2 Large predict other models' GEMMs (other shapes) per op
    within 10% (median), GEMM totals within 10% and attention totals within 15%."""
    if (profile, other) in _CLASS_MISSES:
        request.node.add_marker(pytest.mark.xfail(reason=_CLASS_MISSES[(profile, other)], strict=True))
    p = load_profile(profile)
    km = fit_kernel_model(p, [load_op_table(NEU / GPUS[profile] / "gpt2_large-train-1024-4.csv")])
    e = class_errors(predict_table(p, load_op_table(NEU / GPUS[profile] / f"{other}.csv"), km))
    assert e["gemm"]["median_abs_op_error"] <= 0.10, (other, e["gemm"])
    assert abs(e["gemm"]["error"]) <= 0.10 and abs(e["attention"]["error"]) <= 0.15, (other, e)


def test_max_backward_is_autograds_five_kernels():
    """torch.max(x, c) backward (derivatives.yaml: where(x == c, g / 2, g).masked_fill_(x < c, 0)):
    five kernels and 9 x dtype + 4 bytes an element for the one input that takes a gradient; the
    recorded [1] operand (OPT's torch.tensor(finfo.min)) takes none."""
    from simulator.workload.kernels import op_kernels

    shape = [1, 32, 2048, 2048]
    out = 32 * 2048 * 2048
    fw, bw = op_kernels("max", "attention", [shape, [1]], shape, 4)
    assert len(fw) == 1 and len(bw) == 5
    assert sum(k.bytes for k in bw) == 40 * out
    # Two full-size inputs: each takes its own five.
    _, bw2 = op_kernels("maximum", "elementwise", [shape, shape], shape, 4)
    assert len(bw2) == 10


@pytest.mark.parametrize("profile", list(GPUS))
def test_opt_clamp_max_backward_matches_neusight(profile):
    """Fitted on GPT-2 Large (which has no such op), OPT-1.3B's clamp-max backward within 10% on
    both GPUs (it was 41% short with two kernels)."""
    p = load_profile(profile)
    km = fit_kernel_model(p, [load_op_table(NEU / GPUS[profile] / "gpt2_large-train-1024-4.csv")])
    d = predict_table(p, load_op_table(NEU / GPUS[profile] / "opt_13-train-2048-1.csv"), km)
    row = d[d["op_type"] == "max"].iloc[0]
    assert row["bw_us"] > 1000
    assert abs(row["pred_bw_us"] / row["bw_us"] - 1) <= 0.10, (row["pred_bw_us"], row["bw_us"])
