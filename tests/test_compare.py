"""`clustersim compare A B`: scenarios or report JSONs, one page, differences highlighted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from simulator.errors import UserError
from simulator.report import browser
from simulator.report.compare import compare_app

BASE = {
    "name": "small-1f1b", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 4},
    "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 4096}, "schedule": "1f1b",
    "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"},
}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    a = d / "a.yaml"
    a.write_text(yaml.safe_dump(BASE))
    b_data = dict(BASE, name="small-interleaved", schedule="interleaved-1f1b", parallelism={"tp": 2, "pp": 4, "vpp": 2})
    b = d / "b.yaml"
    b.write_text(yaml.safe_dump(b_data))
    return a, b


@pytest.fixture(scope="module")
def compared(scenarios, tmp_path_factory):
    a, b = scenarios
    out = tmp_path_factory.mktemp("out") / "cmp.html"
    res = CliRunner().invoke(compare_app, [str(a), str(b), "--output", str(out)])
    assert res.exit_code == 0, res.output
    return out, res


def test_compare_scenarios(compared):
    out, res = compared
    assert str(out) in res.stdout.splitlines()[-1]
    page = out.read_text()
    assert "B vs A" in page and "Scenario differences" in page
    assert "parallelism.vpp" in page and "interleaved-1f1b" in page
    assert 'class="better"' in page or 'class="worse"' in page
    assert page.count('id="sec-cmp-timeline"') == 1 and 'id="step-delta"' in page  # both timelines, one axis
    assert not list(out.parent.glob(".*.tmp"))  # written atomically, nothing left behind


def test_compare_report_jsons(tmp_path):
    from simulator.scenario import load_scenario
    from simulator.simulate import simulate

    over = {"model": "llama3-8b", "cluster.gpus": 64, "parallelism.tp": 2, "parallelism.pp": 4,
            "batch.global_batch_size": 32, "batch.seq_length": 4096}
    ra = simulate(load_scenario(None, over)).report
    rb = ra.model_copy(update={"name": "slower <b>x</b>", "step_time_s": ra.step_time_s * 1.5})
    (tmp_path / "a.json").write_text(ra.model_dump_json())
    (tmp_path / "b.json").write_text(rb.model_dump_json())
    out = tmp_path / "r.html"
    res = CliRunner().invoke(compare_app, [str(tmp_path / "a.json"), str(tmp_path / "b.json"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "+50.0%" in page and 'class="worse">+50.0%' in page
    assert "No timeline" in page
    assert "<b>x</b>" not in page and "slower &lt;b&gt;x&lt;/b&gt;" in page
    # a report whose figures no simulation writes (edited by hand, NaN) is refused, not drawn
    for bad in (-1.0, float("nan")):
        (tmp_path / "c.json").write_text(ra.model_copy(update={"step_time_s": bad}).model_dump_json())
        res = CliRunner().invoke(compare_app, [str(tmp_path / "a.json"), str(tmp_path / "c.json"), "-o", str(tmp_path / "c.html")])
        assert isinstance(res.exception, UserError) and "step_time_s" in str(res.exception), res.output
    assert not (tmp_path / "c.html").exists()
    # a report written to a .gz name is gzip (it was plain JSON under a .gz name), and compare reads it
    import gzip

    from simulator.files import write_atomic

    write_atomic(tmp_path / "a.json.gz", ra.model_dump_json())
    assert json.loads(gzip.open(tmp_path / "a.json.gz", "rt").read())["name"] == ra.name
    res = CliRunner().invoke(compare_app, [str(tmp_path / "a.json.gz"), str(tmp_path / "b.json"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    # --dashboard names the page as it does for simulate and sweep (was "No such option: --dashboard")
    res = CliRunner().invoke(compare_app, [str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--dashboard",
                                           str(tmp_path / "d.html")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "d.html").read_text().count("B vs A") >= 1


def test_compare_bad_inputs(tmp_path, scenarios):
    a, _ = scenarios
    runner = CliRunner()
    res = runner.invoke(compare_app, [str(a), str(tmp_path / "missing.yaml")])
    assert isinstance(res.exception, UserError) and "does not exist" in str(res.exception)
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": 1}')
    res = runner.invoke(compare_app, [str(a), str(bad)])
    assert isinstance(res.exception, UserError) and "not a report JSON" in str(res.exception)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    res = runner.invoke(compare_app, [str(broken), str(a)])
    assert isinstance(res.exception, UserError) and "not valid JSON" in str(res.exception)


@pytest.mark.browser
@pytest.mark.skipif(browser.find_chromium() is None, reason="chromium is not installed (apt-get install chromium)")
def test_compare_renders_in_chromium(compared, tmp_path):
    out, _ = compared
    res = browser.open_page(out, budget_ms=5000, screenshot_to=tmp_path / "cmp.png")
    assert res.js_errors == []
    assert res.dom.count('class="main-svg"') >= 4
    assert Path(tmp_path / "cmp.png").stat().st_size > 20_000


def test_idle_share_falls_while_bubble_time_grows():
    """A longer step can lower the idle share while the bubble itself grows: compare shows both,
    and calls the share better and the bubble time worse rather than hiding the growth."""
    from simulator.report.compare import metric_rows
    from simulator.scenario import load_scenario
    from simulator.simulate import simulate

    over = {"model": "llama3-8b", "cluster.gpus": 64, "parallelism.tp": 2, "parallelism.pp": 4,
            "batch.global_batch_size": 32, "batch.seq_length": 4096}
    ra = simulate(load_scenario(None, over)).report
    bubble_s = ra.step_breakdown_s["bubble"]
    assert bubble_s > 0
    rb = ra.model_copy(update={"bubble_fraction": ra.bubble_fraction * 0.8,
                               "step_breakdown_s": {**ra.step_breakdown_s, "bubble": bubble_s * 1.2}})
    rows = {label: (change, cls) for label, _, _, change, cls in metric_rows(ra, rb)}
    # a share's change in percentage points, then relative
    points = 100 * (rb.bubble_fraction - ra.bubble_fraction)
    assert rows["pipeline idle, share of step"] == (f"{points:+.1f} points (-20.0%)", "better")
    assert rows["bubble time"] == ("+20.0%", "worse")
