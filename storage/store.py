"""The object-store contract: put-if-absent, verified get, head, list, delete — nothing else.

Every object is immutable once written. `put_if_absent` is the only write; on S3 it is a PUT
with `If-None-Match: *`, on a local folder a hard link of a finished temporary file (atomic, and
fails when the name exists), on `memory://` a locked check-then-write (unit tests only).
Listing discovers candidates; it never decides a commit — manifests do.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import itertools
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import BinaryIO, Protocol

import fsspec
import fsspec.asyn
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError

CHUNK_BYTES = 16 * 2**20  # one copied or uploaded block of a large object
# One block of a streamed download. Two deltas are read at once, each with a block in use and
# the next in flight: at 4 MiB that stays small beside the model, and reads are no slower.
READ_BYTES = 4 * 2**20
SINGLE_PUT_MAX = 5 * 2**30  # S3's limit for one PUT; larger files go up in parts
PARTS_AT_ONCE = 4  # multipart upload parts in flight: memory is PARTS_AT_ONCE × CHUNK_BYTES, not 10 × 50 MiB
STREAM_BREAKS = (HTTPClientError, IncompleteReadError)  # a read timeout, a reset, a short body
_MEMORY_LOCK = threading.Lock()
_COUNTERS: dict[str, IOCounters] = {}


class StoreError(Exception):
    """Object storage answered in a way the caller can act on (message says what to do)."""


class ObjectMissing(StoreError):
    pass


class IntegrityError(StoreError):
    """The bytes read are not the bytes that were named (hash or size mismatch)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _read_up_to(body, n: int) -> bytes:
    """Up to `n` bytes of a streaming response body (fewer only at its end)."""
    pieces, got = [], 0
    while got < n and (piece := await body.read(n - got)):
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


def _lost_to_an_existing_object(exc: Exception) -> bool:
    """Whether a create-only write failed because the key exists (412) or lost a race for it (409)."""
    status = getattr(exc, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status in (409, 412) or any(s in str(exc) for s in ("PreconditionFailed", "412", "409"))


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


@dataclass
class ObjectStore:
    """One bucket (or folder) addressed by URL, e.g. ``s3://islands-global`` or ``file:///d/g``."""

    url: str
    storage_options: dict = field(default_factory=dict)
    io: IOCounters = field(init=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.io = _COUNTERS.setdefault(self.url, IOCounters())
        self.protocol = self.url.split("://", 1)[0] if "://" in self.url else "file"
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    # -- checks ---------------------------------------------------------------------------
    def check_reachable(self) -> None:
        """Fail early, before anything is written, if the bucket or folder is not usable."""
        try:
            if self.protocol == "file":
                Path(self.root).mkdir(parents=True, exist_ok=True)
                return
            if self.protocol == "s3":
                bucket = self.root.split("/", 1)[0]
                self.fs.call_s3("head_bucket", Bucket=bucket)
                return
            self.fs.makedirs(self.root, exist_ok=True)  # memory://: unit tests only
        except FileNotFoundError as exc:
            raise StoreError(f"{self.url}: bucket does not exist ({exc}); create it or fix --store") from exc
        except PermissionError as exc:
            raise StoreError(f"{self.url}: access denied ({exc}); check the credentials") from exc
        except Exception as exc:  # noqa: BLE001 - network errors come in many classes
            raise StoreError(
                f"{self.url}: not reachable ({type(exc).__name__}: {exc}); "
                "check AWS_ENDPOINT_URL / the endpoint and that the server is up"
            ) from exc

    # -- writes ---------------------------------------------------------------------------
    def put_if_absent(self, key: str, data: bytes | Stream) -> bool:
        """Write `data` (bytes, or a stream of an object's pieces) at `key` unless something is
        there. True if this call wrote it. A stream is uploaded as it is read, in parts when large."""
        path = self._path(key)
        size = len(data) if isinstance(data, bytes) else data.size
        if self.protocol == "file":
            written = self._link_if_absent(path, data)
        elif self.protocol == "memory":
            with _MEMORY_LOCK:
                written = not self.fs.exists(path)
                if written:
                    self.fs.pipe_file(path, data if isinstance(data, bytes) else b"".join(data.chunks()))
        else:
            try:
                if isinstance(data, bytes):
                    self.fs.pipe_file(path, data, mode="create")
                elif self.protocol == "s3" and size <= SINGLE_PUT_MAX:
                    self._s3_put_stream(path, data)
                else:
                    self._put_in_parts(path, data)
                written = True
            except FileExistsError:
                written = False
            except (OSError, ClientError) as exc:
                if not _lost_to_an_existing_object(exc):
                    raise
                written = False
        self.io.add(puts=1, bytes_written=size if written else 0)
        return written

    def _s3_put_stream(self, path: str, data: Stream) -> None:
        """A create-only PUT streamed from the pieces: one request where a multipart upload makes
        one per part, nothing whole in memory. It carries the sha256 the stream already has, for
        S3 to refuse bytes that are not those; botocore then computes no checksum of its own,
        which over plain HTTP is a whole read of the object before sending it. botocore rewinds
        the stream for its own retries; a new attempt opens it again."""
        bucket, key, _ = self.fs.split_path(path)
        checksum = base64.b64encode(bytes.fromhex(data.sha256)).decode()

        async def put() -> None:
            await self.fs.set_session()
            s3 = await self.fs.get_s3(bucket)
            with data.open() as body:
                await s3.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*", ChecksumSHA256=checksum)

        fsspec.asyn.sync(self.fs.loop, put)

    def _put_in_parts(self, path: str, data: Stream) -> None:
        """A create-only upload through a temporary file: in parts on S3 (an object over S3's
        one-PUT limit), the filesystem's own upload elsewhere."""
        parts = {"chunksize": CHUNK_BYTES, "max_concurrency": PARTS_AT_ONCE} if self.protocol == "s3" else {}
        with tempfile.TemporaryDirectory(prefix="islands-put-") as tmp:
            spilled = Path(tmp) / "object"
            with open(spilled, "wb") as fh:
                fh.writelines(data.chunks())
            self.fs.put_file(str(spilled), path, mode="create", **parts)

    def _link_if_absent(self, path: str, data: bytes | Stream) -> bool:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.writelines([data] if isinstance(data, bytes) else data.chunks())
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

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

    def delete(self, key: str) -> None:
        """Garbage collection only: the contract never rewrites an object."""
        self.fs.rm_file(self._path(key))

    # -- reads ----------------------------------------------------------------------------
    def _check_size(self, key: str, max_bytes: int | None) -> None:
        """Refuse an object over `max_bytes` before any of its bytes are fetched."""
        if max_bytes is None:
            return
        size = self.size(key)
        if size is None:
            raise ObjectMissing(f"{self.url}/{key} does not exist")
        if size > max_bytes:
            raise IntegrityError(f"{self.url}/{key} is {size} bytes, over the {max_bytes} limit")

    def get(self, key: str, sha256: str | None = None, max_bytes: int | None = None) -> bytes:
        """Read an object; with `sha256`, refuse bytes that are not the named ones."""
        path = self._path(key)
        self._check_size(key, max_bytes)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError as exc:
            raise ObjectMissing(f"{self.url}/{key} does not exist") from exc
        self.io.add(gets=1, bytes_read=len(data))
        if sha256 is not None and sha256_hex(data) != sha256:
            raise IntegrityError(f"{self.url}/{key}: sha256 {sha256_hex(data)[:12]}… ≠ expected {sha256[:12]}…")
        return data

    def get_chunks(self, key: str, max_bytes: int | None = None) -> Iterator[bytes]:
        """An object's bytes in order, READ_BYTES at a time, so a large object is never whole in
        memory; refuses one over `max_bytes` before and while reading."""
        self._check_size(key, max_bytes)
        try:
            chunks = self._s3_chunks(key) if self.protocol == "s3" else self._file_chunks(key)
            first = next(chunks, b"")  # opens the object: a missing one fails here, before any yield
        except FileNotFoundError as exc:
            raise ObjectMissing(f"{self.url}/{key} does not exist") from exc
        self.io.add(gets=1)
        read = 0
        for chunk in itertools.chain([first] if first else [], chunks):
            read += len(chunk)
            self.io.add(bytes_read=len(chunk))
            if max_bytes is not None and read > max_bytes:
                chunks.close()
                raise IntegrityError(f"{self.url}/{key} grew past the {max_bytes} limit while being read")
            yield chunk

    def _s3_chunks(self, key: str) -> Iterator[bytes]:
        """One streaming GET cut into READ_BYTES pieces. A ranged GET per chunk would cost a
        request each on S3, and a copy of the whole object each on moto's server. A stream that
        stalls or breaks is picked up where it stopped (a ranged GET of the same ETag), up to
        the filesystem's retry count. The next chunk downloads while the caller uses this one:
        one chunk more in memory, and the network no longer waits on hashing or the disk."""
        bucket, path, _ = self.fs.split_path(self._path(key))
        offset, breaks, same = 0, 0, {}
        while True:
            try:
                resp = self.fs.call_s3(
                    "get_object", Bucket=bucket, Key=path, **({"Range": f"bytes={offset}-", **same} if offset else {})
                )
            except OSError as exc:
                if not offset:
                    raise
                raise IntegrityError(f"{self.url}/{key} changed while being read ({exc})") from exc
            same = {"IfMatch": resp["ETag"]}
            body = resp["Body"]
            ahead = self._read_ahead(body)
            try:
                while chunk := ahead.result():
                    offset += len(chunk)
                    ahead = self._read_ahead(body)  # downloads while the caller hashes and writes this one
                    yield chunk
                return
            except STREAM_BREAKS as exc:
                breaks += 1
                if breaks > self.fs.retries:
                    raise StoreError(f"{self.url}/{key}: the download broke {breaks} times ({exc})") from exc
            finally:
                concurrent.futures.wait([ahead])  # never close the body under a read in flight
                body.close()

    def _read_ahead(self, body) -> concurrent.futures.Future:
        """The body's next chunk, read on the filesystem's event loop while this thread goes on."""
        return asyncio.run_coroutine_threadsafe(_read_up_to(body, READ_BYTES), self.fs.loop)

    def _file_chunks(self, key: str) -> Iterator[bytes]:
        with self.fs.open(self._path(key), "rb", block_size=READ_BYTES, cache_type="none") as fh:
            while chunk := fh.read(READ_BYTES):
                yield chunk

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object: headers are read before whole bodies."""
        try:
            data = self.fs.cat_file(self._path(key), start=start, end=end)
        except FileNotFoundError as exc:
            raise ObjectMissing(f"{self.url}/{key} does not exist") from exc
        self.io.add(gets=1, bytes_read=len(data))
        return data

    def size(self, key: str) -> int | None:
        """Size in bytes, None when absent. On S3 one HEAD: s3fs's own `info` follows a missing
        key's HEAD with a LIST (in case the key names a folder), and readers poll for keys that
        are not there yet."""
        try:
            if self.protocol == "s3":
                bucket, s3_key = self._s3_address(key)
                return int(self.fs.call_s3("head_object", Bucket=bucket, Key=s3_key)["ContentLength"])
            return int(self.fs.info(self._path(key))["size"])
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def list(self, prefix: str, start_after: str | None = None) -> dict[str, int]:
        """Keys in the folder `prefix` with their sizes, only those sorting after `start_after`
        when it is given (S3's StartAfter: a poller asks for what is new, not for everything
        again); for discovery only, never a commit decision."""
        self.io.add(lists=1)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        found = self._s3_list(prefix, start_after) if self.protocol == "s3" else self._fs_list(prefix)
        return {key: size for key, size in found if "/.tmp-" not in key and (start_after is None or key > start_after)}

    def _s3_address(self, key: str) -> tuple[str, str]:
        """(bucket, S3 key) of one of this store's keys (the store may sit below a bucket's root)."""
        bucket, _, below = self.root.partition("/")
        return bucket, f"{below}/{key}" if below else key

    def _s3_list(self, prefix: str, start_after: str | None) -> Iterator[tuple[str, int]]:
        """ListObjectsV2 page by page, straight from the API: no directory cache to go stale."""
        bucket, s3_prefix = self._s3_address(prefix)
        skip = len(s3_prefix) - len(prefix)  # the part of each S3 key that is the store's root
        args = {"Bucket": bucket, "Prefix": s3_prefix}
        if start_after is not None:
            args["StartAfter"] = self._s3_address(start_after)[1]
        while True:
            page = self.fs.call_s3("list_objects_v2", **args)
            for obj in page.get("Contents", []):
                yield obj["Key"][skip:], int(obj["Size"])
            if not page.get("IsTruncated"):
                return
            args = {"Bucket": bucket, "Prefix": s3_prefix, "ContinuationToken": page["NextContinuationToken"]}

    def _fs_list(self, prefix: str) -> Iterator[tuple[str, int]]:
        try:
            found = self.fs.find(self._path(prefix).rstrip("/"), detail=True)
        except FileNotFoundError:
            return
        root = self.root + "/"
        for path, info in found.items():
            if path.startswith(root) and info.get("type") != "directory":
                yield path[len(root) :], int(info.get("size") or 0)


def bucket_url(template: str, bucket: str) -> str:
    """Expand a store template such as ``s3://islands-{bucket}`` for one bucket."""
    if "{bucket}" not in template:
        raise ValueError(f"store template {template!r} must contain '{{bucket}}', e.g. s3://islands-{{bucket}}")
    return template.replace("{bucket}", bucket)


class Stores:
    """The global store and one store per region, from one URL template."""

    def __init__(self, template: str, regions: list[str], storage_options: dict | None = None):
        opts = storage_options or {}
        self.template = template
        self.global_ = ObjectStore(bucket_url(template, "global"), opts)
        self.regions = {r: ObjectStore(bucket_url(template, r), opts) for r in regions}

    def region(self, name: str) -> ObjectStore:
        return self.regions[name]

    def all(self) -> list[ObjectStore]:
        return [self.global_, *self.regions.values()]
