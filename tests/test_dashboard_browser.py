"""The dashboards in real headless Chromium: causes, findings, zoom to ops, linked compare axes,
hostile names, an unreachable CDN. Assertions read the rendered DOM and Plotly's plot data (not
pixels), through a probe script added to the page that writes its findings into the DOM."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from simulator.report import browser
from simulator.report.dashboard import CAUSE_COLORS, build_dashboard_html
from simulator.report.findings import attach
from simulator.scenario import build_scenario
from simulator.simulate import simulate

pytestmark = [pytest.mark.skipif(browser.find_chromium() is None, reason="chromium is not installed (apt-get install chromium)"),
              pytest.mark.browser]

# MoE with DualPipe and every dimension > 1: all six causes of waiting occur.
MOE = {"name": "moe-dualpipe", "model": "mixtral-8x7b",
       "parallelism": {"tp": 2, "cp": 2, "pp": 4, "ep": 2, "zero": 1}, "schedule": "dualpipe",
       "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 2048},
       "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
DENSE = {"name": "dense", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 4, "zero": 1},
         "batch": {"micro_batch_size": 1, "global_batch_size": 32, "seq_length": 4096},
         "cluster": {"gpus": 64, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}}
OVERFLOW = dict(DENSE, name="overflow", model="llama3-70b", parallelism={"tp": 2, "pp": 4, "zero": 0},
                batch={"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 4096})
IMBALANCED = dict(DENSE, name="imbalanced", parallelism={"tp": 2, "pp": 4, "zero": 1, "pp_layer_split": [5, 9, 9, 9]})
PAYLOAD = "<img src=x onerror=alert(1)>"


def probe(page: str, tmp_path: Path, js_body: str, name: str = "page", budget_ms: int = 8000) -> tuple[dict, browser.PageResult]:
    """Open ``page`` with an async probe (``js_body``, returning a JSON-able value) run once the page
    is ready; returns the probe's value and the rendered page."""
    spy = ("<script>window.alert=function(m){document.documentElement.setAttribute('data-alert',String(m));};</script>")
    script = ("<script>window.addEventListener('cs-ready',function(){setTimeout(async function(){var v;"
              "try{v=await (async function(){" + js_body + "})();}catch(e){v={probe_error:String(e)};}"
              "var p=document.createElement('pre');p.id='probe-out';p.textContent=JSON.stringify(v);"
              "document.body.appendChild(p);},200);});</script>")
    text = page.replace("<head>", "<head>" + spy, 1).replace("</body>", script + "</body>", 1)
    path = tmp_path / f"{name}.html"
    path.write_text(text)
    res = browser.open_page(path, budget_ms=budget_ms)
    m = re.search(r'<pre id="probe-out">(.*?)</pre>', res.dom, re.S)
    assert m, f"probe did not run; js errors: {res.js_errors}"
    value = json.loads(html.unescape(m.group(1)))
    assert not (isinstance(value, dict) and "probe_error" in value), value
    return value, res


@pytest.fixture(scope="module")
def moe():
    return attach(simulate(build_scenario(MOE)), budget_s=0)


CAUSES_JS = """
var gd=document.getElementById('timeline'),out={};
gd._fullData.forEach(function(t){if(t.meta&&t.meta.cause){var o=out[t.meta.cause]||{n:0,color:t.line.color,name:t.name};
  o.n+=t._length;out[t.meta.cause]=o;}});
var legend=Array.prototype.map.call(gd.querySelectorAll('.legendtext'),function(e){return e.textContent;});
var cp=gd._fullData.filter(function(t){return t.name==='critical path';}).map(function(t){return t._length;});
var hover={};
for(var c in out){var ci=-1;gd._fullData.forEach(function(t,i){if(ci<0&&t.meta&&t.meta.cause===c)ci=i;});
  Plotly.Fx.hover(gd,[{curveNumber:ci,pointNumber:1}]);await new Promise(function(r){setTimeout(r,100);});
  var h=gd.querySelector('.hoverlayer');hover[c]=h?h.textContent:'';}
return {causes:out,legend:legend,critical:cp,hover:hover};
"""

ZOOM_JS = """
var tl=document.getElementById('timeline'),d=document.getElementById('detail'),out={initial:+d.getAttribute('data-ops'),
  note:(d.layout.annotations||[]).map(function(a){return a.text;}),windows:[]};
var step=tl.layout.xaxis.range[1];
var wins=__WINDOWS__;
for(var k=0;k<wins.length;k++){var a=wins[k][0],b=wins[k][1];
  await Plotly.relayout(tl,{'xaxis.range':[a,b]});await new Promise(function(r){setTimeout(r,400);});
  var n=0,inside=true,names=[],kinds={};
  d.data.forEach(function(t){n+=t.x.length;kinds[t.meta.kind]=1;
    for(var i=0;i<t.x.length;i++){if(t.base[i]>b||t.base[i]+t.x[i]<a)inside=false;if(names.length<3)names.push(t.customdata[i][0]);}});
  out.windows.push({a:a,b:b,ops:+d.getAttribute('data-ops'),bars:n,inside:inside,names:names,kinds:Object.keys(kinds),
    range:d.layout.xaxis.range,dom_bars:d.querySelectorAll('.bars .point').length});}
return out;
"""


def test_every_cause_colour_and_zoom_to_ops_on_moe_dualpipe(moe, tmp_path):
    page = build_dashboard_html(moe)
    value, res = probe(page, tmp_path, CAUSES_JS + "", "moe")
    assert res.js_errors == []
    causes = value["causes"]
    assert set(causes) == set(CAUSE_COLORS), causes  # bubble, tp, cp, ep, pp, dp
    for cause, c in causes.items():
        assert c["n"] > 0 and c["color"] == CAUSE_COLORS[cause]
    assert len({c["color"] for c in causes.values()}) == len(CAUSE_COLORS)
    for label in ("bubble (waiting on another stage)", "waiting on tp", "waiting on cp", "waiting on ep",
                  "waiting on pp transfer", "waiting on dp", "critical path"):
        assert label in value["legend"]
    assert value["critical"] and value["critical"][0] > 2
    # the hover names what was waited on and since when
    for cause, text in value["hover"].items():
        assert "waiting since" in text or "waits merged; the first began at" in text, (cause, text)
        assert re.search(r"rank \d+ \(pp \d+\)", text), text
    assert "from pp rank" in value["hover"]["pp"] and "on the wire since" in value["hover"]["pp"]
    assert "to compute it" in value["hover"]["bubble"] or "slowest rank" in value["hover"]["bubble"]

    # windows of 2% of the step at the start, around the first, middle and last forward, and the end
    ev = moe.timeline.events
    f = ev[ev["kind"] == "F"].sort_values("start_s")["start_s"].to_numpy() * 1e3
    step = moe.timeline.step_time_s * 1e3
    wins = [[0, 0.02 * step]] + [[t, t + 0.02 * step] for t in (f[0], f[len(f) // 2], f[-1])] + [[0.98 * step, step]]
    zoom, res = probe(page, tmp_path, ZOOM_JS.replace("__WINDOWS__", json.dumps(wins)), "moe-zoom", budget_ms=15000)
    assert res.js_errors == []
    n_ops = len(moe.timeline.events) + len(moe.timeline.waits)
    assert n_ops > 4000 and zoom["initial"] > 0  # opens on a mid-step window
    for w in zoom["windows"]:
        # anywhere in the step, zooming the overview draws every op of the window in the detail view
        assert w["ops"] > 0 and w["bars"] == w["ops"] and w["inside"], w
        assert w["range"] == pytest.approx([w["a"], w["b"]])
        assert w["dom_bars"] > 0 and w["names"]
    kinds = set().union(*[w["kinds"] for w in zoom["windows"]])
    assert {"F", "B"} & kinds and any(k.startswith("wait:") for k in kinds)


def test_zoomed_out_detail_asks_to_zoom_in(moe, tmp_path):
    page = build_dashboard_html(moe)
    js = ("var d=document.getElementById('detail');window.csDrawOps(0,document.getElementById('timeline').layout.xaxis.range[1]);"
          "await new Promise(function(r){setTimeout(r,300);});"
          "return {ops:+d.getAttribute('data-ops'),note:(d.layout.annotations||[]).map(function(a){return a.text;})};")
    value, _ = probe(page, tmp_path, js, "moe-out")
    assert value["ops"] == 0 and "zoom in" in value["note"][0]


FINDINGS_JS = """
return Array.prototype.map.call(document.querySelectorAll('li.finding'),function(li){
  return {kind:li.getAttribute('data-kind'),value:li.getAttribute('data-value'),text:li.textContent};});
"""


@pytest.mark.parametrize("scenario,kinds", [(OVERFLOW, {"memory"}), (IMBALANCED, {"imbalance", "bubble"})],
                         ids=["overflow", "imbalance-and-bubble"])
def test_findings_present_and_numeric(scenario, kinds, tmp_path):
    res = attach(simulate(build_scenario(scenario)), budget_s=3)
    value, page = probe(build_dashboard_html(res, cdn=False), tmp_path, FINDINGS_JS, scenario["name"])
    assert page.js_errors == []
    got = {f["kind"]: f for f in value}
    assert kinds <= set(got), got
    for k in kinds:
        f = got[k]
        assert float(f["value"]) > 0
        assert re.search(r"\d+\.\d+ (s|GiB|ms)", f["text"]), f["text"]
    if "memory" in kinds:
        assert "GiB" in got["memory"]["text"] and "fits" in got["memory"]["text"]
    if "imbalance" in kinds:
        assert "pp_layer_split" in got["imbalance"]["text"]
    if "bubble" in kinds:
        assert "zb-h1" in got["bubble"]["text"] and "simulated" in got["bubble"]["text"]


def test_compare_axes_are_linked(tmp_path):
    from simulator.report.compare import compare_app

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(yaml.safe_dump(dict(DENSE, name="a")))
    b.write_text(yaml.safe_dump(dict(DENSE, name="b", schedule="zb-h1")))
    out = tmp_path / "cmp.html"
    r = CliRunner().invoke(compare_app, [str(a), str(b), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "B − A" in r.stdout and "bubble" in r.stdout  # the terminal delta table
    js = """
    var gd=document.getElementById('cmp-timeline'),L=gd.layout;
    var before=[L.xaxis.range.slice(),L.xaxis2.range.slice()];
    await Plotly.relayout(gd,{'xaxis2.range':[10,20]});await new Promise(function(r){setTimeout(r,200);});
    return {before:before,after:[gd.layout.xaxis.range,gd.layout.xaxis2.range],
            matches:[L.xaxis.matches||null,L.xaxis2.matches||null],
            traces:gd.data.map(function(t){return t.xaxis+'/'+t.yaxis;})};
    """
    value, res = probe(out.read_text(), tmp_path, js, "cmp")
    assert res.js_errors == []
    # both runs on one time axis: the same range at first, and zooming one zooms the other
    assert value["before"][0] == pytest.approx(value["before"][1])
    assert value["after"][0] == pytest.approx([10, 20]) and value["after"][1] == pytest.approx([10, 20])
    assert {"x/y", "x2/y2"} <= set(value["traces"])


def test_hostile_name_neither_runs_nor_escapes(tmp_path, monkeypatch):
    from simulator.cli import app

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    name = f"../../escaped/{PAYLOAD}"
    r = CliRunner().invoke(app, ["simulate", "--model", "llama3-8b", "--gpus", "16", "--tp", "2", "--pp", "2",
                                 "--global-batch-size", "16", "--seq-length", "2048", "--set", f"name={name}"])
    assert r.exit_code == 0, r.output
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) == 1 and written[0].parent == work / "dashboards", written
    assert not (tmp_path.parent / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert ".." not in written[0].name and "/" not in written[0].name
    value, res = probe(written[0].read_text(), tmp_path, "return document.title;", "hostile")
    tag = re.search(r"<html[^>]*>", res.dom).group(0)
    assert "data-alert" not in tag, "alert() ran"
    assert not re.search(r"<img\b", res.dom)
    assert value == f"ClusterSim · {name}"  # shown as written


def test_cdn_unreachable_says_so(tmp_path):
    res = simulate(build_scenario(DENSE))
    page = build_dashboard_html(res, cdn=True)
    page = re.sub(r'src="https://cdn\.plot\.ly[^"]*"', 'src="http://127.0.0.1:9/plotly.min.js"', page)
    path = tmp_path / "offline.html"
    path.write_text(page)
    out = browser.open_page(path, budget_ms=4000)
    tag = re.search(r"<html[^>]*>", out.dom).group(0)
    assert 'data-plotly="missing"' in tag and 'data-ready="1"' in tag
    msg = re.search(r'<div id="cs-noplotly"[^>]*>(.*?)</div>', out.dom, re.S).group(1)
    assert "plotly.js could not be loaded from its CDN" in msg and "without --cdn" in msg
