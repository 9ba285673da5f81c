import pytest

from islands.core.config import QuorumSettings
from islands.core.quorum import Decision, LearnerHistory, cycle, decide, grace_s, quorum_arrivals, seen_lag
from islands.storage.manifest import Contribution

POLICY = QuorumSettings(min_quorum=2, max_quorum=4, grace_max_s=30.0, round_timeout_s=300.0, grace_fraction=None)
LEARNERS = ["a", "b", "c", "d"]
START = 1000.0  # the round opens; its deadline is 1300


def history(**expected_phase):
    """learner=(last_arrival, [phase seconds])."""
    return {
        name: LearnerHistory(phase_seconds=list(s), last_arrival=last) for name, (last, s) in expected_phase.items()
    }


def at(now, arrived, hist=None, policy=POLICY, listing_s=0.0):
    return decide(policy, START, now, arrived, LEARNERS, hist or {}, listing_s)


def test_expected_arrival():
    assert LearnerHistory([100.0, 110.0], 1020.0).expected_arrival() == 1125.0
    assert LearnerHistory([], 1020.0).expected_arrival() is None
    assert LearnerHistory([100.0], None).expected_arrival() is None
    # The time between arrivals, when known, wins over the phase time (it holds the upload too).
    assert LearnerHistory([100.0, 110.0], 1020.0, cycle_s=112.0).expected_arrival() == 1132.0
    assert LearnerHistory([], 1020.0, cycle_s=112.0).expected_arrival() == 1132.0


def test_a_learner_is_waited_for_one_listing_period_past_its_expected_arrival():
    # c is expected at 1125; a delta landing then is seen at the next look, up to 2 s later.
    listed = POLICY
    hist = history(c=(1020.0, [100.0, 110.0]))
    arrived = {"a": 1100.0, "b": 1110.0}
    assert at(1110.0, arrived, hist, listed, 2.0) == Decision(
        close=False, reason=None, recheck_at=1127.0, waiting_for=("c",)
    )
    assert at(1126.0, arrived, hist, listed, 2.0).close is False
    assert at(1127.0, arrived, hist, listed, 2.0).reason == "quorum+grace"
    # Past the grace cap too: a learner expected right at the cap (1140) is still waited for 2 s.
    capped = history(c=(1020.0, [120.0]))
    assert at(1110.0, arrived, capped, listed, 2.0).recheck_at == 1142.0
    # Nobody worth waiting for: the listing period does not hold the round back.
    assert at(1110.0, arrived, {}, listed, 2.0).reason == "quorum+grace"


def test_all_in_at_max_quorum():
    arrived = {"a": 1010.0, "b": 1020.0, "c": 1030.0, "d": 1040.0}
    assert at(1040.0, arrived) == Decision(close=True, reason="all-in", recheck_at=None, waiting_for=())
    three = QuorumSettings(min_quorum=2, max_quorum=3, grace_max_s=30.0, round_timeout_s=300.0, grace_fraction=None)
    assert at(1030.0, {"a": 1010.0, "b": 1020.0, "c": 1030.0}, policy=three).reason == "all-in"
    # Every listed learner is in: nobody is left to wait for, even below max_quorum.
    everyone = decide(POLICY, START, 1030.0, {"a": 1010.0, "b": 1020.0, "c": 1030.0}, ["a", "b", "c"], {})
    assert everyone == Decision(close=True, reason="all-in", recheck_at=None, waiting_for=())


def test_before_quorum_waits_for_everyone_until_the_deadline():
    assert at(1050.0, {"a": 1050.0}) == Decision(
        close=False, reason=None, recheck_at=1300.0, waiting_for=("b", "c", "d")
    )


def test_grace_waits_for_a_learner_expected_soon_and_closes_when_it_arrives():
    # Quorum at 1110 (b is the 2nd arrival), grace until 1140. c is expected at 1020 + 105 = 1125: wait.
    # d is expected at 1000 + 300 = 1300, after the grace cap: not waited for.
    hist = history(c=(1020.0, [100.0, 110.0]), d=(1000.0, [300.0]))
    arrived = {"a": 1100.0, "b": 1110.0}
    assert at(1110.0, arrived, hist) == Decision(close=False, reason=None, recheck_at=1125.0, waiting_for=("c",))
    assert at(1124.0, arrived, hist).close is False

    arrived["c"] = 1120.0
    assert at(1120.0, arrived, hist) == Decision(close=True, reason="quorum+grace", recheck_at=None, waiting_for=())


def test_grace_gives_up_at_the_expected_time_when_the_learner_is_late():
    hist = history(c=(1020.0, [100.0, 110.0]))
    arrived = {"a": 1100.0, "b": 1110.0}
    assert at(1125.0, arrived, hist) == Decision(close=True, reason="quorum+grace", recheck_at=None, waiting_for=())


def test_the_grace_is_capped_by_a_fraction_of_the_typical_phase():
    # Phases take ~10 s; a fixed 30 s grace would wait for d (expected 25 s after the quorum).
    hist = history(a=(1090.0, [10.0, 10.0]), b=(1100.0, [10.0, 10.0]), c=(1101.0, [10.0]), d=(1075.0, [60.0]))
    arrived = {"a": 1100.0, "b": 1110.0}
    assert at(1110.0, arrived, hist).waiting_for == ("c", "d")
    half = QuorumSettings(min_quorum=2, max_quorum=4, grace_max_s=30.0, round_timeout_s=300.0, grace_fraction=0.5)
    assert grace_s(half, hist) == 5.0  # the median phase is 10 s
    assert at(1110.0, arrived, hist, policy=half) == Decision(
        close=False, reason=None, recheck_at=1111.0, waiting_for=("c",)
    )
    assert at(1111.0, arrived, hist, policy=half).close is True
    assert grace_s(half, {}) == 30.0  # no history yet: the fixed cap


def test_closes_at_quorum_when_the_missing_are_expected_after_the_grace_cap_or_unknown():
    hist = history(c=(1100.0, [200.0]), d=(None, [50.0]))  # c at 1300 > 1140; d unknown
    decision = at(1110.0, {"a": 1100.0, "b": 1110.0}, hist)
    assert decision == Decision(close=True, reason="quorum+grace", recheck_at=None, waiting_for=())


def test_grace_cap_reached():
    # b expected at 1130, c exactly at the cap 1110 + 30 = 1140: both waited for, at most until 1140.
    hist = history(b=(1030.0, [100.0]), c=(1020.0, [110.0, 130.0]))
    arrived = {"a": 1100.0, "d": 1110.0}
    assert at(1111.0, arrived, hist) == Decision(close=False, reason=None, recheck_at=1140.0, waiting_for=("b", "c"))
    arrived["b"] = 1131.0
    assert at(1139.9, arrived, hist) == Decision(close=False, reason=None, recheck_at=1140.0, waiting_for=("c",))
    assert at(1140.0, arrived, hist).reason == "quorum+grace"


def test_quorum_time_is_the_min_quorum_th_arrival():
    # Three arrivals; quorum (2) was reached at 1050, so the grace window ends at 1080 — not 30 s after the last.
    hist = history(d=(1000.0, [85.0]))  # expected 1085 > 1080
    assert at(1070.0, {"a": 1010.0, "b": 1050.0, "c": 1070.0}, hist).reason == "quorum+grace"
    hist = history(d=(1000.0, [75.0]))  # expected 1075 <= 1080
    assert at(1070.0, {"a": 1010.0, "b": 1050.0, "c": 1070.0}, hist).recheck_at == 1075.0


def test_timeout_with_some_arrivals():
    assert at(1299.0, {"a": 1200.0}).close is False
    assert at(1300.0, {"a": 1200.0}) == Decision(close=True, reason="timeout", recheck_at=None, waiting_for=())


def test_timeout_with_no_arrivals():
    assert at(1299.9, {}) == Decision(close=False, reason=None, recheck_at=1300.0, waiting_for=("a", "b", "c", "d"))
    assert at(1300.0, {}) == Decision(close=True, reason="timeout", recheck_at=None, waiting_for=())


def test_deadline_cuts_the_grace_window_short():
    short = QuorumSettings(
        min_quorum=2, max_quorum=4, grace_max_s=30.0, round_timeout_s=120.0, grace_fraction=None
    )  # deadline 1120
    hist = history(c=(1020.0, [105.0]))  # expected 1125
    arrived = {"a": 1100.0, "b": 1110.0}
    assert at(1111.0, arrived, hist, short) == Decision(close=False, reason=None, recheck_at=1120.0, waiting_for=("c",))
    assert at(1120.0, arrived, hist, short).reason == "timeout"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"min_quorum": 0}, "min_quorum"),
        ({"min_quorum": 3, "max_quorum": 2}, "max_quorum"),
        ({"grace_max_s": -1.0}, "grace_max_s"),
        ({"grace_fraction": -0.5}, "grace_fraction"),
        ({"round_timeout_s": 0.0}, "round_timeout_s"),
        ({"poll_s": 0.0}, "poll_s"),
    ],
)
def test_invalid_policy_names_the_field(kwargs, field):
    fields = {"min_quorum": 1, "max_quorum": 2, "grace_max_s": 10.0, "round_timeout_s": 60.0} | kwargs
    with pytest.raises(ValueError, match=field):
        QuorumSettings(**fields)


def test_a_negative_listing_period_is_refused():
    with pytest.raises(ValueError, match="listing_s"):
        decide(POLICY, START, START, {}, LEARNERS, {}, listing_s=-0.1)


def merged(phase: int, finished_at: float, seen_at: float) -> Contribution:
    return Contribution(
        learner="a-0",
        region="a",
        phase=phase,
        base_round=0,
        staleness=0,
        tokens=1,
        tokens_counted=1,
        weight=1.0,
        loss=1.0,
        bytes=1,
        key=f"k{phase}",
        sha256="ab" * 32,
        finished_at=finished_at,
        seconds=3.0,
        seen_at=seen_at,
    )


def test_a_learners_cycle_and_lag_come_from_its_merged_deltas():
    # Finished every 3.5 s on its own clock (phase 3 was never merged: its gap counts per phase);
    # seen 0.3 s after finishing at best, later when the synchronizer was busy between rounds.
    recent = [merged(0, 100.0, 100.3), merged(1, 103.5, 104.9), merged(2, 107.0, 107.4), merged(4, 114.0, 114.3)]
    assert cycle(recent) == 3.5
    assert seen_lag(recent) == pytest.approx(0.3)
    assert cycle(recent[:1]) is None
    # Nothing merged yet: no lag known.
    assert seen_lag([]) == 0.0


def test_a_delta_seen_in_this_round_moves_its_learners_expected_arrival_on():
    h = LearnerHistory([3.0, 3.2], 1010.0, cycle_s=3.5, lag_s=0.2)
    assert h.expected_arrival() == 1013.5
    later = h.seen(1013.6, 3.4)
    assert later.last_arrival == pytest.approx(1013.8) and later.phase_seconds == [3.0, 3.2, 3.4]
    assert later.expected_arrival() == pytest.approx(1017.3)
    # A delta no newer than the last arrival known changes nothing.
    assert h.seen(1009.0, 3.1) is h
    # A learner with nothing merged yet becomes expected after its first delta.
    assert LearnerHistory([], None).seen(1005.0, 4.0).expected_arrival() == 1009.0


def test_a_learner_whose_last_delta_missed_a_round_is_waited_for_in_the_next():
    # c's previous delta landed at 1100, after the round before closed: the manifests merged c's
    # delta of 1096.5 last, so they expect it at 1100, which has passed. Seen in this round, the
    # late delta makes its fresh one due at 1103.5, inside the grace window of a and b's quorum.
    policy = QuorumSettings(min_quorum=2, max_quorum=4, grace_max_s=30.0, round_timeout_s=300.0, grace_fraction=0.5)
    merged = {"c": LearnerHistory([3.5, 3.5], 1096.5, cycle_s=3.5)}
    fresh = {"a": 1102.5, "b": 1103.0}
    assert at(1103.0, fresh, merged, policy, 0.5).reason == "quorum+grace"
    seen = {"c": merged["c"].seen(1100.0, 3.5)}
    assert at(1103.0, fresh, seen, policy, 0.5) == Decision(
        close=False, reason=None, recheck_at=1104.0, waiting_for=("c",)
    )
    assert at(1104.0, fresh, seen, policy, 0.5).reason == "quorum+grace"


def test_a_round_with_no_learner_left_to_wait_for_closes_at_once():
    """Learners known down are left out of `learners`: with none left, nothing is waited for."""
    policy = QuorumSettings(min_quorum=2, max_quorum=3, round_timeout_s=600)
    d = decide(policy, 1000.0, 1000.5, {}, [], {})
    assert d.close and d.reason == "all-in"
    d = decide(policy, 1000.0, 1001.0, {"a-0": 1000.8}, ["a-0"], {})
    assert d.close and d.reason == "all-in"


def test_only_deltas_from_the_parent_round_count_towards_the_quorum():
    """Round 5 (parent 4): b's delta from round 3 merges but counts for nobody; a's two deltas from
    round 4 count once, when the first was seen."""
    found = quorum_arrivals([("a", 4, 1010.0), ("b", 3, 1001.0), ("a", 4, 1005.0), ("c", 4, 1020.0)], 4)
    assert found == {"a": 1005.0, "c": 1020.0}
    assert quorum_arrivals([("b", 3, 1001.0)], 4) == {}
