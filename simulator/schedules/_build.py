"""Shared plumbing for the schedule generators (internal)."""

from __future__ import annotations

from collections import defaultdict, deque

from simulator.errors import UserError
from simulator.schedules.base import Action, PipelineSchedule


class RankOps:
    """Appends one rank's actions, numbering microbatches per (stage, kind) in issue order.

    Every generator here (like torch's and DeepSeek's) hands out microbatches to a stage in
    increasing order, so the builder keeps one counter per (stage, F | input-grad | W) and the
    generator only says which stage runs next. ``mb_offset`` maps a stage to the first global
    microbatch of its chain (DualPipe numbers the second direction's microbatches after the
    first's).
    """

    def __init__(self, mb_offset: dict[int, int] | None = None):
        self.ops: list[Action] = []
        self._next: defaultdict[tuple[int, str], int] = defaultdict(int)
        self._offset = mb_offset or {}
        # I actions whose W has not been issued yet, oldest first (DualPipe's WeightGradStore).
        self._pending_w: deque[tuple[int, int]] = deque()

    def _take(self, stage: int, counter: str) -> int:
        local = self._next[(stage, counter)]
        self._next[(stage, counter)] = local + 1
        return self._offset.get(stage, 0) + local

    def make_f(self, stage: int) -> Action:
        return Action(stage, "F", self._take(stage, "F"))

    def make_b(self, stage: int) -> Action:
        m = self._take(stage, "BI")
        # A full backward also settles the weight-gradient counter, so W numbering stays aligned.
        self._take(stage, "W")
        return Action(stage, "B", m)

    def f(self, stage: int) -> None:
        self.ops.append(self.make_f(stage))

    def b(self, stage: int) -> None:
        self.ops.append(self.make_b(stage))

    def i(self, stage: int) -> None:
        m = self._take(stage, "BI")
        self._pending_w.append((stage, m))
        self.ops.append(Action(stage, "I", m))

    def w_oldest(self) -> None:
        """W of the oldest I still waiting for one; nothing if none waits (as DualPipe does)."""
        if self._pending_w:
            stage, m = self._pending_w.popleft()
            self._take(stage, "W")
            self.ops.append(Action(stage, "W", m))

    def w_of(self, stage: int) -> None:
        """W of the next microbatch of ``stage`` (ZB-V numbers W per chunk, not in I order)."""
        m = self._take(stage, "W")
        self._pending_w.remove((stage, m))
        self.ops.append(Action(stage, "W", m))

    def fb(self, f_stage: int, b_stage: int) -> None:
        f, b = self.make_f(f_stage), self.make_b(b_stage)
        self.ops.append(Action(f.stage, "FB", f.microbatch, sub=(f, b)))

    def count(self, stage: int, counter: str) -> int:
        """Actions issued so far for ``stage``: counter "F", "BI" (B or I) or "W" (W or B)."""
        return self._next[(stage, counter)]

    def pending_weights(self) -> int:
        return len(self._pending_w)


def check_counts(name: str, num_ranks: int, num_microbatches: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise UserError(f"schedule {name!r}: num_ranks={num_ranks!r} is invalid; use a positive integer (pp)")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise UserError(
            f"schedule {name!r}: num_microbatches={num_microbatches!r} is invalid; use a positive integer "
            "(global batch / (micro batch * dp))"
        )


def check_vpp(name: str, vpp: int, allowed: tuple[int, ...], fix: str) -> None:
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp not in allowed:
        raise UserError(f"schedule {name!r}: vpp={vpp!r} is not supported; {fix}")


def single_chain(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    stage_rank: list[int] | tuple[int, ...],
    actions: list[list[Action]],
) -> PipelineSchedule:
    return PipelineSchedule(
        name=name,
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        chains=(tuple(range(len(stage_rank))),),
        stage_rank=tuple(stage_rank),
        actions=tuple(tuple(a) for a in actions),
        microbatch_chain=(0,) * num_microbatches,
    )


def looped_stage_rank(num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage s on rank s % pp: Megatron's and torch's "loop" placement for interleaved schedules."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_stage_rank(num_ranks: int) -> tuple[int, ...]:
    """Stage s on rank s going down, then back up: torch's "v" placement (2 stages per rank).

    Rank r holds stages r and 2*pp-1-r, so the first and last stage share rank 0 and the turn of
    the V sits on the last rank (no transfer between stages pp-1 and pp).
    """
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))
