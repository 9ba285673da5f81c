"""Which learners are known down, kept in the global bucket by the driver that launched them.

The driver watches its learners' flow runs; when one fails or crashes it records the learner
"down" (with the reason) before it does anything else, so that the round in progress stops
waiting for it, and "up" again when it relaunches it. The synchronizer reads the newest event of
each learner, by (driver epoch, event number): a resumed driver relaunches every learner and
records each "up", so what an earlier driver saw never outlives it. Only the driver writes here.
"""

from __future__ import annotations

import json

from islands.storage import layout
from islands.storage.store import ObjectStore


def record(store: ObjectStore, run: str, learner: str, epoch: int, seq: int, state: str, reason: str = "") -> None:
    """Write one event; a retry of the same event is a no-op (create-only key)."""
    body = json.dumps({"learner": learner, "epoch": epoch, "state": state, "reason": reason}, sort_keys=True)
    store.put_if_absent(layout.liveness_key(run, learner, epoch, seq, state), body.encode())


def down(store: ObjectStore, run: str) -> dict[str, str]:
    """{learner: why} of every learner whose newest event says it is down."""
    newest: dict[str, tuple[tuple[int, int], str, str]] = {}
    for key in store.list(layout.liveness_prefix(run)):
        parsed = layout.parse_liveness_key(key)
        if parsed is None:
            continue
        learner, epoch, seq, state = parsed
        if learner not in newest or (epoch, seq) > newest[learner][0]:
            newest[learner] = ((epoch, seq), state, key)
    out = {}
    for learner, (_, state, key) in newest.items():
        if state == "down":
            try:
                out[learner] = str(json.loads(store.get(key)).get("reason", ""))[:300]
            except (ValueError, AttributeError):
                out[learner] = "down"
    return out
