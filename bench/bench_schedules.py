"""Time generating and checking DualPipe with 16 pipeline stages and 256 microbatches.

Issue 4's target: generating and replaying it in <= 1 s. Printed figures are medians over
``--repeat`` runs. "engine replay" runs the SimPy engine over the schedule with uniform
costs and no communication (the same event loop a full simulation uses).

    python bench/bench_schedules.py [--ranks 16] [--microbatches 256] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from simulator.engine.core import Engine
from simulator.network.alpha_beta import IdealNetwork
from simulator.schedules import build_schedule, peak_activations, replay_unit_costs, validate_schedule
from simulator.workload.program import synthetic_program


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16, help="pipeline ranks (stages per direction)")
    ap.add_argument("--microbatches", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    for name, ranks in (("dualpipe", args.ranks), ("dualpipev", args.ranks // 2)):
        s = build_schedule(name, ranks, args.microbatches)
        gen_s = _median_s(lambda: build_schedule(name, ranks, args.microbatches), args.repeat)
        val_s = _median_s(lambda: validate_schedule(s), args.repeat)
        rep_s = _median_s(lambda: replay_unit_costs(s, F=1.0, B=2.0, W=1.0, FB=2.5), args.repeat)
        mem_s = _median_s(lambda: peak_activations(s), args.repeat)
        eng_s = _median_s(lambda: Engine(synthetic_program(s, 1.0, 2.0, 1.0), IdealNetwork()).run(), args.repeat)
        total_s = _median_s(
            lambda: (validate_schedule(sched := build_schedule(name, ranks, args.microbatches)),
                     Engine(synthetic_program(sched, 1.0, 2.0, 1.0), IdealNetwork()).run()),
            args.repeat,
        )
        print(
            f"{name:9s} pp={ranks:<3d} stages={s.num_stages:<3d} microbatches={args.microbatches} "
            f"actions={s.num_actions}: generate {gen_s * 1e3:.1f} ms, validate {val_s * 1e3:.1f} ms, "
            f"unit-cost replay {rep_s * 1e3:.1f} ms, peak activations {mem_s * 1e3:.1f} ms, "
            f"engine replay {eng_s * 1e3:.1f} ms; generate+validate+engine replay {total_s * 1e3:.1f} ms "
            f"(median of {args.repeat}; target <= 1000 ms)"
        )


if __name__ == "__main__":
    main()
