"""Static checks that a schedule can complete, before anything is simulated.

``validate_schedule`` raises ``UserError`` naming the rank, the action and the reason for the
first problem it finds, in this order:

1. shape: one action list per rank, stage ids in range, each stage run by the rank that holds
   it, known kinds, FB pairs made of an F and a B or I on that rank, microbatch ids in range
   and on the chain the microbatch flows through;
2. completeness: per (stage, microbatch) exactly one F and either one B or one I plus one W;
3. local order: a B/I after its F on the rank, a W after its I;
4. cross-rank progress: every rank runs its list in order, an action starting once the events
   of ``required_inputs`` are done (no durations needed -- only order matters). If ranks are
   left blocked, the message lists each blocked rank, the action it waits at and the input it
   lacks.
"""

from __future__ import annotations

from collections import defaultdict

from simulator.errors import UserError
from simulator.schedules.base import BACKWARD_INPUT_KINDS, Action, PipelineSchedule, required_inputs

_KINDS = ("F", "B", "I", "W", "FB")


def _describe_event(schedule: PipelineSchedule, event: tuple[int, str, int]) -> str:
    stage, what, m = event
    label = f"{stage}F{m}" if what == "F" else f"{stage}B{m}/{stage}I{m}"
    if 0 <= stage < schedule.num_stages:
        return f"{label} on rank {schedule.stage_rank[stage]}"
    return label


def _where(rank: int, idx: int, action: Action) -> str:
    """Where a problem is, for its message (formatted only when there is one)."""
    return f"rank {rank}, action {idx} ({action})"




def _check_shape(schedule: PipelineSchedule) -> None:
    s_count, n = schedule.num_stages, schedule.num_microbatches
    if len(schedule.actions) != schedule.num_ranks:
        raise UserError(
            f"actions are listed for {len(schedule.actions)} ranks but the schedule has "
            f"num_ranks={schedule.num_ranks}; give one action list per pipeline rank"
        )
    for s, r in enumerate(schedule.stage_rank):
        if not 0 <= r < schedule.num_ranks:
            raise UserError(
                f"stage {s} is placed on rank {r}, outside 0..{schedule.num_ranks - 1}; "
                "fix the stage-to-rank map"
            )
    chain_stages = [set(c) for c in schedule.chains]
    for rank, ops in enumerate(schedule.actions):
        for idx, action in enumerate(ops):
            if action.kind not in _KINDS:
                raise UserError(f"{_where(rank, idx, action)}: unknown kind {action.kind!r}; use one of F, B, I, W, FB")
            if action.kind == "FB":
                sub = action.sub
                if sub is None or len(sub) != 2 or sub[0].kind != "F" or sub[1].kind not in ("B", "I"):
                    raise UserError(
                        f"{_where(rank, idx, action)}: an overlapped pair must hold one F and then one B or I, e.g. (0F3;7B1)"
                    )
            elif action.sub is not None:
                raise UserError(f"{_where(rank, idx, action)}: only FB actions carry sub-actions; drop the pair or make it FB")
            for leaf in action.leaves:
                if not 0 <= leaf.stage < s_count:
                    raise UserError(
                        f"{_where(rank, idx, action)}: stage {leaf.stage} does not exist; stages are 0..{s_count - 1}"
                    )
                if schedule.stage_rank[leaf.stage] != rank:
                    raise UserError(
                        f"{_where(rank, idx, action)}: stage {leaf.stage} lives on rank {schedule.stage_rank[leaf.stage]}, not on "
                        f"rank {rank}; move the action to rank {schedule.stage_rank[leaf.stage]}'s list"
                    )
                if not 0 <= leaf.microbatch < n:
                    raise UserError(
                        f"{_where(rank, idx, action)}: microbatch {leaf.microbatch} is out of range 0..{n - 1}; "
                        f"the schedule has {n} microbatches"
                    )
                chain = schedule.chain_of_microbatch(leaf.microbatch)
                if leaf.stage not in chain_stages[chain]:
                    raise UserError(
                        f"{_where(rank, idx, action)}: microbatch {leaf.microbatch} flows through chain {chain}, which does not "
                        f"contain stage {leaf.stage}; run it on a stage of chain {chain}"
                    )


def _check_complete_and_ordered(schedule: PipelineSchedule) -> None:
    # (stage, microbatch) -> {kind: (rank, index)} of the first occurrence.
    seen: dict[tuple[int, int], dict[str, tuple[int, int]]] = defaultdict(dict)
    for rank, ops in enumerate(schedule.actions):
        for idx, action in enumerate(ops):
            for leaf in action.leaves:
                key = (leaf.stage, leaf.microbatch)
                kinds = seen[key]
                if leaf.kind in kinds:
                    raise UserError(
                        f"{_where(rank, idx, leaf)}: duplicate {leaf.kind} for stage {leaf.stage} microbatch {leaf.microbatch} "
                        f"(also action {kinds[leaf.kind][1]}); keep only one"
                    )
                if leaf.kind in ("B", "I"):
                    other = "I" if leaf.kind == "B" else "B"
                    if other in kinds:
                        raise UserError(
                            f"{_where(rank, idx, leaf)}: stage {leaf.stage} microbatch {leaf.microbatch} has both B and I; "
                            "use a full backward B or an I+W split, not both"
                        )
                    if "F" not in kinds:
                        raise UserError(
                            f"{_where(rank, idx, leaf)}: backward before its forward {leaf.stage}F{leaf.microbatch} on rank {rank}; "
                            "move the backward after the forward"
                        )
                if leaf.kind == "W":
                    if "B" in kinds:
                        raise UserError(
                            f"{_where(rank, idx, leaf)}: W after a full backward B of the same microbatch; a B already computes "
                            "the weight gradient, so drop the W or split the B into I and W"
                        )
                    if "I" not in kinds:
                        raise UserError(
                            f"{_where(rank, idx, leaf)}: W before its input-grad {leaf.stage}I{leaf.microbatch}; run the I first"
                        )
                kinds[leaf.kind] = (rank, idx)
    chain_stages = [set(c) for c in schedule.chains]
    for stage in range(schedule.num_stages):
        rank = schedule.stage_rank[stage]
        for m in range(schedule.num_microbatches):
            if stage not in chain_stages[schedule.chain_of_microbatch(m)]:
                continue
            kinds = seen.get((stage, m), {})
            missing = None
            if "F" not in kinds:
                missing = f"{stage}F{m}"
            elif "B" not in kinds and "I" not in kinds:
                missing = f"{stage}B{m} (or {stage}I{m} and {stage}W{m})"
            elif "I" in kinds and "W" not in kinds:
                missing = f"{stage}W{m} after {stage}I{m}"
            if missing:
                raise UserError(
                    f"rank {rank}: missing action {missing} for stage {stage} microbatch {m}; every microbatch "
                    "needs F and B (or I and W) on every stage of its chain"
                )


def check_progress(schedule: PipelineSchedule) -> None:
    """Run every rank's list in order under the dependency rule; report ranks left waiting.

    Each rank advances while its next action's inputs are done; a rank that blocks registers on
    the one event it lacks and is woken when that event completes, so the sweep is linear in the
    number of actions.
    """
    done: set[tuple[int, str, int]] = set()
    waiting: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    pos = [0] * schedule.num_ranks
    ready = list(range(schedule.num_ranks))
    blocked_on: dict[int, tuple[int, str, int]] = {}
    stage_prev, stage_next = schedule.stage_prev, schedule.stage_next
    while ready:
        rank = ready.pop()
        ops = schedule.actions[rank]
        i = pos[rank]
        while i < len(ops):
            action = ops[i]
            # required_inputs, spelled out for the common kinds (this loop visits every action).
            kind, s, m = action.kind, action.stage, action.microbatch
            lacking = None
            if kind == "F":
                p = stage_prev[s]
                if p >= 0 and (p, "F", m) not in done:
                    lacking = (p, "F", m)
            elif kind in BACKWARD_INPUT_KINDS:
                nxt = stage_next[s]
                if (s, "F", m) not in done:
                    lacking = (s, "F", m)
                elif nxt >= 0 and (nxt, "BI", m) not in done:
                    lacking = (nxt, "BI", m)
            elif kind == "W":
                if (s, "BI", m) not in done:
                    lacking = (s, "BI", m)
            else:
                lacking = next((e for e in required_inputs(schedule, action) if e not in done), None)
            if lacking is not None:
                blocked_on[rank] = lacking
                waiting[lacking].append(rank)
                break
            for leaf in action.leaves:
                if leaf.kind == "W":
                    continue
                event = (leaf.stage, "F" if leaf.kind == "F" else "BI", leaf.microbatch)
                done.add(event)
                woken = waiting.pop(event, None)
                if woken:
                    for w in woken:
                        blocked_on.pop(w, None)
                    ready.extend(woken)
            i += 1
        pos[rank] = i
    stuck = [r for r in range(schedule.num_ranks) if pos[r] < len(schedule.actions[r])]
    if stuck:
        parts = [
            f"rank {r} at action {pos[r]} ({schedule.actions[r][pos[r]]}) waits for "
            f"{_describe_event(schedule, blocked_on[r])}"
            for r in stuck
        ]
        raise UserError(
            f"schedule {schedule.name!r} deadlocks: " + "; ".join(parts)
            + "; reorder the actions so each input is produced before a rank blocks on it"
        )


def validate_schedule(schedule: PipelineSchedule) -> None:
    """Raise ``UserError`` if ``schedule`` cannot complete; return None if it can."""
    try:
        _check_shape(schedule)
        _check_complete_and_ordered(schedule)
    except UserError as exc:
        raise UserError(f"schedule {schedule.name!r}: {exc}") from None
    check_progress(schedule)


__all__ = ["validate_schedule", "check_progress"]
