"""Object stores on this machine: a local folder (`file://`, or a plain path) and `memory://`.

A folder makes a create-only write a hard link of a finished temporary file: the link is atomic
and fails when the name exists, so a reader never sees half an object and two writers never
both win. `memory://` is a dictionary behind a lock, for unit tests of pure logic only: the
processes of a run cannot share it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from islands.storage.store import ObjectStore, StoreError, Stream

TEMPORARY = ".tmp-"  # an unfinished write's name, in the folder it will be linked into


def _pieces(data: bytes | Stream) -> Iterator[bytes | memoryview]:
    return iter([data]) if isinstance(data, bytes) else data.chunks()


class FolderStore(ObjectStore):
    """A folder whose files are the objects, named by their keys."""

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url, storage_options)
        self.root = Path(self.url.removeprefix("file://")).absolute()

    def _path(self, key: str) -> Path:
        return self.root / key

    def check_reachable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.url}: the folder cannot be made or used ({exc.strerror}); fix --store") from exc

    def _create(self, key: str, data: bytes | Stream) -> bool:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=TEMPORARY)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.writelines(_pieces(data))
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self.missing(key) from None

    def _chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        try:
            fh = open(self._path(key), "rb", buffering=0)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self.missing(key) from None
        with fh:
            while chunk := fh.read(chunk_bytes):
                yield chunk

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self._path(key), "rb") as fh:
                fh.seek(start)
                return fh.read(end - start)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self.missing(key) from None

    def size(self, key: str) -> int | None:
        path = self._path(key)
        return path.stat().st_size if path.is_file() else None

    def _list(self, prefix: str, start_after: str | None) -> Iterator[tuple[str, int]]:
        """Files under the folder `prefix`; unfinished writes are not objects."""
        top = self._path(prefix) if prefix else self.root
        found = [
            Path(folder) / name for folder, _, names in os.walk(top) for name in names if not name.startswith(TEMPORARY)
        ]
        for key, path in sorted((p.relative_to(self.root).as_posix(), p) for p in found):  # in key order, as S3 lists
            yield key, path.stat().st_size

    def delete(self, key: str) -> None:
        """The file, and the folders it leaves empty: as on S3, no folder outlives its last key."""
        path = self._path(key)
        path.unlink(missing_ok=True)
        for folder in path.parents:
            if folder == self.root or not folder.is_relative_to(self.root):
                return
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): the folders above are not empty either
                return


_MEMORY: dict[str, bytes] = {}  # "<bucket path>/<key>" → bytes, for every memory:// store of the process
_MEMORY_LOCK = threading.Lock()


class MemoryStore(ObjectStore):
    """Objects in this process's memory (unit tests of pure logic only)."""

    def __init__(self, url: str, storage_options: dict | None = None):
        super().__init__(url, storage_options)
        self.root = self.url.removeprefix("memory://").strip("/")

    def _name(self, key: str) -> str:
        return f"{self.root}/{key}"

    def check_reachable(self) -> None:
        return None

    def _create(self, key: str, data: bytes | Stream) -> bool:
        body, name = b"".join(_pieces(data)), self._name(key)
        with _MEMORY_LOCK:
            if name in _MEMORY:
                return False
            _MEMORY[name] = body
            return True

    def _read(self, key: str) -> bytes:
        try:
            return _MEMORY[self._name(key)]
        except KeyError:
            raise self.missing(key) from None

    def _chunks(self, key: str, chunk_bytes: int) -> Iterator[bytes]:
        data = self._read(key)
        for start in range(0, len(data), chunk_bytes):
            yield data[start : start + chunk_bytes]

    def _read_range(self, key: str, start: int, end: int) -> bytes:
        return self._read(key)[start:end]

    def size(self, key: str) -> int | None:
        data = _MEMORY.get(self._name(key))
        return None if data is None else len(data)

    def _list(self, prefix: str, start_after: str | None) -> Iterator[tuple[str, int]]:
        below = f"{self.root}/"
        with _MEMORY_LOCK:
            found = [
                (name[len(below) :], len(data)) for name, data in _MEMORY.items() if name.startswith(below + prefix)
            ]
        yield from sorted(found)

    def delete(self, key: str) -> None:
        with _MEMORY_LOCK:
            _MEMORY.pop(self._name(key), None)
