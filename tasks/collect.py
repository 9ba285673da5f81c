"""Collect: watch the regional buckets until the quorum policy closes the round.

Each new delta is read once, size-checked before its bytes are fetched, streamed to the round's
spool directory while it is hashed, parsed only by safetensors one tensor at a time, and judged
by `tasks.core.validate`; a bad one is quarantined with its reason, never merged and never looked at
again. A good one stays on local disk until the merge, so memory does not grow with the number of
deltas. Listing only discovers; the consumed set comes from manifests. A poll asks each
learner's folder only for keys after the newest one seen (`DeltaWatch`), so it costs the same
however many deltas the run has written.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from storage import layout
from storage.codec import CodecError, TensorFile
from storage.manifest import Excluded
from storage.spool import spool
from storage.store import IntegrityError, ObjectMissing, ObjectStore
from tasks.core.quorum import Decision, decide
from tasks.core.validate import check_metadata, check_names, check_tensor, global_norm
from tasks.round_state import RoundState

READERS = 2  # deltas read at once (see inspect_all)


@dataclass
class Arrival:
    """A valid delta waiting to be merged."""

    key: str
    learner: str
    region: str
    phase: int
    base_round: int
    tokens: int
    loss: float
    bytes: int
    sha256: str
    seconds: float
    finished_at: float
    norm: float  # global L2 norm, for spotting outliers among the round's deltas
    delta: TensorFile = field(repr=False)  # the checked copy in the round's spool directory
    seen_at: float | None = None  # the collector's clock at the listing that found it


@dataclass
class Collected:
    arrivals: list[Arrival]
    quarantined: list[Excluded]
    decision: Decision
    waited_s: float


class DeltaWatch:
    """New keys in one region's bucket under the run's deltas.

    The first look lists everything there; later ones ask each of the region's learners'
    folders for keys after the newest one seen (S3's StartAfter), one small request each.
    `look(everything=True)` lists the whole prefix again: the round's last look does, so a key
    outside the region's learners' folders (another region's learner, a stray object) is found
    and quarantined in the round it came in."""

    def __init__(self, store: ObjectStore, run: str, learners: list[str]):
        self.store, self.run = store, run
        self.folders = {learner: layout.learner_deltas_prefix(run, learner) for learner in learners}
        self.newest: dict[str, str] | None = None  # learner → newest key seen in its folder

    def owned(self, key: str) -> bool:
        return any(key.startswith(folder) for folder in self.folders.values())

    def look(self, everything: bool = False) -> dict[str, int]:
        if everything or self.newest is None:
            found = self.store.list(layout.deltas_prefix(self.run))
        else:
            found = {}
            for learner, folder in self.folders.items():
                found.update(self.store.list(folder, start_after=self.newest[learner] or None))
        newest = self.newest or {}
        self.newest = {
            learner: max((k for k in found if k.startswith(folder)), default=newest.get(learner, ""))
            for learner, folder in self.folders.items()
        }
        return found


def inspect(state: RoundState, region: str, key: str, size: int) -> Arrival | Excluded:
    """Read and judge one delta found in `region`'s bucket."""
    parsed = layout.parse_delta_key(key)
    owners = {name: r for name, r, _ in state.config.learners()}

    path: Path | None = None  # where the delta is spooled, once it is

    def bad(reason: str, **kw) -> Excluded:
        if path is not None:
            path.unlink(missing_ok=True)
        return Excluded(kind="quarantined", key=key, reason=reason, region=region, **kw)

    if parsed is None:
        return bad("not a delta key of this layout")
    learner, phase = parsed
    if owners.get(learner) != region:
        return bad(
            f"learner {learner!r} does not belong to region {region!r} in this run", learner=learner, phase=phase
        )
    if size > state.max_delta_bytes():
        return bad(f"oversized: {size} bytes > {state.max_delta_bytes()}", learner=learner, phase=phase)
    path = state.spool_dir / f"{region}.{learner}.{phase:06d}.safetensors"
    try:
        got = spool(state.stores.region(region), key, path, max_bytes=state.max_delta_bytes())
    except (ObjectMissing, IntegrityError) as exc:
        return bad(f"unreadable: {exc}", learner=learner, phase=phase)
    sha = got.sha256
    dup = state.consumed_shas.get(sha)
    if dup is not None:
        return bad(f"duplicate of consumed delta {dup}", learner=learner, phase=phase, sha256=sha)
    try:
        delta = TensorFile(path, got.body_sha256)
    except CodecError as exc:
        return bad(str(exc), learner=learner, phase=phase, sha256=sha)
    meta = delta.metadata
    reason, norm = check_metadata(meta, state.run, learner, phase, state.round - 1), 0.0
    if not reason:
        reason, norm = check_delta(delta, state.model)
    if reason:
        return bad(reason, learner=learner, phase=phase, sha256=sha, tokens=_int(meta.get("tokens")))
    return Arrival(
        key=key,
        learner=learner,
        region=region,
        phase=phase,
        base_round=int(meta["base_round"]),
        tokens=int(meta["tokens"]),
        loss=float(meta["loss"]),
        bytes=got.bytes,
        sha256=sha,
        seconds=float(meta.get("seconds", 0.0)),
        finished_at=float(meta.get("finished_at", time.time())),
        norm=norm,
        delta=delta,
    )


def inspect_all(state: RoundState, found: list[tuple[str, str, int]]) -> list[Arrival | Excluded]:
    """`inspect` for each (region, key, size), READERS at a time, in the order given.

    One reader keeps neither side busy: the store serves while the reader waits, and the reader
    hashes and writes while the store waits. Memory holds a chunk or a tensor per reader."""
    if not found:
        return []
    _ = state.spool_dir, state.consumed_shas  # made once, before the readers share them
    with ThreadPoolExecutor(READERS, thread_name_prefix="collect") as pool:
        return list(pool.map(lambda item: inspect(state, *item), found))


def check_delta(delta: TensorFile, model: dict[str, torch.Tensor]) -> tuple[str | None, float]:
    """(reason or None, global norm): every tensor decoded and checked against the model's, one
    at a time; a tensor the codec cannot decode is refused with the codec's reason."""
    reason = check_names(delta.names, model)
    if reason:
        return reason, 0.0
    norms = []
    for name, ref in model.items():
        try:
            reason, norm = check_tensor(name, delta.decoded(name, tuple(ref.shape)), ref)
        except CodecError as exc:
            return str(exc), 0.0
        if reason:
            return reason, 0.0
        norms.append(norm)
    return None, global_norm(norms)


def _int(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


@task(name="collect", cache_policy=NO_CACHE)
def collect(state: RoundState) -> Collected:
    """Poll until all are in, the quorum's grace window ends, or the hard deadline passes."""
    log = get_run_logger()
    cfg = state.config
    consumed = state.consumed_keys
    history = state.history()
    learners = [name for name, _, _ in cfg.learners()]
    watches = {
        region: DeltaWatch(store, state.run, [name for name, r, _ in cfg.learners() if r == region])
        for region, store in state.stores.regions.items()
    }
    seen: dict[str, Arrival | Excluded] = {}

    def look(last: bool = False) -> None:
        """Inspect what is new; on the last look, only keys outside the learners' folders (a
        learner's delta that lands now is left for the next round)."""
        listed_at = time.time()
        new = [
            (region, key, size)
            for region, watch in watches.items()
            for key, size in sorted(watch.look(everything=last).items())
            if key not in consumed and key not in seen and not (last and watch.owned(key))
        ]
        for (_, key, _), found in zip(new, inspect_all(state, new)):
            seen[key] = found
            if isinstance(found, Arrival):
                found.seen_at = listed_at
            if isinstance(found, Excluded):
                log.warning("%s round %d: quarantined %s: %s", state.run, state.round, key, found.reason)

    started, looks = time.time(), 0
    while True:
        look()
        looks += 1
        arrivals = [a for a in seen.values() if isinstance(a, Arrival)]
        # Only deltas from the parent round count towards the quorum; staler ones still merge,
        # and move their learner's expected next arrival on.
        fresh: dict[str, float] = {}
        current = dict(history)
        for a in sorted(arrivals, key=lambda a: a.finished_at):
            if a.base_round == state.round - 1:
                fresh[a.learner] = min(fresh.get(a.learner, a.seen_at), a.seen_at)
            if a.learner in current:
                current[a.learner] = current[a.learner].seen(a.finished_at, a.seconds)
        now = time.time()
        decision = decide(cfg.quorum, started, now, fresh, learners, current, listing_s=cfg.quorum.poll_s)
        if decision.close:
            if looks > 1:  # the first look listed everything already
                look(last=True)
            break
        wake = decision.recheck_at if decision.recheck_at is not None else now + cfg.quorum.poll_s
        time.sleep(min(cfg.quorum.poll_s, max(0.05, wake - now)))
    waited = time.time() - started
    quarantined = [e for e in seen.values() if isinstance(e, Excluded)]
    log.info(
        "%s round %d: collected %d deltas from %d learners in %.1f s (%s); %d quarantined",
        state.run,
        state.round,
        len(arrivals),
        len(fresh),
        waited,
        decision.reason,
        len(quarantined),
    )
    return Collected(sorted(arrivals, key=lambda a: (a.learner, a.phase)), quarantined, decision, waited)
