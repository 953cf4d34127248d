"""Flow-level fabric speed: one data-parallel all-reduce across 16,384 GPUs on llama3-24k.

Mesh tp=8, dp=128, pp=16 (Megatron order tp-cp-ep-dp-pp): 128 concurrent DP groups of 128
ranks, one GPU per node each, all issuing the all-reduce together as the engine's reduced
mode does: 16,384 ring flows (plus the double-binary-tree candidate the fabric also prices).
A second layout puts dp outermost (tp-cp-ep-pp-dp) so every DP ring crosses the 1:7
oversubscribed pod uplinks.

Prints medians over repeats of:
  cold    plan building + routing + isolated max-min timing of every candidate (cache empty)
  warm    collective_time_s on a cached plan
  solve   one max-min solve over all flows of the ring
  simpy   start() of the collective plus 127 others (one per pipeline stage and TP rank is
          already in it) run to completion under SimPy with the fast path off, i.e. flows
          re-solved at every arrival and departure: with the coflow model (the default) and
          with per-flow max-min (coflow=False)
Run: python bench/bench_fabric.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import simpy

from simulator.network.base import CollectiveRequest, bus_factor
from simulator.network.fabric import FlowNetwork
from simulator.network.maxmin import maxmin_rates
from simulator.topology.graph import build_graph
from simulator.topology.placement import Mesh
from simulator.topology.spec import load_topology

N_GPUS = 16384
SIZE_BYTES = 1 << 30


def _median(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(order: str, repeats: int) -> None:
    t0 = time.perf_counter()
    graph = build_graph(load_topology("llama3-24k"), N_GPUS)
    t_graph = time.perf_counter() - t0
    groups = Mesh(tp=8, cp=1, ep=1, dp=128, pp=16, order=order).groups("dp")
    req = CollectiveRequest("all_reduce", "dp", groups, SIZE_BYTES)

    def cold():
        net = FlowNetwork(graph, nic_efficiency=0.9, nvlink_efficiency=0.8)
        return net, net.collective_time_s(req)

    t_cold, (net, t_coll) = _median(cold, repeats)
    t_warm, _ = _median(lambda: net.collective_time_s(req), max(repeats, 100))
    plan = net.plan_for(req)
    ring = [p for p in net._candidates(req) if p.algorithm == "ring"][0]
    inc = ring.phases[0].inc
    A, AT = inc.tocsr(), inc.T.tocsr()
    t_solve, _ = _median(lambda: maxmin_rates(A, net.capacity_Bps, None, AT), repeats)

    def dynamic(coflow=True):
        n2 = FlowNetwork(graph, nic_efficiency=0.9, nvlink_efficiency=0.8, fast_path=False, coflow=coflow)
        n2._plans = net._plans  # reuse the cached plans: this measures the event loop
        n2._gkeys = net._gkeys
        env = simpy.Environment()
        ev = n2.start(env, req)
        env.run()
        assert ev.processed
        return n2, env.now

    t_dyn, (n2, t_end) = _median(dynamic, repeats)
    t_pf, (n3, t_end_pf) = _median(lambda: dynamic(False), repeats)
    busbw = SIZE_BYTES / t_coll / 1e9 * bus_factor("all_reduce", 128)
    print(f"order {order}: {groups.shape[0]} groups x {groups.shape[1]} ranks, graph {graph.n_links} links built in {t_graph*1e3:.0f} ms")
    print(f"  chosen {plan.algorithm}; ring flows {ring.phases[0].n_flows}, incidence nnz {inc.nnz}")
    print(f"  simulated 1 GiB all-reduce: {t_coll*1e3:.2f} ms, busbw {busbw:.1f} GB/s (SimPy run: {t_end*1e3:.2f} ms)")
    print(f"  median cold (plans + routing + isolated timing): {t_cold*1e3:.0f} ms")
    print(f"  median warm collective_time_s: {t_warm*1e6:.1f} us")
    print(f"  median one max-min solve ({ring.phases[0].n_flows} flows): {t_solve*1e3:.1f} ms")
    print(f"  median SimPy run, fast path off, coflow: {t_dyn*1e3:.0f} ms ({n2.stats.solves} solves)")
    print(f"  median SimPy run, fast path off, per flow: {t_pf*1e3:.0f} ms ({n3.stats.solves} solves, "
          f"ends at {t_end_pf*1e3:.2f} ms)")
    top = net.link_report(3) if net.link_bytes.any() else n2.link_report(3)
    print("  busiest links:", ", ".join(f"{r['name']} ({r['kind']}) {r['utilization']:.2f}" for r in top))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    run("tp-cp-ep-dp-pp", args.repeats)
    run("tp-cp-ep-pp-dp", args.repeats)


if __name__ == "__main__":
    main()
