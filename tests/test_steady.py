"""The steady-state fast path (simulator.engine.steady) gives the plain event loop's answers."""

import math

import pytest

from simulator.scenario import build_scenario
from simulator.simulate import simulate

REL = 1e-9


def _scenario(schedule: str, pp: int, nmb: int, vpp: int = 1, tp: int = 2, dp: int = 2, network: str | None = None,
              seq_length: int = 2048) -> dict:
    d = {
        "name": f"steady-{schedule}", "model": "llama3-8b",
        "parallelism": {"tp": tp, "pp": pp, "vpp": vpp, "dp": dp, "zero": 1},
        "batch": {"micro_batch_size": 1, "global_batch_size": nmb * dp, "seq_length": seq_length},
        "schedule": schedule,
        "cluster": {"gpus": tp * pp * dp, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
    }
    if network:
        d["network"] = network
    return d


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-12)


def _same(fast, plain) -> None:
    rf, rp = fast.report, plain.report
    assert _close(rf.step_time_s, rp.step_time_s), (rf.step_time_s, rp.step_time_s)
    for k, v in rp.step_breakdown_s.items():
        assert _close(rf.step_breakdown_s[k], v) or abs(rf.step_breakdown_s[k] - v) <= REL * rp.step_time_s, k
    for d, v in rp.exposed_comm_s.items():
        assert abs(rf.exposed_comm_s[d] - v) <= REL * rp.step_time_s, d
    for d, v in rp.comm_bytes_per_gpu.items():
        assert _close(rf.comm_bytes_per_gpu[d], v), d
    assert abs(rf.bubble_fraction - rp.bubble_fraction) <= REL
    # The same critical path: the walk starts from the lowest of the ranks ending the step
    # together, so float rounding of the replayed end times does not move it to another rank.
    assert abs(sum(rf.critical_path_s.values()) - sum(rp.critical_path_s.values())) <= 1e-6 * rp.step_time_s
    for d, v in rp.critical_path_s.items():
        assert abs(rf.critical_path_s.get(d, 0.0) - v) <= 1e-6 * rp.step_time_s, (d, rf.critical_path_s, rp.critical_path_s)
    tf, tp = fast.timeline, plain.timeline
    for r in tp.ranks:
        assert _close(tf.busy_compute_s[r], tp.busy_compute_s[r])
        assert _close(tf.end_time_s[r], tp.end_time_s[r])
    # Same rows: every compute row and wait, same times and labels. Rows of float-rounding
    # length (a pp wait of +-1 ulp where a transfer arrives just as its consumer is ready) come
    # and go with rounding in the plain loop as well; they are not compared (steady._sized).
    zero_s = 1e-12 * tp.step_time_s
    for name in ("events", "waits"):
        a, b = getattr(tf, name), getattr(tp, name)
        a = a[a["end_s"] - a["start_s"] > zero_s].sort_values(["rank", "start_s", "end_s"], kind="stable").reset_index(drop=True)
        b = b[b["end_s"] - b["start_s"] > zero_s].sort_values(["rank", "start_s", "end_s"], kind="stable").reset_index(drop=True)
        assert len(a) == len(b), name
        assert (abs(a["start_s"] - b["start_s"]) <= REL * tp.step_time_s).all(), name
        if name == "events":
            assert (a["microbatch"].to_numpy() == b["microbatch"].to_numpy()).all()
            assert (a["name"].astype(str).to_numpy() == b["name"].astype(str).to_numpy()).all()
        else:
            assert (a["what"].astype(str).to_numpy() == b["what"].astype(str).to_numpy()).all()


@pytest.mark.parametrize("schedule,pp,nmb,vpp,tp,dp,network,replayed,seq_length", [
    # Until round 22 pp ranks 0 and 1 of this layout settled geometrically on the flow network
    # (periods 3e-9, 5.5e-10, ... s apart) and no short run verified. With the embedding's
    # weight gradient at its real size on pp rank 0 they settle exactly, at sequence 512 to 8192:
    # replayed. The runs that do not verify are below (zb-h1 24, dualpipev, gpipe) and in
    # test_aperiodic_short_run_stops_early (FSDP + PP).
    ("1f1b", 4, 24, 1, 2, 2, None, True, 1024),
    ("1f1b", 4, 48, 1, 2, 2, None, True, 2048),
    ("1f1b", 4, 24, 1, 2, 2, None, True, 2048),
    ("1f1b", 4, 24, 1, 2, 2, "alpha-beta", True, 2048),
    ("1f1b", 4, 32, 1, 1, 4, None, True, 2048),
    ("interleaved-1f1b", 2, 24, 2, 2, 2, None, True, 2048),
    ("interleaved-1f1b", 4, 32, 2, 2, 2, None, True, 2048),  # q = pp = 4: 24 of 32 microbatches simulated
    ("zb-h1", 4, 48, 1, 2, 2, None, True, 2048),  # the first short run has not settled: the retry has
    ("zb-h1", 4, 24, 1, 2, 2, None, False, 2048),  # too few microbatches to settle: the plain run
    ("zbv", 4, 48, 1, 2, 2, None, True, 2048),
    ("dualpipev", 4, 24, 1, 2, 2, None, False, 2048),  # no repeating block of this shape: the plain run
    ("gpipe", 4, 24, 1, 2, 2, None, False, 2048),  # no steady phase: the plain run
])
def test_fast_path_equals_plain(schedule, pp, nmb, vpp, tp, dp, network, replayed, seq_length):
    sc = build_scenario(_scenario(schedule, pp, nmb, vpp, tp=tp, dp=dp, network=network, seq_length=seq_length))
    plain = simulate(sc)
    fast = simulate(sc, fast_forward=True)
    assert plain.timeline.fast_forward is None
    assert (fast.timeline.fast_forward is not None) == replayed
    _same(fast, plain)


def test_fast_path_applies():
    """On interleaved 1F1B with many microbatches the fast path does replay periods (the
    equality tests above then compare a replayed step, not two plain runs)."""
    sc = build_scenario(_scenario("interleaved-1f1b", 2, 24, 2))
    fast = simulate(sc, fast_forward=True)
    ff = fast.timeline.fast_forward
    assert ff is not None and ff["periods_skipped"] > 0 and ff["microbatches_simulated"] < 24
    assert fast.timeline.num_events < simulate(sc).timeline.num_events


def test_fast_path_applies_interleaved_pp4():
    """Interleaved 1F1B with a period of pp = 4 microbatches (8 periods): warm-up, two observed
    periods (the first of them the settling one: no period of its own where a period holds
    SETTLE_MICROBATCHES) and the cool-down are simulated (20 of 32 microbatches), the rest
    replayed, and the step is the plain loop's."""
    sc = build_scenario(_scenario("interleaved-1f1b", 4, 32, 2))
    fast = simulate(sc, fast_forward=True)
    ff = fast.timeline.fast_forward
    assert ff is not None and ff["microbatches_per_period"] == 4
    assert ff["microbatches_simulated"] == 20 and ff["periods_skipped"] == 3
    plain = simulate(sc)
    assert fast.timeline.num_events < 0.7 * plain.timeline.num_events
    assert fast.report.step_time_s == pytest.approx(plain.report.step_time_s, rel=1e-9)


@pytest.mark.parametrize("schedule,pp,nmb,vpp,tp,dp", [("1f1b", 4, 32, 1, 1, 4), ("interleaved-1f1b", 4, 32, 2, 2, 2),
                                                     ("zbv", 4, 48, 1, 2, 2)])
def test_figures_only_run_reports_what_the_rows_give(schedule, pp, nmb, vpp, tp, dp):
    """simulate(rows=False) (validate --published's run): the replayed periods' rows are not
    made; the report's figures, the step breakdown per pipeline rank included, are those of the
    run that makes them (its compute, bubble and optimizer seconds summed without the rows)."""
    sc = build_scenario(_scenario(schedule, pp, nmb, vpp, tp=tp, dp=dp))
    full = simulate(sc, fast_forward=True)
    lean = simulate(sc, fast_forward=True, rows=False)
    assert full.timeline.fast_forward is not None and lean.timeline.fast_forward is not None
    assert not lean.timeline.rows and len(lean.timeline.events) == 0 and not lean.report.critical_path
    rf, rl = full.report, lean.report
    assert rl.step_time_s == rf.step_time_s
    assert rl.step_breakdown_s["bubble"] + rl.step_breakdown_s["imbalance"] > 0.01 * rf.step_time_s  # (idle to sum)
    for a, b in zip(rf.per_pp_rank, rl.per_pp_rank):
        for k, v in a["breakdown_s"].items():
            assert abs(b["breakdown_s"][k] - v) <= REL * rf.step_time_s, (a["pp_rank"], k, v, b["breakdown_s"][k])
        assert abs(a["bubble_fraction"] - b["bubble_fraction"]) <= REL


def test_find_cut_on_schedules():
    """The schedule check: 1F1B and interleaved repeat one block; DualPipeV has no such shape."""
    from simulator.engine.steady import find_cut, plan_cut, relabel
    from simulator.schedules import build_schedule

    full = build_schedule("1f1b", 4, 40, 1)
    short, cut = plan_cut(full, lambda m: build_schedule("1f1b", 4, m, 1))
    assert cut.q == 1 and cut.m_short < 20 and cut.n_periods == 40 - cut.m_short
    for r in range(4):  # the full schedule is the short one with the block repeated
        c, a = cut.cut_index[r], cut.period_actions[r]
        rebuilt = list(short.actions[r][:c])
        for k in range(1, cut.n_periods + 1):
            rebuilt += [relabel(x, k) for x in short.actions[r][c - a:c]]
        rebuilt += [relabel(x, cut.n_periods) for x in short.actions[r][c:]]
        assert tuple(rebuilt) == full.actions[r]
    full_i = build_schedule("interleaved-1f1b", 2, 40, 2)
    _, cut_i = plan_cut(full_i, lambda m: build_schedule("interleaved-1f1b", 2, m, 2))
    assert cut_i.q == 2
    # A short schedule of another shape is refused.
    assert find_cut(full, 20, 1, build_schedule("gpipe", 4, 20, 1)) is None
    full_d = build_schedule("dualpipev", 4, 40, 1)
    assert plan_cut(full_d, lambda m: build_schedule("dualpipev", 4, m, 1)) is None


@pytest.mark.parametrize("name, pp, n, vpp", [("1f1b", 16, 64, 1), ("interleaved-1f1b", 8, 96, 2),
                                               ("zb-h1", 8, 48, 1), ("gpipe", 4, 40, 1)])
def test_cut_search_skips_only_counts_that_cannot_cut(name, pp, n, vpp, monkeypatch):
    """Where a short schedule lacks observed blocks, plan_cuts jumps past the counts that cannot
    hold them: it offers the same cuts, fewest microbatches first, as trying every count."""
    import simulator.engine.steady as S
    from simulator.schedules import build_schedule

    full = build_schedule(name, pp, n, vpp)

    def offers(built):
        def build(m):
            built.append(m)
            return build_schedule(name, pp, m, vpp)
        return [(short.num_microbatches, tuple(cut.cut_index)) for short, cut in S.plan_cuts(full, build)]

    tried_jump, tried_all = [], []
    jumping = offers(tried_jump)
    search = S._find_cut
    monkeypatch.setattr(S, "_find_cut", lambda *a: search(*a)._replace(lacking=1))
    assert offers(tried_all) == jumping
    assert len(tried_jump) <= len(tried_all)
    if name in ("1f1b", "interleaved-1f1b"):
        assert jumping and len(tried_jump) < len(tried_all)


def _short_1f1b_run():
    """The short run the fast path would simulate for 1F1B pp4 with 24 microbatches: its
    timeline, the short schedule, the cut and the engine (with its action marks). On the
    alpha-beta network, whose 1F1B steady phase is periodic from its first period (the
    parametrised table replays it): on the default flow network the first short run has not
    settled (test_fast_path_equals_plain), and these tests need one that verifies."""
    import simulator.simulate as S
    from simulator.engine.steady import plan_cut
    from simulator.schedules import build_schedule

    sc = build_scenario(_scenario("1f1b", 4, 24, 1, network="alpha-beta"))
    profile, topo = S.load_profile(sc.cluster.gpu), S.load_topology(sc.cluster.topology)
    full = build_schedule("1f1b", 4, 24, 1)
    short, cut = plan_cut(full, lambda m: build_schedule("1f1b", 4, m, 1))
    prog = S.build_program(sc, profile, short)
    eng = S.Engine(prog, S.make_network(sc, topo, profile), plan=S.build_plan(prog), sm_count=profile.compute.sm_count)
    eng.action_marks = {}
    return eng.run(), short, cut, eng


def test_unsettled_short_run_is_refused():
    """The dynamics check can fail: one row moved by a microsecond in the observed periods
    makes ``extend`` refuse the short run (and say why)."""
    from simulator.engine.steady import extend

    tl, short, cut, eng = _short_1f1b_run()
    assert extend(tl, short, cut, eng.action_marks) is not None
    # Move one compute row of the last steady period on the last rank by 1 us.
    ev = tl.events
    last = tl.ranks[-1]
    comp = ev[(ev["rank"] == last) & (ev["stream"] == "compute") & (ev["microbatch"] == cut.m_short - 3)]
    i = comp.index[len(comp) // 2]
    ev.loc[i, ["start_s", "end_s"]] += 1e-6
    why: list[str] = []
    assert extend(tl, short, cut, eng.action_marks, why) is None
    assert why and "differ" in why[0]


def test_rounding_length_rows_do_not_refuse():
    """A wait of float-rounding length (a transfer arriving as its consumer gets ready, +-1 ulp)
    in one observed period only does not make ``extend`` refuse the short run; a real wait does."""
    import pandas as pd

    from simulator.engine.steady import extend

    tl, short, cut, eng = _short_1f1b_run()
    ff = extend(tl, short, cut, eng.action_marks)
    assert ff is not None
    # A wait row inside the older observed period, at the start of a compute row there.
    ev = tl.events
    last = tl.ranks[-1]
    t_mid = ev[(ev["rank"] == last) & (ev["stream"] == "compute") & (ev["microbatch"] == cut.m_short - 4)]["start_s"].iloc[0]
    base = tl.waits

    def with_wait(seconds: float):
        row = {"rank": last, "start_s": t_mid, "end_s": t_mid + seconds, "cause": "pp", "issued_s": t_mid,
               "src_rank": -1, "what": "test"}
        tl.waits = pd.concat([base, pd.DataFrame([row], columns=base.columns)], ignore_index=True)
        why: list[str] = []
        return extend(tl, short, cut, eng.action_marks, why), why

    out, why = with_wait(4e-15)
    assert out is not None, why
    out, why = with_wait(1e-6)
    assert out is None and why == ["row counts differ between periods"]


def test_aperiodic_short_run_stops_early():
    """FSDP (zero 3) with pp sends over the same NICs and compute slowed by the gathers' SMs: the
    stages run at different periods for tens of microbatches (torchtitan's 405B 1F1B row), so
    the short run cannot verify. Its marks say so before its cool-down (``run_short`` stops
    there), and ``extend`` on the whole short run refuses it too: the early stop only saves time."""
    import simulator.simulate as S
    from simulator.engine.steady import extend, plan_cut, run_short
    from simulator.schedules import build_schedule

    d = {"name": "fsdp-pp", "model": "llama3-405b",
         "parallelism": {"tp": 8, "pp": 8, "dp": 2, "zero": 3, "sequence_parallel": True, "overlap_grad_reduce": True},
         "batch": {"micro_batch_size": 1, "global_batch_size": 48, "seq_length": 8192},
         "schedule": "1f1b", "recompute": "full", "framework": "torchtitan",
         "cluster": {"gpus": 128, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    sc = build_scenario(d)
    profile, topo = S.load_profile(sc.cluster.gpu), S.load_topology(sc.cluster.topology)
    short, cut = plan_cut(build_schedule("1f1b", 8, 24, 1), lambda m: build_schedule("1f1b", 8, m, 1))
    prog = S.build_program(sc, profile, short)

    def engine():
        return S.Engine(prog, S.make_network(sc, topo, profile), plan=S.build_plan(prog), sm_count=profile.compute.sm_count)

    why: list[str] = []
    early = engine()
    assert run_short(early, short, cut, why) is None
    assert why and why[0].startswith("stopped early") and "period differs" in why[0], why
    whole = engine()
    whole.action_marks = {}
    tl = whole.run()
    assert early.env.now < 0.8 * tl.step_time_s  # stopped before the cool-down
    # ... and before every rank had left its steady phase (ShortRunMarks.check_passed)
    assert early.action_marks.waiting, "the early stop waited for every rank"
    why_whole: list[str] = []
    assert extend(tl, short, cut, whole.action_marks, why_whole) is None, why_whole


@pytest.mark.parametrize("schedule,pp,nmb,vpp,network,refuses,seq_length", [
    ("zb-h1", 4, 48, 1, None, True, 2048),  # the first short run has not settled: stopped early
    ("1f1b", 4, 24, 1, None, False, 1024),
    ("1f1b", 4, 24, 1, None, False, 2048),
    ("1f1b", 4, 24, 1, "alpha-beta", False, 2048),
    ("interleaved-1f1b", 4, 32, 2, None, False, 2048),
    ("zbv", 4, 48, 1, None, False, 2048),
])
def test_early_stop_agrees_with_extend(schedule, pp, nmb, vpp, network, refuses, seq_length):
    """The early check during the short run (``run_short``) refuses exactly where ``extend`` on
    the whole short run refuses, on the first two short runs of each schedule: it is a speed-up,
    never a different answer."""
    import simulator.simulate as S
    from simulator.engine.steady import extend, plan_cuts, run_short
    from simulator.schedules import build_schedule

    sc = build_scenario(_scenario(schedule, pp, nmb, vpp, network=network, seq_length=seq_length))
    profile, topo = S.load_profile(sc.cluster.gpu), S.load_topology(sc.cluster.topology)
    full = build_schedule(schedule, pp, nmb, vpp)
    refused = []
    for short, cut in list(plan_cuts(full, lambda m: build_schedule(schedule, pp, m, vpp)))[:2]:
        prog = S.build_program(sc, profile, short)

        def engine():
            return S.Engine(prog, S.make_network(sc, topo, profile), plan=S.build_plan(prog), sm_count=profile.compute.sm_count)

        why: list[str] = []
        early = run_short(engine(), short, cut, why)
        whole = engine()
        whole.action_marks = {}
        tl = whole.run()
        late = extend(tl, short, cut, whole.action_marks)
        assert (early is None) == (late is None), why
        if early is None:
            refused.append(why[0])
            assert why[0].startswith("stopped early")  # (this refusal is decided by the marks)
        else:
            assert early.step_time_s == late.step_time_s
    assert bool(refused) == refuses
