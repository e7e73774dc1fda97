"""Round-to-nearest quantization with torch ops on the tensor's own device: ``portakern.quantize`` of a GPU tensor.

The same rule, in the same float64 arithmetic, as the numpy reference ``portakern.ir.packing.quantize_native``
(which states it), so both give the same bits (``tests/test_gemv_prepare.py`` compares them on CPU tensors); the
result is in the NATIVE packing on the tensor's device, with real bfloat16 scales where the format asks for them.
"""

from __future__ import annotations

import numpy as np
import torch

from portakern.ir.dtypes import DType
from portakern.ir.quant import Packing, QuantFormat

from .errors import InvalidInputError, InvalidTypeError


def _step_up(y: torch.Tensor, x: torch.Tensor, int_dtype) -> torch.Tensor:
    """``y`` (a non-negative float tensor) moved one unit in the last place up where it is below ``x``."""
    up = (y.view(int_dtype) + 1).view(y.dtype)
    return torch.where(y.double() < x, up, y)


def ceil_to_dtype(x: torch.Tensor, dtype: DType) -> torch.Tensor:
    """The smallest value representable in ``dtype`` that is >= ``x`` (float64, x > 0), as float64:
    ``portakern.ir.packing.ceil_to_dtype`` with torch ops."""
    if dtype is DType.float16:
        return _step_up(x.to(torch.float16), x, torch.int16).double()
    y = _step_up(x.to(torch.float32), x, torch.int32)
    if dtype is DType.bfloat16:   # bf16 = top half of fp32: truncate, then step up if bits were lost
        bits = y.view(torch.int32)
        top = bits & -65536
        y = torch.where(top != bits, top + 65536, top).view(torch.float32)
    return y.double()


def quantize_native(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                    scale_dtype: DType | str) -> tuple[dict[str, torch.Tensor], QuantFormat]:
    """``portakern.ir.packing.quantize_native`` for a torch tensor, computed on its device: returns
    ``(tensors, fmt)`` with the NATIVE packing's tensors (``qweight`` uint8, ``scales`` in the scale dtype,
    ``zeros`` uint8 for asymmetric formats) on ``w``'s device. Raises as the reference does."""
    N, K = (int(s) for s in w.shape)
    if not isinstance(symmetric, (bool, np.bool_)):
        raise InvalidTypeError(f"symmetric={symmetric!r} must be True or False (a bool, not a "
                               f"{type(symmetric).__name__})")
    fmt = QuantFormat(bits=bits, group_size=group_size, symmetric=bool(symmetric), packing=Packing.NATIVE,
                      scale_dtype=DType.parse(scale_dtype, argument="scale_dtype"))
    fmt.verify(K=K, N=N)
    w = w.detach().to(torch.float64)
    finite = torch.isfinite(w)
    if not bool(finite.all()):
        bad = tuple(int(i) for i in torch.nonzero(~finite)[0])
        raise InvalidInputError(f"w{list(bad)}={w[bad].item()}: w must be finite to quantize; replace NaN/Inf first")
    wg = w.reshape(N, K // group_size, group_size)
    if fmt.symmetric:
        qmax = (1 << (bits - 1)) - 1
        raw = wg.abs().amax(dim=-1) / qmax
    else:
        qmax = (1 << bits) - 1
        lo = torch.clamp(wg.amin(dim=-1), max=0.0)
        hi = torch.clamp(wg.amax(dim=-1), min=0.0)
        raw = (hi - lo) / qmax
    scales = ceil_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), fmt.scale_dtype)
    if not bool(torch.isfinite(scales).all()):
        big = float(w.abs().max())
        wider = "pass scale_dtype='float32' or " if fmt.scale_dtype is DType.float16 else ""
        raise InvalidInputError(f"w has values up to {big:.4g}: its scale overflows scale_dtype="
                                f"{fmt.scale_dtype.value}; {wider}rescale w")
    s = scales[..., None]
    if fmt.symmetric:
        zeros = None
        codes = torch.clamp(torch.round(wg / s), -qmax, qmax) + fmt.zero_point
    else:
        zeros = torch.clamp(torch.round(-lo / scales), 0, qmax)
        codes = torch.clamp(torch.round(wg / s) + zeros[..., None], 0, qmax)
    c = codes.reshape(N, K).to(torch.uint8)
    qweight = (c[:, 0::2] | (c[:, 1::2] << 4)) if bits == 4 else c
    out = {"qweight": qweight.contiguous(), "scales": scales.to(getattr(torch, fmt.scale_dtype.value))}
    if zeros is not None:
        out["zeros"] = zeros.to(torch.uint8)
    return out, fmt


__all__ = ["ceil_to_dtype", "quantize_native"]
