"""Closed-form stretches (``Engine.run_ahead``): a rank whose streams are idle runs its compute
segments and its unshared blocking collectives on its own clock and meets the event loop at its
next interaction. The timeline must be the event loop's, value for value; only the heap entries
it took to get there change."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import simpy

from agreement_scenarios import AGREEMENT_SCENARIOS
from engine_helpers import build_engine
from simulator.engine import events
from simulator.engine.core import Engine
from simulator.network.base import CollectiveRequest
from simulator.vocabulary import CollectiveOp, Dim
from simulator.workload.plan import Collective, Recv

_BATCH = {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 2048}
_H100 = {"gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}

SCENARIOS = {
    # TP + SP with overlapped all-gathers and ZeRO-1 on the flow network (the default's shape)
    "tp-sp-zero1": ({"name": "a", "model": "llama3-8b",
                     "parallelism": {"tp": 4, "pp": 2, "zero": 1, "sequence_parallel": True},
                     "batch": _BATCH, "cluster": {"gpus": 16, **_H100}}, "reduced"),
    # TP without SP, interleaved, on the alpha-beta network (no shared links at all)
    "tp-alpha-beta": ({"name": "b", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 2, "vpp": 2},
                       "schedule": "interleaved-1f1b", "network": "alpha-beta",
                       "batch": _BATCH, "cluster": {"gpus": 8, **_H100}}, "reduced"),
    # Megatron 2021's scatter/gather: the receiver's TP all-gather shares the TP all-reduce's links
    "scatter-gather": ({"name": "c", "model": {"name": "gpt-h2048-l8", "num_layers": 8, "hidden_size": 2048,
                                               "ffn_hidden_size": 8192, "num_attention_heads": 16,
                                               "vocab_size": 50304, "mlp": "gelu", "tied_embeddings": True,
                                               "learned_position_embeddings": True,
                                               "max_position_embeddings": 2048},
                        "parallelism": {"tp": 8, "pp": 2, "pp_scatter_gather": True, "sequence_parallel": False},
                        "framework": "megatron-2021", "batch": _BATCH,
                        "cluster": {"gpus": 16, "gpu": "a100-sxm-80gb", "topology": "dgx-a100-fattree"}}, "reduced"),
    # FSDP across nodes: asynchronous gathers and reduce-scatters around every segment
    "fsdp": ({"name": "d", "model": "llama3-8b", "parallelism": {"zero": 3},
              "batch": {**_BATCH, "global_batch_size": 16}, "cluster": {"gpus": 16, **_H100}}, "reduced"),
    # the per-rank loop: rendezvous everywhere, compute segments only
    "every-rank": ({"name": "e", "model": "llama3-8b", "parallelism": {"tp": 2, "pp": 2, "zero": 1},
                    "batch": _BATCH, "cluster": {"gpus": 8, **_H100}}, "full"),
}


def _engine(d: dict, mode: str, run_ahead: bool, core: str = "lean") -> Engine:
    eng = build_engine(d, mode, core)
    eng.run_ahead = run_ahead
    return eng


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows as a set: a rank that ran ahead writes its rows before the loop reaches them."""
    df = df.copy()
    for c in df.columns:
        if isinstance(df[c].dtype, pd.CategoricalDtype):
            df[c] = df[c].astype(str)
    return df.sort_values(list(df.columns), kind="mergesort").reset_index(drop=True)


def _counted_run(eng: Engine, monkeypatch) -> tuple:
    fired = [0]
    fire = events.Environment._fire

    def counting(self, item):
        fired[0] += 1
        return fire(self, item)

    with monkeypatch.context() as m:
        m.setattr(events.Environment, "_fire", counting)
        tl = eng.run()
    return tl, fired[0]


@pytest.mark.parametrize("case", sorted(SCENARIOS))
def test_closed_form_stretches_give_the_event_loops_timeline(case, monkeypatch):
    d, mode = SCENARIOS[case]
    ahead_eng, plain_eng = _engine(d, mode, True), _engine(d, mode, False)
    ahead, fired_ahead = _counted_run(ahead_eng, monkeypatch)
    plain, fired_plain = _counted_run(plain_eng, monkeypatch)
    assert len(plain.events) > 20
    assert ahead.step_time_s == plain.step_time_s
    pd.testing.assert_frame_equal(_rows(ahead.events), _rows(plain.events), check_exact=True)
    pd.testing.assert_frame_equal(_rows(ahead.waits), _rows(plain.waits), check_exact=True)
    assert ahead.busy_compute_s == plain.busy_compute_s
    assert ahead.exposed_s == plain.exposed_s and ahead.comm_bytes == plain.comm_bytes
    assert ahead.contention_s == plain.contention_s and ahead.end_time_s == plain.end_time_s
    assert ahead.num_events == plain.num_events  # the logical count, as the event loop has it
    assert ahead.network_report == plain.network_report
    assert fired_ahead <= fired_plain
    if case in ("tp-sp-zero1", "tp-alpha-beta"):
        # TP collectives between compute segments: the same timeline from fewer heap entries
        assert ahead_eng._closed and fired_ahead < 0.8 * fired_plain, (fired_ahead, fired_plain)


def test_the_simpy_core_gives_the_same_stretches():
    d, mode = SCENARIOS["tp-sp-zero1"]
    lean, ref = _engine(d, mode, True, "lean").run(), _engine(d, mode, True, "simpy").run()
    assert lean.step_time_s == ref.step_time_s
    pd.testing.assert_frame_equal(lean.events, ref.events)
    pd.testing.assert_frame_equal(lean.waits, ref.waits)


def _tp_closed(d: dict) -> bool:
    eng = _engine(d, "reduced", True)
    eng.run()
    return any(r.dim == Dim.TP and r.op == CollectiveOp.ALL_REDUCE and r.size_bytes > 4 for r in eng._closed.values())


def test_a_neighbours_send_on_the_same_links_keeps_tp_on_the_event_loop():
    # tp 4 x pp 2 on one 8-GPU node: stage 0 sends to stage 1 over NVLink, through the ports
    # stage 1's TP all-reduces use; on two nodes (tp 8) the send leaves through the NICs.
    base = {"name": "n", "model": SCENARIOS["scatter-gather"][0]["model"], "batch": _BATCH,
            "parallelism": {"sequence_parallel": False, "pp": 2}}
    one_node = {**base, "parallelism": {**base["parallelism"], "tp": 4}, "cluster": {"gpus": 8, **_H100}}
    two_nodes = {**base, "parallelism": {**base["parallelism"], "tp": 8}, "cluster": {"gpus": 16, **_H100}}
    assert not _tp_closed(one_node)
    assert _tp_closed(two_nodes)


def test_scatter_gather_is_the_receivers_blocking_all_gather():
    """Megatron 2021's p2p_communication._communicate: after the exchange, the receiver runs
    gather_split_1d_tensor (a tp all-gather) on what it received, blocking, before the next
    layer; the sender's transfer carries 1/tp of the tensor and ends with it."""
    d, mode = SCENARIOS["scatter-gather"]
    eng = _engine(d, mode, True)
    tl = eng.run()
    gathers = [i for i in eng.plan.ranks[1].instrs if isinstance(i, Collective) and i.exposed_dim == Dim.PP]
    recvs = [i for i in eng.plan.ranks[1].instrs if isinstance(i, Recv) and not i.local]
    assert len(gathers) == len(recvs) > 0
    assert all(g.blocking and g.steps[0][:2] == (Dim.TP, CollectiveOp.ALL_GATHER) for g in gathers)
    assert gathers[0].steps[0][2] == eng.prog.pp_gather_bytes == 8 * eng.prog.pp_bytes
    ev = tl.events
    rows = ev[(ev["stream"] == "tp") & (ev["kind"] == "pp")]
    recv_rows = ev[ev["stream"].isin(["pp-recv-f", "pp-recv-b"])]
    assert len(rows) == len(recv_rows) == len(recvs) * 2  # both pipeline ranks receive
    # each gather starts once its slices have arrived
    for _, g in rows.iterrows():
        got = recv_rows[(recv_rows["rank"] == g["rank"]) & (recv_rows["microbatch"] == g["microbatch"])
                        & (recv_rows["stage"] == g["stage"])]
        assert len(got) == 1 and g["start_s"] >= got["end_s"].iloc[0]
    # its exposed time counts as pipeline communication, its wait names it
    w = tl.waits
    assert w[w["what"].str.contains("pipeline scatter/gather")]["cause"].eq("pp").all()
    assert sum(tl.exposed_s[r]["pp"] for r in tl.ranks) >= (rows["end_s"] - rows["start_s"]).sum() * (1 - 1e-9)


def test_a_collective_run_in_closed_form_on_held_links_is_refused():
    eng = _engine(SCENARIOS["tp-sp-zero1"][0], "reduced", True)
    net = eng.net
    env = events.Environment()
    group = np.arange(4).reshape(1, 4)
    req = CollectiveRequest(CollectiveOp.ALL_REDUCE, Dim.TP, group, 64 << 20)
    net.start(env, req)  # runs on these links now
    with pytest.raises(RuntimeError, match="closed form on links another collective holds"):
        net.run_closed_form(env, req, 0.0)


def _wake_log(lean: bool) -> list:
    env = events.Environment() if lean else simpy.Environment()
    delay = (lambda s: s) if lean else env.timeout
    at = events.At if lean else (lambda t: events.simpy_wake_at(env, t))
    log = []
    now0, target = 0.8481164085081618, 3.3471704196953707  # now + (target - now) != target

    def runner():
        yield delay(now0)
        yield at(target)
        log.append(("runner", env.now))

    def other():
        yield delay(target)
        log.append(("other", env.now))

    env.process(other())
    env.process(runner())
    env.run()
    return log


def test_a_process_wakes_at_an_absolute_time_exactly_on_both_cores():
    now0, target = 0.8481164085081618, 3.3471704196953707
    assert now0 + (target - now0) != target  # what a delay would give
    lean, ref = _wake_log(True), _wake_log(False)
    assert lean == ref
    assert [t for _, t in lean] == [target, target]
    assert [n for n, _ in lean] == ["other", "runner"]  # scheduled later at that instant: after


@pytest.mark.parametrize("d", AGREEMENT_SCENARIOS, ids=[d["name"] for d in AGREEMENT_SCENARIOS])
def test_every_parallelism_gives_the_same_timeline_with_stretches(d):
    """The estimate-agreement set (DDP, ZeRO 1-3, HSDP, TP/SP, async TP, TE overlap, CP, EP, every
    shipped schedule) on the flow network, reduced mode: stretches on and off agree value for value.
    (By hand, round 14: the same set on both networks and in both modes, 164 runs, all equal.)"""
    d = {**d, "network": "flow"}
    on, off = _engine(d, "reduced", True).run(), _engine(d, "reduced", False).run()
    assert on.step_time_s == off.step_time_s
    pd.testing.assert_frame_equal(_rows(on.events), _rows(off.events), check_exact=True)
    pd.testing.assert_frame_equal(_rows(on.waits), _rows(off.waits), check_exact=True)
    assert on.exposed_s == off.exposed_s and on.comm_bytes == off.comm_bytes
    assert on.busy_compute_s == off.busy_compute_s and on.contention_s == off.contention_s
    assert on.network_report == off.network_report
