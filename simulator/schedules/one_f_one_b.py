"""GPipe, 1F1B and Megatron's interleaved 1F1B: one chain, full backwards (B)."""

from __future__ import annotations

from simulator.errors import UserError
from simulator.schedules._build import check_counts, check_vpp, looped_stage_rank, single_chain
from simulator.schedules.base import Action, PipelineSchedule


def gpipe(num_ranks: int, num_microbatches: int, vpp: int = 1) -> PipelineSchedule:
    """Fill-drain (Huang et al. 2019): every forward, then every backward in microbatch order.

    Matches ``torch.distributed.pipelining.ScheduleGPipe`` (backwards also in ascending order).
    """
    check_counts("gpipe", num_ranks, num_microbatches)
    check_vpp("gpipe", vpp, (1,), "GPipe holds one stage per rank; use vpp=1 (or schedule interleaved-1f1b)")
    n = num_microbatches
    actions = [
        [Action(r, "F", m) for m in range(n)] + [Action(r, "B", m) for m in range(n)] for r in range(num_ranks)
    ]
    return single_chain("gpipe", num_ranks, n, range(num_ranks), actions)


def one_f_one_b(num_ranks: int, num_microbatches: int, vpp: int = 1) -> PipelineSchedule:
    """PipeDream-Flush / Megatron 1F1B.

    Rank r: warm-up ``min(pp-1-r, n)`` forwards; steady ``n - warm-up`` pairs (F of the next
    microbatch, then B of the oldest); cool-down: the remaining ``warm-up`` backwards. At most
    ``pp - r`` microbatches are in flight on rank r. Same order as torch's ``Schedule1F1B`` runs
    it (torch phrases it as pp-r forwards, then B/F pairs).
    """
    check_counts("1f1b", num_ranks, num_microbatches)
    check_vpp("1f1b", vpp, (1,), "1F1B holds one stage per rank; use vpp=1 or schedule interleaved-1f1b")
    p, n = num_ranks, num_microbatches
    actions = []
    for r in range(p):
        warmup = min(p - 1 - r, n)
        steady = n - warmup
        ops = [Action(r, "F", m) for m in range(warmup)]
        for k in range(steady):
            ops += [Action(r, "F", k + warmup), Action(r, "B", k)]
        ops += [Action(r, "B", k) for k in range(steady, n)]
        actions.append(ops)
    return single_chain("1f1b", p, n, range(p), actions)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, vpp: int = 2) -> PipelineSchedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021), depth-first.

    Rank r holds stages ``r, r+pp, ..., r+(vpp-1)*pp``. Microbatches go in groups of ``pp``
    (Megatron's ``microbatch_group_size_per_vp_stage`` default): the k-th forward on a rank runs
    chunk ``(k % (pp*vpp)) // pp`` of microbatch ``(k // (pp*vpp))*pp + k % pp``; the k-th
    backward runs the chunks in reverse. Like Megatron, n must be a multiple of pp: with a
    shorter last group this order deadlocks (``validate_schedule`` finds it for pp=5, n=7).

    Warm-up ``min(2*(pp-1-r) + (vpp-1)*pp, n*vpp)`` forwards -- or every forward when
    ``n == pp``, as Megatron does; steady: F then B; cool-down: the remaining backwards.
    """
    name = "interleaved-1f1b"
    check_counts(name, num_ranks, num_microbatches)
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 2:
        raise UserError(
            f"schedule {name!r}: vpp={vpp!r} must be at least 2 (model chunks per rank); "
            "set vpp>=2 or use schedule 1f1b"
        )
    p, n, v = num_ranks, num_microbatches, vpp
    if n % p:
        lower, upper = (n // p) * p, (n // p + 1) * p
        fix = f"use {lower} or {upper}" if lower else f"use {upper}"
        raise UserError(
            f"schedule {name!r}: num_microbatches={n} is not a multiple of pp={p}, which Megatron's "
            f"interleaved schedule requires; {fix} (change the global batch)"
        )
    group = p
    # (microbatch, chunk) of the k-th forward, identical on every rank.
    table = [(first + j, c) for first in range(0, n, group) for c in range(v) for j in range(group)]
    total = n * v
    assert len(table) == total, f"{len(table)=}, {total=}"

    actions = []
    for r in range(p):
        if n == p:
            warmup = total
        else:
            warmup = min(2 * (p - 1 - r) + (v - 1) * group, total)
        steady = total - warmup

        def fwd(k: int) -> Action:
            m, c = table[k]
            return Action(c * p + r, "F", m)

        def bwd(k: int) -> Action:
            m, c = table[k]
            return Action((v - 1 - c) * p + r, "B", m)

        ops = [fwd(k) for k in range(warmup)]
        for k in range(steady):
            ops += [fwd(k + warmup), bwd(k)]
        ops += [bwd(k) for k in range(steady, total)]
        actions.append(ops)
    return single_chain(name, p, n, looped_stage_rank(p, v), actions)


def looped_bfs(num_ranks: int, num_microbatches: int, vpp: int = 2) -> PipelineSchedule:
    """Breadth-first pipeline parallelism (Lamy-Poirier 2022, arXiv 2211.05953), as
    ``torch.distributed.pipelining.ScheduleLoopedBFS`` runs it.

    Rank r holds stages ``r, r+pp, ..., r+(vpp-1)*pp`` (the loop placement). Forward: for each
    local stage in order, every microbatch in order; backward: the local stages in reverse, each
    over every microbatch in reverse order (torch's ``_calculate_single_rank_operations``). Like
    GPipe it holds every microbatch's activations of each stage until its backward; unlike
    interleaved 1F1B any microbatch count runs. vpp=1 is GPipe with the backwards reversed.
    """
    name = "looped-bfs"
    check_counts(name, num_ranks, num_microbatches)
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        raise UserError(f"schedule {name!r}: vpp={vpp!r} must be at least 1 (model chunks per rank)")
    p, n, v = num_ranks, num_microbatches, vpp
    actions = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        ops = [Action(s, "F", m) for s in stages for m in range(n)]
        ops += [Action(s, "B", m) for s in reversed(stages) for m in reversed(range(n))]
        actions.append(ops)
    return single_chain(name, p, n, looped_stage_rank(p, v), actions)


__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs"]
