"""Test helpers: an embedded stack with `islands serve` running against it, and the Prefect REST
API spoken over plain HTTP (the test process never imports Prefect with another server's settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from islands.infra.process import stop_group
from islands.infra.stack import LocalStack

FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class Api:
    """Just enough of the Prefect REST API for the tests."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def call(self, method: str, path: str, body: dict | None = None):
        """One request; a 503 (the server's SQLite busy under load) is retried for a while."""
        data = json.dumps(body).encode() if body is not None else None
        deadline = time.monotonic() + 60
        while True:
            req = urllib.request.Request(
                self.url + path, data=data, method=method, headers={"content-type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    text = resp.read()
                return json.loads(text) if text else None
            except urllib.error.HTTPError as exc:
                if exc.code != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def deployment(self, full_name: str, timeout_s: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.call("GET", f"/deployments/name/{full_name}")
            except urllib.error.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def flow_runs(self, **flow_run_filter) -> list[dict]:
        return self.call("POST", "/flow_runs/filter", {"flow_runs": flow_run_filter, "sort": "EXPECTED_START_TIME_ASC"})

    def wait_final(self, flow_run_id: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.call("GET", f"/flow_runs/{flow_run_id}")
            if run["state_type"] in FINAL or time.monotonic() > deadline:
                return run
            time.sleep(1.0)

    def artifacts(self, key_prefix: str) -> dict[str, dict]:
        found = self.call("POST", "/artifacts/filter", {"artifacts": {"key": {"like_": key_prefix}}})
        return {a["key"]: a for a in found}


@contextmanager
def served_stack(home: Path, buckets: list[str], serve_args: list[str], serve_env: dict | None = None):
    """A recorded LocalStack in `home` and `islands serve` reusing it; yields (stack, env, Api)."""
    with LocalStack(home, buckets).start(record=True) as stack:
        env = {**os.environ, "ISLANDS_HOME": str(home)}
        for key in ("PREFECT_API_URL", "AWS_ENDPOINT_URL"):
            env.pop(key, None)  # `islands serve` must find the recorded stack by itself
        log = home / "logs" / "serve.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "islands.flows.cli", "serve", *serve_args],
                env={**env, **(serve_env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            yield stack, {**env, **stack.env()}, Api(stack.api_url)
        finally:
            stop_group(proc)


def islands(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
