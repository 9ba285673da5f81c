"""When a round stops collecting deltas: a pure function of arrivals, history and the clock.

Nothing here sleeps or reads the time, so a scripted timeline tests it exactly and the caller keeps
control of waiting (it can sleep until `recheck_at` or until the next delta lands).
"""

import statistics
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class QuorumPolicy:
    min_quorum: int
    max_quorum: int
    grace_max_s: float
    deadline_s: float
    grace_fraction: float | None = None  # also cap the grace at this fraction of a typical phase
    listing_s: float = 0.0  # a delta can land this long before it is seen: the listing period

    def grace_s(self, history: dict[str, "LearnerHistory"]) -> float:
        """The grace window: grace_max_s, and at most grace_fraction × the median recent phase time
        (so a fixed number of seconds does not hold back rounds whose phases take less)."""
        phases = [s for h in history.values() for s in h.phase_seconds]
        if self.grace_fraction is None or not phases:
            return self.grace_max_s
        return min(self.grace_max_s, self.grace_fraction * statistics.median(phases))

    def __post_init__(self):
        if self.min_quorum < 1:
            raise ValueError(f"QuorumPolicy.min_quorum must be at least 1, got {self.min_quorum}")
        if self.max_quorum < self.min_quorum:
            raise ValueError(
                f"QuorumPolicy.max_quorum ({self.max_quorum}) must be >= min_quorum ({self.min_quorum})"
            )
        if self.grace_max_s < 0:
            raise ValueError(f"QuorumPolicy.grace_max_s must be >= 0 seconds (0: no grace), got {self.grace_max_s}")
        if self.deadline_s <= 0:
            raise ValueError(f"QuorumPolicy.deadline_s must be positive seconds, got {self.deadline_s}")
        if self.listing_s < 0:
            raise ValueError(f"QuorumPolicy.listing_s must be >= 0 seconds, got {self.listing_s}")
        if self.grace_fraction is not None and self.grace_fraction < 0:
            raise ValueError(f"QuorumPolicy.grace_fraction must be >= 0 (0: no grace), got {self.grace_fraction}")


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


@dataclass(frozen=True)
class Decision:
    close: bool
    reason: str | None  # "all-in" | "quorum+grace" | "timeout"
    recheck_at: float | None  # clock time at which the answer can next change without a new arrival
    waiting_for: tuple[str, ...]


def decide(
    policy: QuorumPolicy,
    started_at: float,
    now: float,
    arrived: dict[str, float],
    learners: list[str],
    history: dict[str, LearnerHistory],
) -> Decision:
    """Close at max_quorum, or after a grace window past min_quorum, or at the hard deadline.

    The grace window waits only for missing learners expected (from their recent phase times) by
    the quorum time + the grace (`QuorumPolicy.grace_s`), and for one listing period past their
    expected arrival, since a delta that lands right after a look is seen a period later; a
    learner with no history is not waited for.
    """
    missing = tuple(sorted(name for name in learners if name not in arrived))
    deadline = started_at + policy.deadline_s
    if len(arrived) >= policy.max_quorum or (learners and not missing):
        return Decision(close=True, reason="all-in", recheck_at=None, waiting_for=())

    if len(arrived) >= policy.min_quorum:
        quorum_at = sorted(arrived.values())[policy.min_quorum - 1]
        grace_end = quorum_at + policy.grace_s(history)
        expected = {name: history[name].expected_arrival() if name in history else None for name in missing}
        worth_waiting = {name: t for name, t in expected.items() if t is not None and t <= grace_end}
        close_at = min(max(worth_waiting.values(), default=quorum_at), grace_end) + policy.listing_s
        if not worth_waiting or now >= close_at:
            return Decision(close=True, reason="quorum+grace", recheck_at=None, waiting_for=())
        waiting_for = tuple(sorted(worth_waiting))
    else:
        close_at, waiting_for = deadline, missing

    if now >= deadline:
        return Decision(close=True, reason="timeout", recheck_at=None, waiting_for=())
    return Decision(close=False, reason=None, recheck_at=min(close_at, deadline), waiting_for=waiting_for)
