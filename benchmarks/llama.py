"""The benchmarks' Llama configs in one place: a model of a given width, depth and context, over
the byte vocabulary unless told otherwise (the benchmarks' corpora are bytes), written by
transformers' LlamaConfig as a user's own config.json would be."""

from __future__ import annotations


def llama_config(
    hidden: int,
    layers: int,
    context: int,
    *,
    heads: int | None = None,
    intermediate: int | None = None,
    vocab: int = 256,
    tied: bool = False,
):
    """`heads` defaults to one per 64 dimensions, `intermediate` to Llama's 8/3 × hidden (rounded
    down to a multiple of 64); no special tokens: the runs never generate."""
    from transformers import LlamaConfig

    heads = heads or hidden // 64
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
