"""Weight gradients: a tied LM head still runs its weight-gradient GEMM (dW = G^T X) every
microbatch, its matrix counted once on the embedding; without gradient-accumulation fusion every
microbatch adds each weight's gradient into the main gradient in a pass over HBM."""

import pytest

from simulator.calibrate.published import vtrain_scenario
from simulator.scenario import build_scenario
from simulator.workload.ops import build_layer_ops


def _row(pp: int) -> dict:
    return {"hidden size": "1024", "# layers": "4", "attention heads": "16", "sequence length": "1024",
            "tensor parallelism": "1", "pipeline parallelism": str(pp), "data parallelism": "1",
            "micro batch": "1", "global batch": "4", "# GPUs": str(pp)}


@pytest.mark.parametrize("pp", [1, 2])
def test_tied_head_runs_its_weight_gradient_gemm(pp: int):
    sc = build_scenario(vtrain_scenario(_row(pp)))
    layers = build_layer_ops(sc)
    head = layers["head"]
    _, w_ops = head.backward()
    wgrad = [o for o in w_ops if o.name == "lm_head.wgrad"]
    assert len(wgrad) == 1
    T, h, V = 1024, 1024, sc.model.vocab_size
    assert wgrad[0].exec_flops == pytest.approx(2.0 * T * h * V)
    # pp=1: one matrix, owned by the embedding (its gradient is reduced once); pp>1: each stage
    # holds its copy and the two are all-reduced between first and last stage (step terms).
    counted = wgrad[0].params
    assert counted == (0.0 if pp == 1 else pytest.approx(V * h))
    assert layers["embedding"].params >= V * h


def _gpt(dtype: str, fusion: bool, zero: int = 0, framework: str = "generic") -> dict:
    data = vtrain_scenario(_row(1))
    data["framework"] = framework
    data["dtype"] = dtype
    data["parallelism"]["grad_accumulation_fusion"] = fusion
    data["parallelism"]["zero"] = zero
    return data


@pytest.mark.parametrize("dtype,per_param", [("fp16", 6.0), ("bf16", 10.0)])
def test_unfused_gradient_accumulation_is_one_pass_per_weight(dtype: str, per_param: float):
    # Without the fusion every microbatch adds each weight's gradient into the main gradient:
    # read main (fp16 runs keep it fp16, bf16 runs fp32), read the fresh 2-byte gradient, write main.
    sc = build_scenario(_gpt(dtype, fusion=False))
    dense = build_layer_ops(sc)["dense"]
    _, w_ops = dense.backward()
    acc = {o.name: o for o in w_ops if o.name.endswith(".grad_accumulate")}
    wgrad = {o.name: o for o in w_ops if o.name.endswith(".wgrad")}
    assert set(acc) == {n.replace(".wgrad", ".grad_accumulate") for n in wgrad}
    fc1 = wgrad["fc1.wgrad"]
    assert acc["fc1.grad_accumulate"].bytes == pytest.approx(fc1.params * per_param)
    # The pass carries no parameters of its own (the DP reduction counts each weight once) and
    # no launch of its own (the wgrad op counts AccumulateGrad's add).
    assert all(o.params == 0 and o.launches == 0 for o in acc.values())


@pytest.mark.parametrize("fusion,zero", [(True, 0), (False, 3)])
def test_no_accumulation_pass_with_the_fusion_or_under_fsdp(fusion: bool, zero: int):
    sc = build_scenario(_gpt("bf16", fusion=fusion, zero=zero))
    _, w_ops = build_layer_ops(sc)["dense"].backward()
    assert not [o for o in w_ops if o.name.endswith(".grad_accumulate")]


@pytest.mark.parametrize("framework,adds", [("generic", 4), ("megatron-2021", 4), ("megatron-deepspeed", 3)])
def test_deepspeed_first_microbatch_takes_the_gradient_without_an_add(framework: str, adds: int):
    # DeepSpeed's FP16_Optimizer.step sets p.grad = None, so of a step's 4 microbatches (gb 4,
    # mb 1, dp 1) only 3 add into .grad; Megatron's main_grad buffer is added into every time.
    sc = build_scenario(_gpt("fp16", fusion=False, framework=framework))
    assert sc.num_microbatches == 4
    _, w_ops = build_layer_ops(sc)["dense"].backward()
    acc = {o.name: o for o in w_ops if o.name.endswith(".grad_accumulate")}
    fc1 = {o.name: o for o in w_ops}["fc1.wgrad"]
    assert acc["fc1.grad_accumulate"].bytes * 4 == pytest.approx(fc1.params * 6.0 * adds)
