"""A learner's memory does not grow with its corpus: streaming a pass over more than 2 GB of
token shards (over 100 times its read-ahead) while it trains peaks within a fixed bound of the
same learner training on a corpus of a few kilobytes in memory."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from islands.storage.shards import CHUNK_BYTES, Dataset, ShardEntry, TokenizerRef

SHARDS, SHARD_BYTES = 17, 128 << 20  # 16 for training (2 GiB), the last held out
BOUND = 128 << 20  # the read-ahead (two chunks as int32 plus one being read) and allocator slack

LEARNER = r"""
import json, sys
import torch
from islands.storage.corpus import training_part
from islands.core.config import InnerSettings
from islands.core.data import BatchSampler, Stream, assign
from islands.core.inner import InnerTrainer
from islands.core.model import build_model, params_of, vocab_and_context

corpus = sys.argv[1]
torch.set_num_threads(1)
model = build_model("tiny", 0)
vocab, context = vocab_and_context(model)
reader, segments = training_part(corpus)
stream = Stream(reader, assign(segments, 0, 1, block_size=context), context + 1, vocab)
trainer = InnerTrainer(model, BatchSampler(stream, 16, context, seed=0), InnerSettings())
base = params_of(model)
trainer.run_phase(base, 2)
chunks = 0
while True:  # one whole pass, as the learner makes over its epochs
    stream.current()
    stream.advance()
    chunks += 1
    if stream.cursor.epoch:
        break
trainer.run_phase(base, 2)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
state = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights and AdamW's two moments
print(json.dumps({"hwm": hwm, "chunks": chunks, "tokens": sum(s.tokens for s in segments), "model_and_optimizer": state}))
"""


def peak(corpus: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", LEARNER, corpus], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_peak_memory_over_2_gb_of_shards_stays_within_a_fixed_bound_of_a_tiny_corpus(tmp_path):
    rng = np.random.default_rng(0)
    entries = []
    for i in range(SHARDS):
        path = tmp_path / "ds" / f"shard-{i:06d}.bin"
        path.parent.mkdir(exist_ok=True)
        with open(path, "wb") as f:
            f.write(rng.integers(0, 256, 1 << 20, dtype=np.uint16).tobytes())  # random ids, then a sparse rest
            f.truncate(SHARD_BYTES)
        entries.append(ShardEntry(name=path.name, tokens=SHARD_BYTES // 2, sha256="-"))
    dataset = Dataset(
        dtype="uint16", tokenizer=TokenizerRef(name="bytes", sha256="bytes", vocab_size=256), shards=entries
    )
    (tmp_path / "ds" / "dataset.json").write_bytes(dataset.to_bytes())
    (tmp_path / "small.txt").write_bytes(bytes(range(256)) * 400)

    small, big = peak(str(tmp_path / "small.txt")), peak(str(tmp_path / "ds"))
    corpus_bytes = big["tokens"] * 2
    print(
        f"\npeak RSS: {small['hwm'] / 2**20:.0f} MiB on {small['tokens']:,} bytes in memory; "
        f"{big['hwm'] / 2**20:.0f} MiB streaming {corpus_bytes / 2**30:.2f} GiB of shards in {big['chunks']} chunks "
        f"of {CHUNK_BYTES >> 20} MiB (+{(big['hwm'] - small['hwm']) / 2**20:.0f} MiB; bound {BOUND >> 20} MiB; "
        f"model and optimizer {big['model_and_optimizer'] / 2**20:.1f} MiB)"
    )
    assert corpus_bytes >= 2 << 30 and corpus_bytes >= 20 * 2 * CHUNK_BYTES and big["chunks"] >= 200
    assert big["hwm"] <= small["hwm"] + BOUND
