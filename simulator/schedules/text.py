"""The custom-schedule CSV that torchtitan loads (``PipelineScheduleMulti._load_csv``).

One line per pipeline rank, in rank order; comma-separated compute actions, as torch's
``_Action`` prints them:

    0F0,0F1,0F2,0I0,0W0,...     <stage><F|B|I|W><microbatch>
    (0F7;7B3)OVERLAP_F_B        an overlapped forward/backward pair (DualPipeV)

Empty cells are skipped (torch writes its idle slots as empty cells). Communication and FSDP
tokens of torch's "compute_comms" dumps (SEND_F, RECV_B, UNSHARD, REDUCE_GRAD, ...) are
skipped too: transfers follow from stage adjacency, and gradient reduction is not a schedule
matter here.

What the file does not say is inferred as torch does: a stage lives on the rank whose line
lists it; stages must be numbered 0..S-1 and a microbatch flows through them in that order
(one chain -- this covers torch's looped and V placements); the microbatch count is the
highest microbatch id + 1.

Two-chain (DualPipe-style) files, which torch cannot express, add one directive line before
the rank lines naming each chain's stages in pipeline order:

    # chains: 0 1 2 3 | 4 5 6 7

Each microbatch then belongs to the chain whose stages run it. Other lines starting with ``#``
are comments (torch would reject them, so files meant for torchtitan should have none).
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from simulator.errors import UserError, read_user_text
from simulator.schedules.base import Action, PipelineSchedule
from simulator.schedules.validate import validate_schedule

_ACTION = re.compile(r"(\d+)([FBIW])(\d+)")
_PAIR = re.compile(r"\(([^;()]*);([^;()]*)\)(?:OVERLAP_F_B)?")
# torch's non-compute action types; a microbatch id may follow, as in 3SEND_F1.
_COMM = re.compile(r"\d+(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)\d*")
_CHAINS = re.compile(r"#\s*chains\s*:(.*)")
_FORMAT_HINT = "write <stage><F|B|I|W><microbatch> such as 0F3, or an overlapped pair such as (0F3;7B1)OVERLAP_F_B"


def _parse_simple(token: str, where: str) -> Action:
    m = _ACTION.fullmatch(token)
    if m is None:
        raise UserError(f"{where}: cannot read action {token!r}; {_FORMAT_HINT}")
    return Action(int(m.group(1)), m.group(2), int(m.group(3)))  # type: ignore[arg-type]


def _parse_token(token: str, where: str) -> Action | None:
    if not token or _COMM.fullmatch(token):
        return None
    if token.startswith("("):
        m = _PAIR.fullmatch(token)
        if m is None:
            raise UserError(f"{where}: cannot read overlapped pair {token!r}; {_FORMAT_HINT}")
        f = _parse_simple(m.group(1).strip(), where)
        b = _parse_simple(m.group(2).strip(), where)
        if f.kind != "F" or b.kind not in ("B", "I"):
            raise UserError(
                f"{where}: overlapped pair {token!r} must be a forward then a backward, e.g. (0F3;7B1)OVERLAP_F_B"
            )
        return Action(f.stage, "FB", f.microbatch, sub=(f, b))
    return _parse_simple(token, where)


def parse_schedule_csv(
    text: str,
    source: str = "<schedule>",
    name: str | None = None,
    num_microbatches: int | None = None,
    validate: bool = True,
) -> PipelineSchedule:
    """Read a schedule from CSV text (see the module docstring); ``source`` names it in errors.

    ``num_microbatches``, when given (the scenario's count), must match the file's. With
    ``validate`` the result also passes ``validate_schedule`` (missing actions, deadlocks).
    """
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    chains_spec: tuple[tuple[int, ...], ...] | None = None
    rank_actions: list[list[Action]] = []
    rank_line: list[int] = []
    stage_rank: dict[int, int] = {}
    stage_where: dict[int, str] = {}
    for lineno, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            m = _CHAINS.fullmatch(stripped)
            if m is not None:
                if rank_actions or chains_spec is not None:
                    raise UserError(
                        f"{source}:{lineno}: the '# chains:' line must come once, before the first rank line"
                    )
                chains_spec = _parse_chains(m.group(1), f"{source}:{lineno}")
            continue
        rank = len(rank_actions)
        row = next(csv.reader([line]), [])
        ops: list[Action] = []
        for token in row:
            token = token.strip()
            where = f"{source}:{lineno} (rank {rank})"
            action = _parse_token(token, where)
            if action is None:
                continue
            for leaf in action.sub if action.sub else (action,):
                owner = stage_rank.setdefault(leaf.stage, rank)
                if owner != rank:
                    raise UserError(
                        f"{where}: action {token!r} runs stage {leaf.stage}, which rank {owner} already runs "
                        f"({stage_where[leaf.stage]}); a stage lives on one rank, so move it to one line"
                    )
                stage_where.setdefault(leaf.stage, f"line {lineno}")
            ops.append(action)
        if not ops:
            raise UserError(
                f"{source}:{lineno} (rank {rank}): no actions; every line is one rank's actions, so remove "
                "the empty line or fill it"
            )
        rank_actions.append(ops)
        rank_line.append(lineno)
    if not rank_actions:
        raise UserError(f"{source}: no rank lines; write one line of comma-separated actions per pipeline rank")

    num_stages = max(stage_rank) + 1
    missing = [s for s in range(num_stages) if s not in stage_rank]
    if missing:
        raise UserError(
            f"{source}: stage {missing[0]} appears on no rank although stage {num_stages - 1} does; "
            "number stages 0..S-1 without gaps"
        )
    if chains_spec is None:
        chains: tuple[tuple[int, ...], ...] = (tuple(range(num_stages)),)
    else:
        chains = chains_spec
        listed = sorted(s for c in chains for s in c)
        if listed != list(range(num_stages)):
            raise UserError(
                f"{source}: the '# chains:' line lists stages {listed} but the ranks run stages 0..{num_stages - 1}; "
                "list every stage exactly once"
            )

    leaves = [
        (r, leaf) for r, ops in enumerate(rank_actions) for a in ops for leaf in (a.sub if a.sub else (a,))
    ]
    n_file = max(leaf.microbatch for _, leaf in leaves) + 1
    if n_file > MAX_FILE_MICROBATCHES:
        # Checked before anything is sized by it: a typo must not build a billion-entry table.
        raise UserError(
            f"{source}: microbatch {n_file - 1} is beyond the {MAX_FILE_MICROBATCHES:,} microbatches a step can have; "
            "number microbatches from 0"
        )
    if num_microbatches is not None and num_microbatches != n_file:
        raise UserError(
            f"{source}: the file runs microbatches 0..{n_file - 1} ({n_file}) but the scenario has "
            f"num_microbatches={num_microbatches}; make them agree"
        )
    chain_of_stage = {s: c for c, chain in enumerate(chains) for s in chain}
    mb_chain: dict[int, int] = {}
    for r, leaf in leaves:
        c = chain_of_stage[leaf.stage]
        if mb_chain.setdefault(leaf.microbatch, c) != c:
            raise UserError(
                f"{source}:{rank_line[r]} (rank {r}): microbatch {leaf.microbatch} runs on stage {leaf.stage} of "
                f"chain {c} and on chain {mb_chain[leaf.microbatch]}; a microbatch flows through one chain"
            )
    schedule = PipelineSchedule(
        name=name or source,
        num_ranks=len(rank_actions),
        num_microbatches=n_file,
        chains=chains,
        stage_rank=tuple(stage_rank[s] for s in range(num_stages)),
        actions=tuple(tuple(ops) for ops in rank_actions),
        microbatch_chain=tuple(mb_chain.get(m, 0) for m in range(n_file)),
    )
    if validate:
        validate_schedule(schedule)
    return schedule


def _parse_chains(spec: str, where: str) -> tuple[tuple[int, ...], ...]:
    chains = []
    for part in spec.split("|"):
        try:
            chain = tuple(int(x) for x in part.replace(",", " ").split())
        except ValueError:
            chain = ()
        if not chain:
            raise UserError(
                f"{where}: cannot read chain {part.strip()!r}; write '# chains: 0 1 2 3 | 4 5 6 7' "
                "(stage ids in pipeline order, chains separated by |)"
            )
        chains.append(chain)
    return tuple(chains)


# The scenario's own bound (simulator.scenario.MAX_MICROBATCHES), kept here to stay below the scenario layer.
MAX_FILE_MICROBATCHES = 100_000


def load_schedule_csv(
    path: str | os.PathLike[str],
    num_microbatches: int | None = None,
    validate: bool = True,
) -> PipelineSchedule:
    """Read a torchtitan-style schedule CSV file; see ``parse_schedule_csv``."""
    p = Path(path)
    text = read_user_text(p, "schedule file")
    return parse_schedule_csv(text, source=str(p), name=p.stem, num_microbatches=num_microbatches, validate=validate)


def _token(action: Action) -> str:
    if action.kind == "FB":
        assert action.sub is not None, f"{action=}"
        return f"({action.sub[0]};{action.sub[1]})OVERLAP_F_B"
    return str(action)


def format_schedule_csv(schedule: PipelineSchedule) -> str:
    """The schedule as CSV text; one-chain schedules come out exactly as torch writes them."""
    lines = []
    default_chains = (tuple(range(schedule.num_stages)),)
    if schedule.chains != default_chains:
        lines.append("# chains: " + " | ".join(" ".join(map(str, c)) for c in schedule.chains))
    lines += [",".join(_token(a) for a in ops) for ops in schedule.actions]
    return "\n".join(lines) + "\n"


def save_schedule_csv(schedule: PipelineSchedule, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(format_schedule_csv(schedule))


__all__ = ["parse_schedule_csv", "load_schedule_csv", "format_schedule_csv", "save_schedule_csv"]
