"""Opening the corpus: token shards with their dataset manifest (storage.shards), streamed, or
text (storage.text) held in memory as one shard — bytes or, with a tokenizer, tokenized when the
run starts. Text is meant for corpora that fit in memory; `islands prepare` turns larger text
into shards, with a copy of their tokenizer beside them, which a run naming none takes
(`shards_tokenizer`).
"""

from __future__ import annotations

import hashlib

import numpy as np

from islands.core.data import InMemory, Segment, ShardReader, split_shards
from islands.storage.shards import MANIFEST, TOKENIZER_COPY, Shards, manifest_url
from islands.storage.text import STDLIB, CorpusError, documents, read_corpus, text_files
from islands.storage.tokenizer import BYTES, Tokenizer, load_tokenizer

__all__ = [
    "CorpusError",
    "STDLIB",
    "check_corpus",
    "held_out_part",
    "open_corpus",
    "shards_tokenizer",
    "training_part",
]


def open_corpus(url: str, tokenizer: Tokenizer | None = None, field_name: str = "corpus") -> ShardReader:
    """The corpus at `url` as shards: a dataset's, streamed, or text in memory as one shard
    (bytes, or tokenized with `tokenizer`)."""
    manifest = manifest_url(url) if url != STDLIB else None
    if manifest is not None:
        return Shards(manifest, field_name)
    if tokenizer is None or tokenizer.backend is None:
        return InMemory(read_corpus(url), name=url)
    docs = [doc for f in text_files(url, field_name) for doc in documents(f)]
    return InMemory(tokenizer.encode(docs).astype(np.int32), name=url)


def vocabulary(reader: ShardReader, tokenizer: Tokenizer) -> int:
    """The vocabulary the corpus's ids come from: its dataset's tokenizer, or the run's."""
    return reader.dataset.tokenizer.vocab_size if isinstance(reader, Shards) else tokenizer.vocab_size


def training_part(
    corpus: str, eval_corpus: str | None = None, tokenizer: str | None = None
) -> tuple[ShardReader, list[Segment]]:
    """The corpus and its training segments: all of it when `eval_corpus` names the held-out
    split, else all but its last shard (or the tail of its only one)."""
    reader = open_corpus(corpus, load_tokenizer(tokenizer))
    if eval_corpus is not None:
        return reader, [Segment(i, 0, n) for i, n in enumerate(reader.lengths)]
    return reader, split_shards(reader.lengths)[0]


def held_out_part(
    corpus: str, eval_corpus: str | None = None, tokenizer: str | None = None
) -> tuple[ShardReader, list[Segment]]:
    """The held-out split: `eval_corpus`, whole, or the corpus's last shard (the tail of its only one)."""
    tok = load_tokenizer(tokenizer)
    if eval_corpus is not None:
        reader = open_corpus(eval_corpus, tok, "eval_corpus")
        return reader, [Segment(i, 0, n) for i, n in enumerate(reader.lengths)]
    reader = open_corpus(corpus, tok)
    return reader, split_shards(reader.lengths)[1]


def shards_tokenizer(corpus: str, eval_corpus: str | None = None) -> str | None:
    """The tokenizer the run's token shards were made with, for a run that names none: the URL
    of the copy `islands prepare` keeps beside their dataset.json, each of its files checked
    against the sha256 the manifest names; None for text and for shards of bytes. CorpusError,
    one line naming the field: shards with no copy of their tokenizer (made before copies were
    kept), a copy that is not the one named, corpus and eval_corpus made with two tokenizers, a
    corpus that is gone."""
    found: tuple[str, str, str | None] | None = None  # (sha256, url, copy) of the first dataset
    for field_name, url in (("corpus", corpus), ("eval_corpus", eval_corpus)):
        if url is None or url == STDLIB:
            continue
        manifest = manifest_url(url)
        if manifest is None:
            text_files(url, field_name)  # text, read as bytes; or nothing there
            continue
        shards = Shards(manifest, field_name)
        ref = shards.dataset.tokenizer
        if found is not None:
            if ref.sha256 != found[0]:
                raise CorpusError(
                    f"{field_name}: {url} was made with another tokenizer ({ref.name}) than {found[1]}; "
                    "prepare both with one tokenizer"
                )
            continue
        if ref.sha256 == BYTES:
            found = (ref.sha256, url, None)
            continue
        if not ref.files:
            raise CorpusError(
                f"{field_name}: {url} was made with the tokenizer {ref.name} and keeps no copy of it; name it as "
                "tokenizer, or run `islands prepare` again to keep one beside the shards"
            )
        for name, sha in sorted(ref.files.items()):
            path = f"{shards.folder}/{TOKENIZER_COPY}/{name}"
            if not shards.fs.isfile(path) or hashlib.sha256(shards.fs.cat_file(path)).hexdigest() != sha:
                raise CorpusError(
                    f"{field_name}: {url}'s {TOKENIZER_COPY}/{name} is missing or not the file its {MANIFEST} "
                    "names; run `islands prepare` again"
                )
        if ref.files.get("tokenizer.json") != ref.sha256:
            raise CorpusError(
                f"{field_name}: {url}'s {MANIFEST} names a tokenizer copy of another sha256; run `islands prepare` again"
            )
        found = (ref.sha256, url, shards.url[: -len(MANIFEST)] + TOKENIZER_COPY)
    return found[2] if found else None


def check_corpus(corpus: str, eval_corpus: str | None, tokenizer: str | None, model_vocab: int) -> None:
    """Before a run writes anything: every corpus URL names text files or a dataset whose shards
    have their manifest's sizes, the tokenizer reads, and the ids fit the model's vocabulary.
    Raises CorpusError or TokenizerError, one line naming the field."""
    tok = load_tokenizer(tokenizer)
    for field_name, url in (("corpus", corpus), ("eval_corpus", eval_corpus)):
        if url is None:
            continue
        manifest = manifest_url(url) if url != STDLIB else None
        if manifest is None:
            text_files(url, field_name)
            if tok.vocab_size > model_vocab:
                raise CorpusError(
                    f"tokenizer: {tokenizer} has {tok.vocab_size} tokens, more than the model's vocabulary of "
                    f"{model_vocab}; use a model with a larger vocabulary or a smaller tokenizer"
                )
            continue
        made_with = Shards(manifest, field_name).dataset.tokenizer
        if tokenizer is not None and made_with.sha256 != tok.sha256:
            raise CorpusError(
                f"tokenizer: {tokenizer} is not the tokenizer {url} was made with ({made_with.name}); "
                "leave tokenizer unset for token shards or give that one"
            )
        if made_with.vocab_size > model_vocab:
            raise CorpusError(
                f"{field_name}: {url} was tokenized with {made_with.vocab_size} tokens ({made_with.name}), more "
                f"than the model's vocabulary of {model_vocab}; prepare it with a tokenizer that fits"
            )
