"""Reading committed rounds: manifests found by listing, trusted only after their hash chain checks.

A round exists once its manifest exists; objects a manifest names are read back with their
sha256 checked, so a reader never trains on or merges bytes that were not committed.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from pydantic import ValidationError

from islands.core.config import RunConfig
from islands.storage import layout
from islands.storage.codec import (
    MAX_HEADER_BYTES,
    CodecError,
    TensorFile,
    chunk_values,
    encode_state_object,
    read_header,
)
from islands.storage.encoded import EncodedObject
from islands.storage.manifest import EncodedRef, Evaluation, Manifest, ObjectRef
from islands.storage.spool import spool
from islands.storage.store import IntegrityError, ObjectMissing, ObjectStore, StoreError, sha256_hex


def latest_round(store: ObjectStore, run: str) -> int | None:
    """Newest round with a manifest (discovery; the manifest itself is the commit)."""
    rounds = [r for k in store.list(layout.rounds_prefix(run)) if (r := layout.parse_manifest_key(k)) is not None]
    return max(rounds) if rounds else None


def newest_round_from(store: ObjectStore, run: str, held: int | None) -> int | None:
    """Newest round with a manifest, found from `held` (a round known to be published) by asking
    for the next rounds' manifests by key: one HEAD a poll while nothing new is out, where a
    listing of the run's rounds (an S3 LIST) grows with every round. Rounds are published in
    order, so the first missing manifest ends the search."""
    if held is None:
        return latest_round(store, run)
    newest = held
    while store.exists(layout.manifest_key(run, newest + 1)):
        newest += 1
    return newest


def read_manifest(store: ObjectStore, run: str, round_: int) -> tuple[Manifest, str]:
    data = store.get(layout.manifest_key(run, round_))
    return Manifest.from_bytes(data), sha256_hex(data)


def read_evaluation(store: ObjectStore, manifest: Manifest) -> Evaluation | None:
    """The round's evaluation, None while it is not written yet; one of another checkpoint than
    the manifest's is refused."""
    try:
        evaluation = Evaluation.model_validate(json.loads(store.get(layout.eval_key(manifest.run, manifest.round))))
    except ObjectMissing:
        return None
    if evaluation.model_sha256 != manifest.model.sha256 or evaluation.round != manifest.round:
        raise IntegrityError(f"round {manifest.round}: its evaluation is of another checkpoint")
    return evaluation


def evaluated(manifest: Manifest, loss: float) -> Manifest:
    """The manifest as readers show it: with the round's held-out loss (a copy; committed
    manifests are never rewritten)."""
    return manifest.model_copy(update={"eval_loss": loss})


def with_eval_losses(store: ObjectStore, manifests: list[Manifest]) -> list[Manifest]:
    """The manifests, each with its round's held-out loss where it is known (None where the
    evaluation is not written yet), for readers that show or test it."""
    out = []
    for m in manifests:
        if m.eval_loss is None and (evaluation := read_evaluation(store, m)) is not None:
            m = evaluated(m, evaluation.eval_loss)
        out.append(m)
    return out


def read_chain(
    store: ObjectStore, run: str, known: list[tuple[Manifest, str]] | None = None
) -> list[tuple[Manifest, str]]:
    """Every manifest from round 0 to the newest, with the parent links checked.

    `known`: a chain this process read and checked before. Committed manifests never change, so
    only the rounds after it are read (a synchronizer reads one manifest a round, not all), and
    found by key rather than by listing every round."""
    chain: list[tuple[Manifest, str]] = list(known or [])
    newest = newest_round_from(store, run, len(chain) - 1 if chain else None)
    for r in range(len(chain), (newest if newest is not None else -1) + 1):
        manifest, sha = read_manifest(store, run, r)
        if manifest.round != r or manifest.run != run:
            raise IntegrityError(f"round {r}: manifest says run {manifest.run!r} round {manifest.round}")
        if chain:
            parent, parent_sha = chain[-1]
            if manifest.parent_round != parent.round or manifest.parent_sha256 != parent_sha:
                raise IntegrityError(f"round {r}: parent link does not match round {parent.round}'s manifest")
        chain.append((manifest, sha))
    return chain


def put_encoded(store: ObjectStore, key_for_sha, encoded: EncodedObject) -> ObjectRef:
    """Upload an encoded object under its content-addressed key; a retry finds the same bytes there."""
    key = key_for_sha(encoded.sha256)
    store.put_or_verify(key, encoded)
    return ObjectRef(key=key, sha256=encoded.sha256, bytes=encoded.size)


def put_tensors(
    store: ObjectStore, key_for_sha, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> ObjectRef:
    """Write exact tensors under a content-addressed key; a retry finds the same bytes there.

    The object is hashed and uploaded straight from the tensors' memory, so its bytes are never
    copied into memory or to disk beside them."""
    return put_encoded(store, key_for_sha, encode_state_object(tensors, metadata))


def checkpoint_metadata(run: str, round_: int) -> dict[str, str]:
    """The metadata of round r's model and outer state: part of the model's hash, so whoever
    rebuilds θ_r from θ_{r−1} and the update encodes it with these to compare."""
    return {"run": run, "round": str(round_)}


def update_metadata(run: str, round_: int, codec: str) -> dict[str, str]:
    """The metadata of round r's encoded update: the checkpoint's, and the codec."""
    return {**checkpoint_metadata(run, round_), "codec": codec}


def put_update(store: ObjectStore, run: str, round_: int, encoded: EncodedObject, codec: str) -> EncodedRef:
    """Upload round r's encoded update under its content address (a retry finds the same bytes)."""
    ref = put_encoded(store, lambda sha: layout.update_key(run, round_, sha), encoded)
    return EncodedRef(**ref.model_dump(), codec=codec)


def get_tensors(store: ObjectStore, ref: ObjectRef) -> dict[str, torch.Tensor]:
    """The tensors of a committed object, its sha256 checked; read through a temporary file so
    the object's bytes and its tensors are never both in memory."""
    with tempfile.TemporaryDirectory(prefix="islands-get-") as tmp:
        got = spool(store, ref.key, Path(tmp) / "object.safetensors")
        if got.sha256 != ref.sha256:
            raise IntegrityError(f"{store.url}/{ref.key}: sha256 {got.sha256[:12]}… ≠ expected {ref.sha256[:12]}…")
        stored = TensorFile(got.path, got.body_sha256)
        return {name: stored.stored(name) for name in stored.names}


def spool_tensors(store: ObjectStore, ref: ObjectRef, path: Path) -> TensorFile:
    """A committed object copied to the local file `path`, its sha256 checked, its tensors left
    there to be read a chunk at a time (the synchronizer's θ_{r−1} and outer state)."""
    got = spool(store, ref.key, path)
    if got.sha256 != ref.sha256:
        path.unlink(missing_ok=True)
        raise IntegrityError(f"{store.url}/{ref.key}: sha256 {got.sha256[:12]}… ≠ expected {ref.sha256[:12]}…")
    return TensorFile(got.path, got.body_sha256)


class SpooledTensors(Mapping[str, torch.Tensor]):
    """Some tensors of a local safetensors file under names of their own (`prefix` taken off
    the stored ones): read whole only where a name is asked for, and a chunk at a time by
    `chunks_of`. Nothing is held in memory."""

    def __init__(self, file: TensorFile, prefix: str = "", skip: str | None = None):
        self.file = file
        self.stored = {
            n[len(prefix) :]: n
            for n in file.names
            if n.startswith(prefix) and not (skip is not None and n.startswith(skip))
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.file.stored(self.stored[name])

    def __contains__(self, name: object) -> bool:
        return name in self.stored  # Mapping's own would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.shape(self.stored[name])

    def chunks(self, name: str, values: int) -> Iterator[torch.Tensor]:
        return self.file.stored_chunks(self.stored[name], values)


def shape_of(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape, read from the header where the tensors are spooled."""
    return tensors.shape(name) if isinstance(tensors, SpooledTensors) else tuple(tensors[name].shape)


def numel_of(tensors: Mapping[str, torch.Tensor], name: str) -> int:
    return math.prod(shape_of(tensors, name))


def chunks_of(tensors: Mapping[str, torch.Tensor], name: str, values: int) -> Iterator[torch.Tensor]:
    """One tensor, flat, `values` elements at a time (whole 128-value blocks), each chunk in
    memory of its own: from the file for spooled tensors, copied out of memory otherwise."""
    if isinstance(tensors, SpooledTensors):
        yield from tensors.chunks(name, values)
        return
    flat, step = tensors[name].detach().reshape(-1), chunk_values(values)
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step].clone()


def read_config(store: ObjectStore, run: str) -> RunConfig:
    """The run's configuration as `islands run` wrote it (raises ObjectMissing for no such run,
    IntegrityError, one line, for an object there that is not a config islands wrote)."""
    key = layout.config_key(run)
    try:
        return RunConfig.model_validate_json(store.get(key))
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        where = ".".join(map(str, first["loc"])) or "its JSON"
        raise IntegrityError(
            f"{store.url}/{key} is not a run config islands wrote ({where}: {str(first['msg'])[:120]})"
        ) from None


def stop_requested(store: ObjectStore, run: str) -> bool:
    return store.exists(layout.stop_key(run))


def object_header(store: ObjectStore, key: str) -> tuple[dict, dict[str, str], int]:
    """A safetensors object's (tensor table, metadata, offset of the tensor data) from two
    ranged reads, without fetching the tensors."""
    size = store.size(key)
    head = store.get_range(key, 0, 8)
    n = int.from_bytes(head, "little")
    table, meta = read_header(head + store.get_range(key, 8, 8 + min(n, MAX_HEADER_BYTES)), object_size=size)
    return table, meta, 8 + n


def object_metadata(store: ObjectStore, key: str) -> dict[str, str]:
    """A safetensors object's metadata, without fetching the tensors."""
    return object_header(store, key)[1]


def reported_metadata(store: ObjectStore, key: str) -> dict[str, str]:
    """`object_metadata` for readers that only report (a run's summary, status): a learner may
    have written anything under its keys, so an object whose header does not read, or that is
    gone, reports nothing ({}) instead of failing the report."""
    try:
        return object_metadata(store, key)
    except (CodecError, StoreError):
        return {}
