"""Token shards end to end on the session stack's S3: `islands prepare` writes them there on all
cores, `islands run` trains on them for three rounds in two regions, a restarted learner goes on
from its saved cursor exactly, and a shard holding an id the model cannot embed fails the phase,
naming the shard and the offset, with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import fsspec
import numpy as np
import pytest
import torch
from conftest import CORPORA, STACK_REGIONS

from islands.core.config import RunConfig
from islands.core.data import TokenRangeError
from islands.storage import layout
from islands.storage.codec import decode_state
from islands.storage.shards import Dataset, ShardEntry, TokenizerRef
from islands.storage.store import Stores
from islands.storage.text import stdlib_files

DATASET = f"s3://{CORPORA}/stdlib-bytes"


def islands(env: dict, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def env(on_stack):
    return {**os.environ, **on_stack}


@pytest.fixture(scope="module")
def prepared(env, tmp_path_factory):
    """About 1 MB of the standard library as byte-level shards of ~0.25 MB on the stack's S3."""
    src = tmp_path_factory.mktemp("src")
    size = 0
    for i, path in enumerate(stdlib_files()):
        shutil.copy(path, src / f"{i:04d}.txt")
        size += path.stat().st_size
        if size > 1_000_000:
            break
    out = islands(env, "prepare", str(src), DATASET, "--shard-mb", "0.25", "--workers", "2")
    return src, out


def test_prepare_writes_shards_to_s3_and_a_second_prepare_writes_none(prepared, env):
    src, first = prepared
    assert (
        "written, 0 already there" in first.stdout and "uint16 tokens, tokenizer bytes (vocabulary 256)" in first.stdout
    )
    assert "prepare" in first.stdout  # the progress bar
    again = islands(env, "prepare", str(src), DATASET, "--shard-mb", "0.25", "--workers", "1")
    dataset = Dataset.model_validate_json(fsspec.open(DATASET + "/dataset.json").open().read())
    n = len(dataset.shards)
    assert n >= 4 and f"{n} shards (0 written, {n} already there)" in again.stdout


def test_a_run_trains_on_the_shards_for_three_rounds_in_two_regions(prepared, env):
    proc = islands(
        env,
        "run",
        "--run-id",
        "shards-run",
        "--corpus",
        DATASET,
        "--regions",
        ",".join(STACK_REGIONS),
        "--rounds",
        "3",
        "--inner-steps",
        "4",
        "--quorum.min-quorum",
        "2",
        "--json",
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds_published"] == 3
    assert summary["eval_loss_final"] < summary["eval_loss_round0"]
    stores = Stores("s3://islands-{bucket}", STACK_REGIONS)
    for region in STACK_REGIONS:
        learner = f"{region}-0"
        keys = stores.region(region).list(layout.learner_state_prefix("shards-run", learner))
        state = decode_state(stores.region(region).get(sorted(keys)[-1]))
        steps = int(state["trainer.step"])
        assert steps >= 4 and int(state["sampler.draws"]) == steps  # one batch per step, the cursor saved


@pytest.fixture
def session_of(on_stack):
    from islands.flows.training_run import create_run
    from islands.tasks.train_phase import LearnerSession

    opened = []

    def make(run: str, corpus: str):
        config = RunConfig(
            run_id=run,
            regions=STACK_REGIONS,
            rounds=2,
            inner_steps=5,
            speed={},
            eval_batches=2,
            corpus=corpus,
            quorum={"min_quorum": 1},
        )
        stores = Stores("s3://islands-{bucket}", config.regions)
        create_run(config, stores)

        def open_learner():
            session = LearnerSession.open(config, run, "north-0", stores)
            session.follow(poll_s=0.05)
            opened.append(session)
            return session

        return open_learner, stores

    yield make
    for session in opened:
        session.rounds.close()
        session.uploads.close()


def test_a_restarted_learner_goes_on_from_its_saved_cursor_exactly(prepared, session_of):
    from islands.tasks.train_phase import train_phase

    open_learner, _ = session_of("shards-cursor", DATASET)
    first = open_learner()
    train_phase(first, 0)
    first.uploads.close()
    restarted = open_learner()
    assert restarted.next_phase == 1
    saved, now = first.trainer.sampler.state_dict(), restarted.trainer.sampler.state_dict()
    assert all(torch.equal(saved[k], now[k]) for k in saved) and int(now["draws"]) == 5
    for _ in range(3):
        (x1, y1), (x2, y2) = first.trainer.sampler.next_batch(), restarted.trainer.sampler.next_batch()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_an_id_outside_the_models_vocabulary_fails_the_phase_naming_shard_and_offset(on_stack, session_of):
    from islands.tasks.train_phase import train_phase

    url = "s3://islands-global/datasets/bad-ids"
    fs = fsspec.filesystem("s3")
    entries = []
    for i in range(3):
        tokens = (np.arange(10_000) % 200).astype(np.uint16)
        if i == 0:
            tokens[5000] = 300
        fs.pipe_file(f"{url}/shard-{i:06d}.bin", tokens.tobytes())
        entries.append(ShardEntry(name=f"shard-{i:06d}.bin", tokens=10_000, sha256="-"))
    manifest = Dataset(
        dtype="uint16", tokenizer=TokenizerRef(name="bytes", sha256="bytes", vocab_size=256), shards=entries
    )
    fs.pipe_file(f"{url}/dataset.json", manifest.to_bytes())
    open_learner, stores = session_of("shards-bad-ids", url)
    session = open_learner()
    with pytest.raises(TokenRangeError, match=r"^corpus: shard shard-000000.bin holds token id 300 at offset 5000"):
        train_phase(session, 0)
    session.uploads.close()
    regional = stores.region("north")
    assert not regional.list(layout.learner_deltas_prefix("shards-bad-ids", "north-0"))
    assert not regional.list(layout.learner_state_prefix("shards-bad-ids", "north-0"))
