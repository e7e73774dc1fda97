"""Quantized GEMV by dequantize + matmul: ``out = x @ dequant(W)^T`` in float32.

The weight is dequantized once, when portakern first hands it to this backend
(``Backend.prepare_weight``; portakern caches the result on the ``QuantizedWeight``), so a call is
one float32 matmul. That trades memory for simplicity: a real backend would keep the packed bytes.
"""

from __future__ import annotations

from typing import Callable

import torch

from portakern import Device
from portakern.arrays import kind_of, to_numpy
from portakern.ir.ops import QuantGemv


def prepare_weight(weight, device: Device) -> torch.Tensor:
    """What portakern hands the kernel for ``weight`` (once per weight and device): ``dense_weight``. Every packing
    works: it dequantizes through ``QuantizedWeight.dequantize()``, so this module needs no ``supports``."""
    return dense_weight(weight, device)


def compile(op: QuantGemv, device: Device) -> Callable[..., None]:
    """The kernel for ``op``: ``quant_gemv_kernel(op)``."""
    return quant_gemv_kernel(op)


def dense_weight(weight, device: Device) -> torch.Tensor:
    """``weight.dequantize()`` as a contiguous float32 ``(N, K)`` tensor on ``device``."""
    w = weight.dequantize()
    t = w if kind_of(w) == "torch" else torch.from_numpy(to_numpy(w))
    target = "cpu" if device.type == "cpu" else f"cuda:{device.index}"
    return t.to(device=target, dtype=torch.float32).contiguous()


def quant_gemv_kernel(op: QuantGemv) -> Callable[..., None]:
    """Build ``kernel(x, w, out)``: ``x (M, K)``, ``w`` the dense float32 weight, ``out (M, N)``."""

    def kernel(x, w, out) -> None:
        out.copy_(x.float() @ w.T)

    return kernel
