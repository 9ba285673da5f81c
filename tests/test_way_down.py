"""The way down on moto's S3 server: two learners of one region reach round 1 from round 0's
checkpoint and round 1's update, each object crossing from the global bucket once; the region's
second learner, the second of two restarted ones and one training again from the round it holds
read nothing from the global bucket but manifests. The round is published by the real outer-round flow."""

from __future__ import annotations

import torch

from fake_learner import delta_bytes, new_run, put
from flows.outer_round import outer_round
from storage import layout
from storage.rounds import read_manifest
from tasks.audit import audit_run
from tasks.train_phase import LearnerSession

RUN = "way-down-run"


HELD: dict[int, tuple] = {}  # id(session) → (round, θ) it holds, as its round follower keeps it


def reads(session: LearnerSession, round_: int):
    """(θ, the way it came, bytes read from the global bucket, bytes read from the regional one)."""
    g, r = session.global_store.io.bytes_read, session.regional_store.io.bytes_read
    params, way = session.base(round_, HELD.get(id(session)))
    HELD[id(session)] = (round_, params)
    return params, way, session.global_store.io.bytes_read - g, session.regional_store.io.bytes_read - r


def test_learners_reach_the_next_round_from_the_update_through_the_regional_cache(on_stack):
    config, stores = new_run(RUN, learners_per_region=2)
    first, second = (LearnerSession.open(config, RUN, name, stores) for name in ("north-0", "north-1"))
    round0 = read_manifest(stores.global_, RUN, 0)[0]

    theta0, way, from_global, _ = reads(first, 0)
    assert way == "checkpoint" and from_global >= round0.model.bytes
    same0, way, from_global, from_region = reads(second, 0)
    assert way == "checkpoint" and from_global < round0.model.bytes <= from_region
    assert all(torch.equal(theta0[n], same0[n]) for n in theta0)

    for i, learner in enumerate(["north-0", "south-0"]):
        put(config, stores, learner, 0, delta_bytes(config, stores, learner, 0, 0, seed=i))
    outer_round(run_id=RUN, round=1, store=stores.template)
    round1 = read_manifest(stores.global_, RUN, 1)[0]
    assert round1.update is not None and round1.update.codec == config.update_codec == "bf16"
    assert round1.update.bytes < round1.model.bytes * 0.6

    theta1, way, from_global, _ = reads(first, 1)
    assert way == "update" and round1.update.bytes <= from_global < round1.model.bytes
    assert stores.region("north").exists(layout.cache_key(RUN, round1.update.key))
    _, way, from_global, from_region = reads(second, 1)
    assert way == "update" and from_global < round1.update.bytes <= from_region

    _, way, from_global, from_region = reads(first, 1)
    assert (way, from_global, from_region) == ("held", 0, 0)

    # Restarted learners hold nothing: the region's first copy of round 1's checkpoint, then that copy.
    restarted = [LearnerSession.open(config, RUN, name, stores) for name in ("north-0", "north-1")]
    again, way, from_global, _ = reads(restarted[0], 1)
    assert way == "checkpoint" and from_global >= round1.model.bytes
    assert all(torch.equal(theta1[n], again[n]) for n in theta1)
    _, way, from_global, from_region = reads(restarted[1], 1)
    assert way == "checkpoint" and from_global < round1.model.bytes <= from_region

    # A held θ_0 that is not round 0's: the rebuilt model misses the manifest's hash; the checkpoint is read.
    off = {**theta0, "lm_head.weight": theta0["lm_head.weight"].clone()}
    off["lm_head.weight"][0, 0] += 1e-3
    HELD[id(second)] = (0, off)
    fixed, way, _, _ = reads(second, 1)
    assert way.startswith("checkpoint:") and all(torch.equal(theta1[n], fixed[n]) for n in theta1)

    report = audit_run(stores, RUN, replay=True)
    assert report.ok and report.replayed == 2, report.summary()
