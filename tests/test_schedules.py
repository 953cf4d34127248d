"""Pipeline schedules: generators, validation, the CSV format, unit-cost bubbles and activations.

The comparison with torch.distributed.pipelining's own orders is in test_schedules_torch.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.errors import UserError
from simulator.schedules import (
    SCHEDULES,
    Action,
    PipelineSchedule,
    build_schedule,
    format_schedule_csv,
    load_schedule_csv,
    parse_schedule_csv,
    peak_activations,
    replay_action_costs,
    replay_unit_costs,
    save_schedule_csv,
    validate_schedule,
)
from simulator.schedules.analysis import makespan_unit_costs

DATA = Path(__file__).parent / "data" / "schedules"

# (name, vpp, valid (pp, n) pairs) -- every schedule over several shapes.
SHAPES = {
    "gpipe": (1, [(1, 1), (2, 3), (4, 4), (4, 9), (8, 16)]),
    "1f1b": (1, [(1, 2), (2, 1), (4, 2), (4, 4), (4, 9), (8, 16)]),
    "interleaved-1f1b": (2, [(2, 2), (2, 4), (4, 4), (4, 8), (4, 12), (8, 24)]),
    "looped-bfs": (3, [(1, 1), (2, 3), (4, 4), (4, 9), (8, 16)]),
    "zb-h1": (1, [(1, 1), (2, 5), (4, 3), (4, 4), (4, 9), (8, 16)]),
    "zbv": (2, [(1, 1), (2, 3), (4, 4), (4, 7), (4, 9), (8, 16)]),
    "dualpipe": (1, [(2, 4), (4, 8), (4, 10), (6, 12), (8, 16), (8, 22)]),
    "dualpipev": (2, [(1, 2), (2, 4), (3, 7), (4, 8), (4, 11), (8, 16)]),
}


def test_registry_lists_every_schedule():
    assert set(SCHEDULES) == set(SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_generated_schedules_are_complete_and_deadlock_free(name):
    vpp, shapes = SHAPES[name]
    for pp, n in shapes:
        s = build_schedule(name, pp, n, vpp)
        validate_schedule(s)
        assert s.num_ranks == pp and s.num_microbatches == n
        per_rank = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": vpp, "looped-bfs": vpp, "zb-h1": 1}.get(name, 2)
        assert s.stages_per_rank == per_rank
        for r in range(pp):
            assert len(s.stages_of_rank(r)) == per_rank


def test_interleaved_with_more_chunks_and_zero_bubble_interleaved():
    for v in (3, 4):
        validate_schedule(build_schedule("interleaved-1f1b", 4, 8, v))
    for pp, n in [(4, 8), (4, 10), (4, 3)]:
        s = build_schedule("zb-h1", pp, n, 2)
        validate_schedule(s)
        assert s.num_stages == 2 * pp


def test_dualpipe_has_two_chains_and_two_model_copies():
    s = build_schedule("dualpipe", 4, 8)
    assert s.chains == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert s.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.model_copies == 2 and s.num_positions == 4
    assert s.microbatch_chain == (0, 0, 0, 0, 1, 1, 1, 1)
    v = build_schedule("dualpipev", 4, 8)
    assert v.model_copies == 1 and v.num_positions == 8
    assert v.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)


@pytest.mark.parametrize("pp,n", [(4, 8), (6, 14), (8, 16)])
def test_dualpipe_is_mirror_symmetric(pp, n):
    """DeepSeek's DualPipe is the same program on rank r and rank pp-1-r with the directions
    swapped: chain-0 stage r <-> chain-1 stage at the same position, microbatch m <-> m +- n/2."""
    s = build_schedule("dualpipe", pp, n)
    half = n // 2

    def mirror(a: Action) -> Action:
        if a.kind == "FB":
            f, b = (mirror(x) for x in a.sub)
            return Action(f.stage, "FB", f.microbatch, sub=(f, b))
        stage = a.stage + pp if a.stage < pp else a.stage - pp
        return Action(stage, a.kind, (a.microbatch + half) % n)

    for r in range(pp):
        assert tuple(map(mirror, s.actions[r])) == s.actions[pp - 1 - r]


@pytest.mark.parametrize(
    "name,pp,n,vpp,match",
    [
        ("pipedream", 4, 8, 1, r"unknown pipeline schedule 'pipedream'; choose one of: gpipe, 1f1b"),
        # another case, or the name a schedule begins with: said (was the list alone)
        ("1F1B", 4, 8, 1, r"unknown pipeline schedule '1F1B' \(did you mean '1f1b'\?\); choose one of"),
        ("interleaved", 4, 8, 1, r"'interleaved' \(did you mean 'interleaved-1f1b'\?\)"),
        ("1f1b", 0, 8, 1, r"num_ranks=0 is invalid"),
        ("1f1b", 4, 0, 1, r"num_microbatches=0 is invalid"),
        ("1f1b", 4, 8, 2, r"vpp=2 is not supported; 1F1B holds one stage per rank"),
        ("gpipe", 4, 8, 2, r"vpp=2 is not supported"),
        ("interleaved-1f1b", 4, 8, 1, r"vpp=1 must be at least 2"),
        ("interleaved-1f1b", 4, 10, 2, r"num_microbatches=10 is not a multiple of pp=4.*use 8 or 12"),
        ("zb-h1", 4, 9, 2, r"num_microbatches=9 with vpp=2 must be a multiple of the number of rounds n//pp=2"),
        ("zbv", 4, 8, 3, r"vpp=3 is not supported; ZB-V always holds 2 stages per rank"),
        ("dualpipe", 3, 12, 1, r"pp=3 must be even"),
        ("dualpipe", 4, 6, 1, r"num_microbatches=6 must be even and at least 2\*pp=8"),
        ("dualpipe", 4, 9, 1, r"num_microbatches=9 must be even"),
        ("dualpipev", 4, 7, 1, r"num_microbatches=7 is below the number of stages 2\*pp=8"),
    ],
)
def test_build_schedule_rejects_bad_input(name, pp, n, vpp, match):
    with pytest.raises(UserError, match=match):
        build_schedule(name, pp, n, vpp)


# ---------------------------------------------------------------- validation


def _sched(text: str) -> PipelineSchedule:
    return parse_schedule_csv(text, source="t.csv", validate=False)


def test_validate_backward_before_forward():
    s = _sched("0F0,0B1,0F1,0B0\n1F0,1B0,1F1,1B1\n")
    with pytest.raises(UserError, match=r"rank 0, action 1 \(0B1\): backward before its forward 0F1 on rank 0"):
        validate_schedule(s)


def test_validate_missing_microbatch():
    s = _sched("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n")
    with pytest.raises(UserError, match=r"rank 1: missing action 1B1 \(or 1I1 and 1W1\) for stage 1 microbatch 1"):
        validate_schedule(s)


def test_validate_duplicate_and_w_without_i():
    with pytest.raises(UserError, match=r"rank 0, action 2 \(0F0\): duplicate F for stage 0 microbatch 0"):
        validate_schedule(_sched("0F0,0B0,0F0\n"))
    with pytest.raises(UserError, match=r"rank 0, action 1 \(0W0\): W before its input-grad 0I0"):
        validate_schedule(_sched("0F0,0W0,0I0\n"))
    with pytest.raises(UserError, match=r"missing action 0W0 after 0I0"):
        validate_schedule(_sched("0F0,0I0\n"))


def test_validate_stage_on_wrong_rank():
    good = build_schedule("1f1b", 2, 2)
    moved = list(good.actions)
    moved[0] = moved[0] + (Action(1, "F", 0),)
    bad = type(good)(**{**good.__dict__, "actions": tuple(moved)})
    with pytest.raises(UserError, match=r"rank 0, action 4 \(1F0\): stage 1 lives on rank 1, not on rank 0"):
        validate_schedule(bad)


def test_validate_reports_cross_rank_deadlock_with_waiting_ranks():
    # Rank 0 wants the gradient of microbatch 0 before it sends microbatch 1 forward; rank 1
    # wants microbatch 1's forward before it sends that gradient back.
    s = _sched("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    with pytest.raises(
        UserError,
        match=r"deadlocks: rank 0 at action 1 \(0B0\) waits for 1B0/1I0 on rank 1; "
        r"rank 1 at action 1 \(1F1\) waits for 0F1 on rank 0",
    ):
        validate_schedule(s)


def test_deadlock_file_is_rejected_on_load():
    with pytest.raises(UserError, match=r"deadlocks: rank 0 .* rank 1 .* rank 2 .* rank 3"):
        load_schedule_csv(DATA / "deadlock_4ranks.csv")


# ---------------------------------------------------------------- CSV


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_csv_round_trip(name, tmp_path):
    vpp, shapes = SHAPES[name]
    pp, n = shapes[-1]
    s = build_schedule(name, pp, n, vpp)
    path = tmp_path / f"{name}.csv"
    save_schedule_csv(s, path)
    back = load_schedule_csv(path, num_microbatches=n)
    assert back.actions == s.actions
    assert back.stage_rank == s.stage_rank
    assert back.chains == s.chains
    assert back.microbatch_chain == s.microbatch_chain
    assert format_schedule_csv(back) == format_schedule_csv(s)


def test_csv_one_chain_files_have_no_directive_and_dualpipe_has_one():
    assert not format_schedule_csv(build_schedule("dualpipev", 2, 4)).startswith("#")
    assert format_schedule_csv(build_schedule("dualpipe", 4, 8)).startswith("# chains: 0 1 2 3 | 4 5 6 7\n")


def test_csv_user_file_loads_and_infers_placement():
    s = load_schedule_csv(DATA / "custom_interleaved_2ranks.csv")
    assert s.num_ranks == 2 and s.num_microbatches == 4
    assert s.stage_rank == (0, 1, 0, 1)
    assert s.chains == ((0, 1, 2, 3),)
    assert s.name == "custom_interleaved_2ranks"


def test_csv_skips_empty_cells_and_comm_tokens():
    s = parse_schedule_csv(",0F0,,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD\n1RECV_F0,1F0,1B0,1SEND_B0,\n")
    assert [str(a) for a in s.actions[0]] == ["0F0", "0B0"]
    assert [str(a) for a in s.actions[1]] == ["1F0", "1B0"]


@pytest.mark.parametrize(
    "text,match",
    [
        ("0F0,0X1\n", r"t.csv:1 \(rank 0\): cannot read action '0X1'; write <stage><F\|B\|I\|W><microbatch>"),
        ("0F0,0B0\n1f0,1b0\n", r"t.csv:2 \(rank 1\): cannot read action '1f0'"),
        ("0F0,0F\n", r"cannot read action '0F'"),
        ("0F0,(0F1;1B0\n", r"cannot read overlapped pair '\(0F1;1B0'"),
        ("(0B0;1F0)OVERLAP_F_B\n", r"must be a forward then a backward"),
        ("0F0,0B0\n0F1,0B1\n", r"t.csv:2 \(rank 1\): action '0F1' runs stage 0, which rank 0 already runs"),
        ("0F0,0B0\n\n1F0,1B0\n", r"t.csv:2 \(rank 1\): no actions"),
        ("", r"t.csv: no rank lines"),
        ("0F0,0B0\n2F0,2B0\n", r"stage 1 appears on no rank"),
        ("# chains: 0 1 | x\n0F0,0B0\n", r"t.csv:1: cannot read chain 'x'"),
        ("# chains: 0 | 2\n0F0,0B0\n1F0,1B0\n", r"lists stages \[0, 2\] but the ranks run stages 0..1"),
    ],
)
def test_csv_malformed(text, match):
    with pytest.raises(UserError, match=match):
        parse_schedule_csv(text, source="t.csv")


def test_csv_malformed_file_and_microbatch_mismatch(tmp_path):
    with pytest.raises(UserError, match=r"malformed\.csv:3 \(rank 2\): cannot read action '2F'"):
        load_schedule_csv(DATA / "malformed.csv")
    with pytest.raises(UserError, match=r"runs microbatches 0..3 \(4\) but the scenario has num_microbatches=8"):
        load_schedule_csv(DATA / "custom_interleaved_2ranks.csv", num_microbatches=8)
    with pytest.raises(UserError, match=r"schedule file .*nope\.csv.* does not exist"):
        load_schedule_csv(tmp_path / "nope.csv")


# ---------------------------------------------------------------- bubbles (unit costs, no comm)


def _worst_bubble(schedule, **costs) -> float:
    r = replay_unit_costs(schedule, **costs)
    return max(r.bubble(k) for k in range(schedule.num_ranks))


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("F,B", [(1.0, 2.0), (1.0, 1.0), (1.5, 3.5)])
def test_bubble_1f1b(pp, F, B):
    for n in (pp, 3 * pp):
        s = build_schedule("1f1b", pp, n)
        r = replay_unit_costs(s, F=F, B=B)
        # Every rank idles (p-1)(F+B): the formula holds for the worst and the typical rank.
        assert [r.bubble(k) for k in range(pp)] == pytest.approx([(pp - 1) * (F + B)] * pp)
        assert r.makespan == pytest.approx((n + pp - 1) * (F + B))


@pytest.mark.parametrize("pp,v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_bubble_interleaved(pp, v):
    f, b = 1.0, 2.0  # per chunk; a rank's whole share costs F = v*f, B = v*b
    for n in (2 * pp, 4 * pp):
        s = build_schedule("interleaved-1f1b", pp, n, v)
        assert _worst_bubble(s, F=f, B=b) == pytest.approx((pp - 1) * (v * f + v * b) / v)


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("F,B,W", [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (2.0, 3.0, 1.0), (1.0, 1.0, 0.5)])
def test_bubble_zb_h1(pp, F, B, W):
    s = build_schedule("zb-h1", pp, 3 * pp)
    assert _worst_bubble(s, F=F, B=B, W=W) == pytest.approx((pp - 1) * (F + B - 2 * W))
    # A third of 1F1B's bubble when F = I = W.
    if F == W and B == 2 * W:
        assert _worst_bubble(s, F=F, B=B, W=W) == pytest.approx(_worst_bubble(build_schedule("1f1b", pp, 3 * pp), F=F, B=B) / 3)


# DeepSeek's formula assumes balanced chunks (F = I = W, so B = 2W) and an overlapped pair no
# slower than running its halves back to back (B <= F&B <= F+B); there it is exact for the worst
# rank. Outside that regime (e.g. I > W) the replay's bubble comes out below the formula.
DUALPIPE_COSTS = [(1.0, 2.0, 1.0, 3.0), (1.0, 2.0, 1.0, 2.5), (1.0, 2.0, 1.0, 2.0), (2.0, 4.0, 2.0, 5.0)]


@pytest.mark.parametrize("pp", [4, 6, 8])
@pytest.mark.parametrize("F,B,W,FB", DUALPIPE_COSTS)
def test_bubble_dualpipe(pp, F, B, W, FB):
    for n in (2 * pp, 3 * pp):
        s = build_schedule("dualpipe", pp, n if n % 2 == 0 else n + 1)
        assert _worst_bubble(s, F=F, B=B, W=W, FB=FB) == pytest.approx((pp / 2 - 1) * (FB + B - 3 * W))


@pytest.mark.parametrize("pp", [4, 6, 8])
@pytest.mark.parametrize("F,B,W,FB", DUALPIPE_COSTS)
def test_bubble_dualpipev_same_on_half_the_devices(pp, F, B, W, FB):
    """DualPipeV on pp/2 devices (pp stages of the same size) has DualPipe's bubble on pp."""
    for n in (2 * pp, 3 * pp):
        s = build_schedule("dualpipev", pp // 2, n)
        assert _worst_bubble(s, F=F, B=B, W=W, FB=FB) == pytest.approx((pp / 2 - 1) * (FB + B - 3 * W))


def test_makespan_counts_overlapped_pair_cost():
    s = build_schedule("dualpipev", 2, 8)
    default = makespan_unit_costs(s, F=1.0, B=2.0, W=1.0)  # pair = F + B
    overlapped = makespan_unit_costs(s, F=1.0, B=2.0, W=1.0, FB=2.0)
    assert overlapped < default


def test_replay_reports_deadlock():
    with pytest.raises(UserError, match=r"deadlocks: rank 0 at action 1 \(0B0\)"):
        replay_unit_costs(_sched("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"), F=1.0, B=2.0)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 1), ("dualpipev", 1),
                                      ("dualpipe", 1)])
def test_replay_action_costs_is_the_unit_replay_with_equal_stages(name, vpp):
    s = build_schedule(name, 4, 8, vpp)
    leaf = {"F": 1.0, "B": 2.0, "I": 1.2, "W": 0.8}
    r = replay_action_costs(s, lambda a: 2.7 if a.kind == "FB" else leaf[a.kind])
    unit = replay_unit_costs(s, F=1.0, B=2.0, W=0.8, FB=2.7)
    assert r.makespan == pytest.approx(unit.makespan)
    assert r.busy == pytest.approx(unit.busy)
    assert [t for e in r.end for t in e] == pytest.approx([t for e in unit.end for t in e])


@pytest.mark.parametrize("name,idle", [("zbv", 0.0), ("dualpipev", 0.0), ("1f1b", 10.8)])
def test_replay_action_costs_puts_heavy_end_stages_where_the_schedule_does(name, idle):
    # The first stage holds the embedding, the last the LM head and loss. With both 1.6x a middle
    # stage (pp 4, 16 microbatches, F = I = W = 1), a V placement puts both on rank 0, whose extra
    # work fills the idle it has with equal stages (3 for zbv, 6 for DualPipeV): the makespan is
    # its busy time. A mean-stage replay plus the heaviest rank's excess (the sweep estimate's
    # reading until round 23) adds that idle on top: 157.05 and 160.5 against 153.6. Under 1F1B
    # the heavy ends sit on ranks 0 and 3, and rank 3 still idles through the fill and drain.
    s = build_schedule(name, 4, 16)
    P = s.num_positions

    def cost(a):
        return sum((1.6 if s.stage_position[x.stage] in (0, P - 1) else 1.0) * {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[x.kind]
                   for x in a.leaves)

    r = replay_action_costs(s, cost)
    assert r.busy[0] == pytest.approx(16 * 1.6 * 3 * (1 if name == "1f1b" else 2))  # F + I + W of its end stages
    assert r.makespan - max(r.busy) == pytest.approx(idle)


# ---------------------------------------------------------------- activations


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_peak_activations_match_dualpipe_readme(pp):
    n = 4 * pp
    # 1F1B: rank r holds pp - r microbatches, so the peak is pp (on rank 0).
    assert peak_activations(build_schedule("1f1b", pp, n)) == [float(pp - r) for r in range(pp)]
    # ZB-H1 keeps 1F1B's memory.
    assert peak_activations(build_schedule("zb-h1", pp, n)) == [float(pp - r) for r in range(pp)]
    # DualPipe: pp + 1 on every rank (in units of one stage = 1/pp of the model).
    assert peak_activations(build_schedule("dualpipe", pp, n)) == [float(pp + 1)] * pp
    # DualPipeV on pp/2 devices with pp stages: the same pp + 1.
    if pp >= 2:
        assert peak_activations(build_schedule("dualpipev", pp // 2, n)) == [float(pp + 1)] * (pp // 2)
    # GPipe holds every microbatch.
    assert peak_activations(build_schedule("gpipe", pp, n)) == [float(n)] * pp


def test_peak_activations_weights():
    pp, v = 4, 2
    s = build_schedule("interleaved-1f1b", pp, 2 * pp, v)
    unit = peak_activations(s)
    per_share = peak_activations(s, stage_weights=[1 / v] * s.num_stages)
    assert per_share == pytest.approx([u / v for u in unit])
    # Megatron's interleaving costs the first rank pp * (1 + (pp-1)/(pp*vpp)) shares (Narayanan
    # et al. 2021), more than 1F1B's pp.
    assert per_share[0] == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))


def test_every_schedule_capture_runs_is_one_the_simulator_runs():
    # A bundle captured with --schedule looped-bfs failed validate: "unknown pipeline schedule".
    from simulator.calibrate.validate import _SCHEDULE_ALIASES
    from simulator.capture.spec import SCHEDULES as CAPTURE_SCHEDULES

    for name, (torch_class, _layout) in CAPTURE_SCHEDULES.items():
        ours = _SCHEDULE_ALIASES.get(name, name)
        assert SCHEDULES[ours].torch_class == torch_class, name


def test_replay_action_costs_hides_a_wait_in_the_idle_before_the_action():
    # An action's ``wait`` runs from the rank's previous end: idle waiting for input hides it.
    s = build_schedule("1f1b", 2, 1)
    plain = replay_action_costs(s, lambda a: 1.0)
    assert plain.makespan == pytest.approx(4.0)  # F0 on rank 0, F0 and B0 on rank 1, B0 on rank 0
    # Rank 1's F idles 1.0 for rank 0's F, which hides its 0.5 wait: it ends at 1.5, not 2.0.
    # Rank 0's F has nothing before it to hide its wait in (its cost is its whole span).
    r = replay_action_costs(s, lambda a: 1.0, lambda a: 0.5 if a.kind == "F" else 0.0)
    assert r.makespan == pytest.approx(3.5)
    assert r.hidden == pytest.approx((0.0, 0.5))
    assert r.start[1][0] == pytest.approx(1.0) and r.end[1][0] == pytest.approx(1.5)
    assert r.busy == plain.busy
