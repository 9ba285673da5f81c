"""End to end: a run with a target loss or a token budget ends at the first round that reaches
it, long before its last round, with its learners stopped the usual way; status and resume
treat it as finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import STACK_REGIONS, run_args

ROUNDS, TARGET = 40, 5.0  # round 0 evaluates at about 5.5; H=8 rounds pass 5.0 within a few
BUDGET = 3 * 8 * 16 * 128  # three phases of 8 steps of 16 × 128 tokens


def islands(env: dict, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def env(islands_stack):
    s, home = islands_stack
    return {**os.environ, **s.env(), "ISLANDS_HOME": str(home)}


def run(env: dict, run_id: str, *until: str) -> dict:
    return islands(env, *run_args(run_id, STACK_REGIONS, ROUNDS), *until)


@pytest.fixture(scope="module")
def target_run(env):
    return run(env, "target-run", "--target-loss", str(TARGET))


def test_a_run_ends_at_the_first_round_under_its_target_loss(target_run, env):
    last = target_run["rounds_published"]
    assert 1 <= last < ROUNDS
    assert target_run["eval_loss_final"] <= TARGET < target_run["eval_loss_round0"]
    assert target_run["ended"].startswith(f"round {last} reached the target eval loss {TARGET:g}")
    # The learners were told to stop, as at a run's last round, and ended by themselves.
    assert set(target_run["learners"].values()) == {"Completed"}
    status = islands(env, "status", "target-run")
    assert status["state"] == "finished" and status["target_loss"] == TARGET
    assert all(r["eval_loss"] > TARGET for r in status["rounds"][:-1])


def test_resume_of_an_ended_run_publishes_nothing(target_run, env):
    again = islands(env, "resume", "target-run")
    assert again["rounds_published"] == target_run["rounds_published"]
    assert again["ended"] == target_run["ended"] and again["learners"] == {}


def test_a_run_ends_at_the_first_round_that_merges_its_token_budget(env):
    """With eval_every 0: the synchronizer evaluates the round that ends the run, no other."""
    summary = run(env, "budget-run", "--token-budget", str(BUDGET), "--eval-every", "0")
    last = summary["rounds_published"]
    assert 1 <= last < ROUNDS and summary["ended"].startswith(f"round {last} merged the token budget of {BUDGET:,}")
    assert set(summary["learners"].values()) == {"Completed"}
    status = islands(env, "status", "budget-run")
    assert status["state"] == "finished" and status["tokens_applied"] >= BUDGET
    assert [r["round"] for r in status["rounds"]] == list(range(1, last + 1))
    assert all(r["tokens_applied"] < BUDGET for r in status["rounds"][:-1])
    assert summary["eval_loss_round0"] is None and [r["eval_loss"] is None for r in status["rounds"]] == [True] * (
        last - 1
    ) + [False]
    assert summary["eval_loss_final"] == status["rounds"][-1]["eval_loss"] < 5.6
