"""Where torchtitan's stated rows lose time: per row, the step's attention kernel seconds as
modelled, the attention throughput (FlashAttention-2's FLOP convention: forward 4 s_q s_k d per
head, halved causal, backward 2.5x) that alone would close the gap to the published step, and the
same rows under torch 2.5's context parallel without load balancing (parallelism.cp_load_balance
false), the one sourced alternative for the Dec 2024 torch nightly those runs used.

    PYTHONPATH=. python bench/torchtitan_attention_gap.py      (~40 s)

A diagnostic: nothing here feeds the model.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simulator.calibrate.published import read_table, torchtitan_scenario  # noqa: E402
from simulator.profile import load_profile  # noqa: E402
from simulator.scenario import build_scenario  # noqa: E402
from simulator.simulate import simulate  # noqa: E402
from simulator.workload.ops import build_layer_ops, op_durations_s  # noqa: E402
from simulator.workload.program import fp8_speedup, layer_recompute_ops  # noqa: E402


def attention_per_step(sc) -> tuple[float, float]:
    """(attention kernel seconds, attention FLOPs in FA2's convention) of one step on one rank."""
    prof = load_profile(sc.cluster.gpu)
    lo = build_layer_ops(sc)["dense"]
    fwd = [o for o in lo.forward if o.op_class == "attention"]
    i_ops, _ = lo.backward()
    bwd = [o for o in i_ops if o.op_class == "attention"]
    rec = [o for o in layer_recompute_ops(sc, lo, 0) if o.op_class == "attention"]
    ops = fwd + rec + bwd
    t = float(op_durations_s(prof, ops, sc, fp8_speedup(sc, prof)).sum()) if ops else 0.0
    flops = sum(o.exec_flops for o in fwd) * (1 + (1 if rec else 0) + 2.5)
    n = sc.model.num_layers * sc.num_microbatches
    return t * n, flops * n


def main() -> None:
    rows = [r for r in read_table("torchtitan-2024") if not torchtitan_scenario(r)[1]]
    print(f"{'row':26s} {'published':>9s} {'predicted':>9s} {'error':>7s} {'attn s':>7s} {'attn TF/s':>9s} "
          f"{'needs TF/s':>10s} | {'no-LB pred':>10s} {'error':>7s}")
    for r in rows:
        d, _, _ = torchtitan_scenario(r)
        sc = build_scenario(d)
        pub = sc.batch.global_batch_size * sc.batch.seq_length / sc.cluster.gpus / float(r["measured_value"])
        pred = simulate(sc, fast_forward=True).report.step_time_s
        attn_s, flops = attention_per_step(sc)
        needs = flops / (attn_s + pub - pred) / 1e12
        line = (f"{r['table'][:26]:26s} {pub:9.2f} {pred:9.2f} {pred / pub - 1:+7.1%} {attn_s:7.2f} "
                f"{flops / attn_s / 1e12:9.0f} {needs:10.0f} | ")
        if sc.parallelism.cp > 1:
            d2 = copy.deepcopy(d)
            d2["parallelism"]["cp_load_balance"] = False
            p2 = simulate(build_scenario(d2), fast_forward=True).report.step_time_s
            line += f"{p2:10.2f} {p2 / pub - 1:+7.1%}"
        print(line)


if __name__ == "__main__":
    main()
