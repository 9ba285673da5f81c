"""How many inner steps a phase takes: H for the fastest learners, fewer for a slower one.

A learner at a third of the others' rate that also trains H steps sends one delta for every
three of theirs, a third of a phase behind on average, so rounds close on partial quorums and
its deltas arrive stale under the outer momentum. Scaling its phase to H × its rate / the fastest
rate (dynamic local updates, Async Local-SGD's DyLU, arXiv 2401.09135) makes every phase take about as long, so its deltas come as often
as everyone else's and fresh, as in synchronous DiLoCo, while nobody waits. Token weighting
already gives its shorter phases their smaller share.

Rates are tokens per second of a whole phase (the manifests' contributions: tokens / seconds),
so they hold whatever slows a learner: a slower accelerator, a rate cap or a busy machine.
Those seconds are each learner's own claim, so a claim far above the others' is not believed:
otherwise one learner reporting a thousandfold rate would cut every other phase to one step.
Pure arithmetic: the learner, the schedule replay and the tests share it.
"""

from __future__ import annotations

import statistics

TOLERANCE = 0.25  # rates within a quarter of the fastest count as equal: timing noise does not cut H
CREDIBLE = 4.0  # a reported rate above 4× the median reported is not believed (needs 3 or more)


def phase_steps(h: int, own_rate: float | None, rates: list[float]) -> int:
    """Inner steps for a learner training at `own_rate` when the run's learners train at `rates`
    (positive; its own among them or not); H while its own rate is unknown."""
    if h < 1:
        raise ValueError(f"H must be at least 1, got {h}")
    if own_rate is None or own_rate <= 0:
        return h
    fastest = max([own_rate, *credible(rates)])
    return h if own_rate >= (1 - TOLERANCE) * fastest else max(1, round(h * own_rate / fastest))


def credible(rates: list[float]) -> list[float]:
    """The reported rates at most CREDIBLE × their median: the median is an honest rate whenever
    honest learners are the majority."""
    if len(rates) < 3:
        return rates
    ceiling = CREDIBLE * statistics.median(rates)
    return [r for r in rates if r <= ceiling]
