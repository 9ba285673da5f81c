"""islands/infra/prefect.yaml applied with Prefect's own CLI (islands/infra/apply.sh) against a local Prefect server:
its work pools and deployments exist; the Kubernetes job template has the shape Prefect's
Kubernetes worker expects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import prefect
import pytest
import yaml
from served_stack import Api

from islands.infra.prefect_server import PrefectServer

INFRA = Path(__file__).resolve().parent.parent / "islands" / "infra"
TEMPLATE = INFRA / "k8s" / "base-job-template.json"


def prefect_cli_env(api_url: str, home: Path) -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(home),
        "PYTHON": sys.executable,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-yaml")
    server = PrefectServer(home / "server.log")
    server.start({**os.environ, "PREFECT_HOME": str(home / "server")})
    try:
        env = prefect_cli_env(server.api_url, home / "cli")
        done = subprocess.run(
            [str(INFRA / "apply.sh"), "process"], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        yield Api(server.api_url), env
    finally:
        server.stop()


def test_every_pool_and_deployment_of_the_file_exists(applied):
    api, _ = applied
    spec = yaml.safe_load((INFRA / "prefect.yaml").read_text())
    pools = {p["name"] for p in spec["definitions"]["work_pools"].values()}
    found = {p["name"]: p for p in api.call("POST", "/work_pools/filter", {})}
    assert pools == {"islands-synchronizer", "islands-us-east", "islands-eu-west"} <= set(found)
    assert {found[p]["type"] for p in pools} == {"process"}

    deps = {
        f"{flow}/{d['name']}": d
        for flow, d in (
            (api.call("GET", f"/flows/{d['flow_id']}")["name"], d) for d in api.call("POST", "/deployments/filter", {})
        )
    }
    assert set(deps) == {"training-run/synchronizer", "outer-round/synchronizer", "learner/us-east", "learner/eu-west"}
    for region in ("us-east", "eu-west"):
        learner = deps[f"learner/{region}"]
        assert learner["work_pool_name"] == f"islands-{region}"
        assert learner["job_variables"]["s3_secret"] == f"islands-learner-{region}-s3"
    driver = deps["training-run/synchronizer"]
    assert driver["work_pool_name"] == "islands-synchronizer" and driver["enforce_parameter_schema"]
    # Learners are found as `learner/{region}`: exactly the deployments above.
    assert driver["parameters"]["config"]["learner_deployment"] == "learner/{region}"
    # Workers run the installed package: no code to pull, entrypoints are module paths.
    assert all(d["pull_steps"] == [] and "." in d["entrypoint"] and ":" not in d["entrypoint"] for d in deps.values())


def test_a_kubernetes_pool_takes_the_job_template(applied):
    api, env = applied
    cmd = [
        sys.executable,
        "-m",
        "prefect",
        "--no-prompt",
        "work-pool",
        "create",
        "islands-k8s-check",
        "--type",
        "kubernetes",
        "--base-job-template",
        str(TEMPLATE),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    pool = api.call("GET", "/work_pools/islands-k8s-check")
    assert pool["type"] == "kubernetes" and pool["base_job_template"] == json.loads(TEMPLATE.read_text())


def test_the_kubernetes_template_has_what_the_worker_expects():
    template = json.loads(TEMPLATE.read_text())
    # The shape prefect-kubernetes ships as its default, as the Prefect server knows it.
    registry = Path(prefect.__file__).parent / "server/api/collections_data/views/aggregate-worker-metadata.json"
    default = json.loads(registry.read_text())["prefect-kubernetes"]["kubernetes"]["default_base_job_configuration"]
    assert set(default["job_configuration"]) <= set(template["job_configuration"])
    manifest = template["job_configuration"]["job_manifest"]
    assert (manifest["apiVersion"], manifest["kind"]) == ("batch/v1", "Job")
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert (
        container["name"] == "prefect-job" and container["args"] == "{{ command }}" and container["env"] == "{{ env }}"
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert container["envFrom"] == [{"secretRef": {"name": "{{ s3_secret }}"}}]
    # Every placeholder is a declared variable, with a type the UI can render.
    variables = template["variables"]["properties"]
    used = set(re.findall(r"{{\s*(\w+)\s*}}", json.dumps(template["job_configuration"])))
    assert used <= set(variables), used - set(variables)
    assert set(template["variables"]["required"]) == {"s3_secret"}
    assert variables["gpus"]["type"] == "integer"
