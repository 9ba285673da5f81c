"""Reading the training text: an fsspec URL or glob, or the interpreter's own standard library.

The default corpus, ``stdlib``, is the `.py` sources of the Python standard library (without its
test suites and third-party packages) plus the `pydoc_data` topics that ship with the interpreter: real text, already on every machine, nothing
downloaded. Files are read in sorted order so every learner sees the same bytes.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import fsspec

STDLIB = "stdlib"
_SEPARATOR = b"\n\n"


class CorpusError(ValueError):
    pass


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


def read_corpus(url: str = STDLIB, min_bytes: int = 64 * 1024) -> bytes:
    """All bytes of the corpus, concatenated in a fixed order."""
    if url == STDLIB:
        chunks = [p.read_bytes() for p in stdlib_files()]
    else:
        try:
            files = fsspec.open_files(url, mode="rb")
        except Exception as exc:  # noqa: BLE001 - fsspec raises per backend
            raise CorpusError(f"corpus {url!r}: cannot be opened ({exc})") from exc
        chunks = []
        for f in sorted(files, key=lambda f: f.path):
            with f as fh:
                chunks.append(fh.read())
    data = _SEPARATOR.join(chunks)
    if len(data) < min_bytes:
        raise CorpusError(
            f"corpus {url!r}: {len(data)} bytes in {len(chunks)} files; need at least {min_bytes} "
            "(give a larger file, a folder glob such as 'file:///data/*.txt', or 'stdlib')"
        )
    return data
