"""One inner phase as a torch.distributed job across a region's local GPUs:

    torchrun --nproc_per_node 8 -m tasks.ddp_phase --steps 50 --out delta.safetensors

Every rank trains on its slice of each batch (DDP averages the gradients); rank 0 writes the
delta base − local as safetensors. Started without torchrun it is one process with the whole batch,
which gives the same delta within float tolerance. NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from storage.corpus import STDLIB, training_part
from storage.model_files import local_model
from tasks.core.config import InnerSettings
from tasks.core.data import BatchSampler, Stream
from tasks.core.inner import InnerTrainer
from tasks.core.model import build_model, params_of, vocab_and_context


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tasks.ddp_phase", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="the run's model: a preset, an HF folder or config.json, python:...")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    p.add_argument("--corpus", default=STDLIB, help="token shards or text, as RunConfig.corpus takes")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all ranks together")
    p.add_argument("--steps", type=int, default=50, help="H, inner steps")
    p.add_argument("--base", type=Path, help="safetensors of the round to train from (default: the initial weights)")
    p.add_argument("--out", type=Path, required=True, help="where rank 0 writes the delta")
    return p.parse_args(argv)


def train_phase(args: argparse.Namespace, distributed: bool) -> None:
    """Train one phase; rank 0 writes the delta. Returns only when every rank is done with the group."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(local_model(args.model), args.seed)
    vocab, context = vocab_and_context(model)
    reader, segments = training_part(args.corpus)
    sampler = BatchSampler(Stream(reader, segments, context + 1, vocab), args.batch_size, context, seed=args.seed)
    trainer = InnerTrainer(model, sampler, InnerSettings(), device, ddp=distributed)
    base = load_file(args.base) if args.base else params_of(model)
    result = trainer.run_phase(base, args.steps)
    if trainer.rank == 0:
        meta = {
            "steps": str(result.steps),
            "tokens": str(result.tokens),
            "loss": f"{result.loss:.6f}",
            "world_size": str(trainer.world_size),
        }
        save_file(result.delta, args.out, metadata=meta)
    if distributed:
        dist.barrier()  # no rank tears the group down while rank 0 is still writing


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        train_phase(args, distributed)
    finally:
        if distributed:
            # DDP's reducer holds the group: free it before the group is destroyed, never at interpreter exit
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
