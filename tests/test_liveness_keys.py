"""No key in a learner's folder stalls a run: the collector's view of each folder follows the
learner's own phase numbers, whatever else is written there; the same tensors are merged once,
under whatever phase number they come back; and a learner that finds its next key taken writes
under the next free one. On `file://` stores (and moto's S3 for the listings), no Prefect."""

from __future__ import annotations

import logging

import pytest
import torch
from prefect.logging import disable_run_logger

from islands.core.config import RunConfig
from islands.flows.training_run import create_run
from islands.ops.status import newest_delta
from islands.storage import layout
from islands.storage.codec import body_sha256, decode, encode, read_header, restamped
from islands.storage.manifest import Contribution
from islands.storage.rounds import get_tensors, read_manifest
from islands.storage.store import ObjectStore, Stores
from islands.tasks import collect as collect_module
from islands.tasks import train_phase as train_phase_module
from islands.tasks.collect import Arrival, DeltaWatch, collect, inspect
from islands.tasks.round_state import RoundState
from islands.tasks.train_phase import HeldRound, LearnerSession, train_phase

RUN = "keys"


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return ObjectStore(f"file://{tmp_path / 'bucket'}")
    return ObjectStore(f"s3://{request.getfixturevalue('s3_bucket')}")


def key(phase: int, learner: str = "north-0") -> str:
    return layout.delta_key(RUN, learner, phase)


def put(store: ObjectStore, *keys: str, data: bytes = b"d") -> None:
    for k in keys:
        assert store.put_if_absent(k, data)


# -- the collector's view of a learner's folder ---------------------------------------------------


def test_a_planted_key_far_ahead_does_not_hide_a_learners_next_deltas(store):
    put(store, key(0), key(1))
    watch = DeltaWatch(store, RUN, ["north-0"])
    watch.look()
    put(store, key(999), data=b"x")  # one byte, quarantined once read
    assert set(watch.look()) == {key(999)}
    for phase in (2, 3):
        put(store, key(phase))
        assert key(phase) in watch.look()
    assert watch.floor == {"north-0": 3}  # the planted key moved nothing


def test_a_key_that_sorts_last_as_text_does_not_hide_a_learners_next_deltas(store):
    """A seven-digit key sorts after every six-digit key of a phase below 100,000."""
    put(store, key(0), key(1), key(2))
    watch = DeltaWatch(store, RUN, ["north-0"])
    watch.look()
    put(store, key(1_000_000), data=b"x")
    watch.look()
    put(store, key(3))
    assert key(3) in watch.look()


def test_a_quarantined_key_does_not_advance_the_view(store):
    """Keys the first look finds far ahead of a learner's run of phases stay ahead of its floor,
    however they are judged; one at its very next number is passed, since the learner skips it."""
    put(store, key(0), key(1), key(500), key(999_999))
    put(store, key(2), data=b"x")  # junk at the learner's next number: it writes 3 instead
    watch = DeltaWatch(store, RUN, ["north-0"])
    watch.look()
    put(store, key(3))
    assert key(3) in watch.look()
    assert watch.floor == {"north-0": 3}


def test_past_phase_999999_the_next_numbers_are_found_though_they_sort_first(store):
    put(store, key(0))
    watch = DeltaWatch(store, RUN, ["north-0"])
    watch.look()
    watch.floor = {"north-0": 999_999}  # a learner a million phases in (too many keys to write here)
    put(store, key(999_999), key(1_000_000), key(1_000_001))
    lists = store.io.lists
    assert set(watch.look()) == {key(1_000_000), key(1_000_001)}
    assert store.io.lists == lists  # asked by number: no listing whose text order would hide them
    assert watch.floor == {"north-0": 1_000_001}
    put(store, key(1_000_002))
    assert set(watch.look()) == {key(1_000_002)}


# -- a round's collection on a file:// run ------------------------------------------------------


def new_run(tmp_path, run: str = RUN, **quorum) -> tuple[RunConfig, Stores]:
    config = RunConfig(
        run_id=run,
        regions=["north", "south"],
        learners_per_region=1,
        rounds=3,
        inner_steps=5,
        speed={},
        eval_batches=2,
        eval_every=0,
        quorum={"min_quorum": 2, "grace_max_s": 0.0, "round_timeout_s": 5.0, "poll_s": 0.05, **quorum},
    )
    stores = Stores(f"file://{tmp_path}/store/{{bucket}}", config.regions)
    create_run(config, stores)
    return config, stores


def honest(config: RunConfig, stores: Stores, learner: str, phase: int, seed: int, base_round: int = 0) -> bytes:
    model = get_tensors(stores.global_, read_manifest(stores.global_, config.run_id, 0)[0].model)
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in model.items()}
    region = learner.rsplit("-", 1)[0]
    meta = {
        "run": config.run_id,
        "learner": learner,
        "region": region,
        "phase": str(phase),
        "base_round": str(base_round),
        "inner_steps": "5",
        "tokens": "100",
        "loss": "3.5",
        "seconds": "1.0",
        "finished_at": "1700000000.000",
    }
    return encode(tensors, meta)


def collected(config: RunConfig, stores: Stores):
    state = RoundState.load(config, config.run_id, stores)
    with disable_run_logger():
        try:
            return collect.fn(state)
        finally:
            state.drop_spool()


def test_a_planted_key_does_not_keep_a_collection_from_a_learners_fresh_delta(tmp_path, monkeypatch):
    """north-0's delta lands after the first look, behind a one-byte object at its phase 999: the
    round sees it and closes with everyone in, not by its timeout."""
    config, stores = new_run(tmp_path)
    north, south = stores.region("north"), stores.region("south")
    planted = layout.delta_key(RUN, "north-0", 999)
    put(north, planted, data=b"x")
    put(south, layout.delta_key(RUN, "south-0", 0), data=honest(config, stores, "south-0", 0, seed=1))
    fresh = layout.delta_key(RUN, "north-0", 0)
    data = honest(config, stores, "north-0", 0, seed=0)
    look = DeltaWatch.look

    def look_then_land(watch: DeltaWatch, everything: bool = False) -> dict[str, int]:
        found = look(watch, everything)
        if watch.store is north and not north.exists(fresh):
            put(north, fresh, data=data)
        return found

    monkeypatch.setattr(collect_module.DeltaWatch, "look", look_then_land)
    got = collected(config, stores)
    assert {a.key for a in got.arrivals} == {fresh, layout.delta_key(RUN, "south-0", 0)}
    assert [e.key for e in got.quarantined] == [planted]
    assert got.decision.reason == "all-in"


def test_the_same_tensors_under_another_phase_in_one_round_are_merged_once(tmp_path):
    config, stores = new_run(tmp_path)
    first = honest(config, stores, "north-0", 0, seed=0)
    put(stores.region("north"), layout.delta_key(RUN, "north-0", 0), data=first)
    put(stores.region("north"), layout.delta_key(RUN, "north-0", 1), data=restamped(first, phase="1"))
    put(stores.region("south"), layout.delta_key(RUN, "south-0", 0), data=honest(config, stores, "south-0", 0, seed=1))
    got = collected(config, stores)
    assert {a.key for a in got.arrivals} == {layout.delta_key(RUN, n, 0) for n in ("north-0", "south-0")}
    (dup,) = got.quarantined
    assert dup.key == layout.delta_key(RUN, "north-0", 1)
    assert dup.reason == f"same tensors as {layout.delta_key(RUN, 'north-0', 0)}"
    assert dup.body_sha256 == body_sha256(first) and dup.tokens == 100


def test_tensors_a_round_consumed_come_back_under_a_new_phase_as_a_duplicate(tmp_path):
    """Round 1 merged north-0's phase 0 (as its manifest records it); the same tensors under
    phase 1, with metadata fit for round 2, are quarantined in round 2, not merged again; so are
    the tensors of a delta round 1 quarantined."""
    config, stores = new_run(tmp_path)
    north = stores.region("north")
    first = honest(config, stores, "north-0", 0, seed=0)
    put(north, layout.delta_key(RUN, "north-0", 0), data=first)
    state = RoundState.load(config, RUN, stores)
    merged = inspect(state, "north", layout.delta_key(RUN, "north-0", 0), len(first))
    assert isinstance(merged, Arrival)
    bad = honest(config, stores, "north-0", 2, seed=5)
    refused = merged.excluded("quarantined", "far outside the round's median").model_copy(
        update={"key": layout.delta_key(RUN, "north-0", 2), "body_sha256": body_sha256(bad)}
    )
    fields = ("learner", "region", "phase", "base_round", "tokens", "loss", "bytes", "key", "sha256", "body_sha256")
    contribution = Contribution(
        **{k: getattr(merged, k) for k in fields},
        staleness=0,
        tokens_counted=merged.tokens,
        weight=1.0,
        finished_at=merged.finished_at,
        seconds=merged.seconds,
        seen_at=merged.finished_at,
    )
    state.drop_spool()
    round1 = state.parent[0].model_copy(
        update={"round": 1, "parent_round": 0, "contributions": [contribution], "excluded": [refused]}
    )
    state = RoundState(config, RUN, 2, stores, [*state.chain, (round1, "0" * 64)], state.model, state.momentum)
    again = restamped(first, phase="1", base_round="1")
    put(north, layout.delta_key(RUN, "north-0", 1), data=again)
    put(north, layout.delta_key(RUN, "north-0", 3), data=restamped(bad, phase="3", base_round="1"))
    for phase, dup_of in ((1, 0), (3, 2)):
        found = inspect(state, "north", layout.delta_key(RUN, "north-0", phase), north.size(key(phase, "north-0")))
        assert found.kind == "quarantined", found
        assert found.reason == f"same tensors as {layout.delta_key(RUN, 'north-0', dup_of)}, already consumed"
    state.drop_spool()


def test_a_restamped_object_is_the_one_its_tensors_encode_to_with_that_metadata(tmp_path):
    config, stores = new_run(tmp_path)
    data = honest(config, stores, "north-0", 0, seed=0)
    tensors, meta = decode(data)
    meta = {k: v for k, v in meta.items() if k not in ("body_sha256", "codec")}
    assert restamped(data, phase="7") == encode(tensors, {**meta, "phase": "7"})
    assert read_header(restamped(data, phase="7"))[1]["phase"] == "7"


# -- the learner's side --------------------------------------------------------------------------


def test_a_planted_object_at_a_learners_next_key_makes_it_write_under_the_next_free_phase(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(train_phase_module, "get_run_logger", lambda: logging.getLogger("test.learner"))
    config, stores = new_run(tmp_path)
    north = stores.region("north")
    session = LearnerSession.open(config, RUN, "north-0", stores)
    assert session.next_phase == 0
    planted = layout.delta_key(RUN, "north-0", 0)
    put(north, planted, data=b"x")
    session.follow(poll_s=0.05)
    try:
        with caplog.at_level(logging.WARNING):
            train_phase.fn(session, session.next_phase)
            session.uploads.flush()
            train_phase.fn(session, session.next_phase)
            session.uploads.flush()
    finally:
        session.rounds.close()
        session.uploads.close()
    assert north.get(planted) == b"x"
    listed = north.list(layout.learner_deltas_prefix(RUN, "north-0"))
    assert sorted(listed) == [layout.delta_key(RUN, "north-0", p) for p in (0, 1, 2)]
    for phase in (1, 2):
        meta = read_header(north.get(layout.delta_key(RUN, "north-0", phase)))[1]
        assert meta["phase"] == str(phase)
        assert north.exists(layout.learner_state_key(RUN, "north-0", phase))
    warned = [r.getMessage() for r in caplog.records if planted in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "round 0: learner north-0 (north)" in warned[0] and "under phase 1 instead" in warned[0]
    assert session.next_phase == 3

    restored = LearnerSession.open(config, RUN, "north-0", stores)
    assert restored.next_phase == 3


def trained(session: LearnerSession, phases: int) -> None:
    """`phases` phases of `session`, each one's uploads done before the next begins."""
    session.follow(poll_s=0.05)
    try:
        for _ in range(phases):
            train_phase.fn(session, session.next_phase)
            session.uploads.flush()
    finally:
        session.rounds.close()
        session.uploads.close()


def state_key(phase: int, learner: str = "north-0") -> str:
    return layout.learner_state_key(RUN, learner, phase)


def test_a_planted_object_at_a_learners_next_state_key_makes_it_write_under_the_next_free_phase(
    tmp_path, caplog, monkeypatch
):
    """The learner writes its state under its delta's number, after the delta: a number whose
    state key is taken is skipped like one whose delta key is, so both go under the next."""
    monkeypatch.setattr(train_phase_module, "get_run_logger", lambda: logging.getLogger("test.learner"))
    config, stores = new_run(tmp_path)
    north = stores.region("north")
    session = LearnerSession.open(config, RUN, "north-0", stores)
    put(north, state_key(0), data=b"x")
    with caplog.at_level(logging.WARNING):
        trained(session, 1)
    assert north.get(state_key(0)) == b"x"
    assert sorted(north.list(layout.learner_deltas_prefix(RUN, "north-0"))) == [key(1)]
    assert read_header(north.get(state_key(1)))[1]["phase"] == "1"
    assert any(state_key(0) in r.getMessage() and "under phase 1 instead" in r.getMessage() for r in caplog.records)


def test_a_state_key_taken_while_the_delta_goes_up_costs_that_state_not_the_learner(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(train_phase_module, "get_run_logger", lambda: logging.getLogger("test.learner"))
    config, stores = new_run(tmp_path)
    north = stores.region("north")
    session = LearnerSession.open(config, RUN, "north-0", stores)
    place = session.place_delta

    def place_then_plant(*args, **kwargs) -> int:
        number = place(*args, **kwargs)
        north.put_if_absent(state_key(number), b"x")  # between the delta and its state
        return number

    monkeypatch.setattr(session, "place_delta", place_then_plant)
    with caplog.at_level(logging.WARNING):
        trained(session, 2)  # the first phase's upload fails no later one
    assert sorted(north.list(layout.learner_deltas_prefix(RUN, "north-0"))) == [key(0), key(1)]
    assert [north.get(state_key(p)) for p in (0, 1)] == [b"x", b"x"]
    assert sum("state not saved" in r.getMessage() for r in caplog.records) == 2
    restored = LearnerSession.open(config, RUN, "north-0", stores)  # no state of its own: from the start
    assert restored.next_phase == 2 and restored.trainer.step == 0


def test_a_restored_learner_passes_over_whatever_is_under_its_state_keys_that_is_not_its_state(tmp_path, caplog):
    """Junk far ahead, a state of its own copied under another number, and bytes that are not a
    state at all: the learner restores its newest own state, goes on after its number, and says
    what it passed over."""
    config, stores = new_run(tmp_path)
    north = stores.region("north")
    session = LearnerSession.open(config, RUN, "north-0", stores)
    with disable_run_logger():
        trained(session, 2)
    steps = session.trainer.step
    own = north.get(state_key(1))
    junk = {
        state_key(999_999): b"x",
        state_key(1_000_000): own,  # its metadata names phase 1
        state_key(5): encode({"w": torch.zeros(2)}, {"phase": "5"}),  # not the trainer's tensors
        state_key(4): own[: len(own) // 2],
    }
    for k, data in junk.items():
        put(north, k, data=data)
    with caplog.at_level(logging.WARNING):
        restored = LearnerSession.open(config, RUN, "north-0", stores)
    assert restored.next_phase == 2
    assert restored.trainer.step == steps > 0
    passed = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert sorted(k for k in junk if any(k in m for m in passed)) == sorted(junk), passed
    assert all("\n" not in m and len(m) < 400 for m in passed)


def test_a_learner_carries_a_moved_phase_until_its_own_number_is_merged(tmp_path):
    """The number a round consumed is the one the delta went under, not the one it was trained as:
    a quarantined object at the phase's first number does not drop the learner's own progress."""
    config, stores = new_run(tmp_path)
    session = LearnerSession.open(config, RUN, "north-0", stores)
    put(stores.region("north"), layout.delta_key(RUN, "north-0", 0), data=b"x")
    data = honest(config, stores, "north-0", 0, seed=0)
    round_ = session.base(0)[0]
    delta = {k: torch.full_like(v, 1e-3) for k, v in round_.params.items()}
    session.unmerged = {0: delta}
    assert session.place_delta(0, data, 0, logging.getLogger("test")) == 1
    session.reference((0, HeldRound(round_.params, frozenset({0}))))  # the junk quarantined
    assert session.unmerged == {0: delta}
    session.reference((1, HeldRound(round_.params, frozenset({0, 1}))))
    assert session.unmerged == {} and session.placed == {}


# -- status ----------------------------------------------------------------------------------------


def test_status_does_not_take_junk_for_a_learners_newest_delta(tmp_path):
    config, stores = new_run(tmp_path)
    north = stores.region("north")
    put(north, layout.delta_key(RUN, "north-0", 0), data=honest(config, stores, "north-0", 0, seed=0))
    put(north, layout.delta_key(RUN, "north-0", 1), data=b"x")
    put(north, layout.delta_key(RUN, "north-0", 999_999), data=honest(config, stores, "north-0", 0, seed=2))
    newest = newest_delta(stores, RUN, "north-0", "north")
    assert newest == {"phase": 0, "finished_at": 1_700_000_000.0, "seconds": 1.0}
    assert newest_delta(stores, RUN, "south-0", "south") is None
