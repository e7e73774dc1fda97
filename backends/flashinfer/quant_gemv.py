"""Quantized GEMV on the flashinfer backend: none. FlashInfer's GEMM kernels are not wired into portakern.

This module keeps the backend's shape (every backend has ``attention`` and ``quant_gemv``): ``supports`` refuses
every quant_gemv op with ``REASON`` and ``compile`` raises ``NotImplementedError`` with the same text.
"""

from __future__ import annotations

from portakern.backend import Support, no

#: why the flashinfer backend refuses quant_gemv, and the way out
REASON = ("op 'quant_gemv' has no flashinfer lowering: portakern drives only FlashInfer's attention kernels; leave "
          "backend unset (the triton / cuda backends on NVIDIA GPUs) or pass backend='torch' for torch's tinygemm")


def supports(op, device) -> Support:
    """Always no, with ``REASON``."""
    return no(REASON)


def compile(op, device):
    """Raise ``NotImplementedError(REASON)``: there is no kernel to build."""
    raise NotImplementedError(REASON)
