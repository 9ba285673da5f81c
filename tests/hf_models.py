"""Small models for the tests of non-preset `model`s: a tiny Llama config folder written with
transformers' own LlamaConfig, a BPE tokenizer trained with `tokenizers`, and python: factories
(one good, two bad)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


def write_llama(folder: Path, vocab: int = 512, context: int = 64) -> Path:
    """A 2-layer, 64-wide Llama config with tied embeddings in `folder` (config.json only)."""
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ).save_pretrained(folder)
    return folder


def train_bpe(files: list[str], path: Path, vocab: int = 512) -> Path:
    """A BPE tokenizer of `vocab` tokens trained on `files` (characters it never saw: [UNK]),
    saved as the tokenizer.json `path`; documents end with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "<|endoftext|>"], limit_alphabet=120)
    tok.train(files, trainer)
    tok.save(str(path))
    return path


class Bigram(nn.Module):
    """A next-token table with a frozen scale and an integer buffer: what the factory contract needs."""

    vocab_size = 256
    block_size = 32

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(self.vocab_size, self.vocab_size)
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, input_ids, labels):
        logits = self.table(input_ids) * self.scale
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), labels.reshape(-1))


def bigram() -> nn.Module:
    return Bigram()


class _Logits(Bigram):
    def forward(self, input_ids, labels):
        return self.table(input_ids)


def logits_only() -> nn.Module:
    """forward returns logits, not a loss: refused."""
    return _Logits()


def not_a_module():
    return "model"
