"""Objects copied to local disk in one streaming pass, hashed on the way.

A large object (a delta, a checkpoint) is never whole in memory: it is read in chunks, written to
a local file and hashed twice at once — the whole object (its identity in manifests) and the
bytes after its safetensors header (the `body_sha256` the writer recorded). The whole-object
hash runs on a thread of its own (hashlib lets go of the GIL), beside the body hash and the
write, so the two hashes take one hash's time where a core is free. A spooled file is
only ever read by the process that spooled it; a retry spools again from storage.
"""

from __future__ import annotations

import hashlib
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from storage.store import ObjectStore


@dataclass(frozen=True)
class Spooled:
    path: Path
    bytes: int
    sha256: str  # of the whole object
    body_sha256: str  # of the bytes after the header its first 8 bytes announce


def spool(store: ObjectStore, key: str, path: Path, max_bytes: int | None = None) -> Spooled:
    """Copy `key` to `path` (refusing more than `max_bytes`) and hash it on the way."""
    whole, body = hashlib.sha256(), hashlib.sha256()
    body_start, offset = 8, 0
    hashing: Future | None = None  # the whole-object hash of the chunk before this one
    with ThreadPoolExecutor(1, thread_name_prefix="spool-hash") as pool, open(path, "wb") as out:
        for chunk in store.get_chunks(key, max_bytes=max_bytes):  # every chunk but the last is full-size
            if offset == 0 and len(chunk) >= 8:
                body_start += struct.unpack("<Q", chunk[:8])[0]
            if hashing is not None:
                hashing.result()
            hashing = pool.submit(whole.update, chunk)
            if offset + len(chunk) > body_start:
                body.update(memoryview(chunk)[max(0, body_start - offset) :])
            out.write(chunk)
            offset += len(chunk)
        if hashing is not None:
            hashing.result()
    return Spooled(path, offset, whole.hexdigest(), body.hexdigest())
