"""The local Prefect API and UI: `prefect server start` as a child process.

Its SQLite database lives in PREFECT_HOME under the stack's data folder, so flow-run
history in the UI persists from one `islands run` to the next; it is migrated once per
installed Prefect (infra.prefect_db).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from islands.infra import prefect_db
from islands.infra.process import LOOPBACK, free_port, http_status, spawn, stop_group, wait_ready

# Server services the embedded stack never uses: automations (triggers), work-pool workers
# (foreman, cleanup_reconciler), late-run marking, pauses and concurrency leases. Each polls the
# database or reacts to every event, which on two cores slows the runs beside it. The scheduler
# (interval and cron schedules), the task-run recorder (task runs in the UI), the event persister
# and cancellation cleanup stay.
UNUSED_SERVICES = ("TRIGGERS", "FOREMAN", "CLEANUP_RECONCILER", "LATE_RUNS", "PAUSE_EXPIRATIONS", "REPOSSESSOR")


def api_healthy(api_url: str) -> bool:
    """Whether the Prefect API at api_url answers its health check."""
    return http_status(api_url + "/health") == 200


def ui_url_for(api_url: str) -> str:
    """The UI is served by the same server, at the root above /api."""
    return api_url.removesuffix("/api")


class PrefectServer:
    """`prefect server start` on 127.0.0.1 with its home in a given folder."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._api_url: str | None = None
        self._db: prefect_db.Database | None = None

    @property
    def api_url(self) -> str:
        if self._api_url is None:
            raise RuntimeError("the Prefect server is not running; call launch() first")
        return self._api_url

    @property
    def ui_url(self) -> str:
        return ui_url_for(self.api_url)

    @property
    def database(self) -> prefect_db.Database | None:
        """The SQLite database of the last launch (None: the server was given another)."""
        return self._db

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def launch(self, env: Mapping[str, str]) -> str:
        """Start the server without waiting; returns the API URL it will answer on.

        env must carry PREFECT_HOME. Split from `wait` so the caller can start other
        servers while this one boots (seconds, most of it migrating a fresh database).
        """
        self._db = prefect_db.prepare(env)
        port = free_port()
        self._api_url = f"http://{LOOPBACK}:{port}/api"
        self._proc = spawn(
            [sys.executable, "-m", "prefect", "server", "start", "--host", LOOPBACK, "--port", str(port)],
            {
                **env,
                # The UI asks the server where the API is; without these it says :4200.
                "PREFECT_API_URL": self._api_url,
                "PREFECT_SERVER_API_HOST": LOOPBACK,
                "PREFECT_SERVER_API_PORT": str(port),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_SERVER_UI_ENABLED": "true",
                "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
                **{f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in UNUSED_SERVICES},
                **(self._db.server_env() if self._db else {}),
            },
            self.log_path,
        )
        return self._api_url

    def wait(self, timeout: float = 240.0) -> None:
        """Block until /api/health answers; raise with the server log tail if it does not.

        Only a server that exited blames its database (a template that would not open); one that
        is merely slow, on a machine busy with other work, leaves the template for the next."""
        if self._proc is None:
            raise RuntimeError("the Prefect server was not launched")
        try:
            wait_ready(
                self._proc,
                lambda: api_healthy(self.api_url),
                timeout,
                f"The Prefect server ({self.api_url})",
                self.log_path,
            )
        except BaseException:
            if self._db and self._proc.poll() is not None:
                self._db.failed()
            raise
        if self._db:
            self._db.started()

    def start(self, env: Mapping[str, str], timeout: float = 240.0) -> str:
        """Launch and wait; returns the API URL."""
        self.launch(env)
        self.wait(timeout)
        return self.api_url

    def stop(self) -> None:
        if self._proc is not None:
            stop_group(self._proc)
            self._proc = None
        self._api_url = None
