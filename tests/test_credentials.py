"""A learner deployment's AwsCredentials block: its keys and endpoint are what the learner's
stores sign with, not the worker's environment (the session stack's SeaweedFS checks signatures)."""

from __future__ import annotations

import pytest
from prefect_aws import AwsCredentials
from prefect_aws.client_parameters import AwsClientParameters

from islands.flows.credentials import CredentialsError, storage_options
from islands.storage.store import Stores

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_PROFILE")


@pytest.fixture
def blocks(on_stack, monkeypatch):
    """Two blocks, one with the stack's keys and one with a wrong secret; then a worker
    environment that holds no AWS settings at all."""
    endpoint = on_stack["AWS_ENDPOINT_URL"]
    params = AwsClientParameters(endpoint_url=endpoint)
    key, secret = on_stack["AWS_ACCESS_KEY_ID"], on_stack["AWS_SECRET_ACCESS_KEY"]
    AwsCredentials(aws_access_key_id=key, aws_secret_access_key=secret, aws_client_parameters=params).save(
        "north-s3", overwrite=True
    )
    AwsCredentials(aws_access_key_id=key, aws_secret_access_key="not-" + secret, aws_client_parameters=params).save(
        "north-s3-wrong", overwrite=True
    )
    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield endpoint
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_block_gives_the_endpoint_and_keys(blocks):
    options = storage_options("north-s3")
    assert options["endpoint_url"] == blocks and options["key"] and options["secret"]
    store = Stores("s3://islands-{bucket}", ["north"], options).region("north")
    key = "probes/credentials-test"
    store.put_if_absent(key, b"signed with the block's keys")
    assert store.get(key) == b"signed with the block's keys"
    store.delete(key)


def test_a_wrong_secret_in_the_block_is_refused_by_the_store(blocks):
    store = Stores("s3://islands-{bucket}", ["north"], storage_options("north-s3-wrong")).region("north")
    with pytest.raises(Exception, match="(?i)signature|access ?denied|forbidden|403"):
        store.put_if_absent("probes/credentials-wrong", b"x")


def test_a_missing_block_names_itself_and_what_to_do(blocks):
    with pytest.raises(CredentialsError, match="credentials: no AwsCredentials block named 'no-such-block'"):
        storage_options("no-such-block")
