"""The one held-out evaluation every benchmark uses: the same corpus split, the same batches.

They are the batches the synchronizer evaluates each round (tasks.round_state.held_out_batches
with the run's eval_batches), so a manifest's eval loss and a loss computed here agree, except
at --quick, where the synchronizer evaluates on fewer (benchmarks.pipeline.eval_batches).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from islands.core.data import evaluate, split_held_out
from islands.core.model import assign_params, skeleton, spec_vocab_and_context
from islands.storage.text import read_corpus
from islands.tasks.round_state import held_out_batches

CORPUS = "stdlib"
PRESET = "tiny"
BATCH = 16
EVAL_BATCHES = 16


@lru_cache(maxsize=1)
def train_bytes() -> bytes:
    return split_held_out(read_corpus(CORPUS))[0]


def context(model: str = PRESET) -> int:
    """The context length of `model` (a local spec), which every batch's windows have."""
    return spec_vocab_and_context(model, 0)[1]


def batches(model: str = PRESET) -> list:
    return held_out_batches(CORPUS, BATCH, context(model), EVAL_BATCHES)


def loss(params: dict[str, torch.Tensor], model: str = PRESET) -> float:
    net = skeleton(model, 0)
    assign_params(net, params)
    return evaluate(net, batches(model))
