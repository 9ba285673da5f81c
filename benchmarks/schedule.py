"""Why learners carry their unmerged deltas, catch up in the learning-rate schedule and pace their
phases: the pipeline's schedule replayed in virtual time (benchmarks.replay) with each, against
synchronous DiLoCo at the same budget.

The replay runs the pipeline's quorum rule, merge plan and default outer step on its timing (one
learner at a third of the speed, rounds visible a third of a phase after they close), but with
a simulated clock, so the learner behaviours are compared on one schedule, side by side, in
minutes. The bar for the pipeline itself is measured by `quality`; these rows are the replay's.

From quality_robust's warm start (data-parallel for the first half), the pipeline's defaults are
replayed again with rounds reaching the learners a third, two thirds and a whole phase after they
close: how much of the warm-start gap the publish latency alone accounts for.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks import heldout
from benchmarks.inprocess import Budget, data_parallel, sync_diloco_from_seed, sync_diloco_from_warm
from benchmarks.quality import DECOUPLED_BAR, SYNC_RULE, budget, hs
from benchmarks.replay import Schedule, pipeline_defaults, replay
from benchmarks.report import Result, at_most, standalone
from islands.core.config import MergeSettings, RunConfig

# From the warm start: how long after a round closes the learners see it, in phases.
LATE = {"a third of a phase": 1 / 3, "two thirds of a phase": 2 / 3, "a whole phase": 1.0}


def run(quick: bool) -> Result:
    torch.set_num_threads(2)
    b, h = budget(quick), hs(quick)[0]  # the quality part's budget and H
    rule = RunConfig().merge  # the pipeline's default outer step
    res = Result(
        "schedule",
        settings={
            "budget": b.__dict__,
            "H": h,
            "schedule": Schedule(h).__dict__,
            "decoupled_rule": rule.__dict__,
            "sync_rule": SYNC_RULE.__dict__,
        },
    )
    sync = heldout.loss(sync_diloco_from_seed(b, 0, h, SYNC_RULE))
    res.raw["sync"] = sync
    variants = {
        "restart": Schedule(h),
        "carry": Schedule(h, carry=True),
        "carry+catch_up": Schedule(h, carry=True, catch_up=True),
        "carry+catch_up+paced": pipeline_defaults(h),
    }
    for label, schedule in variants.items():
        theta, facts = replay(b, schedule, rule)
        res.raw[label] = {"loss": heldout.loss(theta), **facts}
    res.rows.append(
        at_most(
            f"schedule replay, H={h}: phases restarted from the round / sync DiLoCo",
            res.raw["restart"]["loss"] / sync,
            DECOUPLED_BAR,
            "a phase started before its learner's previous delta is merged retrains from the bare "
            "round the steps the outer step applies anyway; momentum applies that direction twice",
        )
    )
    res.rows.append(
        at_most(
            f"schedule replay, H={h}: carry / sync DiLoCo",
            res.raw["carry"]["loss"] / sync,
            DECOUPLED_BAR,
            "the slow learner is behind in its learning-rate schedule and sends high-rate deltas "
            "while the others anneal",
        )
    )
    res.rows.append(
        at_most(
            f"schedule replay, H={h}: carry and lr catch-up / sync DiLoCo",
            res.raw["carry+catch_up"]["loss"] / sync,
            DECOUPLED_BAR,
            "the slow learner sends one delta for every three of the others', a third of a phase "
            "late on average: rounds close on partial quorums and its deltas arrive stale",
        )
    )
    res.rows.append(
        at_most(
            f"schedule replay, H={h}: carry, lr catch-up and paced phases (the pipeline's defaults) / sync DiLoCo",
            res.raw["carry+catch_up+paced"]["loss"] / sync,
            DECOUPLED_BAR,
            "rounds reach learners a third of a phase after they close, so phases start on the round before",
        )
    )
    warm_start(res, b, h, variants["carry+catch_up+paced"], rule)
    return res


def warm_start(res: Result, b: Budget, h: int, defaults: Schedule, rule: MergeSettings) -> None:
    """The defaults from the warm start, with rounds reaching learners later and later."""
    _, warm = data_parallel(b, seed=0)
    sync = heldout.loss(sync_diloco_from_warm(b, 0, h, SYNC_RULE))
    res.raw["warm_sync"] = sync
    for words, late in LATE.items():
        schedule = replace(defaults, publish_s=late * h * defaults.step_s)
        theta, facts = replay(b.second_half, schedule, rule, init=warm)
        res.raw[f"warm_late_{late:.2f}"] = {"loss": heldout.loss(theta), "publish_s": schedule.publish_s, **facts}
        res.rows.append(
            at_most(
                f"schedule replay, warm start, H={h}: the defaults, rounds {words} late / sync DiLoCo",
                res.raw[f"warm_late_{late:.2f}"]["loss"] / sync,
                DECOUPLED_BAR,
                "the later a round reaches the learners, the more of each phase is trained on weights "
                "the outer step has moved past, and carried onto the round only when it arrives",
            )
        )


if __name__ == "__main__":
    standalone(run)
