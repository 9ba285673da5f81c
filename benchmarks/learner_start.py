"""How long a learner's process takes to be ready: a fresh interpreter against a fork of the
runner's fork server (flows.serve), four at once as a run's learners start.

Prefect starts a served flow's run in multiprocessing's "spawn" context: a new interpreter that
imports torch, Prefect and the flows before the run's first step. The learner runner swaps in a
fork server that has imported them once. Both are timed here side by side, from
`Process.start()` to a child that has `flows.learner` imported, has opened its stores (fsspec
imports s3fs on first use) and has built a learner's model and optimizer (torch.optim imports
torch._dynamo on first use), with the learner runner's own preload. The bar is ours, not the
issue's: a fork must start at least 10× sooner, or the swap is not worth what it costs to keep.
An ablation beside the suite: `--only learner_start`.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

from benchmarks.report import Result, at_least, standalone

LEARNERS = 4


def ready(queue, t0: float) -> None:
    """The child: import what a learner needs and build its model and optimizer, then say how
    long since the parent started it."""
    import torch

    import islands.flows.learner  # noqa: F401
    from benchmarks.heldout import PRESET
    from islands.core.model import build_model
    from islands.storage.store import Stores

    Stores("s3://islands-{bucket}", ["north"])  # no request yet: fsspec imports the S3 file system
    torch.optim.AdamW(build_model(PRESET, 0).parameters())
    queue.put(time.time() - t0)


def start(context: multiprocessing.context.BaseContext, n: int) -> float:
    """Seconds until the last of `n` children started at once is ready."""
    queue = context.SimpleQueue()
    t0 = time.time()
    children = [context.Process(target=ready, args=(queue, t0)) for _ in range(n)]
    for child in children:
        child.start()
    seconds = max(queue.get() for _ in children)
    for child in children:
        child.join()
    return seconds


def run(quick: bool) -> Result:
    from islands.flows.serve import PRELOAD, ForkServer

    fresh, forks = multiprocessing.get_context("spawn"), ForkServer(PRELOAD).get_context()
    start(forks, 1)  # the server imports its preload once, as the runner's does before the first run
    repeats = 1 if quick else 3
    spawned = [start(fresh, LEARNERS) for _ in range(repeats)]
    forked = [start(forks, LEARNERS) for _ in range(repeats)]
    a, b = statistics.median(spawned), statistics.median(forked)
    res = Result(
        "learner_start",
        settings={"learners_at_once": LEARNERS, "repeats": repeats, "preload": PRELOAD},
        raw={"fresh_interpreter_s": spawned, "fork_server_s": forked},
    )
    res.rows.append(
        at_least(
            f"learner start: fresh interpreter / fork server, {LEARNERS} at once",
            a / b,
            10,
            "the fork server imports less than a learner needs before its first step, so each fork imports the rest",
        )
    )
    return res


if __name__ == "__main__":
    standalone(run)
