"""The bare event core's rate against the number of ranks, with no engine around it.

Each rank is one process that computes (a delay) and then meets its group of 8 in a collective
(an event the last arrival triggers after a fixed time), as a TP group does in full mode; the work
per rank is the same at every size and the total work is about the same (400 K rank-steps). If
the core's rate falls with the number of ranks, so will full mode's events/s, whatever the engine
around it does (docs/design-notes.md, "Event core").

    python bench/bench_event_core.py [--repeat 3] [--ranks 64,256,1024,4096,16384]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.engine.events import Environment  # noqa: E402

GROUP = 8
TOTAL_STEPS = 400_000


def _rank(env: Environment, rank: int, steps: int, pending: dict):
    for i in range(steps):
        yield 1.0 + (rank % 7) * 1e-3  # compute, slightly different per rank
        key = (rank // GROUP, i)
        g = pending.get(key)
        if g is None:
            g = pending[key] = [0, env.event()]
        g[0] += 1
        if g[0] == GROUP:  # the last member starts the collective
            del pending[key]
            env.timeout(0.3).callbacks.append(lambda _e, done=g[1]: done.succeed())
        yield g[1]


def rate(ranks: int) -> float:
    """Rank-steps per second of one run."""
    steps = max(1, TOTAL_STEPS // ranks)
    env, pending = Environment(), {}
    for r in range(ranks):
        env.process(_rank(env, r, steps, pending))
    was = gc.isenabled()
    gc.disable()
    try:
        t = time.perf_counter()
        env.run()
        return ranks * steps / (time.perf_counter() - t)
    finally:
        if was:
            gc.enable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ranks", default="64,256,1024,4096,16384")
    args = ap.parse_args()
    print(f"{'ranks':>7} {'rank-steps/s':>14}  (median of {args.repeat}, one process, shared 2-core machine)")
    for n in (int(x) for x in args.ranks.split(",")):
        r = statistics.median(rate(n) for _ in range(args.repeat))
        print(f"{n:>7,} {r:>14,.0f}")


if __name__ == "__main__":
    main()
