"""The baselines, trained with the project's own pieces outside the pipeline: data-parallel (one
model at K× batch, in this process or in a few ranks that average their gradients) and
synchronous DiLoCo (K learners, wait for all, islands.core.merge for the merge), its learners in this
process or in a few worker processes.

Same model, data and seeds as the pipeline's learners (tasks.train_phase): learner i trains on
shard i of the training split with sampler seed seed·1000 + i.
"""

from __future__ import annotations

import gc
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache, partial
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from benchmarks.heldout import BATCH, PRESET, context, train_bytes
from islands.core.config import InnerSettings, MergeSettings
from islands.core.data import BatchSampler, shard
from islands.core.inner import InnerTrainer
from islands.core.merge import merge_round
from islands.core.model import build_model, params_of


@dataclass(frozen=True)
class Budget:
    learners: int = 4
    steps: int = 600  # per learner
    warmup: int = 50
    model: str = PRESET  # a local model spec (islands.core.model.build_model)

    @property
    def tokens(self) -> int:
        return self.learners * self.steps * BATCH * context(self.model)

    @property
    def second_half(self) -> Budget:
        """What is left after the warm start (data-parallel's half-way model)."""
        return Budget(learners=self.learners, steps=self.steps // 2, warmup=self.warmup, model=self.model)


@lru_cache(maxsize=2)
def data_parallel(budget: Budget, seed: int) -> tuple[dict, dict]:
    """One model, batch learners × 16, for `steps` steps: θ at the end and θ half-way (the warm
    start). Trained once per process: the quality parts of one suite run share it."""
    return train_data_parallel(budget, seed, sync_procs(budget))


def train_data_parallel(budget: Budget, seed: int, procs: int = 1) -> tuple[dict, dict]:
    """`data_parallel`, as data-parallel training runs: procs > 1 trains it in that many spawned
    ranks of one thread each (torch.distributed, gloo on loopback), every rank on its slice of
    each batch and DDP averaging the gradients. That is the one-process model within float
    rounding (tests/test_inprocess.py), and on 2 cores sooner a step than one process of two
    threads, the tiny model's matmuls parallelising badly across threads."""
    if procs < 1:
        raise ValueError(f"procs must be >= 1, got {procs}")
    if procs == 1:
        return dp_train(budget, seed, ddp=False)
    ctx = torch.multiprocessing.get_context("spawn")
    conns, ranks = [], []
    with tempfile.TemporaryDirectory(prefix="dp-rendezvous-") as tmp:
        try:
            for rank in range(procs):
                conn, theirs = ctx.Pipe(duplex=False)
                worker = ctx.Process(
                    target=dp_rank, args=(theirs, rank, procs, f"file://{tmp}/store", budget, seed), daemon=True
                )
                worker.start()
                theirs.close()  # its death reads as EOF here, not a hang
                conns.append(conn)
                ranks.append(worker)
            replies, pending = {}, list(conns)
            while pending:  # in whatever order they come: a failed rank leaves the others waiting on it
                for conn in wait(pending):
                    replies[conns.index(conn)] = worker_reply(conn, "a data-parallel rank")
                    pending.remove(conn)
            final, half = replies[0]
            return st_load(final), st_load(half)
        finally:
            stop(ranks, conns)


def dp_train(budget: Budget, seed: int, ddp: bool) -> tuple[dict, dict]:
    """The data-parallel model's training, in one process or as one rank of a group."""
    model = build_model(budget.model, seed)
    sampler = BatchSampler(train_bytes(), budget.learners * BATCH, context(budget.model), seed=seed * 1000)
    trainer = InnerTrainer(
        model,
        sampler,
        InnerSettings(warmup_steps=budget.warmup, total_steps=budget.steps),
        parallel="ddp" if ddp else None,
    )
    half = budget.steps // 2
    trainer.run_phase(params_of(model), half)
    snapshot = params_of(trainer.model)
    trainer.run_phase(params_of(trainer.model), budget.steps - half)
    return params_of(trainer.model), snapshot


def dp_rank(conn: Connection, rank: int, world: int, rendezvous: str, budget: Budget, seed: int) -> None:
    """One data-parallel rank: rank 0 answers with both models as safetensors bytes (plain bytes
    outlive this process, shared-memory tensors would not), the others with None; an error goes
    back as its traceback."""
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's traffic stays on loopback
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
        try:
            final, half = dp_train(budget, seed, ddp=True)
            conn.send((st_save(final), st_save(half)) if rank == 0 else None)
        finally:
            gc.collect()  # DDP's reducer holds the group: free it before the group goes
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - any failure is the caller's to raise
        conn.send(traceback.format_exc())


def sync_diloco(
    budget: Budget,
    seed: int,
    h: int,
    rule: MergeSettings,
    init: dict | None = None,
    on_round: Callable[[int, dict], None] | None = None,
    procs: int = 1,
) -> dict:
    """K learners, H inner steps each, all deltas merged every round (equal tokens, equal weights);
    `on_round(r, θ_r)` sees each round's model. procs > 1 trains the learners in that many worker
    processes of one thread each (learner i in worker i % procs): the same bits as procs=1 under
    torch.set_num_threads(1), since each learner runs the same ops and the merge stays here."""
    if procs < 1:
        raise ValueError(f"procs must be >= 1, got {procs}")
    theta = init if init is not None else params_of(build_model(budget.model, seed))
    momentum = None
    phases = (
        nullcontext(partial(phase_deltas, learner_trainers(budget, seed, range(budget.learners))))
        if procs == 1
        else worker_phases(budget, seed, procs)
    )
    with phases as run_phases:
        for r in range(1, budget.steps // h + 1):
            theta, momentum = merge_round(theta, momentum, run_phases(theta, h), [1.0] * budget.learners, rule)
            if on_round is not None:
                on_round(r, theta)
    return theta


def learner_trainers(budget: Budget, seed: int, learners: range) -> list[InnerTrainer]:
    """The trainers of `learners` as the pipeline builds them: learner i on shard i with sampler seed
    seed·1000 + i. One construction for the serial loop and the workers, so both train the same run."""
    block = context(budget.model)
    cfg = InnerSettings(warmup_steps=budget.warmup, total_steps=budget.steps)
    return [
        InnerTrainer(
            build_model(budget.model, seed),
            BatchSampler(
                shard(train_bytes(), i, budget.learners, block_size=block), BATCH, block, seed=seed * 1000 + i
            ),
            cfg,
        )
        for i in learners
    ]


def phase_deltas(trainers: list[InnerTrainer], theta: dict, h: int) -> list[dict]:
    """One round's work: each trainer's H-step phase from θ, in order, as its delta."""
    return [t.run_phase(theta, h).delta for t in trainers]


@contextmanager
def worker_phases(budget: Budget, seed: int, procs: int) -> Iterator[Callable[[dict, int], list[dict]]]:
    """`procs` spawned worker processes (fork is unsafe once torch has threads), each owning the learners
    i ≡ w (mod procs); yields `run_phases(θ, H)` -> every learner's delta in learner order. θ and the
    deltas travel as shared-memory tensors (torch.multiprocessing), not as pickled bytes. The workers
    are stopped on the way out, and killed when an error leaves them mid-phase."""
    ctx = torch.multiprocessing.get_context("spawn")
    conns, workers = [], []
    try:
        for w in range(procs):
            conn, theirs = ctx.Pipe()
            conns.append(conn)
            worker = ctx.Process(
                target=learner_worker, args=(theirs, budget, seed, range(w, budget.learners, procs)), daemon=True
            )
            worker.start()
            workers.append(worker)
            theirs.close()  # only the worker holds its end now: its death reads as EOF here, not a hang
        for conn in conns:
            worker_reply(conn)

        def run_phases(theta: dict, h: int) -> list[dict]:
            for conn in conns:
                conn.send((theta, h))
            replies = [worker_reply(conn) for conn in conns]
            return [replies[i % procs][i // procs] for i in range(budget.learners)]

        yield run_phases
        for conn in conns:
            conn.send(None)
        for worker in workers:
            worker.join()
    finally:
        stop(workers, conns)


def stop(workers: list, conns: list[Connection]) -> None:
    """Kill the workers still running (an error left them mid-job), reap all and close their pipes."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
        worker.join()
    for conn in conns:
        conn.close()


def learner_worker(conn: Connection, budget: Budget, seed: int, learners: range) -> None:
    """A worker process: one thread (the tiny model's matmuls gain little from more), its learners'
    trainers kept across rounds, each (θ, H) from `conn` answered with their deltas until None. Its
    first reply (None) says the trainers are built; an error goes back as its traceback, which the
    caller raises (this process's stderr is nobody's to read)."""
    try:
        torch.set_num_threads(1)
        trainers = learner_trainers(budget, seed, learners)
        conn.send(None)
        while (job := conn.recv()) is not None:
            conn.send(phase_deltas(trainers, *job))
    except Exception:  # noqa: BLE001 - any failure is the caller's to raise
        conn.send(traceback.format_exc())


def worker_reply(conn: Connection, worker: str = "a learner worker"):
    """A worker's next reply; its traceback raised here when it failed."""
    reply = conn.recv()
    if isinstance(reply, str):
        raise RuntimeError(f"{worker} failed:\n{reply}")
    return reply


def sync_procs(budget: Budget) -> int:
    """Processes for the suite's sync DiLoCo learners and data-parallel ranks. On this tiny model
    two processes of one thread each step faster than one process of two threads, its matmuls
    parallelising badly across threads; starting and stopping them costs more than that saves at
    --quick's ten steps."""
    return min(2, os.cpu_count() or 1) if budget.steps >= 100 else 1


@lru_cache(maxsize=4)
def sync_diloco_from_seed(budget: Budget, seed: int, h: int, rule: MergeSettings) -> dict:
    """`sync_diloco` from the seeded model, trained once per process: the quality and schedule
    parts of one suite run compare against the same run (callers must not change it)."""
    return sync_diloco(budget, seed, h, rule, procs=sync_procs(budget))


@lru_cache(maxsize=4)
def sync_diloco_from_warm(budget: Budget, seed: int, h: int, rule: MergeSettings) -> dict:
    """`sync_diloco` over the budget's second half from data-parallel's (seed 0) half-way model,
    trained once per process: quality_robust and schedule compare against the same run."""
    _, warm = data_parallel(budget, seed=0)
    return sync_diloco(budget.second_half, seed, h, rule, init=warm, procs=sync_procs(budget.second_half))
