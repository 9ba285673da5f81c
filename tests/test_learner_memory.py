"""A learner's memory is a small constant multiple of its model: a 43M-parameter Llama-config
learner on a `file://` store, training three phases with their deltas and states uploaded, then
a second process restoring the saved state and training three more, each peaks within 8× the
model's float32 bytes plus a fixed allowance over what it held after its imports
(benchmarks.learner_memory measures it, in processes of their own)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from benchmarks.learner_memory import PHASES, measure
from islands.storage.codec import encode_state, encode_state_object, restamped, restamped_object

HIDDEN, LAYERS = 768, 6  # 42.9M parameters, 164 MiB in float32
ALLOWANCE = 256 << 20  # the interpreter's allocator slack, a step's activations, one tensor in flight


def test_a_learners_peak_memory_is_at_most_8_times_its_model_plus_a_fixed_allowance(tmp_path):
    out = measure(HIDDEN, LAYERS, tmp_path, restarts=1)
    for name, run in (("first", out["first"]), ("restarted", out)):
        print(
            f"\n{name} learner: {run['params'] / 1e6:.1f}M params ({run['model_bytes'] / 2**20:.0f} MiB), "
            f"peak {run['peak_rss'] / 2**20:.0f} MiB, {run['growth'] / 2**20:.0f} MiB over "
            f"{run['base_rss'] / 2**20:.0f} MiB at start: {run['ratio']:.2f}× the model"
        )
        assert run["growth"] <= 8 * run["model_bytes"] + ALLOWANCE, run
    assert (out["first"]["phases"], out["phases"]) == (PHASES, 2 * PHASES)  # the restart went on from the state


def test_a_restamped_object_is_restamped_bytes_never_assembled(tmp_path):
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2], dtype=torch.int64)}
    obj = encode_state_object(tensors, {"phase": "3", "run": "r"})
    again = restamped_object(obj, phase="4")
    expected = restamped(encode_state(tensors, {"phase": "3", "run": "r"}), phase="4")
    assert again.read_bytes() == expected == encode_state(tensors, {"phase": "4", "run": "r"})
    assert again.sha256 == __import__("hashlib").sha256(expected).hexdigest()
    assert again.pieces[1:] == obj.pieces[1:]


def test_a_checkpoint_is_spooled_through_the_regions_cache_and_a_damaged_copy_replaced(tmp_path):
    from islands.storage import layout
    from islands.storage.cache import regional_spool
    from islands.storage.manifest import ObjectRef
    from islands.storage.store import ObjectStore, sha256_hex

    global_, region = ObjectStore(f"file://{tmp_path}/g"), ObjectStore(f"file://{tmp_path}/r")
    data = encode_state({"w": torch.arange(1000.0)}, {"round": "1"})
    ref = ObjectRef(key=layout.model_key("run", 1, sha256_hex(data)), sha256=sha256_hex(data), bytes=len(data))
    global_.put_if_absent(ref.key, data)
    first = regional_spool(region, global_, "run", ref, "north-0", tmp_path / "a")
    assert first.path.read_bytes() == data and region.get(layout.cache_key("run", ref.key)) == data
    read = global_.io.bytes_read
    again = regional_spool(region, global_, "run", ref, "north-1", tmp_path / "b")
    assert again.path.read_bytes() == data and global_.io.bytes_read == read  # the region's copy

    copy = next(p for p in (tmp_path / "r").rglob("*") if p.is_file() and p.read_bytes() == data)
    copy.write_bytes(data[:-1] + b"\0")
    third = regional_spool(region, global_, "run", ref, "north-1", tmp_path / "c")
    assert third.path.read_bytes() == data and region.get(layout.cache_key("run", ref.key)) == data


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "topk"])
def test_a_delta_written_tensor_by_tensor_is_the_object_and_residual_of_the_whole_dict(tmp_path, codec):
    from islands.core.compress import compress_with_feedback
    from islands.core.config import TopkSettings
    from islands.storage.codec import encode_wire
    from islands.tasks.train_phase import encode_delta

    gen = torch.Generator().manual_seed(0)
    delta = {f"layer{i}.w": torch.randn(300, 7, generator=gen) * 1e-3 for i in range(3)}
    residual = {n: torch.randn(t.shape, generator=gen) * 1e-5 for n, t in delta.items()} if codec != "fp32" else {}
    topk = TopkSettings(chunk=256, k=8)
    wire, _, expected_residual = compress_with_feedback(delta, residual, codec, topk)
    expected = encode_wire(wire, {"phase": "4", "run": "r"}, codec)

    session = SimpleNamespace(
        config=SimpleNamespace(codec=codec, carry=True, topk=topk), residual=dict(residual), scratch=tmp_path
    )
    (tmp_path / "phase").mkdir()
    obj, new_residual, kept = encode_delta(
        session, SimpleNamespace(delta=dict(delta)), {"phase": 4, "run": "r"}, tmp_path / "phase"
    )
    assert obj.read_bytes() == expected
    assert set(new_residual) == set(expected_residual)
    assert all(torch.equal(new_residual[n], expected_residual[n]) for n in expected_residual)
    assert all(torch.equal(kept[n], delta[n]) for n in delta) and set(kept) == set(delta)


def test_rounds_rebuilt_from_spooled_updates_are_apply_updates_and_leave_the_held_round_be(tmp_path):
    from islands.core.merge import apply_update
    from islands.storage import layout
    from islands.storage.codec import decode, encode_wire
    from islands.storage.manifest import ObjectRef
    from islands.storage.rounds import checkpoint_metadata
    from islands.storage.store import Stores, sha256_hex
    from islands.tasks.train_phase import LearnerSession

    stores = Stores(f"file://{tmp_path}/{{bucket}}", ["north"])
    session = LearnerSession.__new__(LearnerSession)
    session.run, session.learner, session.region, session.stores = "run", "north-0", "north", stores
    session._scratch, session._scratch_made = SimpleNamespace(path=tmp_path), threading.Lock()
    gen = torch.Generator().manual_seed(0)
    held = {f"w{i}": torch.randn(130, 3, generator=gen) for i in range(3)}
    before = {n: t.clone() for n, t in held.items()}
    manifests, expected = [], held
    for round_ in (1, 2):
        data = encode_wire({n: torch.randn(t.shape, generator=gen) * 1e-2 for n, t in held.items()}, {}, "bf16")
        ref = ObjectRef(
            key=layout.update_key("run", round_, sha256_hex(data)), sha256=sha256_hex(data), bytes=len(data)
        )
        stores.global_.put_if_absent(ref.key, data)
        expected = apply_update(expected, decode(data)[0])
        model = SimpleNamespace(sha256=sha256_hex(encode_state(expected, checkpoint_metadata("run", round_))))
        manifests.append(SimpleNamespace(round=round_, update=ref, model=model))

    got = session.rebuilt(manifests, held)
    assert got is not None and all(torch.equal(got[n], expected[n]) for n in expected)
    assert all(torch.equal(held[n], before[n]) for n in held)  # the follower's round is not touched
    wrong = SimpleNamespace(round=1, update=manifests[0].update, model=manifests[1].model)
    assert session.rebuilt([wrong], held) is None  # round 1 rebuilt is not the model named
