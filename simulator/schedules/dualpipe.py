"""DualPipe and DualPipeV (DeepSeek-V3 report, 2024; github.com/deepseek-ai/DualPipe).

Both are written with DeepSeek's eight named steps and closed-form step counts. In DeepSeek's
code a rank's "phase 0" chunk is the one its first microbatches enter and "phase 1" the other;
here ``s0`` and ``s1`` are those two stages. With ``H`` half ranks, ``h`` this rank's distance
from the nearer end, and ``N`` microbatches per direction:

    1  nF0      2*(H-h-1) x  F(s0)
    2  nF0F1    (h+1)     x  F(s0) F(s1)
    3  nB1W1F1  (H-h-1)   x  I(s1) W F(s1)                 (zero bubble)
    4  nF0B1F1B0 (N-2H+h+1) x F(s0)&B(s1)  F(s1)&B(s0)     (overlapped pairs; the middle rank
                                                            runs its first pair apart)
    5  nB1F1B0  (H-h-1)   x  B(s1) F(s1)&B(s0)
    6  nB1B0    (h+1)     x  B(s1) B(s0), switching to I from the middle step on
    7  nWB0     (H-h-1)   x  W I(s0)
    8  nW       (h+1)     x  W

W always runs the oldest pending input-grad's weight-grad (DeepSeek's WeightGradStore queue).
"""

from __future__ import annotations

from simulator.errors import UserError
from simulator.schedules._build import RankOps, check_counts, check_vpp, v_stage_rank
from simulator.schedules.base import Action, PipelineSchedule


def _rank_ops(
    s0: int, s1: int, half_rank: int, num_half_ranks: int, chunks: int, is_middle: bool, mb_offset: dict[int, int]
) -> list[Action]:
    h, big_h, n = half_rank, num_half_ranks, chunks
    ops = RankOps(mb_offset)
    # Step 1: nF0
    for _ in range(2 * (big_h - h - 1)):
        ops.f(s0)
    # Step 2: nF0F1
    for _ in range(h + 1):
        ops.f(s0)
        ops.f(s1)
    # Step 3: nB1W1F1
    for _ in range(big_h - h - 1):
        ops.i(s1)
        ops.w_oldest()
        ops.f(s1)
    # Step 4: nF0B1F1B0
    for i in range(n - 2 * big_h + h + 1):
        if i == 0 and is_middle:
            # DeepSeek: not overlapped, to shrink the bubble at the turn of the pipeline.
            ops.f(s0)
            ops.b(s1)
        else:
            ops.fb(s0, s1)
        ops.fb(s1, s0)
    # Step 5: nB1F1B0
    for _ in range(big_h - h - 1):
        ops.b(s1)
        ops.fb(s1, s0)
    # Step 6: nB1B0, the second half with zero bubble
    step_6 = h + 1
    zero_bubble = False
    for i in range(step_6):
        if i == step_6 // 2 and h % 2 == 1:
            zero_bubble = True
        (ops.i if zero_bubble else ops.b)(s1)
        if i == step_6 // 2 and h % 2 == 0:
            zero_bubble = True
        (ops.i if zero_bubble else ops.b)(s0)
    # Step 7: nWB0
    for _ in range(big_h - h - 1):
        ops.w_oldest()
        ops.i(s0)
    # Step 8: nW
    for _ in range(h + 1):
        ops.w_oldest()
    for s in (s0, s1):
        assert ops.count(s, "F") == n and ops.count(s, "BI") == n, (
            f"{s=}, {ops.count(s, 'F')=}, {ops.count(s, 'BI')=}, {n=}, {half_rank=}, {num_half_ranks=}"
        )
    assert ops.pending_weights() == 0, f"{ops.pending_weights()=}, {half_rank=}, {num_half_ranks=}"
    return ops.ops


def dualpipe(num_ranks: int, num_microbatches: int, vpp: int = 1) -> PipelineSchedule:
    """DualPipe: two pipelines in opposite directions over the same ranks, two model copies.

    Chain 0 is stages ``0..pp-1`` with stage r on rank r and carries microbatches ``0..n/2-1``;
    chain 1 is stages ``pp..2pp-1`` with position j (stage ``pp+j``) on rank ``pp-1-j`` and
    carries microbatches ``n/2..n-1``. Every rank holds one stage of each chain, so its
    parameters are twice a one-chain schedule's. Ranks in the first half enter chain 0 first;
    ranks in the second half enter chain 1 first (DeepSeek's ``phase ^= is_in_second_half``).

    Needs an even pp and an even n with ``n >= 2*pp`` (DeepSeek's asserts).
    """
    name = "dualpipe"
    check_counts(name, num_ranks, num_microbatches)
    check_vpp(name, vpp, (1,), "DualPipe holds one stage of each direction per rank; use vpp=1")
    p, n = num_ranks, num_microbatches
    if p % 2:
        raise UserError(f"schedule {name!r}: pp={p} must be even (the two directions meet in the middle); use an even pp or schedule dualpipev")
    if n % 2 or n < 2 * p:
        raise UserError(
            f"schedule {name!r}: num_microbatches={n} must be even and at least 2*pp={2 * p} "
            "(half go each direction); raise the global batch"
        )
    half_ranks, chunks = p // 2, n // 2
    down = tuple(range(p))
    up = tuple(range(p, 2 * p))
    stage_rank = tuple(range(p)) + tuple(p - 1 - j for j in range(p))
    mb_offset = {s: chunks for s in up}
    actions = []
    for r in range(p):
        h = min(r, p - 1 - r)
        mine = (r, p + (p - 1 - r))
        s0, s1 = mine if r < half_ranks else mine[::-1]
        actions.append(tuple(_rank_ops(s0, s1, h, half_ranks, chunks, h == half_ranks - 1, mb_offset)))
    return PipelineSchedule(
        name=name,
        num_ranks=p,
        num_microbatches=n,
        chains=(down, up),
        stage_rank=stage_rank,
        actions=tuple(actions),
        microbatch_chain=(0,) * chunks + (1,) * chunks,
    )


def dualpipev(num_ranks: int, num_microbatches: int, vpp: int = 2) -> PipelineSchedule:
    """DualPipeV: DualPipe cut in half and folded into a V over ``pp`` ranks (2*pp stages).

    Rank r holds stages r and ``2pp-1-r`` (torch's "v" placement); all n microbatches go down
    and back up the one chain. Same steps as DualPipe with ``H = pp``, ``h = r``, ``N = n``;
    matches torch's ``ScheduleDualPipeV``. Needs ``n >= 2*pp`` (torch and DeepSeek).
    """
    name = "dualpipev"
    check_counts(name, num_ranks, num_microbatches)
    check_vpp(name, vpp, (1, 2), "DualPipeV always holds 2 stages per rank; leave vpp at 1 or set it to 2")
    p, n = num_ranks, num_microbatches
    if n < 2 * p:
        raise UserError(
            f"schedule {name!r}: num_microbatches={n} is below the number of stages 2*pp={2 * p}; "
            "raise the global batch or lower pp"
        )
    actions = tuple(tuple(_rank_ops(r, 2 * p - 1 - r, r, p, n, r == p - 1, {})) for r in range(p))
    return PipelineSchedule(
        name=name,
        num_ranks=p,
        num_microbatches=n,
        chains=(tuple(range(2 * p)),),
        stage_rank=v_stage_rank(p),
        actions=actions,
        microbatch_chain=(0,) * n,
    )


__all__ = ["dualpipe", "dualpipev"]
