"""What the codecs alone cost in held-out loss: replayed schedules (benchmarks.replay) with the
pipeline's default wire (fp32 deltas, bf16 updates), with the wire part's int4 run's (int4 deltas,
int3 updates), and with int4 deltas and int2 updates, at the wire part's budget and H.

The wire part compares two pipeline runs whose rounds close on whatever has arrived, so their
round counts differ with timing and the loss ratio swings by more than the 0.5% bar; here the
learners, data and schedule are the same, and only the codecs differ. One schedule is not
enough: int2 updates cost 0.1% on the default one and 0.8% when rounds reach the learners
sooner, so each pair runs on three. An ablation beside the suite, like `schedule`:
`python -m benchmarks --only codec`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks import heldout
from benchmarks.quality import hs
from benchmarks.replay import Schedule, pipeline_defaults, replay
from benchmarks.report import Result, at_most, standalone
from benchmarks.wire import INT4_LOSS_BAR, INT4_UPDATES, wire_budget
from flows.config import RunConfig
from tasks.merge_step import merge_rule

REFERENCE = (RunConfig().codec, RunConfig().update_codec)  # the pipeline's defaults
VARIANTS = {  # (delta codec, update codec): what each is there to show
    ("int4", INT4_UPDATES): "the wire part's int4 run",
    ("int4", "int2"): "int2 updates, at 2.25 bits a value",
}


def schedules(h: int) -> dict[str, Schedule]:
    """The pipeline's defaults, then rounds that reach learners sooner, then another learner slow."""
    defaults = pipeline_defaults(h)
    return {
        "rounds seen 3 s after they close": defaults,
        "rounds seen after 1 s": replace(defaults, publish_s=1.0),
        "learner 0 the slow one": replace(defaults, speeds=(1 / 3, 1.0, 1.0, 1.0)),
    }


def run(quick: bool) -> Result:
    torch.set_num_threads(2)
    b, h = wire_budget(quick), hs(quick)[0]
    rule = merge_rule(RunConfig())
    cases = schedules(h)
    timing = {what: {k: v for k, v in s.__dict__.items() if k not in ("codec", "update_codec")}  # codecs: raw
              for what, s in cases.items()}
    res = Result("codec", settings={"budget": b.__dict__, "H": h, "schedules": timing, "rule": rule.__dict__})
    for what, schedule in cases.items():
        losses = {}
        for codecs in (REFERENCE, *VARIANTS):
            theta, facts = replay(b, replace(schedule, codec=codecs[0], update_codec=codecs[1]), rule)
            losses[codecs] = heldout.loss(theta)
            res.raw["%s: %s deltas, %s updates" % (what, *codecs)] = {"loss": losses[codecs], **facts}
        for codecs, shows in VARIANTS.items():
            res.rows.append(at_most(f"codec replay, H={h}, {what}: {codecs[0]} deltas, {codecs[1]} updates / "
                                    f"{REFERENCE[0]} deltas, {REFERENCE[1]} updates ({shows})",
                                    losses[codecs] / losses[REFERENCE], INT4_LOSS_BAR,
                                    "what the update codec drops each round: the learners train from each round as "
                                    "published, off by that until error feedback sends it a round later"))
    return res


if __name__ == "__main__":
    standalone(run)
