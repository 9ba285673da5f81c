"""A tensor read in ranges (whole 128-value blocks of its stored bytes) is the tensor read whole,
for every codec: what the synchronizer's merge reads a chunk at a time is what it read before."""

from __future__ import annotations

import zlib

import pytest
import torch

from islands.core.codecs import CODECS
from islands.core.compress import to_wire
from islands.core.config import TopkSettings
from islands.storage.codec import CodecError, TensorFile, encode, encode_state, encode_wire, read_header

CHUNKS = (128, 384, 1000, 10**9)  # one block, a few, not a multiple of a block (rounded down), all
TOPK = TopkSettings(chunk=256, k=16)  # chunks of 128 and 384 values start and end inside its chunks


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "wte.weight": torch.randn(300, 77, generator=g) * 1e-3,  # rows that straddle blocks
        "ln.bias": torch.randn(5, generator=g),  # less than a block
        "h.0.w": torch.randn(1024, generator=g).round(decimals=1) * 1e-2,  # deflates well
        "zero": torch.zeros(256),
        "uniform": torch.rand(4096, generator=g) * 2 - 1,  # integers that do not deflate: kept packed
    }


def written(tmp_path, name: str, data: bytes) -> TensorFile:
    path = tmp_path / name
    path.write_bytes(data)
    return TensorFile(path, read_header(data)[1]["body_sha256"])


@pytest.mark.parametrize("codec", CODECS)
def test_chunks_put_end_to_end_are_the_decoded_tensor(tmp_path, codec):
    f = written(tmp_path, codec, encode(tensors(), {"run": "r"}, codec, TOPK))
    if codec.startswith("int"):  # deflated integers, and (but for int2's, which always deflate) packed ones
        assert any(n.endswith(".z") for n in f._table) and (codec == "int2" or any(n.endswith(".q") for n in f._table))
    for name in f.names:
        whole = f.decoded(name).reshape(-1)
        for values in CHUNKS:
            chunks = list(f.chunks(name, values, tuple(f.decoded(name).shape)))
            step = max(128, values - values % 128)
            assert all(c.numel() == step for c in chunks[:-1]), (codec, name, values)
            joined = torch.cat(chunks)
            assert joined.dtype == whole.dtype and torch.equal(joined.view(torch.int32), whole.view(torch.int32))


def test_stored_chunks_keep_the_stored_dtype(tmp_path):
    state = {"m": torch.randn(1000), "codec.residual.m": torch.randn(1000).to(torch.bfloat16), "step": torch.arange(3)}
    data = encode_state(state)
    f = written(tmp_path, "state", data)
    for name, t in state.items():
        for values in CHUNKS:
            joined = torch.cat(list(f.stored_chunks(name, values)))
            assert joined.dtype == t.dtype and torch.equal(joined, t.reshape(-1))


def _deflated(z: bytes) -> bytes:
    t = {"w": torch.randn(1024).round(decimals=1) * 1e-2}
    wire = to_wire(t, "int8")
    assert "w.z" in wire
    wire["w.z"] = torch.frombuffer(bytearray(z), dtype=torch.uint8)
    return encode_wire(wire, {}, "int8")


@pytest.mark.parametrize(
    ("z", "reason"),
    [
        (
            zlib.compress(bytes(512)),
            r"integers must be 1024 torch.int8 values for shape \[1024\], got torch.int8 \(512,\)",
        ),
        (zlib.compress(bytes(2048)), "more than the 1024 bytes"),
        (zlib.compress(bytes(1024)) + b"junk", "followed by other bytes"),
        (zlib.compress(bytes(1024))[:-6], "cut short"),
        (b"not a deflate stream", "not a deflate stream"),
    ],
)
def test_a_bad_deflate_stream_is_refused_chunk_by_chunk_as_whole(tmp_path, z, reason):
    f = written(tmp_path, "bad", _deflated(z))
    with pytest.raises(CodecError, match=reason):
        f.decoded("w")
    for values in (128, 10**9):
        with pytest.raises(CodecError, match=reason):
            list(f.chunks("w", values))


def test_a_wrong_shape_is_refused_before_anything_is_inflated(tmp_path):
    f = written(tmp_path, "int8", encode(tensors(), {}, "int8"))
    with pytest.raises(CodecError, match="wrong shape"):
        next(f.chunks("wte.weight", 128, (77, 300)))
