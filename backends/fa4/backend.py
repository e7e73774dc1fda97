"""Fa4Backend: FlashAttention-4 (``flash_attn.cute``) as a portakern backend, capabilities as data.

Registered always, so ``portakern info`` shows it; without the package its status is "unavailable: No module named
'flash_attn' (pip install ...)" and ``supports`` refuses every op with that line, through the base's ``requires``.
The op limits are in ``attention.supports``.
"""

from __future__ import annotations

from portakern.backend import Backend

from .tuning import DEFAULT_PRIORITY


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"flash-attn-cute {version('flash-attn-cute')}"
    except Exception:
        return "flash_attn.cute not installed"


class Fa4Backend(Backend):
    """FlashAttention-4 forward kernels (CuTe DSL) on sm_90 / sm_100 / sm_110 GPUs."""

    name = "fa4"
    version = _version()
    array_kind = "torch"
    device_types = ("cuda",)
    priority = DEFAULT_PRIORITY
    requires = ("torch", "flash_attn.cute")
    install_hint = ("pip install flash-attn-cute (FlashAttention-4; needs an sm_90 / sm_100 GPU and "
                    "nvidia-cutlass-dsl)")
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    min_capability = (9, 0)
    device_refusal = ("FlashAttention-4 runs on NVIDIA GPUs (cuda), not on {device}; pass backend=None to let "
                      "portakern pick a backend for {device}")


__all__ = ["Fa4Backend"]
