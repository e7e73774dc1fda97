"""``portakern.quantize``: round-to-nearest quantization of a float weight into the native packing."""

from __future__ import annotations

from typing import Any

from portakern.ir import packing
from portakern.ir.dtypes import DType

from .arrays import device_of, kind_of, to_numpy
from .errors import InvalidInputError, InvalidTypeError
from .quantized import QuantizedWeight
from .validate import _is_int, check_dense_array

_FLOAT_INPUTS = (DType.float16, DType.bfloat16, DType.float32, DType.float64)


_SCALE_DTYPES = ("float16", "bfloat16", "float32")


def quantize(w: Any, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
             scale_dtype: str | DType = "float16") -> QuantizedWeight:
    """Quantize a float weight ``w (N, K)`` (out x in features) into a ``QuantizedWeight``.

    Round-to-nearest min/max per group of ``group_size`` consecutive input channels, stored in the
    NATIVE packing (see ``portakern.ir.Packing``); ``portakern.ir.packing.quantize_native`` states
    the exact rule. Asymmetric (default) stores an integer zero point per group; ``symmetric=True``
    uses the fixed zero point ``2^(bits-1)``. Every group satisfies ``max|w - dequant| <= scale/2``.

    Args:
        w: numpy array, torch tensor (CPU or GPU) or cupy array of float16/bfloat16/float32/float64.
        bits: 4 or 8.
        group_size: a divisor of K (>= 2), or -1 for one group per row.
        symmetric: no zero points when True.
        scale_dtype: "float16" (default), "bfloat16" or "float32".

    A torch tensor on a GPU is quantized there with torch ops (``portakern.quantize_torch``: the same float64
    arithmetic, the same bits as the numpy reference, no copy through the host); other arrays on the host.

    Returns:
        A ``QuantizedWeight`` whose tensors are in ``w``'s array library and on ``w``'s device
        (numpy has no bfloat16: numpy weights keep bfloat16 scales as bf16-exact float32).

    Raises:
        InvalidTypeError: ``w`` is not a dense float array of a supported library (sparse torch
            tensors and numpy masked arrays are refused).
        InvalidInputError: bad or empty shape (N, K >= 1), bits, group size, non-finite values,
            scale overflow.
        InvalidTypeError: also for a ``symmetric`` that is not a bool (``"False"`` is refused, not
            read as true).
    """
    kind = kind_of(w, "w")
    check_dense_array(w, kind, "w")  # sparse torch / numpy masked: no plain values to quantize
    try:
        device_of(w, kind)   # a torch device no backend runs on (meta) is refused before any value is read
    except InvalidTypeError as e:
        raise InvalidTypeError(f"w: {e}") from None
    try:
        dt = DType.parse(str(w.dtype), argument="w.dtype")
    except InvalidInputError:
        dt = None
    if dt not in _FLOAT_INPUTS:
        raise InvalidTypeError(f"w has dtype {w.dtype}: quantize takes a float weight (float16, bfloat16, "
                               "float32 or float64); convert it first")
    if len(w.shape) != 2:
        raise InvalidInputError(f"w has shape {tuple(w.shape)}: expected a 2-D weight (N, K) = (out, in "
                                "features); reshape it, e.g. w.reshape(N, -1)")
    N, K = (int(s) for s in w.shape)
    if N < 1 or K < 1:
        raise InvalidInputError(f"w has shape {(N, K)}: quantize needs N >= 1 output rows and K >= 1 input "
                                "columns; skip the empty weight or pass a non-empty one")
    if not _is_int(bits) or bits not in (4, 8):
        raise InvalidInputError(f"bits={bits!r} is not supported by portakern.quantize: choose 4 or 8")
    if group_size == -1:
        if K < 2:
            raise InvalidInputError(f"group_size=-1 makes one group of K={K} column, but a group needs at least 2 "
                                    "columns; quantize a weight with K >= 2 (pad it with a zero column)")
        group_size = K
    if not _is_int(group_size) or group_size < 2:
        raise InvalidInputError(f"group_size={group_size!r} must be an int >= 2 (or -1 for one group per row)")
    bits, group_size = int(bits), int(group_size)  # numpy ints are fine; the packing takes Python ints
    try:   # every spelling DType.parse reads ("fp16", torch.float16, ...), but only the three scale dtypes
        scale_ok = DType.parse(scale_dtype, argument="scale_dtype").value in _SCALE_DTYPES
    except InvalidInputError:
        scale_ok = False
    if not scale_ok:
        raise InvalidInputError(f"scale_dtype={scale_dtype!r} is not a scale dtype of portakern.quantize: choose "
                                f"{', '.join(map(repr, _SCALE_DTYPES))} (float16 is the default)")
    if K % group_size:
        divisors = [g for g in (256, 128, 64, 32) if K % g == 0]
        hint = f"such as {', '.join(map(str, divisors))}, " if divisors else ""
        raise InvalidInputError(f"group_size={group_size} does not divide K={K}: pick a divisor of K "
                                f"({hint}or -1 for one group per row) or pad K to a multiple of {group_size}")
    if kind == "torch" and w.device.type != "cpu":   # on the GPU, with torch ops: no round trip through the host
        from .quantize_torch import quantize_native

        tensors, fmt = quantize_native(w, bits, group_size, symmetric, scale_dtype)
        return QuantizedWeight(fmt, N, K, tensors)
    host, fmt = packing.quantize_native(to_numpy(w), bits, group_size, symmetric, scale_dtype)
    return QuantizedWeight(fmt, N, K, _like(host, kind, w, fmt.scale_dtype))


def _like(host: dict, kind: str, w: Any, scale_dtype: DType) -> dict:
    """Move the numpy tensors to ``w``'s library and device (bf16 scales become real bf16 there)."""
    if kind == "numpy":
        return host
    if kind == "torch":
        import torch

        out = {k: torch.from_numpy(v).to(w.device) for k, v in host.items()}
        if scale_dtype is DType.bfloat16:
            out["scales"] = out["scales"].to(torch.bfloat16)  # exact: the values are bf16 already
        return out
    import cupy

    with cupy.cuda.Device(device_of(w, kind).index):
        return {k: cupy.asarray(v) for k, v in host.items()}
