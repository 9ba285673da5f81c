"""Model folders on any fsspec URL: a run's `model` read from `s3://` (or any other remote
filesystem) onto local disk once, and an export written to a folder or a bucket.

The pure core (`islands.core.model`) builds models from local paths only; everything that touches a
remote filesystem is here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import fsspec

from islands.core.config import RunConfig
from islands.core.model import FACTORY, PRESETS, ModelError, spec_vocab_and_context

CACHE = Path(os.environ.get("ISLANDS_MODEL_CACHE", Path.home() / ".cache" / "islands" / "models"))


def is_remote(url: str) -> bool:
    return "://" in url and not url.startswith("file://")


def step_tokens(config: RunConfig) -> int:
    """Tokens one inner step of the run trains (batch × the model's context): what bounds a
    delta's token claim, with its inner steps."""
    return config.inner.batch_size * spec_vocab_and_context(local_model(config.model), config.seed)[1]


def local_model(spec: str) -> str:
    """`spec` as the core builds it: a preset, a factory or a local path as it is; a remote
    folder (or its config.json) copied to the local cache, once per content (the cache is keyed
    by the URL and the names, sizes and ETags of its files), and the copy's path."""
    if spec in PRESETS or spec.startswith(FACTORY) or not is_remote(spec):
        return spec
    folder, name = (spec.rsplit("/", 1)[0], "config.json") if spec.endswith("/config.json") else (spec, None)
    try:
        fs, root = fsspec.url_to_fs(folder)
        entries = [e for e in fs.ls(root, detail=True) if e.get("type") == "file"]
    except (OSError, ValueError) as exc:
        raise ModelError(f"model: {spec} cannot be read ({exc}); check the URL and the credentials") from exc
    if name is not None:
        entries = [e for e in entries if e["name"].rsplit("/", 1)[-1] == name]
    if not any(e["name"].endswith("/config.json") for e in entries):
        raise ModelError(f"model: {spec} has no config.json; give a Hugging Face model folder or its config.json")
    key = hashlib.sha256(
        repr([folder, sorted((e["name"], e.get("size"), e.get("ETag")) for e in entries)]).encode()
    ).hexdigest()[:16]
    target = CACHE / key
    if not target.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=CACHE, prefix=f".{key}-"))
        for entry in entries:
            fs.get_file(entry["name"], str(partial / entry["name"].rsplit("/", 1)[-1]))
        try:
            partial.rename(target)
        except OSError:  # another process finished the same copy first
            shutil.rmtree(partial, ignore_errors=True)
    return str(target / name) if name else str(target)


def check_writable(url: str) -> None:
    """Raise ModelError (naming OUT) when nothing could be written at `url`: a local folder whose
    nearest existing parent is not a writable folder, a file in its place, or a bucket that
    does not answer. Nothing is written."""
    if not is_remote(url):
        path = Path(url.removeprefix("file://")).resolve()
        if path.exists() and not path.is_dir():
            raise ModelError(f"OUT: {url} is a file; give a folder")
        parent = next(p for p in (path, *path.parents) if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ModelError(f"OUT: {url} cannot be created ({parent} is not a writable folder); give another folder")
        return
    try:
        fs, root = fsspec.url_to_fs(url)
        bucket = root.split("/", 1)[0]
        if not fs.exists(bucket):
            raise ModelError(f"OUT: {url}: the bucket {bucket!r} does not exist; create it or give another URL")
    except (OSError, ValueError, PermissionError) as exc:
        raise ModelError(f"OUT: {url} cannot be reached ({exc}); check the URL and the credentials") from exc


def put_folder(local: Path, url: str) -> list[str]:
    """Copy the files of the local folder `local` into `url` (a folder or an fsspec URL); the
    names written, sorted."""
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    if not is_remote(url):
        out = Path(url.removeprefix("file://"))
        out.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(local / name, out / name)
        return names
    fs, root = fsspec.url_to_fs(url)
    for name in names:
        fs.put_file(str(local / name), f"{root.rstrip('/')}/{name}")
    return names
