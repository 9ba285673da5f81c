"""islands simulate: the run's own quorum, grace and merge policy on a simulated clock, beside
synchronous DiLoCo and data-parallel under the same failures."""

import json
import math
import textwrap

import pytest

from islands.core.config import ConfigError
from islands.core.simulate import Region, SimConfig, load_sim_config, simulate, wire_bits


def config(regions=(("us-east", 2, 1.0), ("eu-west", 2, 1.0)), **sections) -> SimConfig:
    data = {
        "regions": [
            {"name": n, "learners": k, "chips_per_learner": 4, "step_s": s, "link_gbps": 1e5, "latency_s": 0.0}
            for n, k, s in regions
        ],
        "run": {"params": 1000, "tokens_per_step": 10, "inner_steps": 10, "publish_s": 0.0, "hours": 1.0},
        "quorum": {"min_quorum": sum(k for _, k, _ in regions), "round_timeout_s": 300.0},
    }
    for section, fields in sections.items():
        data.setdefault(section, {}).update(fields)
    return SimConfig.model_validate(data)


def test_no_faults_and_equal_speeds_is_synchronous_diloco_round_by_round():
    result = simulate(config())
    decoupled, sync = result.decoupled.records, result.sync_diloco.records
    assert len(decoupled) == len(sync) == 359  # 10 s rounds over an hour; the last closes just after it
    for d, s in zip(decoupled, sync):
        assert d.number == s.number and d.reason == "all-in"
        assert sorted(d.learners) == sorted(s.learners) and len(d.learners) == 4
        assert d.tokens == s.tokens == 4 * 10 * 10
        assert d.staleness == s.staleness == (0, 0, 0, 0)
        assert d.closed_at == pytest.approx(s.closed_at, abs=1e-6)
    assert result.decoupled.goodput == pytest.approx(result.sync_diloco.goodput, rel=1e-9)
    assert result.decoupled.goodput == pytest.approx(359 / 360)


def test_a_region_outage_longer_than_the_round_timeout_closes_rounds_on_the_timeout():
    cfg = config(faults={"outages": [{"region": "eu-west", "at_s": 1000.0, "for_s": 1200.0}]})
    result = simulate(cfg)
    timeouts = [r for r in result.decoupled.records if r.reason == "timeout"]
    assert result.decoupled.closings["timeout"] == len(timeouts) >= 3  # 1200 s out, 300 s a round
    assert all(r.learners and all(n.startswith("us-east") for n in r.learners) for r in timeouts)
    assert all(1000.0 <= r.closed_at <= 2200.0 + 300.0 for r in timeouts)
    # The lockstep schemes lose the region's learners for the outage; the others go on.
    assert result.decoupled.goodput < 1 and result.sync_diloco.goodput < result.decoupled.goodput


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    faults = {"chip_mtbf_h": 20.0, "recover_s": 120.0, "straggler_fraction": 0.1, "stall_fraction": 0.1}
    cfg = config(faults=faults, quorum={"min_quorum": 2})
    first, again = simulate(cfg).summary(), simulate(cfg).summary()
    assert json.dumps(first) == json.dumps(again)
    other = simulate(cfg.model_copy(update={"seed": 1})).summary()
    assert json.dumps(other) != json.dumps(first)


def test_failures_cost_the_lockstep_schemes_more_than_the_decoupled_one():
    cfg = config(faults={"chip_mtbf_h": 10.0, "recover_s": 300.0}, quorum={"min_quorum": 2})
    result = simulate(cfg)
    assert 0 < result.data_parallel.goodput < result.decoupled.goodput < 1
    assert 0 < result.sync_diloco.goodput < result.decoupled.goodput
    assert result.decoupled.closings.get("quorum+grace", 0) > 0


def test_a_slow_region_trains_paced_phases_and_its_link_carries_what_its_deltas_weigh():
    """eu-west at a third of the speed trains H/3-step phases after its first, so its deltas come as often; each
    learner sends one int4 delta (4.125 bits a value) a phase and receives every round."""
    cfg = config(
        regions=(("us-east", 1, 1.0), ("eu-west", 1, 3.0)),
        run={"params": 1e9, "inner_steps": 30},
    )
    result = simulate(cfg)
    d = result.decoupled
    assert set(d.closings) == {"all-in"} and set(d.staleness) == {0}
    assert d.goodput > 0.98
    up_gbps = 1e9 * wire_bits("int4") / 30 / 1e9  # a delta every 30 s
    down_gbps = 1e9 * 32 / 30 / 1e9  # an fp32 round every 30 s
    for mean, _ in d.links.values():
        # Less the few rounds eu-west's first two phases cost: H steps each, its own rate not known
        # before its first ends, and the others' not before it holds a round that records them.
        assert mean == pytest.approx(max(up_gbps, down_gbps), rel=0.06)
    # Synchronous DiLoCo waits for the slow region: 2 × 1/3 of the 1 + 1/3 steps a second.
    assert result.sync_diloco.goodput == pytest.approx((2 / 3) / (1 + 1 / 3), rel=0.03)


def test_config_errors_are_one_line_naming_the_field(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text(
        textwrap.dedent(
            """
            [[regions]]
            name = "us-east"
            step_s = inf
            """
        )
    )
    with pytest.raises(ConfigError, match=r"^regions\.0\.step_s: .*finite"):
        load_sim_config(path)
    path.write_text('[[regions]]\nname = "us-east"\n[quorum]\nmin_quorum = 3\n')
    with pytest.raises(ConfigError, match=r"^quorum\.min_quorum: 3 is more than the 1 learners$"):
        load_sim_config(path)
    with pytest.raises(ConfigError, match=r"^--config: .* does not exist"):
        load_sim_config(tmp_path / "missing.toml")
    path.write_text(
        '[[regions]]\nname = "us-east"\n[quorum]\nmin_quorum = 1\n[faults]\noutages = [{region = "mars", at_s = 1, for_s = 1}]\n'
    )
    with pytest.raises(ConfigError, match=r"^faults\.outages: region 'mars' is not one of"):
        load_sim_config(path)


def test_the_command_prints_the_schemes_side_by_side_and_ends_with_json(tmp_path, capsys):
    from islands.flows.cli import main

    path = tmp_path / "sim.toml"
    path.write_text(
        '[[regions]]\nname = "us-east"\nlearners = 2\n[[regions]]\nname = "eu-west"\nlearners = 2\n'
        "[run]\nhours = 0.5\nparams = 1e8\n"
    )
    assert main(["simulate", "--config", str(path), "--json", "--seed", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "decoupled" in out[1] and "data-parallel" in out[1]
    figures = json.loads(out[-1])
    for scheme in ("decoupled", "sync_diloco", "data_parallel"):
        assert {"goodput", "utilization", "mean_gbps", "peak_gbps"} <= set(figures[scheme])
        assert all(math.isfinite(figures[scheme][k]) for k in ("goodput", "utilization", "mean_gbps"))
    assert main(["simulate", "--config", str(tmp_path / "nope.toml")]) != 0


@pytest.mark.parametrize("name", ["decoupled_diloco", "decoupled_diloco_128", "three_regions"])
def test_the_shipped_configs_load_and_run(name):
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "simulate" / f"{name}.toml"
    cfg = load_sim_config(path, {"run.hours": 0.5})
    if name.startswith("decoupled_diloco"):
        assert cfg.chips >= 10**6 and len(cfg.regions) == 8
    result = simulate(cfg)
    assert 0 < result.decoupled.goodput <= 1 and result.decoupled.rounds > 0


def test_a_recorded_runs_timings_predict_its_rounds_closings_and_bytes():
    """Two learners whose 10 s phases land a second after they finish, rounds published half a
    second after the last delta: calibrated on those timings, the simulation closes the same
    rounds, all-in, with the same bytes."""
    from islands.core.config import MergeSettings, QuorumSettings
    from islands.core.simulate import RecordedDelta, RecordedRound, calibrated, compare

    rounds = []
    for k in range(10):
        done = 1000.0 + 10 * (k + 1)
        deltas = tuple(
            RecordedDelta(name, region, k, 1000, 5000, done, 10.0, done + 1.0)
            for name, region in (("us-east-0", "us-east"), ("eu-west-0", "eu-west"))
        )
        rounds.append(RecordedRound(k + 1, done + 1.5, "all-in", deltas))
    learners = {"us-east-0": "us-east", "eu-west-0": "eu-west"}
    cfg = calibrated(rounds, learners, 10, QuorumSettings(), MergeSettings())
    assert [r.step_s for r in cfg.regions] == [1.0, 1.0] and cfg.run.tokens_per_step == 100
    assert cfg.regions[0].latency_s == 1.0 and cfg.run.publish_s == 0.5 and cfg.run.delta_bytes == 5000
    found = compare(rounds, cfg, simulate(cfg))
    assert found["predicted"]["rounds"] == 10 and found["predicted"]["closings"] == {"all-in": 10}
    assert found["error"]["rounds"] == 0 and found["error"]["bytes"] < 1e-9


@pytest.mark.parametrize("run_id", ["sim-record", "run-96f8bc"])
def test_a_recorded_demo_run_calibrates_to_its_rounds_closings_and_bytes(run_id):
    """benchmarks/simulate/recorded: the manifests and config of two 8-round `islands run`s of the
    demo (four regions on two shared cores). Fed each learner's recorded phase times, the
    policy's own decisions give their rounds and closings within 10% and their bytes within 5%."""
    from pathlib import Path

    from islands.ops.calibrate import calibration

    store = Path(__file__).resolve().parent.parent / "benchmarks" / "simulate" / "recorded"
    found = calibration(run_id, f"file://{store}/{{bucket}}")
    assert found["recorded"]["rounds"] == 8
    assert found["error"]["rounds"] <= 0.1
    assert all(off <= 0.1 for off in found["error"]["closings"].values())
    assert found["error"]["bytes"] <= 0.05


def test_a_learner_with_recorded_phase_times_takes_each_phase_its_own_time():
    """Phases of 10 steps at 1 s, then 2 s, then the median (1.5 s) a step: deltas at 10, 30, 45,
    60, 75 and 90 s of 100, a round each; at its region's 1 s a step, at 10, 20, … 90 s: nine."""
    plain = config(regions=(("us-east", 1, 1.0),), run={"hours": 100 / 3600, "paced": False})
    region = plain.regions[0].model_dump()
    traced = plain.model_copy(update={"regions": [Region.model_validate(region | {"phase_step_s": [[1.0, 2.0]]})]})
    assert simulate(traced).decoupled.rounds == 6
    assert simulate(plain).decoupled.rounds == 9
    with pytest.raises(ValueError, match="phase_step_s: at most 1 lists"):
        Region.model_validate(region | {"phase_step_s": [[1.0], [2.0]]})


def test_topk_deltas_and_updates_weigh_what_the_codec_sends():
    """A sparse codec's bits come from its settings (positions, values and a scale a chunk): the
    defaults' 0.16 bit a parameter, and more with 8-bit values."""
    from islands.core.config import TopkSettings

    assert wire_bits("topk") == pytest.approx(0.16, abs=0.005)
    assert wire_bits("topk", TopkSettings(value_bits=8)) > wire_bits("topk")
    cfg = config(run={"codec": "topk", "update_codec": "topk"})
    dense = simulate(config(run={"codec": "int4", "update_codec": "int4"})).decoupled
    sparse = simulate(cfg).decoupled
    assert sparse.rounds == dense.rounds and sparse.mean_gbps < dense.mean_gbps / 20
