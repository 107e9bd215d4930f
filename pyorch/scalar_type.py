"""vLLM's ScalarType for the quantized-weight ops (`scalar_types.uint4b8`, `scalar_types.uint4`).

The ops take a type as its integer `id`, packed as vLLM packs it (vllm/scalar_type.py): mantissa
bits 0-7, exponent bits 8-15, signed bit 16, bias bits 17-48, finite-values-only bit 49, NaN
representation bits 50-57. pyorch's W4A16 kernels read the first four fields
(cpp/w4a16_checks.h).
"""

from dataclasses import dataclass
from enum import Enum


class NanRepr(Enum):
    NONE = 0
    IEEE_754 = 1
    EXTD_RANGE_MAX_MIN = 2


@dataclass(frozen=True)
class ScalarType:
    exponent: int
    mantissa: int
    signed: bool
    bias: int
    _finite_values_only: bool = False
    nan_repr: NanRepr = NanRepr.IEEE_754

    @property
    def size_bits(self) -> int:
        return self.exponent + self.mantissa + int(self.signed)

    @property
    def id(self) -> int:
        fields = [
            (self.mantissa, 8),
            (self.exponent, 8),
            (int(self.signed), 1),
            (self.bias, 32),
            (int(self._finite_values_only), 1),
            (self.nan_repr.value, 8),
        ]
        value, offset = 0, 0
        for field, width in fields:
            value |= (field & ((1 << width) - 1)) << offset
            offset += width
        return value

    @classmethod
    def uint(cls, size_bits: int, bias: int | None) -> "ScalarType":
        return cls(0, size_bits, False, bias or 0)

    @classmethod
    def int_(cls, size_bits: int, bias: int | None) -> "ScalarType":
        return cls(0, size_bits - 1, True, bias or 0)

    def __str__(self) -> str:
        kind = "int" if self.signed else "uint"
        return f"{kind}{self.size_bits}" + (f"b{self.bias}" if self.bias else "")


class scalar_types:  # noqa: N801 - vLLM's name
    int4 = ScalarType.int_(4, None)
    uint4 = ScalarType.uint(4, None)
    int8 = ScalarType.int_(8, None)
    uint8 = ScalarType.uint(8, None)
    uint4b8 = ScalarType.uint(4, 8)
    uint8b128 = ScalarType.uint(8, 128)
