"""Deltas written straight into regional buckets, as a learner would write them, without training:
the synchronizer tests need what arrives in S3, not how it was computed."""

from __future__ import annotations

import time

import torch

from islands.core.config import RunConfig
from islands.storage import layout
from islands.storage.codec import encode
from islands.storage.rounds import get_tensors, read_manifest
from islands.storage.store import Stores

TEMPLATE = "s3://islands-{bucket}"
TOKENS = 5 * 16 * 128  # H × batch × block of the tiny model


def new_run(
    run_id: str, learners_per_region: int = 1, update_codec: str = "bf16", **quorum
) -> tuple[RunConfig, Stores]:
    """A run on the session stack's buckets with round 0 published and no learner running."""
    from islands.flows.training_run import create_run

    config = RunConfig(
        run_id=run_id,
        regions=["north", "south"],
        learners_per_region=learners_per_region,
        rounds=2,
        inner_steps=5,
        speed={},
        eval_batches=2,
        update_codec=update_codec,
        quorum={"min_quorum": 1, "grace_max_s": 0.0, **quorum},
    )
    stores = Stores(TEMPLATE, config.regions)
    create_run(config, stores)
    return config, stores


def region_of(config: RunConfig, learner: str) -> str:
    return next(r for name, r, _ in config.learners() if name == learner)


def pseudo_gradient(stores: Stores, run: str, seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """Random tensors with the model's names, shapes and dtype, the size of a few inner steps."""
    model = get_tensors(stores.global_, read_manifest(stores.global_, run, 0)[0].model)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * scale for k, v in model.items()}


def metadata(config: RunConfig, learner: str, phase: int, base_round: int, tokens: int = TOKENS) -> dict[str, str]:
    return {
        "run": config.run_id,
        "learner": learner,
        "region": region_of(config, learner),
        "phase": str(phase),
        "base_round": str(base_round),
        "inner_steps": "5",
        "tokens": str(tokens),
        "loss": "3.5",
        "seconds": "1.0",
        "finished_at": f"{time.time():.3f}",
    }


def delta_bytes(config: RunConfig, stores: Stores, learner: str, phase: int, base_round: int, seed: int) -> bytes:
    return encode(pseudo_gradient(stores, config.run_id, seed), metadata(config, learner, phase, base_round))


def put(config: RunConfig, stores: Stores, learner: str, phase: int, data: bytes) -> str:
    """Write `data` as the learner's delta for `phase`; returns the key."""
    key = layout.delta_key(config.run_id, learner, phase)
    assert stores.region(region_of(config, learner)).put_if_absent(key, data)
    return key
