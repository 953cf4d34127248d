"""The lean event core (simulator/engine/events.py) against SimPy, its reference: the same order of
events, so the same timeline, value for value."""

from __future__ import annotations

import pandas as pd
import pytest
import simpy

from engine_helpers import build_engine
from simulator.engine import events
from simulator.engine.core import Engine
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.simulate import make_network, resolve_schedule
from simulator.topology.spec import load_topology
from simulator.workload.program import build_program


def _trace_order(make_env):
    """Who ran when, in what order, on an environment from ``make_env``: processes that wait on
    delays, on shared events, on already processed events and on the first of two events."""
    env = make_env()
    log = []
    gate = env.event()
    delay = (lambda s: s) if isinstance(env, events.Environment) else env.timeout

    def waiter(name, d):
        yield delay(d)
        log.append((env.now, name, "slept"))
        v = yield gate
        log.append((env.now, name, "gate", v))
        v = yield gate  # processed already: goes on at once with its value
        log.append((env.now, name, "again", v))

    def opener():
        yield delay(1.0)
        gate.succeed("open")
        log.append((env.now, "opener", "opened"))

    def racer():
        a, b = env.timeout(2.0, "a"), env.event()
        fired = yield a | b
        log.append((env.now, "racer", a in fired, b in fired))
        b2 = env.event()
        env.timeout(0.5).callbacks.append(lambda _e: b2.succeed("b"))
        fired = yield env.timeout(3.0) | b2
        log.append((env.now, "racer", b2 in fired))

    for i, d in enumerate([1.0, 0.5, 1.0, 0.0]):
        env.process(waiter(f"w{i}", d))
    env.process(opener())
    env.process(racer())
    env.run()
    return log


def test_lean_core_runs_processes_in_simpys_order():
    lean, ref = _trace_order(events.Environment), _trace_order(simpy.Environment)
    assert lean == ref
    # and the order is the one SimPy documents: same-time events in the order they were
    # scheduled (w0 and w2 both wake at 1.0, before the opener that was created after them)
    assert [x[1] for x in lean if x[0] == 1.0 and x[2] == "slept"] == ["w0", "w2"]
    assert ("racer", True, False) == lean[[x[1] for x in lean].index("racer")][1:]


def _same_instant_order(make_env):
    """Entries that meet at one instant: many processes waking together, zero delays scheduled
    while the instant runs, and a process started mid-run (SimPy's URGENT start comes before the
    instant's NORMAL entries still pending)."""
    env = make_env()
    log = []
    delay = (lambda s: s) if isinstance(env, events.Environment) else env.timeout

    def late(name):
        log.append((env.now, name, "started"))
        yield delay(0.0)
        log.append((env.now, name, "after zero delay"))

    def member(i):
        yield delay(1.0)
        log.append((env.now, f"m{i}", "woke"))
        if i == 2:
            env.process(late("late"))  # starts before m3..m5 resume
            ev = env.event()
            ev.callbacks.append(lambda _e: log.append((env.now, "zero-delay event", "fired")))
            ev.succeed()  # after everything already pending at t=1
        yield delay(0.0)
        log.append((env.now, f"m{i}", "after zero delay"))
        yield delay(0.25 * (i % 2))
        log.append((env.now, f"m{i}", "done"))

    for i in range(6):
        env.process(member(i))
    env.run()
    return log


def test_lean_core_keeps_simpys_order_within_one_instant():
    lean, ref = _same_instant_order(events.Environment), _same_instant_order(simpy.Environment)
    assert lean == ref, [(a, b) for a, b in zip(lean, ref) if a != b][:3]
    # The mid-run start came before the members still pending at t = 1.
    names = [e[1] for e in ref if e[0] == 1.0]
    assert names.index("late") < names.index("m3")


def test_simpy_events_run_on_the_lean_core():
    env = events.Environment()
    seen = []
    ev = simpy.Event(env)  # the flow network builds its completion events this way

    def proc():
        v = yield ev
        seen.append((env.now, v))

    env.process(proc())
    env.timeout(2.5).callbacks.append(lambda _e: ev.succeed(7))
    env.run()
    assert seen == [(2.5, 7)]


def test_an_exception_in_a_process_leaves_the_loop_as_itself():
    class Stop(Exception):
        pass

    env = events.Environment()

    def proc():
        yield 1.0
        raise Stop("why")

    env.process(proc())
    with pytest.raises(Stop, match="why"):
        env.run()
    assert env.now == 1.0


def test_negative_delay_is_refused():
    with pytest.raises(ValueError, match="negative delay"):
        events.Environment().timeout(-1.0)


SCENARIOS = {
    # full mode with TP, PP, DP collectives on the flow network and SM contention
    "full-tp2-pp2-dp2": ({"name": "c1", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 2, "zero": 1},
                          "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 2048},
                          "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}, "full"),
    # FSDP (ZeRO-3) across nodes with asynchronous gathers and reduce-scatters
    "fsdp-16": ({"name": "c2", "model": "llama3-8b", "parallelism": {"zero": 3},
                 "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 2048},
                 "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}, "full"),
    # zero-bubble (split backward) in full mode
    "zb-h1": ({"name": "c4", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 4}, "schedule": "zb-h1",
               "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 2048},
               "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}, "full"),
    # an interleaved pipeline in reduced mode
    "interleaved": ({"name": "c3", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 4, "vpp": 2},
                     "schedule": "interleaved-1f1b", "batch": {"micro_batch_size": 1, "global_batch_size": 8,
                                                          "seq_length": 2048},
                     "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}, "reduced"),
}


def _run(d: dict, mode: str, core: str):
    return build_engine(d, mode, core).run()


@pytest.mark.parametrize("case", sorted(SCENARIOS))
def test_lean_core_gives_simpys_timeline(case):
    d, mode = SCENARIOS[case]
    lean, ref = _run(d, mode, "lean"), _run(d, mode, "simpy")
    assert lean.step_time_s == ref.step_time_s
    assert len(lean.events) > 20
    pd.testing.assert_frame_equal(lean.events, ref.events)
    pd.testing.assert_frame_equal(lean.waits, ref.waits)
    assert lean.exposed_s == ref.exposed_s and lean.contention_s == ref.contention_s
    assert lean.num_events == ref.num_events


def test_unknown_core_is_refused():
    d, mode = SCENARIOS["interleaved"]
    sc = build_scenario(d)
    profile = load_profile(sc.cluster.gpu)
    prog = build_program(sc, profile, resolve_schedule(sc))
    with pytest.raises(ValueError, match="core must be 'lean' or 'simpy'"):
        Engine(prog, make_network(sc, load_topology(sc.cluster.topology), profile), core="fast")


def test_conditions_are_freed_without_the_cyclic_collector():
    """A fired ``a | b`` holds no reference to itself, so reference counting frees it: a run with
    the cyclic collector off (as simulations run) leaves none of its conditions alive."""
    import gc

    env = events.Environment()

    def racer():
        for _ in range(200):
            yield env.timeout(1.0) | env.event()

    env.process(racer())
    was = gc.isenabled()
    gc.disable()
    try:
        env.run()
        alive = sum(1 for o in gc.get_objects() if type(o) is events.AnyOf)
    finally:
        if was:
            gc.enable()
    assert alive == 0, alive


@pytest.mark.parametrize("enabled", [True, False])
def test_simulate_leaves_the_cyclic_collector_as_it_found_it(enabled):
    """The collector is paused while a step is simulated (cyclic_gc_paused) and put back as it was,
    also when the simulation fails."""
    import gc

    from simulator.gcpause import cyclic_gc_paused
    from simulator.simulate import simulate

    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        sc = build_scenario({"model": "llama3-8b", "parallelism": {"tp": 2, "pp": 2},
                             "batch": {"micro_batch_size": 1, "global_batch_size": 4, "seq_length": 1024},
                             "cluster": {"gpus": 4, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
        simulate(sc)
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError, match="inside"):
            with cyclic_gc_paused():
                assert not gc.isenabled()
                raise RuntimeError("inside")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def _interruptible_order(lean: bool):
    """Who ran when, in what order: segments that wait on the first of their end and a change
    (SimPy: ``timeout | change``; the lean core: ``Interruptible``), changed at their end's very
    instant, before it, after it, twice in one instant, and never; other processes share every
    instant."""
    env = events.Environment() if lean else simpy.Environment()
    log = []
    current: dict[str, object] = {}

    def segment(name, work):
        t0 = env.now
        if lean:
            seg = current[name] = events.Interruptible(env, work)
            yield seg.wake
            finished = seg.finished
        else:
            change = current[name] = env.event()
            finish = env.timeout(work)
            fired = yield finish | change
            finished = finish in fired
        current[name] = None
        log.append((env.now, name, "finished" if finished else "changed", env.now - t0))

    def change(name):
        ev = current.get(name)
        if ev is None:
            log.append((env.now, name, "nothing to change"))
        elif lean:
            current[name] = None
            ev.interrupt()
        else:
            current[name] = None
            if not ev.triggered:
                ev.succeed()

    def changer(name, at):
        yield env.timeout(at)
        log.append((env.now, "changer", name))
        change(name)
        change(name)  # a second change in the same instant finds none pending

    def bystander(name, at):
        yield env.timeout(at)
        log.append((env.now, name, "ran"))

    for name, work, at in (("a", 3.0, 1.0), ("b", 2.0, 2.0), ("c", 2.0, 5.0), ("d", 4.0, None)):
        env.process(segment(name, work))
        if at is not None:
            env.process(changer(name, at))
    for t in (1.0, 2.0, 3.0, 4.0):
        env.process(bystander(f"x{t:g}", t))
    env.run()
    return log


def test_interruptible_delay_keeps_simpy_s_order():
    lean, ref = _interruptible_order(True), _interruptible_order(False)
    assert lean == ref
    assert (1.0, "a", "changed", 1.0) in ref  # changed before its end
    # changed at its end's very instant, after the end was processed: it finished
    assert (2.0, "changer", "b") in ref and (2.0, "b", "finished", 2.0) in ref
    assert (5.0, "c", "nothing to change") in ref and (4.0, "d", "finished", 4.0) in ref
