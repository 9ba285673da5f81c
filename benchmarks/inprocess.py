"""The baselines, trained in this process with the project's own pieces: data-parallel (one
model at K× batch) and synchronous DiLoCo (K learners, wait for all, tasks.merge for the merge).

Same model, data and seeds as the pipeline's learners (tasks.train_phase): learner i trains on
shard i of the training split with sampler seed seed·1000 + i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from benchmarks.heldout import BATCH, PRESET, train_bytes
from tasks.data import BatchSampler, shard
from tasks.inner import InnerConfig, InnerTrainer
from tasks.merge import MergeRule, merge_round
from tasks.model import build_model, params_of


@dataclass(frozen=True)
class Budget:
    learners: int = 4
    steps: int = 600  # per learner
    warmup: int = 50

    @property
    def tokens(self) -> int:
        return self.learners * self.steps * BATCH * build_model(PRESET, 0).config.block_size

    @property
    def second_half(self) -> "Budget":
        """What is left after the warm start (data-parallel's half-way model)."""
        return Budget(learners=self.learners, steps=self.steps // 2, warmup=self.warmup)


@lru_cache(maxsize=2)
def data_parallel(budget: Budget, seed: int) -> tuple[dict, dict]:
    """One model, batch learners × 16, for `steps` steps: θ at the end and θ half-way (the warm
    start). Trained once per process: the quality parts of one suite run share it."""
    model = build_model(PRESET, seed)
    sampler = BatchSampler(train_bytes(), budget.learners * BATCH, model.config.block_size, seed=seed * 1000)
    trainer = InnerTrainer(model, sampler, InnerConfig(warmup_steps=budget.warmup, total_steps=budget.steps))
    half = budget.steps // 2
    trainer.run_phase(params_of(model), half)
    snapshot = params_of(trainer.model)
    trainer.run_phase(params_of(trainer.model), budget.steps - half)
    return params_of(trainer.model), snapshot


def sync_diloco(budget: Budget, seed: int, h: int, rule: MergeRule, init: dict | None = None,
                on_round: Callable[[int, dict], None] | None = None) -> dict:
    """K learners, H inner steps each, all deltas merged every round (equal tokens, equal weights);
    `on_round(r, θ_r)` sees each round's model."""
    block = build_model(PRESET, seed).config.block_size
    cfg = InnerConfig(warmup_steps=budget.warmup, total_steps=budget.steps)
    trainers = []
    for i in range(budget.learners):
        data = shard(train_bytes(), i, budget.learners, block_size=block)
        trainers.append(InnerTrainer(build_model(PRESET, seed), BatchSampler(data, BATCH, block, seed=seed * 1000 + i), cfg))
    theta = init if init is not None else params_of(build_model(PRESET, seed))
    momentum = None
    for r in range(1, budget.steps // h + 1):
        deltas = [t.run_phase(theta, h).delta for t in trainers]
        theta, momentum = merge_round(theta, momentum, deltas, [1.0] * len(deltas), rule)
        if on_round is not None:
            on_round(r, theta)
    return theta


@lru_cache(maxsize=4)
def sync_diloco_from_seed(budget: Budget, seed: int, h: int, rule: MergeRule) -> dict:
    """`sync_diloco` from the seeded model, trained once per process: the quality and schedule
    parts of one suite run compare against the same run (callers must not change it)."""
    return sync_diloco(budget, seed, h, rule)


@lru_cache(maxsize=4)
def sync_diloco_from_warm(budget: Budget, seed: int, h: int, rule: MergeRule) -> dict:
    """`sync_diloco` over the budget's second half from data-parallel's (seed 0) half-way model,
    trained once per process: quality_robust and schedule compare against the same run."""
    _, warm = data_parallel(budget, seed=0)
    return sync_diloco(budget.second_half, seed, h, rule, init=warm)
