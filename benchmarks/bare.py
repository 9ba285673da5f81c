"""One learner's inner loop with nothing around it: no Prefect, no S3, same model, data, threads
and rate cap (`--min-step-s`) as a pipeline learner. With `--index`, that learner alone prints
{"tokens": …, "steps": …, "seconds": …} as one JSON line; without it, all `--learners` train side
by side, each in a fork of this process, and the line is the list of theirs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from multiprocessing.connection import Connection

import torch
import torch._dynamo  # noqa: F401 - torch.optim imports it at the first optimizer: here once, not in every fork

from benchmarks.heldout import BATCH, PRESET, context, train_bytes
from islands.core.config import InnerSettings
from islands.core.data import BatchSampler, shard
from islands.core.inner import InnerTrainer
from islands.core.model import build_model, params_of


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--index", type=int, help="train this learner alone (default: every learner, side by side)")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--inner-steps", type=int, required=True)
    p.add_argument("--min-step-s", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=PRESET, help="a local model spec (islands.core.model.build_model)")
    args = p.parse_args()
    torch.set_num_threads(1)
    job = (args.learners, args.steps, args.inner_steps, args.min_step_s, args.seed, args.model)
    print(json.dumps(train(args.index, *job) if args.index is not None else side_by_side(*job)))


def side_by_side(
    learners: int, steps: int, inner_steps: int, min_step_s: float = 0.0, seed: int = 0, model: str = PRESET
) -> list[dict]:
    """Every learner's `train` at once, each in a fork of this process, as the pipeline's learners
    are forks of the learner runner's fork server: one interpreter's imports of torch and
    torch._dynamo, not one per learner. Only for a process that has run
    nothing on torch's threads yet (this module's command line): a fork of one that has can hang
    in them."""
    ctx = multiprocessing.get_context("fork")
    conns, procs = [], []
    try:
        for index in range(learners):
            conn, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_report, args=(theirs, index, learners, steps, inner_steps, min_step_s, seed, model)
            )
            proc.start()
            theirs.close()  # a child's death reads as EOF here, not a hang
            conns.append(conn)
            procs.append(proc)
        return [conn.recv() for conn in conns]
    finally:
        for proc in procs:
            proc.join()


def _report(conn: Connection, *job) -> None:
    conn.send(train(*job))
    conn.close()


def train(
    index: int,
    learners: int,
    steps: int,
    inner_steps: int,
    min_step_s: float = 0.0,
    seed: int = 0,
    model: str = PRESET,
) -> dict:
    """Learner `index`'s inner loop on this process's threads, phase after phase from its own
    θ, until it has trained `steps` batches' tokens; the model is built before the clock starts."""
    net, block = build_model(model, seed), context(model)
    data = shard(train_bytes(), index, learners, block_size=block)
    sampler = BatchSampler(data, BATCH, block, seed=seed * 1000 + index)
    trainer = InnerTrainer(net, sampler, InnerSettings())
    t0, tokens, done, theta = time.perf_counter(), 0, 0, params_of(net)
    while tokens < steps * sampler.tokens_per_batch:
        result = trainer.run_phase(theta, inner_steps, min_step_s=min_step_s)
        theta = {k: theta[k] - result.delta[k] for k in theta}
        tokens, done = tokens + result.tokens, done + result.steps
    return {"tokens": tokens, "steps": done, "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    main()
