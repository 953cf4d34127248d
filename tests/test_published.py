"""The published development set: a few Megatron-LM SC'21 rows simulate close to the paper."""

import pytest

from simulator.calibrate.published import PUBLISHED, VALIDATION_DIR, megatron_2021_scenario
from simulator.scenario import build_scenario
from simulator.simulate import simulate


def test_small_megatron_2021_rows_within_15_percent():
    import csv

    rows = list(csv.DictReader((VALIDATION_DIR / PUBLISHED["megatron-2021"]).open()))
    assert len(rows) == 10
    # The three smallest runs (TP1-8, no pipeline): fast to simulate; the full table is in
    # bench/bench_validate_published.py and the closing notes.
    for row in rows[:3]:
        rep = simulate(build_scenario(megatron_2021_scenario(row))).report
        published = float(row["step_time_s"])
        assert rep.step_time_s == pytest.approx(published, rel=0.15), row["params_billion"]
