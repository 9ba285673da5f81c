"""A learner's credentials in hostile hands: whatever it writes, rounds keep publishing.

Three parts, on the session's S3 and Prefect API: a merge whose result would not be finite
quarantines the delta that made it so and publishes from the others; a round full of hostile
deltas whose synchronizer is killed mid-publish finishes on retry with the same quarantines; and
a real run (`islands run`, learners and all) keeps publishing, its held-out loss falling, while
one region's bucket receives hostile deltas all along.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch
from conftest import STACK_REGIONS, run_args
from fake_learner import TEMPLATE, delta_bytes, metadata, new_run, pseudo_gradient, put
from prefect.logging import disable_run_logger
from safetensors.torch import save as st_save

from islands.core.model import build_model
from islands.flows.outer_round import outer_round
from islands.ops.audit import audit_run
from islands.storage import layout
from islands.storage.codec import canonical, decode_state, encode
from islands.storage.rounds import read_chain, read_manifest
from islands.storage.store import Stores
from islands.tasks.collect import collect
from islands.tasks.merge_step import merge
from islands.tasks.round_state import RoundState
from islands.tasks.train_phase import phase_after


def hostile_deltas(run: str, learner: str, region: str, params: dict[str, torch.Tensor], n: int):
    """(key, bytes) of the n-th hostile object in a cycle of kinds, each under a key of
    `learner`'s folder that its own phases never reach, or a key aliasing one of them."""
    phase = 900_000 + n
    gen = torch.Generator().manual_seed(n)
    noise = {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in params.items()}
    model_norm = float(torch.sqrt(sum(v.double().pow(2).sum() for v in params.values())))
    noise_norm = float(torch.sqrt(sum(v.double().pow(2).sum() for v in noise.values())))
    meta = {
        "run": run,
        "learner": learner,
        "region": region,
        "phase": str(phase),
        "base_round": "0",
        "inner_steps": "8",
        "tokens": str(8 * 16 * 128),
        "loss": "3.0",
        "seconds": "1.0",
        "finished_at": f"{time.time():.3f}",
    }
    key = layout.delta_key(run, learner, phase)
    name = sorted(params)[0]
    kinds = [
        lambda: (key, encode(noise, {**meta, "seconds": "soon"})),
        lambda: (key, encode(noise, {**meta, "tokens": "9" * 4000})),
        lambda: (key, encode(noise, {**meta, "tokens": str(2**70), "inner_steps": str(10**12)})),
        lambda: (key, encode({k: torch.full_like(v, 1e30) for k, v in noise.items()}, meta)),
        lambda: (key, encode({k: v * (2 * model_norm / noise_norm) for k, v in noise.items()}, meta)),
        lambda: (key, encode({**noise, name: torch.full_like(noise[name], float("nan"))}, meta)),
        lambda: (key, encode({**noise, name: torch.zeros(3)}, meta)),
        lambda: (key, encode(noise, {**meta, "loss": "inf"})),
        lambda: (key, encode(noise, {**meta, "finished_at": "-1e300"})),
        lambda: (key, encode(noise, {**meta, "learner": "x" * 100_000})),
        lambda: (key, encode(noise, {**meta, "base_round": "٣"})),
        lambda: (key, canonical(st_save(noise, metadata={**meta, "codec": "pickle"}))),
        lambda: (key.replace(f"{phase:06d}", f"0{phase:06d}"), encode(noise, meta)),
        lambda: (key.replace(learner, learner.upper()), encode(noise, meta)),
        lambda: (key.replace(f"/{learner}/", f"//{learner}/"), encode(noise, meta)),
        lambda: (key.replace(str(phase)[-1], "\u0661"), encode(noise, meta)),
        lambda: (key, encode(noise, meta)[:-100]),
        lambda: (key, b"\xff" * 64),
    ]
    assert len(kinds) == N_KINDS
    return kinds[n % N_KINDS]()


N_KINDS = 18


def as_held(stores: Stores, run: str, written) -> tuple[set[str], set[str]]:
    """(the hostile keys south's bucket holds as written, the keys it holds instead of the others):
    a store may normalize a key on write (SeaweedFS folds `a//b` into `a/b`, where AWS keeps it),
    and a key it folded into the learner's own canonical spelling is that learner's own delta,
    judged as any other it writes."""
    listed = set(stores.region("south").list(layout.deltas_prefix(run)))
    held = {k for k in written if k in listed}
    normalized = {k.replace("//", "/") for k in written if k not in listed}
    assert normalized <= listed, normalized - listed
    return held, normalized


def test_a_merge_that_would_not_be_finite_quarantines_its_cause(on_stack):
    """θ_{r−1} in memory blown up so far that the norm limit lets a delta of -θ by: merged, the
    outer step overflows float32. The synchronizer quarantines that delta, reads θ_{r−1} and the
    other deltas again, and merges those: θ_r is finite, and the honest delta is in it."""
    run = "non-finite"
    config, stores = new_run(run)
    honest = put(config, stores, "north-0", 0, delta_bytes(config, stores, "north-0", 0, 0, seed=1))
    g = pseudo_gradient(stores, run, seed=2)
    culprit = put(
        config,
        stores,
        "south-0",
        0,
        encode({k: torch.full_like(v, -3e38) for k, v in g.items()}, metadata(config, "south-0", 0, 0)),
    )
    state = RoundState.load(config, run, stores)
    truth = {k: v.clone() for k, v in state.model.items()}
    state.model = {k: torch.full_like(v, 3.3e38) for k, v in state.model.items()}
    with disable_run_logger():
        collected = collect.fn(state)
        assert {a.key for a in collected.arrivals} == {honest, culprit}
        merged = merge.fn(state, collected)
    model = decode_state(merged.model_object.read_bytes())  # from its part files, before they go
    state.drop_spool()
    assert [c.key for c in merged.contributions] == [honest]
    (why,) = [e for e in merged.excluded if e.key == culprit]
    assert why.kind == "quarantined" and "non-finite" in why.reason
    assert all(torch.isfinite(t).all() for t in model.values())
    moved = sum(float((model[k] - truth[k]).abs().max()) for k in truth)
    assert 0 < moved < 1  # θ_0 read again and stepped by the honest delta alone


def test_a_round_of_hostile_deltas_finishes_when_retried_after_a_crash(on_stack):
    """Its first try dies with SIGKILL after writing θ_r; the retry, in another process, sees the
    same deltas and publishes with every hostile one quarantined; the run audits clean."""
    run = "hostile-retry"
    config, stores = new_run(run)
    for i, learner in enumerate(["north-0", "south-0"]):
        put(config, stores, learner, 0, delta_bytes(config, stores, learner, 0, 0, seed=i))
    params = pseudo_gradient(stores, run, seed=0)
    hostile = {}
    for n in range(N_KINDS):
        key, data = hostile_deltas(run, "south-0", "south", params, n)
        if stores.region("south").put_if_absent(key, data):
            hostile[key] = n
    # The same key in the other region's bucket: judged there (and refused), apart from the honest one.
    north_key = layout.delta_key(run, "north-0", 0)
    assert stores.region("south").put_if_absent(north_key, b"\0" * 100)
    env = {**os.environ, "ISLANDS_CRASH": "publish.after_model@1"}
    first = subprocess.run(
        [sys.executable, "-m", "islands.flows.outer_round", run, "1", TEMPLATE],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert first.returncode == -9, first.stderr[-3000:]
    assert not stores.global_.exists(layout.manifest_key(run, 1))
    summary = outer_round(run_id=run, round=1, store=TEMPLATE)
    assert summary["outcome"] == "committed"
    manifest, _ = read_manifest(stores.global_, run, 1)
    assert sorted((c.region, c.learner) for c in manifest.contributions) == [("north", "north-0"), ("south", "south-0")]
    recorded = {(e.region, e.key): e for e in manifest.excluded}
    held, normalized = as_held(stores, run, hostile)
    assert {("south", k) for k in held} | {("south", north_key)} <= set(recorded)
    assert all(("south", k) in recorded or k in {c.key for c in manifest.contributions} for k in normalized)
    assert all(len(e.reason) <= 240 and e.kind == "quarantined" for e in recorded.values())
    assert len(manifest.to_bytes()) < 20_000  # nothing the learner wrote is copied whole
    assert outer_round(run_id=run, round=1, store=TEMPLATE)["outcome"] == "already-published"
    report = audit_run(stores, run, replay=True)
    assert report.ok, report.summary()
    assert report.ledger["north-0"]["applied"] == manifest.contributions[0].tokens_counted


ROUNDS = 4


def test_a_run_keeps_publishing_while_a_region_receives_hostile_deltas(on_stack):
    """`islands run` with two regions; from the start, south's bucket gets a hostile object every
    few tenths of a second in its learner's folder, as whoever holds that learner's credentials
    can write. Every round is published, the held-out loss falls, nothing hostile is merged, and
    the audit is clean. (The hostile keys sort after the learner's own, so its listing moves past
    them and its honest deltas wait: a learner's credentials can silence that learner, no other.)"""
    run = "hostile-run"
    params = {k: v.detach() for k, v in build_model("tiny", 0).state_dict().items()}
    stores = Stores(TEMPLATE, STACK_REGIONS)
    written, stop = {}, threading.Event()

    def attack() -> None:
        n = 0
        while not stop.is_set():
            key, data = hostile_deltas(run, "south-0", "south", params, n)
            try:
                if stores.region("south").put_if_absent(key, data):
                    written[key] = n
            except Exception:  # noqa: BLE001 - the attacker's own failures do not matter
                pass
            n += 1
            stop.wait(0.3)

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "islands.flows.cli",
                *run_args(run, STACK_REGIONS, ROUNDS),
                "--json",
            ],
            env=dict(os.environ),
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        stop.set()
        attacker.join()
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds_published"] == ROUNDS
    assert summary["eval_loss_final"] < summary["eval_loss_round0"]
    chain = [m for m, _ in read_chain(stores.global_, run)]
    merged = {c.key for m in chain for c in m.contributions}
    assert not merged & set(written), "a hostile delta was merged"
    # Only a key the store folds into the learner's own spelling may be merged: a valid delta of
    # its own. Told by its kind, since a write the attacker saw fail may still have landed.
    (folds,) = [n for n in range(N_KINDS) if "//" in hostile_deltas(run, "south-0", "south", params, n)[0]]
    foreign = [
        c.key for m in chain for c in m.contributions if c.phase >= 900_000 and (c.phase - 900_000) % N_KINDS != folds
    ]
    assert not foreign, foreign
    quarantined = {e.key for m in chain for e in m.excluded}
    assert len(quarantined & set(written)) >= N_KINDS, (len(written), len(quarantined))
    report = audit_run(stores, run, replay=False)
    assert report.ok, report.summary()
    print(
        f"\nhostile run: {ROUNDS} rounds in {took:.0f} s, {len(written)} hostile objects written, "
        f"eval loss {summary['eval_loss_round0']:.3f} -> {summary['eval_loss_final']:.3f}"
    )


def test_a_restored_learner_goes_on_after_its_state_whatever_numbers_its_folder_holds():
    assert phase_after([], []) == 0
    assert phase_after([0, 1, 2], [0, 1, 2]) == 3
    assert phase_after([1, 2], [0, 1, 2, 3]) == 4  # delta 3 was written, its state was not (a crash)
    assert phase_after([2], [2, 3, 900_000, 999_999_999]) == 4  # written by someone holding its keys
    assert phase_after([], [0, 5]) == 1
