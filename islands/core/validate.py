"""What makes a delta acceptable, as pure functions: each refuses with a short reason or passes.

Kept apart from reading and from Prefect so the synchronizer, `islands audit` and the tests all
judge a delta by the same rules. Every field a learner controls is read here, once, against a
bound: its metadata (METADATA: integers in range, finite floats, bounded strings, a known codec;
no other field), its tensors' names, shapes and dtypes, and its norm. A reason quotes what the
learner wrote only through `shown`, so no manifest holds more than a few dozen of its characters.
"""

from __future__ import annotations

import math
import re
import statistics
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from islands.core.codecs import CODECS

MAX_REASON = 240  # characters of a quarantine reason, as a manifest records it
MAX_SHOWN = 40  # characters of a learner's own text quoted in a reason


class Invalid(ValueError):
    """The delta is refused; the message is the quarantine reason."""


@dataclass(frozen=True)
class Field:
    """One metadata field: its kind ("int", "float", "text", "codec", "sha256"), its bounds,
    and whether a delta must have it."""

    kind: str
    required: bool = True
    low: float = 0
    high: float = 0
    pattern: str = ""  # text fields: the whole value must match


_BIG = 2**62
METADATA = {
    "run": Field("text", pattern=r"[a-z0-9-]{3,42}"),
    "learner": Field("text", pattern=r"[a-z0-9-]{3,46}"),
    "region": Field("text", pattern=r"[a-z0-9-]{3,42}"),
    "phase": Field("int", high=999_999_999),
    "base_round": Field("int", high=999_999),
    "start_round": Field("int", required=False, high=999_999),
    "rebases": Field("text", required=False, pattern=r"([0-9]{1,9}:[0-9]{1,6}(,[0-9]{1,9}:[0-9]{1,6}){0,99})?"),
    "inner_steps": Field("int", low=1, high=10**7),
    "tokens": Field("int", low=1, high=2**53),
    "loss": Field("float", high=1e4),
    "seconds": Field("float", required=False, high=1e8),
    "finished_at": Field("float", required=False, high=1e11),
    "io_read": Field("int", required=False, high=_BIG),
    "io_read_global": Field("int", required=False, high=_BIG),
    "io_written": Field("int", required=False, high=_BIG),
    "codec": Field("codec"),
    "body_sha256": Field("sha256"),
}
REQUIRED_METADATA = tuple(name for name, f in METADATA.items() if f.required)
_INT = re.compile(r"0|[1-9][0-9]{0,18}", re.ASCII)
_FLOAT = re.compile(r"-?[0-9]{1,20}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?", re.ASCII)
_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)


def shown(value: object) -> str:
    """A learner's text as a reason may quote it: printable ASCII, at most MAX_SHOWN characters."""
    text = ascii(value)[1:-1] if isinstance(value, str) else ascii(value)
    text = text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."
    return f"'{text}'" if isinstance(value, str) else text


def short(reason: str) -> str:
    """A reason as a manifest records it: one line without control or format characters, at most
    MAX_REASON characters (the same text again gives the same text)."""
    text = "".join("?" if unicodedata.category(c)[0] == "C" or (c.isspace() and c != " ") else c for c in reason)
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def parse_field(name: str, value: object) -> int | float | str:
    """One metadata field's value, read against its bounds; Invalid names the field and the fault."""
    f = METADATA.get(name)
    if f is None:
        raise Invalid(f"unknown metadata field {shown(name)}")
    if not isinstance(value, str):
        raise Invalid(f"metadata {name}: not a string but {type(value).__name__}")
    if f.kind == "int":
        if not _INT.fullmatch(value):
            raise Invalid(f"metadata {name}: {shown(value)} is not a non-negative integer")
        number = int(value)
        if not f.low <= number <= f.high:
            raise Invalid(f"metadata {name}: {number if number < 10**12 else '>1e12'} outside [{f.low:g}, {f.high:g}]")
        return number
    if f.kind == "float":
        if not _FLOAT.fullmatch(value):
            raise Invalid(f"metadata {name}: {shown(value)} is not a finite decimal number")
        number = float(value)
        if not (math.isfinite(number) and f.low <= number <= f.high):
            raise Invalid(f"metadata {name}: {number:.4g} outside [{f.low:g}, {f.high:g}]")
        return number
    if f.kind == "codec":
        if value not in CODECS:
            raise Invalid(f"metadata codec: {shown(value)} is not one of {', '.join(CODECS)}")
        return value
    if f.kind == "sha256":
        if not _SHA256.fullmatch(value):
            raise Invalid(f"metadata {name}: {shown(value)} is not a sha256 in hex")
        return value
    if not re.fullmatch(f.pattern, value, re.ASCII):
        raise Invalid(f"metadata {name}: {shown(value)} is not of the form {f.pattern}")
    return value


def read_field(meta: dict, name: str, default: int | float | str) -> int | float | str:
    """One field of a delta's metadata, or `default` where it is missing or refused: for readers
    that only report (status, summaries), so that no delta can make them fail."""
    try:
        return parse_field(name, meta[name])
    except (KeyError, Invalid):
        return default


@dataclass(frozen=True)
class Expected:
    """What the synchronizer knows of a delta before reading it: the key's owner (its learner, that
    learner's region, which must be the bucket's), the key's phase, the newest published round, H
    (no phase trains more steps) and the tokens one inner step trains (batch × block)."""

    run: str
    learner: str
    region: str
    phase: int
    newest_round: int
    max_steps: int
    tokens_per_step: int


@dataclass(frozen=True)
class Claims:
    """A delta's metadata, read and bounded."""

    base_round: int
    inner_steps: int
    tokens: int  # the claim, capped at what its inner steps can hold
    loss: float
    seconds: float
    finished_at: float | None  # None: not given


def read_claims(meta: dict, expected: Expected) -> Claims:
    """Every metadata field parsed against its bounds, and the claims against what the key and
    the run say. The learner's identity is the key's owner; the metadata must agree with it."""
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise Invalid(f"metadata missing: {', '.join(missing)}")
    values = {name: parse_field(name, value) for name, value in sorted(meta.items())}
    if values["run"] != expected.run:
        raise Invalid(f"wrong run id {shown(values['run'])} (this run is '{expected.run}')")
    if values["learner"] != expected.learner or values["phase"] != expected.phase:
        raise Invalid(
            f"metadata names {values['learner']} phase {values['phase']}, "
            f"but the key says {expected.learner} phase {expected.phase}"
        )
    if values["region"] != expected.region:
        raise Invalid(f"metadata names region {values['region']}, but {expected.learner} is of {expected.region}")
    base = values["base_round"]
    if base > expected.newest_round:
        raise Invalid(f"base round {base} is from the future (newest published round is {expected.newest_round})")
    if values.get("start_round", base) > base:
        raise Invalid(f"start round {values['start_round']} is after its base round {base}")
    if values["inner_steps"] > expected.max_steps:
        raise Invalid(f"inner steps {values['inner_steps']} > H = {expected.max_steps}")
    return Claims(
        base_round=base,
        inner_steps=values["inner_steps"],
        tokens=min(values["tokens"], values["inner_steps"] * expected.tokens_per_step),
        loss=values["loss"],
        seconds=values.get("seconds", 0.0),
        finished_at=values.get("finished_at"),
    )


def claimed_tokens(meta: dict, max_steps: int, tokens_per_step: int) -> int:
    """The tokens a delta's metadata claims, capped at what its inner steps (at most H) can hold;
    0 where either field is missing or refused. Ledgers count these, never the raw claim."""
    steps = read_field(meta, "inner_steps", 0)
    return min(read_field(meta, "tokens", 0), min(steps, max_steps) * tokens_per_step)


def check_tensors(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> str | None:
    """Same names, shapes and float dtype as the model, all values finite."""
    reason = check_names(tensors, reference)
    for name, ref in reference.items():
        reason = reason or check_tensor(name, tensors[name], ref)[0]
    return reason


def check_names(names: Iterable[str], reference: dict[str, torch.Tensor]) -> str | None:
    """Exactly the model's tensor names."""
    given = set(names)
    if given != set(reference):
        extra, missing = sorted(given - set(reference)), sorted(set(reference) - given)
        return (
            f"wrong tensor names (unexpected {len(extra)}: {', '.join(shown(n) for n in extra[:2]) or '-'}; "
            f"missing {len(missing)}: {', '.join(missing[:2]) or '-'})"
        )
    return None


def check_tensor(name: str, t: torch.Tensor, ref: torch.Tensor) -> tuple[str | None, float]:
    """(reason or None, the tensor's L2 norm) for one tensor of a delta: the model's shape, a
    float dtype, finite values. The norm is finite exactly when every value is, so one pass does
    both: in the tensor's own dtype first (fast), and again in float64, where squares of finite
    values cannot overflow, only when that overflowed."""
    if tuple(t.shape) != tuple(ref.shape):
        return f"wrong shape for {name}: {shown(tuple(t.shape))} instead of {tuple(ref.shape)}", 0.0
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


def norm_bound(norm: float, history: list[float], model_norm: float, limit: float) -> str | None:
    """Why a delta of L2 norm `norm` is too large to merge, or None (`merge.norm_limit`): it may
    be at most `limit`× the median norm of the deltas merged in recent rounds (`history`, which
    holds only deltas that passed this check), and never larger than the model it would move
    (`model_norm`, θ_{r−1}). Both hold for a delta alone in its round, or with one other."""
    if norm > model_norm:
        return f"norm {norm:.3g} above the model's own norm {model_norm:.3g}"
    reference = statistics.median(history) if history else None
    if reference is not None and norm > limit * reference:
        return f"norm {norm:.3g} above {limit:g}× the median {reference:.3g} of recently merged deltas"
    return None


def norm_outliers(norms: dict[str, float], limit: float) -> dict[str, str]:
    """Keys whose norm is more than `limit`× from the median of the round's (needs 3 or more),
    either way: the median is an honest norm whenever honest deltas are the majority."""
    out = {}
    if len(norms) < 3:
        return out
    med = statistics.median(norms.values())
    for key, n in norms.items():
        if med > 0 and (n > limit * med or n < med / limit):
            out[key] = f"norm {n:.3g} far outside the others' (median {med:.3g}, limit ×{limit:g})"
    return out
