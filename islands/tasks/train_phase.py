"""A learner's unit of work: one phase of H inner steps from a published round, ending in a delta.

`LearnerSession` holds what lives across phases in the learner's process (model, inner AdamW,
data cursor) and knows how to restore it from the learner's newest saved state,
so a restarted learner continues where it stopped. `train_phase` is the Prefect task: one task
run per phase.

The way down: a learner holding θ_h rebuilds θ_r from the updates of rounds h+1…r while they
are together smaller than the checkpoint, and checks the result against the manifest's model
hash; one further behind, or just restarted, reads the checkpoint. Both come through the region's
cache (storage.cache).

Carry: a phase starts from the learner's own weights, not from the bare θ_r. Its deltas that the
newest round has not merged yet are still in those weights, and they are kept there when a newer
round arrives (`reference`), until a round that consumed them replaces them. Without it, every
phase that starts before the previous one is merged retrains, from θ_r, steps the outer step is
about to apply anyway, and the outer momentum applies that direction twice.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import math
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from islands.core.compress import RESIDUAL_PREFIX, compress_with_feedback, split_residual
from islands.core.config import RunConfig
from islands.core.inner import InnerTrainer, carried
from islands.core.model import build_model, own_params
from islands.core.pace import phase_steps
from islands.core.validate import short
from islands.storage import layout
from islands.storage.cache import regional_spool
from islands.storage.codec import (
    TensorFile,
    TensorFileWriter,
    encode_state_object,
    restamped,
    restamped_object,
)
from islands.storage.encoded import EncodedObject
from islands.storage.lease import Watch
from islands.storage.manifest import Manifest, ObjectRef
from islands.storage.model_files import local_model
from islands.storage.rounds import checkpoint_metadata, newest_round_from, read_manifest, stop_requested
from islands.storage.spool import OwnedFolder, remove_dead, spool
from islands.storage.store import IntegrityError, ObjectMissing, ObjectStore, StoreError, Stores, sha256_hex
from islands.tasks.crash import crash_point
from islands.tasks.ddp_phase import PhaseJob, learner_trainer
from islands.tasks.follow import Held, RoundFollower
from islands.tasks.write_behind import WriteBehind

STOP_CHECK_S = 2.0
CARRY_LIMIT = 8  # unmerged deltas a learner carries at most (each a model's size on local disk)
log = logging.getLogger(__name__)


def phase_after(states: Iterable[int], deltas: Iterable[int]) -> int:
    """The phase a restored learner trains next: the one after its newest saved state, past any
    delta already under that number (written before its state, by a crash between the two). Not
    after its newest delta: whoever holds the learner's keys could write one under any number,
    and the learner would jump there, up to numbers its keys cannot spell."""
    taken, phase = set(deltas), max(states, default=-1) + 1
    while phase in taken:
        phase += 1
    return phase


def holds(store: ObjectStore, key: str, data: bytes | EncodedObject) -> bool:
    """Whether `key` holds exactly `data` (a retried write of the same bytes); an object of
    another size is not read."""
    size, sha256 = (len(data), sha256_hex(data)) if isinstance(data, bytes) else (data.size, data.sha256)
    if store.size(key) != size:
        return False
    digest = hashlib.sha256()
    for chunk in store.get_chunks(key, max_bytes=size):
        digest.update(chunk)
    return digest.hexdigest() == sha256


def restamp(data: bytes | EncodedObject, **metadata: str) -> bytes | EncodedObject:
    return restamped(data, **metadata) if isinstance(data, bytes) else restamped_object(data, **metadata)


def scratch_folder(run: str, learner: str) -> OwnedFolder:
    """A local folder for this process's files (deltas and states on their way up, carried
    deltas, objects read). The learner flow removes it when it ends (a flow run's process may
    leave without running exit handlers), the interpreter at exit otherwise; those of this
    learner's processes that were killed are removed first."""
    prefix = f"islands-learner-{run}-{learner}-"
    remove_dead(prefix)
    folder = OwnedFolder(prefix)
    atexit.register(folder.remove)
    return folder


class Spilled(Mapping):
    """A delta kept on local disk, one file per tensor, read back one tensor at a time: a carried
    delta costs no memory between phases, and a phase's base made from θ_r and it (Carried) holds
    one of its tensors at a time. Its files go when the last reference to it does (a phase's base
    may still read a delta the learner has stopped carrying)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir()
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], Path]] = {}
        weakref.finalize(self, shutil.rmtree, folder, True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        path = self.folder / str(len(self._entries))
        t = tensor.detach().cpu().contiguous()
        with open(path, "wb") as fh:
            fh.write(t.reshape(-1).view(torch.uint8).numpy())
        self._entries[name] = (t.dtype, tuple(t.shape), path)

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, path = self._entries[name]
        return torch.from_file(str(path), shared=False, size=math.prod(shape), dtype=dtype).reshape(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class HeldRound:
    """A round as a learner holds it: θ_r, and which of this learner's phases rounds ≤ r consumed."""

    params: dict[str, torch.Tensor]
    consumed: frozenset[int] = frozenset()
    tokens_applied: int = 0  # the run's progress at round r (Manifest.tokens_applied)
    rates: dict[str, float] = field(default_factory=dict)  # learner → tokens/s of its newest merged phase


@dataclass(frozen=True)
class Way:
    """How a learner came by a round: the round it held already, made from the run's seed (round
    0), rebuilt from `updates` updates onto the round it held, or read as the checkpoint, with the
    reason when the updates were tried first and failed (`fallback`)."""

    source: Literal["held", "seed", "updates", "checkpoint"]
    updates: int = 0
    fallback: str | None = None


@dataclass
class LearnerSession:
    config: RunConfig
    run: str
    learner: str
    region: str
    stores: Stores
    trainer: InnerTrainer | PhaseJob
    next_phase: int = 0
    last_base: int | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    watch: Watch | None = None  # the driver's lease; None: follow no driver
    crash: str | None = None  # crash point armed in this learner (tasks.crash)
    halt: str | None = None  # why the learner stops before the run ends
    stop_asked: bool = False  # the run asked its learners to stop (seen in storage)
    stop_checked_at: float = -math.inf  # when must_stop last asked storage (time.monotonic)
    residual: Mapping[str, torch.Tensor] = field(
        default_factory=dict
    )  # codec error feedback (Spilled), saved with the state
    # Phase p's writes overlap phase p+1's training; phase p+1's wait for them (one phase on its way up).
    uploads: WriteBehind = field(default_factory=lambda: WriteBehind(limit=1))
    rounds: RoundFollower | None = None  # the published rounds, fetched in the background (follow())
    unmerged: dict[int, Mapping[str, torch.Tensor]] = field(default_factory=dict)  # phase → delta no round holds yet
    rate: float | None = None  # tokens/s of this learner's last phase (islands.core.pace)
    written: int = -1  # the highest phase number this process wrote a delta under
    placed: dict[int, int] = field(default_factory=dict)  # phase → the number its delta went under, once written
    placing: threading.Lock = field(default_factory=threading.Lock, repr=False)  # `placed`: uploads write, phases read
    _scratch: OwnedFolder | None = (
        None  # local folder for this process's files (scratch_folder), made when first needed
    )
    _scratch_made: threading.Lock = field(default_factory=threading.Lock, repr=False)  # the follower asks too

    @property
    def scratch(self) -> Path:
        with self._scratch_made:
            if self._scratch is None:
                self._scratch = scratch_folder(self.run, self.learner)
            return self._scratch.path

    def remove_scratch(self) -> None:
        with self._scratch_made:
            if self._scratch is not None:
                self._scratch.remove()
                self._scratch = None

    @property
    def global_store(self) -> ObjectStore:
        return self.stores.global_

    @property
    def regional_store(self) -> ObjectStore:
        return self.stores.region(self.region)

    @classmethod
    def open(cls, config: RunConfig, run: str, learner: str, stores: Stores) -> LearnerSession:
        """Build the learner from the run's config and restore its newest saved state, if any."""
        torch.set_num_threads(config.threads_per_learner())
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # Several GPUs: each phase is a torchrun job; the learner's process keeps its state between them.
        # Either refuses a learner that is not part of the run.
        trainer = (
            learner_trainer(config, learner, device) if config.gpus_per_learner == 1 else PhaseJob(config, learner)
        )
        region = next(r for name, r, _ in config.learners() if name == learner)
        session = cls(config, run, learner, region, stores, trainer, device=device)
        session.restore()
        return session

    def restore(self) -> None:
        """Continue after the newest phase this learner finished (its state and delta are in S3).

        Its newest state that reads as its own: an object under its state keys that does not
        (other bytes, other tensors, metadata naming another phase) is passed over with a
        warning, never a failure, and never moves its count: whoever holds its keys may have
        written it, under any number. Only a store that does not answer stops the restore."""
        store = self.regional_store
        states = {
            p: k
            for k in store.list(layout.learner_state_prefix(self.run, self.learner))
            if (p := layout.parse_state_key(k)) is not None
        }
        deltas = [
            parsed[1]
            for k in store.list(layout.learner_deltas_prefix(self.run, self.learner))
            if (parsed := layout.parse_delta_key(k)) and parsed[0] == self.learner
        ]
        restored: list[int] = []
        for number in sorted(states, reverse=True):
            try:
                self.load_state(states[number], number)
            except StoreError as exc:
                if not isinstance(exc, ObjectMissing | IntegrityError):
                    raise
                reason = str(exc)
            except Exception as exc:  # noqa: BLE001 - whatever its bytes provoke, the learner goes on
                reason = f"{type(exc).__name__}: {exc}"
            else:
                restored = [number]
                break
            log.warning(
                "%s learner %s: %s is not a state this learner saved, passed over: %s",
                self.run,
                self.learner,
                states[number],
                short(reason),
            )
        self.next_phase = phase_after(restored, deltas)

    def load_state(self, key: str, number: int) -> None:
        """Load the saved state at `key`, phase `number`; raises if it is not one."""
        # Spooled to local disk and read tensor by tensor: the state (twice the model) is
        # never in memory as bytes beside its tensors, and the tensors read become the
        # optimizer's own.
        with tempfile.TemporaryDirectory(prefix="restore-", dir=self.scratch) as tmp:
            spooled = spool(self.regional_store, key, Path(tmp) / "state")
            saved = TensorFile(spooled.path, spooled.body_sha256)
            if saved.metadata.get("phase") != str(number):
                raise ValueError(f"its metadata names another phase than {number}")
            tensors = {name: saved.stored(name) for name in saved.names}
        trainer_state, residual = split_residual(tensors)
        del tensors
        self.trainer.load_state_dict(trainer_state, own=True)
        self.residual = residual

    def collect_old_states(self, newest: int) -> None:
        """Garbage-collect saved states older than the one before `newest` (only those are read)."""
        store = self.regional_store
        for key in store.list(layout.learner_state_prefix(self.run, self.learner)):
            p = layout.parse_state_key(key)
            if p is not None and p < newest - 1:
                store.delete(key)

    def base(self, round_: int, held: Held | None = None) -> tuple[HeldRound, Way]:
        """Round `round_` the cheapest way given the round already `held`, and which way that was."""
        if held is not None and held[0] == round_:
            return held[1], Way("held")
        behind = held is not None and held[0] < round_
        first = held[0] + 1 if behind else round_
        manifests = [read_manifest(self.global_store, self.run, r)[0] for r in range(first, round_ + 1)]
        consumed = (held[1].consumed if behind else frozenset()) | {
            item.phase for m in manifests for item in [*m.contributions, *m.excluded] if item.learner == self.learner
        }
        rates = dict(held[1].rates) if behind else {}
        rates.update({c.learner: c.tokens / c.seconds for m in manifests for c in m.contributions if c.seconds > 0})
        params, way = None, Way("checkpoint")
        if round_ == 0:
            params = self.seeded(manifests[-1])
            if params is not None:  # a warm start's round 0 is read
                way = Way("seed")
        updates = [m.update for m in manifests]
        if behind and all(updates) and sum(u.bytes for u in updates) < manifests[-1].model.bytes:
            params = self.rebuilt(manifests, held[1].params)
            way = (
                Way("updates", len(updates))
                if params is not None
                else Way("checkpoint", fallback="the updates did not rebuild the published model")
            )
        if params is None:
            params = self.fetch_state(manifests[-1].model)
        return HeldRound(params, frozenset(consumed), manifests[-1].tokens_applied, rates), way

    def seeded(self, manifest: Manifest) -> dict[str, torch.Tensor] | None:
        """Round 0 made from the run's seed, if it encodes to the very bytes its manifest names (a
        warm-started run's does not): a region downloads no model it can make itself."""
        params = own_params(build_model(local_model(self.config.model), self.config.seed))
        encoded = encode_state_object(params, checkpoint_metadata(self.run, 0))  # hashed where it lies
        return params if encoded.sha256 == manifest.model.sha256 else None

    def rebuilt(self, manifests: list[Manifest], held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """θ_h + the updates of rounds h+1…r in turn, if that encodes to the very bytes round r's
        manifest names (each round's model is its parent plus its update, so the last hash checks all).

        Each update is spooled to local disk and applied a tensor at a time, as `apply_update`
        applies it (θ + decoded, in float32): the round held is never copied whole beside the
        update's bytes and its decoded tensors, only θ_r is made; a second update adds in place."""
        params = held
        for manifest in manifests:
            with tempfile.TemporaryDirectory(prefix="update-", dir=self.scratch) as tmp:
                got = regional_spool(
                    self.regional_store, self.global_store, self.run, manifest.update, self.learner, Path(tmp) / "u"
                )
                update = TensorFile(got.path, got.body_sha256)
                if params is held:
                    params = {name: p.add(update.decoded(name)) for name, p in params.items()}
                else:
                    for name, p in params.items():
                        p.add_(update.decoded(name))
        encoded = encode_state_object(params, checkpoint_metadata(self.run, manifests[-1].round))
        return params if encoded.sha256 == manifests[-1].model.sha256 else None

    def fetch_state(self, ref: ObjectRef) -> dict[str, torch.Tensor]:
        """A checkpoint through the region's cache (each crosses regions once per region), spooled
        to local disk and read tensor by tensor: its bytes are never in memory beside its tensors
        (the follower fetches while the phase trains and the round before is still held)."""
        with tempfile.TemporaryDirectory(prefix="round-", dir=self.scratch) as tmp:
            got = regional_spool(
                self.regional_store, self.global_store, self.run, ref, self.learner, Path(tmp) / "object"
            )
            saved = TensorFile(got.path, got.body_sha256)
            return {name: saved.stored(name) for name in saved.names}

    def follow(self, poll_s: float) -> RoundFollower:
        """Start following the published rounds (raises when the run has none)."""
        self.rounds = RoundFollower(
            lambda held: newest_round_from(self.global_store, self.run, held), self.fetch_round, poll_s
        )
        return self.rounds.start(self.run)

    def fetch_round(self, round_: int, held: Held | None) -> HeldRound:
        """Round `round_` for the follower thread, saying when the updates could not be used."""
        published, way = self.base(round_, held)
        if way.fallback is not None:
            log.warning("%s learner %s: round %d from the checkpoint: %s", self.run, self.learner, round_, way.fallback)
        return published

    def reference(self, held: Held) -> Mapping[str, torch.Tensor]:
        """The point this learner's steps count from on the held round: θ_r, or with `carry`, θ_r
        plus its own progress that round r has not merged yet (so its weights keep it). A phase
        counts as merged by the number its delta was written under; one not written yet is not."""
        with self.placing:
            self.unmerged = {q: d for q, d in self.unmerged.items() if self.placed.get(q) not in held[1].consumed}
            self.placed = {q: n for q, n in self.placed.items() if q in self.unmerged}
        return carried(held[1].params, list(self.unmerged.values()))

    def phase_from(self, phase: int) -> int:
        """The number a phase that was to be `phase` takes: past every number this process's
        uploads have written under (they skip numbers they find taken)."""
        return max(phase, self.written + 1)

    def place_delta(self, phase: int, delta: bytes | EncodedObject, round_: int, logger) -> int:
        """Write `phase`'s delta under the first number from `phase_from(phase)` on that is free,
        and return that number. A number whose delta key holds an object this learner did not
        write (its keys in other hands, a careless operator), or whose state key holds anything
        (the learner writes its state there after its delta), is skipped with a warning, never a
        failure: the delta goes under the next number, its metadata naming that one (`restamped`)."""
        store = self.regional_store
        number = self.phase_from(phase)
        while True:
            key = layout.delta_key(self.run, self.learner, number)
            data = delta if number == phase else restamp(delta, phase=str(number))
            state_key = layout.learner_state_key(self.run, self.learner, number)
            if store.exists(state_key):
                key = state_key
            elif store.put_if_absent(key, data) or holds(store, key, data):
                break
            logger.warning(
                "%s round %d: learner %s (%s): %s holds an object this learner did not write; "
                "its delta goes under phase %d instead",
                self.run,
                round_,
                self.learner,
                self.region,
                key,
                number + 1,
            )
            number += 1
        with self.placing:
            self.placed[phase] = self.written = number
        return number

    def rebase_offer(self, moves: list[int]):
        """For run_phase: a round newer than moves[-1] (and still part of the run), once; each
        round offered is appended to `moves`."""
        if not self.config.rebase:
            return None

        def offer() -> Mapping[str, torch.Tensor] | None:
            held = self.rounds.held()
            if moves[-1] < held[0] < self.config.rounds:
                moves.append(held[0])
                return self.reference(held)
            return None

        return offer

    def must_stop(self) -> bool:
        """The run asked learners to stop, or this learner's driver is gone or replaced.

        Storage is asked at most every STOP_CHECK_S seconds (two requests each time): the phase
        loop asks before every step and the learner before every phase, on its training thread.
        A stop, once seen, stays."""
        now = time.monotonic()
        if self.halt is None and not self.stop_asked and now - self.stop_checked_at >= STOP_CHECK_S:
            self.stop_checked_at = now
            if self.watch is not None:
                self.halt = self.watch.verdict()
            self.stop_asked = self.halt is None and stop_requested(self.global_store, self.run)
        return self.halt is not None or self.stop_asked

    def superseded(self) -> bool:
        """Asked right before writing: has a newer driver launched its own learner in this one's place?"""
        if self.watch is None:
            return False
        self.halt = self.watch.verdict() or self.halt
        return self.watch.superseded

    def io_totals(self) -> dict[str, int]:
        """Bytes this process moved so far; global reads alone are what crossed regions downwards."""
        g, r = self.global_store.io, self.regional_store.io
        return {
            "io_read": g.bytes_read + r.bytes_read,
            "io_read_global": g.bytes_read,
            "io_written": g.bytes_written + r.bytes_written,
        }


@task(name="train-phase", cache_policy=NO_CACHE, task_run_name="{session.learner}/phase-{phase}")
def train_phase(session: LearnerSession, phase: int) -> dict:
    """Train H steps from the newest round held, folding in rounds published meanwhile, then
    hand the delta and the learner's state to the uploads."""
    log = get_run_logger()
    cfg = session.config
    held = session.rounds.held()
    start_round = held[0]
    moves = [start_round]  # the rounds the phase trained on, in turn
    if cfg.lr_catch_up:
        session.trainer.catch_up(held[1].tokens_applied, cfg.num_learners)
    steps = phase_steps(cfg.inner_steps, session.rate, list(held[1].rates.values())) if cfg.paced else cfg.inner_steps
    # The phase holds its base alone: the round held, or that round with the carried deltas read
    # from local disk a tensor at a time (Carried), never a copy of a model's size beside it.
    base = [session.reference(held)]
    del held
    result = session.trainer.run_phase(
        base.pop(),
        steps,
        slowdown=cfg.slowdown(session.region),
        min_step_s=cfg.min_step_s.get(session.region, 0.0),
        should_stop=session.must_stop,
        rebase=session.rebase_offer(moves),
    )
    base_round = session.last_base = moves[-1]
    phase = session.phase_from(phase)
    if result.seconds > 0:
        session.rate = result.tokens / result.seconds
    if result.steps == 0:
        log.info(
            "%s learner %s (%s): stopped before phase %d began", session.run, session.learner, session.region, phase
        )
        return {"phase": phase, "steps": 0}
    store = session.regional_store
    meta = {
        "run": session.run,
        "learner": session.learner,
        "region": session.region,
        "phase": phase,
        "base_round": base_round,
        "start_round": start_round,
        "rebases": ",".join(f"{step}:{r}" for step, r in zip(result.rebased_at, moves[1:])),
        "inner_steps": result.steps,
        "tokens": result.tokens,
        "loss": f"{result.loss:.6f}",
        "seconds": f"{result.seconds:.3f}",
        "finished_at": f"{time.time():.3f}",
        **session.io_totals(),
    }
    folder = Path(tempfile.mkdtemp(prefix=f"phase-{phase:06d}-", dir=session.scratch))
    try:
        delta, residual, kept = encode_delta(session, result, meta, folder)
        # Encoded now, before the next phase moves the optimizer on; uploaded while it trains.
        state = encode_learner_state(session, residual, {"phase": str(phase), "base_round": str(base_round)}, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise

    def upload() -> None:
        try:
            if session.superseded():
                # A newer driver's learner owns this learner's phases now; it re-does this data.
                log.warning(
                    "%s learner %s: phase %d not written: %s", session.run, session.learner, phase, session.halt
                )
                return
            crash_point("phase.before_delta", phase, session.crash)
            number = session.place_delta(phase, delta, base_round, log)
            crash_point("phase.after_delta", phase, session.crash)
            # The delta first: a crash before the state is saved re-trains from the older state, it
            # never loses a finished delta. The state goes under the delta's number.
            saved = state if number == phase else restamped_object(state, phase=str(number))
            state_key = layout.learner_state_key(session.run, session.learner, number)
            if not (store.put_if_absent(state_key, saved) or holds(store, state_key, saved)):
                # Taken since place_delta looked: the older state stays the newest, and a
                # restart retrains this phase's data from it, past this number.
                log.warning(
                    "%s learner %s: %s holds an object this learner did not write; phase %d's state not saved",
                    session.run,
                    session.learner,
                    state_key,
                    number,
                )
                return
            crash_point("phase.after_state", phase, session.crash)
            session.collect_old_states(number)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    session.uploads.submit(upload)
    if kept is not None:
        session.unmerged[phase] = kept
        if len(session.unmerged) > CARRY_LIMIT:  # no round for many phases: bound the disk, not the run
            oldest = min(session.unmerged)
            del session.unmerged[oldest]
            log.warning(
                "%s learner %s: %d phases without a round that merged them; phase %d no longer carried",
                session.run,
                session.learner,
                CARRY_LIMIT + 1,
                oldest,
            )
    session.residual = residual
    session.next_phase = phase + 1
    log.info(
        "%s learner %s (%s) phase %d on round %d%s: %d steps%s%s, loss %.3f, %d tokens, %.1f s, delta %.2f MB",
        session.run,
        session.learner,
        session.region,
        phase,
        base_round,
        f" (from round {start_round})" if start_round != base_round else "",
        result.steps,
        f" (paced: H is {cfg.inner_steps})" if steps < cfg.inner_steps else "",
        f" as a torchrun job of {cfg.gpus_per_learner} processes ({cfg.parallel})" if cfg.gpus_per_learner > 1 else "",
        result.loss,
        result.tokens,
        result.seconds,
        delta.size / 1e6,
    )
    return {
        "phase": phase,
        "steps": result.steps,
        "tokens": result.tokens,
        "loss": result.loss,
        "seconds": result.seconds,
    }


def encode_delta(
    session: LearnerSession, result, meta: dict, folder: Path
) -> tuple[EncodedObject, Spilled, Spilled | None]:
    """The phase's delta as an object on local disk, tensor by tensor: (the object, the new
    error-feedback residual on disk, the delta kept for `carry` on disk, or None). Error feedback: what
    the codec drops now rides along with the next delta. Each tensor of the delta is let go once
    it is written, so the delta, its wire form and the carried copy are never whole in memory
    beside each other."""
    codec = session.config.codec
    pending = dict(result.delta)
    result.delta = {}
    # The residual is a model's size with an integer codec: it waits for the next phase on disk.
    residual = Spilled(session.scratch / f"residual-{folder.name}")
    kept = Spilled(session.scratch / f"carried-{folder.name}") if session.config.carry else None
    with TensorFileWriter(folder / "delta") as writer:
        for name in list(pending):
            tensor = pending.pop(name)
            old = {name: session.residual[name]} if name in session.residual else {}
            wire, _, new = compress_with_feedback({name: tensor}, old, codec, session.config.topk)
            for part, value in wire.items():
                writer.add(part, value)
            for part, value in new.items():
                residual.add(part, value)
            if kept is not None:
                kept.add(name, tensor)
        delta = writer.finish({**{k: str(v) for k, v in meta.items()}, "codec": codec})
    return delta, residual, kept


def encode_learner_state(
    session: LearnerSession, residual: Mapping[str, torch.Tensor], metadata: dict[str, str], folder: Path
) -> EncodedObject:
    """The learner's state (`state_dict()` and the residual) as an object on local disk, each
    tensor copied off the trainer and written before the next is asked for."""
    trainer = session.trainer
    items = trainer.state_items() if hasattr(trainer, "state_items") else iter(trainer.state_dict().items())
    with TensorFileWriter(folder / "state") as writer:
        for name, tensor in items:
            writer.add(name, tensor)
        for name, tensor in residual.items():
            writer.add(RESIDUAL_PREFIX + name, tensor.contiguous())
        return writer.finish(metadata)
