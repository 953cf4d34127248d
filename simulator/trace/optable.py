"""The OpTable: one row per GPU kernel / memcpy / memset, or, for CPU-only traces, per CPU op
of interest and per collective span. Column names and dtypes live here so that importers,
calibration and tests agree on them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

# column -> dtype. Missing numbers are NaN (float) or <NA> (nullable Int); missing strings <NA>.
OPTABLE_COLUMNS: dict[str, str] = {
    "rank": "int32",
    "device": "int16",            # GPU index (Kineto pid of GPU events); -1 for CPU rows
    "stream": "int64",            # CUDA stream id; the OS thread id for CPU rows
    "category": "category",       # Kineto category: kernel, gpu_memcpy, gpu_memset, cpu_op, user_annotation
    "name": "category",
    "cpu_op": "category",         # the CPU op the kernel was launched from (itself for CPU rows)
    "op_class": "category",       # gemm attention elementwise norm optimizer communication memcpy other
    # The fine class of the kernel (simulator.trace.kernel_classes.KERNEL_CLASSES: gemm attention
    # norm softmax elementwise reduce optimizer copy memset communication embedding other); op_class
    # is the cost-model class it is charged to.
    "kernel_class": "category",
    "op_id": "int64",             # the launching CPU op (row of the rank's host ops), shared by its kernels; -1 none
    # The launching op's signature: "name|Input Dims|Input type" when it recorded shapes, else its
    # name (or, with no launching op, the kernel's name). Measured time per signature and class
    # survives where shapes (and so FLOPs/bytes) are missing.
    "op_sig": "category",
    "shapes_known": "bool",       # the launching op recorded Input Dims
    "start_us": "float64",        # from the earliest event of the job (all ranks loaded together)
    "dur_us": "float64",
    "start_abs_ns": "int64",      # Unix epoch ns, comparable across ranks
    "step": "int32",              # ProfilerStep#N around the (launching) CPU op; -1 outside steps
    # The launching op's FLOPs and bytes (inputs read + outputs written, each tensor once), spread
    # over its kernels by duration share, so a sum over kernels counts each op once. NaN: unknown.
    "flops": "float64",
    "bytes": "float64",
    "dtype": "category",
    "collective": "category",     # normalised: all_reduce all_gather reduce_scatter all_to_all broadcast ...
    "msg_bytes": "Int64",         # nccl-tests 'size': max(send, recv) bytes of one rank's call
    "in_msg_bytes": "Int64",
    "out_msg_bytes": "Int64",
    "group_size": "Int32",
    "group_ranks": "category",    # as Kineto writes it: "[0, 1]" (long lists truncated by Kineto)
    "pg_name": "category",
    "seq": "Int64",               # collective sequence number (Kineto 'Seq', else per rank+stream order)
    "coll_source": "category",    # where the collective metadata came from
    # send/recv: the other side as the call names it, its index in the call's process group
    # (c10d::send dstRank, c10d::recv_ srcRank); <NA> elsewhere or unrecorded
    "peer": "Int32",
    # Collectives only (NaN elsewhere), filled by simulator.trace.collectives when a set is loaded:
    # the transfer part of the call (the instance's last member's start to its end with all ranks;
    # the lower envelope per (collective, size, group) otherwise) and the rest, spent waiting.
    "transfer_us": "float64",
    "wait_us": "float64",
    "coll_instance": "Int64",     # id of the matched instance across ranks (<NA>: not matched)
    "transfer_source": "category",  # "instance" (all members found) or "envelope"
    # envelope rows: why no instance (simulator.trace.collectives.WHY); <NA> for instances
    "transfer_why": "category",
    "external_id": "int64",
    "correlation": "int64",
    # CTAs the kernel launched (product of Kineto's args.grid; <NA> where the trace has none): an
    # NCCL kernel runs one CTA per channel, each resident on one SM while it runs (contention), and
    # a compute kernel with fewer CTAs than SMs leaves SMs free for it.
    "grid_blocks": "Int32",
}
OPTABLE_COLUMN_NAMES = tuple(OPTABLE_COLUMNS)


def empty_optable() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in OPTABLE_COLUMNS.items()})


def make_optable(cols: dict[str, object], n: int) -> pd.DataFrame:
    """Build an OpTable from column arrays; absent columns are filled with their missing value."""
    data = {}
    for c, t in OPTABLE_COLUMNS.items():
        v = cols.get(c)
        if v is None:
            if t == "category":
                v = pd.Categorical([None] * n) if n else pd.Categorical([])
            elif t in ("Int64", "Int32"):
                v = pd.array([pd.NA] * n, dtype=t)
            elif t == "float64":
                v = np.full(n, np.nan)
            elif t == "bool":
                v = np.zeros(n, dtype=bool)
            else:
                v = np.full(n, -1, dtype=t)
        col = pd.Series(v).astype(t)
        if t == "category":
            col = col.cat.remove_unused_categories()
        data[c] = col
    return pd.DataFrame(data)


def concat_optables(tables: list[pd.DataFrame]) -> pd.DataFrame:
    tables = [t for t in tables if len(t)]
    if not tables:
        return empty_optable()
    df = pd.concat(tables, ignore_index=True)
    for c, t in OPTABLE_COLUMNS.items():
        if t == "category" and df[c].dtype != "category":
            df[c] = df[c].astype("category")
    return df
