"""The outer-round flow: collect → merge → publish → evaluate (when due) for one round; one flow run per round.

Everything it needs is read from the global bucket, so retrying a failed run of this flow (from
the UI, the API or `islands resume`) finishes the round from what is already in storage.
"""

from __future__ import annotations

import time

import torch
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from islands.flows.artifacts import publish_round_artifacts
from islands.storage import layout
from islands.storage.manifest import Manifest
from islands.storage.rounds import evaluated, read_config, read_manifest
from islands.storage.store import Stores
from islands.tasks.collect import collect
from islands.tasks.crash import crash_point
from islands.tasks.evaluate import evaluate_round, round_loss
from islands.tasks.merge_step import merge
from islands.tasks.publish import publish
from islands.tasks.round_state import RoundState


def _name() -> str:
    p = flow_run.parameters
    return f"{p['run_id']}/round-{p['round']:03d}"


def summarize(manifest: Manifest) -> dict:
    """The per-round facts the driver prints and reports (the manifest with its eval loss)."""
    return {
        "round": manifest.round,
        "closed_by": manifest.quorum.closed_by,
        "learners": ", ".join(f"{c.learner}@s{c.staleness}" for c in manifest.contributions),
        "received": manifest.quorum.received,
        "waited_s": manifest.quorum.waited_s,
        "eval_loss": manifest.eval_loss,
        "bytes_in": sum(c.bytes for c in manifest.contributions),
        "bytes_out": sum(ref.bytes for ref in (manifest.model, manifest.outer, manifest.update) if ref),
        "excluded": [f"{e.key}: {e.reason}" for e in manifest.excluded],
        "tokens": sum(c.tokens_counted for c in manifest.contributions),
        "tokens_applied": manifest.tokens_applied,
    }


@flow(name="outer-round", flow_run_name=_name)
def outer_round(run_id: str, round: int, store: str) -> dict:  # noqa: A002 - the UI form says "round"
    """Publish round `round` of run `run_id` from the deltas waiting in the regional buckets."""
    log = get_run_logger()
    stores = Stores(store, [])
    config = read_config(stores.global_, run_id)
    stores = Stores(store, config.regions)
    # One learner's share of the cores: more threads only spin against the learners beside it.
    torch.set_num_threads(config.threads_per_learner())
    if stores.global_.exists(layout.manifest_key(run_id, round)):  # rounds are published in order
        log.info(
            "%s round %d is already published; nothing to do but its evaluation, if due and missing", run_id, round
        )
        manifest = read_manifest(stores.global_, run_id, round)[0]
        loss = round_loss(config, stores.global_, manifest)
        return {**summarize(evaluated(manifest, loss)), "outcome": "already-published"}
    t0 = time.perf_counter()
    state = RoundState.load(config, run_id, stores)
    if state.round != round:
        state.drop_spool()  # θ_{r−1} and the outer state were spooled for nothing
        raise RuntimeError(f"{run_id}: round {round} cannot be published before round {state.round}")
    t1 = time.perf_counter()
    try:
        collected = collect(state)
        crash_point("collect.done", round)
        t2 = time.perf_counter()
        merged = merge(state, collected)
        t3 = time.perf_counter()
        timings = {"load_s": round_s(t1 - t0), "collect_s": round_s(t2 - t1), "merge_s": round_s(t3 - t2)}
        published = publish(state, collected, merged, timings)
        # The merge never holds θ_r whole: an evaluation due reads the committed checkpoint once,
        # the merge's memory long given back. A round just committed and not due has none to read.
        due = config.evaluates(round, published.manifest.tokens_applied)
        loss = evaluate_round(config, stores.global_, published.manifest) if due else None
    finally:
        state.drop_spool()
    manifest = evaluated(published.manifest, loss)
    publish_round_artifacts(manifest, f"{stores.global_.url}/{layout.manifest_key(run_id, round)}", published.sha256)
    return {**summarize(manifest), "outcome": published.outcome}


def round_s(seconds: float) -> float:
    return round(seconds, 3)


if __name__ == "__main__":
    # One round as its own process: `python -m islands.flows.outer_round RUN ROUND STORE` (fault rehearsals).
    import sys

    outer_round(run_id=sys.argv[1], round=int(sys.argv[2]), store=sys.argv[3])
