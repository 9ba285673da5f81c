"""When a round stops collecting deltas: a pure function of arrivals, history and the clock.

Nothing here sleeps or reads the time, so a scripted timeline tests it exactly and the caller keeps
control of waiting (it can sleep until `recheck_at` or until the next delta lands).

Closing on a quorum or a deadline instead of on every learner is what decouples the regions:
a slow or dead one never stalls the rest (Decoupled DiLoCo, arXiv 2604.21428).
"""

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from islands.core.config import QuorumSettings


def grace_s(settings: QuorumSettings, history: dict[str, "LearnerHistory"]) -> float:
    """The grace window: grace_max_s, and at most grace_fraction × the median recent phase time
    (so a fixed number of seconds does not hold back rounds whose phases take less)."""
    phases = [s for h in history.values() for s in h.phase_seconds]
    if settings.grace_fraction is None or not phases:
        return settings.grace_max_s
    return min(settings.grace_max_s, settings.grace_fraction * statistics.median(phases))


@dataclass
class LearnerHistory:
    phase_seconds: list[float]  # recent phase durations, newest last
    last_arrival: float | None  # clock time of its last delta
    cycle_s: float | None = None  # time between its deltas' arrivals, when known
    lag_s: float = 0.0  # from its finish time to the synchronizer seeing the delta, at best

    def seen(self, finished_at: float, seconds: float) -> "LearnerHistory":
        """This history once the round has seen a delta the learner finished at `finished_at`
        (its own clock) after a phase of `seconds`. A delta that missed the last round arrives
        in this one before the learner's fresh delta does; counted from the older, merged deltas
        alone, the fresh one would look due already, and the grace window would never wait for it."""
        at = finished_at + self.lag_s
        if self.last_arrival is not None and at <= self.last_arrival:
            return self
        return replace(self, last_arrival=at, phase_seconds=[*self.phase_seconds, seconds])

    def expected_arrival(self) -> float | None:
        """The last arrival plus the time between arrivals; without that, plus the mean phase
        (which leaves out what a learner does between phases: encoding, uploading)."""
        if self.last_arrival is None:
            return None
        if self.cycle_s is not None:
            return self.last_arrival + self.cycle_s
        if not self.phase_seconds:
            return None
        return self.last_arrival + sum(self.phase_seconds) / len(self.phase_seconds)


HISTORY = 5  # a learner's newest merged deltas its history counts


class MergedDelta(Protocol):
    """What a learner's history reads of one of its merged deltas (a manifest's contribution)."""

    phase: int
    finished_at: float  # the learner's clock
    seconds: float  # its phase
    seen_at: float  # the synchronizer's clock when it first listed it


def cycle(recent: Sequence[MergedDelta]) -> float | None:
    """A learner's time from one delta to the next, from its finish times (its own clock, so
    how late the synchronizer happened to look does not enter): the median per phase, so a
    skipped phase does not count double; None under two deltas."""
    per_phase = [
        (b.finished_at - a.finished_at) / (b.phase - a.phase) for a, b in zip(recent, recent[1:]) if b.phase > a.phase
    ]
    return statistics.median(per_phase) if per_phase else None


def seen_lag(recent: Sequence[MergedDelta]) -> float:
    """From a learner's finish time to the synchronizer seeing its delta, at best: the upload and
    the clocks' offset, without the wait for the next look (0 before the learner's first delta)."""
    return min((c.seen_at - c.finished_at for c in recent), default=0.0)


def history_of(merged: Iterable[MergedDelta]) -> LearnerHistory:
    """A learner's history at a round's start, from its merged deltas: the newest HISTORY of them
    by phase give its recent phase times, its last arrival (on the synchronizer's clock), the time
    between its deltas and its lag."""
    recent = sorted(merged, key=lambda c: c.phase)[-HISTORY:]
    lag = seen_lag(recent)
    return LearnerHistory(
        phase_seconds=[c.seconds for c in recent],
        last_arrival=recent[-1].finished_at + lag if recent else None,
        cycle_s=cycle(recent),
        lag_s=lag,
    )


@dataclass(frozen=True)
class Decision:
    close: bool
    reason: str | None  # "all-in" | "quorum+grace" | "timeout"
    recheck_at: float | None  # clock time at which the answer can next change without a new arrival
    waiting_for: tuple[str, ...]


def quorum_arrivals(arrivals: Iterable[tuple[str, int, float]], parent_round: int) -> dict[str, float]:
    """The learners whose deltas count towards a round's quorum, each with when its first was
    seen, from (learner, base round, seen at) of every delta in: only a delta trained from the
    parent round counts. Staler ones still merge (discounted) and move their learner's expected
    next arrival on, but a round closed on them alone would wait for nobody fresh."""
    fresh: dict[str, float] = {}
    for learner, base_round, seen_at in arrivals:
        if base_round == parent_round:
            fresh[learner] = min(fresh.get(learner, seen_at), seen_at)
    return fresh


def decide(
    policy: QuorumSettings,
    started_at: float,
    now: float,
    arrived: dict[str, float],
    learners: list[str],
    history: dict[str, LearnerHistory],
    listing_s: float = 0.0,
) -> Decision:
    """Close at max_quorum (every learner when unset), or after a grace window past min_quorum,
    or at the hard deadline `round_timeout_s` after `started_at`.

    The grace window waits only for missing learners expected (from their recent phase times) by
    the quorum time + the grace (`grace_s`), and for one listing period (`listing_s`: a delta can
    land that long before the caller sees it) past their expected arrival; a learner with no
    history is not waited for.
    """
    if listing_s < 0:
        raise ValueError(f"listing_s must be >= 0 seconds, got {listing_s}")
    missing = tuple(sorted(name for name in learners if name not in arrived))
    deadline = started_at + policy.round_timeout_s
    max_quorum = policy.max_quorum or len(learners)
    if len(arrived) >= max_quorum or not missing:  # no learner left to wait for (every one in, or down)
        return Decision(close=True, reason="all-in", recheck_at=None, waiting_for=())

    if len(arrived) >= policy.min_quorum:
        quorum_at = sorted(arrived.values())[policy.min_quorum - 1]
        grace_end = quorum_at + grace_s(policy, history)
        expected = {name: history[name].expected_arrival() if name in history else None for name in missing}
        worth_waiting = {name: t for name, t in expected.items() if t is not None and t <= grace_end}
        close_at = min(max(worth_waiting.values(), default=quorum_at), grace_end) + listing_s
        if not worth_waiting or now >= close_at:
            return Decision(close=True, reason="quorum+grace", recheck_at=None, waiting_for=())
        waiting_for = tuple(sorted(worth_waiting))
    else:
        close_at, waiting_for = deadline, missing

    if now >= deadline:
        return Decision(close=True, reason="timeout", recheck_at=None, waiting_for=())
    return Decision(close=False, reason=None, recheck_at=min(close_at, deadline), waiting_for=waiting_for)
