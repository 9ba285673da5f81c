"""The object-store contract on the S3 API: a create-only write is a PUT with `If-None-Match: *`.

What S3 answered is read from botocore's error code, never from a message: 412
PreconditionFailed means the key exists (the write lost, which the contract reports as False);
409 ConditionalRequestConflict means another write of the key was in flight, and AWS asks the
client to try again, which this does a bounded number of times with a jittered backoff. Every
other retry (throttling, 5xx, a dropped connection) is botocore's standard retry mode, which this
turns on unless the caller's storage_options chose a mode.

Requests go straight to the aiobotocore client that s3fs holds for the storage options (its
credentials, endpoint and event loop), not through s3fs's own calls, which wrap every error in an
OSError and retry on top of botocore.

With `with_retention(days)`, objects are created under S3 Object Lock in COMPLIANCE mode: S3
then refuses to delete their version or shorten the date until it passes, whoever asks. S3 wants
a checksum algorithm named on such writes; every write names SHA-256 and carries the object's
(or part's) SHA-256, which S3 checks against the bytes, so botocore computes none of its own.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import hashlib
import os
import random
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import fsspec
import fsspec.asyn
import s3fs
from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError

from islands.storage.store import AccessDenied, IntegrityError, ObjectStore, StoreError, Stream

SINGLE_PUT_MAX = 5 * 2**30  # S3's limit for one PUT; larger objects go up in parts
PART_BYTES = 16 * 2**20  # one part of a multipart upload
PARTS_AT_ONCE = 4  # parts in flight: memory is PARTS_AT_ONCE × PART_BYTES
LIST_PAGE_KEYS = 1000  # keys asked for per ListObjectsV2 page (S3's most)
STREAM_BREAKS = (HTTPClientError, IncompleteReadError)  # a read timeout, a reset, a short body
STREAM_RESUMES = 5  # a download that breaks is picked up where it stopped at most this often
CONFLICT_TRIES = 6  # create-only writes answered 409 ConditionalRequestConflict, in all
CONFLICT_BACKOFF_S = 0.05  # first wait after a 409, doubled after each (full jitter)
MISSING = {"NoSuchKey", "NotFound", "404"}
DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}


def error_code(exc: ClientError) -> str:
    """S3's error code of a failed request. A HEAD answer has no body to carry one, so its HTTP
    status stands in, as botocore itself does."""
    error = exc.response.get("Error", {})
    return str(error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _checksum(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


async def _read_up_to(body, n: int) -> bytes:
    """Up to `n` bytes of a streaming response body (fewer only at its end)."""
    pieces, got = [], 0
    while got < n and (piece := await body.read(n - got)):
        pieces.append(piece)
        got += len(piece)
    return b"".join(pieces)


class S3Store(ObjectStore):
    """A bucket, or a folder of one, on an S3 endpoint (AWS, or one that speaks its API)."""

    holds_retention = True

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url, storage_options)
        options = dict(self.storage_options)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get("client_kwargs", {}):
            # Named, so that it is part of fsspec's instance-cache key: a process whose endpoint
            # variable changes (a restarted embedded stack, a second server) never gets a file
            # system of the old endpoint back, whose buckets are not this one's (NoSuchBucket).
            options["endpoint_url"] = endpoint
        config = dict(options.get("config_kwargs") or {})
        config["retries"] = {"mode": "standard", **(config.get("retries") or {})}
        self.fs, root = fsspec.core.url_to_fs(self.url, **{**options, "config_kwargs": config})
        _filesystems.add(self.fs)
        self.bucket, _, self.below = root.rstrip("/").partition("/")

    def _key(self, key: str) -> str:
        """The S3 key of one of this store's keys (the store may sit below a bucket's root)."""
        return f"{self.below}/{key}" if self.below else key

    # -- requests -------------------------------------------------------------------------
    def _start(self, make: Callable[[Any], Coroutine]) -> concurrent.futures.Future:
        """`make(client)` started on the filesystem's event loop while this thread goes on."""

        async def call():
            await self.fs.set_session()
            return await make(await self.fs.get_s3(self.bucket))

        return asyncio.run_coroutine_threadsafe(call(), self.fs.loop)

    def _run(self, make: Callable[[Any], Coroutine]) -> Any:
        return self._start(make).result()

    def _submit(self, method: str, **kwargs) -> concurrent.futures.Future:
        """One S3 API call on this bucket, started; botocore retries what its retry mode retries."""
        return self._start(lambda client: getattr(client, method)(Bucket=self.bucket, **kwargs))

    def _call(self, method: str, **kwargs) -> dict:
        return self._submit(method, **kwargs).result()

    def _failure(self, exc: ClientError, key: str | None = None) -> StoreError:
        """The contract's error for an S3 error answer, chosen by its code."""
        code, where = error_code(exc), f"{self.url}/{key}" if key is not None else self.url
        if code in MISSING:
            return self.missing(key or "")
        if code == "NoSuchBucket":
            return StoreError(f"{self.url}: bucket does not exist ({code}); create it or fix --store")
        if code in DENIED:
            return AccessDenied(f"{where}: access denied ({code}); the credentials in use may not do this")
        message = exc.response.get("Error", {}).get("Message", "")
        return StoreError(f"{where}: S3 answered {code}{f' ({message})' if message else ''}")

    # -- checks ---------------------------------------------------------------------------
    def check_reachable(self) -> None:
        try:
            self._call("head_bucket")
        except ClientError as exc:
            code = error_code(exc)
            if code in MISSING | {"NoSuchBucket"}:
                raise StoreError(f"{self.url}: bucket does not exist ({code}); create it or fix --store") from exc
            if code in DENIED:
                raise AccessDenied(f"{self.url}: access denied ({code}); check the credentials") from exc
            raise self._failure(exc) from exc
        except Exception as exc:  # noqa: BLE001 - an endpoint that does not answer fails in many classes
            raise StoreError(
                f"{self.url}: not reachable ({type(exc).__name__}: {exc}); "
                "check AWS_ENDPOINT_URL / the endpoint and that the server is up"
            ) from exc

    def check_retention(self) -> None:
        """The bucket must have S3 Object Lock: only a bucket created with it, or given it
        afterwards with versioning on, takes writes under retention."""
        advice = (
            "create it with Object Lock (aws s3api create-bucket --object-lock-enabled-for-bucket) "
            "or leave object_lock_days unset"
        )
        try:
            config = self._call("get_object_lock_configuration").get("ObjectLockConfiguration", {})
        except ClientError as exc:
            if error_code(exc) != "ObjectLockConfigurationNotFoundError":
                raise self._failure(exc) from exc
            config = {}
        if config.get("ObjectLockEnabled") != "Enabled":
            raise StoreError(f"{self.url}: object_lock_days is set, but the bucket has no S3 Object Lock; {advice}")

    # -- writes ---------------------------------------------------------------------------
    def _retention(self) -> dict:
        if self.retain_days is None:
            return {}
        until = datetime.now(UTC) + timedelta(days=self.retain_days)
        return {"ObjectLockMode": "COMPLIANCE", "ObjectLockRetainUntilDate": until}

    def _create(self, key: str, data: bytes | Stream) -> bool:
        """A create-only write, tried again while S3 answers 409 (another write of the key was
        in flight), as AWS asks; 412 means the key exists."""
        conflict: ClientError | None = None
        for attempt in range(CONFLICT_TRIES):
            if attempt:
                time.sleep(random.uniform(0, CONFLICT_BACKOFF_S * 2**attempt))
            try:
                if isinstance(data, bytes):
                    self._call(
                        "put_object",
                        Key=self._key(key),
                        Body=data,
                        IfNoneMatch="*",
                        ChecksumAlgorithm="SHA256",
                        ChecksumSHA256=_checksum(hashlib.sha256(data).digest()),
                        **self._retention(),
                    )
                elif data.size <= SINGLE_PUT_MAX:
                    self._put_stream(key, data)
                else:
                    self._put_in_parts(key, data)
                return True
            except ClientError as exc:
                code = error_code(exc)
                if code == "PreconditionFailed":
                    return False
                if code != "ConditionalRequestConflict":
                    raise self._failure(exc, key) from exc
                conflict = exc
        raise StoreError(
            f"{self.url}/{key}: S3 answered 409 ConditionalRequestConflict {CONFLICT_TRIES} times in a row; "
            "other writes of this key kept racing this one"
        ) from conflict

    def _put_stream(self, key: str, data: Stream) -> None:
        """A create-only PUT streamed from the pieces: one request where a multipart upload makes
        one per part, nothing whole in memory. It carries the sha256 the stream already has, for
        S3 to refuse bytes that are not those; botocore then computes no checksum of its own,
        which over plain HTTP is a whole read of the object before sending it. botocore rewinds
        the stream for its own retries; a new attempt opens it again."""
        checksum = _checksum(bytes.fromhex(data.sha256))

        async def put(client) -> None:
            with data.open() as body:
                await client.put_object(
                    Bucket=self.bucket,
                    Key=self._key(key),
                    Body=body,
                    IfNoneMatch="*",
                    ChecksumAlgorithm="SHA256",
                    ChecksumSHA256=checksum,
                    **self._retention(),
                )

        self._run(put)

    def _put_in_parts(self, key: str, data: Stream) -> None:
        """An object over S3's one-PUT limit, in parts read one after another from the stream,
        PARTS_AT_ONCE of them in flight; each names its SHA-256. The upload becomes the object
        only when it is completed, create-only; one that fails is aborted. Under retention the
        completed version is given it once more by PutObjectRetention (the same date)."""
        s3_key, retention = self._key(key), self._retention()
        upload = self._call("create_multipart_upload", Key=s3_key, ChecksumAlgorithm="SHA256", **retention)
        upload_id, parts, flying = upload["UploadId"], [], []

        def land(number: int, checksum: str, sent: concurrent.futures.Future) -> None:
            parts.append({"PartNumber": number, "ETag": sent.result()["ETag"], "ChecksumSHA256": checksum})

        try:
            with data.open() as body:
                number = 0
                while piece := body.read(PART_BYTES):
                    number += 1
                    checksum = _checksum(hashlib.sha256(piece).digest())
                    sent = self._submit(
                        "upload_part",
                        Key=s3_key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=piece,
                        ChecksumAlgorithm="SHA256",
                        ChecksumSHA256=checksum,
                    )
                    flying.append((number, checksum, sent))
                    if len(flying) >= PARTS_AT_ONCE:
                        land(*flying.pop(0))
            for part in flying:
                land(*part)
            done = self._call(
                "complete_multipart_upload",
                Key=s3_key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            concurrent.futures.wait([sent for _, _, sent in flying])
            self._call("abort_multipart_upload", Key=s3_key, UploadId=upload_id)
            raise
        if retention:  # again on the version made: some S3-compatible servers (moto) drop it from the upload
            self._call(
                "put_object_retention",
                Key=s3_key,
                VersionId=done["VersionId"],
                Retention={
                    "Mode": retention["ObjectLockMode"],
                    "RetainUntilDate": retention["ObjectLockRetainUntilDate"],
                },
                ChecksumAlgorithm="SHA256",
            )

    def delete(self, key: str) -> None:
        try:
            self._call("delete_object", Key=self._key(key))
        except ClientError as exc:
            raise self._failure(exc, key) from exc

    # -- reads ----------------------------------------------------------------------------
    def size(self, key: str) -> int | None:
        """One HEAD: readers poll for keys that are not there yet (the next manifest, stop.json)."""
        try:
            return int(self._call("head_object", Key=self._key(key))["ContentLength"])
        except ClientError as exc:
            if error_code(exc) in MISSING:
                return None
            raise self._failure(exc, key) from exc

    def _read(self, key: str) -> bytes:
        return b"".join(self._chunks(key, 2**62))

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        """One ranged GET; a broken body is asked for again. Past the end it is short (or empty:
        S3 answers 416 to a range that starts there)."""

        async def get(client) -> bytes:
            resp = await client.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}")
            async with resp["Body"] as body:
                return await body.read()

        breaks = 0
        while True:
            try:
                return self._run(get)
            except ClientError as exc:
                if error_code(exc) == "InvalidRange":
                    return b""
                raise self._failure(exc, key) from exc
            except STREAM_BREAKS as exc:
                breaks += 1
                if breaks > STREAM_RESUMES:
                    raise StoreError(f"{self.url}/{key}: the download broke {breaks} times ({exc})") from exc

    def _chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        """One streaming GET cut into `chunk_bytes` pieces. A ranged GET per chunk would cost a
        request each on S3, and a copy of the whole object each on moto's server. A stream that
        stalls or breaks is picked up where it stopped (a ranged GET of the same ETag), up to
        STREAM_RESUMES times. The next chunk downloads while the caller uses this one: one chunk
        more in memory, and the network no longer waits on hashing or the disk."""
        offset, breaks, same = 0, 0, {}
        while True:
            try:
                resp = self._call(
                    "get_object", Key=self._key(key), **({"Range": f"bytes={offset}-", **same} if offset else {})
                )
            except ClientError as exc:
                if not offset:
                    raise self._failure(exc, key) from exc
                raise IntegrityError(f"{self.url}/{key} changed while being read ({error_code(exc)})") from exc
            same = {"IfMatch": resp["ETag"]}
            body = resp["Body"]
            ahead = self._read_ahead(body, chunk_bytes)
            try:
                while chunk := ahead.result():
                    offset += len(chunk)
                    ahead = self._read_ahead(body, chunk_bytes)  # downloads while the caller hashes and writes this one
                    yield chunk
                return
            except STREAM_BREAKS as exc:
                breaks += 1
                if breaks > STREAM_RESUMES:
                    raise StoreError(f"{self.url}/{key}: the download broke {breaks} times ({exc})") from exc
            finally:
                concurrent.futures.wait([ahead])  # never close the body under a read in flight
                body.close()

    def _read_ahead(self, body, n: int) -> concurrent.futures.Future:
        """The body's next `n` bytes, read on the filesystem's event loop while this thread goes on."""
        return asyncio.run_coroutine_threadsafe(_read_up_to(body, n), self.fs.loop)

    def _list(self, prefix: str, start_after: str | None) -> Iterator[tuple[str, int]]:
        """ListObjectsV2 page by page, straight from the API: no directory cache to go stale. A
        page that says more follow must give a token not seen before, so a listing ends."""
        s3_prefix = self._key(prefix)
        skip = len(s3_prefix) - len(prefix)  # the part of each S3 key that is the store's root
        args = {"Prefix": s3_prefix, "MaxKeys": LIST_PAGE_KEYS}
        if start_after is not None:
            args["StartAfter"] = self._key(start_after)
        tokens: set[str] = set()
        while True:
            try:
                page = self._call("list_objects_v2", **args)
            except ClientError as exc:
                raise self._failure(exc, prefix) from exc
            for obj in page.get("Contents", []):
                yield obj["Key"][skip:], int(obj["Size"])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")
            if not token or token in tokens:
                raise StoreError(f"{self.url}/{prefix}: the listing says more keys follow, but gives no new token")
            tokens.add(token)
            args = {"Prefix": s3_prefix, "MaxKeys": LIST_PAGE_KEYS, "ContinuationToken": token}

    def version_counts(self, prefix: str) -> dict[str, int]:
        """ListObjectVersions page by page (versions and delete markers), ending as `_list` does."""
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        s3_prefix = self._key(prefix)
        skip = len(s3_prefix) - len(prefix)
        counts: dict[str, int] = {}
        args: dict = {"Prefix": s3_prefix}
        markers: set[tuple[str, str]] = set()
        while True:
            try:
                page = self._call("list_object_versions", **args)
            except ClientError as exc:
                raise self._failure(exc, prefix) from exc
            for entry in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
                key = entry["Key"][skip:]
                counts[key] = counts.get(key, 0) + 1
            if not page.get("IsTruncated"):
                return counts
            marker = (page.get("NextKeyMarker", ""), page.get("NextVersionIdMarker", ""))
            if not marker[0] or marker in markers:
                raise StoreError(f"{self.url}/{prefix}: the version listing says more follow, but gives no new marker")
            markers.add(marker)
            args = {"Prefix": s3_prefix, "KeyMarker": marker[0], "VersionIdMarker": marker[1]}


_filesystems: weakref.WeakSet = weakref.WeakSet()  # every store's, also those dropped from s3fs's cache


@atexit.register
def _stop_io() -> None:
    """Close every S3 client's connections, then stop fsspec's IO thread, before the interpreter
    tears down. Left running, that daemon thread wakes when a server closes an idle connection,
    finds the interpreter finalizing and is ended in the middle of native code: the process
    aborts ("terminate called without an active exception") after its work is done."""
    loop, thread = fsspec.asyn.loop[0], fsspec.asyn.iothread[0]
    if loop is None or not loop.is_running():
        return
    for fs in {*s3fs.S3FileSystem._cache.values(), *_filesystems}:
        if fs._s3 is not None:
            try:
                fsspec.asyn.sync(loop, fs._s3.close, timeout=2)
            except Exception:  # noqa: BLE001 - best effort at exit: the connection goes with the process
                pass
    loop.call_soon_threadsafe(loop.stop)
    if thread is not None:
        thread.join(timeout=2)
