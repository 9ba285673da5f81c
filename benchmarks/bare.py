"""One learner's inner loop with nothing around it: no Prefect, no S3, same model, data, threads
and rate cap (`--min-step-s`) as a pipeline learner. Prints {"tokens": …, "steps": …, "seconds": …} as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.heldout import BATCH, PRESET, train_bytes
from tasks.data import BatchSampler, shard
from tasks.inner import InnerConfig, InnerTrainer
from tasks.model import build_model, params_of


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--inner-steps", type=int, required=True)
    p.add_argument("--min-step-s", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(train(args.index, args.learners, args.steps, args.inner_steps, args.min_step_s, args.seed)))


def train(index: int, learners: int, steps: int, inner_steps: int, min_step_s: float = 0.0, seed: int = 0) -> dict:
    """Learner `index`'s inner loop on this process's threads, phase after phase from its own
    θ, until it has trained `steps` batches' tokens; the model is built before the clock starts."""
    model = build_model(PRESET, seed)
    data = shard(train_bytes(), index, learners, block_size=model.config.block_size)
    sampler = BatchSampler(data, BATCH, model.config.block_size, seed=seed * 1000 + index)
    trainer = InnerTrainer(model, sampler, InnerConfig())
    t0, tokens, done, theta = time.perf_counter(), 0, 0, params_of(model)
    while tokens < steps * sampler.tokens_per_batch:
        result = trainer.run_phase(theta, inner_steps, min_step_s=min_step_s)
        theta = {k: theta[k] - result.delta[k] for k in theta}
        tokens, done = tokens + result.tokens, done + result.steps
    return {"tokens": tokens, "steps": done, "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    main()
