"""Quantized GEMV on the fa4 backend: none. FlashAttention-4 is an attention library.

This module keeps the backend's shape (every backend has ``attention`` and ``quant_gemv``): ``supports`` refuses
every quant_gemv op with ``REASON`` and ``compile`` raises ``NotImplementedError`` with the same text.
"""

from __future__ import annotations

from portakern.backend import Support, no

#: why the fa4 backend refuses quant_gemv, and the way out
REASON = ("op 'quant_gemv' has no fa4 lowering: FlashAttention-4 has no GEMV kernel; leave backend unset (the "
          "triton / cuda backends on NVIDIA GPUs) or pass backend='torch' for torch's tinygemm")


def supports(op, device) -> Support:
    """Always no, with ``REASON``."""
    return no(REASON)


def compile(op, device):
    """Raise ``NotImplementedError(REASON)``: there is no kernel to build."""
    raise NotImplementedError(REASON)
