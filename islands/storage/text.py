"""Reading text: an fsspec URL, glob or folder of `.txt`, `.jsonl` (a "text" field per line) or
`.parquet` (a "text" column) files, or the interpreter's own standard library.

The default corpus, ``stdlib``, is the `.py` sources of the Python standard library (without its
test suites and third-party packages) plus the `pydoc_data` topics that ship with the interpreter: real text, already on every machine, nothing
downloaded. Files are read in sorted order so every learner sees the same bytes.
"""

from __future__ import annotations

import io
import json
import os
import sysconfig
from pathlib import Path

import fsspec

STDLIB = "stdlib"
_SEPARATOR = b"\n\n"


class CorpusError(ValueError):
    """A corpus that cannot be trained on; one line naming the field and what to do."""


SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib's `.py` files in sorted order. Skipped folders are pruned, not walked and then
    filtered: the interpreter's site-packages can hold far more files than the stdlib itself, and
    every learner and synchronizer process lists this at start."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = set()
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED_DIRS]
        files.update(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


def text_files(url: str, field_name: str = "corpus") -> list[str]:
    """The files a text corpus URL names, in sorted order: a file, a glob, or every file under a
    folder. `stdlib`: the standard library's files."""
    if url == STDLIB:
        return [str(p) for p in stdlib_files()]
    try:
        fs, path = fsspec.core.url_to_fs(url)
        if any(ch in path for ch in "*?["):
            found = fs.glob(path)
        elif fs.isdir(path):
            found = fs.find(path)
        else:
            found = [path] if fs.isfile(path) else []
    except Exception as exc:  # noqa: BLE001 - fsspec raises per backend
        raise CorpusError(f"{field_name}: {url!r} cannot be opened ({exc})") from exc
    if not found:
        raise CorpusError(
            f"{field_name}: {url!r} matches no files; give a file, a folder, a glob such as "
            "'file:///data/*.txt', a folder of shards with its dataset.json, or 'stdlib'"
        )
    return [fs.unstrip_protocol(p) for p in sorted(found)]


def documents(file: str) -> list[bytes]:
    """A file's documents: a `.jsonl` file's "text" fields, a `.parquet` file's "text" column, or
    the whole of any other file. A file that does not read as its kind is one CorpusError naming
    it and where (for JSON Lines, the line and the byte offset)."""
    with fsspec.open(file, "rb") as fh:
        raw = fh.read()
    if file.endswith(".jsonl"):
        return json_lines(file, raw)
    if file.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            column = pq.read_table(io.BytesIO(raw), columns=["text"]).column("text").to_pylist()
            return [t.encode() for t in column if t is not None]
        except Exception as exc:  # noqa: BLE001 - pyarrow raises its own error types
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
            raise CorpusError(f'{file}: not a Parquet file with a "text" column of strings ({first})') from None
    return [raw]


def json_lines(file: str, raw: bytes) -> list[bytes]:
    """The "text" string of each non-blank line of a JSON Lines file, as UTF-8."""
    docs = []
    offset = 0
    for number, line in enumerate(raw.splitlines(keepends=True), 1):
        start, offset = offset, offset + len(line)
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(
                f"{file}: invalid UTF-8 at byte {start + exc.start} (line {number}); JSON Lines must be UTF-8"
            ) from None
        try:
            value = json.loads(text.removeprefix("\ufeff") if number == 1 else text)["text"]
            if not isinstance(value, str):
                raise TypeError("not a string")
            docs.append(value.encode("utf-8"))
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
            said = {
                UnicodeEncodeError: "an unpaired surrogate escape",
                KeyError: 'no "text"',
                RecursionError: "nested too deeply",
            }
            why = said.get(type(exc)) or str(exc)[:80]
            raise CorpusError(
                f'{file}: line {number} (byte {start}) is not a JSON object with a "text" string ({why})'
            ) from None
    return docs


def read_corpus(url: str = STDLIB, min_bytes: int = 64 * 1024) -> bytes:
    """All bytes of a text corpus, its documents joined by a blank line in a fixed order."""
    files = text_files(url)
    data = _SEPARATOR.join(doc for f in files for doc in documents(f))
    if len(data) < min_bytes:
        raise CorpusError(
            f"corpus {url!r}: {len(data)} bytes in {len(files)} files; need at least {min_bytes} "
            "(give a larger file, a folder glob such as 'file:///data/*.txt', or 'stdlib')"
        )
    return data
