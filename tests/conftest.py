"""Shared fixtures: a real S3 API (moto's server, for its IAM enforcement) on 127.0.0.1 for the session, a fresh
bucket per test, and one embedded stack (SeaweedFS, Prefect, learner runner) for the tests that need Prefect."""

import os
import uuid
from pathlib import Path

import pytest

from islands.core.config import embedded_buckets

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server bound to loopback; AWS_* variables point at it for the session."""
    from islands.infra.s3_server import serve_s3

    server = serve_s3("127.0.0.1")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    env = {**_S3_ENV, "AWS_ENDPOINT_URL": url}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.shutdown()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, uniquely named bucket on the session's S3 endpoint."""
    import boto3
    import s3fs

    name = f"test-{uuid.uuid4().hex[:16]}"
    boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=name)
    s3fs.S3FileSystem.clear_instance_cache()
    yield name


STACK_REGIONS = ["north", "south"]
# Token shards live outside the store's buckets: prepare refuses a destination inside any of them.
CORPORA = "test-corpora"


def run_args(run_id: str, regions: list[str], rounds: int) -> list[str]:
    """`islands run`'s arguments for the tests' short runs: phases of 8 steps, a quorum of one."""
    return f"run --run-id {run_id} --regions {','.join(regions)} --rounds {rounds} --inner-steps 8 --quorum.min-quorum 1".split()


@pytest.fixture(scope="session")
def islands_stack(tmp_path_factory):
    """One embedded stack (SeaweedFS S3 in its own process, Prefect API, learner runner) shared by the
    tests that need Prefect; recorded in its home so `islands` commands given ISLANDS_HOME reuse it."""
    from islands.infra.stack import LocalStack

    home = tmp_path_factory.mktemp("islands-stack")
    stack = LocalStack(home, [*embedded_buckets(STACK_REGIONS), CORPORA], keep=False)
    with pytest.MonkeyPatch.context() as mp:
        # The learner runner (and each learner it starts) can import the tests' python: model factories.
        mp.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
        )
        stack.start(record=True)
    with stack:
        yield stack, home


@pytest.fixture(scope="module")
def on_stack(islands_stack):
    """Point this process (S3 clients, the Prefect client) and its children at the session stack."""
    import s3fs
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    stack, home = islands_stack
    env = {**stack.env(), "ISLANDS_HOME": str(home)}
    with pytest.MonkeyPatch.context() as mp, temporary_settings(updates={PREFECT_API_URL: stack.api_url}):
        for key, value in env.items():
            mp.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        yield env
        APILogWorker.drain_all(timeout=5)  # send this module's flow logs while the API is still there
    s3fs.S3FileSystem.clear_instance_cache()
