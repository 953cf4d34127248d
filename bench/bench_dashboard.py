"""Dashboard: build time, page size, DOM nodes and time to interactive in headless Chromium, for the
default scenario, the 16,384-GPU Llama-3-405B scenario and a DeepSeek-V3-like MoE / DualPipe scenario.
Perfetto export time and size too.

    python bench/bench_dashboard.py                 # all three
    python bench/bench_dashboard.py --only default

Time to interactive is measured in real time over the DevTools pipe (simulator.report.browser.time_page):
"interactive" is when the figures of the first screen are drawn (the page responds), "all drawn" when
every figure and the op-level view are. Targets (issue 17): the default page <= 3 MB with plotly.js
inline, and <= 3 s to interactive. Simulation time is reported apart, not counted in the build time.
Timings on a shared machine vary a lot: read them with its load (printed) in mind.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from simulator.report import browser
from simulator.report.dashboard import build_dashboard_html
from simulator.report.findings import attach
from simulator.report.perfetto import dumps, perfetto_trace
from simulator.scenario import build_scenario, load_scenario
from simulator.simulate import simulate

MOE = {"name": "deepseek-v3-like-2048", "model": "deepseek-v3",
       "parallelism": {"tp": 1, "pp": 16, "ep": 64, "zero": 1, "sequence_parallel": False},
       "batch": {"micro_batch_size": 1, "global_batch_size": 4096, "seq_length": 4096}, "schedule": "dualpipe",
       "cluster": {"gpus": 2048, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta"}
SCENARIOS = {
    "default": lambda: load_scenario(None, {}),
    "16k": lambda: load_scenario(None, {"model": "llama3-405b", "cluster.gpus": 16384, "parallelism.tp": 8,
                                        "parallelism.pp": 16, "batch.global_batch_size": 2048,
                                        "batch.seq_length": 8192}),
    "moe": lambda: build_scenario(MOE),
}
MAX_MB, MAX_TTI_S = 3.0, 3.0


def median_time(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=list(SCENARIOS))
    ap.add_argument("--repeat", type=int, default=3, help="builds and page loads per scenario (median)")
    ap.add_argument("--findings-budget-s", type=float, default=0.0,
                    help="re-simulation budget of the findings (0: findings from the memory model only)")
    args = ap.parse_args()
    have_chromium = browser.find_chromium() is not None
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; chromium {'found' if have_chromium else 'MISSING'}")
    ok = True
    out_dir = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    for key, make in SCENARIOS.items():
        if args.only and key != args.only:
            continue
        t = time.perf_counter()
        res = simulate(make())
        sim_s = time.perf_counter() - t
        t = time.perf_counter()
        attach(res, budget_s=args.findings_budget_s)
        find_s = time.perf_counter() - t
        rows = len(res.timeline.events)
        print(f"{key}: {res.report.name}, {res.report.gpus:,} GPUs, {rows:,} timeline rows; simulated in {sim_s:.1f} s, "
              f"findings in {find_s:.1f} s ({len(res.report.findings)})")
        for cdn in (False, True):
            dt, page = median_time(lambda: build_dashboard_html(res, cdn=cdn), args.repeat)
            mb = len(page.encode()) / 1e6
            line = f"  page {'cdn   ' if cdn else 'inline'}: built in {dt:5.2f} s, {mb:5.2f} MB"
            if not cdn and have_chromium:
                path = out_dir / f"{key}.html"
                path.write_text(page)
                timings = [browser.time_page(path, timeout_s=180) for _ in range(args.repeat)]
                tti = statistics.median(x.tti_ms for x in timings) / 1e3
                ready = statistics.median(x.ready_ms for x in timings) / 1e3
                nodes = timings[0].dom_nodes
                errors = sorted({e for x in timings for e in x.js_errors})
                line += f", {nodes:,} DOM nodes, interactive in {tti:4.2f} s, all drawn in {ready:4.2f} s"
                if errors:
                    line += f", JS errors {errors}"
                if key == "default":
                    met = mb <= MAX_MB and tti <= MAX_TTI_S
                    ok &= met
                    line += f"  [{'ok' if met else 'OVER'}: <= {MAX_MB} MB, <= {MAX_TTI_S} s]"
            print(line)
        dt, text = median_time(lambda: dumps(perfetto_trace(res.timeline, result=res)), 1)
        print(f"  perfetto: {dt:5.2f} s  {len(text) / 1e6:6.2f} MB")
    print("targets met" if ok else "some targets missed (see OVER)")


if __name__ == "__main__":
    main()
