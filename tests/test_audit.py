"""`islands audit` on a real run: clean it passes (ledger balanced, every merge replayed bit for
bit, the newest manifest the one the Prefect API recorded); after each kind of tampering it exits 1
naming the round and the object, a chain rewritten consistently in storage included.

One short run (2 regions, 3 rounds, H = 5) through `islands run` on the session stack; each test
breaks the stored objects with plain S3 writes and puts the original bytes back afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from prefect.settings import PREFECT_API_URL, temporary_settings

from islands.core.config import MergeSettings, QuorumSettings, RunConfig
from islands.flows.cli import main
from islands.infra.s3_server import client
from islands.storage import layout
from islands.storage.codec import decode_state, encode_state, read_header
from islands.storage.manifest import Manifest, RoundSettings

RUN = "audit-run"
GLOBAL = "islands-global"
TEMPLATE = "s3://islands-{bucket}"


@pytest.fixture(scope="module")
def s3(on_stack, tmp_path_factory):
    config = tmp_path_factory.mktemp("audit-run") / "run.toml"
    config.write_text("eval_batches = 2\n")
    cmd = [
        sys.executable,
        "-m",
        "islands.flows.cli",
        "run",
        "--config",
        str(config),
        "--run-id",
        RUN,
        "--regions",
        "north,south",
        "--rounds",
        "3",
        "--inner-steps",
        "5",
        "--quorum.min-quorum",
        "2",
    ]
    proc = subprocess.run(cmd, env={**os.environ, **on_stack}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return client(on_stack["AWS_ENDPOINT_URL"])


def read(s3, key: str, bucket: str = GLOBAL) -> bytes:
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def manifest(s3, round_: int) -> Manifest:
    return Manifest.from_bytes(read(s3, layout.manifest_key(RUN, round_)))


def flip(data: bytes, at: int = -10) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


@contextmanager
def tampered(s3, changes: dict[tuple[str, str], bytes | None]):
    """Overwrite (bytes) or delete (None) objects as an attacker with raw write access would; restore after."""
    saved = {(b, k): read(s3, k, b) for b, k in changes}
    try:
        for (bucket, key), body in changes.items():
            if body is None:
                s3.delete_object(Bucket=bucket, Key=key)
            else:
                s3.put_object(Bucket=bucket, Key=key, Body=body)
        yield
    finally:
        for (bucket, key), body in saved.items():
            s3.put_object(Bucket=bucket, Key=key, Body=body)


def audit(capsys, *flags: str) -> tuple[int, str]:
    code = main(["audit", RUN, "--store", TEMPLATE, *flags])
    return code, capsys.readouterr().out


def test_a_clean_run_passes_with_replay_and_balanced_books(s3, on_stack):
    """The real command, on the embedded stack it finds through ISLANDS_HOME."""
    proc = subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", "audit", RUN, "--replay", "--json"],
        env={**os.environ, **on_stack},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["problems"] == []
    assert report["rounds"] == 3 and report["replayed"] == 4
    assert report["witnessed"] == 3 and any("the Prefect API at" in n for n in report["notes"]), report["notes"]
    assert set(report["ledger"]) == {"north-0", "south-0"}
    for row in report["ledger"].values():
        assert row["trained"] > 0 and row["applied"] > 0
        assert row["lost"] == 0 and row["trained"] == row["applied"] + row["dropped"] + row["pending"]


def test_every_round_records_the_settings_it_ran_with(s3):
    """Round 0's manifest and those the outer rounds published: the run's settings, typed, and the
    number of learners an unset quorum.max_quorum stands for."""
    config = RunConfig.model_validate_json(read(s3, layout.config_key(RUN)))
    for r in range(4):
        settings = manifest(s3, r).settings
        assert isinstance(settings.merge, MergeSettings) and isinstance(settings.quorum, QuorumSettings)
        assert settings == RoundSettings.of(config)
        assert (settings.quorum.min_quorum, settings.quorum.max_quorum, settings.max_quorum) == (2, None, 2)


def _model(s3, r: int) -> str:
    return manifest(s3, r).model.key


def _outer(s3, r: int) -> str:
    return manifest(s3, r).outer.key


def _delta(s3, r: int) -> tuple[str, str]:
    c = manifest(s3, r).contributions[0]
    return f"islands-{c.region}", c.key


def _m(r: int) -> str:
    return layout.manifest_key(RUN, r)


def _e(r: int) -> str:
    return layout.eval_key(RUN, r)


def _skip_round_2(s3) -> bytes:
    """Round 3's manifest re-pointed at round 1, as if round 2 had never been."""
    m = manifest(s3, 3).model_copy(
        update={"parent_round": 1, "parent_sha256": hashlib.sha256(read(s3, _m(1))).hexdigest()}
    )
    return m.to_bytes()


# (name, objects to overwrite or delete, [(round, key) the audit must name])
CASES = {
    "a changed byte in a checkpoint": lambda s3: (
        {(GLOBAL, _model(s3, 2)): flip(read(s3, _model(s3, 2)))},
        [(2, _model(s3, 2))],
    ),
    "a changed byte in a delta": lambda s3: (
        {_delta(s3, 2): flip(read(s3, _delta(s3, 2)[1], _delta(s3, 2)[0]))},
        [(2, _delta(s3, 2)[1])],
    ),
    "a changed byte in an outer state": lambda s3: (
        {(GLOBAL, _outer(s3, 1)): flip(read(s3, _outer(s3, 1)))},
        [(1, _outer(s3, 1))],
    ),
    "a changed byte in a manifest": lambda s3: (
        {(GLOBAL, _m(1)): flip(read(s3, _m(1)), at=len(read(s3, _m(1))) // 2)},
        [(1, _m(1))],
    ),
    "a deleted object": lambda s3: ({(GLOBAL, _outer(s3, 3)): None}, [(3, _outer(s3, 3))]),
    "a deleted manifest": lambda s3: ({(GLOBAL, _m(2)): None}, [(2, _m(2))]),
    "two rounds' models swapped": lambda s3: (
        {(GLOBAL, _model(s3, 1)): read(s3, _model(s3, 2)), (GLOBAL, _model(s3, 2)): read(s3, _model(s3, 1))},
        [(1, _model(s3, 1)), (2, _model(s3, 2))],
    ),
    "two rounds' manifests swapped": lambda s3: (
        {(GLOBAL, _m(1)): read(s3, _m(2)), (GLOBAL, _m(2)): read(s3, _m(1))},
        [(1, _m(1)), (2, _m(2))],
    ),
    "a manifest that skips a round": lambda s3: ({(GLOBAL, _m(3)): _skip_round_2(s3)}, [(3, _m(3))]),
    "two rounds' evaluations swapped": lambda s3: (
        {(GLOBAL, _e(1)): read(s3, _e(2)), (GLOBAL, _e(2)): read(s3, _e(1))},
        [(1, _e(1)), (2, _e(2))],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tampering_is_named_by_round_and_object(s3, capsys, case):
    changes, named = CASES[case](s3)
    with tampered(s3, changes):
        code, out = audit(capsys)
    assert code == 1, out
    for round_, key in named:
        assert f"round {round_}  {key}:" in out, f"{case}: round {round_} {key} not named in\n{out}"


def storage_alone():
    """The audit as anyone with read access to the buckets alone runs it: no Prefect API."""
    return temporary_settings(restore_defaults={PREFECT_API_URL})


def test_a_rewritten_newest_manifest_passes_the_chain_but_not_the_witness_nor_the_replay(s3, capsys):
    """The newest manifest has no successor to vouch for it; the Prefect API's record of it does,
    and so does recomputing its merge."""
    head = manifest(s3, 3)
    forged = head.model_copy(
        update={
            "contributions": [
                c.model_copy(update={"weight": c.weight * (2 if i == 0 else 1)})
                for i, c in enumerate(head.contributions)
            ]
        }
    )
    with tampered(s3, {(GLOBAL, _m(3)): forged.to_bytes()}):
        with storage_alone():
            assert audit(capsys)[0] == 0
        code, witnessed = audit(capsys)
        assert code == 1 and f"round 3  {_m(3)}: sha256" in witnessed and "rewritten in storage" in witnessed
        code, out = audit(capsys, "--replay")
    assert code == 1 and f"round 3  {_m(3)}: recorded weights" in out, out


def _rechained(s3, created_at: str) -> dict[tuple[str, str], bytes]:
    """Every manifest rewritten (its created_at) and re-linked: a chain consistent in itself."""
    changes, parent = {}, None
    for r in range(4):
        data = manifest(s3, r).model_copy(update={"created_at": created_at, "parent_sha256": parent}).to_bytes()
        changes[(GLOBAL, _m(r))] = data
        parent = hashlib.sha256(data).hexdigest()
    return changes


def test_a_chain_rewritten_consistently_in_storage_fails_on_the_prefect_witness(s3, capsys):
    with tampered(s3, _rechained(s3, "2000-01-01T00:00:00.000+00:00")):
        with storage_alone():
            code, out = audit(capsys)
            assert code == 0 and "checked against storage alone" in out, out
        code, out = audit(capsys, "--json")
    report = json.loads(out)
    assert code == 1 and report["witnessed"] is None
    named = {(p["round"], p["object"]) for p in report["problems"]}
    assert named == {(r, _m(r)) for r in (1, 2, 3)}, report["problems"]
    assert all("rewritten in storage" in p["what"] for p in report["problems"])


def test_a_deleted_newest_round_is_missed_by_storage_alone_but_not_by_the_witness(s3, capsys):
    with tampered(s3, {(GLOBAL, _m(3)): None}):
        with storage_alone():
            assert audit(capsys)[0] == 0
        code, out = audit(capsys)
    assert code == 1 and f"round 3  {_m(3)}: the Prefect API recorded this manifest" in out, out


def test_trained_tokens_without_a_delta_are_reported_lost(s3, capsys):
    """The learner's own step counter says it trained one phase more than its deltas account for."""
    bucket, prefix = "islands-north", layout.learner_state_prefix(RUN, "north-0")
    key = max(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
    data = read(s3, key, bucket)
    state = decode_state(data)
    state["trainer.step"] = state["trainer.step"] + torch.tensor(5)
    with tampered(s3, {(bucket, key): encode_state(state, read_header(data)[1])}):
        code, out = audit(capsys, "--json")
    report = json.loads(out)
    assert code == 1 and report["ledger"]["north-0"]["lost"] == 5 * 16 * 128
    assert [p["object"] for p in report["problems"]] == [prefix]


def test_the_summary_fits_one_screen(s3, capsys):
    """Runs last: a clean verdict here also shows every tampering above was undone."""
    code, out = audit(capsys)
    assert code == 0, out
    assert out.startswith(f"islands audit {RUN}: OK")
    assert len(out.splitlines()) < 25
