"""Contention measured from traces: how much slower a compute kernel runs while NCCL kernels run
on another stream of its GPU than the same kernel (same name, same launching op with the same
input shapes) running alone.

Per kernel signature (kernel name + the launching op's ``name|Input Dims|Input type``): the median
duration of its launches that an NCCL kernel on another stream covers entirely, over the median of
its launches that no NCCL kernel touches. Per class (GEMM, elementwise, ...): the median of the
signatures' ratios weighted by their overlapped launches, the launches and signatures behind it,
and the CTAs (= SMs, one per NCCL channel) the covering NCCL kernels launched, so the figure can be
set beside the SM-share model (``simulator.contention``: ``sm_count / (sm_count - CTAs)``).

Only what can be a like-for-like comparison counts:
- the launching op recorded its input shapes (``shapes_known``): a kernel name alone is no
  signature: in the HTA A100 rank-0-of-2 trace (no shapes), cuDNN's dgrad kernel alone has an
  interquartile spread of 0.3% of its median yet its overlapped launches run 25% *faster*: they
  are other convolutions under the same name;
- the alone launches agree (interquartile range within ``MAX_ALONE_SPREAD`` of the median), so
  the signature is one piece of work;
- the kernel fills the GPU (launches at least as many CTAs as it has SMs, where the trace records
  the grid): a smaller one runs beside NCCL's CTAs on free SMs, outside the SM-share law;
- the kernel runs at least ``MIN_KERNEL_US``: Kineto writes ts/dur in whole microseconds in
  older traces (the HTA ones), so a 3 µs kernel that reads 4 µs is a rounding step, not +33%.

A class's figure is ``confident`` with at least ``MIN_SIGNATURES`` signatures and
``MIN_OVERLAPPED`` overlapped launches behind it; only a confident GEMM figure changes the
simulator (``simulator.contention.measured_excess_scale``); the rest is reported.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.profile import OverlapFit

# Classes whose kernels are compared (communication, copies and "other" are not compute).
COMPUTE_CLASSES = ("gemm", "attention", "elementwise", "norm", "optimizer")
# Whole-µs timestamps: at 10 µs one rounding step is 10%, the most we accept as noise.
MIN_KERNEL_US = 10.0
# Alone launches of one signature must agree this well (interquartile range / median).
MAX_ALONE_SPREAD = 0.10
# "Covered": at least this share of the kernel's time has an NCCL kernel on another stream.
COVERED = 0.99
MIN_PER_SIDE = 3          # launches on each side for a signature to count
MIN_SIGNATURES = 3        # for a class figure to be confident
MIN_OVERLAPPED = 20


def _coverage(comp: pd.DataFrame, comm: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(share of each compute kernel's time covered by NCCL kernels on other streams, CTAs of the
    NCCL kernels that cover it, summed when several run at once)."""
    cs = comp["start_us"].to_numpy(float)
    ce = cs + comp["dur_us"].to_numpy(float)
    cst = comp["stream"].to_numpy()
    cov = np.zeros(len(comp))
    ctas = np.zeros(len(comp))
    grid = comm["grid_blocks"].astype("Float64").fillna(np.nan).to_numpy(float) if "grid_blocks" in comm else np.full(len(comm), np.nan)
    for a, d, st, g in zip(comm["start_us"].to_numpy(float), comm["dur_us"].to_numpy(float), comm["stream"].to_numpy(), grid):
        o = np.clip(np.minimum(ce, a + d) - np.maximum(cs, a), 0.0, None) * (cst != st)
        cov += o
        ctas += np.where(o > 0, 0.0 if np.isnan(g) else g, 0.0)
    dur = comp["dur_us"].to_numpy(float)
    return np.minimum(cov / np.maximum(dur, 1e-9), 1.0), ctas


def measure_overlap(tables: list[pd.DataFrame], sm_count: int | None) -> dict[str, OverlapFit]:
    """Per compute class, the measured slowdown of kernels that NCCL kernels overlap (see the
    module doc). Classes with no usable signature are absent."""
    parts = []
    for ops in tables:
        if ops is None or not len(ops) or "category" not in ops:
            continue
        k = ops[ops["category"] == "kernel"]
        for (_, _), r in k.groupby(["rank", "device"], sort=True, observed=True):
            comm = r[r["op_class"] == "communication"]
            comp = r[r["op_class"].isin(COMPUTE_CLASSES) & r["shapes_known"].astype(bool) & (r["dur_us"] > 0)]
            if sm_count:
                # The SM-share law is about kernels that fill the GPU: one with fewer CTAs than SMs
                # runs beside NCCL's CTAs on the SMs it leaves free (and its trace says nothing of
                # contention). Without a grid in the trace a kernel is kept.
                grid = comp["grid_blocks"].astype("Float64").fillna(np.inf).to_numpy(float) if "grid_blocks" in comp \
                    else np.full(len(comp), np.inf)
                comp = comp[grid >= sm_count]
            if comm.empty or comp.empty:
                continue
            cov, ctas = _coverage(comp, comm)
            parts.append(pd.DataFrame({"key": comp["name"].astype(str).to_numpy() + "|" + comp["op_sig"].astype(str).to_numpy(),
                                       "cls": comp["op_class"].astype(str).to_numpy(), "t": comp["dur_us"].to_numpy(float),
                                       "cov": cov, "ctas": ctas}))
    per_sig = []  # (class, ratio, overlapped launches, CTAs median)
    if parts:
        # One signature is one piece of work wherever it ran: its launches on every rank pool.
        df = pd.concat(parts, ignore_index=True)
        df["over"] = df["cov"] >= COVERED
        df["alone"] = df["cov"] == 0.0
        # Only signatures seen often enough both ways are compared (few; the rest cost nothing).
        n = df.groupby("key", sort=False)[["over", "alone"]].sum()
        keep = n.index[(n["over"] >= MIN_PER_SIDE) & (n["alone"] >= MIN_PER_SIDE)]
        for _, g in df[df["key"].isin(keep)].groupby("key", sort=False):
            over = g[g["over"]]
            alone = g.loc[g["alone"], "t"]
            med = float(alone.median())
            if med < MIN_KERNEL_US:
                continue
            if float(alone.quantile(0.75) - alone.quantile(0.25)) > MAX_ALONE_SPREAD * med:
                continue
            per_sig.append((g["cls"].iloc[0], float(over["t"].median()) / med, len(over), float(over["ctas"].median())))
    out: dict[str, OverlapFit] = {}
    for cls in COMPUTE_CLASSES:
        rows = [p for p in per_sig if p[0] == cls]
        if not rows:
            continue
        ratios = np.array([p[1] for p in rows])
        w = np.array([p[2] for p in rows], dtype=float)
        order = np.argsort(ratios)
        cw = np.cumsum(w[order])
        slowdown = float(ratios[order][np.searchsorted(cw, cw[-1] / 2)])
        ctas = float(np.median([p[3] for p in rows]))
        n_over = int(w.sum())
        model = None
        if sm_count and 0 < ctas < sm_count:
            model = sm_count / (sm_count - ctas)
        out[cls] = OverlapFit(
            slowdown=slowdown, signatures=len(rows), overlapped_kernels=n_over,
            ratio_min=float(ratios.min()), ratio_max=float(ratios.max()),
            nccl_ctas=ctas if ctas > 0 else None, sm_count=sm_count, sm_share_slowdown=model,
            confident=len(rows) >= MIN_SIGNATURES and n_over >= MIN_OVERLAPPED)
    return out


def overlap_lines(fits: dict[str, OverlapFit]) -> list[str]:
    """One readable line per class, for calibrate's notes."""
    lines = []
    for cls, f in fits.items():
        model = (f"; the SM-share model gives x{f.sm_share_slowdown:.3f} for {f.nccl_ctas:.0f} NCCL CTAs of {f.sm_count} SMs"
                 if f.sm_share_slowdown else "")
        conf = "confident" if f.confident else (f"low confidence (fewer than {MIN_SIGNATURES} signatures or "
                                                 f"{MIN_OVERLAPPED} overlapped kernels): the SM-share model stays")
        lines.append(f"overlap: {cls} kernels under NCCL kernels run x{f.slowdown:.3f} (signatures {f.signatures}, "
                     f"overlapped kernels {f.overlapped_kernels}, per-signature range x{f.ratio_min:.2f}-x{f.ratio_max:.2f})"
                     f"{model}: {conf}")
    return lines
