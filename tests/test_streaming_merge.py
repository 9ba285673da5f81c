"""The synchronizer's streaming data path: deltas spooled to disk and merged tensor by tensor give
the same bits as the whole-dict merge, refuse the same hostile bytes with the same reasons, and
hold one tensor at a time however many deltas there are."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
import weakref

import torch

from islands.core.compress import residual_state, split_residual, to_wire
from islands.core.config import RunConfig
from islands.core.merge import encode_update, merge_round
from islands.core.model import build_model
from islands.storage import layout
from islands.storage.codec import TensorFile, decode, decode_state, encode, encode_state, encode_wire
from islands.storage.manifest import Excluded
from islands.storage.rounds import checkpoint_metadata, get_tensors, put_tensors, update_metadata
from islands.storage.spool import remove_dead, spool_prefix
from islands.storage.store import Stores, sha256_hex
from islands.tasks.collect import Arrival, inspect, inspect_all
from islands.tasks.merge_step import Merged, all_finite, apply_merge
from islands.tasks.publish import write_objects
from islands.tasks.round_state import RoundState

RUN = "stream"
REGIONS = ["east", "west"]


def config(k: int) -> RunConfig:
    return RunConfig(run_id=RUN, regions=REGIONS, learners_per_region=k // 2, speed={})


def params(seed: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in build_model("tiny", 0).state_dict().items()}


def meta(learner: str, region: str, phase: int = 0, tokens: int = 1000) -> dict:
    return {
        "run": RUN,
        "learner": learner,
        "region": region,
        "phase": phase,
        "base_round": 0,
        "inner_steps": 5,
        "tokens": tokens,
        "loss": 2.5,
        "seconds": 1.0,
        "finished_at": time.time(),
    }


def round_state(tmp_path, k: int, codec: str = "fp32"):
    """θ, momentum and K deltas in file:// buckets; the round state and each delta's bytes."""
    stores = Stores(f"file://{tmp_path}/{{bucket}}", REGIONS)
    conf = config(k)
    written = {}
    for i, (learner, region, _) in enumerate(conf.learners()):
        data = encode(params(10 + i, 1e-3), meta(learner, region, tokens=1000 + 100 * i), codec)
        key = layout.delta_key(RUN, learner, 0)
        stores.region(region).put_if_absent(key, data)
        written[(region, key)] = data
    state = RoundState(conf, RUN, 1, stores, [], params(1, 0.02), params(2, 1e-3))
    return state, written


def test_streaming_merge_gives_the_whole_dict_merges_bits(tmp_path):
    for codec in ("fp32", "int8"):
        state, written = round_state(tmp_path / codec, 4, codec)
        parent_model = {k: v.clone() for k, v in state.model.items()}
        parent_momentum = {k: v.clone() for k, v in state.momentum.items()}
        arrivals = inspect_all(state, [(region, key, len(data)) for (region, key), data in written.items()])
        assert all(isinstance(a, Arrival) for a in arrivals), arrivals
        model_object, update, outer, weighted, _ = apply_merge(state, arrivals, state.config.merge)
        assert all(torch.equal(state.model[k], parent_model[k]) for k in parent_model)  # left as it was
        model = decode_state(model_object.read_bytes())
        momentum = split_residual(decode_state(outer.read_bytes()))[0]

        by_learner = {a.learner: decode(written[(a.region, a.key)])[0] for a in arrivals}
        target, want_momentum = merge_round(
            parent_model,
            parent_momentum,
            [by_learner[w.candidate.learner] for w in weighted],
            [w.weight for w in weighted],
            state.config.merge,
        )
        want_update, want_model, want_residual = encode_update(parent_model, target, {}, state.config.update_codec)
        for name in want_model:
            assert torch.equal(model[name], want_model[name]), name
            assert torch.equal(momentum[name], want_momentum[name]), name
        codec_u = state.config.update_codec
        assert update.read_bytes() == encode_wire(want_update, update_metadata(RUN, 1, codec_u), codec_u)
        assert update.sha256 == sha256_hex(update.read_bytes()) and update.size == len(update.read_bytes())
        want_model_bytes = encode_state(want_model, checkpoint_metadata(RUN, 1))
        assert model_object.read_bytes() == want_model_bytes and model_object.sha256 == sha256_hex(want_model_bytes)
        want_outer = encode_state({**want_momentum, **residual_state(want_residual)}, checkpoint_metadata(RUN, 1))
        assert outer.read_bytes() == want_outer and outer.sha256 == sha256_hex(want_outer)
        for a in arrivals:  # every merged tensor's spooled bytes were handed back as the merge went
            assert a.delta.released == set(a.delta.names), a.learner
        state.drop_spool()


def test_all_finite_is_exact_where_a_sum_overflows_or_propagates():
    big = torch.full((1000,), 3e38)  # finite values whose float32 sum is inf
    assert all_finite(big) and all_finite(-big) and all_finite(torch.zeros(0))
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(4096)
        t[1234] = bad
        assert not all_finite(t)
        assert not all_finite(torch.cat([big, t]))
    plus_minus = torch.randn(4096)
    plus_minus[7], plus_minus[9] = float("inf"), float("-inf")  # a sum of nan
    assert not all_finite(plus_minus)


def test_checkpoints_written_from_files_are_the_canonical_bytes(tmp_path):
    stores = Stores(f"file://{tmp_path}/{{bucket}}", [])
    tensors = {**params(3, 0.02), "step": torch.arange(3), "half": torch.ones(4, dtype=torch.bfloat16)}
    ref = put_tensors(stores.global_, lambda sha: f"m-{sha[:16]}", tensors, {"run": RUN})
    expected = encode_state(tensors, {"run": RUN})
    assert stores.global_.get(ref.key) == expected and ref.sha256 == sha256_hex(expected)
    assert put_tensors(stores.global_, lambda sha: f"m-{sha[:16]}", tensors, {"run": RUN}) == ref
    back = get_tensors(stores.global_, ref)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


def test_the_rounds_three_objects_go_up_side_by_side_as_merged(tmp_path, monkeypatch):
    """write_objects starts all three uploads before any ends (each waits here for the other two
    to begin), and what lands is the merge's bytes under their content addresses."""
    state, written = round_state(tmp_path, 2)
    arrivals = inspect_all(state, [(region, key, len(data)) for (region, key), data in written.items()])
    model_object, update, outer, _, _ = apply_merge(state, arrivals, state.config.merge)
    store, started = state.stores.global_, threading.Barrier(3, timeout=30)
    put = store.put_or_verify

    def put_when_all_started(key, data):
        started.wait()  # raises BrokenBarrierError when the uploads run one after another
        return put(key, data)

    monkeypatch.setattr(store, "put_or_verify", put_when_all_started)
    refs = write_objects(state, Merged(None, model_object, update, outer, [], []))
    for ref, obj in zip(refs, (model_object, update, outer)):
        assert ref.sha256 == obj.sha256 and store.get(ref.key, sha256=obj.sha256) == obj.read_bytes()
    assert [ref.key for ref in refs] == [
        layout.model_key(RUN, 1, model_object.sha256),
        layout.update_key(RUN, 1, update.sha256),
        layout.outer_key(RUN, 1, outer.sha256),
    ]
    state.drop_spool()


def _flip_tensor_bytes(data: bytes) -> bytes:
    out = bytearray(data)
    out[-100] ^= 0x10
    return bytes(out)


def _hostile() -> dict[str, tuple[bytes, str]]:
    """Objects for east-0 phases 1…: bytes and the quarantine reason each must get."""
    honest = params(20, 1e-3)
    name = sorted(honest)[0]

    def good(phase, tensors=honest, codec="fp32", **m):
        return encode(tensors, {**meta("east-0", "east", phase), **m}, codec)

    int8 = good(6, codec="int8")
    wire = to_wire(honest, "int8")
    short_scale = encode_wire({**wire, name + ".scale": torch.ones(1)}, meta("east-0", "east", 7), "int8")
    return {
        "truncated": (good(1)[: len(good(1)) // 2], "does not fit the object"),
        "flipped tensor bytes": (_flip_tensor_bytes(good(2)), "do not match the body_sha256"),
        "NaN": (good(3, {**honest, name: torch.full(honest[name].shape, float("nan"))}), "non-finite"),
        "wrong shape": (good(4, {**honest, name: torch.zeros(3, 3)}), "wrong shape"),
        "wrong run": (good(5, run="other"), "wrong run id"),
        "unknown codec": (int8.replace(b'"codec":"int8"', b'"codec":"int9"'), "unknown codec"),
        "int8 scale of the wrong length": (short_scale, "scale must be"),
    }


def test_hostile_deltas_are_quarantined_with_their_reason_and_leave_no_spool_file(tmp_path):
    state, _ = round_state(tmp_path, 2)
    store = state.stores.region("east")
    for phase, (label, (data, reason)) in enumerate(_hostile().items(), start=1):
        key = layout.delta_key(RUN, "east-0", phase)
        store.put_if_absent(key, data)
        got = inspect(state, "east", key, len(data))
        assert isinstance(got, Excluded) and got.kind == "quarantined", label
        assert reason in got.reason, (label, got.reason)
    assert list(state.spool_dir.iterdir()) == []
    state.drop_spool()


def test_a_killed_synchronizers_spool_is_removed_by_the_next_one(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    holder = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); time.sleep(60)"
    dead = tmp_path / f"islands-spool-{RUN}-round000003-ab_1"
    other_run = tmp_path / f"islands-spool-{RUN}-2-round000003-ab_1"
    live = tmp_path / f"islands-spool-{RUN}-round000003-cd_2"
    for folder in (dead, other_run, live):
        folder.mkdir()
        (folder / "east.east-0.000003.safetensors").write_bytes(b"spooled")
    owner = subprocess.Popen([sys.executable, "-c", holder, str(live)], stdout=subprocess.PIPE)
    try:
        owner.stdout.readline()  # it holds the live folder's lock now
        state, _ = round_state(tmp_path / "buckets", 2)
        mine = state.spool_dir
        assert not dead.exists() and other_run.exists() and live.exists()
        assert mine.parent == tmp_path and f"{RUN}-round000001-" in mine.name
        assert remove_dead(spool_prefix(RUN)) == []  # this process is alive: its spool stays
        state.drop_spool()
        assert not mine.exists()
    finally:
        owner.kill()
        owner.wait()
    assert remove_dead(spool_prefix(RUN)) == [live]  # its owner is gone: nobody holds the lock


def _peak_live_decoded_bytes(tmp_path, k: int, monkeypatch) -> tuple[int, int]:
    """(most decoded delta bytes alive at once during collect and merge, a chunk's bytes)."""
    live, peak = [0], [0]
    real = TensorFile.chunks

    def count(t):
        size = t.numel() * t.element_size()
        live[0] += size
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, lambda: live.__setitem__(0, live[0] - size))
        return t

    def counted(self, name, values, shape_wanted=None):
        return map(count, real(self, name, values, shape_wanted))  # holds no chunk of its own

    monkeypatch.setattr(TensorFile, "chunks", counted)
    monkeypatch.setattr(RoundState, "chunk_values", property(lambda self: 1000))  # 896: seven blocks
    state, written = round_state(tmp_path / f"k{k}", k)
    arrivals = [inspect(state, region, key, len(data)) for (region, key), data in written.items()]
    assert live[0] == 0, "an arrival holds decoded tensors"
    apply_merge(state, arrivals, state.config.merge)
    state.drop_spool()
    return peak[0], 896 * 4


def test_memory_does_not_grow_with_the_number_of_deltas(tmp_path, monkeypatch):
    peak_2, chunk = _peak_live_decoded_bytes(tmp_path, 2, monkeypatch)
    peak_8, _ = _peak_live_decoded_bytes(tmp_path, 8, monkeypatch)
    assert peak_8 == peak_2
    assert peak_8 <= 2 * chunk  # the chunk being added and, briefly, the one before it
