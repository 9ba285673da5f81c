"""A round's evaluation: written after its manifest, once, and only ever of that round's model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from islands.core.config import MergeSettings, QuorumSettings
from islands.storage import layout
from islands.storage.manifest import Evaluation, Manifest, ObjectRef, Quorum, RoundSettings
from islands.storage.rounds import read_evaluation, with_eval_losses
from islands.storage.store import IntegrityError, ObjectStore
from islands.tasks.evaluate import commit_evaluation

RUN = "run-eval"


def manifest(round_: int, eval_loss: float | None = None) -> Manifest:
    return Manifest(
        run=RUN,
        round=round_,
        parent_round=round_ - 1 if round_ else None,
        parent_sha256=None,
        created_at="2026-01-01T00:00:00+00:00",
        model=ObjectRef(key=f"m{round_}", sha256=f"{round_:02d}" * 32, bytes=10),
        outer=None,
        settings=RoundSettings(merge=MergeSettings(), quorum=QuorumSettings(min_quorum=1), num_learners=2),
        quorum=Quorum(received=1, learners=[], waited_s=1.0, closed_by="all-in"),
        eval_loss=eval_loss,
    )


def evaluation(m: Manifest, loss: float) -> Evaluation:
    return Evaluation(run=RUN, round=m.round, model_sha256=m.model.sha256, eval_loss=loss, batches=4, seconds=0.1)


def test_the_first_evaluation_written_is_the_rounds():
    store, m = ObjectStore("memory://eval-first"), manifest(1)
    assert read_evaluation(store, m) is None
    assert commit_evaluation(store, evaluation(m, 2.5)) == 2.5
    # A retry, or a second synchronizer, whose float sum came out another way: the first one stays.
    assert commit_evaluation(store, evaluation(m, 2.5000001)) == 2.5
    assert read_evaluation(store, m).eval_loss == 2.5


def test_an_evaluation_of_another_checkpoint_is_refused():
    store, one, two = ObjectStore("memory://eval-other"), manifest(1), manifest(2)
    store.put_if_absent(layout.eval_key(RUN, 2), evaluation(one, 2.5).to_bytes())  # round 1's, stored as round 2's
    with pytest.raises(IntegrityError, match="round 2"):
        read_evaluation(store, two)


def test_readers_see_each_round_with_its_loss_or_none_while_it_is_evaluated():
    store = ObjectStore("memory://eval-readers")
    chain = [manifest(0, eval_loss=5.5), manifest(1), manifest(2)]
    commit_evaluation(store, evaluation(chain[1], 3.25))
    assert [m.eval_loss for m in with_eval_losses(store, chain)] == [5.5, 3.25, None]
    assert chain[1].eval_loss is None  # the manifests read are not changed


def test_an_evaluation_gives_the_same_loss_twice_without_importing_torch_dynamo():
    """A driver's first evaluation is on the way from its start to its learners' launch: building
    the weightless model on the meta device would import torch._dynamo there (1.2 s of a core)."""
    script = """
import sys
import torch
from islands.core.config import RunConfig
from islands.tasks.evaluate import held_out_loss
from islands.core.model import assign_params, build_model, own_params, skeleton
config = RunConfig(run_id="eval-imports", regions=["north", "south"], eval_batches=1, speed={})
theta = own_params(build_model(config.model, 0))
models = [skeleton(config.model, 0) for _ in range(2)]
for model in models:
    assign_params(model, theta)
first, again = (held_out_loss(config, model) for model in models)
assert first == again and 5.0 < first < 6.0, (first, again)
assert "torch._dynamo" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
