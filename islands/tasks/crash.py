"""Named crash points: places where a process of the run can be made to die for real (SIGKILL, no
cleanup, no `finally`), so that resuming from every awkward moment is tested, not assumed.

`ISLANDS_CRASH=POINT[@N]` arms one point in this process; N is the round for synchronizer and
driver points and the phase for learner points, and without it the first time the point is
reached kills. Learners run in other processes, so the driver hands its setting on to the
learners it launches (`armed()` / `crash_point(..., spec=...)`).
"""

from __future__ import annotations

import os
import signal

ENV = "ISLANDS_CRASH"

POINTS = {
    "phase.before_delta": "learner: phase trained, its delta not yet written",
    "phase.after_delta": "learner: delta written, learner state not yet",
    "phase.after_state": "learner: delta and state written, next phase not begun",
    "collect.done": "synchronizer: deltas collected, nothing of the round written",
    "publish.after_model": "synchronizer: θ_r written, its update and outer state maybe in flight, no manifest",
    "publish.after_outer": "synchronizer: θ_r, its update and outer state written, manifest not yet",
    "publish.after_manifest": "synchronizer: round committed, not yet evaluated",
    "round.after_publish": "driver: round published, next round not started",
}
LEARNER_POINTS = frozenset(p for p in POINTS if p.startswith("phase."))
SYNCHRONIZER_POINTS = frozenset(p for p in POINTS if p.startswith(("collect.", "publish.")))


class CrashSpecError(ValueError):
    """A crash setting that names no crash point; the message lists the valid ones."""


def parse(spec: str) -> tuple[str, int | None]:
    """`POINT[@N]` → (point, N or None)."""
    point, sep, at = spec.strip().partition("@")
    if point not in POINTS:
        raise CrashSpecError(f"{ENV}={spec!r}: unknown crash point {point!r}; valid points: {', '.join(POINTS)}")
    if not sep:
        return point, None
    try:
        n = int(at.removeprefix("round").removeprefix("phase"))
    except ValueError:
        raise CrashSpecError(f"{ENV}={spec!r}: after '@' give a round or phase number, e.g. {point}@2") from None
    if n < 0:
        raise CrashSpecError(f"{ENV}={spec!r}: the round or phase number must be >= 0")
    return point, n


def armed() -> str | None:
    """This process's crash setting, checked (raises CrashSpecError when it is wrong)."""
    spec = os.environ.get(ENV) or None
    if spec is not None:
        parse(spec)
    return spec


def crash_point(name: str, n: int | None = None, spec: str | None = None) -> None:
    """Die here with SIGKILL if `spec` (default: $ISLANDS_CRASH) names this point (and `n`)."""
    if name not in POINTS:
        raise CrashSpecError(f"crash point {name!r} is not registered; valid points: {', '.join(POINTS)}")
    spec = spec if spec is not None else os.environ.get(ENV)
    if not spec:
        return
    point, at = parse(spec)
    if point == name and (at is None or at == n):
        os.kill(os.getpid(), signal.SIGKILL)
