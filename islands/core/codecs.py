"""The wire codecs' names, defined here and nowhere else.

A codec is named by what a value travels as: a float format, or `int<bits>` for block-wise
integers (islands.core.compress gives each name its meaning). The configuration's fields are
typed with `Codec`, and the wire format, metadata validation and benchmarks take their lists from
the tuples below, so a codec added here is one the whole pipeline offers and checks. No torch:
the configuration, which the CLI imports before anything heavy, needs the names too.
"""

from __future__ import annotations

from typing import Literal, get_args

FloatCodec = Literal["fp32", "bf16"]
IntegerCodec = Literal["int8", "int4", "int3", "int2"]
Codec = Literal[FloatCodec, IntegerCodec]

FLOAT_CODECS: tuple[FloatCodec, ...] = get_args(FloatCodec)
INTEGER_CODECS: tuple[IntegerCodec, ...] = get_args(IntegerCodec)
CODECS: tuple[Codec, ...] = get_args(Codec)


def bits_of(codec: IntegerCodec) -> int:
    """Bits of each integer an `int<bits>` codec sends: 4 for int4."""
    return int(codec.removeprefix("int"))
