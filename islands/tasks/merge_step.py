"""Merge: turn the collected deltas into θ_r and the new outer momentum.

The arithmetic is `islands.core.merge` (pure); this task decides which deltas take part (norm outliers
are quarantined, over-stale ones dropped) and keeps the bookkeeping the manifest needs.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from islands.core.compress import RESIDUAL_PREFIX
from islands.core.config import MergeSettings
from islands.core.merge import Candidate, encode_update_chunk_, merge_tensor_, plan_merge
from islands.core.validate import norm_outliers
from islands.storage.codec import TensorFileWriter
from islands.storage.encoded import EncodedObject
from islands.storage.manifest import Contribution, Excluded
from islands.storage.rounds import checkpoint_metadata, chunks_of, shape_of, update_metadata
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
    model: dict[str, torch.Tensor] | None  # θ_r in memory where a caller has it; the merge leaves it None
    model_object: EncodedObject  # θ_r as its checkpoint object, from part files written while merging
    update: EncodedObject  # the update codec's object, written while merging
    outer: EncodedObject  # the outer state: momentum and what the update codec has not sent yet
    contributions: list[Contribution]
    excluded: list[Excluded]


def apply_merge(state: RoundState, arrivals: list[Arrival], rule: MergeSettings):
    """(θ_r's checkpoint object, the encoded update, the outer state, weighted, dropped); the
    three objects are None when nothing is weighted.

    A chunk at a time (synchronizer.chunk_mb of float32 values, whole 128-value blocks): each
    parameter's chunk of θ_{r−1}, of the momentum, of the residual and of every delta is read
    from its local file, the deltas are averaged and the outer step taken, the step is encoded
    with the update codec (islands.core.merge.encode_update_chunk), and θ_r = θ_{r−1} + the
    decoded step, the new momentum, the update's wire values and the new residual are appended
    to part files; the update's integers are deflated as one stream per tensor, the same bytes
    as deflating them whole. Every operation is value by value or block by block in a fixed
    order, so the bits are those of the whole-tensor merge (islands.core.merge.merge_round and
    encode_update, which `audit --replay` runs). The three objects are hashed side by side from
    their part files and uploaded from there. Memory holds a few chunks, whatever the model's
    size and however many deltas there are; the round state is left as it was. Each tensor's
    bytes in the spooled deltas are released once merged, so the part files take over their
    pages and the spool shrinks as the merge goes."""
    weighted, dropped = plan_merge(
        state.round - 1, [Candidate(a.learner, a.phase, a.base_round, a.tokens) for a in arrivals], rule
    )
    if not weighted:
        return None, None, None, weighted, dropped
    by_id = {(a.learner, a.phase): a for a in arrivals}
    files = [by_id[(w.candidate.learner, w.candidate.phase)].delta for w in weighted]
    weights = [w.weight for w in weighted]
    codec = state.config.update_codec
    # The parts stay in the round's spool until the round is published.
    spool = state.spool_dir
    with (
        TensorFileWriter(spool / f"model-{state.round:06d}.parts") as model,
        TensorFileWriter(spool / f"update-{state.round:06d}.parts") as update,
        TensorFileWriter(spool / f"outer-{state.round:06d}.parts") as outer,
    ):
        for name in state.model:
            _merge_tensor(state, name, files, weights, weighted, by_id, rule, model, update, outer)
            for f in files:
                f.release(name)  # read for the last time: the part files reuse its pages
        meta = checkpoint_metadata(state.run, state.round)
        with ThreadPoolExecutor(2, thread_name_prefix="merge-hash") as pool:  # hashlib lets go of the GIL
            model_hashed = pool.submit(model.finish, meta)
            update_hashed = pool.submit(update.finish, update_metadata(state.run, state.round, codec))
            outer_object = outer.finish(meta)
            model_object, update_object = model_hashed.result(), update_hashed.result()
    return model_object, update_object, outer_object, weighted, dropped


def _merge_tensor(state, name, files, weights, weighted, by_id, rule, model, update, outer) -> None:
    """One parameter of `apply_merge`, a chunk at a time."""
    codec, values = state.config.update_codec, state.chunk_values
    shape = list(shape_of(state.model, name))
    momentum = state.momentum if state.momentum is not None and name in state.momentum else None
    residual = state.residual if name in state.residual else None
    moms = chunks_of(momentum, name, values) if momentum is not None else None
    carried = chunks_of(residual, name, values) if residual is not None else None
    deltas = [f.chunks(name, values) for f in files]
    theta_part = new_momentum = wire = left = None
    for parent in chunks_of(state.model, name, values):
        param = parent.clone()
        m = next(moms) if moms is not None else None
        param, m = merge_tensor_(param, m, (next(d) for d in deltas), weights, rule)
        if not (all_finite(param) and all_finite(m)):
            pulls = [
                w
                * math.sqrt(
                    sum(float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2 for c in f.chunks(name, values))
                )
                for f, w in zip(files, weights)
            ]
            culprit = weighted[max(range(len(files)), key=pulls.__getitem__)].candidate
            raise NonFinite(name, by_id[(culprit.learner, culprit.phase)].key)
        if new_momentum is None:
            new_momentum = outer.stream(name, m.dtype, shape)
        new_momentum.write(m)
        del m  # written: one chunk fewer held while the update is encoded
        dtype = parent.dtype
        parts, rebuilt, kept = encode_update_chunk_(
            name, parent, param, next(carried) if carried is not None else None, codec, state.config.topk
        )
        del param  # used up by the encoding
        if theta_part is None:
            theta_part = model.stream(name, dtype, shape)
            wire = update.coded(name, shape, parts)
            if kept is not None:  # the residual travels with the momentum, so a resumed synchronizer carries on exactly
                left = outer.stream(RESIDUAL_PREFIX + name, kept.dtype, shape)
        theta_part.write(rebuilt)
        for key, stream in wire.items():
            stream.write(parts[key])
        if left is not None:
            left.write(kept)
        del parent, rebuilt, parts, kept
    if theta_part is None:
        raise ValueError(f"tensor {name!r} has no values to merge")
    for stream in (theta_part, new_momentum, *wire.values(), *([left] if left is not None else [])):
        stream.close()


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite. A NaN or an infinity makes the sum non-finite, so a
    finite sum settles it without building isfinite's mask of the chunk (a fraction of its
    time); a sum that overflows from finite values is checked value by value."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def quarantined(a: Arrival, reason: str) -> Excluded:
    return a.excluded("quarantined", reason)


def merge_finite(state: RoundState, arrivals: list[Arrival], rule: MergeSettings, excluded: list[Excluded]):
    """`apply_merge`, and should θ_r or its momentum come out non-finite, again without the delta
    that caused it (quarantined), from θ_{r−1} and the other deltas read afresh: the merge lets
    go of what it has read."""
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
    arrivals, (model_object, update, outer, weighted, dropped) = merge_finite(state, arrivals, rule, excluded)
    by_id = {(a.learner, a.phase): a for a in arrivals}
    for d in dropped:
        a = by_id[(d.candidate.learner, d.candidate.phase)]
        excluded.append(a.excluded("dropped", d.reason))
    if model_object is None:
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
    return Merged(None, model_object, update, outer, contributions, excluded)
