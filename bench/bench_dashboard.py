"""Dashboard and Perfetto export: build time (median of 3) and size, for the default scenario and
the 16,384-GPU Llama-3-405B scenario.

    python bench/bench_dashboard.py            # both scenarios
    python bench/bench_dashboard.py --only default

Targets (issue 8): default HTML <= 5 MB with --cdn and built in <= 3 s; 16K-GPU HTML <= 10 MB.
Simulation time is reported separately and not counted in the build time.
"""

from __future__ import annotations

import argparse
import statistics
import time

from simulator.report.dashboard import build_dashboard_html
from simulator.report.perfetto import dumps, perfetto_trace
from simulator.scenario import load_scenario
from simulator.simulate import simulate

SCENARIOS = {
    "default": ({}, 5.0, 3.0),
    "16k": ({"model": "llama3-405b", "cluster.gpus": 16384, "parallelism.tp": 8, "parallelism.pp": 16,
             "batch.global_batch_size": 2048, "batch.seq_length": 8192}, 10.0, None),
}


def median_time(fn, repeat: int = 3):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=list(SCENARIOS))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    ok = True
    for key, (over, max_mb, max_s) in SCENARIOS.items():
        if args.only and key != args.only:
            continue
        t = time.perf_counter()
        res = simulate(load_scenario(None, over))
        sim_s = time.perf_counter() - t
        rows = len(res.timeline.events)
        print(f"{key}: {res.report.name}, {res.report.gpus:,} GPUs, {rows:,} timeline rows, simulated in {sim_s:.1f} s")
        for cdn in (True, False):
            dt, html = median_time(lambda: build_dashboard_html(res, cdn=cdn), args.repeat)
            mb = len(html.encode()) / 1e6
            # targets: the default scenario with --cdn (size and time); the 16K scenario either way (size)
            targeted = cdn or key == "16k"
            met = mb <= max_mb and (max_s is None or not cdn or dt <= max_s)
            verdict = ("ok" if met else "OVER") if targeted else "no target"
            ok &= met or not targeted
            print(f"  dashboard {'cdn   ' if cdn else 'inline'}: {dt:5.2f} s  {mb:6.2f} MB  [{verdict}]")
        dt, text = median_time(lambda: dumps(perfetto_trace(res.timeline)), args.repeat)
        print(f"  perfetto        : {dt:5.2f} s  {len(text) / 1e6:6.2f} MB")
    print("all targets met" if ok else "some targets missed")


if __name__ == "__main__":
    main()
