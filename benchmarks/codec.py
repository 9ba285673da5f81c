"""What the codecs alone cost in held-out loss: replayed schedules (benchmarks.replay) with the
pipeline's default wire (fp32 deltas, bf16 updates), with the wire part's int4 run's (int4 deltas,
int3 updates), and with int4 deltas and int2 updates, at the wire part's budget and H.

The wire part compares two pipeline runs whose rounds close on whatever has arrived, so their
round counts differ with timing and the loss ratio swings by more than the 0.5% bar; here the
learners, data and schedule are the same, and only the codecs differ. One schedule is not
enough: what int2 updates cost changes with how soon rounds reach the learners, so each pair runs
on three. An ablation beside the suite, like `schedule`:
`python -m benchmarks --only codec`. `run_live` (`--only codec_live`) holds the pipeline's own
schedules fixed instead: the wire part's two runs, each replayed on its own (benchmarks.retrace).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from benchmarks import heldout, pipeline
from benchmarks.quality import at_budget, hs
from benchmarks.replay import Schedule, pipeline_defaults, replay
from benchmarks.report import Result, at_most, standalone
from benchmarks.retrace import retrace, trace
from benchmarks.wire import INT4_LOSS_BAR, INT4_UPDATES, loss_pair, wire_budget
from islands.core.config import RunConfig

REFERENCE = (RunConfig().codec, RunConfig().update_codec)  # the pipeline's defaults
INT4_CODECS = ("int4", INT4_UPDATES)  # the wire part's int4 run
VARIANTS = {  # (delta codec, update codec): what each is there to show
    INT4_CODECS: "the wire part's int4 run",
    ("int4", "int2"): "int2 updates, at 2.125 bits a value",
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
    rule = RunConfig().merge
    cases = schedules(h)
    timing = {
        what: {k: v for k, v in s.__dict__.items() if k not in ("codec", "update_codec")}  # codecs: raw
        for what, s in cases.items()
    }
    res = Result("codec", settings={"budget": b.__dict__, "H": h, "schedules": timing, "rule": rule.__dict__})
    for what, schedule in cases.items():
        losses = {}
        for codecs in (REFERENCE, *VARIANTS):
            theta, facts = replay(b, replace(schedule, codec=codecs[0], update_codec=codecs[1]), rule)
            losses[codecs] = heldout.loss(theta)
            res.raw["%s: %s deltas, %s updates" % (what, *codecs)] = {"loss": losses[codecs], **facts}
        for codecs, shows in VARIANTS.items():
            res.rows.append(
                at_most(
                    f"codec replay, H={h}, {what}: {codecs[0]} deltas, {codecs[1]} updates / "
                    f"{REFERENCE[0]} deltas, {REFERENCE[1]} updates ({shows})",
                    losses[codecs] / losses[REFERENCE],
                    INT4_LOSS_BAR,
                    "what the update codec drops each round: the learners train from each round as "
                    "published, off by that until error feedback sends it a round later",
                )
            )
    return res


def run_live(quick: bool) -> Result:
    """The wire part's two H=10 pipeline runs, each run's own schedule (benchmarks.retrace)
    replayed with both wires: what the codecs cost on schedules the pipeline really ran, and how
    far the two runs' schedules alone move the loss. One thread, as each of the pipeline's
    learners has, so a run's own codecs rebuild its published model bit for bit (checked).
    `python -m benchmarks --only codec_live`."""
    torch.set_num_threads(1)
    b = wire_budget(quick)
    runs = dict(zip((REFERENCE, INT4_CODECS), loss_pair(quick)))
    res = Result("codec_live", settings={"budget": b.__dict__, "runs": {"%s+%s" % k: s.name for k, s in runs.items()}})
    losses, live = {}, {}
    for schedule_of, spec in runs.items():
        live[schedule_of], facts = at_budget(spec, b.tokens)
        run = pipeline.run(spec)
        t = trace(run, facts["round"])
        thetas = {codecs: retrace(t, b, *codecs) for codecs in runs}
        published = run.model(facts["round"])
        rebuilt = all(torch.equal(thetas[schedule_of][n], published[n]) for n in published)
        losses.update({(schedule_of, codecs): heldout.loss(theta) for codecs, theta in thetas.items()})
        res.raw["%s deltas, %s updates: the run" % schedule_of] = {"live_loss": live[schedule_of], **facts}
        res.raw["%s deltas, %s updates: its schedule replayed" % schedule_of] = {
            "rebuilds the published model bit for bit": rebuilt,
            **{"%s deltas, %s updates" % codecs: losses[schedule_of, codecs] for codecs in runs},
        }
    for schedule_of in runs:
        res.rows.append(
            at_most(
                "codec on a live schedule, H=%d, the %s run's: %s deltas, %s updates / %s deltas, %s updates"
                % (hs(quick)[0], schedule_of[0], *INT4_CODECS, *REFERENCE),
                losses[schedule_of, INT4_CODECS] / losses[schedule_of, REFERENCE],
                INT4_LOSS_BAR,
                "what the codecs drop, on the schedule this run's timing gave it",
            )
        )
    res.raw["schedules alone, fp32 wire: the int4 run's / the fp32 run's"] = (
        losses[INT4_CODECS, REFERENCE] / losses[REFERENCE, REFERENCE]
    )
    res.raw["live, as the wire part measures it: the int4 run / the fp32 run"] = live[INT4_CODECS] / live[REFERENCE]
    return res


if __name__ == "__main__":
    standalone(run)
