"""End to end: a run with a target loss ends at the first round that reaches it, long before its
last round, with its learners stopped the usual way; status and resume treat it as finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import STACK_REGIONS

ROUNDS, TARGET = 40, 5.0  # round 0 evaluates at about 5.5; H=8 rounds pass 5.0 within a few


def islands(env: dict, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args, "--json"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def env(islands_stack):
    s, home = islands_stack
    return {**os.environ, **s.env(), "ISLANDS_HOME": str(home)}


@pytest.fixture(scope="module")
def ended_run(env):
    return islands(env, "run", "--run-id", "target-run", "--regions", ",".join(STACK_REGIONS), "--rounds", str(ROUNDS),
                   "--inner-steps", "8", "--min-quorum", "1", "--target-loss", str(TARGET))


def test_the_run_ends_at_the_first_round_under_the_target(ended_run, env):
    last = ended_run["rounds_published"]
    assert 1 <= last < ROUNDS
    assert ended_run["eval_loss_final"] <= TARGET < ended_run["eval_loss_round0"]
    assert ended_run["ended"].startswith(f"round {last} reached the target eval loss {TARGET:g}")
    # The learners were told to stop, as at a run's last round, and ended by themselves.
    assert set(ended_run["learners"].values()) == {"Completed"}
    status = islands(env, "status", "target-run")
    assert status["state"] == "finished" and status["target_loss"] == TARGET
    assert all(r["eval_loss"] > TARGET for r in status["rounds"][:-1])


def test_resume_of_an_ended_run_publishes_nothing(ended_run, env):
    again = islands(env, "resume", "target-run")
    assert again["rounds_published"] == ended_run["rounds_published"]
    assert again["ended"] == ended_run["ended"] and again["learners"] == {}
