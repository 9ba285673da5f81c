"""The embedded stack really serves S3 and Prefect on loopback, keeps its buckets on disk, and
leaves nothing behind.

One stack for the module: the Prefect server alone takes ~11 s to start here.
"""

import json
import os
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

from islands.infra.process import http_status, port_open
from islands.infra.s3_server import client
from islands.infra.stack import LocalStack, find_running, stack_env

BUCKETS = ["islands-global", "islands-region-a"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("islands")


@pytest.fixture(scope="module")
def stack(data_dir):
    local = LocalStack(data_dir, BUCKETS, serve_learners=False).start(record=True)
    yield local
    local.stop()


def test_buckets_exist_and_objects_round_trip(stack):
    s3 = client(stack.s3_url)
    names = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    assert set(BUCKETS) <= names
    s3.put_object(Bucket="islands-global", Key="runs/demo/rounds/000000/model.safetensors", Body=b"weights")
    body = s3.get_object(Bucket="islands-global", Key="runs/demo/rounds/000000/model.safetensors")
    assert body["Body"].read() == b"weights"


def test_prefect_api_and_ui_answer(stack):
    assert http_status(stack.api_url + "/health") == 200
    assert http_status(stack.ui_url) == 200
    ui_settings = get_json(stack.ui_url + "/ui-settings")
    assert ui_settings["api_url"] == stack.api_url


def test_env_points_at_the_stack(stack, data_dir):
    env = stack.env()
    assert env == stack_env(stack.data_dir, stack.s3_url, stack.api_url)
    assert env["PREFECT_API_URL"] == stack.api_url
    assert env["AWS_ENDPOINT_URL"] == stack.s3_url
    assert env["PREFECT_HOME"] == str(data_dir / "prefect")
    assert all(urlparse(u).hostname == "127.0.0.1" for u in (stack.s3_url, stack.api_url))


def test_find_running_sees_the_recorded_stack(stack, data_dir):
    found = find_running(data_dir)
    assert found == {"pid": os.getpid(), "s3_url": stack.s3_url, "api_url": stack.api_url, "ui_url": stack.ui_url}


def test_find_running_removes_a_stale_record(tmp_path):
    state = tmp_path / "stack.json"
    dead = "http://127.0.0.1:1"
    state.write_text(json.dumps({"pid": 2**22 + 1, "s3_url": dead, "api_url": dead + "/api", "ui_url": dead}))
    assert find_running(tmp_path) is None
    assert not state.exists()


def test_stop_frees_everything_and_a_new_stack_finds_the_objects_again(stack, data_dir):
    ports = [urlparse(u).port for u in (stack.s3_url, stack.api_url)]
    pids = stack.pids()
    assert len(pids) == 2

    stack.stop()
    stack.stop()

    assert not any(port_open(p) for p in ports)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert not (data_dir / "stack.json").exists()

    with LocalStack(data_dir, BUCKETS, serve_learners=False, keep=False) as again:
        s3 = client(again.s3_url)
        key = "runs/demo/rounds/000000/model.safetensors"
        assert s3.get_object(Bucket="islands-global", Key=key)["Body"].read() == b"weights"
        assert {"islands-region-a"} <= {b["Name"] for b in s3.list_buckets()["Buckets"]}
    # keep=False: a throwaway stack's buckets go with it
    assert not (data_dir / "seaweedfs").exists()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())
