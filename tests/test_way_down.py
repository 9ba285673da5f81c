"""The way down on moto's S3 server: two learners of one region make round 0 from the run's seed
and reach round 1 from round 1's update, each object crossing from the global bucket once; the region's
second learner, the second of two restarted ones and one training again from the round it holds
read nothing from the global bucket but manifests. The round is published by the real outer-round flow."""

from __future__ import annotations

import torch
from fake_learner import delta_bytes, new_run, put

from islands.core import compress
from islands.flows.outer_round import outer_round
from islands.ops import audit
from islands.ops.audit import audit_run
from islands.storage import layout
from islands.storage.codec import encode_state, packed
from islands.storage.rounds import checkpoint_metadata, read_manifest
from islands.storage.store import sha256_hex
from islands.tasks.train_phase import HeldRound, LearnerSession, Way

RUN = "way-down-run"


# id(session) → (session, round, HeldRound): the round it holds, as its round follower keeps it. The
# entry keeps the session alive, so a session opened later is never given a finished one's id.
HELD: dict[int, tuple] = {}


def held(session: LearnerSession) -> tuple[int, HeldRound] | None:
    entry = HELD.get(id(session))
    return entry[1:] if entry is not None else None


def reads(session: LearnerSession, round_: int):
    """(θ, the way it came, bytes read from the global bucket, bytes read from the regional one)."""
    g, r = session.global_store.io.bytes_read, session.regional_store.io.bytes_read
    published, way = session.base(round_, held(session))
    HELD[id(session)] = (session, round_, published)
    return published.params, way, session.global_store.io.bytes_read - g, session.regional_store.io.bytes_read - r


def test_learners_reach_the_next_round_from_the_update_through_the_regional_cache(on_stack):
    config, stores = new_run(RUN, learners_per_region=2)
    first, second = (LearnerSession.open(config, RUN, name, stores) for name in ("north-0", "north-1"))
    round0 = read_manifest(stores.global_, RUN, 0)[0]

    # Round 0 is the seeded model: each learner makes it and checks its hash, nothing is read.
    for learner in (first, second):
        theta0, way, from_global, from_region = reads(learner, 0)
        assert way.source == "seed" and from_global < round0.model.bytes and from_region == 0
    assert sha256_hex(encode_state(theta0, checkpoint_metadata(RUN, 0))) == round0.model.sha256

    for i, learner in enumerate(["north-0", "south-0"]):
        put(config, stores, learner, 0, delta_bytes(config, stores, learner, 0, 0, seed=i))
    outer_round(run_id=RUN, round=1, store=stores.template)
    round1 = read_manifest(stores.global_, RUN, 1)[0]
    assert round1.update is not None and round1.update.codec == config.update_codec == "bf16"
    assert round1.update.bytes < round1.model.bytes * 0.6

    theta1, way, from_global, _ = reads(first, 1)
    assert way == Way("updates", 1) and round1.update.bytes <= from_global < round1.model.bytes
    # Each contribution's tokens per second, which paced phases scale H by (islands.core.pace).
    assert held(first)[1].rates == {c.learner: c.tokens / c.seconds for c in round1.contributions}
    assert set(held(first)[1].rates) == {"north-0", "south-0"}
    assert stores.region("north").exists(layout.cache_key(RUN, round1.update.key))
    _, way, from_global, from_region = reads(second, 1)
    assert way == Way("updates", 1) and from_global < round1.update.bytes <= from_region

    _, way, from_global, from_region = reads(first, 1)
    assert (way, from_global, from_region) == (Way("held"), 0, 0)

    # Restarted learners hold nothing: the region's first copy of round 1's checkpoint, then that copy.
    restarted = [LearnerSession.open(config, RUN, name, stores) for name in ("north-0", "north-1")]
    again, way, from_global, _ = reads(restarted[0], 1)
    assert way == Way("checkpoint") and from_global >= round1.model.bytes
    assert all(torch.equal(theta1[n], again[n]) for n in theta1)
    _, way, from_global, from_region = reads(restarted[1], 1)
    assert way == Way("checkpoint") and from_global < round1.model.bytes <= from_region

    # A held θ_0 that is not round 0's: the rebuilt model misses the manifest's hash; the checkpoint is read.
    off = {**theta0, "lm_head.weight": theta0["lm_head.weight"].clone()}
    off["lm_head.weight"][0, 0] += 1e-3
    HELD[id(second)] = (second, 0, HeldRound(off))
    fixed, way, _, _ = reads(second, 1)
    assert (
        way.source == "checkpoint"
        and way.fallback is not None
        and all(torch.equal(theta1[n], fixed[n]) for n in theta1)
    )

    report = audit_run(stores, RUN, replay=True)
    assert report.ok and report.replayed == 2, report.summary()


def test_a_learner_rounds_behind_chains_the_updates_and_learns_which_of_its_deltas_were_merged(on_stack, monkeypatch):
    """int4 updates are about an eighth of the checkpoint: a learner holding round 0 reaches round 2
    from rounds 1 and 2's updates, bit for bit, and learns that rounds 1 and 2 consumed its phases 0
    and 1. An audit whose zlib deflates the updates' integers into other bytes replays them too."""
    run = RUN + "-chain"
    config, stores = new_run(run, update_codec="int4")
    session = LearnerSession.open(config, run, "north-0", stores)
    reads(session, 0)
    for phase in (0, 1):
        for i, learner in enumerate(["north-0", "south-0"]):
            put(config, stores, learner, phase, delta_bytes(config, stores, learner, phase, phase, seed=2 * phase + i))
        outer_round(run_id=run, round=phase + 1, store=stores.template)
    manifests = [read_manifest(stores.global_, run, r)[0] for r in (1, 2)]
    assert sum(m.update.bytes for m in manifests) < manifests[1].model.bytes

    theta2, way, from_global, _ = reads(session, 2)
    assert way == Way("updates", 2) and from_global < manifests[1].model.bytes
    assert held(session)[1].consumed == {0, 1}
    fresh, way, _, _ = reads(LearnerSession.open(config, run, "north-0", stores), 2)
    assert way == Way("checkpoint") and all(torch.equal(theta2[n], fresh[n]) for n in theta2)

    compared = []
    monkeypatch.setattr(compress, "DEFLATE_LEVEL", 9)  # as another zlib build would: other bytes
    monkeypatch.setattr(audit, "packed", lambda data: compared.append(data) or packed(data))
    report = audit_run(stores, run, replay=True)
    assert report.ok and report.replayed == 3, report.summary()  # rounds 0 to 2
    assert len(compared) == 4  # each round's update matched only once its integers were packed again


def test_a_phase_starts_from_the_learners_own_weights_and_no_earlier_in_the_schedule_than_the_run(on_stack):
    """Carry: with no newer round, phase 1 goes on from where phase 0 ended (θ_0 − δ_0), not from
    θ_0; once round 1 has merged δ_0, the learner stands on θ_1 plus only its unmerged δ_1. A
    learner that starts late begins at the run's average step of the learning-rate schedule."""
    from islands.tasks.train_phase import train_phase

    run = RUN + "-carry"
    config, stores = new_run(run)
    session = LearnerSession.open(config, run, "north-0", stores)
    session.follow(poll_s=0.05)
    try:
        theta0 = session.rounds.held()[1].params
        train_phase(session, 0)
        end0 = {n: p.detach().clone() for n, p in session.trainer.model.named_parameters()}
        delta0 = session.unmerged[0]
        start1 = session.reference(session.rounds.held())
        assert all(torch.allclose(start1[n], end0[n], atol=1e-6) for n in end0)
        assert all(torch.equal(start1[n], theta0[n] - delta0[n]) for n in end0)
        train_phase(session, 1)
        session.uploads.close()

        outer_round(run_id=run, round=1, store=stores.template)  # merges phases 0 and 1 of north-0
        session.rounds.wait_newer(0, timeout_s=10.0)
        now = session.rounds.held()
        assert now[0] == 1 and now[1].consumed == {0, 1}
        assert session.reference(now) is now[1].params and session.unmerged == {}

        # Round 1 applied north-0's 10 steps: the run's 2 learners are 5 steps in on average, so
        # south-0's first phase runs at steps 5…9 of the learning-rate schedule, not 0…4.
        tokens_per_step = session.trainer.sampler.tokens_per_batch
        assert now[1].tokens_applied == read_manifest(stores.global_, run, 1)[0].tokens_applied == 10 * tokens_per_step
        south = LearnerSession.open(config, run, "south-0", stores)
        south.follow(poll_s=0.05)
        try:
            train_phase(south, 0)
            assert south.trainer.step == 5 and south.trainer.schedule_step == 5 + 5  # steps trained, schedule
        finally:
            south.rounds.close()
            south.uploads.close()
    finally:
        session.rounds.close()
