"""DDP inside a region: two gloo ranks on CPU, each training on half of every batch, give the delta
one process gives with the whole batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from infra.process import free_port
from tasks.core.config import InnerSettings
from tasks.core.data import BatchSampler
from tasks.core.inner import InnerTrainer
from tasks.core.model import build_model

TORCHRUN = Path(sys.executable).with_name("torchrun")
PHASE = ["--batch-size", "4", "--steps", "3"]


def phase(tmp_path: Path, out: str, launcher: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_bytes(bytes((i * 7 + i // 13) % 256 for i in range(80_000)))
    # gloo on the loopback interface only; one thread per rank on a shared machine.
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, "-m", "tasks.ddp_phase", *PHASE, "--corpus", str(corpus), "--out", str(tmp_path / out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    with safe_open(tmp_path / out, "pt") as f:
        meta = f.metadata()
    return load_file(tmp_path / out), meta


def test_two_ranks_give_the_delta_of_one_process_with_the_whole_batch(tmp_path):
    one, one_meta = phase(tmp_path, "one.safetensors", [sys.executable])
    torchrun = [
        str(TORCHRUN),
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    two, two_meta = phase(tmp_path, "two.safetensors", torchrun)
    assert (one_meta["world_size"], two_meta["world_size"]) == ("1", "2")
    assert one_meta["tokens"] == two_meta["tokens"] == str(3 * 4 * 128)
    assert abs(float(one_meta["loss"]) - float(two_meta["loss"])) < 1e-5
    assert one.keys() == two.keys()
    assert max(t.abs().max().item() for t in one.values()) > 1e-5  # the phase really moved the weights
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)


def test_ddp_needs_an_initialized_process_group():
    sampler = BatchSampler(bytes(range(256)) * 8, batch_size=2, block_size=16, seed=0)
    with pytest.raises(ValueError, match="torchrun"):
        InnerTrainer(build_model("tiny", 0), sampler, InnerSettings(), ddp=True)
