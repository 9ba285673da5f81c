"""The schedule replay is the synchronous algorithm when nothing is slow or late: equal learners
whose rounds are visible at once give synchronous DiLoCo's model bit for bit, with or without carry
(there is never an unmerged delta to carry, no learner is behind or ahead, every phase is H). Latency is what separates the learner behaviours."""

from dataclasses import replace

import torch

from benchmarks.heldout import PRESET
from benchmarks.inprocess import Budget, sync_diloco
from benchmarks.replay import Schedule, replay
from islands.core.config import MergeSettings
from islands.core.model import build_model, params_of

RULE = MergeSettings(outer_lr=0.7, outer_momentum=0.9)
BUDGET = Budget(steps=4, warmup=1)


def test_equal_learners_and_no_latency_replay_synchronous_diloco_exactly():
    torch.set_num_threads(1)
    sync_rounds = []
    sync = sync_diloco(BUDGET, 0, 2, RULE, on_round=lambda r, theta: sync_rounds.append((r, theta)))
    for behaviour in ({}, {"carry": True}, {"carry": True, "catch_up": True, "paced": True}):
        rounds = []
        theta, facts = replay(
            BUDGET,
            Schedule(2, speeds=(1, 1, 1, 1), publish_s=0.0, **behaviour),
            RULE,
            on_round=lambda r, theta: rounds.append((r, theta)),
        )
        assert facts["rounds"] == 2 and facts["deltas_per_round"] == 4 and facts["mean_staleness"] == 0
        assert all(torch.equal(theta[n], sync[n]) for n in sync)
        assert [r for r, _ in rounds] == [r for r, _ in sync_rounds] == [1, 2]  # every round, seen as published
        assert all(torch.equal(a[n], b[n]) for (_, a), (_, b) in zip(rounds, sync_rounds) for n in sync)
    late, _ = replay(BUDGET, Schedule(2, speeds=(1, 1, 1, 1), publish_s=1.0), RULE)
    assert not all(torch.equal(late[n], sync[n]) for n in sync)


def test_a_warm_start_replays_synchronous_diloco_from_the_same_model():
    torch.set_num_threads(1)
    warm = sync_diloco(BUDGET, 1, 2, RULE)
    sync = sync_diloco(BUDGET, 0, 2, RULE, init=warm)
    theta, _ = replay(BUDGET, Schedule(2, speeds=(1, 1, 1, 1), publish_s=0.0, carry=True), RULE, init=warm)
    assert all(torch.equal(theta[n], sync[n]) for n in sync)
    cold, _ = replay(BUDGET, Schedule(2, speeds=(1, 1, 1, 1), publish_s=0.0), RULE)
    assert not all(torch.equal(theta[n], cold[n]) for n in sync)


def test_paced_phases_bring_the_slow_learner_into_every_round():
    torch.set_num_threads(1)
    budget = Budget(steps=12, warmup=1)
    _, plain = replay(budget, Schedule(3, publish_s=0.0, carry=True), RULE)
    _, paced = replay(budget, Schedule(3, publish_s=0.0, carry=True, paced=True), RULE)
    assert plain["deltas_per_round"] < 3 and paced["deltas_per_round"] > 3.5  # the last round closes on what is left


def test_a_learner_away_only_moves_the_lr_catch_up():
    """Three learners of a run of four, the fourth never sending: rounds close on the three as
    they would in a run of three, and only the catch-up, which counts the run's four, differs."""
    torch.set_num_threads(1)
    budget = Budget(learners=3, steps=4, warmup=1)
    three = Schedule(2, speeds=(1, 1, 1), publish_s=0.0, carry=True)
    alone, _ = replay(budget, three, RULE)
    away, facts = replay(budget, replace(three, away=1), RULE)
    assert facts["rounds"] == 2 and facts["deltas_per_round"] == 3
    assert all(torch.equal(away[n], alone[n]) for n in alone)
    alone, _ = replay(budget, replace(three, catch_up=True), RULE)
    away, _ = replay(budget, replace(three, catch_up=True, away=1), RULE)
    assert not all(torch.equal(away[n], alone[n]) for n in alone)


def test_deltas_and_updates_go_through_their_codecs_with_error_feedback():
    """fp32 deltas are the exact replay; int4 deltas move it off by what the codec drops, and int2
    updates on top move it further (two rounds: error feedback has not caught up yet)."""
    torch.set_num_threads(1)
    sync = sync_diloco(BUDGET, 0, 2, RULE)
    start = params_of(build_model(PRESET, 0))

    def off(**codecs) -> float:
        theta, _ = replay(BUDGET, Schedule(2, speeds=(1, 1, 1, 1), publish_s=0.0, **codecs), RULE)
        return distance(theta, sync) / distance(sync, start)

    assert off(codec="fp32") == 0.0
    int4 = off(codec="int4")
    assert 0.0 < int4 < 0.05
    assert off(codec="int4", update_codec="int2") > 2 * int4


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[n] - b[n]).double().pow(2).sum()) for n in a) ** 0.5
