"""Publish: write θ_r, its encoded update and the outer state (content-addressed), then the
manifest — the commit point. The held-out evaluation comes after (tasks.evaluate).

The manifest is written last and only if absent. When another synchronizer (or an earlier try of
this one) already committed the round, the loser reads the winner's manifest: if it names the
same model bytes the retry was idempotent; otherwise the winner's round is adopted as is. Either
way exactly one manifest exists per round and nothing is applied twice.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from islands.core.config import RunConfig
from islands.core.model import build_model, own_params
from islands.storage import layout
from islands.storage.manifest import EncodedRef, Manifest, ObjectRef, Quorum, RoundSettings
from islands.storage.model_files import local_model
from islands.storage.rounds import checkpoint_metadata, put_encoded, put_tensors, put_update, read_manifest
from islands.storage.store import ObjectStore, Stores, sha256_hex
from islands.tasks.collect import Collected
from islands.tasks.crash import crash_point
from islands.tasks.evaluate import held_out_loss
from islands.tasks.merge_step import Merged
from islands.tasks.round_state import RoundState


@dataclass
class Published:
    manifest: Manifest
    sha256: str
    outcome: str  # "committed" | "idempotent" | "adopted"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def round_store(config: RunConfig, stores: Stores) -> ObjectStore:
    """Where a round's checkpoints and manifest go: the global bucket, each object under S3
    Object Lock (compliance mode) for `object_lock_days` when the run asks for it, so that not
    even the synchronizer's or an admin's credentials can delete or replace the record."""
    days = config.object_lock_days
    return stores.global_ if days is None else stores.global_.with_retention(days)


def commit(store: ObjectStore, manifest: Manifest) -> Published:
    """Put the manifest if absent; on a lost race, verify or adopt the winner's."""
    data = manifest.to_bytes()
    key = layout.manifest_key(manifest.run, manifest.round)
    if store.put_if_absent(key, data):
        return Published(manifest, sha256_hex(data), "committed")
    winner, sha = read_manifest(store, manifest.run, manifest.round)
    same = winner.model.sha256 == manifest.model.sha256 and winner.parent_sha256 == manifest.parent_sha256
    return Published(winner, sha, "idempotent" if same else "adopted")


def publish_initial(config: RunConfig, run: str, stores: Stores) -> Published:
    """Round 0: the seeded initial model, its held-out loss (if the run evaluates round 0), no
    momentum yet."""
    model = build_model(local_model(config.model), config.seed)
    store = round_store(config, stores)
    ref = put_tensors(store, lambda sha: layout.model_key(run, 0, sha), own_params(model), checkpoint_metadata(run, 0))
    loss = held_out_loss(config, model) if config.evaluates(0, 0) else None
    learners = [name for name, _, _ in config.learners()]
    manifest = Manifest(
        run=run,
        round=0,
        parent_round=None,
        parent_sha256=None,
        created_at=_now(),
        model=ref,
        outer=None,
        settings=RoundSettings.of(config),
        quorum=Quorum(received=0, learners=learners, waited_s=0.0, closed_by="initial"),
        eval_loss=loss,
    )
    return commit(store, manifest)


def write_objects(state: RoundState, merged: Merged) -> tuple[ObjectRef, EncodedRef, ObjectRef]:
    """θ_r, its encoded update and the outer state under their content addresses: everything of
    the round but the manifest, which names them.

    The three go up side by side, each from where its bytes are: an S3 endpoint takes several
    uploads at once faster than one after another (moto's server stores them on its threads).
    A crash point fires once the objects it names are in; the others may then be in flight, and
    an upload cut short leaves no object."""
    run, r, codec = state.run, state.round, state.config.update_codec
    store = round_store(state.config, state.stores)
    with ThreadPoolExecutor(3, thread_name_prefix="publish-put") as pool:
        model = pool.submit(put_encoded, store, lambda sha: layout.model_key(run, r, sha), merged.model_object)
        update = pool.submit(put_update, store, run, r, merged.update, codec)
        outer = pool.submit(put_encoded, store, lambda sha: layout.outer_key(run, r, sha), merged.outer)
        model_ref = model.result()
        crash_point("publish.after_model", r)
        update_ref, outer_ref = update.result(), outer.result()
    crash_point("publish.after_outer", r)
    return model_ref, update_ref, outer_ref


@task(name="publish", cache_policy=NO_CACHE)
def publish(state: RoundState, collected: Collected, merged: Merged, timings: dict[str, float]) -> Published:
    log = get_run_logger()
    t0 = time.perf_counter()
    run, r = state.run, state.round
    model_ref, update_ref, outer_ref = write_objects(state, merged)
    parent, parent_sha = state.parent
    manifest = Manifest(
        run=run,
        round=r,
        parent_round=parent.round,
        parent_sha256=parent_sha,
        created_at=_now(),
        model=model_ref,
        outer=outer_ref,
        update=update_ref,
        contributions=merged.contributions,
        excluded=merged.excluded,
        tokens_applied=parent.tokens_applied + sum(c.tokens_counted for c in merged.contributions),
        settings=RoundSettings.of(state.config),
        quorum=Quorum(
            received=len({c.learner for c in merged.contributions}),
            learners=sorted({c.learner for c in merged.contributions}),
            waited_s=round(collected.waited_s, 3),
            closed_by=collected.decision.reason or "timeout",
        ),
        timings={**timings, "publish_s": round(time.perf_counter() - t0, 3)},
    )
    published = commit(round_store(state.config, state.stores), manifest)
    crash_point("publish.after_manifest", r)
    if published.outcome != "committed":
        log.warning("%s round %d: another synchronizer committed first (%s)", run, r, published.outcome)
    log.info("%s round %d published: manifest %s", run, r, published.sha256[:12])
    return published
