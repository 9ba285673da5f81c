"""A fault rehearsal end to end: `islands run --chaos` kills one learner for good, stalls the S3
endpoint for 20 s and crashes the synchronizer mid-publish — and the run still publishes every
round, and `islands audit --replay` finds nothing lost and nothing applied twice.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

REGIONS = ["east", "west", "south"]
ROUNDS = 6
CHAOS = ["kill:west@round2", "stall:s3@20s+20s", "crash:synchronizer@publish.after_model@round4"]


def islands(env: dict, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_chaos_run_completes_and_the_books_balance(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_", "ISLANDS_"))}
    env["ISLANDS_HOME"] = str(tmp_path)
    t0 = time.monotonic()
    run = islands(
        env,
        "run",
        "--run-id",
        "chaos-run",
        "--regions",
        ",".join(REGIONS),
        "--rounds",
        str(ROUNDS),
        "--inner-steps",
        "10",
        "--quorum.min-quorum",
        "2",
        "--chaos",
        ",".join(CHAOS),
        "--json",
        timeout=900,
    )
    wall = time.monotonic() - t0
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["rounds_published"] == ROUNDS
    chaos = summary["chaos"]
    assert any("killed learner-west-0" in line for line in chaos), chaos
    assert any("synchronizer killed (SIGKILL) at publish.after_model" in line for line in chaos), chaos
    assert summary["learners"]["learner-west-0"] == "Crashed", summary["learners"]
    held = re.search(r"S3 stalled for 20 s from 20 s into the run; (\d+) transfers were held", run.stderr)
    assert held and int(held.group(1)) > 0, "the stall must have held S3 traffic"

    # The embedded store kept every object on disk; audit the run from it, served again.
    audit = islands(env, "audit", "chaos-run", "--replay", "--json", timeout=300)
    report = json.loads(audit.stdout or "null") or {}
    assert audit.returncode == 0 and report.get("ok"), audit.stdout[-4000:] + audit.stderr[-2000:]
    books = {
        c: sum(row[c] for row in report["ledger"].values())
        for c in ("trained", "applied", "dropped", "pending", "lost")
    }
    assert books["lost"] <= 0, report["ledger"]
    assert report["ledger"]["west-0"]["trained"] > 0
    print(
        f"\nchaos run: {ROUNDS} rounds in {wall:.0f} s (islands run wall {summary['wall_s']} s); "
        f"{', '.join(CHAOS)}\n  {chaos}\n  tokens {books}; applied {books['applied'] / books['trained']:.1%} of trained"
    )
