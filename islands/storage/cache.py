"""A region's copy of the global bucket's round objects, so that each crosses regions once.

Learners read a checkpoint or an update through their region's bucket: the copy sits under the
same round and content address (`layout.cache_key`), is written put-if-absent and is used only
once its sha256 matches the manifest's. Learners of one region tend to miss together (they all
see a new round at once), so the first one claims the fetch with a small put-if-absent marker
and the others wait for its copy; they fetch the original themselves only if no copy appears
within CLAIM_WAIT_S (the claimer died), and a damaged copy is replaced from the original.

`regional_spool` takes the same way for an object as large as a model: spooled to a local file
as it is read (storage.spool) and copied to the region from that file, never whole in memory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from islands.storage import layout
from islands.storage.encoded import EncodedObject
from islands.storage.manifest import ObjectRef
from islands.storage.spool import Spooled, spool
from islands.storage.store import IntegrityError, ObjectMissing, ObjectStore

CLAIM_WAIT_S = 60.0
T = TypeVar("T")
POLL_S = 0.25


def regional_get(
    region: ObjectStore,
    global_: ObjectStore,
    run: str,
    ref: ObjectRef,
    owner: str,
    wait_s: float = CLAIM_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
) -> bytes:
    """The bytes `ref` names, from the region's copy; the region's first reader makes the copy."""
    key = layout.cache_key(run, ref.key)

    def copy() -> bytes:
        data = global_.get(ref.key, sha256=ref.sha256)
        region.put_if_absent(key, data)
        return data

    return _through_region(region, key, owner, lambda: region.get(key, sha256=ref.sha256), copy, wait_s, sleep)


def regional_spool(
    region: ObjectStore,
    global_: ObjectStore,
    run: str,
    ref: ObjectRef,
    owner: str,
    path: Path,
    wait_s: float = CLAIM_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
) -> Spooled:
    """`regional_get`, the object spooled to `path` (hashed on the way) instead of returned."""
    key = layout.cache_key(run, ref.key)

    def copy() -> Spooled:
        got = _spooled(global_, ref.key, ref, path)
        region.put_if_absent(key, EncodedObject((path,), got.sha256))
        return got

    return _through_region(region, key, owner, lambda: _spooled(region, key, ref, path), copy, wait_s, sleep)


def _through_region(
    region: ObjectStore,
    key: str,
    owner: str,
    read: Callable[[], T],
    copy: Callable[[], T],
    wait_s: float,
    sleep: Callable[[float], None],
) -> T:
    """The region's copy at `key` if it is there and sound (a damaged one is deleted and made
    again); else the first reader claims the copy with a put-if-absent marker and makes it, and
    the others wait for it, up to `wait_s`, then make it themselves."""
    try:
        return read()
    except ObjectMissing:
        pass
    except IntegrityError:
        region.delete(key)  # damaged in storage: garbage; copied again below
        return copy()
    claim = json.dumps({"owner": owner, "at": time.time()}).encode()
    if region.put_if_absent(layout.claim_key(key), claim):
        return copy()
    waited = 0.0
    while waited < wait_s:
        sleep(POLL_S)
        waited += POLL_S
        if region.exists(key):
            try:
                return read()
            except IntegrityError:
                break
    return copy()


def _spooled(store: ObjectStore, key: str, ref: ObjectRef, path: Path) -> Spooled:
    got = spool(store, key, path, max_bytes=ref.bytes)
    if got.sha256 != ref.sha256 or got.bytes != ref.bytes:
        raise IntegrityError(f"{store.url}/{key}: sha256 {got.sha256[:12]}… ≠ expected {ref.sha256[:12]}…")
    return got
