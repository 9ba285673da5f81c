"""`islands`: the command line. Parses flags and hands them to the command (islands.flows.commands),
which validates the config before anything is written, brings up (or reuses) the embedded stack
(islands.flows.bring_up) and runs the flows.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from islands.flows import commands
from islands.flows.run_flags import add_run_flags
from islands.infra.memory import return_freed_memory


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="islands", description="Decoupled DiLoCo across regions through object storage.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train (no config: the embedded demo)")
    run.add_argument("--config", type=Path, help="TOML file with any of the settings below; flags override it")
    add_run_flags(run)
    run.add_argument("--json", action="store_true", help="end with one JSON object")
    run.add_argument(
        "--chaos",
        action="append",
        metavar="SPEC",
        help="inject a fault (repeatable or comma-separated): kill:REGION@roundN, restart:REGION@roundN, "
        "stall:s3@40s+20s, crash:synchronizer@POINT[@roundN]",
    )

    prep = sub.add_parser("prepare", help="tokenize text into token shards and their dataset.json, on all cores")
    prep.add_argument("src", help="text: a file, folder or glob of .txt, .jsonl or .parquet (fsspec URL), or stdlib")
    prep.add_argument("dst", help="folder for the shards, any fsspec URL, e.g. s3://bucket/data/corpus")
    prep.add_argument("--tokenizer", help="tokenizer.json or Hugging Face tokenizer folder (default: bytes)")
    prep.add_argument("--shard-mb", type=float, default=64.0, help="text per shard, in MB (default 64)")
    prep.add_argument("--workers", type=int, help="processes (default: every core)")
    prep.add_argument(
        "--store",
        metavar="TEMPLATE",
        help="the runs' bucket URL template, whose buckets DST must stay out of (default: the embedded S3's)",
    )
    prep.add_argument("--force", action="store_true", help="replace files in DST that islands prepare did not write")

    up = sub.add_parser("up", help="start the local S3 endpoint, Prefect server + UI and learner runner")
    up.add_argument("--regions", help="regional buckets to create (default: the demo's)")

    res = sub.add_parser("resume", help="continue a run from its last published round")
    res.add_argument("run_id")
    res.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    res.add_argument("--json", action="store_true")

    pl = sub.add_parser("plan", help="WAN bandwidth each scheme needs: data-parallel vs DiLoCo vs decoupled")
    pl.add_argument("--params", type=float, default=10e9, help="model parameters, e.g. 1e9")
    pl.add_argument("--step-time", type=float, default=1.0, help="seconds of compute per inner step")
    pl.add_argument("--inner-steps", type=int, default=100, help="H, inner steps per phase")
    pl.add_argument("--replicas", type=int, default=4, help="regions (workers) that exchange updates")
    pl.add_argument("--bits", type=int, default=4, help="bits per value of the decoupled delta (codec)")
    pl.add_argument(
        "--checkpoint-bits", type=int, default=32, help="bits per value of the checkpoint learners download"
    )
    pl.add_argument(
        "--overlap", type=int, help="τ: steps of compute a transfer (a fragment's) hides behind (default: H/F)"
    )
    pl.add_argument(
        "--fragments", type=int, default=1, help="F: send the model in F fragments, one every H/F steps (streamed)"
    )
    pl.add_argument("--utilization", type=float, default=0.95, help="target compute utilization, e.g. 0.95")
    pl.add_argument("--link-gbps", type=float, default=2.0, help="link for the checkpoint transfer time")
    pl.add_argument("--check", action="store_true", help="compare with published figures instead")

    sim = sub.add_parser(
        "simulate", help="simulate a run at any scale: goodput and bandwidth against sync DiLoCo and data-parallel"
    )
    what = sim.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", type=Path, help="the simulation's TOML (benchmarks/simulate/)")
    what.add_argument(
        "--calibrate", metavar="RUN", help="simulate a recorded run from its own timings and compare with it"
    )
    sim.add_argument("--store", help="with --calibrate: bucket URL template the run lives in (default: embedded S3)")
    sim.add_argument("--seed", type=int, help="seed of the failures drawn (default: the config's)")
    sim.add_argument("--hours", type=float, help="wall time simulated (default: the config's run.hours)")
    sim.add_argument("--json", action="store_true", help="end with the figures as one JSON object")

    srv = sub.add_parser("serve", help="register the deployments so runs can be started or scheduled from the UI")
    srv.add_argument("--config", type=Path, help="TOML file whose fields become the run form's defaults")
    when = srv.add_mutually_exclusive_group()
    when.add_argument("--interval", type=float, metavar="SECONDS", help="start a training run every SECONDS")
    when.add_argument("--cron", metavar="EXPR", help="start a training run on this cron schedule, e.g. '0 3 * * *'")

    st = sub.add_parser("status", help="rounds, contributors, learners alive/late/dead, latest eval loss")
    st.add_argument("run_id")
    st.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    st.add_argument("--json", action="store_true", help="one JSON object (with --watch: one per line)")
    st.add_argument(
        "--watch",
        type=float,
        metavar="SECONDS",
        help="show it again every SECONDS until the run is finished; waits for a run not created yet",
    )

    aud = sub.add_parser(
        "audit", help="verify a run from storage: hash chain, objects, token ledger; its head against Prefect's record"
    )
    aud.add_argument("run_id")
    aud.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    aud.add_argument("--replay", action="store_true", help="also recompute every merge and compare the bits")
    aud.add_argument("--json", action="store_true", help="print the report as one JSON object")
    exp = sub.add_parser("export", help="write a round as files transformers (or safetensors) loads")
    exp.add_argument("run_id")
    exp.add_argument("out", metavar="OUT", help="folder or fsspec URL (e.g. s3://bucket/models/run-1) to write to")
    exp.add_argument("--round", type=int, help="the round to export (default: the newest)")
    exp.add_argument("--store", help="bucket URL template the run lives in (default: embedded S3)")
    exp.add_argument("--force", action="store_true", help="replace files at OUT that hold other bytes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return_freed_memory()  # the synchronizer's merges and evaluations, the audit's replays
    try:
        return getattr(commands, f"cmd_{args.command}")(args)
    except KeyboardInterrupt:
        print("islands: interrupted; every process this command started has been stopped", file=sys.stderr)
        return 130


def entry() -> None:
    """The `islands` command. Its status is `main`'s; what the process made is left out of the
    interpreter's last garbage collections, which walked every object torch and Prefect had made
    (about a second of a core after each run) only for the system to take the memory back."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
