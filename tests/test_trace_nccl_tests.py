from pathlib import Path

import pytest

from simulator.errors import UserError
from simulator.trace.nccl_tests import COLLECTIVE_TABLE_COLUMNS, busbw_factor, import_nccl_tests

REF = Path(__file__).parent / "data" / "reference" / "nccl-tests"
P4DE = REF / "p4de-2nodes-16gpu_all_reduce_perf.txt"


def test_p4de_all_reduce():
    r = import_nccl_tests(P4DE)
    t = r.table
    assert list(t.columns) == list(COLLECTIVE_TABLE_COLUMNS)
    assert len(t) == 58 and int(t["in_place"].sum()) == 29
    assert r.nranks == 16  # no '# Rank' lines: solved from busbw/algbw = 2(n-1)/n
    assert set(t["collective"]) == {"all_reduce"} and set(t["dtype"]) == {"float32"} and set(t["redop"]) == {"sum"}
    assert t["size_bytes"].min() == 8 and t["size_bytes"].max() == 2147483648
    first = t.iloc[0]
    assert (first["size_bytes"], first["count"], first["time_us"], first["in_place"]) == (8, 2, 164.3, False)
    big = t[t["size_bytes"] == 2147483648].set_index("in_place")
    assert (big.loc[False, "time_us"], big.loc[False, "algbw_GBps"], big.loc[False, "busbw_GBps"]) == (51406.0, 41.78, 78.33)
    assert (big.loc[True, "algbw_GBps"], big.loc[True, "busbw_GBps"]) == (41.77, 78.33)
    gib = t[(t["size_bytes"] == 1073741824) & t["in_place"]].iloc[0]
    assert (gib["time_us"], gib["busbw_GBps"]) == (26194.0, 76.86)
    # algbw = size / time, busbw = algbw * 2(n-1)/n, to the log's 2 decimals
    row = t[(t["size_bytes"] == 134217728) & ~t["in_place"]].iloc[0]
    assert round(134217728 / row["time_us"] / 1e3, 2) == row["algbw_GBps"] == 34.30
    assert round(row["algbw_GBps"] * busbw_factor("all_reduce", 16), 2) == pytest.approx(row["busbw_GBps"], abs=0.01)


MPIRUN_OLD = """\
[1,0]<stdout>:# nThread 1 nGpus 1 minBytes 1024 maxBytes 4096 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
[1,0]<stdout>:#
[1,0]<stdout>:# Using devices
[1,0]<stdout>:#   Rank  0 Pid  10 on node-a device  0 [0x10] Tesla V100-SXM2-16GB
[1,0]<stdout>:#   Rank  1 Pid  11 on node-b device  0 [0x10] Tesla V100-SXM2-16GB
[1,0]<stdout>:#
[1,0]<stdout>:#                                                     out-of-place                       in-place
[1,0]<stdout>:#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
[1,0]<stdout>:#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
[1,0]<stdout>:        1024           128   float            20.00    0.05    0.03  0e+00    21.00    0.05    0.02  0e+00
[1,0]<stdout>:        2048           256   float            22.00    0.09    0.05  0e+00    23.00    0.09    0.04  0e+00
[1,0]<stdout>:# Out of bounds values : 0 OK
[1,0]<stdout>:# Avg bus bandwidth    : 0.035
"""

NEW_WITH_RANKS = """\
# nccl-tests version 2.13.8 nccl-headers=21903 nccl-library=21903
# Collective test starting: all_gather_perf
#  Rank  0 Group  0 Pid   4 on     host1 device  0 [0000:18:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   5 on     host1 device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
     1048576        131072     float    none      -1    20.00   52.43   26.21      0    19.50   53.77   26.89    N/A
# Avg bus bandwidth    : 26.55
# Collective test concluded: all_gather_perf
"""


def test_old_layout_mpirun_prefix(tmp_path):
    p = tmp_path / "alltoall.log"
    p.write_text(MPIRUN_OLD)
    r = import_nccl_tests(p, collective="alltoall")
    t = r.table
    assert len(t) == 4 and set(t["collective"]) == {"all_to_all"} and set(t["redop"]) == {"none"}
    assert (r.nranks, r.hosts, r.devices) == (2, ["node-a", "node-b"], ["Tesla V100-SXM2-16GB"] * 2)
    assert t["time_us"].tolist() == [20.0, 21.0, 22.0, 23.0]
    assert r.avg_busbw_GBps == 0.035


def test_new_layout_rank_lines(tmp_path):
    p = tmp_path / "run.txt"
    p.write_text(NEW_WITH_RANKS)
    r = import_nccl_tests(p)
    assert (r.version, r.nranks, r.hosts) == ("2.13.8", 2, ["host1"])
    assert r.devices == ["NVIDIA H100 80GB HBM3"] * 2
    assert r.table["collective"].tolist() == ["all_gather", "all_gather"]
    assert r.table["busbw_GBps"].tolist() == [26.21, 26.89]


def test_busbw_factor():
    assert busbw_factor("all_reduce", 16) == 2 * 15 / 16
    assert busbw_factor("allgather", 8) == 7 / 8
    assert busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("alltoall", 2) == 0.5
    assert busbw_factor("broadcast", 64) == busbw_factor("sendrecv", 2) == 1.0
    with pytest.raises(UserError, match=r"no bus-bandwidth factor for collective 'frobnicate'"):
        busbw_factor("frobnicate", 4)


def test_unknown_collective_argument():
    with pytest.raises(UserError, match=r"unknown collective 'allsum'"):
        import_nccl_tests(P4DE, collective="allsum")


def test_not_nccl_tests(tmp_path):
    p = tmp_path / "x_all_reduce_perf.txt"
    p.write_text("hello\nworld\n")
    with pytest.raises(UserError, match=r"has no nccl-tests result rows"):
        import_nccl_tests(p)


def test_a_log_whose_bandwidths_disagree_with_its_times_is_said_to(tmp_path):
    # Times x2 with algbw/busbw kept was fitted exactly as a consistent x2 log, without a word.
    src = Path(__file__).parent / "data" / "reference" / "nccl-tests" / "p4de-2nodes-16gpu_all_reduce_perf.txt"
    out = []
    for line in src.read_text().splitlines():
        tok = line.split()
        o = 1 if tok and tok[0].endswith(":") else 0  # (an MPI launcher's "0:" prefix)
        if len(tok) >= 13 + o and tok[o].isdigit():
            # new layout: size count type redop root | time algbw busbw #wrong | time algbw busbw #wrong
            tok[5 + o] = f"{float(tok[5 + o]) * 2:.1f}"
            tok[9 + o] = f"{float(tok[9 + o]) * 2:.1f}"
            line = "  ".join(tok)
        out.append(line)
    edited = tmp_path / "edited_all_reduce_perf.txt"
    edited.write_text("\n".join(out) + "\n")
    from simulator.trace.nccl_tests import import_nccl_tests

    res = import_nccl_tests(edited)
    assert any("algbw column is 2.00x size / time" in w for w in res.warnings), res.warnings
    assert not any("algbw column" in w for w in import_nccl_tests(src).warnings)


@pytest.mark.parametrize("edit,match", [
    # every time negated: was "has no nccl-tests result rows: expected lines ...", naming nothing
    (lambda t: [t[0], t[1], t[2], t[3], "-" + t[4], *t[5:8], "-" + t[8], *t[9:]],
     r"line \d+: '-[0-9.]+' is not a non-negative number"),
    # out-of-place columns only
    (lambda t: t[:8], r"line \d+: 8 fields where a result row has 11 to 13: .*in-place columns is not read"),
])
def test_a_log_of_rows_that_do_not_parse_names_the_first(tmp_path, edit, match):
    from simulator.errors import UserError

    src = (REF / "azure-ndv4-a100-40gb-2gpu_all_reduce_perf.txt").read_text().splitlines()
    out = []
    for line in src:
        tok = line.split()
        out.append(" ".join(edit(tok)) if tok and tok[0].isdigit() and len(tok) == 12 else line)
    p = tmp_path / "log.txt"
    p.write_text("\n".join(out) + "\n")
    with pytest.raises(UserError, match=match):
        import_nccl_tests(p)


def test_nccl_tests_logs_are_told_from_a_folders_other_files(tmp_path):
    from simulator.trace.nccl_tests import looks_like_nccl_tests

    assert all(looks_like_nccl_tests(p) for p in REF.iterdir())
    (tmp_path / "notes.txt").write_text("size count type algbw\nnot a log\n")
    kineto = Path(__file__).parent / "data" / "reference" / "kineto" / "hta_a100_rank0of16.json.gz"
    assert not looks_like_nccl_tests(tmp_path / "notes.txt") and not looks_like_nccl_tests(kineto)


def test_a_folder_of_logs_calibrates_as_its_logs_and_a_mixed_one_reads_both(tmp_path):
    # An nccl-tests log in a folder of Kineto traces was skipped without a word, and a folder of
    # a cluster's logs was "no .json or .json.gz trace files".
    import json
    import shutil

    from typer.testing import CliRunner

    from simulator.cli import app

    log = REF / "p4de-2nodes-16gpu_all_reduce_perf.txt"
    logs, mixed = tmp_path / "logs", tmp_path / "mixed"
    logs.mkdir(), mixed.mkdir()
    shutil.copy(log, logs)
    shutil.copy(log, mixed)
    shutil.copy(Path(__file__).parent / "data" / "reference" / "kineto" / "hta_a100_rank0of16.json.gz", mixed)

    def nccl_model(*inputs):
        out = tmp_path / f"p{len(list(tmp_path.glob('p*.json')))}.json"
        r = CliRunner().invoke(app, ["calibrate", *map(str, inputs), "--out", str(out), "--base", "a100-sxm-80gb"])
        assert r.exit_code == 0, r.output
        return json.loads(out.read_text())["comm"]["nccl"]

    assert nccl_model(logs) == nccl_model(log) == nccl_model(mixed)
    r = CliRunner().invoke(app, ["trace", "info", str(mixed), "--json"])
    assert r.exit_code == 0, r.output
    assert any("not read with the traces: 1 nccl-tests log(s) (p4de-2nodes-16gpu_all_reduce_perf.txt)" in w
               for w in json.loads(r.stdout)["warnings"])
    r = CliRunner().invoke(app, ["trace", "info", str(logs)])
    assert r.exit_code == 2 and "all together by calibrate" in r.output
