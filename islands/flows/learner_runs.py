"""A run's learner flow runs seen through the Prefect API: find the live ones, wait for earlier
drivers' learners to end, and kill a region's learner processes (fault rehearsals).

A learner records `host:pid` in its flow run's infrastructure_pid when it starts (flows.learner),
which is how a learner process is found from the driver.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowRunFilter
from prefect.states import Cancelled

from islands.infra.process import pid_alive
from islands.storage.lease import LEASE_S

RETIRE_S = LEASE_S + 15.0


def live_learner_runs(client, run: str, region: str | None = None) -> list:
    """Learner flow runs of `run` (of `region`'s learners, if given) not in a final state."""
    tags = [run] if region is None else [run, region]
    runs = client.read_flow_runs(
        flow_filter=FlowFilter(name={"any_": ["learner"]}), flow_run_filter=FlowRunFilter(tags={"all_": tags})
    )
    return [r for r in runs if not r.state or not r.state.is_final()]


def retire_learners(run: str, timeout_s: float = RETIRE_S) -> list[str]:
    """Wait for the learners of earlier drivers to end; cancel the ones that never report back.

    They stop by themselves within seconds of seeing the newer epoch. One still not final once
    the lease has run out has no live process behind it (its runner died with it).
    """
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while (left := live_learner_runs(client, run)) and time.monotonic() < deadline:
            time.sleep(1.0)
        for r in left:
            client.set_flow_run_state(r.id, Cancelled(message="its driver is gone and no process answered"), force=True)
        return [r.name for r in left]


def kill_learners(run: str, region: str, timeout_s: float = 60.0) -> list[str]:
    """SIGKILL the process of every live learner of `region`; returns the flow-run names.

    Waits (up to `timeout_s`) for each live learner to have recorded its process, then for the
    process to be gone, so a relaunch never overlaps it.
    """
    host = socket.gethostname()
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = live_learner_runs(client, run, region)
            if runs and all(r.infrastructure_pid for r in runs):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{run}: no running learner of region {region} with a recorded process to kill")
            time.sleep(0.5)
    pids = []
    for r in runs:
        where, _, pid = r.infrastructure_pid.rpartition(":")
        if where != host:
            raise RuntimeError(
                f"{run}: learner run {r.name} runs on {where}; only learners on this machine can be killed"
            )
        os.kill(int(pid), signal.SIGKILL)
        pids.append(int(pid))
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [r.name for r in runs]
