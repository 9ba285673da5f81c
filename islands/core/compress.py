"""Deltas in fewer bits: block-wise int8/int4/int3/int2 quantization, and error feedback.

Each tensor is cut into blocks of BLOCK values; a block keeps one bfloat16 scale (its absolute
maximum over the largest level) and one small integer per value, so one large value costs
precision only in its own block. A bfloat16 scale over 128 values costs 0.125 bit per value
(int4: 4.125 bits a value); its rounding (at most 2^-8 of the scale) is one more error that
error feedback carries. int4 packs two values per byte,
int3 (−3 to 3: 3.125 bits a value) eight per three bytes; int2 (each value −1, 0 or +1 times its
block's scale: 2.125 bits a value) packs four, and is meant for what has error feedback on its
side; its scale is chosen for the least error rather than as the block's maximum (`ternary`),
and decodes the same way. The packed integers then go through deflate (zlib), losslessly: a
pseudo-gradient's values crowd the levels near zero, so they carry fewer bits than they are
packed in. A tensor whose integers do not shrink keeps them packed as they are. Error feedback keeps what the quantizer dropped (the residual) and
adds it to the next delta, so over many phases the sum of what was sent tracks the sum of the
true deltas instead of drifting (error feedback as in 1-bit SGD and its successors; the
outer gradients of Streaming DiLoCo, arXiv 2501.18512, travel in 4 bits the same way).

The wire form is a flat dict of tensors that safetensors can store: `<name>.z` (the integers,
deflated) or `<name>.q` (as packed), `<name>.scale` and `<name>.shape`; storage.codec writes and
reads it. A reader inflates no more bytes than the shape calls for, so a hostile stream cannot
blow up in memory. Pure torch: no storage, no Prefect, so the learner, the synchronizer and the
tests share one definition. The `topk` codec's own form is islands.core.sparse's; the functions
here take it too, given the run's `[topk]` settings where they encode.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch.nn import functional as F

from islands.core import sparse
from islands.core.codecs import (
    CODECS,
    INTEGER_CODECS,
    SPARSE_CODECS,
    Codec,
    FloatCodec,
    IntegerCodec,
    bits_of,
    check_shape,
)
from islands.core.config import TopkSettings

BLOCK = 128  # values per scale
SCALE_DTYPE = torch.bfloat16
BITS: dict[IntegerCodec, int] = {c: bits_of(c) for c in INTEGER_CODECS}
FLOAT_WIRE: dict[FloatCodec, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}  # one per FLOAT_CODECS
INTEGER_PARTS = (".q", ".z")  # packed, or packed and deflated
PARTS = (*INTEGER_PARTS, ".scale", ".shape")
DEFLATE_LEVEL = 1
RESIDUAL_PREFIX = "codec.residual."
TERNARY_THRESHOLD = 0.7  # × a block's mean magnitude: int2 sends the values above it


def levels(bits: int) -> int:
    """Largest integer a value is rounded to: 127 for int8, 7 for int4, 3 for int3, 1 for int2 (symmetric, no −2^(b−1))."""
    return 2 ** (bits - 1) - 1


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Values in [−2^(bits−1), 2^(bits−1)) packed tight, the first one in the lowest bits: int4 and
    int2 fill one byte with 2 and 4 values, int3 fills three bytes with 8 (a 24-bit word each)."""
    group, width = word_shape(bits)
    if q.numel() % group:
        raise ValueError(f"int{bits} packing needs a multiple of {group} values, got {q.numel()}")
    fields = (q.reshape(-1, group).to(torch.int16) + 2 ** (bits - 1)).to(word_dtype(width))
    words = fields[:, 0].clone()
    for i in range(1, group):
        words |= fields[:, i] << (i * bits)
    if width == 1:
        return words
    return torch.stack([(words >> (8 * j)) & 255 for j in range(width)], dim=1).to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    group, width = word_shape(bits)
    rows = packed.reshape(-1, width)
    words = rows[:, 0].to(word_dtype(width))
    for j in range(1, width):
        words |= rows[:, j].to(torch.int32) << (8 * j)
    out = torch.empty(words.numel(), group, dtype=torch.int8)
    for i in range(group):
        out[:, i] = ((words >> (i * bits)) & (2**bits - 1)).to(torch.int8) - 2 ** (bits - 1)
    return out.reshape(-1)


def word_shape(bits: int) -> tuple[int, int]:
    """(values, bytes) of the smallest whole-byte word of `bits`-bit values: (2, 1) for int4, (8, 3) for int3."""
    group = 8 // math.gcd(bits, 8)
    return group, bits * group // 8


def word_dtype(width: int) -> torch.dtype:
    return torch.uint8 if width == 1 else torch.int32


def quantize(t: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers, per-block scales) of a float tensor; int4, int3 and int2 integers come packed in
    uint8. int8, int4 and int3 scale a block by its largest magnitude, so no value is clipped; int2
    by `ternary`."""
    flat = t.detach().to("cpu", torch.float32).reshape(-1)
    blocks = F.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
    if bits == 2:
        return ternary(blocks)
    scale = (blocks.abs().amax(dim=1) / levels(bits)).to(SCALE_DTYPE)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    q = torch.round(blocks / divisor[:, None]).clamp_(-levels(bits), levels(bits)).to(torch.int8).reshape(-1)
    return (pack(q, bits) if bits < 8 else q), scale


def ternary(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int2 integers, scales) of rows of BLOCK values, each sent as −1, 0 or +1 × its row's scale.

    With one level, a block's maximum as the scale sends only the values above half of it, each as
    the maximum: about half of a Gaussian-like block's energy is lost, for error feedback to send
    later. Instead the values above TERNARY_THRESHOLD × the block's mean magnitude are sent, as ±
    their mean magnitude (the least-squares scale for that choice; the threshold is ternary weight
    networks'): under a fifth is lost (`python -m benchmarks --only codec` compares the two on
    the replayed schedule)."""
    mag = blocks.abs()
    sent = mag > TERNARY_THRESHOLD * mag.mean(dim=1, keepdim=True)
    scale = (mag * sent).sum(dim=1) / sent.sum(dim=1).clamp(min=1)
    peak = mag.amax(dim=1)  # NaN or Inf where a block holds one: such a block must not decode, as with int4
    scale = torch.where(torch.isfinite(peak), scale, peak).to(SCALE_DTYPE)
    return pack((torch.sign(blocks) * sent).to(torch.int8).reshape(-1), 2), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, shape: list[int], bits: int) -> torch.Tensor:
    """float32 tensor of `shape`; raises ValueError when the parts do not describe one."""
    check_shape(shape)
    check_parts(q, scale, shape, bits)
    return dequantize_blocks(q, scale, bits)[: math.prod(shape)].view(shape)


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 values of whole blocks, flat: their packed integers and their scales (a tensor's,
    or any run of its blocks: the values are the same either way, value by value)."""
    if not torch.isfinite(scale).all() or (scale < 0).any():
        raise ValueError("scale holds NaN, Inf or negative values")
    ints = unpack(q, bits) if bits < 8 else q
    return (ints.to(torch.float32).view(-1, BLOCK) * scale.float()[:, None]).reshape(-1)


def integer_bytes(numel: int, bits: int) -> int:
    """Bytes of the packed integers of `numel` values in blocks of BLOCK."""
    return -(-numel // BLOCK) * BLOCK * bits // 8


def deflate(q: torch.Tensor) -> torch.Tensor | None:
    """The packed integers deflated, as a uint8 tensor; None when that does not make them smaller."""
    raw = q.contiguous().view(torch.uint8).numpy()
    packed = zlib.compress(raw, DEFLATE_LEVEL)
    if len(packed) >= raw.nbytes:
        return None
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def inflate(z: torch.Tensor, limit: int, dtype: torch.dtype) -> torch.Tensor:
    """The packed integers of a `.z` part; a stream that would give more than `limit` bytes is
    refused before it does, as is one that is cut short or followed by other bytes."""
    if z.dtype != torch.uint8 or z.dim() != 1:
        raise ValueError(f"deflated integers must be a 1-D uint8 tensor, got {z.dtype} {tuple(z.shape)}")
    stream = zlib.decompressobj()
    try:
        out = stream.decompress(z.contiguous().numpy(), limit + 1)
    except zlib.error as exc:
        raise ValueError(f"deflated integers are not a deflate stream ({exc})") from exc
    if len(out) > limit:
        raise ValueError(f"deflated integers inflate to more than the {limit} bytes their shape calls for")
    if not stream.eof or stream.unused_data:
        raise ValueError("deflated integers are cut short or followed by other bytes")
    return torch.frombuffer(bytearray(out), dtype=torch.uint8).view(dtype) if out else torch.empty(0, dtype=dtype)


def inflate_for(z: torch.Tensor, shape: list[int], bits: int) -> torch.Tensor:
    """`inflate` with the limit a tensor of `shape` calls for, in the integers' own dtype."""
    check_shape(shape)
    return inflate(z, integer_bytes(math.prod(shape), bits), torch.uint8 if bits < 8 else torch.int8)


def check_parts(q: torch.Tensor, scale: torch.Tensor, shape: list[int], bits: int) -> None:
    """`q` must hold the packed integers and `scale` the bfloat16 scales of a tensor of `shape`
    in blocks of BLOCK; raises ValueError saying what they hold instead."""
    want_dtype = torch.uint8 if bits < 8 else torch.int8
    want_numel = integer_bytes(math.prod(shape), bits)
    if q.dtype != want_dtype or q.dim() != 1 or q.numel() != want_numel:
        raise ValueError(
            f"integers must be {want_numel} {want_dtype} values for shape {shape}, got {q.dtype} {tuple(q.shape)}"
        )
    n_blocks = -(-math.prod(shape) // BLOCK)
    if scale.dtype != SCALE_DTYPE or scale.dim() != 1 or scale.numel() != n_blocks:
        raise ValueError(
            f"scale must be {n_blocks} bfloat16 values for shape {shape}, got {scale.dtype} {tuple(scale.shape)}"
        )


def to_wire(
    tensors: dict[str, torch.Tensor], codec: Codec, topk: TopkSettings | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a delta object stores for `codec` (`topk`: the run's settings for it); non-float
    tensors travel unchanged."""
    return deflated_wire(quantized_wire(tensors, codec, topk), codec)


def needed(topk: TopkSettings | None) -> TopkSettings:
    """The run's `[topk]` settings, which the `topk` codec encodes with: refused when missing, so
    no caller encodes with other settings than its run's unnoticed."""
    if topk is None:
        raise ValueError("the topk codec encodes with the run's [topk] settings, and none were given")
    return topk


def feedback_decay(codec: str, topk: TopkSettings | None) -> float:
    """β: what of the residual an encoding carries (`topk.beta` for the sparse codec, else all of it)."""
    return needed(topk).beta if codec in SPARSE_CODECS else 1.0


def quantized_wire(
    tensors: dict[str, torch.Tensor], codec: Codec, topk: TopkSettings | None = None
) -> dict[str, torch.Tensor]:
    """`to_wire` with the integers packed, not yet deflated (`packed_wire`'s form)."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    layout = sparse.Layout.of(needed(topk)) if codec in SPARSE_CODECS else None
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        if not t.is_floating_point():
            out[name] = t.contiguous()
        elif codec in FLOAT_WIRE:
            out[name] = t.to(FLOAT_WIRE[codec]).contiguous()
        else:
            reserved = sparse.PARTS if layout is not None else PARTS
            if name.endswith(reserved):
                raise ValueError(
                    f"tensor name {name!r} ends with a suffix the {codec} codec reserves ({', '.join(reserved)})"
                )
            if layout is not None:
                out.update((name + suffix, part) for suffix, part in sparse.encode(t, layout).items())
                continue
            out[name + ".q"], out[name + ".scale"] = quantize(t, BITS[codec])
            out[name + ".shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
    return out


def deflated_wire(wire: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """`wire` with each packed `.q` part deflated to a `.z` where that makes it smaller."""
    if codec in FLOAT_WIRE:
        return wire
    out: dict[str, torch.Tensor] = {}
    for name, t in wire.items():
        z = deflate(t) if name.endswith(".q") else None
        if z is None:
            out[name] = t
        else:
            out[name[: -len(".q")] + ".z"] = z
    return out


def wire_plan(wire_floats: dict[str, bool], codec: str) -> dict[str, tuple[str, ...]]:
    """Each decoded tensor's name and the wire tensors it is made from, given which wire tensors
    are floating point; raises ValueError naming the bad tensor. Needs no tensor data, so a
    reader can check the whole layout first and then decode one tensor at a time."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r} in the metadata; this reader knows {', '.join(CODECS)}")
    if codec in FLOAT_WIRE:
        return {name: (name,) for name in wire_floats}
    if codec in SPARSE_CODECS:
        return sparse_plan(wire_floats)
    plan: dict[str, tuple[str, ...]] = {}
    bases = {k[: -len(p)] for k in wire_floats for p in INTEGER_PARTS if k.endswith(p)}
    for name, is_float in wire_floats.items():
        base = next((name[: -len(p)] for p in PARTS if name.endswith(p)), None)
        if base is None:
            if is_float:
                raise ValueError(f"tensor {name!r}: a float tensor outside the {codec} wire form")
            plan[name] = (name,)
        elif base not in bases:
            raise ValueError(f"tensor {name!r}: no {base}.q or {base}.z to go with it")
    for base in sorted(bases):
        integers = [base + p for p in INTEGER_PARTS if base + p in wire_floats]
        if len(integers) > 1:
            raise ValueError(f"tensor {base!r}: both {' and '.join(integers)}, where one of them belongs")
        missing = [base + p for p in (".scale", ".shape") if base + p not in wire_floats]
        if missing:
            raise ValueError(f"tensor {base!r}: missing {', '.join(missing)}")
        plan[base] = (integers[0], base + ".scale", base + ".shape")
    return plan


def sparse_plan(wire_floats: dict[str, bool]) -> dict[str, tuple[str, ...]]:
    """`wire_plan` for the `topk` codec: each tensor's five parts (sparse.PARTS), all there, and
    no float outside them."""
    plan: dict[str, tuple[str, ...]] = {}
    bases = {k[: -len(".topk")] for k in wire_floats if k.endswith(".topk")}
    for name, is_float in wire_floats.items():
        base = next((name[: -len(p)] for p in sparse.PARTS if name.endswith(p)), None)
        if base is None:
            if is_float:
                raise ValueError(f"tensor {name!r}: a float tensor outside the topk wire form")
            plan[name] = (name,)
        elif base not in bases:
            raise ValueError(f"tensor {name!r}: no {base}.topk to go with it")
    for base in sorted(bases):
        missing = [base + p for p in sparse.PARTS if base + p not in wire_floats]
        if missing:
            raise ValueError(f"tensor {base!r}: missing {', '.join(missing)}")
        plan[base] = tuple(base + p for p in sparse.PARTS)
    return plan


def decode_one(
    name: str,
    parts: dict[str, torch.Tensor],
    codec: str,
    shape_wanted: tuple[int, ...] | None = None,
    topk_wanted: TopkSettings | None = None,
) -> torch.Tensor:
    """One tensor back from its wire parts (by wire name, in `wire_plan`'s order): float32 when it
    is a float. With `shape_wanted`, coded integers declaring another shape are refused before
    they are inflated: deflate can make a small object declare a large tensor, and a reader of
    untrusted deltas knows what size each must be. With `topk_wanted`, a `topk` tensor coded with
    other settings is refused too."""
    if len(parts) == 1:
        (t,) = parts.values()
        return t.float() if t.is_floating_point() else t
    if codec in SPARSE_CODECS:
        by_suffix = dict(zip(sparse.PARTS, parts.values()))
        try:
            dims = by_suffix[".shape"].tolist() if by_suffix[".shape"].dtype == torch.int64 else None
            if shape_wanted is not None and (dims is None or tuple(dims) != tuple(shape_wanted)):
                raise ValueError(f"wrong shape: {dims} instead of {tuple(shape_wanted)}")
            return sparse.decode(by_suffix, None if topk_wanted is None else sparse.Layout.of(topk_wanted))
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from exc
    (integers, q), (_, scale), (_, shape) = parts.items()
    if shape.dtype != torch.int64 or shape.dim() != 1:
        raise ValueError(f"tensor {name!r}: .shape must be a 1-D int64 tensor")
    bits = BITS[codec]
    try:
        dims = shape.tolist()
        if shape_wanted is not None and tuple(dims) != tuple(shape_wanted):
            raise ValueError(f"wrong shape: {tuple(dims)} instead of {tuple(shape_wanted)}")
        if integers.endswith(".z"):
            q = inflate_for(q, dims, bits)
        return dequantize(q, scale, dims, bits)
    except ValueError as exc:
        raise ValueError(f"tensor {name!r}: {exc}") from exc


def from_wire(wire: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """float32 tensors back from the wire form; raises ValueError naming the bad tensor."""
    plan = wire_plan({k: v.is_floating_point() for k, v in wire.items()}, codec)
    return {name: decode_one(name, {p: wire[p] for p in parts}, codec) for name, parts in plan.items()}


def packed_wire(wire: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """`wire` with each deflated `.z` part inflated back to the packed `.q` it was made from.
    Deflate's bytes differ between zlib builds while what they inflate to does not, so this is
    the form in which two writers of the same integers agree bit for bit."""
    plan = wire_plan({k: v.is_floating_point() for k, v in wire.items()}, codec)
    out: dict[str, torch.Tensor] = {}
    for name, (integers, *rest) in plan.items():
        if integers.endswith(".z"):
            out[name + ".q"] = inflate_for(wire[integers], wire[name + ".shape"].tolist(), BITS[codec])
        else:
            out[integers] = wire[integers]
        out.update((p, wire[p]) for p in rest)
    return out


def compress_with_feedback(
    delta: dict[str, torch.Tensor], residual: dict[str, torch.Tensor], codec: Codec, topk: TopkSettings | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(wire tensors of delta + β·residual, what a receiver decodes from them, the new residual).

    The new residual is (delta + β·old residual) − what the receiver will decode, so nothing the
    quantizer drops is lost: it rides along with the next delta. A lossless codec keeps none.
    β is 1 but for `topk`, whose residual holds most of each delta and decays by `topk.beta`
    (SparseLoCo's error feedback: what waits too long fades rather than grows).
    The decoded tensors are `from_wire(wire)` bit for bit, taken from the packed integers before
    they are deflated, so a sender that needs them (the synchronizer rebuilding θ_r) does not
    inflate what it has just deflated.
    """
    beta = feedback_decay(codec, topk)
    target = {n: (t.add(residual[n], alpha=beta) if n in residual else t).float() for n, t in delta.items()}
    packed = quantized_wire(target, codec, topk)
    decoded = from_wire(packed, codec)  # from the packed integers: nothing to inflate
    if codec == "fp32":
        return packed, decoded, {}
    return deflated_wire(packed, codec), decoded, {n: target[n] - decoded[n] for n in target}


def residual_state(residual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The residual as entries of the learner's saved state."""
    return {RESIDUAL_PREFIX + n: t.contiguous() for n, t in residual.items()}


def split_residual(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the rest of a saved learner state, the residual it carried)."""
    rest = {k: v for k, v in state.items() if not k.startswith(RESIDUAL_PREFIX)}
    residual = {k[len(RESIDUAL_PREFIX) :]: v for k, v in state.items() if k.startswith(RESIDUAL_PREFIX)}
    return rest, residual
