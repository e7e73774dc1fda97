"""Round-to-nearest quantization with torch ops on the tensor's own device: ``portakern.quantize`` of a GPU tensor.

The same rule as the numpy reference ``portakern.ir.packing.quantize_native`` (which states it), in its float64
arithmetic where that matters (the group statistics and scales; the quotients where ``quotient_dtype`` says float32
could round differently), so both give the same bits (``tests/test_gemv_prepare.py`` compares them on CPU tensors); the
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


def quotient_dtype(w_dtype, scale_dtype: DType):
    """The float type in which ``round(w / scale)`` gives the codes the float64 reference gives: float32 where
    that is proven to round alike, float64 otherwise.

    float32 suffices for a float16 / bfloat16 / float32 ``w`` and a float16 / bfloat16 scale. Write ``w = A 2^a``
    and ``s = B 2^b`` with integers ``A < 2^24`` and ``B < 2^11``; ``|w / s| <= 255`` (the scale is at least the
    group's largest magnitude over the largest code). A half-integer quotient (where ``round`` breaks ties) has at
    most 9 significant bits, so float32 holds it exactly. Any other quotient is at least ``min(1 / (2 B),
    |w / s| / A)`` away from every half-integer (the difference is a non-zero integer over ``2 B``, or over
    ``B 2^(b - a)``), while float32 division errs by at most ``|w / s| 2^-24``: below both bounds, so the float32
    quotient rounds to the same integer. A float32 scale (``B`` up to ``2^24``) or a float64 ``w`` breaks the
    bounds: those take float64, as the reference."""
    narrow = w_dtype in (torch.float16, torch.bfloat16, torch.float32)
    return torch.float32 if narrow and scale_dtype in (DType.float16, DType.bfloat16) else torch.float64


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
    w = w.detach()
    finite = torch.isfinite(w)   # in w's own dtype: the same answer, without a float64 copy of w
    if not bool(finite.all()):
        bad = tuple(int(i) for i in torch.nonzero(~finite)[0])
        raise InvalidInputError(f"w{list(bad)}={w[bad].item()}: w must be finite to quantize; replace NaN/Inf first")
    wg = w.reshape(N, K // group_size, group_size)
    # the groups' extremes in w's dtype (exact there), then the reference's float64 arithmetic on them
    if fmt.symmetric:
        qmax = (1 << (bits - 1)) - 1
        raw = wg.abs().amax(dim=-1).double() / qmax
    else:
        qmax = (1 << bits) - 1
        lo_w, hi_w = torch.aminmax(wg, dim=-1)
        lo = torch.clamp(lo_w.double(), max=0.0)
        hi = torch.clamp(hi_w.double(), min=0.0)
        raw = (hi - lo) / qmax
    scales = ceil_to_dtype(torch.where(raw == 0, torch.ones_like(raw), raw), fmt.scale_dtype)
    if not bool(torch.isfinite(scales).all()):
        big = float(w.abs().max())
        wider = "pass scale_dtype='float32' or " if fmt.scale_dtype is DType.float16 else ""
        raise InvalidInputError(f"w has values up to {big:.4g}: its scale overflows scale_dtype="
                                f"{fmt.scale_dtype.value}; {wider}rescale w")
    ct = quotient_dtype(w.dtype, fmt.scale_dtype)
    codes = wg.to(ct) / scales.to(ct)[..., None]
    torch.round(codes, out=codes)
    if fmt.symmetric:
        zeros = None
        codes.clamp_(-qmax, qmax).add_(fmt.zero_point)
    else:
        zeros = torch.clamp(torch.round(-lo / scales), 0, qmax)
        codes.add_(zeros.to(ct)[..., None]).clamp_(0, qmax)
    c = codes.reshape(N, K).to(torch.uint8)
    qweight = (c[:, 0::2] | (c[:, 1::2] << 4)) if bits == 4 else c
    out = {"qweight": qweight.contiguous(), "scales": scales.to(getattr(torch, fmt.scale_dtype.value))}
    if zeros is not None:
        out["zeros"] = zeros.to(torch.uint8)
    return out, fmt


__all__ = ["ceil_to_dtype", "quantize_native", "quotient_dtype"]
