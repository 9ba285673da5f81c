"""The manifest: a round's commit record, and a link in the run's hash chain.

A round exists once its manifest exists (written last, put-if-absent). The manifest names the
sha256 of every object of the round and of its parent manifest, so a reader holding the newest
manifest can verify the whole run from storage alone. Serialized as canonical JSON (sorted keys,
no spaces) so that the same content always has the same hash.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_bytes(self) -> bytes:
        """Canonical JSON: the same content always has the same bytes, so the same hash."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


class ObjectRef(_Strict):
    key: str
    sha256: str
    bytes: int


class EncodedRef(ObjectRef):
    """An object written in a wire codec (storage.codec.encode_wire), which readers decode."""

    codec: str


class Contribution(_Strict):
    """A delta that was merged into this round."""

    learner: str
    region: str
    phase: int
    base_round: int
    staleness: int
    tokens: int
    tokens_counted: int
    weight: float
    loss: float
    bytes: int
    key: str
    sha256: str
    finished_at: float  # the learner's clock when it wrote the delta (unix seconds)
    seconds: float  # how long the learner's phase took
    seen_at: float  # the synchronizer's clock when it first listed the delta
    norm: float | None = None  # the delta's L2 norm, which later rounds' norm limit compares with


class Excluded(_Strict):
    """A delta left out of this round for good: quarantined (invalid) or dropped (too stale)."""

    kind: Literal["quarantined", "dropped"]
    key: str
    reason: str
    learner: str | None = None
    region: str | None = None
    phase: int | None = None
    tokens: int = 0
    sha256: str | None = None


class Quorum(_Strict):
    min_quorum: int
    max_quorum: int
    received: int
    learners: list[str]
    waited_s: float
    closed_by: Literal["all-in", "quorum+grace", "timeout", "initial"]


class Evaluation(_Strict):
    """A published round's held-out loss, written after its manifest: the learners fetch a round
    as soon as it is committed, and the evaluation is not on their way."""

    run: str
    round: int
    model_sha256: str  # the checkpoint evaluated: the manifest's model
    eval_loss: float
    batches: int
    seconds: float


class Manifest(_Strict):
    schema_version: int = SCHEMA_VERSION
    run: str
    round: int
    parent_round: int | None
    parent_sha256: str | None
    created_at: str
    model: ObjectRef
    outer: ObjectRef | None
    update: EncodedRef | None = None  # θ_r − θ_{r−1} as applied; absent in round 0
    contributions: list[Contribution] = []
    excluded: list[Excluded] = []
    quorum: Quorum
    hyper: dict[str, float | int | str]
    eval_loss: float | None = None  # round 0's held-out loss; a later round's is in its Evaluation
    timings: dict[str, float] = {}
    tokens_applied: int = 0  # tokens of every delta merged into rounds 1…r: the run's progress

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        return cls.model_validate(json.loads(data))

    def consumed(self) -> set[tuple[str, str]]:
        """(region, delta key) of every delta this round used up: merged, quarantined or dropped.
        By region too: one key in two regions' buckets names two objects, judged apart."""
        return {(c.region, c.key) for c in self.contributions} | {(e.region or "", e.key) for e in self.excluded}
