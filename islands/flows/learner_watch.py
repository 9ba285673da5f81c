"""The driver's watch over its learners: a learner whose flow run fails or crashes is a first-class
event, not a silence that rounds wait out.

A background thread reads the learners' flow runs from the Prefect API about once a second. When
one has failed, crashed or was cancelled while the run goes on, the watch records the learner down
in the global bucket at once (islands.storage.liveness), so the round in progress stops waiting for
it, and reports it — learner, region, reason — in the driver's log (the UI) and the terminal. The
driver relaunches it from its saved state between rounds, in its own thread (so the new flow run
is the driver's child in the UI), at most `learner_relaunches` times; after that the learner is
given up, and once no learner is left the run ends.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from islands.core.config import RunConfig
from islands.storage import liveness
from islands.storage.store import ObjectStore

EVERY_S = 1.0


@dataclass
class Learner:
    region: str
    flow_run: UUID | None = None
    relaunches: int = 0
    seq: int = 0  # this driver's liveness events for the learner so far
    down: str | None = None  # why it is down, while it is
    deliberate: bool = False  # taken down on purpose (a fault rehearsal): not relaunched
    given_up: bool = False
    runs: list[UUID] = field(default_factory=list)


def one_line(message: str | None) -> str:
    lines = [line.strip() for line in (message or "").splitlines() if line.strip()]
    return (lines[-1] if lines else "its flow run ended without a message")[:300]


# Prefect's worker: "Flow run infrastructure exited with non-zero status code -9."; its runner and
# other workers name an exit code or the signal.
KILLED = re.compile(r"(exit|status) code:? (-9|137)\b|signal:? 9\b|SIGKILL", re.IGNORECASE)
OOM_HINT = "killed by the kernel, likely out of memory: lower inner.micro_batch_size, or run fewer learners per machine"


def death(state_name: str, message: str | None) -> str:
    """Why a learner's flow run ended, in one line; a process the kernel killed (SIGKILL: exit
    code -9 or 137, the OOM killer's way) says what to change."""
    why = f"{state_name}: {one_line(message)}"
    if state_name == "Crashed" and KILLED.search(message or ""):
        why += f"; {OOM_HINT}"
    return why


class LearnerWatch:
    def __init__(
        self,
        config: RunConfig,
        store: ObjectStore,
        epoch: int,
        report: Callable[[str], None],
        every_s: float = EVERY_S,
    ):
        self.config, self.store, self.epoch, self.report, self.every_s = config, store, epoch, report, every_s
        self.learners = {name: Learner(region) for name, region, _ in config.learners()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the driver tells it ---------------------------------------------------------------

    def launched(self, learner: str, flow_run: UUID) -> None:
        """`learner` runs as `flow_run` from now on: recorded up."""
        with self._lock:
            state = self.learners[learner]
            state.flow_run, state.down, state.deliberate = flow_run, None, False
            state.runs.append(flow_run)
            self._record(learner, state, "up", "")

    def taken_down(self, learners: list[str], why: str) -> None:
        """These learners are about to be stopped on purpose: down, and not relaunched."""
        with self._lock:
            for learner in learners:
                state = self.learners[learner]
                state.down, state.deliberate = why, True
                self._record(learner, state, "down", why)

    # -- what the driver asks --------------------------------------------------------------------

    def to_relaunch(self) -> list[tuple[str, str]]:
        """(learner, region) of each learner down by accident with relaunches left; the ones
        without are given up here, and reported."""
        out = []
        with self._lock:
            for name, state in self.learners.items():
                if state.down is None or state.deliberate or state.given_up:
                    continue
                if state.relaunches < self.config.learner_relaunches:
                    state.relaunches += 1
                    out.append((name, state.region))
                else:
                    state.given_up = True
                    self.report(
                        f"learner {name} ({state.region}) given up after {state.relaunches} relaunches: {state.down}"
                    )
        return out

    def given_up(self) -> dict[str, str]:
        with self._lock:
            return {n: s.down or "" for n, s in self.learners.items() if s.given_up}

    def none_left(self) -> bool:
        """No learner runs, and none will be relaunched."""
        with self._lock:
            return all(s.given_up or (s.down is not None and s.deliberate) for s in self.learners.values())

    def flow_runs(self) -> list[UUID]:
        with self._lock:
            return [run for s in self.learners.values() for run in s.runs]

    # -- the thread ------------------------------------------------------------------------------

    def check(self) -> None:
        """One look at the learners' current flow runs."""
        with self._lock:
            watched = {s.flow_run: name for name, s in self.learners.items() if s.flow_run and s.down is None}
        if not watched:
            return
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(watched))))
        for run in runs:
            state = run.state
            if state is None or not state.is_final() or state.is_completed():
                continue
            name = watched[run.id]
            why = death(state.name, state.message)
            with self._lock:
                learner = self.learners[name]
                if learner.flow_run != run.id or learner.down is not None:
                    continue
                learner.down = why
                self._record(name, learner, "down", why)
            self.report(f"learner {name} ({learner.region}) died: {why}")

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the API or the store may be away a while; look again
                if self._stop.is_set():
                    return
                self.report(f"could not look at the learners' flow runs ({type(exc).__name__}: {exc}); trying again")

    def _record(self, learner: str, state: Learner, event: str, why: str) -> None:
        state.seq += 1
        liveness.record(self.store, self.config.run_id, learner, self.epoch, state.seq, event, why)

    def __enter__(self) -> LearnerWatch:
        self._thread = threading.Thread(target=self._loop, name="learner-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching: the run is over, and learners ending now are not deaths."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __exit__(self, *exc: object) -> None:
        self.stop()
