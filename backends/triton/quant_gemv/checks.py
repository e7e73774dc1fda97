"""Host-side checks of the triton GEMV launcher: the kernels' 32-bit element offsets (x and output row strides) and
a prepared weight matching the op and device a launcher was compiled for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from portakern.errors import InvalidInputError, InvalidTypeError
from portakern.ir.gguf_kquants import gemv_bits

if TYPE_CHECKING:
    from portakern.ir.ops import QuantGemv

    from portakern.gemv_weight import PreparedGemvWeight

#: The kernels compute element offsets into x and the output as 32-bit integers (``row * stride + column``).
MAX_OFFSET = 2**31 - 1


def max_row_stride(rows: int, cols: int) -> int:
    """The largest row stride of a ``(rows, cols)`` array whose last element lies within ``MAX_OFFSET`` of its
    first (one row: any stride, the kernels never multiply it)."""
    if rows <= 1:
        return 1 << 62
    return (MAX_OFFSET - cols + 1) // (rows - 1)


def raise_out_stride(M: int, stride: int) -> None:
    """The error of an output view whose rows lie too far apart for the kernels' 32-bit offsets."""
    raise InvalidInputError(f"out has row stride {stride}: its {M} rows span {(M - 1) * stride} elements or more, "
                            f"past the 2^31 the triton kernels' 32-bit offsets reach; pass a contiguous out "
                            f"(torch.empty((M, N))) and copy it into the view")


def check_weight(op: QuantGemv, w: PreparedGemvWeight, tdev: str) -> None:
    """Raise unless ``w`` is a weight of ``op`` on ``tdev``: its shape, bits and group size are the op's (the
    launcher's grid and constexprs are; the bits of its words: ``gemv_bits``), and every tensor of it lives on the
    device the kernel launches on (a kernel reading another GPU's memory faults, which ends the CUDA context)."""
    f = op.fmt
    for what, got, want in (("(N, K)", (w.N, w.K), (op.N, op.K)), ("bits", w.bits, gemv_bits(f)),
                            ("group_size", w.group_size, f.group_size)):
        if got != want:
            raise InvalidInputError(f"prepared weight has {what} = {got} but this quant_gemv op was compiled for "
                                    f"{want}; prepare the weight of this op, or compile the op of this weight")
    for name, t in w.tensors().items():
        if str(t.device) != tdev:
            raise InvalidTypeError(f"prepared weight's {name} is on {t.device} but this quant_gemv kernel was "
                                   f"compiled for {tdev}; prepare the weight on {tdev} (prepare_weight(..., device)) "
                                   f"or compile the op for {t.device}")
