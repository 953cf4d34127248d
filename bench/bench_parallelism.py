"""Sim wall time of the issue-7 reference scenarios (target: DeepSeek-V3-like <= 30 s).

DeepSeek-V3-like: PP16 DualPipe, EP64, ZeRO-1 on 2,048 H100 (15,360 x 4,096-token sequences per
step, as DeepSeek-V3 trained). Llama-3-405B-like: TP8 PP16 CP16 with FSDP on 16,384 H100 at
131,072 tokens. Medians over --repeat runs, reduced mode, both networks.

    python bench/bench_parallelism.py [--repeat 3] [--network flow|alpha-beta|both]
"""

from __future__ import annotations

import argparse
import statistics
import time

from simulator.scenario import build_scenario
from simulator.simulate import simulate

DEEPSEEK_V3_LIKE = {
    "name": "deepseek-v3-like-2048xh100", "model": "deepseek-v3",
    "parallelism": {"tp": 1, "pp": 16, "ep": 64, "zero": 1, "sequence_parallel": False},
    "batch": {"micro_batch_size": 1, "global_batch_size": 15360, "seq_length": 4096}, "schedule": "dualpipe",
    "cluster": {"gpus": 2048, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}
LLAMA3_405B_CP16_FSDP = {
    "name": "llama3-405b-cp16-fsdp-16384xh100", "model": "llama3-405b",
    "parallelism": {"tp": 8, "pp": 16, "cp": 16, "zero": 3, "fsdp_reshard_after_forward": False},
    "batch": {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 131072},
    "cluster": {"gpus": 16384, "gpu": "h100-sxm-80gb", "topology": "llama3-24k"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--network", default="both")
    args = ap.parse_args()
    networks = ["flow", "alpha-beta"] if args.network == "both" else [args.network]
    for spec in (DEEPSEEK_V3_LIKE, LLAMA3_405B_CP16_FSDP):
        for net in networks:
            sc = build_scenario({**spec, "network": net})
            walls = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                rep = simulate(sc).report
                walls.append(time.perf_counter() - t0)
            print(f"{spec['name']} [{net}]: {statistics.median(walls):.2f} s wall (median of {args.repeat}), "
                  f"{rep.events:,} events; step {rep.step_time_s:.2f} s, MFU {rep.mfu:.1%}, bubble {rep.bubble_fraction:.1%}, "
                  f"exposed {{{', '.join(f'{k}: {v:.2f}' for k, v in rep.exposed_comm_s.items() if v > 0)}}} s, "
                  f"peak memory {rep.peak_memory_gib:.1f} GiB (fits: {rep.fits_in_memory})")


if __name__ == "__main__":
    main()
