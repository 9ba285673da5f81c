"""The Prefect UI, in headless Chromium: a training run started from the deployment with the
parameters its run form submits shows its rounds and their table artifacts, and its report. The
same run, seen by `islands status` while it runs and after it finished.

Screenshots land in test-output/ (gitignored). Chromium comes from Debian's packages; the test
installs it when missing and it can (root, apt-get), and skips saying why otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cdp import Browser
from served_stack import islands, served_stack

from infra.s3_server import client

CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parent.parent / "test-output"
RUN = "ui-run"


def ensure_chromium() -> None:
    if CHROMIUM.exists():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{CHROMIUM} is missing and only root can install it: apt-get install -y chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"{' '.join(cmd)} failed, so there is no browser to test with: {done.stderr[-500:]}")


@pytest.fixture
def browser(tmp_path):
    ensure_chromium()
    b = Browser(CHROMIUM, tmp_path / "profile")
    yield b
    b.close()


def shot(browser: Browser, name: str) -> Path:
    OUTPUT.mkdir(exist_ok=True)
    path = browser.screenshot(OUTPUT / name)
    assert path.stat().st_size > 10_000, f"{path} is (nearly) empty"
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("islands-ui")
    with served_stack(home, ["islands-global"], []) as served:
        yield served


@pytest.fixture(scope="module")
def watching(served, tmp_path_factory):
    """`islands status --watch`, started before the run and seen waiting for it: it has paid for
    its imports before the run starts, however busy the machine, and then looks every second."""
    _, env, _ = served
    log = tmp_path_factory.mktemp("watch") / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "status", RUN, "--json", "--watch", "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    deadline = time.monotonic() + 180
    while "waiting" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    yield proc, log
    proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def ui_run(served, watching):
    """A run created from training-run/local with what its form submits: the defaults, edited."""
    _, _, api = served
    dep = api.deployment("training-run/local")
    config = {
        **dep["parameters"]["config"],
        "run_id": RUN,
        "regions": ["fresh"],
        "speed": {},
        "rounds": 2,
        "inner_steps": 8,
        "eval_batches": 2,
        "quorum": {**dep["parameters"]["config"]["quorum"], "min_quorum": 1},
    }
    return api.call("POST", f"/deployments/{dep['id']}/create_flow_run", {"parameters": {"config": config}})


@pytest.fixture(scope="module")
def finished(served, ui_run):
    _, _, api = served
    run = api.wait_final(ui_run["id"], timeout_s=240)
    assert run["state_type"] == "COMPLETED", run["state"]
    return run


def status(env: dict) -> dict:
    out = islands(env, "status", RUN, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_while_the_run_is_running(served, watching, ui_run):
    stack, _, _ = served
    proc, log = watching
    out, _ = proc.communicate(timeout=300)  # the watch ends by itself once the run is finished
    assert proc.returncode == 0, log.read_text()[-3000:]
    seen = [json.loads(line) for line in out.splitlines()]
    assert seen and seen[-1]["state"] == "finished", log.read_text()[-3000:]
    running = [s for s in seen if s["state"] == "running" and s["learners"][0]["flow_run"] == "RUNNING"]
    assert running, [(s["state"], s["rounds_published"], s["learners"][0]["flow_run"]) for s in seen]
    # A UI run names a region no bucket was made for: the flow made it on the embedded endpoint.
    assert "islands-fresh" in {b["Name"] for b in client(stack.s3_url).list_buckets()["Buckets"]}
    assert running[0]["prefect_api"] == stack.api_url
    assert running[0]["learners"][0]["status"] in ("alive", "starting")
    assert [s["rounds_published"] for s in seen] == sorted(s["rounds_published"] for s in seen)


def test_status_after_the_run_finished(served, finished):
    _, env, _ = served
    seen = status(env)
    assert seen["state"] == "finished" and [r["round"] for r in seen["rounds"]] == [1, 2]
    assert seen["learners"] == [
        {**seen["learners"][0], "learner": "fresh-0", "status": "done", "flow_run": "COMPLETED"}
    ]
    assert seen["eval_loss"] == seen["rounds"][-1]["eval_loss"]
    text = islands(env, "status", RUN).stdout
    assert f"{RUN}: finished, 2/2 rounds published" in text and "fresh-0" in text


def test_the_run_page_shows_its_rounds_and_the_round_table(served, finished, browser):
    stack, _, api = served
    rounds = api.flow_runs(name={"like_": f"{RUN}/round-"})
    assert sorted(r["name"] for r in rounds) == [f"{RUN}/round-001", f"{RUN}/round-002"], [r["name"] for r in rounds]

    browser.open(f"{stack.ui_url}/runs/flow-run/{finished['id']}")
    browser.wait_for(RUN, "Subflow Runs")
    browser.click_text("Subflow Runs")
    browser.wait_for(f"{RUN}/round-001", f"{RUN}/round-002")
    shot(browser, "ui-run-page.png")

    artifacts = api.artifacts(RUN)
    browser.open(f"{stack.ui_url}/artifacts/artifact/{artifacts[f'{RUN}-round-001']['id']}")
    browser.wait_for("fresh-0", "merged", "staleness", "Manifest")
    shot(browser, "ui-round-table.png")

    browser.open(f"{stack.ui_url}/artifacts/artifact/{artifacts[f'{RUN}-report']['id']}")
    browser.wait_for("Quorum decisions", "Bytes sent", "Where everything is")
    assert 'src="data:image/svg+xml;base64,' in browser.html()
    shot(browser, "ui-run-report.png")
