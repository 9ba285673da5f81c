"""`islands serve` against the embedded stack: the deployments and their run form, a schedule that
starts a run by itself, values the form refuses, and `islands status` of the finished run.
(A run started as the UI form does, seen running and finished: test_ui_browser.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error

import pytest
from served_stack import islands, served_stack

INTERVAL_S = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("islands-serve")
    files = home / "files"
    config = home / "tiny.toml"
    # The scheduled run: one region, one round, a few steps, buckets in a local folder.
    config.write_text(
        f'regions = ["solo"]\nrounds = 1\ninner_steps = 4\neval_batches = 2\nstore = "file://{files}/{{bucket}}"\n'
        "[quorum]\nmin_quorum = 1\n"
    )
    args = ["--config", str(config), "--interval", str(INTERVAL_S)]
    with served_stack(home, ["islands-global", "islands-solo"], args) as (stack, env, api):
        yield stack, env, api, files


@pytest.fixture(scope="module")
def scheduled_run(served):
    """The first run the schedule made, once it has started by itself (only that one is kept, so
    the machine trains one tiny run, not one every INTERVAL_S)."""
    _, _, api, _ = served
    dep = api.deployment("training-run/local")
    deadline = time.monotonic() + 60
    while not (runs := api.flow_runs(deployment_id={"any_": [dep["id"]]})):
        assert time.monotonic() < deadline, "the interval schedule made no run"
        time.sleep(0.5)
    first, later = runs[0], runs[1:]
    for run in later:
        api.call("POST", f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLED"}, "force": True})
    while api.call("GET", f"/flow_runs/{first['id']}")["state_type"] == "SCHEDULED":
        assert time.monotonic() < deadline + INTERVAL_S, "the scheduled run never started"
        time.sleep(0.5)
    api.call("POST", f"/deployments/{dep['id']}/pause_deployment")  # and deletes what it scheduled since
    return api.wait_final(first["id"], timeout_s=180), dep


def test_deployments_show_a_form_with_defaults_and_help(served):
    _, _, api, _ = served
    run = api.deployment("training-run/local")
    assert api.deployment("outer-round/local")["enforce_parameter_schema"]
    assert api.deployment("learner/local")["name"] == "local"
    assert run["enforce_parameter_schema"]
    schema = run["parameter_openapi_schema"]
    fields = schema["definitions"]["RunConfig"]["properties"]
    assert fields["inner_steps"]["description"].startswith("H:")
    assert fields["learners_per_region"]["default"] == 1 and fields["learners_per_region"]["maximum"] == 64
    assert schema["definitions"]["QuorumSettings"]["properties"]["min_quorum"]["minimum"] == 1
    # The form's defaults are the config `islands serve` was given.
    assert run["parameters"]["config"]["regions"] == ["solo"] and run["parameters"]["config"]["rounds"] == 1
    assert [s["schedule"]["interval"] for s in run["schedules"]] == [INTERVAL_S]


def test_an_interval_schedule_starts_a_run_by_itself(scheduled_run):
    run, _ = scheduled_run
    assert "auto-scheduled" in run["tags"]
    assert run["state_type"] == "COMPLETED", run["state"]


def test_a_scheduled_run_leaves_its_artifacts(served, scheduled_run):
    _, env, api, files = served
    run, _ = scheduled_run
    run_id = next(p.name for p in (files / "global" / "runs").iterdir())
    found = api.artifacts(run_id)
    assert {f"{run_id}-round-001", f"{run_id}-round-001-manifest", f"{run_id}-progress", f"{run_id}-report"} <= set(
        found
    )
    table = json.loads(found[f"{run_id}-round-001"]["data"])
    # The learner never waits, so a second 4-step phase may be in before the round closes.
    assert table and all(row["learner"] == "solo-0" and row["status"] == "merged" for row in table)
    assert found[f"{run_id}-progress"]["data"] == 100.0
    report = found[f"{run_id}-report"]["data"]
    assert "data:image/svg+xml;base64," in report and "## Quorum decisions" in report
    assert f"{files}/global/runs/{run_id}/rounds/" in report
    assert found[f"{run_id}-round-001-manifest"]["data"].endswith("000001/manifest.json)")


def test_the_form_refuses_a_value_the_schema_forbids(served):
    _, _, api, _ = served
    dep = api.deployment("training-run/local")
    bad = {**dep["parameters"]["config"], "rounds": 0}
    with pytest.raises(urllib.error.HTTPError) as refused:
        api.call("POST", f"/deployments/{dep['id']}/create_flow_run", {"parameters": {"config": bad}})
    assert refused.value.code in (409, 422)
    assert "rounds" in refused.value.read().decode()


def test_a_run_with_inconsistent_fields_fails_at_once_naming_the_field(served, scheduled_run):
    _, _, api, _ = served
    _, dep = scheduled_run
    bad = {**dep["parameters"]["config"], "quorum": {"min_quorum": 3}}
    created = api.call("POST", f"/deployments/{dep['id']}/create_flow_run", {"parameters": {"config": bad}})
    run = api.wait_final(created["id"], timeout_s=60)
    assert run["state_type"] == "FAILED"
    assert "min_quorum" in run["state"]["message"], run["state"]["message"]


def test_status_of_the_finished_scheduled_run(served, scheduled_run):
    _, env, _, files = served
    run_id = next(p.name for p in (files / "global" / "runs").iterdir())
    out = islands(env, "status", run_id, "--store", f"file://{files}/{{bucket}}", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["state"] == "finished" and status["rounds_published"] == 1
    assert status["rounds"][0]["contributors"] and set(status["rounds"][0]["contributors"]) == {"solo-0@s0"}
    assert status["learners"][0]["status"] == "done" and status["learners"][0]["flow_run"] == "COMPLETED"


def test_status_of_an_unknown_run_says_so(served):
    _, env, _, _ = served
    out = islands(env, "status", "no-such-run")
    assert out.returncode == 2 and "no-such-run: no such run" in out.stderr


PROBE = """
import sys


def imported(queue):
    queue.put(sorted(m for m in ("torch", "prefect", "islands.flows.training_run") if m in sys.modules))
"""

FORKS = """
import inspect

import cloudpickle
import prefect.flow_engine

from islands.core.config import RunConfig
from islands.flows.serve import fork_flow_runs
from islands.flows.training_run import training_run
from probe import imported

print('multiprocessing.get_context("spawn")' in inspect.getsource(prefect.flow_engine.run_flow_in_subprocess))
fork_flow_runs(["islands.flows.training_run"])
context = prefect.flow_engine.multiprocessing.get_context("spawn")
queue = context.SimpleQueue()
child = context.Process(target=imported, args=(queue,))
child.start()
print(queue.get())
child.join()
copy = cloudpickle.loads(cloudpickle.dumps(training_run))
print(copy is training_run, type(copy.validate_parameters({"config": RunConfig().model_dump(mode="json")})["config"]).__name__)
"""


def test_served_flow_runs_are_forks_of_a_process_that_imported_the_flows(tmp_path):
    """Prefect starts a served flow's run in multiprocessing's "spawn" context; `islands serve`
    swaps in a fork server that has imported torch, Prefect and the flows, and pickles the flow
    as a reference, so its parameters' types still resolve in the fork."""
    (tmp_path / "probe.py").write_text(PROBE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", FORKS],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["True", "['islands.flows.training_run', 'prefect', 'torch']", "True RunConfig"]


FIRST_STEP = """
import importlib
import os
import sys

from islands.flows.serve import PRELOAD

for name in PRELOAD:
    importlib.import_module(name)
before = set(sys.modules)
from islands.core.data import BatchSampler
from islands.core.config import InnerSettings
from islands.core.inner import InnerTrainer
from islands.core.model import build_model
from islands.storage.store import Stores

Stores("s3://islands-{bucket}", ["north"])  # what a learner opens first: fsspec imports s3fs for it
model = build_model("tiny", 0)
InnerTrainer(model, BatchSampler(os.urandom(1 << 16), 2, model.config.block_size, seed=0), InnerSettings()).train_step()
print(len(set(sys.modules) - before), sorted(set(sys.modules) - before)[:10])
"""


def test_the_fork_servers_preload_holds_what_a_learner_imports_before_its_first_step():
    """A module a learner first imports after the fork is imported again by every learner:
    torch.optim's first optimizer alone pulls in torch._dynamo and sympy, 800 modules, and the
    learner's first store s3fs, aiobotocore and aiohttp."""
    out = subprocess.run([sys.executable, "-c", FIRST_STEP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, _ = out.stdout.split(" ", 1)
    assert int(count) <= 5, out.stdout
