"""Tensors on the wire: round trips, and every refusal of untrusted bytes as a CodecError."""

import hashlib
import json
import os
import pickle
import struct
import sys

import pytest
import torch
from pydantic import ValidationError

from islands.core.config import RunConfig
from islands.storage.codec import (
    MAX_HEADER_BYTES,
    CodecError,
    TensorFile,
    TensorFileWriter,
    decode,
    decode_state,
    encode,
    encode_state,
    encode_state_object,
    read_header,
)
from islands.storage.manifest import Contribution, Excluded, Manifest, ObjectRef, Quorum, RoundSettings
from islands.storage.store import sha256_hex

META = {
    "run": "run-abc",
    "learner": "us-east-0",
    "region": "us-east",
    "phase": "3",
    "base_round": "2",
    "inner_steps": "50",
    "tokens": "65536",
    "loss": "2.75",
}


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "wte.weight": torch.randn(16, 8, generator=g),
        "ln.bias": torch.randn(8, generator=g) * 1e-3,
        "step": torch.arange(5, dtype=torch.int64),
    }


def raw(header: dict, body: bytes) -> bytes:
    """A safetensors-shaped object from a header and body, with no checks."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def header_length(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


# -- round trips --------------------------------------------------------------------------------


def test_fp32_round_trip_is_exact_with_metadata():
    src = tensors()
    data = encode(src, {**META, "finished_at": 1.5}, codec="fp32")
    out, meta = decode(data)
    assert set(out) == set(src)
    for name in src:
        assert out[name].dtype == src[name].dtype
        assert torch.equal(out[name], src[name])
    assert meta.pop("body_sha256") == hashlib.sha256(data[8 + header_length(data) :]).hexdigest()
    assert meta == {**META, "finished_at": "1.5", "codec": "fp32"}
    header, header_meta = read_header(data)
    assert header["wte.weight"]["dtype"] == "F32"
    assert header_meta["codec"] == "fp32"


def test_bf16_round_trip_within_bf16_tolerance():
    src = tensors()
    data = encode(src, META, codec="bf16")
    header, meta = read_header(data)
    assert header["wte.weight"]["dtype"] == "BF16"
    assert header["step"]["dtype"] == "I64"  # only floating tensors change wire dtype
    assert meta["codec"] == "bf16"
    out, meta = decode(data)
    assert meta == {**META, "codec": "bf16", "body_sha256": meta["body_sha256"]}
    assert out["wte.weight"].dtype == torch.float32
    for name in ("wte.weight", "ln.bias"):
        assert torch.allclose(out[name], src[name], rtol=2**-8, atol=0)
        assert not torch.equal(out[name], src[name])  # really went through bf16
        assert torch.equal(out[name], src[name].to(torch.bfloat16).float())
    assert torch.equal(out["step"], src["step"])
    assert len(data) < len(encode(src, META, codec="fp32"))


def test_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="unknown codec 'int5'"):
        encode(tensors(), META, codec="int5")


def test_state_round_trip_is_exact_in_every_dtype():
    src = {
        "m": torch.randn(4, 4, dtype=torch.float64),
        "b": torch.randn(3).to(torch.bfloat16),
        "n": torch.tensor([7], dtype=torch.int32),
    }
    out = decode_state(encode_state(src, {"round": "4"}))
    assert set(out) == set(src)
    for name in src:
        assert out[name].dtype == src[name].dtype
        assert torch.equal(out[name], src[name])


def test_encoding_with_one_metadata_entry_is_deterministic():
    assert encode(tensors(), {}) == encode(tensors(), {})
    assert encode_state(tensors(), {"round": "1"}) == encode_state(tensors(), {"round": "1"})
    assert encode_state(tensors(), {"round": "1"}) != encode_state(tensors(), {"round": "2"})


def test_encoding_with_several_metadata_entries_is_deterministic():
    shas = {sha256_hex(encode_state(tensors(), {"run": "run-abc", "round": "3"})) for _ in range(30)}
    assert len(shas) == 1
    assert len({sha256_hex(encode(tensors(), META)) for _ in range(10)}) == 1


# -- refusals -----------------------------------------------------------------------------------


def refusal(data: bytes, **kw) -> str:
    with pytest.raises(CodecError) as info:
        read_header(data, **kw)
    return str(info.value)


def test_read_header_refusals_each_say_why():
    good = encode(tensors(), META)
    n = header_length(good)
    body = good[8 + n :]
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    messages = {
        "short": refusal(good[:5]),
        "header longer than object": refusal(struct.pack("<Q", 1000) + b"{}"),
        "oversized header": refusal(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}"),
        "not json": refusal(struct.pack("<Q", 6) + b"{nope}"),
        "out of range": refusal(raw({"w": {**entry, "data_offsets": [8, 24]}}, bytes(16))),
        "unknown dtype": refusal(raw({"w": {**entry, "dtype": "F8_E9"}}, bytes(16))),
    }
    assert "truncated" in messages["short"] and "5 bytes" in messages["short"]
    assert "header length 1000 larger than the object" in messages["header longer than object"]
    assert "oversized header" in messages["oversized header"] and str(MAX_HEADER_BYTES) in messages["oversized header"]
    assert "not JSON" in messages["not json"]
    assert "'w'" in messages["out of range"] and "8..24" in messages["out of range"]
    assert "unsupported dtype F8_E9" in messages["unknown dtype"]
    assert len(set(messages.values())) == len(messages)
    # the good object passes, whole or as a prefix with its full size
    read_header(good)
    read_header(good[: 8 + n], object_size=len(good))
    assert len(body) > 0


def test_cut_in_the_body_is_refused():
    good = encode(tensors(), META)
    cut = good[:-7]
    message = refusal(cut)
    assert "does not fit the object" in message
    with pytest.raises(CodecError):
        decode(cut)


def test_cut_in_the_header_is_refused():
    good = encode(tensors(), META)
    n = header_length(good)
    assert "larger than the object" in refusal(good[: 8 + n - 3])
    # a prefix read with the full size known: the header itself is incomplete
    assert f"header needs {8 + n} bytes" in refusal(good[: 8 + n - 3], object_size=len(good))


def test_oversized_header_refused_before_the_length_is_trusted():
    # a prefix read: only 8 bytes in hand, the object is claimed huge
    assert "oversized header" in refusal(struct.pack("<Q", 2**40), object_size=2**41)


def test_header_must_be_an_object_with_string_metadata():
    assert "not a JSON object" in refusal(raw([1, 2], b""))  # type: ignore[arg-type]
    assert "metadata must map strings to strings" in refusal(raw({"__metadata__": {"tokens": 5}}, b""))
    assert "malformed entry" in refusal(raw({"w": {"dtype": "F32", "shape": [4]}}, bytes(16)))


def test_tensor_size_must_match_its_range():
    # a range inside the object but shorter than the shape needs
    assert "does not fit" in refusal(raw({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(16)))


def test_overlapping_tensors_are_refused_by_decode():
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    data = raw({"a": entry, "b": entry}, bytes(8))
    read_header(data)  # each range fits on its own
    with pytest.raises(CodecError, match="safetensors refused"):
        decode(data)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]},
        {"dtype": "F32", "shape": ["four"], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]},
        {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]},
    ],
    ids=["string-offsets", "string-shape", "scalar-shape", "list-dtype"],
)
def test_wrongly_typed_entries_are_codec_errors(entry):
    with pytest.raises(CodecError):
        decode(raw({"w": entry}, bytes(16)))


def test_every_flipped_tensor_byte_is_refused():
    good = encode(tensors(), META)
    n = header_length(good)
    for i in range(8 + n, len(good), 7):
        bad = bytearray(good)
        bad[i] ^= 0x01
        with pytest.raises(CodecError, match="body_sha256"):
            decode(bytes(bad))


def test_every_flipped_header_byte_is_refused():
    good = encode(tensors(), META)
    n = header_length(good)
    for i in range(8, 8 + n):
        bad = bytearray(good)
        bad[i] ^= 0xFF
        with pytest.raises(CodecError):
            decode(bytes(bad))


@pytest.mark.parametrize(
    "needle,replacement", [(b'{"__', b'z"__'), (b'"data_offsets":[0,', b'"data_offsets":[1,'), (b'"F32"', b'"G32"')]
)
def test_single_bit_flips_in_structure_are_refused(needle, replacement):
    good = encode(tensors(), META)
    assert sum(a != b for a, b in zip(needle, replacement)) == 1
    bad = good.replace(needle, replacement, 1)
    assert bad != good
    with pytest.raises(CodecError):
        decode(bad)


def test_flipped_length_prefix_is_refused():
    good = encode(tensors(), META)
    for i in range(8):
        bad = bytearray(good)
        bad[i] ^= 0x80
        with pytest.raises(CodecError):
            decode(bytes(bad))


class _Trap:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_pickle_payloads_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps({"w": _Trap(str(marker)), "t": torch.ones(3)})
    with pytest.raises(CodecError):
        decode(payload)
    with pytest.raises(CodecError):
        decode_state(payload)
    assert not marker.exists()
    buffer = tmp_path / "torch.pt"
    torch.save({"w": torch.ones(3)}, buffer)
    with pytest.raises(CodecError):
        decode(buffer.read_bytes())


# -- manifest -----------------------------------------------------------------------------------


def manifest(**changes) -> Manifest:
    fields = dict(
        run="run-abc",
        round=3,
        parent_round=2,
        parent_sha256="ab" * 32,
        created_at="2026-01-01T00:00:00Z",
        model=ObjectRef(
            key="runs/run-abc/rounds/000003/model-0123456789abcdef.safetensors", sha256="cd" * 32, bytes=1234
        ),
        outer=None,
        contributions=[
            Contribution(
                learner="us-east-0",
                region="us-east",
                phase=5,
                base_round=2,
                staleness=1,
                tokens=4096,
                tokens_counted=4096,
                weight=2730.6666666666665,
                loss=2.5,
                bytes=999,
                key="runs/run-abc/deltas/us-east-0/000005.safetensors",
                sha256="ef" * 32,
                finished_at=1.75e9,
                seconds=12.5,
                seen_at=1.75e9 + 0.5,
            )
        ],
        excluded=[
            Excluded(
                kind="dropped",
                key="runs/run-abc/deltas/eu-west-0/000001.safetensors",
                reason="staleness 5 > 4",
                learner="eu-west-0",
                tokens=100,
            )
        ],
        settings=RoundSettings.of(RunConfig(merge={"outer_lr": 0.5, "outer_momentum": 0.9, "max_staleness": 4})),
        quorum=Quorum(
            received=3,
            learners=["us-east-0", "ap-south-0", "sa-east-0"],
            waited_s=4.5,
            closed_by="quorum+grace",
        ),
        eval_loss=2.25,
        timings={"collect": 4.5, "merge": 0.25},
    )
    fields.update(changes)
    return Manifest(**fields)


def test_manifest_round_trip():
    m = manifest()
    data = m.to_bytes()
    back = Manifest.from_bytes(data)
    assert back == m
    assert back.to_bytes() == data
    assert back.contributions[0].weight == 2730.6666666666665
    assert back.consumed() == {
        ("us-east", "runs/run-abc/deltas/us-east-0/000005.safetensors"),
        ("", "runs/run-abc/deltas/eu-west-0/000001.safetensors"),
    }


def test_manifest_bytes_are_canonical():
    a, b = manifest(), manifest(timings=dict(reversed(list(manifest().timings.items()))))
    assert a.to_bytes() == b.to_bytes()
    assert sha256_hex(a.to_bytes()) == sha256_hex(b.to_bytes())
    data = a.to_bytes()
    assert b" " not in data.replace(b"quorum+grace", b"").replace(b"staleness 5 > 4", b"")
    keys = list(json.loads(data))
    assert keys == sorted(keys)
    # re-serializing a parsed pretty-printed copy gives the same canonical bytes
    pretty = json.dumps(json.loads(data), indent=2).encode()
    assert Manifest.from_bytes(pretty).to_bytes() == data
    assert manifest(eval_loss=2.5).to_bytes() != data


def test_manifest_refuses_extra_fields():
    doc = json.loads(manifest().to_bytes())
    doc["surprise"] = 1
    with pytest.raises(ValidationError, match="surprise"):
        Manifest.from_bytes(json.dumps(doc).encode())
    doc = json.loads(manifest().to_bytes())
    doc["contributions"][0]["bonus"] = 2
    with pytest.raises(ValidationError, match="bonus"):
        Manifest.from_bytes(json.dumps(doc).encode())


def test_manifest_refuses_unknown_quorum_closing():
    doc = json.loads(manifest().to_bytes())
    doc["quorum"]["closed_by"] = "whenever"
    with pytest.raises(ValidationError):
        Manifest.from_bytes(json.dumps(doc).encode())


def test_tensors_written_one_at_a_time_give_encode_states_very_bytes(tmp_path):
    """TensorFileWriter takes tensors in any order and any dtype mix and makes what encode_state
    writes for the whole dict, as encode_state_object does from memory: a merge can stream an
    object and its sha256 still names it."""
    tensors = {
        "b": torch.randn(5, dtype=torch.bfloat16),
        "a": torch.randn(2, 3),
        "c": torch.tensor(7),
        "z": torch.arange(3, dtype=torch.uint8),
        "e": torch.zeros(0),
    }
    for meta in ({"run": "r", "round": "3"}, None):
        with TensorFileWriter(tmp_path / f"parts-{meta is None}") as writer:
            for name in ("z", "a", "e", "c", "b"):
                writer.add(name, tensors[name])
            written = writer.finish(meta)
        for encoded in (written, encode_state_object(tensors, meta)):
            want = encode_state(tensors, meta)
            assert encoded.read_bytes() == want and encoded.sha256 == sha256_hex(want) and encoded.size == len(want)
            with encoded.open() as fh:  # the reader an upload rewinds: seek anywhere, read across pieces
                assert fh.read() == want
                fh.seek(5)
                assert fh.read(len(want) - 7) == want[5:-2] and fh.tell() == len(want) - 2
                assert fh.seek(0, 2) == len(want) and fh.read() == b""
    with pytest.raises(RuntimeError), TensorFileWriter(tmp_path / "failed") as writer:
        writer.add("a", tensors["a"])
        raise RuntimeError("the merge failed")
    assert not (tmp_path / "failed").exists()  # a failed object leaves no part file


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_released_tensor_gives_its_disk_back_and_cannot_be_read_again(tmp_path, codec):
    """The merge releases each tensor of a spooled delta once merged: its bytes (every wire part)
    are deallocated while the file keeps its size, the other tensors read as before, and reading
    it again is an error, never a tensor of zeros."""
    g = torch.Generator().manual_seed(1)
    tensors = {"wte.weight": torch.randn(512, 1024, generator=g), "ln.bias": torch.randn(1024, generator=g)}
    data = encode(tensors, META, codec)
    path = tmp_path / "delta.safetensors"
    path.write_bytes(data)
    n = header_length(data)
    delta = TensorFile(path, hashlib.sha256(data[8 + n :]).hexdigest())
    kept, blocks = delta.decoded("ln.bias"), os.stat(path).st_blocks
    delta.release("wte.weight")
    assert os.stat(path).st_size == len(data) and delta.released == {"wte.weight"}
    assert torch.equal(delta.decoded("ln.bias"), kept)
    for read in (delta.decoded, delta.stored):
        with pytest.raises(RuntimeError, match="released"):
            read("wte.weight")
    if sys.platform.startswith("linux"):
        table, _ = read_header(data)
        spans = [table[part]["data_offsets"] for part in delta.plan["wte.weight"]]
        on_disk = path.read_bytes()
        assert all(on_disk[8 + n + a : 8 + n + b] == bytes(b - a) for a, b in spans)
        assert on_disk[: 8 + n] == data[: 8 + n]
        released_blocks = sum(b - a for a, b in spans) // 512
        assert os.stat(path).st_blocks <= blocks - released_blocks + 16 * len(
            spans
        )  # a partial page may stay at each edge
