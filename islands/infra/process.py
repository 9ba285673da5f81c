"""Child processes of the local stack.

Each child starts in its own session, so the whole tree it spawns (uvicorn, flow-run
subprocesses) can be ended with one signal to its process group. Each group is also handed to
a reaper: a small process that holds the read end of a pipe this process alone writes to. When
this process ends, however it ends (SIGKILL, the OOM killer included), the pipe closes and the
reaper ends every group it was given, so no server is left listening.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
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


REAP_GRACE_S = 5.0  # a group the reaper ends has this long after SIGTERM before SIGKILL


class _Reaper:
    """The reaper of this process's children (`python -m islands.infra.process`), started with the first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner: int | None = None

    def adopt(self, pgid: int) -> None:
        """End group `pgid` when this process ends."""
        with self._lock:
            if self._proc is None or self._owner != os.getpid():  # a fork must not write its parent's pipe
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "islands.infra.process"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C in the terminal reaches the children, not it
                )
                self._owner = os.getpid()
            self._send(f"{pgid}")

    def release(self, pgid: int) -> None:
        """Forget group `pgid`, which has ended: its id may be given to an unrelated group later."""
        with self._lock:
            if self._proc is not None and self._owner == os.getpid():
                self._send(f"-{pgid}")

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(f"{line}\n".encode())
            self._proc.stdin.flush()
        except BrokenPipeError:  # the reaper is gone; nothing is left to tell
            pass


_reaper = _Reaper()


def reap(stdin=sys.stdin.buffer) -> None:
    """The reaper's loop: read process-group ids until end of file ("-ID" forgets one its parent
    has stopped), then end the groups still held one after another, the newest first, so that the
    learner runner's flow runs end (and report so) while the Prefect and S3 servers they talk to
    are still up: SIGTERM, and SIGKILL for what is left of a group after REAP_GRACE_S."""
    held: dict[int, None] = {}  # insertion-ordered
    for line in stdin:
        pgid = int(line)
        if pgid < 0:
            held.pop(-pgid, None)
        else:
            held[pgid] = None
    for pgid in reversed(held):
        _signal_group(pgid, signal.SIGTERM)
        _ended(pgid, time.monotonic() + REAP_GRACE_S)
        _signal_group(pgid, signal.SIGKILL)


def spawn(cmd: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start cmd in a new session with stdout and stderr appended to log_path; its group ends
    when this process does, if not before."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
    try:
        _reaper.adopt(proc.pid)
    except BaseException:
        stop_group(proc)
        raise
    return proc


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
    if not _ended(pgid, time.monotonic() + grace, proc):
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()
        _ended(pgid, time.monotonic() + 5.0)
    if proc.poll() is not None and not pid_alive(pgid, group=True):
        _reaper.release(pgid)


def _ended(pgid: int, deadline: float, leader: subprocess.Popen | None = None) -> bool:
    """Wait until group `pgid` (and its leader, reaped if it is our child) is gone, or the
    deadline passes; whether it is gone."""
    while True:
        if (leader is None or leader.poll() is not None) and not pid_alive(pgid, group=True):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


class ChildServer:
    """A server this process runs as a child process group: its URL once started, its pid, and a
    stop that ends the whole group. Subclasses start it and set `_proc` and `_url`."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError(f"the {type(self).__name__} is not running; call start() first")
        return self._url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self) -> None:
        if self._proc is not None:
            stop_group(self._proc)
            self._proc = None
        self._url = None


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reap()
