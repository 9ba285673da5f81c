"""How the `topk` codec codes positions, measured on real deltas: a tiny model trained a phase
with the run's own inner loop, its delta's top 64 of each 4096 values. Elias–Fano (the codec's)
against 12-bit packing and a Rice code of the sorted gaps with its parameter chosen per chunk
(what islands.core.sparse's docstring reports)."""

from __future__ import annotations

from pathlib import Path

import torch

import islands
from islands.core import sparse
from islands.core.config import InnerSettings, TopkSettings
from islands.core.data import BatchSampler
from islands.core.inner import InnerTrainer
from islands.core.model import build_model, params_of

RICE_PARAMETER_BITS = 4  # a chunk's parameter, 0 to 11 for gaps under 4096


def real_positions(settings: TopkSettings) -> torch.Tensor:
    """(chunks, k) sorted positions of the top k of each whole chunk of a real phase's delta."""
    text = b"".join(p.read_bytes() for p in sorted(Path(islands.__file__).parent.rglob("*.py")))
    model = build_model("tiny", 0)
    trainer = InnerTrainer(model, BatchSampler(text, 8, 64, seed=0), InnerSettings(lr=3e-3, warmup_steps=2))
    delta = trainer.run_phase({n: t.clone() for n, t in params_of(model).items()}, 10).delta
    rows = []
    for t in delta.values():
        whole = t.numel() // settings.chunk
        flat = t.reshape(-1)[: whole * settings.chunk].view(whole, settings.chunk)
        rows.append(flat.abs().topk(settings.k, dim=1).indices.sort(dim=1).values)
    return torch.cat(rows)


def rice_bits(top: torch.Tensor) -> float:
    """Bits of a Rice code of each chunk's gaps (the first position, then each next one's distance
    less one), its parameter the best for the chunk and sent with it."""
    gaps = torch.cat([top[:, :1], top.diff(dim=1) - 1], dim=1)
    k = top.shape[1]
    costs = torch.stack([(gaps >> r).sum(dim=1) + k * (1 + r) for r in range(12)])  # (parameters, chunks)
    return float(costs.min(dim=0).values.sum() + RICE_PARAMETER_BITS * top.shape[0])


def test_elias_fano_positions_are_a_third_under_12_bit_packing_and_near_a_rice_code():
    settings = TopkSettings()
    top = real_positions(settings)
    per_position = {
        "12-bit": 12.0,
        "Elias-Fano": 8 * sparse.Layout.of(settings).idx_bytes(settings.chunk) / settings.k,
        "Rice": rice_bits(top) / top.numel(),
    }
    print(f"bits per position over {top.shape[0]} chunks of a real delta: {per_position}")
    assert per_position["Elias-Fano"] == 8.0
    assert 7.3 < per_position["Rice"] < 8.0  # measured 7.57
