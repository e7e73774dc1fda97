"""FlashinferBackend: FlashInfer's attention kernels as a portakern backend, capabilities as data.

Registered always, so ``portakern info`` shows it; without the package its status is "unavailable: No module named
'flashinfer' (pip install ...)" and ``supports`` refuses every op with that line, through the base's ``requires``.
The op limits are in ``attention.supports``.
"""

from __future__ import annotations

from portakern.backend import Backend

from .tuning import DEFAULT_PRIORITY


def _version() -> str:
    try:
        from importlib.metadata import version

        return f"flashinfer {version('flashinfer-python')}"
    except Exception:
        return "flashinfer not installed"


class FlashinferBackend(Backend):
    """FlashInfer's single-sequence prefill kernels on NVIDIA GPUs (sm_75 and newer)."""

    name = "flashinfer"
    version = _version()
    array_kind = "torch"
    device_types = ("cuda",)
    priority = DEFAULT_PRIORITY
    requires = ("torch", "flashinfer")
    install_hint = "pip install flashinfer-python (FlashInfer; JIT-compiles its kernels on first use)"
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    min_capability = (7, 5)
    device_refusal = ("FlashInfer runs on NVIDIA GPUs (cuda), not on {device}; pass backend=None to let portakern "
                      "pick a backend for {device}")


__all__ = ["FlashinferBackend"]
