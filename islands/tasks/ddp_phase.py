"""A learner's phase as one torch.distributed job across its node's GPUs (gpus_per_learner > 1):

    python -m torch.distributed.run --standalone --nproc_per_node 8 -m islands.tasks.ddp_phase \\
        --config run.json --learner us-east-0 --dir PHASE_DIR --steps 50

(without base.safetensors in PHASE_DIR: from round 0, the run's seeded model)

The learner's flow run launches it for every phase (`PhaseJob`): it writes the round to train
from (base.safetensors) and the learner's saved state (state-in.safetensors: AdamW moments,
step, data cursor) into PHASE_DIR; every rank builds the learner's trainer as the learner's own
process would (`learner_trainer`), trains on its slice of each batch (DDP, or FSDP2 with
`parallel = "fsdp"`), and rank 0 writes the delta base − local (delta.safetensors) and the state
after the phase (state.safetensors), which the learner reads back and uploads as it does its
own. Started without torchrun it is one process with the whole batch, which gives the same delta
within float tolerance. NCCL on GPUs, gloo on CPU.

A job trains its phase to the end: it folds in no round published meanwhile (`rebase`) and sees
a stop between phases only.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from islands.core.config import RunConfig
from islands.core.data import BatchSampler, Stream, assign
from islands.core.inner import InnerTrainer, OutOfMemory, PhaseResult
from islands.core.model import build_model, own_params, vocab_and_context
from islands.storage.corpus import training_part
from islands.storage.model_files import local_model


def learner_trainer(config: RunConfig, learner: str, device: torch.device, parallel: str | None = None) -> InnerTrainer:
    """The trainer of `learner` at phase 0: the run's seeded model, the learner's part of the
    training token ranges (`assign`) streamed in its own order, the run's inner settings. The
    learner's own process and every rank of its torchrun job build it alike, so they train on
    the same batches."""
    index = {name: i for name, _, i in config.learners()}
    if learner not in index:
        raise ValueError(f"learner {learner!r} is not part of run {config.run_id} ({', '.join(index)})")
    model = build_model(local_model(config.model), config.seed).to(device)
    vocab, context = vocab_and_context(model)
    reader, segments = training_part(config.corpus, config.eval_corpus, config.tokenizer)
    mine = assign(segments, index[learner], config.num_learners, block_size=context)
    sampler = BatchSampler(
        Stream(reader, mine, context + 1, vocab),
        config.inner.batch_size,
        context,
        seed=config.seed * 1000 + index[learner],
    )
    return InnerTrainer(model, sampler, config.inner, device=device, parallel=parallel)


class PhaseJob:
    """A learner's trainer whose phases run as torchrun jobs of `gpus_per_learner` processes.

    Between phases it keeps the learner's state in `local`, a trainer on the host that never
    trains: the job starts from its state_dict() and leaves its own back in it, so the learner
    saves, restores and schedules (catch_up) a job's state as it does its own."""

    def __init__(self, config: RunConfig, learner: str):
        self.config, self.learner = config, learner
        self.local = learner_trainer(config, learner, torch.device("cpu"))
        self.catch_up, self.state_dict, self.load_state_dict = (
            self.local.catch_up,
            self.local.state_dict,
            self.local.load_state_dict,
        )

    @property
    def step(self) -> int:
        return self.local.step

    def command(self, phase_dir: Path, steps: int, slowdown: float, min_step_s: float) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # one node: the rendezvous on a free port of localhost
            "--nproc_per_node",
            str(self.config.gpus_per_learner),
            "-m",
            "islands.tasks.ddp_phase",
            "--config",
            str(phase_dir / "run.json"),
            "--learner",
            self.learner,
            "--dir",
            str(phase_dir),
            "--steps",
            str(steps),
            "--lr-offset",
            str(self.local.lr_offset),
            "--slowdown",
            repr(slowdown),
            "--min-step-s",
            repr(min_step_s),
        ]

    def run_phase(self, base, steps, slowdown=1.0, min_step_s=0.0, on_step=None, should_stop=None, rebase=None):
        """InnerTrainer.run_phase's contract, trained by one torchrun job (see the module's
        docstring for what a job does not do); `seconds` is the job's wall time, start-up included."""
        if should_stop is not None and should_stop():
            return PhaseResult(delta={}, steps=0, tokens=0, loss=float("nan"), seconds=0.0, losses=[])
        with tempfile.TemporaryDirectory(prefix=f"phase-{self.learner}-") as tmp:
            phase_dir = Path(tmp)
            (phase_dir / "run.json").write_text(self.config.model_dump_json())
            save_file({k: v.contiguous() for k, v in base.items()}, phase_dir / "base.safetensors")
            save_file(self.local.state_dict(), phase_dir / "state-in.safetensors")
            env = dict(os.environ)
            if not torch.cuda.is_available():
                env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one node: gloo between local processes
                env["OMP_NUM_THREADS"] = str(max(1, self.config.threads_per_learner() // self.config.gpus_per_learner))
            started = time.perf_counter()
            done = subprocess.run(
                self.command(phase_dir, steps, slowdown, min_step_s), env=env, capture_output=True, text=True
            )
            seconds = time.perf_counter() - started
            if done.returncode != 0:
                errors = sorted(phase_dir.glob("error-*.txt"))
                why = errors[0].read_text().strip() if errors else done.stderr.strip()[-2000:]
                raise RuntimeError(f"the torchrun phase of {self.learner} failed (exit {done.returncode}): {why}")
            self.local.load_state_dict(load_file(phase_dir / "state.safetensors"))
            delta = load_file(phase_dir / "delta.safetensors")
            with safe_open(phase_dir / "delta.safetensors", "pt") as f:
                meta = f.metadata()
        losses = [float(v) for v in meta["losses"].split(",")] if meta["losses"] else []
        return PhaseResult(
            delta=delta,
            steps=int(meta["steps"]),
            tokens=int(meta["tokens"]),
            loss=float(meta["loss"]),
            seconds=seconds,
            losses=losses,
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m islands.tasks.ddp_phase", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the run's configuration (RunConfig as JSON)")
    p.add_argument("--learner", required=True, help="the learner whose phase this is")
    p.add_argument(
        "--dir", type=Path, required=True, help="phase folder: base and state-in are read, delta and state written"
    )
    p.add_argument("--steps", type=int, default=50, help="H, inner steps")
    p.add_argument("--lr-offset", type=int, default=0, help="the learning-rate schedule's lead (InnerTrainer.catch_up)")
    p.add_argument("--slowdown", type=float, default=1.0, help="InnerTrainer.run_phase's slowdown")
    p.add_argument("--min-step-s", type=float, default=0.0, help="InnerTrainer.run_phase's min_step_s")
    return p.parse_args(argv)


def train_phase(args: argparse.Namespace, distributed: bool) -> None:
    """Train one phase; rank 0 writes the delta and the state. Returns only when every rank is
    done with the group."""
    config = RunConfig.model_validate_json(args.config.read_text())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    trainer = learner_trainer(config, args.learner, device, config.parallel if distributed else None)
    if (args.dir / "state-in.safetensors").exists():
        trainer.load_state_dict(load_file(args.dir / "state-in.safetensors"))
    trainer.lr_offset = args.lr_offset
    if (args.dir / "base.safetensors").exists():
        base = load_file(args.dir / "base.safetensors")
    else:  # round 0, as the run's seed makes it
        base = own_params(build_model(local_model(config.model), config.seed))
    result = trainer.run_phase(base, args.steps, slowdown=args.slowdown, min_step_s=args.min_step_s)
    delta, state = dict(result.delta), trainer.state_dict()  # every rank: FSDP2 gathers the shards
    if trainer.rank == 0:
        meta = {
            "steps": str(result.steps),
            "tokens": str(result.tokens),
            "loss": f"{result.loss:.6f}",
            "losses": ",".join(f"{v:.6f}" for v in result.losses),
            "world_size": str(trainer.world_size),
        }
        save_file(delta, args.dir / "delta.safetensors", metadata=meta)
        save_file(state, args.dir / "state.safetensors")
    if distributed:
        dist.barrier()  # no rank tears the group down while rank 0 is still writing


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        train_phase(args, distributed)
    except OutOfMemory as exc:  # the one line the learner reports, not a rank's traceback
        (args.dir / f"error-{os.environ.get('RANK', 0)}.txt").write_text(str(exc))
        raise
    finally:
        if distributed:
            # DDP's reducer holds the group: free it before the group is destroyed, never at interpreter exit
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
