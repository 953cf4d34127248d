"""Schedule names -> generators, and the one entry point ``build_schedule``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from simulator.errors import UserError, did_you_mean_name
from simulator.schedules.base import PipelineSchedule
from simulator.schedules.dualpipe import dualpipe, dualpipev
from simulator.schedules.one_f_one_b import gpipe, interleaved_1f1b, looped_bfs, one_f_one_b
from simulator.schedules.zero_bubble import zb_h1, zbv


@dataclass(frozen=True)
class ScheduleInfo:
    generator: Callable[[int, int, int], PipelineSchedule]
    summary: str
    # The torch.distributed.pipelining class that runs the same order, if any.
    torch_class: str | None


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo(gpipe, "all forwards, then all backwards", "ScheduleGPipe"),
    "1f1b": ScheduleInfo(one_f_one_b, "one forward, one backward (PipeDream-Flush, Megatron)", "Schedule1F1B"),
    "interleaved-1f1b": ScheduleInfo(
        interleaved_1f1b, "Megatron's interleaved 1F1B, vpp >= 2 chunks per rank", "ScheduleInterleaved1F1B"
    ),
    "looped-bfs": ScheduleInfo(
        looped_bfs, "breadth-first: each local chunk over all microbatches, vpp >= 1 chunks per rank", "ScheduleLoopedBFS"
    ),
    "zb-h1": ScheduleInfo(
        zb_h1, "zero bubble H1: split backward, W delayed into the bubble", "ScheduleInterleavedZeroBubble"
    ),
    "zbv": ScheduleInfo(zbv, "zero bubble V: 2 chunks per rank in a V", "ScheduleZBVZeroBubble"),
    "dualpipe": ScheduleInfo(dualpipe, "DeepSeek DualPipe: two directions, 2x parameters", None),
    "dualpipev": ScheduleInfo(dualpipev, "DeepSeek DualPipeV: DualPipe folded into a V", "ScheduleDualPipeV"),
}


def schedule_names() -> list[str]:
    return list(SCHEDULES)


def build_schedule(name: str, num_ranks: int, num_microbatches: int, vpp: int = 1) -> PipelineSchedule:
    """The named schedule for ``num_ranks`` pipeline ranks, ``num_microbatches`` and ``vpp``.

    ``vpp`` is model chunks per rank: 1 for gpipe, 1f1b and dualpipe; >= 2 for interleaved-1f1b;
    >= 1 for zb-h1; 1 or 2 for zbv and dualpipev, which always hold 2 (so their layers split
    into ``schedule.num_positions == 2*pp`` positions either way). Raises ``UserError`` for an
    unknown name or an unsupported combination.
    """
    info = SCHEDULES.get(name) if isinstance(name, str) else None
    if info is None:
        # (`1F1B` in another case, `interleaved` for interleaved-1f1b: the names it begins or holds)
        raise UserError(f"unknown pipeline schedule {name!r}{did_you_mean_name(name, SCHEDULES)}; choose one of: "
                        f"{', '.join(SCHEDULES)}")
    return info.generator(num_ranks, num_microbatches, vpp)
