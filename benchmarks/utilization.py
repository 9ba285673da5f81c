"""Learner utilization: tokens/s of the learners inside the pipeline against the same inner loop
run bare (benchmarks.bare: no Prefect, no S3), with the same processes, threads and rate cap (the
same floor on a step's time), in the same benchmark run. A learner's pipeline time runs from its
first phase's start to its last delta written, so waiting, downloads and uploads all count
against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

from benchmarks import pipeline
from benchmarks.faults import CAP, full_speed_step_s, specs, step_floor_s
from benchmarks.heldout import PRESET
from benchmarks.report import Result, at_least, standalone


def pipeline_rate(run: pipeline.Run) -> tuple[float, dict, dict]:
    """(tokens/s of all learners, each learner's, where each learner's time went)."""
    by: dict[str, list[pipeline.Delta]] = defaultdict(list)
    for d in run.deltas:
        by[d.learner].append(d)
    rates, spent = {}, {}
    for learner, ds in by.items():
        start = min(d.finished_at - d.seconds for d in ds)
        end = max(d.finished_at for d in ds)
        tokens, training = sum(d.tokens for d in ds), sum(d.seconds for d in ds)
        rates[learner] = tokens / (end - start)
        # Inside phases (steps, their floor and rebases) against between them (the Prefect task
        # run, encoding, the next round's choice).
        spent[learner] = {
            "phases": len(ds),
            "in_phases_s": training,
            "between_phases_s": end - start - training,
            "in_phase_tokens_per_s": tokens / training,
        }
    return sum(rates.values()), rates, spent


def bare_rate(learners: int, steps: int, h: int, min_step_s: float, model: str = PRESET) -> tuple[float, list[dict]]:
    """(tokens/s of all, each one's figures) of `learners` bare inner loops side by side, forks of
    one new interpreter (benchmarks.bare)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bare",
            "--learners",
            str(learners),
            "--steps",
            str(steps),
            "--inner-steps",
            str(h),
            "--min-step-s",
            str(min_step_s),
            "--model",
            model,
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"benchmarks.bare failed ({out.returncode}):\n{out.stderr[-3000:]}")
    outs = json.loads(out.stdout.strip().splitlines()[-1])
    return sum(o["tokens"] / o["seconds"] for o in outs), outs


def against_bare(spec: pipeline.Spec, min_step_s: float) -> tuple[float, dict]:
    """(pipeline tokens/s / bare tokens/s, the raw figures) of the pipeline run of `spec` and as
    many bare loops of its model with the same steps and floor on a step's time."""
    pipe = pipeline.run(spec)
    ours, per_learner, spent = pipeline_rate(pipe)
    steps = max(
        1, sum(d.tokens for d in pipe.deltas) // len(per_learner) // (pipe.deltas[0].tokens // spec.inner_steps)
    )
    bare, outs = bare_rate(len(per_learner), steps, spec.inner_steps, min_step_s, spec.model)
    return ours / bare, {
        "bare_steps": steps,
        "pipeline_tokens_per_s": ours,
        "per_learner": per_learner,
        "time_per_learner": spent,
        "bare_tokens_per_s": bare,
        "bare": outs,
    }


UTILIZATION_BAR = 0.95
UTILIZATION_LIMIT = (
    "per-phase costs left on the learner's path: the Prefect task run, encoding the delta "
    "and state, and the CPU the synchronizer, the Prefect server and moto take from the "
    "learners on the same two cores"
)


def run(quick: bool) -> Result:
    spec = specs(quick)[0]  # no faults, every learner capped alike
    ratio, raw = against_bare(spec, step_floor_s())
    res = Result(
        "utilization",
        settings={
            "spec": spec.config(),
            "threads": 1,
            "speed_cap": CAP,
            "bare_steps": raw["bare_steps"],
            "full_speed_step_s": full_speed_step_s(),
            "min_step_s": step_floor_s(),
        },
        raw=raw,
    )
    res.rows.append(
        at_least("utilization: learner tokens/s in the pipeline / bare", ratio, UTILIZATION_BAR, UTILIZATION_LIMIT)
    )
    return res


if __name__ == "__main__":
    standalone(run)
