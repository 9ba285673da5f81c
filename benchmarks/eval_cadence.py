"""What the synchronizer's per-round evaluation costs a run: the quality part's pipeline at
H=10 over a sixth of its budget, evaluating every round (`eval_every = 1`, the default) against
the round that ends the run alone (`eval_every = 0`, what the quality, wire and quality_robust
parts run with: they evaluate the round at their budget themselves), side by side, alternating.

The evaluation runs on the synchronizer between rounds; at small H the next round's deltas
wait while it does, and its CPU is taken from the learners on a busy machine. The figure is
wall-clock to the same tokens, every round / last only; the held-out losses at the budget are
reported beside it (they move with the runs' timing either way). The bar is ours: a knob that
saves less than 5% is not worth the rounds it leaves without a loss. An ablation beside the
suite: `--only eval_cadence`.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from benchmarks.inprocess import Budget
from benchmarks.quality import at_budget, budget, decoupled_spec, hs
from benchmarks.report import Result, at_least, standalone


def run(quick: bool) -> Result:
    full, h = budget(quick), hs(quick)[0]
    b = full if quick else Budget(learners=full.learners, steps=full.steps // 6, warmup=full.warmup)
    repeats = 1 if quick else 2
    walls: dict[int, list[float]] = {1: [], 0: []}
    losses: dict[int, list[float]] = {1: [], 0: []}
    for i in range(repeats):
        for every in (1, 0):
            spec = replace(decoupled_spec(quick, h, steps=b.steps), name=f"ev{every}r{i}", eval_every=every)
            loss, facts = at_budget(spec, b.tokens)
            walls[every].append(facts["wall_s"])
            losses[every].append(loss)
    ratio = statistics.median(walls[1]) / statistics.median(walls[0])
    res = Result(
        "eval_cadence",
        settings={"budget": b.__dict__, "H": h, "order": "alternating, every round first"},
        raw={
            "wall_s_every_round": walls[1],
            "wall_s_last_only": walls[0],
            "loss_every_round": losses[1],
            "loss_last_only": losses[0],
        },
    )
    res.rows.append(
        at_least(
            f"eval cadence: wall-clock evaluating every round / the last only, H={h}",
            ratio,
            1.05,
            "the evaluation is a small part of a round at this H on this machine",
        )
    )
    return res


if __name__ == "__main__":
    standalone(run)
