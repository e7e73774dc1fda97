"""TorchBackend and its SDPA-kernel variants: capabilities as data on the core's backend base.

``torch`` runs attention through ``torch.nn.functional.scaled_dot_product_attention`` with torch's own kernel choice
(and ``flex_attention`` for a score_mod SDPA cannot express) and int4 quantized GEMV through tinygemm. Each variant
pins one SDPA kernel with ``torch.nn.attention.sdpa_kernel``, so conformance certifies that kernel alone:

  torch-math        SDPBackend.MATH                 cpu, cuda
  torch-flash       SDPBackend.FLASH_ATTENTION      cuda (FlashAttention-2 in torch) and cpu (torch's CPU flash
                                                    kernel, called as aten._scaled_dot_product_flash_attention_for_cpu
                                                    so its log-sum-exp comes back too)
  torch-efficient   SDPBackend.EFFICIENT_ATTENTION  cuda
  torch-cudnn       SDPBackend.CUDNN_ATTENTION      cuda (sm_80 and newer)

A variant has attention only (``lowerings``); the GEMV is the ``torch`` backend's. The op limits live in the
lowering modules; what is here is the data and the one backend-wide rule (storage floats).
"""

from __future__ import annotations

from typing import ClassVar

from portakern.backend import YES, Backend, Support, no
from portakern.devices import Device
from portakern.ir.dtypes import STORAGE_FLOATS

from .tuning import DEFAULT_PRIORITY


def _torch_version() -> str:
    try:
        import torch

        return f"torch {torch.__version__}"
    except Exception:
        return "torch not installed"


class TorchBackend(Backend):
    """torch's own kernels behind portakern's door: SDPA (torch's kernel choice), flex_attention, tinygemm."""

    name = "torch"
    version = _torch_version()
    array_kind = "torch"
    device_types = ("cpu", "cuda")
    priority = DEFAULT_PRIORITY
    requires = ("torch",)
    install_hint = "pip install torch"
    lowerings = {"attention": "attention", "quant_gemv": "quant_gemv"}
    x_prologues = ("silu_mul",)      # quant_gemv.supports narrows it to float32 activations on cpu
    device_refusal = ("the {name} backend runs on {types} torch devices, not on {device}; pass backend=None to let "
                      "portakern pick a backend for {device}")
    #: the SDPA kernel this backend pins (an ``SDPBackend`` member name), None: torch's own choice (and flex)
    sdpa_kernel: ClassVar[str | None] = None

    def check(self, op, device: Device) -> Support:
        """Both ops: storage floats only (float16, bfloat16, float32); attention: the limits of the pinned SDPA
        kernel (``attention.kernel_limits``), before the limits every variant shares (``attention.supports``)."""
        if op.dtype not in STORAGE_FLOATS:
            return no(f"dtype {op.dtype.value} is not a storage float (float16, bfloat16, float32)")
        if getattr(op, "kind", None) == "attention" and self.lowering(op) is not None:
            return self.lowering(op).kernel_limits(self.sdpa_kernel, op, device)
        return YES

    def compile(self, op, device: Device):
        """Attention: the kernel for this backend's pinned SDPA kernel (``attention.build``); else the base's."""
        if getattr(op, "kind", None) == "attention":
            return self._lowering_for(op, "compile").build(op, device, self.sdpa_kernel)
        return super().compile(op, device)


class TorchMathBackend(TorchBackend):
    """SDPA's math kernel (composite torch ops) on cpu and cuda."""

    name = "torch-math"
    lowerings = {"attention": "attention"}
    sdpa_kernel = "MATH"


class TorchFlashBackend(TorchBackend):
    """SDPA's flash kernel: FlashAttention-2 on cuda, torch's CPU flash kernel on cpu."""

    name = "torch-flash"
    lowerings = {"attention": "attention"}
    sdpa_kernel = "FLASH_ATTENTION"


class TorchEfficientBackend(TorchBackend):
    """SDPA's memory-efficient kernel (xFormers' cutlass kernel) on cuda."""

    name = "torch-efficient"
    device_types = ("cuda",)
    lowerings = {"attention": "attention"}
    sdpa_kernel = "EFFICIENT_ATTENTION"


class TorchCudnnBackend(TorchBackend):
    """SDPA's cuDNN kernel on cuda, sm_80 and newer."""

    name = "torch-cudnn"
    device_types = ("cuda",)
    min_capability = (8, 0)
    lowerings = {"attention": "attention"}
    sdpa_kernel = "CUDNN_ATTENTION"


#: every backend this package registers, the ``torch`` backend first
BACKENDS = (TorchBackend, TorchMathBackend, TorchFlashBackend, TorchEfficientBackend, TorchCudnnBackend)

__all__ = ["BACKENDS", "TorchBackend", "TorchCudnnBackend", "TorchEfficientBackend", "TorchFlashBackend",
           "TorchMathBackend"]
