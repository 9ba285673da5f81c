"""The scaling ablation reads a loss curve: the round at which it first comes down to a loss."""

import pytest

from benchmarks.scaling import crossing


def test_crossing_interpolates_between_the_rounds_around_the_target():
    assert crossing([5.0, 4.0, 3.0, 2.0], 3.0) == 2.0  # reached exactly at round 2
    assert crossing([5.0, 4.0, 3.0, 2.0], 2.5) == pytest.approx(2.5)  # half-way from round 2 to 3
    assert crossing([5.0, 4.0, 4.5, 3.0], 4.2) == pytest.approx(0.8)  # the first time it gets there counts


def test_crossing_is_none_when_the_curve_never_gets_there():
    assert crossing([5.0, 4.0, 3.5], 3.0) is None
    assert crossing([5.0], 6.0) is None  # round 0 alone is no round reached
