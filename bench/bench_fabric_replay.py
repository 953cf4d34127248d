"""The network's share of a published row's cost, alone: the collectives a row starts, replayed
on a fresh fabric at the times the engine started them, with nothing else running.

The engine's cost (plan replay, streams, SimPy processes) is left out, so a change to the fabric
shows as it is; on the shared development machine the load still moves every figure, so compare
runs taken together (``--base`` alternates another checkout's code with this one's).

    python bench/bench_fabric_replay.py --row 529.6 --record /tmp/r529.pkl   # run the row once
    python bench/bench_fabric_replay.py --replay /tmp/r529.pkl [--repeat 3] [--base OTHER_CHECKOUT]

The recording holds the scenario, the requests (each once, as the engine reuses them) and the
(time, request) of every start of the fabric that the steady-state fast path's short run used.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_REPLAY = r"""
import json, pickle, sys, time
import simpy
from simulator.scenario import build_scenario
from simulator.simulate import make_network
from simulator.profile import load_profile
from simulator.topology.spec import load_topology
rec = pickle.loads(open(sys.argv[1], "rb").read())
sc = build_scenario(rec["scenario"])
net = make_network(sc, load_topology(sc.cluster.topology), load_profile(sc.cluster.gpu))
reqs, trace = rec["requests"], rec["trace"]
env = simpy.Environment()
def driver():
    for t, i in trace:
        if t > env.now:
            yield env.timeout(t - env.now)
        net.start(env, reqs[i])
env.process(driver())
c = time.process_time()
env.run()
cpu = time.process_time() - c
print(json.dumps({"cpu_s": cpu, "starts": len(trace), "fast_path": net.stats.fast_path,
                  "materialized": net.stats.materialized}))
"""


def record(row: str, out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from simulator.calibrate import published as P
    from simulator.network import fabric as F
    from simulator.scenario import build_scenario
    from simulator.simulate import simulate

    d = next(P.megatron_2021_scenario(r) for r in P.read_table("megatron-2021") if r["params_billion"] == row)
    traces: dict[int, tuple] = {}
    start = F.FlowNetwork.start

    def recording_start(self, env, req):
        reqs, ids, trace = traces.setdefault(id(self), ([], {}, []))
        i = ids.get(id(req))
        if i is None:
            i = ids[id(req)] = len(reqs)
            reqs.append(req)
        trace.append((env.now, i))
        return start(self, env, req)

    F.FlowNetwork.start = recording_start
    try:
        simulate(build_scenario(d), fast_forward=True)
    finally:
        F.FlowNetwork.start = start
    reqs, _, trace = max(traces.values(), key=lambda v: len(v[2]))
    out.write_bytes(pickle.dumps({"scenario": d, "requests": reqs, "trace": trace}))
    print(f"{row}B: {len(trace):,} starts of {len(reqs)} requests -> {out}")


def _child(root: Path, rec: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", _REPLAY, str(rec)], cwd=root, capture_output=True, text=True,
                       env={"PYTHONPATH": str(root), "PATH": ""}, check=False)
    if p.returncode != 0:
        raise SystemExit(f"replay with {root} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", default="529.6", help="Megatron SC'21 row (params_billion) to record.")
    ap.add_argument("--record", type=Path)
    ap.add_argument("--replay", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base", type=Path, default=None)
    args = ap.parse_args()
    if args.record:
        record(args.row, args.record)
        return
    if not args.replay:
        ap.error("give --record FILE or --replay FILE")
    roots = ([("base", args.base.resolve())] if args.base else []) + [("this", ROOT)]
    runs: dict[str, list[dict]] = {name: [] for name, _ in roots}
    for _ in range(args.repeat):
        for name, root in roots:
            runs[name].append(_child(root, args.replay))
    for name, rs in runs.items():
        cpu = statistics.median(r["cpu_s"] for r in rs)
        r = rs[0]
        print(f"{name:5s} {r['starts']:>8,d} starts ({r['fast_path']:,} fast path, {r['materialized']:,} materialised): "
              f"{cpu:.2f} CPU s, {cpu / r['starts'] * 1e6:.1f} us per start (median of {len(rs)})")


if __name__ == "__main__":
    main()
