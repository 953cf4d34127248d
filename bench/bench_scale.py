"""Simulation cost against the work: GPUs, microbatches, events, events/s, wall and peak RSS.

Issue 13's targets (this 2-core shared machine): every row of the published tables in reduced
mode <= 5 s; Llama-3-405B on 16,384 GPUs with the flow network <= 3 s; full mode at 1,024 GPUs
<= 10 s and at 16,384 GPUs <= 120 s and <= 8 GB, with events/s flat from 64 to 16,384 GPUs.
Each run is a fresh process (so peak RSS is the run's own); the table shows medians of --repeat.
A run whose resident memory passes --rss-limit-gib (default 8, the issue's bound) is stopped and
reported as such, so a run that cannot meet the bound does not take the shared machine down.

    python bench/bench_scale.py [--repeat 3] [--set quick|full-mode|every-rank|published|all]
    python bench/bench_scale.py --set every-rank --gpus 16384 --repeat 1   # the reference loop at 16,384 GPUs (~7 min)

Full mode simulates the ranks that move in lockstep once (simulator.engine.lockstep) and gives
every rank its rows; "every-rank" is the reference loop with one process per rank. The events
column counts the events simulated; "events/s" is over the engine's whole run, "loop ev/s" over its
event loop alone. The set-up before the loop analyses and routes every request the plans will
issue once (O(world) for world-sized groups, paid once per step however many microbatches); the
loop's events in full mode carry every replica's flows, so its link accounting still grows with
the fabric.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
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
# Full mode's rows of every rank are made when first read (simulator.engine.lockstep): time that too.
t = time.perf_counter()
n_rows = len(tl.events) + (0 if tl.waits is None else len(tl.waits))
rows_s = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "rows_s": rows_s, "rows": n_rows, "cpu_s": time.process_time(), "engine_s": tl.sim_wall_s,
                  "loop_s": tl.loop_wall_s if tl.loop_wall_s else tl.sim_wall_s, "events": tl.num_events,
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


def cases(which: str, full_gpus: tuple[int, ...] | None = None) -> list[tuple[str, dict, str]]:
    out: list[tuple[str, dict, str]] = []
    if which in ("quick", "full-mode", "all"):
        sizes = full_gpus or ((64, 256) if which == "quick" else (64, 256, 1024, 4096, 16384))
        out += [("llama3-70b TP8 PP8, 8 mb", llama70b(g, 8), "full") for g in sizes]
    if which in ("every-rank", "all") or (which == "full-mode" and full_gpus is None):
        # The reference loop (one process per rank) that full mode is checked against.
        sizes = full_gpus if which == "every-rank" and full_gpus else (64, 256, 1024)
        out += [("llama3-70b TP8 PP8, 8 mb", llama70b(g, 8), "every-rank") for g in sizes]
    if which in ("quick", "all"):
        out.append(("llama3-405b TP8 PP16 (flow)", LLAMA405B_16K, "reduced"))
    if which in ("published", "all"):
        out += [(label, d, "reduced") for label, d in published_rows()]
    elif which == "quick":
        out += [(label, d, "reduced") for label, d in published_rows()[:2]]
    return out


def _rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def run_one(d: dict, mode: str, timeout_s: float, rss_limit_gib: float) -> tuple[dict | None, str]:
    """One simulation in a fresh process: (figures, "") or (None, why it has none)."""
    p = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(d), mode], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    t0, peak = time.monotonic(), 0.0
    while p.poll() is None:
        peak = max(peak, _rss_gib(p.pid))
        why = ""
        if peak > rss_limit_gib:
            why = f"stopped at {peak:.1f} GiB resident (limit {rss_limit_gib:g}) after {time.monotonic() - t0:.0f} s"
        elif time.monotonic() - t0 > timeout_s:
            why = f"timed out after {timeout_s:.0f} s, unfinished ({peak:.1f} GiB resident by then)"
        if why:
            p.kill()
            p.communicate()
            return None, why
        time.sleep(0.2)
    out, err = p.communicate()
    if p.returncode != 0:
        return None, f"failed: {err.strip().splitlines()[-1] if err.strip() else p.returncode}"
    return json.loads(out.strip().splitlines()[-1]), ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--set", default="quick", choices=["quick", "full-mode", "every-rank", "published", "all"])
    ap.add_argument("--gpus", default=None,
                    help="Comma-separated GPU counts of the full-mode rows (multiples of 64), e.g. 64,256,1024,16384.")
    ap.add_argument("--timeout", type=float, default=900.0, help="Seconds per run before it is reported as a timeout.")
    ap.add_argument("--rss-limit-gib", type=float, default=8.0, help="Resident GiB at which a run is stopped.")
    args = ap.parse_args()
    full_gpus = None
    if args.gpus:
        try:
            full_gpus = tuple(int(x) for x in args.gpus.split(","))
        except ValueError:
            full_gpus = (0,)
        bad = [g for g in full_gpus if g <= 0 or g % 64]
        if bad:
            print(f"--gpus {args.gpus!r}: give positive multiples of 64 (the scenario is TP8 x PP8 x DP), "
                  "comma-separated, e.g. 64,256,1024,16384", file=sys.stderr)
            sys.exit(2)
    print(f"{'scenario':34s} {'mode':10s} {'GPUs':>6s} {'mb':>5s} {'events':>10s} {'events/s':>9s} {'loop ev/s':>9s} {'wall s':>7s} "
          f"{'rows':>11s} {'+rows s':>7s} {'RSS GiB':>7s} {'cpu s':>7s}  (median of {args.repeat}, one process per run, "
          "shared 2-core machine; events/s: over the engine's whole run; loop ev/s: over its event loop alone, without the "
          "set-up that analyses and routes every request once; +rows s: making every rank's rows after the run, RSS includes them)")
    for label, d, mode in cases(args.set, full_gpus):
        runs, why = [], ""
        for _ in range(args.repeat):
            r, why = run_one(d, mode, args.timeout, args.rss_limit_gib)
            if r is None:
                runs = []
                break
            runs.append(r)
        gpus = d["cluster"]["gpus"]
        if not runs:
            print(f"{label:34s} {mode:10s} {gpus:>6,d}  {why}", flush=True)
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{label:34s} {mode:10s} {gpus:>6,d} {int(med['microbatches']):>5d} {int(med['events']):>10,d} "
              f"{med['events'] / med['engine_s']:>9,.0f} {med['events'] / med['loop_s']:>9,.0f} {med['wall_s']:>7.2f} {int(med['rows']):>11,d} {med['rows_s']:>7.2f} "
              f"{med['rss_gib']:>7.2f} "
              f"{med['cpu_s']:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
