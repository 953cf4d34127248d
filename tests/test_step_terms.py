"""What a step pays besides forward and backward: tied-embedding gradient all-reduce between the
first and last stage, gradient-norm clipping, the per-microbatch loss all-reduce, and pipeline
positions holding only the embedding or only the LM head."""

import pytest

from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.workload.program import split_layers


def _gpt(pp=2, vpp=1, layers=8, **par):
    return {
        "model": {"name": "gpt-small", "num_layers": layers, "hidden_size": 1024, "ffn_hidden_size": 4096,
                  "num_attention_heads": 16, "vocab_size": 51200, "mlp": "gelu", "tied_embeddings": True,
                  "learned_position_embeddings": True},
        "parallelism": {"tp": 1, "pp": pp, "vpp": vpp, "zero": 0, **par},
        "batch": {"micro_batch_size": 1, "global_batch_size": 2 * pp * 2, "seq_length": 1024},
        "schedule": "interleaved-1f1b" if vpp > 1 else "1f1b",
        "cluster": {"gpus": 2 * pp, "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"},
    }


def test_tied_embedding_allreduce_between_first_and_last_stage():
    res = simulate(build_scenario(_gpt()))
    emb = [c for c in res.program.step_collectives if c.dim == "emb"]
    assert len(emb) == 1 and emb[0].size_bytes == pytest.approx(51200 * 1024 * 4)
    rows = res.timeline.df if hasattr(res.timeline, "df") else None
    # Untied: no such all-reduce; tied is slower by about the all-reduce of 210 MB over NVLink.
    untied = _gpt()
    untied["model"]["tied_embeddings"] = False
    res_u = simulate(build_scenario(untied))
    assert not [c for c in res_u.program.step_collectives if c.dim == "emb"]
    assert res.report.step_time_s > res_u.report.step_time_s
    # pp=1: the tied matrix lives on one rank, nothing to all-reduce.
    assert not [c for c in simulate(build_scenario(_gpt(pp=1))).program.step_collectives if c.dim == "emb"]


def test_grad_clip_norm_costs_time_and_can_be_turned_off():
    on = simulate(build_scenario(_gpt()))
    off = simulate(build_scenario(_gpt(grad_clip=False)))
    norm = [c for c in on.program.step_collectives if c.label == "grad norm"]
    assert norm and norm[0].compute_s > 0
    assert not [c for c in off.program.step_collectives if c.label == "grad norm"]
    assert on.report.step_time_s > off.report.step_time_s


def test_loss_all_reduce_per_microbatch_on_the_last_stage():
    on = simulate(build_scenario(_gpt(loss_all_reduce_per_microbatch=True)))
    off = simulate(build_scenario(_gpt()))
    assert on.report.step_time_s > off.report.step_time_s


def test_embedding_and_head_only_positions():
    # The zero-bubble paper's interleaved layout: 22 layers on pp*vpp = 24 positions.
    data = _gpt(pp=4, vpp=6, layers=22)
    with pytest.raises(UserError, match="account_for_embedding_in_pipeline_split"):
        build_scenario(data)
    data["parallelism"].update(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    data["batch"]["global_batch_size"] = 2 * 4 * 2
    res = simulate(build_scenario(data))
    counts = [len(x) for x in res.program.position_layers]
    assert counts[0] == 0 and counts[-1] == 0 and sum(counts) == 22
    assert res.report.step_time_s > 0
    # Megatron's rule: the embedding and loss take one layer's place on the first/last stage.
    assert [len(x) for x in split_layers(30, 8, None, True, True)] == [3, 4, 4, 4, 4, 4, 4, 3]
    c = [len(x) for x in split_layers(32, 8, None, True, False)]
    assert sum(c) == 32 and c[0] == 3 and max(c) == 5


def test_torchtitan_recompute_policies_sit_between_selective_and_full():
    def run(rec):
        data = _gpt(pp=1)
        data["recompute"] = rec
        res = simulate(build_scenario(data))
        return res.report.step_time_s, res.memory.per_rank_gib[0]["activations_gib"]

    t = {rec: run(rec) for rec in ("none", "selective", "selective-op", "selective-layer", "full")}
    # Per-op SAC recomputes every second matmul and the cheap ops: dearer than Megatron's selective.
    assert t["selective"][0] < t["selective-op"][0] < t["full"][0]
    # Every second layer recomputed whole: between none and full in time and memory.
    assert t["none"][0] < t["selective-layer"][0] < t["full"][0]
    assert t["full"][1] < t["selective-layer"][1] < t["none"][1]


def test_sweep_estimate_accepts_embedding_only_positions():
    from simulator.sweep.estimate import _segment_sum

    import numpy as np

    assert _segment_sum(np.arange(5.0), np.array([0, 2, 3, 0])).tolist() == [0.0, 1.0, 9.0, 0.0]
    from simulator.sweep.estimate import Estimator

    data = _gpt(pp=4, vpp=6, layers=22)
    data["parallelism"].update(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    data["batch"]["global_batch_size"] = 2 * 4 * 2
    sc = build_scenario(data)
    est = Estimator().estimate(sc)
    sim = simulate(sc).report.step_time_s
    assert est.step_time_s == pytest.approx(sim, rel=0.3)


def test_fp16_pays_unscale_and_inf_check():
    data = _gpt()
    data["dtype"] = "fp16"
    labels = [c.label for c in simulate(build_scenario(data)).program.step_collectives]
    assert "fp16 unscale + inf check" in labels
    assert "fp16 unscale + inf check" not in [c.label for c in simulate(build_scenario(_gpt())).program.step_collectives]


def test_torchtitan_clip_multiplies_every_gradient():
    # torch.nn.utils.clip_grads_with_norm_ (torchtitan's clip_grad_norm_) runs _foreach_mul_ on
    # every gradient by the clamped coefficient, clipping or not: read and write 4 bytes a
    # parameter of the fp32 shard, beside the norm's read of 4.
    base = {"model": "llama3-8b", "parallelism": {"dp": 8, "zero": 3},
            "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 2048},
            "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    tt = simulate(build_scenario({**base, "framework": "torchtitan"})).program.step_collectives
    clip = [c for c in tt if c.label == "grad clip"]
    norm = [c for c in tt if c.label == "grad norm"]
    assert len(clip) == 1 and clip[0].size_bytes == 0.0
    assert clip[0].compute_s == pytest.approx(2 * norm[0].compute_s, rel=0.05)
    assert not [c for c in simulate(build_scenario(base)).program.step_collectives if c.label == "grad clip"]
    off = simulate(build_scenario({**base, "framework": "torchtitan", "parallelism": {"dp": 8, "zero": 3, "grad_clip": False}}))
    assert not [c for c in off.program.step_collectives if c.label.startswith("grad")]


def test_torchtitan_fused_adamw_moves_28_bytes_a_parameter():
    # torchtitan 0.1.0's optimizer implementation "fused" (torch _fused_adamw_) over FSDP2's fp32
    # shards reads param, grad, m and v and writes param, m and v: 28 bytes, no bf16 copy (30).
    from simulator.profile import load_profile
    from simulator.workload.ops import optimizer_time_s
    from simulator.workload.plan import adam_bytes_per_param

    base = {"model": "llama3-8b", "parallelism": {"dp": 8, "zero": 3},
            "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 2048},
            "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    assert adam_bytes_per_param(build_scenario({**base, "framework": "torchtitan"})) == 28
    assert adam_bytes_per_param(build_scenario(base)) == 30
    tt = simulate(build_scenario({**base, "framework": "torchtitan"})).program
    gen = simulate(build_scenario(base)).program
    prof = load_profile("h100-sxm-80gb")
    params = 8.03e9 / 8
    sc = build_scenario(base)
    assert tt.optimizer_s < gen.optimizer_s
    assert optimizer_time_s(prof, params, 300, 28, sc) < optimizer_time_s(prof, params, 300, 30, sc)
