"""S3 endpoints on 127.0.0.1 and what is shared by them: the test credentials, a client,
bucket creation. moto's S3 server keeps every object in memory: tests use it (its IAM
enforcement among others) and the data-plane benchmark compares it with the embedded stack's
endpoint, SeaweedFS (islands/infra/seaweed.py), which keeps them on disk.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from islands.infra.process import LOOPBACK, ChildServer, http_status, spawn, wait_ready

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}

log = logging.getLogger(__name__)


def s3_answers(url: str) -> bool:
    """Whether an S3 endpoint answers HTTP at url (any status counts: it is up)."""
    return http_status(url + "/") is not None


def client(url: str):
    """A boto3 S3 client for the local endpoint with the dummy credentials."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        config=Config(connect_timeout=2, read_timeout=60, retries={"max_attempts": 3}),
    )


def create_buckets(url: str, names: Iterable[str], locked: Iterable[str] = ()) -> None:
    """Create each bucket unless it exists already; those in `locked` with S3 Object Lock, which
    an existing one is given if it can be (versioning first; moto takes it on an empty bucket only)."""
    from botocore.exceptions import ClientError

    from islands.storage.store import StoreError

    s3 = client(url)
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    locked = set(locked)
    for name in names:
        if name not in existing:
            s3.create_bucket(Bucket=name, **({"ObjectLockEnabledForBucket": True} if name in locked else {}))
            usable(s3, name)
        elif name in locked and not lock_enabled(s3, name):
            s3.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
            try:
                s3.put_object_lock_configuration(Bucket=name, ObjectLockConfiguration={"ObjectLockEnabled": "Enabled"})
            except ClientError as exc:
                raise StoreError(
                    f"s3://{name} on {url} holds objects written before a run asked for object_lock_days, and "
                    f"this endpoint turns S3 Object Lock on for an empty bucket only ({exc.response['Error']['Code']}); "
                    "start the embedded stack in a fresh ISLANDS_HOME"
                ) from exc


def usable(s3, bucket: str, timeout: float = 30.0) -> None:
    """Wait until a bucket just created answers: SeaweedFS's S3 gateway learns of a new bucket
    from its filer a moment later, and a write before then fails with NoSuchBucket (seen on a
    loaded machine, right after the server restarted)."""
    from botocore.exceptions import ClientError

    deadline = time.monotonic() + timeout
    while True:
        try:
            s3.head_bucket(Bucket=bucket)
            return
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def lock_enabled(s3, bucket: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        config = s3.get_object_lock_configuration(Bucket=bucket)["ObjectLockConfiguration"]
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "ObjectLockConfigurationNotFoundError":
            return False
        raise
    return config.get("ObjectLockEnabled") == "Enabled"


class MotoServer(ChildServer):
    """moto's S3 server as a child process on 127.0.0.1."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        super().__init__()

    def start(self, env: Mapping[str, str], timeout: float = 30.0) -> str:
        """Start the server and wait until it answers; returns its endpoint URL.

        The child binds port 0 and reports the port it got, so no other process can
        take the port between choosing and binding it.
        """
        port_file = self.log_path.with_name(f"s3-server.{os.getpid()}.port")
        port_file.unlink(missing_ok=True)
        self._proc = spawn(
            [sys.executable, "-m", "islands.infra.s3_server", "--port-file", str(port_file)],
            env,
            self.log_path,
        )

        def ready() -> bool:
            if self._url is None and port_file.exists():
                self._url = f"http://{LOOPBACK}:{int(port_file.read_text())}"
            return self._url is not None and s3_answers(self._url)

        wait_ready(self._proc, ready, timeout, "The S3 server (moto)", self.log_path)
        port_file.unlink(missing_ok=True)
        return self._url


def serve_s3(host: str, port: int = 0):
    """moto's S3 service on a thread of this process; returns the werkzeug server (its
    `server_address`, `shutdown()`).

    moto's own server works out which of its ~200 services each request is for, listing its
    package's folders on every request under one lock. This endpoint serves S3 alone, so every
    request goes straight to moto's S3 app (`python -m benchmarks --only s3_endpoint` measures
    the CPU a request saves)."""
    from moto.moto_server.werkzeug_app import create_backend_app

    return serve_wsgi(create_backend_app("s3"), host, port)


def serve_wsgi(app, host: str, port: int = 0):
    """A moto WSGI app served as moto serves it (threaded, moto's request handler) on a daemon
    thread of this process; returns the werkzeug server."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, name="s3-server", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> None:
    """Serve S3 on 127.0.0.1 until terminated; write the bound port to --port-file."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args(argv)

    # One log line per request would grow the log by the thousands during a run.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = serve_s3(LOOPBACK, args.port).server_address[1]
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.rename(args.port_file)
    print(f"S3 (moto) listening on http://{LOOPBACK}:{port}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
