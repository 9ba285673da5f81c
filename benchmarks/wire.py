"""Bytes on the wire per trained token: the pipeline's S3 traffic against ring all-reduce.

What crosses between regions, per learner: the deltas it uploads (object sizes in its regional
bucket, which the synchronizer reads) and what it downloads from the global bucket (its own
IOCounters, recorded in each delta's metadata as `io_read_global`: manifests, updates, and its
region's one copy of a checkpoint). Reads of the regional cache and learner state stay in the
learner's own region and are reported apart. Ring all-reduce for the same tokens: each of
K workers sends 2(K−1)/K × the fp32 gradient bytes per step and receives as many.
"""

from __future__ import annotations

from dataclasses import replace

from benchmarks import heldout, pipeline
from benchmarks.inprocess import Budget
from benchmarks.quality import at_budget, budget, decoupled_spec, hs
from benchmarks.report import Result, at_least, at_most, standalone
from islands.core.codecs import IntegerCodec, bits_of
from islands.core.model import build_model
from islands.core.plan import ring_bytes

INT4_LOSS_BAR = 1.005
INT4_UPDATES: IntegerCodec = "int3"
INT4_TAG = f"i4u{bits_of(INT4_UPDATES)}"  # in the runs' names


def traffic(run: pipeline.Run) -> dict:
    """Cross-region bytes of every learner, from each one's newest delta and the object sizes."""
    newest: dict[str, pipeline.Delta] = {}
    sent = tokens = 0
    for d in run.deltas:
        sent += d.bytes
        tokens += d.tokens
        if d.learner not in newest or d.finished_at > newest[d.learner].finished_at:
            newest[d.learner] = d
    # Counters in a delta cover what its learner did before writing it: add that last delta once.
    received = sum(int(d.metadata["io_read_global"]) for d in newest.values())  # bytes from the global bucket
    read_in_region = sum(d.io_read for d in newest.values()) - received
    written = sum(d.io_written + d.bytes for d in newest.values())
    model_bytes = run.chain[-1].model.bytes
    phases = len(run.deltas)
    return {
        "tokens": tokens,
        "sent": sent,
        "received": received,
        "phases": phases,
        "read_in_region": read_in_region,
        "state_and_cache_in_region": written - sent,
        "checkpoint_bytes": model_bytes,
        "received_per_phase_in_checkpoints": received / phases / model_bytes,
        "synchronizer": run.summary.get("bytes", {}).get("synchronizer"),
    }


def ring_per_token(learners: int) -> float:
    model = build_model(heldout.PRESET, 0)
    grad = 4 * model.num_params()
    tokens_per_step = heldout.BATCH * model.config.block_size
    return 2 * ring_bytes(grad, learners) / tokens_per_step


def ratio(run: pipeline.Run, learners: int) -> tuple[float, float, dict]:
    t = traffic(run)
    ring = ring_per_token(learners)
    ours = (t["sent"] + t["received"]) / t["tokens"]
    return ring / ours, ring / (t["sent"] / t["tokens"]), {**t, "ring_per_token": ring, "ours_per_token": ours}


def limit(upload_only: float, facts: dict) -> str:
    return (
        f"learners download {facts['received_per_phase_in_checkpoints']:.2f} checkpoints per phase across "
        f"regions: every round's update (a round comes about once a phase, and an update is as large as a "
        f"delta in the same codec), the whole checkpoint when the updates since the round held would be "
        f"larger, or on a region's first read; counting uploads alone the ratio would be {upload_only:.0f}×"
    )


def wire_budget(quick: bool) -> Budget:
    """Bytes per token need no full budget: every run here trains a third of it, and the int4/fp32
    loss ratio is taken at that third (equal tokens for both). --quick trains the quality part's
    whole toy budget instead, so its fp32 run is the quality part's run: one pipeline run fewer."""
    full = budget(quick)
    return full if quick else Budget(learners=full.learners, steps=full.steps // 3, warmup=full.warmup)


def loss_pair(quick: bool) -> tuple[pipeline.Spec, pipeline.Spec]:
    """The H=10 runs whose held-out losses are compared: fp32 deltas (with the default update
    codec), and "with the int4 codec": int4 deltas up, the updates down in int3, with error
    feedback on the synchronizer's side. int3 is the narrowest update codec that keeps
    the held-out loss on the replayed schedules (`--only codec`)."""
    fp32 = decoupled_spec(quick, hs(quick)[0], steps=wire_budget(quick).steps)
    return fp32, replace(fp32, name=fp32.name + INT4_TAG, codec="int4", update_codec=INT4_UPDATES)


def run(quick: bool) -> Result:
    b = wire_budget(quick)
    h10, h50 = hs(quick)[0], hs(quick)[-1]
    res = Result(
        "wire",
        settings={
            "budget": b.__dict__,
            "model": heldout.PRESET,
            "ring": "2(K-1)/K x fp32 gradient, sent and as many received, per worker per step",
        },
    )
    fp32, int4 = loss_pair(quick)
    runs = [("fp32", fp32, 15), ("int4", int4, 100)]
    if h50 != h10:  # --quick has one H
        long = decoupled_spec(quick, h50, steps=b.steps)
        runs.append(("int4", replace(long, name=f"w{h50}{INT4_TAG}", codec="int4", update_codec=INT4_UPDATES), 500))
    for label, spec, bar in runs:
        r, upload_only, facts = ratio(pipeline.run(spec), b.learners)
        res.raw[f"{label}_h{spec.inner_steps}"] = {**facts, "run": pipeline.run(spec).run_id}
        res.rows.append(
            at_least(
                f"wire: ring all-reduce / ours per token, H={spec.inner_steps}, {label} deltas, "
                f"{spec.update_codec} updates",
                r,
                bar,
                limit(upload_only, facts),
            )
        )
    loss32, f32 = at_budget(fp32, b.tokens)
    loss4, f4 = at_budget(int4, b.tokens)
    res.raw["loss_fp32_h%d" % h10], res.raw["loss_int4_h%d" % h10] = {"loss": loss32, **f32}, {"loss": loss4, **f4}
    res.rows.insert(
        2,
        at_most(
            f"wire: held-out loss int4 / fp32, H={h10}",
            loss4 / loss32,
            INT4_LOSS_BAR,
            f"int4 deltas, {INT4_UPDATES} updates, with error feedback on both sides; the budget was "
            f"reached at round {f4['round']} with int4 ({f4['applied_tokens']:,} tokens merged) and "
            f"{f32['round']} with fp32 ({f32['applied_tokens']:,}): two runs whose rounds and merged "
            "tokens move with their timing; replayed on each run's own schedule (`python -m benchmarks "
            "--only codec_live`), the codecs alone cost a fraction of the bar, and the rest is the "
            "two schedules: which deltas each round merged, and when the learners moved onto it",
        ),
    )
    return res


if __name__ == "__main__":
    standalone(run)
