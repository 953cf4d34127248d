"""Fitting per-op-class compute models from captured op timings.

A sample is one captured op: its class, FLOPs, bytes and measured time. Per class the fit is a
lookup of the achieved rate (TFLOP/s for FLOP-bound classes, GB/s for memory-bound ones) against
size, at the medians of log-spaced size bins, plus a per-kernel overhead (the intercept of the
smallest ops). Between bins the profile interpolates the rate in log space; beyond them it keeps
the end rate and warns (Profile.compute_time_s).

The error stored per class is measured on ops the fit did not see: interior size bins are dealt
alternately into two folds, each fold is predicted from a fit on the other (and on the end bins,
so that the held-out error measures interpolation, which is what the simulator does). With fewer
than three distinct sizes the ops themselves are dealt alternately.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from simulator.profile import OP_CLASSES, OpClassModel

# Classes whose time follows FLOPs when the ops carry FLOPs; the rest follow bytes.
FLOP_CLASSES = ("gemm", "attention")
BINS_PER_OCTAVE = 2  # size bins: two per factor of two
MIN_SAMPLES = 3


@dataclass
class ClassFit:
    op_class: str
    basis: str  # "flops" or "bytes"
    sizes: np.ndarray  # bin median sizes, ascending
    rates: np.ndarray  # achieved size-per-µs (FLOPs/µs or bytes/µs) at sizes, overhead removed
    overhead_us: float
    fit_error: float | None
    n_samples: int
    size_range: tuple[float, float]

    def predict_us(self, size: np.ndarray) -> np.ndarray:
        size = np.asarray(size, dtype=float)
        rate = np.exp(np.interp(np.log(np.maximum(size, 1.0)), np.log(self.sizes), np.log(self.rates)))
        return self.overhead_us + size / rate

    def to_model(self, peak_tflops: float, hbm_GBps: float) -> OpClassModel:
        if self.basis == "flops":
            tflops = self.rates * 1e6 / 1e12
            return OpClassModel(
                peak_efficiency=float(min(1.0, max(1e-6, tflops.max() / peak_tflops))),
                half_efficiency_flops=0.0,
                bandwidth_efficiency=1.0,
                overhead_us=self.overhead_us,
                table_flops=[float(x) for x in self.sizes],
                table_tflops=[float(x) for x in tflops],
                fit_error=self.fit_error,
                fit_range_flops=self.size_range,
                basis="flops",
                fit_samples=self.n_samples,
            )
        gbps = self.rates * 1e6 / 1e9
        return OpClassModel(
            peak_efficiency=1.0,
            half_efficiency_flops=0.0,
            bandwidth_efficiency=float(min(1.0, max(1e-6, gbps.max() / hbm_GBps))),
            overhead_us=self.overhead_us,
            table_bytes=[float(x) for x in self.sizes],
            table_GBps=[float(x) for x in gbps],
            fit_error=self.fit_error,
            fit_range_bytes=self.size_range,
            basis="bytes",
            fit_samples=self.n_samples,
        )


def _bin_ids(size: np.ndarray) -> np.ndarray:
    return np.floor(np.log2(size) * BINS_PER_OCTAVE + 1e-9).astype(np.int64)


def _fit_points(size: np.ndarray, t_us: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(bin sizes, rates, overhead) from raw points."""
    df = pd.DataFrame({"b": _bin_ids(size), "s": size, "t": t_us})
    g = df.groupby("b").agg(s=("s", "median"), t=("t", "median")).sort_index()
    s, t = g["s"].to_numpy(float), g["t"].to_numpy(float)
    overhead = _overhead(s, t)
    # The bandwidth part must stay positive: a bin at (or below) the overhead is treated as 10%
    # above it, which keeps its rate finite and its prediction within that 10%.
    work = np.maximum(t - overhead, 0.1 * t)
    rates = s / work
    return s, rates, overhead


def _overhead(s: np.ndarray, t: np.ndarray) -> float:
    """Intercept of t = a + s / r over the smallest bins, clamped to [0, 0.9 x the smallest time]."""
    k = min(len(s), 3)
    if k < 2:
        return 0.0
    A = np.stack([np.ones(k), s[:k]], axis=1)
    coef, *_ = np.linalg.lstsq(A, t[:k], rcond=None)
    if coef[1] <= 0:
        # Time that does not grow with size among the smallest bins (different kernels of one
        # class at their own efficiencies: an H200's RMSNorm forward moved 67 MB in 24 us, its
        # backward 47 MB in 34 us) puts them on no line t = a + s / r: their intercept is no
        # per-kernel overhead, and taking it gave the forward a rate of 28 TB/s.
        return 0.0
    return float(np.clip(coef[0], 0.0, 0.9 * t.min()))


def _holdout_error(size: np.ndarray, t_us: np.ndarray) -> float | None:
    bins = _bin_ids(size)
    uniq = np.unique(bins)
    folds = np.zeros(len(size), dtype=np.int64) - 1  # -1: always in the training set
    if len(uniq) >= 3:
        interior = uniq[1:-1]
        for j, b in enumerate(interior):
            folds[bins == b] = j % 2
        n_folds = 1 if len(interior) == 1 else 2
    elif len(size) >= 2:
        order = np.argsort(size, kind="stable")
        folds[order] = np.arange(len(size)) % 2
        n_folds = 2
    else:
        return None
    errs = []
    for k in range(n_folds):
        test = folds == k
        train = ~test
        if not test.any() or not train.any():
            continue
        s, r, ovh = _fit_points(size[train], t_us[train])
        fit = ClassFit("", "", s, r, ovh, None, 0, (0.0, 0.0))
        pred = fit.predict_us(size[test])
        errs.append(np.abs(pred - t_us[test]) / t_us[test])
    if not errs:
        return None
    return float(np.median(np.concatenate(errs)))


def fit_class(op_class: str, flops: np.ndarray, bytes_: np.ndarray, t_us: np.ndarray) -> ClassFit | None:
    """Fit one class; None when it has fewer than MIN_SAMPLES usable ops."""
    flops = np.asarray(flops, dtype=float)
    bytes_ = np.asarray(bytes_, dtype=float)
    t_us = np.asarray(t_us, dtype=float)
    ok_t = np.isfinite(t_us) & (t_us > 0)
    has_f = ok_t & np.isfinite(flops) & (flops > 0)
    has_b = ok_t & np.isfinite(bytes_) & (bytes_ > 0)
    if op_class in FLOP_CLASSES and has_f.sum() >= MIN_SAMPLES:
        basis, size, sel = "flops", flops, has_f
    elif has_b.sum() >= MIN_SAMPLES:
        basis, size, sel = "bytes", bytes_, has_b
    elif has_f.sum() >= MIN_SAMPLES:
        basis, size, sel = "flops", flops, has_f
    else:
        return None
    x, t = size[sel], t_us[sel]
    s, r, ovh = _fit_points(x, t)
    return ClassFit(op_class, basis, s, r, ovh, _holdout_error(x, t), int(sel.sum()), (float(x.min()), float(x.max())))


def fit_compute(samples: pd.DataFrame) -> dict[str, ClassFit]:
    """samples: columns op_class, flops, bytes, time_us. Returns the classes that could be fitted."""
    out: dict[str, ClassFit] = {}
    for cls in OP_CLASSES:
        sub = samples[samples["op_class"] == cls]
        if sub.empty:
            continue
        fit = fit_class(cls, sub["flops"].to_numpy(float), sub["bytes"].to_numpy(float), sub["time_us"].to_numpy(float))
        if fit is not None:
            out[cls] = fit
    return out
