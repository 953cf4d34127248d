"""torchtitan + torchao Float8 (tensorwise, `--model.converters=float8`) as the sources run it
(torchao 0.11/0.12 float8_linear.py, float8_ops.py, fsdp_utils.py; torchtitan 0.1.0 SAC policy):
the cast bytes of each linear forward and backward, what per-op SAC reruns, and the FSDP2
FP8 all-gather bytes."""

import pytest

from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.workload.ops import build_layer_ops, fp8_input_recast_bytes_per_elem
from simulator.workload.program import layer_recompute_ops

SEQ = 8192
H, FFN, KV = 4096, 14336, 8 * 128  # Llama 3 8B
T = SEQ  # tokens of one microbatch (micro_batch_size 1)


def _sc(fp8=None, dtype="fp8", recompute="selective-op", **kw):
    base = {"name": "t", "model": "llama3-8b", "parallelism": {"dp": 8, "zero": 3},
            "batch": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": SEQ},
            "framework": "torchtitan", "recompute": recompute, "dtype": dtype,
            "fp8": fp8 or {"recipe": "tensorwise", "param_all_gather": True},
            "cluster": {"gpus": 8, "gpu": "h200-sxm-141gb", "topology": "dgx-h200"}}
    base.update(kw)
    return build_scenario(base)


# (k, n) of each of our linears: qkv fused (wq, wk, wv), wo, w1+w3 fused, w2.
SHAPES = {"qkv_proj": (H, H + 2 * KV), "attn_out_proj": (H, H), "fc1_gate_up": (H, 2 * FFN), "fc2": (FFN, H)}


def test_tensorwise_cast_bytes_per_linear():
    ops = {o.name: o for o in build_layer_ops(_sc())["dense"].forward}
    for name, (k, n) in SHAPES.items():
        cast = ops[f"{name}.fp8_cast"]
        # Forward: amax (2) + one row-major cast (2 read, 1 write) of the input; the weight comes
        # FP8 from the all-gather, so no weight term.
        assert cast.bytes == pytest.approx(5 * T * k)
        # Backward: grad_output amax + cast + transposed copy (6), the input re-cast for grad_weight
        # (5), the FP8 weight transposed for grad_input (1 + 1).
        assert cast.bwd_bytes == pytest.approx(6 * T * n + 5 * T * k + 2 * k * n)
        assert ops[name].fp8
    # Without the FP8 all-gather Float8Linear.forward casts the bf16 weight every microbatch.
    no_ag = {o.name: o for o in build_layer_ops(_sc(fp8={"recipe": "tensorwise"}))["dense"].forward}
    k, n = SHAPES["fc2"]
    assert no_ag["fc2.fp8_cast"].bytes == pytest.approx(5 * T * k + 5 * k * n)
    # Transformer Engine keeps the forward's transposed copy: no input re-cast in backward.
    assert fp8_input_recast_bytes_per_elem("te-delayed") == 0.0
    te = {o.name: o for o in build_layer_ops(_sc(fp8={"recipe": "te-delayed"}))["dense"].forward}
    assert te["fc2.fp8_cast"].bwd_bytes == pytest.approx(4 * T * H)


def test_sac_op_with_float8_recomputes_the_same_mms_and_only_their_casts():
    sc = _sc()
    layer = build_layer_ops(sc)["dense"]
    rec = layer_recompute_ops(sc, layer)
    bf = _sc(dtype="bf16", fp8={"recipe": "te-delayed"})
    rec_bf = layer_recompute_ops(bf, build_layer_ops(bf)["dense"])
    # SAC sees aten.mm on the Float8Tensor operands: the same mms (wk, wo, w3) as bf16.
    gemms = [o.name for o in rec if o.op_class == "gemm"]
    assert gemms == [o.name for o in rec_bf if o.op_class == "gemm"] == ["qkv_proj.mm1", "attn_out_proj",
                                                                            "fc1_gate_up.mm1"]
    assert all(o.fp8 for o in rec if o.op_class == "gemm")
    casts = {o.name: o for o in rec if ".fp8_cast" in o.name}
    # Only the inputs of recomputed GEMMs are re-quantized, without the (saved) amax: 3 B.
    assert set(casts) == {"qkv_proj.fp8_cast.rec", "attn_out_proj.fp8_cast.rec", "fc1_gate_up.fp8_cast.rec"}
    for name, op in casts.items():
        k, _ = SHAPES[name.split(".")[0]]
        assert op.bytes == pytest.approx(3 * T * k)
    # Without the FP8 all-gather the FP8 weight is a recomputed value too: w2's weight re-cast
    # (3 B a parameter) although its mm is saved.
    sc2 = _sc(fp8={"recipe": "tensorwise"})
    rec2 = {o.name: o for o in layer_recompute_ops(sc2, build_layer_ops(sc2)["dense"]) if ".fp8_cast" in o.name}
    assert rec2["fc2.fp8_cast.rec"].bytes == pytest.approx(3 * FFN * H)
    k, n = SHAPES["attn_out_proj"]
    assert rec2["attn_out_proj.fp8_cast.rec"].bytes == pytest.approx(3 * T * k + 3 * k * n)
    # Full AC reruns the whole forward, casts included, at their forward bytes.
    full = _sc(recompute="full")
    lf = build_layer_ops(full)["dense"]
    fwd_casts = [o for o in lf.forward if o.name.endswith(".fp8_cast")]
    assert [o for o in layer_recompute_ops(full, lf) if ".fp8_cast" in o.name] == fwd_casts


def test_fsdp_float8_all_gather_bytes():
    sc = _sc()
    prog = simulate(sc).program
    layer = build_layer_ops(sc)["dense"]
    norms = 2 * H
    # Float8 linears gather their e4m3 data (1 B), the two RMSNorm weights bf16.
    assert prog.unit_gather_bytes[0] == pytest.approx((layer.params - norms) * 1 + norms * 2)
    # Embedding and the LM head are not Float8Linear: bf16.
    V = 128256
    assert prog.unit_gather_bytes[-1] == pytest.approx(V * H * 2)
    assert prog.unit_gather_bytes[32] == pytest.approx((V * H + H) * 2)
    # The plan's all-gathers carry those bytes.
    ev = simulate(sc).timeline.events
    # (on the reduce-scatters' stream: FSDP2's one communicator, Program.fsdp_one_communicator)
    ag = sorted({round(b) for b in ev[ev["name"].astype(str).str.startswith("all_gather params")]["bytes"]})
    # (the embedding and the head are one FSDP unit under torchtitan, the root: gathered together)
    assert ag == sorted({round(prog.unit_gather_bytes[0]), round(prog.unit_gather_bytes[-1] + prog.unit_gather_bytes[32])})
    # bf16 all-gather (no FP8 gather): the generic parameter bytes.
    assert simulate(_sc(fp8={"recipe": "tensorwise"})).program.unit_gather_bytes == {}


def _tp_ops(recipe="tensorwise", recompute="selective-op", framework="torchtitan", tp=8):
    sc = _sc(fp8={"recipe": recipe}, recompute=recompute, framework=framework,
             parallelism={"tp": tp, "dp": 1, "zero": 1, "sequence_parallel": True})
    lo = build_layer_ops(sc)["dense"]
    i_ops, _ = lo.backward()
    return {o.name: o for o in lo.forward}, {o.name: o for o in i_ops}


def test_float8_tensor_parallel_gathers_fp8_and_casts_the_shard():
    # torchao float8_tensor_parallel.py: PrepareFloat8ModuleInput casts the block input on its
    # sequence shard, then all-gathers e4m3 (1 B); Float8RowwiseParallel's output gradient is cast
    # to e5m2 before its backward all-gather (1 B); reduce-scatters stay bf16 (2 B).
    tp = 8
    fwd, bwd = _tp_ops(tp=tp)
    for gather, scatter in (("attn_in", "attn_out"), ("mlp_in", "mlp_out")):
        assert fwd[gather].comm.size_bytes == T * H
        assert bwd[gather + ".bwd"].comm.op == "reduce_scatter" and bwd[gather + ".bwd"].comm.size_bytes == 2 * T * H
        assert fwd[scatter].comm.size_bytes == 2 * T * H
        assert bwd[scatter + ".bwd"].comm.op == "all_gather" and bwd[scatter + ".bwd"].comm.size_bytes == T * H
    names = list(fwd)
    assert names.index("qkv_proj.fp8_cast") < names.index("attn_in") < names.index("qkv_proj")  # cast, then gather
    # the block-input casts see T / tp tokens; the row-parallel inputs are local and whole
    k = SHAPES["qkv_proj"][0]
    full, _ = _tp_ops(framework="generic", tp=tp)
    assert full["qkv_proj.fp8_cast"].bytes - fwd["qkv_proj.fp8_cast"].bytes == pytest.approx(5 * (T - T // tp) * k)
    assert full["attn_out_proj.fp8_cast"].bytes == fwd["attn_out_proj.fp8_cast"].bytes
    # rowwise float8 keeps regular (bf16) TP in torchtitan
    base, _ = _tp_ops(recipe="rowwise", tp=tp)
    assert base["attn_in"].comm.size_bytes == 2 * T * H and base["attn_in"].comm.bwd_size_bytes is None



def test_sac_recasts_a_float8_tp_block_input_on_its_shard():
    # Under Float8 TP the column-parallel inputs are cast on the sequence shard, before the
    # all-gather; SAC's re-cast was sized by the GEMM's M (all T tokens), tp x the shard.
    tp = 8
    sc = _sc(fp8={"recipe": "tensorwise"}, parallelism={"tp": tp, "dp": 1, "zero": 1, "sequence_parallel": True})
    rec = {o.name: o for o in layer_recompute_ops(sc, build_layer_ops(sc)["dense"]) if ".fp8_cast" in o.name}
    for name in ("qkv_proj", "fc1_gate_up"):  # a mm of each recomputed (wk, w3): input re-cast, 3 B
        k, n = SHAPES[name]
        assert rec[name + ".fp8_cast.rec"].bytes == pytest.approx(3 * T // tp * k + 3 * k * n // tp)
    k, n = SHAPES["attn_out_proj"]  # a row-parallel input stays whole on every rank
    assert rec["attn_out_proj.fp8_cast.rec"].bytes == pytest.approx(3 * T * k // tp + 3 * k // tp * n)

@pytest.mark.parametrize("framework,recompute,regather", [
    ("torchtitan", "full", False), ("torchtitan", "none", False), ("torchtitan", "selective-op", True),
    ("generic", "full", True), ("megatron-2021", "none", True),
])
def test_the_sp_input_is_gathered_again_only_where_nothing_kept_it(framework, recompute, regather):
    sc = _sc(dtype="bf16", recompute=recompute, framework=framework,
             parallelism={"tp": 8, "dp": 1, "zero": 1, "sequence_parallel": True})
    i_ops, _ = build_layer_ops(sc)["dense"].backward()
    assert any(o.name.endswith(".input_regather") for o in i_ops) == regather


@pytest.mark.parametrize("framework,regathers", [("torchtitan", 0), ("generic", 1)])
def test_the_lm_head_and_moe_attention_regather_as_the_dense_layer_does(framework, regathers):
    # torchtitan's LM head (never checkpointed) and a MoE layer's attention keep their DTensor-gathered
    # inputs as the dense layer's do; both used to re-gather them (tp 8: 7/8 of T x h x 2 B each).
    sc = _sc(dtype="bf16", recompute="none", framework=framework, model="mixtral-8x7b",
             parallelism={"tp": 8, "dp": 8, "ep": 8, "zero": 1, "sequence_parallel": True},
             batch={"micro_batch_size": 1, "global_batch_size": 8, "seq_length": SEQ},
             cluster={"gpus": 64, "gpu": "h200-sxm-141gb", "topology": "dgx-h200"})
    layers = build_layer_ops(sc)
    head_i, _ = layers["head"].backward()
    moe_i, _ = layers["moe"].backward()
    head_g = [o.comm.size_bytes for o in head_i if o.name.endswith(".input_regather")]
    moe_g = [o.name for o in moe_i if o.name.endswith(".input_regather")]
    assert head_g == [T * 4096 * 2] * regathers
    assert moe_g == ["qkv_proj.input_regather"] * regathers


@pytest.mark.parametrize("recipe,per_elem", [("rowwise", 2), ("tensorwise", 1)])
def test_per_op_sac_regathers_a_float8_tp_input_as_its_forward_gathered_it(recipe, per_elem):
    """torchtitan's per-op SAC does not save the SP all-gather's output, so backward gathers a
    column-parallel input again, past its Float8 cast: bf16 where the forward gathered bf16
    (rowwise: no float8 TP), 1 byte where float8 tensorwise TP gathered e4m3."""
    sc = _sc(fp8={"recipe": recipe}, parallelism={"tp": 2, "dp": 4, "zero": 3, "sequence_parallel": True})
    dense = build_layer_ops(sc)["dense"]
    regathers = {o.name: o.comm.size_bytes for o in dense.backward()[0] if o.name.endswith(".input_regather")}
    assert regathers == {"qkv_proj.input_regather": T * H * per_elem, "fc1_gate_up.input_regather": T * H * per_elem}
    gathers = [o.comm.size_bytes for o in dense.forward if o.comm is not None and o.comm.op == "all_gather"]
    assert gathers == [T * H * per_elem] * 2
