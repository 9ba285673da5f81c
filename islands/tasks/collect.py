"""Collect: watch the regional buckets until the quorum policy closes the round.

Each new delta is read once, size-checked before its bytes are fetched, streamed to the round's
spool directory while it is hashed, parsed only by safetensors one tensor at a time, and judged
by `islands.core.validate`; a bad one is quarantined with its reason, never merged and never looked at
again. A good one stays on local disk until the merge, so memory does not grow with the number of
deltas. Listing only discovers; the consumed set comes from manifests. A poll asks each
learner's folder only for what lies past the unbroken run of phase numbers it holds
(`DeltaWatch`), so it costs the same however many deltas the run has written, and no key moves
it past a learner's next delta. A delta is judged once by its bytes and once by its tensors: the
same tensors under another key (a new phase number, say) as a delta already merged or
quarantined are quarantined too.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from islands.core.quorum import Decision, decide, quorum_arrivals
from islands.core.validate import (
    Expected,
    Invalid,
    check_names,
    check_tensor,
    claimed_tokens,
    global_norm,
    norm_bound,
    read_claims,
    short,
    shown,
)
from islands.storage import layout, liveness
from islands.storage.codec import CodecError, TensorFile
from islands.storage.manifest import Excluded
from islands.storage.rounds import shape_of
from islands.storage.spool import spool
from islands.storage.store import IntegrityError, ObjectMissing, ObjectStore, StoreError
from islands.tasks.round_state import RoundState

READERS = 2  # deltas read at once (see inspect_all)
# Delta keys spell their phase in six digits or more (layout.delta_key): below a million, their
# text order is their phases' order; past it, a seven-digit key sorts before a six-digit one.
TEXT_ORDERED = 10**6


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
    body_sha256: str  # of its tensor bytes: the same tensors under another key are a duplicate
    seconds: float
    finished_at: float
    norm: float  # global L2 norm, for spotting outliers among the round's deltas
    delta: TensorFile = field(repr=False)  # the checked copy in the round's spool directory
    seen_at: float | None = None  # the collector's clock at the listing that found it

    def excluded(self, kind: Literal["quarantined", "dropped"], reason: str) -> Excluded:
        """This delta's record as left out of the round."""
        return Excluded(
            kind=kind,
            key=self.key,
            reason=reason,
            learner=self.learner,
            region=self.region,
            phase=self.phase,
            tokens=self.tokens,
            sha256=self.sha256,
            body_sha256=self.body_sha256,
        )


@dataclass
class Collected:
    arrivals: list[Arrival]
    quarantined: list[Excluded]
    decision: Decision
    waited_s: float


class DeltaWatch:
    """New keys in one region's bucket under the run's deltas.

    The first look lists the whole prefix. From it the watch takes each of the region's learners'
    *floor*: the end of the unbroken run of phase numbers 0, 1, 2, … that its folder holds, keys
    read by their parsed phase, never by their text. A learner writes its phases in that order
    and skips a number it finds taken, so its next delta is the next number past its floor. Later
    looks (polls) ask each folder only for what lies past the floor — below phase 1,000,000, where
    text order is phase order, one listing after the floor's key (S3's StartAfter); from there on,
    where a seven-digit key sorts before a six-digit one, the next numbers one by one — and move
    the floor only along that run. So no key moves the view past a learner's next delta: not one
    far ahead, whether it is quarantined or merged, nor one that sorts last as text. A key at the
    very next number moves the floor by one and hides nothing: the learner cannot write there,
    and writes under the number after it.

    `look(everything=True)` lists the whole prefix again; the round's last look does. The full
    listings are the last word, and are still needed: a poll asks only for a learner's numbers
    past its floor, so a key outside the learners' folders (another region's learner, a stray
    object), or a learner's delta that no poll reaches (past a hole in its numbers from phase
    1,000,000 on), is found by a full listing — at the latest the next round's first look — and
    is never hidden for good. A poll costs a request per learner (and one per new number from
    phase 1,000,000 on) however many deltas the run holds; only the full listings, two a round
    at most, grow with the run."""

    def __init__(self, store: ObjectStore, run: str, learners: list[str]):
        self.store, self.run = store, run
        self.folders = {learner: layout.learner_deltas_prefix(run, learner) for learner in learners}
        self.floor: dict[str, int] | None = None  # learner → end of its unbroken run of phases from 0 (−1: none)
        self.ahead: dict[str, set[int]] = {learner: set() for learner in learners}  # phases seen past the floor

    def owned(self, key: str) -> bool:
        return any(key.startswith(folder) for folder in self.folders.values())

    def look(self, everything: bool = False) -> dict[str, int]:
        if everything or self.floor is None:
            found = self.store.list(layout.deltas_prefix(self.run))
        else:
            found = {}
            for learner in self.folders:
                found.update(self.past_floor(learner))
        floors = self.floor or {}
        for key in found:
            parsed = layout.parse_delta_key(key)
            if parsed is not None and parsed[0] in self.ahead and key.startswith(self.folders[parsed[0]]):
                self.ahead[parsed[0]].add(parsed[1])
        self.floor = {}
        for learner, ahead in self.ahead.items():
            floor = floors.get(learner, -1)
            while floor + 1 in ahead:
                floor += 1
            self.floor[learner] = floor
            self.ahead[learner] = {phase for phase in ahead if phase > floor}
        return found

    def past_floor(self, learner: str) -> dict[str, int]:
        """Keys of `learner`'s folder past its floor's key as text (below TEXT_ORDERED), else the
        keys of the numbers after its floor, up to the first that is free."""
        floor = self.floor[learner]
        if floor + 1 < TEXT_ORDERED:
            after = layout.delta_key(self.run, learner, floor) if floor >= 0 else None
            return self.store.list(self.folders[learner], start_after=after)
        found, phase = {}, floor + 1
        while (size := self.store.size(key := layout.delta_key(self.run, learner, phase))) is not None:
            found[key] = size
            phase += 1
        return found


def inspect(state: RoundState, region: str, key: str, size: int) -> Arrival | Excluded | None:
    """Read and judge one delta found in `region`'s bucket. Any fault of the delta, or any error
    while reading or checking it, quarantines it with a short reason; only the store failing to
    answer (no verdict on the delta) leaves it for a later look (None)."""
    known: dict = {}  # what is known of the delta so far, for its record
    path = state.spool_dir / f"{region}.{len(key)}.{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"
    try:
        return _judge(state, region, key, size, path, known)
    except StoreError as exc:
        path.unlink(missing_ok=True)
        if not isinstance(exc, ObjectMissing | IntegrityError):
            return None
        reason = f"unreadable: {exc}"
    except (Invalid, CodecError) as exc:
        reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - whatever a delta's bytes provoke, the round goes on
        reason = f"could not be checked: {type(exc).__name__}: {exc}"
    path.unlink(missing_ok=True)
    return Excluded(kind="quarantined", key=key, reason=short(reason), region=region, **known)


def _judge(state: RoundState, region: str, key: str, size: int, path: Path, known: dict) -> Arrival:
    """`inspect`'s checks, in order of cost; each fault raises. `known` gathers the delta's
    learner, phase, sha256s and capped tokens as they are established, for a quarantine record."""
    parsed = layout.parse_delta_key(key)
    if parsed is None:
        raise Invalid("not a delta key of this layout")
    learner, phase = parsed
    known.update(learner=learner, phase=phase)
    owners = {name: r for name, r, _ in state.config.learners()}
    if owners.get(learner) != region:
        raise Invalid(f"learner {learner!r} does not belong to region {region!r} in this run")
    if size > state.max_delta_bytes():
        raise Invalid(f"oversized: {size} bytes > {state.max_delta_bytes()}")
    got = spool(state.stores.region(region), key, path, max_bytes=state.max_delta_bytes())
    known["sha256"] = sha = got.sha256
    dup = state.consumed_shas.get(sha)
    if dup is not None:
        raise Invalid(f"duplicate of consumed delta {dup}")
    delta = TensorFile(path, got.body_sha256, state.config.topk)
    known["body_sha256"] = body = got.body_sha256  # tensor bytes that read as such, and no others
    dup = state.consumed_bodies.get(body)
    if dup is not None:
        raise Invalid(f"same tensors as {dup}, already consumed")
    cfg = state.config
    known["tokens"] = claimed_tokens(delta.metadata, cfg.inner_steps, state.step_tokens)
    expected = Expected(state.run, learner, region, phase, state.round - 1, cfg.inner_steps, state.step_tokens)
    claims = read_claims(delta.metadata, expected)
    reason, norm = check_delta(delta, state.model, state.chunk_values)
    # Bounded here, not at the merge, so that a delta too large to merge never counts towards the quorum.
    reason = reason or norm_bound(norm, state.recent_norms(), state.model_norm, cfg.merge.norm_limit)
    if reason:
        raise Invalid(reason)
    return Arrival(
        key=key,
        learner=learner,
        region=region,
        phase=phase,
        base_round=claims.base_round,
        tokens=claims.tokens,
        loss=claims.loss,
        bytes=got.bytes,
        sha256=sha,
        body_sha256=body,
        seconds=claims.seconds,
        finished_at=claims.finished_at if claims.finished_at is not None else time.time(),
        norm=norm,
        delta=delta,
    )


def first_with_its_tensors(found: Arrival | Excluded, bodies: dict[str, str]) -> Arrival | Excluded:
    """`found`, or, when it is a valid delta whose tensor bytes a delta looked at before it in
    this round had too (merged or quarantined), that delta quarantined as a duplicate. `bodies`
    (body_sha256 → key) holds what was looked at, in order; `found`'s tensors join it."""
    if found.body_sha256 is None:
        return found
    first = bodies.setdefault(found.body_sha256, found.key)
    if first == found.key or not isinstance(found, Arrival):
        return found
    found.delta.path.unlink(missing_ok=True)
    return found.excluded("quarantined", short(f"same tensors as {first}"))


def inspect_all(state: RoundState, found: list[tuple[str, str, int]]) -> list[Arrival | Excluded | None]:
    """`inspect` for each (region, key, size), READERS at a time, in the order given.

    One reader keeps neither side busy: the store serves while the reader waits, and the reader
    hashes and writes while the store waits. Memory holds a chunk or a tensor per reader."""
    if not found:
        return []
    _ = (
        state.spool_dir,
        state.consumed_shas,
        state.consumed_bodies,
        state.model_norm,
        state.step_tokens,
    )  # made once, before the readers share them
    with ThreadPoolExecutor(READERS, thread_name_prefix="collect") as pool:
        return list(pool.map(lambda item: inspect(state, *item), found))


def check_delta(delta: TensorFile, model: Mapping[str, torch.Tensor], values: int) -> tuple[str | None, float]:
    """(reason or None, global norm): every tensor decoded and checked against the model's
    shapes, `values` elements at a time, so no tensor is ever whole in memory, however large; a
    tensor the codec cannot decode is refused with the codec's reason."""
    reason = check_names(delta.names, model)
    if reason:
        return reason, 0.0
    norms = []
    for name in model:
        shape = shape_of(model, name)
        try:
            if len(delta.plan[name]) == 1 and delta.shape(name) != shape:
                return f"wrong shape for {name}: {shown(delta.shape(name))} instead of {shape}", 0.0
            squares = 0.0
            for chunk in delta.chunks(name, values, shape):
                reason, norm = check_tensor(name, chunk, chunk)
                if reason:
                    return reason, 0.0
                squares += norm * norm
        except CodecError as exc:
            return str(exc), 0.0
        norms.append(math.sqrt(squares))
    return None, global_norm(norms)


@task(name="collect", cache_policy=NO_CACHE)
def collect(state: RoundState) -> Collected:
    """Poll until all are in, the quorum's grace window ends, or the hard deadline passes."""
    log = get_run_logger()
    cfg = state.config
    consumed = state.consumed
    history = state.history()
    learners = [name for name, _, _ in cfg.learners()]
    watches = {
        region: DeltaWatch(store, state.run, [name for name, r, _ in cfg.learners() if r == region])
        for region, store in state.stores.regions.items()
    }
    seen: dict[tuple[str, str], Arrival | Excluded] = {}  # by (region, key): a key may be in two buckets
    bodies: dict[str, str] = {}  # body_sha256 → key of the deltas seen this round, in the order looked at

    def look(last: bool = False) -> None:
        """Inspect what is new; on the last look, only keys outside the learners' folders (a
        learner's delta that lands now is left for the next round). A delta the store did not
        serve is looked at again next time."""
        listed_at = time.time()
        new = [
            (region, key, size)
            for region, watch in watches.items()
            for key, size in sorted(watch.look(everything=last).items())
            if (region, key) not in consumed and (region, key) not in seen and not (last and watch.owned(key))
        ]
        for (region, key, _), found in zip(new, inspect_all(state, new)):
            if found is None:
                log.warning(
                    "%s round %d: %s not read (the store did not answer); again later", state.run, state.round, key
                )
                continue
            seen[region, key] = found = first_with_its_tensors(found, bodies)
            if isinstance(found, Arrival):
                found.seen_at = listed_at
            if isinstance(found, Excluded):
                log.warning("%s round %d: quarantined %s: %s", state.run, state.round, key, found.reason)

    down: dict[str, str] = {}

    def known_down(fresh: dict[str, float]) -> dict[str, str]:
        """Learners their driver recorded down (islands.storage.liveness): the round waits for
        them no more. A delta of theirs already in still counts."""
        now_down = {k: v for k, v in liveness.down(state.stores.global_, state.run).items() if k not in fresh}
        for learner in sorted(now_down.keys() - down.keys()):
            log.warning(
                "%s round %d: not waiting for learner %s: down (%s)", state.run, state.round, learner, now_down[learner]
            )
        down.clear()
        down.update(now_down)
        return now_down

    started, looks = time.time(), 0
    while True:
        look()
        looks += 1
        arrivals = [a for a in seen.values() if isinstance(a, Arrival)]
        fresh = quorum_arrivals(((a.learner, a.base_round, a.seen_at) for a in arrivals), state.round - 1)
        current = dict(history)
        for a in sorted(arrivals, key=lambda a: a.finished_at):
            if a.learner in current:
                current[a.learner] = current[a.learner].seen(a.finished_at, a.seconds)
        alive = [name for name in learners if name not in known_down(fresh)]
        now = time.time()
        decision = decide(cfg.quorum, started, now, fresh, alive, current, listing_s=cfg.quorum.poll_s)
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
