"""The engine replays every schedule: bubbles equal the published formulas (unit costs, zero
communication), match the independent unit-cost replay, and a stalled loop is reported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simulator.engine.core import Engine
from simulator.errors import SimulationStalled
from simulator.network.alpha_beta import IdealNetwork
from simulator.schedules import build_schedule, replay_unit_costs
from simulator.schedules.base import Action, PipelineSchedule
from simulator.workload.program import synthetic_program

DATA = Path(__file__).parent / "data"


def idle_per_rank(name: str, p: int, m: int, v: int, F: float, B: float, W: float) -> tuple[list[float], float]:
    sched = build_schedule(name, p, m, v)
    tl = Engine(synthetic_program(sched, F_s=F, B_s=B, W_s=W), IdealNetwork()).run()
    return [tl.step_time_s - tl.busy_compute_s[r] for r in tl.ranks], tl.step_time_s


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
def test_1f1b_and_gpipe_bubble(p, m):
    for name in ("1f1b", "gpipe"):
        idle, _ = idle_per_rank(name, p, m, 1, F=1.0, B=2.0, W=0.0)
        assert idle == pytest.approx([(p - 1) * 3.0] * p), f"{name=}, {p=}, {m=}"


@pytest.mark.parametrize("p,v", [(4, 2), (4, 4), (8, 2)])
def test_interleaved_bubble_is_divided_by_v(p, v):
    m = 2 * p
    # Per-chunk costs are a 1/v share of the rank's F and B.
    idle, _ = idle_per_rank("interleaved-1f1b", p, m, v, F=1.0 / v, B=2.0 / v, W=0.0)
    assert max(idle) == pytest.approx((p - 1) * 3.0 / v), f"{p=}, {v=}, {idle=}"


@pytest.mark.parametrize("F,B,W", [(1.0, 2.0, 1.0), (1.0, 2.0, 0.5), (2.0, 3.0, 1.0)])
def test_zb_h1_bubble(F, B, W):
    p, m = 4, 12
    idle, _ = idle_per_rank("zb-h1", p, m, 1, F=F, B=B, W=W)
    assert max(idle) == pytest.approx((p - 1) * (F + B - 2 * W)), f"{F=}, {B=}, {W=}, {idle=}"


@pytest.mark.parametrize("p", [4, 8])
def test_dualpipe_and_dualpipev_bubble(p):
    # Balanced chunks (F = I = W), the case the DualPipe README's table assumes; F&B = F + B.
    F = I = W = 1.0
    B = I + W
    FB = F + B
    idle, _ = idle_per_rank("dualpipe", p, 4 * p, 1, F=F, B=B, W=W)
    assert max(idle) == pytest.approx((p / 2 - 1) * (FB + B - 3 * W)), f"{p=}, {idle=}"
    # DualPipeV: the same bubble on p/2 devices (p stages, two per device).
    idle_v, _ = idle_per_rank("dualpipev", p // 2, 4 * p, 1, F=F, B=B, W=W)
    assert max(idle_v) == pytest.approx((p / 2 - 1) * (FB + B - 3 * W)), f"{p=}, {idle_v=}"


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2), ("zb-h1", 4, 8, 1),
                                        ("zbv", 4, 8, 1), ("dualpipe", 4, 16, 1), ("dualpipev", 4, 16, 1)])
def test_engine_step_equals_independent_unit_cost_replay(name, p, m, v):
    sched = build_schedule(name, p, m, v)
    tl = Engine(synthetic_program(sched, F_s=1.0, B_s=2.5, W_s=1.0), IdealNetwork()).run()
    assert tl.step_time_s == pytest.approx(replay_unit_costs(sched, F=1.0, B=2.5, W=1.0).makespan)


def test_stalled_engine_reports_waiting_ranks_and_returns_nothing():
    # Rank 0 lists its backward before its forward; rank 1 waits for that forward forever.
    # validate_schedule would reject this; the engine is given it directly to show it never hangs.
    a = Action
    sched = PipelineSchedule(
        name="cyclic", num_ranks=2, num_microbatches=1, chains=((0, 1),), stage_rank=(0, 1),
        actions=((a(0, "B", 0), a(0, "F", 0)), (a(1, "F", 0), a(1, "B", 0))),
    )
    with pytest.raises(SimulationStalled, match=r"simulation stalled .*: rank 0 \(pp 0\) waits on 0F0 \(same rank\) before 0B0; "
                       r"rank 1 \(pp 1\) waits on activation of 0F0 from pp rank 0 before 1F0"):
        Engine(synthetic_program(sched, 1.0, 2.0), IdealNetwork()).run()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "simulator.cli", *args], capture_output=True, text=True)


def test_schedule_file_simulates_a_users_schedule(tmp_path):
    from simulator.schedules import save_schedule_csv

    path = tmp_path / "mine.csv"
    save_schedule_csv(build_schedule("1f1b", 4, 8), path)
    base = ["simulate", str(DATA / "scenarios" / "small-llama.yaml"), "--json", "--no-dashboard", "--set", "batch.global_batch_size=64"]
    from_file = _cli(*base, "--schedule-file", str(path))
    built_in = _cli(*base)
    assert from_file.returncode == 0, from_file.stderr
    import json

    assert json.loads(from_file.stdout)["step_time_s"] == pytest.approx(json.loads(built_in.stdout)["step_time_s"])


def test_malformed_and_deadlocking_schedule_files_exit_2():
    base = ["simulate", str(DATA / "scenarios" / "small-llama.yaml"), "--no-dashboard"]
    r = _cli(*base, "--schedule-file", str(DATA / "schedules" / "malformed.csv"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert "malformed.csv" in r.stderr
    r = _cli(*base, "--schedule-file", str(DATA / "schedules" / "deadlock_4ranks.csv"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "waits for" in r.stderr and "rank" in r.stderr
