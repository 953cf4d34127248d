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


def _curve(coll: str, n: int, s: np.ndarray, t: np.ndarray, max_busbw_GBps: float | None = None) -> tuple[float, np.ndarray, np.ndarray]:
    alpha = _alpha_us(s, t)
    f = bus_factor(coll, n) if coll != "send_recv" else 1.0
    f = f if f > 0 else 1.0
    if max_busbw_GBps:
        # The latency can be no larger than leaves every size's transfer at or below the link's
        # bandwidth: with few sizes (traces) the smallest time is no flat region, and taking 95%
        # of it as latency turned 100 µs calls into "2 TB/s + 300 µs" fits.
        room = t - f * s / (max_busbw_GBps * 1e3)
        alpha = float(min(alpha, max(0.0, room.min())))
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


def fit_collectives(samples: pd.DataFrame, source: str = "", max_busbw_GBps: dict[str, float] | None = None) -> list[CollectiveFit]:
    """One CollectiveFit per (collective, group_size, tier) with at least two sizes.
    max_busbw_GBps: per tier, the link bandwidth per GPU that bounds the split into latency and
    transfer (see _curve); None: no bound."""
    df = samples.copy()
    df["collective"] = df["collective"].astype(str).map(lambda c: _OP_ALIASES.get(c, c))
    df = df[df["collective"].isin(_SIMULATED) & (df["time_us"] > 0) & (df["size_bytes"] > 0) & (df["group_size"] >= 2)]
    fits: list[CollectiveFit] = []
    for (coll, n, tier), sub in df.groupby(["collective", "group_size", "tier"], sort=True):
        s, t = _medians(sub)
        if len(s) < 2:
            continue
        alpha, ts, bw = _curve(coll, int(n), s, t, (max_busbw_GBps or {}).get(tier))
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
    """Transfer times of the collectives in an OpTable, waiting for peers taken out.

    Each call's transfer part comes from simulator.trace.collectives (filled by load_trace;
    computed here when the table lacks it): with every member of an instance in the table, the
    last-starting member's duration; otherwise the lower envelope per (collective, size, group).
    One sample per instance, and one per envelope key (its shortest call). Group sizes come from
    the calls' records (or default_group_size); calls are never merged by being concurrent.
    Returns rows with collective, group_size, size_bytes, time_us, ranks (members found) and
    source (instance / envelope).
    """
    from simulator.trace.collectives import annotate_transfers

    cols = ["collective", "group_size", "size_bytes", "time_us", "ranks", "source"]
    c = ops[(ops["op_class"] == "communication") & ops["msg_bytes"].notna() & ops["collective"].notna()]
    if c.empty:
        return pd.DataFrame(columns=cols)
    if default_group_size and c["group_size"].isna().any():
        ops = ops.copy()
        ops["group_size"] = ops["group_size"].fillna(default_group_size)
        c = None
    if "transfer_us" not in ops.columns or ops.loc[(ops["op_class"] == "communication") & ops["collective"].notna(), "transfer_us"].isna().all():
        ops = annotate_transfers(ops.copy())
        c = None
    if c is None:
        c = ops[(ops["op_class"] == "communication") & ops["msg_bytes"].notna() & ops["collective"].notna()]
    c = c[c["transfer_us"].notna()]
    rows = []
    inst = c[c["transfer_source"] == "instance"]
    if len(inst):
        g = inst.groupby("coll_instance", observed=True).agg(
            collective=("collective", "first"), group_size=("group_size", "first"), size_bytes=("msg_bytes", "first"),
            time_us=("transfer_us", "min"), ranks=("rank", "nunique"))
        for r in g.itertuples(index=False):
            gs = int(r.group_size) if not pd.isna(r.group_size) else int(r.ranks)
            rows.append((str(r.collective), gs, int(r.size_bytes), float(r.time_us), int(r.ranks), "instance"))
    env = c[c["transfer_source"] != "instance"]
    env = env[env["group_size"].notna()]
    if len(env):
        g = env.groupby(["collective", "msg_bytes", "group_size"], observed=True).agg(
            time_us=("transfer_us", "min"), ranks=("rank", "nunique"))
        for (coll, size, gs), r in g.iterrows():
            rows.append((str(coll), int(gs), int(size), float(r["time_us"]), int(r["ranks"]), "envelope"))
    return pd.DataFrame(rows, columns=cols)
