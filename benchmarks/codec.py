"""What the codecs alone cost in held-out loss: one schedule replayed (benchmarks.replay) with the
pipeline's default wire (fp32 deltas, bf16 updates), with the wire part's int4 run's (int4 deltas,
int2 updates), and with each of those two codecs alone, at the wire part's budget and H.

The wire part compares two pipeline runs whose rounds close on whatever has arrived, so their
round counts differ with timing and the loss ratio swings by more than the 0.5% bar; here the
learners, data and schedule are the same, and only the codecs differ. An ablation beside the
suite, like `schedule`: `python -m benchmarks --only codec`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks import heldout
from benchmarks.quality import hs
from benchmarks.replay import pipeline_defaults, replay
from benchmarks.report import Result, at_most, standalone
from benchmarks.wire import INT4_LOSS_BAR, INT4_UPDATES, wire_budget
from flows.config import RunConfig
from tasks.merge_step import merge_rule

REFERENCE = (RunConfig().codec, RunConfig().update_codec)  # the pipeline's defaults
VARIANTS = {  # (delta codec, update codec): what each is there to show
    ("int4", "bf16"): "the int4 deltas alone",
    ("fp32", INT4_UPDATES): f"the {INT4_UPDATES} updates alone",
    ("int4", INT4_UPDATES): "both: the wire part's int4 run",
}


def run(quick: bool) -> Result:
    torch.set_num_threads(2)
    b, h = wire_budget(quick), hs(quick)[0]
    rule = merge_rule(RunConfig())
    defaults = pipeline_defaults(h)
    timing = {k: v for k, v in defaults.__dict__.items() if k not in ("codec", "update_codec")}  # each run's codecs: raw
    res = Result("codec", settings={"budget": b.__dict__, "H": h, "schedule": timing, "rule": rule.__dict__})
    losses = {}
    for codecs in (REFERENCE, *VARIANTS):
        theta, facts = replay(b, replace(defaults, codec=codecs[0], update_codec=codecs[1]), rule)
        losses[codecs] = heldout.loss(theta)
        res.raw["%s deltas, %s updates" % codecs] = {"loss": losses[codecs], **facts}
    for codecs, what in VARIANTS.items():
        res.rows.append(at_most(f"codec replay, H={h}: {codecs[0]} deltas, {codecs[1]} updates / {REFERENCE[0]} deltas, "
                                f"{REFERENCE[1]} updates ({what})", losses[codecs] / losses[REFERENCE], INT4_LOSS_BAR,
                                "what the quantizer drops and error feedback has not yet sent when the budget ends, "
                                "and the outer momentum's response to the coarser steps"))
    return res


if __name__ == "__main__":
    standalone(run)
