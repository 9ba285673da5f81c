"""One endpoint and one set of credentials per run.

- A run given a store on an S3 endpoint of the user's own (AWS_ENDPOINT_URL, the user's keys),
  with no PREFECT_API_URL: every process of it, learners included, writes to that endpoint with
  those keys. The endpoint here is a SeaweedFS server that admits the user's keys alone, so a
  process sent there with the embedded stack's test keys would be refused.
- `islands up`, its Prefect API exported (as a user does to use the `prefect` CLI), `islands
  serve`, and a run started with `prefect deployment run`: it completes on the embedded store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
from served_stack import Api, islands

from islands.infra.process import stop_group
from islands.infra.seaweed import SeaweedServer

USER_KEYS = {"AWS_ACCESS_KEY_ID": "acme-user", "AWS_SECRET_ACCESS_KEY": "acme-secret-key"}
REGIONS = ["north", "south"]


def bare_env(home: Path) -> dict[str, str]:
    """This machine's environment without the test session's endpoint or Prefect API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_"))}
    return {**env, "ISLANDS_HOME": str(home)}


def test_a_run_on_the_users_own_endpoint_writes_there_with_the_users_keys(tmp_path):
    server = SeaweedServer(tmp_path / "acme-s3", tmp_path / "acme-s3.log", credentials=USER_KEYS)
    url = server.start(os.environ)
    try:
        s3 = boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1", **{k.lower(): v for k, v in USER_KEYS.items()}
        )
        for bucket in ["global", *REGIONS]:
            s3.create_bucket(Bucket=f"acme-islands-{bucket}")
        home = tmp_path / "islands"
        env = {**bare_env(home), **USER_KEYS, "AWS_ENDPOINT_URL": url, "AWS_DEFAULT_REGION": "us-east-1"}
        args = ["--regions", ",".join(REGIONS), "--rounds", "3", "--inner-steps", "5", "--run-id", "acme"]
        done = islands(env, "run", "--store", "s3://acme-islands-{bucket}", *args, "--json", timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["rounds_published"] == 3
        assert not (home / "seaweedfs").exists(), "an embedded S3 endpoint was started for a run with its own store"
        for region in REGIONS:
            found = [o["Key"] for o in s3.list_objects_v2(Bucket=f"acme-islands-{region}").get("Contents", [])]
            assert any(k.startswith(f"runs/acme/deltas/{region}-0/") for k in found), (region, found)
        manifests = s3.list_objects_v2(Bucket="acme-islands-global", Prefix="runs/acme/rounds/000003/manifest.json")
        assert manifests.get("KeyCount") == 1
    finally:
        server.stop()


def test_islands_up_with_its_api_exported_serves_runs_started_from_the_prefect_cli(tmp_path):
    home = tmp_path / "islands"
    env = bare_env(home)
    config = tmp_path / "tiny.toml"
    config.write_text('regions = ["solo"]\nrounds = 1\ninner_steps = 4\neval_batches = 2\n[quorum]\nmin_quorum = 1\n')
    up = subprocess.Popen(
        [sys.executable, "-m", "islands.flows.cli", "up", "--regions", "solo"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    serve = None
    try:
        deadline = time.monotonic() + 120
        while not (home / "stack.json").exists():
            assert up.poll() is None and time.monotonic() < deadline, "islands up did not come up"
            time.sleep(0.5)
        api_url = json.loads((home / "stack.json").read_text())["api_url"]
        exported = {**env, "PREFECT_API_URL": api_url}
        with open(tmp_path / "serve.log", "ab") as log:
            serve = subprocess.Popen(
                [sys.executable, "-m", "islands.flows.cli", "serve", "--config", str(config)],
                env=exported,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        api = Api(api_url)
        api.deployment("training-run/local")
        started = subprocess.run(
            [sys.executable, "-m", "prefect", "deployment", "run", "training-run/local"],
            env=exported,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert started.returncode == 0, started.stdout + started.stderr
        flow_run = next(line.split()[-1] for line in started.stdout.splitlines() if "UUID" in line)
        final = api.wait_final(flow_run, timeout_s=180)
        assert final["state_type"] == "COMPLETED", (final["state"], (tmp_path / "serve.log").read_text()[-4000:])
    finally:
        if serve is not None:
            stop_group(serve)
        stop_group(up, grace=60)  # a clean stop removes stack.json; on a loaded machine it takes a while
    assert not (home / "stack.json").exists()
