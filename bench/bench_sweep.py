"""Sweep benchmark: configurations estimated per second, scenarios simulated per second.

Issue 9's targets on this (2-core, shared) machine:
  1. estimate: a search over Llama-3-405B on 16,384 H100 -- a space of >= 100,000 points
     (tp x pp x vpp x cp x micro-batch x zero x schedule x recompute x global batch) -- pruned
     and estimated on ONE core in <= 10 minutes;
  2. top-k at 16K: the best estimates of that space simulated (default flow network) on the
     local pool, with the rank agreement between estimate and simulation;
  3. throughput: 1,000 scenarios simulated in <= 10 minutes, on the local pool and on a Dask
     LocalCluster (2 workers). A 405B / 16K simulation takes 2 s (alpha-beta) to 10 s (flow)
     here, so this part uses a smaller scenario: Llama-3-8B on 64 GPUs, alpha-beta network,
     the 1,000 best estimates of a 8,640-point space.

    python bench/bench_sweep.py [--part estimate|topk|pool|dask|all] [--n-sim 1000] [--topk 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from simulator.sweep.estimate import Estimator
from simulator.sweep.runner import evaluate_space, run_sweep
from simulator.sweep.space import make_spec

BASE_405B = {
    "name": "llama3-405b-16k", "model": "llama3-405b",
    "parallelism": {"tp": 8, "pp": 16, "zero": 1},
    "batch": {"micro_batch_size": 1, "global_batch_size": 2048, "seq_length": 8192},
    "schedule": "1f1b",
    "cluster": {"gpus": 16384, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}
AXES_405B = {
    "tp": [1, 2, 4, 8],
    "pp": [1, 2, 4, 8, 16, 32, 64],
    "vpp": [1, 2, 4],
    "cp": [1, 2, 4, 8],
    "micro_batch_size": [1, 2],
    "zero": [0, 1, 3],
    "schedule": ["1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"],
    "recompute": ["none", "selective", "full"],
    "global_batch_size": [512, 1024, 2048, 4096],
}
BASE_8B = {
    "name": "llama3-8b-64", "model": "llama3-8b",
    "parallelism": {"tp": 1, "pp": 1, "zero": 1},
    "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 2048},
    "schedule": "1f1b", "network": "alpha-beta",
    "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}
AXES_8B = {
    "tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8], "vpp": [1, 2], "zero": [0, 1, 3], "micro_batch_size": [1, 2],
    "schedule": ["1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zbv"], "recompute": ["none", "selective", "full"],
    "global_batch_size": [32, 64, 128],
}


def log(msg: str) -> None:
    print(msg, flush=True)


def part_estimate(results: dict) -> object:
    spec = make_spec(BASE_405B, AXES_405B, name="bench-405b", top_k=12)
    log(f"[estimate] llama3-405b on 16,384 GPUs: {spec.size:,} points, one core")
    est = Estimator()
    t0 = time.perf_counter()
    ev = evaluate_space(spec, est)
    wall = time.perf_counter() - t0
    results["estimate"] = {
        "points": spec.size, "feasible": len(ev.candidates), "pruned": sum(ev.pruned.values()),
        "wall_s": wall, "points_per_s": spec.size / wall,
        "feasible_per_s": len(ev.candidates) / wall, "caches": est.stats,
        "pruned_by_reason": dict(ev.pruned.most_common()),
        "best_estimate": {"point": ev.candidates[0].point, "tokens_per_s": ev.candidates[0].score,
                          "mfu": ev.candidates[0].estimate.mfu} if ev.candidates else None,
    }
    log(f"[estimate] {spec.size:,} points in {wall:.1f} s = {spec.size / wall:,.0f} points/s "
        f"({len(ev.candidates):,} feasible, estimated at {len(ev.candidates) / wall:,.0f}/s); target <= 600 s")
    for reason, n in ev.pruned.most_common():
        log(f"    pruned {n:>7,}  {reason}")
    log(f"    caches: {est.stats}")
    if ev.candidates:
        c = ev.candidates[0]
        log(f"    best estimate: {c.point} {c.score:,.0f} tokens/s, MFU {c.estimate.mfu:.1%}")
    # A second pass with warm caches: the per-point cost once programs and replays are built.
    t0 = time.perf_counter()
    sub = make_spec(BASE_405B, {**AXES_405B, "global_batch_size": [2048]}, name="bench-405b-warm")
    evaluate_space(sub, est)
    w2 = time.perf_counter() - t0
    results["estimate"]["warm_points_per_s"] = sub.size / w2
    log(f"[estimate] warm caches: {sub.size:,} points in {w2:.1f} s = {sub.size / w2:,.0f} points/s")
    return (spec, ev)


def part_topk(results: dict, k: int, workers: int | None, spec_ev=None) -> None:
    spec, ev = spec_ev or part_estimate(results)
    store = Path(tempfile.mkdtemp(prefix="bench-sweep-")) / "topk.sqlite"
    # The flow network at 16K GPUs with ~100 microbatches takes many minutes per scenario on
    # this machine; the alpha-beta network keeps the top-k part to minutes.
    import dataclasses

    spec = dataclasses.replace(spec, base={**spec.base, "network": "alpha-beta"})
    ev = dataclasses.replace(ev, candidates=[dataclasses.replace(c, scenario={**c.scenario, "network": "alpha-beta"})
                                             for c in ev.candidates[:k]])
    log(f"[topk] simulating the {k} best estimates of the 16K space (alpha-beta network) on the local pool")
    t0 = time.perf_counter()
    out = run_sweep(spec, store=store, executor="local", workers=workers, top_k=k, evaluation=ev, show_progress=False)
    wall = time.perf_counter() - t0
    sims = [r["report"]["sim_wall_s"] for r in out.simulated]
    results["topk_16k"] = {"k": k, "wall_s": wall, "simulated": len(out.simulated), "errors": len(out.errors),
                           "sim_wall_s_median": sorted(sims)[len(sims) // 2] if sims else None,
                           "agreement": out.agreement,
                           "best": {"point": out.best["point"], "tokens_per_s": out.best["score"]} if out.best else None}
    log(f"[topk] {len(out.simulated)} simulated in {wall:.1f} s ({len(out.simulated) / wall:.2f}/s); "
        f"agreement {json.dumps(out.agreement)}")
    if out.best:
        log(f"    simulated best: {out.best['point']} {out.best['score']:,.0f} tokens/s")


def _throughput(results: dict, label: str, executor, n: int, workers: int | None) -> None:
    spec = make_spec(BASE_8B, AXES_8B, name=f"bench-8b-{label}", top_k=n)
    ev = evaluate_space(spec)
    store = Path(tempfile.mkdtemp(prefix="bench-sweep-")) / f"{label}.sqlite"
    log(f"[{label}] simulating {min(n, len(ev.candidates)):,} of {len(ev.candidates):,} feasible llama3-8b/64-GPU points")
    t0 = time.perf_counter()
    out = run_sweep(spec, store=store, executor=executor, workers=workers, top_k=n, evaluation=ev, show_progress=False)
    wall = time.perf_counter() - t0
    results[label] = {"simulated": len(out.simulated), "errors": len(out.errors), "wall_s": wall,
                      "sims_per_s": len(out.simulated) / wall, "agreement": out.agreement,
                      "projected_1000_s": 1000 * wall / max(1, len(out.simulated))}
    log(f"[{label}] {len(out.simulated):,} simulated in {wall:.1f} s = {len(out.simulated) / wall:.2f}/s "
        f"(1,000 in {1000 * wall / max(1, len(out.simulated)):.0f} s; target <= 600 s); agreement {json.dumps(out.agreement)}")


def part_pool(results: dict, n: int, workers: int | None) -> None:
    _throughput(results, "pool", "local", n, workers)


def part_dask(results: dict, n: int, workers: int | None) -> None:
    from distributed import Client, LocalCluster

    from simulator.sweep.runner import DaskExecutor

    nw = workers or os.cpu_count() or 2
    with LocalCluster(n_workers=nw, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=40) as cluster, Client(cluster) as client:
        _throughput(results, "dask", DaskExecutor(client), n, workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=["estimate", "topk", "pool", "dask", "all"])
    ap.add_argument("--n-sim", type=int, default=1000)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results: dict = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    spec_ev = None
    if args.part in ("estimate", "all"):
        spec_ev = part_estimate(results)
    if args.part in ("pool", "all"):
        part_pool(results, args.n_sim, args.workers)
    if args.part in ("dask", "all"):
        part_dask(results, args.n_sim, args.workers)
    if args.part in ("topk", "all"):
        part_topk(results, args.topk, args.workers, spec_ev)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
