"""int8/int4/int3/int2 deltas: error bounds, exact packing, deflated integers, error feedback without
drift, hostile parts refused."""

import typing
import zlib

import pytest
import torch
from pydantic import ValidationError

from islands.core.codecs import CODECS, FLOAT_CODECS, INTEGER_CODECS, SPARSE_CODECS
from islands.core.compress import (
    BITS,
    BLOCK,
    FLOAT_WIRE,
    TERNARY_THRESHOLD,
    compress_with_feedback,
    decode_one,
    dequantize,
    from_wire,
    integer_bytes,
    levels,
    pack,
    quantize,
    residual_state,
    split_residual,
    to_wire,
    unpack,
)
from islands.core.config import RunConfig
from islands.storage.codec import CodecError, decode, encode, encode_wire, packed

META = {"run": "run-abc", "learner": "us-east-0", "phase": "3"}


def delta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "wte.weight": torch.randn(256, 128, generator=g) * 1e-3,
        "blocks.0.ln_1.bias": torch.randn(130, generator=g) * 1e-5,  # not a multiple of the block
        "scalar": torch.tensor(0.25),
        "zeros": torch.zeros(3, 5),
        "step": torch.arange(4, dtype=torch.int64),
    }


@pytest.mark.parametrize("codec", FLOAT_CODECS + INTEGER_CODECS)
def test_every_codec_name_round_trips_through_the_wire(codec):
    """Each dense codec's name is one the wire writes and reads back, to within what its format
    keeps: a float's rounding, or a step of its integers (int2, with one level, may miss by a
    block's peak). The sparse one keeps only some values: tests/test_sparse.py."""
    src = delta()
    out, meta = decode(encode(src, META, codec))
    assert meta["codec"] == codec and set(out) == set(src)
    assert torch.equal(out["step"], src["step"])
    for name, t in src.items():
        if t.is_floating_point():
            peak = t.abs().max()
            bound = peak / levels(BITS[codec]) if codec in BITS else peak * torch.finfo(FLOAT_WIRE[codec]).eps
            assert out[name].dtype == torch.float32 and out[name].shape == t.shape
            assert (out[name] - t).abs().max() <= bound, name


def test_the_wire_and_the_configuration_know_the_same_codecs():
    assert (*FLOAT_WIRE, *BITS, *SPARSE_CODECS) == CODECS
    for field in ("codec", "update_codec"):
        assert typing.get_args(RunConfig.model_fields[field].annotation) == CODECS
        for codec in CODECS:
            assert getattr(RunConfig(**{field: codec}), field) == codec
        with pytest.raises(ValidationError):
            RunConfig(**{field: "int5"})


@pytest.mark.parametrize("codec", ["int8", "int4", "int3"])
def test_round_trip_error_is_within_half_a_level_of_each_blocks_scale(codec):
    src = delta()
    out, meta = decode(encode(src, META, codec))
    assert meta["codec"] == codec and set(out) == set(src)
    assert torch.equal(out["step"], src["step"])
    bits = {"int8": 8, "int4": 4, "int3": 3}[codec]
    for name, t in src.items():
        if not t.is_floating_point():
            continue
        assert out[name].dtype == torch.float32 and out[name].shape == t.shape
        flat = torch.nn.functional.pad(t.reshape(-1), (0, -t.numel() % BLOCK)).view(-1, BLOCK)
        # Half a level of the scale as sent: bfloat16 rounds the scale by at most 2^-8 of it.
        bound = flat.abs().amax(dim=1) / levels(bits) / 2 * (1 + 2**-8 + 1e-6)
        err = torch.nn.functional.pad((out[name] - t).reshape(-1), (0, -t.numel() % BLOCK)).view(-1, BLOCK).abs()
        assert (err <= bound[:, None]).all(), name
    assert torch.equal(out["zeros"], src["zeros"])


def test_int2_sends_each_blocks_large_values_as_their_mean_and_loses_under_a_fifth():
    torch.manual_seed(0)
    t = torch.randn(64 * 1024) * 0.01
    q, scale = quantize(t, 2)
    out = dequantize(q, scale, list(t.shape), 2)
    blocks, got = t.view(-1, BLOCK), out.view(-1, BLOCK)
    mag = blocks.abs()
    sent = mag > TERNARY_THRESHOLD * mag.mean(dim=1, keepdim=True)
    assert torch.equal(got != 0, sent) and torch.equal(got.sign(), blocks.sign() * sent)
    mean_sent = (mag * sent).sum(dim=1) / sent.sum(dim=1)
    assert torch.allclose(got.abs().amax(dim=1), mean_sent, rtol=2**-8)  # the scale, rounded to bfloat16
    assert float((out - t).pow(2).sum() / t.pow(2).sum()) < 0.2
    zeros = dequantize(*quantize(torch.zeros(100), 2), [100], 2)
    assert torch.equal(zeros, torch.zeros(100))
    broken = torch.zeros(100)
    broken[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):  # never sent as zeros: the receiver refuses it
        dequantize(*quantize(broken, 2), [100], 2)


@pytest.mark.parametrize("codec,ratio", [("int8", 3.5), ("int4", 6.5), ("int3", 8.5), ("int2", 12.5)])
def test_quantized_deltas_are_that_much_smaller_than_fp32(codec, ratio):
    src = {"w": torch.randn(512, 512)}
    assert len(encode(src, META, "fp32")) / len(encode(src, META, codec)) > ratio


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_packing_is_exact_for_every_value_and_position(bits):
    low = -(2 ** (bits - 1))
    values = torch.arange(low, -low, dtype=torch.int8).repeat_interleave(16)
    values = values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(1))]
    packed = pack(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == values.numel() * bits // 8
    assert torch.equal(unpack(packed, bits), values)


def test_packing_puts_the_first_value_in_the_lowest_bits():
    assert pack(torch.tensor([-8, 7], dtype=torch.int8), 4).item() == 0xF0
    assert pack(torch.tensor([-2, -1, 0, 1], dtype=torch.int8), 2).item() == 0b11_10_01_00
    # int3: eight values in a 24-bit word, its low byte first.
    word = sum((v + 4) << (3 * i) for i, v in enumerate(range(-4, 4)))
    assert pack(torch.arange(-4, 4, dtype=torch.int8), 3).tolist() == [word & 255, word >> 8 & 255, word >> 16]
    with pytest.raises(ValueError, match="multiple of 4"):
        pack(torch.zeros(6, dtype=torch.int8), 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(torch.zeros(12, dtype=torch.int8), 3)


def test_quantize_uses_the_full_range_and_rounds_symmetrically():
    t = torch.linspace(-1, 1, BLOCK)
    q, scale = quantize(t, 8)
    assert q.min().item() == -127 and q.max().item() == 127
    assert scale.dtype == torch.bfloat16 and torch.equal(scale, torch.tensor([1 / 127], dtype=torch.bfloat16))


def test_scales_in_another_dtype_are_refused():
    t = torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(4))
    q, scale = quantize(t, 8)
    with pytest.raises(ValueError, match="scale must be 3 bfloat16 values"):
        dequantize(q, scale.float(), [3 * BLOCK], 8)


@pytest.mark.parametrize("codec,bits", BITS.items())
def test_error_feedback_keeps_the_sum_of_sent_updates_on_the_sum_of_true_deltas(codec, bits):
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(64, 64, generator=g) * 1e-4  # a consistent direction, as in training
    true_sum = torch.zeros(64, 64)
    sent_fb = torch.zeros(64, 64)
    sent_plain = torch.zeros(64, 64)
    residual: dict = {}
    worst_gap = largest = 0.0
    for _ in range(300):
        d = {"w": bias + torch.randn(64, 64, generator=g) * 1e-3}
        true_sum += d["w"]
        wire, decoded, residual = compress_with_feedback(d, residual, codec)
        received = decode(encode_wire(wire, META, codec))[0]["w"]
        assert torch.equal(received, decoded["w"])  # what the sender rebuilds from is what arrives
        sent_fb += received
        sent_plain += decode(encode(d, META, codec))[0]["w"]
        # The books balance at every step: what was sent plus what is held back is what was trained.
        assert torch.allclose(sent_fb + residual["w"], true_sum, atol=1e-5)
        worst_gap = max(worst_gap, (sent_fb - true_sum).abs().max().item())
        largest = max(largest, d["w"].abs().max().item())
    # Bounded drift: after 300 steps the gap is still within about one quantization level of one
    # step's largest value, while without feedback the errors pile up.
    assert worst_gap <= 1.5 * largest / levels(bits)
    assert (sent_fb - true_sum).norm() < (sent_plain - true_sum).norm() / 3


def test_fp32_needs_no_residual_and_the_residual_round_trips_through_the_learner_state():
    d = delta()
    wire, decoded, residual = compress_with_feedback(d, {}, "fp32")
    assert residual == {} and torch.equal(from_wire(wire, "fp32")["wte.weight"], d["wte.weight"])
    assert torch.equal(decoded["wte.weight"], d["wte.weight"])
    floats = {k: v for k, v in d.items() if v.is_floating_point()}
    _, _, residual = compress_with_feedback(floats, {}, "int4")
    state = {"opt.step": torch.tensor(3), **residual_state(residual)}
    assert set(state) - {"opt.step"} == {f"codec.residual.{n}" for n in floats}
    rest, back = split_residual(state)
    assert set(rest) == {"opt.step"} and all(torch.equal(back[n], residual[n]) for n in floats)


# -- hostile parts -------------------------------------------------------------------------------


def hostile(codec: str, **changes) -> bytes:
    wire = to_wire({"w": torch.randn(10, 13)}, codec)
    for name, value in changes.items():
        if name in ("q", "z"):  # the integers, packed or deflated: the one given replaces either
            wire.pop("w.q", None)
            wire.pop("w.z", None)
        key = "w." + name
        if value is None:
            del wire[key]
        else:
            wire[key] = value
    return encode_wire(wire, META, codec)


n_blocks = -(-130 // BLOCK)


@pytest.mark.parametrize("codec", INTEGER_CODECS)
@pytest.mark.parametrize(
    "changes,reason",
    [
        ({"scale": torch.full((n_blocks,), float("nan"), dtype=torch.bfloat16)}, "NaN"),
        ({"scale": torch.tensor([1.0] * (n_blocks - 1) + [float("inf")], dtype=torch.bfloat16)}, "NaN, Inf"),
        ({"scale": -torch.ones(n_blocks, dtype=torch.bfloat16)}, "negative"),
        ({"scale": torch.ones(n_blocks + 1)}, "scale must be"),
        ({"scale": torch.ones(n_blocks, dtype=torch.float64)}, "scale must be"),
        ({"scale": torch.ones(n_blocks, 1)}, "scale must be"),
        ({"shape": torch.tensor([10, 40])}, "integers must be"),
        ({"shape": torch.tensor([10, -13])}, "not a tensor shape"),
        ({"shape": torch.tensor([10.0, 13.0])}, "1-D int64"),
        ({"q": torch.zeros(3, dtype=torch.int8)}, "integers must be"),
        ({"scale": None}, "missing w.scale"),
        ({"shape": None}, "missing w.shape"),
    ],
)
def test_hostile_parts_are_refused_with_a_codec_error(codec, changes, reason):
    with pytest.raises(CodecError, match=reason):
        decode(hostile(codec, **changes))


def as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("codec", INTEGER_CODECS)
@pytest.mark.parametrize(
    "stream,reason",
    [
        (lambda n: zlib.compress(bytes(100 * n + 10**6)), "inflate to more than the"),
        (lambda n: zlib.compress(bytes(n))[:-6], "cut short"),
        (lambda n: zlib.compress(bytes(n)) + b"more", "followed by other bytes"),
        (lambda n: b"not deflate at all", "not a deflate stream"),
    ],
)
def test_hostile_deflated_integers_are_refused_without_inflating_past_their_shape(codec, stream, reason):
    n = integer_bytes(130, BITS[codec])
    with pytest.raises(CodecError, match=reason):
        decode(hostile(codec, z=as_bytes(stream(n))))


def test_deflated_integers_must_be_bytes_and_come_alone():
    with pytest.raises(CodecError, match="1-D uint8"):
        decode(hostile("int4", z=torch.zeros(4, dtype=torch.int16)))
    wire = to_wire({"w": torch.randn(10, 13)}, "int4")
    q, _ = quantize(torch.randn(10, 13), 4)
    with pytest.raises(CodecError, match="both w.q and w.z"):
        decode(encode_wire({**wire, "w.q": q}, META, "int4"))


def test_a_reader_that_knows_the_shape_refuses_a_larger_one_before_inflating():
    """A few kB of deflated zeros can declare a tensor of a GB: the shape is checked first."""
    n = 2**28
    bomb = {
        "w.z": as_bytes(zlib.compress(bytes(n // 2))),
        "w.scale": torch.zeros(n // BLOCK, dtype=torch.bfloat16),
        "w.shape": torch.tensor([n]),
    }
    with pytest.raises(ValueError, match=r"wrong shape: \(268435456,\) instead of \(10, 13\)"):
        decode_one("w", bomb, "int4", shape_wanted=(10, 13))


@pytest.mark.parametrize("codec", INTEGER_CODECS)
def test_a_pseudo_gradients_integers_go_deflated_and_decode_to_the_same_values(codec):
    t = torch.randn(256, 128, generator=torch.Generator().manual_seed(3)) * 1e-3  # values crowd near zero
    q, scale = quantize(t, BITS[codec])
    wire = to_wire({"w": t}, codec)
    assert "w.q" not in wire and wire["w.z"].dtype == torch.uint8
    assert wire["w.z"].numel() < 0.95 * q.numel() * q.element_size()
    assert torch.equal(wire["w.scale"], scale)
    assert torch.equal(
        from_wire(wire, codec)["w"],
        dequantize(q, scale, [256, 128], BITS[codec]),
    )


def test_integers_that_do_not_shrink_stay_packed_and_packed_objects_still_decode():
    t = torch.linspace(-1, 1, 256)[
        torch.randperm(256, generator=torch.Generator().manual_seed(0))
    ]  # every int8 level once or twice
    wire = to_wire({"w": t}, "int8")
    assert "w.z" not in wire and torch.equal(wire["w.q"], quantize(t, 8)[0])
    small = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e-3
    q, scale = quantize(small, 4)
    packed = {
        "v.q": q,
        "v.scale": scale,
        "v.shape": torch.tensor([1000]),
    }  # as a tensor whose integers do not shrink is sent
    out, _ = decode(encode_wire(packed, META, "int4"))
    assert torch.equal(out["v"], dequantize(q, scale, [1000], 4))


def test_objects_of_the_same_integers_deflated_differently_are_the_same_once_packed(monkeypatch):
    src = delta()
    fast = encode(src, META, "int4")
    monkeypatch.setattr("islands.core.compress.DEFLATE_LEVEL", 9)
    slow = encode(src, META, "int4")
    assert fast != slow and packed(fast) == packed(slow)
    assert torch.equal(decode(fast)[0]["wte.weight"], decode(slow)[0]["wte.weight"])
    other = encode({**src, "wte.weight": src["wte.weight"] * 1.5}, META, "int4")
    assert packed(other) != packed(slow)
    assert b'"wte.weight.q"' in packed(slow) and b'"wte.weight.z"' not in packed(slow)


def test_orphan_parts_and_stray_floats_are_refused():
    wire = to_wire({"w": torch.randn(8)}, "int8")
    with pytest.raises(CodecError, match="no v.q"):
        decode(encode_wire({**wire, "v.scale": torch.ones(1)}, META, "int8"))
    with pytest.raises(CodecError, match="float tensor outside"):
        decode(encode_wire({**wire, "raw": torch.ones(2)}, META, "int8"))
    with pytest.raises(CodecError, match="unknown codec 'int5'"):
        decode(encode_wire(wire, META, "int8").replace(b'"codec":"int8"', b'"codec":"int5"'))


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("numel", [0, 1, 64, 100, 256, 1000])
def test_every_size_decodes_to_each_value_times_its_blocks_scale(bits, numel):
    t = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    q, scale = quantize(t, bits)
    assert scale.numel() == -(-numel // BLOCK)
    ints = unpack(q, bits) if bits < 8 else q
    expected = ints.float()[:numel] * scale.float().repeat_interleave(BLOCK)[:numel]
    assert torch.equal(dequantize(q, scale, [numel], bits), expected)


def test_dequantize_refuses_q_of_the_wrong_codec():
    q, scale = quantize(torch.randn(BLOCK), 8)
    with pytest.raises(ValueError, match="integers must be"):
        dequantize(q, scale, [BLOCK], 4)


def test_reserved_suffixes_cannot_be_parameter_names():
    with pytest.raises(ValueError, match="reserves"):
        encode({"w.q": torch.ones(2)}, META, "int4")
