"""Merge: turn the collected deltas into θ_r and the new outer momentum.

The arithmetic is `islands.core.merge` (pure); this task decides which deltas take part (norm outliers
are quarantined, over-stale ones dropped) and keeps the bookkeeping the manifest needs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from islands.core.compress import RESIDUAL_PREFIX
from islands.core.config import MergeSettings
from islands.core.merge import Candidate, encode_update_tensor, merge_tensor_, plan_merge
from islands.core.validate import norm_outliers
from islands.storage.codec import TensorFileWriter, encode_state_object
from islands.storage.encoded import EncodedObject
from islands.storage.manifest import Contribution, Excluded
from islands.storage.rounds import checkpoint_metadata, update_metadata
from islands.tasks.collect import Arrival, Collected, inspect
from islands.tasks.round_state import RoundState


class RoundFailed(RuntimeError):
    """The round cannot be published; the message says why and how to continue."""


class NonFinite(ArithmeticError):
    """Merging made a tensor of θ_r or its momentum non-finite; `key` is the delta that weighs
    most in that tensor, which is quarantined before the round is merged again."""

    def __init__(self, name: str, key: str):
        super().__init__(f"merging gives non-finite values in {name}")
        self.name, self.key = name, key


@dataclass
class Merged:
    model: dict[str, torch.Tensor]  # θ_r = θ_{r−1} + decode(update)
    model_object: EncodedObject  # θ_r as its checkpoint object, read from θ_r's memory
    update: EncodedObject  # the update codec's object, written while merging
    outer: EncodedObject  # the outer state: momentum and what the update codec has not sent yet
    contributions: list[Contribution]
    excluded: list[Excluded]


def apply_merge(state: RoundState, arrivals: list[Arrival], rule: MergeSettings):
    """(θ_r, momentum, θ_r's checkpoint object, the encoded update, the outer state, weighted,
    dropped).

    Tensor by tensor: each parameter's deltas are read from the spooled files, averaged and
    stepped into the round state's θ and momentum in place, then the step is encoded with the
    update codec (islands.core.merge.encode_update), its wire tensors go straight to the update's part
    files, θ_r becomes θ_{r−1} + the decoded step, and the codec's new residual goes straight to
    the outer state's parts; the outer state and the checkpoint read the momentum and θ_r from
    memory. The three objects are hashed side by side and uploaded from where their bytes are.
    Memory holds θ and the momentum (the round state's residual is used up as it goes), and one
    tensor of each delta, however many deltas there are; nothing long-lived is allocated in the
    loop, so freed tensors are reused, not fragmented. Each tensor's bytes in the spooled deltas
    are released once merged, so the part files take over their pages instead of new ones and
    the spool shrinks as the merge goes."""
    weighted, dropped = plan_merge(
        state.round - 1, [Candidate(a.learner, a.phase, a.base_round, a.tokens) for a in arrivals], rule
    )
    if not weighted:
        return None, None, None, None, None, weighted, dropped
    by_id = {(a.learner, a.phase): a for a in arrivals}
    files = [by_id[(w.candidate.learner, w.candidate.phase)].delta for w in weighted]
    weights = [w.weight for w in weighted]
    momentum = state.momentum if state.momentum is not None else {}
    codec = state.config.update_codec
    # The parts stay in the round's spool until the round is published.
    update_parts = state.spool_dir / f"update-{state.round:06d}.parts"
    outer_parts = state.spool_dir / f"outer-{state.round:06d}.parts"
    with TensorFileWriter(update_parts) as update, TensorFileWriter(outer_parts) as outer:
        for name, param in state.model.items():
            parent = param.clone()
            _, momentum[name] = merge_tensor_(
                param, momentum.get(name), (f.decoded(name) for f in files), weights, rule
            )
            if not (torch.isfinite(param).all() and torch.isfinite(momentum[name]).all()):
                pulls = [
                    w * float(torch.linalg.vector_norm(f.decoded(name), dtype=torch.float64))
                    for f, w in zip(files, weights)
                ]
                culprit = weighted[max(range(len(files)), key=pulls.__getitem__)].candidate
                raise NonFinite(name, by_id[(culprit.learner, culprit.phase)].key)
            for f in files:
                f.release(name)  # read for the last time: the part files below reuse its pages
            wire, rebuilt, left = encode_update_tensor(name, parent, param, state.residual, codec)
            state.residual.pop(name, None)  # the old residual goes as the new one comes: never both whole
            param.copy_(rebuilt)
            for key, tensor in wire.items():
                update.add(key, tensor)
            # The residual travels with the momentum, so a resumed synchronizer carries on exactly.
            outer.keep(name, momentum[name])  # in memory anyway, and unchanged until the upload
            for key, tensor in left.items():
                outer.add(RESIDUAL_PREFIX + key, tensor)
        with ThreadPoolExecutor(2, thread_name_prefix="merge-hash") as pool:  # hashlib lets go of the GIL
            meta = checkpoint_metadata(state.run, state.round)
            model_hashed = pool.submit(encode_state_object, state.model, meta)
            update_hashed = pool.submit(update.finish, update_metadata(state.run, state.round, codec))
            outer_object = outer.finish(meta)
            model_object, update_object = model_hashed.result(), update_hashed.result()
    state.momentum = momentum
    return state.model, momentum, model_object, update_object, outer_object, weighted, dropped


def quarantined(a: Arrival, reason: str) -> Excluded:
    return a.excluded("quarantined", reason)


def merge_finite(state: RoundState, arrivals: list[Arrival], rule: MergeSettings, excluded: list[Excluded]):
    """`apply_merge`, and should θ_r or its momentum come out non-finite, again without the delta
    that caused it (quarantined), from θ_{r−1} and the other deltas read afresh: the merge works
    in place and lets go of what it has read."""
    while True:
        try:
            return arrivals, apply_merge(state, arrivals, rule)
        except NonFinite as exc:
            culprit = next(a for a in arrivals if a.key == exc.key)
            excluded.append(quarantined(culprit, f"merging it gives a non-finite θ_r (in {exc.name})"))
            state.reload()
            again = []
            for a in arrivals:
                if a is culprit:
                    continue
                found = inspect(state, a.region, a.key, a.bytes)
                if found is None:
                    raise RoundFailed(f"{state.run} round {state.round}: the store did not answer; retry it") from exc
                if isinstance(found, Arrival):
                    found.seen_at = a.seen_at
                    again.append(found)
                else:
                    excluded.append(found)
            arrivals = again


@task(name="merge", cache_policy=NO_CACHE)
def merge(state: RoundState, collected: Collected) -> Merged:
    log = get_run_logger()
    rule = state.config.merge
    refused = norm_outliers({a.key: a.norm for a in collected.arrivals}, rule.norm_limit)

    excluded = list(collected.quarantined)
    excluded += [quarantined(a, refused[a.key]) for a in collected.arrivals if a.key in refused]
    arrivals = [a for a in collected.arrivals if a.key not in refused]
    arrivals, (model, _, model_object, update, outer, weighted, dropped) = merge_finite(state, arrivals, rule, excluded)
    by_id = {(a.learner, a.phase): a for a in arrivals}
    for d in dropped:
        a = by_id[(d.candidate.learner, d.candidate.phase)]
        excluded.append(a.excluded("dropped", d.reason))
    if model is None:
        why = (
            f"{len(excluded)} excluded"
            if excluded
            else "nothing arrived; if the learners are running, quorum.round_timeout_s must be longer than "
            "they take to start and train one phase"
        )
        raise RoundFailed(
            f"{state.run} round {state.round}: no valid delta after {collected.waited_s:.0f} s "
            f"({why}); check the learners, then `islands resume {state.run}`"
        )
    contributions = []
    for w in weighted:
        a = by_id[(w.candidate.learner, w.candidate.phase)]
        contributions.append(
            Contribution(
                learner=a.learner,
                region=a.region,
                phase=a.phase,
                base_round=a.base_round,
                staleness=w.staleness,
                tokens=a.tokens,
                tokens_counted=w.tokens_counted,
                weight=w.weight,
                loss=a.loss,
                bytes=a.bytes,
                key=a.key,
                sha256=a.sha256,
                body_sha256=a.body_sha256,
                finished_at=a.finished_at,
                seconds=a.seconds,
                seen_at=a.seen_at,
                norm=a.norm,
            )
        )
    log.info(
        "%s round %d: merged %d deltas (%s)",
        state.run,
        state.round,
        len(contributions),
        ", ".join(f"{c.learner}@s{c.staleness}" for c in contributions),
    )
    return Merged(model, model_object, update, outer, contributions, excluded)
