"""Child processes of the local stack.

Each child starts in its own session, so the whole tree it spawns (uvicorn, flow-run
subprocesses) can be ended with one signal to its process group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def port_open(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((LOOPBACK, port)) == 0


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status url answers with, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (OSError, ValueError):
        return None


def spawn(cmd: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """Start cmd in a new session with stdout and stderr appended to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(cmd),
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def log_tail(log_path: Path, lines: int = 30) -> str:
    """The last lines of a child's log, for error messages."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def wait_ready(
    proc: subprocess.Popen,
    ready: Callable[[], bool],
    timeout: float,
    what: str,
    log_path: Path,
) -> None:
    """Wait until ready() holds; fail fast, with the log tail, if the child dies or stalls."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {proc.returncode} before it was ready. "
                f"Last lines of {log_path}:\n{log_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{what} was not ready after {timeout:.0f} s. Last lines of {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(0.2)


def pid_alive(pid: int, group: bool = False) -> bool:
    """Whether a process (or, with group=True, a process group) with this id exists on this
    machine, whoever owns it."""
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the child's process group, SIGKILL what is left after grace seconds.

    The group is signalled even when the leader has already exited, because its
    children may outlive it.
    """
    pgid = proc.pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        if proc.returncode is not None and not pid_alive(pgid, group=True):
            return
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5.0
    while pid_alive(pgid, group=True) and time.monotonic() < deadline:
        time.sleep(0.1)
