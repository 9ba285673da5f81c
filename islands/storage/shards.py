"""Token shards: flat arrays of uint16 or uint32 token ids (nanoGPT's `.bin` layout, no header),
with a dataset manifest beside them, `dataset.json`, naming each shard with its token count and
sha256, the dtype and the tokenizer's sha256 and vocabulary size. A tokenizer's own files are kept
beside them, in `tokenizer/` (`TOKENIZER_COPY`), each named in the manifest with its sha256.

A learner reads its shards by ranges (`Shards.read`, one ranged GET per chunk), so nothing reads a
shard whole. Opening a dataset checks every shard's size against its manifest (one listing), so a
shard of the wrong dtype or length is named before anything trains on it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

import fsspec
import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from islands.storage.text import CorpusError
from islands.storage.tokenizer import TOKENIZER_FILES

MANIFEST = "dataset.json"
TOKENIZER_COPY = "tokenizer"  # the folder beside the manifest holding the tokenizer's files
FORMAT = "islands-tokens/1"
DTYPES: dict[str, type[np.unsignedinteger]] = {"uint16": np.uint16, "uint32": np.uint32}
CHUNK_BYTES = 8 << 20  # what one ranged read fetches: the read-ahead is one chunk beyond the current


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


MAX_VOCAB = 1 << 32  # every id of a uint32 shard


def inside_folder(name: str) -> str:
    """A shard's name as a file of the manifest's folder (or a folder below it), or ValueError:
    a name from a data file never leads out of its folder (`../x`, `/etc/passwd`, `s3://other`)."""
    parts = name.split("/")
    if "://" in name or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{name[:80]!r} is not a file inside the dataset's folder")
    return name


class ShardEntry(_Strict):
    name: Annotated[str, AfterValidator(inside_folder)]  # relative to the manifest's folder
    tokens: int = Field(ge=0)
    sha256: str
    source_sha256: str = ""  # of the text it was made from, with the tokenizer (islands prepare)


class TokenizerRef(_Strict):
    name: str
    sha256: str
    vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    # Its files in TOKENIZER_COPY, name → sha256; none for bytes (or shards made before copies were kept).
    files: dict[Literal[TOKENIZER_FILES], str] = {}


class Dataset(_Strict):
    format: Literal["islands-tokens/1"] = FORMAT
    dtype: Literal["uint16", "uint32"]
    tokenizer: TokenizerRef
    shards: list[ShardEntry]

    @model_validator(mode="after")
    def _consistent(self) -> Dataset:
        if self.dtype == "uint16" and self.tokenizer.vocab_size > 1 << 16:
            raise ValueError(f"uint16 shards cannot hold the ids of a vocabulary of {self.tokenizer.vocab_size}")
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"shard {twice!r} is listed twice")
        return self

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1).encode()


def prepared_names(shards: list[str]) -> list[str]:
    """Every file `islands prepare` may write in its folder for these shard names: each shard
    and its sidecar, the tokenizer's copy and the manifest."""
    sidecars = [name for shard in shards for name in (shard, shard.removesuffix(".bin") + ".json")]
    return [*sidecars, *(f"{TOKENIZER_COPY}/{name}" for name in TOKENIZER_FILES), MANIFEST]


def foreign_files(dst: str, names: list[str]) -> list[str]:
    """Those of `names` (`prepared_names`) that are in the folder `dst` and that prepare did not
    write: a manifest that is not a dataset's, a sidecar that is not a shard's entry, a shard no
    sidecar names, a tokenizer file its manifest does not name with these bytes' sha256. Prepare
    replaces none of them unless told to (--force)."""
    fs, root = fsspec.core.url_to_fs(dst)
    folder = root.rstrip("/")
    return [name for name in names if fs.exists(f"{folder}/{name}") and not _prepared(fs, folder, name)]


def _prepared(fs, folder: str, name: str) -> bool:
    try:
        if name == MANIFEST:
            Dataset.model_validate_json(fs.cat_file(f"{folder}/{name}"))
            return True
        if name.startswith(TOKENIZER_COPY + "/"):
            named = Dataset.model_validate_json(fs.cat_file(f"{folder}/{MANIFEST}")).tokenizer.files
            sha = hashlib.sha256(fs.cat_file(f"{folder}/{name}")).hexdigest()
            return named.get(name.removeprefix(TOKENIZER_COPY + "/")) == sha
        shard = name.removesuffix(".json") + ".bin" if name.endswith(".json") else name
        sidecar = shard.removesuffix(".bin") + ".json"
        return (
            fs.isfile(f"{folder}/{name}")
            and ShardEntry.model_validate_json(fs.cat_file(f"{folder}/{sidecar}")).name == shard
        )
    except (OSError, ValueError):  # not there, a folder, not JSON, not an entry
        return False


def dtype_for(vocab_size: int) -> str:
    """The narrowest dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def manifest_url(corpus: str) -> str | None:
    """The dataset manifest a corpus URL names (the manifest itself or a folder holding one), or
    None when it names text."""
    if corpus.endswith("/" + MANIFEST) or corpus == MANIFEST:
        return corpus
    if any(ch in corpus for ch in "*?["):
        return None
    fs, root = fsspec.core.url_to_fs(corpus)
    candidate = root.rstrip("/") + "/" + MANIFEST
    return corpus.rstrip("/") + "/" + MANIFEST if fs.isfile(candidate) else None


class Shards:
    """A dataset's shards, read by token ranges through fsspec."""

    def __init__(self, url: str, field_name: str = "corpus"):
        self.url = url
        self.fs, path = fsspec.core.url_to_fs(url)
        self.folder = path.rsplit("/", 1)[0]
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError as exc:
            raise CorpusError(f"{field_name}: {url} does not exist; run `islands prepare` first") from exc
        try:
            self.dataset = Dataset.model_validate(json.loads(raw))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"])) or "the manifest"
            raise CorpusError(f"{field_name}: {url} is not a dataset manifest ({where}: {first['msg']})") from None
        except ValueError as exc:  # not JSON, not UTF-8, or nested past the parser's stack
            raise CorpusError(f"{field_name}: {url} is not a dataset manifest ({str(exc)[:120]})") from None
        except RecursionError:
            raise CorpusError(f"{field_name}: {url} is not a dataset manifest (nested too deeply)") from None
        if not self.dataset.shards:
            raise CorpusError(f"{field_name}: {url} lists no shards")
        self.itemsize = np.dtype(self.dataset.dtype).itemsize
        self.dtype = DTYPES[self.dataset.dtype]
        self.names = [s.name for s in self.dataset.shards]
        self.lengths = [s.tokens for s in self.dataset.shards]
        self.paths = [f"{self.folder}/{s.name}" for s in self.dataset.shards]
        self.chunk_tokens = CHUNK_BYTES // self.itemsize
        self._check_sizes(field_name)

    def _check_sizes(self, field_name: str) -> None:
        sizes: dict[str, int] = {}
        for folder in sorted({p.rsplit("/", 1)[0] for p in self.paths}):
            sizes.update({e["name"].rstrip("/"): e["size"] for e in self.fs.ls(folder, detail=True)})
        for name, path, tokens in zip(self.names, self.paths, self.lengths):
            size = sizes.get(path)
            if size is None:
                raise CorpusError(f"{field_name}: shard {name} of {self.url} is missing; run `islands prepare` again")
            if size != tokens * self.itemsize:
                raise CorpusError(
                    f"{field_name}: shard {name} holds {size} bytes, not the {tokens} {self.dataset.dtype} tokens "
                    f"({tokens * self.itemsize} bytes) its manifest names: another dtype or a cut length; "
                    "run `islands prepare` again"
                )

    def read(self, shard: int, start: int, end: int) -> np.ndarray:
        raw = self.fs.cat_file(self.paths[shard], start=start * self.itemsize, end=end * self.itemsize)
        return np.frombuffer(raw, self.dtype).astype(np.int32)
