"""The published development sets: rows simulate as their sources describe them; a few Megatron
rows land close to the paper; every torchtitan row builds, with unstated setups marked and
explained; vTrain rows on one node give the same time on the alpha-beta network as on the flow
fabric (so the 1,440 rows may use it)."""

import csv

import pytest

from simulator.calibrate.published import (
    PUBLISHED,
    VALIDATION_DIR,
    megatron_2021_scenario,
    read_table,
    torchtitan_scenario,
    validate_published,
    vtrain_scenario,
)
from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate


def test_small_megatron_2021_rows_within_15_percent():
    rows = list(csv.DictReader((VALIDATION_DIR / PUBLISHED["megatron-2021"]).open()))
    assert len(rows) == 10
    # The three smallest runs (TP1-8, no pipeline): fast to simulate; the full table is in
    # bench/bench_validate_published.py and the closing notes.
    for row in rows[:3]:
        rep = simulate(build_scenario(megatron_2021_scenario(row))).report
        published = float(row["step_time_s"])
        assert rep.step_time_s == pytest.approx(published, rel=0.15), row["params_billion"]


def test_torchtitan_rows_build_and_unstated_setups_are_marked():
    table = read_table("torchtitan-2024")
    assert len(table) == 43
    stated = 0
    for row in table:
        data, missing, notes = torchtitan_scenario(row)
        sc = build_scenario(data)  # every row is a valid scenario
        assert sc.cluster.gpus == int(row["num_gpus"])
        if not row["seq_length"].strip():
            assert any("sequence length" in m for m in missing)
        if row["precision"].startswith("fp8"):
            assert sc.dtype == "fp8"
        stated += not missing
    # Table 2 (CP), the Trainy H200 rows and most A100 rows state their setup.
    assert 8 <= stated <= 20


def test_torchtitan_h200_row_simulates_as_stated():
    row = [r for r in read_table("torchtitan-2024") if r["gpu"].startswith("H200")][0]
    data, missing, _ = torchtitan_scenario(row)
    assert not missing and data["cluster"]["gpu"] == "h200-sxm-141gb" and data["fp8"]["param_all_gather"]
    rep = simulate(build_scenario(data)).report
    tokens_per_gpu = data["batch"]["global_batch_size"] * data["batch"]["seq_length"] / data["cluster"]["gpus"]
    predicted_tps = tokens_per_gpu / rep.step_time_s
    # A sanity bound only: the per-row error is reported by the bench (see its closing notes).
    assert 0.5 < predicted_tps / float(row["measured_value"]) < 2.0


def test_vtrain_alpha_beta_equals_flow_on_one_node():
    table = read_table("vtrain-single-node")
    assert len(table) == 1440
    for row in table[:6]:
        data = vtrain_scenario(row)
        ab = simulate(build_scenario(data)).report.step_time_s
        data["network"] = "flow"
        flow = simulate(build_scenario(data)).report.step_time_s
        assert ab == pytest.approx(flow, rel=1e-3)


def test_validate_published_reports_mape_and_signed_error():
    v = validate_published("vtrain-single-node", limit=5)
    assert len(v.rows) == 5 and len(v.stated_rows) == 5
    assert v.mape == pytest.approx(sum(abs(r.error) for r in v.rows) / 5)
    assert v.mean_signed_error == pytest.approx(sum(r.error for r in v.rows) / 5)
    js = v.to_json()
    assert js["stated_rows"] == 5 and len(js["rows"]) == 5
    with pytest.raises(UserError, match="unknown published set"):
        validate_published("nope")
