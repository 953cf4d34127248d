"""torchtitan's kernels the layer model adds (framework: torchtitan): RoPE and repeat_kv, the eager
RMSNorm / SwiGLU passes without torch.compile, FSDP2's copy-out, and per-op SAC's recomputation."""

import pytest

from simulator.scenario import build_scenario
from simulator.workload.ops import (RMSNORM_EAGER_EXTRA, SWIGLU_EAGER_EXTRA, TORCHTITAN_ROPE_COMPILED_BYTES_PER_ELEM,
                                    TORCHTITAN_ROPE_EAGER_BYTES_PER_ELEM, build_layer_ops)

SEQ = 8192


def _sc(**kw):
    base = {"name": "t", "model": "llama3-8b", "parallelism": {"dp": 8, "zero": 3},
            "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": SEQ},
            "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    base.update(kw)
    return build_scenario(base)


def _fwd_bytes(sc, kind="dense"):
    return sum(o.bytes for o in build_layer_ops(sc)[kind].forward)


def test_other_frameworks_unchanged():
    # generic (and Megatron's) layers have no torchtitan op; torch_compile is ignored there.
    names = {o.name for o in build_layer_ops(_sc())["dense"].forward}
    assert not names & {"rope", "repeat_kv", "fsdp_copy_out", "attn_norm.eager"}
    assert _fwd_bytes(_sc(torch_compile=False)) == _fwd_bytes(_sc())


def test_rope_and_repeat_kv_bytes():
    ops = {o.name: o for o in build_layer_ops(_sc(framework="torchtitan"))["dense"].forward}
    # Llama 3 8B: 32 query heads, 8 KV heads of 128; T = 8192 tokens, bf16.
    q_k = SEQ * (32 + 8) * 128
    assert ops["rope"].bytes == pytest.approx(q_k * TORCHTITAN_ROPE_COMPILED_BYTES_PER_ELEM)
    kv = SEQ * 8 * 128
    assert ops["repeat_kv"].bytes == pytest.approx(2 * kv * (1 + 4) * 2)
    eager = {o.name: o for o in build_layer_ops(_sc(framework="torchtitan", torch_compile=False))["dense"].forward}
    assert eager["rope"].bytes == pytest.approx(q_k * TORCHTITAN_ROPE_EAGER_BYTES_PER_ELEM)
    assert eager["rope"].launches == 6


def test_eager_adds_norm_and_swiglu_passes():
    # torch before 2.9: nn.RMSNorm composite on CUDA (the Dec 2024 rows' torch).
    compiled = _fwd_bytes(_sc(framework="torchtitan"))
    eager_ops = build_layer_ops(_sc(framework="torchtitan", torch_compile=False, torch_version="2.6"))["dense"]
    rope_extra = SEQ * 40 * 128 * (TORCHTITAN_ROPE_EAGER_BYTES_PER_ELEM - TORCHTITAN_ROPE_COMPILED_BYTES_PER_ELEM)
    norm_extra = 2 * RMSNORM_EAGER_EXTRA["fwd_passes"] * SEQ * 4096 * 2  # two RMSNorms a layer
    swiglu_extra = SWIGLU_EAGER_EXTRA["fwd_passes"] * SEQ * 14336 * 2
    eager = sum(o.bytes for o in eager_ops.forward)
    assert eager - compiled == pytest.approx(rope_extra + norm_extra + swiglu_extra)
    # Their backward: the eager ops' own (larger) byte counts, and the norm weights still reach W.
    i_ops, w_ops = eager_ops.backward()
    bwd = {o.name: o for o in i_ops}
    assert bwd["attn_norm.eager.bwd"].bytes == pytest.approx(RMSNORM_EAGER_EXTRA["bwd_passes"] * SEQ * 4096 * 2)
    assert sum(o.params for o in w_ops) == pytest.approx(eager_ops.params)


def test_torch_from_2_9_runs_eager_rmsnorm_fused():
    """From torch 2.9 (the first wheel with aten::_fused_rms_norm's CUDA dispatch) eager RMSNorm is
    the fused norm op alone: RoPE and SwiGLU keep their eager passes. Unset, torch_version is a
    current release."""
    old = {o.name for o in build_layer_ops(_sc(framework="torchtitan", torch_compile=False, torch_version="2.8.0a0"))["dense"].forward}
    for version in (None, "2.9", "2.11.0+cu130"):
        new = build_layer_ops(_sc(framework="torchtitan", torch_compile=False, torch_version=version))["dense"]
        names = {o.name for o in new.forward}
        assert old - names == {"attn_norm.eager", "mlp_norm.eager"}, version
        assert {"swiglu.eager", "rope"} <= names
    assert _sc(framework="torchtitan", torch_version="2.10").torch_fuses_rms_norm
    assert not _sc(framework="torchtitan", torch_version="2.8").torch_fuses_rms_norm



def test_eager_moe_block_pays_the_norm_and_swiglu_passes_too():
    # Only the attention block of a MoE layer used to get the eager passes: its ffn_norm is
    # nn.RMSNorm and its experts' SwiGLU runs unfused as the dense one does.
    moe = {"model": "mixtral-8x7b", "parallelism": {"dp": 8, "ep": 8, "zero": 3}, "framework": "torchtitan"}
    compiled = {o.name: o for o in build_layer_ops(_sc(**moe))["moe"].forward}
    eager = {o.name: o for o in build_layer_ops(_sc(**moe, torch_compile=False, torch_version="2.6"))["moe"].forward}
    assert set(eager) - set(compiled) == {"attn_norm.eager", "mlp_norm.eager", "experts_swiglu.eager"}
    assert eager["mlp_norm.eager"].bytes == pytest.approx(RMSNORM_EAGER_EXTRA["fwd_passes"] * SEQ * 4096 * 2)
    routed = SEQ * 2  # top-2, uniform routing: the busiest rank sees the mean load
    assert eager["experts_swiglu.eager"].bytes == pytest.approx(SWIGLU_EAGER_EXTRA["fwd_passes"] * routed * 14336 * 2)

def test_fsdp_copy_out_bytes_and_not_recomputed():
    layer = build_layer_ops(_sc(framework="torchtitan"))["dense"]
    copy = layer.forward[0]
    assert copy.name == "fsdp_copy_out" and not copy.recompute
    # Read the gathered bf16 buffer and write the parameters: 2 x 2 bytes a parameter.
    assert copy.bytes == pytest.approx(4 * layer.params)
    fp8 = build_layer_ops(_sc(framework="torchtitan", dtype="fp8",
                              fp8={"recipe": "tensorwise", "param_all_gather": True}))["dense"]
    # FP8 all-gather: the linears' parameters are 1 byte, the two norm weights stay bf16.
    assert fp8.forward[0].bytes == pytest.approx(2 * (fp8.params - 2 * 4096) + 4 * 2 * 4096)
    # No FSDP (dp 1): nothing to copy out.
    solo = _sc(framework="torchtitan", parallelism={"dp": 1, "zero": 3},
               batch={"micro_batch_size": 1, "global_batch_size": 1, "seq_length": SEQ},
               cluster={"gpus": 1, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
    assert all(o.name != "fsdp_copy_out" for o in build_layer_ops(solo)["dense"].forward)



def test_the_embedding_copies_out_its_tables_and_a_tied_head_keeps_its_transforms_backward():
    # The embedding's tables are its LayerOps' parameters, not an op's, and FSDP2's copy-out was
    # sized from the ops' (none): Llama 3 8B's 128,256 x 4,096 table read and written in bf16.
    emb = build_layer_ops(_sc(framework="torchtitan"))["embedding"]
    assert emb.forward[0].name == "fsdp_copy_out"
    assert emb.forward[0].bytes == pytest.approx(4 * 128256 * 4096)
    assert [o.bytes for o in emb.backward()[0] if o.name == "fsdp_copy_out.bwd"] == [pytest.approx(4 * 128256 * 4096)]
    # A tied head's backward was taken before the eager RMSNorm's passes and the copy-out were
    # added to its forward: both backward ops were missing.
    tied = {"name": "tied", "num_layers": 2, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 16,
            "vocab_size": 128256, "mlp": "swiglu", "tied_embeddings": True}
    head = build_layer_ops(_sc(framework="torchtitan", model=tied, torch_compile=False, torch_version="2.6"))["head"]
    i_ops, w_ops = head.backward()
    bwd = {o.name: o.bytes for o in i_ops}
    assert bwd["final_norm.eager.bwd"] == pytest.approx(RMSNORM_EAGER_EXTRA["bwd_passes"] * SEQ * 2048 * 2)
    assert bwd["fsdp_copy_out.bwd"] == pytest.approx(4 * 2048)  # the norm weight only: the matrix is the embedding's
    # (FSDP2's reduce-scatter copy-in follows each weight gradient; the shared matrix's is the
    # embedding's, copied in once.)
    assert [(o.name, o.params) for o in w_ops if not o.name.endswith(".grad_accumulate")] == \
        [("lm_head.wgrad", 0.0), ("final_norm.wgrad", 2048)]
    assert [o.name for o in w_ops if o.name.endswith(".grad_accumulate")] == ["final_norm.grad_accumulate"]


def test_fsdp2_reduce_scatter_copy_in_runs_on_the_compute_stream():
    # torch 2.13 _fsdp_collectives.foreach_reduce: foreach_reduce_scatter_copy_in (chunk_cat of the
    # bf16 gradients into the fp32 reduce-scatter input) runs on the current stream, before
    # reduce_scatter_stream.wait_stream: 2 + 4 bytes a parameter after every weight gradient.
    layer = build_layer_ops(_sc(framework="torchtitan"))["dense"]
    _, w_ops = layer.backward()
    copy_in = [o for o in w_ops if o.name.endswith(".grad_accumulate")]
    assert copy_in and sum(o.bytes for o in copy_in) == pytest.approx(6 * layer.params)
    # Generic ZeRO-3 charges none; nor does torchtitan on one data-parallel rank (no FSDP applied).
    assert not [o for o in build_layer_ops(_sc())["dense"].backward()[1] if o.name.endswith(".grad_accumulate")]
    solo = _sc(framework="torchtitan", parallelism={"dp": 1, "zero": 3},
               batch={"micro_batch_size": 1, "global_batch_size": 1, "seq_length": SEQ},
               cluster={"gpus": 1, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
    assert not [o for o in build_layer_ops(solo)["dense"].backward()[1] if o.name.endswith(".grad_accumulate")]


def test_fsdp2_under_a_pipeline_accumulates_fp32_and_copies_out_once_a_step():
    # torch.distributed.pipelining turns gradient sync off for every microbatch and reduces after
    # the last (stage.py backward_maybe_with_nosync, perform_reduce_grad): the first microbatch
    # casts the bf16 gradient to fp32 (6 B), the others add into it (10 B), the copy-in reads and
    # writes fp32 once (8 B); units kept unsharded (torchtitan's rule under PP) are copied out at
    # their first forward only.
    pp = _sc(framework="torchtitan", parallelism={"dp": 2, "pp": 4, "zero": 3, "fsdp_reshard_after_forward": False},
             batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": SEQ})
    assert pp.num_microbatches == 8
    layer = build_layer_ops(pp)["dense"]
    copy_in = sum(o.bytes for o in layer.backward()[1] if o.name.endswith(".grad_accumulate"))
    assert copy_in == pytest.approx((6 + 7 * 10 + 8) / 8 * layer.params)
    copy = layer.forward[0]
    assert copy.name == "fsdp_copy_out" and copy.bytes == pytest.approx(4 * layer.params / 8)
    assert not [o for o in layer.backward()[0] if o.name == "fsdp_copy_out.bwd"]

def test_sac_op_recomputes_every_second_matmul_and_no_copy_out():
    from simulator.workload.program import layer_recompute_ops

    sc = _sc(framework="torchtitan", recompute="selective-op")
    layer = build_layer_ops(sc)["dense"]
    rec = layer_recompute_ops(sc, layer)
    gemm = {o.name: o for o in layer.forward if o.op_class == "gemm"}
    rec_gemm = [o for o in rec if o.op_class == "gemm"]
    # torchtitan's seven mms wq, wk, wv, wo, w1, w3, w2: the even ones (wk, wo, w3) recomputed.
    assert [o.name for o in rec_gemm] == ["qkv_proj.mm1", "attn_out_proj", "fc1_gate_up.mm1"]
    wk_frac = 8 / (32 + 2 * 8)  # Llama 3 8B: 32 query heads, 8 KV heads
    assert rec_gemm[0].exec_flops == pytest.approx(gemm["qkv_proj"].exec_flops * wk_frac)
    assert rec_gemm[0].kernel.n == 8 * 128
    assert rec_gemm[2].exec_flops == pytest.approx(gemm["fc1_gate_up"].exec_flops / 2)
    # About a third of the layer's forward GEMM FLOPs, i.e. ~1/9 of fwd + bwd.
    share = sum(o.exec_flops for o in rec_gemm) / sum(o.exec_flops for o in gemm.values())
    assert 0.3 < share < 0.4
    # Everything else but attention is rerun; FSDP's copy-out is not (params already gathered).
    names = {o.name for o in rec}
    assert {"rope", "repeat_kv", "attn_norm", "swiglu"} <= names
    assert "fsdp_copy_out" not in names and "attention" not in names
    full = layer_recompute_ops(_sc(framework="torchtitan", recompute="full"), layer)
    assert [o.name for o in full] == [o.name for o in layer.forward if o.name != "fsdp_copy_out"]
    # Other frameworks count our fused GEMMs: attn_out_proj and fc2 (unchanged behaviour).
    gsc = _sc(recompute="selective-op")
    grec = layer_recompute_ops(gsc, build_layer_ops(gsc)["dense"])
    assert [o.name for o in grec if o.op_class == "gemm"] == ["attn_out_proj", "fc2"]


def test_sac_op_memory_keeps_only_the_save_list_and_the_loss_keeps_what_torch_does():
    from simulator.simulate import simulate
    from simulator.workload.memory import activation_bytes_per_layer

    sc = _sc(framework="torchtitan", recompute="selective-op")
    # By hand, Llama 3 8B (h 4096, 32 heads of 128, 8 KV heads, FFN 14336), bytes a token: the
    # block input 2 x 4096; the saved mms wq, wv, w1, w2 (the odd ones of wq wk wv wo w1 w3 w2)
    # 2 x (4096 + 1024 + 14336 + 4096); the attention output 2 x 4096 and its logsumexp 4 x 32.
    per_token = 2 * 4096 + 2 * (4096 + 1024 + 14336 + 4096) + 2 * 4096 + 4 * 32
    assert activation_bytes_per_layer(sc) == pytest.approx(SEQ * per_token)
    # Under half of what a layer keeps without recomputation (the Korthikanti set, 36 x s x h).
    none = activation_bytes_per_layer(_sc(framework="torchtitan", recompute="none"))
    assert activation_bytes_per_layer(sc) < 0.45 * none
    # Tensor and sequence parallelism: column-parallel outputs / t, the row-parallel w2's mm output
    # whole (partial sums before the reduce-scatter), the reduce-scatter outputs / t.
    t = 2
    tp = _sc(framework="torchtitan", recompute="selective-op", parallelism={"tp": t, "dp": 4, "zero": 3,
                                                                           "sequence_parallel": True})
    tp_token = (2 * 4096 / t + 2 * (4096 + 1024 + 14336) / t + 2 * 4096 + 2 * (2 * 4096 / t)
                + 2 * 4096 / t + 4 * 32 / t)
    assert activation_bytes_per_layer(tp) == pytest.approx(SEQ * tp_token)
    # The loss (bench/loss_memory.py): eager, its backward holds the incoming and the input
    # gradients, fp32, 8 bytes a logit beside the 4 of the kept log-softmax; compiled (torchtitan
    # >= 0.1.0 with the model, or as asked), it keeps the bf16 logits and writes their bf16 gradient.
    logits = SEQ * 128256
    eager = simulate(_sc(framework="torchtitan", recompute="selective-op", compile_loss=False)).memory.per_rank_gib[0]
    compiled = simulate(sc).memory.per_rank_gib[0]
    assert eager["loss_working_set_gib"] == pytest.approx(8 * logits / 2**30)
    assert compiled["loss_working_set_gib"] == pytest.approx(2 * logits / 2**30)
    assert eager["activations_gib"] - compiled["activations_gib"] == pytest.approx(2 * logits / 2**30)
    # Under tp, loss_parallel on vocab-sharded logits: eager 4 kept and 12 more, compiled 4 and 6.
    par = {"tp": 2, "dp": 4, "zero": 3, "sequence_parallel": True}
    for compile_loss, extra in ((False, 12), (True, 6)):
        m = simulate(_sc(framework="torchtitan", recompute="selective-op", parallelism=par,
                         compile_loss=compile_loss)).memory.per_rank_gib[0]
        assert m["loss_working_set_gib"] == pytest.approx(extra * logits / 2 / 2**30)
    no_compile = simulate(_sc(framework="torchtitan", recompute="selective-op", torch_compile=False)).memory
    assert no_compile.per_rank_gib[0]["loss_working_set_gib"] == pytest.approx(8 * logits / 2**30)
    # Megatron's vocab-parallel loss works in place in its saved fp32 softmax: no working set.
    generic = simulate(_sc(recompute="selective-op")).memory.per_rank_gib[0]
    assert "loss_working_set_gib" not in generic
    # FSDP2's sharded parameters are the fp32 masters and there is no bf16 copy: 4 + 8 bytes a
    # parameter, where Megatron's distributed optimizer keeps bf16 weights beside master, m and v.
    assert compiled["parameters_gib"] == pytest.approx(2 * generic["parameters_gib"])
    assert compiled["parameters_gib"] + compiled["optimizer_gib"] == pytest.approx(
        (generic["parameters_gib"] + generic["optimizer_gib"]) * 12 / 14)


def test_cp_merge_and_repeated_kv_gather():
    from simulator.workload.ops import torch_cp_merge_op

    par = {"dp": 2, "cp": 4, "zero": 3}
    tt = {o.name: o for o in build_layer_ops(_sc(framework="torchtitan", parallelism=par))["dense"].forward}
    # Against megatron-core with TE's all-gather CP (cp_comm_type all_gather; its default is p2p).
    gen = {o.name: o for o in build_layer_ops(_sc(parallelism={**par, "cp_attention": "allgather"}))["dense"].forward}
    # torchtitan repeats K/V to all 32 heads before SDPA: CP gathers 4x the 8-KV-head bytes.
    assert tt["cp_kv_all_gather"].comm.size_bytes == pytest.approx(4 * gen["cp_kv_all_gather"].comm.size_bytes)
    assert "cp_sdpa_merge" not in gen
    # torch's CP gathers K/V before step 0's SDPA and waits at step 1: overlapped under torchtitan.
    assert tt["cp_kv_all_gather"].comm.overlap and not gen["cp_kv_all_gather"].comm.overlap
    E = (SEQ // 4) * 32 * 128  # local tokens x heads x head_dim
    # Merges, plus the K/V cat before each rotation (8 bytes an element, cp - 1 steps each way)
    # and K/V made contiguous once each way (8: the transposed repeat_kv views).
    assert tt["cp_sdpa_merge"].bytes == pytest.approx(E * (12 + 8 + 32.5 * 3 + 8 * 3))
    assert tt["cp_sdpa_merge"].bwd_bytes == pytest.approx(E * (76 + 8 + 50.5 * 3 + 8 * 3))
    # One CP rank: nothing to merge (cp 1 has no merge op at all).
    assert torch_cp_merge_op(E, 1).bytes == pytest.approx((12 + 8) * E)
    assert "cp_sdpa_merge" not in {o.name for o in build_layer_ops(_sc(framework="torchtitan"))["dense"].forward}


def test_cp_sdpa_kernels_torch_launches():
    """torch's load-balanced CP (torch 2.6 _templated_ring_attention): step 0 causal over the local
    s x s, later steps unmasked half blocks (s x s/2 for i <= rank, s/2 x s after; rank cp // 2
    modelled), each half a full block's work; together the causal work of the rank's queries
    against the whole sequence, in about the time of that one causal kernel."""
    from simulator.profile import load_profile
    from simulator.workload.ops import op_durations_s

    par = {"dp": 2, "cp": 4, "zero": 3}
    sc = _sc(framework="torchtitan", parallelism=par)
    fwd = build_layer_ops(sc)["dense"].forward
    steps = [o for o in fwd if o.op_class == "attention"]
    s = SEQ // 4
    assert [o.name for o in steps] == [f"attention_step{i}" for i in range(4)]
    shapes = [(o.kernel.m, o.kernel.n, o.kernel.causal) for o in steps]
    assert shapes == [(s, s, True), (s, s // 2, False), (s, s // 2, False), (s // 2, s, False)]
    assert all(o.exec_flops == pytest.approx(steps[0].exec_flops) for o in steps)
    gen = [o for o in build_layer_ops(_sc(parallelism={**par, "cp_attention": "allgather"}))["dense"].forward
           if o.op_class == "attention"]
    assert len(gen) == 1 and gen[0].kernel.causal and (gen[0].kernel.m, gen[0].kernel.n) == (s, SEQ)
    assert sum(o.exec_flops for o in steps) == pytest.approx(gen[0].exec_flops)
    # Same work in about the same time: three more launches, and the causal step's diagonal
    # tiles cost within 2% of the single kernel's.
    from simulator.workload.kernel_model import kernel_model_of

    p = load_profile("h100-sxm-80gb")
    floor = kernel_model_of(p).launch_floor_us * 1e-6
    t_steps = op_durations_s(p, steps, sc).sum() - 3 * floor
    t_one = op_durations_s(p, gen, sc).sum()
    assert t_steps == pytest.approx(t_one, rel=0.02)


def test_cp_without_load_balance_paced_by_last_rank():
    """torch 2.5's CP (contiguous shards, blocks from later ranks skipped): the last rank runs step 0
    causal and cp - 1 full s x s blocks, (2 cp - 1) / cp the balanced work; the model FLOPs (what
    MFU counts) do not change."""
    par = {"dp": 2, "cp": 4, "zero": 3}
    lb = build_layer_ops(_sc(framework="torchtitan", parallelism=par))["dense"].forward
    nolb = build_layer_ops(_sc(framework="torchtitan", parallelism={**par, "cp_load_balance": False}))["dense"].forward
    a_lb = [o for o in lb if o.op_class == "attention"]
    a_no = [o for o in nolb if o.op_class == "attention"]
    s = SEQ // 4
    assert [(o.kernel.m, o.kernel.n, o.kernel.causal) for o in a_no] == [(s, s, True)] + [(s, s, False)] * 3
    assert sum(o.exec_flops for o in a_no) == pytest.approx(sum(o.exec_flops for o in a_lb) * 7 / 4)
    assert sum(o.model_flops for o in a_no) == pytest.approx(sum(o.model_flops for o in a_lb))
    E = s * 32 * 128
    merge = {o.name: o for o in nolb}["cp_sdpa_merge"]
    assert merge.bytes == pytest.approx(E * (12 + 8 + 38 * 3 + 8 * 3))
    assert merge.bwd_bytes == pytest.approx(E * (76 + 8 + 46 * 3 + 8 * 3))


def test_torch_pipelining_holds_a_receive_buffer_per_microbatch():
    from simulator.simulate import simulate

    # torch.distributed.pipelining (stage.py) allocates every microbatch's receive buffers up front:
    # activations into every stage but the first, gradients into every stage but the last.
    sc = _sc(framework="torchtitan", parallelism={"pp": 4, "dp": 2, "zero": 3}, batch={
        "micro_batch_size": 1, "global_batch_size": 16, "seq_length": SEQ})
    rows = simulate(sc).memory.per_rank_gib
    boundary_gib = 2 * SEQ * 4096 / 2**30  # one microbatch's bf16 hidden states
    nmb = 8
    assert [r["pp_recv_buffers_gib"] for r in rows] == pytest.approx(
        [nmb * boundary_gib, 2 * nmb * boundary_gib, 2 * nmb * boundary_gib, nmb * boundary_gib])
    assert all("pp_recv_buffers_gib" not in r for r in simulate(_sc(parallelism={"pp": 4, "dp": 2, "zero": 3}, batch={
        "micro_batch_size": 1, "global_batch_size": 16, "seq_length": SEQ})).memory.per_rank_gib)


def test_per_op_sac_recomputes_grouped_expert_gemms_and_keeps_the_all_to_alls():
    """torchtitan's MoE experts run torch._grouped_mm, which per-op SAC neither counts as aten.mm
    nor saves (0.2.0 _op_sac_save_list), while all_to_all_single is saved: a MoE layer under
    selective-op recomputes both expert GEMMs and keeps the dispatch and combine outputs. It had
    raised AttributeError (the grouped GEMMs carry no single kernel)."""
    from simulator.profile import load_profile
    from simulator.simulate import resolve_schedule, simulate
    from simulator.workload.program import build_program, layer_recompute_ops, selective_op_saved_bytes

    d = {"model": "mixtral-8x7b", "framework": "torchtitan", "recompute": "selective-op",
         "parallelism": {"tp": 2, "ep": 4, "zero": 3},
         "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
         "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta"}
    sc = build_scenario(d)
    moe = build_layer_ops(sc)["moe"]
    rerun = {o.name for o in layer_recompute_ops(sc, moe)}
    assert {"experts_fc1", "experts_fc2"} <= rerun
    a2a = sum(o.comm.size_bytes for o in moe.forward if o.comm is not None and o.comm.op == "all_to_all")
    assert a2a > 0
    # The same layer with the all-to-alls left unsaved keeps exactly a2a bytes less.
    from dataclasses import replace

    no_a2a = replace(moe, forward=[o for o in moe.forward if not (o.comm is not None and o.comm.op == "all_to_all")])
    assert selective_op_saved_bytes(sc, moe) - selective_op_saved_bytes(sc, no_a2a) == pytest.approx(a2a)
    # At ep 1 no all-to-all runs, so none is kept.
    sc1 = build_scenario({**d, "parallelism": {"tp": 2, "ep": 1, "zero": 3}})
    moe1 = build_layer_ops(sc1)["moe"]
    no_a2a1 = replace(moe1, forward=[o for o in moe1.forward if not (o.comm is not None and o.comm.op == "all_to_all")])
    assert selective_op_saved_bytes(sc1, moe1) == pytest.approx(selective_op_saved_bytes(sc1, no_a2a1))
    rep = simulate(sc).report
    assert rep.step_time_s > 0 and rep.peak_memory_gib > 0
