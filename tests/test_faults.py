"""The fault tools alone: crash-point settings, --chaos specs, the driver lease, the S3 proxy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from islands.flows.chaos import Chaos, ChaosError, Stall
from islands.infra.s3_proxy import S3Proxy
from islands.storage import lease
from islands.storage.store import ObjectStore
from islands.tasks.crash import POINTS, CrashSpecError, crash_point, parse


def test_crash_setting_parses_point_and_number():
    assert parse("publish.after_model") == ("publish.after_model", None)
    assert parse("publish.after_model@3") == ("publish.after_model", 3)
    assert parse("phase.after_delta@phase2") == ("phase.after_delta", 2)


@pytest.mark.parametrize("spec", ["publish.nope", "publish.after_model@x", "round.after_publish@-1"])
def test_a_bad_crash_setting_names_the_valid_points(spec):
    with pytest.raises(CrashSpecError) as err:
        parse(spec)
    assert "publish.after_model" in str(err.value) or "number" in str(err.value)


def test_crash_point_kills_its_own_process_with_sigkill_only_where_armed():
    code = "from islands.tasks.crash import crash_point as c; c('collect.done', 1); c('collect.done', 2); print('survived')"
    env = {**os.environ, "ISLANDS_CRASH": "collect.done@2"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL and "survived" not in proc.stdout
    env["ISLANDS_CRASH"] = "collect.done@3"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "survived" in proc.stdout


def test_an_unregistered_crash_point_is_refused():
    with pytest.raises(CrashSpecError, match="not registered"):
        crash_point("publish.after_everything")
    assert len(POINTS) == 8


def test_chaos_specs_parse_comma_separated_and_repeated():
    chaos = Chaos.parse(
        ["kill:eu-west@round3,restart:us-east@round5", "stall:s3@40s+20s", "crash:synchronizer@publish.after_model"]
    )
    assert chaos.kills == {3: ["eu-west"]} and chaos.restarts == {5: ["us-east"]}
    assert chaos.stalls == [Stall(40.0, 20.0)]
    assert chaos.crashes == [("publish.after_model", None)]
    assert Chaos.parse(["crash:synchronizer@collect.done@round2"]).crashes == [("collect.done", 2)]


@pytest.mark.parametrize(
    "spec, names",
    [
        ("explode:eu-west@round3", "kill:"),
        ("kill:eu-west@3", "kill:REGION@roundN"),
        ("stall:s3@40+20", "stall:s3@STARTs+LENGTHs"),
        ("crash:synchronizer@phase.after_delta", "crash:synchronizer@POINT"),
        ("crash:learner@publish.after_model", "crash:synchronizer@POINT"),
        ("crash:synchronizer@round.after_publish", "crash:synchronizer@POINT"),
    ],
)
def test_a_bad_chaos_spec_names_the_bad_part(spec, names):
    with pytest.raises(ChaosError) as err:
        Chaos.parse(["kill:eu-west@round1", spec])
    assert repr(spec) in str(err.value) and names in str(err.value)


def test_a_region_killed_then_restarted_is_away_in_between_and_killed_once(monkeypatch):
    import islands.flows.learner_runs

    killed = []
    monkeypatch.setattr(
        islands.flows.learner_runs,
        "kill_learners",
        lambda run, region: killed.append(region) or [f"learner-{region}-0"],
    )
    monkeypatch.setattr(Chaos, "_note", lambda self, line: self.log.append(line))
    chaos = Chaos.parse(["kill:west@round2,restart:west@round4"])
    learners = [("west-0", "west", 0), ("east-0", "east", 1)]
    relaunch = lambda learner, region: learner  # noqa: E731
    assert chaos.after_round("r", 2, learners, relaunch) == [] and killed == ["west"]
    assert chaos.after_round("r", 3, learners, relaunch) == []
    assert chaos.after_round("r", 4, learners, relaunch) == ["west-0"] and killed == ["west"]
    assert "down since an earlier kill; relaunched" in chaos.log[-1]


def test_chaos_must_fit_the_run():
    with pytest.raises(ChaosError, match="no such region"):
        Chaos.parse(["kill:mars@round1"]).check(["eu-west"], 4)
    with pytest.raises(ChaosError, match="ends at round 4"):
        Chaos.parse(["kill:eu-west@round4"]).check(["eu-west"], 4)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_learner_stops_when_a_newer_driver_claims_the_run():
    store = ObjectStore("memory://lease-newer")
    first = lease.claim(store, "r", {})
    watch = lease.Watch(store, "r", first, clock=Clock())
    assert watch.verdict() is None and not watch.superseded
    assert lease.claim(store, "r", {}) == first + 1
    assert "took over" in watch.verdict() and watch.superseded


def test_a_learner_stops_when_its_driver_stops_beating_and_not_before():
    store, clock = ObjectStore("memory://lease-silent"), Clock()
    epoch = lease.claim(store, "r", {})
    watch = lease.Watch(store, "r", epoch, lease_s=30, clock=clock)
    with lease.Heartbeat(store, "r", epoch, every_s=0.01):
        for _ in range(5):
            time.sleep(0.05)
            clock.now += 20  # 100 s of learner time, but the heartbeat moves in between
            assert watch.verdict() is None
    time.sleep(0.05)
    watch.verdict()
    clock.now += 31
    assert "has not beaten" in watch.verdict() and not watch.superseded
    beats = [k for k in store.list("runs/r/drivers/") if "beat-" in k]
    assert len(beats) <= 2, "old beats are garbage-collected"


def echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")], daemon=True
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def test_the_proxy_holds_traffic_while_paused_and_lets_it_through_after():
    srv, port = echo_server()
    with S3Proxy(f"http://127.0.0.1:{port}") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as c:
            c.sendall(b"one")
            assert c.recv(16) == b"one"
            proxy.pause()
            time.sleep(0.1)
            c.sendall(b"two")
            c.settimeout(0.5)
            with pytest.raises(TimeoutError):
                c.recv(16)
            proxy.resume()
            c.settimeout(5)
            assert c.recv(16) == b"two" and proxy.held >= 1
    srv.close()


def test_checking_faults_imports_no_prefect_before_the_stack_settings_exist():
    code = (
        "import sys, islands.flows.commands as c; "
        "assert c.check_faults(c.RunConfig(), ['kill:eu-west@round2,stall:s3@1s+1s']) is None; "
        "assert 'prefect' not in sys.modules, 'Prefect would read its settings before the stack sets them'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
