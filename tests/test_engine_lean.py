"""The engine's bookkeeping shortcuts (issue 13): the wait table's text, the GC state."""

from __future__ import annotations

import gc

import pytest

from simulator.scenario import build_scenario
from simulator.simulate import simulate_step
from simulator.workload.plan import Recv

SMALL = {"name": "lean", "model": "llama3-70b", "parallelism": {"tp": 4, "pp": 4, "zero": 1},
         "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 2048},
         "cluster": {"gpus": 32, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}


@pytest.mark.parametrize("gc_on", [True, False])
def test_run_restores_the_collectors_state(gc_on):
    was = gc.isenabled()
    try:
        gc.enable() if gc_on else gc.disable()
        simulate_step(build_scenario(SMALL), mode="reduced")
        assert gc.isenabled() is gc_on
    finally:
        gc.enable() if was else gc.disable()


def test_wait_text_is_the_awaited_instructions_description():
    # Descriptions are formatted once per instruction when the table is built: every pipeline
    # wait's text must still be the description of a Recv of that rank's plan.
    res = simulate_step(build_scenario(SMALL), mode="full")
    w = res.timeline.waits
    assert len(w) and w["what"].map(lambda x: isinstance(x, str) and x != "" and x != "?").all()
    recv_text = {i.describe() for rp in res.plan.ranks for i in rp.instrs if isinstance(i, Recv)}
    pp = w[(w["cause"] == "pp") & (w["src_rank"] >= 0)]  # receipts (collectives on pp have no source)
    assert len(pp) and set(pp["what"]) <= recv_text
    assert len(set(w["what"])) > 1


def test_a_finished_engine_is_freed_without_the_collector():
    # Its stream loops wait for work forever and hold the engine: a cycle over the whole run
    # (every plan instruction and event) that only the cyclic collector freed, in one pass over
    # millions of live objects after the run. They are closed when the loop ends.
    import weakref

    from simulator.engine.core import Engine
    from simulator.profile import load_profile
    from simulator.simulate import make_network, resolve_schedule
    from simulator.topology.spec import load_topology
    from simulator.workload.program import build_program

    sc = build_scenario(SMALL)
    profile, topo = load_profile(sc.cluster.gpu), load_topology(sc.cluster.topology)
    prog = build_program(sc, profile, resolve_schedule(sc))
    was = gc.isenabled()
    gc.disable()
    try:
        eng = Engine(prog, make_network(sc, topo, profile), mode="reduced", sm_count=profile.compute.sm_count)
        tl = eng.run()
        ref = weakref.ref(eng)
        del eng
        assert ref() is None
        assert tl.step_time_s > 0
    finally:
        gc.enable() if was else gc.disable()
