"""Value-for-value check that a change to the simulator's cost left every result as it was.

Runs a few scenarios (published rows: Megatron SC'21 529.6B / 1T / 310.1B with the steady-state
fast path, a small Megatron row without it, torchtitan FSDP rows, one in full mode) and saves,
or compares against a saved copy, everything a run reports: the timeline rows, the waits, the
step time, exposed/busy/contention seconds, wire bytes, the network report (link bytes), the
fast-path summary, and the report's step breakdown, critical path and per-pipeline-rank rows.
DataFrames are compared with ``pandas.testing.assert_frame_equal`` exactly. The network report's
numbers are compared to LINK_REL (every other field exactly): since round 15 the fabric sums the
bytes of collectives run alone per phase and multiplies once (FlowNetwork._log_isolated_bytes),
which rounds differently from adding each collective's bytes to each link.

    git checkout BASE; python bench/compare_timelines.py --save /tmp/base.pkl
    git checkout NEW;  python bench/compare_timelines.py --check /tmp/base.pkl [--only NAME ...] [--any-row-order]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_scale's scenario

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: PYTHONPATH=OTHER_CHECKOUT saves that checkout's results


def _scenarios() -> dict[str, tuple[dict, str, bool]]:
    """name -> (scenario dict, mode, fast_forward)."""
    from simulator.calibrate import published as P

    meg = {r["params_billion"]: r for r in P.read_table("megatron-2021")}
    tt = {r["table"]: r for r in P.read_table("torchtitan-2024") if r["model"].startswith("Llama 3.1")}
    return {
        "megatron-529.6B": (P.megatron_2021_scenario(meg["529.6"]), "reduced", True),
        "megatron-1008.0B": (P.megatron_2021_scenario(meg[max(meg, key=float)]), "reduced", True),
        "megatron-310.1B": (P.megatron_2021_scenario(meg["310.1"]), "reduced", True),
        "megatron-1.7B-plain": (P.megatron_2021_scenario(meg[min(meg, key=float)]), "reduced", False),
        "megatron-76.1B-plain": (P.megatron_2021_scenario(meg["76.1"]), "reduced", False),
        "torchtitan-8B-128-fsdp": (P.torchtitan_scenario(tt["Table 3 (FSDP)"])[0], "reduced", True),
        "torchtitan-405B-fsdp4-cp2": (P.torchtitan_scenario(tt["Table 6 (FSDP 4, CP 2)"])[0], "reduced", True),
        "torchtitan-8B-8-fsdp-full": (P.torchtitan_scenario(tt["Table 1 (FSDP)"])[0], "full", False),
        # full mode at 256 GPUs: hundreds of virtual collectives at once (bench_scale.py's case)
        "llama3-70b-256-full": (_llama70b(256, 8), "full", False),
        # closed-form stretches (Engine.run_ahead): TP + SP with overlapped all-gathers (the
        # default scenario), TP without SP on the fabric, and the alpha-beta network
        "default-70b-1024": (_default(), "reduced", True),
        "torchtitan-70B-2D": (P.torchtitan_scenario(tt["Table 4 (2D)"])[0], "reduced", True),
        "vtrain-tp4-pp2": (_vtrain(), "reduced", False),
    }


def _default() -> dict:
    from simulator.scenario import default_scenario_dict

    return default_scenario_dict()


def _vtrain() -> dict:
    from simulator.calibrate import published as P

    for row in P.read_table("vtrain-single-node"):
        d = P.vtrain_scenario(row)
        if d["parallelism"].get("tp") == 4 and d["parallelism"].get("pp") == 2 and d["batch"]["micro_batch_size"] == 2:
            return d
    raise LookupError("no vTrain row with tp 4, pp 2, microbatch 2")


def _llama70b(gpus: int, nmb: int) -> dict:
    from bench_scale import llama70b

    return llama70b(gpus, nmb)


def run(d: dict, mode: str, ff: bool) -> dict:
    from simulator.scenario import build_scenario
    from simulator.simulate import simulate

    t = time.process_time()
    res = simulate(build_scenario(d), mode=mode, fast_forward=ff)
    cpu = time.process_time() - t
    tl = res.timeline
    return {
        "events": tl.events, "waits": tl.waits, "step_time_s": tl.step_time_s, "ranks": tl.ranks,
        "busy_compute_s": tl.busy_compute_s, "exposed_s": tl.exposed_s, "comm_bytes": tl.comm_bytes,
        "contention_s": tl.contention_s, "end_time_s": tl.end_time_s, "network_report": tl.network_report,
        "fast_forward": tl.fast_forward, "num_events": tl.num_events, "_cpu_s": cpu,
        "step_breakdown_s": res.report.step_breakdown_s, "critical_path_s": res.report.critical_path_s,
        "critical_path": res.report.critical_path, "per_pp_rank": res.report.per_pp_rank,
    }


def _plain_strings(df: pd.DataFrame) -> pd.DataFrame:
    """String columns as pandas' string dtype: the timeline keeps them as categoricals since
    round 9 (a storage choice, not a result), so a run saved before compares value for value."""
    cat = [c for c in df.columns if isinstance(df[c].dtype, pd.CategoricalDtype)]
    if not cat:
        return df
    out = df.copy()
    for c in cat:
        out[c] = out[c].astype(pd.Series(["x"]).dtype)
    return out


def _in_row_order(df: pd.DataFrame) -> pd.DataFrame:
    """The rows sorted by every column: the same rows appended in another order compare equal."""
    df = _plain_strings(df)
    return df.sort_values(list(df.columns), kind="mergesort").reset_index(drop=True)


# Relative difference of a link's bytes (and what the report derives from them) that is float
# rounding: a sum of a few thousand terms in another order differs by ~1e-15.
LINK_REL = 1e-12


def _same_report(a: list[dict], b: list[dict]) -> bool:
    """Network reports equal: the same rows and keys, numbers to LINK_REL, the rest exactly."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for key, u in x.items():
            v = y[key]
            if isinstance(u, float) and isinstance(v, float):
                if abs(u - v) > LINK_REL * max(abs(u), abs(v)):
                    return False
            elif u != v:
                return False
    return True


def compare(name: str, base: dict, new: dict, any_row_order: bool = False) -> list[str]:
    bad = []
    for k, v in base.items():
        if k.startswith("_"):
            continue
        w = new[k]
        if k == "network_report":
            if not _same_report(v, w):
                bad.append(f"{name}: {k} differs beyond {LINK_REL:g}: {v!r:.200} vs {w!r:.200}")
        elif isinstance(v, pd.DataFrame) or isinstance(w, pd.DataFrame):
            try:
                if any_row_order and k in ("events", "waits"):
                    pd.testing.assert_frame_equal(_in_row_order(v), _in_row_order(w), check_exact=True)
                else:
                    pd.testing.assert_frame_equal(_plain_strings(v), _plain_strings(w), check_exact=True)
            except AssertionError as e:
                bad.append(f"{name}: {k} differs: {str(e).splitlines()[0:3]}")
        elif v != w:
            bad.append(f"{name}: {k} differs: {v!r:.200} vs {w!r:.200}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--check", type=Path)
    ap.add_argument("--only", nargs="*", default=None, help="Scenario names (default: all).")
    ap.add_argument("--any-row-order", action="store_true",
                    help="Compare the timeline's rows and waits as sets (sorted), not in the order the engine wrote them.")
    args = ap.parse_args()
    sc = _scenarios()
    names = args.only or list(sc)
    if args.save:
        out = {}
        for n in names:
            out[n] = run(*sc[n])
            print(f"{n:28s} step {out[n]['step_time_s']:.6f} s, {out[n]['num_events']:,} events, "
                  f"{out[n]['_cpu_s']:.2f} CPU s", flush=True)
        args.save.write_bytes(pickle.dumps(out))
        return
    base = pickle.loads(args.check.read_bytes())
    bad = []
    for n in names:
        if n not in base:
            print(f"{n:28s} not in {args.check}: skipped")
            continue
        new = run(*sc[n])
        diff = compare(n, base[n], new, args.any_row_order)
        bad += diff
        print(f"{n:28s} {'same' if not diff else 'DIFFERENT'}: step {new['step_time_s']:.6f} s, "
              f"{new['num_events']:,} events, {new['_cpu_s']:.2f} CPU s (saved run {base[n]['_cpu_s']:.2f})", flush=True)
    for line in bad:
        print(line)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
