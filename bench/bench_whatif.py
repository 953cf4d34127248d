"""What-if at scale (issue 18): wall time of perturbed steps and what one bad part costs.

Targets (medians, 2-core shared machine): Llama-3-405B on 16,384 GPUs with one 0.8x GPU <= 30 s
(the perturbed step in split mode; the clean step it is compared with is timed separately);
a 100-seed jitter distribution on 1,024 GPUs <= 5 min. Also prints the cost of one slow GPU,
one halved leaf uplink and one failed node for the default scenario and the 16,384-GPU one,
and the chain of waits from the slow GPU.

    python bench/bench_whatif.py [--repeat 1] [--seeds 100] [--skip-405b] [--granularity stage]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_simulate import LLAMA3_405B_16K  # noqa: E402

from simulator.scenario import build_scenario, default_scenario_dict  # noqa: E402
from simulator.simulate import simulate  # noqa: E402
from simulator.whatif.summary import whatif_lines  # noqa: E402


def with_pert(base: dict, pert: dict) -> dict:
    d = dict(base)
    d["perturbations"] = pert
    return d


def costs(label: str, base: dict, slow_rank: int, repeat: int) -> None:
    cases = [
        (f"one 0.8x GPU (rank {slow_rank}, a middle pipeline stage)", {"gpus": [{"rank": slow_rank, "speed": 0.8}]}),
        ("one 0.8x GPU (rank 3, first pipeline stage)", {"gpus": [{"rank": 3, "speed": 0.8}]}),
        ("one halved leaf uplink (leaf 0 <-> spine)", {"links": [{"name": "uplink:0", "bandwidth": 0.5}]}),
        ("one halved NIC link (nic 3 of node 0: a DP rail)", {"links": [{"name": "nic:3", "bandwidth": 0.5}]}),
        ("one failed node (restart)", {"failures": {"nodes": [0]}}),
    ]
    for what, pert in cases:
        sc = build_scenario(with_pert(base, pert))
        walls, res = [], None
        for _ in range(repeat):
            t0 = time.perf_counter()
            res = simulate(sc)
            walls.append(time.perf_counter() - t0)
        w = res.report.whatif
        # The perturbed step alone: the report's engine time of the split run.
        print(f"[{label}] {what}: end-to-end {statistics.median(walls):.1f} s (clean + perturbed), perturbed engine "
              f"{res.report.sim_wall_s:.1f} s")
        for line in whatif_lines(w):
            print("   ", line)


def jitter_distribution(seeds: int, granularity: str, workers: int) -> None:
    base = default_scenario_dict()
    sc = build_scenario(with_pert(base, {"jitter": {"cv": 0.05, "seeds": seeds, "seed": 0, "granularity": granularity}}))
    from simulator.whatif.run import simulate_whatif

    t0 = time.perf_counter()
    res = simulate_whatif(sc, workers=workers)
    wall = time.perf_counter() - t0
    d = res.report.whatif["distribution"]
    print(f"[jitter, 1,024 GPUs, {granularity}, {workers} worker(s)] {seeds} seeds in {wall:.1f} s ({wall / seeds:.2f} s per seed incl. "
          f"the clean step; projection for 100 seeds {wall / seeds * 100:.0f} s; target <= 300 s); "
          f"{res.report.whatif.get('simulated_ranks')} simulated ranks; P50 {d['p50_s']:.4f} s, P90 {d['p90_s']:.4f} s, "
          f"P99 {d['p99_s']:.4f} s vs clean {res.report.whatif['clean_step_time_s']:.4f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--granularity", default="stage", choices=["stage", "group"])
    ap.add_argument("--skip-405b", action="store_true")
    ap.add_argument("--workers", type=int, default=1, help="forked processes for the seeds (same numbers as 1)")
    ap.add_argument("--only", choices=["costs70", "costs405", "jitter"], default=None)
    args = ap.parse_args()
    if args.only in (None, "costs70"):
        # default: TP8 PP8 -> rank 4 * 128 + 3 is GPU 3 of a stage-4 TP group
        costs("llama3-70b, 1,024 GPUs", default_scenario_dict(), slow_rank=4 * 128 + 3, repeat=args.repeat)
    if args.only in (None, "costs405") and not args.skip_405b:
        # TP8 PP16 DP128 -> rank 8 * 1024 + 3 is on pipeline stage 8
        costs("llama3-405b, 16,384 GPUs", LLAMA3_405B_16K, slow_rank=8 * 1024 + 3, repeat=args.repeat)
    if args.only in (None, "jitter"):
        jitter_distribution(args.seeds, args.granularity, args.workers)


if __name__ == "__main__":
    main()
