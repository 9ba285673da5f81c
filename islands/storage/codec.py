"""Tensors on the wire: safetensors with string metadata, never pickle.

Codecs: those islands.core.codecs names, floats or integers with per-block scales (islands.core.compress
gives each its wire form), or a chunk's largest values and their positions (islands.core.sparse).
Whatever the codec, `decode` returns float32 tensors under the original names, so validation
and the merge never see the codec.

Untrusted bytes (a delta from a learner) are checked before safetensors parses them: the
8-byte header length must fit inside the object and under a cap, the header must be JSON naming
only known dtypes, and every tensor's byte range must lie inside the object.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

# safetensors' save imports numpy.ctypeslib lazily, on its first call, whichever thread makes it;
# once (a merge resumed after a crash, threads of the round about) that import found the module
# half made and numpy's lazy attribute lookup recursed until RecursionError. Imported with the
# codec, it is whole before anything saves.
import numpy.ctypeslib  # noqa: F401
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from islands.core import compress, sparse
from islands.core.codecs import CODECS, SPARSE_CODECS, Codec, check_shape
from islands.core.compress import (
    BITS,
    BLOCK,
    decode_one,
    dequantize_blocks,
    from_wire,
    integer_bytes,
    packed_wire,
    to_wire,
    wire_plan,
)
from islands.core.config import TopkSettings
from islands.storage.encoded import EncodedObject, Piece, hash_pieces, piece_size
from islands.storage.spool import punch_holes

MAX_HEADER_BYTES = 16 * 2**20
BODY_SHA256 = "body_sha256"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_FLOAT_DTYPES = {"F64", "F32", "BF16", "F16"}
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CodecError(ValueError):
    """The bytes are not a well-formed safetensors object of ours; the message says why."""


def encode(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], codec: Codec = "fp32", topk: TopkSettings | None = None
) -> bytes:
    """Serialize float tensors in the codec's wire form (`topk`: the run's settings for that codec);
    other dtypes travel unchanged."""
    return encode_wire(to_wire(tensors, codec, topk), metadata, codec)


def encode_wire(wire: dict[str, torch.Tensor], metadata: dict[str, str], codec: Codec) -> bytes:
    """Serialize tensors already in `codec`'s wire form (error feedback makes them itself)."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    meta = {k: str(v) for k, v in metadata.items()}
    meta["codec"] = codec
    return canonical(st_save(wire, metadata=meta))


def canonical(data: bytes) -> bytes:
    """The same tensors and metadata always give the same bytes (and so the same sha256).

    safetensors writes metadata entries in hash-map order, which changes from call to call;
    content-addressed checkpoints and bit-for-bit replays need one spelling. The header is
    re-written with sorted metadata, compact separators and the format's 8-byte space padding.
    It also records the sha256 of the tensor bytes, so a flipped bit in the data is caught on read
    even where a learner's delta has no other checksum.
    """
    (n,) = struct.unpack("<Q", data[:8])
    return canonical_header(data[8 : 8 + n], hashlib.sha256(memoryview(data)[8 + n :]).hexdigest()) + data[8 + n :]


def canonical_header(header_json: bytes, body_sha256: str) -> bytes:
    """The length prefix and canonical header that `canonical` puts before the tensor bytes."""
    header = json.loads(header_json)
    meta = header.pop("__metadata__", None) or {}
    meta[BODY_SHA256] = body_sha256
    ordered = {"__metadata__": dict(sorted(meta.items()))} | header
    text = json.dumps(ordered, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(data: bytes, object_size: int | None = None) -> tuple[dict, dict[str, str]]:
    """Validate the safetensors header and return (tensor table, metadata) without loading.

    `data` is the whole object, or only its first bytes when `object_size` gives the full size.
    """
    size = len(data) if object_size is None else object_size
    if len(data) < 8:
        raise CodecError(f"truncated: {len(data)} bytes, not even a header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES:
        raise CodecError(f"oversized header: {n} bytes > {MAX_HEADER_BYTES}")
    if 8 + n > size:
        raise CodecError(f"header length {n} larger than the object ({size} bytes)")
    if 8 + n > len(data):
        raise CodecError(f"truncated: header needs {8 + n} bytes, got {len(data)}")
    try:
        header = json.loads(data[8 : 8 + n])
    except RecursionError:  # arrays or objects nested deeper than the parser's stack
        raise CodecError("header is not JSON we read: nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or a number longer than Python converts
        raise CodecError(f"header is not JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise CodecError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CodecError("metadata must map strings to strings")
    body = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(dtype, str) or not isinstance(shape, list):
                raise TypeError("dtype must be a string and shape a list")
            for d in shape:
                if not isinstance(d, int) or d < 0:
                    raise ValueError(f"bad dimension {d if isinstance(d, int) else type(d).__name__}")
            numel = 0 if 0 in shape else 1
            for d in shape if numel else ():
                numel *= d
                if numel > body:  # cannot fit already: no product of a million dimensions
                    break
            if not isinstance(start, int) or not isinstance(end, int):
                raise TypeError("data_offsets must be integers")
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"tensor {name[:40]!r}: malformed entry ({str(exc)[:80]})") from None
        if dtype not in _DTYPE_BYTES:
            raise CodecError(f"tensor {name[:40]!r}: unsupported dtype {dtype[:40]}")
        if not (0 <= start <= end <= body) or end - start != numel * _DTYPE_BYTES[dtype]:
            raise CodecError(
                f"tensor {name[:40]!r}: byte range {str(start)[:20]}..{str(end)[:20]} does not fit the object"
            )
    return header, metadata


def check_body(data: bytes, metadata: dict[str, str]) -> None:
    """The tensor bytes must match the sha256 the writer recorded (when it recorded one)."""
    if BODY_SHA256 in metadata:
        check_body_sha256(metadata, body_sha256(data))


def body_sha256(data: bytes) -> str:
    """The sha256 of a safetensors object's tensor bytes (those after the header its first 8 bytes
    announce), whatever its header says."""
    (n,) = struct.unpack("<Q", data[:8])
    return hashlib.sha256(memoryview(data)[8 + n :]).hexdigest()


def restamped(data: bytes, **metadata: str) -> bytes:
    """The canonical object `data` with these metadata fields set: the very bytes that encoding its
    tensors with that metadata gives, the tensor bytes untouched (a learner's delta and state
    written under another phase number than they were encoded for)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None) or {}
    body = body_sha256(data)
    if meta.get(BODY_SHA256, body) != body:
        raise CodecError("tensor bytes do not match the body_sha256 in the header")
    header["__metadata__"] = {**meta, **metadata}
    return canonical_header(json.dumps(header).encode(), body) + data[8 + n :]


def restamped_object(obj: EncodedObject, **metadata: str) -> EncodedObject:
    """`restamped` for an object given as pieces (a header, then its tensor bytes): a new header,
    the same pieces after it, never assembled."""
    head = bytes(obj.pieces[0])
    (n,) = struct.unpack("<Q", head[:8])
    header = json.loads(head[8 : 8 + n])
    meta = header.pop("__metadata__", None) or {}
    body = hashlib.sha256()
    hash_pieces(body, obj.pieces[1:])
    if meta.get(BODY_SHA256, body.hexdigest()) != body.hexdigest():
        raise CodecError("tensor bytes do not match the body_sha256 in the header")
    header["__metadata__"] = {**meta, **metadata}
    new_head = canonical_header(json.dumps(header).encode(), body.hexdigest())
    whole = hashlib.sha256(new_head)
    hash_pieces(whole, obj.pieces[1:])
    return EncodedObject((new_head, *obj.pieces[1:]), whole.hexdigest())


def check_body_sha256(metadata: dict[str, str], body_sha256: str) -> None:
    expected = metadata.get(BODY_SHA256)
    if expected is not None and body_sha256 != expected:
        raise CodecError("tensor bytes do not match the body_sha256 in the header (corrupted in storage or transit)")


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse checked bytes; floating tensors come back as float32 under their own names."""
    _, metadata = read_header(data)
    check_body(data, metadata)
    try:
        tensors = st_load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise CodecError(f"safetensors refused the bytes: {exc}") from exc
    try:
        return from_wire(tensors, metadata.get("codec", "fp32")), metadata
    except ValueError as exc:
        raise CodecError(str(exc)) from exc


def packed(data: bytes) -> bytes:
    """A coded object in canonical bytes with its deflated integers packed again (`packed_wire`):
    the same for two objects of the same integers whichever zlib deflated them."""
    _, metadata = read_header(data)
    check_body(data, metadata)
    codec = metadata.get("codec", "fp32")
    try:
        return encode_wire(packed_wire(st_load(data), codec), metadata, codec)
    except ValueError as exc:
        raise CodecError(str(exc)) from exc


def encode_state(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Exact serialization (no codec) for checkpoints and optimizer state."""
    return canonical(st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=metadata or None))


def decode_state(data: bytes) -> dict[str, torch.Tensor]:
    check_body(data, read_header(data)[1])
    return st_load(data)


def encode_state_object(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> EncodedObject:
    """`encode_state`'s very bytes, read straight from the tensors' memory when uploaded: no copy
    of them in memory or on disk. The tensors must not change until the object is uploaded."""
    return _encoded({name: _in_place(tensor) for name, tensor in tensors.items()}, metadata)


def _in_place(tensor: torch.Tensor) -> tuple[torch.dtype, list[int], Piece]:
    """A tensor as an object's entry whose bytes are read from the tensor's own memory."""
    t = tensor.detach().cpu().contiguous()
    return t.dtype, list(t.shape), t.reshape(-1).view(torch.uint8).numpy()


class TensorFileWriter:
    """`encode_state`'s very bytes for tensors that come one at a time (a merge makes them tensor
    by tensor): each goes to a part file in `parts_dir` as it comes, and `finish` gives the object
    as the canonical header and the part files in safetensors' own order, never assembled.
    The parts stay until the caller removes `parts_dir` (after the upload); on an error they go.
    A tensor that stays in memory anyway, unchanged until the upload, is `keep`-ed instead: read
    where it is, not written."""

    def __init__(self, parts_dir: Path):
        self.parts_dir = parts_dir
        self.parts_dir.mkdir()
        self.parts: dict[str, tuple[torch.dtype, list[int], Piece]] = {}
        self._files = 0

    def _new_part(self) -> Path:
        self._files += 1
        return self.parts_dir / str(self._files - 1)

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            shutil.rmtree(self.parts_dir, ignore_errors=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        dtype, shape, data = self._entry(name, tensor)
        part = self._new_part()
        with open(part, "wb") as fh:
            fh.write(data)
        self.parts[name] = (dtype, shape, part)

    def stream(self, name: str, dtype: torch.dtype, shape: list[int]) -> PartStream:
        """A tensor of `shape` whose values come a chunk at a time, in order (`PartStream.write`),
        each appended to its part file as it comes."""
        if name in self.parts:
            raise ValueError(f"tensor {name!r} added twice")
        return PartStream(self, name, dtype, list(shape))

    def deflating(self, name: str, dtype: torch.dtype) -> DeflatedStream:
        """Packed integers `<name>.q` that come a chunk at a time and are deflated as they come,
        as `islands.core.compress.deflate` deflates them whole (the same bytes): kept as `<name>.z`
        where that is smaller, as `<name>.q` where not."""
        return DeflatedStream(self, name, dtype)

    def coded(
        self, name: str, shape: list[int], wire: dict[str, torch.Tensor]
    ) -> dict[str, PartStream | DeflatedStream]:
        """Where a tensor of `shape` that comes a chunk at a time in a codec's wire form (the
        first chunk's `wire`, integers packed, as islands.core.compress.quantized_wire gives it)
        goes, by wire name: the floats and scales appended, the packed integers deflated as they
        come, the shape written now, once."""
        streams: dict[str, PartStream | DeflatedStream] = {}
        if name + ".topk" in wire:
            return self._sparse(name, shape, wire)
        for key, t in wire.items():
            if key == name:
                streams[key] = self.stream(key, t.dtype, shape)
            elif key == name + ".q":
                streams[key] = self.deflating(name, t.dtype)
            elif key == name + ".scale":
                streams[key] = self.stream(key, t.dtype, [-(-math.prod(shape) // BLOCK)])
            elif key == name + ".shape":
                self.add(key, torch.tensor(shape, dtype=torch.int64))
            else:
                raise ValueError(f"tensor {name!r}: no wire entry {key!r} in a codec's form")
        return streams

    def _sparse(self, name: str, shape: list[int], wire: dict[str, torch.Tensor]) -> dict[str, PartStream]:
        """`coded` for the `topk` form: positions, values and scales appended chunk by chunk, the
        shape and the layout written now."""
        if set(wire) != {name + p for p in sparse.PARTS}:
            raise ValueError(f"tensor {name!r}: wire entries {sorted(wire)} are not the topk form's")
        sizes = sparse.sizes(shape, sparse.Layout.read(wire[name + ".topk"]))
        self.add(name + ".shape", torch.tensor(shape, dtype=torch.int64))
        self.add(name + ".topk", wire[name + ".topk"])
        return {name + p: self.stream(name + p, wire[name + p].dtype, [sizes[p]]) for p in (".idx", ".val", ".scale")}

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        self.parts[name] = self._entry(name, tensor)

    def _entry(self, name: str, tensor: torch.Tensor) -> tuple[torch.dtype, list[int], Piece]:
        if name in self.parts:
            raise ValueError(f"tensor {name!r} added twice")
        return _in_place(tensor)

    def finish(self, metadata: dict[str, str] | None) -> EncodedObject:
        return _encoded(self.parts, metadata)


def _raw(tensor: torch.Tensor):
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


class PartStream:
    """One tensor of a `TensorFileWriter`, written to its part file a chunk at a time."""

    def __init__(self, writer: TensorFileWriter, name: str, dtype: torch.dtype, shape: list[int]):
        self.writer, self.name, self.dtype, self.shape = writer, name, dtype, shape
        self.path = writer._new_part()
        self.fh = open(self.path, "wb")  # noqa: SIM115 - closed by close(), or with the parts on an error

    def write(self, chunk: torch.Tensor) -> None:
        if chunk.dtype != self.dtype:
            raise ValueError(f"tensor {self.name!r}: a {chunk.dtype} chunk where {self.dtype} was declared")
        self.fh.write(_raw(chunk))

    def close(self) -> None:
        self.fh.close()
        want = math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()
        if self.path.stat().st_size != want:
            raise ValueError(f"tensor {self.name!r}: {self.path.stat().st_size} bytes written, its shape needs {want}")
        self.writer.parts[self.name] = (self.dtype, self.shape, self.path)


class DeflatedStream:
    """Packed integers written a chunk at a time, deflated on the way (see `TensorFileWriter.deflating`)."""

    def __init__(self, writer: TensorFileWriter, name: str, dtype: torch.dtype):
        self.writer, self.name, self.dtype = writer, name, dtype
        self.packed, self.deflated = writer._new_part(), writer._new_part()
        self.q = open(self.packed, "wb")  # noqa: SIM115 - closed by close()
        self.z = open(self.deflated, "wb")  # noqa: SIM115 - closed by close()
        self.stream = zlib.compressobj(compress.DEFLATE_LEVEL)  # read when used, as `deflate` reads it

    def write(self, chunk: torch.Tensor) -> None:
        raw = _raw(chunk)
        self.q.write(raw)
        self.z.write(self.stream.compress(raw))

    def close(self) -> None:
        self.z.write(self.stream.flush())
        self.q.close()
        self.z.close()
        raw, packed = self.packed.stat().st_size, self.deflated.stat().st_size
        if packed >= raw:
            self.deflated.unlink()
            self.writer.parts[self.name + ".q"] = (self.dtype, [raw], self.packed)
        else:
            self.packed.unlink()
            self.writer.parts[self.name + ".z"] = (torch.uint8, [packed], self.deflated)


def _encoded(
    entries: dict[str, tuple[torch.dtype, list[int], Piece]], metadata: dict[str, str] | None
) -> EncodedObject:
    """The object `encode_state` makes of tensors given as (dtype, shape, their bytes)."""
    # safetensors orders tensors by dtype, then name: ask it, with one-element stand-ins.
    probe = st_save({name: torch.zeros(1, dtype=dtype) for name, (dtype, _, _) in entries.items()})
    (n,) = struct.unpack("<Q", probe[:8])
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset, body = 0, []
    for name, entry in json.loads(probe[8 : 8 + n]).items():
        if name == "__metadata__":
            continue
        _, shape, piece = entries[name]
        size = piece_size(piece)
        header[name] = {**entry, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
        body.append(piece)
    body_sha = hashlib.sha256()
    hash_pieces(body_sha, body)
    head = canonical_header(json.dumps(header).encode(), body_sha.hexdigest())
    whole = hashlib.sha256(head)
    hash_pieces(whole, body)
    return EncodedObject((head, *body), whole.hexdigest())


class TensorFile:
    """A safetensors file on local disk whose header, body hash and wire layout have been
    checked; its tensors are parsed by safetensors one at a time.

    Each read maps the file afresh and lets go of it: a mapping kept open keeps every page it
    touched resident, so reading K files side by side would hold K files in memory."""

    def __init__(self, path: Path, body_sha256: str, topk: TopkSettings | None = None):
        """`topk`: the run's settings for that codec; a `topk` tensor coded otherwise is refused
        where it is read (None: any layout a writer could make)."""
        self.path = path
        self.topk = topk
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            head = fh.read(8)
            rest = fh.read(min(struct.unpack("<Q", head)[0], MAX_HEADER_BYTES)) if len(head) == 8 else b""
        table, self.metadata = read_header(head + rest, object_size=size)
        self._table = table
        body = 8 + len(rest)
        self._spans = {
            name: (body + info["data_offsets"][0], info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in table.items()
        }
        self.released: set[str] = set()
        check_body_sha256(self.metadata, body_sha256)
        self.codec = self.metadata.get("codec", "fp32")
        try:
            self.plan = wire_plan({name: info["dtype"] in _FLOAT_DTYPES for name, info in table.items()}, self.codec)
            with safe_open(path, framework="pt"):
                pass
        except ValueError as exc:
            raise CodecError(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CodecError(f"safetensors refused the bytes: {exc}") from exc

    @property
    def names(self) -> list[str]:
        """Names of the decoded tensors (the model's names, whatever the codec)."""
        return list(self.plan)

    def release(self, name: str) -> None:
        """Hand back the local pages of one tensor's stored bytes once they have been read for
        the last time (the merge does, tensor by tensor), so what is written next reuses them
        (storage.spool.punch_holes); reading the tensor again is refused."""
        self.released.add(name)
        punch_holes(self.path, [self._spans[part] for part in self.plan[name]])

    def _readable(self, name: str) -> None:
        if name in self.released:
            raise RuntimeError(f"{self.path}: tensor {name!r} was released and cannot be read again")

    def decoded(self, name: str, shape_wanted: tuple[int, ...] | None = None) -> torch.Tensor:
        """One tensor as `decode` gives it: floats as float32, whatever the codec. With
        `shape_wanted`, coded integers declaring another shape are refused uninflated (`decode_one`)."""
        self._readable(name)
        with safe_open(self.path, framework="pt") as fh:
            parts = {p: fh.get_tensor(p) for p in self.plan[name]}
        try:
            return decode_one(name, parts, self.codec, shape_wanted, self.topk)
        except ValueError as exc:
            raise CodecError(str(exc)) from exc

    def stored(self, name: str) -> torch.Tensor:
        """One tensor exactly as stored, in memory of its own (for checkpoints and states)."""
        self._readable(name)
        with safe_open(self.path, framework="pt") as fh:
            return fh.get_tensor(name).clone()

    def shape(self, name: str) -> tuple[int, ...]:
        """A stored tensor's shape, from the header alone."""
        return tuple(self._table[name]["shape"])

    def _read(self, fh, wire_name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of a stored tensor, flat, read from the file into memory of their own."""
        info = self._table[wire_name]
        size = _DTYPE_BYTES[info["dtype"]]
        offset, _ = self._spans[wire_name]
        buffer = bytearray((stop - start) * size)
        fh.seek(offset + start * size)
        if fh.readinto(buffer) != len(buffer):
            raise CodecError(f"{self.path}: tensor {wire_name!r} is cut short")
        if not buffer:
            return torch.empty(0, dtype=_TORCH_DTYPES[info["dtype"]])
        return torch.frombuffer(buffer, dtype=_TORCH_DTYPES[info["dtype"]])

    def stored_chunks(self, name: str, values: int) -> Iterator[torch.Tensor]:
        """One stored tensor as it is stored (no codec: checkpoints and states), flat, `values`
        elements at a time (rounded down to whole blocks of BLOCK); each chunk in memory of its own."""
        self._readable(name)
        step = chunk_values(values)
        numel = math.prod(self.shape(name))
        with open(self.path, "rb") as fh:
            for start in range(0, numel, step):
                yield self._read(fh, name, start, min(numel, start + step))

    def chunks(self, name: str, values: int, shape_wanted: tuple[int, ...] | None = None) -> Iterator[torch.Tensor]:
        """One tensor as `decoded` gives it, flattened, `values` elements at a time (rounded down to
        whole blocks of BLOCK, the codecs' scale blocks): the chunks put end to end are `decoded`
        bit for bit, and only one chunk's bytes are read and held at a time. Deflated integers are
        inflated as a stream, never more than the chunk's; everything `decoded` refuses is refused
        (at the chunk where it shows, a cut-short or overlong stream at the end)."""
        self._readable(name)
        parts = self.plan[name]
        if len(parts) == 1:  # no local holds a chunk while the reader has it: map, not a loop
            yield from map(_as_decoded, self.stored_chunks(name, values))
            return
        try:
            yield from self._coded_chunks(name, parts, chunk_values(values), shape_wanted)
        except ValueError as exc:
            if isinstance(exc, CodecError):
                raise
            raise CodecError(f"tensor {name!r}: {exc}") from exc

    def _declared_shape(self, fh, shape_name: str, shape_wanted: tuple[int, ...] | None) -> list[int]:
        """The dims a coded tensor's `.shape` part declares, checked against `shape_wanted`."""
        shape_info = self._table[shape_name]
        if shape_info["dtype"] != "I64" or len(shape_info["shape"]) != 1:
            raise ValueError(".shape must be a 1-D int64 tensor")
        dims = self._read(fh, shape_name, 0, shape_info["shape"][0]).tolist()
        if shape_wanted is not None and tuple(dims) != tuple(shape_wanted):
            raise ValueError(f"wrong shape: {tuple(dims)} instead of {tuple(shape_wanted)}")
        check_shape(dims)
        return dims

    def _sparse_chunks(
        self, name: str, parts: tuple[str, ...], step: int, shape_wanted: tuple[int, ...] | None
    ) -> Iterator[torch.Tensor]:
        """`chunks` of a `topk` tensor: the top-k chunks that cover each run of `step` values are
        read (by their byte offsets: every whole chunk's parts have the same size) and decoded,
        and the run cut from them, so any `step` reads the same values."""
        by_suffix = dict(zip(sparse.PARTS, parts))
        with open(self.path, "rb") as fh:
            dims = self._declared_shape(fh, by_suffix[".shape"], shape_wanted)
            info = self._table[by_suffix[".topk"]]
            sparse.check_part(".topk", _TORCH_DTYPES[info["dtype"]], tuple(info["shape"]), 3)
            layout = sparse.Layout.read(self._read(fh, by_suffix[".topk"], 0, 3))
            if self.topk is not None and layout != sparse.Layout.of(self.topk):
                wanted = sparse.layout_text(sparse.Layout.of(self.topk))
                raise ValueError(f"coded with {sparse.layout_text(layout)}, where the run sets {wanted}")
            for suffix, want in sparse.sizes(dims, layout).items():
                info = self._table[by_suffix[suffix]]
                sparse.check_part(suffix, _TORCH_DTYPES[info["dtype"]], tuple(info["shape"]), want)
            numel = math.prod(dims)
            for start in range(0, numel, step):
                stop = min(numel, start + step)
                c0, c1 = start // layout.chunk, -(-stop // layout.chunk)
                (i0, v0), (i1, v1) = layout.offsets(numel, c0), layout.offsets(numel, c1)
                values = sparse.decode_chunks(
                    numel,
                    layout,
                    c0,
                    c1,
                    self._read(fh, by_suffix[".idx"], i0, i1),
                    self._read(fh, by_suffix[".val"], v0, v1),
                    self._read(fh, by_suffix[".scale"], c0, c1),
                )
                yield values[start - c0 * layout.chunk : stop - c0 * layout.chunk]

    def _coded_chunks(
        self, name: str, parts: tuple[str, ...], step: int, shape_wanted: tuple[int, ...] | None
    ) -> Iterator[torch.Tensor]:
        if self.codec in SPARSE_CODECS:
            yield from self._sparse_chunks(name, parts, step, shape_wanted)
            return
        integers, scale_name, shape_name = parts
        bits = BITS[self.codec]
        with open(self.path, "rb") as fh:
            dims = self._declared_shape(fh, shape_name, shape_wanted)
            numel = math.prod(dims)
            n_blocks, want_bytes = -(-numel // BLOCK), integer_bytes(numel, bits)
            int_dtype = "U8" if bits < 8 else "I8"
            int_info, scale_info = self._table[integers], self._table[scale_name]
            deflated = integers.endswith(".z")
            if deflated:
                if int_info["dtype"] != "U8" or len(int_info["shape"]) != 1:
                    shown_dtype = _TORCH_DTYPES[int_info["dtype"]]
                    raise ValueError(
                        f"deflated integers must be a 1-D uint8 tensor, got {shown_dtype} {tuple(int_info['shape'])}"
                    )
            elif int_info["dtype"] != int_dtype or int_info["shape"] != [want_bytes]:
                raise ValueError(
                    f"integers must be {want_bytes} {_TORCH_DTYPES[int_dtype]} values for shape {dims}, "
                    f"got {_TORCH_DTYPES[int_info['dtype']]} {tuple(int_info['shape'])}"
                )
            if scale_info["dtype"] != "BF16" or scale_info["shape"] != [n_blocks]:
                raise ValueError(
                    f"scale must be {n_blocks} bfloat16 values for shape {dims}, "
                    f"got {_TORCH_DTYPES[scale_info['dtype']]} {tuple(scale_info['shape'])}"
                )
            per_block = BLOCK * bits // 8
            short = (
                f"integers must be {want_bytes} {_TORCH_DTYPES[int_dtype]} values for shape {dims}, "
                f"got {_TORCH_DTYPES[int_dtype]} ({{}},)"
            )
            stream = _Inflater(self, fh, integers, short) if deflated else None
            for start in range(0, numel, step):
                stop = min(numel, start + step)
                b0, b1 = start // BLOCK, -(-stop // BLOCK)
                if stream is not None:
                    raw = stream.take((b1 - b0) * per_block)
                    q = torch.frombuffer(raw, dtype=_TORCH_DTYPES[int_dtype]) if raw else torch.empty(0)
                else:
                    q = self._read(fh, integers, b0 * per_block, b1 * per_block)
                scale = self._read(fh, scale_name, b0, b1)
                yield dequantize_blocks(q, scale, bits)[: stop - start]
            if stream is not None:
                stream.finish(want_bytes)


def _as_decoded(chunk: torch.Tensor) -> torch.Tensor:
    return chunk.float() if chunk.is_floating_point() else chunk


def chunk_values(values: int) -> int:
    """A chunk's elements: `values` rounded down to whole BLOCKs, one BLOCK at least."""
    return max(BLOCK, values - values % BLOCK)


class _Inflater:
    """A `.z` part inflated as a stream, its compressed bytes read a bounded piece at a time."""

    READ = 1 << 20

    def __init__(self, owner: TensorFile, fh, wire_name: str, short: str):
        self.fh, self.short, self.given = fh, short, 0  # `short`: what a stream cut short is told, given its length
        self.offset, self.left = owner._spans[wire_name]
        self.stream = zlib.decompressobj()
        self.pending = b""  # compressed bytes read and not yet taken in

    def _more(self) -> None:
        if not self.pending and self.left:
            self.fh.seek(self.offset)
            self.pending = self.fh.read(min(self.READ, self.left))
            self.offset += len(self.pending)
            self.left -= len(self.pending)

    def _inflate(self, most: int) -> bytes:
        self._more()
        try:
            got = self.stream.decompress(self.pending, most)
        except zlib.error as exc:
            raise ValueError(f"deflated integers are not a deflate stream ({exc})") from exc
        self.pending = self.stream.unconsumed_tail
        return got

    def take(self, n: int) -> bytearray:
        """The next `n` inflated bytes; fewer there are not."""
        out = bytearray()
        while len(out) < n and not self.stream.eof:
            got = self._inflate(n - len(out))
            if not got and not self.pending and not self.left:
                break
            out += got
        self.given += len(out)
        if len(out) < n:
            raise ValueError(
                self.short.format(self.given)
                if self.stream.eof
                else "deflated integers are cut short or followed by other bytes"
            )
        return out

    def finish(self, limit: int) -> None:
        """The stream must end where the integers do (`limit` bytes), with nothing after it."""
        while not self.stream.eof:
            if self._inflate(1):
                raise ValueError(f"deflated integers inflate to more than the {limit} bytes their shape calls for")
            if not self.pending and not self.left:
                break
        if not self.stream.eof or self.stream.unused_data or self.pending or self.left:
            raise ValueError("deflated integers are cut short or followed by other bytes")
