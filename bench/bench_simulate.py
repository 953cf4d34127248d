"""Sim wall time and events per second of the spine's two reference scenarios.

Issue 2's targets on a 2-core machine, reduced mode: the default scenario (Llama-3-70B on
1,024 H100, TP8 PP8 DP16) <= 5 s; a Llama-3-405B-class scenario on 16,384 GPUs (TP8 PP16
DP128) <= 30 s. A MoE scale point beside them: DeepSeek-V3 as NeMo 2.5's recipe lays it out
(TP2 PP16 EP64 with expert tensor parallelism 1 on 1,024 H100: ep folds over tp x dp), held to the
405B's 30 s. Medians over --repeat runs; this machine is shared, so expect noise.

    python bench/bench_simulate.py [--repeat 3] [--mode reduced|full]
"""

from __future__ import annotations

import argparse
import statistics
import time

from simulator.scenario import build_scenario, default_scenario_dict, load_scenario
from simulator.simulate import simulate

LLAMA3_405B_16K = {
    "name": "llama3-405b-16384xh100",
    "model": "llama3-405b",
    "parallelism": {"tp": 8, "pp": 16, "sequence_parallel": True, "zero": 1},
    "batch": {"micro_batch_size": 1, "global_batch_size": 2048, "seq_length": 8192},
    "schedule": "1f1b",
    "cluster": {"gpus": 16384, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}

# NeMo 2.5 recipes/deepseek_v3.py pretrain_recipe: tensor_parallelism 2 (set after the trainer),
# pipeline 16, expert 64, expert_tensor_parallel_size 1, seq_length 4096, global batch 4096.
DEEPSEEK_V3_1K = {
    "name": "deepseek-v3-1024xh100",
    "model": "deepseek-v3",
    "parallelism": {"tp": 2, "pp": 16, "ep": 64, "etp": 1, "sequence_parallel": True, "zero": 1},
    "batch": {"micro_batch_size": 1, "global_batch_size": 4096, "seq_length": 4096},
    "schedule": "1f1b",
    "cluster": {"gpus": 1024, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mode", default="reduced")
    args = ap.parse_args()
    cases = [("default (llama3-70b, 1,024 GPUs)", load_scenario(), 5.0),
             ("llama3-405b, 16,384 GPUs", build_scenario(LLAMA3_405B_16K), 30.0),
             ("deepseek-v3 TP2 PP16 EP64, 1,024 GPUs", build_scenario(DEEPSEEK_V3_1K), 30.0)]
    for label, sc, target_s in cases:
        walls, results = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = simulate(sc, mode=args.mode)
            walls.append(time.perf_counter() - t0)
            results.append(res)
        rep = results[-1].report
        wall = statistics.median(walls)
        print(f"{label}: end-to-end {wall:.2f} s (engine {statistics.median(r.report.sim_wall_s for r in results):.2f} s), "
              f"{rep.events:,} events, {rep.events / wall:,.0f} events/s; target <= {target_s:.0f} s; "
              f"predicted step {rep.step_time_s:.2f} s, MFU {rep.mfu:.1%}, bubble {rep.bubble_fraction:.1%} "
              f"(median of {args.repeat}, {args.mode} mode)")


if __name__ == "__main__":
    main()
