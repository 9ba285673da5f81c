"""A learner's peak memory against its model's size: `python -m benchmarks.learner_memory [--quick]`.

Each size runs in a process of its own on a `file://` store: a Llama config of that many
parameters (the byte vocabulary, so the corpus costs nothing), round 0 published by a process
before it (--quick: by this one, its 2M model being a smoke test), then a learner that opens,
restores nothing, trains PHASES phases of H=2 steps on round 0 with carry and error feedback, and
writes each delta and state through its write-behind uploads. The figure is the growth of the
learner process's peak resident memory (VmHWM) over what it held after importing torch and the
rest (the interpreter's own ~0.35 GiB is not the model's), over its model's float32 bytes,
against the bar of 8× the model + 1 GiB (fp32 AdamW on the CPU; see docs/operations.md, "What a
learner needs").

`python -m benchmarks.learner_memory --publish HIDDEN LAYERS FOLDER` writes the model's config
and the run; `--child FOLDER` is one learner's measurement (JSON on its last line);
`measure(hidden, layers, folder)` runs both in subprocesses and returns that JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.llama import llama_config
from benchmarks.report import Result, Row, at_most, figure

SIZES = {"10M": (384, 6), "100M": (768, 14), "180M": (1024, 14)}  # hidden size, layers
QUICK_SIZES = {"2M": (256, 2)}  # a smoke test: the interpreter's own memory dwarfs it
PHASES = 3
RATIO_BAR, ALLOWANCE = 8.0, 1 << 30
RUN = "learner-memory"


def llama(folder: Path, hidden: int, layers: int, context: int = 32) -> Path:
    """A Llama config.json of `layers` blocks `hidden` wide over the 256 byte tokens."""
    llama_config(hidden, layers, context).save_pretrained(folder)
    return folder


def config_for(folder: Path):
    from islands.core.config import RunConfig

    corpus = folder / "corpus.txt"
    if not corpus.exists():
        corpus.write_bytes(bytes(range(32, 127)) * 2000)
    return RunConfig(
        run_id=RUN,
        model=str(folder / "model"),
        corpus=str(corpus),
        regions=["north", "south"],
        learners_per_region=1,
        rounds=2,
        inner_steps=2,
        inner={"batch_size": 1, "warmup_steps": 1, "total_steps": 100},
        speed={},
        eval_batches=1,
        eval_every=0,
        paced=False,
        lr_catch_up=False,
        torch_threads=1,
    )


def publish(folder: Path, hidden: int, layers: int) -> None:
    """Write the model's config and the run with round 0 (in this process, not the learner's)."""
    from islands.flows.training_run import create_run
    from islands.storage.store import Stores

    llama(folder / "model", hidden, layers)
    config = config_for(folder)
    create_run(config, Stores(f"file://{folder}/store/{{bucket}}", config.regions))


def learner(folder: Path) -> dict:
    """Open the learner, train PHASES phases with their uploads, and report the peak memory."""
    import logging

    import torch

    from islands.infra.memory import return_freed_memory
    from islands.storage.store import Stores
    from islands.tasks import train_phase as module
    from islands.tasks.train_phase import LearnerSession, train_phase

    module.get_run_logger = lambda: logging.getLogger("learner-memory")
    return_freed_memory()  # as the learner flow does at its start
    config = config_for(folder)
    stores = Stores(f"file://{folder}/store/{{bucket}}", config.regions)
    base = rss()
    session = LearnerSession.open(config, RUN, "north-0", stores)
    params = sum(p.numel() for p in session.trainer.model.parameters())
    session.follow(poll_s=0.05)
    try:
        for _ in range(PHASES):
            train_phase.fn(session, session.next_phase)
        session.uploads.flush()
    finally:
        session.rounds.close()
        session.uploads.close()
    return {
        "phases": session.next_phase,
        "params": params,
        "model_bytes": params * 4,
        "base_rss": base,
        "peak_rss": hwm(),
        "threads": torch.get_num_threads(),
    }


def status(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":")) * 1024


def rss() -> int:
    return status("VmRSS")


def hwm() -> int:
    return status("VmHWM")


def measure(
    hidden: int, layers: int, folder: Path, restarts: int = 0, timeout_s: float = 1800, publish_here: bool = False
) -> dict:
    """One size: round 0 published by one process (this one with `publish_here`: a small model,
    a process start saved), the learner measured in another; with `restarts`, that many more
    learner processes after it, each restoring the state the one before saved (the figures are
    the last one's, `first` the first one's)."""
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"}
    outs = []
    if publish_here:
        publish(folder, hidden, layers)
    first = [] if publish_here else [["--publish", str(hidden), str(layers)]]
    for args in (*first, *[["--child"]] * (1 + restarts)):
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.learner_memory", *args, str(folder)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"learner_memory {args[0]} failed: {proc.stderr[-3000:]}")
        if args[0] == "--child":
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            out["growth"] = out["peak_rss"] - out["base_rss"]
            out["ratio"] = out["growth"] / out["model_bytes"]
            outs.append(out)
    return {**outs[-1], "first": outs[0]} if restarts else outs[0]


def run(quick: bool = False) -> Result:
    rows: list[Row] = []
    raw = {}
    for name, (hidden, layers) in (QUICK_SIZES if quick else SIZES).items():
        with tempfile.TemporaryDirectory(prefix="islands-learner-memory-") as tmp:
            out = measure(hidden, layers, Path(tmp), publish_here=quick)
        raw[name] = out
        bar = RATIO_BAR + ALLOWANCE / out["model_bytes"]
        rows.append(
            at_most(
                f"learner memory {name}: peak RSS growth / model fp32 bytes",
                out["ratio"],
                bar,
                f"{out['params'] / 1e6:.0f}M params, {out['growth'] / 2**30:.2f} GiB peak over "
                f"{out['base_rss'] / 2**30:.2f} GiB at start; bar 8× + 1 GiB",
            )
        )
        rows.append(figure(f"learner memory {name}: peak RSS, GiB", out["peak_rss"] / 2**30, "the whole process"))
    return Result("learner_memory", rows=rows, raw=raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.learner_memory", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--publish", nargs=3, metavar=("HIDDEN", "LAYERS", "FOLDER"))
    p.add_argument("--child", metavar="FOLDER")
    args = p.parse_args(argv)
    if args.publish:
        hidden, layers, folder = args.publish
        publish(Path(folder), int(hidden), int(layers))
        return 0
    if args.child:
        print(json.dumps(learner(Path(args.child))))
        return 0
    from benchmarks.report import print_report

    print_report([run(args.quick)], args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
