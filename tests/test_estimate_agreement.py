"""One cost model (issue 13): the sweep's closed-form estimate sums the workload's own plan, so it
agrees with the event-driven simulation on step time across every parallelism it covers."""

from __future__ import annotations

import pytest

from agreement_scenarios import AGREEMENT_SCENARIOS
from simulator.scenario import build_scenario
from simulator.simulate import simulate
from simulator.sweep.estimate import Estimator

_EST = Estimator()  # one per module: its caches assume the shipped files do not change


def test_the_set_covers_every_parallelism_and_schedule():
    from simulator.schedules import schedule_names

    assert len(AGREEMENT_SCENARIOS) >= 30
    names = " ".join(d["name"] for d in AGREEMENT_SCENARIOS)
    for tag in ("ddp", "zero1", "zero2", "zero3", "hsdp", "tp", "cp", "ep", *schedule_names()):
        assert tag in names, tag


@pytest.mark.parametrize("d", AGREEMENT_SCENARIOS, ids=[d["name"] for d in AGREEMENT_SCENARIOS])
def test_estimate_agrees_with_simulation_within_10_percent(d):
    sc = build_scenario(d)
    sim = simulate(sc).timeline.step_time_s
    est = _EST.estimate(sc).step_time_s
    assert est == pytest.approx(sim, rel=0.10), f"{d['name']}: estimate {est * 1e3:.2f} ms, simulation {sim * 1e3:.2f} ms"


def test_estimate_optimizer_follows_hsdp_and_expert_sharding():
    # The optimizer step is the program's: HSDP shards over the shard group, experts over edp.
    from agreement_scenarios import scenario, SMALL_MOE

    for d in (scenario("h", parallelism={"zero": 3, "fsdp_shard_size": 4}),
              scenario("m", model=SMALL_MOE, parallelism={"ep": 8, "zero": 1})):
        sc = build_scenario(d)
        assert _EST.estimate(sc).optimizer_s == pytest.approx(simulate(sc).program.optimizer_s, rel=1e-9)


@pytest.mark.parametrize("d", AGREEMENT_SCENARIOS, ids=[d["name"] for d in AGREEMENT_SCENARIOS])
def test_estimate_memory_is_the_memory_model_of_the_layout(d):
    # The sweep prunes and ranks by this figure. Its program view lacked the layout's expert share,
    # so expert optimizer state was sharded over dp instead of edp: Mixtral ep 8 ZeRO-1 on 128 H100
    # estimated 72.5 GiB (fits) where the simulation says 75.9 of 75.6 (does not fit), ranked 2nd.
    from simulator.profile import load_profile
    from simulator.simulate import resolve_schedule
    from simulator.workload.memory import memory_report
    from simulator.workload.program import build_program

    sc = build_scenario(d)
    prof = load_profile(sc.cluster.gpu_name)
    mem = memory_report(sc, build_program(sc, prof, resolve_schedule(sc)), prof.hbm_gib, prof.usable_memory_fraction)
    assert _EST.estimate(sc).peak_memory_gib == pytest.approx(mem.peak_gib, rel=1e-9), d["name"]


@pytest.mark.parametrize("pp,gbs", [(2, 256), (4, 128)])
def test_estimate_lets_later_stages_reduce_in_their_drain(pp, gbs):
    # megatron-core's later stages reduce their gradients in one piece after their last backward,
    # which runs while the first stage drains the pipeline. The estimate charged the last rank's
    # whole reduction as the step's tail: 1.10 x the simulation at tp8 pp2 dp64 with 4 microbatches.
    from simulator.scenario import default_scenario_dict

    d = default_scenario_dict()
    d["parallelism"].update(pp=pp)
    d["batch"]["global_batch_size"] = gbs
    d["network"] = "alpha-beta"
    sc = build_scenario(d)
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    assert _EST.estimate(sc).step_time_s == pytest.approx(sim, rel=0.02)


def test_estimate_memory_keys_the_bucket_field_as_written():
    # memory_report sizes its bucket reserve by the field (40M where unset), not by the resolved
    # bucket: an unset field and the value it resolves to (DeepSpeed without overlap: 500M) differ
    # in memory and must not share the estimator's memory cache.
    from agreement_scenarios import scenario

    est = Estimator()
    par = {"pp": 2, "zero": 1, "overlap_grad_reduce": False}
    unset = build_scenario(scenario("u", gbs=32, framework="megatron-deepspeed", parallelism=par))
    given = build_scenario(scenario("g", gbs=32, framework="megatron-deepspeed",
                                    parallelism={**par, "grad_bucket_params": unset.grad_bucket_params}))
    a, b = est.estimate(unset).peak_memory_gib, est.estimate(given).peak_memory_gib
    assert a == pytest.approx(simulate(unset).memory.peak_gib, rel=1e-9)
    assert b == pytest.approx(simulate(given).memory.peak_gib, rel=1e-9)
    assert a != b


def test_reference_programs_are_not_shared_across_what_the_ops_read():
    # _layer_key dropped zero, dp and the global batch, but the layer's ops read them (main_grad
    # adds without ZeRO 3, FSDP2's copy-out with it, the loss all-reduce over dp, Float8 weight
    # casts per microbatch): one Estimator that had seen a ZeRO-3 point priced torchtitan
    # interleaved-1f1b ZeRO-1 below at 53.8 ms, a fresh one 45.8 ms.
    from agreement_scenarios import scenario
    from simulator.sweep.estimate import _layer_key

    base = dict(gbs=32, parallelism={"pp": 4, "vpp": 2}, schedule="interleaved-1f1b")
    shared = Estimator()
    for fw in ("torchtitan", "generic"):
        for z in (3, 1):
            d = scenario(f"{fw}-z{z}", framework=fw, **{**base, "parallelism": {**base["parallelism"], "zero": z}})
            sc = build_scenario(d)
            assert shared.estimate(sc).step_time_s == pytest.approx(Estimator().estimate(sc).step_time_s, rel=1e-12), d["name"]
    # Whatever shares a key builds the same reference Program.
    points = [scenario("a", **over) for over in (
        dict(parallelism={"zero": 1}), dict(parallelism={"zero": 3}), dict(parallelism={"zero": 0}, gpus=1, gbs=4),
        dict(parallelism={"zero": 0}), dict(framework="megatron-deepspeed", parallelism={"zero": 0}, gbs=64),
        dict(framework="megatron-deepspeed", parallelism={"zero": 0}), dict(framework="torchtitan", parallelism={"zero": 3}),
        dict(framework="torchtitan", parallelism={"zero": 3}, gpus=32, gbs=32),
        dict(framework="torchtitan", parallelism={"zero": 3, "fsdp_shard_size": 4}),
        dict(framework="torchtitan", parallelism={"zero": 1}),
    )]
    by_key: dict[str, tuple] = {}
    for d in points:
        sc = build_scenario(d)
        est = Estimator()
        tab = est._table(sc)
        totals = tuple(round(float(v.sum()), 15) for v in tab.comp.values())
        assert by_key.setdefault(_layer_key(sc, est._layout(sc, est._point_schedule(sc)[0])), totals) == totals
    assert len(by_key) >= 8


@pytest.mark.parametrize("pp,gbs", [(1, 256), (4, 128)])
def test_estimate_gathers_kept_fsdp_units_once_a_step(pp, gbs):
    # Without resharding after forward a unit is gathered before its stage's first forward only
    # (the plan's rule); the estimate added the gather to every microbatch's forward, so its
    # error grew with the microbatch count (llama3-8b, 16 H100, 16 microbatches: +52%). Here,
    # simulation 241.9 / 157.2 ms: estimated 266.1 / 169.1 ms before, 242.1 / 156.7 ms now.
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("zero3-keep-many", gbs=gbs,
                                 parallelism={"zero": 3, "pp": pp, "fsdp_reshard_after_forward": False}))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    assert Estimator().estimate(sc).step_time_s == pytest.approx(sim, rel=0.05)


def test_estimate_memory_under_the_fp8_all_gather_does_not_depend_on_the_points_before():
    # The estimator's reference Program is shared by points of every ZeRO stage; the FP8
    # all-gather's per-unit bytes (bf16 embedding, head and norms, 1-byte Float8 linears) must
    # be there for a ZeRO-3 point even when a ZeRO-1 point built it (they fell back to
    # param_bytes x parameters: 2.60 GiB of gathered units against the simulation's 2.22).
    from simulator.profile import load_profile
    from simulator.simulate import resolve_schedule
    from simulator.workload.memory import memory_report
    from simulator.workload.program import build_program

    def d(zero):
        return {"name": f"fp8ag{zero}", "model": "llama3-8b", "framework": "torchtitan", "dtype": "fp8",
                "fp8": {"recipe": "tensorwise", "param_all_gather": True}, "flash_attention": True,
                "parallelism": {"tp": 1, "pp": 1, "zero": zero},
                "batch": {"micro_batch_size": 1, "global_batch_size": 16, "seq_length": 2048},
                "cluster": {"gpus": 16, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}, "network": "alpha-beta"}
    est = Estimator()
    est.estimate(build_scenario(d(1)))
    sc = build_scenario(d(3))
    prof = load_profile(sc.cluster.gpu)
    mem = memory_report(sc, build_program(sc, prof, resolve_schedule(sc)), prof.hbm_gib, prof.usable_memory_fraction)
    assert est.estimate(sc).peak_memory_gib == pytest.approx(mem.peak_gib, rel=1e-9)


@pytest.mark.parametrize("case", ["tied-pp2", "fp16-1gpu"])
def test_estimate_pays_the_step_level_terms(case):
    # The plan runs Program.step_collectives after the gradient reduction: the tied-embedding
    # gradient all-reduce between the first and last stage's ranks (262 MB of fp32 main grads
    # here, across nodes), the fp16 unscale and the gradient norm with their all-reduces. The
    # estimate left them out: tied pp 2 read 44.05 ms against the simulation's 49.31 (-10.7%),
    # fp16 on one GPU 69.95 against 74.00 (-5.5%: the unscale's 2.70 ms and the norm's 1.35 ms).
    from agreement_scenarios import scenario, SMALL_DENSE

    d = {"tied-pp2": scenario("tied-pp2", model=dict(SMALL_DENSE, tied_embeddings=True), parallelism={"pp": 2, "zero": 1}),
         "fp16-1gpu": scenario("fp16-1gpu", gpus=1, gbs=4, dtype="fp16")}[case]
    sc = build_scenario(d)
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    est = Estimator().estimate(sc)
    assert est.step_time_s == pytest.approx(sim, rel=0.02), f"estimate {est.step_time_s * 1e3:.2f} ms, simulation {sim * 1e3:.2f} ms"
    assert est.step_terms_s > 0


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_estimate_ties_no_embedding_under_v_schedules(schedule):
    # Both ends of the chain sit on pp rank 0 under V schedules: the plan all-reduces nothing (rank
    # 0 holds the matrix once, ops.tied_head_shares_embedding), and neither does the estimate: its
    # step terms cost no more than the untied model's (whose rank 0 holds a second matrix for the
    # gradient norm to read), and it is as close to the simulation as for the untied model.
    from agreement_scenarios import scenario, SMALL_DENSE

    def d(tied):
        return scenario("v", model=dict(SMALL_DENSE, tied_embeddings=tied), gbs=64, parallelism={"pp": 4, "zero": 1},
                        schedule=schedule)
    tied, untied = build_scenario(d(True)), build_scenario(d(False))
    res = simulate(tied)
    assert "tied embedding grads" not in {t.label for t in res.program.step_collectives}
    est_tied, est_untied = Estimator().estimate(tied), Estimator().estimate(untied)
    assert est_tied.step_terms_s <= est_untied.step_terms_s
    # Tied or not, the estimate is as close to the simulation (a tied all-reduce, 262 MB, would
    # add far more than the 0.5% allowed).
    ratio_tied = est_tied.step_time_s / res.timeline.step_time_s
    ratio_untied = est_untied.step_time_s / simulate(untied).timeline.step_time_s
    assert ratio_tied == pytest.approx(ratio_untied, rel=0.005)


def test_estimate_gathers_the_fp8_all_gathers_bytes():
    # With FP8 all-gather, FSDP moves 1-byte Float8 weights (Program.unit_gather_bytes); the
    # estimate priced every unit at the dtype's 2 bytes: torchtitan tensorwise ZeRO-3 on 16 H100
    # read 42.03 ms against the simulation's 39.78 (+5.7%). (Since FSDP2's one communicator:
    # 50.06 against 49.97.)
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("fp8-ag", framework="torchtitan", dtype="fp8", parallelism={"zero": 3},
                                 fp8={"recipe": "tensorwise", "param_all_gather": True}))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    assert Estimator().estimate(sc).step_time_s == pytest.approx(sim, rel=0.02)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_estimate_hides_an_actions_first_gather_as_the_plan_does(schedule):
    # Resharded ZeRO-3 under a pipeline: the plan gathers every segment's layer ids as units (the
    # embedding and the head on their own) in each rank's order of actions, so an action's first
    # unit is gathered behind the rank's previous action (the head's backward gather behind the
    # head's forward). The estimate merged the head into the last layer's unit and put every
    # row's gather behind the row before in the model (the last row's backward behind the
    # embedding's): 96.18 / 91.92 ms against the simulation's 93.89 / 87.95 (+2.4% / +4.5%).
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("z3-pp4", gbs=64, parallelism={"pp": 4, "zero": 3}, schedule=schedule))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    assert Estimator().estimate(sc).step_time_s == pytest.approx(sim, rel=0.02)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_estimate_prices_zero3_gathers_on_its_exact_program_path(schedule):
    # A split that gives the embedding and the loss positions of their own takes the estimate's
    # exact path (the point's own program), which priced no FSDP gather at all: 1f1b pp 4 read
    # 69.47 ms against the simulation's 77.56 (-10.4%).
    from agreement_scenarios import scenario

    par = {"pp": 4, "zero": 3, "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}
    if schedule == "interleaved-1f1b":
        par["vpp"] = 2
    # This split gives the middle positions 5 layers and the ends 3 and the embedding or head, so
    # 1F1B's heaviest ranks are the middle ones. The estimate's replay of its per-action costs
    # reads 1F1B at 86.6 ms of pipeline where the simulation's takes 89.4: the middle ranks compute
    # 76.6 ms there (75.4 ms of actions here) and also wait 1.1 ms on p2p in the steady state, which
    # the estimate leaves out (it prices p2p on the fill and drain). Until round 23 a mean-stage
    # replay plus the heaviest rank's excess over-read the pipeline by about as much (-1.2%), which
    # hid this; now 1F1B reads -2.7% (-2.2% at ZeRO-1) and the gathers' -10.4% stays well outside.
    sc = build_scenario(scenario("exact-zero3", gbs=64, parallelism=par, schedule=schedule))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    est = Estimator().estimate(sc).step_time_s
    rel = 0.03 if schedule == "1f1b" else 0.02
    assert est == pytest.approx(sim, rel=rel), f"estimate {est * 1e3:.2f} ms, simulation {sim * 1e3:.2f} ms"


@pytest.mark.parametrize("model,zero,schedule", [
    *[("small", z, s) for s in ("zbv", "dualpipev") for z in (0, 1, 2, 3)],
    *[("llama3-8b", z, s) for s in ("zbv", "dualpipev") for z in (1, 3)],
])
def test_estimate_reads_v_schedules_as_placed(model, zero, schedule):
    # V placements put the first stage (the embedding) and the last (the LM head and the loss)
    # both on pp rank 0, the heaviest rank, whose extra work fills the idle it would have with
    # equal stages. The estimate replayed the schedule with the mean stage and added rank 0's
    # excess on top, counting that idle twice: small model zbv +2.7%, DualPipeV +5.8% at ZeRO-1
    # (+2.6..+3.1% / +5.6..+5.8% at every stage), Llama-3-8B +2.2% / +2.9% (ZeRO-3 +1.2% / +5.5%).
    # The replay now takes each position's own cost and adds the idle above the heaviest rank's
    # busy time: -0.2 / -0.3% at ZeRO-1 (+0.3 / +0.1% at ZeRO-3), Llama-3-8B -0.2 / -0.2%.
    from agreement_scenarios import scenario, SMALL_DENSE

    d = scenario("v", gbs=64, parallelism={"pp": 4, "zero": zero}, schedule=schedule)
    if model != "small":
        d["model"] = model
    sc = build_scenario(d)
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    est = _EST.estimate(sc).step_time_s
    assert est == pytest.approx(sim, rel=0.01), f"estimate {est * 1e3:.2f} ms, simulation {sim * 1e3:.2f} ms"


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "gpipe", "zb-h1"])
def test_estimate_keeps_one_chain_end_a_rank_schedules_close(schedule):
    # Each position replayed with its own cost also reads the schedules that hold one end a rank:
    # small model pp 4 ZeRO-1 went +0.62 / -1.78 / +0.62 / +1.17% -> -0.20 / -0.96 / -0.20 /
    # -0.50% (1F1B's last rank idles through the fill and drain of the other stages, which the
    # mean stage, holding the head's share, over-read; interleaved-1f1b's ranks hold a middle
    # position beside an end one).
    from agreement_scenarios import scenario

    par = {"pp": 4, "zero": 1, "vpp": 2 if schedule == "interleaved-1f1b" else 1}
    sc = build_scenario(scenario("one-end", gbs=64, parallelism=par, schedule=schedule))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    est = _EST.estimate(sc).step_time_s
    assert est == pytest.approx(sim, rel=0.012), f"estimate {est * 1e3:.2f} ms, simulation {sim * 1e3:.2f} ms"


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_estimate_reads_an_uneven_v_split_as_placed(schedule):
    # With the embedding and the loss counted in the split, the small model's 16 layers sit 1, 2,
    # 2, 3 | 3, 2, 2, 1 along the V: the turn's rank 3 holds the heaviest positions, not the
    # ends' rank 0, and the middle positions differ. The mean-stage replay read zbv +1.2% and
    # DualPipeV +2.7%, and a replay of three classes (first, mean middle, last) would read
    # +0.8% / +2.1%; the replay of each position's own cost reads both within 0.1%.
    from agreement_scenarios import scenario

    par = {"pp": 4, "zero": 1, "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}
    sc = build_scenario(scenario("uneven-v", gbs=64, parallelism=par, schedule=schedule))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    est = _EST.estimate(sc).step_time_s
    assert est == pytest.approx(sim, rel=0.005), f"estimate {est * 1e3:.2f} ms, simulation {sim * 1e3:.2f} ms"



def test_estimate_reduces_torchtitan_gradients_every_microbatch_as_the_plan_does():
    # torchtitan's gradient accumulation without PP reduce-scatters every microbatch's gradients
    # (Program.grad_reduce_every_microbatch), waiting for the previous unit's reduction before
    # the next (grad_reduce_waits_previous); the estimate replayed the last backward's reductions
    # only: small dense ZeRO-3 on 16 H100, 4 microbatches, 99.6 ms against the simulation's 107.1 (then
    # 106.9; since FSDP2's one communicator 112.9 against 112.6).
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("tt-accum", framework="torchtitan", gbs=64, parallelism={"zero": 3}))
    assert sc.num_microbatches == 4
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    assert Estimator().estimate(sc).step_time_s == pytest.approx(sim, rel=0.02)


@pytest.mark.parametrize("gbs,prefetch", [(16, 1), (128, 1), (128, 2)])
def test_estimate_queues_fsdp2_gathers_behind_its_reduce_scatters(gbs, prefetch):
    # FSDP2's gathers and reduce-scatters share one communicator (Program.fsdp_one_communicator):
    # a backward's gather waits behind the reduce-scatter issued before it. The estimate priced
    # each gather alone and the reductions on a stream of their own: small dense ZeRO-3 on 16 H100
    # (dp across two nodes), one microbatch, 28.11 ms against the simulation's 29.06 (-3.3%);
    # 4 microbatches -5.1%. It now replays a pp-1 rank's queue (two and three microbatches,
    # extended by their difference beyond three).
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("tt-queue", framework="torchtitan", gbs=gbs,
                                 parallelism={"zero": 3, "fsdp_prefetch": prefetch}))
    assert sc.num_microbatches == gbs // 16
    rep = simulate(sc, with_critical_path=False).report
    est = Estimator().estimate(sc)
    assert est.step_time_s == pytest.approx(rep.step_time_s, rel=0.01)
    # The queue's reduce-scatters slow the backward they overlap: compute, as the simulation
    # counts it, not exposed dp (at 8 microbatches the estimate reported 35.5 ms exposed against
    # the simulation's 21.5, its compute 11 ms short).
    assert est.pipeline_s == pytest.approx(rep.step_breakdown_s["compute"], rel=0.02)
    assert est.exposed_comm_s["dp"] == pytest.approx(rep.step_breakdown_s["exposed_dp"], rel=0.15, abs=2e-4)


@pytest.mark.parametrize("schedule,vpp,rel", [("1f1b", 1, 0.02), ("interleaved-1f1b", 2, 0.04)])
def test_estimate_reduces_torchtitan_pipeline_gradients_after_the_last_backward(schedule, vpp, rel):
    # torch.distributed.pipelining reduces a stage's FSDP2 gradients after its last backward, unit
    # by unit, the compute stream waiting for each (the plan's reduce_stage_grads); the estimate
    # overlapped them with that backward: small dense, pp 4, 8 microbatches on 16 H100, 65.31 /
    # 57.91 ms against the simulation's 66.46 / 61.29 (-1.7% / -5.5%); now 66.80 / 59.40.
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("tt-pp", framework="torchtitan", gbs=32, schedule=schedule,
                                 parallelism={"zero": 3, "pp": 4, "vpp": vpp, "fsdp_reshard_after_forward": False}))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    assert Estimator().estimate(sc).step_time_s == pytest.approx(sim, rel=rel)


@pytest.mark.parametrize("schedule,nmb,rel", [("dualpipev", 8, 0.02), ("1f1b", 8, 0.01)])
def test_estimate_hides_an_actions_gather_wait_in_the_idle_before_it(schedule, nmb, rel):
    # Resharded ZeRO-3: the plan issues an action's first gather on the rank's own order, so a
    # rank idle waiting for its input (the pipeline's bubble) has that gather running. The
    # replay charged the wait on top of the idle: 64 GPUs (dp 16 across nodes), seq 512, 8
    # microbatches read DualPipeV +2.91% and 1F1B +1.51%; letting the wait run from the rank's
    # previous end (replay_action_costs' ``wait``): +1.93% / +0.60%.
    from agreement_scenarios import scenario

    sc = build_scenario(scenario("z3-idle", gpus=64, seq=512, gbs=16 * nmb, parallelism={"pp": 4, "zero": 3},
                                 schedule=schedule))
    sim = simulate(sc, with_critical_path=False).timeline.step_time_s
    est = Estimator().estimate(sc).step_time_s
    assert est == pytest.approx(sim, rel=rel), f"estimate {est * 1e3:.2f} ms, simulation {sim * 1e3:.2f} ms"
