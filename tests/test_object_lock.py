"""object_lock_days: a round's checkpoints and manifest are written under S3 Object Lock in
COMPLIANCE mode, and within the retention S3 refuses to delete their version, whoever asks.

moto's server honours the retention of a version (its delete is refused) and the bucket-level
switch; it does not refuse a PutObjectRetention that shortens a COMPLIANCE date, which AWS does
(the last test shows it). The session's moto server checks no IAM, so every raw call below is an
administrator's.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import boto3
import pytest
import torch
from botocore.exceptions import ClientError

import islands.storage.s3 as s3_module
from islands.core.config import ConfigError, RunConfig, load_config
from islands.core.model import build_model
from islands.infra.s3_server import create_buckets, lock_enabled
from islands.ops.audit import audit_run
from islands.storage import layout
from islands.storage.codec import encode_state_object
from islands.storage.encoded import EncodedObject
from islands.storage.rounds import checkpoint_metadata, update_metadata
from islands.storage.store import ObjectStore, StoreError, Stores, sha256_hex
from islands.tasks.merge_step import Merged
from islands.tasks.publish import publish_initial, write_objects
from islands.tasks.round_state import RoundState

DAYS = 2


@pytest.fixture
def s3(s3_endpoint):
    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def template(s3):
    """A store template whose global bucket has Object Lock and whose region bucket does not."""
    prefix = f"lock-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=f"{prefix}-global", ObjectLockEnabledForBucket=True)
    s3.create_bucket(Bucket=f"{prefix}-east")
    return f"s3://{prefix}-{{bucket}}"


def bucket_of(store: ObjectStore) -> str:
    return store.url.removeprefix("s3://")


def assert_retained(s3, bucket: str, key: str, days: int = DAYS) -> str:
    """The object's newest version is under COMPLIANCE retention for about `days`; its version id."""
    head = s3.head_object(Bucket=bucket, Key=key)
    assert head["ObjectLockMode"] == "COMPLIANCE", (key, head)
    until = head["ObjectLockRetainUntilDate"]
    assert abs(until - (datetime.now(UTC) + timedelta(days=days))) < timedelta(hours=1), (key, until)
    return head["VersionId"]


@pytest.mark.parametrize("single_put_max", [None, 1000], ids=["one PUT", "in parts"])
def test_bytes_and_streams_are_written_under_compliance_retention(s3, template, monkeypatch, single_put_max):
    if single_put_max:
        monkeypatch.setattr(s3_module, "SINGLE_PUT_MAX", single_put_max)
        monkeypatch.setattr(s3_module, "PART_BYTES", 5 * 2**20)
    store = Stores(template, []).global_
    locked = store.with_retention(DAYS)
    body = bytes(range(256)) * (6 * 2**12)  # 6 MiB: two parts when in parts
    stream = EncodedObject((b"head", body), sha256_hex(b"head" + body))
    assert locked.put_if_absent("runs/r/rounds/000001/manifest.json", b"{}")
    assert locked.put_if_absent("runs/r/rounds/000001/model-x.safetensors", stream)
    assert store.put_if_absent("runs/r/rounds/000001/eval.json", b"{}")  # the same bucket, not locked
    for key in ("runs/r/rounds/000001/manifest.json", "runs/r/rounds/000001/model-x.safetensors"):
        assert_retained(s3, bucket_of(store), key)
    assert "ObjectLockMode" not in s3.head_object(Bucket=bucket_of(store), Key="runs/r/rounds/000001/eval.json")
    assert store.get("runs/r/rounds/000001/model-x.safetensors") == b"head" + body
    assert locked.io is store.io  # one bucket, one set of counters


def test_within_retention_a_version_can_be_neither_deleted_nor_replaced(s3, template):
    store = Stores(template, []).global_.with_retention(DAYS)
    bucket, key = bucket_of(store), layout.manifest_key("r", 1)
    assert store.put_if_absent(key, b"the record")
    version = assert_retained(s3, bucket, key)
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.delete_object(Bucket=bucket, Key=key, VersionId=version)
    refused = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": key, "VersionId": version}]})
    assert [e["Code"] for e in refused.get("Errors", [])] == ["AccessDenied"] and not refused.get("Deleted")
    assert store.put_if_absent(key, b"forged") is False  # create-only: 412
    # What is left to a writer is to stack a version on top, or a delete marker: the record stays.
    s3.put_object(Bucket=bucket, Key=key, Body=b"forged")
    s3.delete_object(Bucket=bucket, Key=key)
    kept = s3.get_object(Bucket=bucket, Key=key, VersionId=version)
    assert kept["Body"].read() == b"the record" and kept["ObjectLockMode"] == "COMPLIANCE"
    assert store.version_counts(layout.round_prefix("r", 1)) == {key: 3}


def test_moto_lets_a_compliance_retention_be_shortened(s3, template):
    """AWS refuses to shorten a COMPLIANCE retention, for every principal; moto takes it, and then
    lets the version be deleted. So here retention holds against deletes and overwrites, not
    against a PutObjectRetention (which the synchronizer's policy grants only to write under lock)."""
    store = Stores(template, []).global_.with_retention(DAYS)
    bucket, key = bucket_of(store), layout.manifest_key("r", 2)
    store.put_if_absent(key, b"the record")
    version = assert_retained(s3, bucket, key)
    past = datetime.now(UTC) - timedelta(minutes=1)
    s3.put_object_retention(
        Bucket=bucket, Key=key, VersionId=version, Retention={"Mode": "COMPLIANCE", "RetainUntilDate": past}
    )
    s3.delete_object(Bucket=bucket, Key=key, VersionId=version)
    assert not store.exists(key)


def test_retention_needs_a_bucket_with_object_lock(template, tmp_path):
    Stores(template, []).global_.check_retention()
    with pytest.raises(StoreError, match="has no S3 Object Lock") as refused:
        Stores(template, ["east"]).region("east").check_retention()
    assert "create it with Object Lock" in str(refused.value) and "-east" in str(refused.value)
    for url in (f"file://{tmp_path}/g", f"memory://lock-{uuid.uuid4().hex[:8]}"):
        with pytest.raises(StoreError, match="cannot keep objects under retention"):
            ObjectStore(url).with_retention(DAYS)


def test_the_embedded_endpoint_gives_a_bucket_object_lock_when_a_run_asks(s3, s3_endpoint):
    fresh, empty, full = (f"embed-{uuid.uuid4().hex[:8]}-{n}" for n in ("fresh", "empty", "full"))
    s3.create_bucket(Bucket=empty)
    s3.create_bucket(Bucket=full)
    s3.put_object(Bucket=full, Key="runs/old/config.json", Body=b"{}")
    create_buckets(s3_endpoint, [fresh, empty], locked=[fresh, empty])
    assert lock_enabled(s3, fresh) and lock_enabled(s3, empty)
    with pytest.raises(StoreError, match="fresh ISLANDS_HOME"):
        create_buckets(s3_endpoint, [full], locked=[full])


def test_object_lock_days_is_checked_with_the_rest_of_the_config(tmp_path):
    assert RunConfig().object_lock_days is None
    assert RunConfig(object_lock_days=7).object_lock_days == 7  # the embedded S3 endpoint
    assert RunConfig(object_lock_days=7, store="s3://acme-{bucket}").object_lock_days == 7
    for overrides, said in (
        ({"object_lock_days": 7, "store": f"file://{tmp_path}/{{bucket}}"}, "object_lock_days: needs an s3:// store"),
        ({"object_lock_days": 0}, "object_lock_days: Input should be greater than or equal to 1"),
    ):
        with pytest.raises(ConfigError, match=said):
            load_config(None, overrides)


def _config(template: str) -> RunConfig:
    return RunConfig(
        run_id="lock-run",
        regions=["east"],
        speed={},
        store=template,
        object_lock_days=DAYS,
        eval_every=0,
        quorum={"min_quorum": 1},
    )


def test_publishing_writes_a_rounds_checkpoints_and_manifest_under_retention(s3, template):
    """Round 0 (model, manifest) and a round's model, update and outer state, as publish writes them."""
    config = _config(template)
    stores = Stores(template, config.regions)
    bucket = bucket_of(stores.global_)
    published = publish_initial(config, config.run_id, stores)
    for key in (published.manifest.model.key, layout.manifest_key(config.run_id, 0)):
        assert_retained(s3, bucket, key)
    params = {k: v.detach().clone() for k, v in build_model("tiny", 0).state_dict().items()}
    model = encode_state_object(params, checkpoint_metadata(config.run_id, 1))
    update = encode_state_object(
        {k: torch.zeros_like(v) for k, v in params.items()}, update_metadata("lock-run", 1, "fp32")
    )
    outer = encode_state_object({k: torch.zeros_like(v) for k, v in params.items()}, checkpoint_metadata("lock-run", 1))
    state = RoundState(config, config.run_id, 1, stores, [], params, {})
    for ref in write_objects(state, Merged(params, model, update, outer, [], [])):
        assert_retained(s3, bucket, ref.key)


def test_the_audit_names_a_round_object_written_again_under_lock(s3, template):
    """Even with the same bytes: under Object Lock a round object has one version, the published one."""
    config = _config(template)
    stores = Stores(template, config.regions)
    stores.global_.put_if_absent(layout.config_key(config.run_id), json.dumps(config.model_dump(mode="json")).encode())
    publish_initial(config, config.run_id, stores)
    assert audit_run(stores, config.run_id, replay=False).ok
    key, bucket = layout.manifest_key(config.run_id, 0), bucket_of(stores.global_)
    s3.put_object(Bucket=bucket, Key=key, Body=s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    report = audit_run(stores, config.run_id, replay=False)
    assert [(p.round, p.object) for p in report.problems] == [(0, key)]
    assert "2 versions" in report.problems[0].what
