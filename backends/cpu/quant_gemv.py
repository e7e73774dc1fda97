"""Reference weight-only quantized GEMV: ``out = x @ dequant(W)^T`` in float64.

The dequantization itself (``(q - z) * s`` per group, for every packing) lives in
``portakern.ir.packing``: the same numpy unpackers the round-trip tests prove, so the reference
adds no second reading of any byte layout.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from portakern.errors import InvalidInputError
from portakern.ir.ops import QuantGemv


def quant_gemv_kernel(op: QuantGemv) -> Callable[..., None]:
    """Build the reference kernel for ``op``: ``kernel(x, weight, out)``.

    Args:
        op: a verified ``QuantGemv`` node.

    Returns:
        A function taking numpy ``x (M, K)`` (``(M, 2K)`` with the ``silu_mul`` prologue; bf16 arrives as
        float32), a ``QuantizedWeight`` whose ``tensors`` are numpy arrays, and ``out (M, N)``; it computes
        ``x @ dequant(W)^T`` (``silu(gate) * up`` for ``x`` with the prologue) in float64 and writes every
        element of ``out`` (cast to its dtype).

    Raises (from the kernel):
        InvalidInputError: ``x``, ``out`` or the weight do not match the op's shapes or format.
    """
    op.verify()

    def kernel(x, weight, out) -> None:
        # lazy: the packers are only needed once a quantized kernel actually runs
        from portakern.ir.packing import dequantize

        # -- check operands against the op
        _check(op, x, weight, out)
        # -- the input: x itself, or silu(gate) * up (prologue "silu_mul"), in float64
        xin = x_input(op, np.asarray(x, dtype=np.float64))
        # -- dequantize W (N, K) to float64, then one float64 matmul
        w = dequantize(op.fmt, weight.tensors, op.N, op.K)
        out[...] = xin @ np.asarray(w, dtype=np.float64).T

    kernel.__name__ = f"cpu_quant_gemv_{op.content_hash()}"
    return kernel


def compile(op: QuantGemv, device=None) -> Callable[..., None]:
    """The lowering's entry point for the backend base: ``quant_gemv_kernel(op)`` (the host is the only device)."""
    return quant_gemv_kernel(op)


def x_input(op: QuantGemv, x: np.ndarray) -> np.ndarray:
    """The GEMV's ``(M, K)`` input from float64 ``x`` (``op.shapes()["x"]``): ``x`` itself, or with the
    ``silu_mul`` prologue ``silu(gate) * up`` of its two halves (``silu(g) = g * sigmoid(g)``, the sigmoid as
    ``(1 + tanh(g / 2)) / 2``: no overflow for any finite g)."""
    if op.prologue is None:
        return x
    gate, up = x[:, :op.K], x[:, op.K:]
    return gate * (0.5 * (1.0 + np.tanh(0.5 * gate))) * up


def _check(op: QuantGemv, x, weight, out) -> None:
    """Raise naming the operand when a shape or the weight's format differs from ``op``."""
    for name, arr, want in (("x", x, op.shapes()["x"]), ("out", out, (op.M, op.N))):
        if tuple(arr.shape) != want:
            raise InvalidInputError(f"{name} has shape {tuple(arr.shape)}, expected {want} for "
                                    f"QuantGemv(M={op.M}, N={op.N}, K={op.K})")
    if (weight.N, weight.K) != (op.N, op.K):
        raise InvalidInputError(f"weight has shape {(weight.N, weight.K)}, expected (N, K) = "
                                f"{(op.N, op.K)}: build the op with N=weight.N, K=weight.K")
    if weight.fmt != op.fmt:
        raise InvalidInputError(f"weight format {weight.fmt} differs from the op's format {op.fmt}: "
                                "build the op with fmt=weight.fmt")
