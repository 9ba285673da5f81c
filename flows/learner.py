"""The learner flow: phase after phase, each from the newest published round, until the run ends.

A learner never waits on the synchronizer for longer than `learner_wait_s`: if no newer round
has been published by then it trains again from the round it has (its delta is then one round
staler, and the merge weighs it accordingly).
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.config import RunConfig
from storage.rounds import latest_round, read_config, stop_requested
from storage.store import Stores
from tasks.train_phase import LearnerSession, train_phase

POLL_S = 0.5


def _name() -> str:
    return f"learner-{flow_run.parameters['learner']}"


def next_base(session: LearnerSession) -> int | None:
    """The round to train from next, or None when the run is over."""
    cfg, store, run = session.config, session.global_store, session.run
    deadline = time.monotonic() + cfg.learner_wait_s
    while True:
        if stop_requested(store, run):
            return None
        newest = latest_round(store, run)
        if newest is None:
            raise RuntimeError(f"run {run} has no round 0 in {store.url}; start it with `islands run`")
        if newest >= cfg.rounds:
            return None
        if session.last_base is None or newest > session.last_base or time.monotonic() >= deadline:
            return newest
        time.sleep(POLL_S)


@flow(name="learner", flow_run_name=_name, log_prints=True)
def learner(run_id: str, learner: str, store: str) -> dict:
    """Train `learner` of run `run_id` against the buckets of the `store` template."""
    log = get_run_logger()
    global_only = Stores(store, [])
    config = RunConfig.model_validate(read_config(global_only.global_, run_id))
    session = LearnerSession.open(config, run_id, learner, Stores(store, config.regions))
    log.info("%s learner %s (%s) starts at phase %d", run_id, learner, session.region, session.next_phase)
    phases = tokens = 0
    while (base := next_base(session)) is not None:
        out = train_phase(session, session.next_phase, base)
        phases += out["steps"] > 0
        tokens += out.get("tokens", 0)
    log.info("%s learner %s (%s) done: %d phases, %d tokens", run_id, learner, session.region, phases, tokens)
    return {"learner": learner, "phases": phases, "tokens": tokens}
