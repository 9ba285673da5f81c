"""Tokenizers: bytes (the default, vocabulary 256), a `tokenizer.json`, or a Hugging Face tokenizer
folder, read with `tokenizers` (or `transformers` for a folder without a `tokenizer.json`).

A tokenizer is known by the sha256 of its serialized form, which a dataset manifest records, so
shards made with one tokenizer are never read as if made with another. An export writes the
run's tokenizer as the files transformers' `AutoTokenizer` reads (`save_tokenizer`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

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
    candidates = [root] if root.endswith(".json") else [root.rstrip("/") + "/tokenizer.json"]
    for candidate in candidates:
        if fs.isfile(candidate):
            text = fs.cat_file(candidate).decode()
            try:
                backend = Backend.from_str(text)
            except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception type
                raise TokenizerError(f"{field_name}: {path} is not a tokenizer.json ({exc})") from exc
            return _wrap(path, backend, hashlib.sha256(text.encode()).hexdigest())
    if fs.isdir(root):
        if "file" not in fs.protocol:
            raise TokenizerError(f"{field_name}: {path} has no tokenizer.json; copy the folder to local disk")
        try:
            from transformers import AutoTokenizer

            auto = AutoTokenizer.from_pretrained(root)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            raise TokenizerError(f"{field_name}: {path} is no tokenizer folder transformers can read ({exc})") from exc
        backend = getattr(auto, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError(f"{field_name}: {path} has no fast tokenizer; save it with tokenizer.json")
        text = backend.to_str()
        tok = _wrap(path, backend, hashlib.sha256(text.encode()).hexdigest())
        tok.eos = auto.eos_token_id if auto.eos_token_id is not None else tok.eos
        return tok
    raise TokenizerError(
        f"{field_name}: {path} does not exist; give a tokenizer.json or a Hugging Face tokenizer folder"
    )


def _wrap(path: str, backend, sha: str) -> Tokenizer:
    eos = next((i for name in _EOS_NAMES if (i := backend.token_to_id(name)) is not None), None)
    return Tokenizer(path, sha, backend.get_vocab_size(with_added_tokens=True), eos, backend)


def save_tokenizer(path: str, folder: Path) -> None:
    """Write the tokenizer at `path` (any fsspec URL) into the local `folder` as the files
    `AutoTokenizer.from_pretrained(folder)` loads: a Hugging Face tokenizer folder's own files,
    copied; a bare `tokenizer.json` (or a folder holding only one) wrapped in
    `PreTrainedTokenizerFast`, its end-of-document and unknown tokens named."""
    fs, root = fsspec.core.url_to_fs(path)
    root = root.rstrip("/")
    if not root.endswith(".json") and fs.isfile(f"{root}/tokenizer_config.json"):
        for name in TOKENIZER_FILES:
            if fs.isfile(f"{root}/{name}"):
                fs.get_file(f"{root}/{name}", str(folder / name))
        return
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(path)
    special = {"eos_token": tok.backend.id_to_token(tok.eos)} if tok.eos is not None else {}
    if unk := getattr(tok.backend.model, "unk_token", None):
        special["unk_token"] = unk
    PreTrainedTokenizerFast(tokenizer_object=tok.backend, **special).save_pretrained(folder)
