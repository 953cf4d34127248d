"""A tied LM head shares the embedding's matrix but still runs its weight-gradient GEMM
(dW = G^T X) every microbatch; the matrix's parameters are counted once, on the embedding."""

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
