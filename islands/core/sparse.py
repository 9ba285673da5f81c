"""The `topk` codec: of each chunk of a tensor's values, the k largest in magnitude, their
positions and their values in a few bits (SparseLoCo, arXiv 2508.15706: chunks of 4096, k = 64,
2-bit values, error feedback on every sender).

A tensor is flattened and cut into chunks of `chunk` values; the last one may be shorter and
keeps min(k, its length) values. Per chunk travel:

- the positions, sorted, Elias–Fano coded: each one's low l = ⌊log2(n/k)⌋ bits as they are,
  its high bits as a unary bit vector of k + ((n−1) >> l) + 1 bits, so a chunk's positions
  always take the same bytes (64 for k = 64 of 4096: 8 bits a position). Measured on a tiny
  model's real delta (tests/test_sparse_index.py, k = 64 of 4096): 12-bit packing takes 12
  bits a position, a Rice code of the sorted gaps with its parameter chosen per chunk (and sent
  in 4 bits) 7.58, Elias–Fano 8.00. Elias–Fano is a Rice code of parameter l padded to its
  bound, and that fixed size lets a reader decode any run of chunks straight from their byte
  offsets (the synchronizer reads deltas a run of values at a time) and check each part's size
  before reading it; the 0.42 bit a position that Rice would save is 0.007 bit a parameter.
- the values: a sign bit and value_bits − 1 bits of magnitude j, sent as (j + ½) × the chunk's
  scale, the largest magnitude kept over 2^(value_bits−1), in bfloat16 (16 bits a chunk). A NaN
  or Inf makes its chunk's scale NaN or Inf, and such a chunk does not decode.

At k = 64 of 4096 with 2-bit values that is (64 × (8 + 2) + 16) / 4096 = 0.16 bit a parameter.

The wire form of a tensor `<name>` is `<name>.idx` (the positions, uint8), `<name>.val` (the
values, uint8), `<name>.scale` (bfloat16, one per chunk), `<name>.shape` (int64) and
`<name>.topk` (int64: chunk, k, value_bits), so an object says how it was made and a reader can
refuse one made otherwise than its run says. Every decode refuses, as ValueError with a short
reason, parts of the wrong size or dtype, positions out of range, repeated or out of order, and
non-zero padding bits, so each tensor has one spelling. Pure torch, no storage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from islands.core.codecs import check_shape
from islands.core.config import MAX_TOPK_CHUNK, TOPK_VALUE_BITS, TopkSettings

SCALE_DTYPE = torch.bfloat16
PARTS = (".idx", ".val", ".scale", ".shape", ".topk")
VALUE_BITS = TOPK_VALUE_BITS


@dataclass(frozen=True)
class Layout:
    """How a tensor was cut and coded: values per chunk, values kept of each, bits per value."""

    chunk: int
    k: int
    value_bits: int

    @staticmethod
    def of(settings: TopkSettings) -> Layout:
        """The layout a run's `[topk]` settings give."""
        return Layout(settings.chunk, settings.k, settings.value_bits)

    @staticmethod
    def read(part: torch.Tensor) -> Layout:
        """The layout a `.topk` part declares; ValueError unless it is one a writer could make."""
        check_part(".topk", part.dtype, tuple(part.shape), 3)
        chunk, k, bits = part.tolist()
        if not (2 <= chunk <= MAX_TOPK_CHUNK) or chunk & (chunk - 1):
            raise ValueError(f"chunk {chunk} is not a power of two in [2, {MAX_TOPK_CHUNK}]")
        if not 1 <= k <= chunk:
            raise ValueError(f"k {k} outside [1, chunk {chunk}]")
        if bits not in VALUE_BITS:
            raise ValueError(f"value bits {bits} not one of {', '.join(map(str, VALUE_BITS))}")
        return Layout(chunk, k, bits)

    def part(self) -> torch.Tensor:
        return torch.tensor([self.chunk, self.k, self.value_bits], dtype=torch.int64)

    def kept(self, length: int) -> int:
        """Values kept of a chunk of `length` values."""
        return min(self.k, length)

    def idx_bytes(self, length: int) -> int:
        """Bytes of the positions of a chunk of `length` values (Elias–Fano, whole bytes)."""
        k = self.kept(length)
        low = low_bits(length, k)
        return -(-(k * low + k + ((length - 1) >> low) + 1) // 8)

    def val_bytes(self, length: int) -> int:
        return -(-self.kept(length) * self.value_bits // 8)

    def chunks(self, numel: int) -> tuple[int, int]:
        """(whole chunks, values of the shorter last one, 0 if none) of a tensor of `numel` values."""
        return numel // self.chunk, numel % self.chunk

    def offsets(self, numel: int, c: int) -> tuple[int, int]:
        """(byte of `.idx`, byte of `.val`) where chunk `c` of a tensor of `numel` values starts
        (c may be the number of chunks: where the parts end)."""
        whole, tail = self.chunks(numel)
        full = min(c, whole)
        idx, val = full * self.idx_bytes(self.chunk), full * self.val_bytes(self.chunk)
        if c > whole and tail:
            idx, val = idx + self.idx_bytes(tail), val + self.val_bytes(tail)
        return idx, val

    def n_chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)


def low_bits(length: int, k: int) -> int:
    """Elias–Fano's low bits for k positions in [0, length): ⌊log2(length / k)⌋, 0 at least."""
    return max(0, (length // k).bit_length() - 1)


def bits_per_value(layout: Layout) -> float:
    """Wire bits per parameter of a large tensor: positions, values and the scale of a whole chunk."""
    return (8 * (layout.idx_bytes(layout.chunk) + layout.val_bytes(layout.chunk)) + 16) / layout.chunk


def _to_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """(m, n) non-negative integers as (m, n × width) bits, lowest bit first."""
    shifts = torch.arange(width, dtype=torch.int64)
    return ((values.to(torch.int64)[..., None] >> shifts) & 1).to(torch.uint8).reshape(values.shape[0], -1)


def _from_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """(m, n × width) bits back to (m, n) int64, lowest bit first."""
    shifts = torch.arange(width, dtype=torch.int64)
    return (bits.reshape(bits.shape[0], -1, width).to(torch.int64) << shifts).sum(dim=-1)


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """(m, b) bits as (m, ⌈b/8⌉) bytes, the first bit the lowest of the first byte; zeros pad."""
    rows = F.pad(bits, (0, -bits.shape[1] % 8)).reshape(bits.shape[0], -1, 8).to(torch.int32)
    return (rows << torch.arange(8, dtype=torch.int32)).sum(dim=-1).to(torch.uint8)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """(m, B) bytes as (m, bits) bits; ValueError when a padding bit after them is set."""
    out = ((data[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(data.shape[0], -1)  # a byte a bit
    if out[:, bits:].any():
        raise ValueError("padding bits are set")
    return out[:, :bits]


def encode_rows(rows: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, values, scales) of m chunks of equal length n: (m, n) float32 in, (m,
    idx_bytes(n)) and (m, val_bytes(n)) uint8 and (m,) bfloat16 out."""
    m, n = rows.shape
    k = layout.kept(n)
    top = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # (m, k), ascending
    values = rows.gather(1, top)
    half = 2 ** (layout.value_bits - 1)
    scale = (values.abs().amax(dim=1) / half).to(SCALE_DTYPE)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    magnitude = torch.floor(values.abs() / divisor[:, None]).nan_to_num_(0).clamp_(0, half - 1).to(torch.int64)
    codes = magnitude | ((values < 0).to(torch.int64) << (layout.value_bits - 1))
    low = low_bits(n, k)
    high = torch.zeros(m, k + ((n - 1) >> low) + 1, dtype=torch.uint8)
    high.scatter_(1, (top >> low) + torch.arange(k), 1)  # the j-th position's high bits, unary
    idx = _pack(torch.cat([_to_bits(top & ((1 << low) - 1), low), high], dim=1))
    return idx, _pack(_to_bits(codes, layout.value_bits)), scale


def decode_rows(idx: torch.Tensor, val: torch.Tensor, scale: torch.Tensor, n: int, layout: Layout) -> torch.Tensor:
    """(m, n) float32 chunks back from `encode_rows`' parts; ValueError naming the first fault."""
    m, k = scale.shape[0], layout.kept(n)
    if not torch.isfinite(scale).all() or (scale < 0).any():
        raise ValueError("scale holds NaN, Inf or negative values")
    low = low_bits(n, k)
    bits = _unpack(idx.reshape(m, -1), k * low + k + ((n - 1) >> low) + 1)
    high = bits[:, k * low :]
    counts = high.sum(dim=1, dtype=torch.int64)
    if (counts != k).any():
        bad = int(torch.nonzero(counts != k)[0, 0])
        raise ValueError(f"chunk {bad} codes {int(counts[bad])} positions where k is {k}")
    ones = torch.nonzero(high)[:, 1].reshape(m, k)  # row-major: each row's ones in order
    top = (ones - torch.arange(k)) << low
    if low:
        top |= _from_bits(bits[:, : k * low], low)
    if (top >= n).any():
        raise ValueError(f"position {int(top.max())} out of range of a chunk of {n} values")
    steps = top.diff(dim=1)
    if (steps == 0).any():
        raise ValueError("a position is repeated")
    if (steps < 0).any():
        raise ValueError("positions are not sorted")
    codes = _from_bits(_unpack(val.reshape(m, -1), k * layout.value_bits), layout.value_bits)
    half = 2 ** (layout.value_bits - 1)
    values = ((codes & (half - 1)).float() + 0.5) * scale.float()[:, None]
    values = torch.where(codes >= half, -values, values)
    return torch.zeros(m, n, dtype=torch.float32).scatter_(1, top, values)


def encode(t: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """A float tensor's wire parts, by suffix (PARTS)."""
    flat = t.detach().to("cpu", torch.float32).reshape(-1)
    whole, tail = layout.chunks(flat.numel())
    groups = [flat[: whole * layout.chunk].view(whole, layout.chunk)] if whole else []
    if tail:
        groups.append(flat[whole * layout.chunk :].view(1, tail))  # (1, tail): the shorter last chunk
    coded = [encode_rows(rows, layout) for rows in groups]
    return {
        ".idx": torch.cat([c[0].reshape(-1) for c in coded]) if coded else torch.empty(0, dtype=torch.uint8),
        ".val": torch.cat([c[1].reshape(-1) for c in coded]) if coded else torch.empty(0, dtype=torch.uint8),
        ".scale": torch.cat([c[2] for c in coded]) if coded else torch.empty(0, dtype=SCALE_DTYPE),
        ".shape": torch.tensor(list(t.shape), dtype=torch.int64),
        ".topk": layout.part(),
    }


def sizes(shape: list[int], layout: Layout) -> dict[str, int]:
    """Elements of each 1-D part (by suffix) a tensor of `shape` has."""
    numel = check_shape(shape)
    idx, val = layout.offsets(numel, layout.n_chunks(numel))
    return {".idx": idx, ".val": val, ".scale": layout.n_chunks(numel), ".shape": len(shape), ".topk": 3}


DTYPES = {".idx": torch.uint8, ".val": torch.uint8, ".scale": SCALE_DTYPE, ".shape": torch.int64, ".topk": torch.int64}


def check_part(suffix: str, dtype: torch.dtype, shape: tuple[int, ...], want: int) -> None:
    """A part must be a 1-D tensor of its dtype and `want` elements; ValueError saying what it is."""
    if dtype != DTYPES[suffix] or tuple(shape) != (want,):
        raise ValueError(f"{suffix} must be {want} {DTYPES[suffix]} values, got {dtype} {tuple(shape)}")


def decode_chunks(
    numel: int, layout: Layout, c0: int, c1: int, idx: torch.Tensor, val: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Values of chunks [c0, c1) of a tensor of `numel` values, flat, from those chunks' bytes of
    `.idx` and `.val` and their scales (a tensor's, or any run of its chunks)."""
    whole, tail = layout.chunks(numel)
    full = max(0, min(c1, whole) - c0)
    i_full, v_full = full * layout.idx_bytes(layout.chunk), full * layout.val_bytes(layout.chunk)
    out = []
    if full:
        out.append(decode_rows(idx[:i_full], val[:v_full], scale[:full], layout.chunk, layout).reshape(-1))
    if c1 > whole and tail:
        out.append(decode_rows(idx[i_full:], val[v_full:], scale[full:], tail, layout).reshape(-1))
    return torch.cat(out) if out else torch.empty(0)


def decode(parts: Mapping[str, torch.Tensor], layout_wanted: Layout | None = None) -> torch.Tensor:
    """A float32 tensor back from its parts (by suffix); ValueError when they do not describe one,
    or describe a layout other than `layout_wanted`."""
    layout = Layout.read(parts[".topk"])
    if layout_wanted is not None and layout != layout_wanted:
        raise ValueError(f"coded with {layout_text(layout)}, where the run sets {layout_text(layout_wanted)}")
    shape = parts[".shape"]
    if shape.dtype != torch.int64 or shape.dim() != 1:
        raise ValueError(".shape must be a 1-D int64 tensor")
    dims = shape.tolist()
    for suffix, want in sizes(dims, layout).items():
        check_part(suffix, parts[suffix].dtype, tuple(parts[suffix].shape), want)
    numel = math.prod(dims)
    values = decode_chunks(numel, layout, 0, layout.n_chunks(numel), parts[".idx"], parts[".val"], parts[".scale"])
    return values.view(dims)


def layout_text(layout: Layout) -> str:
    return f"chunk {layout.chunk}, k {layout.k}, {layout.value_bits}-bit values"
