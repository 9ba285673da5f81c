"""What makes a delta acceptable, as pure functions: each returns a reason to quarantine or None.

Kept apart from reading and from Prefect so the synchronizer, `islands audit` and the tests all
judge a delta by the same rules.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

import torch

REQUIRED_METADATA = ("run", "learner", "region", "phase", "base_round", "inner_steps", "tokens", "loss")
INT_FIELDS = ("phase", "base_round", "inner_steps", "tokens")


def check_metadata(meta: dict[str, str], run: str, learner: str, phase: int, round_: int) -> str | None:
    """The delta's own claims must be complete, parse, and agree with where it was found."""
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        return f"metadata missing: {', '.join(missing)}"
    try:
        ints = {k: int(meta[k]) for k in INT_FIELDS}
        loss = float(meta["loss"])
    except ValueError:
        return "metadata not numeric where it must be"
    if meta["run"] != run:
        return f"wrong run id {meta['run']!r} (this run is {run!r})"
    if meta["learner"] != learner or ints["phase"] != phase:
        return f"metadata names {meta['learner']} phase {ints['phase']}, but the key says {learner} phase {phase}"
    if ints["base_round"] > round_:
        return f"base round {ints['base_round']} is from the future (newest published round is {round_})"
    if ints["base_round"] < 0 or ints["tokens"] <= 0 or ints["inner_steps"] <= 0:
        return "base round, tokens and inner steps must be positive"
    if not math.isfinite(loss):
        return "loss is not finite"
    return None


def check_tensors(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> str | None:
    """Same names, shapes and float dtype as the model, all values finite."""
    reason = check_names(tensors, reference)
    for name, ref in reference.items():
        reason = reason or check_tensor(name, tensors[name], ref)[0]
    return reason


def check_names(names: Iterable[str], reference: dict[str, torch.Tensor]) -> str | None:
    """Exactly the model's tensor names."""
    if set(names) != set(reference):
        extra, missing = sorted(set(names) - set(reference)), sorted(set(reference) - set(names))
        return f"wrong tensor names (unexpected {extra[:3]}, missing {missing[:3]})"
    return None


def check_tensor(name: str, t: torch.Tensor, ref: torch.Tensor) -> tuple[str | None, float]:
    """(reason or None, the tensor's L2 norm) for one tensor of a delta: the model's shape, a
    float dtype, finite values. The norm is finite exactly when every value is, so one pass does
    both: in the tensor's own dtype first (fast), and again in float64, where squares of finite
    values cannot overflow, only when that overflowed."""
    if tuple(t.shape) != tuple(ref.shape):
        return f"wrong shape for {name}: {tuple(t.shape)} instead of {tuple(ref.shape)}", 0.0
    if not t.is_floating_point():
        return f"wrong dtype for {name}: {t.dtype}", 0.0
    norm = float(torch.linalg.vector_norm(t))
    if not math.isfinite(norm):
        norm = float(torch.linalg.vector_norm(t, dtype=torch.float64))
    if not math.isfinite(norm):
        return f"non-finite values (NaN or Inf) in {name}", norm
    return None, norm


def global_norm(norms: Iterable[float]) -> float:
    """The L2 norm of a whole delta from its tensors' norms."""
    return math.sqrt(sum(n * n for n in norms))


def norm_outliers(norms: dict[str, float], factor: float = 10.0) -> dict[str, str]:
    """Keys whose norm is more than `factor`× from the median of all (needs 3 or more).

    The median of all is an honest norm whenever honest deltas are the majority.
    """
    out = {}
    if len(norms) < 3:
        return out
    med = statistics.median(norms.values())
    for key, n in norms.items():
        if med > 0 and (n > factor * med or n < med / factor):
            out[key] = f"norm {n:.3g} far outside the others' (median {med:.3g}, limit ×{factor:g})"
    return out
