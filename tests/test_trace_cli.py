import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simulator.trace.cli import trace_app

REF = Path(__file__).parent / "data" / "reference"
DATA = Path(__file__).parent / "data" / "trace"
runner = CliRunner()


def _info_json(path):
    res = runner.invoke(trace_app, ["info", str(path), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_info_nccl_data():
    d = _info_json(REF / "kineto" / "hta_nccl_data_a100_rank0of2.json.gz")
    assert d["ranks"] == [0] and d["devices"] == ["NVIDIA A100-PG509-200"]
    assert set(d["op_classes"]) == {"gemm", "elementwise", "norm", "optimizer", "communication", "memcpy", "other"}
    assert d["op_classes"]["communication"] == pytest.approx(46876.493)
    assert {(c["name"], c["bytes"], c["group_size"], c["count"]) for c in d["collectives"]} == {
        ("all_reduce", 8196000, 2, 3), ("all_reduce", 9724160, 2, 3), ("all_reduce", 26255360, 2, 3),
        ("all_reduce", 26550272, 2, 3), ("all_reduce", 31502336, 2, 3), ("broadcast", 424, 2, 3),
        ("broadcast", 212480, 2, 3)}
    assert d["span_us"] == pytest.approx(660551.005)


@pytest.mark.parametrize("name, ranks, n_coll", [
    ("hta_a100_rank0of16.json.gz", [0], 80),
    ("hta_sampled_rank0of128.json.gz", [0], 10),
    ("hta_sampled_rank1of128.json.gz", [1], 10),
])
def test_info_reference_traces(name, ranks, n_coll):
    d = _info_json(REF / "kineto" / name)
    assert d["ranks"] == ranks
    assert sum(c["count"] for c in d["collectives"]) == n_coll
    assert d["span_us"] > 0 and d["warnings"]


def test_info_bundle_and_table_output():
    d = _info_json(DATA / "gloo_bundle")
    assert (d["kind"], d["ranks"], d["devices"]) == ("bundle", [0, 1], ["cpu", "cpu"])
    assert {"name": "send", "count": 1, "bytes": 1024, "group_size": 2} .items() <= next(
        c for c in d["collectives"] if c["name"] == "send").items()
    res = runner.invoke(trace_app, ["info", str(DATA / "gloo_bundle")])
    assert res.exit_code == 0 and "all_gather" in res.stdout and "op classes" in res.stdout


def test_info_nccl_tests_log():
    d = _info_json(REF / "nccl-tests" / "p4de-2nodes-16gpu_all_reduce_perf.txt")
    assert d["kind"] == "nccl-tests" and d["ranks"] == list(range(16)) and d["n_rows"] == 58
    assert len(d["collectives"]) == 29 and d["collectives"][-1]["busbw_GBps"] == 78.33


def test_info_bad_input_exit_2():
    res = runner.invoke(trace_app, ["info", str(DATA / "not_kineto.json")])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1


def test_info_says_when_a_manifest_world_size_is_not_its_ranks(tmp_path):
    # Was printed side by side without a word (ranks: 2 [0, 1]   world size: 8).
    import shutil

    b = tmp_path / "b"
    shutil.copytree(DATA / "gloo_bundle", b)
    m = json.loads((b / "manifest.json").read_text())
    assert not any("world_size" in w for w in _info_json(b)["warnings"])
    m["world_size"] = 8
    (b / "manifest.json").write_text(json.dumps(m))
    assert any("manifest.json says world_size 8 but the bundle holds traces of 2 ranks" in w
               for w in _info_json(b)["warnings"])
