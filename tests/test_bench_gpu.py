"""benchmarks/gpu.py at its toy sizes on the CPU (--cpu-smoke): the code a GPU machine runs keeps working."""

from __future__ import annotations

import math

import torch

from benchmarks import gpu


def test_the_gpu_benchmark_runs_its_smoke_sizes_and_reports_one_row_per_figure():
    res = gpu.run(quick=True)
    assert [r.benchmark.split(" (")[0] for r in res.rows] == [
        "gpu: bare loop tokens/s",
        "gpu: learner phase + delta upload tokens/s",
        "gpu: merge of 8 deltas of 0.001B params, s",
    ]
    assert all(r.ours is not None and math.isfinite(r.ours) and r.ours > 0 for r in res.rows)
    assert res.raw["params"] == sum(p.numel() for p in gpu.llama(gpu.SMOKE).parameters())
    if not torch.cuda.is_available():
        assert res.raw["bare_mfu"] is None  # MFU is a GPU's figure
        full = gpu.run(quick=False)
        assert all(r.ours is None and "no CUDA" in r.limit for r in full.rows)
