"""A learner's view of the published rounds, kept fresh by a background thread.

The thread asks the global bucket for the next round's manifest every `poll_s` and fetches a
newly published round's model as soon as it appears, so a learner never stops to download: it
starts each phase from the newest round it holds and folds a round published mid-phase into that
phase (`InnerTrainer.run_phase(rebase=...)`). Only this thread fetches models.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
Held = tuple[int, Any]  # (round, what `fetch` returned for it)


class RoundFollower:
    def __init__(
        self, newest_round: Callable[[int | None], int | None], fetch: Callable[[int, Held | None], Any], poll_s: float
    ) -> None:
        """`newest_round(held)`: the newest published round, given the round held now (None
        before the first); `fetch(round, held)`: that round's model, given the round and model
        held now (the fetch can then take the small way from it)."""
        self._newest_round, self._fetch, self._poll_s = newest_round, fetch, poll_s
        self._held: Held | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, run: str) -> RoundFollower:
        """Fetch the newest round now (errors surface here), then follow in the background."""
        if not self._refresh():
            raise RuntimeError(f"run {run} has no published round yet; start it with `islands run`")
        self._thread = threading.Thread(target=self._follow, name="round-follower", daemon=True)
        self._thread.start()
        return self

    def held(self) -> Held:
        """The newest round fetched and its model."""
        assert self._held is not None, "start() first"
        return self._held

    def wait_newer(self, than: int, timeout_s: float) -> int:
        """The newest round held, waiting up to `timeout_s` for one newer than `than`."""
        with self._changed:
            self._changed.wait_for(lambda: self.held()[0] > than, timeout=timeout_s)
            return self.held()[0]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self._poll_s + 30)

    def _refresh(self) -> bool:
        newest = self._newest_round(None if self._held is None else self._held[0])
        if newest is None:
            return False
        if self._held is None or newest > self._held[0]:
            model = self._fetch(newest, self._held)
            with self._changed:
                self._held = (newest, model)
                self._changed.notify_all()
        return True

    def _follow(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self._refresh()
            except Exception as exc:  # noqa: BLE001 - a failed poll is retried; the learner trains on
                log.warning("following the published rounds: %s: %s (retrying)", type(exc).__name__, exc)
