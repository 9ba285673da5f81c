"""The crash-point matrix: for every named crash point, a real run dies there (SIGKILL),
`islands resume` finishes it, and the audit proves nothing was lost or applied twice.

Each case is a tiny real run — moto's S3 server and a Prefect server on 127.0.0.1, `islands run`
and `islands resume` as processes. Synchronizer and driver points kill the driver process itself;
learner points kill both learners, after which the driver is killed too (the machine "goes
down"), so the resume has to restart learners from their saved state as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
from conftest import STACK_REGIONS

from islands.ops.audit import audit_run
from islands.storage.store import Stores
from islands.tasks.crash import LEARNER_POINTS, POINTS

REGIONS = STACK_REGIONS
ROUNDS = 3
H = 5
RESULTS: dict[str, dict] = {}


def qualified(point: str) -> str:
    """Where each point fires: learners in their second phase, the synchronizer in round 2."""
    return f"{point}@{1 if point in LEARNER_POINTS or point == 'round.after_publish' else 2}"


@pytest.fixture(scope="module")
def stack(islands_stack, on_stack):
    """The session's stack (regions north and south, as here); the matrix is printed at the end."""
    env = {**os.environ, **on_stack}
    env.pop("ISLANDS_CRASH", None)
    yield islands_stack[0], env
    print_matrix()


def islands(env: dict, *args: str, crash: str | None = None) -> subprocess.Popen:
    extra = {"ISLANDS_CRASH": crash} if crash else {}
    return subprocess.Popen(
        [sys.executable, "-m", "islands.flows.cli", *args],
        env={**env, **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def learner_runs(api_url: str, run: str) -> list[dict]:
    body = json.dumps({"flows": {"name": {"any_": ["learner"]}}, "flow_runs": {"tags": {"all_": [run]}}}).encode()
    req = urllib.request.Request(f"{api_url}/flow_runs/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def keys(s3, bucket: str, prefix: str) -> set[str]:
    out = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out |= {o["Key"] for o in page.get("Contents", [])}
    return out


def print_matrix() -> None:
    cols = ("survived", "rounds", "trained", "applied", "dropped", "pending", "lost", "twice", "wall_s")
    lines = [
        "",
        "crash-point matrix (tokens summed over learners; twice = re-done after a delta-before-state crash)",
        f"{'point':<24}" + "".join(f"{c:>10}" for c in cols),
    ]
    for point in POINTS:
        row = RESULTS.get(point)
        if row:
            lines.append(f"{point:<24}" + "".join(f"{row[c]!s:>10}" for c in cols))
        else:
            lines.append(f"{point:<24}{'not run':>10}")
    print("\n".join(lines))


FAST = {"publish.after_model"}  # the rest of the matrix is marked slow: each case pays two learner start-ups


@pytest.mark.parametrize("point", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in POINTS])
def test_crash_then_resume_loses_nothing_and_applies_nothing_twice(stack, point):
    s, env = stack
    run = "cm-" + point.replace(".", "-").replace("_", "-")
    t0 = time.monotonic()
    args = ["--regions", ",".join(REGIONS), "--rounds", str(ROUNDS), "--inner-steps", str(H)]
    driver = islands(env, "run", "--run-id", run, *args, crash=qualified(point))
    if point in LEARNER_POINTS:
        wait_until(
            lambda: sum(r["state_type"] == "CRASHED" for r in learner_runs(s.api_url, run)) == len(REGIONS),
            180,
            f"both learners to die at {point}",
        )
        assert driver.poll() is None, driver.communicate()[1][-3000:]
        driver.kill()
        driver.wait()
    else:
        _, err = driver.communicate(timeout=240)
        assert driver.returncode == -9, f"the driver should have died at {point}: {err[-3000:]}"

    resumed = islands(env, "resume", run, "--json")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["rounds_published"] == ROUNDS
    wait_until(
        lambda: all(r["state_type"] in ("COMPLETED", "CRASHED", "CANCELLED") for r in learner_runs(s.api_url, run)),
        60,
        "every learner run to end",
    )

    # A synchronizer killed mid-round leaves its spooled deltas; the resumed one removes them.
    assert not list(Path(tempfile.gettempdir()).glob(f"islands*-{run}-*")), f"{point}: a spool folder was left"

    report = audit_run(Stores("s3://islands-{bucket}", REGIONS), run, replay=True)
    assert report.ok, "\n".join(p.line() for p in report.problems)
    books = {
        c: sum(row[c] for row in report.ledger.values()) for c in ("trained", "applied", "dropped", "pending", "lost")
    }
    phase_tokens = H * 16 * 128
    assert all(row["lost"] <= 0 for row in report.ledger.values()), report.ledger
    if point == "phase.after_delta":
        # Each learner's phase-1 delta is kept; its data is re-done from the phase-0 state as phase 2.
        assert all(row["lost"] == -phase_tokens for row in report.ledger.values()), report.ledger
    else:
        assert books["lost"] == 0, report.ledger

    s3 = boto3.client(
        "s3",
        endpoint_url=s.s3_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    # Every round is evaluated, also one whose synchronizer died between its manifest and its evaluation.
    published = keys(s3, "islands-global", f"runs/{run}/rounds/")
    assert all(f"runs/{run}/rounds/{r:06d}/eval.json" in published for r in range(1, ROUNDS + 1)), (
        f"{point}: {sorted(published)}"
    )
    for region in REGIONS:
        learner = f"{region}-0"
        found = keys(s3, f"islands-{region}", f"runs/{run}/")
        delta1 = f"runs/{run}/deltas/{learner}/000001.safetensors"
        assert delta1 in found, f"{point}: phase 1 of {learner} must exist (kept or re-done under its number)"
        if point == "phase.after_delta":
            assert f"runs/{run}/learners/{learner}/state-000001.safetensors" not in found
    # One driver epoch per start; no learner of the crashed driver outlived the resume's launch.
    assert len({k for k in keys(s3, "islands-global", f"runs/{run}/drivers/") if k.endswith(".json")}) == 2
    RESULTS[point] = {
        "survived": "yes",
        "rounds": summary["rounds_published"],
        **books,
        "twice": -books["lost"],
        "wall_s": round(time.monotonic() - t0),
    }
    RESULTS[point]["lost"] = max(0, books["lost"])
