"""Paced phases: H for the fastest learners, H × rate / fastest for a slower one."""

import pytest

from islands.core.pace import phase_steps


def test_h_while_rates_are_unknown():
    assert phase_steps(10, None, [900.0, 300.0]) == 10  # this learner has not finished a phase yet
    assert phase_steps(10, 300.0, []) == 10  # no round has merged anyone: its own rate is the fastest known
    assert phase_steps(10, 0.0, [900.0]) == 10


def test_the_fastest_and_those_within_the_tolerance_train_h():
    assert phase_steps(10, 900.0, [900.0, 300.0, 880.0]) == 10
    assert phase_steps(50, 700.0, [900.0]) == 50  # 22% slower is timing noise on a busy machine, not a straggler
    assert phase_steps(50, 1000.0, [900.0]) == 50  # faster than any rate the rounds reported


def test_a_slower_learner_trains_in_proportion_to_its_rate():
    assert phase_steps(10, 300.0, [900.0, 300.0, 880.0]) == 3
    assert phase_steps(50, 300.0, [900.0]) == 17
    assert phase_steps(50, 600.0, [900.0]) == 33
    assert phase_steps(10, 1.0, [900.0]) == 1  # never fewer than one step


def test_a_rate_far_above_the_others_is_not_believed():
    # One learner claims a phase took a thousandth of its real time: the others keep their H.
    assert phase_steps(10, 900.0, [900.0, 300.0, 880.0, 900_000.0]) == 10
    assert phase_steps(10, 300.0, [900.0, 300.0, 880.0, 900_000.0]) == 3  # paced against the honest fastest
    # Up to 4× the median is believed, as a faster accelerator would report it.
    assert phase_steps(10, 900.0, [900.0, 900.0, 900.0, 3000.0]) == 3
    # With two rates there is no majority to judge by: both are believed.
    assert phase_steps(10, 900.0, [900.0, 900_000.0]) == 1


def test_h_must_be_positive():
    with pytest.raises(ValueError, match="H must be at least 1"):
        phase_steps(0, 300.0, [900.0])
