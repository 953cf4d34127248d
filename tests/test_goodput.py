"""Goodput under failures: Daly's exact renewal model against limits that can be worked by hand."""

import math

import pytest

from simulator.errors import UserError
from simulator.whatif.goodput import FailurePolicy, expected_segment_time_s, goodput, optimal_checkpoint_interval_s


def test_no_failures_leaves_only_checkpoint_cost():
    # An MTBF of 10^12 hours per GPU: the job essentially never fails.
    g = goodput(8, FailurePolicy(mtbf_per_gpu_h=1e12, checkpoint_interval_s=1800, checkpoint_cost_s=60, restart_cost_s=600))
    assert g.goodput == pytest.approx(1800 / 1860, rel=1e-6)
    assert g.lost_to_failures == pytest.approx(0.0, abs=1e-6)


def test_first_order_waste_matches_young():
    # For lambda*(tau+delta) << 1, waste ~ delta/tau + lambda*(restart + tau/2) (Young 1974).
    gpus, mtbf_h, tau, delta, restart = 16384, 50_000.0, 1200.0, 30.0, 300.0
    g = goodput(gpus, FailurePolicy(mtbf_h, tau, delta, restart))
    rate = gpus / (mtbf_h * 3600)
    first_order = delta / tau + rate * (restart + (tau + delta) / 2)
    assert 1 - g.goodput == pytest.approx(first_order, rel=0.1)


def test_more_gpus_lose_more_and_failures_per_day_scale():
    small = goodput(1024, FailurePolicy(50_000.0, 1800, 60, 600))
    large = goodput(16384, FailurePolicy(50_000.0, 1800, 60, 600))
    assert large.goodput < small.goodput
    assert large.failures_per_day == pytest.approx(16 * small.failures_per_day)


def test_optimal_interval_minimises_segment_waste():
    rate, delta, restart = 1 / 3600.0, 60.0, 300.0
    best = optimal_checkpoint_interval_s(delta, rate)

    def waste(tau):
        return expected_segment_time_s(tau, delta, restart, rate) / tau

    assert waste(best) <= waste(best * 0.7) and waste(best) <= waste(best * 1.4)
    assert best == pytest.approx(math.sqrt(2 * delta * 3600), rel=0.2)  # Young's first-order value


@pytest.mark.parametrize("field, value", [("mtbf_per_gpu_h", 0), ("checkpoint_interval_s", float("nan")),
                                          ("restart_cost_s", -1)])
def test_bad_policy_is_one_line(field, value):
    kwargs = dict(mtbf_per_gpu_h=1000.0, checkpoint_interval_s=600.0, checkpoint_cost_s=10.0, restart_cost_s=60.0)
    kwargs[field] = value
    with pytest.raises(UserError, match=field):
        goodput(8, FailurePolicy(**kwargs))
