"""Evaluate: a published round's held-out loss, written beside its manifest after the commit,
for the rounds the run evaluates (RunConfig.eval_every, and the last).

The learners poll for manifests; evaluating θ_r before the commit put the evaluation on the way
from a round's close to the learners, which the quality from a warm start paid for. The loss is
a pure function of the committed checkpoint, so whoever finds it missing (a retry, a resume after
a crash between the manifest and the evaluation) computes it again and gets the round's loss.
"""

from __future__ import annotations

import json
import time

import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from islands.core.config import RunConfig
from islands.core.data import evaluate
from islands.core.model import assign_params, skeleton, vocab_and_context
from islands.storage import layout
from islands.storage.manifest import Evaluation, Manifest
from islands.storage.model_files import local_model
from islands.storage.rounds import get_tensors, read_evaluation
from islands.storage.store import ObjectStore
from islands.tasks.round_state import held_out_batches


def held_out_loss(config: RunConfig, model: torch.nn.Module) -> float:
    """Held-out loss of a model that holds θ."""
    vocab, context = vocab_and_context(model)
    batches = held_out_batches(
        config.corpus,
        config.inner.batch_size,
        context,
        config.eval_batches,
        eval_corpus=config.eval_corpus,
        tokenizer=config.tokenizer,
        vocab_size=vocab,
    )
    return evaluate(model, batches)


def commit_evaluation(store: ObjectStore, evaluation: Evaluation) -> float:
    """Write the evaluation if absent; a racer's, when it was first, is the round's."""
    key = layout.eval_key(evaluation.run, evaluation.round)
    if store.put_if_absent(key, evaluation.to_bytes()):
        return evaluation.eval_loss
    return Evaluation.model_validate(json.loads(store.get(key))).eval_loss


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_round(
    config: RunConfig, store: ObjectStore, manifest: Manifest, params: dict[str, torch.Tensor] | None = None
) -> float:
    """Round `manifest.round`'s held-out loss: read when it is written, else computed from
    `params` (θ_r in memory) or the committed checkpoint, and written."""
    if manifest.eval_loss is not None:
        return manifest.eval_loss
    written = read_evaluation(store, manifest)
    if written is not None:
        return written.eval_loss
    t0 = time.perf_counter()
    # The model without weights first: the template it is copied from is built once, weights and
    # all, and that should come and go before θ is in memory, not beside it.
    model = skeleton(local_model(config.model), config.seed)
    assign_params(model, params if params is not None else get_tensors(store, manifest.model))
    loss = held_out_loss(config, model)
    loss = commit_evaluation(
        store,
        Evaluation(
            run=manifest.run,
            round=manifest.round,
            model_sha256=manifest.model.sha256,
            eval_loss=loss,
            batches=config.eval_batches,
            seconds=round(time.perf_counter() - t0, 3),
        ),
    )
    get_run_logger().info("%s round %d: eval loss %.4f", manifest.run, manifest.round, loss)
    return loss


def round_loss(
    config: RunConfig, store: ObjectStore, manifest: Manifest, params: dict[str, torch.Tensor] | None = None
) -> float | None:
    """The published round's held-out loss: evaluated (or read) when the run evaluates this
    round, else read if written; None when it is not evaluated."""
    if config.evaluates(manifest.round, manifest.tokens_applied):
        return evaluate_round(config, store, manifest, params)
    written = read_evaluation(store, manifest)
    return None if written is None else written.eval_loss
