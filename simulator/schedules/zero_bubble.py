"""Zero-bubble schedules (Qi et al. 2024): the backward split into input-grad I and weight-grad W.

Both follow torch.distributed.pipelining's implementations action for action, so a schedule
tuned here runs as-is under torchtitan.
"""

from __future__ import annotations

from simulator.errors import UserError
from simulator.schedules._build import (
    RankOps,
    check_counts,
    check_vpp,
    looped_stage_rank,
    single_chain,
    v_stage_rank,
)
from simulator.schedules.base import PipelineSchedule


def zb_h1(num_ranks: int, num_microbatches: int, vpp: int = 1) -> PipelineSchedule:
    """ZB-H1: 1F1B with I in place of B and each rank's W's delayed into the cool-down bubble.

    Rank r: warm-up ``min(pp-1-r, n)`` forwards; steady: F, I, and -- from the (r+1)-th steady
    step on -- the W of the oldest I still waiting; cool-down: I (+ W); then the last ``r`` W's.
    So the last rank, whose cool-down bubble is longest, holds the most W's back. In-flight
    activations stay at 1F1B's ``pp - r``.

    With vpp >= 2 this is torch's ``ScheduleInterleavedZeroBubble`` (ZB-H1 over looped chunks,
    microbatches in rounds of ``n // max(1, n // pp)``); with vpp == 1 that class reduces to
    ZB-H1, which is what the tests compare against.
    """
    name = "zb-h1"
    check_counts(name, num_ranks, num_microbatches)
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        raise UserError(f"schedule {name!r}: vpp={vpp!r} is invalid; use a positive integer (1 for plain ZB-H1)")
    p, n, v = num_ranks, num_microbatches, vpp
    rounds = max(1, n // p)
    per_round = n // rounds
    if v > 1 and n % rounds:
        raise UserError(
            f"schedule {name!r}: num_microbatches={n} with vpp={v} must be a multiple of the number of "
            f"rounds n//pp={rounds} (torch's interleaved zero bubble); use a multiple of pp={p}"
        )
    total = n * v
    actions = []
    for r in range(p):
        warmup = min((v - 1) * per_round + (p - 1 - r), total)
        steady = total - warmup

        def f_stage(k: int) -> int:
            return ((k // per_round) % v) * p + r

        def b_stage(k: int) -> int:
            return (v - 1 - (k // per_round) % v) * p + r

        ops = RankOps()
        for k in range(warmup):
            ops.f(f_stage(k))
        for k in range(steady):
            ops.f(f_stage(k + warmup))
            ops.i(b_stage(k))
            if k >= r:
                ops.w_oldest()
        for k in range(steady, total):
            ops.i(b_stage(k))
            if k >= r:
                ops.w_oldest()
        while ops.pending_weights():
            ops.w_oldest()
        actions.append(ops.ops)
    return single_chain(name, p, n, looped_stage_rank(p, v), actions)


def zbv(num_ranks: int, num_microbatches: int, vpp: int = 2) -> PipelineSchedule:
    """ZB-V (Qi et al. 2024, section 6): two chunks per rank in a V, F = I = W balanced.

    Rank r holds stage ``s0 = r`` (going down) and ``s1 = 2*pp-1-r`` (coming back). As torch's
    ``ScheduleZBVZeroBubble``, it is built for ``n' = max(n, 2*pp-1)`` microbatches and the
    actions of microbatches >= n are then dropped:

    - warm-up: ``2*(pp-r)-1`` F(s0); ``r`` times F(s1) F(s0); ``pp-r`` times F(s1) I(s1) W(s1)
    - steady, ``n'-pp`` steps: F(s0) (while any remain) I(s0) W(s0) F(s1) I(s1) W(s1)
    - cool-down: ``r`` times I(s0) I(s1); ``pp-r`` times I(s0) W(s0); the pending W(s1), W(s0).
    """
    name = "zbv"
    check_counts(name, num_ranks, num_microbatches)
    check_vpp(name, vpp, (1, 2), "ZB-V always holds 2 stages per rank; leave vpp at 1 or set it to 2")
    p, n = num_ranks, num_microbatches
    n_built = max(2 * p - 1, n)
    actions = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        ops = RankOps()
        for _ in range(2 * (p - r) - 1):
            ops.f(s0)
        for _ in range(r):
            ops.f(s1)
            ops.f(s0)
        for _ in range(p - r):
            ops.f(s1)
            ops.i(s1)
            ops.w_of(s1)
        f0_left = n_built - (2 * p - r - 1)
        for step in range(n_built - p):
            if step < f0_left:
                ops.f(s0)
            ops.i(s0)
            ops.w_of(s0)
            ops.f(s1)
            ops.i(s1)
            ops.w_of(s1)
        for _ in range(r):
            ops.i(s0)
            ops.i(s1)
        for _ in range(p - r):
            ops.i(s0)
            ops.w_of(s0)
        while ops.count(s1, "W") < n_built:
            ops.w_of(s1)
        while ops.count(s0, "W") < n_built:
            ops.w_of(s0)
        for s in (s0, s1):
            for kind in ("F", "BI", "W"):
                assert ops.count(s, kind) == n_built, f"{r=}, {s=}, {kind=}, {ops.count(s, kind)=}, {n_built=}"
        actions.append([a for a in ops.ops if a.microbatch < n])
    return single_chain(name, p, n, v_stage_rank(p), actions)


__all__ = ["zb_h1", "zbv"]
