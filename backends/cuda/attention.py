"""Attention on the cuda backend: no kernel yet.

The cuda backend has no CUDA attention kernel; on NVIDIA GPUs the triton backend serves attention. This module keeps
the backend's shape (every backend has ``attention`` and ``quant_gemv``) and says so with the way out: ``supports``
refuses every attention op with ``REASON``, and ``compile`` / ``compile_for_target`` raise ``NotImplementedError``
with the same text should anything call them without asking.
"""

from __future__ import annotations

from portakern.backend import Support, no

#: why the cuda backend refuses attention, and the way out
REASON = ("op 'attention' has no cuda lowering yet: the cuda backend has no CUDA attention kernel; the triton backend "
          "serves attention on NVIDIA GPUs (leave backend unset, or pass backend='triton')")


def supports(op, device) -> Support:
    """Always no, with ``REASON``."""
    return no(REASON)


def compile(op, device):
    """Raise ``NotImplementedError(REASON)``: there is no kernel to build."""
    raise NotImplementedError(REASON)


def compile_for_target(op, target: str):
    """Raise ``NotImplementedError(REASON)``: there is no kernel to lower."""
    raise NotImplementedError(REASON)
