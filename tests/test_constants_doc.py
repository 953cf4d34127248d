"""docs/constants.md lists every constant of every shipped profile with its source, and is what
the generator makes of today's profiles (regenerate: python -m simulator.calibrate.constants_doc > docs/constants.md)."""

from pathlib import Path

import pytest

from simulator.calibrate.constants_doc import NO_SOURCE, profile_constants, render, schema_defaults
from simulator.profile import available_profiles, load_profile

DOC = Path(__file__).resolve().parents[1] / "docs" / "constants.md"


def test_constants_doc_matches_profiles():
    assert DOC.read_text() == render(), "docs/constants.md is stale: python -m simulator.calibrate.constants_doc > docs/constants.md"


def test_every_profile_and_key_constant_listed_with_source():
    text = DOC.read_text()
    for name in available_profiles():
        assert f"## {name} " in text
    for name in ("h200-sxm-141gb", "b200", "gb200"):
        rows = {f: src for f, _, src in profile_constants(name)}
        for key in ("compute.peak_tflops", "compute.peak_tflops_fp8", "compute.hbm_GBps", "hbm_gib", "compute.sm_count",
                    "comm.nvlink_efficiency", "compute.kernels.launch_floor_us", "compute.kernels.mem_efficiency.elementwise"):
            assert "no source" not in rows[key], (name, key)


def test_no_constant_without_a_source():
    missing = [(name, f) for name in available_profiles() for f, _, src in profile_constants(name) if src == NO_SOURCE]
    assert missing == [], f"{len(missing)} constants without a provenance item, e.g. {missing[:5]}"


def test_unread_and_superseded_constants_are_gone_from_spec_profiles():
    # Spec profiles time memory-bound kernels by shape (compute.kernels): the elementwise and norm
    # class curves are read by no path, so they are not shipped; overlap_slowdown is read by none.
    for name in available_profiles():
        p = load_profile(name)
        if p.provenance.method != "spec":
            continue
        assert p.compute.kernels is not None, name
        assert set(p.compute.classes) == {"gemm", "attention", "optimizer", "other"}, name
        fields = {f for f, _, _ in profile_constants(name)}
        assert not any(f.startswith(("compute.classes.elementwise", "compute.classes.norm", "compute.overlap_slowdown")) for f in fields)
        # Memory-bound fallback classes follow bytes only: no FLOP-curve constants listed for them.
        assert "compute.classes.optimizer.peak_efficiency" not in fields and p.compute.classes["optimizer"].basis == "bytes"


def test_defaults_the_model_reads_are_listed():
    # h100 leaves the host launch costs unset: the table says so rather than hiding them.
    d = dict(schema_defaults("h100-sxm-80gb"))
    assert d["compute.host_launch_forward_us"] == 0.0 and "compute.overlap_slowdown" not in d
    assert "`compute.host_launch_forward_us` 0" in DOC.read_text()


def test_old_profile_files_still_load():
    # Profiles written before the cleanup (all six class curves, overlap_slowdown) load unchanged,
    # and their extra curves still time ops of those classes.
    import json

    import numpy as np

    from simulator.profile import CALIBRATION_DIR, Profile

    d = json.loads((CALIBRATION_DIR / "h100-sxm-80gb.json").read_text())
    d["compute"]["overlap_slowdown"] = 1.0
    d["compute"]["classes"]["elementwise"] = {"peak_efficiency": 0.5, "half_efficiency_flops": 1e9, "bandwidth_efficiency": 0.5,
                                              "overhead_us": 1.0}
    p = Profile.model_validate(d)
    t = p.compute_time_s(np.array(["elementwise"]), np.array([0.0]), np.array([1e9]))[0]
    assert t == pytest.approx(1e9 / (3350e9 * 0.5) + 1e-6)
