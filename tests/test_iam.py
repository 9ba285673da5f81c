"""The regional credentials hold under real IAM enforcement (moto's server with
INITIAL_NO_AUTH_ACTION_COUNT): a learner writes only its own region's bucket for its run, the
synchronizer reads every region and writes the global bucket. The reads and writes go through the
project's own ObjectStore, as learners and the synchronizer make them.
"""

from __future__ import annotations

import json
import os
import sys

import boto3
import pytest

from infra.iam import policy
from infra.process import free_port, http_status, spawn, stop_group, wait_ready
from storage.store import ObjectStore

RUN = "iam-run"
TEMPLATE = "s3://iam-{bucket}"
REGIONS = ["north", "south"]
ADMIN = {"aws_access_key_id": "admin", "aws_secret_access_key": "admin", "region_name": "us-east-1"}
# Unauthenticated set-up calls: 3 buckets, then 4 calls per identity (user, policy, attach, key).
SETUP_CALLS = 3 + 4 * 2


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
    """{role: storage options} for a north learner and the synchronizer."""
    s3 = boto3.client("s3", endpoint_url=endpoint, **ADMIN)
    for bucket in ("global", *REGIONS):
        s3.create_bucket(Bucket=f"iam-{bucket}")
    iam = boto3.client("iam", endpoint_url=endpoint, **ADMIN)
    out = {}
    for role, regions in (("learner", ["north"]), ("synchronizer", REGIONS)):
        iam.create_user(UserName=role)
        arn = iam.create_policy(PolicyName=role, PolicyDocument=json.dumps(policy(role, RUN, TEMPLATE, regions)))[
            "Policy"
        ]["Arn"]
        iam.attach_user_policy(UserName=role, PolicyArn=arn)
        key = iam.create_access_key(UserName=role)["AccessKey"]
        out[role] = {
            "key": key["AccessKeyId"],
            "secret": key["SecretAccessKey"],
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        }
    return out


def store(credentials, role: str, bucket: str) -> ObjectStore:
    return ObjectStore(f"s3://iam-{bucket}", credentials[role])


def test_enforcement_is_on(endpoint, credentials):
    s3 = boto3.client("s3", endpoint_url=endpoint, **ADMIN)
    with pytest.raises(Exception, match="InvalidAccessKeyId|AccessDenied"):
        s3.put_object(Bucket="iam-global", Key="x", Body=b"x")


def test_learner_writes_its_own_region_and_reads_the_global_bucket(credentials):
    sync_global = store(credentials, "synchronizer", "global")
    assert sync_global.put_if_absent(f"runs/{RUN}/rounds/000000/manifest.json", b"{}")
    learner_north = store(credentials, "learner", "north")
    assert learner_north.put_if_absent(f"runs/{RUN}/deltas/north-0/000000.safetensors", b"delta")
    assert learner_north.put_if_absent(f"runs/{RUN}/learners/north-0/state-000000.safetensors", b"state")
    learner_north.delete(f"runs/{RUN}/learners/north-0/state-000000.safetensors")
    assert learner_north.put_if_absent(f"runs/{RUN}/cache/000000/model-0123456789abcdef.safetensors", b"copy")
    assert store(credentials, "learner", "global").get(f"runs/{RUN}/rounds/000000/manifest.json") == b"{}"


@pytest.mark.parametrize(
    "bucket, key",
    [
        ("global", f"runs/{RUN}/rounds/000001/manifest.json"),
        ("south", f"runs/{RUN}/deltas/south-0/000000.safetensors"),
        ("south", f"runs/{RUN}/cache/000000/model-0123456789abcdef.safetensors"),
        ("north", "runs/other-run/deltas/north-0/000000.safetensors"),
    ],
)
def test_learner_is_refused_outside_its_region_and_run(credentials, bucket, key):
    with pytest.raises(PermissionError):
        store(credentials, "learner", bucket).put_if_absent(key, b"forged")


def test_synchronizer_reads_every_region_and_writes_only_the_global_bucket(credentials):
    key = f"runs/{RUN}/deltas/north-0/000009.safetensors"
    store(credentials, "learner", "north").put_if_absent(key, b"delta")
    assert store(credentials, "synchronizer", "north").get(key) == b"delta"
    for region in REGIONS:
        assert isinstance(store(credentials, "synchronizer", region).list(f"runs/{RUN}/deltas/"), dict)
        with pytest.raises(PermissionError):
            store(credentials, "synchronizer", region).put_if_absent(
                f"runs/{RUN}/deltas/{region}-0/000010.safetensors", b"forged"
            )
    assert store(credentials, "synchronizer", "global").put_if_absent(f"runs/{RUN}/rounds/000001/manifest.json", b"{}")
