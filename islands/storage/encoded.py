"""An object's bytes as pieces read in order, never assembled: a header, then tensor bytes that
sit in memory (a checkpoint's tensors) or in part files on disk (what a merge wrote tensor by
tensor).

Hashing and uploading read the pieces where they are, so an object costs neither a second
copy in memory nor an assembled file on disk. `open()` gives a seekable reader, which an
upload's retries rewind.
"""

from __future__ import annotations

import bisect
import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from islands.storage.store import CHUNK_BYTES

Piece = bytes | memoryview | Path


def piece_size(piece: Piece) -> int:
    return piece.stat().st_size if isinstance(piece, Path) else memoryview(piece).nbytes


@dataclass(frozen=True)
class EncodedObject:
    """The bytes of one object, its size and sha256; in-memory pieces must not change until it is
    uploaded."""

    pieces: tuple[Piece, ...]
    sha256: str
    sizes: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(piece_size(p) for p in self.pieces))

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def chunks(self) -> Iterator[bytes | memoryview]:
        return chunks_of(self.pieces)

    def open(self) -> io.BufferedReader:
        return io.BufferedReader(_Reader(self.pieces, self.sizes), CHUNK_BYTES)

    def read_bytes(self) -> bytes:
        return b"".join(self.chunks())


def chunks_of(pieces: tuple[Piece, ...] | list[Piece]) -> Iterator[bytes | memoryview]:
    """The pieces' bytes in order, CHUNK_BYTES at most at a time."""
    for piece in pieces:
        if isinstance(piece, Path):
            with open(piece, "rb") as fh:
                while chunk := fh.read(CHUNK_BYTES):
                    yield chunk
        else:
            view = memoryview(piece).cast("B")
            for start in range(0, view.nbytes, CHUNK_BYTES):
                yield view[start : start + CHUNK_BYTES]


def hash_pieces(hasher, pieces: tuple[Piece, ...] | list[Piece]) -> None:
    """Feed the pieces' bytes to `hasher`. Memory is hashed where it is; files are read into one
    reused buffer, so hashing a part file allocates nothing per read."""
    buffer: memoryview | None = None
    for piece in pieces:
        if isinstance(piece, Path):
            buffer = buffer or memoryview(bytearray(CHUNK_BYTES))
            with open(piece, "rb", buffering=0) as fh:
                while n := fh.readinto(buffer):
                    hasher.update(buffer[:n])
        else:
            hasher.update(memoryview(piece).cast("B"))


class _Reader(io.RawIOBase):
    """The pieces as one seekable stream; a part file is open only while it is being read."""

    def __init__(self, pieces: tuple[Piece, ...], sizes: tuple[int, ...]):
        super().__init__()
        self._pieces, self._sizes = pieces, sizes
        self._starts = list(itertools.accumulate(sizes, initial=0))[:-1]
        self._size, self._pos = sum(sizes), 0
        self._file: tuple[int, io.BufferedReader] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        if self._pos >= self._size:
            return 0
        i = bisect.bisect_right(self._starts, self._pos) - 1  # the last piece starting at or before pos
        offset = self._pos - self._starts[i]
        out = memoryview(buffer).cast("B")
        n = min(out.nbytes, self._sizes[i] - offset)
        piece = self._pieces[i]
        if isinstance(piece, Path):
            part = self._part(i)
            part.seek(offset)
            n = part.readinto(out[:n])
        else:
            out[:n] = memoryview(piece).cast("B")[offset : offset + n]
        self._pos += n
        return n

    def _part(self, i: int) -> io.BufferedReader:
        if self._file is None or self._file[0] != i:
            self._close_part()
            self._file = (i, open(self._pieces[i], "rb"))
        return self._file[1]

    def _close_part(self) -> None:
        if self._file is not None:
            self._file[1].close()
            self._file = None

    def close(self) -> None:
        self._close_part()
        super().close()
