"""Fitting communication models: per collective x group size x tier, a latency alpha and a
size-dependent bus bandwidth; from them, the per-link efficiencies and per-step latencies the
flow-level fabric uses.

Inputs are rows of the collective table (simulator.trace.nccl_tests.COLLECTIVE_TABLE_COLUMNS:
collective, size_bytes, time_us, plus group_size and tier), from a sweep (nccl-tests or our own
collectives.parquet) or from the collectives found in training traces (``collectives_from_ops``).

alpha is the time of the smallest messages (the median of the sizes whose time is within 10% of
the smallest time, which is where the curve is flat). The bandwidth of the rest of the time,
busbw(S) = factor x S / (t(S) - alpha), is kept at every measured size and interpolated in log
space between them, so the model reproduces the sweep it was fitted on and interpolates smoothly.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simulator.profile import CollectiveFit
from simulator.network.base import bus_factor

COMM_SAMPLE_COLUMNS = ("collective", "group_size", "tier", "size_bytes", "time_us")
# Names the simulator's network uses; the importers' send/recv pair is one send_recv transfer.
_OP_ALIASES = {"send": "send_recv", "recv": "send_recv", "sendrecv": "send_recv"}
_SIMULATED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


def _alpha_us(s: np.ndarray, t: np.ndarray) -> float:
    flat = t <= t.min() * 1.1
    return float(np.median(t[flat])) * 0.95 if flat.any() else 0.0


def _curve(coll: str, n: int, s: np.ndarray, t: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    alpha = _alpha_us(s, t)
    f = bus_factor(coll, n) if coll != "send_recv" else 1.0
    f = f if f > 0 else 1.0
    work_us = np.maximum(t - alpha, 0.05 * t)
    busbw = f * s / (work_us * 1e3)  # bytes/µs -> GB/s: / 1e3
    return alpha, s, busbw


def _medians(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    g = df.groupby("size_bytes")["time_us"].median().sort_index()
    return g.index.to_numpy(float), g.to_numpy(float)


def _holdout(coll: str, n: int, s: np.ndarray, t: np.ndarray) -> float | None:
    """Every other interior size left out, predicted from the rest (and vice versa)."""
    if len(s) < 4:
        return None
    idx = np.arange(1, len(s) - 1)
    errs = []
    for k in (0, 1):
        test = idx[idx % 2 == k]
        train = np.setdiff1d(np.arange(len(s)), test)
        alpha, ts, bw = _curve(coll, n, s[train], t[train])
        fit = CollectiveFit(collective=coll, group_size=n, tier="intra", alpha_us=alpha,
                            table_bytes=list(ts), table_busbw_GBps=list(bw))
        pred = fit.time_us(s[test])
        errs.append(np.abs(pred - t[test]) / t[test])
    return float(np.median(np.concatenate(errs)))


def fit_collectives(samples: pd.DataFrame, source: str = "") -> list[CollectiveFit]:
    """One CollectiveFit per (collective, group_size, tier) with at least two sizes."""
    df = samples.copy()
    df["collective"] = df["collective"].astype(str).map(lambda c: _OP_ALIASES.get(c, c))
    df = df[df["collective"].isin(_SIMULATED) & (df["time_us"] > 0) & (df["size_bytes"] > 0) & (df["group_size"] >= 2)]
    fits: list[CollectiveFit] = []
    for (coll, n, tier), sub in df.groupby(["collective", "group_size", "tier"], sort=True):
        s, t = _medians(sub)
        if len(s) < 2:
            continue
        alpha, ts, bw = _curve(coll, int(n), s, t)
        fits.append(CollectiveFit(
            collective=str(coll), group_size=int(n), tier=tier, alpha_us=alpha,
            table_bytes=[float(x) for x in ts], table_busbw_GBps=[float(x) for x in bw],
            fit_error=_holdout(str(coll), int(n), s, t), fit_range_bytes=(float(s.min()), float(s.max())),
            source=source,
        ))
    return fits


def large_message_busbw(fit: CollectiveFit, min_bytes: float = 1 << 20) -> float:
    """Bus bandwidth (whole time, alpha included) of the largest measured messages."""
    s = np.asarray(fit.table_bytes)
    big = s[s >= min(min_bytes, s.max())]
    t = fit.time_us(big)
    f = bus_factor(fit.collective, fit.group_size) if fit.collective != "send_recv" else 1.0
    return float(np.max(f * big / (t * 1e3)))


# ---------------------------------------------------------------------------------------------
# Collectives inside training traces
# ---------------------------------------------------------------------------------------------

def collectives_from_ops(ops: pd.DataFrame, default_group_size: int | None = None) -> pd.DataFrame:
    """Transfer times of the collectives in a multi-rank OpTable.

    A rank's collective lasts from its own call to the end of the transfer, so it includes
    waiting for the slowest peer. The instances of one collective on the member ranks overlap in
    time; among them the latest-starting rank waited least, and its duration is the transfer time.
    Instances are matched by (collective, message bytes) and overlapping intervals on distinct
    ranks. With one rank only (a single-rank file) its own durations are kept: an upper bound.
    Returns rows with collective, group_size, size_bytes, time_us, ranks (members found).
    """
    c = ops[(ops["op_class"] == "communication") & ops["msg_bytes"].notna() & ops["collective"].notna()].copy()
    if c.empty:
        return pd.DataFrame(columns=["collective", "group_size", "size_bytes", "time_us", "ranks"])
    c["collective"] = c["collective"].astype(str)
    c["end_us"] = c["start_us"] + c["dur_us"]
    rows = []
    for (coll, size), sub in c.groupby(["collective", "msg_bytes"], observed=True, sort=True):
        sub = sub.sort_values("start_us", kind="stable")
        st, en, rk = sub["start_us"].to_numpy(), sub["end_us"].to_numpy(), sub["rank"].to_numpy()
        gs = sub["group_size"].to_numpy(dtype=float, na_value=np.nan)
        # Sweep: a component of overlapping intervals is one instance (one per distinct rank).
        i = 0
        while i < len(st):
            j = i + 1
            end = en[i]
            while j < len(st) and st[j] <= end and rk[j] not in rk[i:j]:
                end = max(end, en[j])
                j += 1
            members = slice(i, j)
            last = i + int(np.argmax(st[members]))
            n_found = j - i
            g = gs[i] if np.isfinite(gs[i]) else (default_group_size or n_found)
            if n_found >= min(int(g), 2) or ops["rank"].nunique() == 1:
                rows.append((coll, int(g), int(size), float(en[last] - st[last]), n_found))
            i = j
    return pd.DataFrame(rows, columns=["collective", "group_size", "size_bytes", "time_us", "ranks"])
