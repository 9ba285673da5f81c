"""`python -m benchmarks [--quick] [--only NAME ...]`: the measured-performance suite, one table.

The suite is the measurements (SUITE); the ablations run only when named: `schedule` (why the
pipeline's learner behaviours close the gap to synchronous DiLoCo, `--only schedule`), `codec`
(what the int4 codecs alone cost in held-out loss, on three replayed schedules, `--only codec`),
`codec_live` (the same on the wire part's two pipeline runs' own schedules, each rebuilt from its
objects, `--only codec_live`),
`scaling` (whether the loss follows the learners' compute, the faults bar's premise, `--only scaling`),
`learner_start` (a learner process from a fresh interpreter against a fork, `--only learner_start`),
`prefect_start` (the Prefect server on a fresh database against the migrated template,
`--only prefect_start`), `eval_cadence` (the pipeline evaluating every round against the last
alone, `--only eval_cadence`) and `s3_endpoint` (the embedded S3 endpoint's CPU per request,
moto's own server against its S3 app served directly, `--only s3_endpoint`), `hf` (a Llama-config
model at the quality and utilization bars, `--only hf`) and `gpu` (a GPU learner's tokens/s and
MFU, and the merge of 1B-parameter deltas, `--only gpu`; benchmarks.gpu). The suite's
`learner_memory` is a learner's peak memory over its model's bytes at 10M, 100M and 180M
parameters (--quick: 2M), each in a process of its own; `large_run` is a real two-learner run of
the 180M model, judged on its processes' peak memory and `islands audit --replay`; `merge_memory`
is the synchronizer's merge at 100M and 1B parameters (--quick: 20M and 80M); `simulation`
is `islands simulate` on the paper's configs beside its figures, and on a recorded run beside
what it recorded (seconds: nothing is trained).
Each benchmark also runs alone: `python -m benchmarks.<name> [--quick]`. A benchmark that
fails outright gets a row saying so, and the suite goes on with the others (exit status 1).
Each part's report is written to `--out` (default `.islands/bench/`) the moment it finishes, so
a suite stopped half-way keeps what it measured; the combined table prints at the end, with each
part's time against its budget and the whole suite's time, which is reported, not judged: it
follows the machine's speed. The same table, every raw figure and setting, stamped with the
commit, the date, the machine and the wall time, then go to `--results`
(benchmarks/results/latest.md and latest.json; benchmarks.record says how a part run alone
replaces its own section and keeps the others'). Each full-size part runs on a new embedded stack
unless it reads the runs of the part before it (`keeps_stack`).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from benchmarks import (
    codec,
    dataplane,
    eval_cadence,
    faults,
    gpu,
    hf,
    large_run,
    learner_memory,
    learner_start,
    pipeline,
    prefect_start,
    quality,
    record,
    s3_endpoint,
    scaling,
    schedule,
    simulation,
    utilization,
    wire,
)
from benchmarks.report import Result, Row, at_most, figure, print_report, report, timed

BENCHMARKS = {
    "quality": quality.run,
    "quality_robust": quality.run_robust,
    "schedule": schedule.run,
    "codec": codec.run,
    "codec_live": codec.run_live,
    "scaling": scaling.run,
    "learner_start": learner_start.run,
    "prefect_start": prefect_start.run,
    "eval_cadence": eval_cadence.run,
    "s3_endpoint": s3_endpoint.run,
    "wire": wire.run,
    "faults": faults.run,
    "utilization": utilization.run,
    "dataplane": dataplane.run,
    "merge_memory": dataplane.run_memory,
    "learner_memory": learner_memory.run,
    "large_run": large_run.run,
    "simulation": simulation.run,
    "hf": hf.run,
    "gpu": gpu.run,
}
SUITE = (
    "quality",
    "wire",
    "quality_robust",
    "faults",
    "utilization",
    "dataplane",
    "merge_memory",
    "learner_memory",
    "large_run",
    "simulation",
)
# Parts that run no stack of their own: they need no new one.
NO_STACK = {"merge_memory", "learner_memory", "simulation"}
ORDER = [*SUITE, *(name for name in BENCHMARKS if name not in SUITE)]  # of the results file's sections
PART_MINUTES, QUICK_MINUTES = 25, 3


def keeps_stack(previous: str | None, name: str, quick: bool) -> bool:
    """Whether part `name` runs on the stack part `previous` used, with its runs. At --quick's toy
    sizes every part does: the stack stays small, a new one costs seconds of the 3 minutes, and
    wire's fp32 run is quality's. At full size, only a part that reads a run of the part before:
    utilization reads the faults part's run (a), and a part that runs no stack (NO_STACK) leaves
    it be. Every other part starts on a new stack (`pipeline.new_stack`)."""
    return quick or (previous, name) == ("faults", "utilization") or name in NO_STACK


def part_time(res: Result, quick: bool) -> Row | None:
    """A full-size part's bar: under 25 minutes (--quick judges the whole run instead)."""
    if quick:
        return None
    return at_most(
        f"time: {res.name}, minutes",
        res.seconds / 60,
        PART_MINUTES,
        "learner compute at this budget on 2 cores plus per-round overhead",
    )


def run_time(total_s: float, quick: bool, whole_suite: bool) -> Row | None:
    """--quick's bar, under 3 minutes however many parts ran; the whole suite's time, a figure
    without a bar (it follows the machine's speed); none for a few full-size parts."""
    if quick:
        return at_most("time: --quick suite, minutes", total_s / 60, QUICK_MINUTES, "see the parts' seconds")
    if whole_suite:
        return figure("time: whole suite, minutes", total_s / 60, "follows the machine's speed")
    return None


def whole_suite(results: list[Result]) -> bool:
    return sorted(r.name for r in results) == sorted(SUITE)


def time_budget(results: list[Result], total_s: float, quick: bool) -> Result:
    """The suite's own rows: the run's time, then each part's."""
    rows = [run_time(total_s, quick, whole_suite(results)), *(part_time(r, quick) for r in results)]
    raw = {r.name: round(r.seconds) for r in results} | {"suite": round(total_s)}
    return Result("time", rows=[r for r in rows if r], raw=raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="toy sizes: a smoke test of every path in a few minutes")
    p.add_argument(
        "--only",
        action="append",
        choices=sorted(BENCHMARKS),
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}; "
        f"without it, the suite: {', '.join(SUITE)}",
    )
    p.add_argument(
        "--out", type=Path, default=Path(".islands/bench"), help="where each part's report is written as it finishes"
    )
    p.add_argument(
        "--results",
        type=Path,
        default=record.RESULTS,
        help="where latest.md and latest.json are kept: this run replaces its parts' sections, keeps the others",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    try:
        record.read(args.results)  # before the run, not after it: a file it cannot update stops nothing measured
    except record.ResultsFileError as exc:
        p.exit(2, f"python -m benchmarks: error: {exc}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SUITE)
    run = record.stamp(argv, args.quick, names)
    results, failed, t0, previous = [], False, time.monotonic(), None
    for name in names:
        if not keeps_stack(previous, name, args.quick):
            pipeline.new_stack()
        previous = name
        started = time.monotonic()
        try:
            res = timed(BENCHMARKS[name], args.quick)
        except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
            failed = True
            traceback.print_exc()
            res = Result(
                name, rows=[Row(f"{name}: did not complete", None, "runs", False, f"{type(exc).__name__}: {exc}")]
            )
            res.seconds = time.monotonic() - started  # what it spent before failing counts in the suite's time
        results.append(res)
        (args.out / f"{name}{'-quick' if args.quick else ''}.md").write_text(report([res], args.quick))
        print(f"[benchmarks] {name} finished in {res.seconds:.0f} s; report in {args.out}", file=sys.stderr, flush=True)
    total_s = time.monotonic() - t0
    print_report([*results, time_budget(results, total_s, args.quick)], args.quick)
    run = record.finish(run, total_s, run_time(total_s, args.quick, whole_suite(results)))
    run["parts"] = [record.part(r, part_time(r, args.quick)) for r in results]
    record.write(args.results, run, ORDER)
    print(
        f"[benchmarks] {total_s / 60:.1f} minutes in all; results in {args.results / 'latest.md'} and latest.json",
        file=sys.stderr,
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
