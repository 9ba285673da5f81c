"""`islands prepare`: text into token shards and their dataset manifest, on any fsspec URL.

The source files, in sorted order, are cut into groups of about `shard_bytes` of text; each group
becomes one shard, tokenized and written by its own worker process (all cores). Beside each shard
a small sidecar (`shard-NNNNNN.json`) records its entry, with the sha256 of what it was made from
(the tokenizer and each source file's name and fsspec `ukey`): a shard whose sidecar names the
same source hash and whose size matches is not made again, so an interrupted or repeated prepare
does only what is missing. A copy of the tokenizer goes beside the shards (`tokenizer/`), so that a
run on them and its export use the very tokenizer they were made with; the manifest,
`dataset.json`, naming the copy's files with their sha256, is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing import get_context

import fsspec
import numpy as np

from islands.storage.shards import DTYPES, MANIFEST, TOKENIZER_COPY, Dataset, ShardEntry, TokenizerRef, dtype_for
from islands.storage.text import documents, text_files
from islands.storage.tokenizer import Tokenizer, copy_tokenizer, load_tokenizer


@dataclass(frozen=True)
class Group:
    index: int
    files: tuple[str, ...]
    bytes: int
    source_sha256: str

    @property
    def name(self) -> str:
        return f"shard-{self.index:06d}.bin"


def groups(src: str, tokenizer: Tokenizer, shard_bytes: int) -> list[Group]:
    """The source files cut, in order, into groups of at least `shard_bytes` (the last: the rest)."""
    files = text_files(src, "SRC")
    fs = fsspec.core.url_to_fs(files[0])[0]
    out: list[Group] = []
    batch: list[str] = []
    size = 0

    def close() -> None:
        keys = [[f, fs.ukey(fsspec.core.url_to_fs(f)[1])] for f in batch]
        sha = hashlib.sha256(json.dumps([tokenizer.sha256, keys]).encode()).hexdigest()
        out.append(Group(len(out), tuple(batch), size, sha))

    for f in files:
        batch.append(f)
        size += fs.size(fsspec.core.url_to_fs(f)[1])
        if size >= shard_bytes:
            close()
            batch, size = [], 0
    if batch:
        close()
    return out


@lru_cache(maxsize=1)
def _tokenizer(path: str | None) -> Tokenizer:
    return load_tokenizer(path)


def make_shard(dst: str, group: Group, tokenizer_path: str | None, dtype: str) -> tuple[ShardEntry, bool]:
    """Shard `group` under `dst`, unless a sidecar there names the same source; (entry, made)."""
    fs, root = fsspec.core.url_to_fs(dst)
    path = f"{root.rstrip('/')}/{group.name}"
    sidecar = path.removesuffix(".bin") + ".json"
    itemsize = np.dtype(dtype).itemsize
    if fs.isfile(sidecar) and fs.isfile(path):
        entry = ShardEntry.model_validate(json.loads(fs.cat_file(sidecar)))
        if entry.source_sha256 == group.source_sha256 and fs.size(path) == entry.tokens * itemsize:
            return entry, False
    tokens = _tokenizer(tokenizer_path).encode([doc for f in group.files for doc in documents(f)])
    raw = tokens.astype(DTYPES[dtype]).tobytes()
    fs.pipe_file(path, raw)
    entry = ShardEntry(
        name=group.name,
        tokens=len(tokens),
        sha256=hashlib.sha256(raw).hexdigest(),
        source_sha256=group.source_sha256,
    )
    fs.pipe_file(sidecar, json.dumps(entry.model_dump(mode="json"), sort_keys=True).encode())
    return entry, True


def prepare(
    plan: list[Group],
    dst: str,
    tokenizer: Tokenizer,
    tokenizer_path: str | None,
    workers: int | None = None,
    on_shard: Callable[[int, bool], None] | None = None,
) -> tuple[Dataset, int]:
    """Tokenize the groups of `plan` (`groups`) into shards under `dst` and write the manifest;
    returns (the dataset, the shards made now). `on_shard(source bytes, made)` is called as each
    shard is done."""
    dtype = dtype_for(tokenizer.vocab_size)
    fs, root = fsspec.core.url_to_fs(dst)
    fs.makedirs(root, exist_ok=True)
    entries: dict[int, ShardEntry] = {}
    made = 0
    workers = max(1, min(workers or os.cpu_count() or 1, len(plan)))

    def done(group: Group, entry: ShardEntry, new: bool) -> None:
        nonlocal made
        entries[group.index] = entry
        made += new
        if on_shard is not None:
            on_shard(group.bytes, new)

    if workers == 1:  # in this process: no interpreter to start per worker
        for g in plan:
            done(g, *make_shard(dst, g, tokenizer_path, dtype))
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(make_shard, dst, g, tokenizer_path, dtype): g for g in plan}
            for future in as_completed(futures):
                done(futures[future], *future.result())
    copy = f"{dst.rstrip('/')}/{TOKENIZER_COPY}"
    files = {} if tokenizer.backend is None else copy_tokenizer(tokenizer_path, copy)
    dataset = Dataset(
        dtype=dtype,
        tokenizer=TokenizerRef(
            name=tokenizer.name, sha256=tokenizer.sha256, vocab_size=tokenizer.vocab_size, files=files
        ),
        shards=[entries[i] for i in sorted(entries)],
    )
    fs.pipe_file(f"{root.rstrip('/')}/{MANIFEST}", dataset.to_bytes())
    return dataset, made
