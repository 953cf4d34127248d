"""Context parallelism against the framework sources: torch's context-parallel SDPA as torchtitan
runs it (torch 2.13 / 2.6.0 distributed/tensor/experimental _attention.py) and Transformer
Engine's CP attention as megatron-core runs it (TE 2.20.2 pytorch/attention/dot_product_attention/
context_parallel.py: AttnFuncWithCPAndKVP2P, AttnFuncWithCPAndKVAllGather)."""

import pytest

from simulator.scenario import build_scenario
from simulator.workload.ops import build_layer_ops

SEQ = 8192
B = 1
HEADS, KV_HEADS, D = 32, 8, 128  # Llama 3 8B


def _sc(framework="generic", cp=4, attn="allgather", seq=SEQ, recompute="none", **kw):
    par = {"dp": 8 // cp, "cp": cp, "zero": 3 if framework == "torchtitan" else 1, "cp_attention": attn}
    return build_scenario({"name": "t", "model": "llama3-8b", "framework": framework, "recompute": recompute,
                           "parallelism": par,
                           "batch": {"micro_batch_size": B, "global_batch_size": 8 // cp, "seq_length": seq},
                           "cluster": {"gpus": 8, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, **kw})


def _cp(ops):
    """(name, op, bytes, overlap) of the cp collectives in order (JOINs as op "join")."""
    return [(o.name, o.comm.op, o.comm.size_bytes, o.comm.overlap) for o in ops if o.comm is not None and o.comm.dim == "cp"]


def _seq(ops):
    """The names of the attention kernels and cp collectives, in order."""
    return [o.name for o in ops if o.op_class == "attention" or (o.comm is not None and o.comm.dim == "cp")]


def test_torch_cp_gather_waited_before_step_one():
    """_AllGatherRotater: the all-gather leaves before step 0's SDPA and next_buffer waits for it at
    step 1; without a JOIN the overlapped gather ran on under every later step and the MLP."""
    fwd = build_layer_ops(_sc("torchtitan"))["dense"].forward
    assert _seq(fwd) == ["cp_kv_all_gather", "attention_step0", "cp_kv_all_gather.wait",
                         "attention_step1", "attention_step2", "attention_step3"]
    E = SEQ // 4 * HEADS * D
    assert _cp(fwd) == [("cp_kv_all_gather", "all_gather", 4 * 2 * E * 2, True), ("cp_kv_all_gather.wait", "join", 0.0, False)]


def test_torch_cp_backward_regathers_kv_and_rotates_fp32_dkv():
    """_templated_ring_attention_backward: the K/V rotater gathers K/V again before step 0's
    backward (not a reduce-scatter of them), and after each step's backward cat(dK, dV) in fp32
    goes to the next rank (the dK/dV rotater is all-to-all whatever the method), waited after the
    next step; the last at once."""
    i_ops, _ = build_layer_ops(_sc("torchtitan"))["dense"].backward()
    E = SEQ // 4 * HEADS * D
    assert _seq(i_ops) == ["cp_kv_all_gather.regather", "attention_step0.bwd", "cp_dkv_rotate0",
                           "attention_step1.bwd", "cp_dkv_rotate1", "attention_step2.bwd", "cp_dkv_rotate2",
                           "attention_step3.bwd", "cp_dkv_rotate3", "cp_dkv_rotate.wait"]
    comms = _cp(i_ops)
    assert comms[0] == ("cp_kv_all_gather.regather", "all_gather", 4 * 2 * E * 2, True)
    assert [c[1:] for c in comms[1:5]] == [("ring_step", 2 * E * 4, True)] * 4
    assert comms[5][1] == "join"
    assert not any(c[1] == "reduce_scatter" for c in comms)
    # The steps' backward kernels: twice the forward's FLOPs, backward kernels of the same shapes.
    fwd = {o.name: o for o in build_layer_ops(_sc("torchtitan"))["dense"].forward}
    for o in i_ops:
        if o.op_class == "attention":
            f = fwd[o.name.removesuffix(".bwd")]
            assert o.kernel.backward and (o.kernel.m, o.kernel.n) == (f.kernel.m, f.kernel.n)
            assert o.exec_flops == pytest.approx(2 * f.exec_flops) and o.model_flops == pytest.approx(2 * f.model_flops)


def test_torch_cp_alltoall_rotate_method():
    """torchtitan's context_parallel_rotate_method "alltoall" (scenario cp_attention ring):
    _AllToAllRotater permutes K/V to the next rank before every step but the last, waited at the
    next step; backward the K/V permute and the fp32 dK/dV permute leave together after each step."""
    cp = 4
    sc = _sc("torchtitan", cp=cp, attn="ring")
    E = SEQ // cp * HEADS * D
    kv, dkv = 2 * E * 2, 2 * E * 4
    fwd = build_layer_ops(sc)["dense"].forward
    assert _seq(fwd) == ["cp_kv_rotate0", "attention_step0", "cp_kv_rotate1", "attention_step1", "cp_kv_rotate2",
                         "attention_step2", "cp_kv_rotate.wait", "attention_step3"]
    assert [c[2] for c in _cp(fwd) if c[1] == "ring_step"] == [kv] * (cp - 1)
    i_ops, _ = build_layer_ops(sc)["dense"].backward()
    sizes = [c[2] for c in _cp(i_ops) if c[1] == "ring_step"]
    # K/V for step 1 before step 0; after step i dK/dV with K/V for step i + 2.
    assert sizes == [kv, dkv + kv, dkv + kv, dkv, dkv]
    assert sum(sizes) == pytest.approx((cp - 1) * kv + cp * dkv)
    assert _cp(i_ops)[-1][1] == "join"


def test_te_p2p_ring():
    """TE's p2p ring (megatron-core's default cp_comm_type): K/V blocks (KV heads only) pass while a
    step computes, the last waited before the last step; the steps are the load-balanced sections
    timed by shape; backward sends K/V at step 0, K/V with dK/dV after, dK/dV alone at the last
    step, each under its own step's kernel: 2 (cp - 1) blocks where the reversed forward sent cp - 1."""
    cp = 4
    sc = _sc(cp=cp, attn="ring")
    s = SEQ // cp
    kv = 2 * B * s * KV_HEADS * D * 2
    fwd = build_layer_ops(sc)["dense"].forward
    assert _seq(fwd) == ["cp_kv_ring_step0", "attention_block0", "cp_kv_ring_step1", "attention_block1",
                         "cp_kv_ring_step2", "attention_block2", "cp_kv_ring.wait", "attention_block3"]
    assert [c[2] for c in _cp(fwd) if c[1] == "ring_step"] == [kv] * (cp - 1)
    blocks = [o for o in fwd if o.op_class == "attention"]
    assert [(o.kernel.m, o.kernel.n, o.kernel.causal) for o in blocks] == [
        (s, s, True), (s, s // 2, False), (s, s // 2, False), (s // 2, s, False)]
    i_ops, _ = build_layer_ops(sc)["dense"].backward()
    assert _seq(i_ops) == ["cp_kv_ring_step0.bwd", "attention_block0.bwd", "cp_kv_ring_step1.bwd",
                           "attention_block1.bwd", "cp_kv_ring_step2.bwd", "attention_block2.bwd",
                           "cp_kv_ring_step3.bwd", "attention_block3.bwd", "cp_kv_ring.wait.bwd"]
    sizes = [c[2] for c in _cp(i_ops) if c[1] == "ring_step"]
    assert sizes == [kv, 2 * kv, 2 * kv, kv] and sum(sizes) == 2 * (cp - 1) * kv


def test_te_ring_merge_bytes():
    """The ring's elementwise passes (bf16): forward the K/V cat (4 B a K/V element), step 0's
    output cloned (4) and each later step folded in, whole (6) on a lower-triangle step, half (3) on
    an upper one: at cp 2 rank 0's step 1 is upper, rank 1's lower, mean 4.5. Backward the K/V copy
    (4) and dq / dK, dV folded in per step, section by section (mean 8.5 each at cp 2)."""
    from simulator.workload.ops import te_cp_merge_op

    fwd = te_cp_merge_op(1.0, 0.0, 2, 2)
    assert fwd.bytes == pytest.approx(4 + 4.5)
    assert fwd.bwd_bytes == pytest.approx((2 + 5 + 4 + 6) / 2)  # dq: rank 0 half copy, first-half copy + add; rank 1 copy, add
    kv = te_cp_merge_op(0.0, 1.0, 2, 2)
    assert kv.bytes == pytest.approx(4)
    assert kv.bwd_bytes == pytest.approx(4 + (4 + 5 + 2 + 6) / 2)  # dK/dV: rank 0 copy, half add + half copy; rank 1 half copy, add


def test_te_allgather_backward_regathers_kv():
    """TE's all_gather CP backward gathers K and V again (gather_along_first_dim, blocking) before
    the attention gradients and reduce-scatters dK, dV after: the backward moved only the latter."""
    sc = _sc(cp=4)
    fwd = build_layer_ops(sc)["dense"].forward
    i_ops, _ = build_layer_ops(sc)["dense"].backward()
    size = 2 * B * SEQ * KV_HEADS * D * 2
    assert _cp(fwd) == [("cp_kv_all_gather", "all_gather", size, False)]
    assert _seq(i_ops) == ["cp_kv_all_gather.regather", "attention.bwd", "cp_kv_all_gather.bwd"]
    assert [c[1:] for c in _cp(i_ops)] == [("all_gather", size, False), ("reduce_scatter", size, False)]


@pytest.mark.parametrize("framework,attn", [("torchtitan", "allgather"), ("torchtitan", "ring"),
                                            ("generic", "allgather"), ("generic", "ring")])
def test_cp_metamorphic(framework, attn):
    """cp ranks together run the full causal attention; every op outside attention sees s/cp tokens;
    forward + backward model FLOPs of attention are 3x the forward's, whichever way the backward
    was built."""
    cp = 4
    one = build_layer_ops(_sc(framework, cp=1, attn=attn))["dense"]
    many = build_layer_ops(_sc(framework, cp=cp, attn=attn))["dense"]
    assert not _cp(one.forward)
    a1 = [o for o in one.forward if o.op_class == "attention"]
    an = [o for o in many.forward if o.op_class == "attention"]
    assert cp * sum(o.exec_flops for o in an) == pytest.approx(sum(o.exec_flops for o in a1))
    assert cp * sum(o.model_flops for o in an) == pytest.approx(sum(o.model_flops for o in a1))
    i_ops, w_ops = many.backward()
    bwd_attn = [o for o in i_ops if o.op_class == "attention"]
    assert sum(o.model_flops for o in bwd_attn) == pytest.approx(2 * sum(o.model_flops for o in an))
    ones = {o.name: o for o in one.forward}
    outside = [o for o in many.forward if o.comm is None and o.op_class != "attention" and "merge" not in o.name]
    assert outside
    for o in outside:
        ref = ones[o.name]
        assert o.exec_flops == pytest.approx(ref.exec_flops / cp)
        if o.op_class == "gemm":
            k, rk = o.kernel, ref.kernel
            assert (k.m, k.n, k.k) == (rk.m // cp, rk.n, rk.k)
        elif o.name != "fsdp_copy_out":  # parameters, not tokens
            assert o.bytes == pytest.approx(ref.bytes / cp)


def test_torch_cp_last_dkv_rotation_is_exposed():
    """The last fp32 dK/dV permute is waited as soon as it leaves (next_buffer after the loop):
    exposed cp time, where the model had none (its backward reduce-scatter overlapped the rest)."""
    from simulator.simulate import simulate

    res = simulate(_sc("torchtitan", cp=2, recompute="full"))
    assert res.report.exposed_comm_s["cp"] > 0


def test_sac_keeps_one_sdpa_output_under_cp():
    """Per-op SAC saves the SDPA op's outputs once (the merged output and logsumexp of the rank's
    queries), not each CP step's, and never reruns the merge that runs inside that op."""
    from simulator.workload.program import layer_recompute_ops, selective_op_saved_bytes

    saved = []
    for cp in (1, 2, 4):
        sc = _sc("torchtitan", cp=cp, seq=SEQ * cp, recompute="selective-op")
        lo = build_layer_ops(sc)["dense"]
        saved.append(selective_op_saved_bytes(sc, lo))
        assert "cp_sdpa_merge" not in {o.name for o in layer_recompute_ops(sc, lo)}
    assert saved[1] == pytest.approx(saved[0]) and saved[2] == pytest.approx(saved[0])


def test_megatron_selective_recompute_reruns_the_ring_merge():
    from simulator.workload.program import layer_recompute_ops

    sc = _sc(cp=2, attn="ring", recompute="selective")
    assert "cp_ring_merge" in {o.name for o in layer_recompute_ops(sc, build_layer_ops(sc)["dense"])}


def test_torch_cp_attention_working_set_memory():
    """torch's CP attention backward holds the gathered K/V (all heads, whole sequence), the step's
    K/V cat, fp32 dq and three fp32 dK/dV buffers, and the step's bf16 gradients beside the layer's
    activations; the alltoall rotater three K/V blocks instead of the whole sequence."""
    from simulator.simulate import simulate
    from simulator.workload.memory import cp_attention_working_set_bytes

    cp = 4
    E = SEQ // cp * HEADS * D
    sc = _sc("torchtitan", cp=cp, recompute="full")
    assert cp_attention_working_set_bytes(sc) == pytest.approx((cp + 1) * 4 * E + 4 * E + 24 * E + 6 * E)
    assert cp_attention_working_set_bytes(_sc("torchtitan", cp=cp, attn="ring")) == pytest.approx(
        3 * 4 * E + 4 * E + 24 * E + 6 * E)
    assert cp_attention_working_set_bytes(_sc(cp=cp)) == 0.0
    assert cp_attention_working_set_bytes(_sc("torchtitan", cp=1)) == 0.0
    row = simulate(sc).memory.per_rank_gib[0]
    assert row["cp_attention_working_set_gib"] == pytest.approx(cp_attention_working_set_bytes(sc) / 2**30)


@pytest.mark.parametrize("framework, expected", [("generic", "ring"), ("torchtitan", "allgather")])
def test_cp_attention_defaults_to_the_frameworks_own_method(framework, expected):
    """Unset, cp_attention is what the framework runs by default: megatron-core passes cp_comm_type
    None to TE as "p2p" (the K/V ring), torch's context_parallel all-gathers K/V (torchtitan's
    context_parallel_rotate_method "allgather"). Set, it is kept whatever the framework."""
    default = _sc(framework, attn=None)
    assert default.parallelism.cp_attention is None and default.cp_attention == expected
    other = "allgather" if expected == "ring" else "ring"
    assert _cp(build_layer_ops(default)["dense"].forward) == _cp(build_layer_ops(_sc(framework, attn=expected))["dense"].forward)
    assert _cp(build_layer_ops(default)["dense"].forward) != _cp(build_layer_ops(_sc(framework, attn=other))["dense"].forward)
    assert _sc(framework, attn=other).cp_attention == other


@pytest.mark.parametrize("given, method", [("p2p", "ring"), ("all_gather", "allgather"), ("alltoall", "ring")])
def test_cp_attention_takes_the_frameworks_own_names(given, method):
    # megatron-core's cp_comm_type names and torchtitan's context_parallel_rotate_method names.
    assert _sc(attn=given).cp_attention == method


def test_ulysses_cp_is_refused_with_the_methods_that_are_modelled():
    from simulator.errors import UserError

    with pytest.raises(UserError, match=r"cp_attention: 'a2a' \(Ulysses-style all-to-all CP\) is not modelled: use ring"):
        _sc(attn="a2a")
