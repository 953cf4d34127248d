"""The workload runs what frameworks run: Megatron SP's backward re-gather, multi-tensor Adam
launches, HF eager layers kernel by kernel, shape-aware timing under a kernel model."""

from pathlib import Path

import pytest

from simulator.workload.kernel_model import kernel_model_of
from simulator.profile import load_profile
from simulator.scenario import build_scenario
from simulator.errors import UserError
from simulator.workload.kernels import adam_kernels
from simulator.workload.ops import build_layer_ops, op_durations_s

HF = Path(__file__).parent / "data" / "hf" / "neusight"


def _sc(**over):
    data = {"model": "llama3-8b", "parallelism": {"tp": 2, "pp": 1, "sequence_parallel": True},
            "batch": {"micro_batch_size": 1, "global_batch_size": 4, "seq_length": 4096},
            "cluster": {"gpus": 2, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
    data.update(over)
    return build_scenario(data)


def _collectives(ops):
    return [o.comm.op for o in ops if o.comm is not None and o.comm.op != "identity_ar"]


def test_megatron_sp_gathers_six_times_per_layer():
    dense = build_layer_ops(_sc())["dense"]
    i_ops, w_ops = dense.backward()
    ops = dense.forward + i_ops + w_ops
    assert _collectives(ops).count("all_gather") == 6
    assert _collectives(ops).count("reduce_scatter") == 4
    # Norm weights saw 1/tp of the tokens: their fp32 gradients are all-reduced over tp.
    ar = [o for o in w_ops if o.comm is not None and o.comm.op == "all_reduce"]
    assert len(ar) == 1 and ar[0].comm.dim == "tp" and ar[0].comm.size_bytes == 2 * 4096 * 4
    regather = [o for o in i_ops if o.name.endswith(".input_regather")]
    assert len(regather) == 2 and all(o.comm.overlap for o in regather)
    # Each re-gather comes right before the input-grad GEMM it overlaps.
    names = [o.name for o in i_ops]
    for o in regather:
        assert names[names.index(o.name) + 1].endswith(".dgrad")
    # Without SP there is nothing to re-gather.
    no_sp = build_layer_ops(_sc(parallelism={"tp": 2, "sequence_parallel": False}))["dense"]
    assert "all_gather" not in _collectives(no_sp.forward + no_sp.backward()[0])
    assert not any(o.comm is not None for o in no_sp.backward()[1])


def test_gemm_kernels_transpose_in_backward():
    dense = build_layer_ops(_sc())["dense"]
    fwd = next(o for o in dense.forward if o.name == "qkv_proj").kernel
    i_ops, w_ops = dense.backward()
    dgrad = next(o for o in i_ops if o.name == "qkv_proj.dgrad").kernel
    wgrad = next(o for o in w_ops if o.name == "qkv_proj.wgrad").kernel
    assert (dgrad.m, dgrad.n, dgrad.k) == (fwd.m, fwd.k, fwd.n)
    assert (wgrad.m, wgrad.n, wgrad.k) == (fwd.k, fwd.n, fwd.m)


def test_adam_launches():
    # 1.3B parameters in 296 tensors: limited by elements per launch (21M), not tensors (36).
    ks = adam_kernels(1.3e9, 296, 16.0)
    assert len(ks) == 62 and sum(k.bytes for k in ks) == pytest.approx(1.3e9 * 16)
    # A small model: limited by tensors per launch.
    assert len(adam_kernels(1e6, 100, 16.0)) == 3
    # The optimizer's time is its launches' (timed once, as they are equal).
    from simulator.workload.kernel_model import kernels_time_s
    from simulator.workload.ops import optimizer_time_s

    prof = load_profile("h100-sxm-80gb")
    sc = build_scenario({"model": "llama3-8b", "batch": {"global_batch_size": 8, "seq_length": 2048}, "cluster": {"gpus": 8}})
    assert optimizer_time_s(prof, 1.3e9, 296, 16.0, sc) == pytest.approx(
        float(kernels_time_s(prof, adam_kernels(1.3e9, 296, 16.0), sc.dtype).sum()), rel=1e-12)
    assert optimizer_time_s(prof, 0.0, 296, 16.0, sc) == 0.0


def test_launch_floor_dominates_small_models():
    p = load_profile("h100-sxm-80gb")
    floor = kernel_model_of(p).launch_floor_us * 1e-6

    def floor_share(seq, batch):
        sc = _sc(model=str(HF / "gpt2-large.json"), implementation="hf-eager", flash_attention=False, dtype="fp32",
                 parallelism={"tp": 1}, batch={"micro_batch_size": batch, "global_batch_size": batch, "seq_length": seq},
                 cluster={"gpus": 1, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
        dense = build_layer_ops(sc)["dense"]
        ops = [o for o in dense.forward + dense.backward()[0] if o.comm is None]
        return floor * len(ops) / op_durations_s(p, ops, sc).sum()

    small, large = floor_share(32, 1), floor_share(1024, 4)
    # The floor is the measured 7 us (Kineto, A100; was an assumed 3 us): ~3% of a GPT-2 Large b4 layer.
    assert small > 0.1 and large < 0.05 and small > 10 * large


def test_hf_eager_gpt2_layer_matches_hf_ops():
    sc = _sc(model=str(HF / "gpt2-large.json"), implementation="hf-eager", flash_attention=False, dtype="fp32",
             parallelism={"tp": 1}, batch={"micro_batch_size": 4, "global_batch_size": 4, "seq_length": 1024},
             cluster={"gpus": 1, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
    layers = build_layer_ops(sc)
    dense = layers["dense"]
    # HF GPT-2 block: 4 Conv1D GEMMs, 2 attention matmuls, 8 gelu_new kernels, 3 dropouts.
    fwd = dense.forward
    assert sum(o.op_class == "gemm" for o in fwd) == 4
    assert sum(o.kernel.kind == "gemm" and o.op_class == "attention" for o in fwd) == 2
    assert sum(o.name.startswith("gelu") for o in fwd) == 8
    # Parameters of one layer: 12 h^2 + 13 h (weights, biases and two LayerNorms).
    h = 1280
    assert dense.params == 12 * h * h + 13 * h


def _classic_attention(micro_batch: int, tp: int):
    """GPT with Megatron's classic (materialised-score) attention, 16 heads, fp16."""
    sc = build_scenario({"model": {"hidden_size": 1024, "num_layers": 4, "num_attention_heads": 16,
                                   "ffn_hidden_size": 4096, "vocab_size": 51200, "mlp": "gelu"},
                         "parallelism": {"tp": tp, "pp": 1}, "dtype": "fp16", "flash_attention": False,
                         "batch": {"micro_batch_size": micro_batch, "global_batch_size": 8 * micro_batch,
                                   "seq_length": 1024},
                         "cluster": {"gpus": tp, "gpu": "a100-sxm-80gb", "topology": "dgx-a100"}})
    dense = build_layer_ops(sc)["dense"]
    fwd = next(o for o in dense.forward if o.name == "softmax_dropout")
    bwd = next(o for o in dense.backward()[0] if o.name == "softmax_dropout.bwd")
    return fwd, bwd, micro_batch * (16 // tp) * 1024 * 1024  # score elements: b x heads x s x s


@pytest.mark.parametrize("micro_batch, tp, fused", [(1, 8, False), (2, 8, True), (1, 4, True), (3, 2, True)])
def test_megatron_softmax_falls_back_unfused_where_its_kernel_refuses(micro_batch, tp, fused):
    """FusedScaleMaskSoftmax needs b x heads a multiple of 4: 1 x 16/8 = 2 heads takes the
    fp32 torch path, which moves 36 B a score forward instead of the fused kernel's 4."""
    fwd, bwd, scores = _classic_attention(micro_batch, tp)
    assert fwd.bytes / scores == pytest.approx(11.0 if fused else 43.0), fwd.bytes / scores
    assert bwd.bytes / scores == pytest.approx(22.0 if fused else 54.0), bwd.bytes / scores
    assert (fwd.launches, bwd.launches) == ((2, 4) if fused else (6, 7))


def test_classic_attention_pays_megatron_layout_copies_and_flash_does_not():
    """Megatron's classic attention copies the context [b, np, sq, hn] -> [sq, b, np, hn]
    (permute(...).contiguous(), read + write) and, in backward, cats the q, k, v gradients of its
    torch.split (read + write); the fused FlashAttention path has neither."""
    sc = _sc(parallelism={"tp": 2, "sequence_parallel": False}, flash_attention=False)
    dense = build_layer_ops(sc)["dense"]
    (copy,) = [o for o in dense.forward if o.name == "attn_layout_copies"]
    tokens, h, kv = 4096, 4096, 8 * 128  # llama3-8b: 32 heads, 8 key/value heads of 128
    assert copy.bytes == 2 * tokens * (h // 2) * 2  # context on one of 2 TP ranks, bf16, read + write
    (bwd,) = [o for o in dense.backward()[0] if o.name == "attn_layout_copies.bwd"]
    assert bwd.bytes == 2 * tokens * ((h + 2 * kv) // 2) * 2  # the fused QKV output's gradient
    assert bwd.launches == 1
    flash = build_layer_ops(_sc(parallelism={"tp": 2, "sequence_parallel": False}))["dense"]
    assert not any(o.name.startswith("attn_layout_copies") for o in flash.forward + flash.backward()[0])


def test_embedding_weight_gradient_is_torchs_dense_backward():
    """Every microbatch zeroes a gradient the size of the rank's table; up to 3,072 indices one
    feature kernel adds each token's row, beyond that the sorted path sums fp32 partials (one per
    distinct row: every token of the word table, each position once a sequence). Megatron's
    get_batch mask is not part of it; the program's first stage runs it as the W segment."""
    from simulator.calibrate.published import vtrain_scenario
    from simulator.schedules import build_schedule
    from simulator.workload.ops import embedding_wgrad_op
    from simulator.workload.program import build_program

    def row(tp, mb):
        return {"hidden size": "2048", "# layers": "12", "tensor parallelism": str(tp), "data parallelism": "1",
                "pipeline parallelism": "2", "micro batch": str(mb), "global batch": str(2 * mb),
                "attention heads": "16", "sequence length": "1024", "# GPUs": str(2 * tp)}

    h, s = 2048, 1024
    for tp in (1, 4):
        sc = build_scenario(vtrain_scenario(row(tp, 4)))
        T, V = 4 * s, sc.model.vocab_size / tp
        op = embedding_wgrad_op(sc, params=1.0)
        word = V * h * 2 + T * h * 2 + T * h * 8 + T * h * 2  # zero, read, partials, scatter
        position = s * h * 2 + T * h * 2 + s * h * 8 + s * h * 2  # 4 repeats a position: one partial
        assert op.bytes == pytest.approx(word + position)
        assert op.launches == 6 + 6 + 2  # two sorted tables and their AccumulateGrad adds
        # 1,024 tokens: the feature kernel, no sort and no partials.
        small = embedding_wgrad_op(build_scenario(vtrain_scenario(row(tp, 1))), params=1.0)
        assert small.bytes == pytest.approx(V * h * 2 + s * h * 6 + s * h * 2 + s * h * 6)
        assert small.launches == 2 + 2 + 2
    sc = build_scenario(vtrain_scenario(row(1, 4)))
    prof = load_profile(sc.cluster.gpu)
    prog = build_program(sc, prof, build_schedule("1f1b", 2, 2, 1))
    w = prog.segments[(0, "W")]
    emb_w = float(w.compute_s[w.layer == -1].sum())
    layer_ops = build_layer_ops(sc)["embedding"]
    op = embedding_wgrad_op(sc, layer_ops.params)
    kernels_s = op_durations_s(prof, [op] + layer_ops.grad_accumulate_ops(op), sc).sum()
    # A segment lasts as long as its kernels or the host's issue of them, whichever is longer.
    host_s = op.launches * prof.compute.host_launch_backward_us * 1e-6
    assert emb_w == pytest.approx(max(kernels_s, host_s), rel=1e-6)
    assert kernels_s > 0.3e-3  # the 206 MB zeroed table alone takes ~0.12 ms at the A100's HBM rate


def test_the_embedding_adds_its_gradient_into_main_grad_even_with_the_fusion():
    # gradient_accumulation_fusion reaches only wgrad GEMMs; megatron-core's hook adds the table's
    # fresh bf16 .grad into the fp32 main_grad every microbatch: 2 + 4 + 4 bytes a parameter.
    fused = build_layer_ops(_sc(parallelism={"tp": 2, "grad_accumulation_fusion": True}))
    assert fused["embedding"].grad_accum_bytes_per_param == 10.0
    assert fused["dense"].grad_accum_bytes_per_param == 0.0
    fsdp = build_layer_ops(_sc(parallelism={"tp": 2, "zero": 3}))
    assert fsdp["embedding"].grad_accum_bytes_per_param == 0.0

def test_hf_eager_embedding_backward_zeroes_each_table_once():
    """hf-eager gives the embedding's backward kernel by kernel (the zeroed table as an input-grad
    kernel, the scatter as the weight gradient); the program used to swap the weight gradient for
    ops.embedding_wgrad_op, which zeroes the tables again."""
    from simulator.schedules.registry import build_schedule
    from simulator.workload.program import build_program

    sc = _sc(model=str(HF / "gpt2-large.json"), implementation="hf-eager", flash_attention=False, dtype="fp32",
             parallelism={"tp": 1}, batch={"micro_batch_size": 4, "global_batch_size": 4, "seq_length": 1024},
             cluster={"gpus": 1, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"})
    prof = load_profile("h100-sxm-80gb")
    prog = build_program(sc, prof, build_schedule("1f1b", 1, 1))
    emb = build_layer_ops(sc)["embedding"]
    i_ops, w_ops = emb.backward()
    h, vocab, positions = 1280, 50257, 1024  # gpt2-large.json
    zeroed = [o.bytes for o in i_ops if o.name in ("wte.bwd0", "wpe.bwd0")]
    assert zeroed == [positions * h * 4, vocab * h * 4]  # fp32 tables, each zeroed once
    assert sum(o.params for o in w_ops) == (vocab + positions) * h
    # The embedding's W segment is its own two scatter kernels, no more.
    w = prog.segments[(0, "W")]
    scatter_s = op_durations_s(prof, w_ops, sc).sum()
    emb_w_s = sum(t for t, layer in zip(w.compute_s, w.layer) if layer == -1)
    assert emb_w_s == pytest.approx(scatter_s, rel=1e-9)
    assert sum(g for g, layer in zip(w.grad_bytes, w.layer) if layer == -1) == pytest.approx((vocab + positions) * h * 4)


def test_megatron_selective_recompute_reruns_core_attention_whole():
    """Megatron's selective recompute checkpoints core_attention: classic attention's context
    permute copy, and under context parallelism TE attention's own K/V exchange, rerun with it
    (both were left out, picked by class and name)."""
    from simulator.workload.program import layer_recompute_ops

    sc = build_scenario({"model": {"hidden_size": 1024, "num_layers": 4, "num_attention_heads": 16,
                                   "ffn_hidden_size": 4096, "vocab_size": 51200, "mlp": "gelu"},
                         "parallelism": {"tp": 2, "pp": 1}, "dtype": "fp16", "flash_attention": False,
                         "recompute": "selective", "batch": {"micro_batch_size": 4, "global_batch_size": 8, "seq_length": 1024},
                         "cluster": {"gpus": 2, "gpu": "a100-sxm-80gb", "topology": "dgx-a100"}})
    rec = layer_recompute_ops(sc, build_layer_ops(sc)["dense"])
    assert [o.name for o in rec] == ["attention", "softmax_dropout", "attn_layout_copies"]
    assert rec[2].bytes == 2 * 4 * 1024 * (1024 // 2) * 2  # the context, b x s x h / tp in fp16, read + write
    # The ring's wait for the last K/V block (a JOIN) reruns with it.
    for style, comms in (("ring", ["cp_kv_ring_step0", "cp_kv_ring.wait"]), ("allgather", ["cp_kv_all_gather"])):
        cp = _sc(parallelism={"tp": 1, "cp": 2, "cp_attention": style}, recompute="selective")
        rec = layer_recompute_ops(cp, build_layer_ops(cp)["dense"])
        assert [o.name for o in rec if o.comm is not None] == comms
        assert all(o.comm is None or o.comm.dim == "cp" for o in rec)


def test_torchtitan_tensor_parallelism_without_sequence_parallelism_is_refused():
    # torchtitan's apply_tp shards the norms over the sequence (SequenceParallel) with no option to
    # turn it off; megatron-core's dense layers run tp without SP.
    tt = {"framework": "torchtitan", "parallelism": {"tp": 2, "pp": 1, "sequence_parallel": False}}
    with pytest.raises(UserError, match=r"framework torchtitan runs tensor parallelism \(tp=2\) with sequence parallelism always"):
        _sc(**tt)
    assert not _sc(parallelism={"tp": 2, "pp": 1, "sequence_parallel": False}).parallelism.sequence_parallel
    assert _sc(framework="torchtitan").parallelism.sequence_parallel


def _torchtitan_fsdp(training_dtype: str):
    from simulator.simulate import simulate

    sc = build_scenario({"model": "llama3-8b", "framework": "torchtitan", "training_dtype": training_dtype,
                         "parallelism": {"zero": 3}, "recompute": "selective-op",
                         "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
                         "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
    return simulate(sc, fast_forward=True).report


def test_torchtitan_bf16_training_halves_the_state_not_the_traffic():
    """torchtitan's training.dtype bfloat16: the sharded parameters, their gradients and AdamW's
    moments are bf16 (8 B a parameter against 16), while what FSDP2 gathers (bf16 either way) and
    reduces (fp32, mixed_precision_reduce) does not change; the optimizer step moves 14 B a
    parameter against 28, and the gradient clip reads and writes bf16 gradients."""
    mixed, bf16 = _torchtitan_fsdp("float32"), _torchtitan_fsdp("bfloat16")
    m, b = mixed.per_pp_rank[0]["memory_gib"], bf16.per_pp_rank[0]["memory_gib"]
    for key in ("parameters_gib", "gradients_gib", "optimizer_gib"):
        assert b[key] == pytest.approx(m[key] / 2, rel=1e-12), key
    for key in ("activations_gib", "gathered_parameters_gib", "fsdp_grad_buffers_gib"):
        assert b[key] == pytest.approx(m[key], rel=1e-12), key
    assert bf16.comm_bytes_per_gpu["dp"] == pytest.approx(mixed.comm_bytes_per_gpu["dp"], rel=1e-12)
    # ~1B parameters a rank: 14 B against 28 at the same HBM efficiency, plus the same launches
    assert 0.45 < bf16.step_breakdown_s["optimizer"] / mixed.step_breakdown_s["optimizer"] < 0.55
    assert bf16.step_time_s < mixed.step_time_s


def test_torchtitan_bf16_training_needs_bf16_compute():
    with pytest.raises(UserError, match="training_dtype bfloat16 keeps the parameters in bf16.*set dtype bf16"):
        build_scenario({"model": "llama3-8b", "framework": "torchtitan", "training_dtype": "bfloat16", "dtype": "fp32",
                        "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
                        "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
