"""The `collectives` workload: an nccl-tests-like sweep over collectives, sizes and group sizes.

Conventions follow nccl-tests (FORMATS.md §5.2) so that this table and an imported nccl-tests log
are interchangeable: ``size_bytes`` is max(send, recv) bytes of one rank, ``count`` is the
per-call count argument (per rank for all-gather / reduce-scatter, per peer for all-to-all),
``time_us`` is the per-iteration time averaged over the ranks that took part,
``algbw_GBps = size_bytes / 1e9 / time_s`` and ``busbw_GBps = algbw_GBps x factor(n)``.

Every rank takes part at every group size: the world is cut into consecutive groups of that
size that run concurrently (as TP groups do in training). Ranks left over when the world is not
a multiple of the group size sit the measurement out.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from simulator.capture.harness import RankContext, WorkloadResult

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
# nccl-tests' type names, so rows compare with imported logs.
DTYPE_NAMES = {"float32": "float", "float16": "half", "bfloat16": "bfloat16"}
_REDUCING = {"all_reduce", "reduce_scatter"}
_IN_PLACE = {"all_reduce", "broadcast"}  # torch runs these on one buffer


def busbw_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def message_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    sizes, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-9):
        sizes.append(int(round(s)))
        s *= factor
    return sizes


def default_group_sizes(world_size: int) -> list[int]:
    sizes = [1 << i for i in range(1, 63) if (1 << i) < world_size]
    return sizes + [world_size] if world_size >= 2 else []


def _count_and_size(collective: str, size_bytes: int, n: int, elem_bytes: int) -> tuple[int, int]:
    """(per-call count, nccl-tests size in bytes) for a requested message size."""
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        count = size_bytes // (n * elem_bytes)
        return count, count * n * elem_bytes
    count = size_bytes // elem_bytes
    return count, count * elem_bytes


def _make_op(collective: str, count: int, n: int, ranks: list[int], rank: int, pg: Any, dtype: Any, device: Any):
    idx = ranks.index(rank)
    if collective == "all_reduce":
        buf = torch.ones(count, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=pg)
    if collective == "all_gather":
        inp = torch.ones(count, dtype=dtype, device=device)
        out = torch.empty(count * n, dtype=dtype, device=device)
        return lambda: dist.all_gather_into_tensor(out, inp, group=pg)
    if collective == "reduce_scatter":
        inp = torch.ones(count * n, dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        return lambda: dist.reduce_scatter_tensor(out, inp, group=pg)
    if collective == "all_to_all":
        inp = torch.ones(count * n, dtype=dtype, device=device)
        out = torch.empty(count * n, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=pg)
    if collective == "send_recv":
        # nccl-tests' sendrecv: every rank sends to the next in the ring and receives from the previous.
        send = torch.ones(count, dtype=dtype, device=device)
        recv = torch.empty(count, dtype=dtype, device=device)
        nxt, prv = ranks[(idx + 1) % n], ranks[(idx - 1) % n]

        def sendrecv() -> None:
            ops = [dist.P2POp(dist.isend, send, nxt, pg), dist.P2POp(dist.irecv, recv, prv, pg)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return sendrecv
    if collective == "broadcast":
        buf = torch.ones(count, dtype=dtype, device=device)
        return lambda: dist.broadcast(buf, src=ranks[0], group=pg)
    raise ValueError(collective)


def run(ctx: RankContext) -> WorkloadResult:
    a = ctx.cfg.args
    world, rank = ctx.world_size, ctx.rank
    dtype = getattr(torch, a["dtype"])
    elem_bytes = torch.tensor([], dtype=dtype).element_size()
    group_sizes = a.get("group_sizes") or default_group_sizes(world)
    collectives = a.get("collectives") or list(COLLECTIVES)
    sizes = message_sizes(a["min_bytes"], a["max_bytes"], a["factor"])
    iters, warmup = a["iters"], a["warmup_iters"]

    # new_group is collective over the whole world: every rank creates every group, in order.
    mine: dict[int, tuple[Any, list[int]]] = {}
    for g in group_sizes:
        for i in range(world // g):
            ranks = list(range(i * g, (i + 1) * g))
            pg = dist.group.WORLD if g == world else dist.new_group(ranks)
            if rank in ranks:
                mine[g] = (pg, ranks)

    local: list[tuple[str, int, int, int, float]] = []  # (collective, group size, count, size, time_us)
    # torch 2.13 marks all_gather_into_tensor / reduce_scatter_tensor deprecated; they are the APIs
    # FSDP2 and Megatron call, so they are what is measured.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    with ctx.profiler():
        for g in group_sizes:
            for coll in collectives:
                for req in sizes:
                    count, size = _count_and_size(coll, req, g, elem_bytes)
                    if count == 0:
                        continue
                    op = None
                    if g in mine:
                        pg, ranks = mine[g]
                        op = _make_op(coll, count, g, ranks, rank, pg, dtype, ctx.device)
                        with torch.profiler.record_function(f"warmup:{coll}:{size}B:g{g}"):
                            for _ in range(warmup):
                                op()
                    ctx.synchronize()
                    dist.barrier()
                    t0 = time.perf_counter()
                    if op is not None:
                        with torch.profiler.record_function(f"sweep:{coll}:{size}B:g{g}"):
                            for _ in range(iters):
                                op()
                        ctx.synchronize()
                    dt_us = (time.perf_counter() - t0) * 1e6 / iters
                    local.append((coll, g, count, size, dt_us if op is not None else math.nan))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)

    rows = []
    for i, (coll, g, count, size, _) in enumerate(local):
        # nccl-tests' default (-a 1): the time is averaged over the ranks that ran it.
        ts = [r[i][4] for r in gathered if not math.isnan(r[i][4])]
        time_us = sum(ts) / len(ts)
        algbw = size / 1e9 / (time_us * 1e-6)
        rows.append(
            {
                "collective": coll,
                "size_bytes": size,
                "count": count,
                "dtype": DTYPE_NAMES.get(a["dtype"], a["dtype"]),
                "redop": "sum" if coll in _REDUCING else "none",
                "in_place": coll in _IN_PLACE,
                "time_us": time_us,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * busbw_factor(coll, g),
                "nranks": world,
                "group_size": g,
                "backend": ctx.cfg.backend,
            }
        )
    table = pd.DataFrame(rows)
    notes = [
        f"{iters} timed iterations after {warmup} warm-up ones per row; times averaged over ranks",
        "groups of each size are consecutive ranks and run concurrently",
    ]
    return WorkloadResult(tables={"collectives": table}, notes=notes)
