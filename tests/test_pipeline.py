"""End to end: the `islands` command against a real Prefect API and the embedded S3 server (SeaweedFS) on loopback.

One run with two regions, the second at a third of the speed and Q_min = 1, so rounds close
without the slow region and its deltas arrive late. Everything the run wrote is then read back
with plain boto3 and safetensors — no project code — and the books are checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import boto3
import pytest
from conftest import STACK_REGIONS, run_args
from safetensors import safe_open
from safetensors.torch import load as st_load

REGIONS = STACK_REGIONS
ROUNDS = 6  # the slow region starts late and trains a third as fast: room for its first delta to land


@pytest.fixture(scope="module")
def finished_run(islands_stack):
    s, home = islands_stack
    env = {**os.environ, **s.env(), "ISLANDS_HOME": str(home)}
    cmd = [
        sys.executable,
        "-m",
        "islands.flows.cli",
        *run_args("e2e-run", REGIONS, ROUNDS),
        "--speed",
        "south=0.33",
        "--json",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    s3 = boto3.client(
        "s3",
        endpoint_url=s.s3_url,
        region_name="us-east-1",
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    return summary, s3


def objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def manifests(s3) -> list[dict]:
    found = objects(s3, "islands-global", "runs/e2e-run/rounds/")
    keys = sorted(k for k in found if k.endswith("manifest.json"))
    return [(json.loads(found[k]), found[k], found) for k in keys]


def test_run_completes_and_learns(finished_run):
    summary, _ = finished_run
    assert summary["run_id"] == "e2e-run"
    assert summary["rounds_published"] == ROUNDS
    assert summary["eval_loss_final"] < summary["eval_loss_round0"] - 0.5
    assert set(summary["bytes"]) == {*REGIONS, "synchronizer"}
    assert all(b["written"] > 0 for r, b in summary["bytes"].items())


def test_everything_is_readable_with_plain_boto3_and_the_chain_holds(finished_run):
    _, s3 = finished_run
    chain = manifests(s3)
    assert [m["round"] for m, _, _ in chain] == list(range(ROUNDS + 1))
    parent_sha = None
    for manifest, raw, found in chain:
        assert manifest["parent_sha256"] == parent_sha
        for ref in filter(None, [manifest["model"], manifest["outer"]]):
            body = found[ref["key"]]
            assert hashlib.sha256(body).hexdigest() == ref["sha256"] and len(body) == ref["bytes"]
            tensors = st_load(body)
            assert "tok_emb.weight" in tensors or len(tensors) > 5
        parent_sha = hashlib.sha256(raw).hexdigest()
    # Deltas named by manifests: right bytes, safetensors metadata readable without our code.
    for manifest, _, _ in chain[1:]:
        for c in manifest["contributions"]:
            meta = delta_metadata(s3, c)
            assert meta["run"] == "e2e-run" and meta["learner"] == c["learner"] and int(meta["phase"]) == c["phase"]
            assert int(meta["base_round"]) == c["base_round"] == manifest["round"] - 1 - c["staleness"]


def delta_metadata(s3, contribution: dict) -> dict:
    """A merged delta's safetensors metadata, its bytes checked against the manifest, read
    without this project's code."""
    body = s3.get_object(Bucket=f"islands-{contribution['region']}", Key=contribution["key"])["Body"].read()
    assert hashlib.sha256(body).hexdigest() == contribution["sha256"]
    path = f"/tmp/islands-e2e-{os.getpid()}.safetensors"
    with open(path, "wb") as fh:
        fh.write(body)
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    os.unlink(path)
    return meta


def test_the_slow_region_never_holds_a_round_back_and_is_merged_late(finished_run):
    _, s3 = finished_run
    chain = [m for m, _, _ in manifests(s3)][1:]
    closed = [m["quorum"]["closed_by"] for m in chain]
    assert all(c in ("all-in", "quorum+grace", "timeout") for c in closed)
    without_south = [m for m in chain if "south-0" not in {c["learner"] for c in m["contributions"]}]
    assert without_south, "some round must close without the slow region"
    south = [c for m in chain for c in m["contributions"] if c["learner"] == "south-0"]
    assert south, "the slow region's deltas must be merged in a later round"
    # A slow delta is either stale (and says so) or was rebased mid-phase onto a newer round.
    metas = {c["key"]: delta_metadata(s3, c) for c in south}
    starts = {key: int(m["start_round"]) for key, m in metas.items()}
    assert any(c["staleness"] >= 1 or starts[c["key"]] < c["base_round"] for c in south), (south, starts)
    for c in south:  # the rounds it moved onto mid-phase, after how many steps: the last is its base
        moves = [tuple(map(int, m.split(":"))) for m in metas[c["key"]]["rebases"].split(",") if m]
        assert [r for _, r in moves][-1:] == ([c["base_round"]] if starts[c["key"]] < c["base_round"] else [])
        assert all(0 <= step < int(metas[c["key"]]["inner_steps"]) for step, _ in moves)
    assert all(c["weight"] > 0 for c in south)
    # Not applied twice: every delta key appears in at most one manifest.
    used = [c["key"] for m in chain for c in m["contributions"]] + [e["key"] for m in chain for e in m["excluded"]]
    assert len(used) == len(set(used))
    # Not lost: every delta in the regional buckets is consumed, or newer than the last round's.
    for region in REGIONS:
        for key in objects(s3, f"islands-{region}", "runs/e2e-run/deltas/"):
            if key not in used:
                body = s3.get_object(Bucket=f"islands-{region}", Key=key)["Body"].read()
                n = int.from_bytes(body[:8], "little")
                meta = json.loads(body[8 : 8 + n])["__metadata__"]
                assert float(meta["finished_at"]) > 0 and int(meta["base_round"]) >= ROUNDS - 1 - 4
