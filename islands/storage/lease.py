"""The driver's lease, kept in the global bucket so that learners anywhere can see it.

Every driver start (`islands run`, `islands resume`) claims the next *epoch* with put-if-absent
and then writes a heartbeat object every few seconds. A learner belongs to one epoch and stops
when a newer epoch exists (a resume took over: it must not keep writing beside the learners the
resume launches) or when its driver's heartbeat has not moved for `LEASE_S` of the learner's own
clock (the driver died and nobody resumed: it must not train on for ever). Comparing heartbeat
sequence numbers, not timestamps, keeps clocks of different regions out of it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from islands.storage import layout
from islands.storage.store import ObjectStore, StoreError

BEAT_S = 5.0
LEASE_S = 60.0  # well above an S3 stall that clients ride out by retrying
CLAIM_TRIES = 20  # epochs tried before giving up: each lost try is another driver starting at once


def epochs(store: ObjectStore, run: str) -> dict[int, int]:
    """Each claimed epoch with its newest heartbeat sequence number (-1 before the first)."""
    out: dict[int, int] = {}
    for key in store.list(layout.drivers_prefix(run)):
        parsed = layout.parse_driver_key(key)
        if parsed is not None:
            epoch, seq = parsed
            out[epoch] = max(out.get(epoch, -1), -1 if seq is None else seq)
    return out


def claim(store: ObjectStore, run: str, info: dict) -> int:
    """Claim the next epoch for this driver; two drivers starting at once get different ones.

    Each try asks for an epoch above every one listed and above the one it lost last, so a store
    whose listing lags behind its writes cannot make it ask for the same key again; after
    CLAIM_TRIES lost tries it gives up rather than spin."""
    body, tried = json.dumps(info, sort_keys=True).encode(), -1
    for _ in range(CLAIM_TRIES):
        epoch = max(max(epochs(store, run), default=-1), tried) + 1
        if store.put_if_absent(layout.driver_key(run, epoch), body):
            return epoch
        tried = epoch
    raise StoreError(
        f"{store.url}: run {run}: {CLAIM_TRIES} driver epochs in a row were taken before this driver could "
        f"claim one (up to epoch {tried}); is another `islands run` or `resume` of {run} starting over and over?"
    )


class Heartbeat:
    """Beats for one epoch from a background thread while the driver lives (a context manager)."""

    def __init__(self, store: ObjectStore, run: str, epoch: int, every_s: float = BEAT_S):
        self.store, self.run, self.epoch, self.every_s = store, run, epoch, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{run}", daemon=True)

    def _loop(self) -> None:
        seq = 0
        while not self._stop.is_set():
            try:
                self.store.put_if_absent(layout.beat_key(self.run, self.epoch, seq), b"")
                if seq >= 2:
                    self.store.delete(layout.beat_key(self.run, self.epoch, seq - 2))
                seq += 1
            except Exception:  # noqa: BLE001 - a missed beat is retried; only a long silence counts
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class Watch:
    """A learner's view of its driver: `verdict()` is None while it may go on."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        epoch: int,
        lease_s: float = LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.run, self.epoch, self.lease_s, self.clock = store, run, epoch, lease_s, clock
        self._seq: int | None = None
        self._moved_at = clock()
        self.superseded = False

    def verdict(self) -> str | None:
        """Why this learner must stop now, or None."""
        seen = epochs(self.store, self.run)
        newer = [e for e in seen if e > self.epoch]
        if newer:
            self.superseded = True
            return f"driver epoch {max(newer)} took over from epoch {self.epoch} (a resume launches its own learners)"
        seq = seen.get(self.epoch)
        if seq != self._seq:
            self._seq, self._moved_at = seq, self.clock()
        elif self.clock() - self._moved_at > self.lease_s:
            return (
                f"driver epoch {self.epoch} has not beaten for {self.lease_s:.0f} s: the driver is gone; "
                f"`islands resume {self.run}` continues the run"
            )
        return None
