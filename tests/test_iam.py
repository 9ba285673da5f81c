"""The per-learner and synchronizer credentials under real IAM enforcement (moto's server with
INITIAL_NO_AUTH_ACTION_COUNT), written as properties over every place a role does not own.

moto enforces a statement's Action and Resource: a learner creates and reads only its own
deltas and state and its region's cache, deletes only its own old states and cache copies; the
synchronizer reads every region, creates in the global bucket and deletes only heartbeats and
probes. moto does not evaluate S3 condition keys (its IAM evaluates StringEquals on a few
non-S3 keys and skips every other operator), so the `s3:if-none-match` condition that makes
every PutObject create-only on AWS is not enforced here: the last tests show exactly that, and
that S3 Object Lock still keeps a manifest's first version from every credential, an admin's
included. The reads and writes go through the project's own ObjectStore, as the roles make them.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime, timedelta

import boto3
import pytest
from botocore.exceptions import ClientError

from islands.infra.iam import policy
from islands.infra.process import free_port, http_status, spawn, stop_group, wait_ready
from islands.storage import layout
from islands.storage.probe import check_create_only
from islands.storage.store import ObjectStore

RUN = "iam-run"
TEMPLATE = "s3://iam-{bucket}"
REGIONS = ["north", "south"]
ADMIN = {"aws_access_key_id": "admin", "aws_secret_access_key": "admin", "region_name": "us-east-1"}
# (identity, its policy's role, regions, learner): two learners share north.
IDENTITIES = [
    ("north-0", "learner", ["north"], "north-0"),
    ("north-1", "learner", ["north"], "north-1"),
    ("south-0", "learner", ["south"], "south-0"),
    ("synchronizer", "synchronizer", REGIONS, None),
]
# Unauthenticated set-up calls: 3 buckets, then 4 calls per identity (user, policy, attach, key),
# and 3 for an administrator allowed everything (user, attach of an inline policy, key).
SETUP_CALLS = 3 + 4 * len(IDENTITIES) + 3


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """A moto server of its own, enforcing IAM once the set-up calls are spent."""
    port = free_port()
    log = tmp_path_factory.mktemp("iam") / "moto.log"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_CALLS)}
    proc = spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        # moto's own API answers without counting as an action.
        wait_ready(proc, lambda: http_status(url + "/moto-api/") is not None, 60, "moto with IAM", log)
        yield url
    finally:
        stop_group(proc)


@pytest.fixture(scope="module")
def credentials(endpoint):
    """{identity: storage options}; the global bucket has S3 Object Lock, as object_lock_days needs."""
    s3 = boto3.client("s3", endpoint_url=endpoint, **ADMIN)
    s3.create_bucket(Bucket="iam-global", ObjectLockEnabledForBucket=True)
    for region in REGIONS:
        s3.create_bucket(Bucket=f"iam-{region}")
    iam = boto3.client("iam", endpoint_url=endpoint, **ADMIN)
    out = {}

    def keys(name: str) -> dict:
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {
            "key": key["AccessKeyId"],
            "secret": key["SecretAccessKey"],
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }

    for name, role, regions, learner in IDENTITIES:
        iam.create_user(UserName=name)
        doc = json.dumps(policy(role, RUN, TEMPLATE, regions, learner))
        arn = iam.create_policy(PolicyName=name, PolicyDocument=doc)["Policy"]["Arn"]
        iam.attach_user_policy(UserName=name, PolicyArn=arn)
        out[name] = keys(name)
    iam.create_user(UserName="admin")
    everything = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="admin", PolicyName="everything", PolicyDocument=json.dumps(everything))
    out["admin"] = keys("admin")
    return out


def store(credentials, who: str, bucket: str) -> ObjectStore:
    return ObjectStore(f"s3://iam-{bucket}", credentials[who])


def client(credentials, who: str):
    c = credentials[who]
    return boto3.client("s3", aws_access_key_id=c["key"], aws_secret_access_key=c["secret"], **c["client_kwargs"])


def delta(learner: str, phase: int = 0, run: str = RUN) -> str:
    return layout.delta_key(run, learner, phase)


def state(learner: str, phase: int = 0) -> str:
    return layout.learner_state_key(RUN, learner, phase)


CACHED = layout.cache_key(RUN, layout.model_key(RUN, 0, "0123456789abcdef" * 4))


def test_enforcement_is_on(endpoint, credentials):
    s3 = boto3.client("s3", endpoint_url=endpoint, **ADMIN)
    with pytest.raises(Exception, match="InvalidAccessKeyId|AccessDenied"):
        s3.put_object(Bucket="iam-global", Key="x", Body=b"x")


def test_a_learner_writes_its_own_folders_and_reads_the_published_rounds(credentials):
    sync_global = store(credentials, "synchronizer", "global")
    assert sync_global.put_if_absent(layout.manifest_key(RUN, 0), b"{}")
    north = store(credentials, "north-0", "north")
    assert north.put_if_absent(delta("north-0"), b"delta")
    assert north.get(delta("north-0")) == b"delta"
    assert north.put_if_absent(state("north-0"), b"state")
    north.delete(state("north-0"))
    assert north.put_if_absent(CACHED, b"copy")
    assert store(credentials, "north-1", "north").get(CACHED) == b"copy"  # the region's cache is shared
    store(credentials, "north-1", "north").delete(CACHED)  # a damaged copy is anyone's in the region to collect
    assert set(north.list(layout.learner_deltas_prefix(RUN, "north-0"))) == {delta("north-0")}
    assert store(credentials, "north-0", "global").get(layout.manifest_key(RUN, 0)) == b"{}"


# Every place a north-0 learner does not own, by bucket: a region-mate's folders, the region's
# other objects, another region (its learners' folders and cache), the global bucket, another run.
NOT_NORTH_0 = [
    ("north", delta("north-1")),
    ("north", state("north-1")),
    ("north", layout.config_key(RUN)),
    ("north", f"runs/{RUN}/elsewhere/x"),
    ("north", delta("north-0", run="other-run")),
    ("south", delta("north-0")),
    ("south", delta("south-0")),
    ("south", state("south-0")),
    ("south", CACHED),
    ("global", layout.manifest_key(RUN, 1)),
    ("global", layout.model_key(RUN, 1, "ab" * 32)),
    ("global", layout.stop_key(RUN)),
    ("global", layout.driver_key(RUN, 7)),
    ("global", layout.config_key(RUN)),
]


@pytest.mark.parametrize("bucket, key", NOT_NORTH_0)
def test_a_learner_creates_nothing_outside_its_own_folders(credentials, bucket, key):
    with pytest.raises(PermissionError):
        store(credentials, "north-0", bucket).put_if_absent(key, b"forged")


@pytest.mark.parametrize("bucket, key", [*NOT_NORTH_0, ("north", delta("north-0"))])
def test_a_learner_deletes_nothing_but_its_old_states_and_cache_copies(credentials, bucket, key):
    """Not a region-mate's state or deltas, not even its own deltas (they are the run's record)."""
    with pytest.raises(PermissionError):
        store(credentials, "north-0", bucket).delete(key)


def test_a_region_mates_saved_state_and_deltas_stay(credentials):
    mate = store(credentials, "north-1", "north")
    for key in (state("north-1", 3), delta("north-1", 3)):
        assert mate.put_if_absent(key, b"mine")
        with pytest.raises(PermissionError):
            store(credentials, "north-0", "north").delete(key)
        with pytest.raises(PermissionError):
            store(credentials, "north-0", "north").put_if_absent(key, b"forged")
        assert mate.get(key) == b"mine"


@pytest.mark.parametrize("bucket, key", [("north", delta("north-1")), ("north", state("north-1")), ("south", CACHED)])
def test_a_learner_reads_no_region_mates_deltas_or_state_nor_another_region(credentials, bucket, key):
    with pytest.raises(PermissionError):
        store(credentials, "north-0", bucket).get(key)


def test_the_synchronizer_reads_every_region_and_creates_only_in_the_global_bucket(credentials):
    key = delta("north-0", 9)
    store(credentials, "north-0", "north").put_if_absent(key, b"delta")
    assert store(credentials, "synchronizer", "north").get(key) == b"delta"
    for region in REGIONS:
        assert isinstance(store(credentials, "synchronizer", region).list(layout.deltas_prefix(RUN)), dict)
        with pytest.raises(PermissionError):
            store(credentials, "synchronizer", region).put_if_absent(delta(f"{region}-0", 10), b"forged")
        with pytest.raises(PermissionError):
            store(credentials, "synchronizer", region).delete(key)
    assert store(credentials, "synchronizer", "global").put_if_absent(layout.manifest_key(RUN, 1), b"{}")


@pytest.mark.parametrize(
    "key",
    [
        layout.manifest_key(RUN, 2),
        layout.model_key(RUN, 2, "cd" * 32),
        layout.eval_key(RUN, 2),
        layout.config_key(RUN),
        layout.stop_key(RUN),
    ],
)
def test_the_synchronizer_deletes_no_round_object_nor_the_runs_record(credentials, key):
    sync = store(credentials, "synchronizer", "global")
    assert sync.put_if_absent(key, b"record")
    with pytest.raises(PermissionError):
        sync.delete(key)
    assert sync.put_if_absent(key, b"replacement") is False  # create-only: S3 answers 412
    assert sync.get(key) == b"record"


def test_the_synchronizer_collects_heartbeats_and_probes(credentials):
    sync = store(credentials, "synchronizer", "global")
    for key in (layout.beat_key(RUN, 0, 3), layout.probe_key("0123abcd")):
        assert sync.put_if_absent(key, b"")
        sync.delete(key)
        assert not sync.exists(key)


def test_moto_does_not_enforce_the_create_only_condition(credentials):
    """On AWS these policies allow PutObject only with If-None-Match (`"Null":
    {"s3:if-none-match": "false"}`), so a plain PUT over a learner's own delta is refused. moto
    evaluates no S3 condition key: the plain PUT goes through and replaces the delta."""
    key = delta("north-0", 20)
    assert store(credentials, "north-0", "north").put_if_absent(key, b"delta")
    client(credentials, "north-0").put_object(Bucket="iam-north", Key=key, Body=b"replaced")
    assert store(credentials, "north-0", "north").get(key) == b"replaced"


def test_object_lock_keeps_a_manifests_first_version_from_every_credential(credentials):
    """What moto leaves to the condition key, Object Lock makes up for where it counts: a manifest
    written under compliance retention keeps its first version whoever asks; the synchronizer's
    plain PUT only stacks a newer version on top, which `islands audit` names."""
    key = layout.manifest_key(RUN, 5)
    locked = store(credentials, "synchronizer", "global").with_retention(1)
    assert locked.put_if_absent(key, b"the record")
    first = client(credentials, "admin").head_object(Bucket="iam-global", Key=key)
    assert first["ObjectLockMode"] == "COMPLIANCE"
    assert first["ObjectLockRetainUntilDate"] > datetime.now(UTC) + timedelta(hours=23)
    for who in ("synchronizer", "admin"):
        with pytest.raises(ClientError, match="AccessDenied"):
            client(credentials, who).delete_object(Bucket="iam-global", Key=key, VersionId=first["VersionId"])
    client(credentials, "synchronizer").put_object(Bucket="iam-global", Key=key, Body=b"forged")
    kept = client(credentials, "admin").get_object(Bucket="iam-global", Key=key, VersionId=first["VersionId"])
    assert kept["Body"].read() == b"the record"
    versions = client(credentials, "admin").list_object_versions(Bucket="iam-global", Prefix=key)["Versions"]
    assert len(versions) == 2


def test_the_synchronizer_runs_the_create_only_probe(credentials):
    check_create_only(store(credentials, "synchronizer", "global"))
