"""What-if at scale: slow GPUs, degraded links, jitter, failures; split symmetry against full mode."""

import json
from pathlib import Path
import re
import subprocess
import sys

import numpy as np
import pytest

from simulator.errors import UserError
from simulator.network.base import CollectiveRequest
from simulator.network.fabric import FlowNetwork
from simulator.scenario import build_scenario, load_scenario
from simulator.simulate import simulate
from simulator.vocabulary import CollectiveOp, Dim
from simulator.whatif.links import link_names, select_links
from simulator.whatif.split import refine_classes
from simulator.workload.plan import build_plan

SMALL_MODEL = {"name": "tiny", "num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 3584,
               "num_attention_heads": 8, "num_kv_heads": 8, "vocab_size": 32000}


def _scenario(pert=None, **kw):
    d = {
        "name": "wi", "model": SMALL_MODEL,
        "parallelism": kw.pop("parallelism", {"tp": 8, "pp": 2, "zero": 1}),
        "batch": kw.pop("batch", {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 2048}),
        "cluster": {"gpus": kw.pop("gpus", 256)},
    }
    d.update(kw)
    if pert is not None:
        d["perturbations"] = pert
    return build_scenario(d)


def test_slow_gpu_in_dp_only_job_adds_its_compute_share():
    # DP only, gradients reduced after backward (no overlap): the slow rank computes busy/0.8,
    # every rank waits for it at the DP all-reduce, then each runs its own optimizer step.
    par = {"tp": 1, "pp": 1, "zero": 0, "overlap_grad_reduce": False}
    batch = {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}
    clean = simulate(_scenario(None, parallelism=par, batch=batch, gpus=8))
    slow = simulate(_scenario({"gpus": [{"rank": 5, "speed": 0.8}]}, parallelism=par, batch=batch, gpus=8))
    busy = clean.timeline.busy_compute_s[0]
    expected = clean.timeline.step_time_s + busy * (1 / 0.8 - 1)
    assert slow.timeline.step_time_s == pytest.approx(expected, rel=1e-3)
    w = slow.report.whatif
    assert w["delta_s"] == pytest.approx(busy * 0.25, rel=1e-2)
    # Everyone else waits on rank 5 at the DP all-reduce, and the chain says so.
    first = [h for h in w["wait_chain"] if h["depth"] == 1]
    assert first and all(h["waited_on"] == 5 and h["dim"] == "dp" for h in first)
    assert sum(h["ranks"] for h in first) == 7
    # They wait for the slowed forward and backward (the optimizer step comes after the all-reduce).
    ev = clean.timeline.events
    fb = ev[(ev["rank"] == 0) & (ev["stream"] == "compute") & (ev["kind"] != "opt")]
    fb_s = float((fb["end_s"] - fb["start_s"]).sum())
    assert fb_s < busy
    assert first[0]["wait_s"] == pytest.approx(fb_s * 0.25, rel=1e-3)


def test_halved_nic_uplink_slows_its_dp_ring_2x_and_no_other():
    # 32 DGX H100 nodes; DP groups are rails (GPU j of every node, NIC j). Halving NIC 3 of
    # node 0 (both directions) halves ring 3's bottleneck and touches no other ring.
    # A ring (NCCL_ALGO=Ring) runs at the pace of its slowest link.
    ring = {"all_reduce": "ring"}
    net = FlowNetwork.from_topology("dgx-h100-fattree", 256, algorithms=ring)
    groups = np.arange(256).reshape(32, 8).T  # group j = GPU j of each node
    size = 1 << 30  # large enough that bandwidth, not latency, decides

    def t(net, g):
        return net.collective_time_s(CollectiveRequest(CollectiveOp.ALL_REDUCE, Dim.DP, g, size))

    before = [t(net, groups[j:j + 1]) for j in range(8)]
    ids = select_links(net.graph, "nic:3")
    assert sorted(link_names(net.graph)[ids]) == ["leaf0->nic3", "nic3->leaf0"]
    slow = FlowNetwork.from_topology("dgx-h100-fattree", 256, algorithms=ring)
    slow.capacity_Bps = slow.capacity_Bps.copy()
    slow.capacity_Bps[ids] *= 0.5
    after = [t(slow, groups[j:j + 1]) for j in range(8)]
    assert after[3] / before[3] == pytest.approx(2.0, rel=0.02)
    for j in set(range(8)) - {3}:
        assert after[j] == pytest.approx(before[j], rel=1e-12)
    # NCCL's tuner (the default) switches to the double binary tree, which the halved NIC
    # hurts less: slower than before, faster than the halved ring.
    tuned = FlowNetwork.from_topology("dgx-h100-fattree", 256)
    tuned.capacity_Bps = tuned.capacity_Bps * np.where(np.isin(np.arange(tuned.graph.n_links), ids), 0.5, 1.0)
    assert before[3] < t(tuned, groups[3:4]) < after[3]


def test_halved_nic_in_a_job_slows_only_that_rails_dp_collectives():
    par = {"tp": 8, "pp": 1, "zero": 1}
    batch = {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 2048}
    clean = simulate(_scenario(None, parallelism=par, batch=batch, gpus=256))
    slow = simulate(_scenario({"links": [{"name": "nic:3", "bandwidth": 0.5}]}, parallelism=par, batch=batch, gpus=256))

    def dp_time(res, rank):
        ev = res.timeline.events
        sel = ev[(ev["rank"] == rank) & (ev["kind"] == "dp")]
        return float((sel["end_s"] - sel["start_s"]).sum())

    # rank 3 (GPU 3 of node 0) stands for rail 3; rank 0 for an untouched rail.
    assert 3 in slow.timeline.ranks and 0 in slow.timeline.ranks
    assert dp_time(slow, 0) == pytest.approx(dp_time(clean, 0), rel=1e-9)
    assert dp_time(slow, 3) > 1.5 * dp_time(clean, 0)


def test_split_symmetry_agrees_with_full_mode_on_256_gpus():
    pert = {"gpus": [{"rank": 37, "speed": 0.8}], "links": [{"name": "nic:21", "bandwidth": 0.3}]}
    sc = _scenario(pert)
    split = simulate(sc, mode="reduced")
    full = simulate(sc, mode="full")
    assert split.report.whatif["simulated_ranks"] < 64  # not the world (256)
    assert split.timeline.step_time_s == pytest.approx(full.timeline.step_time_s, rel=1e-3)
    assert split.report.whatif["clean_step_time_s"] == pytest.approx(full.report.whatif["clean_step_time_s"], rel=1e-12)
    assert split.timeline.step_time_s > split.report.whatif["clean_step_time_s"]
    # Report means weigh each class by its size, so they are full mode's means over every rank.
    for d, v in full.report.exposed_comm_s.items():
        assert split.report.exposed_comm_s[d] == pytest.approx(v, rel=1e-3, abs=1e-9)
    assert split.report.bubble_fraction == pytest.approx(full.report.bubble_fraction, rel=1e-3)
    for k in ("bubble", "imbalance"):  # (measured per replica: the classes' replicas are full mode's)
        assert split.report.step_breakdown_s[k] == pytest.approx(full.report.step_breakdown_s[k], rel=1e-3, abs=1e-9)


def test_slow_gpu_shows_in_its_pp_rank_and_its_replica_alone_is_imbalanced():
    # tp2 pp4 dp2: rank 5 is pp rank 1 of replica 0. Halved, it makes pp rank 1 the slowest stage
    # (the clean run's is pp rank 3, with the head) in its own replica only; the other replica
    # waits for it at the DP reduction. Imbalance was measured against the slowest rank of the
    # world, so every rank's idle time became imbalance (bubble 3.17 -> 1.61 ms), the pp rank 1
    # row held one rank in eight, and the finding named pp rank 3.
    from simulator.report.analysis import BREAKDOWN_KEYS
    from simulator.report.findings import find

    par = {"tp": 2, "pp": 4, "zero": 1}
    batch = {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}
    res = simulate(_scenario({"gpus": [{"rank": 5, "speed": 0.5}]}, model={**SMALL_MODEL, "num_layers": 8},
                             parallelism=par, batch=batch, gpus=16))
    rep, clean = res.report, res.clean.report
    assert tuple(res.program.mesh.coords[5, :2]) == (1, 0)  # pp rank 1, replica 0
    row = rep.per_pp_rank[1]
    assert row["slowest"]["rank"] == 5 and row["slowest"]["ranks"] == 1
    clean_compute_s = clean.per_pp_rank[1]["compute_s"]
    assert row["slowest"]["compute_s"] == pytest.approx(clean_compute_s / 0.5, rel=0.02)
    assert row["compute_s"] < 1.5 * clean_compute_s  # the mean over the pp rank's four ranks
    bd = rep.step_breakdown_s
    assert sum(bd[k] for k in BREAKDOWN_KEYS) == pytest.approx(rep.step_time_s, rel=1e-12)
    assert abs(bd["unattributed"]) < 1e-12
    # A slower stage lengthens its replica's fill and drain: the bubble does not shrink.
    assert bd["bubble"] >= clean.step_breakdown_s["bubble"]
    imbalance = next(f for f in find(res, budget_s=0) if f.kind == "imbalance")
    assert imbalance.message.startswith("imbalance: pp rank 1 ") and "rank 5" in imbalance.message
    split = imbalance.suggestions[0].overrides["parallelism.pp_layer_split"]
    assert split[1] < 2  # layers move off the slow GPU's stage (2 layers a stage now)
    # The slow GPU's own share is named as the perturbation's, with the GPU as the first remedy.
    beyond = bd["imbalance"] - clean.step_breakdown_s["imbalance"]
    assert beyond > 0
    assert f"{beyond:.3f} s of it beyond the clean step" in imbalance.message
    assert re.search(r"runs its layers (1\.9\d|2\.0\d)x as long \(replacing or draining that GPU", imbalance.message)
    clean_imbalance = [f for f in find(res.clean, budget_s=0) if f.kind == "imbalance"]
    assert all("beyond the clean step" not in f.message for f in clean_imbalance)


def test_no_perturbation_classes_are_the_pipeline_ranks():
    sc = _scenario(None)
    res = simulate(sc)
    plan = build_plan(res.program)
    labels = refine_classes(plan, [plan.mesh.coords[:, 0]])
    assert len(np.unique(labels)) == 2
    assert (labels == plan.mesh.coords[:, 0]).all() or (labels == 1 - plan.mesh.coords[:, 0]).all()


def test_same_seed_same_distribution_byte_for_byte():
    pert = {"jitter": {"cv": 0.05, "seeds": 4, "seed": 7, "target": "both"}}
    par = {"tp": 8, "pp": 2, "zero": 1}
    batch = {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}
    a = simulate(_scenario(pert, parallelism=par, batch=batch, gpus=64)).report.whatif["distribution"]
    b = simulate(_scenario(pert, parallelism=par, batch=batch, gpus=64)).report.whatif["distribution"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert len(set(a["step_times_s"])) > 1  # the seeds differ from one another
    assert a["p50_s"] <= a["p90_s"] <= a["p99_s"] <= a["max_s"]
    # Forked workers give the same bytes as one process.
    from simulator.whatif.run import simulate_whatif

    forked = simulate_whatif(_scenario(pert, parallelism=par, batch=batch, gpus=64), workers=2).report.whatif["distribution"]
    assert json.dumps(forked, sort_keys=True) == json.dumps(a, sort_keys=True)
    pert2 = {"jitter": {"cv": 0.05, "seeds": 4, "seed": 8, "target": "both"}}
    c = simulate(_scenario(pert2, parallelism=par, batch=batch, gpus=64)).report.whatif["distribution"]
    assert c["step_times_s"] != a["step_times_s"]


def test_failures_give_goodput_and_cost_per_failure():
    pert = {"failures": {"nodes": [2], "mtbf_per_gpu_h": 50_000, "checkpoint_interval_s": 1800,
                         "checkpoint_cost_s": 60, "restart_cost_s": 600}}
    res = simulate(_scenario(pert))
    f = res.report.whatif["failures"]
    assert res.report.whatif["delta_s"] == 0.0  # failures do not change the step itself
    assert f["failures_per_day"] == pytest.approx(256 * 24 / 50_000)
    # one failure: the restart plus about half an interval of rework (Young's first order)
    assert 600 + 900 < f["cost_per_failure_s"] < 600 + 1860
    assert f["cost_per_failure_gpu_h"] == pytest.approx(f["cost_per_failure_s"] * 256 / 3600)
    assert f["cost_per_failure_steps"] == pytest.approx(f["cost_per_failure_s"] / res.timeline.step_time_s)
    spares = simulate(_scenario({"failures": {**pert["failures"], "policy": "spares", "spare_swap_s": 60}}))
    assert spares.report.whatif["failures"]["cost_per_failure_s"] < f["cost_per_failure_s"]


@pytest.mark.parametrize("pert,fragment", [
    ({"gpus": [{"rank": 9999, "speed": 0.8}]}, "rank 9999"),
    ({"gpus": [{"node": 99, "speed": 0.8}]}, "node 99"),
    ({"links": [{"name": "leaf99->spine0", "bandwidth": 0.5}]}, "leaf99->spine0"),
    ({"links": [{"name": "tier:bogus", "bandwidth": 0.5}]}, "tier"),
    ({"failures": {"nodes": [1000]}}, "node 1000"),
])
def test_bad_perturbations_are_one_line(pert, fragment):
    with pytest.raises(UserError) as exc:
        simulate(_scenario(pert))
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_bad_perturbation_values_rejected_by_schema():
    for pert in ({"gpus": [{"rank": 1, "speed": 0}]}, {"gpus": [{"rank": 1, "node": 0, "speed": 0.5}]},
                 {"jitter": {"cv": float("nan")}}, {"links": [{"name": "x", "bandwidth": 0.5, "extra": 1}]}):
        with pytest.raises(UserError):
            _scenario(pert)


def test_cli_flags_and_errors(tmp_path):
    base = [sys.executable, "-m", "simulator.cli", "simulate", "--model", "llama3-8b", "--tp", "8", "--pp", "2",
            "--gpus", "64", "--global-batch-size", "16", "--seq-length", "1024", "--no-dashboard"]
    out = subprocess.run(base + ["--slow-gpu", "3=0.8", "--slow-link", "uplink:0=0.5", "--fail-node", "1", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    w = json.loads(out.stdout)["whatif"]
    assert w["delta_s"] > 0 and w["failures"]["failed_nodes"] == [1]
    for bad in (["--slow-gpu", "3=fast"], ["--slow-gpu", "3"], ["--slow-link", "nope=0.5"], ["--seeds", "5"],
                ["--slow-gpu", "3=0"], ["--slow-gpu", "3=0.8", "--slow-gpu", "3=0.5"],
                ["--slow-link", "nic:1=0.5", "--slow-link", "nic:1=0.7"]):
        r = subprocess.run(base + bad, capture_output=True, text=True, timeout=600)
        assert r.returncode == 2, (bad, r.stderr)
        assert r.stderr.startswith("error:") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_compare_shows_perturbed_against_clean(tmp_path):
    import yaml

    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump({
        "name": "slow", "model": SMALL_MODEL, "parallelism": {"tp": 8, "pp": 2},
        "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}, "cluster": {"gpus": 32},
        "perturbations": {"gpus": [{"rank": 9, "speed": 0.5}]},
    }))
    out = tmp_path / "cmp.html"
    r = subprocess.run([sys.executable, "-m", "simulator.cli", "compare", str(path), "-o", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert "slow (clean)" in html and "who waits on whom" in html and "step time" in html
    assert "exposed tp comm" in html


def test_dashboard_of_a_perturbed_run_names_the_wait_chain():
    from simulator.report.dashboard import build_dashboard_html

    res = simulate(_scenario({"gpus": [{"rank": 9, "speed": 0.5}]}, batch={"micro_batch_size": 1, "global_batch_size": 16,
                                                                          "seq_length": 1024}, gpus=32))
    html = build_dashboard_html(res, cdn=True)
    assert "who waits on whom" in html and "rank 9" in html


MOE_MODEL = {**SMALL_MODEL, "name": "tinymoe", "num_experts": 8, "top_k": 2}


@pytest.mark.parametrize("model,par,gpus,seq,schedule", [
    (MOE_MODEL, {"tp": 2, "pp": 2, "ep": 4, "zero": 1}, 64, 1024, "1f1b"),
    (MOE_MODEL, {"tp": 2, "pp": 2, "ep": 8, "zero": 1}, 16, 1024, "1f1b"),  # ep folded over tp x dp
    (SMALL_MODEL, {"tp": 2, "pp": 2, "cp": 2, "cp_attention": "ring", "zero": 1}, 64, 2048, "1f1b"),
    (SMALL_MODEL, {"tp": 1, "pp": 1, "zero": 3, "fsdp_shard_size": 8}, 32, 1024, "1f1b"),
    (SMALL_MODEL, {"tp": 4, "pp": 2, "vpp": 2, "zero": 1}, 64, 1024, "interleaved-1f1b"),
])
def test_split_equals_full_across_parallelisms(model, par, gpus, seq, schedule):
    # Experts (ep, edp), ring attention (ring steps), HSDP (dp_shard/dp_rep) and interleaving.
    pert = {"gpus": [{"rank": 13, "speed": 0.7}], "links": [{"name": "nic:9", "bandwidth": 0.3}],
            "gpu_draw": {"cv": 0.03, "seed": 1, "levels": 2}}
    sc = _scenario(pert, model=model, parallelism=par, gpus=gpus, schedule=schedule,
                   batch={"micro_batch_size": 1, "global_batch_size": 32, "seq_length": seq})
    split, full = simulate(sc, mode="reduced"), simulate(sc, mode="full")
    assert split.timeline.step_time_s == pytest.approx(full.timeline.step_time_s, rel=1e-9)
    for k in ("bubble", "imbalance"):
        assert split.report.step_breakdown_s[k] == pytest.approx(full.report.step_breakdown_s[k], rel=1e-6, abs=1e-12)
    assert split.report.whatif["delta_s"] > 0


def test_jitter_by_tp_group_matches_per_rank_draws_of_full_mode():
    # Full mode draws every rank's kernels and every group's collectives; split mode draws one
    # max-of-k per TP group segment and the max over groups issuing together. Means over seeds agree.
    pert = {"jitter": {"cv": 0.05, "seeds": 8, "target": "both"}}
    batch = {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}
    sc = _scenario(pert, parallelism={"tp": 4, "pp": 2}, batch=batch, gpus=32)
    split = simulate(sc, mode="reduced").report.whatif
    full = simulate(sc, mode="full").report.whatif
    assert split["simulated_ranks"] == 8 and full["simulated_ranks"] == 32
    assert split["distribution"]["mean_s"] == pytest.approx(full["distribution"]["mean_s"], rel=5e-3)
    # and noise costs time: E[max of draws] > 1
    assert split["distribution"]["mean_s"] > 1.01 * split["clean_step_time_s"]


def test_example_scenario_file_loads_and_runs():
    from pathlib import Path

    from simulator.scenario import load_scenario

    sc = load_scenario(Path(__file__).parent / "data" / "scenarios" / "whatif-small.yaml")
    w = simulate(sc).report.whatif
    assert w["delta_s"] > 0 and w["distribution"]["seeds"] == 3 and w["failures"]["failed_nodes"] == [1]


def test_few_seeds_say_their_percentiles_are_interpolated():
    from simulator.whatif.summary import whatif_lines

    def lines(n):
        return whatif_lines({"clean_step_time_s": 1.0, "step_time_s": 1.0, "delta_s": 0.0, "delta_fraction": 0.0,
                             "distribution": {"seeds": n, "p50_s": 1.0, "p90_s": 1.1, "p99_s": 1.2, "mean_s": 1.0}})

    assert any("P90 and P99 are interpolated between 5 draws" in l for l in lines(5))
    assert any("P99 is interpolated between 20 draws" in l for l in lines(20))
    assert not any("interpolated" in l for l in lines(100))


def test_a_long_distribution_says_so_after_its_first_seed():
    import warnings

    from simulator.whatif.perturbations import Jitter
    from simulator.whatif.run import LongRunWarning, _warn_if_long

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_if_long(90.0, 100, Jitter(cv=0.05, seeds=100), dp=16)
        _warn_if_long(0.5, 100, Jitter(cv=0.05, seeds=100), dp=16)  # 50 s in all: nothing to say
    (w,) = [c for c in caught if issubclass(c.category, LongRunWarning)]
    assert "other 99 take about 148 min" in str(w.message) and "about 16x cheaper" in str(w.message)


def test_wait_chain_counts_waits_beyond_the_clean_step():
    """A perturbation that barely moves the step names waits of about that size, not the clean
    step's own: a pipeline's drain before its step-end pp all-reduce (the last stage waits for
    the first) is in the clean step too, and the chain subtracts it. The clean run's rendezvous
    waits were not logged, so the whole drain (tenths of the step here) was reported."""
    par = {"tp": 8, "pp": 4, "zero": 1}
    batch = {"micro_batch_size": 1, "global_batch_size": 64, "seq_length": 2048}
    res = simulate(_scenario({"links": [{"name": "uplink:0", "bandwidth": 0.5}]}, parallelism=par, batch=batch, gpus=256))
    w = res.report.whatif
    step = w["clean_step_time_s"]
    assert 0 < w["delta_s"] < 3e-3 * step
    assert w["wait_chain"], "the perturbed run logs waits"
    # (before: 0.9-1.5 ms a hop, 7-13% of the step, the drain on pp rank 0)
    assert max(h["wait_s"] for h in w["wait_chain"]) <= 2 * w["delta_s"]


def test_dp_finding_of_a_slow_gpu_names_the_wait_not_buckets():
    # Replicas waiting at the gradient all-reduce for a slowed one showed as exposed dp, and the
    # finding suggested halving or doubling the gradient buckets, which cannot shorten that wait.
    from simulator.report.findings import find

    par = {"tp": 1, "pp": 1, "zero": 1, "overlap_grad_reduce": True}
    batch = {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 1024}
    slow = simulate(_scenario({"gpus": [{"rank": 5, "speed": 0.5}]}, parallelism=par, batch=batch, gpus=8))
    w = slow.report.whatif
    extra = slow.report.exposed_comm_s["dp"] - w["clean_exposed_comm_s"]["dp"]
    assert extra > 0.5 * slow.report.exposed_comm_s["dp"]
    dp = [f for f in find(slow, budget_s=0) if f.kind == "exposed-dp"]
    assert len(dp) == 1 and dp[0].suggestions == []
    assert f"{extra:.3f} s of it beyond the clean step" in dp[0].message
    assert "grad_bucket_params" not in dp[0].message


def test_imbalance_split_shaped_around_a_slow_gpu_elsewhere_says_so():
    # The LM head's stage is the slowest; a GPU of pp rank 1 is slowed. The proposed split moves a
    # layer off pp rank 1 too, which would be wrong once that GPU is replaced: the finding says so.
    from simulator.report.findings import find

    sc = load_scenario(Path(__file__).parent / "data" / "scenarios" / "small-llama.yaml",
                       {"perturbations": {"gpus": [{"rank": 21, "speed": 0.8}]}})
    res = simulate(sc)
    assert tuple(res.program.mesh.coords[21, :2])[0] == 1  # pp rank 1
    (imb,) = [f for f in find(res, budget_s=0) if f.kind == "imbalance"]
    assert imb.message.startswith("imbalance: pp rank 3 ")
    assert "(the what-if slows a GPU of pp rank 1: a split below also works around it" in imb.message
    clean = [f for f in find(res.clean, budget_s=0) if f.kind == "imbalance"]
    assert clean and all("what-if" not in f.message for f in clean)


@pytest.mark.parametrize("pert,match", [
    ({"gpus": [{"rank": 1, "speed": 0.5}, {"rank": 1, "speed": 0.9}]}, r"gpus names rank 1 twice: give one speed"),
    ({"gpus": [{"node": 0, "speed": 0.5}, {"node": 0, "speed": 0.5}]}, r"gpus names node 0 twice"),
    ({"links": [{"name": "nic:0", "bandwidth": 0.5}, {"name": "nic:0", "bandwidth": 0.2}]},
     r"links names 'nic:0' twice: give one bandwidth"),
])
def test_a_scenario_names_each_perturbed_gpu_or_link_once(pert, match):
    # A YAML with two entries for rank 1 (0.5 then 0.9) simulated 0.9 alone while the report
    # listed both; the --slow-gpu / --slow-link flags already refused it.
    d = {"name": "t", "model": "llama3-8b", "parallelism": {"tp": 1, "pp": 2},
         "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 1024},
         "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "perturbations": pert}
    with pytest.raises(UserError, match=match):
        build_scenario(d)
    # one entry each is fine
    one = {k: v[:1] for k, v in pert.items()}
    assert build_scenario({**d, "perturbations": one}).perturbations is not None
