"""Simulation cost against the work: GPUs, microbatches, events, events/s, wall and peak RSS.

Issue 13's targets (this 2-core shared machine): every row of the published tables in reduced
mode <= 5 s; Llama-3-405B on 16,384 GPUs with the flow network <= 3 s; full mode at 1,024 GPUs
<= 10 s and at 16,384 GPUs <= 120 s and <= 8 GB, with events/s flat from 64 to 16,384 GPUs.
Each run is a fresh process (so peak RSS is the run's own); the table shows medians of --repeat.

    python bench/bench_scale.py [--repeat 3] [--set quick|full-mode|published|all]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, resource, sys, time
from simulator.scenario import build_scenario
from simulator.simulate import simulate
d, mode = json.loads(sys.argv[1]), sys.argv[2]
t = time.perf_counter()
res = simulate(build_scenario(d), mode=mode)
wall = time.perf_counter() - t
tl = res.timeline
print(json.dumps({"wall_s": wall, "engine_s": tl.sim_wall_s, "events": tl.num_events,
                  "microbatches": res.program.schedule.num_microbatches,
                  "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def llama70b(gpus: int, nmb: int) -> dict:
    """The default scenario's layout (TP8 PP8) scaled in data parallelism, nmb microbatches per pipeline."""
    dp = gpus // 64
    return {"name": f"llama3-70b-{gpus}", "model": "llama3-70b", "parallelism": {"tp": 8, "pp": 8, "zero": 1},
            "batch": {"micro_batch_size": 1, "global_batch_size": nmb * dp, "seq_length": 8192},
            "cluster": {"gpus": gpus, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}


LLAMA405B_16K = {
    "name": "llama3-405b-16384", "model": "llama3-405b", "parallelism": {"tp": 8, "pp": 16, "zero": 1},
    "batch": {"micro_batch_size": 1, "global_batch_size": 2048, "seq_length": 8192}, "schedule": "1f1b",
    "cluster": {"gpus": 16384, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}


def published_rows() -> list[tuple[str, dict]]:
    sys.path.insert(0, str(ROOT))
    from simulator.calibrate.published import megatron_2021_scenario

    path = ROOT / "simulator" / "data" / "validation" / "megatron-2021-table1.csv"
    with path.open() as f:
        return [(f"megatron-2021 {r['params_billion']}B", megatron_2021_scenario(r)) for r in csv.DictReader(f)]


def cases(which: str) -> list[tuple[str, dict, str]]:
    out: list[tuple[str, dict, str]] = []
    if which in ("quick", "full-mode", "all"):
        sizes = (64, 256) if which == "quick" else (64, 256, 1024)
        out += [("llama3-70b TP8 PP8, 8 mb", llama70b(g, 8), "full") for g in sizes]
    if which in ("quick", "all"):
        out.append(("llama3-405b TP8 PP16 (flow)", LLAMA405B_16K, "reduced"))
    if which in ("published", "all"):
        out += [(label, d, "reduced") for label, d in published_rows()]
    elif which == "quick":
        out += [(label, d, "reduced") for label, d in published_rows()[:2]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--set", default="quick", choices=["quick", "full-mode", "published", "all"])
    ap.add_argument("--timeout", type=float, default=900.0, help="Seconds per run before it is reported as a timeout.")
    args = ap.parse_args()
    print(f"{'scenario':34s} {'mode':7s} {'GPUs':>6s} {'mb':>5s} {'events':>10s} {'events/s':>9s} {'wall s':>7s} "
          f"{'RSS GiB':>7s}  (median of {args.repeat}, one process per run, loaded 2-core machine)")
    for label, d, mode in cases(args.set):
        runs = []
        for _ in range(args.repeat):
            try:
                p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(d), mode], cwd=ROOT, capture_output=True,
                                   text=True, timeout=args.timeout, env={"PYTHONPATH": str(ROOT), "PATH": ""})
            except subprocess.TimeoutExpired:
                runs = None
                break
            if p.returncode != 0:
                print(f"{label}: failed: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
                runs = None
                break
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
        gpus = d["cluster"]["gpus"]
        if not runs:
            print(f"{label:34s} {mode:7s} {gpus:>6,d}  timed out after {args.timeout:.0f} s")
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{label:34s} {mode:7s} {gpus:>6,d} {int(med['microbatches']):>5d} {int(med['events']):>10,d} "
              f"{med['events'] / med['engine_s']:>9,.0f} {med['wall_s']:>7.2f} {med['rss_gib']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
