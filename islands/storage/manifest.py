"""The manifest: a round's commit record, and a link in the run's hash chain.

A round exists once its manifest exists (written last, put-if-absent). The manifest names the
sha256 of every object of the round and of its parent manifest, so a reader holding the newest
manifest can verify the whole run from storage alone. Serialized as canonical JSON (sorted keys,
no spaces) so that the same content always has the same hash.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from islands.core.config import MergeSettings, QuorumSettings, RunConfig, TopkSettings

SCHEMA_VERSION = 2


class SchemaVersionError(ValueError):
    """A manifest of a schema_version this code does not read (written by another version of islands)."""


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
    body_sha256: str | None = None  # of its tensor bytes: the same tensors under another key are a duplicate


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
    body_sha256: str | None = None  # of its tensor bytes, where they read as such


class RoundSettings(_Strict):
    """The settings a round ran with: the merge rule and the topk codec's settings (what `audit
    --replay` recomputes the round with: the update's error-feedback decay is in no object) and
    the quorum rule, as the run's config gave them, and the run's number of learners, which an
    unset quorum.max_quorum stands for. Manifests from before the topk codec name none: theirs
    are the defaults, which no round of theirs used."""

    merge: MergeSettings
    quorum: QuorumSettings
    num_learners: int
    topk: TopkSettings = Field(default_factory=TopkSettings)

    @classmethod
    def of(cls, config: RunConfig) -> RoundSettings:
        return cls(merge=config.merge, quorum=config.quorum, num_learners=config.num_learners, topk=config.topk)

    @property
    def max_quorum(self) -> int:
        """Q_max as the round applied it: the setting, else every learner."""
        return self.quorum.max_quorum or self.num_learners


class Quorum(_Strict):
    """What the round's quorum decided; the rule it applied is the manifest's settings.quorum."""

    received: int  # learners with a delta merged
    learners: list[str]  # those learners; in round 0, every learner of the run
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
    schema_version: int = SCHEMA_VERSION  # from_bytes reads this one only
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
    settings: RoundSettings
    quorum: Quorum
    eval_loss: float | None = None  # round 0's held-out loss; a later round's is in its Evaluation
    timings: dict[str, float] = {}
    tokens_applied: int = 0  # tokens of every delta merged into rounds 1…r: the run's progress

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse and validate a stored manifest; SchemaVersionError (a ValueError, as JSON and
        validation errors are) when it is of a schema_version this code does not read."""
        doc = json.loads(data)
        if isinstance(doc, dict) and doc.get("schema_version") != SCHEMA_VERSION:
            found = f"schema_version {doc['schema_version']!r}" if "schema_version" in doc else "no schema_version"
            raise SchemaVersionError(
                f"manifest has {found}, and this version of islands reads schema_version {SCHEMA_VERSION} only; "
                "read it with the version that wrote it"
            )
        return cls.model_validate(doc)

    def consumed(self) -> set[tuple[str, str]]:
        """(region, delta key) of every delta this round used up: merged, quarantined or dropped.
        By region too: one key in two regions' buckets names two objects, judged apart."""
        return {(c.region, c.key) for c in self.contributions} | {(e.region or "", e.key) for e in self.excluded}
