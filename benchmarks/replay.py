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
from islands.core.config import MergeSettings, QuorumSettings
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
    trainer: InnerTrainer
    speed: float
    base: dict = field(default_factory=dict)
    base_round: int = 0
    done: int = 0  # steps into the current phase
    phase: int = 0
    phase_started: float = 0.0
    unmerged: dict = field(default_factory=dict)  # phase → delta sent and not yet in a visible round
    residual: dict = field(default_factory=dict)  # the delta codec's error feedback


def replay(
    budget: Budget,
    schedule: Schedule,
    rule: MergeSettings,
    seed: int = 0,
    init: dict | None = None,
    on_round: Callable[[int, dict], None] | None = None,
) -> tuple[dict, dict]:
    """Train until the learners have trained the budget's tokens, merging as the synchronizer
    does (weights from islands.core.merge.plan_merge, one Nesterov step); (θ of the last round, facts).
    Round 0 is `init` when given (a warm start), else the seeded model; `on_round(r, θ_r)` sees
    each round's model as it is published."""
    block = build_model(PRESET, seed).config.block_size
    alive = len(schedule.speeds)
    learners = [
        _Learner(trainer, speed)
        for trainer, speed in zip(
            learner_trainers(replace(budget, learners=alive), seed, range(alive)), schedule.speeds
        )
    ]
    names = [f"l{i}" for i in range(len(learners) + schedule.away)]  # the away ones last: never trained
    policy = QuorumSettings(
        min_quorum=schedule.min_quorum,
        max_quorum=len(names),
        grace_max_s=20.0,
        round_timeout_s=600.0,
        grace_fraction=schedule.grace_fraction,
    )
    theta0 = init if init is not None else params_of(build_model(PRESET, seed))
    rounds = [(0, theta0, 0.0)]  # (round, θ, visible at)
    momentum, update_residual = None, {}
    history = {n: LearnerHistory([], None) for n in names}
    arrived: dict[str, float] = {}
    pending: list[_Arrival] = []  # deltas sent and not merged yet
    collecting_since = 0.0
    budget_steps = budget.tokens // (BATCH * block)
    trained_steps, merged = 0, []
    clock = [(0.0, i) for i in range(len(learners))]
    heapq.heapify(clock)

    settled = [frozenset()]  # round r: the (learner, phase) deltas merged or dropped by round r
    applied = [0]  # round r: tokens merged into rounds 1…r

    def reference(L: _Learner, name: str, t: float) -> tuple[int, dict]:
        """The newest visible round and the point this learner's next steps count from: θ_r, or
        with `carry`, θ_r minus the learner's own deltas that θ_r does not hold yet."""
        r, theta, _ = max((x for x in rounds if x[2] <= t), key=lambda x: x[0])
        if not schedule.carry:
            return r, theta
        L.unmerged = {q: d for q, d in L.unmerged.items() if (name, q) not in settled[r]}
        return r, carried(theta, list(L.unmerged.values()))

    def synchronize(until: float) -> None:
        """Run the synchronizer's events (arrivals seen, rechecks, closes) up to time `until`."""
        now = collecting_since
        while now <= until:
            for a in pending:
                if a.at <= now and a.learner not in arrived:
                    arrived[a.learner] = a.at
                    h = history[a.learner]
                    h.phase_seconds, h.last_arrival = (h.phase_seconds + [a.seconds])[-5:], a.at
            d = decide(policy, collecting_since, now, arrived, names, history)
            if d.close and d.reason == "timeout" and not arrived:
                return  # nothing left to merge: the learners have stopped
            if d.close:
                publish(now)
                now = collecting_since
                continue
            later = [a.at for a in pending if a.at > now] + ([d.recheck_at] if d.recheck_at is not None else [])
            if not later:
                return
            now = min(later)

    def publish(now: float) -> None:
        nonlocal momentum, update_residual, collecting_since
        take = [a for a in pending if a.at <= now]
        r = rounds[-1][0] + 1
        weighted, _ = plan_merge(r - 1, [Candidate(a.learner, a.phase, a.base_round, a.tokens) for a in take], rule)
        by = {(a.learner, a.phase): a for a in take}
        deltas = [by[(w.candidate.learner, w.candidate.phase)].delta for w in weighted]
        theta = rounds[-1][1]
        if weighted:
            merged_theta, momentum = merge_round(theta, momentum, deltas, [w.weight for w in weighted], rule)
            if schedule.update_codec is None:
                theta = merged_theta
            else:
                _, theta, update_residual = encode_update(theta, merged_theta, update_residual, schedule.update_codec)
        merged.append([w.staleness for w in weighted])
        pending[:] = [a for a in pending if a.at > now]
        settled.append(settled[-1] | {(a.learner, a.phase) for a in take})
        applied.append(applied[-1] + sum(w.candidate.tokens for w in weighted))
        arrived.clear()
        rounds.append((r, theta, now + schedule.publish_s))
        if on_round is not None:
            on_round(r, theta)
        collecting_since = now + schedule.publish_s

    while trained_steps < budget_steps:
        t, i = heapq.heappop(clock)
        synchronize(t)
        L, name = learners[i], names[i]
        if L.done == 0:
            L.base_round, L.base = reference(L, name, t)
            if schedule.catch_up:
                L.trainer.catch_up(applied[L.base_round], len(names))  # the run's learners, away or not
            L.trainer.begin(L.base)
            L.phase_started = t
        elif schedule.rebase and max(x[0] for x in rounds if x[2] <= t) > L.base_round:
            r, theta = reference(L, name, t)
            L.trainer.shift(L.base, theta)
            L.base_round, L.base = r, theta
        L.trainer.train_step()
        L.done += 1
        trained_steps += 1
        t_end = t + schedule.step_s / L.speed
        if L.done == schedule.steps_for(L.speed):
            delta = L.trainer.delta(L.base)
            _, sent, L.residual = compress_with_feedback(delta, L.residual, schedule.codec)
            pending.append(
                _Arrival(t_end, name, L.phase, L.base_round, L.done * BATCH * block, t_end - L.phase_started, sent)
            )
            L.unmerged[L.phase] = delta
            L.done, L.phase = 0, L.phase + 1
        heapq.heappush(clock, (t_end, i))
    synchronize(float("inf"))
    staleness = [s for m in merged for s in m]
    return rounds[-1][1], {
        "rounds": rounds[-1][0],
        "deltas_per_round": sum(map(len, merged)) / max(1, len(merged)),
        "mean_staleness": sum(staleness) / max(1, len(staleness)),
    }
