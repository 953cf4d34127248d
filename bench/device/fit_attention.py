"""Fit the fused-attention kernel model's constants to one GPU's measured SDPA kernels
(bench/device/kernels_h200.py's kernels.csv, section "attention"):

    python bench/device/fit_attention.py tests/data/reference/h200/kernels.csv [--profile h200-sxm-141gb]

Per kernel family (torch SDPA's flash backend = FlashAttention-2, and cuDNN) and direction, the
kernel time is modelled as (simulator.workload.kernel_model.flash_attention_time_s)

    t = tiles/SM x (matmul FLOPs a tile / (eff x peak/SM) + scores a tile / (score rate/SM))
        + CTAs/SM x cta_us

and eff, the score rate and cta_us are fitted by least squares on relative error. Backward time is
measured as forward+backward minus forward. Prints the constants, each shape's error, and the
physics checks the constants must pass before a profile takes them: the matmul efficiency below
the best dense GEMM this chip reached (the "gemm" rows of the same file), the score rate of the
order of the SFUs' exp throughput (3.9 T/s on H100 SXM5, FlashAttention-3, arXiv 2407.08608
Sec. 3.1: above it only where part of the softmax overlaps the matmuls), the CTA cost positive.

Round 28's shapes all have batch x sequence = 16,384 tokens and 32 heads, so the number of CTAs is
the same in all of them: a per-CTA cost cannot be told from a per-token one there. For fixed tiles
they are the same thing (CTAs = batch x heads x sequence / tile rows), so predictions do not
depend on which it is; kernels_h200.py now adds 2,048 and 4,096 tokens and an unmasked kernel."""

from __future__ import annotations

import numpy as np
import pandas as pd
from compare_kernels import read_measured

from simulator.workload.kernel_model import _fa2_tiles, _flash_cta_tiles, _sm_count, peak_flops

SFU_EXP_TPS_H100 = 3.9  # FlashAttention-3 (Shah et al. 2024), Sec. 3.1: H100 SXM5 special functions


def design(prof, rows: pd.DataFrame, backward: bool) -> tuple[np.ndarray, np.ndarray, list[str]]:
    sms = _sm_count(prof)
    per_sm = peak_flops(prof, "bf16") / sms
    x, y, labels = [], [], []
    for (b, h, s, d, causal), g in rows.groupby(["batch", "heads", "seq", "head_dim", "causal"]):
        b, h, s, d, causal = int(b), int(h), int(s), int(d), str(causal) == "True"
        t_fwd = float(g[g["name"] == "sdpa_fwd"].time_us.iloc[0])
        t = float(g[g["name"] == "sdpa_fwd_bwd"].time_us.iloc[0]) - t_fwd if backward else t_fwd
        bm, bn = _fa2_tiles(int(d), backward)
        tiles = _flash_cta_tiles(int(s), int(s), int(d), causal, backward)
        tiles_per_sm = int(b) * int(h) * float(tiles.sum()) / sms
        matmul_s = tiles_per_sm * 4.0 * bm * bn * int(d) * (2.5 if backward else 1.0) / per_sm
        scores = tiles_per_sm * bm * bn
        ctas = int(b) * int(h) * len(tiles) / sms
        x.append([matmul_s, scores, ctas])
        y.append(t * 1e-6)
        labels.append(f"b{b} s{s} d{d}" + ("" if causal else " unmasked"))
    return np.array(x), np.array(y), labels


def main() -> None:
    prof, d = read_measured(__doc__.splitlines()[0])
    sms = _sm_count(prof)
    best_gemm = float(d[(d.section == "gemm") & (d["dtype"] == "bf16")].tflops.max()) * 1e12 / peak_flops(prof, "bf16")
    att = d[d.section == "attention"]
    for variant, rows in att.groupby("variant"):
        for backward in (False, True):
            x, y, labels = design(prof, rows, backward)
            coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)
            eff, score_Tps, cta_us = 1.0 / coef[0], sms / coef[1] / 1e12, coef[2] * 1e6
            err = x @ coef / y - 1
            print(f"{variant} {'backward' if backward else 'forward'}: efficiency {eff:.3f}, "
                  f"score rate {score_Tps:.2f} T/s, CTA cost {cta_us:.2f} us; "
                  f"max |error| {np.abs(err).max():.1%}")
            for label, e in zip(labels, err):
                print(f"    {label:<16} {e:+6.1%}")
            checks = {
                f"efficiency {eff:.3f} below the best BF16 GEMM on this chip ({best_gemm:.3f})": 0 < eff < best_gemm,
                f"score rate {score_Tps:.2f} T/s within 0.5-2x the SFU exp rate ({SFU_EXP_TPS_H100} T/s)":
                    0.5 * SFU_EXP_TPS_H100 <= score_Tps <= 2 * SFU_EXP_TPS_H100,
                f"CTA cost {cta_us:.2f} us positive": cta_us > 0,
            }
            for what, ok in checks.items():
                print(f"    {'pass' if ok else 'FAIL'}: {what}")


if __name__ == "__main__":
    main()
