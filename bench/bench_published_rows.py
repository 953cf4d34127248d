"""Every row of the published tables in reduced mode: GPUs, microbatches, events, events/s,
wall and peak RSS per row, and the slowest row against issue 13's 5 s target.

Each row runs in a fresh process (peak RSS is its own), as `validate --published` runs it
(`simulator.calibrate.published.simulate_row`: the steady-state fast path on, `--plain` turns it
off; the report's figures only: no critical path, no rows for the replayed periods). Medians of --repeat. Measured on the
shared 2-core development machine unless said otherwise: wall and events are both printed
because wall depends on the load, events do not.

    python bench/bench_published_rows.py [--set megatron-2021|torchtitan-2024|vtrain-single-node|all]
                                         [--repeat 1] [--rows N] [--only LABEL ...] [--plain]
                                         [--base OTHER_CHECKOUT]

CPU s is the child's process time for the run (less sensitive to the machine's load than wall).
--base: same-load before/after pairs: every repeat runs the row with OTHER_CHECKOUT's code, then
with this one's, alternating, and prints both medians of CPU s and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 5.0

_CHILD = r"""
import json, resource, sys, time
try:
    from simulator.calibrate.published import simulate_row
except ImportError:  # a --base checkout from before simulate_row
    from simulator.scenario import build_scenario
    from simulator.simulate import simulate
    simulate_row = lambda d, fast_forward: simulate(build_scenario(d), fast_forward=fast_forward)
d, ff = json.loads(sys.argv[1]), sys.argv[2] == "1"
t, c = time.perf_counter(), time.process_time()
res = simulate_row(d, fast_forward=ff)
wall, cpu = time.perf_counter() - t, time.process_time() - c
tl = res.timeline
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "engine_s": tl.sim_wall_s, "events": tl.num_events,
                  "microbatches": res.program.schedule.num_microbatches,
                  "simulated_mb": (tl.fast_forward or {}).get("microbatches_simulated", res.program.schedule.num_microbatches),
                  "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def rows(name: str) -> list[tuple[str, dict]]:
    sys.path.insert(0, str(ROOT))
    from simulator.calibrate import published as P

    table = P.read_table(name)
    out, seen = [], set()
    for row in table:
        if name == "megatron-2021":
            label, d = f"{row['params_billion']}B tp{row['tp']} pp{row['pp']} dp{row['dp']}", P.megatron_2021_scenario(row)
        elif name == "torchtitan-2024":
            d = P.torchtitan_scenario(row)[0]
            label = f"{row['model']}: {row['table']}"[:40]
        else:
            d = P.vtrain_scenario(row)
            label = f"h{row['hidden size']} L{row['# layers']} tp{row['tensor parallelism']} pp{row['pipeline parallelism']}"
        key = json.dumps({k: v for k, v in d.items() if k != "name"}, sort_keys=True)
        if key not in seen:  # validate_published simulates each unique scenario once
            seen.add(key)
            out.append((label, d))
    return out


def _child(root: Path, d: dict, plain: bool, timeout: float) -> dict | str:
    """One run in a fresh process with ``root``'s code: its measurements, or why it failed."""
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(d), "0" if plain else "1"], cwd=root,
                           capture_output=True, text=True, timeout=timeout,
                           env={"PYTHONPATH": str(root), "PATH": ""})
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if p.returncode != 0:
        return f"failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="megatron-2021", choices=["megatron-2021", "torchtitan-2024", "vtrain-single-node", "all"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rows", type=int, default=None, help="Only the first N unique rows of each set.")
    ap.add_argument("--plain", action="store_true", help="Without the steady-state fast path.")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--only", nargs="*", default=None, help="Rows whose label starts with one of these (e.g. 529.6B).")
    ap.add_argument("--base", type=Path, default=None, help="Another checkout: alternate its runs with this one's.")
    args = ap.parse_args()
    if args.base is not None:
        ab(args)
        return
    sets = ["megatron-2021", "torchtitan-2024", "vtrain-single-node"] if args.set == "all" else [args.set]
    print(f"{'set':18s} {'row':40s} {'GPUs':>6s} {'mb':>5s} {'sim mb':>6s} {'events':>9s} {'events/s':>9s} "
          f"{'wall s':>7s} {'CPU s':>7s} {'RSS GiB':>7s}  (median of {args.repeat}; fast path {'off' if args.plain else 'on'})")
    worst = (0.0, "")
    for name in sets:
        for label, d in _selected(name, args):
            runs = []
            for _ in range(args.repeat):
                r = _child(ROOT, d, args.plain, args.timeout)
                if isinstance(r, str):
                    print(f"{name:18s} {label:40s} {r}")
                    runs = []
                    break
                runs.append(r)
            if not runs:
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            eps = med["events"] / med["engine_s"] if med["engine_s"] > 0 else float("nan")
            print(f"{name:18s} {label:40s} {d['cluster']['gpus']:>6,d} {int(med['microbatches']):>5d} "
                  f"{int(med['simulated_mb']):>6d} {int(med['events']):>9,d} {eps:>9,.0f} {med['wall_s']:>7.2f} "
                  f"{med['cpu_s']:>7.2f} {med['rss_gib']:>7.2f}", flush=True)
            if med["wall_s"] > worst[0]:
                worst = (med["wall_s"], f"{name} {label}")
    print(f"max over rows: {worst[0]:.2f} s ({worst[1]}) vs target <= {TARGET_S:.0f} s: "
          f"{'met' if worst[0] <= TARGET_S else 'MISSED'}")


def _selected(name: str, args) -> list[tuple[str, dict]]:
    out = rows(name)[: args.rows]
    if args.only:
        out = [(label, d) for label, d in out if any(label.startswith(o) for o in args.only)]
    return out


def ab(args) -> None:
    """Same-load before/after pairs: base and this checkout alternate on every repeat."""
    base = args.base.resolve()
    sets = ["megatron-2021", "torchtitan-2024", "vtrain-single-node"] if args.set == "all" else [args.set]
    print(f"{'set':18s} {'row':40s} {'events':>9s} {'base CPU s':>10s} {'new CPU s':>10s} {'new/base':>8s} "
          f"{'base ev/s':>10s} {'new ev/s':>10s}  (medians of {args.repeat} alternating pairs; base {base})")
    for name in sets:
        for label, d in _selected(name, args):
            pairs = []
            for _ in range(args.repeat):
                rb, rn = _child(base, d, args.plain, args.timeout), _child(ROOT, d, args.plain, args.timeout)
                if isinstance(rb, str) or isinstance(rn, str):
                    print(f"{name:18s} {label:40s} base {rb if isinstance(rb, str) else 'ok'}, new {rn if isinstance(rn, str) else 'ok'}")
                    pairs = []
                    break
                pairs.append((rb, rn))
            if not pairs:
                continue
            cb = statistics.median(b["cpu_s"] for b, _ in pairs)
            cn = statistics.median(n["cpu_s"] for _, n in pairs)
            eb = statistics.median(b["events"] / b["engine_s"] for b, _ in pairs)
            en = statistics.median(n["events"] / n["engine_s"] for _, n in pairs)
            ev = pairs[0][1]["events"]
            same = all(b["events"] == n["events"] for b, n in pairs)
            print(f"{name:18s} {label:40s} {ev:>9,d} {cb:>10.2f} {cn:>10.2f} {cn / cb:>8.2f} {eb:>10,.0f} {en:>10,.0f}"
                  f"{'' if same else '  (event counts differ)'}", flush=True)


if __name__ == "__main__":
    main()
