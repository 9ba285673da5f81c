"""The way down, pure parts: θ_r = θ_{r−1} + decode(update) rebuilt bit for bit from the update
object alone, the synchronizer's residual keeping what the codec dropped, carried through the
outer state object; and the regional cache's claim, on a local folder."""

from __future__ import annotations

import json

import pytest
import torch

from islands.core.codecs import CODECS
from islands.core.compress import residual_state, split_residual
from islands.core.config import TopkSettings
from islands.core.merge import apply_update, encode_update, outer_step
from islands.storage import layout
from islands.storage.cache import regional_get
from islands.storage.codec import decode, decode_state, encode_state, encode_wire
from islands.storage.manifest import Manifest, ObjectRef
from islands.storage.rounds import checkpoint_metadata
from islands.storage.store import ObjectStore, sha256_hex

RUN = "run-down"
ROUNDS = 6
TOPK = TopkSettings(chunk=64, k=8, beta=1.0)  # plain error feedback: the residual keeps all it dropped


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(33, 8, generator=gen) * 0.02, "head.bias": torch.randn(5, generator=gen) * 0.02}


def merged_delta(r: int) -> dict[str, torch.Tensor]:
    """What the merge of round r averaged: small, different every round."""
    gen = torch.Generator().manual_seed(100 + r)
    return {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in model().items()}


def synchronizer_round(params, momentum, residual, r, codec):
    """One round as the synchronizer publishes it: the outer step, then the encoded update."""
    target, new_momentum = {}, {}
    for name, p in params.items():
        prev = momentum[name] if momentum else None
        target[name], new_momentum[name] = outer_step(p, prev, merged_delta(r)[name], lr=0.5, mu=0.9)
    wire, new_params, new_residual = encode_update(params, target, residual, codec, TOPK)
    return encode_wire(wire, checkpoint_metadata(RUN, r), codec), new_params, new_momentum, new_residual


def model_sha(params, r: int) -> str:
    return sha256_hex(encode_state(params, checkpoint_metadata(RUN, r)))


@pytest.mark.parametrize("codec", CODECS)
def test_a_learner_rebuilds_every_round_bit_for_bit_from_the_update_object(codec):
    params, momentum, residual = model(), None, {}
    held = {n: t.clone() for n, t in params.items()}
    for r in range(1, ROUNDS + 1):
        update_bytes, params, momentum, residual = synchronizer_round(params, momentum, residual, r, codec)
        held = apply_update(held, decode(update_bytes)[0])
        assert model_sha(held, r) == model_sha(params, r), f"{codec}: round {r}"
    assert (residual == {}) == (codec == "fp32")


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "fp32"])
def test_the_residual_keeps_what_the_codec_dropped(codec):
    """θ_R + residual is where exact updates would have taken the model, up to float32 rounding and
    the residual's own bf16 rounding (at most 2^-9 of it a round)."""
    params, momentum, residual = model(), None, {}
    exact, exact_momentum = model(), None
    for r in range(1, ROUNDS + 1):
        _, params, momentum, residual = synchronizer_round(params, momentum, residual, r, codec)
        _, exact, exact_momentum, _ = synchronizer_round(exact, exact_momentum, {}, r, "fp32")
    for name in params:
        dropped = (params[name] - exact[name]).abs().max()
        assert dropped > 0
        bf16_rounding = ROUNDS * 2**-9 * residual[name].float().abs().max()
        assert dropped > 10 * bf16_rounding  # the residual holds far more than its rounding loses
        assert torch.allclose(params[name] + residual[name], exact[name], rtol=0, atol=1e-6 + bf16_rounding)


def test_the_residual_survives_a_reload_of_the_outer_state():
    """A synchronizer resumed from the outer object (momentum + residual) publishes the same bits."""
    codec = "int8"
    params, momentum, residual = model(), None, {}
    straight = []
    for r in range(1, ROUNDS + 1):
        update_bytes, params, momentum, residual = synchronizer_round(params, momentum, residual, r, codec)
        straight.append((sha256_hex(update_bytes), model_sha(params, r)))
        if r == 3:
            outer = encode_state({**momentum, **residual_state(residual)}, checkpoint_metadata(RUN, r))
            resumed = (
                decode_state(encode_state(params, checkpoint_metadata(RUN, r))),
                *split_residual(decode_state(outer)),
            )
    params, momentum, residual = resumed
    assert set(residual) == set(momentum) == set(params)
    for r in range(4, ROUNDS + 1):
        update_bytes, params, momentum, residual = synchronizer_round(params, momentum, residual, r, codec)
        assert (sha256_hex(update_bytes), model_sha(params, r)) == straight[r - 1]


def test_a_manifest_without_an_update_reads():
    """Round 0 applied no update, so its manifest has no `update` field."""
    doc = {
        "schema_version": 2,
        "run": RUN,
        "round": 0,
        "parent_round": None,
        "parent_sha256": None,
        "created_at": "2026-01-01T00:00:00.000+00:00",
        "model": {"key": "k", "sha256": "0" * 64, "bytes": 1},
        "outer": None,
        "settings": {"merge": {}, "quorum": {"min_quorum": 1}, "num_learners": 1},
        "quorum": {"received": 0, "learners": [], "waited_s": 0.0, "closed_by": "initial"},
        "eval_loss": 5.0,
    }
    assert Manifest.from_bytes(json.dumps(doc).encode()).update is None


def test_cache_keys_keep_the_round_and_the_content_address():
    key = layout.update_key(RUN, 7, "ab" * 32)
    assert layout.cache_key(RUN, key) == f"runs/{RUN}/cache/000007/update-{'ab' * 8}.safetensors"
    assert layout.claim_key(layout.cache_key(RUN, key)) == f"runs/{RUN}/cache/000007/update-{'ab' * 8}.claim"
    with pytest.raises(ValueError, match="only those are cached"):
        layout.cache_key(RUN, f"runs/{RUN}/deltas/a-0/000001.safetensors")


@pytest.fixture
def buckets(tmp_path):
    global_, region = ObjectStore(f"file://{tmp_path}/global"), ObjectStore(f"file://{tmp_path}/north")
    data = b"model bytes"
    key = layout.model_key(RUN, 2, sha256_hex(data))
    global_.put_if_absent(key, data)
    return global_, region, ObjectRef(key=key, sha256=sha256_hex(data), bytes=len(data)), data


def test_the_first_reader_copies_and_the_others_read_the_copy(buckets):
    global_, region, ref, data = buckets
    before = global_.io.bytes_read
    assert regional_get(region, global_, RUN, ref, owner="north-0") == data
    assert regional_get(region, global_, RUN, ref, owner="north-1") == data
    assert global_.io.bytes_read - before == len(data)


def test_a_reader_behind_a_dead_claim_waits_then_fetches_itself(buckets):
    global_, region, ref, data = buckets
    region.put_if_absent(layout.claim_key(layout.cache_key(RUN, ref.key)), b"{}")  # its claimer died
    slept = []
    assert regional_get(region, global_, RUN, ref, owner="north-1", wait_s=1.0, sleep=slept.append) == data
    assert sum(slept) >= 1.0 and region.exists(layout.cache_key(RUN, ref.key))


def test_a_damaged_copy_is_replaced_from_the_original(buckets):
    global_, region, ref, data = buckets
    cached = layout.cache_key(RUN, ref.key)
    region.put_if_absent(cached, b"damaged")
    assert regional_get(region, global_, RUN, ref, owner="north-0") == data
    assert region.get(cached, sha256=ref.sha256) == data
