"""The merge rule and the outer optimizer (docs/architecture.md, "An outer round"), as pure functions of their inputs.

The outer step is DiLoCo's Nesterov momentum on the averaged pseudo-gradient (arXiv 2311.08105).
Deltas that arrive a few rounds late are weighted down by their staleness, as asynchronous
Local-SGD must (arXiv 2401.09135), and the average is weighted by the tokens each learner trained,
so a round merges whatever quorum has arrived (Decoupled DiLoCo, arXiv 2604.21428).

Weights are Python floats (float64) and deltas are accumulated in float64 in a fixed order, so
replaying a round from the same deltas gives the same bits.

The round's model is *defined* as θ_{r−1} + decode(update), the update being the outer step as
the update codec sends it: a learner holding θ_{r−1} rebuilds θ_r bit for bit from that small
object instead of downloading the checkpoint. What the codec drops is kept as the synchronizer's
error-feedback residual and added to the next round's update, so it is delayed, never lost.
"""

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from islands.core.compress import compress_with_feedback, feedback_decay, from_wire, quantized_wire
from islands.core.config import MergeSettings, TopkSettings

RESIDUAL_DTYPE = torch.bfloat16  # the synchronizer's error-feedback residual


@dataclass(frozen=True)
class Candidate:
    learner: str
    phase: int
    base_round: int
    tokens: int  # tokens the delta claims to cover


@dataclass(frozen=True)
class Weighted:
    candidate: Candidate
    staleness: int
    tokens_counted: int
    weight: float


@dataclass(frozen=True)
class Dropped:
    candidate: Candidate
    reason: str


def plan_merge(round_: int, candidates: list[Candidate], rule: MergeSettings) -> tuple[list[Weighted], list[Dropped]]:
    """Weigh each candidate by tokens / (1 + λ·staleness); drop the ones that cannot be merged.

    The token cap compares a claim with the other mergeable candidates only, so one inflated claim
    cannot raise the bar for itself, and with a single candidate there is nothing to cap against.
    """
    keys = [(c.learner, c.phase) for c in candidates]
    if len(set(keys)) != len(keys):
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"duplicate (learner, phase) candidates in round {round_}: {duplicates}")

    dropped: list[Dropped] = []
    eligible: list[tuple[Candidate, int]] = []
    for c in candidates:
        staleness = round_ - c.base_round
        if staleness < 0:
            dropped.append(Dropped(c, f"base round from the future: base_round {c.base_round} > round {round_}"))
        elif staleness > rule.max_staleness:
            dropped.append(Dropped(c, f"stale: staleness {staleness} > max {rule.max_staleness}"))
        elif c.tokens <= 0:
            dropped.append(Dropped(c, f"no tokens: claims {c.tokens}"))
        else:
            eligible.append((c, staleness))

    weighted: list[Weighted] = []
    for i, (c, staleness) in enumerate(eligible):
        others = [o.tokens for j, (o, _) in enumerate(eligible) if j != i]
        counted = c.tokens
        if others:
            counted = min(counted, int(rule.token_cap * statistics.median(others)))
        weight = counted / (1.0 + rule.staleness_lambda * staleness)
        weighted.append(Weighted(c, staleness, counted, weight))

    def order(item: Weighted | Dropped) -> tuple[str, int]:
        return item.candidate.learner, item.candidate.phase

    return sorted(weighted, key=order), sorted(dropped, key=order)


def weighted_average(tensors: Iterable[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Σ w_i·g_i / Σ w_i for one tensor, summed in float64 in the order given, returned as float32.

    `tensors` may be lazy (decoded as they are needed): only the float64 sum is held."""
    if not weights:
        raise ValueError("need one weight per tensor and at least one of each, got no weights")
    total = 0.0
    for w in weights:  # left to right on purpose: Python 3.12's sum() compensates and would change bits
        total += w
    if not total > 0:
        raise ValueError(f"weights must sum to a positive number, got {total}")
    given = iter(tensors)
    acc = None
    for i, w in enumerate(weights):
        tensor = next(given, None)
        if tensor is None:
            raise ValueError(f"need one weight per tensor and at least one of each, got {i} and {len(weights)}")
        if acc is None:
            acc = torch.zeros(tensor.shape, dtype=torch.float64, device=tensor.device)
        elif tensor.shape != acc.shape:
            raise ValueError(f"cannot average tensors of shapes {tuple(acc.shape)} and {tuple(tensor.shape)}")
        acc.add_(tensor, alpha=w)  # promoted to float64 element by element: no float64 copy of the tensor
        del tensor  # let go of it before the next one is read
    if next(given, None) is not None:
        raise ValueError(f"need one weight per tensor and at least one of each, got more than {len(weights)} tensors")
    return acc.div_(total).to(torch.float32)  # in place: the same values as acc / total, no second float64 copy


def outer_step(
    param: torch.Tensor, momentum: torch.Tensor | None, delta: torch.Tensor, lr: float, mu: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Nesterov step with the merged delta as the gradient; returns (new param, new momentum).

    The same operations as torch.optim.SGD(nesterov=True, dampening=0), so it matches it exactly:
    m ← μ·m + Δ (m = Δ on the first step);  θ ← θ − lr·(Δ + μ·m).
    """
    return outer_step_(param.clone(), None if momentum is None else momentum.clone(), delta, lr, mu)


def outer_step_(
    param: torch.Tensor, momentum: torch.Tensor | None, delta: torch.Tensor, lr: float, mu: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`outer_step` in place: `param` and `momentum` (a new one on the first step) are updated and
    returned, so a synchronizer holding θ and m needs no second copy of either."""
    if momentum is None:
        momentum = delta.clone()
    else:
        momentum.mul_(mu).add_(delta)
    param.add_(delta.add(momentum, alpha=mu), alpha=-lr)
    return param, momentum


def merge_tensor_(
    param: torch.Tensor,
    momentum: torch.Tensor | None,
    deltas: Iterable[torch.Tensor],
    weights: list[float],
    rule: MergeSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One parameter of a round, in place: the weighted average of its deltas, then the outer
    step. Whole-model merges and the synchronizer's tensor-by-tensor merge both come here."""
    return outer_step_(param, momentum, weighted_average(deltas, weights), rule.outer_lr, rule.outer_momentum)


def merge_round(
    params: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor] | None,
    deltas: list[dict[str, torch.Tensor]],
    weights: list[float],
    rule: MergeSettings,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """θ_r and the new momentum from the parent's θ and momentum and the weighted deltas (inputs
    left as they are).

    The same per-tensor step as the synchronizer's, so `islands audit --replay` reproduces the
    published bits.
    """
    model, new_momentum = {}, {}
    for name, param in params.items():
        prev = momentum[name].clone() if momentum is not None else None
        model[name], new_momentum[name] = merge_tensor_(param.clone(), prev, (d[name] for d in deltas), weights, rule)
    return model, new_momentum


def apply_update(params: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """θ_r = θ_{r−1} + decoded update, elementwise in float32: the one way anyone computes it."""
    return {name: param.add(update[name]) for name, param in params.items()}


def encode_update(
    params: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    residual: dict[str, torch.Tensor],
    codec: str,
    topk: TopkSettings | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the update's wire tensors, θ_r as readers rebuild it, the new residual) for a step from
    `params` towards `target` (merge_round's θ), carrying the previous round's `residual`
    (`topk`: the run's settings, for that codec)."""
    wire, rebuilt, new_residual = {}, {}, {}
    for name, param in params.items():
        parts, rebuilt[name], left = encode_update_tensor(name, param, target[name], residual, codec, topk)
        wire.update(parts)
        new_residual.update(left)
    return wire, rebuilt, new_residual


def encode_update_tensor(
    name: str,
    param: torch.Tensor,
    target: torch.Tensor,
    residual: dict[str, torch.Tensor],
    codec: str,
    topk: TopkSettings | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """One tensor of `encode_update` (the synchronizer's merge calls it tensor by tensor): its wire
    entries, its θ_r as `apply_update` rebuilds it, its part of the new residual."""
    carried = {name: residual[name]} if name in residual else {}
    wire, decoded, left = compress_with_feedback({name: target - param}, carried, codec, topk)
    # Kept in bf16: half the synchronizer's memory for it, and its own rounding (2^-9 of what the
    # codec dropped) is negligible next to what it corrects.
    return wire, param.add(decoded[name]), {n: t.to(RESIDUAL_DTYPE) for n, t in left.items()}


def encode_update_chunk_(
    name: str,
    param: torch.Tensor,
    target: torch.Tensor,
    residual: torch.Tensor | None,
    codec: str,
    topk: TopkSettings | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """`encode_update_tensor` for a run of whole BLOCKs of one flattened tensor (the synchronizer's
    streaming merge), `param` turned into its θ_r in place (as `apply_update` rebuilds it) and
    `target` used up: its wire entries with the integers packed, not yet deflated (the caller
    deflates the tensor's as one stream), θ_r (`param`), its part of the new residual (None for
    fp32). Every step is value by value or block by block, and in place only where the values
    are the same, so the chunks put end to end are `encode_update_tensor`'s bits. With `topk`
    the run must be whole chunks of `topk.chunk` values (the tensor's last run may end shorter):
    each chunk is chosen from on its own, so that too is value by value."""
    sent = target.sub_(param)
    if residual is not None:
        sent.add_(residual, alpha=feedback_decay(codec, topk))
    sent = sent.float()
    packed = quantized_wire({name: sent}, codec, topk)
    decoded = from_wire(packed, codec)[name]  # from the packed integers: nothing to inflate
    left = None if codec == "fp32" else sent.sub_(decoded).to(RESIDUAL_DTYPE)
    return packed, param.add_(decoded), left
