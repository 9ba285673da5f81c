"""A BPE tokenizer trained by the tests, with `tokenizers`, on a few standard-library files."""

from __future__ import annotations

from pathlib import Path

from islands.storage.text import stdlib_files


def sample_texts(n: int = 6) -> list[str]:
    return [p.read_text() for p in stdlib_files()[:n]]


def train_bpe(path: Path, vocab_size: int) -> Path:
    """A tokenizer.json of `vocab_size` tokens, `<|endoftext|>` included."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator(sample_texts(), trainer)
    tok.save(str(path))
    return path
