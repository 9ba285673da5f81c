"""End to end: a run whose deltas and updates travel as `topk` (learners encode their deltas
and the synchronizer its updates with error feedback; it checks and merges the deltas a run of
values at a time) publishes its rounds, its held-out loss falls, and `islands audit --replay`
recomputes every round's bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import STACK_REGIONS, run_args

ROUNDS = 3
SPARSE = "--codec topk --topk.chunk 1024 --topk.k 64 --topk.value-bits 4".split()


def islands(env: dict, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def env(islands_stack):
    s, home = islands_stack
    return {**os.environ, **s.env(), "ISLANDS_HOME": str(home)}


@pytest.mark.parametrize("update_codec", ["topk"])
def test_a_run_of_sparse_deltas_trains_and_replays(env, update_codec):
    run_id = f"sparse-{update_codec}"
    summary = islands(env, *run_args(run_id, STACK_REGIONS, ROUNDS), *SPARSE, "--update-codec", update_codec)
    assert summary["rounds_published"] == ROUNDS
    assert summary["eval_loss_final"] < summary["eval_loss_round0"]
    report = islands(env, "audit", run_id, "--replay")
    assert report["ok"] and report["problems"] == [] and report["replayed"] == ROUNDS + 1, report
    assert all(row["lost"] == 0 and row["applied"] > 0 for row in report["ledger"].values()), report["ledger"]
