"""`python -m benchmarks.gpu [--cpu-smoke]`: what a GPU learner spends, for a machine with one.

Three figures on one table: tokens/s and MFU (model FLOPs utilization: 6·N·tokens/s over the
GPU's peak bf16 rate, the PaLM paper's measure, arXiv 2204.02311) of the bare inner loop of a
~150M-parameter Llama-config model (transformers' LlamaConfig) on synthetic tokens; the same
for a learner's phase of H steps with its delta copied to the host, encoded and written to an
object store, which a learner's utilization is read against; and the seconds the synchronizer's
merge (islands.core.merge.merge_round) takes for 8 deltas of a 1B-parameter model.
`--cpu-smoke` runs the same code at toy sizes on the CPU, so CI keeps it working without a GPU
(its figures say nothing about a GPU). Without CUDA and without --cpu-smoke, each row says so.
`python -m benchmarks --only gpu` runs it in the suite's table (`--quick`: the smoke sizes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from benchmarks.llama import llama_config
from benchmarks.report import Result, figure, print_report, timed
from islands.core.compress import compress_with_feedback
from islands.core.config import InnerSettings, MergeSettings
from islands.core.inner import InnerTrainer
from islands.core.merge import merge_round
from islands.core.model import synced
from islands.storage.codec import encode_wire
from islands.storage.store import ObjectStore

# Peak dense bf16 FLOP/s by device name (vendors' data sheets): MFU's denominator.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12}


@dataclass(frozen=True)
class Sizes:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    seq: int
    batch: int
    micro_batch: int
    steps: int  # timed steps of the bare loop, and H of the phase
    merge_params: int  # parameters of the model whose 8 deltas are merged
    merge_tensors: int


FULL = Sizes(768, 12, 12, 2048, 32000, 1024, 32, 8, 20, 1_000_000_000, 100)  # ~150M parameters
SMOKE = Sizes(32, 2, 2, 64, 256, 32, 4, 2, 2, 1_000_000, 10)


class SyntheticTokens:
    """Uniform random token ids: the sampler contract InnerTrainer reads (the data never limits a GPU here)."""

    def __init__(self, vocab: int, batch_size: int, seq: int):
        self.vocab, self.batch_size, self.seq = vocab, batch_size, seq
        self.tokens_per_batch = batch_size * seq
        self.gen = torch.Generator().manual_seed(0)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.batch_size, self.seq + 1), generator=self.gen)
        return ids[:, :-1], ids[:, 1:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}


def llama(s: Sizes) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    config = llama_config(
        s.hidden, s.layers, s.seq, heads=s.heads, intermediate=s.intermediate, vocab=s.vocab, tied=True
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(params: int, tokens_per_s: float, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return None if peak is None else 6 * params * tokens_per_s / peak


def inner_loop(s: Sizes, device: torch.device) -> dict:
    """tokens/s of the bare loop (steps after a warm-up step) and of a learner phase with its upload."""
    model = llama(s)
    params = sum(p.numel() for p in model.parameters())
    cfg = InnerSettings(batch_size=s.batch, micro_batch_size=s.micro_batch, warmup_steps=1, total_steps=1000)
    trainer = InnerTrainer(model, SyntheticTokens(s.vocab, s.batch, s.seq), cfg, device)
    base = {k: v.detach().to("cpu", copy=True) for k, v in synced(trainer.model)}
    trainer.train_step()  # warm-up: kernels chosen, memory allocated
    synchronize(device)
    started = time.perf_counter()
    for _ in range(s.steps):
        trainer.train_step()
    synchronize(device)
    bare = s.steps * s.batch * s.seq / (time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as folder:
        store = ObjectStore(f"file://{folder}")
        started = time.perf_counter()
        result = trainer.run_phase(base, s.steps)
        wire, _, _ = compress_with_feedback(dict(result.delta), {}, "fp32")
        store.put_if_absent("delta.safetensors", encode_wire(wire, {"phase": "0"}, "fp32"))
        phase = result.tokens / (time.perf_counter() - started)
    return {
        "params": params,
        "bare_tokens_per_s": bare,
        "phase_tokens_per_s": phase,
        "bare_mfu": mfu(params, bare, device),
        "phase_mfu": mfu(params, phase, device),
    }


def merge_seconds(s: Sizes, deltas: int = 8) -> float:
    """The synchronizer's merge of `deltas` deltas of an s.merge_params-parameter model, on the host."""
    size = s.merge_params // s.merge_tensors
    gen = torch.Generator().manual_seed(1)
    params = {f"t{i}": torch.randn(size, generator=gen) for i in range(s.merge_tensors)}
    ds = [{k: torch.randn(size, generator=gen) * 1e-3 for k in params} for _ in range(deltas)]
    started = time.perf_counter()
    merge_round(params, None, ds, [1.0 / deltas] * deltas, MergeSettings())
    return time.perf_counter() - started


def run(quick: bool) -> Result:
    """The table; `quick` (or --cpu-smoke): the toy sizes, on the CPU when there is no GPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not quick and device.type != "cuda":
        why = "no CUDA device on this machine; --cpu-smoke runs the toy sizes on the CPU"
        names = ["gpu: bare loop tokens/s", "gpu: phase+upload tokens/s", "gpu: merge of 8 deltas, s"]
        return Result("gpu", [figure(n, None, limit=why) for n in names])
    s = SMOKE if quick else FULL
    loop = inner_loop(s, device)
    merged = merge_seconds(s)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke sizes)"
    mfu_of = "MFU {:.3f}".format
    rows = [
        figure(
            f"gpu: bare loop tokens/s ({loop['params'] / 1e6:.0f}M params, {where})",
            loop["bare_tokens_per_s"],
            mfu_of(loop["bare_mfu"]) if loop["bare_mfu"] is not None else "MFU: no GPU peak known",
        ),
        figure(
            "gpu: learner phase + delta upload tokens/s",
            loop["phase_tokens_per_s"],
            mfu_of(loop["phase_mfu"]) if loop["phase_mfu"] is not None else "MFU: no GPU peak known",
        ),
        figure(f"gpu: merge of 8 deltas of {s.merge_params / 1e9:g}B params, s", merged, "on the host"),
    ]
    return Result("gpu", rows, raw={**loop, "merge_s": merged, "device": where}, settings=vars(s))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU: checks the code, measures nothing")
    args = p.parse_args(argv)
    print_report([timed(run, args.cpu_smoke)], args.cpu_smoke)
    sys.exit(0)


if __name__ == "__main__":
    main()
