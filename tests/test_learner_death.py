"""A learner that dies is a first-class event: the driver sees its flow run fail, says so (learner,
region, reason) on the terminal and in its log in the UI, relaunches it from its saved state, gives
it up after `learner_relaunches`, and ends with exit status 1 — while rounds stop waiting for it
as soon as it is known down, where each used to wait out its whole timeout.

Run on the session stack (SeaweedFS S3, Prefect API, learner runner), with token shards in which
the second learner's whole range holds an id the model cannot embed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import numpy as np
import pytest
from conftest import STACK_REGIONS

from islands.storage import layout, liveness
from islands.storage.rounds import read_chain
from islands.storage.shards import Dataset, ShardEntry, TokenizerRef
from islands.storage.store import Stores

RUN = "dead-learner"
TIMEOUT_S = 240.0


def write_shards(url: str, shards: list[np.ndarray]) -> None:
    fs = fsspec.filesystem("s3")
    entries = []
    for i, tokens in enumerate(shards):
        fs.pipe_file(f"{url}/shard-{i:06d}.bin", tokens.astype(np.uint16).tobytes())
        entries.append(ShardEntry(name=f"shard-{i:06d}.bin", tokens=len(tokens), sha256="-"))
    tokenizer = TokenizerRef(name="bytes", sha256="bytes", vocab_size=256)
    fs.pipe_file(f"{url}/dataset.json", Dataset(dtype="uint16", tokenizer=tokenizer, shards=entries).to_bytes())


@pytest.fixture(scope="module")
def finished(on_stack):
    good = (np.arange(40_000) * 7919 % 251).astype(np.uint16)
    write_shards("s3://islands-global/datasets/half-bad", [good, np.full(40_000, 300, np.uint16)])
    write_shards("s3://islands-global/datasets/held-out", [good[:20_000]])
    args = (
        f"run --run-id {RUN} --regions {','.join(STACK_REGIONS)} --rounds 3 --inner-steps 8 "
        f"--quorum.min-quorum 2 --quorum.round-timeout-s {TIMEOUT_S:g} --learner-relaunches 1 --json "
        "--corpus s3://islands-global/datasets/half-bad --eval-corpus s3://islands-global/datasets/held-out"
    ).split()
    proc = subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args],
        env={**os.environ, **on_stack},
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc


def test_the_run_ends_with_exit_1_naming_the_lost_learner_and_its_reason(finished):
    assert finished.returncode == 1, finished.stderr[-4000:]
    err = finished.stderr
    assert "learner south-0 (south) died: Failed" in err and "token id 300" in err, err[-4000:]
    assert "learner south-0 (south) relaunched from its saved state" in err, err[-4000:]
    assert "learner south-0 (south) given up after 1 relaunches" in err, err[-4000:]
    last = [line for line in err.splitlines() if line.startswith("islands: ")][-1]
    assert last.startswith(f"islands: {RUN}: learners lost: south-0: Failed") and "token id 300" in last, last
    summary = json.loads(finished.stdout.strip().splitlines()[-1])
    assert summary["failed"].startswith("learners lost: south-0")
    assert summary["rounds_published"] == 3  # the living learner trained on


def test_no_round_waited_its_timeout_for_the_dead_learner(finished, on_stack):
    stores = Stores("s3://islands-{bucket}", STACK_REGIONS)
    chain = [m for m, _ in read_chain(stores.global_, RUN)]
    assert [m.round for m in chain] == [0, 1, 2, 3]
    for m in chain[1:]:
        assert m.quorum.closed_by != "timeout" and m.quorum.waited_s < TIMEOUT_S / 2, m.quorum
        assert [c.learner for c in m.contributions] and {c.learner for c in m.contributions} == {"north-0"}
    assert liveness.down(stores.global_, RUN).keys() == {"south-0"}
    events = sorted(k.rsplit("/", 1)[1] for k in stores.global_.list(layout.liveness_prefix(RUN) + "south-0/"))
    assert [e.split("-", 2)[2] for e in events] == ["up.json", "down.json", "up.json", "down.json"]


def test_the_ui_shows_the_death_in_the_drivers_log(finished, on_stack):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        (driver,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[RUN])))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[driver.id])))
        learners = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["learner-south-0"]))
        )
    text = "\n".join(log.message for log in logs)
    assert "learner south-0 (south) died: Failed" in text and "given up" in text, text[-3000:]
    assert "learners lost: south-0" in text
    assert sorted(r.state.name for r in learners if RUN in r.tags) == ["Failed", "Failed"]


def test_a_learners_newest_event_decides_and_a_resumed_driver_supersedes_the_last():
    from islands.storage.local import MemoryStore

    store = MemoryStore("memory://liveness-test")
    liveness.record(store, "r-1", "east-0", 0, 1, "up")
    liveness.record(store, "r-1", "east-0", 0, 2, "down", "Crashed: killed")
    liveness.record(store, "r-1", "west-0", 0, 1, "up")
    liveness.record(store, "r-1", "west-0", 0, 9, "down", "Failed: bad data")
    liveness.record(store, "r-1", "west-0", 0, 10, "up")
    store.put_if_absent("runs/r-1/liveness/east-0/000000-0003-down.json.tmp", b"junk")  # not an event key
    assert liveness.down(store, "r-1") == {"east-0": "Crashed: killed"}
    liveness.record(store, "r-1", "east-0", 1, 1, "up")  # the next driver epoch relaunched it
    assert liveness.down(store, "r-1") == {}
