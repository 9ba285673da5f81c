"""Two synchronizers race on the same round of the same run: exactly one manifest is written, both
processes end well (the loser finds the winner's manifest is the one it would have written), and
the run completes and audits clean; a round asked for again reports it was already published.

The global bucket is versioned for this test, so a second write of the manifest could not hide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from fake_learner import delta_bytes, new_run, put
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterName,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
    TaskRunFilterName,
)

from islands.flows.outer_round import outer_round
from islands.infra.s3_server import client
from islands.ops.audit import audit_run
from islands.storage import layout

RUN = "race-run"
SYNCHRONIZER = (
    "import json, sys\n"
    "from islands.flows.outer_round import outer_round\n"
    "print(json.dumps(outer_round(run_id=sys.argv[1], round=1, store=sys.argv[2])))\n"
)


def wait_collecting(name: str, count: int, timeout_s: float = 120.0) -> None:
    """Until `count` flow runs called `name` are inside their collect task.

    A flow run counts as running before its body checks for a published manifest, so waiting on
    the flow runs alone lets a slow synchronizer find the winner's manifest and skip the race.
    """
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as c:
        while time.monotonic() < deadline:
            runs = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
            collecting = (
                c.read_task_runs(
                    task_run_filter=TaskRunFilter(
                        flow_run_id=TaskRunFilterFlowRunId(any_=[r.id for r in runs]),
                        name=TaskRunFilterName(like_="collect"),
                    )
                )
                if runs
                else []
            )
            if sum(1 for t in collecting if t.state and t.state.is_running()) >= count:
                return
            time.sleep(0.5)
    raise AssertionError(f"{count} flow runs {name!r} were not collecting within {timeout_s:.0f} s")


def test_two_synchronizers_on_one_round_publish_exactly_one_manifest(on_stack):
    s3 = client(on_stack["AWS_ENDPOINT_URL"])
    s3.put_bucket_versioning(Bucket="islands-global", VersioningConfiguration={"Status": "Enabled"})
    config, stores = new_run(RUN, min_quorum=2, round_timeout_s=120.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SYNCHRONIZER, RUN, stores.template],
            env={**os.environ, **on_stack},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        wait_collecting(f"{RUN}/round-001", 2)
        for i, learner in enumerate(["north-0", "south-0"]):
            put(config, stores, learner, 0, delta_bytes(config, stores, learner, 0, 0, seed=i))
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    outcomes = sorted(json.loads(out.strip().splitlines()[-1])["outcome"] for out, _ in results)
    assert outcomes == ["committed", "idempotent"]

    key = layout.manifest_key(RUN, 1)
    versions = s3.list_object_versions(Bucket="islands-global", Prefix=key).get("Versions", [])
    assert len(versions) == 1, f"{len(versions)} versions of {key}"
    models = [k for k in stores.global_.list(layout.round_prefix(RUN, 1)) if "/model-" in k]
    assert len(models) == 1, "both merged the same deltas into the same content-addressed checkpoint"

    for i, learner in enumerate(["north-0", "south-0"]):
        put(config, stores, learner, 1, delta_bytes(config, stores, learner, 1, 1, seed=10 + i))
    assert outer_round(run_id=RUN, round=2, store=stores.template)["round"] == config.rounds
    assert outer_round(run_id=RUN, round=1, store=stores.template)["outcome"] == "already-published"
    report = audit_run(stores, RUN, replay=True)
    assert report.ok and report.replayed == 3, report.summary()
