"""One vocabulary for the whole package: parallel dimensions, streams, collective operations.

StrEnum members compare and hash equal to their string values ("tp" == Dim.TP), so JSON files,
scenario YAML, timeline DataFrames and older callers that pass strings keep working unchanged.
This module sits at the bottom of the layers (beside ``errors``): everything may import it.
"""

from __future__ import annotations

from enum import StrEnum


class Dim(StrEnum):
    """A parallel dimension, or a sub-group of one (the sub-groups report under their base)."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    PP = "pp"
    DP = "dp"
    # expert data parallel: the ranks that hold the same experts (dp x cp / ep, x tp under
    # sequence parallelism: plan.edp_tp_of)
    EDP = "edp"
    DP_SHARD = "dp_shard"  # HSDP: the ranks a parameter is sharded over
    DP_REP = "dp_rep"  # HSDP: the ranks holding the same shard (replicas)
    EDP_SHARD = "edp_shard"  # HSDP: the ranks an expert parameter is sharded over
    EDP_REP = "edp_rep"  # HSDP: the ranks holding the same expert shard (replicas)
    EMB = "emb"  # first and last pipeline stage of a replica: Megatron's tied-embedding gradient all-reduce

    @property
    def base(self) -> "Dim":
        """The dimension this group's time and bytes are reported under."""
        return _BASE.get(self, self)


_BASE = {Dim.EDP: Dim.DP, Dim.DP_SHARD: Dim.DP, Dim.DP_REP: Dim.DP, Dim.EDP_SHARD: Dim.DP, Dim.EDP_REP: Dim.DP,
         Dim.EMB: Dim.PP}

# The dimensions a report shows, in this order (innermost first, as the default mesh order).
REPORT_DIMS: tuple[Dim, ...] = (Dim.TP, Dim.CP, Dim.EP, Dim.PP, Dim.DP)
DIM_NAMES: tuple[str, ...] = tuple(d.value for d in REPORT_DIMS)  # plain strings, for tables and JSON
# Every group the engine can be asked to build.
GROUP_DIMS: tuple[Dim, ...] = (Dim.TP, Dim.CP, Dim.EP, Dim.DP, Dim.EDP, Dim.PP, Dim.DP_SHARD, Dim.DP_REP, Dim.EDP_SHARD,
                               Dim.EDP_REP, Dim.EMB)


def base_dim(dim: str) -> Dim:
    return Dim(dim).base


class Stream(StrEnum):
    """A queue of work on one rank, as the timeline names it."""

    COMPUTE = "compute"
    TP = "tp"
    CP = "cp"
    EP = "ep"
    PP_SEND_F = "pp-send-f"
    PP_RECV_F = "pp-recv-f"
    PP_SEND_B = "pp-send-b"
    PP_RECV_B = "pp-recv-b"
    DP = "dp"  # gradient reduction
    DP_AG = "dp-ag"  # ZeRO / FSDP parameter all-gathers


# Display order of the streams (dashboards, Perfetto).
STREAM_ORDER: tuple[Stream, ...] = tuple(Stream)
STREAM_NAMES: tuple[str, ...] = tuple(s.value for s in STREAM_ORDER)
COMM_STREAMS: tuple[Stream, ...] = tuple(s for s in Stream if s is not Stream.COMPUTE)
RECV_STREAM_OF = {Stream.PP_SEND_F: Stream.PP_RECV_F, Stream.PP_SEND_B: Stream.PP_RECV_B}


class CollectiveOp(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"
    # Workload-level ops the network never sees as such:
    RING_STEP = "ring_step"  # every member sends one block to the next (ring attention); a send_recv per pair
    IDENTITY_AR = "identity_ar"  # Megatron's f/g conjugate that is a no-op in this direction


# The operations a network prices (nccl-tests' collectives plus point-to-point).
NETWORK_OPS: tuple[CollectiveOp, ...] = (
    CollectiveOp.ALL_REDUCE, CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_TO_ALL,
    CollectiveOp.SEND_RECV, CollectiveOp.BROADCAST,
)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw = algbw x factor (FORMATS.md §5.2): bytes each rank puts on the wire per
    byte of the nccl-tests ``size``. A ring step sends its block once."""
    if n <= 1:
        return 0.0
    if op == CollectiveOp.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0
