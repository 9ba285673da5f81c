"""The embedded S3 endpoint (SeaweedFS) on its own: every write it acknowledged is there after the
server is killed with SIGKILL; it keeps the conditional-write contract (storage.probe) and S3
Object Lock; and a child spawned by a process is ended when that process is killed, while a group
its parent has already stopped (whose id may belong to another group by then) is left alone."""

from __future__ import annotations

import datetime
import io
import os
import signal
import subprocess
import sys
import threading
import time

import boto3
import pytest
from botocore.exceptions import ClientError

from islands.infra.process import pid_alive, reap
from islands.infra.s3_server import CREDENTIALS, create_buckets
from islands.infra.seaweed import SeaweedServer
from islands.storage.probe import check_create_only
from islands.storage.store import ObjectStore


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedServer(folder / "data", folder / "weed.log")
    t0 = time.monotonic()
    server.start({**os.environ, **CREDENTIALS})
    print(f"SeaweedFS answered S3 after {time.monotonic() - t0:.1f} s")
    yield server
    server.stop()


def s3_client(url: str):
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )


def test_acknowledged_writes_outlive_a_sigkill_of_the_server(weed):
    create_buckets(weed.url, ["islands-global"])
    s3 = s3_client(weed.url)
    for i in range(20):
        s3.put_object(
            Bucket="islands-global", Key=f"runs/r/rounds/{i:06d}/manifest.json", Body=b"m%d" % i, IfNoneMatch="*"
        )
    os.killpg(weed.pid, signal.SIGKILL)
    weed.stop()
    weed.start({**os.environ, **CREDENTIALS})
    s3 = s3_client(weed.url)
    for i in range(20):
        body = s3.get_object(Bucket="islands-global", Key=f"runs/r/rounds/{i:06d}/manifest.json")["Body"].read()
        assert body == b"m%d" % i


def test_it_refuses_a_second_create_only_write_and_a_wrong_checksum(weed, monkeypatch):
    create_buckets(weed.url, ["islands-probe"])
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": weed.url}.items():
        monkeypatch.setenv(key, value)
    check_create_only(ObjectStore("s3://islands-probe"))  # raises unless 412 on the second write
    with pytest.raises(ClientError) as wrong:
        s3_client(weed.url).put_object(
            Bucket="islands-probe", Key="c", Body=b"abc", ChecksumAlgorithm="SHA256", ChecksumSHA256="A" * 43 + "="
        )
    assert wrong.value.response["Error"]["Code"] == "BadDigest"


def test_object_lock_keeps_a_version_under_compliance_retention(weed):
    create_buckets(weed.url, ["islands-locked"], locked=["islands-locked"])
    s3 = s3_client(weed.url)
    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    put = s3.put_object(
        Bucket="islands-locked",
        Key="m",
        Body=b"m",
        IfNoneMatch="*",
        ChecksumAlgorithm="SHA256",
        ObjectLockMode="COMPLIANCE",
        ObjectLockRetainUntilDate=until,
    )
    with pytest.raises(ClientError) as refused:
        s3.delete_object(Bucket="islands-locked", Key="m", VersionId=put["VersionId"])
    assert refused.value.response["Error"]["Code"] == "AccessDenied"
    assert s3.get_object(Bucket="islands-locked", Key="m", VersionId=put["VersionId"])["Body"].read() == b"m"


PARENT = """
import sys, time
from pathlib import Path
from islands.infra.process import spawn
child = spawn([sys.executable, "-c", "import time; time.sleep(600)"], {}, Path(sys.argv[1]))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_spawned_child_ends_when_its_parent_is_killed(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert pid_alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(child), "the child outlived its parent's SIGKILL"


def test_the_reaper_ends_the_groups_it_holds_and_never_one_already_released():
    held, released = (subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2))
    lines = io.BytesIO(f"{released.pid}\n{held.pid}\n-{released.pid}\n".encode())
    reaper = threading.Thread(target=reap, args=(lines,))  # here, so that the test reaps its sleeps
    try:
        reaper.start()
        assert held.wait(timeout=10) == -signal.SIGTERM
        reaper.join(timeout=10)
        assert released.poll() is None, "the reaper signalled a group its parent had released"
    finally:
        for proc in (held, released):
            proc.kill()
            proc.wait()


def test_a_new_endpoint_waits_for_the_one_a_killed_stack_left_on_its_folder(tmp_path, capsys, monkeypatch):
    """A resume right after a SIGKILL found the dying stack's `weed` still holding the store's lock
    (a Go stack trace from the new one); the new one waits for it, saying so, then starts."""
    from islands.infra import seaweed

    env = {**os.environ, **CREDENTIALS}
    old = SeaweedServer(tmp_path / "data", tmp_path / "old.log")
    old.start(env)
    create_buckets(old.url, ["islands-global"])
    s3_client(old.url).put_object(Bucket="islands-global", Key="kept", Body=b"kept")
    monkeypatch.setattr(seaweed, "PREVIOUS_STOP_S", 2.0)
    with pytest.raises(RuntimeError, match=rf"still holds {tmp_path / 'data'} after 2 s; stop it \(kill {old.pid}\)"):
        seaweed.wait_for_previous(tmp_path / "data", 2.0)
    threading.Timer(3.0, old.stop).start()
    new = SeaweedServer(tmp_path / "data", tmp_path / "new.log")
    try:
        new.start(env)
        assert "is still stopping; waiting up to" in capsys.readouterr().err
        assert s3_client(new.url).get_object(Bucket="islands-global", Key="kept")["Body"].read() == b"kept"
        assert seaweed.holder(tmp_path / "data") == new.pid
    finally:
        new.stop()
    assert seaweed.holder(tmp_path / "data") is None
