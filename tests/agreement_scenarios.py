"""A fixed set of small scenarios covering every parallelism the estimate and the engine model
(DDP, ZeRO-1/2/3, HSDP, TP/SP, CP, EP with uniform routing, PP with every shipped schedule).
Each is small (a 16-layer, 2048-wide Llama-style model, short sequences) so the set runs fast."""

from __future__ import annotations

from simulator.schedules import schedule_names

SMALL_DENSE = dict(name="small-dense", num_layers=16, hidden_size=2048, ffn_hidden_size=7168, num_attention_heads=16,
                   num_kv_heads=8, vocab_size=32000, mlp="swiglu")
SMALL_MOE = dict(SMALL_DENSE, name="small-moe", num_experts=8, top_k=2, ffn_hidden_size=4096)


def scenario(name: str, model=SMALL_DENSE, gpus: int = 16, gbs: int = 32, seq: int = 1024, **over) -> dict:
    d = {
        "name": name, "model": dict(model),
        "parallelism": {"tp": 1, "pp": 1, "zero": 0},
        "batch": {"micro_batch_size": 1, "global_batch_size": gbs, "seq_length": seq},
        "cluster": {"gpus": gpus, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
        "network": "alpha-beta",
    }
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def _pp_vpp(name: str) -> int:
    return 2 if name == "interleaved-1f1b" else 1


AGREEMENT_SCENARIOS: list[dict] = [
    scenario("ddp"),
    scenario("ddp-no-overlap", parallelism={"overlap_grad_reduce": False}),
    scenario("ddp-small-buckets", parallelism={"grad_bucket_params": 5_000_000}),
    scenario("zero1", parallelism={"zero": 1}),
    scenario("zero1-no-param-overlap", parallelism={"zero": 1, "overlap_param_gather": False}),
    scenario("zero2", parallelism={"zero": 2}),
    scenario("zero3", parallelism={"zero": 3}),
    scenario("zero3-keep", parallelism={"zero": 3, "fsdp_reshard_after_forward": False}),
    scenario("zero3-prefetch2", parallelism={"zero": 3, "fsdp_prefetch": 2}),
    scenario("hsdp4", parallelism={"zero": 3, "fsdp_shard_size": 4}),
    scenario("hsdp8-64gpu", gpus=64, gbs=64, parallelism={"zero": 3, "fsdp_shard_size": 8}),
    scenario("tp2-sp", parallelism={"tp": 2, "zero": 1}),
    scenario("tp8-sp", parallelism={"tp": 8, "zero": 1}),
    scenario("tp8-sp-async", parallelism={"tp": 8, "zero": 1, "async_tp": True}),
    scenario("tp8-sp-te-overlap", parallelism={"tp": 8, "zero": 1, "tp_comm_overlap": True}),
    scenario("tp4-nosp", parallelism={"tp": 4, "zero": 1, "sequence_parallel": False}),
    scenario("cp2-allgather", seq=4096, parallelism={"cp": 2, "zero": 1}),
    scenario("cp4-ring", seq=8192, parallelism={"cp": 4, "zero": 1, "cp_attention": "ring"}),
    scenario("tp2-cp2", seq=4096, parallelism={"tp": 2, "cp": 2, "zero": 1}),
    scenario("ep4-moe", model=SMALL_MOE, parallelism={"ep": 4, "zero": 1}),
    scenario("ep8-moe-z0", model=SMALL_MOE, parallelism={"ep": 8, "zero": 0}),
    scenario("ep4-moe-zero3", model=SMALL_MOE, parallelism={"ep": 4, "zero": 3}),
    scenario("ep4-tp2-moe", model=SMALL_MOE, parallelism={"ep": 4, "tp": 2, "zero": 1}),
    scenario("hsdp-ep-moe", model=SMALL_MOE, gpus=32, parallelism={"ep": 4, "zero": 3, "fsdp_shard_size": 8}),
    scenario("ep8-folded-over-tp2-moe", model=SMALL_MOE, gpus=8, parallelism={"ep": 8, "tp": 2, "zero": 1}),
    scenario("ep4-etp2-moe", model=SMALL_MOE, parallelism={"ep": 4, "tp": 2, "etp": 2, "zero": 1}),
    scenario("bf16-adam-bf16-grads", parallelism={"tp": 2, "zero": 1, "grad_reduce_in_fp32": False},
             optimizer={"precision_aware": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}),
    scenario("recompute-full", parallelism={"tp": 2, "zero": 1}, recompute="full"),
    *[scenario(f"pp4-{s}", gbs=64, parallelism={"pp": 4, "vpp": _pp_vpp(s), "tp": 2, "zero": 1}, schedule=s)
      for s in schedule_names()],
    *[scenario(f"pp2-{s}-dp", gbs=32, parallelism={"pp": 2, "vpp": _pp_vpp(s), "zero": 1}, schedule=s)
      for s in schedule_names()],
    scenario("pp4-1f1b-zero3", gbs=64, parallelism={"pp": 4, "zero": 3}),
    scenario("pp4-interleaved-no-param-overlap", gbs=64, schedule="interleaved-1f1b",
             parallelism={"pp": 4, "vpp": 2, "tp": 2, "zero": 1, "overlap_param_gather": False}),
    scenario("pp2-1f1b-moe-ep", model=SMALL_MOE, gbs=32, parallelism={"pp": 2, "ep": 4, "zero": 1}),
    scenario("pp2-tp4-cp2", gbs=32, seq=4096, gpus=32, parallelism={"pp": 2, "tp": 4, "cp": 2, "zero": 1}),
]
