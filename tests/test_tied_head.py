"""A tied LM head on the rank that holds the embedding: one matrix, counted once.

V-shaped schedules (zbv, dualpipev) put the first and the last stage on pp rank 0, which holds
the embedding and the head's matrix as one tensor (ops.tied_head_shares_embedding; the plan
all-reduces nothing there, schedules.base.PipelineSchedule.chain_end_ranks). The ops' tie rule
shared it only at pp = 1, so rank 0 counted V x h parameters twice: its weights, gradients,
optimizer state and DP gradient reduction.
"""

from __future__ import annotations

import pytest

from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.sweep.estimate import Estimator
from simulator.workload.ops import total_parameters
from simulator.workload.plan import grad_reduce_bytes

GIB = 1024**3
H, F, V, A, L = 1024, 4096, 50304, 16, 8
# Counted from the model's dimensions: Q, K, V, O (as many KV heads as query heads), SwiGLU's
# three matrices and the two RMSNorm weights a layer; the vocabulary matrix; the final norm.
LAYER = 4 * H * H + 3 * H * F + 2 * H
EMB = V * H
NORM = H


def _scenario(schedule: str, tied: bool = True, framework: str = "generic"):
    model = {"name": "tied", "num_layers": L, "hidden_size": H, "ffn_hidden_size": F, "num_attention_heads": A,
             "vocab_size": V, "tied_embeddings": tied}
    return build_scenario({
        "name": "t", "model": model, "framework": framework, "schedule": schedule,
        "parallelism": {"tp": 1, "pp": 4, "zero": 0},
        "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 1024},
        "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta",
    })


def _rank_positions(prog, rank: int) -> list[int]:
    sched = prog.schedule
    return [sched.stage_position[st] for st in sched.stages_of_rank(rank)]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_v_schedules_rank_0_holds_the_tied_matrix_once(schedule):
    sc = _scenario(schedule)
    res = simulate(sc)
    prog = res.program
    # Rank 0 holds stages 0 and 7: the embedding, layers 0 and 7, the final norm and the head,
    # whose matrix is the embedding's. Counted twice it was 136.58 M parameters, not 85.07 M.
    assert prog.schedule.chain_ends_share_rank and _rank_positions(prog, 0) == [0, 7]
    params = EMB + 2 * LAYER + NORM
    assert sum(prog.stage_params[q] for q in _rank_positions(prog, 0)) == params
    row = res.memory.per_rank_gib[0]
    # ZeRO 0, framework generic: bf16 weights 2 bytes, fp32 gradients 4, Adam's fp32 master, m, v 12.
    assert row["parameters_gib"] * GIB == pytest.approx(2 * params, rel=1e-12)
    assert row["gradients_gib"] * GIB == pytest.approx(4 * params, rel=1e-12)
    assert row["optimizer_gib"] * GIB == pytest.approx(12 * params, rel=1e-12)
    # The gradients rank 0 hands to the DP reduction: each parameter once.
    grads = sum(float(prog.segments[(q, "W")].grad_bytes.sum()) for q in _rank_positions(prog, 0))
    assert grads == pytest.approx(params * grad_reduce_bytes(sc.dtype, sc.parallelism.zero), rel=1e-12)
    # The pipeline holds the model once, and no tied-embedding all-reduce is emitted.
    assert sum(prog.stage_params) == total_parameters(sc) == L * LAYER + EMB + NORM
    assert not any(t.dim == "emb" for t in prog.step_collectives)
    # The head still runs its weight-gradient GEMM: model FLOPs (MFU's numerator) are the untied model's.
    untied = simulate(_scenario(schedule, tied=False)).program
    assert prog.model_flops_per_step == pytest.approx(untied.model_flops_per_step, rel=1e-12)
    assert sum(untied.stage_params) == sum(prog.stage_params) + EMB
    # The sweep estimate's per-layer reference Program (one layer a 1F1B position) takes the
    # point's tie: its memory is the simulation's.
    assert Estimator().estimate(sc).peak_memory_gib == pytest.approx(res.memory.peak_gib, rel=1e-9)


def test_1f1b_keeps_the_last_stages_copy_of_the_tied_matrix():
    # Megatron keeps a copy on the last stage and all-reduces the two gradients (unchanged).
    sc = _scenario("1f1b")
    res = simulate(sc)
    prog = res.program
    assert not prog.schedule.chain_ends_share_rank
    assert sum(prog.stage_params[q] for q in _rank_positions(prog, 0)) == EMB + 2 * LAYER
    assert sum(prog.stage_params[q] for q in _rank_positions(prog, 3)) == 2 * LAYER + NORM + EMB
    assert res.memory.per_rank_gib[3]["parameters_gib"] * GIB == pytest.approx(2 * (2 * LAYER + NORM + EMB), rel=1e-12)
    assert sum(prog.stage_params) == total_parameters(sc) + EMB
    assert [t.size_bytes for t in prog.step_collectives if t.dim == "emb"] == [EMB * 4]
