"""An engine built from a scenario dict the way ``simulate`` builds it, for tests that drive the
engine directly (its core, its closed-form stretches)."""

from __future__ import annotations

from simulator.engine.core import Engine
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.simulate import make_network, resolve_schedule
from simulator.topology.spec import load_topology
from simulator.workload.plan import build_plan
from simulator.workload.program import build_program


def build_engine(d: dict, mode: str, core: str = "lean") -> Engine:
    sc = build_scenario(d)
    profile = load_profile(sc.cluster.gpu)
    topo = load_topology(sc.cluster.topology)
    prog = build_program(sc, profile, resolve_schedule(sc))
    return Engine(prog, make_network(sc, topo, profile), mode=mode, plan=build_plan(prog),
                  sm_count=profile.compute.sm_count, core=core)
