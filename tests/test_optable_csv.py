"""Per-operator latency tables (NeuSight's label CSVs) import as measured op tables."""

from pathlib import Path

import pytest

from simulator.errors import UserError
from simulator.trace.optable_csv import load_op_table

NEU = Path(__file__).parent / "data" / "reference" / "neusight"
H100 = NEU / "NVIDIA_H100_80GB_HBM3"


def test_gpt2_large_rows_classified_and_counted():
    t = load_op_table(H100 / "gpt2_large-train-1024-4.csv")
    assert (t.model, t.seq, t.batch, t.num_layers, t.dtype) == ("gpt2_large", 1024, 4, 36, "float32")
    assert t.step_ms["e2e"] == pytest.approx(638.8086, rel=1e-6)
    ops = t.ops.set_index("name")
    # HF GPT-2 Conv1D projections are addmm; the lm_head a Linear module: GEMMs with shapes.
    assert ops.loc["addmm", "op_class"] == "gemm" and ops.loc["addmm", "count"] == 36
    assert ops.loc["addmm", "flops"] == 2.0 * 4096 * 1280 * 3840
    assert ops.loc["lm_head", "flops"] == 2.0 * 4096 * 1280 * 50257 and ops.loc["lm_head", "count"] == 1
    # Eager attention: q.k matmul, scale, causal where, softmax, dropout and matmul with v.
    for name in ("matmul", "truediv", "where", "softmax", "transformer_h_0_attn_attn_dropout", "matmul_1"):
        assert ops.loc[name, "op_class"] == "attention", name
    assert ops.loc["transformer_h_0_ln_1", "op_class"] == "norm"
    assert ops.loc["transformer_wte", "op_class"] == "embedding"
    assert ops.loc["tanh", "op_class"] == "elementwise"
    assert ops.loc["view", "op_class"] == "host" and ops.loc["size", "op_class"] == "host"
    # A GEMM's backward is two GEMMs (+ the bias reduction): twice the forward FLOPs.
    assert ops.loc["addmm", "bw_flops"] == pytest.approx(2 * ops.loc["addmm", "flops"], rel=1e-3)
    cls = t.class_times_s()
    # What the table measured per step (ops x layers) is the step the JSON measured, within 5%
    # (the table's per-op timing adds a few µs to each op).
    kernels = sum(v for k, v in cls.items() if k not in ("host", "grad_accumulate"))
    assert kernels == pytest.approx(t.measured_step_s, rel=0.05)
    assert cls["gemm"] > cls["attention"] > cls["elementwise"] > cls["norm"]


def test_opt_rows_classified():
    t = load_op_table(H100 / "opt_13-train-2048-1.csv")
    ops = t.ops.set_index("name")
    assert ops.loc["model_decoder_layers_0_fc1", "op_class"] == "gemm"
    assert ops.loc["bmm", "op_class"] == "attention" and ops.loc["add_6", "op_class"] == "attention"
    # h = s = 2048: the projections' [1, 2048, 2048] outputs are not attention scores.
    assert ops.loc["mul_1", "op_class"] == "elementwise"


def test_plain_csv(tmp_path):
    p = tmp_path / "ops.csv"
    p.write_text('op,input_shapes,dtype,fw_ms,bw_ms,count\nmatmul,"[[8, 1024, 64], [8, 64, 1024]]",bf16,0.1,0.2,4\n'
                 'softmax,"[[8, 1024, 1024]]",bf16,0.05,0.1,4\n')
    t = load_op_table(p)
    assert list(t.ops["op_class"]) == ["gemm", "softmax"]
    assert t.ops["flops"].iloc[0] == 2.0 * 8 * 1024 * 1024 * 64
    assert t.class_times_s()["gemm"] == pytest.approx(4 * 0.3e-3)


@pytest.mark.parametrize("text,what", [
    ("a,b\n1,2\n", "lacks the columns"),
    ('op,input_shapes,dtype,fw_ms,bw_ms\nmatmul,"[[8, 64",bf16,0.1,0.2\n', "is not a list of shapes"),
    ('op,input_shapes,dtype,fw_ms,bw_ms\nmatmul,"[[8, 64]]",bf16,-1,0.2\n', r"row 0: fw_ms -1 is not a latency: write a non-negative"),
    ('op,input_shapes,dtype,fw_ms,bw_ms\nmatmul,"[[8, 64]]",bf16,0.1,nan\n', r"row 0: bw_ms nan is not a latency"),
    ('op,input_shapes,dtype,fw_ms,bw_ms\nmatmul,"[[8, 64]]",bf16,fast,0.2\n', "row 0: fw_ms 'fast' is not a number"),
    ('op,input_shapes,dtype,fw_ms,bw_ms,count\nmatmul,"[[8, 64]]",bf16,0.1,0.2,x\n', "row 0: count 'x' is not a number"),
])
def test_bad_tables(tmp_path, text, what):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(UserError, match=what):
        load_op_table(p)


def test_layer_table_without_layer_count(tmp_path):
    src = (H100 / "gpt2_large-train-1024-4.csv").read_text()
    p = tmp_path / "gpt2_large-train-1024-4.csv"
    p.write_text(src)
    with pytest.raises(UserError, match="num_layer"):
        load_op_table(p)
    assert load_op_table(p, num_layers=36).num_layers == 36


def test_a_table_named_from_inside_its_folder_keeps_its_device(monkeypatch):
    # Was "no spec profile for device ''": the folder of 'x.csv' is '.', whose name is empty.
    from simulator.trace.optable_csv import load_op_table

    folder = Path(__file__).resolve().parent / "data" / "reference" / "neusight" / "NVIDIA_H100_80GB_HBM3"
    monkeypatch.chdir(folder)
    assert load_op_table(Path("gpt2_large-train-1024-4.csv")).device == "NVIDIA H100 80GB HBM3"
    assert load_op_table(Path("./gpt2_large-train-1024-4.csv")).device == "NVIDIA H100 80GB HBM3"


def _copy_neusight(tmp_path, edit_csv=None, step=None):
    import json

    import pandas as pd

    src = H100 / "gpt2_large-train-1024-4.csv"
    df = pd.read_csv(src)
    if edit_csv:
        df = edit_csv(df)
    p = tmp_path / src.name
    df.to_csv(p, index=False)
    side = json.loads(src.with_suffix(".json").read_text())
    side.update(step or {})
    p.with_suffix(".json").write_text(json.dumps(side))
    return p


def test_neusight_table_without_its_op_column_names_it(tmp_path):
    # Was KeyError 'op' with a traceback: the check took a table without 'op' for NeuSight's.
    p = _copy_neusight(tmp_path, lambda df: df.drop(columns=["op"]))
    with pytest.raises(UserError, match=r"NeuSight's op missing"):
        load_op_table(p)


def test_a_gemm_row_without_its_operands_names_the_row(tmp_path):
    # Was IndexError with a traceback: an addmm recorded with two shapes has no bias before them.
    def cut(df):
        i = df.index[df["target"].astype(str).str.contains("addmm")][0]
        df.loc[i, "input_shapes"] = "[[4096, 1280], [1280, 3840]]"
        return df

    p = _copy_neusight(tmp_path, cut)
    with pytest.raises(UserError, match=r"row \d+: addmm with input_shapes .* lacks the operands"):
        load_op_table(p)


@pytest.mark.parametrize("step,what", [
    ({"e2e_latency": -5.0}, r"e2e_latency=-5\.0 is not a positive time"),
    ({"e2e_latency": "638"}, r"e2e_latency='638' is not a positive time"),
    ({"fw_latency": 0}, r"fw_latency=0 is not a positive time"),
    ({"num_layer": "36"}, r"num_layer='36' is not a positive whole number"),
    ({"num_layer": 0}, r"num_layer=0 is not a positive whole number"),
])
def test_an_unusable_step_file_value_is_an_error_not_a_fallback(tmp_path, step, what):
    # Was silent: the measured step fell back to the sum of the ops, with a note saying there was
    # no step time beside the table.
    with pytest.raises(UserError, match=what):
        load_op_table(_copy_neusight(tmp_path, step=step))
