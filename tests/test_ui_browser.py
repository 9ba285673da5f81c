"""The Prefect UI, in headless Chromium driven by Playwright: a training run started by filling in
the deployment's Run form as a person would shows its rounds and their table artifacts, and its
report. The same run, seen by `islands status` while it runs and after it finished.

Screenshots land in test-output/ (gitignored). Chromium comes from Debian's packages (Playwright
drives it through executable_path and downloads no browser); the test installs it when missing
and it can (root, apt-get), and skips saying why otherwise.
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
from playwright.sync_api import Locator, Page, expect, sync_playwright
from served_stack import islands, served_stack

from islands.infra.s3_server import client

CHROMIUM = Path("/usr/bin/chromium")
# The background-networking, component-update and sync flags keep Chromium from calling home,
# which on a closed network leaves it waiting on refused connections.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OUTPUT = Path(__file__).resolve().parent.parent / "test-output"
RUN = "ui-run"
# The run form's defaults (`islands serve --config`): a run small enough for a test. The form
# changes the region to one no bucket was made for, the run's name and its rounds.
FORM_DEFAULTS = """\
regions = ["north"]
rounds = 5
inner_steps = 8
eval_batches = 2
speed = {}
[quorum]
min_quorum = 1
"""


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


@pytest.fixture(scope="module")
def page():
    ensure_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1300})
        # The UI answers in seconds alone; on two cores shared with the rest of the suite a
        # navigation took over 45 s in CI (setup 72 s), so the waits allow 90.
        page.set_default_timeout(90_000)
        expect.set_options(timeout=90_000)
        yield page
        browser.close()


def shot(page: Page, name: str) -> Path:
    OUTPUT.mkdir(exist_ok=True)
    path = OUTPUT / name
    page.screenshot(path=path, full_page=True)
    assert path.stat().st_size > 10_000, f"{path} is (nearly) empty"
    return path


def shows(page: Page, *needles: str) -> None:
    """Wait until the page's text holds every needle; fails with what it does show."""
    for needle in needles:
        expect(page.locator("body")).to_contain_text(needle)


def form_field(page: Page, label: str) -> Locator:
    """One property of the run form, found by its label as a person finds it: the innermost of
    the form's labelled boxes that holds the label. get_by_label finds nothing here: the form's
    <label for=…> names an id that no input has."""
    return page.locator(".p-label", has=page.get_by_text(f"{label} (Optional)", exact=True)).last


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("islands-ui")
    defaults = home / "form.toml"
    defaults.write_text(FORM_DEFAULTS)
    with served_stack(home, ["islands-global"], ["--config", str(defaults)]) as served:
        yield served


@pytest.fixture(scope="module")
def watching(served, tmp_path_factory):
    """`islands status --watch`, started before the run and seen waiting for it: it has paid for
    its imports before the run starts, however busy the machine, and then looks every second."""
    _, env, _ = served
    log = tmp_path_factory.mktemp("watch") / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "islands.flows.cli", "status", RUN, "--json", "--watch", "1"],
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
def ui_run(served, watching, page):
    """A run started from training-run/local's Run form: its defaults, three fields edited."""
    stack, _, api = served
    dep = api.deployment("training-run/local")
    page.goto(f"{stack.ui_url}/deployments/deployment/{dep['id']}")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_role("button", name="Custom run").click()
    run_id = form_field(page, "Run Id")
    run_id.get_by_role("button", name="str", exact=True).click()
    run_id.get_by_role("textbox").fill(RUN)
    form_field(page, "Regions").get_by_role("textbox").fill("fresh")
    form_field(page, "Rounds").get_by_role("spinbutton").fill("2")
    shot(page, "ui-run-form.png")
    page.get_by_role("button", name="Submit", exact=True).click()
    page.wait_for_url(f"**/deployments/deployment/{dep['id']}?tab=Runs")  # the form's page, closed
    [run] = api.flow_runs(deployment_id={"any_": [dep["id"]]})
    config = run["parameters"]["config"]
    assert (config["run_id"], config["regions"], config["rounds"]) == (RUN, ["fresh"], 2), config
    assert config["inner_steps"] == 8 and config["quorum"]["min_quorum"] == 1, config
    return run


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


def test_the_run_page_shows_its_rounds_and_the_round_table(served, finished, page):
    stack, _, api = served
    rounds = api.flow_runs(name={"like_": f"{RUN}/round-"})
    assert sorted(r["name"] for r in rounds) == [f"{RUN}/round-001", f"{RUN}/round-002"], [r["name"] for r in rounds]

    page.goto(f"{stack.ui_url}/runs/flow-run/{finished['id']}")
    shows(page, RUN)
    page.get_by_text("Subflow Runs", exact=True).click()
    shows(page, f"{RUN}/round-001", f"{RUN}/round-002")
    shot(page, "ui-run-page.png")

    artifacts = api.artifacts(RUN)
    page.goto(f"{stack.ui_url}/artifacts/artifact/{artifacts[f'{RUN}-round-001']['id']}")
    shows(page, "fresh-0", "merged", "staleness", "Manifest")
    shot(page, "ui-round-table.png")

    page.goto(f"{stack.ui_url}/artifacts/artifact/{artifacts[f'{RUN}-report']['id']}")
    shows(page, "Quorum decisions", "Bytes sent", "Where everything is")
    expect(page.locator('img[src^="data:image/svg+xml;base64,"]').first).to_be_visible()
    shot(page, "ui-run-report.png")
