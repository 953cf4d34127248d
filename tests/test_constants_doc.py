"""docs/constants.md lists every constant of every shipped profile with its source, and is what
the generator makes of today's profiles (regenerate: python -m simulator.calibrate.constants_doc > docs/constants.md)."""

from pathlib import Path

from simulator.calibrate.constants_doc import profile_constants, render
from simulator.profile import available_profiles

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
                    "comm.nvlink_efficiency"):
            assert "no source" not in rows[key], (name, key)
