"""A real run of a large model: `python -m benchmarks.large_run [--quick]`.

A Llama config of about 180M parameters (benchmarks.learner_memory's, 0.72 GB in fp32), two
regions of one learner each, two rounds, H=2, run by `islands run --config … --json` on the
embedded stack with the run's defaults otherwise (batch 16, stdlib text as bytes, the
synchronizer evaluating round 0 and the last). What is judged is what a user of this machine
meets: the run finishes, `islands audit --replay` passes, every learner process peaks below
8 × the model's fp32 bytes + 1 GiB, and the `islands run` process (driver, synchronizer and its
evaluations, all in it) below 1 × the model's fp32 bytes + 768 MiB.

Peaks are whole processes (VmHWM, which only grows), read from /proc every SAMPLE_S while the
run lasts; learners are found by the `host:pid` each records on its flow run (flows.learner).
--quick runs a 2M model as a smoke test: the interpreters dwarf it, and no bar is judged then.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import pipeline
from benchmarks.learner_memory import QUICK_SIZES, SIZES, llama
from benchmarks.report import Result, at_most, figure, standalone

SAMPLE_S = 0.5
CONTEXT = 64
LEARNER_BAR, LEARNER_ALLOWANCE = 8.0, 1 << 30
DRIVER_BAR, DRIVER_ALLOWANCE = 1.0, 768 << 20


def peaks(stop: threading.Event, into: dict[int, int]) -> None:
    """Keep the highest VmHWM seen of every process on the machine, by pid, until `stop`."""
    while not stop.wait(SAMPLE_S):
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                hwm = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("VmHWM:"))
            except (OSError, StopIteration):
                continue  # gone, or a kernel thread
            pid = int(proc.name)
            into[pid] = max(into.get(pid, 0), int(hwm.split()[1]) * 1024)


def learner_pids(run: str) -> dict[str, int]:
    """{flow-run name: pid} of every learner process the run launched (relaunches included)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowRunFilter

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name={"any_": ["learner"]}), flow_run_filter=FlowRunFilter(tags={"all_": [run]})
        )
    return {r.name: int(r.infrastructure_pid.rpartition(":")[2]) for r in runs if r.infrastructure_pid}


def parameters(model: Path) -> int:
    """The model's parameter count, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in built.parameters())


def config(model: Path, run: str) -> dict:
    return {
        "run_id": run,
        "model": str(model),
        "regions": ["north", "south"],
        "learners_per_region": 1,
        "rounds": 2,
        "inner_steps": 2,
        "speed": {},
    }


def run(quick: bool = False) -> Result:
    name, (hidden, layers) = next(iter((QUICK_SIZES if quick else {"180M": SIZES["180M"]}).items()))
    env = pipeline.stack_env()
    run_id = f"large-run-{name.lower()}-{int(time.time())}"
    seen: dict[int, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=peaks, args=(stop, seen), daemon=True)
    with tempfile.TemporaryDirectory(prefix="islands-large-run-") as tmp:
        model = llama(Path(tmp) / "model", hidden, layers, context=CONTEXT)
        params = parameters(model)
        conf = Path(tmp) / "run.toml"
        conf.write_text(pipeline.toml(config(model, run_id)))
        t0 = time.monotonic()
        sampler.start()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "islands.flows.cli", "run", "--config", str(conf), "--json"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            out, err = proc.communicate()
        finally:
            stop.set()
            sampler.join()
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"islands run of the {name} model failed ({proc.returncode}):\n{err[-3000:]}")
        audit = subprocess.run(  # while the model's folder is there: the replay builds the model from it
            [sys.executable, "-m", "islands.flows.cli", "audit", run_id, "--replay", "--json"],
            env=env,
            capture_output=True,
            text=True,
        )
    summary = json.loads(out.strip().splitlines()[-1])
    report = json.loads(audit.stdout.strip().splitlines()[-1]) if audit.stdout.strip() else {}
    model_bytes = params * 4
    learners = {flow_run: seen.get(pid, 0) for flow_run, pid in learner_pids(run_id).items()}
    worst = max(learners.values(), default=0)
    driver = seen.get(proc.pid, 0)
    gib = 2**30
    rows = [
        at_most(
            f"large run {name}: worst learner peak RSS / model fp32 bytes",
            worst / model_bytes if learners else None,
            LEARNER_BAR + LEARNER_ALLOWANCE / model_bytes,
            f"{params / 1e6:.0f}M params; learners peaked at "
            + ", ".join(f"{n} {b / gib:.2f} GiB" for n, b in sorted(learners.items()))
            + "; bar 8× + 1 GiB",
        ),
        at_most(
            f"large run {name}: `islands run` peak RSS / model fp32 bytes",
            driver / model_bytes,
            DRIVER_BAR + DRIVER_ALLOWANCE / model_bytes,
            f"driver, synchronizer and evaluation peaked at {driver / gib:.2f} GiB; bar 1× + 768 MiB",
        ),
        at_most(
            f"large run {name}: problems `islands audit --replay` found",
            len(report["problems"]) if "problems" in report else None,
            0,
            f"audit exited {audit.returncode}: {(audit.stdout or audit.stderr)[-600:]}",
        ),
        figure(f"large run {name}: wall time, minutes", wall / 60, "follows the machine's speed"),
    ]
    raw = {
        "params": params,
        "learner_peak_rss": learners,
        "driver_peak_rss": driver,
        "summary": summary,
        "audit_problems": report.get("problems"),
        "wall_s": wall,
    }
    settings = {**config(Path("<model>"), run_id), "hidden": hidden, "layers": layers, "context": CONTEXT}
    return Result("large_run", rows=rows, raw=raw, settings=settings)


if __name__ == "__main__":
    standalone(run)
