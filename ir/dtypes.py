"""Element types and tensor specs of the kernel IR."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import InvalidInputError


class DType(str, enum.Enum):
    """Element types the IR knows. The value is the canonical lower-case name."""

    # floating point
    float16 = "float16"
    bfloat16 = "bfloat16"
    float32 = "float32"
    float64 = "float64"
    # integers (indices, packed quantized payloads)
    int8 = "int8"
    uint8 = "uint8"
    int32 = "int32"
    int64 = "int64"

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, value: object, *, argument: str = "dtype") -> "DType":
        """Return the DType named by ``value`` (a DType, a string, a numpy/torch dtype).

        Raises ``InvalidInputError`` naming ``argument`` when the value is not an IR dtype.
        """
        if isinstance(value, DType):
            return value
        name = str(value)
        for prefix in ("torch.", "<class 'numpy.", "numpy."):
            if name.startswith(prefix):
                name = name[len(prefix):]
        name = name.rstrip("'>")
        name = _ALIASES.get(name, name)
        try:
            return cls(name)
        except ValueError:
            raise InvalidInputError(
                f"{argument}={value!r} is not an IR dtype: expected one of "
                f"{', '.join(d.value for d in cls)}"
            ) from None


_FLOATS = {DType.float16, DType.bfloat16, DType.float32, DType.float64}
_ITEMSIZE = {
    DType.float16: 2, DType.bfloat16: 2, DType.float32: 4, DType.float64: 8,
    DType.int8: 1, DType.uint8: 1, DType.int32: 4, DType.int64: 8,
}
_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16",
            "fp16": "float16", "fp32": "float32", "f2": "float16", "f4": "float32", "f8": "float64"}

#: Activation / attention storage dtypes every backend is asked about.
STORAGE_FLOATS = (DType.float16, DType.bfloat16, DType.float32)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one operand. ``strides`` is None for C-contiguous."""

    shape: tuple[int, ...]
    dtype: DType
    strides: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize
