"""Adam's state precision and the gradient reduction's dtype, as megatron-core runs them.

megatron-core 0.16.1 optimizer_config.py (use_precision_aware_optimizer, exp_avg_dtype,
exp_avg_sq_dtype, main_grads_dtype, store_param_remainders) with Transformer Engine's FusedAdam;
distrib_optimizer.py keeps the fp32 master weight as an int16 remainder beside a bf16 parameter;
DistributedDataParallelConfig.grad_reduce_in_fp32 sets the gradient buffer's dtype. NeMo 2.5's
DeepSeek-V3 recipe runs bf16 moments, bf16 main gradients and grad_reduce_in_fp32 False.
"""

from __future__ import annotations

import pytest

from agreement_scenarios import scenario
from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.sweep.estimate import Estimator
from simulator.vocabulary import Dim, Stream
from simulator.workload.plan import adam_bytes_per_param, optimizer_state_bytes_per_param

GIB = 1024**3
BF16_STATE = {"precision_aware": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16", "main_grads_dtype": "bf16"}


def test_state_and_step_bytes_follow_the_dtypes():
    default = build_scenario(scenario("adam", parallelism={"zero": 1}))
    assert (optimizer_state_bytes_per_param(default), adam_bytes_per_param(default)) == (12, 30)
    bf16_buffer = {"zero": 1, "grad_reduce_in_fp32": False}
    bf16 = build_scenario(scenario("adam-bf16", parallelism=bf16_buffer, optimizer=BF16_STATE))
    # master as a 16-bit remainder (2) + m (2) + v (2); the step reads and writes the bf16
    # parameter and its remainder (8), reads the bf16 gradient buffer (2), reads and writes m and v (8).
    assert (optimizer_state_bytes_per_param(bf16), adam_bytes_per_param(bf16)) == (6, 18)
    # main_grads_dtype is read nowhere in megatron-core: with an fp32 buffer the step reads 4 bytes.
    fp32_buffer = build_scenario(scenario("adam-bf16-fp32-grads", parallelism={"zero": 1}, optimizer=BF16_STATE))
    assert adam_bytes_per_param(fp32_buffer) == 20
    whole = build_scenario(scenario("adam-bf16-fp32-master", parallelism=bf16_buffer,
                                    optimizer={**BF16_STATE, "store_param_remainders": False}))
    assert (optimizer_state_bytes_per_param(whole), adam_bytes_per_param(whole)) == (8, 20)
    # precision-aware with fp32 moments keeps their 8 bytes beside the 2-byte remainder.
    pa = build_scenario(scenario("adam-pa", parallelism={"zero": 1}, optimizer={"precision_aware": True}))
    assert optimizer_state_bytes_per_param(pa) == 10
    # Without it a bf16 buffer's shard is copied to an fp32 .grad first (2 read, 4 written).
    copied = build_scenario(scenario("adam-bf16-buffer", parallelism=bf16_buffer))
    assert adam_bytes_per_param(copied) == 36


def test_bf16_moments_halve_the_optimizer_state_and_shorten_its_step():
    a = simulate(build_scenario(scenario("adam", parallelism={"zero": 1})))
    b = simulate(build_scenario(scenario("adam-bf16", parallelism={"zero": 1}, optimizer=BF16_STATE)))
    params = a.program.stage_params[0]
    assert a.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(12 * params / 16, rel=1e-9)
    assert b.memory.per_rank_gib[0]["optimizer_gib"] * GIB == pytest.approx(6 * params / 16, rel=1e-9)
    assert b.program.optimizer_s < a.program.optimizer_s


def test_gradients_reduced_in_bf16_move_and_hold_half_the_bytes():
    a = simulate(build_scenario(scenario("fp32-grads", parallelism={"zero": 1})))
    b = simulate(build_scenario(scenario("bf16-grads", parallelism={"zero": 1, "grad_reduce_in_fp32": False})))

    def reduced(res) -> float:
        return sum(s[2] for c in res.plan.ranks[0].collectives() if c.stream == Stream.DP
                   for s in c.steps if s[0] == Dim.DP)

    assert reduced(b) == pytest.approx(reduced(a) / 2, rel=1e-9) and reduced(a) > 0
    assert b.memory.per_rank_gib[0]["gradients_gib"] == pytest.approx(a.memory.per_rank_gib[0]["gradients_gib"] / 2)
    # fp32 asked for explicitly is the default for bf16.
    c = simulate(build_scenario(scenario("fp32-asked", parallelism={"zero": 1, "grad_reduce_in_fp32": True})))
    assert c.timeline.step_time_s == a.timeline.step_time_s


@pytest.mark.parametrize("d", [
    scenario("nemo-dsv3-like", parallelism={"zero": 1, "grad_reduce_in_fp32": False}, optimizer=BF16_STATE),
    scenario("pp2-bf16-state", gbs=32, parallelism={"pp": 2, "zero": 1, "grad_reduce_in_fp32": False}, optimizer=BF16_STATE),
], ids=lambda d: d["name"])
def test_the_estimate_prices_them_as_the_simulation_does(d):
    sc = build_scenario(d)
    res = simulate(sc)
    est = Estimator().estimate(sc)
    assert est.optimizer_s == pytest.approx(res.program.optimizer_s, rel=1e-9)
    assert est.peak_memory_gib == pytest.approx(res.memory.peak_gib, rel=1e-9)
    assert est.step_time_s == pytest.approx(res.timeline.step_time_s, rel=0.01)


@pytest.mark.parametrize("over, message", [
    ({"optimizer": {"exp_avg_dtype": "bf16"}},
     r"^optimizer.exp_avg_dtype=bf16 needs the precision-aware optimizer: set optimizer.precision_aware true"),
    ({"optimizer": {"precision_aware": True}, "parallelism": {"zero": 0}},
     r"^optimizer.precision_aware is megatron-core's distributed optimizer .*it needs zero >= 1, not zero=0: set --zero 1$"),
    ({"optimizer": {"precision_aware": True}, "framework": "torchtitan", "parallelism": {"zero": 3}},
     r"framework torchtitan does not run it: set framework generic or precision_aware false$"),
])
def test_what_megatron_core_refuses_is_refused(over, message):
    d = scenario("bad-opt", **{k: v for k, v in over.items() if k != "parallelism"})
    if "parallelism" in over:
        d["parallelism"] = {**d["parallelism"], **over["parallelism"]}
    with pytest.raises(UserError, match=message):
        build_scenario(d)
