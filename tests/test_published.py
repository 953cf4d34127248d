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
        if int(row["num_gpus"]) > 8 and "Gb/s" not in row["notes"]:
            # validation/README.md names the GPU only: a multi-node run's fabric is not stated.
            assert any("inter-node fabric not stated" in m for m in missing)
        if not row["torch_compile"].strip():
            assert "torch.compile not stated" in missing
    # Read literally, only Table 2's one-node rows (FSDP x CP on 8 GPUs, sequence stated) and the
    # Trainy H200 rows (config file and 400 Gb/s stated) state everything the time depends on; the
    # A100 rows leave out the fabric between their 8 nodes and whether torch.compile was on.
    assert stated == 6


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
    # Each row is grouped by its layout and by whether the modelled step waits on kernel launches.
    table = read_table("vtrain-single-node")[:5]
    for r, row in zip(v.rows, table):
        assert {f"tp{row['tensor parallelism']}", f"pp{row['pipeline parallelism']}", f"mb{row['micro batch']}"} <= set(r.features)
        assert len({"host-bound", "device-bound"} & set(r.features)) == 1
    groups = v.feature_groups()
    assert sum(groups.get(k, {"rows": 0})["rows"] for k in ("host-bound", "device-bound")) == 5


def _subset(name: str, rows) -> "object":
    from simulator.calibrate.published import PublishedValidation, _megatron_rows, _vtrain_rows

    def run(label, data):
        return simulate(build_scenario(data)).report

    build = _megatron_rows if name == "megatron-2021" else _vtrain_rows
    return PublishedValidation(name, build(rows, run))


def test_megatron_2021_small_rows_pinned():
    # The five runs with pp <= 2 (1.7B-39B; the whole table takes minutes: bench/
    # bench_validate_published.py, whose figures are in docs/design-notes.md). Measured
    # 2026-11-29: MAPE 0.6%, mean signed -0.3%, worst 1.5% (0.9% / -0.4% / 2.3% before Megatron's
    # cross-entropy bytes, its gradient buffer reduced in one piece and classic attention's layout
    # copies, round 21; 1.7% / +0.5% before the measured 7 us
    # launch floor, contention only while a collective runs, and the A100 NCCL fit on the Azure
    # NDv4 logs). A change that moves them must say why.
    v = _subset("megatron-2021", read_table("megatron-2021")[:5])
    assert v.mape == pytest.approx(0.006, abs=0.005)
    assert v.mean_signed_error == pytest.approx(-0.003, abs=0.005)
    assert max(abs(r.error) for r in v.rows) < 0.03


def test_vtrain_every_24th_row_pinned():
    # 60 of the 1,440 layouts (every 24th). Measured 2026-11-29: MAPE 8.0%, mean signed +4.1%
    # (+2.7% before classic attention's layout copies, +2.0% before Megatron's cross-entropy moved
    # the bytes its code moves, 38 + 14 a logit;
    # -0.4% before the measured 7 us launch floor, contention only while a collective runs and
    # the A100 NCCL fit on the Azure NDv4 logs;
    # the full set's figures are in the bench and docs/design-notes.md). A change that moves
    # them must say why.
    v = _subset("vtrain-single-node", read_table("vtrain-single-node")[::24])
    assert len(v.rows) == 60
    assert v.mape == pytest.approx(0.080, abs=0.005)
    assert v.mean_signed_error == pytest.approx(0.041, abs=0.005)


def test_group_errors_groups_stated_rows_by_layout():
    from simulator.calibrate.published import PublishedRow, PublishedValidation, group_errors

    rows = [PublishedRow("h1024 L4 tp1 dp2 pp1 mb1 gb4", 2, 1.0, 0.9), PublishedRow("h1024 L4 tp2 dp1 pp1 mb1 gb4", 2, 1.0, 1.2),
            PublishedRow("h1024 L4 tp2 dp1 pp1 mb2 gb4", 2, 1.0, 1.0),
            PublishedRow("h1024 L4 tp8 dp1 pp1 mb1 gb4", 8, 1.0, 5.0, stated=False, reason="x")]
    g = group_errors(PublishedValidation("t", rows), "tp")
    assert set(g) == {1, 2}  # the unstated tp8 row is left out
    assert g[1] == (1, pytest.approx(-0.1), pytest.approx(0.1))
    assert g[2] == (2, pytest.approx(0.1), pytest.approx(0.1))
    m = group_errors(PublishedValidation("m", [PublishedRow("76.1B tp8 pp4 dp32", 1024, 16.0, 15.2)]), "B")
    assert list(m) == [76.1]
def test_group_errors_by_pair_separates_opposite_trends():
    from simulator.calibrate.published import PublishedRow, PublishedValidation, group_errors_by_pair

    rows = [PublishedRow("h1024 L4 tp2 dp1 pp1 mb1 gb4", 2, 1.0, 0.9), PublishedRow("h1024 L4 tp2 dp1 pp1 mb4 gb4", 2, 1.0, 1.1),
            PublishedRow("h1024 L4 tp4 dp1 pp1 mb1 gb4", 4, 1.0, 1.1), PublishedRow("h1024 L4 tp4 dp1 pp1 mb4 gb4", 4, 1.0, 0.9),
            PublishedRow("h1024 L4 tp8 dp1 pp1 mb1 gb4", 8, 1.0, 5.0, stated=False, reason="x")]
    v = PublishedValidation("t", rows)
    g = group_errors_by_pair(v, "tp", "mb")
    assert set(g) == {(2, 1), (2, 4), (4, 1), (4, 4)}  # the unstated tp8 row is left out
    assert g[(2, 1)] == (1, pytest.approx(-0.1), pytest.approx(0.1))
    assert g[(4, 1)] == (1, pytest.approx(0.1), pytest.approx(0.1))
    # Grouped by mb alone the two trends cancel: what the pair is for.
    from simulator.calibrate.published import group_errors
    assert group_errors(v, "mb")[1][1] == pytest.approx(0.0)


def test_torchtitan_stated_rows_error_as_measured():
    # Issue 15 targets MAPE <= 10% and |mean signed| <= 3%; what the model reaches, pinned so a
    # change shows (see the bench's per-feature table and docs/design-notes.md for the causes).
    # The H100 rows run on Meta's 96 GB HBM2e variant (2.4 TB/s, torchao's figure; 28.0% on the
    # 3.35 TB/s SXM profile); its 500 W limit has no sourced clock and is not modelled.
    v = validate_published("torchtitan-2024", stated_only=True)
    assert len(v.rows) == 6 and all(r.stated for r in v.rows)
    assert {r.predicted_step_time_s > 0 for r in v.rows} == {True}
    assert [r.note.startswith("H100 96GB HBM2e") for r in v.rows].count(True) == 4  # Table 2's rows
    # 0.258 until round 28 measured FP8 GEMMs on an H200 at 0.931 of BF16's fraction of peak (Hopper
    # gemm_efficiency.fp8 0.67): every stated row is Float8; the H200 rows -15.0 / -16.3% -> -12.2 / -13.5%.
    # 0.245 until round 29 fitted FlashAttention-2's kernels on the same H200 (matmuls, softmax
    # scores and a per-CTA cost; the backward was 13% fast at 8k tokens, head dim 128).
    assert v.mape == pytest.approx(0.218, abs=0.015)
    assert v.mean_signed_error == pytest.approx(-0.218, abs=0.015)
    groups = v.feature_groups()
    assert groups["cp"]["stated_rows"] == 3 and groups["h200"]["stated_rows"] == 2
    # Peak memory: every stated row publishes it; compared with the memory model's peak, pinned so
    # a change shows. Table 2's rows hold 32K tokens a rank at every CP degree (FSDP shards over
    # dp x cp); published ~84 GiB each. CP 1 predicts 77.7 GiB (7% under: the eager loss's
    # backward, loss_working_set_gib, beside the layer full recomputation re-materialises); CP
    # 2 / 4 / 8 add torch's CP attention backward buffers (cp_attention_working_set_gib: the
    # gathered K/V grows with cp) and come to -0.9 / +0.5 / +2.3%. The H200 rows (2025, compiled
    # loss) 1-3% under. torchtitan reports the caching allocator's reserved bytes, we model
    # allocated ones.
    assert len(v.memory_rows) == 6
    h200 = [r for r in v.rows if "h200" in r.features]
    assert [r.published_memory_gib for r in h200] == [47.96, 46.97]
    assert all(r.memory_error == pytest.approx(r.predicted_memory_gib / r.published_memory_gib - 1) for r in v.rows)
    # (0.131 before FSDP's gathered working set was counted, the root module's embedding and head
    # and the unit computing with the one prefetched beside the shard: 0.096; then the layer full
    # recomputation re-materialises in backward: 0.062; then torch's CP attention buffers: 0.026,
    # signed -0.017)
    assert v.memory_mape == pytest.approx(0.026, abs=0.01)
    assert v.memory_mean_signed_error == pytest.approx(-0.017, abs=0.01)
    j = v.to_json()
    assert j["memory_rows"] == 6 and j["rows"][0]["published_memory_gib"] is not None


def test_fa2_attention_kernel_is_slower_on_hopper_only():
    from simulator.profile import load_profile
    from simulator.workload.ops import build_layer_ops, op_durations_s

    base = {"name": "a", "model": "llama3-8b", "parallelism": {"dp": 8, "zero": 3},
            "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 8192}}
    for gpu, ratio in (("h100-sxm-80gb", 0.55 / 0.34), ("a100-sxm-80gb", 1.0), ("h200-sxm-141gb", 0.55 / 0.34)):
        times = {}
        for kernel in ("default", "fa2"):
            sc = build_scenario({**base, "attention_kernel": kernel,
                                 "cluster": {"gpus": 8, "gpu": gpu, "topology": "dgx-h100-fattree"}})
            ops = [o for o in build_layer_ops(sc)["dense"].forward if o.op_class == "attention"]
            times[kernel] = float(op_durations_s(load_profile(gpu), ops, sc).sum())
        # FA2 reaches 0.34 of Hopper's peak (Dao 2023) against 0.55 for the default kernel;
        # A100's attention figures are FA2's already (the launch floor is shared).
        assert times["fa2"] / times["default"] == pytest.approx(ratio, rel=0.01), gpu


def test_torchtitan_pipelines_split_the_local_batch_into_one_microbatch_a_stage():
    # torchtitan of Dec 2024 defaulted n_microbatches to the number of pipeline stages; the
    # 405B rows state neither it nor the virtual stages. Was one sequence a microbatch (32 for
    # the 1F1B row: bubble 7/39 of the step where the default's is 7/15).
    from simulator.calibrate.published import read_table, torchtitan_scenario

    rows = {r["table"]: r for r in read_table("torchtitan-2024")}
    one_f, missing, _ = torchtitan_scenario(rows["Table 5 (1F1B)"])
    inter, _, _ = torchtitan_scenario(rows["Table 5 (Interleaved 1F1B)"])
    assert int(rows["Table 5 (1F1B)"]["local_batch_size"]) == 32
    assert one_f["batch"]["micro_batch_size"] == 4 and one_f["parallelism"]["pp"] == 8  # 8 stages
    assert inter["batch"]["micro_batch_size"] == 2 and inter["parallelism"]["vpp"] == 2  # 16 stages
    assert any("microbatch count" in m for m in missing)  # still a row whose setup is not stated
