"""Steady-state fast path: simulate a shorter pipeline, replay its verified steady period in closed form.

In the steady phase of a pipeline schedule (1F1B, interleaved 1F1B, ...) every rank repeats one
block of actions, the microbatch labels advanced by the schedule's period ``q`` (1 for 1F1B, pp
for interleaved). With deterministic durations the event loop then produces the same period
over and over, shifted in time by ``P``. This module uses that, and only where it is checked:

1. Schedule: the step's schedule with ``m`` microbatches must equal a shorter one with
   ``m_s = m - N*q`` in which, on every rank, the block of actions just before a cut index is
   inserted ``N`` more times (labels advanced by ``q`` each time), the rest relabelled by
   ``N*q``. Checked action by action; any other shape (or a schedule file) takes the plain path.
2. Dynamics: the event loop runs the short plan (every event simulated). The short and the full
   run agree up to t_min (no rank has yet left the repeated block); the cut is an instant T*
   just before it. In the VERIFY_PERIODS periods before T*: the same period ``P`` on every
   rank, the same accumulator increments (compute, exposed communication per dimension, bytes
   per dimension, contention), and on every lane the same timeline rows and waits shifted by
   ``P``, all to 1e-12 of the step. If not, the plain path runs.
3. Closed form: the full step is the short one with the period before T* inserted ``N`` times:
   times after T* move by ``N*P``, accumulators gain ``N`` increments, the rows of the
   inserted periods are the verified period's rows shifted and relabelled. In a deterministic
   periodic regime this is what the event loop would produce (to float rounding);
   tests/test_steady.py checks it against the plain path on several schedules and layouts.

The event loop stays the source of truth: nothing here computes a duration.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import numpy as np
import pandas as pd

from simulator.engine.core import Timeline
from simulator.errors import UserError
from simulator.schedules.base import Action, PipelineSchedule

# Periods observed before the cut: each must repeat the one after it (same period, increments
# and rows), so 2 means two identical consecutive periods.
VERIFY_PERIODS = 2
# Steady microbatches before the observed periods, for the pipeline to settle after its
# warm-up: whole periods where a period is shorter than this (1F1B, zb-h1: q = 1, 4 periods),
# none where one period already holds as many (interleaved 1F1B: q = pp >= 4). There the
# first observed period is the settling one: the verification compares it with the next, and
# a run that had not settled is refused and retried longer (simulate._steady_timeline).
# History: round 6 asked for one settling period at q >= 4 too, after Megatron 76.1B (pp4
# vpp3) and 310.1B (pp16 vpp2) failed without one (an observed period 4.02 s vs 3.60 s at 80
# microbatches). Since the blocking pipeline exchange (round 15) and the row tolerance, both
# verify without it (76.1B at 20 of 28, 310.1B at 80 of 144, 529.6B at 175 of 280, every step
# equal to the plain loop's to 1e-13), and the settling period was a sixth of each run.
SETTLE_MICROBATCHES = 4
# Relative tolerance (of the step time) for "the same time" in the verification: float rounding
# of sums of a few thousand durations is ~1e-13 of the step, a real difference is far larger.
REL_TOL = 1e-12


@dataclass
class Cut:
    m_short: int
    q: int  # microbatch labels advance by q per period
    n_periods: int  # periods inserted in closed form
    cut_index: list[int]  # per pipeline rank: index into the short schedule's actions
    period_actions: list[int]  # per pipeline rank: actions in one period


def relabel(a: Action, d: int) -> Action:
    if a.sub is not None:
        return Action(a.stage, a.kind, a.microbatch + d, (relabel(a.sub[0], d), relabel(a.sub[1], d)))
    return Action(a.stage, a.kind, a.microbatch + d)


def _common_prefix(x: tuple, y: tuple) -> int:
    n = min(len(x), len(y))
    i = 0
    while i < n and x[i] == y[i]:
        i += 1
    return i


def find_cut(full: PipelineSchedule, m_short: int, q: int, short: PipelineSchedule) -> Cut | None:
    """The cut that turns ``short`` into ``full`` by repeating one block per rank, or None."""
    return _find_cut(full, m_short, q, short).cut


class _CutSearch(NamedTuple):
    """What one shorter schedule gives: the cut, or why not and how many periods more to try."""

    cut: Cut | None
    # "cut"; "short": its steady phase holds too few blocks before the cut to observe;
    # "no-repeat": the blocks before the cut do not repeat (the warm-up reaches into them, or the
    # schedule never repeats: GPipe); "shape": the full schedule is not this one with blocks
    # inserted (more microbatches keep it so)
    status: str
    # periods of q microbatches to add before trying again: 1, or the blocks the first rank found
    # wanting lacks (each period more puts one more block into every rank's steady phase)
    lacking: int = 1


def _find_cut(full: PipelineSchedule, m_short: int, q: int, short: PipelineSchedule) -> _CutSearch:
    """The cut from ``short`` to ``full`` (see _CutSearch)."""
    m = full.num_microbatches
    if (m - m_short) % q or m <= m_short:
        return _CutSearch(None, "shape")
    n = (m - m_short) // q
    cuts, periods = [], []
    settle = -(-SETTLE_MICROBATCHES // q) if q < SETTLE_MICROBATCHES else 0
    observed = VERIFY_PERIODS + settle  # blocks before the cut's own that must repeat it
    for r in range(full.num_ranks):
        L, S = full.actions[r], short.actions[r]
        extra = len(L) - len(S)
        if extra <= 0 or extra % n:
            return _CutSearch(None, "shape")
        a_len = extra // n
        c = _common_prefix(L, S)
        if c < (observed + 1) * a_len:
            return _CutSearch(None, "short", -(-((observed + 1) * a_len - c) // a_len))
        block = S[c - a_len:c]
        # The schedule itself repeats the block before the cut (steady phase) ...
        for j in range(1, observed + 1):
            if tuple(relabel(a, j * q) for a in S[c - (j + 1) * a_len:c - j * a_len]) != block:
                # the warm-up reaches into the observed blocks (j - 1 of them repeat), or no repeat
                return _CutSearch(None, "no-repeat", observed - (j - 1))
        # ... and the full schedule is the short one with the block repeated n more times.
        for k in range(1, n + 1):
            if L[c + (k - 1) * a_len:c + k * a_len] != tuple(relabel(a, k * q) for a in block):
                return _CutSearch(None, "shape")
        if L[c + n * a_len:] != tuple(relabel(a, n * q) for a in S[c:]):
            return _CutSearch(None, "shape")
        cuts.append(c)
        periods.append(a_len)
    return _CutSearch(Cut(m_short, q, n, cuts, periods), "cut")


def plan_cuts(full: PipelineSchedule, build: Callable[[int], PipelineSchedule]) -> Iterator[tuple[PipelineSchedule, Cut]]:
    """Shorter schedules and their cuts, fewest microbatches first, each worth simulating
    instead of ``full`` (at most MAX_SHORT_FRACTION of its microbatches)."""
    m, pp = full.num_microbatches, full.num_ranks
    for q in dict.fromkeys((1, 2, pp)):
        # The fewest microbatches whose steady phase holds the observed periods (find_cut says).
        m_s = -(-pp // q) * q
        found = False
        no_repeat = 0
        while m_s + q <= m and m_s <= MAX_SHORT_FRACTION * m:
            if (m - m_s) % q == 0:
                try:
                    short = build(m_s)
                except UserError:  # the schedule rejects this count: try another period
                    break
                search = _find_cut(full, m_s, q, short)
                if search.cut is not None:
                    found = True
                    yield short, search.cut
                elif search.status == "shape":  # more microbatches keep it
                    break
                elif search.status == "no-repeat":
                    no_repeat += 1
                    if no_repeat > NO_REPEAT_TRIES:  # (GPipe: all forwards, then all backwards)
                        break
                # Blocks wanting on some rank: the counts in between cannot hold them either.
                m_s += (search.lacking - 1) * q
            m_s += q
        if found:
            return


def plan_cut(full: PipelineSchedule, build: Callable[[int], PipelineSchedule]) -> tuple[PipelineSchedule, Cut] | None:
    """The shortest of ``plan_cuts``, or None."""
    return next(plan_cuts(full, build), None)


# Short schedules tried whose steady phase does not repeat before giving up on a period.
NO_REPEAT_TRIES = 12
# The most microbatches the short runs of one step simulate together, as a fraction of the
# step's: short runs that do not verify cost at most this much of a plain run on top of it.
# 3/4 rather than 1/2: an interleaved 1F1B step needs warm-up, two observed periods and
# cool-down simulated (about 5 periods of pp microbatches; round 19 also a settling period),
# and the published rows have 7 to 9 periods (Megatron 310.1B: 80 of 144, 529.6B: 175 of 280).
MAX_SHORT_FRACTION = 0.75

# An action label's microbatch (group 3) or "mb<n>" (group 4).
_ANY = re.compile(r"(\d+)(F|BI|B|I|W)(\d+)|mb(\d+)")


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= tol))


def _sized(df: pd.DataFrame, tol: float) -> pd.DataFrame:
    """The rows longer than ``tol``. A row of float-rounding length is not periodic: where a
    pipeline transfer arrives exactly when its consumer is ready (a balanced steady phase), the
    wait is +-1 ulp of the time (3.6e-15 s at 30 s), so a row in one period and none in the
    next (Megatron 529.6B, interleaved pp35). Such rows are compared as absent; the replayed
    periods copy the last period's, each <= ``tol`` long, as the plain loop's are."""
    return df[(df["end_s"] - df["start_s"]) > tol]


def _fail(why: list[str] | None, reason: str) -> None:
    if why is not None:
        why.append(reason)
    return None


def _key(a: Action) -> tuple:
    """The engine's mark key of an action: its first sub-action's (stage, kind, microbatch)."""
    first = a.sub[0] if a.sub is not None else a
    return (first.stage, first.kind, first.microbatch)


def _rank_period(marks_r: dict[tuple, tuple], actions: tuple, c: int, a_len: int, q: int, period: float,
                 period_tol: float) -> tuple[str | None, np.ndarray | None]:
    """(None, the accumulator increment of one period) where the VERIFY_PERIODS blocks of one
    rank before index ``c`` repeat: same period (to ``period_tol``) and increments; else the reason."""
    snaps = []
    for j in range(1, VERIFY_PERIODS + 2):
        i = c - j * a_len
        hit = marks_r.get(_key(actions[i])) if i >= 0 else None
        if hit is None:
            return 'a mark is missing or the schedule does not repeat there', None
        if relabel(actions[i], (j - 1) * q) != actions[c - a_len]:
            return "the schedule does not repeat over a rank's observed periods", None
        t0, busy, exposed, nbytes, cont = hit
        snaps.append((t0, np.array([busy, *exposed, *nbytes, cont], dtype=np.float64)))
    per = [snaps[j][0] - snaps[j + 1][0] for j in range(VERIFY_PERIODS)]
    if any(abs(x - period) > period_tol for x in per):
        return f"period differs from the first rank's ({per} vs {period})", None
    incs = [snaps[j][1] - snaps[j + 1][1] for j in range(VERIFY_PERIODS)]
    scale = np.maximum(np.abs(incs[0]), 1.0) * 1e-9
    for x in incs[1:]:
        bad = np.flatnonzero(np.abs(x - incs[0]) > scale)
        if len(bad):
            return (f"accumulator increments differ between periods (components {bad.tolist()}: "
                    f"{incs[0][bad].tolist()} vs {x[bad].tolist()})"), None
    return None, incs[0]


def _block_holding(t_of: Callable[[int], float | None], c: int, a_len: int, t: float, strict: bool) -> int | None:
    """The cut index of the block (ending at ``c`` or earlier) that starts at or before ``t``
    (before ``t`` where ``strict``), or None where it is not in the simulated steady phase."""
    while True:
        t_prev = t_of(c - a_len) if c - a_len >= 0 else None
        if t_prev is None:
            return None
        if t_prev < t or (t_prev == t and not strict):
            return c
        c -= a_len


class NotPeriodic(Exception):
    """Raised from inside a short run whose marks already show it cannot verify (``ShortRunMarks``)."""


# The early check compares periods (each rank's with the first rank's, as extend does) to
# extend's tolerance REL_TOL * step, with the short run's step, not known yet, bounded above by
# this factor times the time of the check (every rank has then started its cool-down). A
# pipeline's cool-down mirrors its warm-up and the step's tail (gradient reduce, optimizer) is
# far shorter than the steady phase, so the step is < 2x that time; 100x keeps the check looser
# than extend's, so it refuses only short runs extend refuses too. Were a step ever longer, the
# early stop would cost speed only: a stopped run falls back to the plain loop.
# (A tolerance of 1e-6 of the period, used before, let through 1F1B llama3-8b pp4's stages whose
# periods still differ by 3e-9 s = 1e-7 of the period, which extend refuses; see
# docs/design-notes.md "steady state: geometric settling".)
EARLY_STEP_BOUND_FACTOR = 100.0


class ShortRunMarks(dict):
    """``Engine.action_marks`` for a short run that stops it as soon as its marks show it cannot
    verify: once every rank has started its first action past the steady phase (all marks
    ``extend`` checks exist and are final), the periods and accumulator increments are checked
    for every block that may hold T*; where a rank has none that repeats, ``NotPeriodic`` is
    raised from the engine's process and ends the run. A short run that fails this way costs its
    warm-up and steady phase but not its cool-down and step end (the plain run follows).
    Only a speed-up: a run that passes still goes through ``extend``'s full check."""

    def __init__(self, short: PipelineSchedule, cut: Cut, pp_of: dict[int, int]):
        super().__init__()
        self.short, self.cut, self.pp_of = short, cut, pp_of
        self.waiting = set(pp_of)
        self.why: str | None = None
        # the latest mark's time, kept as marks come (the max over every mark, taken at each
        # arrival, cost O(marks) an arrival: 0.8 s of Megatron 529.6B's run)
        self.t_latest = -math.inf

    def setdefault(self, rank, default=None):
        if rank not in self:
            p = self.pp_of[rank]
            # The first action past the steady phase; a rank with none (its steady phase runs to
            # its last action, e.g. 1F1B's last stage) is waited for at its last action.
            c = min(self.cut.cut_index[p], len(self.short.actions[p]) - 1)
            dict.__setitem__(self, rank, _RankMarks(self, rank, _key(self.short.actions[p][c])))
        return self[rank]

    def arrived(self, rank: int) -> None:
        self.waiting.discard(rank)
        why = self.check() if not self.waiting else self.check_passed()
        if why is not None:
            self.why = why
            raise NotPeriodic(why)

    def _t(self, r: int, i: int) -> float | None:
        """When rank ``r`` started its action ``i`` in this run (None: not yet, or no such action)."""
        actions = self.short.actions[self.pp_of[r]]
        marks_r = self.get(r)
        if marks_r is None or not 0 <= i < len(actions):
            return None
        hit = marks_r.get(_key(actions[i]))
        return None if hit is None else hit[0]

    def _period(self) -> tuple[float, float, float] | None:
        """(the first rank's period before its cut, as extend takes it; the period tolerance;
        the latest mark), or None while that period is not known."""
        r0 = next(iter(self.pp_of))  # the engine's order, as the timeline's
        c0, a0 = self.cut.cut_index[self.pp_of[r0]], self.cut.period_actions[self.pp_of[r0]]
        t_a, t_b = self._t(r0, c0 - a0), self._t(r0, c0 - 2 * a0)
        if t_a is None or t_b is None or t_a - t_b <= 0:
            return None
        t_now = self.t_latest
        return t_a - t_b, max(REL_TOL * EARLY_STEP_BOUND_FACTOR * t_now, 1e-15), t_now

    def _t_min_bounds(self, period: float, t_now: float) -> tuple[float, float] | None:
        """(lo_t, hi_t): bounds on t_min (see extend), or None where a passed rank lacks a mark.
        t_min is known up to the end times of ranks with no action after their steady phase:
        from their last action's start (below) and their last block's start plus a period
        (above). A rank still inside its steady phase gives nothing above, and below at most the
        latest mark (its next action has not started; its last block, if not started, starts
        later); once every rank has passed, these are ``check``'s exact bounds."""
        short, cut, pp_of, t_of = self.short, self.cut, self.pp_of, self._t
        lo_t = hi_t = math.inf
        for r in pp_of:
            p = pp_of[r]
            c, a_len = cut.cut_index[p], cut.period_actions[p]
            t_last = t_of(r, c - a_len)
            if r in self.waiting:
                lo_t = min(lo_t, t_now, math.inf if t_last is None else t_last + period)
                continue
            t_next = t_of(r, c) if c < len(short.actions[p]) else t_of(r, c - 1)
            if t_last is None or t_next is None:
                return None
            lo_t = min(lo_t, t_next, t_last + period)
            hi_t = min(hi_t, t_last + period) if c >= len(short.actions[p]) else min(hi_t, t_next, t_last + period)
        return lo_t, hi_t

    def check_passed(self) -> str | None:
        """The same verdict as ``check``, earlier: while some ranks are still in their steady
        phase, t_min is already bounded above by what the ranks past theirs give (the same
        bounds as ``check``'s hi_t, over fewer ranks, so no smaller than the true one). Where a
        rank has no block starting before that bound that repeats, checking every such block
        from the first one up (a superset of ``check``'s window), no T* can verify. Only where
        the bound is no later than the latest mark, so every block before it has its marks.
        None: undecided (the run goes on; ``check`` decides once every rank has passed)."""
        short, cut, pp_of, t_of = self.short, self.cut, self.pp_of, self._t
        ranks = list(pp_of)
        got = self._period()
        if got is None or any(r not in self for r in ranks):
            return None
        period, period_tol, t_now = got
        bounds = self._t_min_bounds(period, t_now)
        if bounds is None:
            return None
        lo_t, hi_t = bounds
        if not hi_t <= t_now:
            return None  # blocks starting before the bound may not all have started
        for r in ranks:
            p = pp_of[r]
            c, a_len = cut.cut_index[p], cut.period_actions[p]
            first_reason = None
            for ci in range(c, a_len - 1, -a_len):
                t_prev = t_of(r, ci - a_len)
                if t_prev is None or t_prev >= hi_t:
                    continue  # not started, or at/after the bound: cannot hold T*
                why, _ = _rank_period(self[r], short.actions[p], ci, a_len, cut.q, period, period_tol)
                if why is None:
                    break
                first_reason = first_reason or why
                if t_prev <= lo_t - period:
                    return f"rank {r}: {first_reason}"  # the lowest block that can hold T*
            else:
                return f"rank {r}: {first_reason or 'no block before t_min in the simulated steady phase'}"
        return None

    def check(self) -> str | None:
        """The reason no T* can verify, or None where one may (``extend`` then decides)."""
        short, cut, pp_of, t_of = self.short, self.cut, self.pp_of, self._t
        ranks = list(pp_of)
        got = self._period()
        if got is None:
            return None
        period, period_tol, t_now = got
        bounds = self._t_min_bounds(period, t_now)  # (every rank has passed: no estimate)
        if bounds is None:
            return None  # (extend names what is missing)
        lo_t, hi_t = bounds
        for r in ranks:
            p = pp_of[r]
            c, a_len = cut.cut_index[p], cut.period_actions[p]

            def t_r(i: int, r=r) -> float | None:
                return t_of(r, i)
            # T* lies strictly inside (t_min - period, t_min): the blocks holding it run from
            # the one holding t_min - period to the last one starting before t_min.
            hi = _block_holding(t_r, c, a_len, hi_t, strict=True)
            lo = _block_holding(t_r, c, a_len, lo_t - period, strict=False)
            if hi is None:
                return f"rank {r}: the block holding T* is not in the simulated steady phase"
            reasons = []
            for ci in range(hi, lo - 1 if lo is not None else 0, -a_len):
                why, _ = _rank_period(self[r], short.actions[p], ci, a_len, cut.q, period, period_tol)
                if why is None:
                    break
                reasons.append(why)
            else:
                return f"rank {r}: {reasons[0]}"
        return None


class _RankMarks(dict):
    __slots__ = ("owner", "rank", "target")

    def __init__(self, owner: ShortRunMarks, rank: int, target: tuple | None):
        super().__init__()
        self.owner, self.rank, self.target = owner, rank, target

    def __setitem__(self, key, value) -> None:
        dict.__setitem__(self, key, value)
        owner = self.owner
        if value[0] > owner.t_latest:
            owner.t_latest = value[0]
        if key == self.target:
            self.owner.arrived(self.rank)


def _sum_by_rank(rank: np.ndarray, seconds: np.ndarray) -> dict[int, float]:
    """rank -> the sum of its seconds (pandas' groupby sum: its compensated summation, so the
    figures are the ones a grouped frame gave)."""
    return {int(r): float(v) for r, v in pd.Series(seconds).groupby(rank).sum().items()}


def row_totals(events: pd.DataFrame, waits: pd.DataFrame | None) -> dict:
    """What the step breakdown reads from a timeline's rows (report.analysis.rank_breakdown):
    {"compute_s": {rank: compute-stream seconds}, "bubble_wait_s": {rank: bubble waits' seconds},
    "opt_s": the longest optimizer-step row (the plan's last compute entry on every rank: kind
    "opt", named "optimizer step")}. Column arrays and masks, no sub-frames: full mode at scale
    has millions of rows, and a filtered frame copies every column."""
    is_comp = (events["stream"] == "compute").to_numpy(dtype=bool)
    dur = events["end_s"].to_numpy() - events["start_s"].to_numpy()
    is_opt = is_comp & (events["kind"] == "opt").to_numpy(dtype=bool) & (events["name"] == "optimizer step").to_numpy(dtype=bool)
    bubble: dict[int, float] = {}
    if waits is not None and len(waits):
        is_b = (waits["cause"] == "bubble").to_numpy(dtype=bool)
        w_dur = waits["end_s"].to_numpy() - waits["start_s"].to_numpy()
        bubble = _sum_by_rank(waits["rank"].to_numpy()[is_b], w_dur[is_b])
    return {"compute_s": _sum_by_rank(events["rank"].to_numpy()[is_comp], dur[is_comp]), "bubble_wait_s": bubble,
            "opt_s": float(dur[is_opt].max()) if is_opt.any() else 0.0}


def run_short(engine, short: PipelineSchedule, cut: Cut, why: list[str] | None = None, rows: bool = True) -> Timeline | None:
    """Run ``engine`` (built on the short schedule) with its action marks watched, and extend
    the result to the full step; None where it does not verify (``why`` gets the reason). The run
    stops early where its marks already rule the cut out (``ShortRunMarks``). ``rows``: see extend."""
    marks = ShortRunMarks(short, cut, {r: int(engine.coords[r, 0]) for r in engine.ranks})
    engine.action_marks = marks
    try:
        tl = engine.run()
    except NotPeriodic:
        return _fail(why, f"stopped early: {marks.why}")
    return extend(tl, short, cut, marks, why, rows)


def extend(tl: Timeline, short: PipelineSchedule, cut: Cut, marks: dict[int, dict[tuple, tuple]],
           why: list[str] | None = None, rows: bool = True) -> Timeline | None:
    """The full step's timeline from the short run ``tl``, or None where the short run is not
    verified periodic before the cut (``why``, given, gets the reason). ``rows`` False: the same
    verification and figures, but the rows are not made (most of this function's time on long
    steps): events and waits empty, ``Timeline.row_totals`` what the report reads from them.

    The cut is one instant T* at which every rank is inside a steady block and no rank has
    started an action past its steady phase, so the short and the full run agree up to T*;
    the full run then repeats the period before T* ``n`` more times and goes on as the short one
    does after T*, shifted by ``n`` periods."""
    step_s = tl.step_time_s
    tol = max(REL_TOL * step_s, 1e-15)
    pp_of = tl.pp_rank_of
    n = cut.n_periods

    def t_of(r: int, i: int) -> float | None:
        if i >= len(short.actions[pp_of[r]]):  # no action after the steady phase: the rank's end
            return tl.end_time_s.get(r)
        hit = marks.get(r, {}).get(_key(short.actions[pp_of[r]][i]))
        return None if hit is None else hit[0]

    r0 = tl.ranks[0]
    c0, a0 = cut.cut_index[pp_of[r0]], cut.period_actions[pp_of[r0]]
    t_a, t_b = t_of(r0, c0 - a0), t_of(r0, c0 - 2 * a0)
    if t_a is None or t_b is None:
        return _fail(why, 'no mark for the period before the cut')
    period = t_a - t_b
    if period <= tol:
        return _fail(why, 'no positive period')
    # The short and the full run agree until a rank starts its first action past the steady
    # phase (short run) or the repeated block would start (full run): t_min.
    t_min = math.inf
    for r in tl.ranks:
        c, a_len = cut.cut_index[pp_of[r]], cut.period_actions[pp_of[r]]
        t_c, t_last = t_of(r, c), t_of(r, c - a_len)
        if t_c is None or t_last is None:
            return _fail(why, 'a rank has no mark at its cut')
        t_min = min(t_min, t_c, t_last + period)
    ev, waits = tl.events, tl.waits
    if waits is None:
        return _fail(why, 'no wait rows')
    # T*: the middle of the widest gap between row starts in the period before t_min.
    starts = np.concatenate([ev["start_s"].to_numpy(), waits["start_s"].to_numpy()])
    inside = np.unique(starts[(starts > t_min - period) & (starts < t_min)])
    edges = np.concatenate([[t_min - period], inside, [t_min]])
    g = int(np.argmax(np.diff(edges)))
    t_star = 0.5 * (edges[g] + edges[g + 1])

    delta: dict[int, np.ndarray] = {}
    for r in tl.ranks:
        p, a_len = pp_of[r], cut.period_actions[pp_of[r]]
        c = _block_holding(lambda i, r=r: t_of(r, i), cut.cut_index[p], a_len, t_star, strict=False)
        if c is None:
            return _fail(why, "a rank's block holding T* is not in the simulated steady phase")
        reason, inc = _rank_period(marks.get(r, {}), short.actions[p], c, a_len, cut.q, period, tol)
        if reason is not None:
            return _fail(why, f"rank {r}: {reason}")
        delta[r] = inc

    ev_parts, w_parts = [], []
    q = cut.q

    def window(df: pd.DataFrame, j: int) -> pd.DataFrame:
        lo, hi = t_star - (j + 1) * period, t_star - j * period
        return df[(df["start_s"] >= lo) & (df["start_s"] < hi)]

    for df, parts, is_ev in ((ev, ev_parts, True), (waits, w_parts, False)):
        # Verify: every lane's rows in each of the last VERIFY_PERIODS periods before T* are the next one's, shifted.
        # Compared lane by lane (a rank's stream; waits have one lane a rank): rows of two lanes
        # that start together in one period may start an ulp apart in the next, which a sort by
        # start time alone would pair crosswise (Megatron 310.1B: a send and a tp all-gather).
        lane = ["rank", "stream"] if is_ev else ["rank"]
        ref = _sized(window(df, 0), tol).sort_values(lane + ["start_s", "end_s"], kind="stable")
        for j in range(1, VERIFY_PERIODS):
            other = _sized(window(df, j), tol).sort_values(lane + ["start_s", "end_s"], kind="stable")
            if len(other) != len(ref) or not (other["rank"].to_numpy() == ref["rank"].to_numpy()).all():
                return _fail(why, 'row counts differ between periods')
            if not _close(other[["start_s", "end_s"]].to_numpy() + j * period, ref[["start_s", "end_s"]].to_numpy(), tol):
                return _fail(why, 'row times differ between periods')
            col = "stream" if is_ev else "cause"
            if not (other[col].astype(str).to_numpy() == ref[col].astype(str).to_numpy()).all():
                return _fail(why, 'row streams differ between periods')
        if not rows:
            continue
        # Build: up to T* as simulated; the verified period n more times; the rest shifted.
        parts.append(df[df["start_s"] < t_star])
        parts.append(_copies(window(df, 0), n, period, q, is_ev))
        parts.append(_shifted(df[df["start_s"] >= t_star], n * period, n * q, is_ev))
    totals = None
    if rows:
        events = pd.concat(ev_parts, ignore_index=True)
        new_waits = pd.concat(w_parts, ignore_index=True)
    else:
        events, new_waits = ev.iloc[:0], waits.iloc[:0]
        # The replayed rows are the verified period's, shifted: each of the n periods adds its
        # seconds once to what the short run's rows sum to.
        totals = row_totals(ev, waits)
        once = row_totals(window(ev, 0), window(waits, 0))
        for key in ("compute_s", "bubble_wait_s"):
            for r, v in once[key].items():
                totals[key][r] = totals[key].get(r, 0.0) + n * v

    dims = list(next(iter(tl.exposed_s.values())).keys())
    nd = len(dims)
    busy, exposed, nbytes, cont, end_t = {}, {}, {}, {}, {}
    for r in tl.ranks:
        g = n * delta[r]
        busy[r] = tl.busy_compute_s[r] + g[0]
        exposed[r] = {d: tl.exposed_s[r][d] + g[1 + i] for i, d in enumerate(dims)}
        nbytes[r] = {d: tl.comm_bytes[r][d] + g[1 + nd + i] for i, d in enumerate(dims)}
        cont[r] = tl.contention_s.get(r, 0.0) + g[1 + 2 * nd]
        end_t[r] = tl.end_time_s[r] + n * period
    return Timeline(
        events=events, step_time_s=max(end_t.values()), ranks=list(tl.ranks), pp_rank_of=dict(pp_of),
        busy_compute_s=busy, exposed_s=exposed, comm_bytes=nbytes, sim_wall_s=tl.sim_wall_s, num_events=tl.num_events,
        mode=tl.mode,
        # Link statistics of the skipped periods are not replayed: the fabric's per-link bytes
        # are not sampled per period, so no busiest-link table rather than a wrong one.
        network_report=[], contention_s=cont, waits=new_waits, end_time_s=end_t,
        fast_forward={"microbatches_simulated": cut.m_short, "periods_skipped": n, "period_s": period,
                      "microbatches_per_period": q},
        loop_wall_s=tl.loop_wall_s, rows=rows, row_totals=totals,
    )


def _template(s: str) -> tuple[list[str], list[int]] | None:
    """``s`` split around the microbatch numbers it names (action labels, "mb<n>")."""
    pieces, nums, pos = [], [], 0
    for mo in _ANY.finditer(s):
        g = mo.lastindex
        start, end = mo.span(g)
        pieces.append(s[pos:start])
        nums.append(int(mo.group(g)))
        pos = end
    if not nums:
        return None
    pieces.append(s[pos:])
    return pieces, nums


def _relabelled(strings: np.ndarray, n: int, q: int) -> np.ndarray:
    """Copies 1..n of ``strings`` (row-major: copy k is block k-1), microbatch numbers advanced by k*q."""
    m = len(strings)
    out = np.empty((n, m), dtype=object)
    cache: dict[str, tuple | None] = {}
    ks = range(1, n + 1)
    for j, s in enumerate(strings.tolist()):
        s = str(s)
        tpl = cache.get(s, 0)
        if tpl == 0:
            tpl = cache[s] = _template(s)
        if tpl is None:
            out[:, j] = s
            continue
        pieces, nums = tpl
        tail = pieces[-1]
        if len(nums) == 1:
            p0, x0 = pieces[0], nums[0]
            out[:, j] = [f"{p0}{x0 + k * q}{tail}" for k in ks]
        else:
            out[:, j] = ["".join(p + str(x + k * q) for p, x in zip(pieces, nums)) + tail for k in ks]
    return out.reshape(-1)


def _copies(df: pd.DataFrame, n: int, period: float, q: int, is_ev: bool) -> pd.DataFrame:
    """Copies 1..n of the rows of one period, each shifted by k periods and relabelled by k*q."""
    if not len(df) or n <= 0:
        return df.iloc[:0]
    m = len(df)
    ks = np.repeat(np.arange(1, n + 1), m)
    dt = ks * period
    take = np.tile(np.arange(m), n)
    cols: dict[str, object] = {}
    for col in df.columns:
        s = df[col]
        if col in ("start_s", "end_s", "issued_s"):
            cols[col] = np.tile(s.to_numpy(), n) + dt
        elif col == "microbatch":
            t = np.tile(s.to_numpy(), n)
            cols[col] = np.where(t >= 0, t + ks * q, t)
        elif col in ("name", "what"):
            # New strings, kept as Python objects: letting the frame infer its string dtype
            # converted a million of them one by one (~0.3 s on Megatron 1T).
            cols[col] = pd.Series(_relabelled(s.to_numpy(dtype=object), n, q), dtype=object)
        elif isinstance(s.dtype, np.dtype) and s.dtype != object:
            cols[col] = np.tile(s.to_numpy(), n)
        else:  # (string columns: the same values, taken in their own dtype)
            cols[col] = s.array.take(take)
    return pd.DataFrame(cols, columns=df.columns)


def _shifted(df: pd.DataFrame, dt: float, dmb: int, is_ev: bool) -> pd.DataFrame:
    if not len(df):
        return df
    out = df.copy()
    out["start_s"] = out["start_s"] + dt
    out["end_s"] = out["end_s"] + dt
    if is_ev:
        mb = out["microbatch"].to_numpy()
        out["microbatch"] = np.where(mb >= 0, mb + dmb, mb)
        names = out["name"].to_numpy(dtype=object)
        has = np.fromiter(("mb" in str(s) for s in names), dtype=bool, count=len(names))
        if has.any():
            names = names.copy()
            names[has] = _relabelled(names[has], 1, dmb)
            out["name"] = pd.Series(names, index=out.index, dtype=object)
    else:
        out["issued_s"] = out["issued_s"] + dt
        out["what"] = pd.Series(_relabelled(out["what"].to_numpy(dtype=object), 1, dmb), index=out.index, dtype=object)
    return out
