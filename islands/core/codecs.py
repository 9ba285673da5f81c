"""The wire codecs' names, defined here and nowhere else.

A codec is named by what a value travels as: a float format, `int<bits>` for block-wise
integers (islands.core.compress gives each name its meaning), or `topk` for the largest values
of each chunk and their positions (islands.core.sparse). The configuration's fields are
typed with `Codec`, and the wire format, metadata validation and benchmarks take their lists from
the tuples below, so a codec added here is one the whole pipeline offers and checks. No torch:
the configuration, which the CLI imports before anything heavy, needs the names too.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

MAX_DIMS = 8

FloatCodec = Literal["fp32", "bf16"]
IntegerCodec = Literal["int8", "int4", "int3", "int2"]
SparseCodec = Literal["topk"]
Codec = Literal[FloatCodec, IntegerCodec, SparseCodec]

FLOAT_CODECS: tuple[FloatCodec, ...] = get_args(FloatCodec)
INTEGER_CODECS: tuple[IntegerCodec, ...] = get_args(IntegerCodec)
SPARSE_CODECS: tuple[SparseCodec, ...] = get_args(SparseCodec)
CODECS: tuple[Codec, ...] = get_args(Codec)


def bits_of(codec: IntegerCodec) -> int:
    """Bits of each integer an `int<bits>` codec sends: 4 for int4."""
    return int(codec.removeprefix("int"))


def check_shape(shape: list[int]) -> int:
    """The number of values of a tensor of `shape`, as a wire object declares it; ValueError unless
    it is a tensor shape. Every coded form checks its declared shape here before sizing anything by it."""
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} is not a tensor shape")
    return math.prod(shape)
