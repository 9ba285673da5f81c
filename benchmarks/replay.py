"""The decoupled pipeline's schedule replayed in virtual time, in one process.

Same learners, data, inner loop, quorum rule (islands.core.quorum.decide) and merge plan
(islands.core.merge.plan_merge) as the pipeline, but the clock is simulated: a full-speed learner's inner
step takes `step_s`, a slow one's 1/speed of that, a round is visible to learners `publish_s` after
it closes. Nothing waits on servers, so learner behaviours, outer steps and codecs can be compared side by side
on the same schedule in minutes (benchmarks.schedule, benchmarks.codec); the pipeline itself (benchmarks.quality,
benchmarks.wire) is what the bars are measured on.

Deltas go through the delta codec with the learner's error feedback (islands.core.compress), as a learner
sends them. With `update_codec`, a round's θ is θ_{r−1} + the decoded update with the
synchronizer's error feedback (islands.core.merge.encode_update), as the pipeline publishes it; without,
it is the merge's θ exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from benchmarks.heldout import BATCH, PRESET
from benchmarks.inprocess import Budget, learner_trainers
from islands.core.codecs import Codec
from islands.core.compress import compress_with_feedback
from islands.core.config import MergeSettings, QuorumSettings, TopkSettings
from islands.core.inner import InnerTrainer, carried
from islands.core.merge import Candidate, encode_update, merge_round, plan_merge
from islands.core.model import build_model, params_of
from islands.core.pace import phase_steps
from islands.core.quorum import LearnerHistory, decide


@dataclass(frozen=True)
class Schedule:
    h: int
    speeds: tuple[float, ...] = (1.0, 1 / 3, 1.0, 1.0)  # learner i's step rate; eu-west is learner 1
    step_s: float = 0.9  # a full-speed learner's inner step, as in the pipeline at full size
    publish_s: float = 3.0  # quorum closed → round visible to learners (merge, write, poll)
    min_quorum: int = 2
    grace_fraction: float = 0.5
    rebase: bool = True
    carry: bool = False  # phases continue from the learner's own weights, its unmerged deltas carried
    catch_up: bool = False  # a phase starts at the learners' average progress in the lr schedule
    paced: bool = False  # a phase's steps scale with the learner's rate (islands.core.pace)
    away: int = 0  # learners of the run that never send a delta (dead throughout), beyond `speeds`
    codec: Codec = "fp32"  # the deltas' codec
    update_codec: Codec | None = None  # the rounds' update codec; None: θ_r is the merge's result as it is
    topk: TopkSettings | None = None  # the topk codec's settings, where either codec is topk

    def steps_for(self, speed: float) -> int:
        return phase_steps(self.h, speed, list(self.speeds)) if self.paced else self.h


def pipeline_defaults(h: int) -> Schedule:
    """The pipeline's learner behaviours: carry, lr catch-up and paced phases."""
    return Schedule(h, carry=True, catch_up=True, paced=True)


@dataclass
class _Arrival:
    at: float
    learner: str
    phase: int
    base_round: int
    tokens: int
    seconds: float
    delta: dict


@dataclass
class _Learner:
    name: str
    trainer: InnerTrainer
    speed: float
    base: dict = field(default_factory=dict)
    base_round: int = 0
    done: int = 0  # steps into the current phase
    phase: int = 0
    phase_started: float = 0.0
    unmerged: dict = field(default_factory=dict)  # phase → delta sent and not yet in a visible round
    residual: dict = field(default_factory=dict)  # the delta codec's error feedback


@dataclass(frozen=True)
class _Round:
    number: int
    theta: dict
    visible_at: float  # when learners first see it: its close + publish_s
    settled: frozenset  # the (learner, phase) deltas merged or dropped by this round
    applied: int  # tokens merged into rounds 1…this one


class Replay:
    """One replayed run: the learners, the rounds published so far and the round being collected,
    advanced event by event on a simulated clock.

    The learners' steps are the events, taken in time order from a heap; before each, the
    synchronizer catches up to that time (`synchronize`), so a learner starting a phase sees
    exactly the rounds visible by then. The synchronizer's decisions are islands.core.quorum's
    and its merge islands.core.merge's, so a replay differs from the pipeline only in its clock.
    """

    def __init__(
        self,
        budget: Budget,
        schedule: Schedule,
        rule: MergeSettings,
        seed: int = 0,
        init: dict | None = None,
        on_round: Callable[[int, dict], None] | None = None,
    ) -> None:
        self.schedule, self.rule, self.on_round = schedule, rule, on_round
        self.block = build_model(PRESET, seed).config.block_size
        alive = len(schedule.speeds)
        trainers = learner_trainers(replace(budget, learners=alive), seed, range(alive))
        self.learners = [_Learner(f"l{i}", t, s) for i, (t, s) in enumerate(zip(trainers, schedule.speeds))]
        # The away learners come last, never trained: the quorum and the catch-up still count them.
        self.names = [f"l{i}" for i in range(alive + schedule.away)]
        self.policy = QuorumSettings(
            min_quorum=schedule.min_quorum,
            max_quorum=len(self.names),
            grace_max_s=20.0,
            round_timeout_s=600.0,
            grace_fraction=schedule.grace_fraction,
        )
        theta0 = init if init is not None else params_of(build_model(PRESET, seed))
        self.rounds = [_Round(0, theta0, 0.0, frozenset(), 0)]
        self.momentum: dict | None = None
        self.update_residual: dict = {}  # the update codec's error feedback
        self.history = {n: LearnerHistory([], None) for n in self.names}
        self.arrived: dict[str, float] = {}  # learner → when its delta reached the round being collected
        self.pending: list[_Arrival] = []  # deltas sent and not merged yet
        self.collecting_since = 0.0
        self.budget_steps = budget.tokens // (BATCH * self.block)
        self.trained_steps = 0
        self.merged: list[list[int]] = []  # each round's deltas' staleness
        self.clock = [(0.0, i) for i in range(alive)]  # (when learner i's next step starts, i)

    def run(self) -> tuple[dict, dict]:
        """Step the learners until they have trained the budget's tokens, then close what is left."""
        while self.trained_steps < self.budget_steps:
            t, i = heapq.heappop(self.clock)
            self.synchronize(t)
            heapq.heappush(self.clock, (self.step(self.learners[i], t), i))
        self.synchronize(float("inf"))
        return self.rounds[-1].theta, self.facts()

    def step(self, L: _Learner, t: float) -> float:
        """One inner step of `L` starting at `t` (a phase begins or rebases first, as the pipeline's
        learner would at that time); returns when the step ends."""
        if L.done == 0:
            self.begin_phase(L, t)
        elif self.schedule.rebase and self.visible(t).number > L.base_round:
            self.rebase(L, t)
        L.trainer.train_step()
        L.done += 1
        self.trained_steps += 1
        t_end = t + self.schedule.step_s / L.speed
        if L.done == self.schedule.steps_for(L.speed):
            self.send(L, t_end)
        return t_end

    def begin_phase(self, L: _Learner, t: float) -> None:
        L.base_round, L.base = self.reference(L, t)
        if self.schedule.catch_up:
            # The lr schedule counts the run's learners, away or not.
            L.trainer.catch_up(self.rounds[L.base_round].applied, len(self.names))
        L.trainer.begin(L.base)
        L.phase_started = t

    def rebase(self, L: _Learner, t: float) -> None:
        """Fold a round published mid-phase into the phase in progress (Streaming DiLoCo's overlap)."""
        r, theta = self.reference(L, t)
        L.trainer.shift(L.base, theta)
        L.base_round, L.base = r, theta

    def send(self, L: _Learner, t_end: float) -> None:
        """End `L`'s phase: its delta goes through the codec with its error feedback, as a learner
        sends it, and arrives at `t_end`."""
        delta = L.trainer.delta(L.base)
        _, sent, L.residual = compress_with_feedback(delta, L.residual, self.schedule.codec, self.schedule.topk)
        tokens = L.done * BATCH * self.block
        self.pending.append(_Arrival(t_end, L.name, L.phase, L.base_round, tokens, t_end - L.phase_started, sent))
        L.unmerged[L.phase] = delta
        L.done, L.phase = 0, L.phase + 1

    def visible(self, t: float) -> _Round:
        return max((x for x in self.rounds if x.visible_at <= t), key=lambda x: x.number)

    def reference(self, L: _Learner, t: float) -> tuple[int, dict]:
        """The newest visible round and the point the learner's next steps count from: θ_r, or
        with `carry`, θ_r minus the learner's own deltas that θ_r does not hold yet."""
        newest = self.visible(t)
        if not self.schedule.carry:
            return newest.number, newest.theta
        L.unmerged = {q: d for q, d in L.unmerged.items() if (L.name, q) not in newest.settled}
        return newest.number, carried(newest.theta, list(L.unmerged.values()))

    def synchronize(self, until: float) -> None:
        """Run the synchronizer's events (arrivals seen, rechecks, closes) up to time `until`."""
        now = self.collecting_since
        while now <= until:
            for a in self.pending:
                if a.at <= now and a.learner not in self.arrived:
                    self.arrived[a.learner] = a.at
                    h = self.history[a.learner]
                    h.phase_seconds, h.last_arrival = (h.phase_seconds + [a.seconds])[-5:], a.at
            d = decide(self.policy, self.collecting_since, now, self.arrived, self.names, self.history)
            if d.close and d.reason == "timeout" and not self.arrived:
                return  # nothing left to merge: the learners have stopped
            if d.close:
                self.close_round(now)
                now = self.collecting_since
                continue
            later = [a.at for a in self.pending if a.at > now] + ([d.recheck_at] if d.recheck_at is not None else [])
            if not later:
                return
            now = min(later)

    def close_round(self, now: float) -> None:
        """Merge the deltas arrived by `now` as the synchronizer does (weights from plan_merge, one
        Nesterov step, the update through its codec) and publish the round."""
        take = [a for a in self.pending if a.at <= now]
        last = self.rounds[-1]
        candidates = [Candidate(a.learner, a.phase, a.base_round, a.tokens) for a in take]
        weighted, _ = plan_merge(last.number, candidates, self.rule)
        by = {(a.learner, a.phase): a for a in take}
        deltas = [by[(w.candidate.learner, w.candidate.phase)].delta for w in weighted]
        theta = last.theta
        if weighted:
            merged_theta, self.momentum = merge_round(
                theta, self.momentum, deltas, [w.weight for w in weighted], self.rule
            )
            if self.schedule.update_codec is None:
                theta = merged_theta
            else:
                _, theta, self.update_residual = encode_update(
                    theta, merged_theta, self.update_residual, self.schedule.update_codec, self.schedule.topk
                )
        self.merged.append([w.staleness for w in weighted])
        self.pending = [a for a in self.pending if a.at > now]
        self.arrived.clear()
        r = _Round(
            last.number + 1,
            theta,
            now + self.schedule.publish_s,
            last.settled | {(a.learner, a.phase) for a in take},
            last.applied + sum(w.candidate.tokens for w in weighted),
        )
        self.rounds.append(r)
        if self.on_round is not None:
            self.on_round(r.number, theta)
        self.collecting_since = r.visible_at

    def facts(self) -> dict:
        staleness = [s for m in self.merged for s in m]
        return {
            "rounds": self.rounds[-1].number,
            "deltas_per_round": sum(map(len, self.merged)) / max(1, len(self.merged)),
            "mean_staleness": sum(staleness) / max(1, len(staleness)),
        }


def replay(
    budget: Budget,
    schedule: Schedule,
    rule: MergeSettings,
    seed: int = 0,
    init: dict | None = None,
    on_round: Callable[[int, dict], None] | None = None,
) -> tuple[dict, dict]:
    """Train until the learners have trained the budget's tokens, merging as the synchronizer
    does; (θ of the last round, facts: rounds, deltas per round, mean staleness). Round 0 is
    `init` when given (a warm start), else the seeded model; `on_round(r, θ_r)` sees each round's
    model as it is published."""
    return Replay(budget, schedule, rule, seed, init, on_round).run()
