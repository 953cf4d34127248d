"""FP8 training: GEMMs at the FP8 tensor-core peak only where they are compute-bound, their
quantization kernels, FP8 weight all-gathers, memory, and refusal on GPUs without FP8."""

import numpy as np
import pytest

from simulator.profile import load_profile
from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.workload.ops import build_layer_ops
from simulator.workload.program import fp8_speedup


def _sc(dtype="bf16", gpu="h100-sxm-80gb", topo="dgx-h100-fattree", recipe="te-delayed", **par):
    return build_scenario({
        "model": "llama3-8b", "parallelism": {"tp": 1, "pp": 1, "zero": 1, **par},
        "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
        "dtype": dtype, "fp8": {"recipe": recipe},
        "cluster": {"gpus": 8, "gpu": gpu, "topology": topo},
    })


def _gemm_time(profile, flops, bytes_, fp8):
    speed = profile.compute.peak_tflops_fp8 / profile.compute.peak_tflops if fp8 else 1.0
    return float(profile.compute_time_s(np.array(["gemm"]), np.array([flops / speed]), np.array([bytes_]))[0])


def test_fp8_doubles_only_compute_bound_gemms():
    prof = load_profile("h100-sxm-80gb")
    # Large GEMM 8192^3: compute-bound, FP8 ~2x faster (within the fixed per-kernel cost).
    n = 8192
    big_bf16 = _gemm_time(prof, 2.0 * n**3, 3 * n * n * 2, False)
    big_fp8 = _gemm_time(prof, 2.0 * n**3, 2 * n * n * 1 + n * n * 2, True)
    assert big_bf16 / big_fp8 == pytest.approx(2.0, rel=0.05)
    # Memory-bound GEMM (65536 tokens x K=64 -> 4096): its bf16 output dominates the bytes.
    m, k, nn = 65536, 64, 4096
    mem_bf16 = _gemm_time(prof, 2.0 * m * k * nn, (m * k + k * nn + m * nn) * 2, False)
    mem_fp8 = _gemm_time(prof, 2.0 * m * k * nn, (m * k + k * nn) * 1 + m * nn * 2, True)
    assert mem_bf16 / mem_fp8 < 1.05
    # Small GEMM 512^3: latency-bound (the fixed per-kernel cost dominates), barely faster.
    s_bf16 = _gemm_time(prof, 2.0 * 512**3, 3 * 512 * 512 * 2, False)
    s_fp8 = _gemm_time(prof, 2.0 * 512**3, 2 * 512 * 512 + 512 * 512 * 2, True)
    assert s_bf16 / s_fp8 < 1.1


def test_fp8_step_faster_on_linears_and_pays_casts():
    bf16 = simulate(_sc()).report.step_time_s
    fp8 = simulate(_sc("fp8")).report.step_time_s
    # Linears get faster, attention, norms and the casts do not: well under 2x overall.
    assert 1.05 < bf16 / fp8 < 1.8
    ops = build_layer_ops(_sc("fp8"))["dense"].forward
    casts = [o for o in ops if o.name.endswith(".fp8_cast")]
    assert len(casts) == 4 and all(o.bytes > 0 and o.bwd_bytes > 0 for o in casts)
    assert [o for o in ops if o.name == "attention"][0].fp8 is False  # attention stays bf16
    # Current scaling pays an extra amax pass over delayed scaling.
    cur = simulate(_sc("fp8", recipe="te-current")).report.step_time_s
    assert cur > fp8


def test_fp8_refused_without_fp8_tensor_cores():
    with pytest.raises(UserError, match="FP8 tensor cores"):
        simulate(_sc("fp8", gpu="a100-sxm-80gb", topo="dgx-a100-fattree"))
    with pytest.raises(UserError, match="MXFP8"):
        simulate(_sc("fp8", recipe="mxfp8"))
    assert fp8_speedup(_sc("fp8", recipe="mxfp8", gpu="b200", topo="dgx-b200"), load_profile("b200")) == pytest.approx(2.0)


def test_fp8_weight_all_gather_and_memory():
    base = dict(zero=3)
    sc = _sc("fp8", recipe="tensorwise", **base)
    sc8 = sc.model_copy(update={"fp8": sc.fp8.model_copy(update={"param_all_gather": True})})
    r16 = simulate(sc)
    r8 = simulate(sc8)
    assert r8.program.param_bytes == 1 and r16.program.param_bytes == 2
    # FP8 linears save FP8 inputs: fewer activation bytes than bf16; TE caches FP8 weights.
    m_bf16 = simulate(_sc()).memory.per_rank_gib[0]
    m_te = simulate(_sc("fp8")).memory.per_rank_gib[0]
    assert m_te["activations_gib"] < m_bf16["activations_gib"]
    assert m_te["fp8_weights_gib"] == pytest.approx(2 * 32 * 218.1e6 / 2**30, rel=0.02)


def test_fp8_moe_experts_quantized():
    sc = build_scenario({
        "model": "mixtral-8x7b", "parallelism": {"tp": 1, "pp": 1, "ep": 8, "zero": 1},
        "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
        "dtype": "fp8", "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
    })
    ops = {o.name: o for o in build_layer_ops(sc)["moe"].forward}
    assert ops["experts_fc1"].fp8 and ops["experts_fc2"].fp8 and not ops["router"].fp8
    assert ops["experts_fc1.fp8_cast"].bytes > 0
    bf16 = simulate(sc.model_copy(update={"dtype": "bf16"})).report.step_time_s
    assert simulate(sc).report.step_time_s < bf16


def test_an_fp8_report_names_its_share_of_the_fp8_peak():
    # MFU is over the BF16 peak (torchtitan's and Megatron's convention), so an FP8 run can report
    # more than 100% of it (70B ZeRO-3 on 8 H100: 104.6%); the setup carries the FP8 peak beside it.
    from simulator.simulate import scenario_setup

    assert scenario_setup(_sc("fp8"))["fp8_peak_tflops"] == load_profile("h100-sxm-80gb").compute.peak_tflops_fp8 == 1978.9
    assert scenario_setup(_sc("bf16"))["fp8_peak_tflops"] is None
    if load_profile("b200").compute.peak_tflops_mxfp8:
        setup = scenario_setup(_sc("fp8", gpu="b200", topo="dgx-b200", recipe="mxfp8"))
        assert setup["fp8_peak_tflops"] == load_profile("b200").compute.peak_tflops_mxfp8


@pytest.mark.parametrize("recipe,per_elem,grad_copies", [("te-delayed", 1.0, 1), ("te-current", 1.0, 1),
                                                         ("mxfp8", 1.0 + 1 / 32, 2)])
def test_transformer_engine_fp8_sequence_parallel_gathers_fp8_and_regathers(recipe, per_elem, grad_copies):
    """TE under FP8 with SP all-gathers the quantized shard (input forward, its backward
    re-gather, the row-parallel output's gradient) and reduce-scatters bf16. The re-gather for
    the weight gradient used to be dropped under FP8: the cast sat between gather and GEMM."""
    gpu, topo = ("b200", "dgx-b200") if recipe == "mxfp8" else ("h100-sxm-80gb", "dgx-h100-fattree")
    sc = _sc("fp8", gpu=gpu, topo=topo, recipe=recipe, tp=2, sequence_parallel=True)
    dense = build_layer_ops(sc)["dense"]
    i_ops, _ = dense.backward()
    T, h = 4096, 4096
    fp8_bytes, bf16_bytes = T * h * per_elem, T * h * 2
    fwd = [(o.name, o.comm.op, o.comm.size_bytes) for o in dense.forward if o.comm is not None]
    assert fwd == [("attn_in", "all_gather", fp8_bytes), ("attn_out", "reduce_scatter", bf16_bytes),
                   ("mlp_in", "all_gather", fp8_bytes), ("mlp_out", "reduce_scatter", bf16_bytes)]
    bwd = {(o.name, o.comm.op): o.comm.size_bytes for o in i_ops if o.comm is not None}
    # MXFP8 gathers the output gradient's row-wise and column-wise copies (each with its scales).
    grad_bytes = grad_copies * fp8_bytes
    assert bwd == {("mlp_out.bwd", "all_gather"): grad_bytes, ("fc1_gate_up.input_regather", "all_gather"): fp8_bytes,
                   ("mlp_in.bwd", "reduce_scatter"): bf16_bytes, ("attn_out.bwd", "all_gather"): grad_bytes,
                   ("qkv_proj.input_regather", "all_gather"): fp8_bytes, ("attn_in.bwd", "reduce_scatter"): bf16_bytes}
    # bf16 gathers and re-gathers the same tensors at 2 bytes an element.
    bf16 = build_layer_ops(_sc("bf16", gpu=gpu, topo=topo, tp=2, sequence_parallel=True))["dense"]
    assert sorted(o.name for o in bf16.backward()[0] if o.comm is not None) == sorted(n for n, _ in bwd)


def test_te_fp8_leaves_a_gather_that_feeds_no_fp8_linear_in_bf16():
    # tp 16 > 8 KV heads: megatron-core all-gathers the QKV GEMM's bf16 output (qkv_group_gather).
    sc = build_scenario({
        "model": "llama3-8b", "parallelism": {"tp": 16, "pp": 1, "sequence_parallel": True},
        "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 4096},
        "dtype": "fp8", "fp8": {"recipe": "te-delayed"},
        "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
    ops = build_layer_ops(sc)["dense"].forward
    group = next(o for o in ops if o.name == "qkv_group_gather")
    assert group.comm.size_bytes == 4096 * (32 + 2 * 8) * 128 * 2
    assert next(o for o in ops if o.name == "attn_in").comm.size_bytes == 4096 * 4096 * 1


def test_mxfp8_userbuffers_gather_one_copy_of_the_output_gradient():
    # TE linear.py backward: userbuffers carry one usage at a time, the row-wise one for dgrad.
    sc = _sc("fp8", gpu="b200", topo="dgx-b200", recipe="mxfp8", tp=2, sequence_parallel=True, tp_comm_overlap=True)
    dense = build_layer_ops(sc)["dense"]
    grad = next(o for o in dense.backward()[0] if o.name == "mlp_out.bwd")
    assert grad.comm.size_bytes == 4096 * 4096 * (1 + 1 / 32)


@pytest.mark.parametrize("recipe,gpu,full_b,shard_b,transpose_b", [
    ("te-delayed", "h100-sxm-80gb", 2.0, 0.0, 2.0), ("te-current", "h100-sxm-80gb", 4.0, 3.0, 2.0),
    ("mxfp8", "b200", 4 + 2 / 32, 4 + 2 / 32, 0.0),
    # Compute capability 10.x: per-tensor FP8 writes the row-wise copy only and transposes nothing.
    ("te-delayed", "b200", 0.0, 0.0, 0.0), ("te-current", "b200", 3.0, 3.0, 0.0)])
def test_te_fp8_sequence_parallel_quantizes_the_shard_and_transposes_the_gathered_copy(recipe, gpu, full_b, shard_b, transpose_b):
    """TE under SP quantizes a norm-fed input on its T / tp shard before the FP8 gather (delayed
    scaling inside the norm kernel, current scaling after a norm that writes the amax, MXFP8 both
    copies with scales); per-tensor scaling transposes the gathered copy in backward, MXFP8
    re-gathers its column-wise copy instead. Without SP the norm-fed cast quantizes all T tokens
    into both copies (``full_b`` bytes an element, test_te_fp8_quantizes_a_norm_fed_input_inside_the_norm)."""
    topo = "dgx-b200" if gpu == "b200" else "dgx-h100-fattree"
    T, tp, h = 4096, 2, 4096
    sp = {o.name: o for o in build_layer_ops(_sc("fp8", gpu=gpu, topo=topo, recipe=recipe, tp=tp,
                                                 sequence_parallel=True))["dense"].forward}
    full = {o.name: o for o in build_layer_ops(_sc("fp8", gpu=gpu, topo=topo, recipe=recipe, tp=tp,
                                                   sequence_parallel=False))["dense"].forward}
    for name in ("qkv_proj", "fc1_gate_up"):
        k = sp[name].kernel.k
        assert k == h
        assert sp[name + ".fp8_cast"].bytes - full[name + ".fp8_cast"].bytes == pytest.approx(T // tp * k * shard_b - T * k * full_b)
        assert sp[name + ".fp8_cast"].bwd_bytes - full[name + ".fp8_cast"].bwd_bytes == pytest.approx(T * k * transpose_b)
    # The row-parallel inputs are not gathered: their casts are the same with and without SP.
    for name in ("attn_out_proj", "fc2"):
        assert sp[name + ".fp8_cast"].bytes == full[name + ".fp8_cast"].bytes


@pytest.mark.parametrize("recipe,gpu,norm_fed_b,cast_b", [("te-delayed", "h100-sxm-80gb", 2.0, 4.0),
                                                         ("te-current", "h100-sxm-80gb", 4.0, 6.0),
                                                         ("te-delayed", "b200", 0.0, 3.0), ("te-current", "b200", 3.0, 5.0)])
def test_te_fp8_quantizes_a_norm_fed_input_inside_the_norm(recipe, gpu, norm_fed_b, cast_b):
    """Without SP, TE's LayerNormLinear hands the norm its input quantizer: delayed scaling writes
    FP8 from the norm kernel and transposes it (2 B an element), current scaling has the norm
    write the amax and then cast-transposes (4 B); TE Linear (fc2, the attention output) keeps a
    separate cast-transpose (4 B, 6 B with current scaling's amax pass)."""
    topo = "dgx-b200" if gpu == "b200" else "dgx-h100-fattree"
    ops = {o.name: o for o in build_layer_ops(_sc("fp8", gpu=gpu, topo=topo, recipe=recipe))["dense"].forward}
    T, h, ffn, qkv = 4096, 4096, 14336, (32 + 2 * 8) * 128
    w_f = cast_b  # one microbatch a step: the weight cast every microbatch
    assert ops["qkv_proj.fp8_cast"].bytes == pytest.approx(T * h * norm_fed_b + h * qkv * w_f)
    assert ops["fc1_gate_up.fp8_cast"].bytes == pytest.approx(T * h * norm_fed_b + h * 2 * ffn * w_f)
    assert ops["fc2.fp8_cast"].bytes == pytest.approx(T * ffn * cast_b + ffn * h * w_f)


@pytest.mark.parametrize("recipe,copies", [("te-delayed", 1), ("te-current", 1), ("mxfp8", 2)])
def test_blackwell_per_tensor_fp8_caches_no_weight_transpose(recipe, copies):
    """TE caches each linear weight's FP8 copy across microbatches; on Hopper per-tensor scaling
    adds its transpose (2 bytes a parameter), on compute capability 10.x one row-wise buffer serves
    both GEMM layouts (1 byte), while MXFP8 keeps its two block-scaled copies on any GPU."""
    def cached(gpu, topo, r):
        return simulate(_sc("fp8", gpu=gpu, topo=topo, recipe=r)).memory.per_rank_gib[0]["fp8_weights_gib"]

    hopper = cached("h100-sxm-80gb", "dgx-h100-fattree", "te-delayed")
    assert cached("b200", "dgx-b200", recipe) == pytest.approx(hopper * copies / 2, rel=1e-12)
    assert not _sc("fp8", gpu="b200", topo="dgx-b200").te_fp8_transposes and _sc("fp8").te_fp8_transposes


@pytest.mark.parametrize("gpu,topo,fix", [("h100-sxm-80gb", "dgx-h100-fattree", "use fp8.recipe te-delayed, te-current, tensorwise or rowwise"),
                                          ("a100-sxm-80gb", "dgx-a100-fattree", "use dtype bf16, or a b200/gb200 profile")])
def test_mxfp8_refusal_names_a_fix_that_works_on_the_gpu(gpu, topo, fix):
    # A GPU without any FP8 tensor cores cannot take the per-tensor recipes either.
    with pytest.raises(UserError, match=rf"fp8 recipe mxfp8 needs MXFP8 tensor cores.*{fix}"):
        simulate(_sc("fp8", gpu=gpu, topo=topo, recipe="mxfp8"))


@pytest.mark.parametrize("sp", [False, True])
def test_delayed_scaling_norm_writes_its_output_in_fp8(sp):
    """TE's fused norm under delayed scaling (Impl::FULLY_FUSED) writes the FP8 output itself: it
    reads 2 bytes an element and writes 1, on the sequence shard under SP. Current scaling's norm
    writes bf16 (then the quantize reads it). The backward, on bf16 tensors, is the same."""
    from simulator.workload.ops import build_layer_ops

    def norms(recipe):
        lo = build_layer_ops(_sc("fp8", recipe=recipe, tp=2, sequence_parallel=sp))["dense"]
        fwd = {o.name: o for o in lo.forward}
        bwd = {o.name: o for o in lo.backward()[0]}
        return fwd, bwd

    T, h = 4096, 4096
    Tn = T // 2 if sp else T
    (df, db), (cf, cb) = norms("te-delayed"), norms("te-current")
    for name in ("attn_norm", "mlp_norm"):
        assert cf[name].bytes == pytest.approx(4 * Tn * h)
        assert df[name].bytes == pytest.approx(3 * Tn * h)
        assert db[name + ".bwd"].bytes == pytest.approx(cb[name + ".bwd"].bytes) == pytest.approx(8 * Tn * h)
