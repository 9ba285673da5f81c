"""`islands run` on the embedded stack killed with SIGKILL in round 3, as the OOM killer or a
preempted node would: no process of it is left and no port it opened still listens, and
`islands resume` in the same data folder finishes the run from what the S3 endpoint had
acknowledged, with nothing lost (the audit's ledger) and every merge replayed bit for bit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3

from islands.infra.process import port_open

RUN = "hard-crash"
ROUNDS = 4
KILL_AFTER = 2  # the driver dies once round 2 is published, while round 3 is under way


def own_env(home: Path) -> dict[str, str]:
    """This machine's environment without any endpoint or Prefect API of the test session."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PREFECT_"))}
    return {**env, "ISLANDS_HOME": str(home)}


def islands(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "islands.flows.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def processes_of(home: Path) -> dict[int, str]:
    """Every process on this machine whose environment names `home` (all a stack starts inherit it)."""
    marker = f"ISLANDS_HOME={home}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def listening_ports(commands: dict[int, str]) -> list[int]:
    """The ports the stack's servers were told to bind: every weed port, the Prefect server's."""
    ports = []
    for cmd in commands.values():
        ports += [int(p) for p in re.findall(r"-[a-z0-9.]*port[a-z.]*=(\d+)", cmd)]
        ports += [int(p) for p in re.findall(r"--port (\d+)", cmd)]
    return ports


def s3_url(home: Path) -> str | None:
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd[:2] and cmd[1:2] == [b"server"] and f"-dir={home / 'seaweedfs'}".encode() in cmd:
            port = next(c for c in cmd if c.startswith(b"-s3.port="))
            return f"http://127.0.0.1:{int(port.split(b'=')[1])}"
    return None


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


def published(url: str, round_: int) -> bool:
    s3 = boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    try:
        s3.head_object(Bucket="islands-global", Key=f"runs/{RUN}/rounds/{round_:06d}/manifest.json")
        return True
    except Exception:  # noqa: BLE001 - not there yet, or the endpoint still starting
        return False


def test_sigkill_of_run_leaves_no_process_and_resume_finishes_it(tmp_path):
    home = tmp_path / "islands"
    env = own_env(home)
    t0 = time.monotonic()
    args = ["--regions", "north,south", "--rounds", str(ROUNDS), "--inner-steps", "5"]
    run = islands(env, "run", "--run-id", RUN, *args)
    try:
        url = wait_until(lambda: s3_url(home), 120, "the run's S3 endpoint")
        wait_until(lambda: published(url, KILL_AFTER) or run.poll() is not None, 600, f"round {KILL_AFTER}")
        assert run.poll() is None, run.communicate()[1][-3000:]
        stack = processes_of(home)
        ports = listening_ports(stack)
        assert len(ports) >= 9, stack  # SeaweedFS's eight and the Prefect server's
    finally:
        run.send_signal(signal.SIGKILL)  # also when a wait failed: its reaper ends the rest
        run.communicate()
    killed_at = time.monotonic()

    wait_until(lambda: not processes_of(home), 30, "the killed run's processes to end")
    assert not [p for p in ports if port_open(p)], "a port of the killed run still listens"
    print(f"killed after {killed_at - t0:.1f} s; its processes ended within {time.monotonic() - killed_at:.1f} s")

    resumed = islands(env, "resume", RUN, "--json")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-4000:]
    assert json.loads(out.strip().splitlines()[-1])["rounds_published"] == ROUNDS

    audit = islands(env, "audit", RUN, "--replay", "--json")
    out, err = audit.communicate(timeout=120)
    assert audit.returncode == 0, out[-3000:] + err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ledger"], report
    assert all(row["lost"] == 0 for row in report["ledger"].values()), report["ledger"]
    assert not processes_of(home), "resume or audit left a process behind"
    print(f"killed, resumed and audited in {time.monotonic() - t0:.1f} s")
