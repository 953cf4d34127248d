"""Schedule analysis that needs no engine: a unit-cost replay and peak in-flight activations.

The unit-cost replay is the idealised machine the published bubble formulas assume: zero
communication, each rank runs its actions in order, each as soon as its inputs
(``required_inputs``) are done, with fixed costs per action kind. Tests use it to check the
generators against those formulas; the engine, which prices actions from the workload and
sends activations over a fabric, must agree with it when given the same costs and a free
network.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from simulator.schedules.base import Action, PipelineSchedule
from simulator.schedules.validate import check_progress


@dataclass(frozen=True)
class UnitCostReplay:
    makespan: float
    # start[r][i], end[r][i]: times of rank r's i-th action.
    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    # Sum of the rank's action costs (its compute time).
    busy: tuple[float, ...]
    # Per rank, how much of its actions' ``wait`` (replay_action_costs) its idle hid.
    hidden: tuple[float, ...] = ()

    def bubble(self, rank: int) -> float:
        """Idle time of ``rank`` within the makespan."""
        return self.makespan - self.busy[rank]




def replay_unit_costs(
    schedule: PipelineSchedule,
    F: float,
    B: float,
    W: float = 0.0,
    FB: float | None = None,
    I: float | None = None,  # noqa: E741 -- the kind's letter, like F, B and W
) -> UnitCostReplay:
    """Replay ``schedule`` with per-action costs and no communication.

    F, B, W, I: costs of one action of that kind on one stage (B is the full backward;
    I defaults to ``B - W``). FB: cost of an overlapped F&B pair, default the sum of its two
    parts. A pair's outputs are available when the pair ends. Raises ``UserError`` (from the
    deadlock check) if the schedule cannot complete.
    """
    i_cost = B - W if I is None else I
    leaf_cost = {"F": F, "B": B, "I": i_cost, "W": W}

    def cost(action: Action) -> float:
        if action.kind == "FB":
            return FB if FB is not None else sum(leaf_cost[a.kind] for a in action.leaves)
        return leaf_cost[action.kind]

    return replay_action_costs(schedule, cost)


def replay_action_costs(schedule: PipelineSchedule, cost: Callable[[Action], float],
                        wait: Callable[[Action], float] | None = None) -> UnitCostReplay:
    """``replay_unit_costs`` with any cost per action (``cost(action)``, an FB pair's as a
    whole): stages that differ, such as a first stage holding the embedding and a last one
    holding the LM head and loss, replayed as the schedule places them.

    ``wait(action)``: the part of its cost (at most all of it) the action spends waiting at
    its start for something the rank issued before it, independent of its inputs -- a ZeRO-3
    parameter gather the plan prefetches on the rank's own order. That wait runs from the
    rank's previous action's end, so idle spent waiting for inputs hides it: the action
    starts at max(inputs ready, previous end + wait) and runs its cost less the wait, not
    at inputs ready plus its whole cost. ``start`` is then when the action's work begins."""
    finish: dict[tuple[int, str, int], float] = {}
    waiting: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    pos = [0] * schedule.num_ranks
    clock = [0.0] * schedule.num_ranks
    starts: list[list[float]] = [[] for _ in range(schedule.num_ranks)]
    ends: list[list[float]] = [[] for _ in range(schedule.num_ranks)]
    busy = [0.0] * schedule.num_ranks
    hidden = [0.0] * schedule.num_ranks
    ready = list(range(schedule.num_ranks))
    events = schedule.action_events
    while ready:
        rank = ready.pop()
        ops = schedule.actions[rank]
        ev_of = events[rank]
        i, t = pos[rank], clock[rank]
        while i < len(ops):
            action = ops[i]
            needs, makes = ev_of[i]
            begin = t
            lacking = None
            for event in needs:
                at = finish.get(event)
                if at is None:
                    lacking = event
                    break
                begin = max(begin, at)
            if lacking is not None:
                waiting[lacking].append(rank)
                break
            c = cost(action)
            busy[rank] += c
            if wait is not None:
                w = min(wait(action), c)
                # The wait ran from the previous end (t); what of it the idle up to the inputs covered is hidden.
                hidden[rank] += min(w, begin - t)
                begin = max(begin, t + w)
                c -= w
            t = begin + c
            starts[rank].append(begin)
            ends[rank].append(t)
            for event in makes:
                finish[event] = t
                ready.extend(waiting.pop(event, ()))
            i += 1
        pos[rank], clock[rank] = i, t
    if any(pos[r] < len(schedule.actions[r]) for r in range(schedule.num_ranks)):
        check_progress(schedule)  # raises, naming the blocked ranks
        raise AssertionError(f"replay stalled but the progress check passed: {pos=}")
    return UnitCostReplay(
        makespan=max(clock, default=0.0),
        start=tuple(map(tuple, starts)),
        end=tuple(map(tuple, ends)),
        busy=tuple(busy),
        hidden=tuple(hidden),
    )


def makespan_unit_costs(
    schedule: PipelineSchedule,
    F: float,
    B: float,
    W: float = 0.0,
    FB: float | None = None,
    I: float | None = None,  # noqa: E741
) -> float:
    """Makespan of ``replay_unit_costs`` (same arguments)."""
    return replay_unit_costs(schedule, F, B, W, FB, I).makespan


def peak_activations(schedule: PipelineSchedule, stage_weights: Sequence[float] | None = None) -> list[float]:
    """Per rank, the most microbatch activations held at once, in stage-microbatch units.

    Unit: the activations one stage stashes for one microbatch (one pipeline position's worth).
    A forward F(s, m) takes ``stage_weights[s]`` (default 1) and holds it until the input-grad
    pass of (s, m) -- its B, or its I when the backward is split. The W that follows an I
    still needs the layer inputs and output gradients, a small part of the stash; like the
    zero-bubble and DualPipe papers (ZB-H1 "same memory as 1F1B", DualPipe "PP+1") this count
    leaves it out, and the memory model may add it. An overlapped F&B pair is counted with its
    F allocating before its B frees, the conservative order.

    Counted in each rank's action order, which is the order the memory is taken and freed no
    matter how long actions take. With the default weights a 1F1B rank 0 peaks at pp and a
    DualPipe rank at pp+1 stage-microbatches; pass ``1/vpp`` per stage for units of a rank's
    whole model share, or bytes per stage for bytes.
    """
    if stage_weights is None:
        weights: Sequence[float] = [1.0] * schedule.num_stages
    else:
        weights = stage_weights
        if len(weights) != schedule.num_stages:
            raise ValueError(f"{len(weights)=} must equal {schedule.num_stages=}")
    # Per rank, the stash after each F and B/I leaf in order; only an F raises it, so the peak is
    # the largest running sum (and at least nothing held). One pass of numpy a rank: the sweep
    # estimate asks this for every layout's memory.
    w = np.asarray(weights, dtype=float)
    peaks = []
    for stages, signs in schedule.stash_steps:
        peaks.append(max(0.0, float(np.cumsum(signs * w[stages]).max())) if len(stages) else 0.0)
    return peaks



__all__ = ["UnitCostReplay", "replay_unit_costs", "makespan_unit_costs", "peak_activations"]
