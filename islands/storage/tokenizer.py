"""Tokenizers: bytes (the default, vocabulary 256), a `tokenizer.json`, or a Hugging Face tokenizer
folder, read with `tokenizers` (or `transformers` for a folder without a `tokenizer.json`).

A tokenizer is known by the sha256 of its serialized form, which a dataset manifest records, so
shards made with one tokenizer are never read as if made with another; `islands prepare` keeps a
copy of it beside them (`copy_tokenizer`). An export writes the run's tokenizer as the files
transformers' `AutoTokenizer` reads (`save_tokenizer`); for bytes, a byte-level tokenizer whose
ids are the bytes themselves.

No tokenizer folder runs code: one whose tokenizer_config.json or config.json asks for code of
its own (`auto_map`) is refused by name, and transformers is told `trust_remote_code=False`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from islands.core.model import CODE_FIELDS_IN, asks_for_code

BYTES = "bytes"
# Tokens that end a document, by the names common tokenizers give them.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_SEPARATOR = b"\n\n"  # what separates documents in bytes
# The files of a Hugging Face tokenizer folder, slow or fast.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be read; one line naming the field."""


@dataclass
class Tokenizer:
    name: str
    sha256: str
    vocab_size: int
    eos: int | None = None
    backend: Any = field(default=None, repr=False)  # tokenizers.Tokenizer; None: bytes
    serialized: str = field(default="", repr=False)  # the tokenizer.json whose sha256 is `sha256`

    def encode(self, documents: list[bytes]) -> np.ndarray:
        """The documents' token ids laid end to end (int64), each followed by the end-of-document
        token (bytes: separated by a blank line, as the text corpus joins files)."""
        if self.backend is None:
            return np.frombuffer(_SEPARATOR.join(documents), np.uint8).astype(np.int64)
        eos = [] if self.eos is None else [self.eos]
        parts = [np.zeros(0, np.int64)]
        for start in range(0, len(documents), 256):  # a batch at a time: ids as Python ints are large
            batch = [d.decode("utf-8", "replace") for d in documents[start : start + 256]]
            parts.extend(np.asarray(enc.ids + eos, np.int64) for enc in self.backend.encode_batch(batch))
        return np.concatenate(parts)


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(BYTES, BYTES, 256)


def load_tokenizer(path: str | None, field_name: str = "tokenizer") -> Tokenizer:
    """The tokenizer at `path` (a `tokenizer.json`, or a folder holding one or what
    transformers' AutoTokenizer reads), any fsspec URL for the former; bytes when None."""
    if path is None or path == BYTES:
        return byte_tokenizer()
    from tokenizers import Tokenizer as Backend

    fs, root = fsspec.core.url_to_fs(path)
    if not root.endswith(".json") and fs.isdir(root):
        refuse_code(fs, root.rstrip("/"), path, field_name)
    candidates = [root] if root.endswith(".json") else [root.rstrip("/") + "/tokenizer.json"]
    for candidate in candidates:
        if fs.isfile(candidate):
            text = fs.cat_file(candidate).decode()
            try:
                backend = Backend.from_str(text)
            except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
                raise TokenizerError(f"{field_name}: {path} is not a tokenizer.json ({_one_line(exc)})") from exc
            return _wrap(path, backend, text)
    if fs.isdir(root):
        if "file" not in fs.protocol:
            raise TokenizerError(f"{field_name}: {path} has no tokenizer.json; copy the folder to local disk")
        try:
            from transformers import AutoTokenizer

            auto = AutoTokenizer.from_pretrained(root, trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            raise TokenizerError(
                f"{field_name}: {path} is no tokenizer folder transformers can read ({_one_line(exc)})"
            ) from exc
        backend = getattr(auto, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError(f"{field_name}: {path} has no fast tokenizer; save it with tokenizer.json")
        tok = _wrap(path, backend, backend.to_str())
        tok.eos = auto.eos_token_id if auto.eos_token_id is not None else tok.eos
        return tok
    raise TokenizerError(
        f"{field_name}: {path} does not exist; give a tokenizer.json or a Hugging Face tokenizer folder"
    )


def refuse_code(fs, root: str, path: str, field_name: str) -> None:
    """Raise TokenizerError when the tokenizer folder `root` (on `fs`) asks for code of its own."""
    for name in CODE_FIELDS_IN:
        if fs.isfile(f"{root}/{name}") and (why := asks_for_code(name, fs.cat_file(f"{root}/{name}"))):
            raise TokenizerError(
                f"{field_name}: {path} asks to run code it ships ({why}); islands runs no code from tokenizer "
                "folders: give its tokenizer.json, or a folder without auto_map"
            )


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]


def _wrap(path: str, backend, text: str) -> Tokenizer:
    eos = next((i for name in _EOS_NAMES if (i := backend.token_to_id(name)) is not None), None)
    sha = hashlib.sha256(text.encode()).hexdigest()
    return Tokenizer(path, sha, backend.get_vocab_size(with_added_tokens=True), eos, backend, text)


def copy_tokenizer(path: str, dst: str) -> dict[str, str]:
    """Copy the tokenizer at `path` into the folder `dst` (both any fsspec URL), so that
    `load_tokenizer(dst)` is the same tokenizer (the same sha256) and `save_tokenizer(dst, …)`
    writes what it would write of `path`: the tokenizer.json that was hashed, and a tokenizer
    folder's other files. Files of an earlier copy that are not among them are removed.
    Returns {file name: sha256 of its bytes}."""
    tok = load_tokenizer(path)
    if tok.backend is None:
        raise TokenizerError(f"tokenizer: {path} is bytes; there is nothing to copy")
    fs, root = fsspec.core.url_to_fs(path)
    root = root.rstrip("/")
    files = {"tokenizer.json": tok.serialized.encode()}
    if not root.endswith(".json"):
        for name in TOKENIZER_FILES:
            if name not in files and fs.isfile(f"{root}/{name}"):
                files[name] = fs.cat_file(f"{root}/{name}")
    out_fs, out = fsspec.core.url_to_fs(dst)
    out = out.rstrip("/")
    out_fs.makedirs(out, exist_ok=True)
    for name in TOKENIZER_FILES:
        if name not in files and out_fs.isfile(f"{out}/{name}"):
            out_fs.rm_file(f"{out}/{name}")
    for name, data in files.items():
        out_fs.pipe_file(f"{out}/{name}", data)
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def _byte_chars() -> list[str]:
    """The character standing for each byte in a byte-level BPE's vocabulary (GPT-2's table:
    printable Latin-1 bytes as themselves, the others from U+0100 on), as the ByteLevel
    pre-tokenizer writes them."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def save_byte_tokenizer(folder: Path) -> None:
    """Write into `folder` a tokenizer that `AutoTokenizer.from_pretrained(folder)` loads and
    that maps text to its UTF-8 bytes as ids 0–255, as a run on bytes read it: a byte-level BPE
    over the 256 bytes with no merges and no special tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False).save_pretrained(folder)


def save_tokenizer(path: str | None, folder: Path) -> None:
    """Write the tokenizer at `path` (any fsspec URL; None or bytes: `save_byte_tokenizer`) into
    the local `folder` as the files `AutoTokenizer.from_pretrained(folder)` loads: a Hugging Face
    tokenizer folder's own files, copied; a bare `tokenizer.json` (or a folder holding only one)
    wrapped in `PreTrainedTokenizerFast`, its end-of-document and unknown tokens named."""
    if path is None or path == BYTES:
        save_byte_tokenizer(folder)
        return
    tok = load_tokenizer(path)  # refuses a folder asking for code before any of its files is copied
    fs, root = fsspec.core.url_to_fs(path)
    root = root.rstrip("/")
    if not root.endswith(".json") and fs.isfile(f"{root}/tokenizer_config.json"):
        for name in TOKENIZER_FILES:
            if fs.isfile(f"{root}/{name}"):
                fs.get_file(f"{root}/{name}", str(folder / name))
        return
    from transformers import PreTrainedTokenizerFast

    special = {"eos_token": tok.backend.id_to_token(tok.eos)} if tok.eos is not None else {}
    if unk := getattr(tok.backend.model, "unk_token", None):
        special["unk_token"] = unk
    PreTrainedTokenizerFast(tokenizer_object=tok.backend, **special).save_pretrained(folder)
