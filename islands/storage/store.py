"""The object-store contract: create-only writes, verified reads, head, list, delete — nothing else.

Every object is immutable once written. `put_if_absent` is the only write: it creates the key or
reports that something is there, and never replaces it. Listing discovers candidates; it never
decides a commit — manifests do.

`ObjectStore(url, storage_options)` picks the backend from the URL's scheme, as `pathlib.Path`
picks its flavour: `s3://` (storage.s3: conditional PUTs, errors read by their code),
`file://` or a plain path (storage.local: a hard link of a finished file), and `memory://`
(storage.local, unit tests of pure logic only). Each backend implements the primitives below;
what every store must do with them (counting, size limits, hash checks, verified retries) is
written once, here.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import itertools
import os
import posixpath
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import BinaryIO, Protocol

from islands.core.config import GLOBAL_BUCKET, NAME

CHUNK_BYTES = 16 * 2**20  # one copied or uploaded block of a large object
# One block of a streamed download. Two deltas are read at once, each with a block in use and
# the next in flight: at 4 MiB that stays small beside the model, and reads are no slower.
READ_BYTES = 4 * 2**20
_COUNTERS: dict[str, IOCounters] = {}


class StoreError(Exception):
    """Object storage answered in a way the caller can act on (message says what to do)."""


class ObjectMissing(StoreError):
    pass


class IntegrityError(StoreError):
    """The bytes read are not the bytes that were named (hash or size mismatch)."""


class AccessDenied(StoreError, PermissionError):
    """The credentials in use may not do this to this key (S3's 403 AccessDenied)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Stream(Protocol):
    """An object's bytes read in order rather than held (storage.encoded.EncodedObject)."""

    sha256: str

    @property
    def size(self) -> int: ...

    def open(self) -> BinaryIO: ...

    def chunks(self) -> Iterator[bytes | memoryview]: ...


@dataclass
class IOCounters:
    """Bytes and requests that really crossed the wire for one bucket, shared by every
    ObjectStore of this process that addresses it."""

    bytes_read: int = 0
    bytes_written: int = 0
    gets: int = 0
    puts: int = 0
    lists: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Count under a lock: the synchronizer reads several deltas of one bucket at once."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def backend_for(url: str) -> type[ObjectStore]:
    """The ObjectStore class that serves `url`'s scheme."""
    from islands.storage.local import FolderStore, MemoryStore
    from islands.storage.s3 import S3Store

    backends: dict[str, type[ObjectStore]] = {"s3": S3Store, "file": FolderStore, "memory": MemoryStore}
    scheme = scheme_of(url)
    if scheme not in backends:
        raise StoreError(f"{url}: no object store for {scheme}://; use s3://, file:// or a local path")
    return backends[scheme]


class ObjectStore(abc.ABC):
    """One bucket (or folder) addressed by URL, e.g. ``s3://islands-global`` or ``file:///d/g``."""

    holds_retention = False  # whether `with_retention` can keep objects for a time (S3 Object Lock)

    def __new__(cls, url: str | None = None, storage_options: dict | None = None):
        # No URL: copy and pickle make the instance of a known class first, then restore it.
        return super().__new__(backend_for(url) if cls is ObjectStore else cls)

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.io = _COUNTERS.setdefault(self.url, IOCounters())
        self.retain_days: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def missing(self, key: str) -> ObjectMissing:
        return ObjectMissing(f"{self.url}/{key} does not exist")

    # -- what a backend provides -----------------------------------------------------------
    @abc.abstractmethod
    def check_reachable(self) -> None:
        """Fail early, before anything is written, if the bucket or folder is not usable."""

    @abc.abstractmethod
    def _create(self, key: str, data: bytes | Stream) -> bool:
        """Write `key` unless it exists; True if this call wrote it. Never replaces an object."""

    @abc.abstractmethod
    def _read(self, key: str) -> bytes:
        """The whole object; raises ObjectMissing."""

    @abc.abstractmethod
    def _chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        """The object's bytes in order, `chunk_bytes` a piece; raises ObjectMissing on the first."""

    @abc.abstractmethod
    def _read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) (fewer past the end); raises ObjectMissing."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Size in bytes, None when absent."""

    @abc.abstractmethod
    def _list(self, prefix: str, start_after: str | None) -> Iterator[tuple[str, int]]:
        """(key, size) of every object under `prefix`, those sorting after `start_after` at least."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Garbage collection only: the contract never rewrites an object. Absent is no error."""

    def version_counts(self, prefix: str) -> dict[str, int]:
        """How many versions (delete markers included) each key under the folder `prefix` has,
        where the store keeps versions; one that keeps none has none to show."""
        return {}

    def check_retention(self) -> None:
        """Fail unless objects written through `with_retention` are kept for that long."""
        raise self._no_retention()

    def _no_retention(self) -> StoreError:
        return StoreError(
            f"{self.url}: object_lock_days needs an s3:// bucket with S3 Object Lock; "
            f"a {scheme_of(self.url)}:// store cannot keep objects under retention"
        )

    def with_retention(self, days: int) -> ObjectStore:
        """This bucket, writing every object it creates under compliance retention for `days`
        days (S3 Object Lock): until then no credential, the writer's and an admin's included,
        can delete it or shorten that. The same bucket, counters and connections."""
        if not self.holds_retention:
            raise self._no_retention()
        view = copy.copy(self)
        view.retain_days = days
        return view

    # -- the contract, the same on every backend ------------------------------------------
    def put_if_absent(self, key: str, data: bytes | Stream) -> bool:
        """Write `data` (bytes, or a stream of an object's pieces) at `key` unless something is
        there. True if this call wrote it. A stream is uploaded as it is read."""
        written = self._create(key, data)
        size = len(data) if isinstance(data, bytes) else data.size
        self.io.add(puts=1, bytes_written=size if written else 0)
        return written

    def put_or_verify(self, key: str, data: bytes | Stream) -> bool:
        """Put-if-absent; if the key exists it must hold these very bytes (idempotent retry)."""
        if self.put_if_absent(key, data):
            return True
        expected = sha256_hex(data) if isinstance(data, bytes) else data.sha256
        existing = hashlib.sha256()
        for chunk in self.get_chunks(key):
            existing.update(chunk)
        if existing.hexdigest() != expected:
            raise IntegrityError(f"{self.url}/{key} exists with different content")
        return False

    def _check_size(self, key: str, max_bytes: int | None) -> None:
        """Refuse an object over `max_bytes` before any of its bytes are fetched."""
        if max_bytes is None:
            return
        size = self.size(key)
        if size is None:
            raise self.missing(key)
        if size > max_bytes:
            raise IntegrityError(f"{self.url}/{key} is {size} bytes, over the {max_bytes} limit")

    def get(self, key: str, sha256: str | None = None, max_bytes: int | None = None) -> bytes:
        """Read an object; with `sha256`, refuse bytes that are not the named ones."""
        self._check_size(key, max_bytes)
        data = self._read(key)
        self.io.add(gets=1, bytes_read=len(data))
        if sha256 is not None and sha256_hex(data) != sha256:
            raise IntegrityError(f"{self.url}/{key}: sha256 {sha256_hex(data)[:12]}… ≠ expected {sha256[:12]}…")
        return data

    def get_chunks(self, key: str, max_bytes: int | None = None) -> Iterator[bytes]:
        """An object's bytes in order, READ_BYTES at a time, so a large object is never whole in
        memory; refuses one over `max_bytes` before and while reading."""
        self._check_size(key, max_bytes)
        chunks = self._chunks(key, READ_BYTES)
        first = next(chunks, b"")  # opens the object: a missing one fails here, before any yield
        self.io.add(gets=1)
        read = 0
        for chunk in itertools.chain([first] if first else [], chunks):
            read += len(chunk)
            self.io.add(bytes_read=len(chunk))
            if max_bytes is not None and read > max_bytes:
                chunks.close()
                raise IntegrityError(f"{self.url}/{key} grew past the {max_bytes} limit while being read")
            yield chunk

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object: headers are read before whole bodies."""
        data = self._read_range(key, start, end) if end > start else b""
        self.io.add(gets=1, bytes_read=len(data))
        return data

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def list(self, prefix: str, start_after: str | None = None) -> dict[str, int]:
        """Keys in the folder `prefix` with their sizes, only those sorting after `start_after`
        when it is given (S3's StartAfter: a poller asks for what is new, not for everything
        again); for discovery only, never a commit decision."""
        self.io.add(lists=1)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        return {key: size for key, size in self._list(prefix, start_after) if start_after is None or key > start_after}


def bucket_url(template: str, bucket: str) -> str:
    """Expand a store template such as ``s3://islands-{bucket}`` for one bucket."""
    if "{bucket}" not in template:
        raise ValueError(f"store template {template!r} must contain '{{bucket}}', e.g. s3://islands-{{bucket}}")
    return template.replace("{bucket}", bucket)


def location(url: str, follow_links: bool = True) -> str:
    """Where a store URL points, as one spelling: '.', '..' and doubled slashes resolved, and a
    local folder made absolute (with its links followed, unless not `follow_links`); two URLs of
    one place have one location."""
    scheme = scheme_of(url)
    path = url.split("://", 1)[1] if "://" in url else url
    if scheme == "file":
        return "file://" + (os.path.realpath(path) if follow_links else os.path.abspath(path))
    return f"{scheme}://" + posixpath.normpath(path).lstrip("/")


def bucket_holding(url: str, template: str, buckets: Iterable[str] = ()) -> str | None:
    """The bucket of the store `template` that `url` (a folder or an fsspec URL) is, or lies in,
    None when it is in none: any bucket the template can make (``{bucket}`` standing for any name
    a region or the global bucket can have), and each of `buckets` wherever links lead. What
    writes outside the store (export, prepare) asks this first: no file of theirs may land on a
    run's keys, which only the store's create-only writes may make."""
    if "{bucket}" not in template or scheme_of(url) != scheme_of(template):
        return None
    where = location(url)
    for bucket in buckets:
        there = location(bucket_url(template, bucket))
        if where == there or where.startswith(there + "/"):
            return bucket_url(template, bucket)
    for follow in (True, False):
        where, pattern = location(url, follow), re.escape(location(template, follow))
        pattern = pattern.replace(re.escape("{bucket}"), f"(?P<b>{NAME})", 1).replace(re.escape("{bucket}"), "(?P=b)")
        found = re.fullmatch(pattern + "(?:/.*)?", where, re.ASCII | re.DOTALL)
        if found:
            return bucket_url(template, found.group("b"))
    return None


def check_template(template: str, buckets: list[str]) -> None:
    """Refuse a store template whose buckets are not places of their own: one whose `..` takes
    the bucket away (``file:///x/{bucket}/..``: every bucket is /x), or two of `buckets` that
    resolve to one location, or one inside another. A delta would be both merged and judged
    foreign, a learner's folder another's. StoreError, one line."""
    if "{bucket}" in template and "{bucket}" not in location(template):
        raise StoreError(
            f"store {template!r}: the bucket name is taken away by '..' ({location(template)} for every bucket); "
            "give a template in which {bucket} names a folder or bucket of its own"
        )
    seen: dict[str, str] = {}
    for bucket in buckets:
        where = location(bucket_url(template, bucket))
        for other, there in seen.items():
            if where == there or where.startswith(there + "/") or there.startswith(where + "/"):
                raise StoreError(
                    f"store {template!r}: the buckets {other!r} and {bucket!r} are one location ({there} and {where}); "
                    "every bucket must be a place of its own"
                )
        seen[bucket] = where


class Stores:
    """The global store and one store per region, from one URL template (check_template)."""

    def __init__(self, template: str, regions: list[str], storage_options: dict | None = None):
        opts = storage_options or {}
        check_template(template, [GLOBAL_BUCKET, *regions])
        self.template = template
        self.global_ = ObjectStore(bucket_url(template, GLOBAL_BUCKET), opts)
        self.regions = {r: ObjectStore(bucket_url(template, r), opts) for r in regions}

    def region(self, name: str) -> ObjectStore:
        return self.regions[name]

    def all(self) -> list[ObjectStore]:
        return [self.global_, *self.regions.values()]
