"""Error lines found by a new-user walkthrough: a misspelt YAML key, a bad value that was not shown,
missing keys reported one per run, layouts real stacks refuse, and sweep prune reasons."""

from __future__ import annotations

import json

import pytest
import yaml

from simulator.errors import UserError
from simulator.scenario import build_scenario
from simulator.simulate import simulate

from cli_helpers import REPO, TINY_SCENARIO, assert_one_line_error, clustersim

TINY = json.loads(json.dumps(TINY_SCENARIO))


def _with(**changes) -> dict:
    d = json.loads(json.dumps(TINY))
    for dotted, value in changes.items():
        node = d
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return d


# ------------------------------------------------------------------ 1. unknown key before missing key

def test_yaml_key_typo_is_named_before_the_key_it_leaves_missing(tmp_path):
    # Was "missing key 'batch.seq_length': add it", never naming seq_len.
    d = _with()
    d["batch"] = {"global_batch_size": 8, "seq_len": 512}
    with pytest.raises(UserError, match=r"^scenario: unknown key 'batch\.seq_len' \(did you mean 'seq_length'\?\): "
                                        r"remove it or check its spelling$"):
        build_scenario(d)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    assert_one_line_error(clustersim(["simulate", "s.yaml"], tmp_path),
                          r"unknown key 'batch\.seq_len' \(did you mean 'seq_length'\?\)")


def test_unknown_key_without_a_near_miss_has_no_hint():
    d = _with()
    d["batch"]["flux_capacitor"] = 1
    with pytest.raises(UserError, match=r"unknown key 'batch\.flux_capacitor': remove it") as exc:
        build_scenario(d)
    assert "did you mean" not in str(exc.value)


# ------------------------------------------------------------------ 2. the bad value is shown

@pytest.mark.parametrize("override,pattern", [
    ({"fp8.recipe": "foo"}, r"fp8\.recipe: 'foo' is not one of 'te-delayed', 'te-current', 'mxfp8', 'tensorwise' or 'rowwise'$"),
    ({"fp8.recipe": "te-delayd"}, r"fp8\.recipe: 'te-delayd' is not one of .* \(did you mean 'te-delayed'\?\)$"),
    ({"dtype": "bf61"}, r"dtype: 'bf61' is not one of 'bf16', 'fp16', 'fp32' or 'fp8' \(did you mean 'bf16'\?\)"),
    ({"parallelism.tp": "two"}, r"parallelism\.tp: got 'two': write a whole number$"),
    ({"parallelism.zero": 1.5}, r"parallelism\.zero: got 1\.5: write a whole number$"),
    ({"flash_attention": "maybe"}, r"flash_attention: got 'maybe': write true or false$"),
    ({"batch": [1, 2]}, r"batch: got \[1, 2\]: write a section of keys, e\.g\. batch: \{key: value\}$"),
    ({"cluster.gpu.compute.peak_tflops": float("nan")}, r"peak_tflops: got nan: write a finite number$"),
])
def test_bad_values_are_shown(override, pattern):
    with pytest.raises(UserError, match=pattern):
        build_scenario(TINY, override)


def test_cli_set_bad_literal_shows_the_value(tmp_path):
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(TINY))
    assert_one_line_error(clustersim(["simulate", "s.yaml", "--set", "fp8.recipe=foo"], tmp_path),
                          r"fp8\.recipe: 'foo' is not one of 'te-delayed'")


# ------------------------------------------------------------------ 3. every missing key at once

def test_all_missing_keys_in_one_line(tmp_path):
    # Was one key per run: ffn_hidden_size, then num_attention_heads, then vocab_size.
    d = _with()
    d["model"] = {"num_layers": 4, "hidden_size": 512}
    with pytest.raises(UserError, match=r"^scenario: missing keys 'model\.ffn_hidden_size', 'model\.num_attention_heads', "
                                        r"'model\.vocab_size': add them$"):
        build_scenario(d)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    assert_one_line_error(clustersim(["simulate", "s.yaml"], tmp_path), r"missing keys 'model\.ffn_hidden_size', ")


def test_one_missing_key_reads_as_before():
    d = _with()
    del d["batch"]["seq_length"]
    with pytest.raises(UserError, match=r"^scenario: missing key 'batch\.seq_length': add it$"):
        build_scenario(d)


# ------------------------------------------------------------------ 4b. interleaving needs pp >= 2

@pytest.mark.parametrize("changes,pattern", [
    ({"schedule": "interleaved-1f1b", "parallelism__pp": 1, "parallelism__vpp": 2},
     r"^schedule 'interleaved-1f1b' needs pp >= 2 \(model chunks are interleaved over pipeline ranks\), but pp=1: set pp"),
    ({"schedule": "interleaved-1f1b", "parallelism__pp": 1},
     r"^schedule 'interleaved-1f1b' needs pp >= 2 .*, but pp=1"),
    ({"schedule": "zb-h1", "parallelism__pp": 1, "parallelism__vpp": 2}, r"^vpp=2 needs pp >= 2 .*, but pp=1"),
])
def test_interleaving_with_one_pipeline_rank_is_refused(changes, pattern):
    with pytest.raises(UserError, match=pattern):
        build_scenario(_with(**changes))


def test_interleaving_with_two_pipeline_ranks_still_builds():
    sc = build_scenario(_with(schedule="interleaved-1f1b", parallelism__pp=2, parallelism__vpp=2))
    assert sc.parallelism.vpp == 2


# ------------------------------------------------------------------ 4c. no bf16 on Volta

def test_bf16_on_v100_is_refused_with_fp16_as_the_fix(tmp_path):
    d = _with(cluster__gpu="v100-sxm2-32gb", cluster__topology="dgx-a100-fattree")
    with pytest.raises(UserError, match=r"dtype bf16 needs BF16 tensor cores but GPU profile 'v100-sxm2-32gb' has none .*: "
                                        r"use dtype fp16"):
        simulate(build_scenario(d))
    # fp8 on V100 used to suggest bf16, which V100 has no tensor cores for either.
    with pytest.raises(UserError, match=r"dtype fp8 needs FP8 tensor cores .*: use dtype fp16, or an H100"):
        simulate(build_scenario(dict(d, dtype="fp8")))
    assert simulate(build_scenario(dict(d, dtype="fp16"))).report.step_time_s > 0
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    assert_one_line_error(clustersim(["simulate", "s.yaml"], tmp_path), r"dtype bf16 needs BF16 tensor cores.*use dtype fp16")


def test_fp8_on_a100_still_suggests_bf16():
    d = _with(cluster__gpu="a100-sxm-80gb", cluster__topology="dgx-a100-fattree", dtype="fp8")
    with pytest.raises(UserError, match=r"dtype fp8 needs FP8 tensor cores .*: use dtype bf16, or an H100"):
        simulate(build_scenario(d))


# ------------------------------------------------------------------ 5. sweep prune reasons

def test_prune_reasons_show_a_real_example_and_every_point_pruned_is_an_error(tmp_path):
    space = REPO / "tests" / "data" / "sweep" / "tiny.yaml"
    args = ["sweep", space, "--no-dashboard", "--no-progress", "--store", tmp_path / "s.sqlite", "--estimate-only"]
    p = clustersim([*args, "--tp", "2,3"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "tp=3 does not divide num_attention_heads=32" in p.stdout and "=N" not in p.stdout
    # Every point pruned: was exit 0 with no message; and the store it would open is not left behind.
    fresh = [a if a != tmp_path / "s.sqlite" else tmp_path / "new.sqlite" for a in args]
    assert_one_line_error(clustersim([*fresh, "--tp", "3"], tmp_path),
                          r"^error: nothing to simulate: every point was pruned \(tp=3 does not divide "
                          r"num_attention_heads=32 \(16 points\)\)")
    assert not any(p.name.startswith("new.sqlite") for p in tmp_path.iterdir())


def test_user_files_may_be_gzip_and_a_broken_one_is_one_line(tmp_path):
    import gzip

    from simulator.errors import read_user_text

    good = tmp_path / "r.json.gz"
    good.write_bytes(gzip.compress(b'{"a": 1}'))
    assert read_user_text(good, "report") == '{"a": 1}'
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(good.read_bytes()[:-6])
    with pytest.raises(UserError, match=r"report '.*cut\.json\.gz' is a truncated or corrupt gzip file"):
        read_user_text(cut, "report")


@pytest.mark.parametrize("override,pattern", [
    ({"name": 12345}, r"name: got 12345: write one piece of text \(quote it"),
    ({"schedule": ["1f1b"]}, r"schedule: got \['1f1b'\]: write one piece of text"),
])
def test_a_value_that_should_be_text_says_so(override, pattern):
    # Was pydantic's "Input should be a valid string", with no fix.
    with pytest.raises(UserError, match=pattern):
        build_scenario({**TINY, **override})


def test_yaml_merge_keys_are_read_and_duplicates_still_refused():
    # `<<: *defaults` was "could not determine a constructor for the tag ...merge": the duplicate-key
    # check constructed the merge key itself. Keys written beside it override it, as YAML says.
    from simulator.errors import parse_yaml_text

    doc = "base: &b {tp: 2, pp: 4}\nparallelism:\n  <<: *b\n  tp: 8\n"
    assert parse_yaml_text(doc, "scenario file", "s.yaml")["parallelism"] == {"tp": 8, "pp": 4}
    with pytest.raises(UserError, match="duplicate key 'tp'"):
        parse_yaml_text("parallelism:\n  tp: 2\n  tp: 8\n", "scenario file", "s.yaml")
