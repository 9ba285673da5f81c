"""A pipeline run's own schedule, replayed in one process with other codecs.

Two pipeline runs never share a schedule: which deltas a round merges, and from which round each
phase started, move with the runs' timing, so a loss ratio between two runs mixes the codecs' cost
with their schedules' luck. A `Trace` is one run's schedule as its objects record it: every
phase's start round, steps, and the rounds it moved onto mid-phase after how many steps (the
delta's metadata), every round's merged phases and weights, the phases it consumed and the tokens
applied by it (the manifests). `retrace` trains the same learners through that schedule with any
delta and update codec, so a run's schedule can be held fixed while the codecs change, and two
runs' schedules compared under one codec.

The learners train with their sampler seeds, their error feedback, their unmerged deltas carried
and their lr catch-up, as the pipeline's learners do; at the pipeline's one thread per learner
(`torch.set_num_threads(1)`) a run's own codecs rebuild its published models bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.heldout import PRESET
from benchmarks.inprocess import Budget, learner_trainers
from benchmarks.pipeline import REGIONS, Run
from islands.core.codecs import Codec
from islands.core.compress import compress_with_feedback
from islands.core.config import MergeSettings, RunConfig
from islands.core.inner import carried
from islands.core.merge import encode_update, merge_round
from islands.core.model import build_model, params_of
from islands.tasks.train_phase import CARRY_LIMIT


@dataclass(frozen=True)
class Phase:
    learner: str
    phase: int
    start_round: int  # the round it began on
    steps: int
    rebases: tuple[tuple[int, int], ...]  # (steps done, round): each round it moved onto mid-phase


@dataclass(frozen=True)
class Round:
    merged: tuple[tuple[str, int, float], ...]  # (learner, phase, weight)
    consumed: frozenset[tuple[str, int]]  # merged, quarantined or dropped in this round
    tokens_applied: int  # by rounds 1…r


@dataclass(frozen=True)
class Trace:
    phases: dict[str, list[Phase]]  # learner → its phases in order
    rounds: list[Round]  # index r − 1 for round r
    rule: MergeSettings
    learners: tuple[str, ...]  # in the run's order: learner i trains shard i


def trace(run: Run, until: int) -> Trace:
    """Rounds 1…`until` of a pipeline run, and the phases they merged or consumed."""
    chain = run.chain[: until + 1]
    phases: dict[str, list[Phase]] = {}
    for d in run.deltas:
        m = d.metadata
        if "rebases" not in m:
            raise ValueError(
                f"{d.key} does not record its rebases (written before deltas did): its run cannot be retraced"
            )
        rebases = tuple(tuple(map(int, move.split(":"))) for move in m["rebases"].split(",") if move)
        phases.setdefault(d.learner, []).append(
            Phase(d.learner, int(m["phase"]), int(m["start_round"]), int(m["inner_steps"]), rebases)
        )
    rounds = [
        Round(
            tuple((c.learner, c.phase, c.weight) for c in m.contributions),
            frozenset(
                {(c.learner, c.phase) for c in m.contributions}
                | {(e.learner, e.phase) for e in m.excluded if e.learner is not None}
            ),
            m.tokens_applied,
        )
        for m in chain[1:]
    ]
    rule = chain[-1].settings.merge
    config = RunConfig(run_id=run.run_id, regions=list(REGIONS))
    return Trace(
        {n: sorted(ps, key=lambda p: p.phase) for n, ps in phases.items()},
        rounds,
        rule,
        tuple(name for name, _, _ in config.learners()),
    )


def retrace(t: Trace, budget: Budget, codec: Codec, update_codec: Codec, seed: int = 0) -> dict[str, torch.Tensor]:
    """θ of the trace's last round, the learners trained through the trace's schedule with
    `codec` deltas (learner-side error feedback) and `update_codec` updates (the synchronizer's),
    carrying their unmerged deltas as the pipeline's learners do."""
    trainers = dict(zip(t.learners, learner_trainers(budget, seed, range(len(t.learners)))))
    thetas = [params_of(build_model(PRESET, seed))]
    applied = [0] + [r.tokens_applied for r in t.rounds]
    consumed = [frozenset()]
    for r in t.rounds:
        consumed.append(consumed[-1] | r.consumed)
    trained = {n: -1 for n in t.learners}  # the last phase trained
    residual: dict[str, dict] = {n: {} for n in t.learners}
    unmerged: dict[str, dict[int, dict]] = {n: {} for n in t.learners}
    sent: dict[tuple[str, int], dict] = {}

    def reference(name: str, r: int) -> dict:
        unmerged[name] = {q: d for q, d in unmerged[name].items() if (name, q) not in consumed[r]}
        return carried(thetas[r], list(unmerged[name].values()))

    def train_through(name: str, phase: int) -> None:
        for p in (p for p in t.phases[name] if trained[name] < p.phase <= phase):
            trainer = trainers[name]
            trainer.catch_up(applied[p.start_round], len(t.learners))
            base = reference(name, p.start_round)
            trainer.begin(base)
            moves = dict(p.rebases)
            for step in range(p.steps):
                if step in moves:
                    newer = reference(name, moves[step])
                    trainer.shift(base, newer)
                    base = newer
                trainer.train_step()
            delta = trainer.delta(base)
            _, sent[(name, p.phase)], residual[name] = compress_with_feedback(delta, residual[name], codec)
            unmerged[name][p.phase] = delta
            if len(unmerged[name]) > CARRY_LIMIT:
                del unmerged[name][min(unmerged[name])]
            trained[name] = p.phase

    momentum, update_residual = None, {}
    for r in t.rounds:
        for name, phase, _ in r.merged:
            train_through(name, phase)
        theta = thetas[-1]
        if r.merged:
            target, momentum = merge_round(
                theta, momentum, [sent.pop((n, q)) for n, q, _ in r.merged], [w for _, _, w in r.merged], t.rule
            )
            _, theta, update_residual = encode_update(theta, target, update_residual, update_codec)
        thetas.append(theta)
    return thetas[-1]
