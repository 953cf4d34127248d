"""Pipeline schedules as data (DESIGN.md rule 1).

A schedule is, per pipeline rank, the ordered list of compute actions that rank runs. The
engine replays any schedule; no schedule logic lives in the engine.

Vocabulary, as in ``torch.distributed.pipelining``:

- A *stage* is one model chunk placed on one rank. Stages are numbered globally. Actions name
  the stage they run on (``0F1`` = stage 0, forward, microbatch 1), like torch's ``_Action`` and
  torchtitan's custom-schedule CSV.
- A *chain* is the ordered list of stages a microbatch flows through. Ordinary schedules have one
  chain ``[0, 1, ..., S-1]``. DualPipe has two (one per direction, each rank holding one stage of
  each), so every rank holds two model copies.
- A stage's *position* is its index in its chain; the workload gives every position its layers
  (position 0 holds the embedding, the last position the LM head and loss).

Kinds: F forward; B full backward (input-grad and weight-grad together); I input-grad only;
W weight-grad only; FB an overlapped forward/backward pair (DualPipe), whose ``sub`` holds the F
and the B (or I) action that run together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

ActionKind = Literal["F", "B", "I", "W", "FB"]


@dataclass(frozen=True, slots=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int
    # For kind == "FB" only: (forward action, backward action) run overlapped as one unit; the
    # pair's own stage and microbatch repeat its forward's (torch leaves them unset).
    sub: tuple["Action", "Action"] | None = None

    @property
    def leaves(self) -> tuple["Action", ...]:
        """The actions that run: an FB pair's forward and backward, else the action itself."""
        return self.sub if self.kind == "FB" and self.sub is not None else (self,)

    def __str__(self) -> str:
        if self.kind == "FB":
            assert self.sub is not None
            return f"({self.sub[0]};{self.sub[1]})"
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class PipelineSchedule:
    name: str
    num_ranks: int
    num_microbatches: int
    # Stage ids in pipeline order, one tuple per chain (direction).
    chains: tuple[tuple[int, ...], ...]
    # stage_rank[s] = the pipeline rank that holds stage s.
    stage_rank: tuple[int, ...]
    # actions[r] = the ordered compute actions of pipeline rank r.
    actions: tuple[tuple[Action, ...], ...]
    # Which chain each microbatch flows through (all 0 unless the schedule has several chains).
    microbatch_chain: tuple[int, ...] = field(default=())

    @property
    def num_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def num_positions(self) -> int:
        """Layer partitions along one chain (pp * vpp for interleaved, 2 * pp for V shapes)."""
        return len(self.chains[0])

    @cached_property
    def stage_position(self) -> tuple[int, ...]:
        pos = [0] * self.num_stages
        for chain in self.chains:
            for i, s in enumerate(chain):
                pos[s] = i
        return tuple(pos)

    @cached_property
    def stage_prev(self) -> tuple[int, ...]:
        """The stage feeding each stage's forward, or -1 for a chain's first stage."""
        prev = [-1] * self.num_stages
        for chain in self.chains:
            for a, b in zip(chain, chain[1:]):
                prev[b] = a
        return tuple(prev)

    @cached_property
    def stage_next(self) -> tuple[int, ...]:
        """The stage feeding each stage's backward, or -1 for a chain's last stage."""
        nxt = [-1] * self.num_stages
        for chain in self.chains:
            for a, b in zip(chain, chain[1:]):
                nxt[a] = b
        return tuple(nxt)

    def chain_of_microbatch(self, microbatch: int) -> int:
        return self.microbatch_chain[microbatch] if self.microbatch_chain else 0

    @cached_property
    def action_events(self) -> tuple[tuple[tuple[tuple, tuple], ...], ...]:
        """Per rank, per action: (the events it needs, ``required_inputs``; the events it
        produces, its non-W leaves' 'F' / 'BI' outputs). Built once a schedule: replays of the
        same schedule with other costs (the sweep estimate's) reuse it."""
        out = []
        for ops in self.actions:
            row = []
            for a in ops:
                made = tuple((leaf.stage, "F" if leaf.kind == "F" else "BI", leaf.microbatch)
                             for leaf in a.leaves if leaf.kind != "W")
                row.append((tuple(required_inputs(self, a)), made))
            out.append(tuple(row))
        return tuple(out)

    @cached_property
    def stash_steps(self) -> tuple[tuple["np.ndarray", "np.ndarray"], ...]:
        """Per rank, each F and B/I leaf in order as (stage, +1 for F, -1 for B or I): what
        ``analysis.peak_activations`` sums with any stage weights."""
        import numpy as np

        out = []
        for ops in self.actions:
            st, sg = [], []
            for action in ops:
                for leaf in action.leaves:
                    if leaf.kind == "F" or leaf.kind in BACKWARD_INPUT_KINDS:
                        st.append(leaf.stage)
                        sg.append(1.0 if leaf.kind == "F" else -1.0)
            out.append((np.asarray(st, dtype=np.int64), np.asarray(sg, dtype=float)))
        return tuple(out)

    @cached_property
    def _stages_by_rank(self) -> tuple[tuple[int, ...], ...]:
        by: list[list[int]] = [[] for _ in range(max(self.stage_rank, default=-1) + 1)]
        for s, r in enumerate(self.stage_rank):
            by[r].append(s)
        return tuple(tuple(x) for x in by)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        # (asked per action by the planner and the estimate: a scan of every stage each time was
        # 4% of a cold sweep estimate)
        by = self._stages_by_rank
        return by[rank] if 0 <= rank < len(by) else ()

    @cached_property
    def chain_end_ranks(self) -> tuple[int, int]:
        """The ranks of the first chain's first and last stage: where the input embedding and the
        LM head live, so the two ends of a tied embedding (ranks 0 and pp - 1 for 1F1B and the
        looped placements; both rank 0 under the V placement and with one rank). DualPipe's
        second chain holds the other model copy; its ends mirror the first's."""
        chain = self.chains[0]
        return self.stage_rank[chain[0]], self.stage_rank[chain[-1]]

    @property
    def chain_ends_share_rank(self) -> bool:
        """Whether one rank holds both the first and the last stage of the first chain."""
        first, last = self.chain_end_ranks
        return first == last

    @property
    def model_copies(self) -> int:
        """Full model replicas the pipeline holds: 2 for DualPipe (one per chain), else 1.

        Every chain runs the whole model, so parameters, gradients and optimizer state per rank
        scale with the number of chains.
        """
        return len(self.chains)

    @property
    def stages_per_rank(self) -> int:
        """Stages (model chunks) each rank holds: vpp for interleaved, 2 for V shapes and DualPipe."""
        return self.num_stages // self.num_ranks

    @property
    def num_actions(self) -> int:
        return sum(len(a) for a in self.actions)


# The dependency rule, stated once. Every cross-stage dependency is also a point-to-point
# transfer when the two stages sit on different ranks (activations forward, gradients back).
#
#   F(s, m)      needs F(prev(s), m)                      -- activation from the previous stage
#   B|I(s, m)    needs B|I(next(s), m), and F(s, m)       -- gradient from the next stage; the
#                                                            last stage needs only its own F
#   W(s, m)      needs I(s, m)                            -- same rank, no transfer
#
# "B|I" means whichever of B or I the schedule runs for that (stage, microbatch): both produce
# the input gradient that the previous stage waits for.
BACKWARD_INPUT_KINDS = ("B", "I")


def required_inputs(schedule: PipelineSchedule, action: Action) -> list[tuple[int, str, int]]:
    """(stage, 'F' or 'BI', microbatch) events that must complete before ``action`` can start.

    'BI' stands for the input gradient produced by a B or an I action.
    """
    if action.kind == "FB":
        assert action.sub is not None
        return required_inputs(schedule, action.sub[0]) + required_inputs(schedule, action.sub[1])
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        p = schedule.stage_prev[s]
        return [] if p < 0 else [(p, "F", m)]
    if action.kind in BACKWARD_INPUT_KINDS:
        n = schedule.stage_next[s]
        deps = [(s, "F", m)]
        if n >= 0:
            deps.append((n, "BI", m))
        return deps
    if action.kind == "W":
        return [(s, "BI", m)]
    raise ValueError(f"unknown action kind {action.kind!r}")
