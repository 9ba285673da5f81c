"""The `topk` codec: what it keeps, its size, every hostile form refused with its reason (and so
quarantined), error feedback with SparseLoCo's decay, and the way down: the chunked merge's
update is the whole-tensor encoding's bits, and θ_r = θ_{r−1} + decode(update)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from pydantic import ValidationError

from islands.core import sparse
from islands.core.compress import (
    compress_with_feedback,
    decode_one,
    from_wire,
    residual_state,
    split_residual,
    to_wire,
    wire_plan,
)
from islands.core.config import RunConfig, TopkSettings
from islands.core.merge import RESIDUAL_DTYPE, apply_update, encode_update, encode_update_chunk_
from islands.core.validate import parse_field
from islands.storage.codec import (
    CodecError,
    TensorFile,
    TensorFileWriter,
    decode,
    decode_state,
    encode,
    encode_state,
    encode_wire,
    read_header,
)
from islands.storage.rounds import update_metadata
from islands.tasks.collect import check_delta

RUN_TOPK = TopkSettings()  # the anchor's: k = 64 of 4096, 2-bit values, β = 0.95
SMALL = TopkSettings(chunk=256, k=16, value_bits=4)
SHAPES = [(1,), (10,), (255,), (256,), (1000,), (64, 129), (3, 0), (0,), (2, 3, 100)]
LAYOUTS = [
    TopkSettings(chunk=256, k=16, value_bits=2),
    TopkSettings(chunk=128, k=7, value_bits=4),  # k·bits and positions not whole bytes
    TopkSettings(chunk=64, k=64, value_bits=8),  # every value kept
    TopkSettings(chunk=2, k=1, value_bits=2),
]


def rand(shape, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def chunk_rows(t: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    flat = t.reshape(-1)
    return [flat[i : i + chunk] for i in range(0, flat.numel(), chunk)]


@pytest.mark.parametrize("settings", LAYOUTS, ids=lambda s: f"{s.chunk}-{s.k}-{s.value_bits}")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_chunk_keeps_its_k_largest_values_to_within_half_a_step(shape, settings):
    t = rand(shape, seed=len(shape) + sum(shape))
    wire = to_wire({"w": t}, "topk", settings)
    out = from_wire(wire, "topk")["w"]
    assert out.shape == t.shape and out.dtype == torch.float32
    half = 2 ** (settings.value_bits - 1)
    for src, got in zip(chunk_rows(t, settings.chunk), chunk_rows(out, settings.chunk)):
        kept = got != 0
        assert int(kept.sum()) == min(settings.k, src.numel())
        dropped = torch.cat([src[~kept].abs(), torch.zeros(1)])
        assert float(src[kept].abs().min()) >= float(dropped.max())  # the largest ones
        assert torch.equal(got[kept].sign(), src[kept].sign())
        peak = float(src.abs().max())
        step = float(torch.tensor(peak / half).to(torch.bfloat16))  # the scale as sent
        assert float((got[kept] - src[kept]).abs().max()) <= step / 2 + peak * 2**-8


def test_under_a_fifth_of_a_bit_per_parameter_at_the_anchors_settings(tmp_path):
    """k = 64 of 4096 with 2-bit values: 8 bits a position (Elias–Fano), 2 a value, 16 a chunk's
    scale, 0.16 bit a parameter; the whole object, header and all, well under half a bit."""
    layout = sparse.Layout.of(RUN_TOPK)
    assert sparse.bits_per_value(layout) == (64 * (8 + 2) + 16) / 4096
    tensors = {"wte.weight": rand((4096, 256)), "h.0.w": rand((1024, 1000), seed=1), "ln.b": rand(1000, seed=2)}
    numel = sum(t.numel() for t in tensors.values())
    data = encode(tensors, {"run": "r"}, "topk", RUN_TOPK)
    assert len(data) * 8 / numel < 0.17
    fp32 = encode(tensors, {"run": "r"}, "fp32")
    assert len(fp32) / len(data) > 190


def test_the_layout_is_checked_where_it_is_set():
    for bad in (
        {"chunk": 1000},
        {"chunk": 2**19},
        {"k": 0},
        {"k": 5000},
        {"value_bits": 3},
        {"beta": 0},
        {"beta": 1.5},
    ):
        with pytest.raises(ValidationError):
            RunConfig(topk=bad)
    config = RunConfig.model_validate({"codec": "topk", "update_codec": "topk", "topk": {"chunk": 1024, "k": 8}})
    assert (config.codec, config.topk.chunk, config.topk.k, config.topk.value_bits) == ("topk", 1024, 8, 2)
    assert parse_field("codec", "topk") == "topk"
    with pytest.raises(ValueError, match=r"\[topk\] settings"):  # never encoded with settings other than the run's
        to_wire({"w": rand(10)}, "topk")


# -- hostile forms ---------------------------------------------------------------------------


def elias_fano(positions: list[int], n: int) -> bytes:
    """The positions of one chunk of n values as the format spells them, written bit by bit here
    and in no order the encoder would check: low bits first, then the unary high bits."""
    k = len(positions)
    low = max(0, (n // k).bit_length() - 1)
    bits = [(p >> j) & 1 for p in positions for j in range(low)]
    high = [0] * (k + ((n - 1) >> low) + 1)
    for j, p in enumerate(positions):
        high[(p >> low) + j] = 1
    bits += high
    bits += [0] * (-len(bits) % 8)
    return bytes(sum(b << j for j, b in enumerate(bits[i : i + 8])) for i in range(0, len(bits), 8))


def forged(t: torch.Tensor, settings: TopkSettings, **parts: torch.Tensor) -> dict[str, torch.Tensor]:
    """`t`'s honest wire form under the name "w", with the given parts (by suffix) replaced."""
    wire = to_wire({"w": t}, "topk", settings)
    wire.update(("w" + suffix, part) for suffix, part in parts.items())
    return wire


def positions(*chunks: list[int], n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(elias_fano(c, n) for c in chunks)), dtype=torch.uint8)


ONE_CHUNK = TopkSettings(chunk=256, k=5)  # 5 low bits and 13 high: 38 bits, 5 bytes with 2 of padding


def test_the_positions_spelled_by_hand_are_the_encoders():
    t = torch.zeros(512)
    t[[3, 40, 41, 100, 255, 256, 300, 301, 400, 511]] = torch.arange(1.0, 11.0)
    got = to_wire({"w": t}, "topk", ONE_CHUNK)["w.idx"]
    assert torch.equal(got, positions([3, 40, 41, 100, 255], [0, 44, 45, 144, 255], n=256))


HOSTILE = {
    "out of range": ({"idx": positions([3, 40, 41, 200, 256], n=256)}, "position 256 out of range of a chunk of 256"),
    "repeated": ({"idx": positions([3, 40, 40, 100, 200], n=256)}, "a position is repeated"),
    "unsorted": ({"idx": positions([3, 41, 40, 100, 200], n=256)}, "positions are not sorted"),
    "too few ones": ({"idx": torch.zeros(5, dtype=torch.uint8)}, "codes 0 positions where k is 5"),
    "padding": (
        {"idx": positions([3, 40, 41, 100, 200], n=256) | torch.tensor([0, 0, 0, 0, 128], dtype=torch.uint8)},
        "padding bits are set",
    ),
    "value count": (
        {"val": torch.zeros(3, dtype=torch.uint8)},
        r"\.val must be 2 torch.uint8 values, got torch.uint8 \(3,\)",
    ),
    "positions of another k": ({"idx": positions(list(range(8)), n=256)}, r"\.idx must be 5 torch.uint8"),
    "scale count": ({"scale": torch.ones(2, dtype=torch.bfloat16)}, r"\.scale must be 1"),
    "NaN scale": ({"scale": torch.tensor([float("nan")], dtype=torch.bfloat16)}, "scale holds NaN"),
    "chunk not a power of two": ({"topk": torch.tensor([255, 5, 2])}, "chunk 255 is not a power of two"),
    "k above the chunk": ({"topk": torch.tensor([256, 300, 2])}, "k 300 outside"),
    "value bits": ({"topk": torch.tensor([256, 5, 3])}, "value bits 3 not one of 2, 4, 8"),
    "layout dtype": (
        {"topk": torch.tensor([256, 5, 2], dtype=torch.int32)},
        r"\.topk must be 3 torch.int64 values, got torch.int32",
    ),
    "shape": (
        {"shape": torch.tensor([16, 17])},
        r"\.idx must be 8 torch.uint8|wrong shape: \(16, 17\) instead of \(256,\)",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_every_hostile_form_is_refused_with_its_reason(tmp_path, case):
    """Decoded whole (storage.codec.decode), read in chunks by the synchronizer's own check
    (collect.check_delta, whose reason quarantines the delta), the same reason."""
    parts, reason = HOSTILE[case]
    t = rand(256)
    wire = forged(t, ONE_CHUNK, **{"." + suffix: part for suffix, part in parts.items()})
    data = encode_wire(wire, {"run": "r"}, "topk")
    with pytest.raises(CodecError, match=reason):
        decode(data)
    path = tmp_path / "delta"
    path.write_bytes(data)
    found, _ = check_delta(TensorFile(path, read_header(data)[1]["body_sha256"], ONE_CHUNK), {"w": t}, 128)
    assert found is not None and re.search(reason, found) and found.startswith("tensor 'w': "), found


def quarantined_reason(tmp_path, data: bytes, model: dict[str, torch.Tensor], run: TopkSettings, values: int = 2**18):
    path = tmp_path / "delta"
    path.write_bytes(data)
    return check_delta(TensorFile(path, read_header(data)[1]["body_sha256"], run), model, values)[0]


def test_a_delta_coded_otherwise_than_the_run_says_is_quarantined(tmp_path):
    model = {"w": rand((64, 100))}
    other = encode(model, {"run": "r"}, "topk", TopkSettings(chunk=1024, k=64))
    assert quarantined_reason(tmp_path, other, model, RUN_TOPK) == (
        "tensor 'w': coded with chunk 1024, k 64, 2-bit values, where the run sets chunk 4096, k 64, 2-bit values"
    )
    more = encode(model, {"run": "r"}, "topk", TopkSettings(k=128))
    assert "coded with chunk 4096, k 128" in quarantined_reason(tmp_path, more, model, RUN_TOPK)
    assert quarantined_reason(tmp_path, encode(model, {"run": "r"}, "topk", RUN_TOPK), model, RUN_TOPK) is None
    with pytest.raises(CodecError, match="where the run sets"):
        path = tmp_path / "delta"
        path.write_bytes(other)
        TensorFile(path, read_header(other)[1]["body_sha256"], RUN_TOPK).decoded("w")
    wrong_shape = encode({"w": rand((100, 64))}, {"run": "r"}, "topk", RUN_TOPK)
    assert (
        quarantined_reason(tmp_path, wrong_shape, model, RUN_TOPK)
        == "tensor 'w': wrong shape: (100, 64) instead of (64, 100)"
    )


def test_a_part_missing_or_a_stray_float_is_refused_before_any_is_read():
    wire = to_wire({"w": rand(300)}, "topk", SMALL)
    floats = {k: v.is_floating_point() for k, v in wire.items()}
    for gone in sparse.PARTS:
        with pytest.raises(ValueError, match=f"missing w{gone}" if gone != ".topk" else "no w.topk"):
            wire_plan({k: f for k, f in floats.items() if k != "w" + gone}, "topk")
    with pytest.raises(ValueError, match="a float tensor outside the topk wire form"):
        wire_plan({**floats, "x": True}, "topk")
    with pytest.raises(ValueError, match="wrong shape"):
        decode_one("w", {k: wire[k] for k in wire_plan(floats, "topk")["w"]}, "topk", (301,))
    with pytest.raises(ValueError, match="reserves"):
        to_wire({"w.val": rand(3)}, "topk", SMALL)


@pytest.mark.parametrize("values", [128, 256, 384, 1000, 2**18])
def test_any_run_of_values_reads_as_the_tensor_read_whole(tmp_path, values):
    """The merge's chunks need not be whole top-k chunks to be read: each run is cut from the
    top-k chunks that cover it."""
    tensors = {"a": rand((70, 33)), "b": rand(5, seed=1), "c": rand(0, seed=2)}
    data = encode(tensors, {"run": "r"}, "topk", SMALL)
    path = tmp_path / "delta"
    path.write_bytes(data)
    f = TensorFile(path, read_header(data)[1]["body_sha256"], SMALL)
    for name in tensors:
        whole = f.decoded(name).reshape(-1)
        chunks = list(f.chunks(name, values))
        assert torch.equal(torch.cat(chunks) if chunks else torch.empty(0), whole)


# -- error feedback ------------------------------------------------------------------------


def test_the_residual_keeps_what_was_not_sent_after_beta_decays_the_old():
    """sent + new residual = delta + β·old residual, the residual being exactly their difference;
    β = 1 is plain error feedback (delta + old residual)."""
    delta, old = {"w": rand((40, 100))}, {"w": rand((40, 100), seed=1)}
    for beta in (0.95, 1.0):
        settings = TopkSettings(chunk=512, k=16, beta=beta)
        wire, sent, residual = compress_with_feedback(delta, old, "topk", settings)
        target = delta["w"].add(old["w"], alpha=beta)
        assert beta != 1.0 or torch.equal(target, delta["w"] + old["w"])
        assert torch.equal(sent["w"], from_wire(wire, "topk")["w"])
        assert torch.equal(residual["w"], target - sent["w"])
        assert torch.allclose(sent["w"] + residual["w"], target, rtol=0, atol=1e-12)


def test_with_beta_one_the_sum_of_what_was_sent_tracks_the_sum_of_the_deltas():
    settings = TopkSettings(chunk=256, k=8, beta=1.0)
    residual, sent_total, true_total = {}, torch.zeros(2000), torch.zeros(2000)
    for phase in range(50):
        delta = {"w": rand(2000, seed=phase)}
        _, sent, residual = compress_with_feedback(delta, residual, "topk", settings)
        sent_total += sent["w"]
        true_total += delta["w"]
    assert torch.allclose(sent_total + residual["w"], true_total, atol=1e-6)
    assert float((sent_total - true_total).norm()) < 0.5 * float(true_total.norm())


def test_a_resumed_learner_sends_what_an_uninterrupted_one_does():
    """The residual saved in the learner's state (exactly, float32) and read back gives the next
    delta's very bytes."""
    deltas = [{"wte.weight": rand((64, 300), seed=p), "ln.b": rand(7, seed=100 + p)} for p in range(4)]
    residual, straight = {}, []
    for d in deltas:
        wire, _, residual = compress_with_feedback(d, residual, "topk", RUN_TOPK)
        straight.append(encode_wire(wire, {"run": "r"}, "topk"))
    residual = {}
    for p, d in enumerate(deltas):
        wire, _, residual = compress_with_feedback(d, residual, "topk", RUN_TOPK)
        assert encode_wire(wire, {"run": "r"}, "topk") == straight[p]
        state = decode_state(encode_state({"opt.step": torch.tensor(p), **residual_state(residual)}))
        residual = split_residual(state)[1]  # what a learner restarted after this phase holds


# -- the way down ----------------------------------------------------------------------------


def chunked_update(params, target, residual, settings, values: int, tmp_path):
    """The update as the synchronizer's streaming merge writes it: each tensor a run of `values`
    at a time through encode_update_chunk_ and TensorFileWriter.coded."""
    rebuilt, left = {}, {}
    tmp_path.mkdir(exist_ok=True)
    with TensorFileWriter(tmp_path / "update") as writer:
        for name, param in params.items():
            flat_p, flat_t = param.reshape(-1), target[name].reshape(-1)
            flat_r = residual[name].reshape(-1) if name in residual else None
            streams, theta, kept = None, [], []
            for start in range(0, flat_p.numel(), values):
                stop = min(flat_p.numel(), start + values)
                parts, theta_part, kept_part = encode_update_chunk_(
                    name,
                    flat_p[start:stop].clone(),
                    flat_t[start:stop].clone(),
                    None if flat_r is None else flat_r[start:stop],
                    "topk",
                    settings,
                )
                streams = streams or writer.coded(name, list(param.shape), parts)
                for key, stream in streams.items():
                    stream.write(parts[key])
                theta.append(theta_part)
                kept.append(kept_part)
            for stream in streams.values():
                stream.close()
            rebuilt[name], left[name] = torch.cat(theta).view(param.shape), torch.cat(kept).view(param.shape)
        return writer.finish(update_metadata("run-x", 1, "topk")).read_bytes(), rebuilt, left


@pytest.mark.parametrize("settings", [RUN_TOPK, SMALL], ids=["anchor", "small"])
def test_the_chunked_update_is_the_whole_tensor_encodings_bits(tmp_path, settings):
    """Bit for bit: the update object, θ_r and the residual, whether the synchronizer encodes a
    run of values at a time or `audit --replay` a tensor at once; and θ_r = θ_{r−1} + decode(update)."""
    shapes = {"wte.weight": (300, 77), "h.0.w": (4096,), "ln.b": (5,)}
    params = {n: rand(s, seed=i) * 20 for i, (n, s) in enumerate(shapes.items())}
    target = {n: p + rand(p.shape, seed=10 + i) for i, (n, p) in enumerate(params.items())}
    residual = {n: rand(p.shape, seed=20 + i).to(RESIDUAL_DTYPE) for i, (n, p) in enumerate(params.items())}
    wire, want_model, want_residual = encode_update(params, target, residual, "topk", settings)
    want = encode_wire(wire, update_metadata("run-x", 1, "topk"), "topk")
    for values in (settings.chunk, 4 * settings.chunk, 2**18):
        got, model, left = chunked_update(params, target, residual, settings, values, tmp_path / str(values))
        assert got == want
        assert all(torch.equal(model[n], want_model[n]) for n in params)
        assert all(torch.equal(left[n], want_residual[n]) for n in params)
    held = apply_update(params, decode(want)[0])
    assert all(torch.equal(held[n].view(torch.int32), want_model[n].view(torch.int32)) for n in params)


def test_a_merge_chunk_that_splits_a_topk_chunk_is_refused_not_written(tmp_path):
    """In a run, synchronizer.chunk_mb makes every merge chunk whole top-k chunks (topk.chunk is
    at most 2^18 values, a power of two); a chunk that is not would write a tensor of the wrong
    size, and the writer refuses it."""
    params, target = {"w": rand(1000)}, {"w": rand(1000, seed=1)}
    with pytest.raises(ValueError, match="its shape needs"):
        chunked_update(params, target, {}, SMALL, 300, tmp_path)


def test_topk_chunks_divide_every_merge_chunk():
    assert all(2**18 % TopkSettings(chunk=2**e, k=1).chunk == 0 for e in range(1, 19))
    assert math.log2(RUN_TOPK.chunk).is_integer()
