"""The learner's round follower: fetches each newly published round in the background, keeps
going after a failed poll, and says clearly when a run has no round to start from."""

import threading

import pytest
import torch

from islands.tasks.follow import RoundFollower


def test_follows_new_rounds_and_survives_a_failed_poll():
    published, fetched, fail_once = [0], [], threading.Event()

    def newest(held):
        assert held is None or held == fetched[-1]  # it is told the round it holds
        if fail_once.is_set():
            fail_once.clear()
            raise OSError("S3 stalled")
        return published[-1]

    def fetch(r, held):
        assert held is None or held[0] < r  # it is told what it holds, and only asked for newer rounds
        fetched.append(r)
        return {"w": torch.full((2,), float(r))}

    follower = RoundFollower(newest, fetch, poll_s=0.01).start("run-x")
    try:
        assert follower.held()[0] == 0 and fetched == [0]
        fail_once.set()
        published.append(3)
        assert follower.wait_newer(0, timeout_s=5.0) == 3
        r, model = follower.held()
        assert r == 3 and torch.equal(model["w"], torch.full((2,), 3.0)) and fetched == [0, 3]
        assert follower.wait_newer(3, timeout_s=0.05) == 3  # nothing newer: returns what it has
    finally:
        follower.close()


def test_a_run_without_a_published_round_is_refused_at_start():
    with pytest.raises(RuntimeError, match="run-y has no published round"):
        RoundFollower(lambda held: None, lambda r, held: {}, poll_s=0.01).start("run-y")
