"""Retrying a failed outer-round flow run through the Prefect API finishes the round from S3.

The round first fails (its deadline passes with no delta); the deltas then arrive; the same flow
run is set back to Scheduled, as the UI's Retry and `prefect flow-run retry` do, and the runner
serving the deployment runs it again. The deltas written before are merged as they are, once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from fake_learner import delta_bytes, new_run, put
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Scheduled

from islands.flows.bring_up import wait_for_learner_deployment
from islands.infra.process import stop_group
from islands.ops.audit import audit_run
from islands.storage import layout
from islands.storage.rounds import read_manifest

RUN = "retry-run"
DEPLOYMENT = "outer-round/retry-test"
RUNNER = "from islands.flows.outer_round import outer_round\nouter_round.serve(name='retry-test', print_starting_message=False)\n"


def wait_final(flow_run_id, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as c:
        while time.monotonic() < deadline:
            fr = c.read_flow_run(flow_run_id)
            if fr.state and fr.state.is_final():
                return fr
            time.sleep(0.5)
    raise AssertionError(f"flow run {flow_run_id} did not finish within {timeout_s:.0f} s")


def test_retrying_the_failed_flow_run_finishes_the_round_from_storage(on_stack, tmp_path):
    config, stores = new_run(RUN, min_quorum=2, round_timeout_s=2.0)
    log = open(tmp_path / "runner.log", "w")
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER],
        env={**os.environ, **on_stack, "PREFECT_RUNNER_POLL_FREQUENCY": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_learner_deployment(DEPLOYMENT, timeout_s=120.0)
        first = run_deployment(DEPLOYMENT, parameters={"run_id": RUN, "round": 1, "store": stores.template}, timeout=0)
        failed = wait_final(first.id)
        assert failed.state.is_failed(), failed.state
        assert "no valid delta" in (failed.state.message or "")
        assert "nothing arrived; if the learners are running, quorum.round_timeout_s" in failed.state.message
        assert not stores.global_.exists(layout.manifest_key(RUN, 1))

        keys = [
            put(config, stores, learner, 0, delta_bytes(config, stores, learner, 0, 0, seed=i))
            for i, learner in enumerate(["north-0", "south-0"])
        ]
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(first.id, Scheduled(message="retried by the test"), force=True)
        done = wait_final(first.id)
    finally:
        stop_group(runner)
        log.close()
    assert done.state.is_completed(), (done.state, (tmp_path / "runner.log").read_text()[-3000:])
    assert done.run_count == 2

    manifest, _ = read_manifest(stores.global_, RUN, 1)
    assert sorted(c.key for c in manifest.contributions) == sorted(keys)
    report = audit_run(stores, RUN, replay=True)
    assert report.ok and report.replayed == 2, report.summary()
