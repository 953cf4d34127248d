"""Released HuggingFace config.json files as --model: their parameter counts against the totals the
model cards publish, and the fields that change which layers are expert layers.

tests/data/hf/{llama31-8b,qwen25-7b,qwen3-30b-a3b,deepseek-v3}.json are the released configs
(meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-7B, Qwen/Qwen3-30B-A3B, deepseek-ai/DeepSeek-V3);
mixtral.json is Mixtral-8x7B's shape.
"""

from __future__ import annotations

import json

import pytest

from simulator.errors import UserError
from simulator.scenario import load_scenario, resolve_model
from simulator.workload.ops import active_parameters, total_parameters

from cli_helpers import REPO, assert_one_line_error, clustersim

HF = REPO / "tests" / "data" / "hf"


# Published totals, billions: Llama 3.1 model card (8.03B), Qwen2.5 model card (7.61B), Mixtral
# paper (46.7B), Qwen3 model card (30.5B), DeepSeek-V3 report (671B without the MTP module).
@pytest.mark.parametrize("name,published_b", [("llama31-8b", 8.03), ("qwen25-7b", 7.61), ("mixtral", 46.7),
                                              ("qwen3-30b-a3b", 30.5), ("deepseek-v3", 671.0)])
def test_released_configs_count_the_published_parameters(name, published_b):
    sc = load_scenario(None, {"model": str(HF / f"{name}.json"), "cluster.gpus": 8, "parallelism.tp": 1,
                              "parallelism.pp": 1})
    assert total_parameters(sc) / 1e9 == pytest.approx(published_b, rel=0.005)


# Active (per-token) parameters as published: Mixtral paper 12.9B (13B "active"), Qwen3 model card
# 3.3B activated, DeepSeek-V3 report 37B activated; a dense model's are all of its parameters.
@pytest.mark.parametrize("name,active_b,rel", [("mixtral", 12.9, 0.005), ("qwen3-30b-a3b", 3.3, 0.02),
                                               ("deepseek-v3", 37.0, 0.02), ("llama31-8b", 8.03, 0.005)])
def test_released_configs_count_the_published_active_parameters(name, active_b, rel):
    sc = load_scenario(None, {"model": str(HF / f"{name}.json"), "cluster.gpus": 8, "parallelism.tp": 1,
                              "parallelism.pp": 1})
    assert active_parameters(sc) / 1e9 == pytest.approx(active_b, rel=rel)


def test_the_layout_line_gives_total_and_active_parameters(tmp_path):
    out = clustersim(["simulate", "--model", HF / "mixtral.json", "--gpus", "16", "--tp", "1", "--pp", "1",
                      "--ep", "8", "--global-batch-size", "16", "--seq-length", "1024", "--no-dashboard"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "(46.7B parameters, 12.9B active) · TP1 PP1 DP16 EP8" in out.stdout


def _variant(tmp_path, base: str, **fields):
    cfg = json.loads((HF / f"{base}.json").read_text())
    cfg.update(fields)
    path = tmp_path / f"{base}-variant.json"
    path.write_text(json.dumps(cfg))
    return path


def test_qwen_moe_first_mlp_only_layers_are_dense_layers(tmp_path):
    # Was ignored: every layer simulated with experts.
    m = resolve_model(str(_variant(tmp_path, "qwen3-30b-a3b", mlp_only_layers=[0, 1, 2])))
    assert (m.num_dense_layers, m.ffn_hidden_size) == (3, 6144)
    assert resolve_model(str(HF / "qwen3-30b-a3b.json")).num_dense_layers == 0


@pytest.mark.parametrize("fields,match", [
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2 and mlp_only_layers=\[\] put dense layers \[0, 2, 4, .*"
                                 r"not modelled .*: set decoder_sparse_step to 1"),
    ({"mlp_only_layers": [5]}, r"mlp_only_layers=\[5\] put dense layers \[5\] between the expert layers"),
    ({"mlp_only_layers": [48]}, r"'mlp_only_layers' is \[48\]; write a list of layer indices 0\.\.47"),
])
def test_qwen_moe_dense_layers_between_expert_layers_are_refused(tmp_path, fields, match):
    # Were ignored silently: parameters and FLOPs of an all-expert model.
    with pytest.raises(UserError, match=match):
        resolve_model(str(_variant(tmp_path, "qwen3-30b-a3b", **fields)))


def test_deepseek_moe_layer_freq_is_refused_in_one_line(tmp_path):
    path = _variant(tmp_path, "deepseek-v3", moe_layer_freq=2)
    p = clustersim(["simulate", "--model", path, "--gpus", "64", "--tp", "1", "--pp", "4", "--no-dashboard"], tmp_path)
    assert_one_line_error(p, r"moe_layer_freq=2 puts dense layers between the expert layers, which is not modelled "
                             r".*: set moe_layer_freq to 1")
    assert sorted(x.name for x in tmp_path.iterdir()) == [path.name]


def test_sliding_window_is_said_to_be_not_modelled(tmp_path):
    # Was ignored silently: Mistral-7B-v0.1's 4,096-token window simulated as full attention at 8,192.
    path = _variant(tmp_path, "mistral", sliding_window=4096)
    assert resolve_model(str(path)).sliding_window == 4096
    # Qwen's window only applies with use_sliding_window (Qwen2.5-7B ships it false)
    assert resolve_model(str(HF / "qwen25-7b.json")).sliding_window is None
    base = ["simulate", "--model", path, "--gpus", "8", "--tp", "8", "--pp", "1", "--global-batch-size", "1",
            "--no-dashboard", "--findings-budget-s", "0", "--json"]
    p = clustersim(base + ["--seq-length", "8192"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert ("note: sliding_window=4096 in the model config is not modelled: attention is simulated full-causal over "
            "seq_length=8192 tokens") in p.stderr
    p = clustersim(base + ["--seq-length", "4096"], tmp_path)
    assert p.returncode == 0 and "sliding_window" not in p.stderr


def test_a_config_without_model_type_says_to_add_it(tmp_path):
    # Was "model_type None ... is not supported".
    cfg = json.loads((HF / "mistral.json").read_text())
    del cfg["model_type"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"has no model_type: add the architecture's \(one of .*llama"):
        resolve_model(str(p))


def test_a_scenario_yaml_given_as_the_model_says_where_it_goes(tmp_path):
    # Was "model config 's.yaml' is not valid JSON: fix the file", of a file that is fine.
    p = tmp_path / "s.yaml"
    p.write_text("name: x\nmodel: llama3-8b\n")
    with pytest.raises(UserError, match=r"is YAML: a model is a preset name or a HuggingFace config\.json; a scenario YAML "
                                        r"goes first on the command line"):
        resolve_model(str(p))
