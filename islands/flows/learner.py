"""The learner flow: phase after phase, each from the newest published round, until the run ends.

Rounds are fetched in the background (tasks.follow) and a round published mid-phase is folded
into the phase in progress (`rebase`), so a learner never stops for the synchronizer. It waits
for a newer round only if `learner_wait_s` > 0, and at most that long.

A learner follows the driver that launched it (`storage.lease`): it ends when the run ends, when
that driver has been silent for the lease, or when a resumed driver took over — never two
processes for one learner. It records `host:pid` on its flow run so tools can find its process.
"""

from __future__ import annotations

import os
import socket
import time

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from islands.flows.credentials import storage_options
from islands.infra.memory import return_freed_memory
from islands.storage import lease
from islands.storage.rounds import read_config
from islands.storage.store import Stores
from islands.tasks.crash import LEARNER_POINTS, CrashSpecError, parse
from islands.tasks.train_phase import LearnerSession, train_phase

POLL_S = 0.5


def _name() -> str:
    return f"learner-{flow_run.parameters['learner']}"


def next_base(session: LearnerSession) -> int | None:
    """The round to train from next, or None when the run is over."""
    cfg = session.config
    deadline = time.monotonic() + cfg.learner_wait_s
    while True:
        if session.must_stop():
            return None
        newest = session.rounds.held()[0]
        if newest >= cfg.rounds:
            return None
        left = deadline - time.monotonic()
        if session.last_base is None or newest > session.last_base or left <= 0:
            return newest
        session.rounds.wait_newer(session.last_base, min(POLL_S, left))


def record_process() -> None:
    """Put this process's `host:pid` on the flow run (Prefect's infrastructure_pid field)."""
    run_id = flow_run.id
    if run_id is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(run_id, infrastructure_pid=f"{socket.gethostname()}:{os.getpid()}")


@flow(name="learner", flow_run_name=_name, log_prints=True)
def learner(
    run_id: str,
    learner: str,
    store: str,
    driver: int | None = None,
    crash: str | None = None,
    credentials: str | None = None,
) -> dict:
    """Train `learner` of run `run_id` against the buckets of the `store` template.

    `driver`: the epoch of the driver that launched it (default: the newest); `crash`: a learner
    crash point to die at, for fault rehearsals (tasks.crash); `credentials`: the name of a
    prefect-aws AwsCredentials block to sign S3 requests with (set on a region's learner
    deployment; default: the worker's environment).
    """
    log = get_run_logger()
    if crash is not None and parse(crash)[0] not in LEARNER_POINTS:
        raise CrashSpecError(
            f"crash={crash!r} is not a learner crash point; use one of {', '.join(sorted(LEARNER_POINTS))}"
        )
    record_process()
    return_freed_memory()
    options = storage_options(credentials) if credentials else {}
    global_only = Stores(store, [], options)
    config = read_config(global_only.global_, run_id)
    session = LearnerSession.open(config, run_id, learner, Stores(store, config.regions, options))
    epoch = driver if driver is not None else max(lease.epochs(session.global_store, run_id), default=0)
    session.watch = lease.Watch(session.global_store, run_id, epoch)
    session.crash = crash
    log.info(
        "%s learner %s (%s) starts at phase %d under driver epoch %d",
        run_id,
        learner,
        session.region,
        session.next_phase,
        epoch,
    )
    phases = tokens = 0
    try:
        session.follow(POLL_S)
        while next_base(session) is not None:
            out = train_phase(session, session.next_phase)
            phases += out["steps"] > 0
            tokens += out.get("tokens", 0)
        session.rounds.close()
        session.uploads.close()  # the last phase's delta and state are in storage before the run ends
    finally:
        session.remove_scratch()
    log.info(
        "%s learner %s (%s) done: %d phases, %d tokens%s",
        run_id,
        learner,
        session.region,
        phases,
        tokens,
        f"; stopped: {session.halt}" if session.halt else "",
    )
    return {"learner": learner, "phases": phases, "tokens": tokens, "halt": session.halt}
