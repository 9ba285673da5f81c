"""Objects copied to local disk in one streaming pass, hashed on the way.

A large object (a delta, a checkpoint) is never whole in memory: it is read in chunks, written to
a local file and hashed twice at once — the whole object (its identity in manifests) and the
bytes after its safetensors header (the `body_sha256` the writer recorded). The whole-object
hash runs on a thread of its own (hashlib lets go of the GIL), beside the body hash and the
write, so the two hashes take one hash's time where a core is free. A spooled file is
only ever read by the process that spooled it; a retry spools again from storage.

What a reader is done with can be handed back before the file goes (`punch_holes`): on the VMs
this runs on, writing into page cache the machine has not used lately runs at a few hundred
MB/s, and into pages just freed at memory speed.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import struct
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from islands.storage.store import ObjectStore


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


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@cache
def _fallocate():
    """libc's fallocate(2) with 64-bit offsets, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fallocate = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if fallocate is not None:
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        fallocate.restype = ctypes.c_int
    return fallocate


def punch_holes(path: Path, spans: list[tuple[int, int]]) -> None:
    """Deallocate each (offset, length) of a local file: its size stays, those bytes read as
    zeros from now on, and the page cache and disk blocks they held are free at once. Where the
    platform or the filesystem cannot, the file keeps those pages until it is removed."""
    fallocate = _fallocate()
    if fallocate is None:
        return
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, length in spans:
            if length and fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
                return
    finally:
        os.close(fd)


class OwnedFolder:
    """A fresh local folder named `prefix…`, owned by this process for as long as it holds an
    exclusive lock on the folder itself (flock(2) of its descriptor). The kernel lets go of the
    lock when the process dies however it dies, so a folder whose lock can be taken belongs to
    nobody: a synchronizer or learner killed mid-round cannot clean up after itself, and the next
    one of the same name does (`remove_dead`)."""

    def __init__(self, prefix: str):
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self._owner: int | None = os.open(self.path, os.O_RDONLY)
        fcntl.flock(self._owner, fcntl.LOCK_EX)

    def remove(self) -> None:
        """Delete the folder and let go of it; again, nothing."""
        if self._owner is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._owner)
            self._owner = None


def spool_prefix(run: str, round_: int | None = None) -> str:
    """The name of a synchronizer's spool folders of `run` (of round `round_`)."""
    return f"islands-spool-{run}-round" + ("" if round_ is None else f"{round_:06d}-")


def remove_dead(prefix: str) -> list[Path]:
    """Delete the local folders named `prefix…` that no live process owns (OwnedFolder): each
    may hold a model's size or more. Live ones, this process's own too, stay (a second lock on
    the same folder is refused)."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # removed meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
