"""The kernel model against one GPU's measurements (bench/device/kernels_h200.py's kernels.csv):
GEMMs by shape in bf16 and FP8, fused attention by shape, and the SM-share contention law.

    python bench/device/compare_kernels.py tests/data/reference/h200/kernels.csv [--profile h200-sxm-141gb]

Prints, per row, measured and modelled time and their error, then the median absolute error per
group. Measured times are medians of back-to-back calls (operands L2-resident where they fit)."""

from __future__ import annotations

import argparse
import statistics

import pandas as pd

from simulator.contention import compute_slowdown
from simulator.profile import Profile, load_profile
from simulator.workload.kernel_model import fa2_kernel_model, flash_attention_time_s, gemm_time_s


# Rows within this factor of the fastest call of their dtype are taken to be the host's issue
# time, not device time: round 28's kernels.csv timed back-to-back calls without queueing them
# behind a sleep, and four FP8 GEMMs from 2 to 17 GFLOP (6 to 67 MB) all took 26-29 us, where
# the largest needs 9 us at the FP8 peak and 3 us at HBM speed (kernels_h200.bench_s now queues).
HOST_FLOOR_FACTOR = 1.15


def host_floor_rows(g: pd.DataFrame) -> pd.Series:
    """Per GEMM row: whether its time sits at its dtype's floor (host-bound, not device time)."""
    floor = g.groupby("dtype")["time_us"].transform("min")
    return g["time_us"] <= HOST_FLOOR_FACTOR * floor


def read_measured(description: str) -> tuple[Profile, pd.DataFrame]:
    """The command line of the device-table scripts: the kernels CSV and the profile to hold it against."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("csv", help="kernels.csv written by bench/device/kernels_h200.py")
    ap.add_argument("--profile", default="h200-sxm-141gb", help="shipped profile name or path")
    a = ap.parse_args()
    return load_profile(a.profile), pd.read_csv(a.csv)


def main() -> None:
    prof, d = read_measured(__doc__.splitlines()[0])
    groups: dict[str, list[float]] = {}

    def show(group: str, label: str, meas_us: float, model_us: float) -> None:
        err = model_us / meas_us - 1
        groups.setdefault(group, []).append(abs(err))
        print(f"{group:<22} {label:<34} measured {meas_us:10.1f} us  model {model_us:10.1f} us  {err:+7.1%}")

    g = d[d.section == "gemm"]
    host_bound = host_floor_rows(g)
    for i, r in g.iterrows():
        if r["dtype"] == "fp8" and r.variant != "tensorwise":
            continue  # one FP8 kernel per shape: TE's per-tensor scaling (fast accumulation off)
        m, n, k = int(r.m), int(r.n), int(r.k)
        t = float(gemm_time_s(prof, 1, m, n, k, r["dtype"])) * 1e6
        big = m * n * k >= 2048**3
        if host_bound[i]:
            print(f"{'gemm ' + r['dtype'] + ' host floor':<22} {r['name'] + f' {m}x{n}x{k}':<34} measured "
                  f"{r.time_us:10.1f} us  model {t:10.1f} us  (the host's issue time, not the kernel's: left out)")
            continue
        show(f"gemm {r['dtype']} {'large' if big else 'small'}", f"{r['name']} {m}x{n}x{k}", r.time_us, t)
    bf = g[g["dtype"] == "bf16"].set_index("name").time_us
    f8 = g[(g["dtype"] == "fp8") & (g.variant == "tensorwise")].set_index("name").time_us
    print("\nFP8 speed-up over BF16, measured (model):")
    for name in bf.index:
        r = g[(g["name"] == name) & (g["dtype"] == "bf16")].iloc[0]
        m_bf = float(gemm_time_s(prof, 1, r.m, r.n, r.k, "bf16"))
        m_f8 = float(gemm_time_s(prof, 1, r.m, r.n, r.k, "fp8"))
        floor = " (a host floor: not a kernel ratio)" if host_bound[g[g["name"] == name].index].any() else ""
        print(f"  {name:<18} {bf[name] / f8[name]:5.2f}x ({m_bf / m_f8:4.2f}x){floor}")
    at = d[d.section == "attention"]
    base = prof.compute.kernels
    # torch SDPA's flash backend is FlashAttention-2 (the profile's fa2_* figures); cuDNN's is the
    # Hopper-native kernel the attention_* figures describe
    fa2 = fa2_kernel_model(base)
    for _, r in at.iterrows():
        bwd = r["name"] == "sdpa_fwd_bwd"
        km = fa2 if r.variant.startswith("flash") else base
        causal = str(r.causal) == "True"
        shape = (int(r.batch), int(r.heads), int(r.seq), int(r.seq), int(r.head_dim), causal)
        t = flash_attention_time_s(prof, *shape, False, km=km)
        if bwd:
            t += flash_attention_time_s(prof, *shape, True, km=km)
        show(f"attention {r.variant.split('_')[0]} {'fwd+bwd' if bwd else 'fwd'}",
             f"b{int(r.batch)} s{int(r.seq)} d{int(r.head_dim)}" + ("" if causal else " unmasked"), r.time_us, t * 1e6)
    c = d[(d.section == "contention") & (d["mode"].isin(["spin", "copy"])) & (d["name"] != "interferer_alone")]
    sms = prof.compute.sm_count
    print("\ncontention: slowdown under N resident SMs, measured against the model: the SM-share law sm / (sm - N)\n"
          "for GEMMs and attention, none for memory-bound kernels (Segments.sm_share)")
    for _, r in c.iterrows():
        memory_bound = r["name"].startswith("scale")
        law = 1.0 if memory_bound else compute_slowdown(sms, int(r.sms_taken))
        err = law / r.slowdown - 1
        group = f"contention {r['mode']} {'gemm' if 'gemm' in r['name'] else r['name'].split('_')[0]}"
        groups.setdefault(group, []).append(abs(err))
        print(f"{group:<22} {r['name'] + ' N=' + str(int(r.sms_taken)):<34} measured x{r.slowdown:.3f}  model x{law:.3f}  {err:+7.1%}")
    print("\nmedian |error| per group:")
    for k, v in groups.items():
        print(f"  {k:<26} {statistics.median(v):6.1%}  (n={len(v)})")


if __name__ == "__main__":
    main()
