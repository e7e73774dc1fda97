"""Host side of the opencl quantized GEMV: the load-time repack, building ``kernels/quant_gemv.cl``, launching.

``prepare_weight`` reads any packing once (``portakern.ir.packing.unpack_affine``: codes, scales, zero points,
float minimums, group of each k) and stores one layout the kernel reads for all of them (see the kernel's header):
unsigned codes (GGUF Q8_0's signed codes shifted by 128, with zero point 128; 4-bit codes two a byte, 5-, 6- and
8-bit codes one a byte), float32 scales and zero points (exact: fp16 / bf16 / fp32 scales, small integer zero
points, and the K-quants' products ``d * sc`` of a float16 and a 6-bit integer), int32 ``g_idx`` for GPTQ
act-order, and for GGUF Q4_K / Q5_K float32 minimums ``dmin * m`` per group (exact for the same reason), which
the kernel subtracts as ``min * sum(x over the group)`` (its ``HAS_MINS`` path). GGUF Q6_K is 6-bit codes with
zero point 32 and float32 scales ``d * sc`` in groups of 16 (``gguf_kquants.q6_k_to_native``'s exact form). The
arrays go to each OpenCL context that uses the weight once, then stay there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from portakern.backend import YES, Support, no
from portakern.errors import BackendError, InvalidInputError
from portakern.ir.dtypes import DType
from portakern.ir.ops import QuantGemv
from portakern.ir.quant import Packing, QuantFormat

from . import tuning
from .common.program import build, defines, digest, kernel_source, work_group_cap

_STORAGE = {DType.float16: "float16", DType.float32: "float32", DType.bfloat16: "float32"}


@dataclass
class Prepared:
    """A weight repacked for the kernel: host arrays, and their copies per OpenCL context (by pointer)."""

    fmt: QuantFormat
    N: int
    K: int
    host: dict[str, np.ndarray]
    on_device: dict[int, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def buffers(self, queue) -> dict[str, Any]:
        key = queue.context.int_ptr
        bufs = self.on_device.get(key)
        if bufs is None:
            import pyopencl.array as cla

            with self.lock:
                bufs = self.on_device.get(key)
                if bufs is None:
                    bufs = self.on_device[key] = {n: cla.to_device(queue, a) for n, a in self.host.items()}
        return bufs


def prepare_weight(weight, device) -> Prepared:
    """Repack ``weight`` (numpy, torch or pyopencl tensors, any packing) into the kernel's layout, once."""
    from portakern.arrays import to_numpy
    from portakern.ir.packing import unpack_affine

    fmt, N, K = weight.fmt, weight.N, weight.K
    tensors = {n: to_numpy(t) for n, t in weight.tensors.items()}
    codes, scales, zeros, mins, group = unpack_affine(fmt, tensors, N, K)
    if fmt.packing is Packing.GGUF_Q8_0:        # signed codes -> unsigned, zero point 0 -> 128
        codes, zeros = codes + 128, zeros + 128
    c = codes.astype(np.uint8)
    packed = (c[:, 0::2] | (c[:, 1::2] << np.uint8(4))) if code_bits(fmt) == 4 else c
    unused = np.zeros(1, np.float32)            # a kernel argument its path never reads
    host = {"codes": np.ascontiguousarray(packed), "scales": _exact_f32(scales, "scales", fmt),
            "zeros": unused if fmt.has_mins else _exact_f32(zeros, "zeros", fmt),
            "mins": _exact_f32(mins, "mins", fmt) if fmt.has_mins else unused}
    host["g_idx"] = np.ascontiguousarray(group, dtype=np.int32) if fmt.has_g_idx else np.zeros(1, np.int32)
    prepared = Prepared(fmt, N, K, host)
    if device.type == "opencl":                 # copy now, to the device's cached context
        from portakern.opencl_runtime import queue

        prepared.buffers(queue(device))
    return prepared


def _exact_f32(a: np.ndarray, name: str, fmt: QuantFormat) -> np.ndarray:
    """``a`` (float64) as float32, which holds every value of every packing exactly (see the module docstring);
    a value it would round raises ``BackendError`` rather than compute with a different weight."""
    out = np.ascontiguousarray(a, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        same = (out.astype(np.float64) == a) | (np.isnan(out) & np.isnan(a))
    if not same.all():
        i = np.unravel_index(int(np.argmin(same)), a.shape)
        raise BackendError(f"opencl quant_gemv: {fmt.packing.value} {name}{list(map(int, i))} = {a[i]!r} is not "
                           "exact in float32, which the kernel reads; use backend='cpu' (float64)")
    return out


def supports(op: QuantGemv, device) -> Support:
    dtype, out_dtype = DType.parse(op.dtype), DType.parse(op.result_dtype)
    if dtype not in _STORAGE or out_dtype not in _STORAGE:
        return no(f"dtype={dtype.value}, out_dtype={out_dtype.value}: the opencl backend stores float16 or float32 "
                  "(bfloat16 from torch travels as float32); convert x to float16 or float32")
    if code_bits(op.fmt) is None:
        return no(f"QuantFormat bits={op.fmt.bits}: the opencl GEMV kernel unpacks 4-bit codes two a byte and 5- to "
                  "8-bit codes one a byte only; use backend='cpu'")
    return YES


def code_bits(fmt: QuantFormat) -> int | None:
    """Bits a code takes in the kernel's layout: 4 (two a byte) or 8 (5-, 6- and 8-bit codes one a byte);
    None for a width the kernel does not unpack."""
    return 4 if fmt.bits == 4 else 8 if 5 <= fmt.bits <= 8 else None


def _chunk(fmt: QuantFormat) -> int:
    """Codes per work-item step: the largest of 16, 8, 4, 2, 1 dividing the group size (a chunk never spans
    two groups, so its scale and zero point are read once); a whole group where the format subtracts a float
    minimum (the kernel adds the group's minimum term once per chunk)."""
    if fmt.has_mins:
        return fmt.group_size
    for ch in (16, 8, 4, 2, 1):
        if fmt.group_size % ch == 0:
            return ch
    return 1


def program_source(op: QuantGemv, xin_float: bool, wg: int = tuning.GEMV_WG) -> str:
    fmt = op.fmt
    half_x, half_out = (DType.parse(d) is DType.float16 for d in (op.dtype, op.result_dtype))
    vals = dict(K=op.K, N=op.N, M=op.M, MT=min(tuning.GEMV_MT, op.M, wg), WG=wg, GS=fmt.group_size,
                NG=op.K // fmt.group_size, CH=_chunk(fmt), BITS=code_bits(fmt), HAS_GIDX=int(fmt.has_g_idx),
                HAS_MINS=int(fmt.has_mins), IN_HALF=int(half_x), OUT_HALF=int(half_out), XIN_FLOAT=int(xin_float))
    return f"/* portakern opencl quant_gemv {op.content_hash()} */\n" + defines(vals) + kernel_source("quant_gemv.cl")


def compile(op: QuantGemv, device) -> Callable[..., None]:
    """``kernel(x, prepared, out)`` on pyopencl arrays; builds per OpenCL context on first use."""
    op.verify()
    silu = op.prologue == "silu_mul"
    wg = work_group_cap(device, tuning.GEMV_WG)     # the row writes need MT <= WG: both shrink on a small device
    source = program_source(op, xin_float=silu, wg=wg)
    key = digest(source)
    x_shape = op.shapes()["x"]
    want_x, want_out = (np.dtype(_STORAGE[DType.parse(d)]) for d in (op.dtype, op.result_dtype))
    mt = min(tuning.GEMV_MT, op.M, wg)
    mins, ng = op.fmt.has_mins, op.K // op.fmt.group_size

    def kernel(x, weight: Prepared, out) -> None:
        # -- check operands against the op
        if tuple(x.shape) != x_shape or tuple(out.shape) != (op.M, op.N):
            raise InvalidInputError(f"x has shape {tuple(x.shape)} and out {tuple(out.shape)}: expected {x_shape} "
                                    f"and {(op.M, op.N)} for QuantGemv(M={op.M}, N={op.N}, K={op.K})")
        if not isinstance(weight, Prepared) or (weight.fmt, weight.N, weight.K) != (op.fmt, op.N, op.K):
            raise InvalidInputError("weight does not match the op (format, N, K): pass the QuantizedWeight the op "
                                    "was built from; the backend repacks it through prepare_weight")
        if x.dtype != want_x or out.dtype != want_out:
            raise InvalidInputError(f"x has dtype {x.dtype}, out {out.dtype}: this kernel reads {want_x} and "
                                    f"writes {want_out}")
        if out.offset or not out.flags.c_contiguous:
            raise InvalidInputError("out must be a contiguous array at offset 0 of its buffer")
        queue = out.queue
        w = weight.buffers(queue)
        it = x.dtype.itemsize
        x_buf, x_off, x_sm = x.base_data, np.int64(x.offset // it), np.int64(x.strides[0] // it)
        # -- prologue: silu(gate) * up into a float32 (M, K) buffer, once for all output columns
        if silu:
            import pyopencl.array as cla

            xin = cla.empty(queue, (op.M, op.K), np.float32)
            pro = build(queue.context, source, "quant_gemv", "pk_silu_mul", key)
            pro(queue, (-(-op.K // wg) * wg, op.M), (wg, 1), x_buf, xin.base_data, x_off, x_sm)
            x_buf, x_off, x_sm = xin.base_data, np.int64(0), np.int64(op.K)
        # -- float minimums: the sums of x_in over each group, once for all output columns
        xs = w["mins"]                            # unused by a kernel without HAS_MINS
        if mins:
            import pyopencl.array as cla

            xs = cla.empty(queue, (op.M, ng), np.float32)
            sums = build(queue.context, source, "quant_gemv", "pk_group_sums", key)
            sums(queue, (-(-ng // wg) * wg, op.M), (wg, 1), x_buf, xs.data, x_off, x_sm)
        # -- the GEMV: one work-group per (column, block of MT rows)
        knl = build(queue.context, source, "quant_gemv", "pk_quant_gemv", key)
        knl(queue, (op.N * wg, -(-op.M // mt)), (wg, 1), x_buf, w["codes"].data, w["scales"].data,
            w["zeros"].data, w["g_idx"].data, w["mins"].data, xs.data, out.base_data, x_off, x_sm)

    kernel.__name__ = f"opencl_quant_gemv_{op.content_hash()}"
    return kernel
