"""The embedded local stack: an S3 endpoint, a Prefect API + UI, and the learner runner,
all on 127.0.0.1 and all owned by one process that ends them together.

A long-lived `islands up` records its stack in `<data_dir>/stack.json` so a later
`islands run` can use it instead of starting its own.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from islands.infra.prefect_server import PrefectServer, api_healthy, ui_url_for
from islands.infra.process import free_port, pid_alive, spawn, stop_group
from islands.infra.s3_server import CREDENTIALS, create_buckets, s3_answers
from islands.infra.seaweed import SeaweedServer

__all__ = ["LocalStack", "default_data_dir", "find_running", "free_port", "stack_env"]

STATE_FILE = "stack.json"


def default_data_dir() -> Path:
    """$ISLANDS_HOME, else ./.islands in the current directory."""
    return Path(os.environ.get("ISLANDS_HOME") or Path.cwd() / ".islands").absolute()


def stack_env(data_dir: Path, s3_url: str | None, api_url: str) -> dict[str, str]:
    """The variables every process of a run needs to reach this stack's Prefect and, unless
    s3_url is None (the run has a store of its own), its S3 endpoint with the test credentials."""
    prefect = {
        # Where flows and learners send flow runs, logs and artifacts.
        "PREFECT_API_URL": api_url,
        # Links printed in flow-run logs point at this UI.
        "PREFECT_UI_URL": ui_url_for(api_url),
        # Profiles and local storage stay in the data folder, not ~/.prefect.
        "PREFECT_HOME": str(data_dir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # flow.serve picks up a new learner run within a second instead of ten.
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        # Server and clients are the same installed Prefect; skip the version round trip.
        "PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false",
    }
    if s3_url is None:
        return prefect
    return {
        **prefect,
        # boto3, aiobotocore and s3fs all read these.
        "AWS_ENDPOINT_URL": s3_url,
        # Retry through a stalled or flaky endpoint instead of failing the run: standard mode
        # backs off exponentially (up to 20 s) and also retries throttling and timeouts.
        "AWS_RETRY_MODE": "standard",
        "AWS_MAX_ATTEMPTS": "10",
        **CREDENTIALS,
    }


def find_running(data_dir: Path) -> dict | None:
    """The record of a live stack serving data_dir ({pid, s3_url, api_url, ui_url}), or None.

    A record whose process is gone or whose servers do not answer is removed.
    """
    path = data_dir / STATE_FILE
    try:
        record = json.loads(path.read_text())
        alive = pid_alive(int(record["pid"])) and api_healthy(record["api_url"]) and s3_answers(record["s3_url"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        alive = False
    if not alive:
        path.unlink(missing_ok=True)
        return None
    return {k: record[k] for k in ("pid", "s3_url", "api_url", "ui_url")}


class LocalStack:
    """Starts and stops the local stack; use as a context manager.

    The S3 endpoint keeps its buckets in `<data_dir>/seaweedfs`, written as they are written.
    """

    def __init__(
        self,
        data_dir: Path,
        buckets: list[str],
        serve_learners: bool = True,
        s3_front: Callable[[str], str] | None = None,
        keep: bool = True,
        s3: bool = True,
    ):
        """`s3_front` maps the S3 server's URL to the one every client is given (a fault proxy).
        With keep=False the buckets are deleted at stop (a throwaway stack). With s3=False no S3
        endpoint is started: the run has a store of its own, which every child reaches with the
        caller's own AWS settings."""
        self.s3_front = s3_front
        self.keep = keep
        self._client_s3_url: str | None = None
        self.data_dir = Path(data_dir).absolute()
        self.buckets = list(buckets)
        self.serve_learners = serve_learners
        self.logs = self.data_dir / "logs"
        self.s3 = SeaweedServer(self.data_dir / "seaweedfs", self.logs / "s3-server.log") if s3 else None
        self.prefect = PrefectServer(self.logs / "prefect-server.log")
        self._runner: subprocess.Popen | None = None
        self._recorded = False
        self._old_sigterm = None

    @property
    def s3_url(self) -> str | None:
        return self.s3.url if self.s3 else None

    @property
    def api_url(self) -> str:
        return self.prefect.api_url

    @property
    def ui_url(self) -> str:
        return self.prefect.ui_url

    def env(self) -> dict[str, str]:
        """Variables for the caller and every child; see `stack_env`."""
        return stack_env(self.data_dir, self._client_s3_url or self.s3_url, self.api_url)

    def _child_env(self, **extra: str) -> dict[str, str]:
        """This process's environment and `extra`; with the embedded S3 endpoint, none of the
        caller's own AWS settings (a profile, a session token) beside its test credentials."""
        inherited = {k: v for k, v in os.environ.items() if self.s3 is None or not k.startswith("AWS_")}
        return {**inherited, **extra}

    def start(self, record: bool = False) -> LocalStack:
        """Start S3, Prefect and, if asked, the learner runner.

        With record=True, write `<data_dir>/stack.json` so other commands can find it.
        Whatever was started is stopped again if a later step fails.
        """
        running = find_running(self.data_dir)
        if running is not None:
            raise RuntimeError(
                f"A local stack for {self.data_dir} is already running (pid {running['pid']}, "
                f"UI {running['ui_url']}). Use it, or stop that process first."
            )
        atexit.register(self.stop)
        prefect_home = str(self.data_dir / "prefect")
        try:
            self.prefect.launch(self._child_env(PREFECT_HOME=prefect_home))
            if self.s3 is not None:
                self.s3.start(self._child_env())
                create_buckets(self.s3_url, self.buckets)
            if self.s3_front is not None:
                self._client_s3_url = self.s3_front(self.s3_url)
            self.prefect.wait()
            if self.serve_learners:
                self._runner = spawn(
                    [sys.executable, "-m", "islands.flows.serve"],
                    self._child_env(**self.env()),
                    self.logs / "learner-runner.log",
                )
            if record:
                self._record()
        except BaseException:
            self.stop()
            raise
        return self

    def _record(self) -> None:
        path = self.data_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "s3_url": self.s3_url,
                    "api_url": self.api_url,
                    "ui_url": self.ui_url,
                },
                indent=2,
            )
        )
        tmp.replace(path)
        self._recorded = True

    def pids(self) -> list[int]:
        """Process ids of the children started (each leads its own process group)."""
        procs = [self.s3.pid if self.s3 else None, self.prefect.pid, self._runner.pid if self._runner else None]
        return [p for p in procs if p is not None]

    def stop(self) -> None:
        """End every child process group, the learner runner first (its learners write to
        the servers), then the servers. Safe to call twice."""
        if self._runner is not None:
            stop_group(self._runner)
            self._runner = None
        self.prefect.stop()
        if self.s3 is not None:
            self.s3.stop()
            if not self.keep:
                shutil.rmtree(self.s3.data_dir, ignore_errors=True)
        if self._recorded:
            (self.data_dir / STATE_FILE).unlink(missing_ok=True)
            self._recorded = False
        atexit.unregister(self.stop)

    def __enter__(self) -> LocalStack:
        # SIGTERM would end the process without running __exit__ or atexit; make it an exit.
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        except ValueError:
            pass  # not the main thread: signals cannot be handled here
        return self.start() if not self.pids() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
