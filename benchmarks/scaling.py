"""Does the loss follow the learners' compute? The faults part reports (b)/(a) beside the compute
ratio; reading the two as equal assumes that a learner's share of compute taken away makes the run
that much slower to a loss. This measures the premise with no faults and no timing in the way.

The same model and data train for the same steps per learner (the same wall clock for learners
at one rate) with 4 learners and with 3, in synchronous DiLoCo (benchmarks.inprocess) and in the
pipeline's schedule replayed with every learner at full speed (benchmarks.replay), at the wire
part's budget per learner and H=10. The rounds the 4 learners take to reach the loss that the 3
end at, against the rounds the 3 took, is the time that a quarter less compute costs; each row's
bar is 4/3 ± 15%, the compute ratio. Then the replay again with 3 of a run's 4 learners alive, the
fourth away throughout as the faults part's killed learner is for a while: the learners' lr
catch-up (islands.core.inner) puts their schedule at the tokens applied over the run's 4 learners, so
with one away it runs behind their steps; and the same two runs without catch-up.

An ablation beside the suite, like `schedule` and `codec`: `python -m benchmarks --only scaling`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from benchmarks import heldout
from benchmarks.inprocess import sync_diloco
from benchmarks.quality import SYNC_RULE, hs
from benchmarks.replay import pipeline_defaults, replay
from benchmarks.report import Result, standalone, within
from benchmarks.wire import wire_budget
from islands.core.config import RunConfig
from islands.core.model import build_model, params_of

FULL, FEWER = 4, 3  # learners: the faults part's (b) has about 3 learners' compute of (a)'s 4


def crossing(losses: list[float], target: float) -> float | None:
    """The round (fractional, linear between evaluated rounds; losses[r] is round r's) at which
    the loss first comes down to `target`; None if it never does."""
    for r in range(1, len(losses)):
        if losses[r] <= target:
            before, after = losses[r - 1], losses[r]
            return r - 1 + (before - target) / (before - after) if before > target else float(r)
    return None


def curve(train: Callable[[Callable[[int, dict], None]], object], start: float) -> list[float]:
    """Held-out loss of round 0 (`start`: every run begins from the seeded model) and of every
    round that `train` publishes."""
    losses = [start]
    train(lambda r, theta: losses.append(heldout.loss(theta)))
    return losses


def run(quick: bool) -> Result:
    torch.set_num_threads(2)
    per_learner, h = wire_budget(quick), hs(quick)[0]
    rule, defaults = RunConfig().merge, pipeline_defaults(h)  # the pipeline's outer step and learners

    def sync(k: int) -> Callable:
        return lambda watch: sync_diloco(replace(per_learner, learners=k), 0, h, SYNC_RULE, on_round=watch)

    def schedule(k: int, **change) -> Callable:
        return lambda watch: replay(
            replace(per_learner, learners=k), replace(defaults, speeds=(1.0,) * k, **change), rule, on_round=watch
        )

    runs = {
        "sync 4": sync(FULL),
        "sync 3": sync(FEWER),
        "replay 4": schedule(FULL),
        "replay 3": schedule(FEWER),
        "replay 3 of 4": schedule(FEWER, away=FULL - FEWER),
        "replay 4, no catch-up": schedule(FULL, catch_up=False),
        "replay 3 of 4, no catch-up": schedule(FEWER, away=FULL - FEWER, catch_up=False),
    }
    arms = {  # row: (the full run, the one with a quarter less compute)
        f"sync DiLoCo, {FEWER} learners / {FULL}": ("sync 4", "sync 3"),
        f"decoupled schedule, {FEWER} learners / {FULL}": ("replay 4", "replay 3"),
        f"decoupled schedule, {FEWER} of {FULL} learners alive / {FULL}": ("replay 4", "replay 3 of 4"),
        "the same without lr catch-up": ("replay 4, no catch-up", "replay 3 of 4, no catch-up"),
    }
    res = Result(
        "scaling",
        settings={
            "steps_per_learner": per_learner.steps,
            "warmup": per_learner.warmup,
            "H": h,
            "sync_rule": SYNC_RULE.__dict__,
            "decoupled_rule": rule.__dict__,
            "schedule": {**defaults.__dict__, "speeds": "1.0 for every learner alive"},
        },
    )
    losses, start = {}, heldout.loss(params_of(build_model(heldout.PRESET, 0)))
    for name, train in runs.items():
        losses[name] = curve(train, start)
        res.raw[name] = [round(x, 4) for x in losses[name]]
    for label, (full, fewer) in arms.items():
        target = losses[fewer][-1]
        reached = crossing(losses[full], target)
        res.raw[f"{label}: round at which {full!r} reaches {fewer!r}'s last loss"] = reached
        res.rows.append(
            within(
                f"scaling, {label}: rounds to one loss (H={h})",
                (len(losses[fewer]) - 1) / reached if reached else None,
                FULL / FEWER,
                0.15,
                f"after the same steps each, {full!r} ends at {losses[full][-1]:.4f} and {fewer!r} at "
                f"{target:.4f}: the loss does not follow the compute here",
            )
        )
    return res


if __name__ == "__main__":
    standalone(run)
