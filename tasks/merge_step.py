"""Merge: turn the collected deltas into θ_r and the new outer momentum, then evaluate θ_r.

The arithmetic is `tasks.merge` (pure); this task decides which deltas take part (norm outliers
are quarantined, over-stale ones dropped) and keeps the bookkeeping the manifest needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from storage.manifest import Contribution, Excluded
from tasks.collect import Arrival, Collected
from tasks.data import evaluate
from tasks.merge import Candidate, MergeRule, encode_update, merge_round, plan_merge
from tasks.model import build_model
from tasks.round_state import RoundState
from tasks.validate import global_norm, norm_outliers


class RoundFailed(RuntimeError):
    """The round cannot be published; the message says why and how to continue."""


@dataclass
class Merged:
    model: dict[str, torch.Tensor]  # θ_r = θ_{r−1} + decode(update)
    momentum: dict[str, torch.Tensor]
    update: dict[str, torch.Tensor]  # wire tensors of the update codec
    residual: dict[str, torch.Tensor]  # what the update codec has not sent yet
    contributions: list[Contribution]
    excluded: list[Excluded]
    eval_loss: float


def merge_rule(state: RoundState) -> MergeRule:
    m = state.config.merge
    return MergeRule(
        outer_lr=m.outer_lr, outer_momentum=m.outer_momentum, staleness_lambda=m.staleness_lambda,
        max_staleness=m.max_staleness, token_cap=m.token_cap,
    )


def apply_merge(state: RoundState, arrivals: list[Arrival], rule: MergeRule):
    """θ_r and momentum from the arrivals, plus the weights used (pure given its inputs)."""
    weighted, dropped = plan_merge(
        state.round - 1, [Candidate(a.learner, a.phase, a.base_round, a.tokens) for a in arrivals], rule
    )
    if not weighted:
        return None, None, weighted, dropped
    by_id = {(a.learner, a.phase): a for a in arrivals}
    used = [by_id[(w.candidate.learner, w.candidate.phase)].tensors for w in weighted]
    model, momentum = merge_round(state.model, state.momentum, used, [w.weight for w in weighted], rule)
    return model, momentum, weighted, dropped


def eval_loss(state: RoundState, params: dict[str, torch.Tensor]) -> float:
    model = build_model(state.config.model, state.config.seed)
    model.load_state_dict(params)
    return evaluate(model, state.eval_batches())


@task(name="merge", cache_policy=NO_CACHE)
def merge(state: RoundState, collected: Collected) -> Merged:
    log = get_run_logger()
    rule = merge_rule(state)
    outliers = norm_outliers({a.key: global_norm(a.tensors) for a in collected.arrivals})
    excluded = list(collected.quarantined)
    arrivals = []
    for a in collected.arrivals:
        if a.key in outliers:
            excluded.append(Excluded(kind="quarantined", key=a.key, reason=outliers[a.key], learner=a.learner,
                                     region=a.region, phase=a.phase, tokens=a.tokens, sha256=a.sha256))
        else:
            arrivals.append(a)
    model, momentum, weighted, dropped = apply_merge(state, arrivals, rule)
    by_id = {(a.learner, a.phase): a for a in arrivals}
    for d in dropped:
        a = by_id[(d.candidate.learner, d.candidate.phase)]
        excluded.append(Excluded(kind="dropped", key=a.key, reason=d.reason, learner=a.learner, region=a.region,
                                 phase=a.phase, tokens=a.tokens, sha256=a.sha256))
    if model is None:
        raise RoundFailed(
            f"{state.run} round {state.round}: no valid delta after {collected.waited_s:.0f} s "
            f"({len(excluded)} excluded); check the learners, then `islands resume {state.run}`"
        )
    update, model, residual = encode_update(state.model, model, state.residual, state.config.update_codec)
    contributions = []
    for w in weighted:
        a = by_id[(w.candidate.learner, w.candidate.phase)]
        contributions.append(Contribution(
            learner=a.learner, region=a.region, phase=a.phase, base_round=a.base_round, staleness=w.staleness,
            tokens=a.tokens, tokens_counted=w.tokens_counted, weight=w.weight, loss=a.loss, bytes=a.bytes,
            key=a.key, sha256=a.sha256, finished_at=a.finished_at, seconds=a.seconds,
        ))
    loss = eval_loss(state, model)
    log.info("%s round %d: merged %d deltas (%s), eval loss %.4f", state.run, state.round, len(contributions),
             ", ".join(f"{c.learner}@s{c.staleness}" for c in contributions), loss)
    return Merged(model, momentum, update, residual, contributions, excluded, loss)
